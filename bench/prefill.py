"""Rollout prefill sharing on vs off (issue 5, benchmark 4): `generate_rollouts(..., share_prefill)`.

Samples n rollouts per prompt (default 8, the paper's) for the step's prompts with the prompt prefill
shared (each prompt and its image encoded and prefilled once, the cache expanded to its n rows) and
not shared (every row prefilled by generate()), on the same prompts and seed. Forward hooks on the
model time every forward: a forward over more than one query token is prefill (vision encoding +
prompt; with sharing, `prefill_shared_cache`'s forward over the prompts minus their last token), a
one-token forward is decoding (with sharing, generate's first step, which feeds each row its last
prompt token, counts here); a hook on the vision tower times the vision encoding alone. Median over
--repeats interleaved calls per setting.

    .venv/bin/python bench/prefill.py --out bench-prefill.json
    .venv/bin/python bench/prefill.py --quick
"""

import argparse
import sys
import time
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
    sync,
    write_json,
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--models", default="tiny,mid", help="comma-separated model kinds, tiny and/or mid (default: tiny,mid)"
    )
    p.add_argument(
        "--prompts", type=int, default=4, help="prompts of one step (default: 4, the tiny preset's per step)"
    )
    p.add_argument("--rollouts-per-prompt", type=int, default=8, help="rollouts per prompt (default: 8)")
    p.add_argument(
        "--max-new-tokens", type=int, default=16, help="most new tokens per rollout (default: 16, the tiny preset's)"
    )
    p.add_argument(
        "--repeats", type=int, default=5, help="generate_rollouts calls per setting, median reported (default: 5)"
    )
    add_run_args(p, mixed_precision=False)
    p.add_argument(
        "--quick", action="store_true", help="smoke test: tiny model, 2 prompts, 4 new tokens, one repeat, in process"
    )
    p.add_argument("--out", default=None, help="write the measured numbers to this JSON file")
    a = p.parse_args(argv)
    if a.quick:
        a.models, a.prompts, a.max_new_tokens, a.repeats, a.in_process = "tiny", 2, 4, 1, True
    return a


class ForwardTimer:
    """Seconds of prefill forwards (> 1 query token), one-token forwards, and the vision tower."""

    def __init__(self, model, device: str):
        self.device = device
        self.handles = []
        self.reset()
        self._hook(model, "model")
        visual = getattr(getattr(model, "model", None), "visual", None)
        if visual is not None:
            self._hook(visual, "vision")

    def reset(self) -> None:
        self.seconds = {"prefill": 0.0, "decode": 0.0, "vision": 0.0}
        self.calls = {"prefill": 0, "decode": 0, "vision": 0}
        self.tokens = {"prefill": 0, "decode": 0}
        self._t0 = {}

    def _hook(self, module, kind: str) -> None:
        def pre(mod, args, kwargs):
            sync(self.device)
            if kind == "model":
                ids = kwargs.get("input_ids")
                ids = ids if ids is not None else kwargs.get("inputs_embeds")
                q = ids.shape[1] if ids is not None else 1
                phase = "prefill" if q > 1 else "decode"
                self.tokens[phase] += int(ids.shape[0] * q) if ids is not None else 0
            else:
                phase = "vision"
            self._t0[kind] = (phase, time.perf_counter())

        def post(mod, args, kwargs, output):
            sync(self.device)
            phase, t0 = self._t0.pop(kind)
            self.seconds[phase] += time.perf_counter() - t0
            self.calls[phase] += 1

        self.handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        self.handles.append(module.register_forward_hook(post, with_kwargs=True))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def measure(
    model: str, prompts: int, rollouts_per_prompt: int, max_new_tokens: int, repeats: int, seed: int = 0
) -> dict:
    """Median seconds of generate_rollouts and its prefill / decode / vision forwards, sharing on and off."""
    import torch

    from opd.models.chat import encode_prompt
    from opd.data.sources import load_records
    from opd.models.loading import load_model, load_processor
    from opd.engine.rollout import generate_rollouts
    from opd.data.records import student_view

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model_dir, data = model_and_data(model)
    processor = load_processor(str(model_dir))
    policy = load_model(str(model_dir), "bfloat16" if device == "cuda" else "float32", device)
    encoded = [encode_prompt(processor, *student_view(r)) for r in load_records(data)[:prompts]]
    timer = ForwardTimer(policy, device)
    runs = {False: [], True: []}
    samples = {}
    for rep in range(repeats + 1):  # the first round is a warm-up
        for share in (False, True):
            timer.reset()
            torch.manual_seed(seed)
            sync(device)
            t0 = time.perf_counter()
            out = generate_rollouts(policy, encoded, rollouts_per_prompt, max_new_tokens, 0, share)
            sync(device)
            total = time.perf_counter() - t0
            samples[share] = out.response_ids
            if rep:
                runs[share].append({"total_s": total, **{f"{k}_s": v for k, v in timer.seconds.items()},
                                    **{f"{k}_calls": v for k, v in timer.calls.items()},
                                    **{f"{k}_tokens": v for k, v in timer.tokens.items()}})  # fmt: skip
    timer.remove()
    res = {"model": model, "prompt_tokens": [len(p) for p in encoded], "rows": prompts * rollouts_per_prompt,
           "same_samples": bool(torch.equal(samples[False], samples[True]))}  # fmt: skip
    for share, key in ((False, "off"), (True, "on")):
        res[key] = {k: median([r[k] for r in runs[share]]) for k in runs[share][0]}
        res[key]["all"] = runs[share]
    return res


def main(argv=None) -> dict:
    a = parse_args(argv)
    import torch

    set_threads(a.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    info = start(a.wait_quiet, device, a.threads)
    results = []
    for model in a.models.split(","):
        print(f"{model}: {a.prompts} prompts x {a.rollouts_per_prompt} rollouts", file=sys.stderr, flush=True)
        kwargs = {"model": model, "prompts": a.prompts, "rollouts_per_prompt": a.rollouts_per_prompt,
                      "max_new_tokens": a.max_new_tokens, "repeats": a.repeats}  # fmt: skip
        r = run_case("bench.prefill:measure", kwargs, isolated=not a.in_process, threads=a.threads)
        if "error" in r:
            raise SystemExit(f"prefill {model}: {r['error']}")
        results.append(r)
    report = summarize(results, a, info)
    print(report["markdown"])
    write_json(a.out, {"machine": info, "args": vars(a), "results": results, "targets": report["targets"],
                       "command": "python bench/prefill.py " + " ".join(argv if argv is not None else sys.argv[1:])})  # fmt: skip
    return report


def summarize(results: list[dict], a, info: dict) -> dict:
    out, targets = [format_machine(info), ""], {"prefill_3x_less": []}
    table = []
    for r in results:
        off, on = r["off"], r["on"]
        for label, key in (("prefill forwards (vision + prompt)", "prefill_s"), ("vision tower alone", "vision_s"),
                           ("one-token forwards (decoding)", "decode_s"), ("generate_rollouts total", "total_s")):  # fmt: skip
            ratio = off[key] / on[key] if on[key] else None
            table.append([f"`{r['model']}`", label, fmt_s(off[key]), fmt_s(on[key]), fmt_ratio(ratio, 1)])
        table.append([f"`{r['model']}`", "prefill tokens (rows x query tokens)", f"{off['prefill_tokens']:,.0f}", f"{on['prefill_tokens']:,.0f}",
                      fmt_ratio(off["prefill_tokens"] / on["prefill_tokens"] if on["prefill_tokens"] else None, 1)])  # fmt: skip
        ratio = off["prefill_s"] / on["prefill_s"] if on["prefill_s"] else float("nan")
        targets["prefill_3x_less"].append({"model": r["model"], "ratio": ratio, "vision_ratio": off["vision_s"] / on["vision_s"] if on["vision_s"] else None,
                                           "same_samples": r["same_samples"], "met": ratio >= 3})  # fmt: skip
    out += [
        f"{a.prompts} prompts x {a.rollouts_per_prompt} rollouts, {a.max_new_tokens} new tokens; median of {a.repeats} calls per setting "
        "after a warm-up. Prompt tokens: " + "; ".join(f"`{r['model']}` {min(r['prompt_tokens'])}-{max(r['prompt_tokens'])}" for r in results) + ".",
        "",
        markdown_table(["model", "time per step", "sharing off", "sharing on", "off / on"], table, "llrrr"),
        "",
    ]  # fmt: skip
    for t in targets["prefill_3x_less"]:
        out.append(f"- Target: at least 3x less prefill/vision time per step at {a.rollouts_per_prompt} rollouts per prompt, `{t['model']}`: "
                   f"{met(t['met'])} (prefill {t['ratio']:.1f}x, vision {fmt_ratio(t['vision_ratio'], 1)} less; "
                   f"identical samples: {'yes' if t['same_samples'] else 'NO'}).")  # fmt: skip
    out.append("")
    return {"markdown": "\n".join(out), "targets": targets}


if __name__ == "__main__":
    main()
