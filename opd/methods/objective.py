"""The default objective (`Distillation`) and its pass (`distill`: Algorithm 1, lines 11-12) behind the seam of
`opd.methods.interface`: per micro-batch of S, Eq. 2, 1, 3, its share of Eq. 11 backpropagated, and Eq. 7-9's labels.
Memory per micro-batch: about five (n, T, V) float32 tensors (20 n T V bytes); the fused kernel
(`opd.methods.micro_batch`) is opt-in (`--fused-kernel`; automatic past `opd.maths.loss.PLAIN_LOGITS_LIMIT`).
Details: docs/MODULES.md#opdmethodsobjective."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from types import MethodType

import torch

from opd.data.records import StepBatch
from opd.maths.divergence import generalized_jsd, labels_from_terms, upcast, utility_terms, weighted_sum
from opd.maths.family import AGGREGATION_WEIGHTS, DENOMINATORS, SUPPORTS, bias_corrected_reverse_kl
from opd.methods.interface import Objective, ObjectiveContext, ObjectiveResult, TeacherCost
from opd.methods.specs import DISTILL_SPEC
from opd.models.chat import micro_batch_inputs, response_logits
from opd.models.ema_teacher import Stopwatch, book_forward, update_due


def plan_micro_batches(lengths: torch.Tensor, max_rows: int, max_tokens: int = 0) -> list[torch.Tensor]:
    """Index tensors of rows, longest first, filled greedily while rows <= max_rows and rows x longest <= max_tokens."""
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


def plan_rows(rollouts, teacher_prompt, selected: torch.Tensor, micro_batch: int, micro_batch_tokens: int,
              view: str) -> list[torch.Tensor]:  # fmt: skip
    """This rank's micro-batches of `selected` (local row ids), grouped by teacher length (prompt + response)."""
    if not selected.numel():
        return []
    prompt_of = rollouts.prompt_index[selected].tolist()
    t_len = torch.tensor([len(teacher_prompt(view, j)) for j in prompt_of]) + rollouts.lengths[selected]
    return [selected[g] for g in plan_micro_batches(t_len, micro_batch, micro_batch_tokens)]


@dataclass
class Slot:
    """One micro-batch of S on one process: local row ids `rows` of teacher `group`. Several ranks or shards:
    `opd.methods.lockstep.MicroBatch`, the same methods with padding slots (`real` False), syncing and freeing."""
    group: str
    rows: torch.Tensor
    backward: Callable  # the accelerator's backward
    real = True

    def weight(self, w: torch.Tensor) -> torch.Tensor:
        return w

    def teacher(self, teacher):
        return nullcontext()

    def synced(self):
        return nullcontext()


def one_process(ctx, batch, plans: dict[str, list], sync: bool = True, release=()) -> Iterator[Slot]:
    """The micro-batches of `plans` ({teacher: [rows]}) one after another: one process needs no lockstep."""
    for group, plan in plans.items():
        for rows in plan:
            yield Slot(group, rows, ctx.accelerator.backward)


def teacher_plans(ctx: ObjectiveContext, batch: StepBatch, view: str) -> dict[str, list[torch.Tensor]]:
    """{teacher name: micro-batches of its local row ids of S}, in order, grouped by length in `view` (`plan_rows`)."""
    cfg = ctx.loss
    return {n: plan_rows(batch.rollouts, lambda v, j, n=n: batch.teacher_prompt(n, v, j), batch.routed(n),
                         cfg.micro_batch, cfg.micro_batch_tokens, view) for n in ctx.teachers.names}  # fmt: skip


def teacher_inputs(ctx: ObjectiveContext, batch: StepBatch, mb: Slot, view: str, res: ObjectiveResult):
    """(inputs, mask (n, T), width, cost) of `mb` in `view`; a padding slot: the student's prompts, booked nowhere."""
    ro, pids = batch.rollouts, batch.rollouts.prompt_index[mb.rows].tolist()
    prompts = [batch.teacher_prompt(mb.group, view, p) if mb.real else batch.student_prompts[p] for p in pids]
    inputs, mask, width = micro_batch_inputs(prompts, ro, mb.rows, ctx.ids["pad"], ctx.accelerator.device)
    cost = res.teachers[ctx.teachers.label(mb.group, view)] if mb.real else None
    if cost is not None:
        book_forward(cost, inputs, mask, sum(len(p) for p in prompts))
    return inputs, mask, width, cost


def distill(objective, batch: StepBatch, row_weights: torch.Tensor | None = None, sync: bool = True,
            token_sums: dict | None = None, labels: list[str] | None = None) -> ObjectiveResult:  # fmt: skip
    """Eq. 11 on S, backpropagated per micro-batch (plain path); returns its sums and Eq. 9's u_i. row_weights
    (N_local,): numerator only (OPOD's beta); sync=False: no DDP sync; token_sums: the fused pass's (`distill_pass`)."""
    ctx, cfg, device = objective.ctx, objective.ctx.loss, objective.ctx.accelerator.device
    res = begin(ctx, batch, labels or distill_labels(ctx))
    if res.global_tokens == 0:  # S is empty everywhere: no teacher call, zero distillation term
        return res
    row_w, dtype, scale = row_scales(ctx, batch, row_weights)
    plans, teachers = teacher_plans(ctx, batch, ctx.teacher_views[0]), [t.model for t in ctx.teachers.teachers.values()]
    for mb in (ctx.schedule or one_process)(ctx, batch, plans, sync, teachers):
        teacher, rows, views, s_inputs, w_i = slot_inputs(ctx, batch, mb, res)  # padding: zero weights, nothing booked
        (t_inputs, mask, width, _), aggregate = views[0], AGGREGATION_WEIGHTS[cfg.aggregation]  # Eq. 11's weights
        weights = mb.weight(aggregate(row_w[rows].to(device), mask, res.global_tokens, dtype, w_i) * scale)  # (n, T)
        with mb.synced():
            with ctx.autocast(), mb.teacher(teacher):  # one micro-batch's logits (n, T, V), autograd
                watch = Stopwatch(device)
                t_logits = tempered(teacher.logits(t_inputs, width), cfg.temperature)  # (n, T, V) Eq. 2, detached
                seconds = [watch.seconds()]
                s_logits = tempered(response_logits(ctx.student, s_inputs, width), cfg.temperature)  # (n, T, V) Eq. 1
                s_logp, t_logp = SUPPORTS[cfg.support](s_logits, t_logits, cfg.topk)  # (n, T, k + 1) Eq. 3's support
                d = (generalized_jsd(s_logp, t_logp, cfg.alpha) if cfg.divergence == "jsd"  # (n, T) Eq. 3
                     else bias_corrected_reverse_kl(s_logp, t_logp))  # fmt: skip
                loss = weighted_sum(d, weights)  # this micro-batch's share of Eq. 11
                terms = torch.stack(utility_terms(s_logits.detach(), t_logits, cfg.topk), -1)  # (n, T, 3) Eq. 7-8
                u = labels_from_terms(terms, mask, not cfg.no_overlap, not cfg.no_confidence)  # (n,) Eq. 9
            mb.backward(loss)  # sharded: the teacher's gathered root (LM head) is freed before the student's backward
        book(res, mb, rows, loss, u, views, seconds, scale)
    res.loss_share = res.loss_sum / max(1, res.global_tokens)  # summed over ranks: the step's loss
    return res


def begin(ctx: ObjectiveContext, batch: StepBatch, labels: list[str]) -> ObjectiveResult:
    """A step's result before its first micro-batch: no row labelled (NaN), every teacher label's cost zero, and Eq.
    11's denominator over all ranks (`opd.maths.family.DENOMINATORS`: one all-reduce, run by every rank)."""
    ro = batch.rollouts
    res = ObjectiveResult(utility=torch.full((len(ro),), float("nan")), teachers={lab: TeacherCost() for lab in labels})
    denominator = DENOMINATORS[ctx.loss.aggregation]
    res.global_tokens = denominator(ctx.accelerator, ro.lengths, batch.selected, batch.weights, batch.full_tokens)
    return res


def row_scales(ctx: ObjectiveContext, batch: StepBatch, row_weights: torch.Tensor | None):
    """(row_w (N_local,): OPOD's beta or ones, Eq. 11's dtype (float64 for a float64 policy), DDP's rank count)."""
    row_w = torch.ones(len(batch.rollouts)) if row_weights is None else row_weights.float().cpu()
    float64 = next(ctx.student.parameters()).dtype == torch.float64  # DDP averages ranks: times their count
    return row_w, torch.float64 if float64 else torch.float32, ctx.accelerator.num_processes


def slot_inputs(ctx: ObjectiveContext, batch: StepBatch, mb: Slot, res: ObjectiveResult):
    """A slot's (teacher, rows, teacher inputs per view (booked), student inputs, 1 / pi_i (n,) or None)."""
    ro, rows = batch.rollouts, mb.rows
    views = [teacher_inputs(ctx, batch, mb, view, res) for view in ctx.teacher_views]
    prompts = [batch.student_prompts[p] for p in ro.prompt_index[rows].tolist()]
    s_inputs, _, _ = micro_batch_inputs(prompts, ro, rows, ctx.ids["pad"], ctx.accelerator.device)
    w_i = None if batch.weights is None else batch.weights[rows].to(ctx.accelerator.device)  # (n,) 1 / pi_i
    return ctx.teachers.teachers[mb.group], rows, views, s_inputs, w_i


def book(res: ObjectiveResult, mb: Slot, rows, loss: torch.Tensor, u: torch.Tensor, views, seconds, scale):
    """A real slot's share of the loss (times the denominator), its labels u_i and its teacher seconds per view."""
    if not mb.real:
        return
    res.loss_sum += float(loss.detach()) * res.global_tokens / scale
    res.utility[rows] = u.float().cpu()
    for (_, _, _, cost), sec in zip(views, seconds):
        cost.seconds += sec


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return logits if temperature == 1.0 else upcast(logits) / temperature


def distill_labels(ctx) -> list[str]:
    t = ctx.teachers
    return [t.label(n, v) for n in t.names for v in ctx.teacher_views]


class Distillation(Objective):
    """Eq. 11 on S against the run's teacher(s), then the teachers' update after a valid step."""

    spec = DISTILL_SPEC  # its name (`opd.methods.specs`)

    @property
    def labels(self) -> list[str]:
        return distill_labels(self.ctx)

    @property
    def __call__(self) -> Callable[[StepBatch], ObjectiveResult]:
        """`objective(batch)` is the run's pass (`distill`, the plain one, unless the run takes the fused one):
        no call more between the step and Eq. 3."""
        return MethodType(self.ctx.distill_pass or distill, self)

    def after_update(self, step: int) -> None:
        """Algorithm 1, line 13: theta-bar <- (1 - tau) theta-bar + tau theta, each teacher once, every `ema.every`."""
        ctx = self.ctx
        if update_due(ctx.ema.every, step):
            with torch.no_grad():
                for t in dict.fromkeys(ctx.teachers.teachers.values()):
                    t.update(ctx.model(), ctx.ema.tau)
