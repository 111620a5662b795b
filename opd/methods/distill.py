"""The family's distillation pass of one step (Algorithm 1, lines 11-12): Eq. 1, 2, 3, 9 and 11 on S only.

`distill` is the default objective's call (`opd.methods.distillation.Distillation`; OPOD runs it for its gated term).
A rank's rows of S are grouped by length into micro-batches (`--micro-batch` rows); for each, the teacher's detached
logits on the crop prompt (Eq. 2), the student's on the full-image prompt (Eq. 1), Eq. 3 on the support
(`divergence.topk_support` + `generalized_jsd`, through autograd), its share of Eq. 11 (the global denominator:
`divergence.global_denominator`) backpropagated at once, and the labels u_i (Eq. 7-9) from the same logits.

Memory per micro-batch (the plain path): n rows x T response positions x V ids of float32 logits per side; the
student's logits, its tail's masked copy and the teacher's logits are held, about five (n, T, V) tensors at the peak
(20 n T V bytes: the toy's 64 x 4 x 105 is 0.5 MB; Qwen3.5's 4 x 1,024 x 248,320 would be 20 GB). Past
`opd.maths.loss.PLAIN_LOGITS_LIMIT` a run takes the fused kernel instead, as do token weights and OPD-V's second
teacher view (`opd.methods.micro_batch.micro_batch_loss`). Lockstep and padding over ranks:
`opd.methods.lockstep.lockstep`; details, teachers and cost accounting: docs/TRAINING.md#the-distillation-pass.
"""


import torch

from opd.maths.divergence import generalized_jsd, labels_from_terms, upcast, utility_terms, weighted_sum
from opd.maths.family import AGGREGATION_WEIGHTS, SUPPORTS, bias_corrected_reverse_kl
from opd.methods.lockstep import Stopwatch, lockstep
from opd.methods.micro_batch import micro_batch_loss
from opd.data.records import StepBatch
from opd.methods.objective import ObjectiveResult, teacher_inputs, teacher_plans
from opd.models.chat import micro_batch_inputs, response_logits


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
        aggregate = AGGREGATION_WEIGHTS[cfg.aggregation]  # Eq. 11's budgeted_weights (or the method's aggregation)
        weights = mb.weight(aggregate(row_w[rows].to(ctx.device), mask, res.global_tokens, dtype, w_i) * scale)  # (n, T)
        extras: dict = {}
        with mb.synced():
            with ctx.autocast(), mb.teacher(teacher):
                if plain:  # one micro-batch's logits (n, T, V), autograd through opd.maths.divergence
                    watch = Stopwatch(ctx.device)
                    t_logits = tempered(teacher.logits(views[0][0], width), temp)  # (n, T, V) Eq. 2, detached
                    seconds = [watch.seconds()]
                    s_logits = tempered(response_logits(ctx.student, s_inputs, width), temp)  # (n, T, V) Eq. 1
                    s_logp, t_logp = SUPPORTS[cfg.support](s_logits, t_logits, k)  # (n, T, k + 1) Eq. 3's support
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
