"""The hidden-state forwards of the fused kernel (`--fused-kernel`, `opd.maths.chunked`) and of the family's objectives
that score their own completions (DAPD's reference, OPOD's answer): logits = hidden @ W^T, never built whole.

The default step computes logits (`opd.models.chat.response_logits`); nothing here runs in it.
"""

from __future__ import annotations

import torch

from opd.models.chat import EncodedPrompt, collate


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
