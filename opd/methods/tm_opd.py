"""Thinking Machines' on-policy distillation (thinking-machines-lab/tinker-cookbook,
`tinker_cookbook/distillation/train_on_policy.py`; the blog post "On-Policy Distillation", 2025), on Algorithm 1's
loop, with BAS-OPD's budget on top like every method.

A frozen teacher scores the student's own sampled tokens; each token's advantage is the negative one-sample reverse
KL, A_t = -lambda (log pi_old(y_t) - log pi_T(y_t)) (`token_advantages`, optionally discounted), through tinker's
`importance_sampling` loss (`opd.methods.policy_gradient`, `--loss-agg token-sum`). The teacher runs on S only, one
forward per row; the label u_i is Eq. 9 from both sides' hidden states. Their recipe is in `opd.methods.table`.
Departures from their code (docs/DEPARTURES.md): the LoRA alpha (ours 2 r); no environment reward advantages;
--max-response-len is the preset's.
Details: docs/MODULES.md#opdmethodstm_opd.
"""

from __future__ import annotations

import torch

from opd.data.records import StepBatch
from opd.maths.chunked import budgeted_loss_from_hidden
from opd.maths.weights import TokenWeight
from opd.methods.lockstep import MicroBatch, timed
from opd.methods.interface import Objective, ObjectiveContext, ObjectiveResult
from opd.methods.objective import begin, teacher_inputs, teacher_plans
from opd.methods.policy_gradient import PolicyGradient
from opd.methods.specs import TM_OPD_SPEC, TMOPDConfig
from opd.models.ema_teacher import Stopwatch
from opd.models.hidden import lm_head_weight


def token_advantages(old_logp: torch.Tensor, teacher_logp: torch.Tensor, coef: float = 1.0) -> torch.Tensor:
    """A_t = -coef (log pi_old(y_t) - log pi_T(y_t)): the negative one-sample reverse KL of each sampled token.
    (...) -> (...)."""
    return -coef * (old_logp - teacher_logp)


def discounted_future_sum(a: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """A_t <- sum_{s >= t} gamma^(s - t) A_s along each row's valid tokens (their `discounted_future_sum_vectorized`;
    gamma = 0: unchanged). a, mask (n, T) -> (n, T), 0 outside the mask."""
    a = a * mask
    if gamma == 0:
        return a
    out = torch.zeros_like(a)
    running = torch.zeros_like(a[:, 0])
    for t in range(a.shape[1] - 1, -1, -1):
        running = a[:, t] + gamma * running * mask[:, t]
        out[:, t] = running
    return out * mask


class TMOPD(Objective):
    """The objective (see the module docstring): the teacher's log-probs of S's tokens, the importance-sampled policy
    gradient of their advantages, and the selector's labels, one micro-batch at a time."""

    spec = TM_OPD_SPEC  # its name, Config (TMOPDConfig), refuses, aggregations (`opd.methods.specs`)

    def __init__(self, ctx: ObjectiveContext, config: TMOPDConfig | None = None, initial_teacher=None):
        super().__init__(ctx, config or TMOPDConfig(), initial_teacher)
        self.pg = PolicyGradient(ctx, importance=True)

    @property
    def labels(self) -> list[str]:
        t = self.ctx.teachers
        return [t.label(n, v) for n in t.names for v in self.ctx.teacher_views[:1]]

    def __call__(self, batch: StepBatch) -> ObjectiveResult:
        ctx = self.ctx
        res = begin(ctx, batch, self.labels)
        if res.empty:  # S is empty everywhere: no teacher call, zero loss (every rank alike)
            res.loss_share, res.metrics = 0.0, {"teacher_kl": 0.0}
            return res
        n = 1.0 if ctx.loss.aggregation == "token-sum" else float(res.global_tokens)
        kl = torch.zeros(2, dtype=torch.float64)  # this rank's sum of log pi_old - log pi_T over S's tokens, tokens
        hook = lambda mb, mask, h, w: self._advantages(batch, mb, mask, h, w, res, kl)  # noqa: E731
        res.loss_share, _ = self.pg.run(batch, hook, n, release=ctx.teacher_models,
                                        plans=teacher_plans(ctx, batch, ctx.teacher_views[0]))  # fmt: skip
        total = ctx.accelerator.reduce(kl.to(ctx.device), "sum").cpu()  # every rank, also with nothing to do
        res.metrics = {"teacher_kl": float(total[0] / total[1].clamp(min=1))}  # their metric: the mean over tokens
        return res

    @torch.no_grad()
    def _advantages(self, batch: StepBatch, mb: MicroBatch, mask, h_s, w_s, res: ObjectiveResult, kl) -> torch.Tensor:
        """The teacher `mb.group` on the micro-batch's rows (booked unless padding): A_t (P,), and the rows' labels
        u_i (Eq. 9) into `res.utility`."""
        ctx, ro, rows, cfg = self.ctx, batch.rollouts, mb.rows, self.ctx.loss
        teacher = ctx.teachers.teachers[mb.group]
        inputs, _, width, cost = teacher_inputs(ctx, batch, mb, ctx.teacher_views[0], res)
        with ctx.autocast(), mb.teacher(teacher), timed(cost, ctx.device):
            h_t = teacher.hidden(inputs, width)[mask]  # (P, H)
        y = ro.response_ids[rows, :width].to(ctx.device)[mask]  # (P,)
        old = ro.logp[rows, :width].to(ctx.device)[mask]  # (P,) log pi_old(y_t)
        extras, timing = {}, {}
        ones = TokenWeight(lambda s: torch.ones_like(s.student), y)  # w_t = 1: only log pi_T(y_t) comes back
        with ctx.autocast():
            _, _, terms = budgeted_loss_from_hidden(
                h_s, w_s, h_t, lm_head_weight(teacher.model), torch.zeros(h_s.shape[0], device=ctx.device), cfg.topk,
                cfg.alpha, cfg.chunk or max(1, h_s.shape[0]), support=cfg.support, divergence=cfg.divergence,
                tokens=ones, timing=timing, stopwatch=Stopwatch, extras=extras,
            )  # fmt: skip
        teacher_logp = extras["teacher_logp"]  # (P,) at the logits' precision (float32, float64)
        old = old.to(teacher_logp.dtype)
        per_token = torch.zeros(mask.shape, dtype=teacher_logp.dtype, device=ctx.device)
        per_token[mask] = token_advantages(old, teacher_logp, self.config.kl_coef)
        advantage = discounted_future_sum(per_token, mask, self.config.discount)[mask]  # (P,)
        if cost is not None:  # a real slot: its teacher LM-head time, the labels, the KL metric
            cost.seconds += timing.get("teacher_s", 0.0)  # the teacher's LM head inside the fused pass
            res.label(rows, terms, mask, cfg)
            kl += torch.tensor([float((old - teacher_logp).double().sum()), float(mask.sum())], dtype=torch.float64)
        return advantage
