"""Supervised training of the toy world's base model: the policy that BAS-OPD then distills.

The architecture is `opd.tiny`'s Qwen3.5 with the sizes of `SFTConfig` (a hybrid stack, 8-pixel patches merged into
one visual token per image at the defaults). Training is teacher forcing on the answer tokens only, AdamW with
warm-up and cosine decay, on the world's "sft" split drawn on the fly, each sample shown as its crop with probability
`crop_share` (default 1: the regional-to-global gap OPD is meant to close). Learning rate 1e-3 and 150 steps keep the
letter probabilities moderate (measured). The folder is written through `save_pretrained`, so `train.py --model` and
`eval.py --model` load it; a finished folder is reused. `task` (optional) swaps the supervised targets for another
task on the same world.
Details (the measurements behind the settings): docs/MODULES.md#opdtoysft.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import Qwen3_5ForConditionalGeneration

from opd.models.chat import collate, encode_prompt
from opd.models.chat import response_logits
from opd.models.loading import quiet_kernel_warnings
from opd.tiny import tiny_config, tiny_processor
from opd.toy.world import WorldConfig, sample

SFT_VERSION = "1"


@dataclass(frozen=True)
class SFTConfig:
    hidden: int = 64
    """Text hidden size (the vision tower's output size too)."""
    layers: int = 2
    """Text layers: all linear attention except the last, which is full attention."""
    vision_depth: int = 2
    """Vision transformer blocks."""
    vision_hidden: int = 64
    """Vision transformer width (heads of 16 dimensions, MLP twice as wide)."""
    patch: int = 8
    """Vision patch side in pixels (processor and model)."""
    merge: int = 4
    """Spatial merge: merge x merge patches become one visual token (processor and model)."""
    steps: int = 150
    """Optimizer steps."""
    batch: int = 16
    """Samples per step."""
    lr: float = 1e-3
    """Peak AdamW learning rate (warm-up over the first 5% of steps, cosine decay to 10% after)."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    crop_share: float = 1.0
    """Probability that a training sample is shown as its crop (else the full image)."""
    max_resolution: int = 0
    """0: the processor resizes every image to the world's resolution; else it keeps an image's own size
    between resolution and max_resolution pixels a side (the family's resolution base,
    experiments/harness/family.py)."""
    seed: int = 0
    """Initialisation seed of the model (the data come from the world seed)."""
    vllm_shapes: bool = False
    """Attention head_dim 32 and linear-attention key/value head dims 64 (`opd.tiny.build_tiny_vllm_model`'s), the
    smallest sizes vLLM's CPU backend has kernels for, so that `--rollout-engine vllm` serves the base (the
    default toy base, opd.toy.default); False: head dims 16, as the experiments' bases."""


OPTIONAL = {"max_resolution": 0, "vllm_shapes": False}
"""SFTConfig fields added after bases were cached: left out of sft.json at these values, so a cached base of the
experiments (written before them) still matches its config."""


def toy_processor(resolution: int, patch: int = 8, merge: int = 4, max_resolution: int = 0):
    """`opd.tiny.tiny_processor` resizing every image to exactly resolution x resolution pixels, or, with
    `max_resolution`, to a multiple of patch x merge pixels between resolution^2 and max_resolution^2 pixels."""
    largest = max(resolution, max_resolution)
    processor = tiny_processor(max_pixels=largest * largest)
    processor.image_processor.patch_size, processor.image_processor.merge_size = patch, merge
    processor.image_processor.size = {"shortest_edge": resolution * resolution, "longest_edge": largest * largest}
    return processor


def build_model(processor, cfg: SFTConfig):
    """A freshly initialised tiny Qwen3.5 of `cfg`'s size (Qwen's init range 0.02, not tiny's 0.2)."""
    quiet_kernel_warnings("cpu", Qwen3_5ForConditionalGeneration.__module__)
    config = tiny_config(processor.tokenizer, hidden=cfg.hidden, layers=cfg.layers, vision_depth=cfg.vision_depth,
                         init_range=0.02)
    config.text_config.layer_types = ["linear_attention"] * (cfg.layers - 1) + ["full_attention"]
    if cfg.vllm_shapes:  # head_dim 32 x partial rotary 0.25 = rotary 8: vLLM's sum(mrope_section [2, 1, 1]) == 8 // 2
        text = config.text_config
        text.head_dim, text.linear_key_head_dim, text.linear_value_head_dim = 32, 64, 64
    vision = config.vision_config
    vision.hidden_size, vision.intermediate_size, vision.num_heads = cfg.vision_hidden, 2 * cfg.vision_hidden, cfg.vision_hidden // 16
    vision.patch_size, vision.spatial_merge_size = cfg.patch, cfg.merge
    torch.manual_seed(cfg.seed)
    model = Qwen3_5ForConditionalGeneration(config)
    ids = processor.tokenizer.convert_tokens_to_ids
    model.generation_config.eos_token_id = [ids("<|im_end|>"), ids("<|endoftext|>")]
    model.generation_config.pad_token_id = ids("<|endoftext|>")
    return model


def _lr_at(step: int, cfg: SFTConfig) -> float:
    warm = max(1, round(0.05 * cfg.steps))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    progress = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def answer_batch(processor, model, samples, views: list[str]):
    """(model inputs, target ids (n, 2), mask) for teacher forcing "<letter><|im_end|>"."""
    ids = processor.tokenizer.convert_tokens_to_ids
    prompts = [encode_prompt(processor, [s.crop() if v == "crop" else s.image], s.problem) for s, v in zip(samples, views)]
    target = torch.tensor([[ids(s.answer), ids("<|im_end|>")] for s in samples])
    pad = model.generation_config.pad_token_id
    return collate(prompts, pad, target), target


def train_base(out_dir: str | Path, world: WorldConfig, cfg: SFTConfig, log=print, task=None) -> Path:
    """Trains the base model on the world's sft split and writes it to `out_dir`; reused when complete.

    `task`: another task's targets (see the module docstring); None = the letter answers."""
    out = Path(out_dir)
    sft = {k: v for k, v in asdict(cfg).items() if k not in OPTIONAL or v != OPTIONAL[k]}  # as bases made before
    want = {"version": SFT_VERSION, "sft": sft, "world": asdict(world)}
    if task is not None:
        want["task"] = task.name
    if (out / "sft.json").exists():
        have = json.loads((out / "sft.json").read_text())
        if {k: have.get(k) for k in want} != want or have.get("task") != want.get("task"):
            raise SystemExit(f"{out} holds a base model trained with other settings; use another output folder")
        return out
    processor = toy_processor(world.resolution, cfg.patch, cfg.merge, cfg.max_resolution)
    model = build_model(processor, cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    rng = np.random.default_rng([world.seed, cfg.seed, 7])
    model.train()
    t0, losses = time.perf_counter(), []
    for step in range(cfg.steps):
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, cfg)
        samples = [sample(world, "sft", step * cfg.batch + j) for j in range(cfg.batch)]
        views = ["crop" if rng.random() < cfg.crop_share else "full" for _ in samples]
        if task is None:
            inputs, target = answer_batch(processor, model, samples, views)
        else:
            inputs, target = task.batch(processor, model, samples, views, rng)
        logits = response_logits(model, inputs, target.shape[1])  # (n, T, V)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), target.flatten())  # ignores -100
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % max(1, cfg.steps // 10) == 0 or step + 1 == cfg.steps:
            log(f"  sft step {step + 1}/{cfg.steps}: loss {np.mean(losses[-20:]):.4f} ({time.perf_counter() - t0:.0f} s)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        (tmp / "sft.json").write_text(json.dumps({**want, "seconds": time.perf_counter() - t0,
                                                  "final_loss": float(np.mean(losses[-20:]))}, indent=2) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
