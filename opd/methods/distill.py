"""The family's distillation pass of one step (Algorithm 1, lines 11-12): Eq. 1, 2, 3, 9 and 11 on S only.

`distill` is the default objective's call (`opd.methods.distillation.Distillation`; OPOD runs it for its gated term).
A rank's rows of S are grouped by length into micro-batches (`--micro-batch` rows); for each, the teacher's detached
logits on the crop prompt (Eq. 2), the student's on the full-image prompt (Eq. 1), Eq. 3 on the support
(`loss.support_logp` + `generalized_jsd`, through autograd), its share of Eq. 11 (the global denominator:
`opd.maths.loss.loss_denominator`) backpropagated at once, and the labels u_i (Eq. 7-9) from the same logits.

Memory per micro-batch (the plain path): n rows x T response positions x V ids of float32 logits per side; the
student's logits, its tail's masked copy and the teacher's logits are held, about five (n, T, V) tensors at the peak
(20 n T V bytes: the toy's 64 x 4 x 105 is 0.5 MB; Qwen3.5's 4 x 1,024 x 248,320 would be 20 GB). Past
`opd.maths.loss.PLAIN_LOGITS_LIMIT` a run takes the fused kernel instead (--fused-kernel: `micro_batch_loss`,
`opd.maths.chunked`), as do token weights and OPD-V's second teacher view. Lockstep and padding over ranks:
`opd.methods.lockstep.lockstep`; details, teachers and cost accounting: docs/TRAINING.md#the-distillation-pass.
"""


import torch

from opd.maths.chunked import budgeted_loss_from_hidden, sampled_logp, sampled_logp_from_hidden
from opd.maths.divergence import generalized_jsd, upcast, weighted_sum
from opd.maths.family import bias_corrected_reverse_kl, topk_divergence
from opd.models.ema_teacher import Teacher
from opd.models.chat import lm_head_weight, micro_batch_inputs, response_hidden, response_logits
from opd.maths.loss import LossConfig, aggregation_weights, support_logp
from opd.methods.objective import ObjectiveResult, StepBatch, teacher_inputs, teacher_plans
from opd.methods.lockstep import Stopwatch, TeacherCost, lockstep, timed
from opd.maths.utility import labels_from_terms, utility_terms
from opd.maths.weights import SampledLogp, TokenWeight, token_weight


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
            divergence=cfg.divergence, tokens=tokens, timing=timing, extras=flat, temperature=temp,
        )  # Eq. 11 of Eq. 3 (or the method's D)
        costs[0].seconds += timing.get("teacher_s", 0.0)  # the teacher's LM head inside the fused loss
        if tokens is not None and extras is not None:
            for key, values in flat.items():
                extras[key] = torch.zeros(mask.shape, dtype=values.dtype, device=device).masked_scatter(mask, values)
        per_token = torch.zeros(mask.shape, dtype=d_alpha.dtype, device=device).masked_scatter(mask, d_alpha)
        terms = flat_terms  # (P, 3) at the valid positions
    u = labels_from_terms(terms, mask, not cfg.no_overlap, not cfg.no_confidence)  # (n,) Eq. 9 from Eq. 7-8's terms
    return loss, per_token, u, [cost.seconds for cost in costs]


def distill(objective, batch: StepBatch, row_weights: torch.Tensor | None = None, sync: bool = True,
            token_sums: dict | None = None, labels: list[str] | None = None) -> ObjectiveResult:  # fmt: skip
    """Eq. 11 on S against the run's teacher(s), backpropagated micro-batch by micro-batch; returns its sums and the
    labels u_i of S (Eq. 9). The default objective's call (`Distillation.__call__`), so each micro-batch's Eq. 1, 2, 3
    and 11 run right here; the fused kernel, token weights and OPD-V's second view run `micro_batch_loss`.

    `objective.ctx`: the run's `ObjectiveContext` (teachers in a fixed order, each row routed to one by `batch.route`).
    row_weights (N_local,): each row's Eq. 11 weights, numerator only (OPOD's beta); `batch.weights`: unbiased
    selection's 1 / pi_i (Eq. 11's Hajek form). sync=False: no backward synchronises DDP (the caller's later pass
    does). token_sums (a dict), with a token weight: per row sums of w_t and log pi_T(y_t) (OPOD). labels: the
    result's teacher labels (default `distill_labels`). Memory: module docstring."""
    ctx = objective.ctx
    cfg, ro, teachers = ctx.loss, batch.rollouts, ctx.teachers
    res = ObjectiveResult.begin(ctx, batch, labels or distill_labels(ctx))
    sums: dict = {}
    if token_sums is not None and (cfg.token_weight != "none" or cfg.is_clip):
        sums = token_sums
        sums.update(token_weight=torch.zeros(len(ro)), teacher_logp=torch.zeros(len(ro)))
    if res.empty:  # S is empty everywhere: no teacher call, zero distillation term
        return res
    row_w = torch.ones(len(ro)) if row_weights is None else row_weights.float().cpu()  # (N_local,) OPOD's beta
    float64 = next(ctx.student.parameters()).dtype == torch.float64  # Eq. 11's weights in float64 for a float64 policy
    dtype, scale = torch.float64 if float64 else torch.float32, ctx.accelerator.num_processes  # DDP averages ranks
    weighted = cfg.token_weight != "none" or bool(cfg.is_clip)  # a token weight w_t (`opd.maths.weights`)
    plain = not (cfg.kernel or weighted or len(ctx.teacher_views) > 1)
    temp, k = cfg.temperature, cfg.topk
    for mb in lockstep(ctx, batch, teacher_plans(ctx, batch, ctx.teacher_views[0]), sync, release=ctx.teacher_models):
        teacher, rows = teachers.teachers[mb.group], mb.rows  # padding: zero weights, nothing counted or labelled
        views = [teacher_inputs(ctx, batch, mb, view, res) for view in ctx.teacher_views]  # booked
        mask, width = views[0][1], views[0][2]
        s_inputs, _, _ = micro_batch_inputs([batch.student_prompts[p] for p in ro.prompt_index[rows].tolist()], ro,
                                            rows, ctx.ids["pad"], ctx.device)  # fmt: skip
        w_i = None if batch.weights is None else batch.weights[rows].to(ctx.device)  # (n,) 1 / pi_i
        weights = mb.weight(aggregation_weights(cfg.aggregation, row_w[rows].to(ctx.device), mask, res.global_tokens,
                                                dtype, w_i) * scale)  # (n, T) Eq. 11's (or the method's aggregation)
        extras: dict = {}
        with mb.synced():
            with ctx.autocast(), mb.teacher(teacher):
                if plain:  # one micro-batch's logits (n, T, V), autograd through opd.maths.divergence
                    watch = Stopwatch(ctx.device)
                    t_logits = tempered(teacher.logits(views[0][0], width), temp)  # (n, T, V) Eq. 2, detached
                    seconds = [watch.seconds()]
                    s_logits = tempered(response_logits(ctx.student, s_inputs, width), temp)  # (n, T, V) Eq. 1
                    s_logp, t_logp = support_logp(s_logits, t_logits, k, cfg.support)  # (n, T, k + 1) Eq. 3's support
                    d = (generalized_jsd(s_logp, t_logp, cfg.alpha) if cfg.divergence == "jsd"  # (n, T) Eq. 3
                         else bias_corrected_reverse_kl(s_logp, t_logp))  # fmt: skip
                    loss = weighted_sum(d, weights)  # this micro-batch's share of Eq. 11
                    terms = torch.stack(utility_terms(s_logits.detach(), t_logits, k), -1)  # (n, T, 3) Eq. 7-8
                    u = labels_from_terms(terms, mask, not cfg.no_overlap, not cfg.no_confidence)  # (n,) Eq. 9
                else:
                    loss, _, u, seconds = micro_batch_loss(
                        ctx.student, teacher, s_inputs, [v[0] for v in views], mask, width, weights, cfg,
                        ro.response_ids[rows, :width].to(ctx.device), ro.logp[rows, :width].to(ctx.device), extras,
                    )  # fmt: skip
            mb.backward(loss)  # sharded: the teacher's gathered root (LM head) is freed before the student's backward
        if not mb.real:
            continue
        res.loss_sum += float(loss.detach()) * res.global_tokens / scale  # its share of the loss, times the denominator
        res.utility[rows] = u.float().cpu()
        for key in sums:  # with a token weight: its per-row sums (OPOD's gate and teacher log-probs)
            sums[key][rows] = extras[key].sum(-1).float().cpu()
        for (_, _, _, cost), sec in zip(views, seconds):
            cost.seconds += sec
    return res


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logits divided by the loss temperature (OPSD's 1.1; float64 stays float64); at 1 the logits themselves."""
    return logits if temperature == 1.0 else upcast(logits) / temperature


def distill_labels(ctx) -> list[str]:
    """The ledger labels of the pass's teacher forwards: every teacher in every teacher view, in a fixed order."""
    t = ctx.teachers
    return [t.label(n, v) for n in t.names for v in ctx.teacher_views]
