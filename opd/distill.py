"""Selective distillation of one step (Algorithm 1, lines 11-12): Eq. 1, 2, 3, 9 and 11 on the selected rows.

A rank's selected rows are grouped by length into micro-batches (at most `micro_batch` rows and, when
set, `micro_batch_tokens` padded teacher tokens), so the teacher computes little padding. For each
micro-batch: the teacher's detached final hidden states on the crop prompt (Eq. 2) and the student's on
the full-image prompt (Eq. 1), both over the same sampled response tokens; then, one chunk of
`loss_chunk` valid positions at a time, both sides' logits through the LM head, the method's per-token
divergence (Eq. 3 by default) and the utility terms (Eq. 7-8), without ever holding (positions x vocabulary)
logits beyond a chunk (`opd.chunked.budgeted_loss_from_hidden`); its share of the loss (Eq. 11) is
backpropagated at once, and the utility labels (Eq. 9) come from the same chunks. `loss_chunk = 0` computes
whole micro-batch logits instead (`opd.chunked.topk_divergence_from_logits`); tests check both against
`divergence.topk_divergence` + `utility_labels` on full logits.

Distributed: the loss's denominator is global (one all-reduce, run by every rank, `global_denominator`): Eq. 11's
count of selected valid tokens (token-mean; with unbiased selection its Hajek form sum_i w_i T_i), or the count
|S| of selected rows with a valid token (sequence-mean, micro-batch; `AGGREGATIONS`). DDP averages gradients over
ranks, so each rank's loss is scaled by the world size.
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
log-probs; Vision-OPD's importance ratio with `is_clip`; OPOD's gate) multiplies Eq. 11's weights, whose
denominator still counts every selected valid token. The token weights are a table of functions of the
sampled tokens' log-probs (`opd.weights.TOKEN_WEIGHTS`), applied in one place on either path.

Teachers (`opd.external_teachers`): one teacher (the EMA self-teacher or a fixed `--teacher-model`) or several,
each row routed to one (`route`, OPOD's and `--teachers`' routing by a record field). S's rows are planned
into micro-batches per teacher, in the teachers' fixed order, so each teacher runs only on the selected
rows routed to it; sharded, every rank runs as many micro-batches per teacher as the busiest rank.
`row_weights` multiplies a row's Eq. 11 weights in the numerator only (OPOD's per-teacher strength beta; unbiased
selection's 1 / pi_i, in numerator and denominator, are `sample_weights`); with a token weight the per-row sums of
w_t and of log pi_T(y_t) come back (OPOD's controller and reward).

The seam of the loop (`opd.objective`): an objective receives an `ObjectiveContext` and, each step, a
`StepBatch`; it returns a `DistillResult` after backpropagating its share of the loss. `Distillation` here is
the family's objective (every method that is a loss and a view); DAPD (`opd.dapd`) and OPOD (`opd.opod`) are
others. The lockstep order of micro-batches over ranks is `opd.schedule.lockstep`, shared by all of them.

Cost accounting: each teacher view's forward, and the teacher-side LM-head work of the loss (its
logits, log-softmax and gathers inside the chunked loss; the sampled-token log-probs of OPD-V), are
teacher time, per view (`TeacherCost`).

Where this departs from the paper: the student forward runs on selected rows only. Rows with z_i = 0
contribute nothing to Eq. 11 or its gradient, so their forward would be discarded work.
"""

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from opd.chat import EncodedPrompt, collate
from opd.chunked import budgeted_loss_from_hidden, sampled_logp, sampled_logp_from_hidden, topk_divergence_from_logits
from opd.divergence import budgeted_weights, upcast, weighted_sum
from opd.ema_teacher import Teacher, lm_head_weight, response_hidden, response_logits
from opd.objective import DistillResult, Objective, StepBatch
from opd.rollout import Rollouts
from opd.schedule import TeacherCost, lockstep, plan_micro_batches, record_forward, synced, timed
from opd.sharding import reshard
from opd.utility import sample_utility
from opd.weights import SampledLogp, TokenWeight, token_weight

AGGREGATIONS = ("token-mean", "sequence-mean", "micro-batch")
"""How Eq. 11 averages over S (`DistillConfig.aggregation`, `--loss-agg`):

    token-mean     sum_{i,t} z_i m_it D_it / sum_{i,t} z_i m_it                          (Eq. 11; BAS-OPD)
    sequence-mean  (1 / |S|) sum_{i in S} (1 / T_i) sum_t m_it D_it                        (OPSD's per-sequence mean)
    micro-batch    sum_b (n_b / |S|) sum_{i in b, t} m_it D_it / sum_{i in b, t} m_it      (verl: a token mean per
                                                                                          micro-batch b, weighted by rows)

|S| counts the selected rows with at least one valid token, over all ranks; the micro-batches are this loop's
(grouped by length, `plan_micro_batches`), not verl's."""

__all__ = ["AGGREGATIONS", "DistillConfig", "Distillation", "DistillResult", "StepBatch", "TeacherCost", "distill", "plan_micro_batches"]


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
    """The divergence's support (opd.divergence.SUPPORTS)."""
    divergence: str = "jsd"
    """'jsd' (Eq. 3 with alpha) or 'bc_rkl'."""
    token_weight: str = "none"
    """A name of `opd.weights.TOKEN_WEIGHTS`: 'none', 'trust_region' (needs a second, negative teacher view) or
    'gate' (OPOD's teacher gate)."""
    is_clip: float = 0.0
    """Importance-ratio clip c; 0 = no ratio."""
    temperature: float = 1.0
    """Both sides' logits divided by it before the divergence (OPSD's 1.1)."""
    aggregation: str = "token-mean"
    """Eq. 11's aggregation over S (`AGGREGATIONS`)."""


def micro_batch_inputs(
    prompts: list[EncodedPrompt], rollouts: Rollouts, rows: torch.Tensor, pad_id: int, device: torch.device
) -> tuple[dict[str, torch.Tensor], torch.Tensor, int]:
    """Model inputs for `rows`: their prompts + their responses trimmed to the longest valid one."""
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


def micro_batch_loss(student, teacher: Teacher, s_inputs, t_inputs: list, mask, width: int, weights, cfg: DistillConfig,
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
    weight_fn = token_weight(cfg.token_weight, cfg.is_clip)  # w_t (opd.weights), None when 1

    temp = cfg.temperature
    if cfg.loss_chunk == 0:  # whole micro-batch logits: the reference path
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
            s_logits, t_logits, cfg.k, cfg.alpha, support=cfg.support, divergence=cfg.divergence
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
                                                        cfg.loss_chunk, temperature=temp)  # (P,)  # fmt: skip
            tokens = TokenWeight(weight_fn, y, old_logp[mask] if old_logp is not None else None, negative)
        h_s = response_hidden(student, s_inputs, width)[mask]  # (P, H) Eq. 1
        w_s = lm_head_weight(getattr(student, "module", student))  # DDP: .module
        timing: dict[str, float] = {}
        flat: dict = {}
        loss, d_alpha, flat_terms = budgeted_loss_from_hidden(
            h_s, w_s, h_t, w_t, weights[mask], cfg.k, cfg.alpha, cfg.loss_chunk, support=cfg.support,
            divergence=cfg.divergence, tokens=tokens, timing=timing, extras=flat, temperature=temp,
        )  # Eq. 11 of Eq. 3 (or the method's D)
        costs[0].seconds += timing.get("teacher_s", 0.0)  # the teacher's LM head inside the fused loss
        if tokens is not None and extras is not None:
            for key, values in flat.items():
                extras[key] = torch.zeros(mask.shape, dtype=values.dtype, device=device).masked_scatter(mask, values)
        per_token = torch.zeros(mask.shape, dtype=d_alpha.dtype, device=device).masked_scatter(mask, d_alpha)
        terms = torch.zeros((*mask.shape, 3), dtype=flat_terms.dtype, device=device)
        terms[mask] = flat_terms
    d, o, c = terms.unbind(-1)  # (n, T) each, Eq. 7-8
    o = o if cfg.use_overlap else torch.ones_like(o)
    c = c if cfg.use_confidence else torch.ones_like(c)
    return loss, per_token, sample_utility(d, o, c, mask), [cost.seconds for cost in costs]


def distill(
    accelerator,
    student,
    teacher,
    rollouts: Rollouts,
    student_prompts: list[EncodedPrompt],
    teacher_prompt,
    selected: torch.Tensor,
    cfg: DistillConfig,
    pad_id: int,
    autocast=nullcontext,
    teacher_views: tuple[str, ...] = ("crop",),
    *,
    route: list | None = None,
    row_weights: torch.Tensor | None = None,
    sync: bool = True,
    label: Callable[[str, str], str] | None = None,
    sample_weights: torch.Tensor | None = None,
) -> DistillResult:
    """Backpropagates this rank's share of Eq. 11 and returns its sums and utility labels.

    selected: local row ids of S on this rank. teacher: one Teacher, with teacher_prompt(view, j) -> the
    EncodedPrompt of local prompt j in a teacher view; or {name: Teacher} (the routed teachers, in the
    same order on every rank), with teacher_prompt(name, view, j) and route[i] = the teacher name of local
    row i. teacher_prompt is called only for prompts with a selected row. teacher_views: the positive
    teacher's view first, then OPD-V's negative one. autocast() -> the mixed precision context of the
    forwards. row_weights (N_local,): multiplies each row's Eq. 11 weights, numerator only (OPOD's beta).
    sample_weights (N_local,): unbiased selection's w_i = 1 / pi_i, Eq. 11 in its Hajek form (numerator and the
    global denominator weighted, `divergence.budgeted_weights`). sync=False: no backward synchronises DDP gradients (a
    later pass of the caller does). label(name, view) -> the ledger label of a teacher's view (default: the view
    with one teacher, name:view with several).
    """
    if isinstance(teacher, dict):
        teachers, prompt = teacher, teacher_prompt
    else:
        teachers, prompt = {"teacher": teacher}, (lambda name, view, j: teacher_prompt(view, j))
    names = list(teachers)
    label = label or (lambda name, view: view if len(names) == 1 else f"{name}:{view}")
    route = route if route is not None else [names[0]] * len(rollouts)
    res = DistillResult(utility=torch.full((len(rollouts),), float("nan")),
                        teachers={label(n, v): TeacherCost() for n in names for v in teacher_views})  # fmt: skip
    if cfg.token_weight != "none" or cfg.is_clip:
        res.token_weight_sum, res.teacher_logp_sum = torch.zeros(len(rollouts)), torch.zeros(len(rollouts))
    if cfg.aggregation == "token-mean":
        res.global_tokens = global_denominator(accelerator, rollouts.lengths, selected, sample_weights)
    else:  # the selected rows with a valid token (sequence-mean, micro-batch): |S|
        rows = int((rollouts.lengths[selected] > 0).sum()) if selected.numel() else 0
        res.global_tokens = int(accelerator.reduce(torch.tensor(rows, device=accelerator.device), "sum").item())
    if res.global_tokens == 0:  # S is empty everywhere: no teacher call, zero distillation term
        return res
    scale = accelerator.num_processes  # DDP and FSDP average gradients over ranks
    weights = torch.ones(len(rollouts)) if row_weights is None else row_weights.float().cpu()
    float64 = next(student.parameters()).dtype == torch.float64  # Eq. 11's weights in float64 for a float64 policy
    ctx = _Context(accelerator, student, rollouts, student_prompts, prompt, cfg, pad_id, autocast, teacher_views,
                   res, scale, weights, label, torch.float64 if float64 else torch.float32, sample_weights)  # fmt: skip
    plans = {n: plan_rows(rollouts, ctx.prompt_of(n), selected[[route[i] == n for i in selected.tolist()]]
                          if selected.numel() else selected, cfg, teacher_views[0]) for n in names}  # fmt: skip

    def run(name: str, rows, last: bool) -> None:
        padding = rows is None
        with synced(accelerator, student, last or padding):
            _run_micro_batch(ctx, name, teachers[name], torch.tensor([0]) if padding else rows, padding=padding)

    try:
        lockstep(accelerator, student, plans, run, sync=sync,
                 dummy=lambda: dummy_backward(accelerator, student, rollouts, student_prompts, pad_id, autocast))
    finally:
        for t in teachers.values():
            reshard(t.model)
    return res


def aggregation_weights(aggregation: str, row_weights: torch.Tensor, mask: torch.Tensor, denominator, dtype,
                        sample_weights: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """One micro-batch's per-token weights (n, T) of the loss's aggregation (`AGGREGATIONS`): Eq. 11's
    `budgeted_weights` with the global token count (token-mean; with `sample_weights` its Hajek form), each row's
    1 / T_i over the global |S| (sequence-mean), or the micro-batch's own token mean times its rows / |S|
    (micro-batch). `row_weights` (n,) multiplies each row's (OPOD's beta)."""
    if aggregation == "token-mean":
        return budgeted_weights(row_weights, mask, denominator, dtype, sample_weights)
    lengths = mask.sum(-1).to(dtype).clamp(min=1)  # (n,) T_i
    if aggregation == "sequence-mean":
        return budgeted_weights(row_weights.to(dtype) / lengths, mask, denominator, dtype)
    rows = float((mask.sum(-1) > 0).sum())  # micro-batch: n_b / |S| times the micro-batch's token mean
    tokens = float(mask.sum())
    return budgeted_weights(row_weights, mask, max(1.0, tokens), dtype) * (rows / max(1, denominator))


def global_denominator(accelerator, lengths: torch.Tensor, selected: torch.Tensor, sample_weights=None) -> float | int:
    """Eq. 11's denominator over all ranks (one all-reduce, run by every rank): the selected valid tokens, or with
    unbiased selection's weights the Hajek form's sum_i w_i T_i (a float)."""
    device = accelerator.device
    if sample_weights is None:
        tokens = int(lengths[selected].sum()) if selected.numel() else 0
        return int(accelerator.reduce(torch.tensor(tokens, device=device), "sum").item())
    local = (lengths[selected].double() * sample_weights[selected].double()).sum() if selected.numel() else 0.0
    return float(accelerator.reduce(torch.tensor(float(local), device=device, dtype=torch.float64), "sum").item())


def dummy_backward(accelerator, student, rollouts: Rollouts, student_prompts, pad_id: int, autocast) -> None:
    """A zero-weighted forward and backward on this rank's first row: a rank with nothing to train still
    joins DDP's gradient all-reduce (every rank runs the same collectives)."""
    inputs, _, _ = micro_batch_inputs(
        [student_prompts[int(rollouts.prompt_index[0])]], rollouts, torch.tensor([0]), pad_id, accelerator.device
    )
    with autocast():
        dummy = student(**inputs, logits_to_keep=1, use_cache=False).logits.float().sum() * 0.0
    accelerator.backward(dummy)


@dataclass
class _Context:
    """What every micro-batch of one `distill` call shares."""

    accelerator: object
    student: object
    rollouts: Rollouts
    student_prompts: list
    teacher_prompt: Callable
    cfg: DistillConfig
    pad_id: int
    autocast: Callable
    views: tuple[str, ...]
    res: DistillResult
    scale: int
    row_weights: torch.Tensor
    label: Callable
    weight_dtype: torch.dtype = torch.float32
    sample_weights: torch.Tensor | None = None

    def prompt_of(self, name: str):
        return lambda view, j: self.teacher_prompt(name, view, j)


def plan_rows(rollouts: Rollouts, teacher_prompt, selected: torch.Tensor, cfg: DistillConfig,
              view: str) -> list[torch.Tensor]:  # fmt: skip
    """This rank's micro-batches of `selected` (local row ids), grouped by teacher length."""
    if not selected.numel():
        return []
    prompt_of = rollouts.prompt_index[selected].tolist()
    t_len = torch.tensor([len(teacher_prompt(view, j)) for j in prompt_of]) + rollouts.lengths[selected]
    return [selected[g] for g in plan_micro_batches(t_len, cfg.micro_batch, cfg.micro_batch_tokens)]


def _run_micro_batch(ctx: _Context, name: str, teacher: Teacher, rows: torch.Tensor, padding: bool = False) -> None:
    """One micro-batch of `rows` (local ids) scored by teacher `name`: teacher forward(s), student forward, Eq. 11's
    share backpropagated; its sums, labels and costs go into `ctx.res`. padding=True (sharded lockstep): the same
    forwards and backward with zero weights, on the student's prompts for every view; nothing is counted or
    labelled."""
    acc, rollouts, res, cfg = ctx.accelerator, ctx.rollouts, ctx.res, ctx.cfg
    device = acc.device
    prompt_ids = rollouts.prompt_index[rows].tolist()
    t_inputs = []
    for view in ctx.views:
        prompts = [ctx.student_prompts[p] if padding else ctx.teacher_prompt(name, view, p) for p in prompt_ids]
        inputs, mask, width = micro_batch_inputs(prompts, rollouts, rows, ctx.pad_id, device)
        t_inputs.append(inputs)
        if not padding:
            record_forward(res.teachers[ctx.label(name, view)], inputs, mask, sum(len(p) for p in prompts))
    s_inputs, _, _ = micro_batch_inputs([ctx.student_prompts[p] for p in prompt_ids], rollouts, rows, ctx.pad_id, device)
    w_i = None if ctx.sample_weights is None else ctx.sample_weights[rows].to(device)  # (n,) 1 / pi_i
    weights = aggregation_weights(cfg.aggregation, ctx.row_weights[rows].to(device), mask, res.global_tokens,
                                  ctx.weight_dtype, w_i)  # (n, T) Eq. 11's (or the method's aggregation)
    weights = weights * ctx.scale  # DDP and FSDP average gradients over ranks
    if padding:
        weights = torch.zeros_like(weights)
    response = rollouts.response_ids[rows, :width].to(device)  # (n, T)
    old_logp = rollouts.logp[rows, :width].to(device)  # (n, T)
    extras: dict = {}
    with ctx.autocast(), teacher.uncounted() if padding else nullcontext():
        loss, per_token, u, seconds = micro_batch_loss(
            ctx.student, teacher, s_inputs, t_inputs, mask, width, weights, cfg, response, old_logp, extras
        )  # fmt: skip
    reshard(teacher.model)  # sharded: the teacher's gathered root (LM head) is freed before the student's backward
    acc.backward(loss)
    del per_token
    if padding:
        return
    res.loss_sum += float(loss.detach()) * res.global_tokens / ctx.scale  # its share of the loss, times the denominator
    res.utility[rows] = u.float().cpu()
    if "token_weight" in extras:
        res.token_weight_sum[rows] = extras["token_weight"].sum(-1).float().cpu()
        res.teacher_logp_sum[rows] = extras["teacher_logp"].sum(-1).float().cpu()
    for view, sec in zip(ctx.views, seconds):
        res.teachers[ctx.label(name, view)].seconds += sec


class Distillation(Objective):
    """The family's objective (`opd.methods`: student view, teacher view(s), support, divergence, token
    weight): Eq. 11 on S against the run's teacher(s) (`distill`), and the teachers' update after a valid
    step (the EMA of Algorithm 1 line 13, every `ema_every` steps; frozen teachers do not move)."""

    name = "distill"

    @property
    def labels(self) -> list[str]:
        """The ledger labels of every teacher forward this objective can run, in a fixed order."""
        t = self.ctx.teachers
        return [t.label(n, v) for n in t.names for v in self.ctx.teacher_views]

    def __call__(self, batch: StepBatch, row_weights: torch.Tensor | None = None, sync: bool = True) -> DistillResult:
        ctx = self.ctx
        res = distill(
            ctx.accelerator, ctx.student, ctx.teachers.teachers, batch.rollouts, batch.student_prompts,
            batch.teacher_prompt, batch.selected, ctx.distill, ctx.ids["pad"], ctx.autocast, ctx.teacher_views,
            route=batch.route, row_weights=row_weights, sync=sync, label=ctx.teachers.label,
            sample_weights=batch.weights,
        )  # fmt: skip
        for lab in self.labels:  # every label on every rank, in order (the ledger's all-reduce)
            res.teachers.setdefault(lab, TeacherCost())
        res.teachers = {lab: res.teachers[lab] for lab in self.labels}
        return res

    def after_update(self, step: int) -> None:
        """Algorithm 1, line 13 after a valid update, every `ema_every` steps (DAPD's snapshot: tau = 1)."""
        ctx = self.ctx
        if (step + 1) % max(1, ctx.ema_every) == 0:
            for t in dict.fromkeys(ctx.teachers.teachers.values()):  # a shared teacher once
                t.update(ctx.policy(), ctx.ema_tau)
