"""Budgeted selection in the paper's regime: 28 prompts x 8 rollouts, feedback often redundant (docs/SELECTION.md).

    python experiments/regime.py --out runs/regime     # 35 runs at s = 50% and the sweep over s (27 more), resumable
    python experiments/regime.py --smoke               # one seed, 2 steps per run, small worlds (the test)

The world is `harness.regime`'s: a share s of the items has a large target that the full image already answers, the
rest a small one that only the crop shows, so the crop area a_i and the student's entropy carry signal; the answers
are the explained ones of `harness.explain` (7-54 tokens). One base, trained on crops as the other toy bases
(`opd.toy.sft`, the explain task's recipe), serves every s (its supervised split does not depend on s).

1. At s = `share` (50%): Full, Random-25, Entropy-25, Learned-25 (top-K, as published) and the best variants of
   SELECTION.md's parts 1-2 (capped per prompt; Horvitz-Thompson at eps 0.5; stratified by prompt at eps 0.5) x
   `seeds` seeds, 28 prompts x 8 rollouts (K = 56 of 224), one epoch; each scored by eval.py in both views, on all
   items and per kind, and audited at its end (`harness.audit.selection_audit`: the gradient's cosine to the full-query
   one, the utility its S captures).
2. The sweep: s in `sweep` for `sweep_variants` (Full, Random-25, Learned-25) x `sweep_seeds` seeds (the runs at
   s = `share` are part 1's), not audited: where does selection start to pay?
3. OUT/report.md, report.json and regime_accuracy.png from the run folders, with the goal judged
   (`harness.selection.goal_rows`).

Resumable: the worlds, the base, its evaluations and every finished run (done.json) are reused; an unfinished run's
folder is deleted and trained again. The runs go one at a time by default (`--jobs 1`), the part-1 runs first.
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

import numpy as np  # noqa: E402

from harness.entry import Entry  # noqa: E402
from harness.experiment import evaluate, machine, run_folder, say  # noqa: E402
from harness.regime import PROMPTS, ROLLOUTS, RegimeConfig, accuracy_by_kind, base_world, small_share  # noqa: E402
from harness.report import mean_std, save_figure, world_figure, write_report  # noqa: E402
from harness.selection import (  # noqa: E402
    CROP_DROP,
    LABELS,
    VARIANTS,
    accuracy_panel,
    cosine_panel,
    goal_rows,
    goal_table,
    paired,
    policy_table,
    read_selection_run,
    selection_job,
    token_share,
    variant_names,
)
from opd.loop.ledger import write_atomic  # noqa: E402

__all__ = ["RegimeExperimentConfig", "main"]

MAIN = "full-100,random-25,entropy-25,learned-25,learned-25-cap,learned-25-ht-eps50,learned-25-strat-eps50"
"""Part 1's variants: the paper's four policies and the best remedies of SELECTION.md's parts 1-2."""


@dataclass
class RegimeExperimentConfig:
    preset: str = "default"
    """Starting values: 'default' (the reported experiment) or 'smoke' (one seed, a few steps; --smoke)."""
    out: str = "runs/regime"
    """Output folder: world-s<pct>/, base/, base_eval-s<pct>/, runs/s<pct>/<variant>/seed<k>/, report.md and plot."""
    share: int = 50
    """s of part 1 (percent): the share of items with a large target, which the full image already answers."""
    variants: str = MAIN
    """Part 1's policies (names of harness.selection.VARIANTS)."""
    seeds: int = 5
    """Part 1's seeds 0..seeds-1 (data order, rollout sampling and selector seed)."""
    sweep: str = "0,25,50,75"
    """Part 2: the shares s (percent) of the sweep ('' for none)."""
    sweep_variants: str = "full-100,random-25,learned-25"
    """Part 2's policies."""
    sweep_seeds: int = 3
    """Part 2's seeds 0..sweep_seeds-1."""
    steps: int = 30
    """OPD steps per run: one epoch (each world holds prompts_per_step x steps training records)."""
    prompts_per_step: int = PROMPTS
    """Prompts per step (the paper's 28)."""
    rollouts_per_prompt: int = ROLLOUTS
    """Rollouts per prompt (the paper's 8): 224 candidates per step, K = 56 at rho 0.25."""
    max_response_len: int = 64
    """Most sampled tokens per rollout (the longest explained answer is 54 tokens with <|im_end|>)."""
    lr: float = 1.5e-4
    """AdamW learning rate of OPD (every toy experiment's)."""
    replay_start: int = 96
    """Labels in replay before the selector's first update (the paper's 96)."""
    replay_batch: int = 256
    """Replay minibatch (the paper's 256)."""
    selection_batches: int = 2
    """Held batches (28 x 8 candidates each) of part 1's end-of-run selection audit."""
    selection_draws: int = 4
    """Draws of the run's selector per held batch in that audit."""
    jobs: int = 1
    """Runs trained at once, each in its own process with one thread (1: in this process)."""
    n_audit: int = 160
    """Held records of the audit (per world)."""
    n_eval: int = 400
    """Held-out benchmark items (per world; round(s n) of them large)."""
    eval_batch: int = 100
    """eval.py --batch-size."""
    eval_tokens: int = 64
    """eval.py --max-new-tokens (greedy)."""
    sft_steps: int = 300
    """Supervised steps of the base (crops only, explained answers: the explain task's recipe)."""
    sft_batch: int = 32
    """Supervised batch of the base."""


SMOKE = dict(
    seeds=1, sweep="0,50", sweep_seeds=1, steps=2, prompts_per_step=4, rollouts_per_prompt=4, max_response_len=16,
    replay_start=4, replay_batch=16, selection_batches=1, selection_draws=2, n_audit=8, n_eval=16, eval_batch=16,
    eval_tokens=16, sft_steps=4, sft_batch=4, out="runs/regime-smoke",
)  # fmt: skip
PRESETS = {"default": {}, "smoke": SMOKE}


def world_config(cfg: RegimeExperimentConfig, share: int) -> RegimeConfig:
    return RegimeConfig(seed=0, share=share / 100, n_opd=cfg.prompts_per_step * cfg.steps, n_audit=cfg.n_audit,
                        n_eval=cfg.n_eval)  # fmt: skip


def shares(cfg: RegimeExperimentConfig) -> list[int]:
    """Every s of the plan (percent), part 1's first."""
    sweep = [int(x) for x in cfg.sweep.split(",") if x.strip()]
    return list(dict.fromkeys([cfg.share, *sweep]))


def specs(cfg: RegimeExperimentConfig) -> list[dict]:
    """Every run: part 1's (by seed, then variant), then the sweep's at the other shares (by seed, share, variant)."""
    def spec(share, variant, seed, audited):
        policy, pct, _ = VARIANTS[variant]
        return {"share": share, "variant": variant, "policy": policy, "pct": pct, "seed": seed,
                "name": f"s{share}/{variant}", "audited": audited}  # fmt: skip

    out = [spec(cfg.share, v, seed, True) for seed in range(cfg.seeds) for v in variant_names(cfg.variants)]
    have = {(s["share"], s["variant"], s["seed"]) for s in out}
    for seed in range(cfg.sweep_seeds):
        for share in shares(cfg):
            out += [spec(share, v, seed, False) for v in variant_names(cfg.sweep_variants) if (share, v, seed) not in have]
    return out


def job(cfg: RegimeExperimentConfig, spec: dict, root: Path) -> dict:
    return selection_job(cfg, spec, run_folder(root, spec), model=root / "base", world=root / f"world-s{spec['share']}",
                         steps=cfg.steps, prompts=cfg.prompts_per_step, rollouts=cfg.rollouts_per_prompt,
                         response=cfg.max_response_len, eval_tokens=cfg.eval_tokens, audit=spec["audited"])  # fmt: skip


def collect(root: Path, cfg: RegimeExperimentConfig) -> dict:
    """{share: {variant: [record per seed]}}, each record with its accuracy per kind ("kinds") and the share of small
    items in its S and in C ("small_s", "small_c", from its trace)."""
    runs: dict = {}
    for spec in specs(cfg):
        if (rec := read_selection_run(root, spec)) is not None:
            world = world_config(cfg, spec["share"])
            rec["kinds"] = accuracy_by_kind(run_folder(root, spec) / "eval", world)
            trace = rec.pop("trace", None) or []
            rec["small_s"], rec["small_c"] = small_share(trace, world), small_share(trace, world, "candidates")
            runs.setdefault(spec["share"], {}).setdefault(spec["variant"], []).append(rec)
    return runs


def kinds_table(runs: dict) -> list[str]:
    """Per variant: accuracy on the small and the large items in both views, and the small items' share of S."""
    lines = ["| Policy | Small items, full image | Large items, full image | Small items, crop | Large items, crop | "
             "Small items in S (in C) | Mean T_i of S / of C |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for name in [n for n in VARIANTS if runs.get(n)]:
        rs = runs[name]
        k = lambda view, kind: mean_std([r["kinds"][view][kind] for r in rs])  # noqa: E731
        lines.append(f"| {LABELS[name]} | {k('full', 'small')} | {k('full', 'large')} | {k('crop', 'small')} | "
                     f"{k('crop', 'large')} | {100 * np.mean([r['small_s'] for r in rs]):.1f}% "
                     f"({100 * np.mean([r['small_c'] for r in rs]):.1f}%) | "
                     f"{np.mean([r['ledger']['token_ratio'] / r['ledger']['query_ratio'] for r in rs]):.2f} |")  # fmt: skip
    return lines


def sweep_table(runs: dict, bases: dict) -> list[str]:
    """Per s: Full, Random-25 and Learned-25 (mean ± std), Learned-25 paired with both, its teacher tokens, the small
    items' share of S."""
    lines = ["| s (large targets) | Base | Full | Random-25 | Learned-25 | Learned - Random, same seed | "
             "Learned - Full, same seed | Learned tokens vs Full | Small items in S: Random / Learned | "
             "Small items, full image: base / Full / Random / Learned |",
             "| ---: | ---: | ---: | ---: | ---: | --- | --- | ---: | --- | --- |"]  # fmt: skip
    for share in sorted(runs):
        r = runs[share]
        acc = lambda n: mean_std([x["full"] for x in r.get(n, [])])  # noqa: E731
        learned = r.get("learned-25", [])
        share_of = lambda n: f"{100 * np.mean([x['small_s'] for x in r[n]]):.0f}%" if r.get(n) else "-"  # noqa: E731
        tokens = token_share(learned, r.get("full-100")) if learned else None
        base = bases.get(share, {}).get("full", float("nan"))
        base_small = bases.get(share, {}).get("kinds", {}).get("full", {}).get("small", float("nan"))
        small = lambda n: f"{np.mean([x['kinds']['full']['small'] for x in r[n]]):.1f}" if r.get(n) else "-"  # noqa: E731
        lines.append(f"| {share}% | {base:.2f} | {acc('full-100')} | {acc('random-25')} | {acc('learned-25')} | "
                     f"{paired(learned, r.get('random-25')) or '-'} | {paired(learned, r.get('full-100')) or '-'} | "
                     f"{f'{100 * tokens:.1f}%' if tokens is not None else '-'} | {share_of('random-25')} / {share_of('learned-25')} | "
                     f"{base_small:.1f} / {small('full-100')} / {small('random-25')} / {small('learned-25')} |")  # fmt: skip
    return lines


def plot(root: Path, runs: dict, main_share: int) -> str:
    """regime_accuracy.png: part 1's accuracy per seed and gradient cosines; the sweep's accuracy against s and
    Learned-25's paired difference to Random-25 and to Full."""
    from harness.report import _pyplot

    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.4))
    main = runs.get(main_share, {})
    if main:
        accuracy_panel(axes[0][0], main, f"s = {main_share}%: accuracy per seed (dots) and mean (bars)")
        cosine_panel(axes[0][1], main, f"s = {main_share}%: cosine to the full-query gradient (held batches)")
    xs = sorted(runs)
    ax, dx = axes[1][0], axes[1][1]
    for name, colour in (("full-100", "k"), ("random-25", "tab:orange"), ("learned-25", "tab:blue")):
        pts = [(s, [r["full"] for r in runs[s][name]]) for s in xs if runs[s].get(name)]
        if pts:
            ax.errorbar([p[0] for p in pts], [np.mean(p[1]) for p in pts], [np.std(p[1], ddof=1) if len(p[1]) > 1 else 0
                        for p in pts], marker="o", capsize=3, color=colour, label=LABELS[name])  # fmt: skip
    ax.set_xlabel("s: share of large targets, which the full image answers (%)")
    ax.set_ylabel("full-image accuracy (%), mean ± std of seeds")
    ax.set_title("the sweep: accuracy against s")
    ax.legend(fontsize=7)
    for ref, colour in (("random-25", "tab:orange"), ("full-100", "k")):
        pts = []
        for s in xs:
            refs = {r["seed"]: r["full"] for r in runs[s].get(ref, [])}
            d = [r["full"] - refs[r["seed"]] for r in runs[s].get("learned-25", []) if r["seed"] in refs]
            if d:
                pts.append((s, d))
        for s, d in pts:
            dx.scatter([s] * len(d), d, color=colour, s=10, alpha=0.6)
        if pts:
            dx.plot([p[0] for p in pts], [np.mean(p[1]) for p in pts], marker="o", color=colour,
                    label=f"Learned-25 - {LABELS[ref]}")  # fmt: skip
    dx.axhline(0, color="0.5", lw=0.8)
    dx.set_xlabel("s (%)")
    dx.set_ylabel("points, same seed (dots) and mean")
    dx.set_title("the sweep: Learned-25's paired difference")
    dx.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, root / "regime_accuracy.png", 120)
    return "regime_accuracy.png"


def goal_lines(runs: dict, base: dict, cfg: RegimeExperimentConfig) -> list[str]:
    rows = goal_rows(runs, base, seeds=cfg.seeds, above=max(1, cfg.seeds - 1))
    met = [LABELS[g["variant"]] for g in rows if g["met"]]
    return [f"### The goal at s = {cfg.share}%", "",
            "A 25% budget within 1 point of Full (or above), with at most 20% of Full's teacher tokens, above Random-25 "
            f"in at least {max(1, cfg.seeds - 1)} of {cfg.seeds} paired seeds, no collapsed seed: "
            + (f"**met** by {', '.join(met)}." if met else "**not met** by any variant."), ""] + goal_table(rows)  # fmt: skip


def report(root: Path, cfg: RegimeExperimentConfig, timing: dict, command: str) -> str:
    runs = collect(root, cfg)
    bases = {s: json.loads((root / f"base_eval-s{s}.json").read_text()) for s in shares(cfg)
             if (root / f"base_eval-s{s}.json").exists()}  # fmt: skip
    problems = [p for by in runs.values() for rs in by.values() for r in rs for p in r["ledger_problems"]]
    n_rows = sum(r["ledger"]["steps"] for by in runs.values() for rs in by.values() for r in rs)
    lines = ["# Budgeted selection in the paper's regime (28 prompts x 8 rollouts, redundant feedback)", "",
             f"- Command: `{command}`", f"- Machine: {machine()}; {cfg.jobs} run(s) at a time, one thread each",
             f"- Wall time: {timing.get('total_s', 0):.0f} s in all (runs {timing.get('runs_s', 0):.0f} s); CPU time "
             f"{timing.get('cpu_s', 0):.0f} s; {timing.get('invocations', 1)} invocation(s)",
             f"- Finished: {time.strftime('%Y-%m-%d %H:%M:%S')}",
             f"- Setting: {cfg.steps} OPD steps (one epoch) of {cfg.prompts_per_step} prompts x {cfg.rollouts_per_prompt} "
             f"rollouts of at most {cfg.max_response_len} tokens, K = {int(0.25 * cfg.prompts_per_step * cfg.rollouts_per_prompt)} "
             f"at rho 0.25; lr {cfg.lr:g}; base: {cfg.sft_steps} supervised steps of {cfg.sft_batch} crops (explained "
             f"answers); part 1 at s = {cfg.share}%, {cfg.seeds} seeds, selection audit on {cfg.selection_batches} held "
             f"batches x {cfg.selection_draws} draws; sweep s = {cfg.sweep or '-'}%, {cfg.sweep_seeds} seeds; eval.py greedy "
             f"on {cfg.n_eval} held-out items per world", "",
             f"Ledger checks (K = floor(rho |C|), |S| <= K, teacher rows = |S|) on {n_rows} rows: "
             + ("all hold." if not problems else f"{len(problems)} problems: {problems[:5]}"), "",
             "## The base in each world", "", "eval.py's accuracy (%) of the one base (trained on crops) on each world's "
             "benchmark.", "", "| s | Full image | Small items, full | Large items, full | Crop | Small items, crop |",
             "| ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for s, b in sorted(bases.items()):
        k = b.get("kinds", {"full": {}, "crop": {}})
        lines.append(f"| {s}% | {b['full']:.2f} | {k['full'].get('small', float('nan')):.2f} | "
                     f"{k['full'].get('large', float('nan')):.2f} | {b['crop']:.2f} | {k['crop'].get('small', float('nan')):.2f} |")
    main, base = runs.get(cfg.share, {}), bases.get(cfg.share, {"full": float("nan"), "crop": float("nan")})
    if main:
        lines += ["", f"## Part 1: s = {cfg.share}%", "", f"A seed counts as collapsed when its crop view ends more than "
                  f"{CROP_DROP:g} points below the base's ({base['crop']:.1f}%).", ""] + policy_table(main, base)
        lines += ["", "Per kind of item (mean ± std over seeds); T_i ratio: the mean length of S's responses over C's.",
                  ""] + kinds_table(main) + [""] + goal_lines(main, base, cfg)  # fmt: skip
    if len(runs) > 1 or cfg.sweep:
        lines += ["", "## Part 2: the sweep over s", ""] + sweep_table(runs, bases)
    png = plot(root, runs, cfg.share) if runs else None
    lines += ["", f"![{png}]({png})"] if png else []
    if (root / f"world-s{cfg.share}").exists():
        lines += ["", f"![world.png]({world_figure(root, world_config(cfg, cfg.share))})"]
    data = {"timing": timing, "bases": bases, "goal": goal_rows(main, base, seeds=cfg.seeds, above=max(1, cfg.seeds - 1))
            if main else [], "runs": {s: by for s, by in runs.items()}}  # fmt: skip
    return write_report(root, "\n".join(lines) + "\n", data)


def prepare(entry: Entry, cfg: RegimeExperimentConfig) -> None:
    """The worlds (one per s), the one base, and its evaluation on each world's benchmark (per kind too)."""
    from harness.explain import EXPLAIN
    from opd.toy.sft import SFTConfig
    from opd.toy.world import export_world

    root = entry.root
    with entry.phase("world_s"):
        for s in shares(cfg):
            export_world(root / f"world-s{s}", world_config(cfg, s))
    entry.base(base_world(world_config(cfg, cfg.share)), SFTConfig(steps=cfg.sft_steps, batch=cfg.sft_batch), task=EXPLAIN,
               what=f"base ({cfg.sft_steps} supervised steps of explained answers on crops)")  # fmt: skip
    for s in shares(cfg):
        path = root / f"base_eval-s{s}.json"
        if not path.exists():
            with entry.phase("base_eval_s"):
                res = evaluate(root / "base", root / f"world-s{s}" / "bench", root / f"base_eval-s{s}", cfg.eval_batch,
                               cfg.eval_tokens, f"base-s{s}")  # fmt: skip
                res["kinds"] = accuracy_by_kind(root / f"base_eval-s{s}", world_config(cfg, s))
                write_atomic(path, json.dumps(res, indent=1) + "\n")
        b = json.loads(path.read_text())
        say(f"s = {s}%: base full image {b['full']:.1f}% (small {b['kinds']['full']['small']:.1f}%, large "
            f"{b['kinds']['full']['large']:.1f}%), crop {b['crop']:.1f}%")  # fmt: skip


def main(argv: list[str] | None = None) -> str:
    entry = Entry.start(RegimeExperimentConfig, PRESETS, argv, __doc__, "python experiments/regime.py")
    cfg, root = entry.cfg, entry.root
    prepare(entry, cfg)
    entry.runs([job(cfg, s, root) for s in specs(cfg)], cfg.jobs)
    return entry.finish(report)


if __name__ == "__main__":
    from opd.cli import run_cli

    run_cli(main, sys.argv[1:], "regime.py")
