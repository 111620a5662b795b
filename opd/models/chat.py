"""Prompts and the forward that scores a response: Eq. 1 (`response_logits`; Eq. 2 through `ema_teacher.Teacher`).

The student and the teacher see the same question and response tokens; only the images differ. A prompt is encoded
alone (`encode_prompt`), then left-padded into a batch with the response block on the right (`collate`), so every
row's response starts at the same column. Hidden-state forwards (the fused kernel): `opd.models.hidden`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from PIL import Image

IMAGE_MARK = "<image>"


def user_message(problem: str, n_images: int) -> list[dict]:
    """One user turn with the images where `<image>` marks them (in front when unmarked)."""
    parts = problem.split(IMAGE_MARK)
    if len(parts) - 1 not in (0, n_images):
        raise ValueError(f"question has {len(parts) - 1} '{IMAGE_MARK}' marks for {n_images} images")
    content: list[dict] = []
    if len(parts) == 1:
        content += [{"type": "image"}] * n_images
        parts = [problem]
    for j, text in enumerate(parts):
        if j > 0:
            content.append({"type": "image"})
        if text.strip():
            content.append({"type": "text", "text": text.strip()})
    return [{"role": "user", "content": content}]


def prompt_text(processor, problem: str, n_images: int, enable_thinking: bool = False) -> str:
    """The chat-templated prompt with the generation prompt (Qwen3.5 non-thinking by default)."""
    return processor.apply_chat_template(
        user_message(problem, n_images), add_generation_prompt=True, tokenize=False, enable_thinking=enable_thinking
    )


@dataclass
class EncodedPrompt:
    """One encoded prompt: token ids with the image placeholders expanded, and its image patches."""

    input_ids: torch.Tensor  # (P,)
    mm_token_type_ids: torch.Tensor  # (P,)
    pixel_values: torch.Tensor | None  # (patches, D)
    image_grid_thw: torch.Tensor | None  # (n_images, 3)

    def __len__(self) -> int:
        return self.input_ids.numel()


def encode_prompt(processor, images: list[Image.Image], problem: str, enable_thinking: bool = False,
                  max_len: int | None = None) -> EncodedPrompt:
    """Encodes one prompt with the model's own processor; refuses prompts over `max_len` tokens."""
    text = prompt_text(processor, problem, len(images), enable_thinking)
    enc = processor(text=[text], images=images or None, return_tensors="pt")
    ids = enc["input_ids"][0]
    if max_len is not None and ids.numel() > max_len:
        raise ValueError(
            f"prompt has {ids.numel()} tokens, over the maximum prompt length {max_len}: "
            "lower the processor's max_pixels or raise --max-prompt-len"
        )
    mm = enc.get("mm_token_type_ids")
    return EncodedPrompt(
        input_ids=ids,
        mm_token_type_ids=mm[0] if mm is not None else torch.zeros_like(ids),
        pixel_values=enc.get("pixel_values"),
        image_grid_thw=enc.get("image_grid_thw"),
    )


def collate(prompts: list[EncodedPrompt], pad_id: int, response_ids: torch.Tensor | None = None,
            response_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Left-pads prompts into a batch and appends a (n, T) response block: the model's inputs, images in row order.
    Response positions after EOS get attention 0 (no valid position comes after them)."""
    width = max(len(p) for p in prompts)
    n = len(prompts)
    ids = torch.full((n, width), pad_id, dtype=torch.long)  # (n, P)
    attn = torch.zeros((n, width), dtype=torch.long)  # (n, P)
    mm = torch.zeros((n, width), dtype=torch.long)  # (n, P)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = p.input_ids
        attn[i, width - len(p) :] = 1
        mm[i, width - len(p) :] = p.mm_token_type_ids
    if response_ids is not None:
        resp_attn = torch.ones_like(response_ids) if response_mask is None else response_mask.long()
        ids = torch.cat([ids, response_ids], dim=1)  # (n, P + T)
        attn = torch.cat([attn, resp_attn], dim=1)  # (n, P + T)
        mm = torch.cat([mm, torch.zeros_like(response_ids)], dim=1)  # (n, P + T)
    batch = {"input_ids": ids, "attention_mask": attn, "mm_token_type_ids": mm}
    pixels = [p.pixel_values for p in prompts if p.pixel_values is not None]
    if pixels:
        batch["pixel_values"] = torch.cat(pixels, dim=0)
        batch["image_grid_thw"] = torch.cat([p.image_grid_thw for p in prompts if p.image_grid_thw is not None])
    return batch


def micro_batch_inputs(prompts: list[EncodedPrompt], rollouts, rows: torch.Tensor, pad_id: int,
                       device: torch.device) -> tuple[dict[str, torch.Tensor], torch.Tensor, int]:
    """Inputs for `rows` of the rollouts: prompts + responses cut to the longest valid one: (inputs, mask (n, T), T)."""
    width = int(rollouts.lengths[rows].max().clamp(min=1))
    response = rollouts.response_ids[rows, :width]  # (n, T)
    mask = rollouts.response_mask[rows, :width]  # (n, T)
    inputs = collate(prompts, pad_id, response, mask)
    return {k: v.to(device) for k, v in inputs.items()}, mask.to(device), width


def response_logits(model, inputs: dict[str, torch.Tensor], n_response: int, **kwargs) -> torch.Tensor:
    """Eq. 1: the (n, T, V) logits that predict the response block at the end of `inputs` (position P + t - 1
    predicts token t: the last T + 1 positions but the final one). The model derives its M-RoPE positions itself."""
    out = model(**inputs, logits_to_keep=n_response + 1, use_cache=False, **kwargs)
    return out.logits[:, :-1]
