"""Tests of opd/maths/divergence.py and opd/maths/family.py: Eq. 3 (generalized JSD on a top-k support), Eq. 11
(budgeted loss), the family's supports, divergences and aggregations, and their tables by name.

Every equation is compared with an independent computation: explicit Python loops in float64
(math.log / math.exp), the full-vocabulary value at k = V, or torch.autograd.gradcheck.
"""

import math

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from opd.maths.divergence import generalized_jsd, kl_divergence, tail_logp, topk_support
from opd.maths.family import (
    bias_corrected_reverse_kl,
    budgeted_loss,
    check_loss,
    clamped_forward_kl,
    opd_loss,
    teacher_topk_support,
    topk_divergence,
)

F64 = torch.float64


# ----------------------------------------------------------------------------- references (float64)


def _probs(logp_row) -> list[float]:
    return [math.exp(float(v)) for v in logp_row]


def ref_kl(p: list[float], q: list[float]) -> float:
    """KL(P || Q) = sum_v p_v log(p_v / q_v), 0 log 0 = 0, by an explicit Python loop."""
    total = 0.0
    for pv, qv in zip(p, q):
        if pv > 0.0:
            total += pv * (math.log(pv) - math.log(qv))
    return total


def ref_gjsd(s: list[float], t: list[float], alpha: float) -> float:
    """The brief's convention: M = a T + (1 - a) S, D = a KL(T || M) + (1 - a) KL(S || M)."""
    m = [alpha * tv + (1.0 - alpha) * sv for sv, tv in zip(s, t)]
    return alpha * ref_kl(t, m) + (1.0 - alpha) * ref_kl(s, m)


def ref_gjsd_swapped(s: list[float], t: list[float], alpha: float) -> float:
    """The peer bug: the mixture weights swapped, M = (1 - a) T + a S, with the same KL weights."""
    m = [(1.0 - alpha) * tv + alpha * sv for sv, tv in zip(s, t)]
    return alpha * ref_kl(t, m) + (1.0 - alpha) * ref_kl(s, m)


def ref_rows(fn, s_logp: torch.Tensor, t_logp: torch.Tensor, *args) -> torch.Tensor:
    """Applies a per-distribution reference to every row (over the last dim) with a double loop."""
    s2 = s_logp.reshape(-1, s_logp.shape[-1])
    t2 = t_logp.reshape(-1, t_logp.shape[-1])
    out = [fn(_probs(s2[r]), _probs(t2[r]), *args) for r in range(s2.shape[0])]
    return torch.tensor(out, dtype=F64).reshape(s_logp.shape[:-1])


def random_logp(*shape, scale: float = 2.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(*shape, generator=g, dtype=F64) * scale, dim=-1)


# ----------------------------------------------------------------------------- Eq. 3: generalized JSD


@pytest.mark.parametrize("alpha", [0.1, 0.5, 0.9])
def test_generalized_jsd_matches_explicit_double_loop(alpha):
    s = random_logp(3, 4, 7, seed=1)
    t = random_logp(3, 4, 7, seed=2)
    got = generalized_jsd(s, t, alpha)
    want = ref_rows(ref_gjsd, s, t, alpha)
    assert got.dtype == F64
    assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert (want > 1e-3).all()  # a non-trivial comparison


def test_jsd_symmetric_at_half_and_bounded_by_log2():
    s = random_logp(5, 11, seed=3)
    t = random_logp(5, 11, seed=4)
    a = generalized_jsd(s, t, 0.5)
    b = generalized_jsd(t, s, 0.5)
    assert_close(a, b, rtol=1e-12, atol=1e-14)
    assert (a > 0).all() and (a <= math.log(2) + 1e-12).all()


@pytest.mark.parametrize("alpha", [0.1, 0.3, 0.9])
def test_alpha_convention_and_swapped_mixture_bug(alpha):
    """D_alpha(S, T) == D_{1-alpha}(T, S) (swapping the roles of both arguments and alpha), and the
    result differs from the peer bug that swaps only the mixture weights."""
    s = random_logp(6, 9, seed=5)
    t = random_logp(6, 9, seed=6)
    d = generalized_jsd(s, t, alpha)
    assert_close(d, generalized_jsd(t, s, 1.0 - alpha), rtol=1e-10, atol=1e-12)
    swapped = ref_rows(ref_gjsd_swapped, s, t, alpha)
    assert ((d - swapped).abs() > 1e-3).all(), "generalized_jsd uses the swapped mixture weights"
    # Without swapping alpha, the argument order matters away from 0.5.
    assert ((d - generalized_jsd(t, s, alpha)).abs() > 1e-4).all()


def test_endpoints_are_the_kls_and_not_zero():
    s = random_logp(4, 8, seed=7)
    t = random_logp(4, 8, seed=8)
    kl_ts = ref_rows(lambda sp, tp: ref_kl(tp, sp), s, t)  # KL(T || S)
    kl_st = ref_rows(lambda sp, tp: ref_kl(sp, tp), s, t)  # KL(S || T)
    d0 = generalized_jsd(s, t, 0.0)
    d1 = generalized_jsd(s, t, 1.0)
    assert_close(d0, kl_ts, rtol=1e-10, atol=1e-12)
    assert_close(d1, kl_st, rtol=1e-10, atol=1e-12)
    assert (d0 > 1e-2).all() and (d1 > 1e-2).all(), "an endpoint alpha silently gives zero loss"
    assert not torch.allclose(d0, d1)  # the two endpoints are different directions


def test_kl_divergence_matches_loop_and_handles_zero_probability():
    s = random_logp(3, 6, seed=9)
    t = random_logp(3, 6, seed=10)
    assert_close(kl_divergence(s, t), ref_rows(lambda sp, tp: ref_kl(sp, tp), s, t), rtol=1e-10, atol=1e-12)
    # 0 log 0 = 0: an entry with P = 0 contributes nothing even where Q = 0 too.
    p = torch.log(torch.tensor([0.5, 0.5, 0.0], dtype=F64))
    q = torch.log(torch.tensor([0.25, 0.75, 0.0], dtype=F64))
    want = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert_close(kl_divergence(p, q), torch.tensor(want, dtype=F64))


def test_small_alpha_limit_is_kl_teacher_student():
    # Moderate distributions: the first-order error is ~ (alpha / 2) chi^2(T || S) / KL(T || S).
    s = random_logp(4, 9, scale=1.0, seed=11)
    t = random_logp(4, 9, scale=1.0, seed=12)
    eps = 1e-4
    kl_ts = ref_rows(lambda sp, tp: ref_kl(tp, sp), s, t)
    kl_st = ref_rows(lambda sp, tp: ref_kl(sp, tp), s, t)
    assert_close(generalized_jsd(s, t, eps) / eps, kl_ts, rtol=1e-3, atol=0.0)
    assert_close(generalized_jsd(s, t, 1.0 - eps) / eps, kl_st, rtol=1e-3, atol=0.0)
    # The error shrinks linearly with alpha (a limit, not a coincidence at one alpha).
    err_4 = (generalized_jsd(s, t, 1e-4) / 1e-4 - kl_ts).abs()
    err_5 = (generalized_jsd(s, t, 1e-5) / 1e-5 - kl_ts).abs()
    assert (err_5 < 0.2 * err_4).all()
    # ... and the endpoint values are those limits.
    assert_close(generalized_jsd(s, t, 0.0), generalized_jsd(s, t, eps) / eps, rtol=1e-3, atol=0.0)


def test_non_negative_and_zero_iff_equal():
    g = torch.Generator().manual_seed(13)
    for scale in (0.1, 1.0, 8.0):
        s = torch.log_softmax(torch.randn(50, 13, generator=g, dtype=F64) * scale, -1)
        t = torch.log_softmax(torch.randn(50, 13, generator=g, dtype=F64) * scale, -1)
        for alpha in (0.0, 0.1, 0.5, 0.9, 1.0):
            d = generalized_jsd(s, t, alpha)
            assert (d >= 0).all(), (scale, alpha, d.min())
            assert (d > 0).all()
            same = generalized_jsd(s, s.clone(), alpha)
            assert_close(same, torch.zeros_like(same), rtol=0.0, atol=1e-14)


def test_alpha_outside_unit_interval_raises():
    s = random_logp(2, 5, seed=14)
    for bad in (-0.1, 1.1):
        with pytest.raises(ValueError):
            generalized_jsd(s, s, bad)


@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_gradcheck_generalized_jsd_wrt_student_logp(alpha):
    g = torch.Generator().manual_seed(15)
    x = torch.randn(3, 6, generator=g, dtype=F64, requires_grad=True)
    t = torch.log_softmax(torch.randn(3, 6, generator=g, dtype=F64), -1)
    assert torch.autograd.gradcheck(lambda z: generalized_jsd(torch.log_softmax(z, -1), t, alpha), (x,))


def test_gradient_finite_when_student_support_entry_has_zero_probability():
    """kl_divergence implements 0 log 0 = 0; the gradient must respect it too. A support entry with
    P^S = 0 (log-prob -inf) has a zero, not NaN, derivative: d/dx [p log p] -> 0 as p -> 0."""
    x = torch.tensor([[0.3, 1.0, float("-inf"), -0.5]], dtype=F64, requires_grad=True)
    t = torch.log_softmax(torch.tensor([[0.0, 1.0, 2.0, -1.0]], dtype=F64), -1)
    d = generalized_jsd(torch.log_softmax(x, -1), t, 0.5)
    d.sum().backward()
    # Reference: the same distribution with the dead token dropped from the student's logits is the
    # limit x_2 -> -inf; the gradient on the live logits must match it.
    x_lim = torch.tensor([[0.3, 1.0, -60.0, -0.5]], dtype=F64, requires_grad=True)
    generalized_jsd(torch.log_softmax(x_lim, -1), t, 0.5).sum().backward()
    assert torch.isfinite(x.grad).all(), f"NaN gradient: {x.grad}"
    assert_close(x.grad[:, [0, 1, 3]], x_lim.grad[:, [0, 1, 3]], rtol=1e-8, atol=1e-12)


# ----------------------------------------------------------------------------- the top-k support


def full_vocab_gjsd(s_logits: torch.Tensor, t_logits: torch.Tensor, alpha: float) -> torch.Tensor:
    """Eq. 3 over the full vocabulary in float64, with an explicit loop (no top-k, no tail)."""
    s = torch.log_softmax(s_logits.double(), -1)
    t = torch.log_softmax(t_logits.double(), -1)
    return ref_rows(ref_gjsd, s, t, alpha)


@pytest.mark.parametrize("alpha", [0.1, 0.5, 0.9])
def test_topk_support_at_full_vocab_equals_full_vocab_jsd(alpha):
    g = torch.Generator().manual_seed(16)
    s_logits = torch.randn(2, 3, 7, generator=g, dtype=F64) * 2
    t_logits = torch.randn(2, 3, 7, generator=g, dtype=F64) * 2
    want = full_vocab_gjsd(s_logits, t_logits, alpha)
    for k in (7, 100):  # k = V, and k capped at V
        s_logp, t_logp = topk_support(s_logits, t_logits, k=k, tail=True)
        assert s_logp.shape[-1] == 8
        got = generalized_jsd(s_logp, t_logp, alpha).double()
        assert_close(got, want, rtol=1e-5, atol=1e-6)
        # Without the tail, k = V is the same support.
        s_nt, t_nt = topk_support(s_logits, t_logits, k=k, tail=False)
        assert_close(generalized_jsd(s_nt, t_nt, alpha).double(), want, rtol=1e-5, atol=1e-6)


def test_topk_support_tail_makes_each_side_sum_to_one():
    g = torch.Generator().manual_seed(17)
    s_logits = torch.randn(3, 5, 40, generator=g) * 3
    t_logits = torch.randn(3, 5, 40, generator=g) * 3
    for k in (1, 5, 20):
        s_logp, t_logp = topk_support(s_logits, t_logits, k=k, tail=True)
        assert s_logp.shape == (3, 5, k + 1)
        assert_close(s_logp.exp().sum(-1), torch.ones(3, 5), rtol=0, atol=1e-5)
        assert_close(t_logp.exp().sum(-1), torch.ones(3, 5), rtol=0, atol=1e-5)
        # The tail bucket is log of the left-over mass, computed independently in float64.
        s_full = torch.log_softmax(s_logits.double(), -1)
        top = s_full.sort(-1, descending=True).values[..., :k]
        assert_close(s_logp[..., -1].double(), torch.log1p(-top.exp().sum(-1)), rtol=1e-4, atol=1e-5)


def test_topk_support_without_tail_is_renormalised_over_the_top_k():
    """Issue 9 item 7: Eq. 3 takes distributions, so without the tail each side is renormalised over
    the student's top-k ids (as Vision-OPD's and OPSD's renorm_topk), not left as a sub-distribution."""
    g = torch.Generator().manual_seed(17)
    s_logits = torch.randn(3, 5, 40, generator=g, dtype=F64) * 3
    t_logits = torch.randn(3, 5, 40, generator=g, dtype=F64) * 3
    for k in (1, 5, 20):
        s_nt, t_nt = topk_support(s_logits, t_logits, k=k, tail=False)
        assert s_nt.shape == t_nt.shape == (3, 5, k)
        assert_close(s_nt.exp().sum(-1), torch.ones(3, 5, dtype=F64), rtol=0, atol=1e-12)
        assert_close(t_nt.exp().sum(-1), torch.ones(3, 5, dtype=F64), rtol=0, atol=1e-12)
        # P_i = p_i / sum_{j in I} p_j, by a loop over one row
        ids = sorted(range(40), key=lambda v: -float(s_logits[1, 2, v]))[:k]
        t_p = _probs(torch.log_softmax(t_logits[1, 2], -1))
        t_mass = sum(t_p[i] for i in ids)
        assert_close(t_nt[1, 2].exp(), torch.tensor([t_p[i] / t_mass for i in ids], dtype=F64), rtol=1e-12, atol=0)


def test_tail_logp_values():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.3], [0.9, 0.1, 1e-300]], dtype=F64))
    got = tail_logp(logits, torch.tensor([[0, 1], [0, 1]]))
    assert got.shape == (2, 1)
    assert_close(got[0, 0], torch.tensor(math.log(0.3), dtype=F64))
    assert_close(got[1, 0], torch.tensor(math.log(1e-300), dtype=F64))  # exact far below 1 - sum's rounding
    # Every id in the support (k = V): an empty tail, log 0 = -inf.
    assert float(tail_logp(logits, torch.tensor([[2, 0, 1], [0, 1, 2]]))[0, 0]) == float("-inf")


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_tail_is_exact_when_the_top_k_hold_nearly_all_the_mass(dtype):
    """log q = lse(z outside the top-k) - lse(z), not log(1 - sum of the top-k p): with peaked logits
    1 - sum cancels to rounding noise (the old code then clamped it at the dtype's tiny number)."""
    V, k = 30, 3
    z = torch.zeros(2, V, dtype=dtype)
    z[:, :k] = torch.tensor([60.0, 55.0, 50.0], dtype=dtype)
    z[1] *= 0.5  # a second, less peaked row
    s_logp, t_logp = topk_support(z, z.flip(-1), k=k, tail=True)
    for r in range(2):
        top = [float(z[r, i]) for i in range(k)]
        m = max(top)
        lse = m + math.log(sum(math.exp(x - m) for x in top) + (V - k) * math.exp(-m))
        want = math.log(V - k) - lse  # the V - k logits outside the top-k are 0
        assert abs(float(s_logp[r, -1]) - want) < 1e-6 * abs(want)
    # The teacher gathered at the student's ids holds almost nothing there: its tail is ~1.
    assert_close(t_logp[..., -1].exp().double(), torch.ones(2, dtype=F64), rtol=0, atol=1e-6)


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.5, 1.0])
def test_gradient_is_zero_not_nan_where_both_sides_are_empty(alpha):
    """An empty tail bucket (k = V) has log P^S = log P^T = -inf; the mixture log M must not turn its
    zero derivative into NaN (logaddexp(-inf, -inf) alone does). The support is the leaf, as where
    the chunked loss takes dD/ds."""
    inf = torch.full((1, 1), float("-inf"), dtype=F64)
    s_k = torch.log_softmax(torch.tensor([[0.3, -0.4, 1.0]], dtype=F64), -1)
    t_k = torch.log_softmax(torch.tensor([[0.0, 1.0, -1.0]], dtype=F64), -1)
    s = torch.cat([s_k, inf], -1).requires_grad_(True)  # (1, 4) with an empty last entry
    d = generalized_jsd(s, torch.cat([t_k, inf], -1), alpha)
    d.sum().backward()
    ref = s_k.clone().requires_grad_(True)
    d_ref = generalized_jsd(ref, t_k, alpha)
    d_ref.sum().backward()
    assert torch.isfinite(s.grad).all(), s.grad
    assert float(s.grad[0, -1]) == 0.0
    assert_close(s.grad[:, :3], ref.grad, rtol=1e-12, atol=1e-14)
    assert_close(d.detach(), d_ref.detach())


def test_topk_support_gathers_teacher_at_student_ids():
    # V = 6, k = 2. Student's top-2 ids are {4, 1} (in that order); the teacher's own top-2 are {0, 5}.
    s_logits = torch.tensor([[0.0, 2.0, -1.0, 0.5, 3.0, -2.0]], dtype=F64)
    t_logits = torch.tensor([[4.0, -1.0, 0.0, 1.0, -0.5, 3.5]], dtype=F64)
    s_logp, t_logp = topk_support(s_logits, t_logits, k=2, tail=True)
    s_full = torch.log_softmax(s_logits, -1)[0]
    t_full = torch.log_softmax(t_logits, -1)[0]
    ids = [4, 1]
    assert_close(s_logp[0, :2].double(), s_full[ids], rtol=1e-6, atol=1e-6)
    assert_close(t_logp[0, :2].double(), t_full[ids], rtol=1e-6, atol=1e-6)
    t_tail = math.log(1.0 - sum(math.exp(float(t_full[i])) for i in ids))
    assert abs(float(t_logp[0, 2]) - t_tail) < 1e-5
    # Not the teacher's own top-k values.
    teacher_own = t_full.topk(2).values
    assert not torch.allclose(t_logp[0, :2].double(), teacher_own, atol=1e-3)


def test_topk_support_rejects_mismatched_shapes():
    with pytest.raises(ValueError):
        topk_support(torch.zeros(2, 5), torch.zeros(2, 6), k=2)


def test_topk_support_keeps_float64_precision():
    """float32 is an upcast for bf16/fp16 logits; float64 logits must not be rounded to float32."""
    s = torch.randn(2, 9, dtype=F64)
    s_logp, t_logp = topk_support(s, s.clone(), k=4, tail=True)
    assert s_logp.dtype == F64 and t_logp.dtype == F64


def test_gradcheck_topk_support_plus_jsd_wrt_student_logits():
    g = torch.Generator().manual_seed(18)
    x = torch.randn(2, 3, 9, generator=g, dtype=F64, requires_grad=True)
    t = torch.randn(2, 3, 9, generator=g, dtype=F64)

    def f(z):
        s_logp, t_logp = topk_support(z, t, k=4, tail=True)
        return generalized_jsd(s_logp, t_logp, 0.5)

    assert torch.autograd.gradcheck(f, (x,))


def test_topk_support_plus_jsd_gradient_matches_float64_finite_differences():
    """The composed gradient against central differences of an independent float64 reference
    (top-k by sorting, tail by log1p, JSD by a Python loop); tolerance at float32 level."""
    g = torch.Generator().manual_seed(19)
    x = torch.randn(2, 9, generator=g, dtype=F64) * 1.5
    t = torch.randn(2, 9, generator=g, dtype=F64) * 1.5
    k = 4

    def ref(xv: torch.Tensor) -> float:
        total = 0.0
        for r in range(xv.shape[0]):
            s_full = torch.log_softmax(xv[r], -1)
            t_full = torch.log_softmax(t[r], -1)
            ids = sorted(range(xv.shape[1]), key=lambda v: -float(xv[r, v]))[:k]
            sp = [math.exp(float(s_full[i])) for i in ids]
            tp = [math.exp(float(t_full[i])) for i in ids]
            sp.append(1.0 - sum(sp))
            tp.append(1.0 - sum(tp))
            total += ref_gjsd(sp, tp, 0.5)
        return total

    h = 1e-6
    fd = torch.zeros_like(x)
    for r in range(x.shape[0]):
        for v in range(x.shape[1]):
            e = torch.zeros_like(x)
            e[r, v] = h
            fd[r, v] = (ref(x + e) - ref(x - e)) / (2 * h)
    leaf = x.clone().requires_grad_(True)
    s_logp, t_logp = topk_support(leaf, t, k=k, tail=True)
    generalized_jsd(s_logp, t_logp, 0.5).sum().backward()
    assert fd.abs().max() > 1e-2
    assert_close(leaf.grad.double(), fd, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- Eq. 3 aggregate and Eq. 11


def random_batch(n: int, t: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    per_token = torch.rand(n, t, generator=g, dtype=F64) * 2
    lengths = torch.randint(0, t + 1, (n,), generator=g)
    lengths[0] = t  # at least one full row
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    return per_token, mask, g


def ref_budgeted(per_token, selected, mask) -> float:
    num, den = 0.0, 0.0
    for i in range(per_token.shape[0]):
        for t in range(per_token.shape[1]):
            if bool(selected[i]) and bool(mask[i, t]):
                num += float(per_token[i, t])
                den += 1.0
    return num / max(1.0, den)


def test_opd_loss_matches_per_row_loop():
    per_token, mask, _ = random_batch(6, 9, seed=20)
    mask[3] = False  # a row without valid tokens is left out of the mean
    rows = []
    for i in range(6):
        n = int(mask[i].sum())
        if n:
            rows.append(sum(float(per_token[i, t]) for t in range(9) if mask[i, t]) / n)
    want = sum(rows) / len(rows)
    assert_close(opd_loss(per_token, mask), torch.tensor(want, dtype=F64), rtol=1e-12, atol=1e-14)
    # The per-sequence mean differs from the token mean (Eq. 11) when lengths differ.
    assert abs(want - ref_budgeted(per_token, torch.ones(6, dtype=torch.bool), mask)) > 1e-4


def test_opd_loss_all_rows_empty_is_zero():
    per_token = torch.rand(3, 4, dtype=F64)
    out = opd_loss(per_token, torch.zeros(3, 4, dtype=torch.bool))
    assert float(out) == 0.0


def test_budgeted_loss_matches_double_loop_and_gradient():
    per_token, mask, g = random_batch(8, 10, seed=21)
    selected = torch.rand(8, generator=g) < 0.5
    selected[0] = True
    selected[1] = False
    leaf = per_token.clone().requires_grad_(True)
    got = budgeted_loss(leaf, selected, mask)
    assert_close(got, torch.tensor(ref_budgeted(per_token, selected, mask), dtype=F64), rtol=1e-12, atol=1e-14)
    got.backward()
    count = sum(1 for i in range(8) for t in range(10) if selected[i] and mask[i, t])
    want_grad = (selected.unsqueeze(-1) & mask).double() / count
    assert_close(leaf.grad, want_grad)
    # A float 0/1 selection behaves like the boolean one.
    assert_close(budgeted_loss(per_token, selected.double(), mask), got.detach())


def test_budgeted_loss_denominator_clamped_to_one():
    per_token = torch.zeros(2, 3, dtype=F64)
    per_token[0, 0] = 0.25
    mask = torch.zeros(2, 3, dtype=torch.bool)
    mask[0, 0] = True
    # One selected token: sum = 0.25, denominator max(1, 1) = 1.
    assert float(budgeted_loss(per_token, torch.tensor([True, False]), mask)) == 0.25
    # An explicit denominator below one is clamped as well.
    assert float(budgeted_loss(per_token, torch.tensor([True, False]), mask, denominator=0)) == 0.25


def test_budgeted_loss_empty_selection_is_exact_zero_with_zero_gradient():
    per_token, mask, _ = random_batch(4, 5, seed=22)
    per_token[1, 0] = float("nan")
    per_token[2, 1] = float("inf")
    per_token[3, 2] = float("-inf")
    leaf = per_token.clone().requires_grad_(True)
    out = budgeted_loss(leaf, torch.zeros(4, dtype=torch.bool), mask)
    assert out.item() == 0.0
    out.backward()
    assert torch.equal(leaf.grad, torch.zeros_like(per_token))


def test_budgeted_loss_ignores_non_finite_values_outside_selection():
    per_token, mask, _ = random_batch(5, 6, seed=23)
    clean = per_token.clone()
    selected = torch.tensor([True, False, True, False, False])
    mask[2, 4:] = False
    per_token[1] = float("nan")  # an unselected row never computed
    per_token[3, 0] = float("inf")
    per_token[2, 5] = float("nan")  # a padded position of a selected row
    leaf = per_token.clone().requires_grad_(True)
    out = budgeted_loss(leaf, selected, mask)
    assert_close(out, torch.tensor(ref_budgeted(clean, selected, mask), dtype=F64), rtol=1e-12, atol=1e-14)
    out.backward()
    assert torch.isfinite(leaf.grad).all()
    assert (leaf.grad[1] == 0).all() and (leaf.grad[2, 4:] == 0).all()


def test_budgeted_loss_micro_batches_with_global_denominator_sum_to_whole_batch():
    per_token, mask, g = random_batch(9, 7, seed=24)
    selected = torch.rand(9, generator=g) < 0.6
    selected[0] = True
    whole = budgeted_loss(per_token, selected, mask)
    global_count = (selected.unsqueeze(-1) & mask).sum()
    parts = [slice(0, 2), slice(2, 3), slice(3, 7), slice(7, 9)]
    for den in (global_count, int(global_count), float(global_count)):
        total = sum(budgeted_loss(per_token[p], selected[p], mask[p], denominator=den) for p in parts)
        assert_close(total, whole, rtol=1e-12, atol=1e-14)
    # Without the global denominator, micro-batch losses do not add up to Eq. 11.
    local = sum(budgeted_loss(per_token[p], selected[p], mask[p]) for p in parts)
    assert abs(float(local) - float(whole)) > 1e-3


# ----------------------------------------------------------------------------- the seed family: supports, divergences


def ref_bc_rkl(s: list[float], t: list[float]) -> float:
    """RP-OPSD's loss by a loop: sum_v p_s log(p_s / p_t) - p_s + p_t (0 log 0 = 0)."""
    return sum((sv * (math.log(sv) - math.log(tv)) if sv > 0 else 0.0) - sv + tv for sv, tv in zip(s, t))


def test_teacher_topk_support_gathers_both_sides_at_the_teachers_ids():
    # V = 6, k = 2. The teacher's top-2 ids are {0, 5} (in that order); the student's own are {4, 1}.
    s_logits = torch.tensor([[0.0, 2.0, -1.0, 0.5, 3.0, -2.0]], dtype=F64)
    t_logits = torch.tensor([[4.0, -1.0, 0.0, 1.0, -0.5, 3.5]], dtype=F64)
    s_full, t_full = torch.log_softmax(s_logits, -1)[0], torch.log_softmax(t_logits, -1)[0]
    s_logp, t_logp = teacher_topk_support(s_logits, t_logits, k=2)
    assert s_logp.shape == t_logp.shape == (1, 2)
    assert_close(s_logp[0], s_full[[0, 5]])  # full-softmax log-probs, no tail, not renormalised
    assert_close(t_logp[0], t_full[[0, 5]])
    assert float(s_logp.exp().sum()) < 0.25 and float(t_logp.exp().sum()) < 1.0
    s_r, t_r = teacher_topk_support(s_logits, t_logits, k=2, renormalize=True)
    assert_close(s_r[0].exp(), s_full[[0, 5]].exp() / s_full[[0, 5]].exp().sum())
    assert_close(t_r[0].exp(), t_full[[0, 5]].exp() / t_full[[0, 5]].exp().sum())
    with pytest.raises(ValueError):
        teacher_topk_support(torch.zeros(2, 5), torch.zeros(2, 6), k=2)


def test_teacher_topk_support_at_k_equal_v_is_the_full_distribution():
    g = torch.Generator().manual_seed(30)
    s_logits, t_logits = torch.randn(2, 3, 7, generator=g, dtype=F64), torch.randn(2, 3, 7, generator=g, dtype=F64)
    for renormalize in (False, True):
        s_logp, t_logp = teacher_topk_support(s_logits, t_logits, k=100, renormalize=renormalize)
        assert s_logp.dtype == F64 and s_logp.shape == (2, 3, 7)
        assert_close(s_logp.exp().sum(-1), torch.ones(2, 3, dtype=F64))
        # the same entries as the full log-softmax, in the teacher's order
        order = t_logits.argsort(-1, descending=True)
        assert_close(s_logp, torch.log_softmax(s_logits, -1).gather(-1, order))


def test_bias_corrected_reverse_kl_matches_a_loop_on_the_teachers_support():
    g = torch.Generator().manual_seed(31)
    s_logits = torch.randn(3, 4, 30, generator=g, dtype=F64) * 2
    t_logits = torch.randn(3, 4, 30, generator=g, dtype=F64) * 2
    s_logp, t_logp = teacher_topk_support(s_logits, t_logits, k=6)
    got = bias_corrected_reverse_kl(s_logp, t_logp)
    assert got.shape == (3, 4)
    assert_close(got, ref_rows(ref_bc_rkl, s_logp, t_logp), rtol=1e-12, atol=1e-14)
    assert (got > 1e-3).all()
    # non-negative term by term, zero when the sides agree on the support
    assert_close(bias_corrected_reverse_kl(t_logp, t_logp.clone()), torch.zeros(3, 4, dtype=F64), rtol=0, atol=1e-15)
    # on normalised supports the correction sums to zero: the reverse KL
    s_r, t_r = teacher_topk_support(s_logits, t_logits, k=6, renormalize=True)
    assert_close(bias_corrected_reverse_kl(s_r, t_r), kl_divergence(s_r, t_r), rtol=1e-12, atol=1e-14)
    # k = V: KL(p^S || p^T) over the vocabulary, i.e. Eq. 3 at alpha = 1
    s_v, t_v = teacher_topk_support(s_logits, t_logits, k=30)
    kl_st = ref_rows(lambda sp, tp: ref_kl(sp, tp), torch.log_softmax(s_logits, -1), torch.log_softmax(t_logits, -1))
    assert_close(bias_corrected_reverse_kl(s_v, t_v), kl_st, rtol=1e-10, atol=1e-12)


def test_bias_corrected_reverse_kl_is_not_the_plain_reverse_kl_on_a_sub_distribution():
    """Without the correction the truncated reverse KL can be negative; with it every term is >= 0."""
    s_logp = torch.log(torch.tensor([[0.05, 0.05]], dtype=F64))  # the student puts little mass on I_T
    t_logp = torch.log(torch.tensor([[0.6, 0.3]], dtype=F64))
    assert float(kl_divergence(s_logp, t_logp)) < 0
    want = sum(s * math.log(s / t) - s + t for s, t in ((0.05, 0.6), (0.05, 0.3)))
    assert float(bias_corrected_reverse_kl(s_logp, t_logp)) == pytest.approx(want, rel=1e-12) and want > 0


def test_gradcheck_bias_corrected_reverse_kl_through_the_teacher_support():
    g = torch.Generator().manual_seed(32)
    x = torch.randn(2, 3, 9, generator=g, dtype=F64, requires_grad=True)
    t = torch.randn(2, 3, 9, generator=g, dtype=F64)
    for renormalize in (False, True):
        loss = lambda z: bias_corrected_reverse_kl(*teacher_topk_support(z, t, 4, renormalize))  # noqa: E731
        assert torch.autograd.gradcheck(loss, (x,))


def test_topk_divergence_is_each_methods_loss():
    g = torch.Generator().manual_seed(33)
    s_logits, t_logits = torch.randn(5, 25, generator=g, dtype=F64) * 2, torch.randn(5, 25, generator=g, dtype=F64) * 2
    k = 6
    # BAS-OPD / Vision-OPD (the defaults): Eq. 3 on the student's top-k + tail
    want = generalized_jsd(*topk_support(s_logits, t_logits, k), 0.5)
    assert_close(topk_divergence(s_logits, t_logits, k, 0.5), want)
    # OPSD (TRL's generalized_jsd_loss with top_k): the teacher's top-k logits, log_softmax of each side, JSD
    ids = t_logits.topk(k, -1).indices
    s_r, t_r = torch.log_softmax(s_logits.gather(-1, ids), -1), torch.log_softmax(t_logits.gather(-1, ids), -1)
    got = topk_divergence(s_logits, t_logits, k, 0.3, support="teacher_renorm", divergence="jsd")
    assert_close(got, ref_rows(ref_gjsd, s_r, t_r, 0.3), rtol=1e-12, atol=1e-14)
    # RP-OPSD: the teacher's top-k, full softmax, bias-corrected reverse KL
    s_f, t_f = torch.log_softmax(s_logits, -1).gather(-1, ids), torch.log_softmax(t_logits, -1).gather(-1, ids)
    got = topk_divergence(s_logits, t_logits, k, support="teacher", divergence="bc_rkl")
    assert_close(got, ref_rows(ref_bc_rkl, s_f, t_f), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    "support,divergence,message",
    [
        ("teacher_top", "jsd", "unknown support"),
        ("student_tail", "rkl", "unknown divergence"),
        ("teacher", "jsd", "not a distribution"),
    ],
)
def test_bad_support_and_divergence_combinations_are_refused(support, divergence, message):
    z = torch.zeros(2, 8)
    with pytest.raises(ValueError, match=message):
        check_loss(support, divergence)
    with pytest.raises(ValueError, match=message):
        topk_divergence(z, z, 3, support=support, divergence=divergence)
    for ok in (("student_tail", "jsd"), ("student_tail", "bc_rkl"), ("teacher", "bc_rkl"), ("teacher_renorm", "jsd")):
        check_loss(*ok)


# ----------------------------------------------------------------------------- DAPD's clamped forward KL


def _np_clamped_kl(anchor: np.ndarray, student: np.ndarray, temperature: float, clip: float) -> np.ndarray:
    """sum_v min(exp(a_v) (a_v - s_v), clip), a and s the log-softmax at the temperature (numpy, float64)."""

    def log_softmax(x):
        x = x / temperature
        m = x.max(-1, keepdims=True)
        return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))

    a, s = log_softmax(anchor), log_softmax(student)
    return np.minimum(np.exp(a) * (a - s), clip).sum(-1)


@pytest.mark.parametrize("temperature,clip", [(1.1, 0.05), (1.0, 1000.0), (0.7, 0.01)])
def test_clamped_forward_kl_matches_numpy(temperature, clip):
    g = torch.Generator().manual_seed(3)
    anchor = torch.randn(3, 5, 40, generator=g, dtype=torch.float64) * 3
    student = torch.randn(3, 5, 40, generator=g, dtype=torch.float64) * 3
    got = clamped_forward_kl(anchor, student, temperature, clip)
    want = _np_clamped_kl(anchor.numpy(), student.numpy(), temperature, clip)
    assert got.shape == (3, 5)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-14)
    if clip >= 1000:  # no entry reaches the clamp: the plain forward KL at the temperature
        a, s = (torch.log_softmax(x / temperature, -1) for x in (anchor, student))
        torch.testing.assert_close(got, kl_divergence(a, s), rtol=1e-10, atol=1e-12)


def test_clamped_forward_kl_caps_each_entry_and_is_zero_for_equal_sides():
    anchor = torch.tensor([[8.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    student = torch.tensor([[0.0, 8.0, 0.0, 0.0]], dtype=torch.float64)
    loose = clamped_forward_kl(anchor, student, 1.0, 100.0)
    capped = clamped_forward_kl(anchor, student, 1.0, 0.05)
    assert float(loose) > 5 and float(capped) <= 0.05 * 4  # one large entry, capped at 0.05
    x = torch.randn(2, 9, dtype=torch.float64)
    assert torch.allclose(clamped_forward_kl(x, x.clone()), torch.zeros(2, dtype=torch.float64), atol=1e-15)
    with pytest.raises(ValueError, match="positive"):
        clamped_forward_kl(x, x, temperature=0.0)


def test_gradcheck_clamped_forward_kl_wrt_student_logits():
    g = torch.Generator().manual_seed(4)
    anchor = torch.randn(4, 12, generator=g, dtype=torch.float64) * 2
    student = (torch.randn(4, 12, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda s: clamped_forward_kl(anchor, s, 1.1, 0.05), (student,))
    assert torch.autograd.gradcheck(lambda s: clamped_forward_kl(anchor, s, 1.1, 10.0), (student,))


def test_clamped_forward_kl_past_the_clamp_pushes_the_student_off_the_anchors_mode():
    """The documented failure mode: the anchor's mode is clamped (no gradient), the other entries' terms fall as the
    student's mass grows there, so descent lowers the mode's logit and D is negative."""
    anchor = torch.tensor([[3.0, 0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    student = torch.tensor([[1.0, 0.0, 0.0, 0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    d = clamped_forward_kl(anchor, student, 1.1, 0.05)
    d.sum().backward()
    assert float(d) < 0 and float(student.grad[0, 0]) > 0 and (student.grad[0, 1:] < 0).all()
    plain = torch.tensor([[1.0, 0.0, 0.0, 0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    clamped_forward_kl(anchor, plain, 1.1, 1e3).sum().backward()  # without the clamp: toward the mode
    assert float(plain.grad[0, 0]) < 0


def test_the_tables_name_what_the_settings_name_and_the_default_is_bas_opds():
    """The family's tables hold exactly the names the settings accept (`opd.maths.loss.AGGREGATIONS`, `SUPPORTS`), and
    the step's lookups reach BAS-OPD's own functions for the default names."""
    from opd.maths.divergence import budgeted_weights, global_denominator
    from opd.maths.family import AGGREGATION_WEIGHTS, DENOMINATORS, SUPPORTS, aggregation_weights, support_logp
    from opd.maths.loss import AGGREGATIONS, LossConfig

    assert tuple(AGGREGATION_WEIGHTS) == AGGREGATIONS and AGGREGATION_WEIGHTS["token-mean"] is budgeted_weights
    assert tuple(DENOMINATORS) == AGGREGATIONS and DENOMINATORS["token-mean"] is global_denominator
    assert set(SUPPORTS) == {"student_tail", "teacher", "teacher_renorm", "full"}
    assert SUPPORTS["student_tail"] is topk_support
    assert LossConfig().aggregation == "token-mean"
    g = torch.Generator().manual_seed(0)
    s_logits, t_logits = torch.randn(2, 3, 9, generator=g, dtype=F64), torch.randn(2, 3, 9, generator=g, dtype=F64)
    for got, want in zip(support_logp(s_logits, t_logits, 4), topk_support(s_logits, t_logits, 4, tail=True)):
        assert torch.equal(got, want)
    for got, want in zip(support_logp(s_logits, t_logits, 4, "teacher_renorm"),
                         teacher_topk_support(s_logits, t_logits, 4, renormalize=True)):  # fmt: skip
        assert torch.equal(got, want)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    z = torch.tensor([1.0, 0.5], dtype=F64)
    assert torch.equal(aggregation_weights("token-mean", z, mask, 7, F64), budgeted_weights(z, mask, 7, F64))
    assert torch.equal(aggregation_weights("token-sum", z, mask, 7, F64), z[:, None] * mask)
