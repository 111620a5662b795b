"""Per-token weights of the seed family, on the sampled tokens' log-probabilities (detached).

Each multiplies a position's divergence before the Eq. 11 mean, which still divides by every valid
selected token (tokens with weight 0 count in the denominator, as in the peers' token mean):

    L = sum_{i,t} z_i m_{i,t} w_{i,t} D_{i,t} / max(1, sum_{i,t} z_i m_{i,t})

Notation: y_t the student's sampled token at response position t, log pi(y_t) its log-probability.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from opd.maths.loss import TOKEN_WEIGHT_NAMES


def trust_region(pos_teacher_logp: torch.Tensor, neg_teacher_logp: torch.Tensor) -> torch.Tensor:
    """OPD-V's modality-balance trust region, one weight per sampled token:

        w_t = ReLU( log pi_{T+}(y_t) - log pi_{T-}(y_t) ),   detached

    T+ is the teacher with the privileged view (the crop), T- the same weights with the image masked.
    A token gets loss only where the visual evidence raises its probability. (...) -> (...).
    Source: aniri15/OPD-V verl/workers/actor/dp_actor.py (visual_advantage_weights =
    relu((teacher_log_prob - negative_teacher_log_prob).detach())).
    """
    return torch.relu(pos_teacher_logp - neg_teacher_logp).detach()


def importance_ratio(logp: torch.Tensor, old_logp: torch.Tensor, clip: float = 2.0) -> torch.Tensor:
    """Vision-OPD's truncated importance ratio (`is_clip`), one weight per sampled token:

        rho_t = min( exp(clamp(log pi_theta(y_t) - log pi_old(y_t), -20, 20)), c ),   detached

    pi_theta the current student, pi_old the policy that sampled y_t, c = `clip` (2 in Vision-OPD and
    RP-OPSD). It is 1 while the policy has not moved since sampling (one update per batch). Detached,
    as in Vision-OPD: its `negative_approx_kl = (student_log_probs - old_log_probs).detach()`, so the
    ratio only scales the divergence's gradient; the log-ratio is clamped to [-20, 20] before exp, as
    there. (...) -> (...). Source: VisionOPD/Vision-OPD verl/trainer/ppo/core_algos.py
    (compute_self_distillation_loss, is_clip).
    """
    log_ratio = torch.clamp((logp - old_logp).detach(), min=-20.0, max=20.0)
    return torch.exp(log_ratio).clamp(max=clip)


def teacher_gate(teacher_logp: torch.Tensor, student_logp: torch.Tensor) -> torch.Tensor:
    """OPOD's token gate, one weight per sampled token:

        c_t = ReLU( log pi_T(y_t) - log pi_theta(y_t) ),   detached

    pi_T the teacher the response is routed to, pi_theta the student. Guidance only where the teacher
    gives the sampled token more probability than the student. (...) -> (...). Source: OPOD (arXiv
    2607.20918), as transcribed in the project's notes on the family (docs/FAMILY.md; no public code; medium confidence).
    """
    return torch.relu(teacher_logp - student_logp).detach()


@dataclass
class SampledLogp:
    """The log-probabilities of the sampled tokens y_t at a block of valid positions (each (P,), detached)."""

    student: torch.Tensor
    """log pi_theta(y_t): the student now (the forward being trained)."""
    teacher: torch.Tensor
    """log pi_T(y_t): the (positive) teacher."""
    old: torch.Tensor | None = None
    """log pi_old(y_t): the policy that sampled y_t (the rollout's log-probs)."""
    negative: torch.Tensor | None = None
    """log pi_T-(y_t): OPD-V's negative teacher (the masked view); None for every other method."""


TOKEN_WEIGHTS: dict[str, Callable[[SampledLogp], torch.Tensor] | None] = {
    "none": None,  # w_t = 1
    "trust_region": lambda lp: trust_region(lp.teacher, lp.negative),  # OPD-V
    "gate": lambda lp: teacher_gate(lp.teacher, lp.student),  # OPOD
}
"""The methods' per-token weights by name (`opd.maths.loss.TOKEN_WEIGHT_NAMES`, a method's `token_weight`), each a
function of the sampled tokens' log-probs. Training applies them in one place: `TokenWeight`, called by the chunked
loss (`opd.maths.chunked.budgeted_loss_from_hidden`) on each chunk and by the whole-logits reference path alike. The
weights that read a second teacher view (`SampledLogp.negative`): `opd.maths.loss.NEGATIVE_VIEW`."""
assert tuple(TOKEN_WEIGHTS) == TOKEN_WEIGHT_NAMES  # the names the settings accept


def token_weight(name: str, is_clip: float = 0.0) -> Callable[[SampledLogp], torch.Tensor] | None:
    """The method's w_t (`TOKEN_WEIGHTS[name]`) times Vision-OPD's importance ratio when is_clip > 0
    (`importance_ratio(student, old, is_clip)`); None when w_t = 1 (nothing to compute)."""
    if name not in TOKEN_WEIGHTS:
        raise ValueError(f"unknown token weight {name!r}; known: {', '.join(TOKEN_WEIGHTS)}")
    base = TOKEN_WEIGHTS[name]
    if not is_clip:
        return base
    if base is None:
        return lambda lp: importance_ratio(lp.student, lp.old, is_clip)
    return lambda lp: base(lp) * importance_ratio(lp.student, lp.old, is_clip)


@dataclass
class TokenWeight:
    """A token weight over a micro-batch's valid positions: the function (`token_weight`), the sampled ids
    (P,) and the per-position inputs it reads besides the two sides' log-probs (old, negative; (P,) or None).
    `at(rows, student, teacher)` is w_t for the positions `rows` given their sampled-token log-probs."""

    fn: Callable[[SampledLogp], torch.Tensor]
    ids: torch.Tensor
    old: torch.Tensor | None = None
    negative: torch.Tensor | None = None

    def at(self, rows: slice, student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        part = lambda x: None if x is None else x[rows].to(student.dtype)  # noqa: E731
        return self.fn(SampledLogp(student.detach(), teacher.detach(), part(self.old), part(self.negative)))
