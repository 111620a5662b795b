"""The toy experiments' report: Markdown tables (Tables 3, 7, 8, Figures 3, 4 analogues) and plots
(Figures 2-5 analogues, the world), built from the results that `harness.experiment.collect` reads
back from the run folders. Each section function returns its Markdown lines; shared by
experiments/toy.py and experiments/toy_explain.py.

Every file is written whole or not at all, as the rest of the project writes: the report through
`write_report` (`opd.loop.ledger.write_atomic`), each plot through `save_figure` (a temporary sibling, then
os.replace), so a reader or an interrupted run never sees half a report or a truncated PNG. All four
experiment scripts write their reports and plots through these two.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from PIL import Image

from harness.experiment import label, order
from opd.loop.ledger import write_atomic
from opd.toy.world import sample


def write_report(root, text: str, data: dict) -> str:
    """OUT/report.md (`text`) and OUT/report.json (`data`, non-JSON values as their str), each written atomically;
    returns `text`."""
    write_atomic(Path(root) / "report.md", text)
    write_atomic(Path(root) / "report.json", json.dumps(data, indent=1, default=str) + "\n")
    return text


def save_figure(fig, path, dpi: int) -> None:
    """Saves a matplotlib figure atomically (to a temporary sibling, flushed to disk, then os.replace; the format is
    the path's suffix) and closes it."""
    import matplotlib.pyplot as plt  # here: only plots need it, after _pyplot() chose the Agg backend

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with tmp.open("wb") as f:
            fig.savefig(f, format=path.suffix.lstrip(".") or None, dpi=dpi)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
        plt.close(fig)


def mean_std(values) -> str:
    """'mean ± std' (std with n - 1), the mean alone for one value, '-' for none."""
    v = np.asarray([x for x in values if x is not None], dtype=float)
    if v.size == 0:
        return "-"
    return f"{v.mean():.2f} ± {v.std(ddof=1):.2f}" if v.size > 1 else f"{v.mean():.2f}"


def ranks(x) -> np.ndarray:
    """Ranks 0..n-1 of x, tied values sharing their average rank."""
    x = np.asarray(x, dtype=float)
    order = np.argsort(x, kind="stable")
    r = np.empty(len(x))
    r[order] = np.arange(len(x))
    for v in np.unique(x):
        tie = x == v
        r[tie] = r[tie].mean()
    return r


def spearman(x, y) -> float:
    """Spearman rank correlation: Pearson's on average ranks; NaN with fewer than 3 rows or a constant side."""
    if len(x) < 3:
        return float("nan")
    rx, ry = ranks(x), ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


def full_tokens(runs: dict) -> dict[int, int]:
    """Teacher-scored tokens of Full querying, per seed."""
    return {r["seed"]: r["ledger"]["scored_tokens"] for r in runs.get("full-100", [])}


def gap_section(base: dict, runs: dict, names: list[str], base_label: str = "base (SFT on crops)") -> list[str]:
    gap = base["crop"] - base["full"]
    lines = [
        "## The regional-to-global gap (eval.py, held-out benchmark)",
        "",
        "| Model | Full image | Crop | Crop - full |",
        "| --- | ---: | ---: | ---: |",
        f"| {base_label} | {base['full']:.2f} | {base['crop']:.2f} | {gap:+.2f} |",
    ]
    for n in names:
        rs = runs[n]
        lines.append(f"| {label(n)} | {mean_std([r['full'] for r in rs])} | {mean_std([r['crop'] for r in rs])} | "
                     f"{mean_std([r['crop'] - r['full'] for r in rs])} |")
    full = runs.get("full-100", [])
    if full and gap > 0:
        closed = (np.array([r["full"] for r in full]) - base["full"]) / gap
        lines += ["", f"Full querying closes {100 * closed.mean():.1f}% of the base's gap (per seed: "
                  + ", ".join(f"{100 * c:.1f}%" for c in closed) + ")."]
    return lines


def table3(runs: dict, names: list[str]) -> list[str]:
    lines = [
        "## Table 3 analogue: policy accuracy and teacher cost",
        "",
        "Full-image accuracy on the held-out benchmark, mean ± std over seeds (std with n - 1). Query ratio is "
        "selected / candidates; token ratio is teacher-scored tokens relative to Full querying on the same seed.",
        "",
        "| Policy | Query ratio | Token ratio | Full-image accuracy | Per seed | vs Full (paired) |",
        "| --- | ---: | ---: | ---: | --- | ---: |",
    ]
    full_tok = full_tokens(runs)
    by_seed_full = {r["seed"]: r["full"] for r in runs.get("full-100", [])}
    for n in names:
        rs = sorted(runs[n], key=lambda r: r["seed"])
        led = [r["ledger"] for r in rs]
        q = 100 * sum(x["calls"] for x in led) / max(1, sum(x["candidates"] for x in led))
        t = [100 * r["ledger"]["scored_tokens"] / full_tok[r["seed"]] for r in rs if full_tok.get(r["seed"])]
        d = [r["full"] - by_seed_full[r["seed"]] for r in rs if r["seed"] in by_seed_full]
        lines.append(f"| {label(n)} | {q:.2f} | {np.mean(t) if t else float('nan'):.2f} | {mean_std([r['full'] for r in rs])} | "
                     + ", ".join(f"{r['full']:.1f}" for r in rs) + f" | {'-' if n == 'full-100' else mean_std(d)} |")
    return lines


def table7(runs: dict, names: list[str]) -> list[str]:
    lines = ["## Table 7 analogue: teacher-supervision counts (all seeds summed)", "",
             "| Policy | Candidates | Teacher calls | Query ratio | Scored tokens | Tokens vs. Full | Max overrun |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    total_full_tok = sum(r["ledger"]["scored_tokens"] for r in runs.get("full-100", []))
    for n in names:
        led = [r["ledger"] for r in runs[n]]
        c, k, s = (sum(x[key] for x in led) for key in ("candidates", "calls", "scored_tokens"))
        lines.append(f"| {label(n)} | {c:,} | {k:,} | {100 * k / max(1, c):.2f}% | {s:,} | "
                     f"{100 * s / total_full_tok if total_full_tok else float('nan'):.2f}% | "
                     f"{max(max(0, x['max_overrun']) for x in led)} |")
    return lines


def table8(runs: dict, names: list[str]) -> list[str]:
    lines = ["## Table 8 analogue: observed training time (mean ± std over seeds, seconds)", "",
             "| Policy | Teacher forward sum | Mean teacher/step | Mean step | Total step time | Generation sum |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for n in names:
        led = [r["ledger"] for r in runs[n]]
        lines.append(f"| {label(n)} | {mean_std([x['teacher_forward_s'] for x in led])} | "
                     f"{mean_std([x['mean_teacher_s'] for x in led])} | {mean_std([x['mean_step_s'] for x in led])} | "
                     f"{mean_std([x['step_s'] for x in led])} | {mean_std([x['phases_s']['generation'] for x in led])} |")
    return lines


def ledger_line(runs: dict, names: list[str]) -> str:
    problems = [f"{n} seed {r['seed']}: {p}" for n in names for r in runs[n] for p in r["ledger_problems"]]
    n_rows = sum(r["ledger_rows"] for n in names for r in runs[n])
    return (f"Ledger arithmetic (K = floor(rho |C|), |S| <= K, |S| = |C| under Full, teacher rows = |S|, scored "
            f"<= candidate tokens) checked on {n_rows} ledger rows: "
            + ("all hold." if not problems else f"{len(problems)} problem(s): " + "; ".join(problems[:5])))


def audit_section(runs: dict, prompts: int, rollouts: int, name: str = "learned-25") -> list[str]:
    audits = [(r["seed"], r["audit"]) for r in sorted(runs.get(name, []), key=lambda r: r["seed"]) if r.get("audit")]
    if not audits:
        return []
    lines = ["## Figure 3 analogue: frozen-selector utility audit (Learned-25, final state)", "",
             f"{audits[0][1]['batches']} held batches of {prompts} x {rollouts} "
             f"candidates per seed, every candidate scored by the EMA teacher. Utility captured by the top 25%:", "",
             "| Seed | Oracle | Learned | Entropy | Random | Bands by | Band means (top to bottom) | top/next | p_Holm (top > next) | Prompts in top 25%: learned / entropy / random (of P) |",
             "| --- | ---: | ---: | ---: | ---: | --- | --- | ---: | ---: | --- |"]
    for seed, a in audits:
        j = a["fractions"].index(0.25)
        cap = {k: f"{100 * a['capture'][k][j]:.1f}%" if k in a["capture"] else "-"
               for k in ("oracle", "learned", "entropy", "random")}
        bands = ", ".join(f"{b['mean']:.2e} [{b['low']:.2e}, {b['high']:.2e}]" for b in a["bands"]["bands"])
        lines.append(f"| {seed} | {cap['oracle']} | {cap['learned']} | {cap['entropy']} | {cap['random']} | "
                     f"{a['bands_by']} | {bands} | {a['bands']['top_over_next']:.2f} | "
                     f"{a['bands']['tests'][0]['p_holm']:.3f} | " + " / ".join(
                         f"{a['coverage'][k]:.1f}" if k in a.get("coverage", {}) else "-"
                         for k in ("learned", "entropy", "random")) + f" (of {a.get('prompts_per_batch', 0):.0f}) |")
    return lines


def geometry_section(runs: dict, name: str = "learned-25") -> list[str]:
    geometry = [r["geometry"] for r in runs.get(name, []) if r.get("geometry")]
    if not geometry:
        return []
    lines = ["## Figure 4 analogue: gradient geometry (Learned-25, seed 0)", "",
             "S = the frozen selector's top 25% of a held batch, U = the other 75%; g = gradient of Eq. 11's token "
             "mean over the set with respect to all policy parameters.", "",
             "| Step | Batches | mean ‖g_S‖ | mean ‖g_U‖ | ratio of means | per-batch ratio range | mean cos | cos range |",
             "| ---: | ---: | ---: | ---: | ---: | --- | ---: | --- |"]
    for c in geometry[0]:
        s = c["summary"]
        lines.append(f"| {c['step']} | {s['batches']} | {s['mean_norm_selected']:.3e} | {s['mean_norm_unselected']:.3e} | "
                     f"{s['norm_ratio']:.2f} | {s['ratio_min']:.2f}-{s['ratio_max']:.2f} | {s['mean_cosine']:.3f} | "
                     f"{s['cosine_min']:.3f} to {s['cosine_max']:.3f} |")
    return lines


# ----------------------------------------------------------------------------- plots


def _pyplot():
    import matplotlib  # here, not at the top: only plots need it, and Agg must be chosen before pyplot loads

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after matplotlib.use("Agg"): no display needed

    return plt


def world_figure(root, world, n: int = 6) -> str:
    """OUT/world.png: the first `n` held-out items as the canvas with the crop's bbox, and both views at
    the model's input resolution (resized here with PIL's bicubic filter, as an illustration)."""
    plt = _pyplot()
    side = (world.resolution, world.resolution)
    fig, axes = plt.subplots(3, n, figsize=(1.65 * n, 5.2))
    for j in range(n):
        s = sample(world, "eval", j)
        x1, y1, x2, y2 = s.bbox
        views = (s.image, s.image.resize(side, Image.BICUBIC), s.crop().resize(side, Image.BICUBIC))
        for row, im in enumerate(views):
            ax = axes[row, j]
            ax.imshow(im)
            ax.set_xticks([])
            ax.set_yticks([])
        axes[0, j].add_patch(plt.Rectangle((x1 - 0.5, y1 - 0.5), x2 - x1, y2 - y1, fill=False, ec="white", lw=1.2))
        axes[0, j].set_title(f"{s.colour} {s.shape} ({s.answer}), {s.target}px", fontsize=7)
    for row, name in enumerate((f"canvas {world.canvas}x{world.canvas}", f"full view @{world.resolution}",
                                f"crop view @{world.resolution}")):
        axes[row, 0].set_ylabel(name, fontsize=8)
    fig.suptitle("Toy world: the canvas with the crop's bbox, and what the model sees", fontsize=9)
    fig.tight_layout()
    save_figure(fig, root / "world.png", dpi=110)
    return "world.png"


def plots(root, runs: dict, base: dict) -> list[str]:
    """Figures 2, 5, 3 and 4 analogues (OUT/fig*.png) from the runs of Table 3; returns the file names."""
    acc = {n: np.array([r["full"] for r in rs]) for n, rs in runs.items()}
    files = [_budget_figure(root, acc, base), _cost_figure(root, runs, acc, base)]
    audits = [r["audit"] for r in runs.get("learned-25", []) if r.get("audit")]
    if audits:
        files.append(_audit_figure(root, audits))
    geometry = [r["geometry"] for r in runs.get("learned-25", []) if r.get("geometry")]
    if geometry:
        files.append(_geometry_figure(root, geometry[0]))
    return files


def _budget_figure(root, acc: dict, base: dict) -> str:
    """Figure 2 analogue: full-image accuracy against the budget rho."""
    plt = _pyplot()
    full = acc.get("full-100")
    fig, ax = plt.subplots(figsize=(5.2, 3.6))
    learned = sorted([(int(n.split("-")[1]), acc[n]) for n in acc if n.startswith("learned")] +
                     ([(100, full)] if full is not None else []))
    if learned:
        x = [b for b, _ in learned]
        ax.errorbar(x, [a.mean() for _, a in learned], yerr=[a.std(ddof=1) if a.size > 1 else 0 for _, a in learned],
                    marker="o", capsize=3, label="Learned (100 = Full)")
        best = int(np.argmax([a.mean() for _, a in learned]))
        ax.plot([x[best]], [learned[best][1].mean()], "o", color="tab:orange", ms=10, zorder=0)
    for n, m, c in (("random-25", "s", "tab:gray"), ("entropy-25", "^", "tab:green")):
        if n in acc:
            ax.errorbar([25 + (2 if m == "s" else -2)], [acc[n].mean()], yerr=[acc[n].std(ddof=1) if acc[n].size > 1 else 0],
                        fmt=m, color=c, capsize=3, label=label(n))
    if full is not None:
        ax.axhline(full.mean(), ls="--", color="tab:blue", lw=1, label="Full querying")
    ax.axhline(base["full"], ls=":", color="k", lw=1, label="base, full image")
    ax.axhline(base["crop"], ls=":", color="tab:red", lw=1, label="base, crop")
    ax.set_xscale("log")
    ax.set_xticks([10, 25, 50, 100], ["10", "25", "50", "100"])
    ax.set_xlabel("teacher-query budget rho (%)")
    ax.set_ylabel("full-image accuracy (%)")
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("Figure 2 analogue: accuracy vs budget", fontsize=9)
    fig.tight_layout()
    save_figure(fig, root / "fig2_budget.png", dpi=130)
    return "fig2_budget.png"


def _cost_figure(root, runs: dict, acc: dict, base: dict) -> str:
    """Figure 5 analogue: full-image accuracy against the teacher's scored tokens (% of Full querying's)."""
    plt = _pyplot()
    full_tok = full_tokens(runs)
    tok = {n: np.array([100 * r["ledger"]["scored_tokens"] / full_tok[r["seed"]] for r in rs if full_tok.get(r["seed"])])
           for n, rs in runs.items()}  # fmt: skip
    fig, ax = plt.subplots(figsize=(5.2, 3.6))
    for n in order(runs):
        if tok.get(n) is not None and tok[n].size:
            ax.errorbar([tok[n].mean()], [acc[n].mean()], yerr=[acc[n].std(ddof=1) if acc[n].size > 1 else 0],
                        fmt="o", capsize=3)
            ax.annotate(f"{label(n)}", (tok[n].mean(), acc[n].mean()), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.axhline(base["full"], ls=":", color="k", lw=1, label="base, full image")
    ax.set_xlabel("teacher-scored tokens vs Full querying (%)")
    ax.set_ylabel("full-image accuracy (%)")
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("Figure 5 analogue: accuracy vs teacher cost", fontsize=9)
    fig.tight_layout()
    save_figure(fig, root / "fig5_cost.png", dpi=130)
    return "fig5_cost.png"


def _audit_figure(root, audits: list) -> str:
    """Figure 3 analogue: cumulative utility capture and utility by predicted-rank band (Learned-25's audits)."""
    plt = _pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.6))
    grid = np.array(audits[0]["grid"]) * 100
    for key, style in (("oracle", "-"), ("learned", "-"), ("entropy", "--"), ("random", ":")):
        curves = [a["curve"][key] for a in audits if key in a["curve"]]
        if curves:
            a1.plot(grid, 100 * np.mean(curves, 0), style, label=key)
    a1.axvline(25, color="gray", lw=0.8)
    a1.set_xlabel("top fraction of candidates queried (%)")
    a1.set_ylabel("utility captured (%)")
    a1.legend(fontsize=7)
    a1.set_title("(a) cumulative utility capture", fontsize=9)
    bands = audits[0]["bands"]["bands"]
    means = [b["mean"] for b in bands]
    err = [[b["mean"] - b["low"] for b in bands], [b["high"] - b["mean"] for b in bands]]
    a2.bar(["0-25", "25-50", "50-75", "75-100"], means, yerr=err, capsize=3, color="tab:blue")
    a2.set_xlabel(f"predicted rank band (%), by {audits[0]['bands_by']}")
    a2.set_ylabel("mean utility u_i")
    p = audits[0]["bands"]["tests"][0]["p_holm"]
    a2.set_title(f"(b) utility by rank band, 95% bootstrap CI\n(seed 0; top vs next: p_Holm = {p:.3f})", fontsize=8)
    fig.tight_layout()
    save_figure(fig, root / "fig3_audit.png", dpi=130)
    return "fig3_audit.png"


def _geometry_figure(root, g: list) -> str:
    """Figure 4 analogue: selected against unselected gradient norms and cosines over training (Learned-25's)."""
    plt = _pyplot()
    steps = [c["step"] for c in g]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.4))
    for c in g:
        rs = [row["norm_selected"] / row["norm_unselected"] for row in c["rows"] if row["norm_unselected"] > 0]
        a1.plot([c["step"]] * len(rs), rs, ".", color="tab:gray", alpha=0.6)
        a2.plot([c["step"]] * len(c["rows"]), [row["cosine"] for row in c["rows"]], ".", color="tab:gray", alpha=0.6)
    a1.plot(steps, [c["summary"]["norm_ratio"] for c in g], "o-", label="ratio of mean norms")
    a1.axhline(1, color="k", lw=0.8)
    a1.set_xlabel("training step")
    a1.set_ylabel("||g_S|| / ||g_U||")
    a1.legend(fontsize=7)
    a1.set_title("(a) selected vs unselected OPD gradient norm", fontsize=9)
    a2.plot(steps, [c["summary"]["mean_cosine"] for c in g], "o-")
    a2.axhline(0, color="k", lw=0.8)
    a2.set_xlabel("training step")
    a2.set_ylabel("cos(g_S, g_U)")
    a2.set_title("(b) cosine of selected and unselected gradients", fontsize=9)
    fig.tight_layout()
    save_figure(fig, root / "fig4_geometry.png", dpi=130)
    return "fig4_geometry.png"
