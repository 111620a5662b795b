"""BAS-OPD on the toy world with explained answers (5-60 tokens): Tables 3, 4, 7, 8 and Figures 2-5, measured.

    python experiments/toy_explain.py --out runs/toy-explain     # 5 seeds, 50 runs: about 57 minutes on 2 idle cores
    python experiments/toy_explain.py --smoke                    # one seed, 2 steps per run (the test)

The second toy task (docs/TOY_EXPLAIN.md). The world, its questions, training JSONL and benchmark are the
first task's (`opd.toy.world`, docs/TOY.md); only the responses differ: a short explanation, then the
answer (`harness.explain`: from the colour with the letter on the next line to "Blue. I see a small blue square
here. Answer: C").

1. The world (`export_world`) and the base (`opd.toy.sft.train_base(task=EXPLAIN)`): a tiny Qwen3.5 taught
   the explained answers on crops only; eval.py (its answer parser reads the final answer) measures the
   full-image and crop views, and OUT/base_samples.json holds 8 sampled rollouts of a few prompts.
2. OPD runs through `opd.run.Run`: Full, Random-25, Entropy-25, Learned-10/25/50 (Table 3), and Learned-25
   without overlap, confidence, ranking loss or exploration (Table 4, train.py's --no-* switches), each
   over `--seeds` seeds, each scored by eval.py in both views. Every run writes trace.jsonl: per step the
   candidates, S, every rollout's length and entropy, and the utility labels of S (`harness.experiment.Trace`).
   Learned-25 runs get the Figure 3 audit (`harness.audit`) and seed 0 the Figure 4 geometry.
3. OUT/report.md and the plots, from the files on disk: beside the paper's tables, which lengths each
   policy picks and what they carry (utility by length), prompt coverage of S, and the crop view after
   training (the teacher's pathway) per run.

Resumable: the world, the base, its evaluation and every finished run (done.json) are reused; an
unfinished run's folder is deleted and trained again.
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

from harness.entry import Entry, sft_config, world_config  # noqa: E402
from harness.experiment import (  # noqa: E402
    ABLATIONS,
    check_ledger,
    collect,
    label,
    machine,
    order,
    run_folder,
    split_name,
)
from harness.report import (  # noqa: E402
    audit_section,
    gap_section,
    geometry_section,
    ledger_line,
    mean_std,
    plots,
    save_figure,
    spearman,
    table3,
    table7,
    table8,
    world_figure,
    write_report,
)
from opd.loop.ledger import write_atomic  # noqa: E402

__all__ = ["ExplainConfig", "check_ledger", "main"]


@dataclass
class ExplainConfig:
    preset: str = "default"
    """Starting values: 'default' (the reported experiment) or 'smoke' (one seed, a few steps; --smoke)."""
    out: str = "runs/toy-explain"
    """Output folder: world/, base/, base_eval/, runs/<name>/seed<k>/, report.md and the plots."""
    seeds: int = 5
    """Training seeds 0..seeds-1 (data order, rollout sampling and selector seed of every run)."""
    steps: int = 80
    """OPD steps per run (120 = one epoch of the 960 training records at 8 prompts per step; 80 for time: the 50 runs
    took 6,374 CPU seconds, about 57 minutes on 2 idle cores with the base, docs/TOY_EXPLAIN.md)."""
    prompts_per_step: int = 8
    """Prompts per OPD step (the paper: 28)."""
    rollouts_per_prompt: int = 8
    """Rollouts per prompt (the paper's 8); candidates per step = prompts x rollouts."""
    max_response_len: int = 64
    """Most sampled tokens per rollout (the longest style is 54 tokens with <|im_end|>)."""
    lr: float = 1.5e-4
    """AdamW learning rate of the policy in OPD (the first toy task's; the paper's 2e-6 does not move a tiny model)."""
    budgets: str = "10,25,50"
    """Query ratios (percent) of the Learned budget sweep besides 100 (= Full querying, reused)."""
    ablations: str = "no-overlap,no-confidence,no-rank-loss,no-exploration"
    """Table 4: Learned-25 variants, each one of train.py's --no-* switches ('' for none)."""
    replay_start: int = 96
    """Labels in replay before the selector's first update (the paper's 96)."""
    replay_batch: int = 256
    """Replay minibatch (the paper's 256)."""
    jobs: int = 2
    """Runs trained at once, each in its own process with one thread (1: in this process)."""
    world_seed: int = 0
    """Seed of the toy world (0: the first task's images and questions)."""
    n_opd: int = 960
    """Training records of the world."""
    n_audit: int = 160
    """Held records for the Figure 3/4 audits."""
    n_eval: int = 400
    """Held-out benchmark items."""
    sft_steps: int = 300
    """Supervised steps of the base model (crops only, a style drawn per sample; lr 1e-3 as the first task's)."""
    sft_batch: int = 32
    """Supervised batch of the base model (twice the first task's: the explanations need more samples)."""
    eval_batch: int = 100
    """eval.py --batch-size."""
    eval_tokens: int = 64
    """eval.py --max-new-tokens (greedy)."""
    audit_batches: int = 10
    """Held batches of the Figure 3 audit (prompts_per_step prompts each) per Learned-25 run."""
    audit_seeds: int = 5
    """Learned-25 runs (first seeds) that get the Figure 3 audit."""
    grad_checkpoints: int = 4
    """Figure 4: points in the first seed's Learned-25 run (evenly spaced, the last at the end)."""
    grad_batches: int = 5
    """Figure 4: held batches (selected/unselected gradient pairs) per checkpoint."""
    sample_prompts: int = 16
    """Audit prompts whose rollouts_per_prompt base-model rollouts the report counts by style (OUT/base_samples.json)."""


SMOKE = dict(
    seeds=1, steps=2, prompts_per_step=2, rollouts_per_prompt=4, budgets="25,50", replay_start=4, replay_batch=16,
    jobs=1, n_opd=16, n_audit=8, n_eval=16, sft_steps=4, sft_batch=4, eval_batch=16, max_response_len=16, eval_tokens=16,
    audit_batches=2, audit_seeds=1, grad_checkpoints=2, grad_batches=1, sample_prompts=1, out="runs/toy-explain-smoke",
)  # fmt: skip
PRESETS = {"default": {}, "smoke": SMOKE}
CROP_DROP = 10.0
"""Points of crop-view accuracy below the base's after which a run's teacher pathway counts as degraded."""


# ----------------------------------------------------------------------------- the plan


def run_specs(cfg: ExplainConfig) -> list[dict]:
    """Every OPD run: Table 3's policies and Table 4's Learned-25 variants per seed, the costliest first."""
    budgets = sorted({int(b) for b in cfg.budgets.split(",") if b.strip()} | {25})
    kinds = [("full", 100, ""), ("random", 25, ""), ("entropy", 25, "")] + [("learned", b, "") for b in budgets if b != 100]
    kinds += [("learned", 25, a.strip()) for a in cfg.ablations.split(",") if a.strip()]
    specs = []
    for seed in range(cfg.seeds):
        for policy, pct, ablation in kinds:
            if ablation and ablation not in ABLATIONS:
                raise SystemExit(f"--ablations: unknown variant {ablation!r}; known: {', '.join(ABLATIONS)}")
            spec = {"policy": policy, "pct": pct, "seed": seed, "name": f"{policy}-{pct}" + (f"-{ablation}" if ablation else "")}
            specs.append({**spec, "ablation": ablation} if ablation else spec)
    return sorted(specs, key=lambda s: (-s["pct"], s["seed"]))


def job(cfg: ExplainConfig, spec: dict, root: Path) -> dict:
    """One run for `harness.experiment.train_one` (traced; Learned-25 audited, seed 0's geometry)."""
    world = root / "world"
    learned25 = spec["name"] == "learned-25"
    geometry = []
    if learned25 and spec["seed"] == 0 and cfg.grad_checkpoints:
        geometry = sorted({round(cfg.steps * (j + 1) / cfg.grad_checkpoints) for j in range(cfg.grad_checkpoints)})
    ablation = spec.get("ablation", "")
    train = dict(
        model=str(root / "base"), data=str(world / "train.jsonl"), policy=spec["policy"], rho=spec["pct"] / 100,
        steps=cfg.steps, prompts_per_step=cfg.prompts_per_step, rollouts_per_prompt=cfg.rollouts_per_prompt,
        max_prompt_len=512, max_response_len=cfg.max_response_len, lr=cfg.lr, micro_batch=64,
        seed=spec["seed"], selector_seed=spec["seed"], replay_start=cfg.replay_start, replay_batch=cfg.replay_batch,
        save_every=0, keep_checkpoints=1,
    )  # fmt: skip
    if ablation:
        train[ablation.replace("-", "_")] = True
    return {
        "spec": spec, "folder": str(run_folder(root, spec)), "train": train, "trace": True,
        "audit_data": str(world / "audit.jsonl"), "audit_batches": cfg.audit_batches if learned25 and spec["seed"] < cfg.audit_seeds else 0,
        "geometry_steps": geometry, "grad_batches": cfg.grad_batches,
        "eval": {"bench": str(world / "bench"), "batch": cfg.eval_batch, "max_new_tokens": cfg.eval_tokens},
    }  # fmt: skip


def base_samples(root: Path, cfg: ExplainConfig) -> list[dict]:
    """8 (rollouts_per_prompt) sampled responses of the base to each of the first `sample_prompts` audit
    prompts, full image, as training samples them (seeded); written to OUT/base_samples.json."""
    import torch

    from opd.models.chat import encode_prompt
    from opd.data.sources import load_records
    from opd.models.loading import load_model, load_processor, special_ids
    from opd.engine.rollout import generate_rollouts
    from harness.explain import style_of
    from opd.data.records import get_view

    path = root / "base_samples.json"
    if path.exists():
        return json.loads(path.read_text())
    processor, model = load_processor(str(root / "base")), load_model(str(root / "base"))
    records = load_records(root / "world" / "audit.jsonl")[: cfg.sample_prompts]
    prompts = [encode_prompt(processor, *get_view("full")(r, 0)) for r in records]
    torch.manual_seed(0)
    ro = generate_rollouts(model, prompts, cfg.rollouts_per_prompt, cfg.max_response_len)
    eos = special_ids(model)["eos"]
    out = []
    for i in range(len(ro)):
        ids = ro.response_ids[i][ro.response_mask[i]].tolist()
        text = processor.tokenizer.decode([t for t in ids if t not in eos])
        out.append({"prompt": int(ro.prompt_index[i]), "answer": records[int(ro.prompt_index[i])].answer, "text": text,
                    "tokens": int(ro.lengths[i]), "style": style_of(text)})
    write_atomic(path, json.dumps(out, indent=1) + "\n")
    return out


# ----------------------------------------------------------------------------- analyses of the traces


def coverage(trace: list[dict], rollouts: int) -> float:
    """Mean number of distinct prompts among S per step (row i belongs to prompt i // rollouts)."""
    return float(np.mean([len({i // rollouts for i in t["selected"]}) for t in trace])) if trace else float("nan")


def lengths(trace: list[dict]) -> tuple[float, float]:
    """(mean T_i of the candidates, mean T_i of S) over all steps."""
    cand = [t["length"][i] for t in trace for i in t["candidates"]]
    sel = [t["length"][i] for t in trace for i in t["selected"]]
    return (float(np.mean(cand)) if cand else float("nan"), float(np.mean(sel)) if sel else float("nan"))


LENGTH_BANDS = ((1, 12), (13, 25), (26, 45), (46, 10_000))
"""Response-length bands of the utility-by-length table (tokens, <|im_end|> included)."""


def utility_by_length(traces: list[list[dict]], steps: slice) -> list[tuple[int, float]]:
    """Full querying's labels: (rows, mean u_i) per LENGTH_BANDS band over the given steps of every trace."""
    out = []
    for lo, hi in LENGTH_BANDS:
        u = [t["utility"][k] for tr in traces for t in tr[steps] for k, i in enumerate(t["selected"]) if lo <= t["length"][i] <= hi]
        out.append((len(u), float(np.mean(u)) if u else float("nan")))
    return out


# ----------------------------------------------------------------------------- report


def _cell(text: str) -> str:
    """A response as one Markdown table cell (pipes escaped, line breaks shown as the escape)."""
    return "`" + text.replace("`", "'").replace("|", "\\|").replace("\n", "\\n") + "`"


def responses_section(samples: list[dict], base_eval: Path, runs: dict, rollouts: int) -> list[str]:
    from harness.explain import STYLES, response_lengths, style_of

    greedy = [json.loads(x) for x in (base_eval / "zoombench" / "predictions.jsonl").read_text().splitlines() if x.strip()]
    prompts = len({s["prompt"] for s in samples})
    lines = ["## The responses", "",
             "Every response is one of these styles, always ending in an answer eval.py's parser reads. Tokens are "
             "characters (the tiny tokenizer) plus <|im_end|>. The share columns are the base model's: of its greedy "
             f"full-image replies to the {len(greedy)} benchmark items, and of {len(samples)} rollouts it samples for "
             f"{prompts} audit prompts (full image, temperature 1, as in training; OUT/base_samples.json).",
             "", "| Style | Template | Tokens | Greedy replies (base) | Sampled rollouts (base) |", "| --- | --- | ---: | ---: | ---: |"]
    greedy_styles = [style_of(g["reply"]) for g in greedy]
    sampled_styles = [s["style"] for s in samples]
    spans = response_lengths()
    for style, template in [*STYLES.items(), (None, "(none of the above)")]:
        lo, hi = spans.get(style, ("", ""))
        g = 100 * greedy_styles.count(style) / max(1, len(greedy_styles))
        s = 100 * sampled_styles.count(style) / max(1, len(sampled_styles))
        tokens = "" if style is None else f"{lo}" if lo == hi else f"{lo}-{hi}"
        lines.append(f"| {style or 'other'} | {_cell(template)} | {tokens} | {g:.1f}% | {s:.1f}% |")
    first = [r["trace"][0] for r in runs.get("full-100", []) if r.get("trace")]
    step0 = [t["length"][i] for t in first for i in t["candidates"]]
    if step0:
        per_prompt = [np.std([t["length"][i] for i in t["candidates"] if i // rollouts == p])
                      for t in first for p in sorted({i // rollouts for i in t["candidates"]})]
        lines += ["", f"Rollouts at the first OPD step (Full querying, every seed): {len(step0)} rows, length "
                  f"{np.mean(step0):.1f} ± {np.std(step0, ddof=1):.1f} tokens (min {min(step0)}, max {max(step0)}); the "
                  f"{rollouts} rollouts of one prompt have a length standard deviation of {np.mean(per_prompt):.1f} tokens on average."]
    if samples:
        one = [s for s in samples if s["prompt"] == samples[0]["prompt"]]
        lines += ["", f"The base's {len(one)} rollouts of one audit prompt (full image; the answer is {one[0]['answer']}):", "",
                  "| # | Tokens | Style | Response |", "| ---: | ---: | --- | --- |"]
        lines += [f"| {j} | {s['tokens']} | {s['style'] or 'other'} | {_cell(s['text'])} |" for j, s in enumerate(one)]
    return lines


def table4(runs: dict) -> list[str]:
    names = [n for n in order(runs) if n == "learned-25" or split_name(n)[2]]
    if len(names) < 2:
        return []
    ref = {r["seed"]: r["full"] for r in runs["learned-25"]}
    full_tok = {r["seed"]: r["ledger"]["scored_tokens"] for r in runs.get("full-100", [])}
    lines = ["## Table 4 analogue: selector ablations (Learned-25)", "",
             "Each variant switches off one component with train.py's --no-* flag, same seeds. Full-image accuracy "
             "(mean ± std over seeds), paired difference from the full learned selector, the crop view after training "
             "and the token ratio vs Full querying.", "",
             "| Selector variant | Full-image accuracy | Per seed | vs Learned-25 (paired) | Crop view | Token ratio |",
             "| --- | ---: | --- | ---: | ---: | ---: |"]
    for n in names:
        rs = sorted(runs[n], key=lambda r: r["seed"])
        d = [r["full"] - ref[r["seed"]] for r in rs if r["seed"] in ref]
        t = [100 * r["ledger"]["scored_tokens"] / full_tok[r["seed"]] for r in rs if full_tok.get(r["seed"])]
        lines.append(f"| {'Full learned selector' if n == 'learned-25' else label(n)} | {mean_std([r['full'] for r in rs])} | "
                     + ", ".join(f"{r['full']:.1f}" for r in rs) + f" | {'-' if n == 'learned-25' else mean_std(d)} | "
                     f"{mean_std([r['crop'] for r in rs])} | {np.mean(t) if t else float('nan'):.2f} |")
    return lines


def selection_section(runs: dict, names: list[str], cfg: ExplainConfig, base: dict) -> list[str]:
    """Lengths picked, prompt coverage and the crop view per policy; utility by length under Full querying."""
    lines = ["## What each policy selects: lengths, prompts, and the teacher's crop view", "",
             "From every run's trace.jsonl (all steps, all seeds). Mean T_i is the response length in tokens; prompts "
             f"covered is the number of distinct prompts among S per step (of {cfg.prompts_per_step}); the crop view is "
             f"eval.py's crop-view accuracy after training (the teacher's pathway: the base has {base['crop']:.1f}%), and "
             f"a run counts as degraded when it falls more than {CROP_DROP:g} points below the base's.", "",
             "| Policy | Mean T_i, candidates | Mean T_i, S | S / candidates | Prompts covered per step | Crop view | Degraded runs |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for n in names:
        rs = [r for r in runs[n] if r.get("trace")]
        if not rs:
            continue
        lc = [lengths(r["trace"]) for r in rs]
        cand, sel = np.mean([x[0] for x in lc]), np.mean([x[1] for x in lc])
        cov = np.mean([coverage(r["trace"], cfg.rollouts_per_prompt) for r in rs])
        degraded = [r["seed"] for r in runs[n] if r["crop"] < base["crop"] - CROP_DROP]
        lines.append(f"| {label(n)} | {cand:.1f} | {sel:.1f} | {sel / cand:.3f} | {cov:.2f} | "
                     f"{mean_std([r['crop'] for r in runs[n]])} | {len(degraded)} of {len(runs[n])}"
                     + (f" (seed {', '.join(map(str, degraded))})" if degraded else "") + " |")
    traces = [r["trace"] for r in runs.get("full-100", []) if r.get("trace")]
    if traces:
        steps = len(traces[0])
        early, late = utility_by_length(traces, slice(0, max(1, steps // 4))), utility_by_length(traces, slice(3 * steps // 4, steps))
        rho = [spearman([t["length"][i] for i in t["selected"]], t["utility"]) for tr in traces for t in tr]
        lines += ["", "Utility label u_i (Eq. 9) by response length under Full querying (every candidate is labelled), "
                  f"first and last quarter of the steps; Spearman correlation of u_i with T_i within a step: "
                  f"{np.nanmean(rho):+.2f} (mean over {len(rho)} steps).", "",
                  "| T_i (tokens) | Rows, first quarter | Mean u_i, first quarter | Rows, last quarter | Mean u_i, last quarter |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for (lo, hi), (n1, u1), (n2, u2) in zip(LENGTH_BANDS, early, late):
            lines.append(f"| {lo}-{hi} | {n1:,} | {u1:.2e} | {n2:,} | {u2:.2e} |" if hi < 10_000 else
                         f"| {lo} or more | {n1:,} | {u1:.2e} | {n2:,} | {u2:.2e} |")
    return lines


def selection_plot(root: Path, runs: dict, names: list[str], cfg: ExplainConfig) -> str | None:
    """OUT/fig6_selection.png: per step, mean T_i of S over that of the candidates, and prompts covered."""
    from harness.report import _pyplot

    plt = _pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9.5, 3.6))
    drew = False
    for n in names:
        traces = [r["trace"] for r in runs[n] if r.get("trace")]
        if not traces or n == "full-100":
            continue
        steps = min(len(t) for t in traces)
        ratio = [np.mean([np.mean([t[s]["length"][i] for i in t[s]["selected"]]) / np.mean([t[s]["length"][i] for i in t[s]["candidates"]])
                          for t in traces]) for s in range(steps)]
        cov = [np.mean([len({i // cfg.rollouts_per_prompt for i in t[s]["selected"]}) for t in traces]) for s in range(steps)]
        k = max(1, steps // 20)  # moving average over k steps
        smooth = lambda v: np.convolve(v, np.ones(k) / k, mode="valid")  # noqa: E731
        a1.plot(np.arange(len(smooth(ratio))) + k, smooth(ratio), label=label(n))
        a2.plot(np.arange(len(smooth(cov))) + k, smooth(cov), label=label(n))
        drew = True
    if not drew:
        plt.close(fig)
        return None
    a1.axhline(1, color="k", lw=0.8)
    a1.set_xlabel("training step")
    a1.set_ylabel("mean T_i of S / mean T_i of candidates")
    a1.set_title("(a) lengths the budget picks (mean over seeds)", fontsize=9)
    a1.legend(fontsize=6)
    a2.set_xlabel("training step")
    a2.set_ylabel(f"distinct prompts in S (of {cfg.prompts_per_step})")
    a2.set_title("(b) prompt coverage of S", fontsize=9)
    fig.tight_layout()
    save_figure(fig, root / "fig6_selection.png", dpi=130)
    return "fig6_selection.png"


def idle_estimate(timing: dict, jobs: int) -> float:
    """Wall seconds the recorded work takes on an idle machine: every phase's CPU seconds, the parallel
    OPD runs' divided by `jobs` (each run is one thread)."""
    phases = [k for k in timing if k.startswith("cpu_") and k.endswith("_s") and k != "cpu_s"]  # cpu_s: their sum
    return sum(timing[k] / (max(1, jobs) if k == "cpu_runs_s" else 1) for k in phases)


def report(root: Path, cfg: ExplainConfig, timing: dict, command: str) -> str:
    """Writes OUT/report.md (and the plots) from the files on disk; returns the Markdown."""
    base = json.loads((root / "base_eval.json").read_text())
    runs = collect(root, run_specs(cfg))
    main_runs = {n: rs for n, rs in runs.items() if not split_name(n)[2]}
    names, all_names = order(main_runs), order(runs)
    world_png = world_figure(root, world_config(cfg))
    files = plots(root, main_runs, base)
    extra = selection_plot(root, runs, names, cfg)
    files += [extra] if extra else []
    samples = json.loads((root / "base_samples.json").read_text()) if (root / "base_samples.json").exists() else []
    lines = [
        "# BAS-OPD in a toy world with explained answers (CPU)",
        "",
        f"- Command: `{command}`",
        f"- Machine: {machine()}; {cfg.jobs} run(s) at a time, one thread each",
        f"- Wall time: {timing.get('total_s', 0):.0f} s in all (world {timing.get('world_s', 0):.0f} s, base model "
        f"{timing.get('sft_s', 0):.0f} s, base evaluation {timing.get('base_eval_s', 0):.0f} s, OPD runs "
        f"{timing.get('runs_s', 0):.0f} s)" + (f", summed over {timing['invocations']} invocations (each reuses what "
        "the earlier ones finished)" if timing.get("invocations", 1) > 1 else ", one invocation from scratch"),
        f"- CPU time: {timing.get('cpu_s', 0):.0f} s in all processes; on an otherwise idle machine that is about "
        f"{idle_estimate(timing, cfg.jobs):.0f} s of wall time (the OPD runs' CPU time / {cfg.jobs} plus the rest)",
        f"- Finished: {time.strftime('%Y-%m-%d %H:%M:%S')}",
        f"- Setting: {cfg.seeds} seed(s); {cfg.steps} OPD steps of {cfg.prompts_per_step} prompts x "
        f"{cfg.rollouts_per_prompt} rollouts of at most {cfg.max_response_len} tokens; lr {cfg.lr:g}; JSD alpha 0.5, "
        f"top-100, EMA 0.05 (paper); selector as Table 5 with replay start {cfg.replay_start}, minibatch "
        f"{cfg.replay_batch}; base: {cfg.sft_steps} supervised steps of {cfg.sft_batch} crops; eval.py greedy (up to {cfg.eval_tokens} "
        f"tokens) on {cfg.n_eval} held-out items",
        "",
        f"![{world_png}]({world_png})",
        "",
    ]
    lines += responses_section(samples, root / "base_eval", runs, cfg.rollouts_per_prompt) + [""]
    lines += gap_section(base, runs, all_names) + [""] + table3(main_runs, names)
    lines += ["", "Learned-100 is Full querying (at rho = 1 every policy selects all of C), so the Full row stands for it."]
    t4 = table4(runs)
    lines += ([""] + t4 if t4 else [])
    lines += [""] + selection_section(runs, all_names, cfg, base)
    lines += [""] + table7(runs, all_names) + [""] + table8(runs, all_names) + ["", ledger_line(runs, all_names)]
    audit = audit_section(runs, cfg.prompts_per_step, cfg.rollouts_per_prompt)
    lines += ([""] + audit if audit else [])
    geometry = geometry_section(runs)
    lines += ([""] + geometry if geometry else [])
    lines += ["", "## Plots", ""] + [f"![{f}]({f})" for f in files]
    return write_report(root, "\n".join(lines) + "\n", {"base": base, "timing": timing, "runs": {
        n: [{k: v for k, v in r.items() if k not in ("audit", "geometry", "trace")} for r in rs] for n, rs in runs.items()}})


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> str:
    entry = Entry.start(ExplainConfig, PRESETS, argv, __doc__, "python experiments/toy_explain.py")
    cfg, root = entry.cfg, entry.root
    from harness.explain import EXPLAIN

    specs = run_specs(cfg)
    entry.world(world_config(cfg))
    entry.base(world_config(cfg), sft_config(cfg), task=EXPLAIN,
               what=f"base model ({cfg.sft_steps} supervised steps of explained answers on crops)")
    entry.base_eval(cfg.eval_batch, cfg.eval_tokens)
    with entry.phase("base_eval_s"):
        base_samples(root, cfg)
    entry.runs([job(cfg, s, root) for s in specs], cfg.jobs)
    return entry.finish(report)


if __name__ == "__main__":
    from opd.cli import run_cli

    run_cli(main, sys.argv[1:], "toy_explain.py")
