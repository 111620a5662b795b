"""Generation with a sharded policy (issue 12): all-gather once per generate() call or layer by layer.

`--fsdp-generation gathered` all-gathers every FSDP group of the policy before `generate` and frees them
after (one all-gather per group per call; a full copy of the weights held meanwhile); `layerwise` lets
every forward gather and free layer by layer (one all-gather per group per generated token; HF's
`synced_gpus` keeps finished ranks stepping). For each mode and model kind this runs `opd.run.Run.step`
with real generation (the tiny preset's batch: 4 prompts x 8 rollouts, 16-token responses, learned
policy, rho 0.25) under `torchrun --nproc_per_node 2` on the CPU (gloo), each case in a fresh pair of
processes, and reports per mode the mean step and generation seconds over the steps after the first (a
warm-up) and the peak memory per rank (the larger of the two ranks): of generation alone (one
generate() of the rank's rollouts, run first in the fresh process), above what the process held before
it and in all, and of the timed training steps in all (resident set high-water mark,
`bench/_util.PeakMemory`; on CUDA, allocated memory); and, exactly, the most bytes of gathered (unsharded)
weights held at the start of any block's forward during generation (`GatheredBytes`).

    .venv/bin/python bench/fsdp_generation.py --out fsdp_generation.json
    .venv/bin/python bench/fsdp_generation.py --quick
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._util import (  # noqa: E402
    RESULT_TAG,
    ROOT,
    PeakMemory,
    fmt_bytes,
    fmt_s,
    format_machine,
    markdown_table,
    model_and_data,
    start,
    write_json,
)

MODES = ("gathered", "layerwise")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="tiny,mid", help="comma-separated model kinds, tiny and/or mid (default: tiny,mid)")
    p.add_argument("--steps", type=int, default=5, help="training steps per case, the first a warm-up (default: 5)")
    p.add_argument("--nproc", type=int, default=2, help="processes (ranks) per case (default: 2)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank (default: 1)")
    p.add_argument("--wait-quiet", type=float, default=0.0,
                   help="first wait up to this many minutes for a 1-minute load average below 1.0 (default: 0)")
    p.add_argument("--quick", action="store_true", help="smoke test: tiny model, 2 prompts x 4 rollouts, 2 steps")
    p.add_argument("--out", default=None, help="write the measured numbers to this JSON file")
    a = p.parse_args(argv)
    if a.quick:
        a.models, a.steps = "tiny", 2
    return a


def measure(model: str, mode: str, steps: int, out_dir: str, quick: bool = False) -> dict | None:
    """One case on every rank (under torchrun): per-step seconds and this rank's peaks; rank 0 returns all ranks'."""
    import torch

    from opd.config import PRESETS, TrainConfig
    from opd.run import Run
    from opd.engine.rollout import generate_rollouts
    from opd.engine.rollout import mix_seed
    from opd.models.sharding import generation

    model_dir, data = model_and_data(model)
    extra = dict(prompts_per_step=2, rollouts_per_prompt=4, max_response_len=6, replay_start=4, replay_batch=8) if quick else {}
    cfg = TrainConfig(**{**PRESETS["tiny"], "model": str(model_dir), "data": str(data), "out": out_dir, "steps": steps,
                         "fsdp": True, "fsdp_generation": mode, **extra})  # fmt: skip
    run = Run(cfg)
    device = str(run.acc.device)
    # Generation alone first, in the fresh process: a resident-set peak hides memory the allocator reuses.
    prompts = run.prompts.student(run.prompts.of_step(0))
    gathered = GatheredBytes(run.model)
    peak = PeakMemory(device)
    peak.start()
    torch.manual_seed(mix_seed(cfg.run.seed, 0, run.acc.process_index))
    s = cfg.sampling
    with generation(run.model, mode):
        generate_rollouts(run.model, prompts, s.rollouts_per_prompt, s.max_response_len, s.rollout_batch, s.share_prefill)
    generation_peak, generation_total = peak.peak_above(), _total(peak)
    gathered.remove()
    rows = [run.step(0)]  # warm-up
    peak = PeakMemory(device)
    peak.start()
    rows += [run.step(step) for step in range(1, steps)]
    step_peak, step_total = peak.peak_above(), _total(peak)
    mine = [[generation_peak, generation_total, step_peak, step_total, gathered.peak, gathered.sharded]]
    per_rank = run.acc.gather(torch.tensor(mine, dtype=torch.float64, device=run.acc.device)).cpu().tolist()
    if not run.acc.is_main_process:
        return None
    params = sum(p.numel() for p in run.model.parameters())
    return {"model": model, "mode": mode, "rows": rows, "per_rank": per_rank, "world": run.acc.num_processes,
            "params": params, "memory_method": peak.method}  # fmt: skip


class GatheredBytes:
    """Bytes of the policy's parameters held gathered (unsharded) at the start of every forward of a model
    block or of the root (FSDP2 registers the gathered tensors as plain parameters and the shards as
    DTensors); the peak over the calls, and the bytes of this rank's shards."""

    def __init__(self, model):
        from torch.distributed.tensor import DTensor

        from opd.models.sharding import fsdp_modules

        self.model, self.dtensor = model, DTensor
        self.peak = 0.0
        self.sharded = float(sum(p.to_local().numel() * p.element_size() for p in model.parameters() if isinstance(p, DTensor)))
        self.handles = [m.register_forward_pre_hook(self._count) for m in fsdp_modules(model)]

    def _count(self, module, args):
        held = sum(p.numel() * p.element_size() for p in self.model.parameters() if not isinstance(p, self.dtensor))
        self.peak = max(self.peak, float(held))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _total(peak: PeakMemory) -> float:
    """The whole process's (or device's) peak since `peak.start()`: VmHWM, or max_memory_allocated on CUDA."""
    return peak.peak_above() + peak.base


def _child(kwargs_json: str) -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    result = measure(**json.loads(kwargs_json))
    if result is not None:
        print(RESULT_TAG + json.dumps(result, default=str), flush=True)


def run_case(kwargs: dict, nproc: int, threads: int) -> dict:
    """`measure` under torchrun in fresh processes; rank 0's result, or {'error': ...}."""
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, threads)), BENCH_THREADS=str(max(1, threads)))
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(Path(__file__).resolve()), "--child", json.dumps(kwargs)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
    return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}


def summarize(results: list[dict], info: dict) -> dict:
    head = ["model", "mode", "mean step", "mean generation", "generation: gathered weights", "generation: peak above start",
            "generation: process peak", "training steps: process peak"]  # fmt: skip
    table, means = [], {}
    for r in results:
        timed = r["rows"][1:] or r["rows"]
        step = sum(x["step_s"] for x in timed) / len(timed)
        gen = sum(x["generation_s"] for x in timed) / len(timed)
        gen_peak, gen_total, _, step_total, weights, shard = (max(x[i] for x in r["per_rank"]) for i in range(6))
        means[f"{r['model']}/{r['mode']}"] = {"step_s": step, "generation_s": gen, "generation_peak_bytes": gen_peak,
                                              "generation_process_peak_bytes": gen_total, "gathered_weight_bytes": weights,
                                              "shard_bytes": shard, "training_process_peak_bytes": step_total,
                                              "timed_steps": len(timed)}  # fmt: skip
        table.append([r["model"], r["mode"], fmt_s(step), fmt_s(gen), fmt_bytes(weights), fmt_bytes(gen_peak),
                      fmt_bytes(gen_total), fmt_bytes(step_total)])  # fmt: skip
    out = [format_machine(info), ""]
    for model in dict.fromkeys(r["model"] for r in results):
        r = next(x for x in results if x["model"] == model)
        out.append(f"- `{model}`: {r['params']:,} parameters (float32: {fmt_bytes(4 * r['params'])}), {r['world']} ranks, "
                   f"{len(r['rows']) - 1} timed steps after one warm-up; memory: {r['memory_method']}, the larger rank's; "
                   "gathered weights: the most parameter bytes held unsharded at the start of a block's forward.")  # fmt: skip
    out += ["", markdown_table(head, table), ""]
    return {"markdown": "\n".join(out), "means": means}


def main(argv=None) -> dict:
    a = parse_args(argv)
    info = start(a.wait_quiet, "cuda" if _cuda() else "cpu", a.threads)
    info["ranks"] = a.nproc
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-fsdp-gen-") as tmp:
        for model in a.models.split(","):
            model_and_data(model)  # built once here, not by two ranks at once
            for mode in MODES:
                print(f"{model} / {mode}: {a.steps} steps on {a.nproc} ranks", file=sys.stderr, flush=True)
                kwargs = {"model": model, "mode": mode, "steps": a.steps, "out_dir": f"{tmp}/{model}-{mode}", "quick": a.quick}
                r = run_case(kwargs, a.nproc, a.threads)
                if "error" in r:
                    raise SystemExit(f"fsdp_generation {model} {mode}: {r['error']}")
                results.append(r)
    report = summarize(results, info)
    print(report["markdown"])
    write_json(a.out, {"machine": info, "args": vars(a), "results": results, "means": report["means"],
                       "command": "python bench/fsdp_generation.py " + " ".join(argv if argv is not None else sys.argv[1:])})  # fmt: skip
    return report


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        _child(sys.argv[2])
    else:
        main()
