"""Tests of the utility labels (Eq. 7-9, opd/maths/divergence.py) and of the selector loss they train (recency weights
A.3, Eq. 10, 12: opd/selection/selectors.py).

References are hand-worked numbers (plain Python math) and explicit float64 loops.
"""

import math

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from opd.maths.divergence import labels_from_terms, sample_utility, teacher_confidence, token_jsd, topk_overlap, utility_terms
from opd.selection.selectors import pairwise_rank_loss, recency_weights, selector_loss

F64 = torch.float64
LN2 = math.log(2.0)


@torch.no_grad()
def utility_labels(student_logits, teacher_logits, mask, k=100, use_overlap=True, use_confidence=True):
    """Eq. 7-9 composed as training composes them (`opd.methods.objective.distill`): one u_i per row of (N, T, V)."""
    terms = torch.stack(utility_terms(student_logits.detach(), teacher_logits.detach(), k), -1)  # (N, T, 3)
    return labels_from_terms(terms, mask, use_overlap, use_confidence)


def H(ps) -> float:
    """Shannon entropy in nats."""
    return -sum(p * math.log(p) for p in ps if p > 0)


def jsd(p, q) -> float:
    m = [(a + b) / 2 for a, b in zip(p, q)]
    kl = lambda x, y: sum(a * math.log(a / b) for a, b in zip(x, y) if a > 0)  # noqa: E731
    return 0.5 * kl(p, m) + 0.5 * kl(q, m)


# ----------------------------------------------------------------------------- a hand-worked example


def hand_example():
    """N = 1, T = 2, V = 4, k = 2.

    Position 0: student logits [ln 3, 0, -5, -6] -> top-2 ids {0, 1}, P^S = [3/4, 1/4].
                teacher logits [0, ln 3, 10, -10] -> at ids {0, 1}: P^T = [1/4, 3/4];
                teacher's own top-2 = {2, 1}, so o = |{0,1} & {2,1}| / 2 = 1/2.
                d = JSD([3/4,1/4], [1/4,3/4]) = ln 2 - H(1/4, 3/4) ~= 0.1308 (M = [1/2, 1/2]).
                c = 1 - H(1/4, 3/4) / ln 2 ~= 1 - 0.5623 / 0.6931 ~= 0.1887.
    Position 1: student logits [-9, -8, 0, ln 4] -> top-2 ids {3, 2}, P^S over (2, 3) = [1/5, 4/5].
                teacher logits [-9, -8, 0, ln 9] -> P^T over (2, 3) = [1/10, 9/10]; own top-2 {3, 2}: o = 1.
                d = JSD([.2,.8], [.1,.9]) ~= 0.00997;  c = 1 - H(.1, .9) / ln 2 ~= 0.5310.
    """
    s = torch.tensor([[[math.log(3), 0.0, -5.0, -6.0], [-9.0, -8.0, 0.0, math.log(4)]]])
    t = torch.tensor([[[0.0, math.log(3), 10.0, -10.0], [-9.0, -8.0, 0.0, math.log(9)]]])
    d0 = LN2 - H([0.25, 0.75])
    assert abs(d0 - jsd([0.75, 0.25], [0.25, 0.75])) < 1e-15
    d1 = jsd([0.2, 0.8], [0.1, 0.9])
    o0, o1 = 0.5, 1.0
    c0 = 1 - H([0.25, 0.75]) / LN2
    c1 = 1 - H([0.1, 0.9]) / LN2
    return s, t, (d0, d1), (o0, o1), (c0, c1)


def test_hand_worked_terms():
    s, t, (d0, d1), (o0, o1), (c0, c1) = hand_example()
    assert abs(d0 - 0.130812) < 1e-6 and abs(c0 - 0.188722) < 1e-6
    assert abs(d1 - 0.009966) < 1e-6 and abs(c1 - 0.531004) < 1e-6
    d, o, c = utility_terms(s, t, k=2)
    assert_close(d, torch.tensor([[d0, d1]]), rtol=1e-5, atol=1e-6)
    assert_close(o, torch.tensor([[o0, o1]]), rtol=0, atol=0)
    assert_close(c, torch.tensor([[c0, c1]]), rtol=1e-5, atol=1e-6)


def test_hand_worked_utility_labels():
    s, t, (d0, d1), (o0, o1), (c0, c1) = hand_example()
    both = torch.tensor([[True, True]])
    first = torch.tensor([[True, False]])
    u_both = (d0 * o0 * c0 + d1 * o1 * c1) / 2
    assert_close(utility_labels(s, t, both, k=2), torch.tensor([u_both]), rtol=1e-5, atol=1e-7)
    assert_close(utility_labels(s, t, first, k=2), torch.tensor([d0 * o0 * c0]), rtol=1e-5, atol=1e-7)
    # Ablations: o = 1, c = 1, both.
    assert_close(utility_labels(s, t, both, k=2, use_overlap=False), torch.tensor([(d0 * c0 + d1 * c1) / 2]), rtol=1e-5, atol=1e-7)
    assert_close(utility_labels(s, t, both, k=2, use_confidence=False), torch.tensor([(d0 * o0 + d1 * o1) / 2]), rtol=1e-5, atol=1e-7)
    assert_close(
        utility_labels(s, t, both, k=2, use_overlap=False, use_confidence=False), torch.tensor([(d0 + d1) / 2]), rtol=1e-5, atol=1e-7
    )


# ----------------------------------------------------------------------------- random cases vs float64 loops


def ref_terms(s_logits: torch.Tensor, t_logits: torch.Tensor, k: int):
    """Eq. 7-8 and the overlap by explicit loops: numpy argsort for top-k, Python sets, math.log."""
    n, T, V = s_logits.shape
    d = np.zeros((n, T))
    o = np.zeros((n, T))
    c = np.zeros((n, T))
    sl = s_logits.double().numpy()
    tl = t_logits.double().numpy()
    for i in range(n):
        for t in range(T):
            s_ids = list(np.argsort(-sl[i, t], kind="stable")[:k])
            t_ids = set(np.argsort(-tl[i, t], kind="stable")[:k].tolist())
            ps = np.exp(sl[i, t, s_ids] - sl[i, t, s_ids].max())
            ps = ps / ps.sum()
            pt = np.exp(tl[i, t, s_ids] - tl[i, t, s_ids].max())
            pt = pt / pt.sum()
            d[i, t] = jsd(list(ps), list(pt))
            o[i, t] = len(set(int(v) for v in s_ids) & t_ids) / k
            c[i, t] = 1 - H(list(pt)) / math.log(k)
    return torch.tensor(d), torch.tensor(o), torch.tensor(c)


def random_logits(n, T, V, seed, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, T, V, generator=g) * scale, torch.randn(n, T, V, generator=g) * scale


@pytest.mark.parametrize("k", [2, 5, 11])
def test_utility_terms_match_loops(k):
    s, t = random_logits(3, 4, 11, seed=k)
    d, o, c = utility_terms(s, t, k=k)
    rd, ro, rc = ref_terms(s, t, k)
    assert_close(d.double(), rd, rtol=1e-4, atol=1e-6)
    assert_close(o.double(), ro, rtol=0, atol=1e-7)
    assert_close(c.double(), rc, rtol=1e-4, atol=1e-6)
    if k < 11:
        assert (ro < 1).any() and (ro > 0).any()  # overlap actually varies
    else:
        assert (ro == 1).all()


def test_utility_terms_k_capped_at_vocab_and_k_below_two_raises():
    s, t = random_logits(2, 3, 6, seed=30)
    for a, b in zip(utility_terms(s, t, k=100), ref_terms(s, t, 6)):
        assert_close(a.double(), b, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError):
        utility_terms(s, t, k=1)
    with pytest.raises(ValueError):
        utility_terms(s[..., :1], t[..., :1], k=100)


def test_topk_overlap_matches_python_sets():
    g = torch.Generator().manual_seed(31)
    V, k = 30, 7
    s_ids = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(40)]).reshape(5, 8, k)
    t_ids = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(40)]).reshape(5, 8, k)
    t_ids[0, 0] = s_ids[0, 0].flip(0)  # identical sets in another order
    t_ids[0, 1] = torch.tensor([v for v in range(V) if v not in set(s_ids[0, 1].tolist())][:k])  # disjoint
    got = topk_overlap(s_ids, t_ids)
    want = torch.tensor(
        [[len(set(s_ids[i, j].tolist()) & set(t_ids[i, j].tolist())) / k for j in range(8)] for i in range(5)]
    )
    assert_close(got.double(), want.double(), rtol=0, atol=1e-7)
    assert got[0, 0] == 1.0 and got[0, 1] == 0.0


def test_token_jsd_and_confidence_formulas():
    g = torch.Generator().manual_seed(32)
    s = torch.log_softmax(torch.randn(6, 5, generator=g, dtype=F64), -1)
    t = torch.log_softmax(torch.randn(6, 5, generator=g, dtype=F64) * 3, -1)
    want_d = [jsd(list(s[i].exp().tolist()), list(t[i].exp().tolist())) for i in range(6)]
    want_c = [1 - H(t[i].exp().tolist()) / math.log(5) for i in range(6)]
    assert_close(token_jsd(s, t), torch.tensor(want_d, dtype=F64), rtol=1e-10, atol=1e-12)
    assert_close(teacher_confidence(t), torch.tensor(want_c, dtype=F64), rtol=1e-10, atol=1e-12)
    # Limits: uniform teacher -> c = 0, one-hot teacher -> c = 1.
    uni = torch.full((1, 5), -math.log(5), dtype=F64)
    one_hot = torch.log(torch.tensor([[1.0, 0, 0, 0, 0]], dtype=F64))
    assert_close(teacher_confidence(uni), torch.zeros(1, dtype=F64), rtol=0, atol=1e-12)
    assert_close(teacher_confidence(one_hot), torch.ones(1, dtype=F64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("use_overlap", [True, False])
@pytest.mark.parametrize("use_confidence", [True, False])
def test_utility_labels_random_vs_manual_product(use_overlap, use_confidence):
    s, t = random_logits(4, 6, 9, seed=33)
    mask = torch.tensor([[1] * 6, [1] * 3 + [0] * 3, [1] + [0] * 5, [0] * 6], dtype=torch.bool)
    d, o, c = ref_terms(s, t, 4)
    if not use_overlap:
        o = torch.ones_like(o)
    if not use_confidence:
        c = torch.ones_like(c)
    want = []
    for i in range(4):
        vals = [float(d[i, j] * o[i, j] * c[i, j]) for j in range(6) if mask[i, j]]
        want.append(sum(vals) / len(vals) if vals else 0.0)
    got = utility_labels(s, t, mask, k=4, use_overlap=use_overlap, use_confidence=use_confidence)
    assert_close(got.double(), torch.tensor(want, dtype=F64), rtol=1e-4, atol=1e-6)
    assert got[3] == 0.0  # an all-masked row


def test_utility_labels_ignore_padded_positions():
    s, t = random_logits(3, 5, 8, seed=34)
    lengths = [5, 2, 3]
    mask = torch.arange(5).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    base = utility_labels(s, t, mask, k=3)
    s2, t2 = s.clone(), t.clone()
    g = torch.Generator().manual_seed(35)
    s2[~mask] = torch.randn(int((~mask).sum()), 8, generator=g) * 50  # garbage at padding
    t2[~mask] = torch.randn(int((~mask).sum()), 8, generator=g) * 50
    assert torch.equal(utility_labels(s2, t2, mask, k=3), base)
    # Each row equals the label of its own unpadded prefix.
    for i, n in enumerate(lengths):
        alone = utility_labels(s[i : i + 1, :n], t[i : i + 1, :n], torch.ones(1, n, dtype=torch.bool), k=3)
        assert_close(base[i : i + 1], alone, rtol=1e-6, atol=1e-7)


def test_utility_labels_are_detached_and_nonnegative():
    s, t = random_logits(2, 3, 7, seed=36)
    s.requires_grad_(True)
    u = utility_labels(s, t, torch.ones(2, 3, dtype=torch.bool), k=3)
    assert not u.requires_grad
    assert (u >= 0).all() and (u > 0).any()


def test_sample_utility_formula():
    g = torch.Generator().manual_seed(37)
    d, o, c = (torch.rand(3, 4, generator=g, dtype=F64) for _ in range(3))
    mask = torch.tensor([[1, 1, 0, 1], [0, 0, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    want = []
    for i in range(3):
        vals = [float(d[i, j] * o[i, j] * c[i, j]) for j in range(4) if mask[i, j]]
        want.append(sum(vals) / len(vals) if vals else 0.0)
    assert_close(sample_utility(d, o, c, mask), torch.tensor(want, dtype=F64), rtol=1e-12, atol=1e-14)


# ----------------------------------------------------------------------------- recency weights (A.3)


def test_recency_weights_exact_values():
    step, h = 30, 10.0
    collected = torch.tensor([30, 20, 10, 27, 0])
    got = recency_weights(collected, step, h)
    want = torch.tensor([1.0, 0.5, 0.25, 2 ** (-3 / 10), 2 ** (-3.0)])
    assert_close(got, want, rtol=1e-6, atol=0)
    assert got[0] == 1.0 and got[1] == 0.5 and got[2] == 0.25
    # Another half-life.
    assert_close(recency_weights(torch.tensor([4, 0]), 8, half_life=4.0), torch.tensor([0.5, 0.25]))


# ----------------------------------------------------------------------------- Eq. 12 and Eq. 10


def ref_huber(x: float, delta: float = 1.0) -> float:
    return 0.5 * x * x if abs(x) <= delta else delta * (abs(x) - 0.5 * delta)


def ref_weighted_huber(pred, target, w) -> float:
    num = sum(float(w[i]) * ref_huber(float(pred[i] - target[i])) for i in range(len(pred)))
    return num / sum(float(v) for v in w)


def ref_rank(pred, target, w, min_gap=1e-6) -> float:
    num, den = 0.0, 0.0
    n = len(pred)
    for i in range(n):
        for j in range(i + 1, n):
            du = float(target[i]) - float(target[j])
            if abs(du) > min_gap:
                sgn = 1.0 if du > 0 else -1.0
                x = -sgn * (float(pred[i]) - float(pred[j]))
                sp = math.log1p(math.exp(x)) if x < 30 else x
                ww = float(w[i]) * float(w[j])
                num += ww * sp
                den += ww
    return num / den if den > 0 else 0.0


def test_weighted_huber_piecewise():
    from opd.selection.selectors import weighted_huber

    pred = torch.tensor([0.0, 0.5, -2.0, 3.0, 1.0, -0.2], dtype=F64)
    target = torch.tensor([0.3, -0.5, 0.0, 0.5, 1.0, 0.9], dtype=F64)  # errors -0.3, 1.0, -2, 2.5, 0, -1.1
    w = torch.tensor([1.0, 0.5, 0.25, 2.0, 1.0, 0.7], dtype=F64)
    want = ref_weighted_huber(pred, target, w)
    # By hand: 0.5*0.09*1 + 0.5*1*0.5 + 1.5*0.25 + 2.0*2 + 0 + 0.6*0.7 = 5.09, over sum w = 5.45
    assert abs(want - 5.09 / 5.45) < 1e-12
    assert_close(weighted_huber(pred, target, w), torch.tensor(want, dtype=F64), rtol=1e-12, atol=1e-14)


def test_pairwise_rank_loss_matches_double_loop():
    g = torch.Generator().manual_seed(38)
    pred = torch.randn(9, generator=g, dtype=F64)
    target = torch.rand(9, generator=g, dtype=F64)
    w = torch.rand(9, generator=g, dtype=F64) + 0.1
    got = pairwise_rank_loss(pred, target, w)
    assert_close(got, torch.tensor(ref_rank(pred, target, w), dtype=F64), rtol=1e-12, atol=1e-14)
    # Direction: predictions ordered like the targets cost less than reversed ones.
    good = pairwise_rank_loss(target * 5, target, w)
    bad = pairwise_rank_loss(-target * 5, target, w)
    assert good < math.log(2) < bad


def test_pairwise_rank_loss_excludes_pairs_below_min_gap():
    pred = torch.tensor([0.3, -1.0, 2.0, 0.7, -0.4], dtype=F64)
    # Items 0, 1 tie exactly; 2, 3 differ by 5e-7 (< 1e-6); 4 differs from all by > 1e-6.
    target = torch.tensor([0.5, 0.5, 0.2, 0.2 + 5e-7, 0.9], dtype=F64)
    w = torch.tensor([1.0, 0.8, 0.6, 0.4, 0.3], dtype=F64)
    got = pairwise_rank_loss(pred, target, w)
    assert_close(got, torch.tensor(ref_rank(pred, target, w), dtype=F64), rtol=1e-12, atol=1e-14)
    # Explicitly: the qualifying pairs are all but (0, 1) and (2, 3).
    pairs = [(0, 2), (0, 3), (0, 4), (1, 2), (1, 3), (1, 4), (2, 4), (3, 4)]
    num = den = 0.0
    for i, j in pairs:
        sgn = math.copysign(1.0, float(target[i] - target[j]))
        num += float(w[i] * w[j]) * math.log1p(math.exp(-sgn * float(pred[i] - pred[j])))
        den += float(w[i] * w[j])
    assert abs(float(got) - num / den) < 1e-12
    # A custom min_gap that also drops the pairs with item 4 vs 0 / 1 (gap 0.4).
    assert_close(pairwise_rank_loss(pred, target, w, min_gap=0.5), torch.tensor(ref_rank(pred, target, w, 0.5), dtype=F64))


def test_pairwise_rank_loss_no_pair_gives_zero_and_zero_gradient():
    pred = torch.tensor([0.3, -1.0, 2.0], dtype=F64, requires_grad=True)
    target = torch.tensor([0.5, 0.5, 0.5 + 1e-7], dtype=F64)
    out = pairwise_rank_loss(pred, target, torch.ones(3, dtype=F64))
    assert out.item() == 0.0
    out.backward()
    assert torch.equal(pred.grad, torch.zeros(3, dtype=F64))
    # A single item has no pair either.
    assert pairwise_rank_loss(pred[:1], target[:1], torch.ones(1, dtype=F64)).item() == 0.0


def test_selector_loss_is_huber_plus_weighted_rank():
    g = torch.Generator().manual_seed(39)
    pred = torch.randn(12, generator=g, dtype=F64) * 2
    target = torch.rand(12, generator=g, dtype=F64)
    target[3] = target[4]  # a tie
    w = recency_weights(torch.randint(0, 20, (12,), generator=g), 20, 10.0).double()
    huber = ref_weighted_huber(pred, target, w)
    rank = ref_rank(pred, target, w)
    assert rank > 0 and huber > 0
    assert_close(selector_loss(pred, target, w), torch.tensor(huber + 0.2 * rank, dtype=F64), rtol=1e-12, atol=1e-14)
    assert_close(selector_loss(pred, target, w, rank_weight=0.5), torch.tensor(huber + 0.5 * rank, dtype=F64), rtol=1e-12, atol=1e-14)
    assert_close(selector_loss(pred, target, w, rank_weight=0.0), torch.tensor(huber, dtype=F64), rtol=1e-12, atol=1e-14)


def test_selector_loss_gradcheck():
    g = torch.Generator().manual_seed(40)
    pred = (torch.randn(7, generator=g, dtype=F64) * 2).requires_grad_(True)
    target = torch.rand(7, generator=g, dtype=F64)
    w = torch.rand(7, generator=g, dtype=F64) + 0.1
    assert torch.autograd.gradcheck(lambda p: selector_loss(p, target, w), (pred,))
