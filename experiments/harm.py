"""Selection part 4: worlds where feedback can hurt, an oracle arm, a coverage control, paired intervals (SELECTION.md).

    python experiments/harm.py --out runs/harm --results docs/selection/harm   # the study, resumable across sessions
    python experiments/harm.py --smoke                                          # one seed, 2 steps per run (the test)

Three worlds at s = 50% (experiments/harm_world.py): h0 (no harmful item), h25 (25% of the items have a crop cut
around a decoy, of the usual area) and h25-shift (the same items, a smaller crop: a_i tells). One base (crops only, the
explained answers) serves all three. Per world: Full, Random-25, Learned-25 (as published), Oracle-25 (top-K by the
true u_i), Cover-25 (random, 2 rows per prompt) and Learned-25 with diminishing returns per prompt (this study's
design, experiments/harm_policies.py) x `seeds` seeds, paired by seed (data order, rollouts, selector), 28 prompts x 8
rollouts, support k = `topk` of the toy's 105-token vocabulary, eval.py on `n_eval` held-out items. Then the
noise-floor leg: h0 at lr / 10 with Full, Random-25 and Learned-25 x `noise_seeds` seeds.

Resumable: each finished run leaves a compact record in RESULTS/<world>/<policy>/seed<k>.json (committed with the
docs), and the base is copied to RESULTS/base; a run with a record is never trained again, whatever OUT holds. The
runs go seed by seed (every world and policy of seed 0, then seed 1, ...), so a stopped study holds whole pairs.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "experiments"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


from harm_world import HarmConfig, base_world  # noqa: E402
from harness.entry import Entry  # noqa: E402
from harness.experiment import evaluate, machine, read_run, run_folder, say, train_one  # noqa: E402
from harness.regime import PROMPTS, ROLLOUTS, RegimeConfig, accuracy_by  # noqa: E402
from opd.loop.ledger import write_atomic  # noqa: E402

__all__ = ["HarmExperimentConfig", "main"]

WORLDS = {"h0": (0.0, 1.0), "h25": (0.25, 1.0), "h25-shift": (0.25, 0.6)}
"""World name -> (h, harm_scale)."""
HOOKS = "experiments.harm_policies"
POLICIES = {
    "full-100": ("full", 100, {}, "Hook"),
    "random-25": ("random", 25, {}, "Hook"),
    "learned-25": ("learned", 25, {}, "Hook"),
    "oracle-25": ("random", 25, {}, "Oracle"),
    "cover-25": ("random", 25, {"max_per_prompt": 2}, "Hook"),
    "learned-25-dim": ("learned", 25, {}, "Diminishing"),
}
"""Run name -> (train.py policy, percent, train.py settings, hook class of experiments/harm_policies.py)."""
LABELS = {"full-100": "Full", "random-25": "Random-25", "learned-25": "Learned-25", "oracle-25": "Oracle-25",
          "cover-25": "Cover-25 (2 per prompt)", "learned-25-dim": "Learned-25, diminishing per prompt"}  # fmt: skip
NOISE = ("full-100", "random-25", "learned-25")
"""The noise-floor leg's policies (world h0 at lr / 10)."""


@dataclass
class HarmExperimentConfig:
    preset: str = "default"
    """Starting values: 'default' (the reported study) or 'smoke' (one seed, a few steps; --smoke)."""
    out: str = "runs/harm"
    """Working folder: the worlds, the base, its evaluations, the run folders (checkpoints, ledgers, predictions)."""
    results: str = ""
    """Folder of the compact per-run records and the base copy that make the study resumable across machines
    ('' for OUT/results); the report is written there too."""
    seeds: int = 8
    """Seeds 0..seeds-1 of every world x policy."""
    noise_seeds: int = 10
    """Seeds of the noise-floor leg (0 for none)."""
    steps: int = 30
    """OPD steps per run: one epoch of prompts_per_step x steps records."""
    prompts_per_step: int = PROMPTS
    """Prompts per step (the paper's 28)."""
    rollouts_per_prompt: int = ROLLOUTS
    """Rollouts per prompt (the paper's 8): K = 56 of 224 at rho 0.25."""
    max_response_len: int = 64
    """Most sampled tokens per rollout."""
    topk: int = 10
    """The support k of the loss and of Eq. 7-8 (10 of the toy's 105 ids; the paper's 100 of 248,320)."""
    lr: float = 1.5e-4
    """AdamW learning rate (every toy study's); the noise-floor leg uses lr / 10."""
    replay_start: int = 96
    """Labels in replay before the selector's first update (the paper's 96)."""
    replay_batch: int = 256
    """Replay minibatch (the paper's 256)."""
    factor_batches: int = 1
    """Held batches on which each run's d, o, c are measured at its end (and the base's, by Full's seed 0)."""
    jobs: int = 1
    """Runs trained at once, each in its own process with one thread (1: in this process)."""
    n_audit: int = 160
    """Held training records (the factors' batches)."""
    n_eval: int = 1000
    """Held-out benchmark items per world."""
    eval_batch: int = 100
    """eval.py --batch-size."""
    eval_tokens: int = 64
    """eval.py --max-new-tokens (greedy)."""
    sft_steps: int = 300
    """Supervised steps of the base (crops only, explained answers)."""
    sft_batch: int = 32
    """Supervised batch of the base."""


SMOKE = dict(
    seeds=1, noise_seeds=1, steps=2, prompts_per_step=4, rollouts_per_prompt=4, max_response_len=16, replay_start=4,
    replay_batch=16, n_audit=8, n_eval=16, eval_batch=16, eval_tokens=16, sft_steps=4, sft_batch=4, out="runs/harm-smoke",
)  # fmt: skip
PRESETS = {"default": {}, "smoke": SMOKE}


def world_config(cfg: HarmExperimentConfig, world: str) -> HarmConfig:
    harm, scale = WORLDS[world.removesuffix("-lr10")]
    return HarmConfig(seed=0, share=0.5, harm=harm, harm_scale=scale, n_opd=cfg.prompts_per_step * cfg.steps,
                      n_audit=cfg.n_audit, n_eval=cfg.n_eval)  # fmt: skip


def specs(cfg: HarmExperimentConfig) -> list[dict]:
    """Every run, seed by seed: the three worlds x the six policies, then the noise-floor leg (world 'h0-lr10')."""
    def spec(world, policy, seed):
        return {"world": world, "variant": policy, "policy": POLICIES[policy][0], "pct": POLICIES[policy][1],
                "seed": seed, "name": f"{world}/{policy}"}  # fmt: skip

    out = [spec(w, p, seed) for seed in range(cfg.seeds) for w in WORLDS for p in POLICIES]
    return out + [spec("h0-lr10", p, seed) for seed in range(cfg.noise_seeds) for p in NOISE]


def results_dir(cfg: HarmExperimentConfig) -> Path:
    return Path(cfg.results) if cfg.results else Path(cfg.out) / "results"


def result_path(cfg: HarmExperimentConfig, spec: dict) -> Path:
    return results_dir(cfg) / spec["world"] / spec["variant"] / f"seed{spec['seed']}.json"


def job(cfg: HarmExperimentConfig, spec: dict, root: Path) -> dict:
    policy, pct, settings, hook = POLICIES[spec["variant"]]
    lr = cfg.lr / 10 if spec["world"].endswith("-lr10") else cfg.lr
    world = root / f"world-{spec['world'].removesuffix('-lr10')}"
    train = dict(
        model=str(root / "base"), data=str(world / "train.jsonl"), policy=policy, rho=pct / 100, steps=cfg.steps,
        prompts_per_step=cfg.prompts_per_step, rollouts_per_prompt=cfg.rollouts_per_prompt, max_prompt_len=512,
        max_response_len=cfg.max_response_len, lr=lr, topk=cfg.topk, micro_batch=64, seed=spec["seed"],
        selector_seed=spec["seed"], replay_start=cfg.replay_start, replay_batch=cfg.replay_batch, save_every=0,
        keep_checkpoints=1, **settings,
    )  # fmt: skip
    base_factors = spec["variant"] == "full-100" and spec["seed"] == 0 and not spec["world"].endswith("-lr10")
    return {"spec": spec, "folder": str(run_folder(root, spec)), "train": train, "trace": False,
            "hook": f"{HOOKS}:{hook}", "audit_data": str(world / "audit.jsonl"), "audit_batches": 0,
            "selection_batches": 0, "factors": cfg.factor_batches, "factors_start": base_factors and cfg.factor_batches,
            "eval": {"bench": str(world / "bench"), "batch": cfg.eval_batch, "max_new_tokens": cfg.eval_tokens},
            "root": str(root), "result": str(result_path(cfg, spec))}  # fmt: skip


def accuracy_by_kind(eval_dir: Path) -> dict:
    """eval.py's accuracy (%) per kind of item in both views: {"full": {"large", "small", "harmful"}, "crop": {...}},
    from the predictions' meta (target side, harm); a kind with no item is NaN."""
    def kind_of(meta):
        large = int(meta["target"]) >= RegimeConfig.large_min  # the study's worlds keep the regime's 24 px
        return "harmful" if int(meta.get("harm", 0)) else "large" if large else "small"

    return accuracy_by(eval_dir, kind_of, ("large", "small", "harmful"))


def compact(root: Path, spec: dict) -> dict | None:
    """A finished run's record for RESULTS: accuracy (all, per kind), the ledger's summary and checks, the kinds of
    rows in C and S, and its factors at the end (and start); None while it has not finished."""
    rec = read_run(root, spec)
    if rec is None:
        return None
    folder = run_folder(root, spec)
    load = lambda name: json.loads((folder / name).read_text()) if (folder / name).exists() else None  # noqa: E731
    return {"spec": spec, "full": rec["full"], "crop": rec["crop"], "unparsed": rec["unparsed"],
            "kinds": accuracy_by_kind(folder / "eval"), "ledger": rec["ledger"], "problems": rec["ledger_problems"],
            "train_s": rec["train_s"], "eval_s": rec["eval_s"], "mix": load("mix.json"),
            "factors_end": load("factors-end.json"), "factors_start": load("factors-start.json"), "machine": machine(),
            "commit": code_commit()}  # fmt: skip


def code_commit() -> str:
    """The commit of the code that runs (ROOT's HEAD), '+dirty' when it has uncommitted changes to tracked files."""
    def git(*args):
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def record_one(job: dict) -> None:
    """The study's worker: trains, audits and scores one run (`harness.experiment.train_one`), then writes its compact
    record to job["result"] (whole or absent), the marker that the run is done."""
    train_one(job)
    path = Path(job["result"])
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(compact(Path(job["root"]), job["spec"])) + "\n")


def prepare(entry: Entry, cfg: HarmExperimentConfig) -> None:
    """The three worlds, the one base (from RESULTS/base when it is there, else trained and copied there) and its
    evaluation on each world's benchmark (per kind)."""
    from harness.explain import EXPLAIN
    from opd.toy.sft import SFTConfig
    from opd.toy.world import export_world

    root, saved = entry.root, results_dir(cfg) / "base"
    with entry.phase("world_s"):
        for w in WORLDS:
            export_world(root / f"world-{w}", world_config(cfg, w))
    if saved.exists() and not (root / "base").exists():
        shutil.copytree(saved, root / "base")
        say(f"base <- {saved} (the study's own)")
    entry.base(base_world(world_config(cfg, "h0")), SFTConfig(steps=cfg.sft_steps, batch=cfg.sft_batch), task=EXPLAIN,
               what=f"base ({cfg.sft_steps} supervised steps of explained answers on crops)")  # fmt: skip
    if not saved.exists():
        saved.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(root / "base", saved)
    for w in WORLDS:
        path = results_dir(cfg) / f"base_eval-{w}.json"
        if not path.exists():
            with entry.phase("base_eval_s"):
                res = evaluate(root / "base", root / f"world-{w}" / "bench", root / f"base_eval-{w}", cfg.eval_batch,
                               cfg.eval_tokens, f"base-{w}")  # fmt: skip
                res["kinds"] = accuracy_by_kind(root / f"base_eval-{w}")
                write_atomic(path, json.dumps(res, indent=1) + "\n")
        b = json.loads(path.read_text())
        say(f"{w}: base full image {b['full']:.1f}% (small {b['kinds']['full']['small']:.1f}%, harmful "
            f"{b['kinds']['full']['harmful']:.1f}%, large {b['kinds']['full']['large']:.1f}%), crop {b['crop']:.1f}% "
            f"(harmful {b['kinds']['crop']['harmful']:.1f}%)")  # fmt: skip


def main(argv: list[str] | None = None) -> str:
    from harm_report import report

    entry = Entry.start(HarmExperimentConfig, PRESETS, argv, __doc__, "python experiments/harm.py")
    cfg, root = entry.cfg, entry.root
    results_dir(cfg).mkdir(parents=True, exist_ok=True)
    prepare(entry, cfg)
    jobs = [job(cfg, s, root) for s in specs(cfg)]
    for j in jobs:  # a run finished before its record was written (stopped in between)
        if not Path(j["result"]).exists() and (Path(j["folder"]) / "done.json").exists():
            record_one(j)
    say(f"code at {code_commit()}; {sum(result_path(cfg, j['spec']).exists() for j in jobs)} of {len(jobs)} runs recorded "
        f"in {results_dir(cfg)}")  # fmt: skip
    entry.runs(jobs, cfg.jobs, record_one, skip=lambda j: Path(j["result"]).exists(), reused="recorded")
    text = entry.finish(lambda r, c, timing, command: report(results_dir(c), c, timing, command))
    say(f"the study's report: {results_dir(cfg) / 'report.md'} (OUT/report.md is not written)")
    return text


if __name__ == "__main__":
    from opd.cli import run_cli

    run_cli(main, sys.argv[1:], "harm.py")
