"""BAS-OPD's distillation loss: Eq. 3 (generalized JSD on the student's top-k plus a tail) and Eq. 11's weights.

Pure functions on tensors, differentiable by autograd: what the default step runs on a micro-batch's logits
(`opd.methods.distill`). The seed family's other supports, divergences and aggregations, and `topk_divergence`
(every combination's per-position loss on full logits, the plain reference) are `opd.maths.family`'s.

Departures: the support is the student's top-k ids plus one tail bucket per side (Vision-OPD's convention; the paper
says "top-100"), the tail computed exactly as logsumexp(z outside the top-k) - logsumexp(z); at alpha = 0 and 1
`generalized_jsd` returns the limits KL(T || S) and KL(S || T), not a silent 0.
Details: docs/MODULES.md#opdmathsdivergence.
"""

import math

import torch


def kl_divergence(p_logp: torch.Tensor, q_logp: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) = sum_v P_v (log P_v - log Q_v) over the last dim, with 0 log 0 = 0."""
    p = p_logp.exp()
    # Mask the log-ratio, not the product: where(p > 0, p * (-inf - x), 0) has a NaN gradient.
    log_ratio = torch.where(p > 0, p_logp - q_logp, torch.zeros_like(p))  # (..., k)
    return (p * log_ratio).sum(-1)


def log_mixture(teacher_logp: torch.Tensor, student_logp: torch.Tensor, alpha: float) -> torch.Tensor:
    """log M = log(alpha P^T + (1 - alpha) P^S), elementwise, 0 < alpha < 1.

    An entry where both sides are 0 (an empty tail bucket at k = V) gives log M = -inf with a zero
    gradient: logaddexp(-inf, -inf) alone has a NaN derivative, so those entries are swapped for 0
    before it and set back to -inf after it.
    """
    empty = (teacher_logp == float("-inf")) & (student_logp == float("-inf"))  # (..., k)
    t = torch.where(empty, torch.zeros_like(teacher_logp), teacher_logp)
    s = torch.where(empty, torch.zeros_like(student_logp), student_logp)
    log_m = torch.logaddexp(t + math.log(alpha), s + math.log1p(-alpha))  # (..., k)
    return torch.where(empty, torch.full_like(log_m, float("-inf")), log_m)


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
    log_m = log_mixture(teacher_logp, student_logp, alpha)  # (..., k)
    return alpha * kl_divergence(teacher_logp, log_m) + (1.0 - alpha) * kl_divergence(student_logp, log_m)


def upcast(x: torch.Tensor) -> torch.Tensor:
    """float32 for half-precision logits; float32 and float64 kept as they are."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def tail_logp(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The tail bucket: log q with q = sum_{v not in I} p_v the mass outside the ids I, computed exactly

        log q = logsumexp_{v not in I} z_v - logsumexp_v z_v

    (the ids masked to -inf), never as log(1 - sum_{i in I} p_i), which cancels to rounding noise when
    I holds nearly all the mass. logits (..., V), ids (..., k) -> (..., 1). I holding every id (k = V)
    gives an empty tail, log q = -inf (a constant). Logits are assumed finite.
    """
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # (..., 1)
    if ids.shape[-1] >= logits.shape[-1]:
        return torch.full_like(lse, float("-inf")).detach()
    outside = logits.scatter(-1, ids, float("-inf"))  # (..., V) the top-k masked out
    return torch.logsumexp(outside, dim=-1, keepdim=True) - lse  # (..., 1)


def topk_support(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, k: int = 100, tail: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared support of the top-k distillation loss (Eq. 3 is evaluated on it).

    Takes the student's top-k ids I at each position and gathers both sides' full-vocabulary
    log-probs there. With `tail` (Vision-OPD, BAS-OPD) each side gains one bucket log q = log of the
    mass outside I (`tail_logp`, exact); without it each side is renormalised over I,
    log P_i = z_i - logsumexp_{j in I} z_j. Either way each side is a distribution (Eq. 3 takes
    distributions). The teacher is gathered at the *student's* ids (the teacher's own top-k matters
    only for the overlap term of Eq. 9). Returns (student_logp, teacher_logp) of shape (..., k + 1)
    with the tail or (..., k) without.
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student {tuple(student_logits.shape)}, teacher {tuple(teacher_logits.shape)} logits differ")
    k = min(k, student_logits.shape[-1])
    z_s, z_t = upcast(student_logits), upcast(teacher_logits)  # (..., V)
    ids = z_s.topk(k, dim=-1).indices  # (..., k) I
    if not tail:
        return torch.log_softmax(z_s.gather(-1, ids), -1), torch.log_softmax(z_t.gather(-1, ids), -1)  # (..., k)
    s_logp = z_s.gather(-1, ids) - torch.logsumexp(z_s, dim=-1, keepdim=True)  # (..., k)
    t_logp = z_t.gather(-1, ids) - torch.logsumexp(z_t, dim=-1, keepdim=True)  # (..., k)
    s_logp = torch.cat([s_logp, tail_logp(z_s, ids)], dim=-1)  # (..., k + 1)
    t_logp = torch.cat([t_logp, tail_logp(z_t, ids)], dim=-1)  # (..., k + 1)
    return s_logp, t_logp


def budgeted_weights(
    selected: torch.Tensor,
    mask: torch.Tensor,
    denominator: torch.Tensor | float | None = None,
    dtype: torch.dtype = torch.float32,
    sample_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eq. 11's weight of each token: z_i m_{i,t} / max(1, sum_i sum_t z_i m_{i,t}), shape (N, T).

    With sample weights w_i (unbiased selection's 1 / pi_i, `opd.selection.designs`) the Hajek form of the full-query token
    mean: w_i z_i m_{i,t} / sum_i w_i z_i sum_t m_{i,t}, w_i in the numerator *and* the denominator (clamped at 1
    only without weights). (A weight of the numerator alone, such as OPOD's beta, is `selected`'s value z_i, or
    `opd.methods.distill`'s `row_weights`.) `denominator` replaces the sum when the batch is split: the training loop
    evaluates Eq. 11 one micro-batch (and one rank) at a time with the global (weighted) count, so the parts add
    up to Eq. 11.
    """
    zm = selected.to(dtype).unsqueeze(-1) * mask.to(dtype)  # (N, T)
    if sample_weights is not None:
        zm = zm * sample_weights.to(dtype).unsqueeze(-1)  # (N, T)
    if denominator is None:
        denominator = zm.sum()
    floor = 1.0 if sample_weights is None else torch.finfo(zm.dtype).tiny
    return zm / torch.clamp(torch.as_tensor(denominator, dtype=zm.dtype, device=zm.device), min=floor)


def weighted_sum(per_token: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_{i,t} w_{i,t} D_{i,t}, the sum of Eq. 11 for given weights (Eq. 11's, times any token weight).

    Positions with weight 0 are left out, not multiplied: rows outside S may hold non-finite D (never
    computed), and they must not leak into the sum. Training's whole-logits path calls it per micro-batch;
    the chunked path (`opd.maths.chunked.budgeted_loss_from_hidden`) sums the same terms chunk by chunk."""
    return torch.where(weights > 0, per_token * weights, torch.zeros_like(per_token)).sum()
