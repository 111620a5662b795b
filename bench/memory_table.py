"""Memory per GPU of the paper's runs (issue 12): Qwen3.5-4B / 9B under DDP and FSDP2 on 1, 4 and 8 GPUs.

The model is built from its real configuration (bench/configs/qwen3.5-4b.json, qwen3.5-9b.json: the
public config.json of Qwen/Qwen3.5-4B and -9B) on the meta device, so the parameter counts are exact
(no download, no memory): the whole model P, the root FSDP group R (embeddings, LM head, final norm,
vision patch embedding and merger: what `opd.models.sharding.shard_model` leaves outside the repeated blocks)
and the largest block U. Everything else is an estimate from the settings of `--preset paper-4b/9b`
(float32 weights, bf16 autocast, --grad-checkpointing, --micro-batch 4, 28 prompts x 8 rollouts,
prompts up to 8,192 tokens and responses up to 1,024, top-100, --loss-chunk 512), with the formulas
below (bytes, per GPU; s = the number of shards: the GPUs under FSDP2, 1 under DDP):

- policy 4P/s, gradients 4P/s, AdamW moments 8P/s, EMA teacher 4P/s (float32); DDP on more than one
  GPU adds its gradient buckets, 4P (accelerate's default gradient_as_bucket_view=False).
- weights for compute: DDP, autocast's bf16 copies of the policy's weights, 2P, held through the
  student forward; FSDP2, the gathered bf16 root of the student and of the teacher (2R each; the
  teacher's is freed before the student's backward) and two gathered blocks (4U: the running one and
  the prefetched one). At the end of FSDP2's backward the root's bf16 gradient and its float32
  reduce-scatter input (2R + 4R) exist with the gathered root, when the activations are freed.
- activations of one micro-batch (b = 4 rows of L = 8,192 + 1,024 tokens, the maximum), with
  activation checkpointing: every text layer's input b L H x 2 bytes and every vision block's input
  (b x 4 x image tokens patches x Hv x 2), plus one layer's recomputed activations with the GPU kernels
  (flash attention, flash-linear-attention: O(L), nothing quadratic) counted as b L c x 2 bytes, c = 5H
  + 7 nh hd + 5 nkv hd + 4I per token for a full-attention layer, 5H + 3 (2 nk dk + nv dv) + 3 nv dv
  + 4I for a linear-attention one, twice (the activations and their gradients), and the loss of
  `opd.maths.chunked` over b x 1,024 positions: dL/dW in float32 (4VH), the LM head's bf16 copies under DDP
  (2VH per side), one chunk's logits of both sides and the gradient buffer (3 x 512 V x 4; with fewer than 512
  positions the one chunk holds only those).
- generation (before training, in its own phase): the bf16 policy (DDP: autocast's copies; FSDP2
  gathered: the whole model; layerwise: R + 2U) and the cache of every row of a generate() call: 8
  full-attention layers' keys and values (2 nkv hd L x 2 bytes) and 24 linear-attention layers'
  recurrent states (nv dk dv x 4 bytes) and convolution states per row. Rows per call: the rank's 28/N
  prompts x 8 rollouts, capped by --rollout-batch (the table uses 64, which the 1-GPU runs need).
  The prefill's own working set is not counted.

LoRA rows (`--lora-r`, 1 GPU, no sharding; opd/models/lora.py): the base frozen in bf16 (2P: no float32 master weights,
no gradients, no AdamW state for it, and no separate teacher: the EMA teacher is a second adapter on the same base),
the adapters in float32: the student's A parameters (r (in + out) per adapted linear layer of DEFAULT_TARGETS),
its gradients and AdamW moments and the teacher's copy (4A + 4A + 8A + 4A). The forward computes in the weights'
own bf16 (nothing gathered or cast: no weights for compute), the activations are the others' (the adapters' r-wide
activations are small beside them) and so is the loss, less dL/dW (4VH: the tied LM head is frozen, and
`opd.maths.chunked` forms no gradient for a frozen weight), generation reads the same bf16 base (the cache only).

peak = persistent + max(training transient, generation transient). Not counted: the CUDA context and
NCCL buffers (1-3 GB), allocator fragmentation, the processor's pixel tensors, the selector (KBs).
These are estimates for planning; `bench/gpu_check.py` measures the real peak of paper-4b shapes when a
GPU is at hand (docs/BENCHMARKS.md).

    .venv/bin/python bench/memory_table.py                       # prints the Markdown table
    .venv/bin/python bench/memory_table.py --out memory_table.json --gpu-gb 80
"""

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIGS = Path(__file__).resolve().parent / "configs"
MODELS = {"4b": "qwen3.5-4b.json", "9b": "qwen3.5-9b.json"}
GB = 1e9  # decimal gigabytes, as GPU memory is sold ("80 GB")


@dataclass
class Shape:
    """What the estimate needs from a configuration; parameter counts from the meta-device model."""

    params: int  # P
    root: int  # R: parameters outside the repeated blocks
    block: int  # U: the largest repeated block (decoder layer or vision block)
    vocab: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    lin_k_heads: int
    lin_v_heads: int
    lin_k_dim: int
    lin_v_dim: int
    conv_kernel: int
    layer_types: list
    vision_depth: int
    vision_hidden: int
    vision_intermediate: int
    tied: bool
    lora_per_rank: int = 0  # adapter parameters per unit of rank: sum of (in + out) over the adapted layers


@dataclass
class Settings:
    """The paper presets' settings that set the memory (train.py PRESETS['paper-4b'/'paper-9b'])."""

    prompts_per_step: int = 28
    rollouts_per_prompt: int = 8
    prompt_len: int = 8192
    response_len: int = 1024
    micro_batch: int = 4
    loss_chunk: int = 512
    rollout_batch: int = 64
    image_tokens: int = 8192 - 256


def load_config(name: str):
    """The Qwen3_5Config of bench/configs/<name>.json."""
    from transformers import Qwen3_5Config

    data = json.loads((CONFIGS / MODELS[name]).read_text())
    return Qwen3_5Config(**{k: v for k, v in data.items() if k not in ("architectures", "model_type")})


def model_shape(config) -> Shape:
    """Builds the model of a Qwen3_5Config on the meta device (no weights) and counts its parameters the way
    `opd.models.sharding.shard_model` groups them."""
    import torch
    from transformers import AutoModelForImageTextToText

    from opd.models.sharding import shard_units

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    from opd.models.lora import matched_modules
    from opd.models.settings import DEFAULT_TARGETS

    adapted = [model.get_submodule(n) for n in matched_modules(model, DEFAULT_TARGETS)]
    lora_per_rank = sum(m.in_features + m.out_features for m in adapted)
    units = shard_units(model)
    in_units = {id(p) for u in units for p in u.parameters()}
    params = {id(p): p.numel() for p in model.parameters()}  # tied weights counted once
    text, vision = config.text_config, config.vision_config
    return Shape(
        params=sum(params.values()), root=sum(n for i, n in params.items() if i not in in_units),
        block=max(sum(p.numel() for p in u.parameters()) for u in units), vocab=text.vocab_size,
        hidden=text.hidden_size, intermediate=text.intermediate_size, heads=text.num_attention_heads,
        kv_heads=text.num_key_value_heads, head_dim=text.head_dim, lin_k_heads=text.linear_num_key_heads,
        lin_v_heads=text.linear_num_value_heads, lin_k_dim=text.linear_key_head_dim,
        lin_v_dim=text.linear_value_head_dim, conv_kernel=text.linear_conv_kernel_dim,
        layer_types=list(text.layer_types), vision_depth=vision.depth, vision_hidden=vision.hidden_size,
        vision_intermediate=vision.intermediate_size,
        tied=model.lm_head.weight is model.model.language_model.embed_tokens.weight, lora_per_rank=lora_per_rank,
    )  # fmt: skip


def per_token_layer(m: Shape, kind: str) -> int:
    """Activations of one recomputed text layer per token (elements; see the module docstring)."""
    if kind == "full_attention":
        return 5 * m.hidden + 7 * m.heads * m.head_dim + 5 * m.kv_heads * m.head_dim + 4 * m.intermediate
    lin = 2 * m.lin_k_heads * m.lin_k_dim + m.lin_v_heads * m.lin_v_dim  # q, k, v of the gated delta net
    return 5 * m.hidden + 3 * lin + 3 * m.lin_v_heads * m.lin_v_dim + 4 * m.intermediate


def activations(m: Shape, s: Settings, head_grad: bool = True) -> dict[str, float]:
    """One micro-batch of the student's forward and backward with activation checkpointing, and the loss;
    `head_grad` False (LoRA: the LM head is frozen, `opd.maths.chunked` forms no dL/dW) drops the loss's 4 V H."""
    b, length = s.micro_batch, s.prompt_len + s.response_len
    patches = 4 * s.image_tokens  # 2 x 2 patches merge into one token
    saved = len(m.layer_types) * b * length * m.hidden * 2 + m.vision_depth * b * patches * m.vision_hidden * 2
    text_layer = max(per_token_layer(m, kind) for kind in set(m.layer_types)) * b * length * 2
    vision_block = (8 * m.vision_hidden + 2 * m.vision_intermediate) * b * patches * 2
    recompute = 2 * max(text_layer, vision_block)  # a layer's activations and their gradients
    positions = b * s.response_len
    chunk = min(s.loss_chunk, positions)  # opd.maths.chunked's chunks run over the valid positions: a shorter last one
    loss = 4 * m.vocab * m.hidden * head_grad + 3 * chunk * m.vocab * 4 + positions * m.hidden * (4 + 2 + 2)
    return {"saved": saved, "recompute": recompute, "loss": loss}


def cache_per_row(m: Shape, s: Settings) -> float:
    """Generation cache of one rollout at the maximum length: full-attention keys/values (bf16),
    linear-attention recurrent states (float32) and convolution states (bf16)."""
    length = s.prompt_len + s.response_len
    full = sum(t == "full_attention" for t in m.layer_types)
    linear = len(m.layer_types) - full
    conv_dim = 2 * m.lin_k_heads * m.lin_k_dim + m.lin_v_heads * m.lin_v_dim
    kv = full * 2 * m.kv_heads * m.head_dim * length * 2
    state = linear * (m.lin_v_heads * m.lin_k_dim * m.lin_v_dim * 4 + conv_dim * (m.conv_kernel - 1) * 2)
    return kv + state


def estimate_lora(m: Shape, s: Settings, r: int) -> dict:
    """Bytes on one GPU of a LoRA run of rank r (see the module docstring)."""
    A = r * m.lora_per_rank
    persistent = {"policy": 2 * m.params + 4 * A, "gradients": 4 * A, "adamw": 8 * A, "teacher": 4 * A,
                  "ddp_buckets": 0.0}  # fmt: skip
    act = activations(m, s, head_grad=False)  # the tied LM head is frozen: no dL/dW
    training = act["saved"] + act["recompute"] + act["loss"]
    rows = min(s.prompts_per_step * s.rollouts_per_prompt, s.rollout_batch)
    gen = rows * cache_per_row(m, s)
    total = sum(persistent.values()) + max(training, gen)
    return {**persistent, "compute_weights": 0.0, "activations": act["saved"] + act["recompute"], "loss": act["loss"],
            "training_transient": training, "generation": gen, "generation_rows": rows, "peak": total,
            "adapter_params": A}  # fmt: skip


def estimate(m: Shape, s: Settings, strategy: str, gpus: int, generation: str = "gathered") -> dict:
    """Bytes per GPU of each term and the peak (see the module docstring)."""
    shards = gpus if strategy == "fsdp2" else 1
    P, R, U = m.params, m.root, m.block
    persistent = {
        "policy": 4 * P / shards, "gradients": 4 * P / shards, "adamw": 8 * P / shards, "teacher": 4 * P / shards,
        "ddp_buckets": 4 * P if strategy == "ddp" and gpus > 1 else 0.0,
    }  # fmt: skip
    act = activations(m, s)
    if strategy == "ddp":
        forward_weights = 2 * P + 2 * 2 * m.vocab * m.hidden  # autocast's copies, the LM head cast per side
        end_of_backward = 0.0
        gen_weights = 2 * P
    else:
        forward_weights = 2 * R + 2 * R + 4 * U  # student and teacher roots, two blocks
        end_of_backward = 2 * R + 2 * R + 4 * R  # gathered root, its bf16 gradient, the float32 reduce input
        gen_weights = 2 * P if generation == "gathered" else 2 * R + 4 * U
    training = max(forward_weights + act["saved"] + act["recompute"] + act["loss"], end_of_backward)
    rows = min(math.ceil(s.prompts_per_step / gpus) * s.rollouts_per_prompt, s.rollout_batch)
    gen = gen_weights + rows * cache_per_row(m, s)
    total = sum(persistent.values()) + max(training, gen)
    return {**persistent, "compute_weights": forward_weights, "activations": act["saved"] + act["recompute"],
            "loss": act["loss"], "training_transient": training, "generation": gen, "generation_rows": rows,
            "peak": total}  # fmt: skip


def table(shapes: dict[str, Shape], s: Settings, gpu_gb: float, gpus=(1, 4, 8), lora_r: int = 64,
          small_gb: tuple = (24, 48)) -> tuple[str, list[dict]]:  # fmt: skip
    head = ["model", "strategy", "GPUs", "parameters", "gradients", "AdamW", "EMA teacher", "weights for compute",
            "activations + loss", "generation", "peak per GPU", f"fits {gpu_gb:g} GB",
            *(f"fits {g:g} GB" for g in small_gb)]  # fmt: skip
    rows, records = [], []
    for name, m in shapes.items():
        for strategy in ("ddp", "fsdp2", "lora"):
            for n in gpus if strategy != "lora" else (1,):
                e = estimate_lora(m, s, lora_r) if strategy == "lora" else estimate(m, s, strategy, n)
                records.append({"model": name, "strategy": strategy if strategy != "lora" else f"lora-r{lora_r}",
                                "gpus": n, **e})  # fmt: skip
                label = {"ddp": "DDP", "fsdp2": "FSDP2", "lora": f"LoRA r {lora_r} (bf16 base)"}[strategy]
                fits = ["yes" if e["peak"] <= g * GB else "no" for g in (gpu_gb, *small_gb)]
                grads = f"{e['gradients'] / GB:.1f}" + (f" + {e['ddp_buckets'] / GB:.1f}" if e["ddp_buckets"] else "")
                rows.append([
                    f"Qwen3.5-{name.upper()}", label, n, f"{e['policy'] / GB:.1f}",
                    grads, f"{e['adamw'] / GB:.1f}", f"{e['teacher'] / GB:.1f}", f"{e['compute_weights'] / GB:.1f}",
                    f"{(e['activations'] + e['loss']) / GB:.1f}", f"{e['generation'] / GB:.1f} ({e['generation_rows']} rows)",
                    f"**{e['peak'] / GB:.1f}**", *fits,
                ])  # fmt: skip
    from bench._util import markdown_table

    return markdown_table(head, rows, "lllrrrrrrrrl" + "l" * len(small_gb)), records


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="4b,9b", help="comma-separated: 4b, 9b (default: both)")
    p.add_argument("--gpu-gb", type=float, default=80.0, help="GPU memory for the 'fits' column (default: 80)")
    p.add_argument("--micro-batch", type=int, default=Settings.micro_batch, help="rows per student/teacher forward (default: 4)")
    p.add_argument("--rollout-batch", type=int, default=Settings.rollout_batch, help="most rows per generate() call (default: 64)")
    p.add_argument("--image-tokens", type=int, default=Settings.image_tokens,
                   help="image tokens of a prompt (default: 7,936, all but 256 of the 8,192-token maximum)")
    p.add_argument("--lora-r", type=int, default=64, help="LoRA rank of the LoRA rows (default: 64, OPSD's and DAPD's)")
    p.add_argument("--out", default=None, help="write the numbers to this JSON file")
    a = p.parse_args(argv)
    s = Settings(micro_batch=a.micro_batch, rollout_batch=a.rollout_batch, image_tokens=a.image_tokens)
    shapes = {name: model_shape(load_config(name)) for name in a.models.split(",")}
    markdown, records = table(shapes, s, a.gpu_gb, lora_r=a.lora_r)
    counts = "; ".join(f"Qwen3.5-{n.upper()}: P = {m.params / 1e9:.3f} B parameters, root group R = {m.root / 1e9:.3f} B, "
                       f"largest block U = {m.block / 1e6:.0f} M, {'tied' if m.tied else 'untied'} embeddings, "
                       f"LoRA r {a.lora_r} adapter {a.lora_r * m.lora_per_rank / 1e6:.1f} M" for n, m in shapes.items())  # fmt: skip
    per_row = "; ".join(f"{n.upper()} {cache_per_row(m, s) / GB:.2f} GB" for n, m in shapes.items())
    text = (f"{counts}. Generation cache per rollout at {s.prompt_len + s.response_len:,} tokens: {per_row}. "
            f"Micro-batch {s.micro_batch}, image tokens {s.image_tokens:,}, --rollout-batch {s.rollout_batch}; "
            "GB = 10^9 bytes; DDP's gradients + its buckets.\n\n" + markdown)  # fmt: skip
    print(text)
    if a.out:
        payload = {"settings": asdict(s), "shapes": {n: asdict(m) for n, m in shapes.items()}, "rows": records,
                   "markdown": text}  # fmt: skip
        Path(a.out).write_text(json.dumps(payload, indent=2) + "\n")
    return {"markdown": text, "rows": records, "shapes": shapes}


if __name__ == "__main__":
    main()
