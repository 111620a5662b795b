"""Distillation divergence: Eq. 3 (generalized JSD over a top-k support) and Eq. 11 (budgeted loss).

Pure functions on tensors; no model is needed to call them.

Where this departs from / interprets the paper:
- The support is the student's top-k ids at each position plus one tail bucket holding the remaining
  probability mass, log(1 - sum_topk p), on both sides (as in Vision-OPD, which BAS-OPD extends).
  The paper says "top-100 distillation" without fixing the support; this is the peer's convention.
- At the endpoints alpha = 0 and alpha = 1 the mixture formula degenerates to 0. We return the limits
  that the peers use instead (TRL's generalized_jsd_loss): alpha = 0 gives KL(T || S) and alpha = 1
  gives KL(S || T), i.e. lim D_alpha / alpha and lim D_alpha / (1 - alpha). A silent zero loss at the
  endpoints is a known peer bug.
"""

import math

import torch


def kl_divergence(p_logp: torch.Tensor, q_logp: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) = sum_v P_v (log P_v - log Q_v) over the last dim, with 0 log 0 = 0."""
    p = p_logp.exp()
    # Mask the log-ratio, not the product: where(p > 0, p * (-inf - x), 0) has a NaN gradient.
    log_ratio = torch.where(p > 0, p_logp - q_logp, torch.zeros_like(p))  # (..., k)
    return (p * log_ratio).sum(-1)


def generalized_jsd(student_logp: torch.Tensor, teacher_logp: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """Eq. 3 of the paper: the per-position divergence D_alpha(p^T || p^S).

        M = alpha * P^T + (1 - alpha) * P^S
        D_alpha = alpha * KL(P^T || M) + (1 - alpha) * KL(P^S || M)

    alpha = 0.5 is the symmetric Jensen-Shannon divergence the paper trains with. Inputs are
    log-probabilities over a shared support on the last dim (e.g. from `topk_support`); returns one
    value per position, shape (...). Endpoints: alpha = 0 -> KL(P^T || P^S), alpha = 1 ->
    KL(P^S || P^T) (the limits of D_alpha / alpha and D_alpha / (1 - alpha); see module docstring).
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    if alpha == 0.0:
        return kl_divergence(teacher_logp, student_logp)
    if alpha == 1.0:
        return kl_divergence(student_logp, teacher_logp)
    # log M = logsumexp(log alpha + log P^T, log(1 - alpha) + log P^S)
    log_m = torch.logaddexp(teacher_logp + math.log(alpha), student_logp + math.log1p(-alpha))  # (..., k)
    return alpha * kl_divergence(teacher_logp, log_m) + (1.0 - alpha) * kl_divergence(student_logp, log_m)


def upcast(x: torch.Tensor) -> torch.Tensor:
    """float32 for half-precision logits; float32 and float64 kept as they are."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def tail_logp(topk_logp: torch.Tensor) -> torch.Tensor:
    """log(1 - sum_k p_k) of the mass outside a top-k support, the sum in float64, clamped at the dtype's
    smallest normal number (k = V leaves an empty tail)."""
    mass = topk_logp.double().exp().sum(-1, keepdim=True)  # (..., 1)
    return torch.log(torch.clamp(1.0 - mass, min=torch.finfo(topk_logp.dtype).tiny)).to(topk_logp.dtype)


def topk_support(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, k: int = 100, tail: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared support of the top-k distillation loss (Eq. 3 is evaluated on it).

    Takes the student's top-k ids at each position, gathers both sides' log-probs there, and, when
    `tail`, appends one bucket log(1 - sum of the top-k probs) per side so each side sums to one.
    The teacher is gathered at the *student's* ids (the teacher's own top-k matters only for the
    overlap term of Eq. 9). Returns (student_logp, teacher_logp) of shape (..., k) or (..., k + 1).
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student {tuple(student_logits.shape)} and teacher {tuple(teacher_logits.shape)} logits differ")
    k = min(k, student_logits.shape[-1])
    s_logp_full = torch.log_softmax(upcast(student_logits), dim=-1)  # (..., V)
    t_logp_full = torch.log_softmax(upcast(teacher_logits), dim=-1)  # (..., V)
    ids = s_logp_full.topk(k, dim=-1).indices  # (..., k)
    s_logp = s_logp_full.gather(-1, ids)  # (..., k)
    t_logp = t_logp_full.gather(-1, ids)  # (..., k)
    if tail:
        s_logp = torch.cat([s_logp, tail_logp(s_logp)], dim=-1)  # (..., k + 1)
        t_logp = torch.cat([t_logp, tail_logp(t_logp)], dim=-1)  # (..., k + 1)
    return s_logp, t_logp


def opd_loss(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Eq. 3 of the paper, the standard OPD objective as a batch estimate:

        L_OPD = mean_i [ (1 / T_i) sum_t D_alpha(p^T_{i,t} || p^S_{i,t}) ]

    per_token (N, T) holds D_alpha, mask (N, T) the valid response positions (T_i = sum_t m_{i,t}).
    Rows with no valid token are left out of the mean. Training uses Eq. 11 (`budgeted_loss`), which
    takes the mean over tokens instead; this per-sequence form is kept for diagnostics.
    """
    mask = mask.to(per_token.dtype)
    t_i = mask.sum(-1)  # (N,)
    rows = t_i > 0
    per_seq = (per_token * mask).sum(-1)[rows] / t_i[rows]  # (N',)
    return per_seq.mean() if per_seq.numel() else per_token.sum() * 0.0


def budgeted_weights(
    selected: torch.Tensor,
    mask: torch.Tensor,
    denominator: torch.Tensor | float | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Eq. 11's weight of each token: z_i m_{i,t} / max(1, sum_i sum_t z_i m_{i,t}), shape (N, T).

    `denominator` replaces the sum when the batch is split: the training loop evaluates Eq. 11 one
    micro-batch (and one rank) at a time with the global count, so the parts add up to Eq. 11.
    """
    zm = selected.to(dtype).unsqueeze(-1) * mask.to(dtype)  # (N, T)
    if denominator is None:
        denominator = zm.sum()
    return zm / torch.clamp(torch.as_tensor(denominator, dtype=zm.dtype, device=zm.device), min=1.0)


def budgeted_loss(
    per_token: torch.Tensor,
    selected: torch.Tensor,
    mask: torch.Tensor,
    denominator: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Eq. 11 of the paper: the budgeted objective, a masked token mean over selected rows.

        L_BAS = sum_i sum_t z_i m_{i,t} D_alpha(p^T_{i,t} || p^S_{i,t}) / max(1, sum_i sum_t z_i m_{i,t})

    per_token (N, T) holds D_alpha, selected (N,) is z_i, mask (N, T) is m_{i,t}. With no selected
    valid token the result is an exact zero (the denominator is clamped to at least 1).
    `denominator`: see `budgeted_weights`.
    """
    w = budgeted_weights(selected, mask, denominator, per_token.dtype)  # (N, T)
    # Rows with z = 0 may hold non-finite values (never computed); they must not leak into the sum.
    return torch.where(w > 0, per_token * w, torch.zeros_like(per_token)).sum()
