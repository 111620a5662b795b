"""Per-token weights of the seed family, on the sampled tokens' log-probabilities (detached).

Each multiplies a position's divergence before the Eq. 11 mean, which still divides by every valid
selected token (tokens with weight 0 count in the denominator, as in the peers' token mean):

    L = sum_{i,t} z_i m_{i,t} w_{i,t} D_{i,t} / max(1, sum_{i,t} z_i m_{i,t})

Notation: y_t the student's sampled token at response position t, log pi(y_t) its log-probability.
"""

import torch


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
    2607.20918), as transcribed in ../shared/notes/seed-family.md (no public code; medium confidence).
    """
    return torch.relu(teacher_logp - student_logp).detach()
