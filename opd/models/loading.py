"""Loading a policy: any Hugging Face image-text-to-text checkpoint with its processor.

The same `from_pretrained` path serves Qwen3.5-4B/9B on GPU nodes and the built-in tiny model here.
`resolve_model_source` turns a --model value into what `from_pretrained` loads (a local folder, a
cached hub snapshot or a hub id to download) or a one-line `UserError`, without waiting on a network
that is not there.

Optional GPU kernels (flash-attn; flash-linear-attention and causal-conv1d for Qwen3.5's linear
attention) are used when importable; transformers falls back to PyTorch code otherwise. Its warning
per missing kernel is dropped (nothing can be done about it on a CPU); on CUDA one line names the
missing kernels and the install line instead.
"""

import contextlib
import importlib.util
import json
import logging
import os
import re
import sys
import threading
import warnings

import torch
import transformers
from huggingface_hub import constants, snapshot_download
from huggingface_hub.utils import get_session
from transformers import CONFIG_MAPPING, AutoModelForImageTextToText, AutoProcessor, GenerationConfig

from opd.cli import UserError
from opd.models.kernel_warnings import KERNEL_FALLBACK, KernelFallbackFilter
from opd.models.lora import is_adapter_folder, merged

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}

HUB_TIMEOUT_S = 2.5  # seconds the connection check waits for the hub
HUB_ID = re.compile(r"^(?:[\w.-]+/)?[\w.-]+$")  # "name" or "org/name"
WEIGHT_FILE = re.compile(r"\.(safetensors|bin)$|\.index\.json$")

GPU_KERNELS = {"flash_attn": "flash-attn", "fla": "flash-linear-attention", "causal_conv1d": "causal-conv1d"}
KERNEL_LOGGERS = (  # where transformers emits them: the kernel hub, Qwen3.5's and Qwen3-Next's modules
    "transformers.integrations.hub_kernels",
    "transformers.models.qwen3_5.modeling_qwen3_5",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    "transformers.models.qwen3_next.modeling_qwen3_next",
)
_reported: set[str] = set()  # kernel lines already printed by this process


def _looks_like_path(path: str) -> bool:
    """Meant as a local folder: starts with '.', '/' or '~', has more than one '/', or its parent exists."""
    if path.startswith((".", "/", "~")) or path.count("/") > 1 or "\\" in path:
        return True
    parent = os.path.dirname(path)
    return bool(parent) and os.path.isdir(parent)


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set to a true value."""
    flags = (os.environ.get(k, "").strip().upper() for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return bool(constants.HF_HUB_OFFLINE) or any(f in ("1", "ON", "YES", "TRUE") for f in flags)


def hub_reachable(timeout: float | None = None) -> bool:
    """Whether the Hugging Face hub answers within `timeout` seconds (default HUB_TIMEOUT_S; False at
    once when offline).

    Any HTTP answer counts; the request runs in a daemon thread, so a hanging DNS lookup cannot
    stretch the wait past `timeout` plus half a second.
    """
    if hub_offline():
        return False
    timeout = HUB_TIMEOUT_S if timeout is None else timeout
    answered = []

    def probe():
        try:
            get_session().head(constants.ENDPOINT, timeout=timeout)
            answered.append(True)
        except Exception as exc:  # connection refused, DNS failure, timeout; an HTTP error is an answer
            if getattr(exc, "response", None) is not None:
                answered.append(True)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout + 0.5)
    return bool(answered)


def cached_snapshot(repo_id: str) -> str | None:
    """The local snapshot folder of hub model `repo_id` in the Hugging Face cache, if it holds a
    config.json and weights; no network is used."""
    try:
        folder = snapshot_download(repo_id, local_files_only=True)
    except Exception:  # not cached (LocalEntryNotFoundError), an invalid id, an unreadable cache
        return None
    names = os.listdir(folder) if os.path.isdir(folder) else []
    if "config.json" in names and any(WEIGHT_FILE.search(n) for n in names):
        return folder
    return None


def resolve_model_source(path: str) -> str:
    """What `from_pretrained` should load for a --model value, or a one-line `UserError`.

    * an existing folder: returned as given (``~`` expanded); it must hold config.json;
    * a string that looks like a local path (starts with '.', '/' or '~', has more than one '/', or
      its folder part exists) but is not a folder: "no such model folder: PATH";
    * a hub id ("org/name"): its snapshot folder in the local Hugging Face cache when there (config
      and weights), else the id itself when the hub answers within HUB_TIMEOUT_S (from_pretrained
      downloads it), else an error saying it is neither local nor cached and the hub is offline.
    """
    expanded = os.path.expanduser(path)
    if os.path.isdir(expanded):
        if os.path.isfile(os.path.join(expanded, "adapter_config.json")) and not os.path.isfile(
            os.path.join(expanded, "config.json")
        ):
            return expanded  # a LoRA adapter folder (opd.models.lora): load_model merges it into its base
        if not os.path.isfile(os.path.join(expanded, "config.json")):
            raise UserError(f"model folder {path} has no config.json (not a Hugging Face checkpoint folder)")
        check_model_type(os.path.join(expanded, "config.json"))
        return expanded
    if os.path.exists(expanded):
        raise UserError(f"model {path} is a file; give the checkpoint folder (the one holding config.json)")
    if not path or _looks_like_path(path) or not HUB_ID.match(path) or ".." in path or "--" in path:
        raise UserError(f"no such model folder: {path}")
    snapshot = cached_snapshot(path)
    if snapshot is not None:
        return snapshot
    if hub_reachable():
        return path
    raise UserError(f"model '{path}' is not a local folder and not in the Hugging Face cache, "
                    "and the hub cannot be reached (offline)")


def check_model_type(config_path: str) -> None:
    """Refuses, in one line, a config.json that is not JSON or whose model_type transformers does not know."""
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (ValueError, UnicodeDecodeError) as exc:
        raise UserError(f"{config_path}: not a JSON config ({exc})") from None
    kind = config.get("model_type") if isinstance(config, dict) else None
    if not isinstance(kind, str) or kind not in CONFIG_MAPPING:
        raise UserError(f"{config_path}: field 'model_type': {kind!r} is not a model type transformers "
                        f"{transformers.__version__} knows (a newer transformers, or another checkpoint)")


def quiet_kernel_warnings(device: torch.device | str, module: str | None = None) -> None:
    """Silences transformers' warnings about missing optional GPU kernels; on CUDA prints one line
    naming the missing ones and the install line instead (once per process, rank 0 only).

    Only those messages are filtered (`opd.models.kernel_warnings`), on the loggers that emit them (plus `module`'s,
    the loaded model's modeling module) and in `warnings`; every other warning stays.
    """
    for name in KERNEL_LOGGERS + ((module,) if module else ()):
        logger = logging.getLogger(name)
        if not any(isinstance(f, KernelFallbackFilter) for f in logger.filters):
            logger.addFilter(KernelFallbackFilter())
    warnings.filterwarnings("ignore", message=".*(" + KERNEL_FALLBACK.pattern + ")")
    if torch.device(device).type != "cuda" or os.environ.get("RANK", "0") != "0":
        return
    missing = [dist for mod, dist in GPU_KERNELS.items() if importlib.util.find_spec(mod) is None]
    line = (f"optional GPU kernels not installed: {', '.join(missing)} (PyTorch fallbacks are used; "
            "pip install -r requirements-gpu.txt)")
    if missing and line not in _reported:
        _reported.add(line)
        print(line, file=sys.stderr, flush=True)


def attn_implementation(device: torch.device | str) -> str:
    """flash_attention_2 on CUDA when flash-attn is importable, else PyTorch SDPA."""
    if torch.device(device).type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def _load_error(path: str, exc: OSError) -> UserError:
    """transformers' OSError (a missing or unreadable file of the checkpoint) as one line."""
    return UserError(f"cannot load model {path}: {' '.join(str(exc).split())}")


def load_processor(path: str):
    """The checkpoint's own processor, left-padding for batched generation."""
    source = resolve_model_source(path)
    try:
        processor = AutoProcessor.from_pretrained(source)
    except OSError as exc:
        raise _load_error(path, exc) from exc
    processor.tokenizer.padding_side = "left"
    return processor


def load_model(path: str, dtype: str = "float32", device: torch.device | str = "cpu"):
    """An image-text-to-text model from a local folder or hub id (`resolve_model_source`), on `device`; a LoRA adapter
    folder (adapter_config.json, no config.json) is its base with the adapter merged (`opd.models.lora.merged`)."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
    source = resolve_model_source(path)
    quiet_kernel_warnings(device)
    if is_adapter_folder(source):  # a LoRA run's policy: its base with the adapter merged in
        return merged(source, lambda base: load_model(base, dtype, "cpu")).to(device)
    try:
        model = AutoModelForImageTextToText.from_pretrained(
            source, dtype=DTYPES[dtype], attn_implementation=attn_implementation(device)
        )
    except OSError as exc:
        raise _load_error(path, exc) from exc
    quiet_kernel_warnings(device, type(model).__module__)
    return model.to(device)


def special_ids(model) -> dict[str, list[int] | int]:
    """EOS ids, the pad id, and the vision special tokens that must never be sampled into a response.

    A model can sample its own <|image_pad|> / <|vision_start|> ... tokens; a later forward over such a
    response fails on the image-token count, so they are suppressed during sampling.
    """
    gen = model.generation_config
    eos = gen.eos_token_id if gen.eos_token_id is not None else model.config.get_text_config().eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    pad = gen.pad_token_id if gen.pad_token_id is not None else model.config.get_text_config().pad_token_id
    pad = pad if pad is not None else eos[0]
    vision = [
        getattr(model.config, name)
        for name in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
        if getattr(model.config, name, None) is not None
    ]
    return {"eos": eos, "pad": int(pad), "vision": vision}


def neutral_generation_config(model, **kwargs) -> GenerationConfig:
    """A generation config with only the model's special ids and the caller's settings.

    Checkpoints ship sampling defaults (Qwen3.5: top_k 20, top_p 0.95, ...). Rollout statistics must be
    log-probs of the distribution actually sampled from, so none of those defaults may leak in.
    """
    ids = special_ids(model)
    return GenerationConfig(eos_token_id=ids["eos"], pad_token_id=ids["pad"], **kwargs)


@contextlib.contextmanager
def neutral_generation_defaults(model):
    """Swaps model.generation_config for `neutral_generation_config(model)` while generating.

    generate(generation_config=...) fills the fields a passed config leaves unset from the checkpoint's
    own config (transformers 5), so shipped defaults would still leak; swapping the model's config
    does not let them.
    """
    saved = model.generation_config
    model.generation_config = neutral_generation_config(model)
    try:
        yield
    finally:
        model.generation_config = saved


def autocast(device: torch.device | str, mixed_precision: str = "no"):
    """A context-manager factory for the forwards: torch.autocast in bf16/fp16, else a no-op.

    The training loop manages autocast itself instead of accelerate's mixed precision, which would
    convert every float output (all hidden states included) to fp32 copies.
    """
    if mixed_precision not in ("no", "bf16", "fp16"):
        raise ValueError(f"unknown mixed precision {mixed_precision!r}; known: no, bf16, fp16")
    if mixed_precision == "no":
        return contextlib.nullcontext
    dtype = torch.bfloat16 if mixed_precision == "bf16" else torch.float16
    return lambda: torch.autocast(torch.device(device).type, dtype=dtype)
