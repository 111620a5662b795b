"""Budgeted selection that does not bias the gradient, measured where learned selection lost (docs/SELECTION.md).

    python experiments/selection.py --out runs/selection     # 2 tasks x 7 policies x 5 seeds: 70 OPD runs, resumable
    python experiments/selection.py --smoke                  # one seed, 2 steps per run (the test)
    python experiments/selection.py --out runs/selection --variants learned-25-ht,learned-25-strat   # part 2's rows

Both toy tasks, on the same world and bases as their own experiments:

- `letter`: the first task (one-letter answers, experiments/toy.py's base) in its 32 prompts x 2 rollouts setting
  (docs/TOY.md, "a test of reason 1"), 120 steps;
- `explain`: the explained answers (experiments/toy_explain.py's base, 5-60 tokens), 8 prompts x 8 rollouts, 80 steps.

Per task and seed: Full, Random-25, Entropy-25, Learned-25 (top-K, as published), Learned-25 and Entropy-25
unbiased (`--unbiased`: S sampled with inclusion probabilities that grow with the score, the loss weighted by
1 / pi), and Learned-25 with a per-prompt cap (`--max-per-prompt`, K spread evenly: ceil(K / prompts) per
prompt). Part 2 (`--variants all`, or by name): Learned-25 unbiased with the Horvitz-Thompson estimator
(`--estimator ht`) at eps 0.1, 0.3 and 0.5 and with pi proportional to T_i sqrt(u^_i) (`--inclusion-size gradient`),
and stratified by prompt (`--strata prompt`) at eps 0.1 and 0.5. Each run is scored by eval.py in both views (the full image; the crop view is the teacher's pathway:
a collapse shows there), and at its end `harness.audit.selection_audit` measures, on held batches, the cosine of the
run's own budgeted gradient (its selector's draws, weighted as in training) to the full-query gradient, and the
share of the true utility its S captures.
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

from harness.entry import Entry  # noqa: E402
from harness.experiment import evaluate, machine, run_folder, say  # noqa: E402
from harness.report import save_figure, write_report  # noqa: E402
from harness.selection import (  # noqa: E402
    CROP_DROP,
    VARIANTS,
    accuracy_panel,
    cosine_panel,
    policy_table,
    read_selection_run,
    selection_job,
    variant_names,
)

__all__ = ["SelectionConfig", "main"]

PART_1 = ("full-100", "random-25", "entropy-25", "learned-25", "learned-25-unbiased", "entropy-25-unbiased",
          "learned-25-cap")  # fmt: skip
"""The variants of the first measurement (docs/SELECTION.md); the default --variants (the names: harness.selection)."""


@dataclass
class SelectionConfig:
    preset: str = "default"
    """Starting values: 'default' (the reported experiment) or 'smoke' (one seed, a few steps; --smoke)."""
    out: str = "runs/selection"
    """Output folder: world/, base-letter/, base-explain/, runs/<task>/<policy>/seed<k>/, report.md and plots."""
    tasks: str = "letter,explain"
    """The toy tasks: letter (one-letter answers, 32 prompts x 2 rollouts) and explain (explained answers, 8 x 8)."""
    variants: str = ",".join(PART_1)
    """The policies run on each task (names of VARIANTS; 'all': every one)."""
    seeds: int = 5
    """Training seeds 0..seeds-1 (data order, rollout sampling, selector seed)."""
    letter_steps: int = 120
    """OPD steps of the letter task (experiments/toy.py's)."""
    explain_steps: int = 80
    """OPD steps of the explain task (experiments/toy_explain.py's)."""
    lr: float = 1.5e-4
    """AdamW learning rate of both tasks' OPD."""
    replay_start: int = 96
    """Labels in replay before the selector's first update (the paper's 96)."""
    replay_batch: int = 256
    """Replay minibatch (the paper's 256)."""
    selection_batches: int = 5
    """Held batches of the end-of-run selection audit (the gradient cosine, utility captured)."""
    selection_draws: int = 4
    """Draws of the run's selector per held batch in that audit."""
    jobs: int = 2
    """Runs trained at once, each in its own process with one thread."""
    n_opd: int = 960
    """Training records of the world (both tasks share it)."""
    n_audit: int = 160
    """Held records of the audits."""
    n_eval: int = 400
    """Held-out benchmark items."""
    eval_batch: int = 100
    """eval.py --batch-size."""
    letter_sft_steps: int = 150
    """Supervised steps of the letter base (experiments/toy.py's)."""
    explain_sft_steps: int = 300
    """Supervised steps of the explain base (experiments/toy_explain.py's)."""


SMOKE = dict(
    seeds=1, letter_steps=2, explain_steps=2, replay_start=4, replay_batch=16, selection_batches=1, selection_draws=2,
    jobs=1, n_opd=64, n_audit=32, n_eval=16, eval_batch=16, letter_sft_steps=4, explain_sft_steps=4,
    out="runs/selection-smoke",
)  # fmt: skip
PRESETS = {"default": {}, "smoke": SMOKE}

TASKS = {  # prompts x rollouts per step, response length, eval tokens, SFT batch (each task's own experiment)
    "letter": dict(prompts=32, rollouts=2, response=4, eval_tokens=4, sft_batch=16),
    "explain": dict(prompts=8, rollouts=8, response=64, eval_tokens=64, sft_batch=32),
}


def world_config(cfg):
    from opd.toy.world import WorldConfig

    return WorldConfig(seed=0, n_opd=cfg.n_opd, n_audit=cfg.n_audit, n_eval=cfg.n_eval)


def specs(cfg: SelectionConfig) -> list[dict]:
    names = variant_names(cfg.variants)
    out = []
    for task in [t.strip() for t in cfg.tasks.split(",") if t.strip()]:
        if task not in TASKS:
            from opd.cli import UserError

            raise UserError(f"--tasks: unknown {task!r}; known: {', '.join(TASKS)}")
        for seed in range(cfg.seeds):
            for n in names:
                policy, pct, _ = VARIANTS[n]
                out.append({"task": task, "variant": n, "policy": policy, "pct": pct, "seed": seed, "name": f"{task}/{n}"})
    return sorted(out, key=lambda s: (-s["pct"], s["task"] == "letter", s["seed"]))  # the costliest first


def job(cfg: SelectionConfig, spec: dict, root: Path) -> dict:
    t = TASKS[spec["task"]]
    steps = cfg.letter_steps if spec["task"] == "letter" else cfg.explain_steps
    return selection_job(cfg, spec, run_folder(root, spec), model=root / f"base-{spec['task']}", world=root / "world",
                         steps=steps, prompts=t["prompts"], rollouts=t["rollouts"], response=t["response"],
                         eval_tokens=t["eval_tokens"])  # fmt: skip


def collect(root: Path, all_specs: list[dict]) -> dict:
    """{task: {variant: [record per seed]}} from the finished run folders (`harness.selection.read_selection_run`)."""
    runs: dict = {}
    for spec in all_specs:
        if (rec := read_selection_run(root, spec)) is not None:
            runs.setdefault(spec["task"], {}).setdefault(spec["variant"], []).append(rec)
    return runs


def plot(root: Path, runs: dict) -> str:
    """selection_accuracy.png: per task, the full-image accuracy (bars: mean, dots: seeds) above the gradient's
    cosine to the full-query gradient (one draw of S, and the mean of the draws) of each budgeted policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [t for t in TASKS if t in runs]
    fig, axes = plt.subplots(2, max(1, len(tasks)), figsize=(6.5 * max(1, len(tasks)), 7.6), squeeze=False)
    for col, task in enumerate(tasks):
        accuracy_panel(axes[0][col], runs[task], f"{task}: accuracy per seed (dots) and mean (bars)")
        cosine_panel(axes[1][col], runs[task], f"{task}: cosine to the full-query gradient (held batches)")
    fig.tight_layout()
    path = root / "selection_accuracy.png"
    save_figure(fig, path, 120)
    return path.name


def report(root: Path, cfg: SelectionConfig, timing: dict, command: str) -> str:
    all_specs = specs(cfg)
    runs = collect(root, all_specs)
    bases = {t: json.loads((root / f"base_eval-{t}.json").read_text()) for t in TASKS if (root / f"base_eval-{t}.json").exists()}
    problems = [p for task in runs.values() for rs in task.values() for r in rs for p in r["ledger_problems"]]
    n_rows = sum(r["ledger"]["steps"] for task in runs.values() for rs in task.values() for r in rs)
    lines = ["# Unbiased budgeted selection in both toy tasks", "", f"- Command: `{command}`",
             f"- Machine: {machine()}; {cfg.jobs} run(s) at a time, one thread each",
             f"- Wall time: {timing.get('total_s', 0):.0f} s in all; CPU time {timing.get('cpu_s', 0):.0f} s",
             f"- Finished: {time.strftime('%Y-%m-%d %H:%M:%S')}",
             f"- Setting: {cfg.seeds} seed(s); lr {cfg.lr:g}; letter: {cfg.letter_steps} steps of 32 prompts x 2 rollouts; "
             f"explain: {cfg.explain_steps} steps of 8 x 8; selection audit on {cfg.selection_batches} held batches x "
             f"{cfg.selection_draws} draws of the run's selector", "",
             f"Ledger checks (K = floor(rho |C|), |S| <= K, teacher rows = |S|) on {n_rows} rows: "
             + ("all hold." if not problems else f"{len(problems)} problems: {problems[:5]}"), ""]  # fmt: skip
    for task in [t for t in TASKS if t in runs]:
        base = bases.get(task, {"full": float("nan"), "crop": float("nan")})
        lines += [f"## {task}", "", f"Base: full image {base['full']:.1f}%, crop {base['crop']:.1f}%. A seed counts as "
                  f"collapsed when its crop view ends more than {CROP_DROP:g} points below the base's.", ""]
        lines += policy_table(runs[task], base) + [""]
    png = plot(root, runs) if runs else None
    if png:
        lines += [f"![{png}]({png})", ""]
    data = {"timing": timing, "bases": bases, "runs": {t: {n: [{k: v for k, v in r.items() if k != "trace"} for r in rs]
                                                           for n, rs in v.items()} for t, v in runs.items()}}  # fmt: skip
    return write_report(root, "\n".join(lines) + "\n", data)


def main(argv: list[str] | None = None) -> str:
    from harness.explain import EXPLAIN
    from opd.toy.sft import SFTConfig

    entry = Entry.start(SelectionConfig, PRESETS, argv, __doc__, "python experiments/selection.py")
    cfg, root = entry.cfg, entry.root
    all_specs = specs(cfg)
    tasks = sorted({s["task"] for s in all_specs}, key=list(TASKS).index)
    entry.world(world_config(cfg))
    for task in tasks:
        steps = cfg.letter_sft_steps if task == "letter" else cfg.explain_sft_steps
        sft = SFTConfig(steps=steps, batch=TASKS[task]["sft_batch"])
        entry.base(world_config(cfg), sft, folder=f"base-{task}", task=EXPLAIN if task == "explain" else None,
                   what=f"{task} base ({steps} supervised steps on crops)")  # fmt: skip
        path = root / f"base_eval-{task}.json"
        if not path.exists():
            with entry.phase("base_eval_s"):
                base = evaluate(root / f"base-{task}", root / "world" / "bench", root / f"base_eval-{task}", cfg.eval_batch,
                                TASKS[task]["eval_tokens"], f"base-{task}")  # fmt: skip
            from opd.loop.ledger import write_atomic

            write_atomic(path, json.dumps(base, indent=1) + "\n")
        base = json.loads(path.read_text())
        say(f"{task} base: full image {base['full']:.1f}%, crop {base['crop']:.1f}%")
    entry.runs([job(cfg, s, root) for s in all_specs], cfg.jobs)
    return entry.finish(report)


if __name__ == "__main__":
    from opd.cli import run_cli

    run_cli(main, sys.argv[1:], "selection.py")
