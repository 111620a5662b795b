"""Shared helpers of the benchmark scripts: machine facts, fresh-process runs with peak memory,
median timing, Markdown tables, quiet-machine waits, and the models/rollouts the training benchmarks use.

Peak memory on the CPU is the process's resident set: the baseline is VmRSS once a case has built its
inputs, the high-water mark VmHWM is then reset (`echo 5 > /proc/self/clear_refs`) and read after the
timed runs, so the reported number is the peak *above* everything that existed before (falling back to
ru_maxrss, which also counts earlier peaks, where clear_refs is not writable). On CUDA it is
torch.cuda.max_memory_allocated above memory_allocated. Each case of a memory benchmark runs in a fresh
interpreter (`run_case(..., isolated=True)`), whose resident set the parent samples and kills above a
cap, so a wrong estimate cannot take the machine down.
"""

import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python bench/x.py` puts bench/ on the path, not the repository root
    sys.path.insert(0, str(ROOT))

RESULT_TAG = "BENCH_RESULT "
GB = 1024**3
MB = 1024**2


# ---------------------------------------------------------------------------------------------- machine


def _lscpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def mem_total_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def loadavg() -> tuple[float, float, float]:
    a, b, c = Path("/proc/loadavg").read_text().split()[:3]
    return float(a), float(b), float(c)


def machine_info(device: str = "cpu", threads: int | None = None) -> dict:
    """CPU model, cores, RAM, library versions, threads, load average (and the GPU on cuda)."""
    import torch
    import transformers

    info = {
        "cpu": _lscpu_model(),
        "cores": os.cpu_count(),
        "ram_gb": round(mem_total_bytes() / GB, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": threads if threads is not None else torch.get_num_threads(),
        "loadavg": loadavg(),
        "device": device,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def format_machine(info: dict) -> str:
    gpu = f", GPU {info['gpu']}" if info.get("gpu") else ""
    load = " / ".join(f"{x:.2f}" for x in info["loadavg"])
    return (
        f"Machine: {info['cpu']}, {info['cores']} cores, {info['ram_gb']} GB RAM{gpu}; Python {info['python']}, "
        f"torch {info['torch']}, transformers {info['transformers']}; {info['threads']} thread(s); "
        f"device {info['device']}; load average {load} at start."
    )


def wait_quiet(max_minutes: float, threshold: float = 1.0, poll_s: float = 60.0) -> tuple[float, float, float]:
    """Polls /proc/loadavg until the 1-minute load is below `threshold` or `max_minutes` have passed;
    returns the load average seen last. max_minutes 0 returns at once."""
    deadline = time.monotonic() + 60.0 * max_minutes
    load = loadavg()
    while load[0] >= threshold and time.monotonic() < deadline:
        print(f"waiting for a quiet machine: load {load[0]:.2f} >= {threshold}", file=sys.stderr, flush=True)
        time.sleep(min(poll_s, max(1.0, deadline - time.monotonic())))
        load = loadavg()
    return load


def add_run_args(p, *, mixed_precision: bool = True, what: str = "model") -> None:
    """The flags every benchmark script shares: --threads, --mixed-precision (optional), --in-process,
    --wait-quiet. `what` names the unit that runs in a fresh process (a model, a case)."""
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default: 1; 0 = torch's default)")
    if mixed_precision:
        p.add_argument("--mixed-precision", default="auto", help="no, bf16, or auto = bf16 on cuda, no on cpu")
    p.add_argument("--in-process", action="store_true", help=f"run each {what} in this process, not a fresh one")
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        help="first wait up to this many minutes for a 1-minute load average below 1.0 (default: 0)",
    )


def start(wait_minutes: float, device: str, threads: int) -> dict:
    """Waits for a quiet machine (`wait_quiet`), then returns `machine_info` with the load average at the start."""
    import torch

    load = wait_quiet(wait_minutes)
    info = machine_info(device, threads if threads > 0 else torch.get_num_threads())
    info["loadavg"] = load
    return info


def set_threads(threads: int) -> None:
    """torch intra-op threads (0 keeps torch's default)."""
    import torch

    if threads > 0:
        torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------ measurement


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


class PeakMemory:
    """Peak memory of the code between `start()` and `peak_above()`, above what existed at `start()`."""

    def __init__(self, device: str = "cpu"):
        self.device = device
        self.cuda = device.startswith("cuda")
        self.base = 0
        self.method = ""

    def start(self) -> int:
        """Records the baseline (and resets the high-water mark); returns the baseline in bytes."""
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            self.base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            self.method = "torch.cuda.max_memory_allocated"
            return self.base
        self.base = _status_kb("VmRSS") * 1024
        try:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            self.method = "VmHWM (reset after the inputs)"
        except OSError:
            self.method = "ru_maxrss (process lifetime)"
        return self.base

    def peak_above(self) -> int:
        """Peak bytes above the baseline since `start()`."""
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        if self.method.startswith("VmHWM"):
            peak = _status_kb("VmHWM") * 1024
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return max(0, peak - self.base)


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_repeats(fn: Callable[[], object], repeats: int, budget_s: float = 0.0, device: str = "cpu") -> list[float]:
    """Seconds of `repeats` calls of fn (call the warm-up yourself). With budget_s > 0, stops early once
    the timed calls have taken that long (at least one call)."""
    times = []
    for _ in range(max(1, repeats)):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
        if budget_s and sum(times) >= budget_s:
            break
    return times


def median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


# -------------------------------------------------------------------------------------- fresh processes


def _rss_of(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_case(
    target: str,
    kwargs: dict,
    isolated: bool = True,
    threads: int = 1,
    rss_cap_bytes: int = 0,
    timeout_s: float = 3600.0,
) -> dict:
    """Calls `module:function`(**kwargs) -> dict, in a fresh interpreter when `isolated`.

    The child's resident set is sampled every 50 ms; above rss_cap_bytes (0: no cap) it is killed and
    the result is {"error": ...}, as it is for a crash or a time-out.
    """
    if not isolated:
        module, func = target.split(":")
        set_threads(threads)
        return getattr(__import__(module, fromlist=[func]), func)(**kwargs)
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, threads)), MKL_NUM_THREADS=str(max(1, threads)))
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", target, json.dumps(kwargs), str(threads)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0, peak_rss, killed = time.monotonic(), 0, ""
    # Drain pipes in threads so a chatty child cannot block on a full pipe while we poll.
    import threading

    chunks = {"out": [], "err": []}
    readers = [
        threading.Thread(target=lambda s=s, k=k: chunks[k].append(s.read()), daemon=True)
        for s, k in ((proc.stdout, "out"), (proc.stderr, "err"))
    ]
    for r in readers:
        r.start()
    while proc.poll() is None:
        rss = _rss_of(proc.pid)
        peak_rss = max(peak_rss, rss)
        if rss_cap_bytes and rss > rss_cap_bytes:
            killed = f"killed: resident set {rss / GB:.1f} GB above the cap {rss_cap_bytes / GB:.1f} GB"
        elif time.monotonic() - t0 > timeout_s:
            killed = f"killed: ran past {timeout_s:.0f} s"
        if killed:
            proc.kill()
            break
        time.sleep(0.05)
    proc.wait()
    for r in readers:
        r.join(timeout=10)
    out, err = "".join(chunks["out"]), "".join(chunks["err"])
    if killed:
        return {"error": killed, "child_peak_rss_bytes": peak_rss}
    for line in reversed(out.splitlines()):
        if line.startswith(RESULT_TAG):
            result = json.loads(line[len(RESULT_TAG) :])
            result["child_peak_rss_bytes"] = peak_rss
            return result
    tail = (err or out).strip().splitlines()[-5:]
    return {"error": f"exit {proc.returncode}: " + " | ".join(tail), "child_peak_rss_bytes": peak_rss}


def _child(target: str, kwargs_json: str, threads: str) -> None:
    set_threads(int(threads))
    module, func = target.split(":")
    result = getattr(__import__(module, fromlist=[func]), func)(**json.loads(kwargs_json))
    print(RESULT_TAG + json.dumps(result), flush=True)


# ------------------------------------------------------------------------------------------------ output


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    return f"{n / GB:.2f} GB" if abs(n) >= GB else f"{n / MB:.0f} MB"


def fmt_s(s: float | None) -> str:
    if s is None or math.isnan(s):
        return "-"
    return f"{s:.2f} s" if s >= 1 else f"{1000 * s:.1f} ms"


def fmt_ratio(x: float | None, digits: int = 2) -> str:
    if x is None or math.isnan(x):
        return "-"
    return f"{x:.{digits}f}x"


def markdown_table(headers: list[str], rows: list[list], align: str | None = None) -> str:
    """A Markdown table; `align` is one character per column, l or r (default: first l, rest r)."""
    align = align or "l" + "r" * (len(headers) - 1)
    sep = ["---" if a == "l" else "---:" for a in align]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def write_json(path: str | None, payload: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2, default=str) + "\n", encoding="utf-8")


def met(ok: bool | None) -> str:
    return "-" if ok is None else ("met" if ok else "NOT met")


# --------------------------------------------------------------------------------- models and rollouts


def bench_cache() -> Path:
    """Where the benchmark's own models and data are built: $BAS_OPD_CACHE/bench (opd.tiny's cache)."""
    from opd.tiny import cache_dir

    return cache_dir() / "bench"


def model_and_data(kind: str, image_size: int = 384, seed: int = 0, **config) -> tuple[Path, Path]:
    """(model folder, training JSONL) of a built-in model kind.

    "tiny": the built-in default (opd.tiny.tiny_defaults). "mid": a random-weight Qwen3.5 from
    opd.tiny's config builder with `config` (default hidden 512, 8 layers, vision depth 4) and a
    processor whose max_pixels admits the generated `image_size`^2 images (opd.tiny's own processor
    caps images at 64 x 64 pixels), with opd.tiny's dataset generator at that image size.
    """
    from opd.tiny import build_tiny_dataset, build_tiny_model, tiny_defaults

    if kind == "tiny":
        return tiny_defaults()
    if kind != "mid":
        raise ValueError(f"unknown model kind {kind!r}: tiny or mid")
    config = {"hidden": 512, "layers": 8, "vision_depth": 4, **config}
    name = "mid-" + "-".join(f"{k}{v}" for k, v in sorted(config.items())) + f"-img{image_size}-s{seed}"
    model_dir = build_tiny_model(bench_cache() / name, seed, max_pixels=image_size * image_size, **config)
    data = build_tiny_dataset(bench_cache() / f"data-img{image_size}-s{seed}", size=image_size, seed=seed)
    return model_dir, data


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "--child":
    _child(*sys.argv[2:])
