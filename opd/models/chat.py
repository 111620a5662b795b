"""Prompts: chat messages, the processor's encoding of one prompt, batches of prompt + response, and the forwards that
score a response (`response_logits`: the student's Eq. 1 and, through `opd.models.ema_teacher.Teacher`, Eq. 2).

The student and the teacher see the same question and the same response tokens; only the images
differ (Eq. 1 vs Eq. 2). Every model input of this project is built here: prompts are encoded one at
a time (`encode_prompt`), then left-padded into a batch with an optional response block appended on
the right (`collate`), so all rows' responses start at the same column and the logits that predict
them are the last T + 1 positions minus one.
"""

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


def encode_prompt(
    processor, images: list[Image.Image], problem: str, enable_thinking: bool = False, max_len: int | None = None
) -> EncodedPrompt:
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


def prompt_length(processor, sizes: list[tuple[int, int]], problem: str, enable_thinking: bool = False) -> int:
    """The token count `encode_prompt` gives for images of these (width, height) sizes, without decoding or
    resizing any image: the templated text's tokens, each image placeholder expanded to the processor's
    number of image tokens for its size (`_get_num_multimodal_tokens`, the count vLLM uses). A processor
    without that method encodes blank images of the sizes instead (slower, the same count)."""
    counter = getattr(processor, "_get_num_multimodal_tokens", None)
    if counter is None or not sizes:
        blanks = [Image.new("RGB", (max(1, w), max(1, h))) for w, h in sizes]
        return len(encode_prompt(processor, blanks, problem, enable_thinking))
    text = prompt_text(processor, problem, len(sizes), enable_thinking)  # one placeholder token per image
    n_text = len(processor.tokenizer(text)["input_ids"])
    per_image = counter(image_sizes=[(max(1, h), max(1, w)) for w, h in sizes])["num_image_tokens"]
    return n_text - len(sizes) + sum(per_image)


def collate(
    prompts: list[EncodedPrompt],
    pad_id: int,
    response_ids: torch.Tensor | None = None,
    response_mask: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Left-pads prompts to a batch and appends a (n, T) response block on the right.

    Returns model inputs: input_ids, attention_mask, mm_token_type_ids (zeros over padding and the
    response), and pixel_values / image_grid_thw concatenated in row order. Response positions after
    EOS get attention 0; they come after every valid position, so no valid position attends to them.
    """
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


def micro_batch_inputs(
    prompts: list[EncodedPrompt], rollouts, rows: torch.Tensor, pad_id: int, device: torch.device
) -> tuple[dict[str, torch.Tensor], torch.Tensor, int]:
    """Model inputs for `rows` of `rollouts` (`opd.engine.rollout.Rollouts`): their prompts + their responses trimmed to the
    longest valid one: (inputs, mask (n, T), T)."""
    width = int(rollouts.lengths[rows].max().clamp(min=1))
    response = rollouts.response_ids[rows, :width]  # (n, T)
    mask = rollouts.response_mask[rows, :width]  # (n, T)
    inputs = collate(prompts, pad_id, response, mask)
    return {k: v.to(device) for k, v in inputs.items()}, mask.to(device), width


def completion_inputs(
    prompts: list[EncodedPrompt], completions: list[torch.Tensor], pad_id: int, device: torch.device
) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, int]:
    """Model inputs for prompts each followed by its own completion ids (1-D), right-padded to the longest:
    (inputs, mask (n, T), completion ids (n, T), T). The completions of DAPD's reference and OPOD's answer."""
    width = max(1, max(len(c) for c in completions))
    ids = torch.full((len(completions), width), pad_id, dtype=torch.long)  # (n, T)
    mask = torch.zeros((len(completions), width), dtype=torch.bool)  # (n, T)
    for i, c in enumerate(completions):
        ids[i, : len(c)] = c
        mask[i, : len(c)] = True
    inputs = collate(prompts, pad_id, ids, mask)
    return {k: v.to(device) for k, v in inputs.items()}, mask.to(device), ids.to(device), width


def response_logits(model, inputs: dict[str, torch.Tensor], n_response: int, **kwargs) -> torch.Tensor:
    """Logits of the n_response positions that predict the response block at the end of `inputs`.

    With a left-padded prompt and a (n, T) response appended (`opd.models.chat.collate`), position P + t - 1
    predicts response token t, so the last T + 1 positions minus the final one are kept. The model
    computes its own multimodal (M-RoPE) positions from input_ids, mm_token_type_ids and the image
    grid. Returns (n, T, V).
    """
    out = model(**inputs, logits_to_keep=n_response + 1, use_cache=False, **kwargs)
    return out.logits[:, :-1]


def response_hidden(model, inputs: dict[str, torch.Tensor], n_response: int) -> torch.Tensor:
    """The final (normed) hidden states at the same positions as `response_logits`: (n, T, H).

    logits = hidden @ W_lm_head^T; the LM head itself is left to `opd.maths.chunked`, which never builds
    the (n, T, V) logits. Only one position's logits are computed here (logits_to_keep=1).
    """
    out = model(**inputs, logits_to_keep=1, output_hidden_states=True, use_cache=False)
    return out.hidden_states[-1][:, -(n_response + 1) : -1]


def lm_head_weight(model) -> torch.Tensor:
    """W of logits = h W^T (the output embedding; tied to the input embedding in some checkpoints)."""
    return model.get_output_embeddings().weight
