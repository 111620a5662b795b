"""Qwen3.5-4B's exact shapes on a CPU (issue 36): a LoRA run of `--preset paper-4b` rehearsed without a GPU.

Builds a random-weight Qwen3.5 with Qwen3.5-4B's configuration (bench/configs/qwen3.5-4b.json: the 248,320-token
vocabulary, hidden 2,560, 32 layers of which 8 full attention, the 24-block vision tower, tied embeddings) directly
in bfloat16 (no float32 copy: 9.3 GB instead of 18.6), its special-token ids remapped to the built-in character
tokenizer as bench/gpu_check.py does, written once by save_pretrained into the bench cache ($BAS_OPD_CACHE/bench),
so the run loads it through the real from_pretrained path; and a second one of another seed as the external teacher
of --methods' teacher methods (gkd, tm-opd). A tiny dataset: --prompts x --steps records, each a --image-size image
(448 x 448: 196 image tokens) with its crop (opd.tiny's generator).

Then, per method, `train.py --preset paper-4b --lora-r 64 --dtype bfloat16` (bf16 autocast, activation
checkpointing, micro-batch 4, learned policy at rho 0.25 for bas-opd; gkd queries every row) with the batch reduced
to --prompts x --rollouts and --response-len new tokens, for --steps steps, in a fresh process: train.py's `main`,
so `opd.run.Run` end to end (load, generation, selection, teacher, chunked loss, backward, AdamW, EMA, the selector,
the adapter checkpoint and the summary). It prints each ledger phase's seconds per step, the load and wall time,
and the peak resident set: the process's VmHWM, reset at every phase boundary so each phase (and, inside the
objective, the teacher forward, the student forward, the chunked loss and the backward) has its own peak, the run's
peak the largest of them; the parent's 50 ms samples of VmRSS check it. Beside it, bench/memory_table.py's LoRA
estimate for the same settings (prompt length as measured, the micro-batch's real rows, one generate() call of
every row; an external teacher adds its bf16 weights, 2 P, and drops the EMA adapter), and that plus the
process's runtime (its resident set with torch, transformers, accelerate and peft imported, before any model).

    .venv/bin/python bench/cpu_4b.py --out docs/bench/cpu_4b.json          # about 12 min on 2 idle cores, 24 GB RAM
    .venv/bin/python bench/cpu_4b.py --reduced --methods bas-opd           # the real vocabulary, 4 small layers: 1 min

`--reduced` keeps the vocabulary, the head dimensions, the vision width and every module name, with hidden 256,
4 text layers (3 linear, 1 full attention) and 2 vision blocks (tests/test_cpu_4b.py runs it, slow-marked).
"""

import argparse
import json
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._util import GB, _status_kb, bench_cache, fmt_s, format_machine, markdown_table, run_case, start, write_json

CONFIG_4B = Path(__file__).resolve().parent / "configs" / "qwen3.5-4b.json"
REDUCED = {"hidden": 256, "layers": 4, "vision_depth": 2}
"""The reduced variant (--reduced): the 4B's vocabulary, head dims, vision width and module names, small otherwise."""
TEACHER_METHODS = ("gkd", "tm-opd", "opod")
BUILD_VERSION = "1"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", default="bas-opd,gkd", help="comma-separated methods (default: bas-opd,gkd; a "
                   "teacher method gets the second random model as --teacher-model)")  # fmt: skip
    p.add_argument("--prompts", type=int, default=2, help="prompts per step (default: 2; the paper's 28)")
    p.add_argument("--rollouts", type=int, default=2, help="rollouts per prompt (default: 2; the paper's 8)")
    p.add_argument("--response-len", type=int, default=32, help="most new tokens (default: 32; the paper's 1,024)")
    p.add_argument("--steps", type=int, default=2, help="training steps per method (default: 2)")
    p.add_argument("--image-size", type=int, default=448, help="side of the images (default: 448: 196 image tokens)")
    p.add_argument("--lora-r", type=int, default=64, help="LoRA rank (default: 64)")
    p.add_argument("--reduced", action="store_true", help="the reduced variant (hidden 256, 4 layers, 2 vision "
                   "blocks; the real vocabulary and module names): a minute, for tests")  # fmt: skip
    p.add_argument("--teacher-layers", type=int, default=8, help="text layers of the external teacher (default: 8, "
                   "the 4B's first 8: 6 linear and 2 full attention, its vocabulary, hidden and vision tower; 0: all 32, "
                   "another 9.1 GB)")  # fmt: skip
    p.add_argument("--threads", type=int, default=2, help="torch threads of the training process (default: 2)")
    p.add_argument("--rss-cap-gb", type=float, default=22.0, help="kill a process above this resident set (GiB)")
    p.add_argument("--timeout-min", type=float, default=120.0, help="kill a training process after this long")
    p.add_argument("--cache", default=None, help="where the models and data are built (default: the bench cache)")
    p.add_argument("--out", default=None, help="write the numbers to this JSON file")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------------------- the model


def model_config(processor, shape: dict | None = None):
    """Qwen3.5-4B's Qwen3_5Config with the character tokenizer's special ids (vocabulary kept); `shape` replaces
    any of: hidden (with intermediate 4 x hidden and fewer heads: REDUCED), layers (the first n of the 4B's layer
    types) and vision_depth; everything else is the 4B's."""
    from transformers import Qwen3_5Config

    shape = shape or {}
    ids = processor.tokenizer.convert_tokens_to_ids
    data = json.loads(CONFIG_4B.read_text())
    data = {k: v for k, v in data.items() if k not in ("architectures", "model_type")}
    data.update(image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
                vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))  # fmt: skip
    text = {**data["text_config"], "eos_token_id": ids("<|im_end|>"), "pad_token_id": ids("<|endoftext|>")}
    vision = dict(data["vision_config"])
    if "hidden" in shape:
        h = shape["hidden"]
        text.update(hidden_size=h, intermediate_size=4 * h, num_attention_heads=2, num_key_value_heads=1,
                    linear_num_key_heads=2, linear_num_value_heads=4)  # fmt: skip
        vision.update(out_hidden_size=h)
    if "layers" in shape:
        text.update(num_hidden_layers=shape["layers"], layer_types=text["layer_types"][: shape["layers"]])
    if "vision_depth" in shape:
        vision.update(depth=shape["vision_depth"])
    data["text_config"], data["vision_config"] = text, vision
    return Qwen3_5Config(**data)


def shape_tag(shape: dict | None) -> str:
    return "-".join(f"{k}{v}" for k, v in sorted((shape or {}).items())) or "full"


def build_model(folder: str, seed: int, image_size: int, shape: dict | None = None) -> dict:
    """Writes the random-weight model (bfloat16, drawn after torch.manual_seed(seed)) and the character processor
    (images up to image_size^2 pixels) into `folder` by save_pretrained, once (a complete folder is reused)."""
    import torch
    from transformers import Qwen3_5ForConditionalGeneration

    from opd.tiny import _atomic_dir, tiny_processor

    info = {}

    def write(tmp: Path):
        t0 = time.perf_counter()
        processor = tiny_processor(max_pixels=image_size * image_size)
        config = model_config(processor, shape)
        torch.manual_seed(seed)
        model = Qwen3_5ForConditionalGeneration._from_config(config, dtype=torch.bfloat16)  # (no float32 copy)
        ids = processor.tokenizer.convert_tokens_to_ids
        model.generation_config.eos_token_id = [ids("<|im_end|>"), ids("<|endoftext|>")]
        model.generation_config.pad_token_id = ids("<|endoftext|>")
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        info.update(params=sum(p.numel() for p in model.parameters()), build_s=time.perf_counter() - t0)

    _atomic_dir(Path(folder), write)
    return {"folder": folder, **info}


def shapes(a) -> tuple[dict | None, dict]:
    """(the policy's shape, the external teacher's): the 4B's (None), or REDUCED; the teacher has --teacher-layers."""
    policy = REDUCED if a.reduced else None
    teacher = dict(policy or {})
    if a.teacher_layers:
        teacher["layers"] = min(a.teacher_layers, (policy or {}).get("layers", a.teacher_layers))
    return policy, teacher


def models_and_data(a, cache: Path) -> tuple[Path, Path | None, Path, list[dict]]:
    """(policy folder, teacher folder or None, training JSONL, the builds' numbers), each built in a fresh process."""
    from opd.tiny import build_tiny_dataset

    wants_teacher = any(m in TEACHER_METHODS for m in a.methods.split(","))
    wanted = list(zip((0, 1), shapes(a)))[: 1 + wants_teacher]
    folders, builds = [], []
    for seed, shape in wanted:
        folder = cache / f"qwen3.5-4b-{shape_tag(shape)}-random-bf16-img{a.image_size}-s{seed}-v{BUILD_VERSION}"
        folders.append(folder)
        if (folder / ".complete").exists():
            continue
        r = run_case("bench.cpu_4b:build_model", {"folder": str(folder), "seed": seed, "image_size": a.image_size,
                     "shape": shape}, threads=a.threads, rss_cap_bytes=int(a.rss_cap_gb * GB))  # fmt: skip
        if "error" in r:
            raise SystemExit(f"bench/cpu_4b.py: building {folder} failed: {r['error']}")
        builds.append(r)
    n = a.prompts * a.steps
    data = build_tiny_dataset(cache / f"data-img{a.image_size}-n{n}", n=n, size=a.image_size)
    return folders[0], folders[1] if wants_teacher else None, data, builds


# ------------------------------------------------------------------------------------------- the training process


def _hwm() -> int:
    return _status_kb("VmHWM") * 1024


def _reset_hwm() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


class Windows:
    """Peak resident set, wall and CPU seconds per named window: VmHWM read and reset at every window boundary, so
    each window's peak is its own and the run's is the largest of all; a nested window pauses the outer one (its
    seconds are exclusive). CPU seconds are the process's (every thread's), which a loaded machine stretches less
    than wall seconds."""

    def __init__(self):
        self.peak: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.stack = [["other", time.perf_counter(), time.process_time()]]
        _reset_hwm()

    def _close(self, entry: list) -> None:
        """Books `entry`'s window up to now (peak, seconds) and restarts its clocks and the high-water mark."""
        name, wall, cpu = entry
        self.peak[name] = max(self.peak.get(name, 0), _hwm())
        now, now_cpu = time.perf_counter(), time.process_time()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - wall
        self.cpu[name] = self.cpu.get(name, 0.0) + now_cpu - cpu
        entry[1:] = now, now_cpu
        _reset_hwm()

    @contextmanager
    def window(self, name: str):
        self._close(self.stack[-1])
        self.stack.append([name, time.perf_counter(), time.process_time()])
        try:
            yield
        finally:
            self._close(self.stack.pop())
            self.stack[-1][1:] = time.perf_counter(), time.process_time()  # the outer window's clocks go on

    def wrap(self, owner, attr: str, name: str) -> None:
        """owner.attr (a function or method) runs inside window `name`."""
        fn = getattr(owner, attr)

        def wrapped(*args, **kwargs):
            with self.window(name):
                return fn(*args, **kwargs)

        setattr(owner, attr, wrapped)

    def finish(self) -> int:
        self._close(self.stack[-1])
        return max(self.peak.values())


def instrument(windows: Windows, runs: list) -> None:
    """The windows: the run's construction, every ledger phase, and inside the objective (not a ledger phase: its
    seconds are split into teacher_forward and student) the teacher's and student's forwards, the loss and the
    backward. Every Run built is appended to `runs`."""
    import opd.methods.objective
    import opd.methods.micro_batch
    import opd.models.ema_teacher
    import opd.models.adapter_teacher
    import opd.loop.step
    import opd.run
    import opd.methods.lockstep

    init = opd.run.Run.__init__
    opd.run.Run.__init__ = lambda self, *args, **kw: runs.append(self) or init(self, *args, **kw)
    windows.wrap(opd.run.Run, "__init__", "load")
    timer_call = opd.loop.step.PhaseTimer.__call__

    @contextmanager
    def phase(self, name):
        with timer_call(self, name), windows.window(name):
            yield

    opd.loop.step.PhaseTimer.__call__ = phase
    for cls in (opd.models.ema_teacher.Teacher, opd.models.adapter_teacher.AdapterTeacher):
        windows.wrap(cls, "hidden", "objective: teacher forward")
        windows.wrap(cls, "logits", "objective: teacher forward")
    windows.wrap(opd.methods.objective, "response_logits", "objective: student forward")
    windows.wrap(opd.methods.micro_batch, "response_hidden", "objective: student forward")
    windows.wrap(opd.methods.micro_batch, "response_logits", "objective: student forward")
    windows.wrap(opd.methods.micro_batch, "budgeted_loss_from_hidden", "objective: chunked loss")
    windows.wrap(opd.methods.lockstep.MicroBatch, "backward", "objective: backward")
    windows.wrap(opd.run.Run, "step", "step (outside phases)")


def train_case(argv: list[str], out: str) -> dict:
    """train.py's main(argv) in this (fresh) process, instrumented; returns the ledger, the windows' peaks and
    seconds, the wall time, and the runtime's resident set before any model (Python with torch, transformers,
    accelerate, peft and the loop imported: what a CPU process holds beyond memory_table.py's GPU count)."""
    import accelerate  # noqa: F401  (the runtime measured below)
    import peft  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import opd.run  # noqa: F401
    import train
    from opd.loop.ledger import read_ledger
    from opd.models.lora import _tuner_layers

    runtime = _status_kb("VmRSS") * 1024
    windows, runs = Windows(), []
    instrument(windows, runs)
    t0 = time.perf_counter()
    train.main(argv)
    wall = time.perf_counter() - t0
    peak = windows.finish()
    model = runs[0].model
    return {"rows": read_ledger(Path(out) / "ledger.jsonl"), "peak_bytes": peak, "window_peaks": windows.peak,
            "window_seconds": windows.seconds, "window_cpu_s": windows.cpu, "wall_s": wall, "runtime_bytes": runtime,
            "adapted_modules": len(_tuner_layers(model)),
            "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad)}  # fmt: skip


def train_argv(a, method: str, model: Path, teacher: Path | None, data: Path, out: Path) -> list[str]:
    argv = ["--preset", "paper-4b", "--lora-r", str(a.lora_r), "--dtype", "bfloat16", "--model", str(model),
            "--data", str(data), "--prompts-per-step", str(a.prompts), "--rollouts-per-prompt", str(a.rollouts),
            "--max-response-len", str(a.response_len), "--steps", str(a.steps), "--method", method,
            "--out", str(out), "--report-to", "none"]  # fmt: skip
    if method in TEACHER_METHODS:
        argv += ["--teacher-model", str(teacher)]
    return argv


# ------------------------------------------------------------------------------------------------------- estimate


def estimate(model: Path, teacher: Path | None, rows: dict, prompt_len: int, a, image_tokens: int) -> dict:
    """bench/memory_table.py's LoRA estimate for these settings: `rows` the ledger's first row (the student's and
    teacher's rows of a micro-batch: the selected ones, at most 4), prompts of `prompt_len` tokens, one generate()
    call of every rollout; an external `teacher` adds its bf16 weights (2 P_T) and drops the EMA adapter (4 A)."""
    from transformers import AutoConfig

    from bench.memory_table import Settings, estimate_lora, model_shape

    shape = model_shape(AutoConfig.from_pretrained(model))
    micro = max(1, min(4, rows["selected"]))
    s = Settings(prompts_per_step=a.prompts, rollouts_per_prompt=a.rollouts, prompt_len=prompt_len,
                 response_len=a.response_len, micro_batch=micro, rollout_batch=a.prompts * a.rollouts,
                 image_tokens=image_tokens)  # fmt: skip
    e = estimate_lora(shape, s, a.lora_r)
    if teacher is not None:
        e["teacher"], e["external_teacher"] = 0.0, 2.0 * model_shape(AutoConfig.from_pretrained(teacher)).params
        e["peak"] += e["external_teacher"] - 4 * e["adapter_params"]
    return {**e, "micro_batch": micro, "prompt_len": prompt_len, "params": shape.params}


def prompt_tokens(model: Path, data: Path) -> tuple[int, int]:
    """(the longest student prompt in tokens, the most image tokens of one) over the dataset, by the model's
    processor (opd.models.chat.encode_prompt of the full view, as training encodes it)."""
    from opd.models.chat import encode_prompt
    from opd.data.sources import load_records
    from opd.models.loading import load_processor
    from opd.data.records import get_view

    processor, view = load_processor(str(model)), get_view("full")
    longest, image = 0, 0
    for record in load_records(str(data)):
        enc = encode_prompt(processor, *view(record))
        longest = max(longest, len(enc))
        image = max(image, int(enc.image_grid_thw.prod()) // 4)  # 2 x 2 patches merge into one token
    return longest, image


# --------------------------------------------------------------------------------------------------------- report

def gb(n: float | None) -> str:
    """Bytes in GB = 10^9 bytes, as bench/memory_table.py counts."""
    return "-" if n is None else f"{n / 1e9:.2f} GB"


PHASE_ORDER = ("prompt", "generation", "select", "teacher_forward", "student", "optimizer", "ema", "selector", "wait")


def summarize(results: list[dict], info: dict, a) -> str:
    lines = [format_machine(info), ""]
    for r in results:
        if "error" in r:
            lines += [f"**{r['method']}**: {r['error']} (peak sampled {gb(r.get('child_peak_rss_bytes'))})", ""]
            continue
        rows = r["rows"]
        head = ["phase", *(f"step {x['step']}" for x in rows)]
        table = [[p, *(fmt_s(x[f"{p}_s"]) for x in rows)] for p in PHASE_ORDER]
        table.append(["**step**", *(f"**{fmt_s(x['step_s'])}**" for x in rows)])
        e = r["estimate"]
        counts = {k: ", ".join(format(x[k], ".4g") for x in rows) for k in ("selected", "candidates", "scored_tokens",
                                                                            "loss")}  # fmt: skip
        cpu = r.get("window_cpu_s", {})
        windows = [[k, gb(v), fmt_s(r["window_seconds"].get(k)), fmt_s(cpu.get(k))]
                   for k, v in sorted(r["window_peaks"].items(), key=lambda kv: -kv[1])]  # fmt: skip
        lines += [
            (f"**{r['method']}** (`train.py {' '.join(r['argv'])}`): wall {fmt_s(r['wall_s'])}, load "
             f"{fmt_s(r['window_seconds'].get('load'))}; selected {counts['selected']} of {counts['candidates']} "
             f"candidates, scored tokens {counts['scored_tokens']}, loss {counts['loss']}; LoRA on "
             f"{r.get('adapted_modules', '?')} modules, {r.get('trainable_params', 0):,} trainable parameters."),
            "", markdown_table(head, table), "",
            (f"Peak resident set **{gb(r['peak_bytes'])}** (sampled every 50 ms by the parent: "
             f"{gb(r['child_peak_rss_bytes'])}); memory_table.py's estimate **{gb(e['peak'])}** (micro-batch "
             f"{e['micro_batch']}, prompt {e['prompt_len']} tokens), plus the process's runtime "
             f"{gb(r.get('runtime_bytes'))}: {gb(e['peak'] + r.get('runtime_bytes', 0))}. Peak per window:"),
            "", markdown_table(["window", "peak resident", "wall seconds", "CPU seconds"], windows), "",
        ]  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> dict:
    a = parse_args(argv)
    info = start(0.0, "cpu", a.threads)
    cache = Path(a.cache) if a.cache else bench_cache()
    t0 = time.perf_counter()
    model, teacher, data, builds = models_and_data(a, cache)
    info["build_s"] = time.perf_counter() - t0
    prompt_len, image_tokens = prompt_tokens(model, data)
    results = []
    for method in a.methods.split(","):
        with tempfile.TemporaryDirectory(prefix=f"cpu-4b-{method}-") as tmp:
            out = Path(tmp) / "run"
            args = train_argv(a, method, model, teacher, data, out)
            r = run_case("bench.cpu_4b:train_case", {"argv": args, "out": str(out)}, threads=a.threads,
                         rss_cap_bytes=int(a.rss_cap_gb * GB), timeout_s=60 * a.timeout_min)  # fmt: skip
        r.update(method=method, argv=[x if not x.startswith(str(cache)) else x.replace(str(cache), "$CACHE")
                                      for x in args])  # fmt: skip
        if "error" not in r:
            external = teacher if method in TEACHER_METHODS else None
            r["estimate"] = estimate(model, external, r["rows"][0], prompt_len, a, image_tokens)
        results.append(r)
        print(f"bench/cpu_4b.py: {method}: {r.get('error') or gb(r['peak_bytes'])}", file=sys.stderr, flush=True)
    info["total_s"] = time.perf_counter() - t0
    report = summarize(results, info, a)
    print(report)
    write_json(a.out, {"machine": info, "args": vars(a), "builds": builds, "prompt_len": prompt_len,
                       "image_tokens": image_tokens, "results": results, "markdown": report})  # fmt: skip
    return {"markdown": report, "results": results, "machine": info}


if __name__ == "__main__":
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    main()
