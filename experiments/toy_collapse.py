"""Why a learned-selector run collapses in the first toy task: diagnosed runs, step by step.

    python experiments/toy_collapse.py --out runs/toy-collapse     # 15 diagnosed runs, about 25 minutes on 2 cores
    python experiments/toy_collapse.py --smoke                     # 2 steps per run (seconds)
    python experiments/toy_collapse.py --out runs/toy-collapse --report-only   # the report from the finished runs, no training

docs/TOY.md's 32 prompts x 2 rollouts runs (lr 1.5e-4, 120 steps) had one Learned-25 seed in three collapse:
its full-image accuracy fell to 58.8% and the crop view, which the EMA teacher reads, to 77.0%. This
script reruns that setting on the first task's world and base (`opd.toy.world`, `opd.toy.sft`, the
defaults of experiments/toy.py) with `harness.diagnose.Diagnosed`, which trains the same run while
recording, every step, each candidate's utility u_i, the teacher's and the student's answer
probabilities per prompt, S, and the labels the selector receives; every `probe_every` steps it
measures the teacher's crop-view and the student's full-image accuracy on the 160 audit records.

The runs: Learned-25, Entropy-25, Random-25 and Oracle-25 (S = the top 25% by the true u_i, what the
learned selector imitates, with no prediction error) over `--seeds`, and Learned-25 at `--low-lr`.
OUT/report.md answers: are the labels attached to the right rows (a defect check), does the
selection over-sample rows whose teacher is wrong, and does the collapse depend on the step size?
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

from harness.entry import Entry, sft_config, world_config  # noqa: E402
from harness.experiment import machine  # noqa: E402
from harness.report import save_figure, write_report  # noqa: E402

__all__ = ["CollapseConfig", "main"]


@dataclass
class CollapseConfig:
    preset: str = "default"
    """Starting values: 'default' (the reported investigation) or 'smoke' (2 steps per run; --smoke)."""
    out: str = "runs/toy-collapse"
    """Output folder: world/, base/, base_eval.json, runs/<name>/seed<k>/, report.md and the plots."""
    seeds: str = "0,1,2"
    """Training seeds (comma-separated): docs/TOY.md's 32 x 2 runs used 0, 1, 2 and seed 2 collapsed."""
    policies: str = "learned,entropy,random,oracle"
    """Selections at `lr`: learned, entropy, random, or oracle (top 25% by the true u_i, no exploration)."""
    lr: float = 1.5e-4
    """AdamW learning rate of the policy (docs/TOY.md's)."""
    low_lr: float = 7.5e-5
    """A second learning rate for Learned-25 on the same seeds (0: none)."""
    steps: int = 120
    """OPD steps per run (one epoch of the 960 records would be 30 at 32 prompts; docs/TOY.md ran 120)."""
    prompts_per_step: int = 32
    """Prompts per step (docs/TOY.md's diverse-candidate setting)."""
    rollouts_per_prompt: int = 2
    """Rollouts per prompt."""
    replay_start: int = 96
    """Labels in replay before the selector's first update."""
    replay_batch: int = 256
    """Replay minibatch."""
    probe_every: int = 10
    """Steps between accuracy probes of the teacher (crop view) and the student (full image)."""
    jobs: int = 2
    """Runs at once, each in its own process with one thread (1: in this process)."""
    n_opd: int = 960
    """Training records of the world (the first task's)."""
    n_audit: int = 160
    """Audit records (the probes' held set)."""
    n_eval: int = 400
    """Held-out benchmark items."""
    sft_steps: int = 150
    """Supervised steps of the base model (the first task's)."""
    sft_batch: int = 16
    """Supervised batch of the base model."""
    eval_batch: int = 100
    """eval.py --batch-size."""
    report_only: bool = False
    """Train nothing: write OUT/report.md from the runs already finished in OUT (the others are listed as not run)."""


SMOKE = dict(seeds="0", low_lr=7.5e-5, steps=2, prompts_per_step=4, replay_start=4, replay_batch=8, probe_every=1, jobs=1,
             n_opd=16, n_audit=8, n_eval=16, sft_steps=4, sft_batch=4, eval_batch=16, out="runs/toy-collapse-smoke")
PRESETS = {"default": {}, "smoke": SMOKE}
LABELS = {"learned": "Learned-25", "entropy": "Entropy-25", "random": "Random-25", "oracle": "Oracle-25"}


def specs(cfg: CollapseConfig) -> list[dict]:
    seeds = [int(s) for s in cfg.seeds.split(",") if s.strip()]
    out = [{"policy": p, "lr": cfg.lr, "seed": s, "name": f"{p}-25"} for p in cfg.policies.split(",") for s in seeds]
    if cfg.low_lr:
        out += [{"policy": "learned", "lr": cfg.low_lr, "seed": s, "name": "learned-25-low-lr"} for s in seeds]
    return out


def job(cfg: CollapseConfig, spec: dict, root: Path) -> dict:
    world = root / "world"
    train = dict(
        model=str(root / "base"), data=str(world / "train.jsonl"), policy="random" if spec["policy"] == "oracle" else spec["policy"],
        rho=0.25, steps=cfg.steps, prompts_per_step=cfg.prompts_per_step, rollouts_per_prompt=cfg.rollouts_per_prompt,
        max_prompt_len=512, max_response_len=4, lr=spec["lr"], micro_batch=64, seed=spec["seed"], selector_seed=spec["seed"],
        replay_start=cfg.replay_start, replay_batch=cfg.replay_batch, save_every=0, keep_checkpoints=1,
    )  # fmt: skip
    return {"spec": spec, "folder": str(root / "runs" / spec["name"] / f"seed{spec['seed']}"), "train": train,
            "oracle": spec["policy"] == "oracle", "probe_every": cfg.probe_every, "audit_data": str(world / "audit.jsonl"),
            "eval": {"bench": str(world / "bench"), "batch": cfg.eval_batch, "max_new_tokens": 4}}


# ----------------------------------------------------------------------------- analysis


ROW_TYPES = ("confidently wrong", "unsure wrong", "right")
"""How the student's sampled answer relates to the truth: wrong with p(sampled letter) > 0.5 among the four
letters (full image), wrong otherwise (a non-letter sample counts as wrong), or right."""


def teacher_wrong(diag: dict) -> np.ndarray:
    """(N,) bool per candidate row: the teacher's most likely letter (crop view) is not the answer."""
    argmax = np.asarray(diag["teacher_p"]).argmax(-1)
    wrong = argmax != np.asarray(diag["gold"])
    return wrong[np.asarray(diag["prompt"])]


def row_types(diag: dict) -> np.ndarray:
    """(N,) index into ROW_TYPES per row."""
    gold, prompt = np.asarray(diag["gold"]), np.asarray(diag["prompt"])
    sampled, p = np.asarray(diag["sampled"]), np.asarray(diag["student_p"])
    p = p / p.sum(-1, keepdims=True)
    p_sampled = np.where(sampled >= 0, p[prompt, np.clip(sampled, 0, 3)], 0.0)
    wrong = sampled != gold[prompt]
    return np.where(~wrong, 2, np.where(p_sampled > 0.5, 0, 1))


def prior_drift(diags: list[dict], letter: int, block: int = 10) -> dict:
    """The over-predicted letter's story: among C and S, the share of rows that sample `letter` wrongly
    (corrections that lower it) and rightly (confirmations); per `block` steps, the share of prompts the
    student answers with `letter` (full image, most likely letter) and the teacher's crop-view accuracy on
    the prompts whose answer is `letter`."""
    wrong_c, wrong_s, right_c, right_s, rate, teacher = [], [], [], [], [], []
    for d in diags:
        gold, prompt, sampled = np.asarray(d["gold"]), np.asarray(d["prompt"]), np.asarray(d["sampled"])
        sel = np.asarray(d["selected"], dtype=int)
        says = sampled == letter
        wrong, right = says & (gold[prompt] != letter), says & (gold[prompt] == letter)
        wrong_c.append(wrong.mean())
        right_c.append(right.mean())
        wrong_s.append(wrong[sel].mean() if sel.size else 0.0)
        right_s.append(right[sel].mean() if sel.size else 0.0)
        rate.append(float((np.asarray(d["student_p"]).argmax(-1) == letter).mean()))
        own = gold == letter
        teacher.append(float((np.asarray(d["teacher_p"])[own].argmax(-1) == letter).mean()) if own.any() else float("nan"))
    blocks = lambda v: [float(np.nanmean(v[i:i + block])) for i in range(0, len(v), block)]  # noqa: E731
    return {"wrong_c": float(np.mean(wrong_c)), "wrong_s": float(np.mean(wrong_s)), "right_c": float(np.mean(right_c)),
            "right_s": float(np.mean(right_s)), "rate": blocks(rate), "teacher": blocks(teacher)}


def analyse(folder: Path, rollouts: int, explore: float = 0.10, letter: int = 0) -> dict:
    """One run's diagnostics: the label and selection checks, coverage, selector quality, the probes, and by
    row type (ROW_TYPES) the share in C, S and the oracle's top 25%, P(selected), mean u_i and the learned
    ranking's mean rank percentile (0 = ranked first)."""
    from harness.report import spearman

    diags = [json.loads(x) for x in (folder / "diag.jsonl").read_text().splitlines() if x.strip()]
    probes = [json.loads(x) for x in (folder / "probes.jsonl").read_text().splitlines() if x.strip()]
    cover, quality, exact, in_c, in_s = [], [], [], [], []
    by = {k: {"c": 0, "s": 0, "top": 0, "u": [], "rank": []} for k in range(len(ROW_TYPES))}
    for d in diags:
        u = np.asarray(d["u_all"], dtype=float)
        cand = np.flatnonzero(~np.isnan(u))
        sel = np.asarray(d["selected"], dtype=int)
        top = cand[np.argsort(-u[cand], kind="stable")[: d["budget"]]]
        cover.append(len({int(i) // rollouts for i in sel}))
        rank = None
        if d["predicted"] is not None:  # Algorithm 1, line 9: the top K - K_e by u^ are all in S
            predicted = np.asarray(d["predicted"])
            quality.append(spearman(predicted[cand], u[cand]))
            exploit = d["budget"] - math.ceil(explore * d["budget"] - 1e-9)
            order = cand[np.argsort(-predicted[cand], kind="stable")]
            exact.append(set(order[:exploit].tolist()) <= set(sel.tolist()))
            rank = np.empty(len(u))
            rank[order] = np.arange(len(order)) / max(1, len(order) - 1)
        kinds = row_types(d)
        for k in by:
            rows = cand[kinds[cand] == k]
            by[k]["c"] += len(rows)
            by[k]["s"] += int(np.isin(sel, rows).sum())
            by[k]["top"] += int(np.isin(top, rows).sum())
            by[k]["u"] += u[rows].tolist()
            if rank is not None:
                by[k]["rank"] += rank[rows].tolist()
        wrong = teacher_wrong(d)
        in_c.append(wrong[cand].mean())
        in_s.append(wrong[sel].mean() if sel.size else 0.0)
    n_c = sum(b["c"] for b in by.values())
    n_s = sum(b["s"] for b in by.values())
    n_top = sum(b["top"] for b in by.values())
    types = [{"type": ROW_TYPES[k], "share_c": b["c"] / max(1, n_c), "share_s": b["s"] / max(1, n_s),
              "share_top": b["top"] / max(1, n_top), "p_selected": b["s"] / max(1, b["c"]),
              "u": float(np.mean(b["u"])) if b["u"] else float("nan"),
              "rank": float(np.mean(b["rank"])) if b["rank"] else float("nan")} for k, b in by.items()]
    crop = [p["teacher_crop"] for p in probes]
    return {
        "label_error": max((d["label_error"] for d in diags), default=0.0),
        "selection_exact": f"{sum(exact)}/{len(exact)}" if exact else "-",
        "coverage": float(np.mean(cover)) if cover else float("nan"),
        "quality": float(np.nanmean(quality)) if quality else float("nan"),
        "teacher_wrong_c": float(np.mean(in_c)) if in_c else 0.0,
        "teacher_wrong_s": float(np.mean(in_s)) if in_s else 0.0,
        "types": types,
        "prior": prior_drift(diags, letter),
        "teacher_crop_min": min(crop) if crop else float("nan"),
        "teacher_crop_min_step": probes[int(np.argmin(crop))]["step"] if crop else -1,
        "probes": probes,
    }


def over_predicted(base_eval: Path) -> int:
    """Index (0-3) of the letter the base answers most often on the full image (eval.py's predictions)."""
    from opd.toy.world import OPTIONS

    preds = [json.loads(x)["pred"] for x in (base_eval / "zoombench" / "predictions.jsonl").read_text().splitlines() if x.strip()]
    counts = [preds.count(k) for k in OPTIONS]
    return int(np.argmax(counts))


def run_label(r: dict) -> str:
    return LABELS[r["policy"]] + (" (low lr)" if r["name"].endswith("low-lr") else "")


def report(root: Path, cfg: CollapseConfig, timing: dict, command: str) -> str:
    base = json.loads((root / "base_eval.json").read_text())
    letter = over_predicted(root / "base_eval")
    rows, missing = [], []
    for spec in specs(cfg):
        folder = root / "runs" / spec["name"] / f"seed{spec['seed']}"
        if (folder / "done.json").exists():
            rows.append({**json.loads((folder / "done.json").read_text()),
                         **analyse(folder, cfg.rollouts_per_prompt, letter=letter)})
        else:
            missing.append(f"{spec['name']} seed {spec['seed']}")
    train_s = sum(r.get("train_s", 0.0) for r in rows)
    lines = [
        "# Why a learned-selector run collapses: diagnosed runs of the first toy task (CPU)", "",
        f"- Command: `{command}`",
        f"- Machine: {machine()}; {cfg.jobs} run(s) at a time, one thread each",
        f"- Wall time: {timing.get('total_s', 0):.0f} s in all, {timing.get('invocations', 0)} invocation(s) recorded"
        + f"; CPU time {timing.get('cpu_s', 0):.0f} s (OUT/timing.json: the invocations that ran to their end)",
        f"- Training wall time of the {len(rows)} finished runs, summed from their done.json: {train_s:.0f} s "
        f"(eval.py not included; {cfg.jobs} at a time that is about {train_s / max(1, cfg.jobs):.0f} s of wall time on this machine, "
        "with whatever else it was running)",
        "- Not run (no done.json): " + (", ".join(missing) if missing else "none"),
        f"- Finished: {time.strftime('%Y-%m-%d %H:%M:%S')}",
        f"- Setting: the first task's world and base (full image {base['full']:.1f}%, crop {base['crop']:.1f}%); {cfg.steps} "
        f"OPD steps of {cfg.prompts_per_step} prompts x {cfg.rollouts_per_prompt} rollouts, rho 0.25; probes every "
        f"{cfg.probe_every} steps on {cfg.n_audit} audit records", "",
        "## Runs and checks", "",
        "Full and crop: eval.py after training (greedy, held-out benchmark). Teacher crop (probe): the EMA teacher's "
        "accuracy on the audit records' crops (argmax over the option letters), lowest over training and its step. "
        "Label error: the largest |label the selector received - u_i precomputed for the same row|, relative to the "
        "step's largest label (0 up to float error means the labels reach the rows they belong to). Top K - K_e in S: "
        "steps whose S holds the top K - K_e candidates by the selector's u^ (Algorithm 1, line 9), of the steps with "
        "a trained selector. Coverage: distinct prompts in S per step "
        f"(of {cfg.prompts_per_step}). Selector: mean Spearman correlation of u^ with the true u_i over C per step. "
        "Teacher wrong: share of rows whose prompt the teacher's crop view gets wrong, in C and in S.", "",
        "| Run | Seed | lr | Full | Crop | Teacher crop (probe), lowest | Label error | Top K - K_e in S | Coverage | "
        "Selector | Teacher wrong: C / S |",
        "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {run_label(r)} | {r['seed']} | {r['lr']:g} | {r['full']:.1f} | {r['crop']:.1f} | {r['teacher_crop_min']:.1f}% "
            f"(step {r['teacher_crop_min_step']}) | {r['label_error']:.1e} | {r['selection_exact']} | {r['coverage']:.1f} | "
            + (f"{r['quality']:+.2f}" if np.isfinite(r["quality"]) else "-")
            + f" | {100 * r['teacher_wrong_c']:.1f}% / {100 * r['teacher_wrong_s']:.1f}% |")
    lines += [
        "", "## Which rollouts each selection takes", "",
        "Every candidate of every step, by how the student's sampled answer relates to the truth: confidently wrong "
        "(wrong, with probability > 0.5 among the four letters on the full image), unsure wrong, or right. Share of "
        "each type among the candidates C, the selected S and the oracle's top 25% by u_i; the chance a row of the type "
        "is selected; its mean utility u_i; and, for the learned selector, its mean rank percentile by u^ "
        "(0 = ranked first, 0.5 = no preference).", "",
        "| Run | Seed | Row type | Share of C | Share of S | Share of oracle top 25% | P(selected) | Mean u_i | Learned rank |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        for t in r["types"]:
            lines.append(f"| {run_label(r)} | {r['seed']} | {t['type']} | {100 * t['share_c']:.1f}% | {100 * t['share_s']:.1f}% | "
                         f"{100 * t['share_top']:.1f}% | {t['p_selected']:.2f} | {t['u']:.2e} | "
                         + (f"{t['rank']:.2f}" if np.isfinite(t["rank"]) else "-") + " |")
    name = "ABCD"[letter]
    preds = [json.loads(x)["pred"] for x in (root / "base_eval" / "zoombench" / "predictions.jsonl").read_text().splitlines() if x.strip()]
    lines += [
        "", f"## The over-predicted answer ({name})", "",
        f"The base answers {name} on {preds.count(name)} of {len(preds)} full images (eval.py, greedy). Corrections: rows whose "
        f"sampled answer is {name} but the truth is not (the teacher pushes {name} down); confirmations: rows that sample {name} "
        f"rightly. Student's {name} rate: the share of the step's prompts whose most likely letter on the full image is "
        f"{name}, per 10 steps. Teacher on {name}: the EMA teacher's crop-view accuracy on the step's prompts whose answer "
        f"is {name}, per 10 steps.", "",
        f"| Run | Seed | Corrections: C / S | Confirmations: C / S | Student's {name} rate per 10 steps | Teacher on {name} per 10 steps |",
        "| --- | ---: | --- | --- | --- | --- |",
    ]
    for r in rows:
        pr = r["prior"]
        lines.append(f"| {run_label(r)} | {r['seed']} | {100 * pr['wrong_c']:.1f}% / {100 * pr['wrong_s']:.1f}% | "
                     f"{100 * pr['right_c']:.1f}% / {100 * pr['right_s']:.1f}% | "
                     + " ".join(f"{100 * v:.0f}" for v in pr["rate"]) + " | " + " ".join(f"{100 * v:.0f}" for v in pr["teacher"]) + " |")
    png = probe_plot(root, rows)
    lines += ["", "## Plots", "", f"![{png}]({png})"] if png else []
    return write_report(root, "\n".join(lines) + "\n", {"base": base, "timing": timing, "runs": rows})


def probe_plot(root: Path, rows: list[dict]) -> str | None:
    from harness.report import _pyplot

    if not rows:
        return None
    plt = _pyplot()
    colours = {"learned": "tab:blue", "entropy": "tab:green", "random": "tab:gray", "oracle": "tab:red"}
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for r in rows:
        steps = [p["step"] for p in r["probes"]]
        style = ":" if r["name"].endswith("low-lr") else "-"
        kw = dict(color=colours[r["policy"]], ls=style, lw=1.2, alpha=0.85)
        a1.plot(steps, [p["teacher_crop"] for p in r["probes"]], **kw)
        a2.plot(steps, [p["student_full"] for p in r["probes"]], **kw,
                label=f"{run_label(r)} s{r['seed']}")
    a1.set_xlabel("training step")
    a1.set_ylabel("teacher accuracy, crop view (%)")
    a1.set_title("(a) the EMA teacher's crop view", fontsize=9)
    a2.set_xlabel("training step")
    a2.set_ylabel("student accuracy, full image (%)")
    a2.set_title("(b) the student's full image", fontsize=9)
    a2.legend(fontsize=5, ncol=2)
    fig.tight_layout()
    save_figure(fig, root / "fig_collapse.png", dpi=130)
    return "fig_collapse.png"


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> str:
    entry = Entry.start(CollapseConfig, PRESETS, argv, __doc__, "python experiments/toy_collapse.py")
    cfg, root = entry.cfg, entry.root
    if cfg.report_only:
        return entry.report_only(report)
    from harness.diagnose import diagnose_one

    entry.world(world_config(cfg), announce=False, phase="setup_s")
    entry.base(world_config(cfg), sft_config(cfg), phase="setup_s")
    entry.base_eval(cfg.eval_batch, 4, announce=False, phase="setup_s")
    entry.runs([job(cfg, s, root) for s in specs(cfg)], cfg.jobs, diagnose_one, noun="diagnosed runs")
    return entry.finish(report, seconds=False)


if __name__ == "__main__":
    from opd.cli import run_cli

    run_cli(main, sys.argv[1:], "toy_collapse.py")
