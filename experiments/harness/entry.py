"""The entry of a toy experiment script (experiments/toy.py, toy_explain.py, toy_collapse.py, family.py): what
every `main()` does before and after its own work, once.

    entry = Entry.start(ToyConfig, PRESETS, argv, __doc__, "python experiments/toy.py")
    entry.world(world_config(entry.cfg))                        # OUT/world/ (reused)
    entry.base(world_config(entry.cfg), sft_config(entry.cfg), what="base model (150 supervised steps on crops)")
    entry.base_eval(batch, max_new_tokens)                      # OUT/base_eval.json (reused)
    entry.runs([job(cfg, s, root) for s in specs], cfg.jobs)    # the runs without a done.json
    return entry.finish(report)                                 # OUT/timing.json, report(root, cfg, timing, command)

`Entry.start` parses the flags (`parse`; --smoke stands for --preset smoke), quiets the threads, creates `cfg.out`
and starts the clock (OUT/timing.json, summed over the invocations). Each step is timed under its phase and reused
when it is on disk already, so a script run again resumes; files are written whole or not at all.
Details: docs/MODULES.md#harnessentry.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from harness.experiment import Timing, evaluate, quiet, run_jobs, say
from opd.cli import parse_config
from opd.loop.ledger import write_atomic
from opd.toy.sft import SFTConfig, train_base
from opd.toy.world import WorldConfig, export_world

SMOKE_FLAG = "--smoke"
"""The experiments' shorthand for --preset smoke (one seed, a few steps); it wins over a --preset given with it."""


def parse(cls, presets: dict[str, dict], argv: list[str] | None = None, description: str = ""):
    """`cls` from a preset and the flags given (`opd.cli.parse_config`); --smoke is --preset smoke."""
    return parse_config(cls, presets, argv, description, preset_flags={SMOKE_FLAG: "smoke"})


def world_config(cfg):
    """The toy world of an experiment config (its n_opd, n_audit, n_eval and, when it has one, world_seed)."""
    return WorldConfig(seed=getattr(cfg, "world_seed", 0), n_opd=cfg.n_opd, n_audit=cfg.n_audit, n_eval=cfg.n_eval)


def sft_config(cfg):
    """The base model's supervised training of an experiment config (its sft_steps and sft_batch)."""
    return SFTConfig(steps=cfg.sft_steps, batch=cfg.sft_batch)


class Entry:
    """One invocation of an experiment script: its config, output folder, command line and clock."""

    def __init__(self, cfg, command: str):
        self.cfg, self.command = cfg, command
        self.root = Path(cfg.out)
        self.root.mkdir(parents=True, exist_ok=True)
        self.timing = Timing(self.root)

    @classmethod
    def start(cls, config_cls, presets: dict[str, dict], argv: list[str] | None, doc: str, script: str) -> Entry:
        """Parses argv (None: sys.argv[1:]) into `config_cls` (--help's description: the first line of `doc`),
        makes torch and transformers quiet, creates `cfg.out` and starts the clock. `script` begins the command
        line the report shows ("python experiments/toy.py"); the flags follow as given."""
        cfg = parse(config_cls, presets, argv, doc.split("\n")[0])
        quiet()
        return cls(cfg, f"{script} " + " ".join(sys.argv[1:] if argv is None else argv))

    def phase(self, key: str):
        """A block timed under `key` of OUT/timing.json (wall seconds; CPU seconds under 'cpu_' + key)."""
        return self.timing.phase(key)

    def world(self, world, *, announce: bool = True, phase: str = "world_s") -> Path:
        """OUT/world/ (`opd.toy.world.export_world`; a finished one of the same config is reused)."""
        with self.phase(phase):
            if announce:
                say(f"world -> {self.root / 'world'}")
            return export_world(self.root / "world", world)

    def base(self, world, sft, *, folder: str = "base", task=None, what: str | None = None,
             phase: str = "sft_s") -> Path:
        """OUT/<folder>/, a base model trained by `opd.toy.sft.train_base` (a finished one is reused); `what`, when
        given, is said first ('<what> -> OUT/<folder>')."""
        out = self.root / folder
        with self.phase(phase):
            if what is not None:
                say(f"{what} -> {out}")
            return train_base(out, world, sft, log=say, task=task)

    def base_eval(self, batch: int, max_new_tokens: int, *, announce: bool = True, phase: str = "base_eval_s") -> dict:
        """OUT/base_eval.json: eval.py's full-image and crop accuracy of OUT/base on OUT/world/bench (reused)."""
        path = self.root / "base_eval.json"
        with self.phase(phase):
            if not path.exists():
                if announce:
                    say("evaluating the base with eval.py (full image and crop)")
                base = evaluate(self.root / "base", self.root / "world" / "bench", self.root / "base_eval", batch,
                                max_new_tokens, "base")  # fmt: skip
                write_atomic(path, json.dumps(base, indent=1) + "\n")
            base = json.loads(path.read_text())
            if announce:
                say(f"base: full image {base['full']:.1f}%, crop {base['crop']:.1f}%, gap {base['gap']:+.1f} points")
            return base

    def runs(self, jobs: list[dict], parallel: int, worker=None, *, skip=None, noun: str = "OPD runs",
             reused: str = "already done", phase: str = "runs_s") -> list[dict]:
        """Trains the jobs (`harness.experiment` jobs) whose folder has no done.json and that `skip(job)` does not
        leave out, `parallel` at a time with `worker` (`run_jobs`); says how many there are. Returns those trained."""
        with self.phase(phase):
            todo = [j for j in jobs if not (Path(j["folder"]) / "done.json").exists() and not (skip and skip(j))]
            say(f"{len(jobs)} {noun}, {len(jobs) - len(todo)} {reused}, {parallel} at a time")
            run_jobs(todo, parallel, worker)
        return todo

    def finish(self, report, *, seconds: bool = True) -> str:
        """Adds this invocation's time to OUT/timing.json, then `report(root, cfg, timing, command)` (which writes
        OUT/report.md); says where it is (with the seconds in all). Returns the report's Markdown."""
        total = self.timing.save()
        text = report(self.root, self.cfg, total, self.command)
        say(f"report -> {self.root / 'report.md'}" + (f" ({total['total_s']:.0f} s in all)" if seconds else ""))
        return text

    def report_only(self, report) -> str:
        """The report from what OUT holds, nothing trained and no time added (--report-only): `report(root, cfg,
        timing, command)` with OUT/timing.json as the earlier invocations left it ({} without one)."""
        text = report(self.root, self.cfg, self.timing.total, self.command)
        say(f"report (finished runs only, nothing trained) -> {self.root / 'report.md'}")
        return text
