"""The distillation pass on every path the default does not take: the fused kernel, token weights, OPD-V's second
teacher view (`fused_distill`, which the run puts in `opd.methods.objective.distill`'s place: `fused`).

`opd.methods.objective.distill` runs Eq. 1-3, 9 and 11 itself on the plain path (one micro-batch's logits, autograd
through `opd.maths.divergence`). A run with `--fused-kernel` (the paper-4b/-9b presets, or a vocabulary past
`opd.maths.loss.PLAIN_LOGITS_LIMIT`), a method with a token weight (Vision-OPD's is_clip, OPOD's gate) or a second
teacher view (OPD-V) runs `micro_batch_loss` per micro-batch instead: on logits (the plain arm, also the toy studies'
and bench's) or on final hidden states with the LM head chunk by chunk (`opd.maths.chunked.budgeted_loss_from_hidden`,
proven equal to the plain path in float64 by tests/test_chunked.py).
"""

import torch

from opd.maths.chunked import budgeted_loss_from_hidden, sampled_logp, sampled_logp_from_hidden
from opd.data.records import StepBatch
from opd.maths.divergence import labels_from_terms, upcast, utility_terms, weighted_sum
from opd.maths.family import AGGREGATION_WEIGHTS, topk_divergence
from opd.maths.loss import LossConfig
from opd.maths.weights import SampledLogp, TokenWeight, token_weight
from opd.methods.lockstep import lockstep, timed
from opd.methods.interface import ObjectiveResult, TeacherCost
from opd.methods.objective import begin, book, distill_labels, row_scales, slot_inputs, teacher_plans
from opd.models.chat import response_logits
from opd.models.hidden import lm_head_weight, response_hidden
from opd.models.ema_teacher import Stopwatch, Teacher


def micro_batch_loss(student, teacher: Teacher, s_inputs, t_inputs: list, mask, width: int, weights, cfg: LossConfig,
                     response=None, old_logp=None, extras: dict | None = None):
    """This micro-batch's share of Eq. 11 (differentiable), its per-token D (detached, (n, T)), the utility
    labels u_i (Eq. 9, (n,)), and the teacher seconds per teacher view (list, in t_inputs' order).

    t_inputs: the positive teacher's inputs, then the negative teacher's (OPD-V); weights (n, T): Eq. 11's
    per-token weights (times the DDP world size); response, old_logp (n, T): the sampled tokens and their
    log-probs at sampling (for the method's token weight). With a token weight `extras` (a dict) receives
    'token_weight' (w_t) and 'teacher_logp' (log pi_T(y_t)), (n, T), 0 outside the mask.
    """
    device = mask.device
    costs = [TeacherCost() for _ in t_inputs]  # the teacher seconds per view (`lockstep.timed`)
    weight_fn = token_weight(cfg.token_weight, cfg.is_clip)  # w_t (opd.maths.weights), None when 1

    temp = cfg.temperature
    if not cfg.kernel:  # the plain path: one micro-batch's logits, autograd through opd.maths.divergence
        with timed(costs[0], device):
            t_logits = teacher.logits(t_inputs[0], width)  # (n, T, V) Eq. 2
        if temp != 1.0:  # the loss temperature: both sides' logits divided
            t_logits = upcast(t_logits) / temp  # (float64 stays float64)
        negative = None
        if len(t_inputs) > 1:  # OPD-V's negative teacher: its sampled-token log-probs only, at the same temperature
            with timed(costs[1], device):
                n_logits = teacher.logits(t_inputs[1], width)  # (n, T, V)
                if temp != 1.0:
                    n_logits = upcast(n_logits) / temp
                negative = sampled_logp(n_logits, response)  # (n, T)
                del n_logits
        s_logits = response_logits(student, s_inputs, width)  # (n, T, V) Eq. 1
        if temp != 1.0:
            s_logits = upcast(s_logits) / temp
        per_token = topk_divergence(s_logits, t_logits, cfg.topk, cfg.alpha, support=cfg.support,
                                    divergence=cfg.divergence)  # (n, T) Eq. 3 (or the method's D)
        terms = torch.stack(utility_terms(s_logits.detach(), t_logits, cfg.topk), dim=-1)  # (n, T, 3) Eq. 7-8
        if weight_fn is not None:
            sampled = SampledLogp(sampled_logp(s_logits.detach(), response), sampled_logp(t_logits, response), old_logp,
                                  negative)  # fmt: skip
            w_tok = weight_fn(sampled)  # (n, T)
            weights = weights * w_tok
            if extras is not None:
                extras["token_weight"], extras["teacher_logp"] = w_tok * mask, sampled.teacher * mask
        loss = weighted_sum(per_token, weights)  # Eq. 11's share of this micro-batch
        per_token = per_token.detach()
    else:  # final hidden states, LM head chunk by chunk
        with timed(costs[0], device):
            h_t = teacher.hidden(t_inputs[0], width)[mask]  # (P, H) Eq. 2, valid positions
        w_t = lm_head_weight(teacher.model)  # after the forward: gathered there when sharded
        tokens = None
        if weight_fn is not None:
            y = response[mask]  # (P,)
            negative = None
            if len(t_inputs) > 1:  # OPD-V's negative teacher: its sampled-token log-probs only, at the same temperature
                with timed(costs[1], device):
                    negative = sampled_logp_from_hidden(teacher.hidden(t_inputs[1], width)[mask], w_t, y,
                                                        cfg.chunk, temperature=temp)  # (P,)  # fmt: skip
            tokens = TokenWeight(weight_fn, y, old_logp[mask] if old_logp is not None else None, negative)
        h_s = response_hidden(student, s_inputs, width)[mask]  # (P, H) Eq. 1
        w_s = lm_head_weight(getattr(student, "module", student))  # DDP: .module
        timing: dict[str, float] = {}
        flat: dict = {}
        loss, d_alpha, flat_terms = budgeted_loss_from_hidden(
            h_s, w_s, h_t, w_t, weights[mask], cfg.topk, cfg.alpha, cfg.chunk, support=cfg.support,
            divergence=cfg.divergence, tokens=tokens, timing=timing, stopwatch=Stopwatch, extras=flat, temperature=temp,
        )  # Eq. 11 of Eq. 3 (or the method's D)
        costs[0].seconds += timing.get("teacher_s", 0.0)  # the teacher's LM head inside the fused loss
        if tokens is not None and extras is not None:
            for key, values in flat.items():
                extras[key] = torch.zeros(mask.shape, dtype=values.dtype, device=device).masked_scatter(mask, values)
        per_token = torch.zeros(mask.shape, dtype=d_alpha.dtype, device=device).masked_scatter(mask, d_alpha)
        terms = flat_terms  # (P, 3) at the valid positions
    u = labels_from_terms(terms, mask, not cfg.no_overlap, not cfg.no_confidence)  # (n,) Eq. 9 from Eq. 7-8's terms
    return loss, per_token, u, [cost.seconds for cost in costs]


def fused(loss: LossConfig, teacher_views) -> bool:
    """Whether a run's distillation pass leaves the plain path: the fused kernel, a token weight, a second view."""
    return bool(loss.kernel or token_weight(loss.token_weight, loss.is_clip) or len(teacher_views) > 1)


def fused_distill(objective, batch: StepBatch, row_weights: torch.Tensor | None = None, sync: bool = True,
                  token_sums: dict | None = None, labels: list[str] | None = None) -> ObjectiveResult:  # fmt: skip
    """`opd.methods.objective.distill` with `micro_batch_loss` per micro-batch. token_sums (a dict), with a token
    weight: per-row sums of w_t and log pi_T(y_t) (OPOD's gate and teacher log-probs)."""
    ctx = objective.ctx
    cfg, ro = ctx.loss, batch.rollouts
    res = begin(ctx, batch, labels or distill_labels(ctx))
    sums: dict = {}
    if token_sums is not None and token_weight(cfg.token_weight, cfg.is_clip) is not None:
        sums = token_sums
        sums.update(token_weight=torch.zeros(len(ro)), teacher_logp=torch.zeros(len(ro)))
    if res.empty:  # S is empty everywhere: no teacher call, zero distillation term
        return res
    row_w, dtype, scale = row_scales(ctx, batch, row_weights)
    for mb in lockstep(ctx, batch, teacher_plans(ctx, batch, ctx.teacher_views[0]), sync, release=ctx.teacher_models):
        teacher, rows, views, s_inputs, w_i = slot_inputs(ctx, batch, mb, res)
        mask, width, aggregate = views[0][1], views[0][2], AGGREGATION_WEIGHTS[cfg.aggregation]
        weights = mb.weight(aggregate(row_w[rows].to(ctx.device), mask, res.global_tokens, dtype, w_i) * scale)  # (n, T)
        extras: dict = {}
        with mb.synced():
            with ctx.autocast(), mb.teacher(teacher):
                loss, _, u, seconds = micro_batch_loss(
                    ctx.student, teacher, s_inputs, [v[0] for v in views], mask, width, weights, cfg,
                    ro.response_ids[rows, :width].to(ctx.device), ro.logp[rows, :width].to(ctx.device), extras,
                )  # fmt: skip
            mb.backward(loss)
        book(res, mb, rows, loss, u, views, seconds, scale)
        for key in sums if mb.real else ():  # with a token weight: its per-row sums
            sums[key][rows] = extras[key].sum(-1).float().cpu()
    res.loss_share = res.loss_sum / max(1, res.global_tokens)  # summed over ranks: the step's loss
    return res
