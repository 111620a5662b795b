"""Selective distillation of one step (Algorithm 1, lines 11-12): Eq. 1, 2, 3, 9 and 11 on the selected rows.

For each micro-batch of a rank's selected rows: the teacher's detached logits on the crop prompt
(Eq. 2), the student's logits on the full-image prompt (Eq. 1), both over the same sampled response
tokens; the top-k JSD per token (Eq. 3); its share of the budgeted loss (Eq. 11) backpropagated at
once; the utility labels (Eq. 7-9) from the same logits. Full-vocabulary logits live for one
micro-batch only.

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
from opd.divergence import budgeted_loss, generalized_jsd, topk_support
from opd.rollout import Rollouts
from opd.teacher import EMATeacher, response_logits
from opd.utility import utility_labels


@dataclass
class DistillConfig:
    k: int = 100
    alpha: float = 0.5
    micro_batch: int = 4
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
    teacher_s: float = 0.0
    student_s: float = 0.0


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
) -> DistillResult:
    """Backpropagates this rank's share of Eq. 11 and returns its sums and utility labels.

    selected: local row ids of S on this rank. teacher_prompt(j) -> EncodedPrompt of local prompt j's
    privileged view; it is called only for prompts with a selected row.
    """
    device = accelerator.device
    res = DistillResult(utility=torch.full((len(rollouts),), float("nan")))
    res.tokens = int(rollouts.lengths[selected].sum()) if selected.numel() else 0
    res.global_tokens = int(accelerator.reduce(torch.tensor(res.tokens, device=device), "sum").item())
    if res.global_tokens == 0:  # S is empty everywhere: no teacher call, zero distillation term
        return res
    scale = accelerator.num_processes  # DDP averages gradients over ranks
    chunks = list(torch.split(selected, cfg.micro_batch)) if selected.numel() else []
    if not chunks:  # keep this rank in the gradient all-reduce with a zero-weighted forward
        inputs, _, width = micro_batch_inputs(
            [student_prompts[int(rollouts.prompt_index[0])]], rollouts, torch.tensor([0]), pad_id, device
        )
        with accelerator.autocast():
            dummy = response_logits(student, inputs, width).float().sum() * 0.0
        accelerator.backward(dummy)
        return res
    for j, rows in enumerate(chunks):
        sync = nullcontext() if j == len(chunks) - 1 else accelerator.no_sync(student)
        prompt_ids = rollouts.prompt_index[rows].tolist()
        with sync:
            _sync(device)
            t0 = time.perf_counter()
            t_inputs, mask, width = micro_batch_inputs([teacher_prompt(p) for p in prompt_ids], rollouts, rows, pad_id, device)
            with accelerator.autocast():
                t_logits = teacher.logits(t_inputs, width)  # (n, T, V) Eq. 2
            _sync(device)
            t1 = time.perf_counter()
            s_inputs, _, _ = micro_batch_inputs([student_prompts[p] for p in prompt_ids], rollouts, rows, pad_id, device)
            with accelerator.autocast():
                s_logits = response_logits(student, s_inputs, width)  # (n, T, V) Eq. 1
            s_logp, t_logp = topk_support(s_logits, t_logits, cfg.k, tail=True)  # (n, T, k + 1)
            per_token = generalized_jsd(s_logp, t_logp, cfg.alpha)  # (n, T) Eq. 3
            ones = torch.ones(len(rows), device=device)
            loss = budgeted_loss(per_token, ones, mask, denominator=res.global_tokens) * scale  # Eq. 11
            accelerator.backward(loss)
            res.loss_sum += float((per_token.detach() * mask).sum())
            u = utility_labels(s_logits, t_logits, mask, cfg.k, cfg.use_overlap, cfg.use_confidence)  # (n,) Eq. 9
            res.utility[rows] = u.float().cpu()
            del s_logits, t_logits, s_logp, t_logp, per_token, loss
            _sync(device)
            res.teacher_s += t1 - t0
            res.student_s += time.perf_counter() - t1
    return res
