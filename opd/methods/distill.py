"""The family's distillation pass of one step (Algorithm 1, lines 11-12): Eq. 1, 2, 3, 9 and 11 on the selected rows.

A shared piece, not an objective: `opd.methods.distillation.Distillation` (every method that is a loss and a view) runs it
alone, OPOD (`opd.methods.opod`) runs it for its gated term before its policy gradient.

A rank's selected rows are grouped by length into micro-batches (at most `micro_batch` rows and, when
set, `micro_batch_tokens` padded teacher tokens), so the teacher computes little padding. For each
micro-batch: the teacher's detached final hidden states on the crop prompt (Eq. 2) and the student's on
the full-image prompt (Eq. 1), both over the same sampled response tokens; then, one chunk of
`loss_chunk` valid positions at a time, both sides' logits through the LM head, the method's per-token
divergence (Eq. 3 by default) and the utility terms (Eq. 7-8), without ever holding (positions x vocabulary)
logits beyond a chunk (`opd.maths.chunked.budgeted_loss_from_hidden`); its share of the loss (Eq. 11) is
backpropagated at once, and the utility labels (Eq. 9) come from the same chunks. `loss_chunk = 0` computes
whole micro-batch logits instead (`opd.maths.chunked.topk_divergence_from_logits`); tests check both against
`divergence.topk_divergence` + `utility_labels` on full logits.

Distributed: the loss's denominator is global (one all-reduce, run by every rank, `opd.maths.loss.loss_denominator`):
Eq. 11's count of selected valid tokens (token-mean; with unbiased selection its Hajek form sum_i w_i T_i), or the
count |S| of selected rows with a valid token (sequence-mean, micro-batch; `opd.maths.loss.AGGREGATIONS`). DDP averages gradients over
ranks, so each rank's loss is scaled by the world size.
Gradients are synchronised on each rank's last backward only. A rank holding no selected row while
others do runs one zero-weighted forward/backward on one of its rows so that the gradient all-reduce
still happens on every rank; when S is empty everywhere, no rank runs a forward.

Sharded (FSDP2, `opd.models.sharding`): every forward and backward of the student and the teacher gathers
parameters collectively, so the ranks run in lockstep: every rank runs as many micro-batches as the
rank with the most (one all-gather of the counts), padding with zero-weighted micro-batches on one of
its own rows (teacher forwards on the student's prompt, not counted as teacher calls), and gradients
are reduce-scattered after every backward (FSDP keeps no unsharded gradient between micro-batches). The
LM-head weights are read after their model's forward, when FSDP has gathered them (the root group), and
the teacher is resharded after each micro-batch's loss, before the student's backward.

The family (`opd.methods.table`): the teacher runs once per selected row and teacher view (OPD-V: the
crop and the masked crop); the support and divergence are the method's (`opd.maths.loss.LossConfig.support`,
`.divergence`), and a per-token weight w_t (OPD-V's trust region from the two teachers' sampled-token
log-probs; Vision-OPD's importance ratio with `is_clip`; OPOD's gate) multiplies Eq. 11's weights, whose
denominator still counts every selected valid token. The token weights are a table of functions of the
sampled tokens' log-probs (`opd.maths.weights.TOKEN_WEIGHTS`), applied in one place on either path.

Teachers (`opd.models.external_teachers`): one teacher (the EMA self-teacher or a fixed `--teacher-model`) or several,
each row routed to one (`route`, OPOD's and `--teachers`' routing by a record field). S's rows are planned
into micro-batches per teacher, in the teachers' fixed order, so each teacher runs only on the selected
rows routed to it; sharded, every rank runs as many micro-batches per teacher as the busiest rank.
`row_weights` multiplies a row's Eq. 11 weights in the numerator only (OPOD's per-teacher strength beta; unbiased
selection's 1 / pi_i, in numerator and denominator, are the batch's `weights`); with a token weight the per-row
sums of w_t and of log pi_T(y_t) can come back (`token_sums`: OPOD's controller and reward).

The lockstep order of micro-batches over ranks and their padding rules are `opd.methods.schedule.lockstep`'s, shared by
every objective.

Cost accounting: each teacher view's forward, and the teacher-side LM-head work of the loss (its
logits, log-softmax and gathers inside the chunked loss; the sampled-token log-probs of OPD-V), are
teacher time, per view (`TeacherCost`).

Where this departs from the paper: the student forward runs on selected rows only. Rows with z_i = 0
contribute nothing to Eq. 11 or its gradient, so their forward would be discarded work.
"""


import torch

from opd.models.chat import micro_batch_inputs
from opd.maths.chunked import budgeted_loss_from_hidden, sampled_logp, sampled_logp_from_hidden, topk_divergence_from_logits
from opd.maths.divergence import upcast, weighted_sum
from opd.models.ema_teacher import Teacher, lm_head_weight, response_hidden, response_logits
from opd.maths.loss import LossConfig, aggregation_weights
from opd.methods.objective import DistillResult, StepBatch, teacher_inputs, teacher_plans
from opd.methods.schedule import TeacherCost, lockstep, timed
from opd.maths.utility import labels_from_terms
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
    costs = [TeacherCost() for _ in t_inputs]  # the teacher seconds per view (`schedule.timed`)
    weight_fn = token_weight(cfg.token_weight, cfg.is_clip)  # w_t (opd.maths.weights), None when 1

    temp = cfg.temperature
    if cfg.chunk == 0:  # whole micro-batch logits: the reference path
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
        per_token, terms = topk_divergence_from_logits(
            s_logits, t_logits, cfg.topk, cfg.alpha, support=cfg.support, divergence=cfg.divergence
        )  # (n, T) Eq. 3 (or the method's D), (n, T, 3)
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


def distill(ctx, batch: StepBatch, row_weights: torch.Tensor | None = None, sync: bool = True,
            token_sums: dict | None = None, labels: list[str] | None = None) -> DistillResult:  # fmt: skip
    """Backpropagates this rank's share of Eq. 11 on S against the run's teacher(s) and returns its sums and the
    utility labels of S.

    `ctx` the run's `opd.methods.objective.ObjectiveContext` (its teachers in a fixed order, each row routed to one by
    `batch.route`; the teacher views, the positive one first, then OPD-V's negative one); `batch.teacher_prompt` is
    called only for prompts with a selected row. row_weights (N_local,): multiplies each row's Eq. 11 weights,
    numerator only (OPOD's beta). `batch.weights` (N_local,): unbiased selection's w_i = 1 / pi_i, Eq. 11 in its
    Hajek form (numerator and the global denominator weighted, `divergence.budgeted_weights`). sync=False: no
    backward synchronises DDP gradients (a later pass of the caller does). token_sums (a dict), with a token weight:
    receives per row (N_local,) the sums over its valid tokens of w_t ('token_weight') and of log pi_T(y_t)
    ('teacher_logp'), 0 outside S (OPOD's controller and reward). labels: the result's teacher labels, in the
    caller's order (default: every teacher in every teacher view, `distill_labels`)."""
    cfg, ro, teachers = ctx.loss, batch.rollouts, ctx.teachers
    res = DistillResult.begin(ctx, batch, labels or distill_labels(ctx))
    sums: dict = {}
    if token_sums is not None and (cfg.token_weight != "none" or cfg.is_clip):
        sums = token_sums
        sums.update(token_weight=torch.zeros(len(ro)), teacher_logp=torch.zeros(len(ro)))
    if res.empty:  # S is empty everywhere: no teacher call, zero distillation term
        return res
    row_w = torch.ones(len(ro)) if row_weights is None else row_weights.float().cpu()  # (N_local,) OPOD's beta
    float64 = next(ctx.student.parameters()).dtype == torch.float64  # Eq. 11's weights in float64 for a float64 policy
    dtype, scale = torch.float64 if float64 else torch.float32, ctx.accelerator.num_processes  # DDP averages ranks
    for mb in lockstep(ctx, batch, teacher_plans(ctx, batch, ctx.teacher_views[0]), sync,
                       release=ctx.teacher_models):  # fmt: skip
        # One micro-batch of `mb.rows` scored by teacher `mb.group` (padding: the same forwards and backward with zero
        # weights on the student's prompts, nothing counted or labelled): the teacher's inputs in every view (booked),
        # the student's, Eq. 11's weights (with unbiased selection's 1 / pi_i), the loss backpropagated at once.
        teacher, rows = teachers.teachers[mb.group], mb.rows
        views = [teacher_inputs(ctx, batch, mb, view, res) for view in ctx.teacher_views]
        mask, width = views[0][1], views[0][2]
        s_inputs, _, _ = micro_batch_inputs([batch.student_prompts[p] for p in ro.prompt_index[rows].tolist()], ro,
                                            rows, ctx.ids["pad"], ctx.device)  # fmt: skip
        w_i = None if batch.weights is None else batch.weights[rows].to(ctx.device)  # (n,) 1 / pi_i
        weights = mb.weight(aggregation_weights(cfg.aggregation, row_w[rows].to(ctx.device), mask, res.global_tokens,
                                                dtype, w_i) * scale)  # (n, T) Eq. 11's (or the method's aggregation)
        extras: dict = {}
        with mb.synced():
            with ctx.autocast(), mb.teacher(teacher):
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


def distill_labels(ctx) -> list[str]:
    """The ledger labels of the pass's teacher forwards: every teacher in every teacher view, in a fixed order."""
    t = ctx.teachers
    return [t.label(n, v) for n in t.names for v in ctx.teacher_views]
