"""Teacher cost against the query budget (issue 5, benchmark 2).

One training step (`opd.run.Run.step`) on the same fixed rollouts (response lengths uniform in
[--min-len, --max-len]) with the random policy at each rho, read from the ledger row: teacher-forward
seconds, selected rows, scored tokens (valid response tokens of S), teacher tokens (prompt + response,
real) and teacher padded tokens (the teacher's input batches). Each rho is stepped --repeats times,
interleaved, and the median teacher time is reported; the step index stays the same, so every
repeat selects the same rows. Run with the teacher's micro-batches capped by rows only
(--micro-batch-tokens off) and by padded tokens as well (on).

    .venv/bin/python bench/teacher_budget.py --out bench-teacher.json               # tiny and mid-size model
    .venv/bin/python bench/teacher_budget.py --quick                                # smoke test
"""

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._util import (
    add_run_args,
    fmt_ratio,
    fmt_s,
    format_machine,
    markdown_table,
    median,
    met,
    model_and_data,
    run_case,
    set_threads,
    start,
    write_json,
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="tiny,mid",
                   help="comma-separated model kinds: tiny (the built-in default) and/or mid (hidden 512, 8 layers, "
                        "vision depth 4, 384-pixel images) (default: tiny,mid)")  # fmt: skip
    p.add_argument("--rhos", default="0.1,0.25,0.5,1.0", help="query ratios (default: 0.1,0.25,0.5,1.0)")
    p.add_argument("--prompts-per-step", type=int, default=8, help="prompts of the step (default: 8)")
    p.add_argument("--rollouts-per-prompt", type=int, default=8, help="rollouts per prompt (default: 8)")
    p.add_argument("--min-len", type=int, default=4, help="shortest fixed response, EOS included (default: 4)")
    p.add_argument("--max-len", type=int, default=64, help="longest fixed response (default: 64)")
    p.add_argument("--micro-batch", type=int, default=8, help="most rows per teacher/student forward (default: 8)")
    p.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=1024,
        help="the 'on' setting of --micro-batch-tokens: most padded teacher tokens per forward (default: 1024)",
    )
    p.add_argument("--repeats", type=int, default=5, help="steps per rho and setting; median teacher time (default: 5)")
    add_run_args(p)
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: tiny model, 2 prompts x 4 rollouts, rho 0.25 and 1.0, one repeat, in process",
    )
    p.add_argument("--out", default=None, help="write the measured numbers to this JSON file")
    a = p.parse_args(argv)
    if a.quick:
        a.models, a.rhos, a.prompts_per_step, a.rollouts_per_prompt, a.repeats = "tiny", "0.25,1.0", 2, 4, 1
        a.max_len, a.micro_batch_tokens, a.in_process = 12, 64, True
    return a


def measure(model: str, rhos: list[float], prompts_per_step: int, rollouts_per_prompt: int, min_len: int, max_len: int,
            micro_batch: int, micro_batch_tokens: int, repeats: int, mixed_precision: str, out_dir: str) -> dict:  # fmt: skip
    """Ledger rows of one Run stepped at each rho on fixed rollouts, for one micro-batch-token setting."""
    import torch

    from opd.config import PRESETS, TrainConfig
    from opd.run import Run

    if mixed_precision == "auto":
        mixed_precision = "bf16" if torch.cuda.is_available() else "no"
    model_dir, data = model_and_data(model)
    cfg = TrainConfig(**{
        **PRESETS["tiny"], "model": str(model_dir), "data": str(data), "out": out_dir, "policy": "random", "rho": 1.0,
        "prompts_per_step": prompts_per_step, "rollouts_per_prompt": rollouts_per_prompt, "max_response_len": max_len,
        "micro_batch": micro_batch, "micro_batch_tokens": micro_batch_tokens, "mixed_precision": mixed_precision,
    })  # fmt: skip
    run = Run(cfg)
    from opd.engine.synthetic import fixed_rollouts

    rollouts = fixed_rollouts(run, 0, min_len, max_len)
    run.step(0, rollouts)  # warm-up
    rows = {rho: [] for rho in rhos}
    for _ in range(repeats):
        for rho in rhos:
            run.stepper.rho = rho  # the query ratio of Eq. 4 this step budgets with
            rows[rho].append(run.step(0, rollouts))
    keys = ("selected", "candidates", "scored_tokens", "candidate_tokens", "teacher_tokens", "teacher_padded_tokens")
    out = []
    for rho in rhos:
        r = rows[rho]
        out.append({"rho": rho, **{k: r[0][k] for k in keys},
                    "teacher_forward_s": median([x["teacher_forward_s"] for x in r]),
                    "teacher_forward_all_s": [x["teacher_forward_s"] for x in r],
                    "step_s": median([x["step_s"] for x in r])})  # fmt: skip
    return {"model": model, "micro_batch_tokens": micro_batch_tokens, "rows": out,
            "prompt_tokens_student": int(rollouts.prompt_len.float().mean())}  # fmt: skip


def main(argv=None) -> dict:
    a = parse_args(argv)
    import torch

    set_threads(a.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    info = start(a.wait_quiet, device, a.threads)
    rhos = [float(x) for x in a.rhos.split(",")]
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-teacher-") as tmp:
        for model in a.models.split(","):
            for mbt in (0, a.micro_batch_tokens):
                kwargs = {"model": model, "rhos": rhos, "prompts_per_step": a.prompts_per_step, "rollouts_per_prompt": a.rollouts_per_prompt,
                              "min_len": a.min_len, "max_len": a.max_len, "micro_batch": a.micro_batch, "micro_batch_tokens": mbt,
                              "repeats": a.repeats, "mixed_precision": a.mixed_precision, "out_dir": f"{tmp}/{model}-{mbt}"}  # fmt: skip
                print(f"{model}, micro-batch-tokens {mbt or 'off'}: running", file=sys.stderr, flush=True)
                r = run_case("bench.teacher_budget:measure", kwargs, isolated=not a.in_process, threads=a.threads)
                if "error" in r:
                    raise SystemExit(f"teacher_budget {model} micro_batch_tokens={mbt}: {r['error']}")
                results.append(r)
    report = summarize(results, a, rhos, info)
    print(report["markdown"])
    write_json(a.out, {"machine": info, "args": vars(a), "results": results, "targets": report["targets"],
                       "command": "python bench/teacher_budget.py " + " ".join(argv if argv is not None else sys.argv[1:])})  # fmt: skip
    return report


def summarize(results: list[dict], a, rhos: list[float], info: dict) -> dict:
    out = [format_machine(info), ""]
    targets = {"time_ratio_within_1_15x_of_token_ratio": [], "padding_at_most_10pct": []}
    lo, hi = (0.25, 1.0) if 0.25 in rhos and 1.0 in rhos else (min(rhos), max(rhos))
    for r in results:
        ref = next(x for x in r["rows"] if x["rho"] == hi)
        table = []
        for x in r["rows"]:
            pad = 1 - x["teacher_tokens"] / x["teacher_padded_tokens"] if x["teacher_padded_tokens"] else 0.0
            x["padding_share"] = pad
            t_ratio = x["teacher_forward_s"] / ref["teacher_forward_s"] if ref["teacher_forward_s"] else float("nan")
            s_ratio = x["scored_tokens"] / ref["scored_tokens"] if ref["scored_tokens"] else float("nan")
            tt_ratio = x["teacher_tokens"] / ref["teacher_tokens"] if ref["teacher_tokens"] else float("nan")
            x.update(time_ratio=t_ratio, scored_ratio=s_ratio, teacher_token_ratio=tt_ratio)
            table.append([f"{x['rho']:.2f}", f"{x['selected']}/{x['candidates']}", f"{x['scored_tokens']:,}", f"{x['teacher_tokens']:,}",
                          f"{x['teacher_padded_tokens']:,}", f"{100 * pad:.1f}%", fmt_s(x["teacher_forward_s"]), fmt_ratio(t_ratio),
                          fmt_ratio(s_ratio), fmt_ratio(tt_ratio), fmt_ratio(t_ratio / s_ratio if s_ratio else None)])  # fmt: skip
        mbt = f"{r['micro_batch_tokens']:,} tokens" if r["micro_batch_tokens"] else "off"
        out += [
            (f"Model `{r['model']}` (student prompt ~{r['prompt_tokens_student']} tokens), micro-batch {a.micro_batch} rows, "
            f"--micro-batch-tokens {mbt}; ratios against rho = {hi:g}; teacher time: median of {a.repeats}."),
            "",
            markdown_table(["rho", "selected / candidates", "scored tokens", "teacher tokens", "teacher padded tokens", "padding",
                            "teacher forward", "time ratio", "scored-token ratio", "teacher-token ratio", "time / scored ratio"], table),
            "",
        ]  # fmt: skip
        x = next(y for y in r["rows"] if y["rho"] == lo)
        q = x["time_ratio"] / x["scored_ratio"] if x["scored_ratio"] else float("nan")
        targets["time_ratio_within_1_15x_of_token_ratio"].append(
            {"model": r["model"], "micro_batch_tokens": r["micro_batch_tokens"], "rho": lo, "time_ratio": x["time_ratio"],
             "scored_ratio": x["scored_ratio"], "quotient": q, "met": bool(1 / 1.15 <= q <= 1.15)})  # fmt: skip
        worst = max(y["padding_share"] for y in r["rows"])
        targets["padding_at_most_10pct"].append({"model": r["model"], "micro_batch_tokens": r["micro_batch_tokens"],
                                                 "worst_padding_share": worst, "met": worst <= 0.10})  # fmt: skip
    for t in targets["time_ratio_within_1_15x_of_token_ratio"]:
        mbt = t["micro_batch_tokens"] or "off"
        out.append(f"- Target: teacher-time ratio (rho {t['rho']:g} / {hi:g}) within 1.15x of the scored-token ratio, `{t['model']}`, "
                   f"micro-batch-tokens {mbt}: {met(t['met'])} ({t['time_ratio']:.3f} vs {t['scored_ratio']:.3f}, quotient {t['quotient']:.2f}).")  # fmt: skip
    for t in targets["padding_at_most_10pct"]:
        mbt = t["micro_batch_tokens"] or "off"
        out.append(f"- Target: padding at most 10% of teacher tokens, `{t['model']}`, micro-batch-tokens {mbt}: "
                   f"{met(t['met'])} (worst over rho {100 * t['worst_padding_share']:.1f}%).")  # fmt: skip
    out.append("")
    return {"markdown": "\n".join(out), "targets": targets}


if __name__ == "__main__":
    main()
