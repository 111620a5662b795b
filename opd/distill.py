"""Selective distillation of one step (Algorithm 1, lines 11-12): Eq. 1, 2, 3, 9 and 11 on the selected rows.

A rank's selected rows are grouped by length into micro-batches (at most `micro_batch` rows and, when
set, `micro_batch_tokens` padded teacher tokens), so the teacher computes little padding. For each
micro-batch: the teacher's detached final hidden states on the crop prompt (Eq. 2) and the student's on
the full-image prompt (Eq. 1), both over the same sampled response tokens; then, one chunk of
`loss_chunk` valid positions at a time, both sides' logits through the LM head, the top-k JSD per token
(Eq. 3) and the utility terms (Eq. 7-8), without ever holding (positions x vocabulary) logits beyond a
chunk (`opd.chunked`); its share of the budgeted loss (Eq. 11) is backpropagated at once, and the
utility labels (Eq. 9) come from the same chunks. `loss_chunk = 0` computes whole micro-batch logits
instead (`opd.chunked.topk_jsd_from_logits`); tests check both against `topk_support` +
`generalized_jsd` + `utility_labels` on full logits.

Distributed: Eq. 11's denominator is the global count of selected valid tokens (one all-reduce, run
by every rank); DDP averages gradients over ranks, so each rank's loss is scaled by the world size.
Gradients are synchronised on each rank's last backward only. A rank holding no selected row while
others do runs one zero-weighted forward/backward on one of its rows so that the gradient all-reduce
still happens on every rank; when S is empty everywhere, no rank runs a forward.

Where this departs from the paper: the student forward runs on selected rows only. Rows with z_i = 0
contribute nothing to Eq. 11 or its gradient, so their forward would be discarded work.
"""

import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from opd.chat import EncodedPrompt, collate
from opd.chunked import budgeted_loss_from_hidden, topk_jsd_from_logits
from opd.divergence import budgeted_weights
from opd.rollout import Rollouts
from opd.teacher import EMATeacher, lm_head_weight, response_hidden, response_logits
from opd.utility import sample_utility


@dataclass
class DistillConfig:
    k: int = 100
    alpha: float = 0.5
    micro_batch: int = 4
    """Most rows per student/teacher forward."""
    micro_batch_tokens: int = 0
    """Most padded teacher tokens (rows x longest prompt + response) per forward; 0 = no limit."""
    loss_chunk: int = 512
    """Positions per LM-head chunk of the loss; 0 = the plain path on whole micro-batch logits."""
    use_overlap: bool = True
    use_confidence: bool = True


@dataclass
class DistillResult:
    loss_sum: float = 0.0
    """sum over this rank's selected valid tokens of D_alpha (Eq. 11's numerator, local part)."""
    tokens: int = 0
    """this rank's selected valid tokens (Eq. 11's denominator, local part)."""
    global_tokens: int = 0
    """Eq. 11's denominator over all ranks."""
    utility: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    """(N_local,) u_i for selected rows, NaN for unselected rows (they get no label)."""
    teacher_tokens: int = 0
    """prompt + valid response tokens of the rows the teacher scored."""
    teacher_padded_tokens: int = 0
    """tokens of the teacher's input batches, padding included."""
    teacher_s: float = 0.0
    student_s: float = 0.0


def plan_micro_batches(lengths: torch.Tensor, max_rows: int, max_tokens: int = 0) -> list[torch.Tensor]:
    """Groups rows by length: sorted longest first, filled greedily while rows <= max_rows and
    rows x longest <= max_tokens (a row longer than max_tokens goes alone). Returns index tensors."""
    order = torch.sort(lengths, descending=True, stable=True).indices.tolist()
    batches, current = [], []
    for i in order:
        longest = int(lengths[current[0]]) if current else int(lengths[i])
        if current and (len(current) == max_rows or (max_tokens and (len(current) + 1) * longest > max_tokens)):
            batches.append(torch.tensor(current))
            current = []
        current.append(i)
    if current:
        batches.append(torch.tensor(current))
    return batches


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def micro_batch_inputs(
    prompts: list[EncodedPrompt], rollouts: Rollouts, rows: torch.Tensor, pad_id: int, device: torch.device
) -> tuple[dict[str, torch.Tensor], torch.Tensor, int]:
    """Model inputs for `rows`: their prompts + their responses trimmed to the longest valid one."""
    width = int(rollouts.lengths[rows].max().clamp(min=1))
    response = rollouts.response_ids[rows, :width]  # (n, T)
    mask = rollouts.response_mask[rows, :width]  # (n, T)
    inputs = collate(prompts, pad_id, response, mask)
    return {k: v.to(device) for k, v in inputs.items()}, mask.to(device), width


def micro_batch_loss(student, teacher: EMATeacher, s_inputs, t_inputs, mask, width: int, weights, cfg: DistillConfig):
    """This micro-batch's share of Eq. 11 (differentiable), its per-token D_alpha (Eq. 3, detached, (n, T)),
    the utility labels u_i (Eq. 9, (n,)), and the seconds of the teacher forward.

    weights (n, T): Eq. 11's per-token weights (times the DDP world size).
    """
    _sync(mask.device)
    t0 = time.perf_counter()
    if cfg.loss_chunk == 0:  # whole micro-batch logits
        t_logits = teacher.logits(t_inputs, width)  # (n, T, V) Eq. 2
        _sync(mask.device)
        teacher_s = time.perf_counter() - t0
        s_logits = response_logits(student, s_inputs, width)  # (n, T, V) Eq. 1
        per_token, terms = topk_jsd_from_logits(s_logits, t_logits, cfg.k, cfg.alpha)  # (n, T) Eq. 3, (n, T, 3)
        loss = torch.where(weights > 0, per_token * weights, torch.zeros_like(per_token)).sum()  # Eq. 11
        per_token = per_token.detach()
    else:  # final hidden states, LM head chunk by chunk
        h_t = teacher.hidden(t_inputs, width)[mask]  # (P, H) Eq. 2, valid positions only
        _sync(mask.device)
        teacher_s = time.perf_counter() - t0
        h_s = response_hidden(student, s_inputs, width)[mask]  # (P, H) Eq. 1
        w_s, w_t = lm_head_weight(getattr(student, "module", student)), lm_head_weight(teacher.model)  # DDP: .module
        loss, d_alpha, flat_terms = budgeted_loss_from_hidden(
            h_s, w_s, h_t, w_t, weights[mask], cfg.k, cfg.alpha, cfg.loss_chunk
        )  # Eq. 11 of Eq. 3
        per_token = torch.zeros(mask.shape, dtype=d_alpha.dtype, device=mask.device).masked_scatter(mask, d_alpha)
        terms = torch.zeros((*mask.shape, 3), dtype=flat_terms.dtype, device=mask.device)
        terms[mask] = flat_terms
    d, o, c = terms.unbind(-1)  # (n, T) each, Eq. 7-8
    o = o if cfg.use_overlap else torch.ones_like(o)
    c = c if cfg.use_confidence else torch.ones_like(c)
    return loss, per_token, sample_utility(d, o, c, mask), teacher_s


def distill(
    accelerator,
    student,
    teacher: EMATeacher,
    rollouts: Rollouts,
    student_prompts: list[EncodedPrompt],
    teacher_prompt,
    selected: torch.Tensor,
    cfg: DistillConfig,
    pad_id: int,
    autocast=nullcontext,
) -> DistillResult:
    """Backpropagates this rank's share of Eq. 11 and returns its sums and utility labels.

    selected: local row ids of S on this rank. teacher_prompt(j) -> EncodedPrompt of local prompt j's
    privileged view; it is called only for prompts with a selected row. autocast() -> the mixed
    precision context of the forwards.
    """
    device = accelerator.device
    res = DistillResult(utility=torch.full((len(rollouts),), float("nan")))
    res.tokens = int(rollouts.lengths[selected].sum()) if selected.numel() else 0
    res.global_tokens = int(accelerator.reduce(torch.tensor(res.tokens, device=device), "sum").item())
    if res.global_tokens == 0:  # S is empty everywhere: no teacher call, zero distillation term
        return res
    scale = accelerator.num_processes  # DDP averages gradients over ranks
    if not selected.numel():  # keep this rank in the gradient all-reduce with a zero-weighted forward
        inputs, _, width = micro_batch_inputs(
            [student_prompts[int(rollouts.prompt_index[0])]], rollouts, torch.tensor([0]), pad_id, device
        )
        with autocast():
            dummy = student(**inputs, logits_to_keep=1, use_cache=False).logits.float().sum() * 0.0
        accelerator.backward(dummy)
        return res
    prompt_of = rollouts.prompt_index[selected].tolist()
    t_len = torch.tensor([len(teacher_prompt(j)) for j in prompt_of]) + rollouts.lengths[selected]
    plan = plan_micro_batches(t_len, cfg.micro_batch, cfg.micro_batch_tokens)
    for j, group in enumerate(plan):
        rows = selected[group]
        sync = nullcontext() if j == len(plan) - 1 else accelerator.no_sync(student)
        prompt_ids = rollouts.prompt_index[rows].tolist()
        with sync:
            _sync(device)
            t0 = time.perf_counter()
            t_inputs, mask, width = micro_batch_inputs([teacher_prompt(p) for p in prompt_ids], rollouts, rows, pad_id, device)
            s_inputs, _, _ = micro_batch_inputs([student_prompts[p] for p in prompt_ids], rollouts, rows, pad_id, device)
            weights = budgeted_weights(torch.ones(len(rows), device=device), mask, res.global_tokens) * scale  # Eq. 11
            with autocast():
                loss, per_token, u, teacher_s = micro_batch_loss(student, teacher, s_inputs, t_inputs, mask, width, weights, cfg)
            accelerator.backward(loss)
            res.loss_sum += float((per_token * mask).sum())
            res.utility[rows] = u.float().cpu()
            res.teacher_tokens += int(t_len[group].sum())
            res.teacher_padded_tokens += t_inputs["input_ids"].numel()
            del per_token, loss
            _sync(device)
            res.teacher_s += teacher_s
            res.student_s += time.perf_counter() - t0 - teacher_s
    return res
