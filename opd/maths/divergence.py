"""Distillation divergence: Eq. 3 (generalized JSD over a top-k support) and Eq. 11 (budgeted loss).

Pure functions on tensors, differentiable by autograd: what the default step runs on a micro-batch's logits
(`opd.methods.distill`). Besides BAS-OPD's own loss, the seed family's supports (the teacher's top-k, full softmax
or renormalised; the full vocabulary) and divergences (the bias-corrected reverse KL, DAPD's clamped forward KL).
`topk_divergence` is every combination's per-position loss on full logits.

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


def teacher_topk_support(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, k: int = 100, renormalize: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's top-k support of RP-OPSD and OPSD: both sides gathered at the teacher's top-k ids I_T.

        renormalize=False (RP-OPSD):  log p_v = z_v - logsumexp_{all u} z_u,      v in I_T  (no tail)
        renormalize=True  (OPSD):     log P_v = z_v - logsumexp_{u in I_T} z_u,   v in I_T

    Without renormalisation the sides are sub-distributions (sum <= 1): a divergence for them is
    `bias_corrected_reverse_kl`. Sources: wmm7777/RP-OPSD verl/workers/actor/dp_actor.py
    (distillation_topk_source = teacher, distillation_add_tail = False) and
    verl/trainer/ppo/core_algos.py (full-softmax log-probs, no renormalisation); siyan-zhao/OPSD
    opsd_trainer.py (generalized_jsd_loss with top_k: the teacher's top-k logits, then log_softmax).
    Returns (student_logp, teacher_logp), each (..., k).
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student {tuple(student_logits.shape)}, teacher {tuple(teacher_logits.shape)} logits differ")
    k = min(k, student_logits.shape[-1])
    z_s, z_t = upcast(student_logits), upcast(teacher_logits)  # (..., V)
    ids = z_t.topk(k, dim=-1).indices  # (..., k) I_T
    s_k, t_k = z_s.gather(-1, ids), z_t.gather(-1, ids)  # (..., k)
    if renormalize:
        return torch.log_softmax(s_k, -1), torch.log_softmax(t_k, -1)
    return s_k - torch.logsumexp(z_s, -1, keepdim=True), t_k - torch.logsumexp(z_t, -1, keepdim=True)


def bias_corrected_reverse_kl(student_logp: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """RP-OPSD's per-position loss (MOPD's Eq. 5) on the teacher's top-k support without a tail:

        D = sum_{v in I_T} [ p_s(v) log(p_s(v) / p_t(v)) - p_s(v) + p_t(v) ]

    Each term is >= 0 (x log(x / y) - x + y is the Bregman divergence of x log x) and 0 iff
    p_s(v) = p_t(v), so D needs no normalised support. On a normalised one the correction sums to
    zero and D = KL(P^S || P^T). (..., k) -> (...). RP-OPSD runs it with alpha = 1 (the reverse
    direction); alpha plays no part in it. Source: wmm7777/RP-OPSD verl/trainer/ppo/core_algos.py
    (distillation_objective mopd_topk_reverse_kl: reverse_kl_term + bias_correction).
    """
    return kl_divergence(student_logp, teacher_logp) + (teacher_logp.exp() - student_logp.exp()).sum(-1)


SUPPORTS = ("student_tail", "teacher", "teacher_renorm", "full")  # BAS-OPD / Vision-OPD, RP-OPSD, OPSD, GKD
DIVERGENCES = ("jsd", "bc_rkl")  # generalized_jsd (Eq. 3), bias_corrected_reverse_kl


def check_loss(support: str, divergence: str) -> None:
    """ValueError for an unknown support or divergence, and for the teacher's top-k support without
    renormalisation under the JSD (its sides are not distributions; only 'bc_rkl' takes them)."""
    if support not in SUPPORTS:
        raise ValueError(f"unknown support {support!r}: use one of {', '.join(SUPPORTS)}")
    if divergence not in DIVERGENCES:
        raise ValueError(f"unknown divergence {divergence!r}: use one of {', '.join(DIVERGENCES)}")
    if support == "teacher" and divergence != "bc_rkl":
        raise ValueError(
            "support 'teacher' (the teacher's top-k, full softmax, no tail) is not a distribution: it goes only "
            "with divergence 'bc_rkl' (RP-OPSD); for the JSD use 'teacher_renorm' (OPSD) or 'student_tail'"
        )


def support_logp(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, k: int = 100, support: str = "student_tail"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(student_logp, teacher_logp) on the named support: 'student_tail' = `topk_support` with its tail
    (..., k + 1); 'teacher' / 'teacher_renorm' = `teacher_topk_support` (..., k); 'full' = both sides'
    log_softmax over the whole vocabulary (..., V), k unused (GKD's and OPSD's full-vocabulary loss)."""
    if support == "student_tail":
        return topk_support(student_logits, teacher_logits, k, tail=True)
    if support == "full":
        return torch.log_softmax(upcast(student_logits), -1), torch.log_softmax(upcast(teacher_logits), -1)
    return teacher_topk_support(student_logits, teacher_logits, k, renormalize=support == "teacher_renorm")


def token_divergence(
    student_logp: torch.Tensor, teacher_logp: torch.Tensor, divergence: str = "jsd", alpha: float = 0.5
) -> torch.Tensor:
    """The named per-position divergence over the last dim: 'jsd' = `generalized_jsd` with alpha,
    'bc_rkl' = `bias_corrected_reverse_kl` (no alpha). (..., k) -> (...)."""
    if divergence == "jsd":
        return generalized_jsd(student_logp, teacher_logp, alpha)
    return bias_corrected_reverse_kl(student_logp, teacher_logp)


def topk_divergence(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    k: int = 100,
    alpha: float = 0.5,
    *,
    support: str = "student_tail",
    divergence: str = "jsd",
) -> torch.Tensor:
    """The per-position loss of a method on full logits (..., V) -> (...), differentiable by autograd:
    D(support_logp(...)). The defaults are BAS-OPD's Eq. 3. The plain reference for opd/maths/chunked.py.

        BAS-OPD, Vision-OPD  support='student_tail', divergence='jsd'
        RP-OPSD              support='teacher',      divergence='bc_rkl'
        OPSD                 support='teacher_renorm', divergence='jsd'
        GKD                  support='full',         divergence='jsd' (alpha = GKD's beta)
    """
    check_loss(support, divergence)
    return token_divergence(*support_logp(student_logits, teacher_logits, k, support), divergence, alpha)


def clamped_forward_kl(
    anchor_logits: torch.Tensor, student_logits: torch.Tensor, temperature: float = 1.1, clip: float = 0.05
) -> torch.Tensor:
    """DAPD's per-position term: a full-vocabulary forward KL(anchor || student) at a temperature, each
    vocabulary entry's contribution clamped from above:

        a = log_softmax(z_anchor / tau),  s = log_softmax(z_student / tau)
        D = sum_v min( exp(a_v) (a_v - s_v), clip )

    tau = `temperature` (1.1), clip = 0.05. A contribution may be negative (where the student gives an
    entry more probability than the anchor); only large positive ones are capped. The anchor side is
    detached (DAPD computes it without gradient). (..., V), (..., V) -> (...). Source: uanu2002/DAPD
    dapd/trainer.py (`forward_kl`: F.kl_div(student_logp, anchor_logp, log_target=True).clamp(max=clip),
    summed over the vocabulary). The chunked form from hidden states is
    `opd.maths.chunked.clamped_kl_from_hidden`.

    A clamped entry has no gradient. Where the student gives the anchor's mode clearly less probability
    than the anchor (exp(a_m)(a_m - s_m) > clip), the gradient comes only from the other entries, whose
    terms fall as the student's mass grows there, so it lowers the mode's logit further: away from the
    anchor, and D can fall below 0 (the sum of a KL's negative entries). With the toy world's learning rate
    (1.5e-4, full fine-tuning) DAPD's student drifted there and collapsed to chance (measured; DAPD trains a
    LoRA at lr 5e-6 with gradient clip 0.1).
    """
    if temperature <= 0 or clip <= 0:
        raise ValueError(f"temperature and clip must be positive, got {temperature} and {clip}")
    a = torch.log_softmax(upcast(anchor_logits.detach()) / temperature, dim=-1)  # (..., V)
    s = torch.log_softmax(upcast(student_logits) / temperature, dim=-1)  # (..., V)
    p_a = a.exp()
    # Mask the log-ratio where the anchor has no mass (0 log 0 = 0 and no NaN gradient), as kl_divergence.
    contribution = p_a * torch.where(p_a > 0, a - s, torch.zeros_like(s))  # (..., V)
    return contribution.clamp(max=clip).sum(-1)


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


def budgeted_loss(
    per_token: torch.Tensor,
    selected: torch.Tensor,
    mask: torch.Tensor,
    denominator: torch.Tensor | float | None = None,
    sample_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eq. 11 of the paper: the budgeted objective, a masked token mean over selected rows.

        L_BAS = sum_i sum_t z_i m_{i,t} D_alpha(p^T_{i,t} || p^S_{i,t}) / max(1, sum_i sum_t z_i m_{i,t})

    per_token (N, T) holds D_alpha, selected (N,) is z_i, mask (N, T) is m_{i,t}. With no selected
    valid token the result is an exact zero (the denominator is clamped to at least 1).
    `denominator`: see `budgeted_weights`. `sample_weights` (N,) w_i: the Hajek form

        L = sum_i w_i z_i sum_t m_{i,t} D_{i,t} / sum_i w_i z_i sum_t m_{i,t},

    with w_i = 1 / pi_i a consistent estimate of the full-query token mean whatever the inclusion probabilities
    pi of a sampled S (unbiased selection, `opd.selection.designs.sample_with_probabilities`); w = 1 is today's Eq. 11.
    """
    return weighted_sum(per_token, budgeted_weights(selected, mask, denominator, per_token.dtype, sample_weights))


def weighted_sum(per_token: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_{i,t} w_{i,t} D_{i,t}, the sum of Eq. 11 for given weights (Eq. 11's, times any token weight).

    Positions with weight 0 are left out, not multiplied: rows outside S may hold non-finite D (never
    computed), and they must not leak into the sum. Training's whole-logits path calls it per micro-batch;
    the chunked path (`opd.maths.chunked.budgeted_loss_from_hidden`) sums the same terms chunk by chunk."""
    return torch.where(weights > 0, per_token * weights, torch.zeros_like(per_token)).sum()
