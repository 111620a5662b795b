"""Utility labels (Eq. 7-9) and the selector's loss (Eq. 10, 12).

u_i is high when the crop teacher makes a large (d), support-consistent (o) and confident (c)
correction to the full-image policy. Labels exist only for queried rows (Algorithm 1, line 12).

Interpretations of the paper:
- P^S and P^T of Eq. 7-8 are renormalized over the student's top-k ids (no tail bucket, unlike the
  distillation loss); the JSD of Eq. 7 is the symmetric one (alpha = 0.5).
- o_{i,t} is |top-k(P^S) and top-k(p^T)| / k with the teacher's own top-k over the full vocabulary;
  with `use_overlap=False` (an ablation, and the paper's fallback when teacher top-k ids are
  unavailable) o = 1. With `use_confidence=False` c = 1.
- k is capped at the vocabulary size; k must be at least 2 (c divides by log k).
- The ranking term of Eq. 10 is the w_i w_j-weighted mean over unordered pairs with
  |u_i - u_j| > min_gap, and 0 when there is no such pair.
"""

import math

import torch
import torch.nn.functional as F

from opd.maths.divergence import generalized_jsd, upcast


def topk_overlap(student_ids: torch.Tensor, teacher_ids: torch.Tensor) -> torch.Tensor:
    """o_{i,t}: the fraction of the student's top-k ids that are also in the teacher's top-k. (..., k) -> (...)."""
    t_sorted = teacher_ids.sort(-1).values  # (..., k)
    pos = torch.searchsorted(t_sorted.contiguous(), student_ids.contiguous()).clamp(max=t_sorted.shape[-1] - 1)
    found = t_sorted.gather(-1, pos) == student_ids  # (..., k)
    return found.float().mean(-1)


def token_jsd(student_logp_k: torch.Tensor, teacher_logp_k: torch.Tensor) -> torch.Tensor:
    """Eq. 7 of the paper: d_{i,t} = JSD(P^S_{i,t}, P^T_{i,t}) on the renormalized top-k support."""
    return generalized_jsd(student_logp_k, teacher_logp_k, alpha=0.5)


def teacher_confidence(teacher_logp_k: torch.Tensor) -> torch.Tensor:
    """Eq. 8 of the paper: c_{i,t} = 1 - H(P^T_{i,t}) / log k, with P^T renormalized over k ids."""
    k = teacher_logp_k.shape[-1]
    p = teacher_logp_k.exp()
    entropy = -torch.where(p > 0, p * teacher_logp_k, torch.zeros_like(p)).sum(-1)  # (...)
    return 1.0 - entropy / math.log(k)


def utility_terms(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    k: int = 100,
    student_topk: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d, o, c) per position from full-vocabulary logits (..., V); each (...).

    `student_topk` = (values, ids) of the student's top-k logits, when the caller has them already.
    """
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
    """Eq. 9 of the paper: u_i = sum_t m_{i,t} d_{i,t} o_{i,t} c_{i,t} / sum_t m_{i,t}.

    d, o, c, mask: (N, T) -> (N,). A row with no valid token gets 0.
    """
    m = mask.to(d.dtype)
    return (m * d * o * c).sum(-1) / m.sum(-1).clamp(min=1.0)


def labels_from_terms(terms: torch.Tensor, mask: torch.Tensor, use_overlap: bool = True,
                      use_confidence: bool = True) -> torch.Tensor:
    """Eq. 9 from a loss pass's per-position terms (d, o, c) of Eq. 7-8: u_i per row, detached.

    terms: (P, 3) at mask's valid positions (row-major, as `terms[mask]`) or (n, T, 3); mask: (n, T) -> (n,).
    `use_overlap` / `use_confidence` False set o / c to 1 (the ablations of Table 4)."""
    if terms.dim() == 2:  # the valid positions only: back onto the (n, T) grid
        grid = torch.zeros((*mask.shape, 3), dtype=terms.dtype, device=terms.device)
        grid[mask] = terms
        terms = grid
    d, o, c = terms.detach().unbind(-1)  # (n, T) each
    o = o if use_overlap else torch.ones_like(o)
    c = c if use_confidence else torch.ones_like(c)
    return sample_utility(d, o, c, mask)


@torch.no_grad()
def utility_labels(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    k: int = 100,
    use_overlap: bool = True,
    use_confidence: bool = True,
) -> torch.Tensor:
    """Eq. 7-9 of the paper: one detached utility label u_i per row.

    student_logits, teacher_logits: (N, T, V) over the same response tokens; mask: (N, T).
    `use_overlap` / `use_confidence` False set o / c to 1 (the ablations of Table 4).
    """
    terms = torch.stack(utility_terms(student_logits.detach(), teacher_logits.detach(), k), -1)  # (N, T, 3)
    return labels_from_terms(terms, mask, use_overlap, use_confidence)


def recency_weights(collected_at: torch.Tensor, step: int, half_life: float = 10.0) -> torch.Tensor:
    """Appendix A.3: w_i = 2^(-(s - s_i) / h) for an item collected at step s_i, read at step s."""
    return torch.pow(2.0, -(step - collected_at.double()) / half_life).float()


def weighted_huber(pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor, delta: float = 1.0) -> torch.Tensor:
    """Eq. 12 of the paper: L_reg = sum_i w_i Huber(u^_i - u_i) / sum_i w_i (Huber with delta 1)."""
    per_item = F.huber_loss(pred, target, reduction="none", delta=delta)  # (B,)
    return (weights * per_item).sum() / weights.sum().clamp(min=torch.finfo(weights.dtype).tiny)


def pairwise_rank_loss(
    pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor, min_gap: float = 1e-6
) -> torch.Tensor:
    """L_rank of Eq. 10 (Appendix A.3): the w_i w_j-weighted mean over pairs with |u_i - u_j| > min_gap of

        softplus(-sgn(u_i - u_j) (u^_i - u^_j)).

    Unordered pairs i < j (the term is symmetric in i, j); 0 when no pair qualifies.
    """
    du = target.unsqueeze(1) - target.unsqueeze(0)  # (B, B) u_i - u_j
    dp = pred.unsqueeze(1) - pred.unsqueeze(0)  # (B, B) u^_i - u^_j
    ww = weights.unsqueeze(1) * weights.unsqueeze(0)  # (B, B) w_i w_j
    upper = torch.ones_like(du, dtype=torch.bool).triu(diagonal=1)
    pairs = upper & (du.abs() > min_gap)
    if not pairs.any():
        return pred.sum() * 0.0
    terms = F.softplus(-torch.sign(du) * dp)  # (B, B)
    return (ww * terms)[pairs].sum() / ww[pairs].sum()


def selector_loss(
    pred: torch.Tensor,
    target: torch.Tensor,
    weights: torch.Tensor,
    rank_weight: float = 0.2,
    min_gap: float = 1e-6,
) -> torch.Tensor:
    """Eq. 10 of the paper: L_sel = L_reg + lambda_rank L_rank (L_reg is Eq. 12)."""
    loss = weighted_huber(pred, target, weights)
    if rank_weight:
        loss = loss + rank_weight * pairwise_rank_loss(pred, target, weights, min_gap)
    return loss
