"""The policy-gradient pass objectives share: OPOD's group-relative term and Thinking Machines' on-policy
distillation (`opd.methods.opod`, `opd.methods.tm_opd`), on the selected rows S only.

With a detached per-token advantage A_it and row weights w_i (1 / pi_i under unbiased selection; else 1), the loss
is REINFORCE (OPOD) or tinker's `importance_sampling` loss (the ratio pi_theta / pi_old), optionally plus a k3 KL
against a reference model. The advantage comes from a hook `advantage(mb, mask, h, w) -> (P,)` run in the
micro-batch after the student's forward (a precomputed table, or a teacher forward of its own), so a teacher never
runs outside the lockstep (`opd.methods.lockstep.lockstep`).
Details (the formulas): docs/MODULES.md#opdmethodspolicy_gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from opd.data.records import StepBatch
from opd.maths.chunked import sampled_logp_from_hidden, weighted_logp_from_hidden
from opd.methods.lockstep import MicroBatch, lockstep
from opd.methods.objective import plan_micro_batches
from opd.models.chat import micro_batch_inputs
from opd.models.hidden import lm_head_weight, response_hidden


def k3(ref_logp: torch.Tensor, old_logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The k3 estimator of KL(pi_theta || pi_ref) per sampled token and its derivative in log pi_theta, on-policy
    (log pi_theta = the sampling's log pi_old):  k3 = e^{r - o} - (r - o) - 1,  d k3 / d log pi = 1 - e^{r - o}.
    (P,), (P,) -> (P,), (P,)."""
    diff = ref_logp - old_logp
    return torch.exp(diff) - diff - 1.0, 1.0 - torch.exp(diff)


def row_advantages(advantages: dict[int, float]) -> Callable:
    """An `advantage` hook for one advantage per row (OPOD's group-relative A_i): each row's tokens get its A_i
    (rows absent from `advantages`, padding's row 0, get 0)."""

    def advantage(mb: MicroBatch, mask: torch.Tensor, h=None, w=None) -> torch.Tensor:
        a = torch.tensor([advantages.get(i, 0.0) for i in mb.rows.tolist()], device=mask.device)  # (n,)
        return a.unsqueeze(-1).expand(mask.shape)[mask]  # (P,)

    return advantage


def position_weights(batch: StepBatch, rows: torch.Tensor, mask: torch.Tensor, dtype) -> torch.Tensor | None:
    """(P,): 1 / pi_i of each of `rows` at each valid position, in mask's row-major order; None: all 1."""
    if batch.weights is None:
        return None
    w = batch.weights[rows].to(device=mask.device, dtype=dtype)  # (n,)
    return w.unsqueeze(-1).expand(mask.shape)[mask]  # (P,)


@dataclass
class PolicyGradient:
    """One policy-gradient pass over S's micro-batches: `run` backpropagates and returns this rank's values."""

    ctx: object
    """The run's `opd.methods.objective.ObjectiveContext`."""
    weight: float = 1.0
    """lambda."""
    importance: bool = False
    """The importance-sampled form (tinker's) instead of REINFORCE."""
    reference: object = None
    """A frozen model (`opd.models.ema_teacher.Teacher`) for KL(pi_theta || pi_ref); None: no KL term."""
    kl: float = 0.0

    def run(self, batch: StepBatch, advantage: Callable, denominator: float, sync: bool = True, release=(),
            plans: dict | None = None) -> tuple[float, float]:  # fmt: skip
        """Backpropagates this rank's share of L_pg (or L_is) + the KL on S, each row's terms times its 1 / pi_i under
        unbiased selection. `advantage(mb, mask, h, w)` -> (P,) the valid positions' A_it (it may run teacher
        forwards: `release` names their models, freed before each backward). `plans` ({group: [local row ids]}):
        the micro-batches (default: S grouped by length, one group). Returns this rank's (pg value, KL value)."""
        ctx, ro, sel = self.ctx, batch.rollouts, batch.selected
        cfg = ctx.loss
        if plans is None:
            plan = plan_micro_batches(ro.lengths[sel], cfg.micro_batch, cfg.micro_batch_tokens) if sel.numel() else []
            plans = {"pg": [sel[g] for g in plan]}
        values = [0.0, 0.0]
        extra = [self.reference.model] if self.reference is not None else []
        for mb in lockstep(ctx, batch, plans, sync, release=[*release, *extra]):
            with mb.synced():
                self._micro_batch(batch, mb, advantage, denominator, values)
        return values[0], values[1]

    def _micro_batch(self, batch: StepBatch, mb: MicroBatch, advantage: Callable, n: float, values: list) -> None:
        ctx, ro, device = self.ctx, batch.rollouts, self.ctx.device
        chunk, rows = ctx.loss.chunk, mb.rows
        pids = ro.prompt_index[rows].tolist()
        inputs, mask, width = micro_batch_inputs([batch.student_prompts[p] for p in pids], ro, rows, ctx.ids["pad"], device)
        y = ro.response_ids[rows, :width].to(device)[mask]  # (P,)
        old = ro.logp[rows, :width].to(device)[mask]  # (P,) log pi_old(y_t), the sampling's
        kl_terms = d_kl = None
        if self.reference is not None:  # KL(pi_theta || pi_ref), k3 on the sampled tokens
            with ctx.autocast(), mb.teacher(self.reference):
                h_r = self.reference.hidden(inputs, width)[mask]
                ref = sampled_logp_from_hidden(h_r, lm_head_weight(self.reference.model), y, chunk or max(1, h_r.shape[0]))
            mb.free()  # sharded: its gathered root (LM head) freed before the student's forward
            kl_terms, d_kl = k3(ref, old.to(ref.dtype))  # (P,) each
            w_pos = position_weights(batch, rows, mask, kl_terms.dtype) if mb.real else None  # (P,) 1 / pi_i
            if w_pos is not None:
                kl_terms, d_kl = kl_terms * w_pos, d_kl * w_pos
        with ctx.autocast():
            h = response_hidden(ctx.student, inputs, width)[mask]  # (P, H)
            w = lm_head_weight(getattr(ctx.student, "module", ctx.student))
        a = advantage(mb, mask, h.detach(), w.detach()).to(device)  # (P,) A_it, detached
        w_pos = position_weights(batch, rows, mask, a.dtype) if mb.real else None  # (P,) 1 / pi_i
        if w_pos is not None:  # unbiased selection: each position times its row's 1 / pi_i
            a = a * w_pos
        coef = -self.weight * a / n  # (P,) d L_pg / d log pi(y_t)
        if d_kl is not None:
            coef = coef + self.kl * d_kl / n
        coef = mb.weight(coef)
        with ctx.autocast():
            loss, logp = weighted_logp_from_hidden(h, w, y, coef.double() * ctx.accelerator.num_processes,
                                                   chunk or max(1, h.shape[0]), old if self.importance else None)  # fmt: skip
        mb.backward(loss)
        if not mb.real:
            return
        if self.importance:
            values[0] += float((-self.weight * a * torch.exp(logp.double() - old.double())).sum()) / n
        else:
            values[0] += float((-self.weight * a * logp.double()).sum()) / n
        if kl_terms is not None:
            values[1] += self.kl * float(kl_terms.double().sum()) / n
