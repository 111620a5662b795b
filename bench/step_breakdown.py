"""Where a training step's time goes (issue 5, benchmark 3): the ledger's per-phase seconds.

Runs `opd.run.Run.step` with real rollout generation for a few steps on the tiny default (`--preset
tiny`: 4 prompts x 8 rollouts, 16-token responses, learned policy, rho 0.25) and on a mid-size
random-weight Qwen3.5 (hidden 512, 8 layers, vision depth 4, 384-pixel images; same preset
otherwise), each in a fresh process, and reports the mean seconds and share of step time of each
phase of `opd.loop.ledger.PHASES` over the steps after the first (a warm-up); "other" is step time outside
the phases (features, all-gathers' bookkeeping, the ledger row). The learned selector starts
updating once its replay holds --replay-start labels; the selector share is also given over the
steps that updated it.

    .venv/bin/python bench/step_breakdown.py --out bench-step.json
    .venv/bin/python bench/step_breakdown.py --quick
"""

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._util import (
    add_run_args,
    fmt_bytes,
    fmt_s,
    format_machine,
    markdown_table,
    met,
    model_and_data,
    run_case,
    set_threads,
    start,
    write_json,
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--models", default="tiny,mid", help="comma-separated model kinds, tiny and/or mid (default: tiny,mid)"
    )
    p.add_argument(
        "--steps", type=int, default=8, help="steps on the tiny model, the first a warm-up (default: 8, the preset's)"
    )
    p.add_argument(
        "--mid-steps", type=int, default=5, help="steps on the mid-size model, the first a warm-up (default: 5)"
    )
    p.add_argument("--policy", default="learned", help="selection policy (default: learned)")
    p.add_argument("--rho", type=float, default=0.25, help="query ratio (default: 0.25)")
    add_run_args(p)
    p.add_argument(
        "--quick", action="store_true", help="smoke test: tiny model, 2 prompts x 4 rollouts, 3 steps, in process"
    )
    p.add_argument("--out", default=None, help="write the measured numbers to this JSON file")
    a = p.parse_args(argv)
    if a.quick:
        a.models, a.steps, a.in_process = "tiny", 3, True
    return a


def measure(
    model: str, steps: int, policy: str, rho: float, mixed_precision: str, out_dir: str, quick: bool = False
) -> dict:
    """Ledger rows of `steps` steps of a Run on the tiny preset with the given model kind."""
    import resource

    import torch

    from opd.config import PRESETS, TrainConfig
    from opd.run import Run

    if mixed_precision == "auto":
        mixed_precision = "bf16" if torch.cuda.is_available() else "no"
    model_dir, data = model_and_data(model)
    extra = (
        {"prompts_per_step": 2, "rollouts_per_prompt": 4, "max_response_len": 6, "replay_start": 4, "replay_batch": 8}
        if quick
        else {}
    )
    cfg = TrainConfig(**{**PRESETS["tiny"], "model": str(model_dir), "data": str(data), "out": out_dir, "policy": policy,
                         "rho": rho, "steps": steps, "mixed_precision": mixed_precision, **extra})  # fmt: skip
    run = Run(cfg)
    rows = [run.step(s) for s in range(steps)]
    return {"model": model, "rows": rows, "config": {k: cfg.flags()[k] for k in ("prompts_per_step", "rollouts_per_prompt",
            "max_response_len", "micro_batch", "loss_chunk", "policy", "rho", "replay_start")},
            "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # fmt: skip


def phase_means(rows: list[dict]) -> dict:
    from opd.loop.ledger import PHASES

    n = max(1, len(rows))
    means = {p: sum(r[f"{p}_s"] for r in rows) / n for p in PHASES}
    step = sum(r["step_s"] for r in rows) / n
    means["other"] = step - sum(means.values())
    means["step"] = step
    return means


def main(argv=None) -> dict:
    a = parse_args(argv)
    import torch

    set_threads(a.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    info = start(a.wait_quiet, device, a.threads)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-step-") as tmp:
        for model in a.models.split(","):
            steps = a.steps if model == "tiny" else a.mid_steps
            print(f"{model}: {steps} steps", file=sys.stderr, flush=True)
            kwargs = {"model": model, "steps": steps, "policy": a.policy, "rho": a.rho, "mixed_precision": a.mixed_precision,
                          "out_dir": f"{tmp}/{model}", "quick": a.quick}  # fmt: skip
            r = run_case("bench.step_breakdown:measure", kwargs, isolated=not a.in_process, threads=a.threads)
            if "error" in r:
                raise SystemExit(f"step_breakdown {model}: {r['error']}")
            results.append(r)
    report = summarize(results, info)
    print(report["markdown"])
    write_json(a.out, {"machine": info, "args": vars(a), "results": results, "targets": report["targets"],
                       "command": "python bench/step_breakdown.py " + " ".join(argv if argv is not None else sys.argv[1:])})  # fmt: skip
    return report


def summarize(results: list[dict], info: dict) -> dict:
    from opd.loop.ledger import PHASES

    timed = {r["model"]: r["rows"][1:] or r["rows"] for r in results}
    means = {m: phase_means(rows) for m, rows in timed.items()}
    models = list(means)
    head = ["phase"] + [f"{m}: mean" for m in models] + [f"{m}: share" for m in models]
    table = []
    for p in (*PHASES, "other", "step"):
        table.append([p] + [fmt_s(means[m][p]) for m in models]
                     + [f"{100 * means[m][p] / means[m]['step']:.1f}%" if means[m]["step"] else "-" for m in models])  # fmt: skip
    out = [format_machine(info), ""]
    for r in results:
        c = r["config"]
        out.append(f"- `{r['model']}`: {c['prompts_per_step']} prompts x {c['rollouts_per_prompt']} rollouts, {c['max_response_len']}-token "
                   f"responses, {c['policy']} rho {c['rho']}, micro-batch {c['micro_batch']}, loss chunk {c['loss_chunk']}; "
                   f"{len(timed[r['model']])} timed steps (after one warm-up); peak resident set {fmt_bytes(r['max_rss_bytes'])}.")  # fmt: skip
    out += ["", markdown_table(head, table), ""]
    targets = {}
    if "tiny" in timed:
        m = means["tiny"]
        share = (m["select"] + m["selector"]) / m["step"] if m["step"] else float("nan")
        updated = [r for r in timed["tiny"] if "selector" in r]
        share_upd = None
        if updated:
            mu = phase_means(updated)
            share_upd = (mu["select"] + mu["selector"]) / mu["step"]
        targets["selection_under_1pct_tiny"] = {"share": share, "share_on_update_steps": share_upd, "update_steps": len(updated),
                                                "met": share < 0.01 and (share_upd is None or share_upd < 0.01)}  # fmt: skip
        upd = (
            f"; {100 * share_upd:.2f}% over the {len(updated)} steps that updated the selector"
            if share_upd is not None
            else ""
        )
        out.append(f"- Target: learned selection plus selector update under 1% of step time on the tiny default: "
                   f"{met(targets['selection_under_1pct_tiny']['met'])} ({100 * share:.2f}% of the mean step{upd}).")  # fmt: skip
        out.append("")
    return {"markdown": "\n".join(out), "targets": targets, "means": means}


if __name__ == "__main__":
    main()
