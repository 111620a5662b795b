"""A ready GPU check (issue 12): three training steps of paper-4b shapes on one GPU, DDP and FSDP2.

Builds a random-weight Qwen3.5 with Qwen3.5-4B's exact configuration (bench/configs/qwen3.5-4b.json;
its special-token ids remapped to the built-in character tokenizer, the vocabulary kept at 248,320, so
the LM head, the loss and the sampling cost what they cost on the real model) and writes it once in
bfloat16; the run loads it in float32 as training does. Then, for each strategy (DDP, then FSDP2 over
a one-GPU process group), a `opd.run.Run` with `--preset paper-4b`'s settings (bf16 autocast, float32
weights, --grad-checkpointing, --micro-batch 4, learned policy, rho 0.25) except the batch, reduced to
fit a few minutes: --prompts (4 instead of 28) x 8 rollouts, --response-len (256 instead of 1,024)
new tokens, --image-size (448 x 448 images). Each strategy runs one step on fixed rollouts
(`opd.engine.synthetic.fixed_rollouts`, the same for both: the match check) and then --steps steps with real
generation (the timing). Optional GPU kernels are used when importable (flash-attn,
flash-linear-attention, causal-conv1d); the script says which.

It prints, per strategy: generation tokens/s (valid response tokens over generation seconds), teacher
forward seconds per step and its MFU (model FLOPs of the teacher's real input tokens, vision patches,
full-attention scores and the teacher's LM-head products in the loss, over the seconds and the GPU's
dense bf16 peak), student forward+backward and optimizer seconds per step, the peak GPU memory, and
whether FSDP2 matches DDP on the fixed step (same selection and counts, loss and gradient norm within
--tolerance, relative; largest parameter difference after the step over the largest update).

On a CPU (or --model tiny) it runs the same code on the built-in tiny Qwen3.5 with tied embeddings
(as the 4B's) in seconds; tests/test_fsdp.py runs it that way.

    .venv/bin/python bench/gpu_check.py --out gpu_check.json          # on a GPU: about 5-8 minutes
    .venv/bin/python bench/gpu_check.py --device cpu --model tiny      # seconds
"""

import argparse
import gc
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._util import fmt_bytes, fmt_s, format_machine, markdown_table, start, write_json  # noqa: E402

CONFIG_4B = Path(__file__).resolve().parent / "configs" / "qwen3.5-4b.json"
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0,
                    "B200": 2250.0, "GB200": 2500.0}  # dense bf16, the SXM parts  # fmt: skip
KERNELS = ("flash_attn", "fla", "causal_conv1d")
STRATEGIES = ("ddp", "fsdp")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="auto", help="auto (cuda when available), cuda or cpu")
    p.add_argument("--model", default="auto", help="4b (Qwen3.5-4B's config), tiny, or auto: 4b on cuda, tiny on cpu")
    p.add_argument("--steps", type=int, default=3, help="timed training steps with real generation (default: 3)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step (default: 4; the paper's 28)")
    p.add_argument("--rollouts", type=int, default=8, help="rollouts per prompt (default: 8, the paper's)")
    p.add_argument("--response-len", type=int, default=256, help="most new tokens (default: 256; the paper's 1,024)")
    p.add_argument("--image-size", type=int, default=448, help="side of the generated images (default: 448)")
    p.add_argument("--strategies", default="ddp,fsdp", help="comma-separated: ddp, fsdp (default: both)")
    p.add_argument("--mixed-precision", default="auto", help="bf16, no, or auto: bf16 on cuda, no on cpu (CPU bf16 is slow)")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="the device's dense bf16 peak for MFU (default: by name)")
    p.add_argument("--tolerance", type=float, default=2e-2, help="relative loss / gradient-norm tolerance of the match")
    p.add_argument("--engine", action="store_true",
                   help="also time a step with --rollout-engine vllm beside HF generate (bench/engine_step.py: a vLLM "
                        "venv from scripts/install_vllm.sh; on a GPU that is `pip install vllm`)")  # fmt: skip
    p.add_argument("--out", default=None, help="write the measured numbers to this JSON file")
    a = p.parse_args(argv)
    import torch

    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.model == "auto":
        a.model = "4b" if a.device == "cuda" else "tiny"
    if a.mixed_precision == "auto":
        a.mixed_precision = "bf16" if a.device == "cuda" else "no"
    if a.model == "tiny" and "--response-len" not in (argv or sys.argv):
        a.response_len, a.image_size = 8, 64
    return a


def build_model(kind: str, folder: Path, image_size: int, device: str) -> Path:
    """A random-weight Qwen3.5 (4B's config, or the tiny one with tied embeddings) with the character-level
    processor, written by save_pretrained (bfloat16 for 4b)."""
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from opd.tiny import tiny_config, tiny_processor

    processor = tiny_processor(max_pixels=image_size * image_size)
    ids = processor.tokenizer.convert_tokens_to_ids
    eos, pad = ids("<|im_end|>"), ids("<|endoftext|>")
    if kind == "tiny":
        config = tiny_config(processor.tokenizer)
        config.tie_word_embeddings = config.text_config.tie_word_embeddings = True  # as Qwen3.5-4B's
    else:
        data = json.loads(CONFIG_4B.read_text())
        data = {k: v for k, v in data.items() if k not in ("architectures", "model_type")}
        data.update(image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
                    vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))  # fmt: skip
        data["text_config"] = {**data["text_config"], "eos_token_id": eos, "pad_token_id": pad}
        config = Qwen3_5Config(**data)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3_5ForConditionalGeneration(config)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = [eos, pad], pad
    if kind != "tiny":
        model = model.to(torch.bfloat16)  # half the bytes to write and read; the run loads it in float32
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    del model
    return folder


def torch_no_grad(fn):
    def wrapped(*args, **kwargs):
        import torch

        with torch.no_grad():
            return fn(*args, **kwargs)

    return wrapped


def kernels() -> dict[str, bool]:
    return {k: importlib.util.find_spec(k) is not None for k in KERNELS}


def peak_tflops(device: str, given: float) -> float | None:
    import torch

    if given:
        return given
    if not device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


class TeacherFlops:
    """Counts the teacher's useful FLOPs: 2 x (non-embedding text parameters) per real input token, 2 x
    (vision parameters) per patch, 4 x heads x head_dim x (causal half of L^2) per full-attention layer and
    row, and the teacher's LM-head products in the loss (2 V H per scored position, from the ledger)."""

    def __init__(self, run):
        model = run.teacher.model
        text = model.config.get_text_config()
        lm = model.model.language_model
        self.text_params = sum(p.numel() for p in lm.layers.parameters())
        self.vision_params = sum(p.numel() for p in model.model.visual.parameters())
        self.full_layers = sum(t == "full_attention" for t in text.layer_types)
        self.attn_width = text.num_attention_heads * text.head_dim
        self.head = text.vocab_size * text.hidden_size
        self.flops = 0.0
        model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs):
        mask = kwargs["attention_mask"]  # (n, L) 1 on real tokens
        lengths = mask.sum(-1).double()
        grid = kwargs.get("image_grid_thw")
        patches = float(grid.prod(-1).sum()) if grid is not None else 0.0
        self.flops += 2 * self.text_params * float(lengths.sum()) + 2 * self.vision_params * patches
        self.flops += 4 * self.full_layers * self.attn_width * float((lengths * lengths / 2).sum())

    def add_head(self, positions: int) -> None:
        self.flops += 2 * self.head * positions


@torch_no_grad
def perturb_teacher(model, scale: float = 0.25) -> None:
    """Moves the fresh teacher away from the student (seeded noise of `scale` x each weight's std, the same
    for a sharded and an unsharded teacher), so the fixed step's divergence is far above bf16 rounding."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    for i, (name, p) in enumerate(model.named_parameters()):
        full = p.full_tensor() if isinstance(p, DTensor) else p
        std = float(full.float().std()) if full.numel() > 1 else 0.0
        gen = torch.Generator().manual_seed(i)
        noise = (torch.randn(full.shape, generator=gen) * scale * (std or 0.02)).to(p.dtype)
        if isinstance(p, DTensor):
            p.to_local().add_(distribute_tensor(noise.to(p.device), p.device_mesh, p.placements).to_local())
        else:
            p.add_(noise.to(p.device))


def run_strategy(strategy: str, model_dir: Path, data: Path, a, out: Path) -> dict:
    """One Run: a fixed-rollout step (the match), then a.steps timed steps; returns the numbers."""
    import torch

    import opd.config
    import opd.run
    import opd.engine.rollout
    from opd.models.sharding import full_state_dict
    from opd.engine.synthetic import fixed_rollouts

    cuda = a.device.startswith("cuda")
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    settings = {**opd.config.PRESETS["paper-4b"], "model": str(model_dir), "data": str(data), "out": str(out),
                "prompts_per_step": a.prompts, "rollouts_per_prompt": a.rollouts, "max_response_len": a.response_len,
                "steps": a.steps + 1, "replay_start": 8, "replay_batch": 32, "save_every": 0, "policy": "learned",
                "rho": 0.25, "mixed_precision": a.mixed_precision, "fsdp": strategy == "fsdp"}  # fmt: skip
    t0 = time.perf_counter()
    run = opd.run.Run(opd.config.TrainConfig(**settings))
    load_s = time.perf_counter() - t0
    flops = TeacherFlops(run)
    selected, select = [], run.selector.select
    run.selector.select = lambda *args, **kw: selected.append(select(*args, **kw)) or selected[-1]
    generated = []
    real_generate = opd.engine.rollout.generate_rollouts

    def spy(*args, **kw):
        generated.append(real_generate(*args, **kw))
        return generated[-1]

    perturb_teacher(run.teacher.model)
    match_row = run.step(0, fixed_rollouts(run, 0, max_len=min(a.response_len, 32)))
    params = {k: v.float().clone() for k, v in full_state_dict(run.model).items()}  # kept while training goes on
    rows = []
    opd.engine.rollout.generate_rollouts = spy
    try:
        for step in range(1, a.steps + 1):
            before = flops.flops
            row = run.step(step)
            flops.add_head(row["scored_tokens"])
            row["teacher_flops"] = flops.flops - before
            row["generated_tokens"] = int(generated[-1].response_mask.sum())
            rows.append(row)
    finally:
        opd.engine.rollout.generate_rollouts = real_generate
    peak = torch.cuda.max_memory_allocated() if cuda else None
    result = {"strategy": strategy, "load_s": load_s, "match_row": match_row, "match_selected": selected[0][0].tolist(),
              "rows": rows, "peak_bytes": peak, "params_after_match": params}  # fmt: skip
    del run
    gc.collect()
    return result


def compare(ddp: dict, fsdp: dict, initial: dict, tolerance: float) -> dict:
    """FSDP2 against DDP on the fixed step."""
    a, b = ddp["match_row"], fsdp["match_row"]
    counts = all(a[k] == b[k] for k in ("candidates", "budget", "selected", "scored_tokens", "teacher_rows"))
    rel = lambda x, y: abs(x - y) / max(abs(x), 1e-30)  # noqa: E731
    update = max(float((ddp["params_after_match"][k] - initial[k].float()).abs().max()) for k in initial)
    diff = max(float((ddp["params_after_match"][k] - fsdp["params_after_match"][k]).abs().max()) for k in initial)
    ok = (counts and ddp["match_selected"] == fsdp["match_selected"] and rel(a["loss"], b["loss"]) <= tolerance
          and rel(a["grad_norm"], b["grad_norm"]) <= tolerance and diff <= 2 * max(update, 1e-12))  # fmt: skip
    return {"same_selection_and_counts": counts and ddp["match_selected"] == fsdp["match_selected"],
            "loss_rel_diff": rel(a["loss"], b["loss"]), "grad_norm_rel_diff": rel(a["grad_norm"], b["grad_norm"]),
            "max_param_diff": diff, "max_update": update, "matches": ok}  # fmt: skip


def summarize(results: list[dict], match: dict | None, info: dict, a, peak: float | None) -> str:
    head = ["strategy", "generation tokens/s", "teacher forward / step", "teacher MFU", "student fwd+bwd / step",
            "optimizer / step", "step", "peak GPU memory", "load"]  # fmt: skip
    table = []
    for r in results:
        if "error" in r:
            table.append([r["strategy"], r["error"]] + ["-"] * (len(head) - 2))
            continue
        rows = r["rows"]
        gen_s = sum(x["generation_s"] for x in rows)
        tokens = sum(x["generated_tokens"] for x in rows)
        teacher_s = sum(x["teacher_forward_s"] for x in rows)
        mfu = (sum(x["teacher_flops"] for x in rows) / teacher_s / (peak * 1e12)) if peak and teacher_s else None
        n = len(rows)
        table.append([r["strategy"].upper().replace("FSDP", "FSDP2"), f"{tokens / gen_s:,.0f}" if gen_s else "-",
                      fmt_s(teacher_s / n), f"{100 * mfu:.1f}%" if mfu is not None else "n/a (no peak known)",
                      fmt_s(sum(x["student_s"] for x in rows) / n), fmt_s(sum(x["optimizer_s"] for x in rows) / n),
                      fmt_s(sum(x["step_s"] for x in rows) / n), fmt_bytes(r["peak_bytes"]) if r["peak_bytes"] else "n/a (CPU)",
                      fmt_s(r["load_s"])])  # fmt: skip
    lines = [format_machine(info), "",
             f"Model {a.model} ({info['params']:,} parameters), {a.prompts} prompts x {a.rollouts} rollouts, {a.response_len} "
             f"new tokens, {a.image_size} px images, {a.mixed_precision} autocast, float32 weights, {a.steps} timed steps after one "
             f"fixed-rollout step; kernels: " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in info["kernels"].items()),
             "", markdown_table(head, table), ""]  # fmt: skip
    if match is not None:
        lines.append(f"FSDP2 on one device matches DDP: **{'yes' if match['matches'] else 'NO'}** (same selection and counts: "
                     f"{match['same_selection_and_counts']}; loss {match['loss_rel_diff']:.1e} and gradient norm "
                     f"{match['grad_norm_rel_diff']:.1e} relative; largest parameter difference {match['max_param_diff']:.2e} "
                     f"against a largest update of {match['max_update']:.2e}).")  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> dict:
    a = parse_args(argv)
    import torch

    from opd.tiny import build_tiny_dataset

    if a.device == "cpu":
        torch.set_num_threads(1)  # the tiny model's ops are too small for threads (see tests/conftest.py)
    info = start(0.0, a.device, torch.get_num_threads())
    info["kernels"] = kernels()
    peak = peak_tflops(a.device, a.peak_tflops)
    results, match = [], None
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        model_dir = build_model(a.model, tmp / "model", a.image_size, a.device)
        data = build_tiny_dataset(tmp / "data", n=max(32, a.prompts * (a.steps + 1)), size=a.image_size)
        info["build_s"] = time.perf_counter() - t0
        from opd.models.loading import load_model

        model = load_model(str(model_dir), "float32")
        info["params"] = sum(p.numel() for p in model.parameters())  # tied weights once
        initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        del model
        for strategy in a.strategies.split(","):
            try:
                results.append(run_strategy(strategy, model_dir, data, a, tmp / strategy))
            except torch.OutOfMemoryError as exc:
                results.append({"strategy": strategy, "error": f"out of memory: {str(exc).splitlines()[0][:120]}"})
                gc.collect()
                torch.cuda.empty_cache()
        done = {r["strategy"]: r for r in results if "error" not in r}
        if {"ddp", "fsdp"} <= done.keys():
            match = compare(done["ddp"], done["fsdp"], initial, a.tolerance)
    report = summarize(results, match, info, a, peak)
    if a.engine:  # the rollout engines side by side (issue 22)
        from bench import engine_step

        gc.collect()  # the strategies' models and optimizers: their GPU memory back before vLLM takes its share
        if a.device == "cuda":
            torch.cuda.empty_cache()
        engines = engine_step.main(["--steps", str(max(2, a.steps + 1)), "--max-response-len", str(a.response_len),
                                    "--gpu-memory-utilization", "0.3"])  # the trainer shares the GPU with vLLM
        info["engines"] = engines["results"]
        report += "\n\nRollout engines (bench/engine_step.py):\n\n" + engines["markdown"]
    print(report)
    for r in results:
        r.pop("params_after_match", None)
    write_json(a.out, {"machine": info, "args": vars(a), "peak_tflops": peak, "results": results, "match": match,
                       "markdown": report})  # fmt: skip
    return {"markdown": report, "match": match, "results": results}


if __name__ == "__main__":
    main()
