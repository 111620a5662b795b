"""opd/maths/chunked.py's loss functions against `topk_support` + `generalized_jsd` and, for every support and
divergence of the seed family, `topk_divergence` on full logits (values, gradients, gradcheck, float32,
the importance ratio, memory, a training step), and the length-grouped micro-batch plan (opd/methods/objective.py)."""

import pytest
import torch
from test_training import perturb, small_config

from opd.maths.chunked import (
    budgeted_loss_from_hidden,
    clamped_kl_from_hidden,
    sampled_logp_from_hidden,
    topk_divergence_from_logits,
    topk_jsd_from_logits,
    weighted_logp_from_hidden,
)
from opd.maths.divergence import generalized_jsd, topk_support, utility_terms
from opd.maths.family import clamped_forward_kl, topk_divergence
from opd.run import Run
from opd.methods.objective import plan_micro_batches
from opd.models.ema_teacher import Stopwatch
from opd.engine.synthetic import fixed_rollouts
from opd.maths.weights import TokenWeight, importance_ratio, teacher_gate, token_weight

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
def test_hidden_path_equals_the_plain_formula(chunk, k, alpha):
    h_s, w_s, h_t, w_t = inputs()
    weights = torch.linspace(0.5, 2.0, h_s.shape[0], dtype=F64)  # per-position weights of Eq. 11
    loss, d, terms = budgeted_loss_from_hidden(h_s, w_s, h_t, w_t, weights, k, alpha, chunk)
    loss.backward()
    grads = h_s.grad.clone(), w_s.grad.clone()
    h_s.grad = w_s.grad = None
    z_s, z_t = h_s @ w_s.T, h_t @ w_t.T  # (P, V) full logits
    d_plain = generalized_jsd(*topk_support(z_s, z_t, k, tail=True), alpha)
    (d_plain * weights).sum().backward()
    torch.testing.assert_close(loss, (d_plain * weights).sum().detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(d, d_plain.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grads[0], h_s.grad, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(grads[1], w_s.grad, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(terms, torch.stack(utility_terms(z_s.detach(), z_t, k), -1), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("k,alpha", [(5, 0.5), (40, 0.5), (7, 0.8)])
def test_logits_path_equals_the_plain_formula(k, alpha):
    g = torch.Generator().manual_seed(3)
    z_s = torch.randn(3, 4, 40, generator=g, dtype=F64).requires_grad_(True)
    z_t = torch.randn(3, 4, 40, generator=g, dtype=F64)
    upstream = torch.rand(3, 4, generator=g, dtype=F64)
    d, terms = topk_jsd_from_logits(z_s, z_t, k, alpha)
    (d * upstream).sum().backward()
    grad = z_s.grad.clone()
    z_s.grad = None
    d_plain = generalized_jsd(*topk_support(z_s, z_t, k, tail=True), alpha)
    (d_plain * upstream).sum().backward()
    torch.testing.assert_close(d, d_plain.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, z_s.grad, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(terms, torch.stack(utility_terms(z_s.detach(), z_t, k), -1), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("k", [3, 9])  # k = V = 9 covers the empty tail
def test_gradcheck(k, alpha):
    h_s, w_s, h_t, w_t = inputs(P=5, H=4, V=9, seed=1)
    weights = torch.tensor([0.3, 1.0, 0.0, 2.0, 0.7], dtype=F64)
    loss = lambda a, b: budgeted_loss_from_hidden(a, b, h_t, w_t, weights, k, alpha, 2)[0]  # noqa: E731
    assert torch.autograd.gradcheck(loss, (h_s, w_s))
    z_t = h_t @ w_t.T
    z = (h_s @ w_s.T).detach().requires_grad_()
    assert torch.autograd.gradcheck(lambda x: topk_jsd_from_logits(x, z_t, k, alpha)[0], (z,))


def exact_support(z_s: torch.Tensor, z_t: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 3's support in float64, written out independently: the student's top-k log-probs on each
    side plus the tail log q = logsumexp(z outside the top-k) - logsumexp(z); at k = V no tail column."""
    z_s, z_t = z_s.double(), z_t.double()
    ids = z_s.topk(k, -1).indices  # (..., k)

    def side(z):
        lse = z.logsumexp(-1, keepdim=True)
        top = z.gather(-1, ids) - lse
        if k == z.shape[-1]:
            return top
        return torch.cat([top, z.scatter(-1, ids, float("-inf")).logsumexp(-1, keepdim=True) - lse], -1)

    return side(z_s), side(z_t)


def close_to_exact(got: torch.Tensor, want: torch.Tensor, dtype) -> None:
    """float64: to rounding; float32: to float32 rounding of log-softmax relative to the largest entry
    (the plain float32 autograd path has the same error, bit for bit)."""
    big = float(want.abs().max().clamp(min=1.0))
    tol = dict(rtol=1e-9, atol=1e-12 * big) if dtype == F64 else dict(rtol=1e-3, atol=2e-4 * big)
    torch.testing.assert_close(got.double(), want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("scale", [1.0, 40.0])  # 40: peaked logits, the top-k hold all but ~1e-30 of the mass
@pytest.mark.parametrize("k", [12, 40])  # 40 = V: an empty tail
@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_values_and_gradients_match_an_exact_float64_support(alpha, k, scale, dtype):
    """Issue 9 item 6: at alpha = 0 the tail's gradient -T_tail / q with q clamped at the dtype's
    tiny number made the gradient wrong by its whole magnitude (and, with peaked logits, the value
    too). Both paths against autograd through `exact_support`, at both endpoints and 0.5."""
    g = torch.Generator().manual_seed(5)
    P, H, V = 16, 8, 40
    h_s = (torch.randn(P, H, generator=g, dtype=F64) * scale / 3).to(dtype)
    w_s = torch.randn(V, H, generator=g, dtype=F64).to(dtype)
    h_t = (torch.randn(P, H, generator=g, dtype=F64) * scale / 3).to(dtype)
    w_t = torch.randn(V, H, generator=g, dtype=F64).to(dtype)
    weights = torch.linspace(0.5, 2.0, P, dtype=F64).to(dtype)
    # reference: the same (rounded) inputs in float64
    ref = [t.detach().double().clone().requires_grad_(i < 2) for i, t in enumerate((h_s, w_s, h_t, w_t))]
    z_s, z_t = ref[0] @ ref[1].T, ref[2] @ ref[3].T  # (P, V)
    d_ref = generalized_jsd(*exact_support(z_s, z_t, k), alpha)  # (P,)
    (d_ref * weights.double()).sum().backward()
    # the logits path
    z = (h_s @ w_s.T).detach().requires_grad_(True)
    d, _ = topk_jsd_from_logits(z, h_t @ w_t.T, k, alpha)
    (d * weights).sum().backward()
    close_to_exact(d.detach(), d_ref.detach(), dtype)
    zr = z_s.detach().clone().requires_grad_(True)
    (generalized_jsd(*exact_support(zr, z_t.detach(), k), alpha) * weights.double()).sum().backward()
    close_to_exact(z.grad, zr.grad, dtype)
    # the hidden-state path, in chunks of 5 positions
    a, b = h_s.detach().clone().requires_grad_(True), w_s.detach().clone().requires_grad_(True)
    loss, d_h, _ = budgeted_loss_from_hidden(a, b, h_t, w_t, weights, k, alpha, 5)
    loss.backward()
    close_to_exact(d_h, d_ref.detach(), dtype)
    close_to_exact(a.grad, ref[0].grad, dtype)
    close_to_exact(b.grad, ref[1].grad, dtype)


def test_a_loss_scaled_after_the_call_scales_the_gradients_and_accumulates():
    """Backward hands over its buffers when the incoming gradient is 1 and scales a copy otherwise;
    either way .grad equals autograd's through the plain formula, also when added to an existing .grad."""
    h_s, w_s, h_t, w_t = inputs(P=7, H=4, V=12, seed=3)
    weights = torch.rand(7, generator=torch.Generator().manual_seed(0), dtype=F64)
    d_plain = generalized_jsd(*topk_support(h_s @ w_s.T, h_t @ w_t.T, 5, tail=True), 0.5)
    ref = torch.autograd.grad((weights * d_plain).sum(), (h_s, w_s))
    for scale in (1.0, -2.5):
        h_s.grad = w_s.grad = None
        (scale * budgeted_loss_from_hidden(h_s, w_s, h_t, w_t, weights, 5, 0.5, 3)[0]).backward()
        budgeted_loss_from_hidden(h_s, w_s, h_t, w_t, weights, 5, 0.5, 3)[0].backward()  # adds to .grad
        torch.testing.assert_close(h_s.grad, (scale + 1) * ref[0])
        torch.testing.assert_close(w_s.grad, (scale + 1) * ref[1])


def test_float32_matches_a_float64_reference():
    h_s, w_s, h_t, w_t = inputs(dtype=torch.float32, seed=2)
    weights = torch.ones(h_s.shape[0])
    loss, d, _ = budgeted_loss_from_hidden(h_s, w_s, h_t, w_t, weights, 10, 0.5, 3)
    loss.backward()
    ref = [t.detach().double().requires_grad_(i < 2) for i, t in enumerate((h_s, w_s, h_t, w_t))]
    d64 = generalized_jsd(*topk_support(ref[0] @ ref[1].T, ref[2] @ ref[3].T, 10), 0.5)
    d64.sum().backward()
    torch.testing.assert_close(d.double(), d64.detach(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(h_s.grad.double(), ref[0].grad, rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(w_s.grad.double(), ref[1].grad, rtol=1e-3, atol=1e-5)


def test_bf16_hidden_states_with_fp32_master_weights():
    h_s, w_s, h_t, w_t = inputs(dtype=torch.float32, seed=4)
    h16 = h_s.detach().bfloat16().requires_grad_(True)
    loss, _, _ = budgeted_loss_from_hidden(h16, w_s, h_t.bfloat16(), w_t, torch.ones(h_s.shape[0]), 10, 0.5, 4)
    loss.backward()
    assert w_s.grad.dtype == torch.float32 and h16.grad.dtype == torch.bfloat16
    ref = generalized_jsd(*topk_support(h16.detach().float() @ w_s.detach().T, h_t.bfloat16().float() @ w_t.T, 10), 0.5).sum()
    assert float(loss.detach()) == pytest.approx(float(ref), rel=2e-2)


def test_no_positions_gives_a_zero_loss_that_still_reaches_the_weights():
    h_s, w_s, h_t, w_t = inputs()
    loss, d, terms = budgeted_loss_from_hidden(h_s[:0], w_s, h_t[:0], w_t, torch.ones(0, dtype=F64), 5)
    loss.backward()
    assert float(loss) == 0.0 and d.shape == (0,) and terms.shape == (0, 3)
    assert torch.equal(w_s.grad, torch.zeros_like(w_s))


def test_timing_books_the_teachers_lm_head_and_changes_nothing_else():
    h_s, w_s, h_t, w_t = inputs()
    weights = torch.ones(h_s.shape[0], dtype=F64)
    timing = {"teacher_s": 1.0}
    loss, d, terms = budgeted_loss_from_hidden(h_s, w_s, h_t, w_t, weights, 5, 0.5, 4, timing=timing,
                                               stopwatch=Stopwatch)  # fmt: skip
    ref = budgeted_loss_from_hidden(h_s, w_s, h_t, w_t, weights, 5, 0.5, 4)
    assert set(timing) == {"teacher_s"} and timing["teacher_s"] > 1.0  # added to what was there
    with pytest.raises(ValueError, match="stopwatch"):  # the kernel's caller times it (maths imports no methods)
        budgeted_loss_from_hidden(h_s, w_s, h_t, w_t, weights, 5, 0.5, 4, timing={})
    torch.testing.assert_close((loss, d, terms), ref, rtol=0, atol=0)


def test_logits_path_with_no_positions():
    z = torch.zeros(0, 7, 40, dtype=F64, requires_grad=True)
    d, terms = topk_divergence_from_logits(z, z.detach(), 5, 0.5)
    assert d.shape == (0, 7) and terms.shape == (0, 7, 3)
    d.sum().backward()
    assert z.grad.shape == z.shape


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


def test_the_fused_kernel_trains_as_the_plain_path(tmp_path, tiny, float64_model):
    """The default plain path (autograd through `family.topk_divergence` + `utility_terms` on a micro-batch's logits)
    against the opt-in fused kernel (--fused-kernel, `chunked.budgeted_loss_from_hidden`, 5 positions a chunk) on one
    training step in float64 (tests/float64.py): the same loss, every parameter's gradient and every utility label, up to
    float64 rounding of sums taken in another order (~1e-15 relative; float32 gave ~1e-7 to 1e-5, CPU-dependent).
    utility_mean is a float32 mean (labels are stored as float32): one float32 rounding per label."""
    from float64 import F32_EPS

    rows, grads = [], []
    for fused in (False, True):
        run = Run(small_config(tmp_path / f"fused-{fused}", policy="full", rho=1.0, fused_kernel=fused, loss_chunk=5,
                               micro_batch_tokens=150, dtype="float64", lr=0.0))  # fmt: skip
        assert run.context.loss.kernel is fused
        perturb(run.teacher.model)
        run.optimizer.zero_grad = lambda set_to_none=True: None  # keep the step's gradients (lr 0: AdamW moves nothing)
        rows.append(run.step(0, fixed_rollouts(run, 0)))
        grads.append({k: p.grad.clone() for k, p in run.model.named_parameters() if p.grad is not None})
        run.folder.release()
    plain, fused = rows
    assert plain["loss"] > 1e-3 and plain["selected"] > 0
    assert plain["loss"] == pytest.approx(fused["loss"], rel=1e-12)
    assert set(grads[0]) == set(grads[1]) and grads[0]
    for name, g in grads[0].items():
        scale = float(g.abs().max()) or 1.0
        assert float((g - grads[1][name]).abs().max()) <= 1e-11 * scale, name
    n = plain["selected"]  # labels >= 0: torch's float32 mean of n of them rounds n + 1 times at most
    assert plain["utility_mean"] == pytest.approx(fused["utility_mean"], rel=2 * (n + 1) * F32_EPS)
    assert fused["teacher_padded_tokens"] >= fused["teacher_tokens"] > 0


# ----------------------------------------------------------------------------- the seed family's supports, divergences

METHODS = [  # (support, divergence): BAS-OPD/Vision-OPD, -, RP-OPSD, OPSD, -
    ("student_tail", "jsd"),
    ("student_tail", "bc_rkl"),
    ("teacher", "bc_rkl"),
    ("teacher_renorm", "jsd"),
    ("teacher_renorm", "bc_rkl"),
]


@pytest.mark.parametrize("support,divergence", METHODS)
@pytest.mark.parametrize("k,alpha", [(5, 0.5), (40, 0.0), (7, 1.0), (9, 0.3)])  # 40 = V
def test_each_support_and_divergence_equals_the_plain_formula_on_both_paths(support, divergence, k, alpha):
    h_s, w_s, h_t, w_t = inputs(seed=7)
    weights = torch.linspace(0.5, 2.0, h_s.shape[0], dtype=F64)
    method = dict(support=support, divergence=divergence)
    loss, d, terms = budgeted_loss_from_hidden(h_s, w_s, h_t, w_t, weights, k, alpha, 4, **method)
    loss.backward()
    grads = h_s.grad.clone(), w_s.grad.clone()
    h_s.grad = w_s.grad = None
    z_s, z_t = h_s @ w_s.T, h_t @ w_t.T  # (P, V)
    d_plain = topk_divergence(z_s, z_t, k, alpha, **method)
    (d_plain * weights).sum().backward()
    assert (d_plain.detach() > 1e-3).all()
    torch.testing.assert_close(d, d_plain.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(loss, (d_plain * weights).sum().detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grads[0], h_s.grad, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(grads[1], w_s.grad, rtol=1e-8, atol=1e-10)
    # the utility terms stay on the student's top-k whatever the support
    torch.testing.assert_close(terms, torch.stack(utility_terms(z_s.detach(), z_t, k), -1), rtol=1e-10, atol=1e-12)
    # the logits path, chunk of 3 rows
    z = z_s.detach().clone().requires_grad_(True)
    d_l, terms_l = topk_divergence_from_logits(z, z_t, k, alpha, 3, **method)
    (d_l * weights).sum().backward()
    zr = z_s.detach().clone().requires_grad_(True)
    (topk_divergence(zr, z_t, k, alpha, **method) * weights).sum().backward()
    torch.testing.assert_close(d_l, d_plain.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(z.grad, zr.grad, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(terms_l, terms)


@pytest.mark.parametrize("support,divergence", METHODS)
@pytest.mark.parametrize("k", [3, 9])  # 9 = V
def test_gradcheck_each_method(support, divergence, k):
    h_s, w_s, h_t, w_t = inputs(P=5, H=4, V=9, seed=8)
    weights = torch.tensor([0.3, 1.0, 0.0, 2.0, 0.7], dtype=F64)
    method = dict(support=support, divergence=divergence)
    loss = lambda a, b: budgeted_loss_from_hidden(a, b, h_t, w_t, weights, k, 0.4, 2, **method)[0]  # noqa: E731
    assert torch.autograd.gradcheck(loss, (h_s, w_s))
    z_t = h_t @ w_t.T
    z = (h_s @ w_s.T).detach().requires_grad_()
    assert torch.autograd.gradcheck(lambda x: topk_divergence_from_logits(x, z_t, k, 0.4, 2, **method)[0], (z,))


@pytest.mark.parametrize("support,divergence", METHODS)
@pytest.mark.parametrize("scale", [1.0, 40.0])
def test_float32_and_peaked_logits_match_float64_for_each_method(support, divergence, scale):
    g = torch.Generator().manual_seed(9)
    P, H, V, k = 16, 8, 40, 12
    h_s = (torch.randn(P, H, generator=g, dtype=F64) * scale / 3).float()
    w_s = torch.randn(V, H, generator=g, dtype=F64).float()
    h_t = (torch.randn(P, H, generator=g, dtype=F64) * scale / 3).float()
    w_t = torch.randn(V, H, generator=g, dtype=F64).float()
    method = dict(support=support, divergence=divergence)
    ref = [t.double().requires_grad_(i < 2) for i, t in enumerate((h_s, w_s, h_t, w_t))]
    d_ref = topk_divergence(ref[0] @ ref[1].T, ref[2] @ ref[3].T, k, 0.5, **method)
    d_ref.sum().backward()
    a, b = h_s.clone().requires_grad_(True), w_s.clone().requires_grad_(True)
    loss, d, _ = budgeted_loss_from_hidden(a, b, h_t, w_t, torch.ones(P), k, 0.5, 5, **method)
    loss.backward()
    close_to_exact(d, d_ref.detach(), torch.float32)
    close_to_exact(a.grad, ref[0].grad, torch.float32)
    close_to_exact(b.grad, ref[1].grad, torch.float32)


@pytest.mark.parametrize("support,divergence", [("student_tail", "jsd"), ("teacher", "bc_rkl")])
def test_importance_ratio_scales_each_positions_weight(support, divergence):
    """Vision-OPD's is_clip: each position's weight times min(exp(log p^S(y_t) - old_logp), c), detached,
    from the chunk's own logits; D itself is returned unweighted."""
    h_s, w_s, h_t, w_t = inputs(P=9, seed=10)
    g = torch.Generator().manual_seed(10)
    y = torch.randint(0, 40, (9,), generator=g)
    weights = torch.linspace(0.5, 2.0, 9, dtype=F64)
    z_s, z_t = h_s @ w_s.T, h_t @ w_t.T
    logp_y = torch.log_softmax(z_s, -1).gather(-1, y[:, None]).squeeze(-1)  # (P,) log p^S(y_t)
    old = logp_y.detach() + torch.tensor([0.0, -2.0, 1.5, 0.3, -0.2, 0.0, -5.0, 0.7, 30.0], dtype=F64)
    method = dict(support=support, divergence=divergence)
    tokens = TokenWeight(token_weight("none", is_clip=2.0), y, old=old)  # the ratio alone
    loss, d, _ = budgeted_loss_from_hidden(h_s, w_s, h_t, w_t, weights, 6, 0.5, 4, **method, tokens=tokens)
    loss.backward()
    grads = h_s.grad.clone(), w_s.grad.clone()
    h_s.grad = w_s.grad = None
    rho = importance_ratio(logp_y, old, 2.0)
    assert (rho == 2.0).any() and (rho < 1.0).any() and (rho == 1.0).any()
    d_plain = topk_divergence(z_s, z_t, 6, 0.5, **method)
    (weights * rho * d_plain).sum().backward()
    torch.testing.assert_close(loss, (weights * rho * d_plain).sum().detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(d, d_plain.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grads[0], h_s.grad, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(grads[1], w_s.grad, rtol=1e-8, atol=1e-10)


def test_bad_methods_and_token_weights_are_refused():
    h_s, w_s, h_t, w_t = inputs()
    weights = torch.ones(h_s.shape[0], dtype=F64)
    z = (h_s @ w_s.T).detach()
    for method, message in (
        (dict(support="teacher_top"), "unknown support"),
        (dict(divergence="kl"), "unknown divergence"),
        (dict(support="teacher", divergence="jsd"), "not a distribution"),
        (dict(support="teacher"), "not a distribution"),
    ):
        with pytest.raises(ValueError, match=message):
            budgeted_loss_from_hidden(h_s, w_s, h_t, w_t, weights, 5, **method)
        with pytest.raises(ValueError, match=message):
            topk_divergence_from_logits(z, z, 5, **method)
    with pytest.raises(ValueError, match="unknown token weight 'ratio'; known: none, trust_region, gate"):
        token_weight("ratio")
    assert token_weight("none") is None  # w_t = 1: nothing to compute


def test_topk_jsd_from_logits_is_the_default_method():
    assert topk_jsd_from_logits is topk_divergence_from_logits
    h_s, w_s, h_t, w_t = inputs()
    z_s, z_t = (h_s @ w_s.T).detach(), h_t @ w_t.T
    want = generalized_jsd(*topk_support(z_s, z_t, 5), 0.5)
    torch.testing.assert_close(topk_jsd_from_logits(z_s, z_t, 5, 0.5)[0], want)


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_sampled_logp_from_hidden(chunk):
    h, w, _, _ = inputs(P=7, seed=11)
    y = torch.randint(0, 40, (7,), generator=torch.Generator().manual_seed(11))
    got = sampled_logp_from_hidden(h, w, y, chunk)
    assert got.shape == (7,) and not got.requires_grad
    want = torch.log_softmax(h @ w.T, -1).gather(-1, y[:, None]).squeeze(-1)
    torch.testing.assert_close(got, want.detach(), rtol=1e-12, atol=1e-12)
    tempered = torch.log_softmax(h @ w.T / 1.3, -1).gather(-1, y[:, None]).squeeze(-1)  # at a loss temperature
    torch.testing.assert_close(sampled_logp_from_hidden(h, w, y, chunk, temperature=1.3), tempered.detach(), rtol=1e-12,
                               atol=1e-12)  # fmt: skip
    # bf16 hidden states with fp32 weights, as under autocast: logits in float32
    got16 = sampled_logp_from_hidden(h.detach().bfloat16(), w.detach().float(), y, chunk)
    assert got16.dtype == torch.float32
    torch.testing.assert_close(got16.double(), want.detach(), rtol=0, atol=0.1)
    assert sampled_logp_from_hidden(h[:0], w, y[:0], chunk).shape == (0,)


def largest_tensor_mode():
    """A fresh TorchDispatchMode class whose `numel` records the largest tensor any op made under it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    Largest.numel = max(Largest.numel, t.numel())
            return out

    return Largest


@pytest.mark.parametrize("support,divergence", METHODS)
def test_no_tensor_larger_than_one_chunk_of_logits(support, divergence):
    """Memory: every op of the hidden-state path (forward and backward, with the importance ratio) and of
    sampled_logp_from_hidden makes tensors of at most chunk x V elements, never (P, V) logits."""
    Largest = largest_tensor_mode()
    P, H, V, chunk = 64, 4, 50, 8  # P V = 3200; chunk V = 400; V H = 200
    h_s, w_s, h_t, w_t = inputs(P=P, H=H, V=V, seed=12)
    y = torch.randint(0, V, (P,), generator=torch.Generator().manual_seed(12))
    with Largest():
        loss, _, _ = budgeted_loss_from_hidden(
            h_s, w_s, h_t, w_t, torch.ones(P, dtype=F64), 5, 0.5, chunk,
            support=support, divergence=divergence,
            tokens=TokenWeight(token_weight("none", is_clip=2.0), y, old=torch.zeros(P, dtype=F64)),
        )
        loss.backward()
        sampled_logp_from_hidden(h_t, w_t, y, chunk)
    assert 0 < Largest.numel <= chunk * V


# ----------------------------------------------------------------------------- DAPD's clamped KL, OPOD's gate and PG term


@pytest.mark.parametrize("chunk", [1, 4, 64])
@pytest.mark.parametrize("temperature,clip", [(1.1, 0.05), (1.0, 1000.0), (0.8, 0.002)])
def test_clamped_kl_from_hidden_equals_the_plain_function(chunk, temperature, clip):
    """Values and gradients (to h and W) equal autograd through `family.clamped_forward_kl` on full logits,
    in float64; the utility terms are Eq. 7-8 between the student and the anchor."""
    h_s, w_s, h_a, w_a = inputs(P=11, seed=20)
    weights = torch.linspace(0.2, 1.5, 11, dtype=F64)
    loss, d, terms = clamped_kl_from_hidden(h_s, w_s, h_a, w_a, weights, temperature, clip, chunk, utility_k=5)
    loss.backward()
    got = h_s.grad.clone(), w_s.grad.clone()
    h_s.grad = w_s.grad = None
    plain = clamped_forward_kl(h_a @ w_a.T, h_s @ w_s.T, temperature, clip)  # (P,)
    (weights * plain).sum().backward()
    torch.testing.assert_close(loss, (weights * plain).sum().detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(d, plain.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got[0], h_s.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got[1], w_s.grad, rtol=1e-10, atol=1e-12)
    want = torch.stack(utility_terms((h_s @ w_s.T).detach(), h_a @ w_a.T, 5), -1)
    torch.testing.assert_close(terms, want, rtol=1e-12, atol=1e-12)


def test_clamped_kl_from_hidden_several_anchors_is_the_sum_and_gradchecks():
    """Pairs that share the student's context: one call with two anchors equals the two terms' sum (values,
    per-anchor D, gradients); gradcheck in float64 through the analytic backward."""
    h_s, w_s, h_a, w_a = inputs(P=6, H=4, V=15, seed=21)
    _, _, h_b, w_b = inputs(P=6, H=4, V=15, seed=22)
    wa, wb = torch.rand(6, dtype=F64), torch.rand(6, dtype=F64)
    loss, d, terms = clamped_kl_from_hidden(h_s, w_s, [h_a, h_b], [w_a, w_b], [wa, wb], 1.1, 0.05, 4)
    assert d.shape == (2, 6) and terms is None
    z = h_s @ w_s.T
    parts = [clamped_forward_kl(h @ w.T, z, 1.1, 0.05) for h, w in ((h_a, w_a), (h_b, w_b))]
    torch.testing.assert_close(d, torch.stack(parts).detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(loss, ((wa * parts[0]).sum() + (wb * parts[1]).sum()).detach(), rtol=1e-12, atol=1e-14)
    fn = lambda h, w: clamped_kl_from_hidden(h, w, [h_a, h_b], [w_a, w_b], [wa, wb], 1.1, 0.05, 4)[0]  # noqa: E731
    assert torch.autograd.gradcheck(fn, (h_s, w_s))
    fn = lambda h, w: clamped_kl_from_hidden(h, w, h_a, w_a, wa, 1.3, 10.0, 2)[0]  # noqa: E731
    assert torch.autograd.gradcheck(fn, (h_s, w_s))


def test_clamped_kl_float32_matches_float64_and_no_positions():
    h_s, w_s, h_a, w_a = inputs(P=9, seed=23)
    w = torch.ones(9, dtype=F64)
    loss64, d64, _ = clamped_kl_from_hidden(h_s, w_s, h_a, w_a, w, 1.1, 0.05, 4)
    loss64.backward()
    a, b = h_s.detach().float().requires_grad_(True), w_s.detach().float().requires_grad_(True)
    loss32, d32, _ = clamped_kl_from_hidden(a, b, h_a.float(), w_a.float(), w.float(), 1.1, 0.05, 4)
    loss32.backward()
    torch.testing.assert_close(d32.double(), d64.detach(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(a.grad.double(), h_s.grad, rtol=1e-4, atol=1e-6)
    zero, d0, t0 = clamped_kl_from_hidden(h_s[:0], w_s, h_a[:0], w_a, w[:0], utility_k=5)
    assert float(zero) == 0.0 and d0.shape == (0,) and t0.shape == (0, 3)


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_weighted_logp_from_hidden_equals_autograd_and_gradchecks(chunk):
    """OPOD's policy-gradient term sum_p a_p log p(y_p): value, log-probs and gradients against autograd on full
    logits, and gradcheck."""
    h, w, _, _ = inputs(P=7, seed=24)
    g = torch.Generator().manual_seed(24)
    y = torch.randint(0, 40, (7,), generator=g)
    coef = torch.randn(7, generator=g, dtype=F64)
    loss, logp = weighted_logp_from_hidden(h, w, y, coef, chunk)
    loss.backward()
    got = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref = torch.log_softmax(h @ w.T, -1).gather(-1, y[:, None]).squeeze(-1)
    (coef * ref).sum().backward()
    torch.testing.assert_close(logp, ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(loss, (coef * ref).sum().detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[0], h.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got[1], w.grad, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(lambda a, b: weighted_logp_from_hidden(a, b, y, coef, chunk)[0], (h, w))


@pytest.mark.parametrize("chunk", [2, 64])
def test_gate_weights_each_position_by_teacher_minus_student(chunk):
    """OPOD's gate inside the fused loss: each weight times ReLU(log pi_T(y) - log pi_theta(y)) from the chunk's own
    logits (detached), the gate and the teacher's sampled-token log-probs returned; on the plain path's formula."""
    h_s, w_s, h_t, w_t = inputs(P=9, seed=25)
    y = torch.randint(0, 40, (9,), generator=torch.Generator().manual_seed(25))
    weights = torch.linspace(0.5, 2.0, 9, dtype=F64)
    extras: dict = {}
    tokens = TokenWeight(token_weight("gate"), y)
    loss, d, _ = budgeted_loss_from_hidden(h_s, w_s, h_t, w_t, weights, 6, 0.5, chunk, tokens=tokens, extras=extras)
    loss.backward()
    grads = h_s.grad.clone(), w_s.grad.clone()
    h_s.grad = w_s.grad = None
    z_s, z_t = h_s @ w_s.T, h_t @ w_t.T
    s_y = torch.log_softmax(z_s, -1).gather(-1, y[:, None]).squeeze(-1)
    t_y = torch.log_softmax(z_t, -1).gather(-1, y[:, None]).squeeze(-1)
    gate = teacher_gate(t_y, s_y)
    assert (gate == 0).any() and (gate > 0).any()
    plain = topk_divergence(z_s, z_t, 6, 0.5)
    (weights * gate * plain).sum().backward()
    torch.testing.assert_close(loss, (weights * gate * plain).sum().detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(extras["teacher_logp"], t_y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(extras["token_weight"], gate, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grads[0], h_s.grad, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(grads[1], w_s.grad, rtol=1e-8, atol=1e-10)


def test_clamped_kl_and_pg_term_make_no_tensor_larger_than_one_chunk_of_logits():
    Largest = largest_tensor_mode()
    P, H, V, chunk = 64, 4, 50, 8
    h_s, w_s, h_t, w_t = inputs(P=P, H=H, V=V, seed=26)
    y = torch.randint(0, V, (P,), generator=torch.Generator().manual_seed(26))
    with Largest():
        loss, _, _ = clamped_kl_from_hidden(h_s, w_s, [h_t, h_t], [w_t, w_t], [torch.ones(P, dtype=F64)] * 2, 1.1, 0.05,
                                            chunk, utility_k=5)  # fmt: skip
        loss.backward()
        loss, _ = weighted_logp_from_hidden(h_s, w_s, y, torch.ones(P, dtype=F64), chunk)
        loss.backward()
    assert 0 < Largest.numel <= chunk * V


def test_a_frozen_lm_head_gets_no_weight_gradient_and_the_same_hidden_gradient(monkeypatch):
    """A weight that needs no gradient (LoRA's frozen LM head): the three fused functions compute no dL/dW (no
    (V, H) product or buffer: `_accumulate` is never called) and leave W.grad None, while dL/dh and the values are
    the same ops as with a trainable weight (exactly equal)."""
    import opd.maths.chunked

    P, V = 13, 40
    y = torch.randint(0, V, (P,), generator=torch.Generator().manual_seed(31))
    coef = torch.linspace(-1.0, 1.0, P, dtype=F64)
    weights = torch.linspace(0.5, 2.0, P, dtype=F64)
    tokens = TokenWeight(token_weight("gate"), y)
    calls = {
        "topk": lambda h, w, h_t, w_t: budgeted_loss_from_hidden(h, w, h_t, w_t, weights, 5, 0.5, 4, tokens=tokens,
                                                                 temperature=1.2)[:2],
        "clamped": lambda h, w, h_t, w_t: clamped_kl_from_hidden(h, w, [h_t, h_t], [w_t, w_t], [weights, weights], 1.1,
                                                                 0.05, 4, utility_k=5)[:2],
        "pg": lambda h, w, h_t, w_t: weighted_logp_from_hidden(h, w, y, coef, 4),
    }  # fmt: skip
    accumulated = []
    accumulate = opd.maths.chunked._accumulate
    monkeypatch.setattr(opd.maths.chunked, "_accumulate", lambda *a: accumulated.append(1) or accumulate(*a))
    for name, fn in calls.items():
        results = {}
        for frozen in (False, True):
            h_s, w_s, h_t, w_t = inputs(P=P, V=V, seed=30)
            w_s.requires_grad_(not frozen)
            accumulated.clear()
            loss, out = fn(h_s, w_s, h_t, w_t)
            (2.5 * loss).backward()  # a scaled loss: the saved gradients are scaled copies
            results[frozen] = (loss.detach(), out, h_s.grad, w_s.grad, len(accumulated))
        (l0, o0, g0, w0, n0), (l1, o1, g1, w1, n1) = results[False], results[True]
        assert n0 > 0 and w0 is not None and n1 == 0 and w1 is None, name
        assert torch.equal(l0, l1) and torch.equal(o0, o1) and torch.equal(g0, g1), name


def test_the_kernel_is_opt_in_turned_on_by_the_paper_presets_and_by_a_plain_path_too_large():
    """The plain path by default; the fused kernel with --fused-kernel, under --preset paper-4b / paper-9b, and on its
    own (one line naming why) when micro_batch x max_response_len x vocabulary logits exceed PLAIN_LOGITS_LIMIT."""
    from opd.config import resolve
    from opd.maths.loss import PLAIN_LOGITS_LIMIT, LossConfig

    assert not resolve({}).loss.kernel and not resolve({"preset": "tiny"}).loss.kernel
    assert resolve({"preset": "tiny", "fused_kernel": True}).loss.kernel
    for preset in ("paper-4b", "paper-9b"):
        assert resolve({"preset": preset, "data": "x.jsonl"}).loss.kernel
    cfg = LossConfig(micro_batch=4)
    assert cfg.for_vocabulary(1000, 32) == (cfg, None)  # 128,000 logits: plain
    big, note = cfg.for_vocabulary(248_320, 1024)  # Qwen3.5's vocabulary: 1,017,118,720 logits per side
    assert big.kernel and 4 * 1024 * 248_320 > PLAIN_LOGITS_LIMIT
    assert note.count("\n") == 0 and "--fused-kernel on" in note and "1,017,118,720" in note
    assert LossConfig(fused_kernel=True, chunk=0).kernel is False  # --loss-chunk 0: whole logits, the plain path
