"""BAS-OPD in a toy world on a CPU: the paper's Tables 3, 7, 8 and Figures 2-5, measured.

    python experiments/toy.py --out runs/toy                 # 3 seeds, about 15-20 minutes on 2 cores
    python experiments/toy.py --out runs/toy-smoke --smoke   # one seed, a few steps (the test)

1. The world (`opd.toy.world`): a cluttered canvas with one small coloured target, exported as a training
   JSONL (full image + bbox), a held audit JSONL and a held-out benchmark in eval.py's Vision-OPD JSON
   layout (read as `zoombench`, crops included).
2. The base (`opd.toy.sft`): a tiny Qwen3.5 trained by teacher forcing on the crops only, so it reads the
   crop well and the full image poorly. eval.py measures both views (the regional-to-global gap).
3. OPD runs through `opd.run.Run` on the same base: Full, Random-25, Entropy-25, Learned-25 and
   Learned-10/50, over `--seeds` seeds (Learned-100 is Full querying: identical selection, reused).
   Each run is evaluated by eval.py on the held-out benchmark (full view and, as a check of the
   teacher's pathway, crop view). Learned-25 runs also get the Figure 3 audit (`harness.audit`) at the
   end and, for the first seed, the Figure 4 gradient geometry at `--grad-checkpoints` points.
4. OUT/report.md: the tables and plots (OUT/*.png) from the files on disk.

Resumable: the world, the base, the base's evaluation and every finished run (its done.json) are
reused; an unfinished run starts over. `--jobs 2` trains two runs at a time (one thread each).
Running a run, reading results back and the report's tables and plots are shared with
experiments/toy_explain.py (`harness.experiment`, `harness.report`), the steps of `main()` with every
experiment script (`harness.entry`).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from harness.entry import Entry, sft_config, world_config  # noqa: E402
from harness.experiment import check_ledger, collect, machine, order, run_folder  # noqa: E402
from harness.report import (  # noqa: E402
    audit_section,
    gap_section,
    geometry_section,
    ledger_line,
    plots,
    table3,
    table7,
    table8,
    world_figure,
    write_report,
)

__all__ = ["ToyConfig", "check_ledger", "main"]


@dataclass
class ToyConfig:
    preset: str = "default"
    """Starting values: 'default' (the reported experiment) or 'smoke' (one seed, a few steps; --smoke)."""
    out: str = "runs/toy"
    """Output folder: world/, base/, base_eval/, runs/<policy>/seed<k>/, report.md and the plots."""
    seeds: int = 3
    """Training seeds 0..seeds-1 (data order, rollout sampling and selector seed of every run)."""
    steps: int = 120
    """OPD steps per run (120 = one epoch of the 960 training records at 8 prompts per step)."""
    prompts_per_step: int = 8
    """Prompts per OPD step (the paper: 28)."""
    rollouts_per_prompt: int = 8
    """Rollouts per prompt (the paper's 8); candidates per step = prompts x rollouts."""
    max_response_len: int = 4
    """Most sampled tokens per rollout (an answer is a letter and <|im_end|>)."""
    lr: float = 1.5e-4
    """AdamW learning rate of the policy in OPD (the paper's 2e-6 does not move a tiny model)."""
    budgets: str = "10,25,50"
    """Query ratios (percent) of the Learned budget sweep besides 100 (= Full querying, reused)."""
    replay_start: int = 96
    """Labels in replay before the selector's first update (the paper's 96)."""
    replay_batch: int = 256
    """Replay minibatch (the paper's 256)."""
    jobs: int = 2
    """Runs trained at once, each in its own process with one thread (1: in this process)."""
    world_seed: int = 0
    """Seed of the toy world."""
    n_opd: int = 960
    """Training records of the world."""
    n_audit: int = 160
    """Held records for the Figure 3/4 audits."""
    n_eval: int = 400
    """Held-out benchmark items."""
    sft_steps: int = 150
    """Supervised steps of the base model (batch 16, crops only)."""
    sft_batch: int = 16
    """Supervised batch of the base model."""
    eval_batch: int = 100
    """eval.py --batch-size."""
    audit_batches: int = 10
    """Held batches of the Figure 3 audit (prompts_per_step prompts each) per Learned-25 run."""
    audit_seeds: int = 3
    """Learned-25 runs (first seeds) that get the Figure 3 audit."""
    grad_checkpoints: int = 4
    """Figure 4: points in the first seed's Learned-25 run (evenly spaced, the last at the end)."""
    grad_batches: int = 5
    """Figure 4: held batches (selected/unselected gradient pairs) per checkpoint."""


SMOKE = dict(
    seeds=1, steps=2, prompts_per_step=2, rollouts_per_prompt=4, budgets="25,50", replay_start=4, replay_batch=16,
    jobs=1, n_opd=16, n_audit=8, n_eval=16, sft_steps=4, sft_batch=4, eval_batch=16, audit_batches=2, audit_seeds=1,
    grad_checkpoints=2, grad_batches=1, out="runs/toy-smoke",
)  # fmt: skip
PRESETS = {"default": {}, "smoke": SMOKE}


# ----------------------------------------------------------------------------- the plan


def run_specs(cfg: ToyConfig) -> list[dict]:
    """Every OPD run of the experiment: (policy, rho, seed), the costliest first."""
    budgets = sorted({int(b) for b in cfg.budgets.split(",") if b.strip()} | {25})
    kinds = [("full", 100), ("random", 25), ("entropy", 25)] + [("learned", b) for b in budgets if b != 100]
    specs = []
    for seed in range(cfg.seeds):
        for policy, pct in kinds:
            specs.append({"policy": policy, "pct": pct, "seed": seed, "name": f"{policy}-{pct}"})
    return sorted(specs, key=lambda s: (-s["pct"], s["seed"]))


def train_fields(cfg: ToyConfig, spec: dict, base: Path, data: Path) -> dict:
    """The run's `opd.config.TrainConfig` fields (its --out is the run folder)."""
    return dict(
        model=str(base), data=str(data), policy=spec["policy"], rho=spec["pct"] / 100,
        steps=cfg.steps, prompts_per_step=cfg.prompts_per_step, rollouts_per_prompt=cfg.rollouts_per_prompt,
        max_prompt_len=512, max_response_len=cfg.max_response_len, lr=cfg.lr, micro_batch=64,
        seed=spec["seed"], selector_seed=spec["seed"], replay_start=cfg.replay_start, replay_batch=cfg.replay_batch,
        save_every=0, keep_checkpoints=1,
    )  # fmt: skip


def job(cfg: ToyConfig, spec: dict, root: Path) -> dict:
    """One run for `harness.experiment.train_one`: Learned-25 gets the Figure 3 audit (first `audit_seeds`
    seeds) and, on seed 0, the Figure 4 geometry at `grad_checkpoints` evenly spaced steps."""
    world = root / "world"
    learned25 = spec["policy"] == "learned" and spec["pct"] == 25
    geometry = []
    if learned25 and spec["seed"] == 0 and cfg.grad_checkpoints:
        geometry = sorted({round(cfg.steps * (j + 1) / cfg.grad_checkpoints) for j in range(cfg.grad_checkpoints)})
    return {
        "spec": spec, "folder": str(run_folder(root, spec)), "train": train_fields(cfg, spec, root / "base", world / "train.jsonl"),
        "audit_data": str(world / "audit.jsonl"), "audit_batches": cfg.audit_batches if learned25 and spec["seed"] < cfg.audit_seeds else 0,
        "geometry_steps": geometry, "grad_batches": cfg.grad_batches,
        "eval": {"bench": str(world / "bench"), "batch": cfg.eval_batch, "max_new_tokens": 4},
    }  # fmt: skip


# ----------------------------------------------------------------------------- report


def report(root: Path, cfg: ToyConfig, timing: dict, command: str) -> str:
    """Writes OUT/report.md (and the plots) from the files on disk; returns the Markdown."""
    base = json.loads((root / "base_eval.json").read_text())
    runs = collect(root, run_specs(cfg))
    world_png = world_figure(root, world_config(cfg))
    files = plots(root, runs, base)
    names = order(runs)
    lines = [
        "# BAS-OPD in a toy world (CPU)",
        "",
        f"- Command: `{command}`",
        f"- Machine: {machine()}; {cfg.jobs} run(s) at a time, one thread each",
        f"- Wall time: {timing.get('total_s', 0):.0f} s in all (world {timing.get('world_s', 0):.0f} s, base model "
        f"{timing.get('sft_s', 0):.0f} s, base evaluation {timing.get('base_eval_s', 0):.0f} s, OPD runs "
        f"{timing.get('runs_s', 0):.0f} s)" + (f", summed over {timing['invocations']} invocations (each reuses what "
        "the earlier ones finished)" if timing.get("invocations", 1) > 1 else ", one invocation from scratch"),
        f"- Finished: {time.strftime('%Y-%m-%d %H:%M:%S')}",
        f"- Setting: {cfg.seeds} seed(s); {cfg.steps} OPD steps of {cfg.prompts_per_step} prompts x "
        f"{cfg.rollouts_per_prompt} rollouts; lr {cfg.lr:g}; JSD alpha 0.5, top-100, EMA 0.05 (paper); selector as "
        f"Table 5 with replay start {cfg.replay_start}, minibatch {cfg.replay_batch}; eval.py greedy on {cfg.n_eval} "
        "held-out items",
        "",
        f"![{world_png}]({world_png})",
        "",
    ]
    lines += gap_section(base, runs, names) + [""] + table3(runs, names)
    lines += ["", "Learned-100 is Full querying (at rho = 1 every policy selects all of C), so the Full row stands for it.", ""]
    lines += table7(runs, names) + [""] + table8(runs, names) + ["", ledger_line(runs, names)]
    audit = audit_section(runs, cfg.prompts_per_step, cfg.rollouts_per_prompt)
    lines += ([""] + audit if audit else [])
    geometry = geometry_section(runs)
    lines += ([""] + geometry if geometry else [])
    lines += ["", "## Plots", ""] + [f"![{f}]({f})" for f in files]
    return write_report(root, "\n".join(lines) + "\n", {"base": base, "timing": timing, "runs": {
        n: [{k: v for k, v in r.items() if k not in ("audit", "geometry")} for r in rs] for n, rs in runs.items()}})


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> str:
    entry = Entry.start(ToyConfig, PRESETS, argv, __doc__, "python experiments/toy.py")
    cfg, root = entry.cfg, entry.root
    entry.world(world_config(cfg))
    entry.base(world_config(cfg), sft_config(cfg), what=f"base model ({cfg.sft_steps} supervised steps on crops)")
    entry.base_eval(cfg.eval_batch, 4)
    entry.runs([job(cfg, s, root) for s in run_specs(cfg)], cfg.jobs)
    return entry.finish(report)


if __name__ == "__main__":
    from opd.cli import run_cli

    run_cli(main, sys.argv[1:], "toy.py")
