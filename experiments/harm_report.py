"""The part-4 study's report (experiments/harm.py): paired differences with 95% t-intervals, the decision rule applied
to each world, the spread of Eq. 7-9's factors over C, the noise-floor leg. Reads only RESULTS (the compact records).

Decision rule (fixed before the runs, issue 43): selection *pays* in a world when Learned-25 - Random-25 has a 95%
interval above 0; the paper's claim *reproduces* there when Learned-25 - Full also has an interval above 0 at <= 20%
of Full's teacher tokens. If Oracle-25 fails where Learned-25 fails, the label (Eq. 9) is at fault; if the oracle wins
and Learned-25 does not, the features are.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from harm import LABELS, NOISE, POLICIES, WORLDS, HarmExperimentConfig, world_config
from harness.regime import small_area_bound
from harness.report import save_figure, write_report

T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086,
        25: 2.060, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}  # fmt: skip
"""Student's t 0.975 quantiles by degrees of freedom (tables; between entries the next smaller df's, conservative)."""
CONTRASTS = [("learned-25", "random-25"), ("learned-25", "full-100"), ("full-100", "random-25"),
             ("oracle-25", "random-25"), ("oracle-25", "full-100"), ("cover-25", "random-25"),
             ("learned-25", "cover-25"), ("learned-25-dim", "cover-25"), ("learned-25-dim", "learned-25"),
             ("learned-25-dim", "random-25")]  # fmt: skip
"""The paired contrasts of each world (A - B, same seed)."""
DESIGNS = {"h0": "h = 0", "h25": "h = 25%, usual crop area", "h25-shift": "h = 25%, shifted crop area",
           "h0-lr10": "h = 0 at lr / 10 (noise floor)"}  # fmt: skip


def t975(df: int) -> float:
    return T975[max(k for k in T975 if k <= df)] if df >= 1 else float("nan")


def interval(diffs) -> dict:
    """Mean of paired differences with its 95% t-interval (n - 1 degrees of freedom); NaN bounds below 2 pairs."""
    d = np.asarray(diffs, dtype=float)
    n = d.size
    mean = float(d.mean()) if n else float("nan")
    half = t975(n - 1) * float(d.std(ddof=1)) / np.sqrt(n) if n > 1 else float("nan")
    return {"n": n, "mean": mean, "lo": mean - half, "hi": mean + half, "sd": float(d.std(ddof=1)) if n > 1 else float("nan")}


def paired(a: dict, b: dict, key=lambda r: r["full"]) -> dict:
    """interval() of key(A) - key(B) over the seeds both have ({seed: record} each)."""
    return interval([key(a[s]) - key(b[s]) for s in sorted(set(a) & set(b))])


def collect(results: Path) -> dict:
    """{world: {policy: {seed: record}}} from RESULTS/<world>/<policy>/seed<k>.json."""
    runs: dict = {}
    for path in sorted(Path(results).glob("*/*/seed*.json")):
        rec = json.loads(path.read_text())
        s = rec["spec"]
        runs.setdefault(s["world"], {}).setdefault(s["variant"], {})[s["seed"]] = rec
    return runs


def fmt(c: dict) -> str:
    if not c["n"]:
        return "-"
    if c["n"] < 2:
        return f"{c['mean']:+.2f} (n = 1)"
    return f"{c['mean']:+.2f} [{c['lo']:+.2f}, {c['hi']:+.2f}] (n = {c['n']})"


def token_share(a: dict, full: dict) -> dict:
    """Teacher-scored tokens against Full's on the same seed (Oracle-25: its S only; it scores all of C to choose)."""
    return interval([a[s]["ledger"]["scored_tokens"] / full[s]["ledger"]["scored_tokens"] for s in sorted(set(a) & set(full))])


def decision(by: dict) -> dict:
    """The decision rule on one world's runs: pays, reproduces, and where the fault lies."""
    get = lambda a, b: paired(by.get(a, {}), by.get(b, {}))  # noqa: E731
    lr, lf, orr = get("learned-25", "random-25"), get("learned-25", "full-100"), get("oracle-25", "random-25")
    tokens = token_share(by.get("learned-25", {}), by.get("full-100", {}))
    pays = bool(lr["n"] > 1 and lr["lo"] > 0)
    reproduces = bool(pays and lf["lo"] > 0 and tokens["mean"] <= 0.20)
    oracle_wins = bool(orr["n"] > 1 and orr["lo"] > 0)
    fault = "-" if pays or lr["n"] < 2 or orr["n"] < 2 else ("the features (the oracle wins, Learned-25 does not)" if oracle_wins
                              else "the label, Eq. 9 (the oracle fails too)")  # fmt: skip
    return {"pays": pays, "reproduces": reproduces, "oracle_wins": oracle_wins, "fault": fault,
            "learned_random": lr, "learned_full": lf, "oracle_random": orr, "tokens": tokens}  # fmt: skip


def policy_table(by: dict) -> list[str]:
    lines = ["| Policy | Seeds | Full image, mean ± sd | Small | Harmful | Large | Crop view | Harmful rows in S (in C) | "
             "Tokens vs Full, same seed |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for p in [p for p in POLICIES if by.get(p)]:
        rs = list(by[p].values())
        ms = lambda xs: f"{np.mean(xs):.2f} ± {np.std(xs, ddof=1):.2f}" if len(xs) > 1 else f"{np.mean(xs):.2f}"  # noqa: E731
        kind = lambda k: ms([r["kinds"]["full"][k] for r in rs])  # noqa: E731
        mix = [r["mix"] for r in rs if r.get("mix")]
        share = lambda m, w: m[w].get("harmful", 0) / max(1, sum(m[w].values()))  # noqa: E731
        harm = f"{100 * np.mean([share(m, 'S') for m in mix]):.1f}% ({100 * np.mean([share(m, 'C') for m in mix]):.1f}%)" if mix else "-"
        tok = token_share(by[p], by.get("full-100", {}))
        tokens = f"{100 * tok['mean']:.1f}%" + (" + all of C" if p == "oracle-25" else "") if tok["n"] else "-"
        lines.append(f"| {LABELS[p]} | {len(rs)} | {ms([r['full'] for r in rs])} | {kind('small')} | {kind('harmful')} | "
                     f"{kind('large')} | {ms([r['crop'] for r in rs])} | {harm} | {tokens} |")  # fmt: skip
    return lines


def contrast_table(by: dict) -> list[str]:
    lines = ["| Contrast (same seed) | Full-image accuracy, mean [95% interval] | Small items | Harmful items |",
             "| --- | --- | --- | --- |"]
    for a, b in CONTRASTS:
        if by.get(a) and by.get(b):
            kind = lambda k: fmt(paired(by[a], by[b], lambda r: r["kinds"]["full"][k]))  # noqa: E731
            some = next(iter(by[a].values()))
            harm = kind("harmful") if np.isfinite(some["kinds"]["full"]["harmful"]) else "-"
            lines.append(f"| {LABELS[a]} - {LABELS[b]} | {fmt(paired(by[a], by[b]))} | {kind('small')} | {harm} |")
    return lines


SMALL_AREA = small_area_bound(world_config(HarmExperimentConfig(), "h0")) + 1e-4
"""A healthy row's kind from its a_i: a small item's crop area is at most this (0.1914; a large one's at least
0.5625), the same split as the target side `harm_policies.row_kind` uses."""


def factor_rows(rows: list[dict], label: str) -> list[str]:
    """One line per factor (d, o, c, u) and kind of row: quantiles over the rows of C."""
    out = []
    for kind in ("large", "small", "harmful"):
        pick = [r for r in rows if (("harmful" if r["harm"] else "large" if r["area"] > SMALL_AREA else "small") == kind)]
        if not pick:
            continue
        cells = []
        for f in ("o", "c", "o_peak", "c_peak", "d", "u"):
            q = np.percentile([r[f] for r in pick], [5, 50, 95])
            cells.append(f"{q[1]:.3f} [{q[0]:.3f}, {q[2]:.3f}]")
        out.append(f"| {label} | {kind} | {len(pick)} | " + " | ".join(cells) + " |")
    return out


def factor_table(by: dict) -> list[str]:
    """o, c, d and u_i over C: the base (Full's seed 0 before its first step) and each policy's runs at their end."""
    lines = ["| When | Rows | n | o, row mean: median [5%, 95%] | c, row mean | o at the most divergent token | c there | "
             "d, row mean | u = mean(d o c) |", "| --- | --- | ---: | --- | --- | --- | --- | --- | --- |"]
    start = [r for rec in by.get("full-100", {}).values() if rec.get("factors_start") for r in rec["factors_start"]]
    lines += factor_rows(start, "base (start)") if start else []
    for p in [p for p in POLICIES if by.get(p)]:
        end = [r for rec in by[p].values() if rec.get("factors_end") for r in rec["factors_end"]]
        lines += factor_rows(end, f"{LABELS[p]}, end") if end else []
    return lines


def noise_lines(by: dict, base: dict | None) -> list[str]:
    """The noise-floor leg: each policy's gain over the base and the paired contrasts, with the spread of one seed."""
    lines = ["| Policy or contrast | Seeds | Mean [95% interval] | sd of one seed | One seed's 95% range |",
             "| --- | ---: | --- | ---: | --- |"]
    ref = base["full"] if base else float("nan")
    for p in [p for p in NOISE if by.get(p)]:
        c = interval([r["full"] - ref for r in by[p].values()])
        lines.append(f"| {LABELS[p]} - base | {c['n']} | {fmt(c)} | {c['sd']:.2f} | ± {1.96 * c['sd']:.2f} |")
    for a, b in (("learned-25", "random-25"), ("learned-25", "full-100"), ("random-25", "full-100")):
        if by.get(a) and by.get(b):
            c = paired(by[a], by[b])
            lines.append(f"| {LABELS[a]} - {LABELS[b]} | {c['n']} | {fmt(c)} | {c['sd']:.2f} | ± {1.96 * c['sd']:.2f} |")
    return lines


def plot(results: Path, runs: dict) -> str | None:
    """harm_contrasts.png: each world's paired contrasts, mean and 95% interval (a forest plot)."""
    from harness.report import _pyplot

    worlds = [w for w in WORLDS if runs.get(w)]
    if not worlds:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(worlds), figsize=(5.2 * len(worlds), 4.6), squeeze=False, sharex=True)
    for ax, w in zip(axes[0], worlds):
        rows = [(f"{LABELS[a]} - {LABELS[b]}", paired(runs[w][a], runs[w][b])) for a, b in CONTRASTS
                if runs[w].get(a) and runs[w].get(b)]  # fmt: skip
        for y, (name, c) in enumerate(reversed(rows)):
            ax.errorbar([c["mean"]], [y], xerr=[[c["mean"] - c["lo"]], [c["hi"] - c["mean"]]] if c["n"] > 1 else None,
                        fmt="o", color="tab:blue" if c["n"] > 1 and (c["lo"] > 0 or c["hi"] < 0) else "0.4", capsize=3)
        ax.set_yticks(range(len(rows)), [r[0] for r in reversed(rows)], fontsize=7)
        ax.axvline(0, color="0.5", lw=0.8)
        ax.set_title(DESIGNS[w], fontsize=9)
        ax.set_xlabel("full-image accuracy, points (mean, 95% interval)")
    fig.tight_layout()
    save_figure(fig, Path(results) / "harm_contrasts.png", 120)
    return "harm_contrasts.png"


def report(results: Path, cfg, timing: dict, command: str) -> str:
    runs = collect(results)
    bases = {w: json.loads((Path(results) / f"base_eval-{w}.json").read_text()) for w in WORLDS
             if (Path(results) / f"base_eval-{w}.json").exists()}  # fmt: skip
    recs = [r for by in runs.values() for p in by.values() for r in p.values()]
    problems = [q for r in recs for q in r["problems"] if r["spec"]["variant"] != "oracle-25"]
    commits = sorted({r["commit"] for r in recs})
    machines = sorted({r["machine"] for r in recs})
    lines = ["# Selection part 4: harmful feedback, an oracle, a coverage control (paired intervals)", "",
             f"- Command: `{command}`", f"- Code: {', '.join(commits) or '-'}", f"- Machines: {'; '.join(machines) or '-'}",
             f"- Runs recorded: {len(recs)}; wall time of the invocations: {timing.get('total_s', 0):.0f} s; "
             f"written {time.strftime('%Y-%m-%d %H:%M:%S')}",
             f"- Setting: s = 50%, {cfg.steps} steps of {cfg.prompts_per_step} prompts x {cfg.rollouts_per_prompt} "
             f"rollouts (K = {int(0.25 * cfg.prompts_per_step * cfg.rollouts_per_prompt)}), support k = {cfg.topk}, "
             f"lr {cfg.lr:g}, {cfg.n_eval} held-out items per world, greedy", "",
             "Ledger checks (K = floor(rho |C|), |S| <= K, teacher rows = |S|; Oracle-25 left out: it scores all of C to "
             "choose): " + ("all hold." if not problems else f"{len(problems)} problems: {problems[:5]}"), "",
             "## The base in each world", "", "| World | Full image | Small | Harmful | Large | Crop | Crop, harmful |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for w, b in bases.items():
        k = b["kinds"]
        lines.append(f"| {DESIGNS[w]} | {b['full']:.2f} | {k['full']['small']:.2f} | {k['full']['harmful']:.2f} | "
                     f"{k['full']['large']:.2f} | {b['crop']:.2f} | {k['crop']['harmful']:.2f} |")  # fmt: skip
    data = {"decisions": {}, "contrasts": {}}
    for w in [w for w in WORLDS if runs.get(w)]:
        d = decision(runs[w])
        data["decisions"][w] = d
        data["contrasts"][w] = {f"{a} - {b}": paired(runs[w][a], runs[w][b]) for a, b in CONTRASTS
                                if runs[w].get(a) and runs[w].get(b)}  # fmt: skip
        lines += ["", f"## {DESIGNS[w]}", "", *policy_table(runs[w]), "", *contrast_table(runs[w]), "",
                  f"Decision: selection **{'pays' if d['pays'] else 'does not pay'}** (Learned-25 - Random-25 "
                  f"{fmt(d['learned_random'])}); the paper's claim **{'reproduces' if d['reproduces'] else 'does not reproduce'}** "
                  f"(Learned-25 - Full {fmt(d['learned_full'])}, tokens {100 * d['tokens']['mean']:.1f}% of Full's); "
                  f"Oracle-25 - Random-25 {fmt(d['oracle_random'])}; at fault: {d['fault']}.", "",
                  "Eq. 7-9's factors over C (per row: the mean over its tokens; median [5%, 95%] over rows):", "",
                  *factor_table(runs[w])]  # fmt: skip
    if runs.get("h0-lr10"):
        lines += ["", f"## {DESIGNS['h0-lr10']}", "", *noise_lines(runs["h0-lr10"], bases.get("h0"))]
    png = plot(results, runs)
    lines += ["", f"![{png}]({png})"] if png else []
    return write_report(Path(results), "\n".join(lines) + "\n", {"timing": timing, "bases": bases, **data})
