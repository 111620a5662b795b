"""BAS-OPD's losses: Eq. 3 (generalized JSD on the student's top-k plus a tail), Eq. 11's weights and denominator,
and Eq. 7-9's utility labels u_i: pure functions on tensors, differentiable by autograd, run on a micro-batch's logits
(`opd.methods.objective`); the family's other losses: `opd.maths.family`. Departures (exact tail, alpha's endpoints,
Eq. 7-8 on the renormalised top-k, o's fallback, k >= 2) and details: docs/MODULES.md#opdmathsdivergence."""

import math

import torch


def kl_divergence(p_logp: torch.Tensor, q_logp: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) = sum_v P_v (log P_v - log Q_v) over the last dim, with 0 log 0 = 0."""
    p = p_logp.exp()
    # Mask the log-ratio, not the product: where(p > 0, p * (-inf - x), 0) has a NaN gradient.
    log_ratio = torch.where(p > 0, p_logp - q_logp, torch.zeros_like(p))  # (..., k)
    return (p * log_ratio).sum(-1)


def log_mixture(teacher_logp: torch.Tensor, student_logp: torch.Tensor, alpha: float) -> torch.Tensor:
    """log M = log(alpha P^T + (1 - alpha) P^S), elementwise, 0 < alpha < 1; -inf (zero gradient) where both are 0."""
    empty = (teacher_logp == float("-inf")) & (student_logp == float("-inf"))  # (..., k)
    t = torch.where(empty, torch.zeros_like(teacher_logp), teacher_logp)
    s = torch.where(empty, torch.zeros_like(student_logp), student_logp)
    log_m = torch.logaddexp(t + math.log(alpha), s + math.log1p(-alpha))  # (..., k)
    return torch.where(empty, torch.full_like(log_m, float("-inf")), log_m)


def generalized_jsd(student_logp: torch.Tensor, teacher_logp: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """Eq. 3: D_alpha = alpha KL(P^T || M) + (1 - alpha) KL(P^S || M), M = alpha P^T + (1 - alpha) P^S (paper: 0.5).
    Log-probs over a shared support (..., k) -> (...); alpha = 0 / 1: the limits KL(P^T || P^S) / KL(P^S || P^T)."""
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
    """The tail bucket, exact: log q = logsumexp_{v not in I} z_v - logsumexp_v z_v, never log(1 - sum_{i in I} p_i).
    logits (..., V), ids I (..., k) -> (..., 1); k = V: an empty tail, log q = -inf (a constant). Logits finite."""
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # (..., 1)
    if ids.shape[-1] >= logits.shape[-1]:
        return torch.full_like(lse, float("-inf")).detach()
    outside = logits.scatter(-1, ids, float("-inf"))  # (..., V) the top-k masked out
    return torch.logsumexp(outside, dim=-1, keepdim=True) - lse  # (..., 1)


def topk_support(student_logits: torch.Tensor, teacher_logits: torch.Tensor, k: int = 100,
                 tail: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 3's support: both sides' log-probs at the student's top-k ids I plus each side's tail bucket (`tail_logp`),
    or without `tail` renormalised over I. Returns (student_logp, teacher_logp), (..., k + 1) or (..., k)."""
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


def budgeted_weights(selected: torch.Tensor, mask: torch.Tensor, denominator: torch.Tensor | float | None = None,
                     dtype: torch.dtype = torch.float32, sample_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Eq. 11's token weights z_i m_it / max(1, sum_it z_i m_it), (N, T); with sample weights w_i (1 / pi_i) the
    Hajek form w_i z_i m_it / sum_it w_i z_i m_it. `denominator`: the global count, for one micro-batch and rank."""
    zm = selected.to(dtype).unsqueeze(-1) * mask.to(dtype)  # (N, T)
    if sample_weights is not None:
        zm = zm * sample_weights.to(dtype).unsqueeze(-1)  # (N, T)
    if denominator is None:
        denominator = zm.sum()
    floor = 1.0 if sample_weights is None else torch.finfo(zm.dtype).tiny
    return zm / torch.clamp(torch.as_tensor(denominator, dtype=zm.dtype, device=zm.device), min=floor)


def global_denominator(accelerator, lengths: torch.Tensor, selected: torch.Tensor, sample_weights=None,
                       full_tokens: float | None = None) -> float | int:  # fmt: skip
    """Eq. 11's denominator over all ranks (one all-reduce, run by every rank): the selected valid tokens, or with
    weights the Hajek sum_i w_i T_i (a float); `full_tokens` (--estimator ht): T_C instead, if S has a token at all."""
    device = accelerator.device
    if sample_weights is None:
        tokens = int(lengths[selected].sum()) if selected.numel() else 0
        tokens = int(accelerator.reduce(torch.tensor(tokens, device=device), "sum").item())
    else:
        local = (lengths[selected].double() * sample_weights[selected].double()).sum() if selected.numel() else 0.0
        tokens = float(accelerator.reduce(torch.tensor(float(local), device=device, dtype=torch.float64), "sum").item())
    return float(full_tokens) if full_tokens is not None and tokens else tokens


def weighted_sum(per_token: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_{i,t} w_{i,t} D_{i,t} (Eq. 11's sum), skipping weight-0 positions (rows outside S may hold non-finite D)."""
    return torch.where(weights > 0, per_token * weights, torch.zeros_like(per_token)).sum()


def topk_overlap(student_ids: torch.Tensor, teacher_ids: torch.Tensor) -> torch.Tensor:
    """o_{i,t}: the fraction of the student's top-k ids that are also in the teacher's top-k. (..., k) -> (...)."""
    t_sorted = teacher_ids.sort(-1).values  # (..., k)
    pos = torch.searchsorted(t_sorted.contiguous(), student_ids.contiguous()).clamp(max=t_sorted.shape[-1] - 1)
    found = t_sorted.gather(-1, pos) == student_ids  # (..., k)
    return found.float().mean(-1)


def token_jsd(student_logp_k: torch.Tensor, teacher_logp_k: torch.Tensor) -> torch.Tensor:
    """Eq. 7: d_{i,t} = JSD(P^S_{i,t}, P^T_{i,t}) on the renormalized top-k support."""
    return generalized_jsd(student_logp_k, teacher_logp_k, alpha=0.5)


def teacher_confidence(teacher_logp_k: torch.Tensor) -> torch.Tensor:
    """Eq. 8: c_{i,t} = 1 - H(P^T_{i,t}) / log k, with P^T renormalized over k ids."""
    k = teacher_logp_k.shape[-1]
    p = teacher_logp_k.exp()
    entropy = -torch.where(p > 0, p * teacher_logp_k, torch.zeros_like(p)).sum(-1)  # (...)
    return 1.0 - entropy / math.log(k)


def utility_terms(student_logits: torch.Tensor, teacher_logits: torch.Tensor, k: int = 100,
                  student_topk: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
    """(d, o, c) per position from full-vocabulary logits (..., V), each (...); `student_topk`: its (values, ids)."""
    k = min(k, student_logits.shape[-1])
    if k < 2:
        raise ValueError(f"the utility needs k >= 2 (c divides by log k), got k = {k}")
    s_values, s_ids = student_topk if student_topk is not None else upcast(student_logits).topk(k, dim=-1)
    s_logp_k = torch.log_softmax(upcast(s_values), dim=-1)  # (..., k) P^S renormalized
    t_logp_k = torch.log_softmax(upcast(teacher_logits.gather(-1, s_ids)), dim=-1)  # (..., k) P^T
    t_ids = teacher_logits.topk(k, dim=-1).indices  # (..., k)
    d = token_jsd(s_logp_k, t_logp_k)
    o = topk_overlap(s_ids, t_ids)
    c = teacher_confidence(t_logp_k)
    return d, o, c


def sample_utility(d: torch.Tensor, o: torch.Tensor, c: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Eq. 9: u_i = sum_t m_it d_it o_it c_it / sum_t m_it; (N, T) -> (N,), 0 for a row with no valid token."""
    m = mask.to(d.dtype)
    return (m * d * o * c).sum(-1) / m.sum(-1).clamp(min=1.0)


def labels_from_terms(terms: torch.Tensor, mask: torch.Tensor, use_overlap: bool = True,
                      use_confidence: bool = True) -> torch.Tensor:
    """Eq. 9's u_i per row, detached, from terms (d, o, c): (P, 3) at mask's valid positions or (n, T, 3); mask (n, T).
    `use_overlap` / `use_confidence` False set o / c to 1 (Table 4's ablations)."""
    if terms.dim() == 2:  # the valid positions only: back onto the (n, T) grid
        grid = torch.zeros((*mask.shape, 3), dtype=terms.dtype, device=terms.device)
        grid[mask] = terms
        terms = grid
    d, o, c = terms.detach().unbind(-1)  # (n, T) each
    o = o if use_overlap else torch.ones_like(o)
    c = c if use_confidence else torch.ones_like(c)
    return sample_utility(d, o, c, mask)

