"""The chunked hidden-state path (opd/chunked.py) against the plain path on full logits, and the
length-grouped micro-batch plan (opd/distill.py)."""

import pytest
import torch
from ddp_worker import fixed_rollouts
from test_training import perturb, small_config

from opd.chunked import topk_jsd_from_hidden
from opd.distill import plan_micro_batches
from opd.divergence import generalized_jsd, topk_support
from opd.utility import utility_terms
from train import Run

F64 = torch.float64


def inputs(P=11, H=6, V=40, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    h_s = torch.randn(P, H, generator=g, dtype=dtype).requires_grad_(True)
    w_s = torch.randn(V, H, generator=g, dtype=dtype).requires_grad_(True)
    h_t = torch.randn(P, H, generator=g, dtype=dtype)
    w_t = torch.randn(V, H, generator=g, dtype=dtype)
    return h_s, w_s, h_t, w_t


@pytest.mark.parametrize("chunk", [1, 4, 11, 64])
@pytest.mark.parametrize("k,alpha", [(5, 0.5), (40, 0.5), (7, 0.2)])
def test_values_and_gradients_equal_the_plain_path(chunk, k, alpha):
    h_s, w_s, h_t, w_t = inputs()
    weights = torch.linspace(0.5, 2.0, h_s.shape[0], dtype=F64)  # a non-uniform upstream gradient
    d, terms = topk_jsd_from_hidden(h_s, w_s, h_t, w_t, k, alpha, chunk)
    (d * weights).sum().backward()
    grads = h_s.grad.clone(), w_s.grad.clone()
    h_s.grad = w_s.grad = None
    z_s, z_t = h_s @ w_s.T, h_t @ w_t.T  # (P, V) the plain path's logits
    d_plain = generalized_jsd(*topk_support(z_s, z_t, k, tail=True), alpha)
    (d_plain * weights).sum().backward()
    torch.testing.assert_close(d, d_plain.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grads[0], h_s.grad, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(grads[1], w_s.grad, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(terms, torch.stack(utility_terms(z_s.detach(), z_t, k), -1), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("k", [3, 9])  # k = V = 9 covers the empty tail
def test_gradcheck(k):
    h_s, w_s, h_t, w_t = inputs(P=5, H=4, V=9, seed=1)
    assert torch.autograd.gradcheck(lambda a, b: topk_jsd_from_hidden(a, b, h_t, w_t, k, 0.5, 2)[0], (h_s, w_s))


def test_float32_matches_a_float64_reference():
    h_s, w_s, h_t, w_t = inputs(dtype=torch.float32, seed=2)
    d, _ = topk_jsd_from_hidden(h_s, w_s, h_t, w_t, 10, 0.5, 3)
    d.sum().backward()
    ref = [t.detach().double().requires_grad_(i < 2) for i, t in enumerate((h_s, w_s, h_t, w_t))]
    d64 = generalized_jsd(*topk_support(ref[0] @ ref[1].T, ref[2] @ ref[3].T, 10), 0.5)
    d64.sum().backward()
    torch.testing.assert_close(d.double(), d64.detach(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(h_s.grad.double(), ref[0].grad, rtol=1e-3, atol=1e-5)


def test_no_positions_gives_empty_outputs():
    h_s, w_s, h_t, w_t = inputs()
    d, terms = topk_jsd_from_hidden(h_s[:0], w_s, h_t[:0], w_t, 5)
    assert d.shape == (0,) and terms.shape == (0, 3)


def test_plan_groups_by_length_under_both_limits():
    lengths = torch.tensor([5, 30, 7, 12, 29, 6, 100, 11])
    plan = plan_micro_batches(lengths, max_rows=3, max_tokens=60)
    assert sorted(torch.cat(plan).tolist()) == list(range(8))  # every row exactly once
    for group in plan:
        assert len(group) <= 3
        assert len(group) == 1 or len(group) * int(lengths[group].max()) <= 60
    assert plan[0].tolist() == [6]  # 100 tokens > 60: alone
    assert [lengths[g].tolist() for g in plan] == [[100], [30, 29], [12, 11, 7], [6, 5]]
    assert [g.tolist() for g in plan_micro_batches(lengths, max_rows=4)] == [[6, 1, 4, 3], [7, 2, 5, 0]]


def test_training_step_is_the_same_on_both_paths(tmp_path, tiny):
    rows = []
    for chunk in (0, 5):
        run = Run(small_config(tmp_path / f"c{chunk}", policy="full", rho=1.0, loss_chunk=chunk, micro_batch_tokens=150))
        perturb(run.teacher.model)
        rows.append(run.step(0, fixed_rollouts(run, 0, skew=False)))
    assert rows[0]["loss"] > 1e-3
    assert rows[0]["loss"] == pytest.approx(rows[1]["loss"], rel=1e-5)
    assert rows[0]["grad_norm"] == pytest.approx(rows[1]["grad_norm"], rel=1e-4)
    assert rows[0]["utility_mean"] == pytest.approx(rows[1]["utility_mean"], rel=1e-4)
    assert rows[1]["teacher_padded_tokens"] >= rows[1]["teacher_tokens"] > 0
