"""Batched greedy answering of benchmark items with plain Hugging Face `generate` (Appendix B.2).

Each item becomes one chat prompt through the training path (`opd.models.chat.encode_prompt`: the model's
own processor and chat template, the image in front of the question, Qwen3.5's non-thinking
generation prompt unless ``enable_thinking``); prompts are left-padded into batches by
`opd.models.chat.collate`. Decoding is greedy (temperature 0) under a neutral generation config, so the
checkpoint's shipped sampling defaults (top_k, top_p, repetition penalty, ...) never apply; the
model's vision special tokens are suppressed as in training rollouts. Only the new tokens are decoded,
with special tokens skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from opd.models.chat import EncodedPrompt, collate, encode_prompt
from opd.cli import UserError
from opd.eval.bench_items import BenchItem, item_origin, prompt_text
from opd.models.loading import neutral_generation_defaults, special_ids

VIEWS = ("full", "crop")


def item_image(item: BenchItem, view: str):
    """The RGB image an item is asked with: the full image, or its crop for ``view="crop"``."""
    if view == "full":
        return item.image()
    if view == "crop":
        if item.crop is None:
            raise ValueError(f"{item.benchmark} item {item.index}: no crop image for --view crop")
        return item.crop()
    raise ValueError(f"unknown view {view!r}; known: {', '.join(VIEWS)}")


def encode_item(processor, item: BenchItem, view: str = "full", enable_thinking: bool = False,
                max_prompt_len: int | None = None) -> EncodedPrompt:
    """One item's prompt: its image (full or crop) and `opd.eval.bench_items.prompt_text(item)`. A prompt over
    `max_prompt_len` tokens or an image that does not decode is a one-line `item_error`."""
    try:
        return encode_prompt(processor, [item_image(item, view)], prompt_text(item), enable_thinking, max_prompt_len)
    except ValueError as exc:
        raise item_error(item, exc) from None


def item_error(item: BenchItem, exc: Exception) -> UserError:
    """The one-line error of one item's prompt (over --max-prompt-len, an undecodable image, ...), naming the
    benchmark, its file, row and item. `local`: only the process answering that item meets it (under a launcher)."""
    text = str(exc) if isinstance(exc, UserError) else f"{item_origin(item)}: {exc}"  # a UserError names its row
    return UserError(f"benchmark '{item.benchmark}': {text}", local=True)


@torch.no_grad()
def generate_replies(model, processor, prompts: list[EncodedPrompt], max_new_tokens: int) -> list[str]:
    """Greedy replies to a batch of encoded prompts, decoded from the new tokens only."""
    ids = special_ids(model)
    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in collate(prompts, ids["pad"]).items()}
    with neutral_generation_defaults(model):
        out = model.generate(
            **batch, do_sample=False, max_new_tokens=max_new_tokens, suppress_tokens=ids["vision"] or None,
        )  # fmt: skip
    new = out[:, batch["input_ids"].shape[1]:]  # (n, T)
    return [r.strip() for r in processor.batch_decode(new.cpu(), skip_special_tokens=True)]


def answer_items(
    model,
    processor,
    items: Iterable[BenchItem],
    batch_size: int = 8,
    max_new_tokens: int = 64,
    enable_thinking: bool = False,
    view: str = "full",
    max_prompt_len: int | None = None,
) -> Iterator[tuple[BenchItem, str]]:
    """Yields (item, reply) for every item, in order, ``batch_size`` prompts per `generate` call.

    Images are decoded one batch at a time, so memory stays bounded on large benchmarks. The model is
    put in eval mode (and restored afterwards).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if view not in VIEWS:
        raise ValueError(f"unknown view {view!r}; known: {', '.join(VIEWS)}")
    was_training = model.training
    model.eval()
    try:
        batch: list[BenchItem] = []
        for item in items:
            batch.append(item)
            if len(batch) == batch_size:
                yield from _answer_batch(model, processor, batch, max_new_tokens, enable_thinking, view,
                                         max_prompt_len)
                batch = []
        if batch:
            yield from _answer_batch(model, processor, batch, max_new_tokens, enable_thinking, view, max_prompt_len)
    finally:
        model.train(was_training)


def _answer_batch(model, processor, batch, max_new_tokens, enable_thinking, view, max_prompt_len):
    prompts = [encode_item(processor, item, view, enable_thinking, max_prompt_len) for item in batch]
    return zip(batch, generate_replies(model, processor, prompts, max_new_tokens))
