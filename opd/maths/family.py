"""The seed family's supports, divergences and aggregations beside BAS-OPD's (`opd.maths.divergence`, the default's).

The tables by name (`LossConfig.support`, `.aggregation`), whose BAS-OPD entries are the default's functions, and
in which the distillation pass looks its calls up: `SUPPORTS` (the student's top-k + tail; the teacher's top-k, full
softmax or renormalised; the full vocabulary), `AGGREGATION_WEIGHTS` and `DENOMINATORS` (Eq. 11's token mean, OPSD's
sequence mean, verl's micro-batch mean, tinker's token sum). The divergences (`token_divergence`; their names and
`check_loss`: `opd.maths.loss`): the generalized JSD and RP-OPSD's bias-corrected reverse KL; DAPD's clamped
forward KL; the per-sequence L_OPD of Eq. 3; the plain references `topk_divergence` (a method's per-position loss on
full logits, for opd/maths/chunked.py) and `budgeted_loss` (Eq. 11 on a whole batch).
Details: docs/MODULES.md#opdmathsfamily.
"""

from functools import partial

import torch

from opd.maths.divergence import (budgeted_weights, generalized_jsd, global_denominator, kl_divergence, topk_support,
                                  upcast, weighted_sum)
from opd.maths.loss import SUPPORT_NAMES, check_loss


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


def full_support(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, k: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """GKD's and OPSD's full-vocabulary support: both sides' log_softmax over the whole vocabulary, (..., V).
    k is unused (the tables' common signature)."""
    return torch.log_softmax(upcast(student_logits), -1), torch.log_softmax(upcast(teacher_logits), -1)


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


SUPPORTS = {
    "student_tail": topk_support,  # BAS-OPD, Vision-OPD: the student's top-k + one tail bucket, (..., k + 1)
    "teacher": teacher_topk_support,  # RP-OPSD: the teacher's top-k, full softmax, no tail, (..., k)
    "teacher_renorm": partial(teacher_topk_support, renormalize=True),  # OPSD: renormalised over it, (..., k)
    "full": full_support,  # GKD: the whole vocabulary, (..., V)
}
"""Support name (`opd.maths.loss.SUPPORT_NAMES`) -> f(student_logits, teacher_logits, k) = (student_logp, teacher_logp):
the distillation pass looks `LossConfig.support` up here (`opd.methods.objective`), so BAS-OPD's step runs
`divergence.topk_support` itself."""
assert tuple(SUPPORTS) == SUPPORT_NAMES  # the names the settings accept (`opd.maths.loss.check_loss`)


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
    D(SUPPORTS[support](...)). The defaults are BAS-OPD's Eq. 3. The plain reference for opd/maths/chunked.py.

        BAS-OPD, Vision-OPD  support='student_tail', divergence='jsd'
        RP-OPSD              support='teacher',      divergence='bc_rkl'
        OPSD                 support='teacher_renorm', divergence='jsd'
        GKD                  support='full',         divergence='jsd' (alpha = GKD's beta)
    """
    check_loss(support, divergence)
    return token_divergence(*SUPPORTS[support](student_logits, teacher_logits, k), divergence, alpha)


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


def sequence_mean_weights(row_weights: torch.Tensor, mask: torch.Tensor, denominator, dtype: torch.dtype,
                          sample_weights: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """OPSD's sequence mean: z_i m_{i,t} / (T_i |S|), each row's token mean averaged over |S| = `denominator` (the
    global count of selected rows with a token, `opd.maths.family.loss_denominator`); sample weights are not used."""
    lengths = mask.sum(-1).to(dtype).clamp(min=1)  # (n,) T_i
    return budgeted_weights(row_weights.to(dtype) / lengths, mask, denominator, dtype)


def micro_batch_weights(row_weights: torch.Tensor, mask: torch.Tensor, denominator, dtype: torch.dtype,
                        sample_weights: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """verl's micro-batch mean: the micro-batch's own token mean times its rows n_b over |S| = `denominator`, so that
    the micro-batches' parts add up to sum_b (n_b / |S|) (token mean of b); sample weights are not used."""
    rows = float((mask.sum(-1) > 0).sum())  # n_b
    tokens = float(mask.sum())
    return budgeted_weights(row_weights, mask, max(1.0, tokens), dtype) * (rows / max(1, denominator))


def token_sum_weights(row_weights: torch.Tensor, mask: torch.Tensor, denominator, dtype: torch.dtype,
                      sample_weights: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """tinker's token sum (Thinking Machines' on-policy distillation): z_i m_{i,t}, no mean (`denominator` unused);
    with sample weights w_i z_i m_{i,t}, the Horvitz-Thompson sum."""
    return budgeted_weights(row_weights, mask, 1.0, dtype, sample_weights)


AGGREGATION_WEIGHTS = {
    "token-mean": budgeted_weights,  # Eq. 11 (BAS-OPD); with sample weights its Hajek form
    "sequence-mean": sequence_mean_weights,  # OPSD
    "micro-batch": micro_batch_weights,  # verl
    "token-sum": token_sum_weights,  # tinker
}
"""Aggregation name (`opd.maths.loss.AGGREGATIONS`) -> f(row_weights, mask, denominator, dtype, sample_weights), one
micro-batch's per-token weights (n, T); the token mean is Eq. 11's `divergence.budgeted_weights` itself."""


def selected_rows(accelerator, lengths: torch.Tensor, selected: torch.Tensor, sample_weights=None,
                  full_tokens: float | None = None) -> int:  # fmt: skip
    """|S| over all ranks: the selected rows with at least one valid token (one all-reduce, run by every rank), the
    denominator of the sequence-mean and micro-batch aggregations (sample weights and T_C are not used)."""
    rows = int((lengths[selected] > 0).sum()) if selected.numel() else 0
    return int(accelerator.reduce(torch.tensor(rows, device=accelerator.device), "sum").item())


def token_sum_denominator(accelerator, lengths: torch.Tensor, selected: torch.Tensor, sample_weights=None,
                          full_tokens: float | None = None) -> float | int:  # fmt: skip
    """tinker's token sum divides by nothing: its denominator (Eq. 11's token count, no Horvitz-Thompson T_C) only says
    whether S holds a token anywhere."""
    return global_denominator(accelerator, lengths, selected, sample_weights)


DENOMINATORS = {
    "token-mean": global_denominator,  # Eq. 11 (BAS-OPD): the selected tokens over all ranks (Hajek, or T_C for HT)
    "sequence-mean": selected_rows,  # OPSD: |S|
    "micro-batch": selected_rows,  # verl: |S|
    "token-sum": token_sum_denominator,  # tinker
}
"""Aggregation name -> f(accelerator, lengths, selected, sample_weights, full_tokens), the step's global denominator
(one all-reduce, run by every rank); `opd.methods.objective.begin` looks it up."""


def support_logp(student_logits: torch.Tensor, teacher_logits: torch.Tensor, k: int = 100,
                 support: str = "student_tail") -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(student_logp, teacher_logp) on the named support (`SUPPORTS`)."""
    return SUPPORTS[support](student_logits, teacher_logits, k)


def aggregation_weights(aggregation: str, row_weights: torch.Tensor, mask: torch.Tensor, denominator, dtype,
                        sample_weights: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """One micro-batch's per-token weights (n, T) of the named aggregation (`AGGREGATION_WEIGHTS`)."""
    return AGGREGATION_WEIGHTS[aggregation](row_weights, mask, denominator, dtype, sample_weights)


def loss_denominator(accelerator, aggregation: str, lengths: torch.Tensor, selected: torch.Tensor,
                     sample_weights=None, full_tokens: float | None = None) -> float | int:  # fmt: skip
    """The step's denominator of the named aggregation (`DENOMINATORS`)."""
    return DENOMINATORS[aggregation](accelerator, lengths, selected, sample_weights, full_tokens)
