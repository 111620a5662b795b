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

Sharded (FSDP2, `opd.sharding`): every forward and backward of the student and the teacher gathers
parameters collectively, so the ranks run in lockstep: every rank runs as many micro-batches as the
rank with the most (one all-gather of the counts), padding with zero-weighted micro-batches on one of
its own rows (teacher forwards on the student's prompt, not counted as teacher calls), and gradients
are reduce-scattered after every backward (FSDP keeps no unsharded gradient between micro-batches). The
LM-head weights are read after their model's forward, when FSDP has gathered them (the root group), and
the teacher is resharded after each micro-batch's loss, before the student's backward.

The family (`opd.methods`): the teacher runs once per selected row and teacher view (OPD-V: the
crop and the masked crop); the support and divergence are the method's (`DistillConfig.support`,
`.divergence`), and a per-token weight w_t (OPD-V's trust region from the two teachers' sampled-token
log-probs; Vision-OPD's importance ratio with `is_clip`) multiplies Eq. 11's weights, whose
denominator still counts every selected valid token.

Cost accounting: each teacher view's forward, and the teacher-side LM-head work of the loss (its
logits, log-softmax and gathers inside the chunked loss; the sampled-token log-probs of OPD-V), are
teacher time, per view (`TeacherCost`).

Where this departs from the paper: the student forward runs on selected rows only. Rows with z_i = 0
contribute nothing to Eq. 11 or its gradient, so their forward would be discarded work.
"""

import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from opd.chat import EncodedPrompt, collate
from opd.chunked import budgeted_loss_from_hidden, sampled_logp_from_hidden, topk_jsd_from_logits
from opd.divergence import budgeted_weights
from opd.rollout import Rollouts
from opd.sharding import is_sharded, reshard
from opd.teacher import EMATeacher, lm_head_weight, response_hidden, response_logits
from opd.utility import sample_utility
from opd.weights import importance_ratio, trust_region


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
    support: str = "student_tail"
    """The divergence's support (opd.methods.SUPPORTS)."""
    divergence: str = "jsd"
    """'jsd' (Eq. 3 with alpha) or 'bc_rkl'."""
    token_weight: str = "none"
    """'none' or 'trust_region' (needs a second, negative teacher view)."""
    is_clip: float = 0.0
    """Importance-ratio clip c; 0 = no ratio."""


@dataclass
class TeacherCost:
    """What one teacher view cost on this rank: forward rows, real and padded input tokens, seconds."""

    rows: int = 0
    tokens: int = 0
    padded_tokens: int = 0
    seconds: float = 0.0


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
    teachers: dict[str, TeacherCost] = field(default_factory=dict)
    """Per teacher view: rows, prompt + valid response tokens, input tokens with padding, seconds."""
    student_s: float = 0.0

    @property
    def teacher_s(self) -> float:
        return sum(c.seconds for c in self.teachers.values())


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


def micro_batch_loss(student, teacher: EMATeacher, s_inputs, t_inputs: list, mask, width: int, weights, cfg: DistillConfig,
                     response=None, old_logp=None):
    """This micro-batch's share of Eq. 11 (differentiable), its per-token D (detached, (n, T)), the utility
    labels u_i (Eq. 9, (n,)), and the teacher seconds per teacher view (list, in t_inputs' order).

    t_inputs: the positive teacher's inputs, then the negative teacher's (OPD-V); weights (n, T): Eq. 11's
    per-token weights (times the DDP world size); response, old_logp (n, T): the sampled tokens and their
    log-probs at sampling (for the trust region and the importance ratio).
    """
    device = mask.device
    seconds = [0.0] * len(t_inputs)
    is_clip = dict(token_ids=response[mask], old_logp=old_logp[mask], is_clip=cfg.is_clip) if cfg.is_clip else {}

    def teacher_forward(j: int, fn):
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        seconds[j] += time.perf_counter() - t0
        return out

    if cfg.loss_chunk == 0:  # whole micro-batch logits
        t_logits = teacher_forward(0, lambda: teacher.logits(t_inputs[0], width))  # (n, T, V) Eq. 2
        if cfg.token_weight == "trust_region":  # OPD-V: w_t = ReLU(log pi_T+(y_t) - log pi_T-(y_t))
            n_logits = teacher_forward(1, lambda: teacher.logits(t_inputs[1], width))  # (n, T, V)
            pos, neg = (torch.log_softmax(x.float(), -1).gather(-1, response.unsqueeze(-1)).squeeze(-1) for x in (t_logits, n_logits))
            weights = weights * trust_region(pos, neg)  # (n, T)
            del n_logits
        s_logits = response_logits(student, s_inputs, width)  # (n, T, V) Eq. 1
        per_token, terms = topk_jsd_from_logits(
            s_logits, t_logits, cfg.k, cfg.alpha, support=cfg.support, divergence=cfg.divergence
        )  # (n, T) Eq. 3 (or the method's D), (n, T, 3)
        if cfg.is_clip:
            logp = torch.log_softmax(s_logits.float(), -1).gather(-1, response.unsqueeze(-1)).squeeze(-1)  # (n, T)
            weights = weights * importance_ratio(logp, old_logp, cfg.is_clip)
        loss = torch.where(weights > 0, per_token * weights, torch.zeros_like(per_token)).sum()  # Eq. 11
        per_token = per_token.detach()
    else:  # final hidden states, LM head chunk by chunk
        h_t = teacher_forward(0, lambda: teacher.hidden(t_inputs[0], width)[mask])  # (P, H) Eq. 2, valid positions
        w_t = lm_head_weight(teacher.model)  # after the forward: gathered there when sharded
        w_flat = weights[mask]  # (P,)
        if cfg.token_weight == "trust_region":
            y = response[mask]  # (P,)
            pos = teacher_forward(0, lambda: sampled_logp_from_hidden(h_t, w_t, y, cfg.loss_chunk))  # (P,)
            neg = teacher_forward(1, lambda: sampled_logp_from_hidden(
                teacher.hidden(t_inputs[1], width)[mask], w_t, y, cfg.loss_chunk))  # (P,)
            w_flat = w_flat * trust_region(pos, neg)
        h_s = response_hidden(student, s_inputs, width)[mask]  # (P, H) Eq. 1
        w_s = lm_head_weight(getattr(student, "module", student))  # DDP: .module
        timing: dict[str, float] = {}
        loss, d_alpha, flat_terms = budgeted_loss_from_hidden(
            h_s, w_s, h_t, w_t, w_flat, cfg.k, cfg.alpha, cfg.loss_chunk, support=cfg.support,
            divergence=cfg.divergence, timing=timing, **is_clip,
        )  # Eq. 11 of Eq. 3 (or the method's D)
        seconds[0] += timing.get("teacher_s", 0.0)  # the teacher's LM head inside the fused loss
        per_token = torch.zeros(mask.shape, dtype=d_alpha.dtype, device=device).masked_scatter(mask, d_alpha)
        terms = torch.zeros((*mask.shape, 3), dtype=flat_terms.dtype, device=device)
        terms[mask] = flat_terms
    d, o, c = terms.unbind(-1)  # (n, T) each, Eq. 7-8
    o = o if cfg.use_overlap else torch.ones_like(o)
    c = c if cfg.use_confidence else torch.ones_like(c)
    return loss, per_token, sample_utility(d, o, c, mask), seconds


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
    teacher_views: tuple[str, ...] = ("crop",),
) -> DistillResult:
    """Backpropagates this rank's share of Eq. 11 and returns its sums and utility labels.

    selected: local row ids of S on this rank. teacher_prompt(view, j) -> EncodedPrompt of local prompt
    j in a teacher view; it is called only for prompts with a selected row. teacher_views: the
    positive teacher's view first, then OPD-V's negative one. autocast() -> the mixed precision
    context of the forwards.
    """
    device = accelerator.device
    res = DistillResult(utility=torch.full((len(rollouts),), float("nan")), teachers={v: TeacherCost() for v in teacher_views})
    res.tokens = int(rollouts.lengths[selected].sum()) if selected.numel() else 0
    res.global_tokens = int(accelerator.reduce(torch.tensor(res.tokens, device=device), "sum").item())
    if res.global_tokens == 0:  # S is empty everywhere: no teacher call, zero distillation term
        return res
    scale = accelerator.num_processes  # DDP and FSDP average gradients over ranks
    if is_sharded(student):
        try:
            return _distill_lockstep(
                accelerator, student, teacher, rollouts, student_prompts, teacher_prompt, selected, cfg, pad_id,
                autocast, teacher_views, res, scale,
            )  # fmt: skip
        finally:
            reshard(teacher.model)
    if not selected.numel():  # keep this rank in the gradient all-reduce with a zero-weighted forward
        inputs, _, width = micro_batch_inputs(
            [student_prompts[int(rollouts.prompt_index[0])]], rollouts, torch.tensor([0]), pad_id, device
        )
        with autocast():
            dummy = student(**inputs, logits_to_keep=1, use_cache=False).logits.float().sum() * 0.0
        accelerator.backward(dummy)
        return res
    plan = _plan(rollouts, teacher_prompt, selected, cfg, teacher_views[0])
    for j, group in enumerate(plan):
        sync = nullcontext() if j == len(plan) - 1 else accelerator.no_sync(student)
        with sync:
            _run_micro_batch(
                accelerator, student, teacher, rollouts, student_prompts, teacher_prompt, selected[group], cfg, pad_id,
                autocast, teacher_views, res, scale,
            )  # fmt: skip
    return res


def _plan(rollouts: Rollouts, teacher_prompt, selected: torch.Tensor, cfg: DistillConfig, view: str) -> list[torch.Tensor]:
    """This rank's micro-batches of S (positions into `selected`), grouped by teacher length."""
    if not selected.numel():
        return []
    prompt_of = rollouts.prompt_index[selected].tolist()
    t_len = torch.tensor([len(teacher_prompt(view, j)) for j in prompt_of]) + rollouts.lengths[selected]
    return plan_micro_batches(t_len, cfg.micro_batch, cfg.micro_batch_tokens)


def _run_micro_batch(
    accelerator, student, teacher: EMATeacher, rollouts: Rollouts, student_prompts, teacher_prompt, rows: torch.Tensor,
    cfg: DistillConfig, pad_id: int, autocast, teacher_views: tuple[str, ...], res: DistillResult, scale: int,
    padding: bool = False,
) -> None:
    """One micro-batch of `rows` (local ids): teacher forward(s), student forward, Eq. 11's share backpropagated;
    its sums, labels and costs go into `res`. padding=True (sharded lockstep): the same forwards and backward
    with zero weights, on the student's prompts for every view; nothing is counted or labelled."""
    device = accelerator.device
    prompt_ids = rollouts.prompt_index[rows].tolist()
    _sync(device)
    t0 = time.perf_counter()
    t_inputs = []
    for view in teacher_views:
        prompts = [student_prompts[p] if padding else teacher_prompt(view, p) for p in prompt_ids]
        inputs, mask, width = micro_batch_inputs(prompts, rollouts, rows, pad_id, device)
        t_inputs.append(inputs)
        if not padding:
            cost = res.teachers[view]
            cost.rows += len(rows)
            cost.tokens += int(mask.sum()) + sum(len(p) for p in prompts)
            cost.padded_tokens += inputs["input_ids"].numel()
    s_inputs, _, _ = micro_batch_inputs([student_prompts[p] for p in prompt_ids], rollouts, rows, pad_id, device)
    weights = budgeted_weights(torch.ones(len(rows), device=device), mask, res.global_tokens) * scale  # Eq. 11
    if padding:
        weights = torch.zeros_like(weights)
    response = rollouts.response_ids[rows, :width].to(device)  # (n, T)
    old_logp = rollouts.logp[rows, :width].to(device)  # (n, T)
    with autocast(), teacher.uncounted() if padding else nullcontext():
        loss, per_token, u, seconds = micro_batch_loss(
            student, teacher, s_inputs, t_inputs, mask, width, weights, cfg, response, old_logp
        )  # fmt: skip
    reshard(teacher.model)  # sharded: the teacher's gathered root (LM head) is freed before the student's backward
    accelerator.backward(loss)
    del per_token
    _sync(device)
    if padding:
        return
    res.loss_sum += float(loss.detach()) * res.global_tokens / scale  # sum of w_t D over S's tokens
    res.utility[rows] = u.float().cpu()
    for view, sec in zip(teacher_views, seconds):
        res.teachers[view].seconds += sec
    res.student_s += time.perf_counter() - t0 - sum(seconds)


def _distill_lockstep(
    accelerator, student, teacher, rollouts, student_prompts, teacher_prompt, selected, cfg, pad_id, autocast,
    teacher_views, res: DistillResult, scale: int,
) -> DistillResult:
    """`distill` for a sharded student: as many micro-batches on every rank as on the busiest one, the
    missing ones zero-weighted padding on this rank's first row (see the module docstring)."""
    device = accelerator.device
    plan = _plan(rollouts, teacher_prompt, selected, cfg, teacher_views[0])
    steps = int(accelerator.gather(torch.tensor([len(plan)], device=device)).max())  # every rank: the same count
    for j in range(steps):
        rows = selected[plan[j]] if j < len(plan) else torch.tensor([0])
        _run_micro_batch(
            accelerator, student, teacher, rollouts, student_prompts, teacher_prompt, rows, cfg, pad_id, autocast,
            teacher_views, res, scale, padding=j >= len(plan),
        )  # fmt: skip
    return res
