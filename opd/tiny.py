"""The built-in tiny model and dataset (`--preset tiny`, the name 'tiny'): a tiny random-weight Qwen3.5 and a small
generated image/crop dataset, offline. (train.py's default is the toy world, opd.toy.default.)

`build_tiny_model(dir)` writes a `Qwen3_5ForConditionalGeneration` (hidden 64, 4 layers, vision depth 2)
with a character-level `Qwen3_5Tokenizer` and a `Qwen3VLProcessor` through `save_pretrained`, so training,
evaluation and the tests load it through the same `from_pretrained` path as a real checkpoint.
`build_tiny_dataset(dir)` writes images, crops and a training JSONL in both record forms of
`opd.data.records`. Both are deterministic by seed and cached: an existing, complete folder is reused.
"""

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw
from transformers import Qwen2VLImageProcessor, Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3VLProcessor
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

from opd.storage import cache_dir  # also `opd.tiny.cache_dir`, as the built-in names' docs cite it

TINY_VERSION = "3"

SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|image_pad|>", "<|video_pad|>", "<think>", "</think>",
]  # fmt: skip

# A Qwen-style chat template: images as <|vision_start|><|image_pad|><|vision_end|>, and the
# non-thinking generation prompt "<|im_start|>assistant\n<think>\n\n</think>\n\n" unless enable_thinking.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "<|im_start|>{{ message.role }}{{ '\n' }}"
    "{%- if message.content is string -%}{{ message.content }}"
    "{%- else -%}{%- for c in message.content -%}"
    "{%- if c.type == 'image' -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif c.type == 'text' -%}{{ c.text }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "<|im_end|>{{ '\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant{{ '\n' }}"
    "{%- if enable_thinking is not defined or enable_thinking is false -%}<think>{{ '\n\n' }}</think>{{ '\n\n' }}{%- endif -%}"
    "{%- endif -%}"
)


def tiny_tokenizer():
    """Qwen3.5's own tokenizer class (byte-level BPE) with a character vocabulary and no merges:
    printable ASCII, newline and the Qwen special tokens, ids stable across save/load."""
    byte_char = bytes_to_unicode()
    chars = [byte_char[b] for b in [*range(32, 127), 10]]
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + chars)}
    return Qwen3_5Tokenizer(
        vocab=vocab, merges=[], eos_token="<|im_end|>", pad_token="<|endoftext|>",
        extra_special_tokens=SPECIAL_TOKENS[1:],
    )  # fmt: skip


def tiny_processor(max_pixels: int = 64 * 64):
    """A Qwen3VLProcessor (Qwen2-VL image processor, patch 16, merge 2) around the tiny tokenizer."""
    image_processor = Qwen2VLImageProcessor(
        patch_size=16, temporal_patch_size=2, merge_size=2, min_pixels=32 * 32, max_pixels=max_pixels,
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    )  # fmt: skip
    video_processor = Qwen3VLVideoProcessor(patch_size=16, temporal_patch_size=2, merge_size=2)
    return Qwen3VLProcessor(
        image_processor=image_processor, tokenizer=tiny_tokenizer(), video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )  # fmt: skip


def tiny_config(tokenizer, hidden: int = 64, layers: int = 4, vision_depth: int = 2, init_range: float = 0.2):
    """A Qwen3_5Config scaled down: every 4th text layer full attention, the rest linear attention.

    init_range 0.2 (Qwen's is 0.02) gives a random model peaked distributions that depend on the image,
    so the default run shows a visible divergence between the full-image student and the crop teacher.
    """
    ids = tokenizer.convert_tokens_to_ids
    text = dict(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                         "mrope_interleaved": True, "partial_rotary_factor": 0.25},
        pad_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"), bos_token_id=None,
        initializer_range=init_range,
    )  # fmt: skip
    vision = dict(
        depth=vision_depth, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden,
        patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
        initializer_range=init_range,
    )  # fmt: skip
    return Qwen3_5Config(
        text_config=text, vision_config=vision, image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"), vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"), initializer_range=init_range,
    )  # fmt: skip


def _atomic_dir(target: Path, write) -> Path:
    """Builds a folder in a temporary sibling and renames it into place (safe against concurrent builders)."""
    target = Path(target)
    if (target / ".complete").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write(tmp)
        (tmp / ".complete").write_text(TINY_VERSION)
        if target.exists():  # an incomplete leftover from an interrupted build
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first
            if not (target / ".complete").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def build_tiny_model(out_dir: str | Path, seed: int = 0, max_pixels: int = 64 * 64, **config_kwargs) -> Path:
    """Writes a tiny (or, with `config_kwargs`, larger) random-weight Qwen3.5 with its tokenizer and
    processor (images up to `max_pixels`) through `save_pretrained`; returns the folder."""
    return _build_model(Path(out_dir), seed, max_pixels, config_kwargs)


def _build_model(out_dir: Path, seed: int, max_pixels: int, config_kwargs: dict, reshape=None) -> Path:
    """`tiny_config(**config_kwargs)` (changed in place by `reshape(config)` when given), its weights drawn after
    torch.manual_seed(seed), saved with the processor and the generation config's end and pad ids."""
    def write(tmp: Path):
        processor = tiny_processor(max_pixels=max_pixels)
        config = tiny_config(processor.tokenizer, **config_kwargs)
        if reshape is not None:
            reshape(config)
        torch.manual_seed(seed)
        model = Qwen3_5ForConditionalGeneration(config)
        ids = processor.tokenizer.convert_tokens_to_ids
        model.generation_config.eos_token_id = [ids("<|im_end|>"), ids("<|endoftext|>")]
        model.generation_config.pad_token_id = ids("<|endoftext|>")
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)

    return _atomic_dir(out_dir, write)


COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (50, 80, 220), "yellow": (230, 210, 40)}


QUESTION = ("What colour is the small square?\n" + "\n".join(f"({chr(65 + j)}) {c}" for j, c in enumerate(COLOURS))
            + "\nAnswer with the letter.")  # fmt: skip
"""The tiny task's question (its answer: the square's colour as a letter)."""


def _square_item(rng, size: int) -> tuple[Image.Image, str, list[int]]:
    """(grey-noise image with one small coloured square, its answer letter, a bbox around it of the square's side)."""
    names = list(COLOURS)
    pixels = rng.integers(90, 160, size=(size, size, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    side = int(rng.integers(8, 14))
    x, y = (int(v) for v in rng.integers(4, size - side - 4, size=2))
    colour = names[int(rng.integers(len(names)))]
    ImageDraw.Draw(image).rectangle([x, y, x + side - 1, y + side - 1], fill=COLOURS[colour])
    bbox = [max(0, x - side), max(0, y - side), min(size, x + 2 * side), min(size, y + 2 * side)]
    return image, chr(65 + names.index(colour)), bbox


def build_tiny_dataset(out_dir: str | Path, n: int = 32, size: int = 96, seed: int = 0) -> Path:
    """Writes n grey-noise images each with one small coloured square, a question about its colour,
    and `train.jsonl`: even rows in Vision-OPD form (crop file), odd rows in bbox form, and every
    eighth row without a crop (outside C). Returns the JSONL path."""

    def write(tmp: Path):
        rng = np.random.default_rng(seed)
        (tmp / "images").mkdir()
        rows = []
        for i in range(n):
            image, answer, bbox = _square_item(rng, size)
            image.save(tmp / "images" / f"{i:04d}.png")
            row = {"problem": f"<image>{QUESTION}", "answer": answer}
            if i % 8 == 7:
                row["images"] = [f"images/{i:04d}.png"]
            elif i % 2 == 0:
                image.crop(bbox).save(tmp / "images" / f"{i:04d}_crop.png")
                row.update(images=[f"images/{i:04d}.png"], teacher_images=[f"images/{i:04d}_crop.png"])
            else:
                row.update(image=f"images/{i:04d}.png", bbox=bbox)
            rows.append(row)
        with (tmp / "train.jsonl").open("w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)

    return _atomic_dir(Path(out_dir), write) / "train.jsonl"


def build_tiny_bench(out_dir: str | Path, n: int = 16, size: int = 96, seed: int = 1) -> Path:
    """Writes n held-out items of the tiny task (another seed than the training data's) as a benchmark folder for
    eval.py's --data-dir and train.py's --eval-data (the name 'tiny'): zoombench/tiny.json, a Vision-OPD evaluation
    JSON with each item's crop, in ZoomBench's slot. The random tiny model has nothing to score well on; it is the
    tests' and a --preset tiny run's quick check that evaluation runs. Returns the folder."""

    def write(tmp: Path):
        rng = np.random.default_rng(seed)
        bench = tmp / "zoombench"
        (bench / "images").mkdir(parents=True)
        rows = []
        for i in range(n):
            image, answer, bbox = _square_item(rng, size)
            image.save(bench / "images" / f"{i:04d}.png")
            image.crop(bbox).save(bench / "images" / f"{i:04d}_crop.png")
            rows.append({"id": f"tiny-{i:04d}", "images": [f"images/{i:04d}.png"],
                         "teacher_images": [f"images/{i:04d}_crop.png"], "query": QUESTION, "response": answer,
                         "question_type": "mcq"})  # fmt: skip
        (bench / "tiny.json").write_text(json.dumps(rows, indent=0) + "\n")

    return _atomic_dir(Path(out_dir), write)


def tiny_defaults(vllm: bool = False) -> tuple[Path, Path]:
    """(model folder, training JSONL) of the built-in tiny model and dataset (`--preset tiny`, the name 'tiny'), built
    on first use; with `vllm` the model is its vLLM-servable variant (`build_tiny_vllm_model`, cached beside it: what
    `--preset tiny --rollout-engine vllm` trains)."""
    root = cache_dir()
    model = (build_tiny_vllm_model(root / f"tiny-vllm-model-v{TINY_VERSION}") if vllm
             else build_tiny_model(root / f"tiny-model-v{TINY_VERSION}"))  # fmt: skip
    return model, build_tiny_dataset(root / f"tiny-data-v{TINY_VERSION}")


def tiny_bench() -> Path:
    """The built-in 'tiny' benchmark folder (`build_tiny_bench`), built on first use."""
    return build_tiny_bench(cache_dir() / f"tiny-bench-v{TINY_VERSION}")


def build_tiny_vllm_model(out_dir: str | Path, seed: int = 0, max_pixels: int = 64 * 64, **config_kwargs) -> Path:
    """The tiny Qwen3.5 reshaped for vLLM's CPU backend (opd.engine.vllm_server and tests/test_vllm.py only; the default
    above is unchanged): attention head_dim 32 instead of 16 and linear-attention key/value head dims 64
    instead of 16, the smallest sizes whose attention kernels that backend has (head_dim 16 does not load).
    The rest is `tiny_config` (`config_kwargs`: hidden, layers, vision_depth; default hidden 64, 4 layers (one
    full attention), vision depth 2, init range 0.2)."""

    def reshape(config):
        config.text_config.head_dim = 32
        config.text_config.linear_key_head_dim = 64
        config.text_config.linear_value_head_dim = 64

    return _build_model(Path(out_dir), seed, max_pixels, config_kwargs, reshape)
