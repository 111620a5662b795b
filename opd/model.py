"""Loading a policy: any Hugging Face image-text-to-text checkpoint with its processor.

The same `from_pretrained` path serves Qwen3.5-4B/9B on GPU nodes and the built-in tiny model here.
Optional GPU kernels (flash-attn; flash-linear-attention and causal-conv1d for Qwen3.5's linear
attention) are used when importable; transformers falls back to PyTorch code otherwise.
"""

import contextlib
import importlib.util

import torch
from transformers import AutoModelForImageTextToText, AutoProcessor, GenerationConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def attn_implementation(device: torch.device | str) -> str:
    """flash_attention_2 on CUDA when flash-attn is importable, else PyTorch SDPA."""
    if torch.device(device).type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def load_processor(path: str):
    """The checkpoint's own processor, left-padding for batched generation."""
    processor = AutoProcessor.from_pretrained(path)
    processor.tokenizer.padding_side = "left"
    return processor


def load_model(path: str, dtype: str = "float32", device: torch.device | str = "cpu"):
    """An image-text-to-text model from a local folder or hub id, on `device`."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
    model = AutoModelForImageTextToText.from_pretrained(
        path, dtype=DTYPES[dtype], attn_implementation=attn_implementation(device)
    )
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
