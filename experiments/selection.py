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
a collapse shows there), and at its end `opd.audit.selection_audit` measures, on held batches, the cosine of the
run's own budgeted gradient (its selector's draws, weighted as in training) to the full-query gradient, and the
share of the true utility its S captures.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from opd.toy.entry import Entry  # noqa: E402
from opd.toy.experiment import evaluate, machine, read_run, run_folder, say  # noqa: E402
from opd.toy.report import mean_std, save_figure, write_report  # noqa: E402

__all__ = ["SelectionConfig", "main"]

VARIANTS = {
    "full-100": ("full", 100, {}),
    "random-25": ("random", 25, {}),
    "entropy-25": ("entropy", 25, {}),
    "learned-25": ("learned", 25, {}),
    "learned-25-unbiased": ("learned", 25, {"unbiased": True}),
    "entropy-25-unbiased": ("entropy", 25, {"unbiased": True}),
    "learned-25-cap": ("learned", 25, {"max_per_prompt": "even"}),
    # part 2 (docs/SELECTION.md): Horvitz-Thompson, stratified by prompt, the uniform share, the gradient-size map
    "learned-25-ht": ("learned", 25, {"unbiased": True, "estimator": "ht"}),
    "learned-25-ht-eps30": ("learned", 25, {"unbiased": True, "estimator": "ht", "explore": 0.3}),
    "learned-25-ht-eps50": ("learned", 25, {"unbiased": True, "estimator": "ht", "explore": 0.5}),
    "learned-25-ht-grad": ("learned", 25, {"unbiased": True, "estimator": "ht", "inclusion_size": "gradient"}),
    "learned-25-ht-grad-eps50": ("learned", 25, {"unbiased": True, "estimator": "ht", "inclusion_size": "gradient",
                                                 "explore": 0.5}),
    "learned-25-strat": ("learned", 25, {"unbiased": True, "estimator": "ht", "strata": "prompt"}),
    "learned-25-strat-eps50": ("learned", 25, {"unbiased": True, "estimator": "ht", "strata": "prompt", "explore": 0.5}),
}
"""Run name -> (policy, percent, train.py settings); 'even' is ceil(K / prompts per step)."""
LABELS = {"full-100": "Full querying", "random-25": "Random-25", "entropy-25": "Entropy-25",
          "learned-25": "Learned-25 (top-K)", "learned-25-unbiased": "Learned-25 unbiased",
          "entropy-25-unbiased": "Entropy-25 unbiased", "learned-25-cap": "Learned-25 capped per prompt",
          "learned-25-ht": "Learned-25 unbiased HT", "learned-25-ht-eps30": "Learned-25 unbiased HT, eps 0.3",
          "learned-25-ht-eps50": "Learned-25 unbiased HT, eps 0.5",
          "learned-25-ht-grad": "Learned-25 unbiased HT, pi ~ T sqrt(u^)",
          "learned-25-ht-grad-eps50": "Learned-25 unbiased HT, pi ~ T sqrt(u^), eps 0.5",
          "learned-25-strat": "Learned-25 stratified by prompt (HT)",
          "learned-25-strat-eps50": "Learned-25 stratified by prompt (HT), eps 0.5"}  # fmt: skip
PART_1 = ("full-100", "random-25", "entropy-25", "learned-25", "learned-25-unbiased", "entropy-25-unbiased",
          "learned-25-cap")  # fmt: skip
"""The variants of the first measurement (docs/SELECTION.md); the default --variants."""
BASELINES = ("full-100", "random-25", "entropy-25", "learned-25")
"""The paper's policies (grey in the plot); the others are the remedies (blue)."""
CROP_DROP = 10.0
"""Points of crop-view accuracy below the base's after which a run counts as collapsed (its teacher pathway)."""


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
    names = list(VARIANTS) if cfg.variants.strip() == "all" else [v.strip() for v in cfg.variants.split(",") if v.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        from opd.cli import UserError

        raise UserError(f"--variants: unknown {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
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
    settings = dict(VARIANTS[spec["variant"]][2])
    if settings.get("max_per_prompt") == "even":
        budget = math.floor(spec["pct"] / 100 * t["prompts"] * t["rollouts"] + 1e-9)
        settings["max_per_prompt"] = max(1, math.ceil(budget / t["prompts"]))
    train = dict(
        model=str(root / f"base-{spec['task']}"), data=str(root / "world" / "train.jsonl"), policy=spec["policy"],
        rho=spec["pct"] / 100, steps=steps, prompts_per_step=t["prompts"], rollouts_per_prompt=t["rollouts"],
        max_prompt_len=512, max_response_len=t["response"], lr=cfg.lr, micro_batch=64, seed=spec["seed"],
        selector_seed=spec["seed"], replay_start=cfg.replay_start, replay_batch=cfg.replay_batch, save_every=0,
        keep_checkpoints=1, **settings,
    )  # fmt: skip
    return {
        "spec": spec, "folder": str(run_folder(root, spec)), "train": train, "trace": True,
        "audit_data": str(root / "world" / "audit.jsonl"), "audit_batches": 0,
        "selection_batches": cfg.selection_batches if spec["policy"] != "full" else 0,
        "selection_draws": cfg.selection_draws,
        "eval": {"bench": str(root / "world" / "bench"), "batch": cfg.eval_batch, "max_new_tokens": t["eval_tokens"]},
    }  # fmt: skip


def collect(root: Path, all_specs: list[dict]) -> dict:
    """{task: {variant: [record per seed]}} from the finished run folders (opd.toy.experiment.read_run), each with
    its mean distinct prompts in S per step (the ledger's selected_prompts)."""
    from opd.ledger import read_ledger

    runs: dict = {}
    for spec in all_specs:
        if (rec := read_run(root, spec)) is not None:
            rec["selection"] = rec["selection"]["summary"] if rec["selection"] else None
            rows = read_ledger(run_folder(root, spec) / "ledger.jsonl")
            rec["selected_prompts"] = float(np.mean([r["selected_prompts"] for r in rows])) if rows else float("nan")
            runs.setdefault(spec["task"], {}).setdefault(spec["variant"], []).append(rec)
    return runs


def paired(rs: list[dict], reference: list[dict] | None) -> str:
    """'+d, w of n above': the mean difference in full-image accuracy to the reference policy on the same seeds and
    how many of those seeds are above it ('' without a reference run of any of these seeds)."""
    ref = {r["seed"]: r["full"] for r in reference or []}
    diffs = [r["full"] - ref[r["seed"]] for r in rs if r["seed"] in ref]
    if not diffs:
        return ""
    return f"{np.mean(diffs):+.2f}, {sum(d > 0 for d in diffs)} of {len(diffs)} above"


def task_table(task: str, runs: dict, base: dict) -> list[str]:
    """The task's table: one row per variant run (accuracy, paired with Random-25, collapse, cost, the audit)."""
    full_tokens = np.mean([r["ledger"]["scored_tokens"] for r in runs.get("full-100", [])]) if runs.get("full-100") else None
    lines = ["| Policy | Full-image accuracy | Per seed | vs Random-25, same seed | Crop view (end) | Collapsed seeds | "
             "Tokens vs Full | Tokens of C | Prompts in S | Utility captured | cos(g_S, g_C) | cos(mean g_S, g_C) | "
             "Largest 1/pi |", "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for name in [n for n in VARIANTS if runs.get(n)]:
        rs = sorted(runs[name], key=lambda r: r["seed"])
        full = [r["full"] for r in rs]
        crop = [r["crop"] for r in rs]
        collapsed = sum(c < base["crop"] - CROP_DROP for c in crop)
        tokens = np.mean([r["ledger"]["scored_tokens"] for r in rs])
        ratio = f"{100 * tokens / full_tokens:.1f}%" if full_tokens else "-"
        of_c = f"{100 * np.mean([r['ledger']['token_ratio'] for r in rs]):.1f}%"
        vs = paired(rs, runs.get("random-25")) if name != "random-25" else ""
        sel = [r["selection"] for r in rs if r.get("selection")]
        pick = lambda k: f"{np.mean([s[k] for s in sel]):.3f}" if sel else "-"  # noqa: E731
        captured = f"{100 * np.mean([s['captured'] for s in sel]):.1f}%" if sel else "100%"
        weight = max(r["max_weight"] for r in rs)
        prompts = np.mean([r["selected_prompts"] for r in rs])
        lines.append(f"| {LABELS[name]} | {mean_std(full)} | {', '.join(f'{x:.1f}' for x in full)} | {vs} | "
                     f"{mean_std(crop)} | {collapsed} of {len(rs)} | {ratio} | {of_c} | {prompts:.1f} | {captured} | "
                     f"{pick('cosine') if sel else '1'} | {pick('cosine_of_mean') if sel else '1'} | {weight:.1f} |")  # fmt: skip
    return lines


def plot(root: Path, runs: dict) -> str:
    """selection_accuracy.png: per task, the full-image accuracy (bars: mean, dots: seeds) above the gradient's
    cosine to the full-query gradient (one draw of S, and the mean of the draws) of each budgeted policy."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [t for t in TASKS if t in runs]
    fig, axes = plt.subplots(2, max(1, len(tasks)), figsize=(6.5 * max(1, len(tasks)), 7.6), squeeze=False)
    for col, task in enumerate(tasks):
        ax, cx = axes[0][col], axes[1][col]
        names = [n for n in VARIANTS if runs[task].get(n)]
        labels = [textwrap.fill(LABELS[n], 11) for n in names]
        means = [np.mean([r["full"] for r in runs[task][n]]) for n in names]
        for j, n in enumerate(names):
            ax.scatter([j] * len(runs[task][n]), [r["full"] for r in runs[task][n]], color="0.3", s=12, zorder=3)
        ax.bar(range(len(names)), means, color=["0.6" if n in BASELINES else "tab:blue" for n in names])
        ax.set_xticks(range(len(names)), labels, fontsize=7)
        ax.set_ylabel("full-image accuracy (%)")
        ax.set_title(f"{task}: accuracy per seed (dots) and mean (bars)")
        lo = min(min(r["full"] for r in runs[task][n]) for n in names)
        ax.set_ylim(max(0, lo - 10), 100)
        scored = [n for n in names if all(r.get("selection") for r in runs[task][n])]
        for shift, key, label in ((-0.2, "cosine", "one draw of S"), (0.2, "cosine_of_mean", "mean of the draws")):
            vals = [np.mean([r["selection"][key] for r in runs[task][n]]) for n in scored]
            cx.bar(np.arange(len(scored)) + shift, vals, width=0.4, label=label)
        cx.set_xticks(range(len(scored)), [textwrap.fill(LABELS[n], 11) for n in scored], fontsize=7)
        cx.set_ylim(0, 1)
        cx.set_ylabel("cos(g_S, g_C), mean of seeds")
        cx.set_title(f"{task}: cosine to the full-query gradient (held batches)")
        cx.legend(fontsize=7, loc="lower left")
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
        lines += task_table(task, runs[task], base) + [""]
    png = plot(root, runs) if runs else None
    if png:
        lines += [f"![{png}]({png})", ""]
    data = {"timing": timing, "bases": bases, "runs": {t: {n: [{k: v for k, v in r.items() if k != "trace"} for r in rs]
                                                           for n, rs in v.items()} for t, v in runs.items()}}  # fmt: skip
    return write_report(root, "\n".join(lines) + "\n", data)


def main(argv: list[str] | None = None) -> str:
    from opd.toy.explain import EXPLAIN
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
            from opd.ledger import write_atomic

            write_atomic(path, json.dumps(base, indent=1) + "\n")
        base = json.loads(path.read_text())
        say(f"{task} base: full image {base['full']:.1f}%, crop {base['crop']:.1f}%")
    entry.runs([job(cfg, s, root) for s in all_specs], cfg.jobs)
    return entry.finish(report)


if __name__ == "__main__":
    from opd.cli import run_cli

    run_cli(main, sys.argv[1:], "selection.py")
