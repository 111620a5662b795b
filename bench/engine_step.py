"""A training step with each rollout engine, side by side (issue 22): HF `generate` against the vLLM server.

Builds a mid-size random-weight Qwen3.5 that vLLM's CPU backend can load (opd.tiny.build_tiny_vllm_model: hidden
512, 8 layers, vision depth 4, attention head_dim 32, linear-attention head dims 64; 384-pixel images), then runs
`opd.run.Run` for a few steps with `--rollout-engine hf` and with `--rollout-engine vllm` (one server for the run,
started once, weights pushed before each step's generation), the same settings otherwise (the tiny preset's 4
prompts x 8 rollouts, --max-response-len tokens, learned policy, rho 0.25), and reports the mean seconds of each
ledger phase over the steps after the first (a warm-up; with --steps 1 that one step, flagged) and generation's
share of the step. On a GPU (the vLLM venv of scripts/install_vllm.sh) the same command measures the GPU engine
(`bench/gpu_check.py --engine`): the trainer and the server share the GPU, so the server takes
--gpu-memory-utilization of it (default 0.3; vLLM's own default, 0.9, leaves the trainer nothing). Each run's
output folder is temporary and removed when its numbers are read.

    .venv/bin/python bench/engine_step.py --out docs/bench/engine_step.json
"""

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PHASES = ("generation", "teacher_forward", "student", "optimizer", "select", "selector", "prompt", "wait")


def run_engine(engine: str, model: Path, data: Path, steps: int, response: int, url: str | None) -> dict:
    import opd.config
    import opd.run
    from opd.loop.ledger import read_ledger

    out = Path(tempfile.mkdtemp(prefix=f"engine-{engine}-"))
    try:
        cfg = opd.config.TrainConfig(**{**opd.config.PRESETS["tiny"], "model": str(model), "data": str(data), "steps": steps,
                                   "max_response_len": response, "out": str(out), "save_every": 0, "report_to": "none",
                                   "rollout_engine": engine, "vllm_url": url, "max_prompt_len": 2048})  # fmt: skip
        t0 = time.perf_counter()
        opd.run.Run(cfg).train()
        wall = time.perf_counter() - t0
        ledger = read_ledger(out / "ledger.jsonl")
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return summarize(engine, ledger, wall)


def summarize(engine: str, ledger: list[dict], wall: float) -> dict:
    """Mean seconds per phase over the ledger's steps after the first (a warm-up), or over its one step (then
    `warmup_included`)."""
    rows = ledger[1:] or ledger
    mean = {p: sum(r[f"{p}_s"] for r in rows) / len(rows) for p in PHASES}
    step = sum(r["step_s"] for r in rows) / len(rows)
    tokens = sum(r["candidate_tokens"] for r in rows) / len(rows)
    return {"engine": engine, "steps_measured": len(rows), "warmup_included": len(ledger) < 2, "step_s": step,
            "phases_s": mean, "wall_s": wall, "generated_tokens_per_step": tokens,
            "generation_share": mean["generation"] / step if step else 0.0}  # fmt: skip


def main(argv=None) -> dict:
    from bench._util import format_machine, markdown_table, set_threads, start, write_json
    from opd.engine.vllm_server import VLLMServer, check_venv
    from opd.tiny import build_tiny_dataset, build_tiny_vllm_model, cache_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=4, help="steps per engine, the first one a warm-up (default: 4)")
    p.add_argument("--max-response-len", type=int, default=32, help="most tokens per rollout (default: 32)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the trainer on a CPU (default: 2)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3,
                   help="on a GPU: the share of its memory the vLLM server takes, the rest left to the trainer "
                        "(default: 0.3)")  # fmt: skip
    p.add_argument("--out", default=None, help="write the numbers to this JSON file")
    a = p.parse_args(argv)
    if a.steps < 1:
        p.error(f"--steps {a.steps}: must be at least 1")
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"  # where opd.run.Run trains (accelerate's device)
    if device == "cpu":
        set_threads(a.threads)
    info = start(0, device, a.threads if device == "cpu" else 0)
    extra = ("--gpu-memory-utilization", str(a.gpu_memory_utilization)) if device == "cuda" else ()
    root = cache_dir() / "bench"
    model = build_tiny_vllm_model(root / "vllm-mid-h512-l8-v4-img384", seed=0, max_pixels=384 * 384, hidden=512,
                                  layers=8, vision_depth=4)  # fmt: skip
    data = build_tiny_dataset(root / "data-img384-s0", size=384, seed=0)
    results = [run_engine("hf", model, data, a.steps, a.max_response_len, None)]
    check_venv()
    server = VLLMServer.start(model, seed=0, max_model_len=2048 + a.max_response_len + 16, extra_args=extra)
    try:
        results.append(run_engine("vllm", model, data, a.steps, a.max_response_len, server.url))
    finally:
        server.stop()
    head = ["engine", "step (s)", "generation (s)", "generation share", *[f"{p} (s)" for p in PHASES[1:4]],
            "candidate tokens per step"]  # fmt: skip
    rows = [[r["engine"], f"{r['step_s']:.2f}", f"{r['phases_s']['generation']:.2f}", f"{100 * r['generation_share']:.1f}%",
             *(f"{r['phases_s'][p]:.2f}" for p in PHASES[1:4]), f"{r['generated_tokens_per_step']:.0f}"] for r in results]  # fmt: skip
    text = (f"{format_machine(info)} vLLM server start: {server.start_seconds:.1f} s (not in the steps).\n\n"
            + markdown_table(head, rows, "lrrrrrrr"))  # fmt: skip
    print(text)
    write_json(a.out, {"machine": info, "results": results, "server_start_s": server.start_seconds, "markdown": text})
    return {"results": results, "markdown": text}


if __name__ == "__main__":
    main()
