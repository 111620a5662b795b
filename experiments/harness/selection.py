"""The selection experiments' policies, runs and tables, shared by experiments/selection.py (both toy tasks) and
experiments/regime.py (the paper's regime, harness.regime): docs/SELECTION.md.

- `VARIANTS`: the budgeted policies by run name, each a train.py setting of `opd.selection.selectors` (`LABELS` names them);
- `selection_job`: one run of a variant for `harness.experiment.train_one` (traced, the selection audit at its end,
  scored by eval.py in both views);
- `read_selection_run`: a finished run read back with its audit's summary and the prompts its S covered per step;
- `policy_table`: the table of SELECTION.md (accuracy per seed, paired with Random-25 on the same seed, the crop view
  and collapsed seeds, teacher tokens against Full, the audit's utility captured and gradient cosines, 1 / pi);
- `accuracy_panel`, `cosine_panel`: the two panels its plots draw per world.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import numpy as np

from harness.experiment import read_run, run_folder
from harness.report import mean_std
from opd.cli import UserError
from opd.loop.ledger import read_ledger

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
BASELINES = ("full-100", "random-25", "entropy-25", "learned-25")
"""The paper's policies (grey in the plots); the others are the remedies (blue)."""
CROP_DROP = 10.0
"""Points of crop-view accuracy below the base's after which a run counts as collapsed (its teacher pathway)."""


def variant_names(text: str) -> list[str]:
    """Comma-separated names of VARIANTS ('all': every one); an unknown one is a one-line UserError."""
    names = list(VARIANTS) if text.strip() == "all" else [v.strip() for v in text.split(",") if v.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise UserError(f"--variants: unknown {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    return names


def selection_job(cfg, spec: dict, folder: Path, *, model: Path, world: Path, steps: int, prompts: int, rollouts: int,
                  response: int, eval_tokens: int, audit: bool = True) -> dict:  # fmt: skip
    """One run of `spec["variant"]` for `harness.experiment.train_one`: the base `model` distilled on `world`'s
    train.jsonl (lr, replay settings, selection audit and eval batch from `cfg`), traced, audited at its end on
    `world`'s audit.jsonl (budgeted policies, with `audit`), scored by eval.py on its benchmark in both views."""
    settings = dict(VARIANTS[spec["variant"]][2])
    if settings.get("max_per_prompt") == "even":  # the budget spread evenly: ceil(K / prompts) per prompt
        budget = math.floor(spec["pct"] / 100 * prompts * rollouts + 1e-9)
        settings["max_per_prompt"] = max(1, math.ceil(budget / prompts))
    train = dict(
        model=str(model), data=str(world / "train.jsonl"), policy=spec["policy"], rho=spec["pct"] / 100, steps=steps,
        prompts_per_step=prompts, rollouts_per_prompt=rollouts, max_prompt_len=512, max_response_len=response,
        lr=cfg.lr, micro_batch=64, seed=spec["seed"], selector_seed=spec["seed"], replay_start=cfg.replay_start,
        replay_batch=cfg.replay_batch, save_every=0, keep_checkpoints=1, **settings,
    )  # fmt: skip
    return {
        "spec": spec, "folder": str(folder), "train": train, "trace": True,
        "audit_data": str(world / "audit.jsonl"), "audit_batches": 0,
        "selection_batches": cfg.selection_batches if spec["policy"] != "full" and audit else 0,
        "selection_draws": cfg.selection_draws,
        "eval": {"bench": str(world / "bench"), "batch": cfg.eval_batch, "max_new_tokens": eval_tokens},
    }  # fmt: skip


def read_selection_run(root: Path, spec: dict) -> dict | None:
    """`harness.experiment.read_run` with the selection audit's summary in "selection" and the mean distinct prompts
    in S per step (the ledger's selected_prompts) in "selected_prompts"; None while the run has not finished."""
    if (rec := read_run(root, spec)) is None:
        return None
    rec["selection"] = rec["selection"]["summary"] if rec["selection"] else None
    rows = read_ledger(run_folder(root, spec) / "ledger.jsonl")
    rec["selected_prompts"] = float(np.mean([r["selected_prompts"] for r in rows])) if rows else float("nan")
    return rec


def paired(rs: list[dict], reference: list[dict] | None) -> str:
    """'+d, w of n above': the mean difference in full-image accuracy to the reference policy on the same seeds and
    how many of those seeds are above it ('' without a reference run of any of these seeds)."""
    ref = {r["seed"]: r["full"] for r in reference or []}
    diffs = [r["full"] - ref[r["seed"]] for r in rs if r["seed"] in ref]
    if not diffs:
        return ""
    return f"{np.mean(diffs):+.2f}, {sum(d > 0 for d in diffs)} of {len(diffs)} above"


def token_share(rs: list[dict], full: list[dict] | None) -> float | None:
    """Teacher-scored tokens of the runs against Full querying's (means over their seeds), or None without Full."""
    if not full:
        return None
    return float(np.mean([r["ledger"]["scored_tokens"] for r in rs]) / np.mean([r["ledger"]["scored_tokens"] for r in full]))


def policy_table(runs: dict, base: dict) -> list[str]:
    """One world's table: one row per variant run (accuracy, paired with Random-25, collapse, cost, the audit)."""
    lines = ["| Policy | Full-image accuracy | Per seed | vs Random-25, same seed | Crop view (end) | Collapsed seeds | "
             "Tokens vs Full | Tokens of C | Prompts in S | Utility captured | cos(g_S, g_C) | cos(mean g_S, g_C) | "
             "Largest 1/pi |", "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for name in [n for n in VARIANTS if runs.get(n)]:
        rs = sorted(runs[name], key=lambda r: r["seed"])
        full = [r["full"] for r in rs]
        crop = [r["crop"] for r in rs]
        collapsed = sum(c < base["crop"] - CROP_DROP for c in crop)
        share = token_share(rs, runs.get("full-100"))
        ratio = f"{100 * share:.1f}%" if share is not None else "-"
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


def accuracy_panel(ax, runs: dict, title: str) -> None:
    """The full-image accuracy of every variant run: bars the mean, dots the seeds (the paper's policies grey)."""
    names = [n for n in VARIANTS if runs.get(n)]
    means = [np.mean([r["full"] for r in runs[n]]) for n in names]
    for j, n in enumerate(names):
        ax.scatter([j] * len(runs[n]), [r["full"] for r in runs[n]], color="0.3", s=12, zorder=3)
    ax.bar(range(len(names)), means, color=["0.6" if n in BASELINES else "tab:blue" for n in names])
    ax.set_xticks(range(len(names)), [textwrap.fill(LABELS[n], 11) for n in names], fontsize=7)
    ax.set_ylabel("full-image accuracy (%)")
    ax.set_title(title)
    lo = min(min(r["full"] for r in runs[n]) for n in names)
    ax.set_ylim(max(0, lo - 10), 100)


def cosine_panel(ax, runs: dict, title: str) -> None:
    """The selection audit's cosine to the full-query gradient of each audited variant: one draw of S, and the mean
    of the draws (means over seeds)."""
    names = [n for n in VARIANTS if runs.get(n) and all(r.get("selection") for r in runs[n])]
    for shift, key, label in ((-0.2, "cosine", "one draw of S"), (0.2, "cosine_of_mean", "mean of the draws")):
        vals = [np.mean([r["selection"][key] for r in runs[n]]) for n in names]
        ax.bar(np.arange(len(names)) + shift, vals, width=0.4, label=label)
    ax.set_xticks(range(len(names)), [textwrap.fill(LABELS[n], 11) for n in names], fontsize=7)
    ax.set_ylim(0, 1)
    ax.set_ylabel("cos(g_S, g_C), mean of seeds")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="lower left")


def goal_rows(runs: dict, base: dict, *, within: float = 1.0, max_tokens: float = 0.20, above: int = 4,
              seeds: int = 5) -> list[dict]:  # fmt: skip
    """The goal of docs/SELECTION.md, judged for every budgeted variant but Random-25 (its reference): mean full-image
    accuracy at most `within` points below Full querying's (or above it), at most `max_tokens` of Full's teacher-scored
    tokens, above Random-25 on at least `above` of the paired seeds, none of at least `seeds` seeds collapsed.
    One dict per variant: its numbers, each check, and "met" (all of them)."""
    full, rand = runs.get("full-100"), runs.get("random-25")
    out = []
    for name in [n for n in VARIANTS if runs.get(n) and n not in ("full-100", "random-25")]:
        rs = runs[name]
        gap = float(np.mean([r["full"] for r in rs]) - np.mean([r["full"] for r in full])) if full else float("nan")
        tokens = token_share(rs, full)
        ref = {r["seed"]: r["full"] for r in rand or []}
        diffs = [r["full"] - ref[r["seed"]] for r in rs if r["seed"] in ref]
        collapsed = sum(r["crop"] < base["crop"] - CROP_DROP for r in rs)
        checks = {"near_full": gap >= -within, "cheap": tokens is not None and tokens <= max_tokens,
                  "above_random": len(diffs) >= seeds and sum(d > 0 for d in diffs) >= above,
                  "no_collapse": len(rs) >= seeds and collapsed == 0}  # fmt: skip
        out.append({"variant": name, "gap": gap, "tokens": tokens, "wins": sum(d > 0 for d in diffs), "paired": len(diffs),
                    "collapsed": collapsed, "seeds": len(rs), **checks, "met": all(checks.values())})  # fmt: skip
    return out


def goal_table(rows: list[dict]) -> list[str]:
    """`goal_rows` as a Markdown table (each check 'yes' or 'no')."""
    yes = lambda ok: "yes" if ok else "**no**"  # noqa: E731
    lines = ["| Policy | vs Full (mean) | Within 1 point | Tokens vs Full | At most 20% | Above Random-25 | "
             "Collapsed seeds | Goal |", "| --- | ---: | --- | ---: | --- | --- | --- | --- |"]  # fmt: skip
    for g in rows:
        tokens = f"{100 * g['tokens']:.1f}%" if g["tokens"] is not None else "-"
        lines.append(f"| {LABELS[g['variant']]} | {g['gap']:+.2f} | {yes(g['near_full'])} | {tokens} | {yes(g['cheap'])} "
                     f"| {g['wins']} of {g['paired']} ({yes(g['above_random'])}) | {g['collapsed']} of {g['seeds']} "
                     f"({yes(g['no_collapse'])}) | {'met' if g['met'] else 'not met'} |")  # fmt: skip
    return lines
