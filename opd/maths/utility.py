"""Utility labels (Eq. 7-9); the selector learns from them (its loss, Eq. 10 and 12: `opd.selection.selectors`).

u_i is high when the crop teacher makes a large (d), support-consistent (o) and confident (c)
correction to the full-image policy. Labels exist only for queried rows (Algorithm 1, line 12).

Interpretations of the paper:
- P^S and P^T of Eq. 7-8 are renormalized over the student's top-k ids (no tail bucket, unlike the
  distillation loss); the JSD of Eq. 7 is the symmetric one (alpha = 0.5).
- o_{i,t} is |top-k(P^S) and top-k(p^T)| / k with the teacher's own top-k over the full vocabulary;
  with `use_overlap=False` (an ablation, and the paper's fallback when teacher top-k ids are
  unavailable) o = 1. With `use_confidence=False` c = 1.
- k is capped at the vocabulary size; k must be at least 2 (c divides by log k).
"""

import math

import torch

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
