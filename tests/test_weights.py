"""Tests of opd/weights.py: OPD-V's trust region and Vision-OPD's truncated importance ratio, each
against an explicit float64 loop (math.exp / max / min), and detached."""

import math

import pytest
import torch
from torch.testing import assert_close

from opd.weights import importance_ratio, trust_region

F64 = torch.float64


def loop(fn, *tensors) -> torch.Tensor:
    rows = zip(*(t.reshape(-1).tolist() for t in tensors))
    return torch.tensor([fn(*r) for r in rows], dtype=F64).reshape(tensors[0].shape)


def test_trust_region_is_the_positive_part_of_the_teachers_margin():
    g = torch.Generator().manual_seed(0)
    pos = torch.log_softmax(torch.randn(4, 7, 20, generator=g, dtype=F64), -1)[..., 0]  # (4, 7) log pi_T+(y_t)
    neg = torch.log_softmax(torch.randn(4, 7, 20, generator=g, dtype=F64), -1)[..., 0]  # (4, 7) log pi_T-(y_t)
    w = trust_region(pos, neg)
    assert w.shape == (4, 7)
    assert_close(w, loop(lambda a, b: max(0.0, a - b), pos, neg), rtol=0, atol=0)
    assert (w == 0).any() and (w > 0).any()  # both sides of the hinge are exercised
    assert_close(trust_region(pos, pos.clone()), torch.zeros_like(pos))  # no visual evidence, no loss


def test_trust_region_is_detached():
    pos = torch.tensor([-0.1, -2.0, -0.5], requires_grad=True)
    neg = torch.tensor([-1.0, -0.3, -0.5], requires_grad=True)
    w = trust_region(pos, neg)
    assert not w.requires_grad
    assert w.tolist() == pytest.approx([0.9, 0.0, 0.0])


@pytest.mark.parametrize("clip", [2.0, 1.5])
def test_importance_ratio_is_min_of_exp_and_clip(clip):
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(50, generator=g, dtype=F64) * 3
    logp = old + torch.randn(50, generator=g, dtype=F64)  # ratios on both sides of 1 and of the clip
    rho = importance_ratio(logp, old, clip)
    assert_close(rho, loop(lambda a, b: min(math.exp(a - b), clip), logp, old), rtol=1e-14, atol=0)
    assert (rho == clip).any() and (rho < 1).any()


def test_importance_ratio_is_one_on_policy_and_detached():
    logp = torch.tensor([-0.2, -3.0, -7.5], dtype=F64, requires_grad=True)
    rho = importance_ratio(logp, logp.detach().clone())
    assert not rho.requires_grad
    assert rho.tolist() == [1.0, 1.0, 1.0]
    # the scaled loss's gradient flows through the loss only, never through the ratio (as in Vision-OPD)
    loss = (importance_ratio(logp, logp.detach() - 0.1) * logp).sum()
    (grad,) = torch.autograd.grad(loss, logp)
    assert_close(grad, torch.full_like(logp, math.exp(0.1)))


def test_importance_ratio_log_ratio_is_clamped_at_minus_20():
    """As Vision-OPD: the log-ratio is clamped to [-20, 20] before exp, so a collapsed token keeps a
    ratio of exp(-20), not 0."""
    rho = importance_ratio(torch.tensor([-60.0], dtype=F64), torch.tensor([-1.0], dtype=F64), clip=2.0)
    assert float(rho) == pytest.approx(math.exp(-20.0), rel=1e-12)
