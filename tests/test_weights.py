"""Tests of opd/maths/weights.py: OPD-V's trust region and Vision-OPD's truncated importance ratio, each
against an explicit float64 loop (math.exp / max / min), and detached; OPOD's gate, controller, group
advantages and reward terms (opd/methods/opod.py) against numpy and hand computations."""

import math

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from opd.maths.weights import importance_ratio, teacher_gate, trust_region

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


class _TinyLM(torch.nn.Module):
    """A float64 stand-in for the policy's interface (`response_logits` / `response_hidden`, `get_output_embeddings`):
    h_t = tanh(E[x_t] + E[x_{t-1}] / 2), logits = h W^T."""

    def __init__(self, vocab: int, hidden: int, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Parameter(torch.randn(vocab, hidden, generator=g, dtype=F64))
        self.head = torch.nn.Linear(hidden, vocab, bias=False, dtype=F64)
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(vocab, hidden, generator=g, dtype=F64) * 2)

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, logits_to_keep=0, output_hidden_states=False, use_cache=False, **_):
        e = self.emb[input_ids]  # (n, L, H)
        h = torch.tanh(e + torch.nn.functional.pad(e[:, :-1], (0, 0, 1, 0)) / 2)
        logits = self.head(h[:, -logits_to_keep:] if logits_to_keep else h)
        return type("Out", (), {"logits": logits, "hidden_states": (h,)})()


@pytest.mark.parametrize("loss_chunk", [0, 4])
def test_opd_vs_trust_region_reads_both_teachers_at_the_loss_temperature(loss_chunk):
    """With --loss-temperature T both teachers' sampled-token log-probs are at T on either loss path: the weight
    w_t = ReLU(log softmax(z+ / T)[y_t] - log softmax(z- / T)[y_t]) of the positive (crop) and negative (masked)
    teachers' logits, written out in float64 (not the negative side at T = 1). Tolerance: a few float64 roundings
    of log-probs of size <= max|z| / T + log V."""
    from float64 import F64_EPS

    from opd.methods.micro_batch import micro_batch_loss
    from opd.maths.divergence import budgeted_weights
    from opd.models.ema_teacher import Teacher
    from opd.maths.loss import LossConfig

    V, H, n, T, temp = 23, 6, 3, 5, 1.3
    g = torch.Generator().manual_seed(7)
    student, teacher = _TinyLM(V, H, 1), Teacher(_TinyLM(V, H, 2))
    response = torch.randint(0, V, (n, T), generator=g)
    mask = torch.ones(n, T, dtype=torch.bool)
    mask[1, 3:] = False
    mask[2, 4:] = False
    prompts = [torch.randint(0, V, (n, 4), generator=g) for _ in range(3)]  # the student's, the crop's, the masked's
    s_in, pos_in, neg_in = ({"input_ids": torch.cat([p, response], 1)} for p in prompts)
    cfg = LossConfig(topk=5, chunk=loss_chunk, fused_kernel=True, support="student_tail", token_weight="trust_region", temperature=temp)
    weights = budgeted_weights(torch.ones(n, dtype=F64), mask, dtype=F64)
    extras: dict = {}
    micro_batch_loss(student, teacher, s_in, [pos_in, neg_in], mask, T, weights, cfg, response, torch.zeros(n, T, dtype=F64),
                     extras)  # fmt: skip
    with torch.no_grad():
        z_pos, z_neg = (teacher.model(**x).logits[:, -(T + 1) : -1] for x in (pos_in, neg_in))  # (n, T, V)
    logp = lambda z: torch.log_softmax(z / temp, -1).gather(-1, response[..., None]).squeeze(-1)
    want = torch.relu(logp(z_pos) - logp(z_neg)) * mask
    bound = 8 * F64_EPS * (float(torch.cat([z_pos, z_neg]).abs().max()) / temp + math.log(V))
    assert_close(extras["token_weight"], want, rtol=0, atol=bound)
    assert_close(extras["teacher_logp"], logp(z_pos) * mask, rtol=0, atol=bound)
    negative_at_one = torch.log_softmax(z_neg, -1).gather(-1, response[..., None]).squeeze(-1)
    assert float((torch.relu(logp(z_pos) - negative_at_one) * mask - want).abs().max()) > 1e3 * bound  # T matters


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


# ----------------------------------------------------------------------------- OPOD (opd/maths/weights.py, opd/methods/opod.py)


def test_teacher_gate_is_the_positive_part_of_teacher_minus_student_and_detached():
    g = torch.Generator().manual_seed(1)
    t = torch.log_softmax(torch.randn(5, 6, 30, generator=g, dtype=F64), -1)[..., 0]
    s = torch.log_softmax(torch.randn(5, 6, 30, generator=g, dtype=F64), -1)[..., 0].requires_grad_(True)
    c = teacher_gate(t, s)
    np.testing.assert_array_equal(c.numpy(), np.maximum(t.numpy() - s.detach().numpy(), 0.0))
    assert not c.requires_grad and (c == 0).any() and (c > 0).any()


def test_controller_step_and_warm_up_against_numpy():
    from opd.methods.opod import GateController, controller_step

    rng = np.random.default_rng(0)
    for _ in range(50):
        beta, c, eps, eta = rng.uniform(0, 3), rng.uniform(0, 1), rng.uniform(0, 0.5), rng.uniform(0, 2)
        assert controller_step(beta, c, eps, eta, 0.1, 2.0) == pytest.approx(float(np.clip(beta + eta * (c - eps), 0.1, 2.0)))
    ctl = GateController(["img", "txt"], beta_init=1.0, beta_min=0.1, beta_max=2.0, eta=0.5, warmup=3, eps_floor=0.02)
    means = [0.3, 0.1, 0.2]  # the warm-up: beta unchanged, eps = their mean
    for m in means:
        ctl.observe("img", m)
        assert ctl.beta["img"] == 1.0
    assert ctl.eps["img"] == pytest.approx(np.mean(means))
    ctl.observe("img", None)  # a step without tokens of this teacher: not observed
    ctl.observe("img", 0.6)
    assert ctl.beta["img"] == pytest.approx(1.0 + 0.5 * (0.6 - 0.2))
    for m in (0.001, 0.0, 0.002):  # a warm-up mean below the floor: eps = 0.02
        ctl.observe("txt", m)
    assert ctl.eps["txt"] == 0.02 and ctl.beta["txt"] == 1.0
    for _ in range(20):
        ctl.observe("txt", 0.0)
    assert ctl.beta["txt"] == pytest.approx(1.0 - 20 * 0.5 * 0.02)
    for _ in range(100):
        ctl.observe("img", 5.0)
    assert ctl.beta["img"] == 2.0  # clipped at beta_max
    restored = GateController(["img", "txt"])
    restored.load_state_dict(ctl.state_dict())
    assert restored.state_dict() == ctl.state_dict()


def test_group_advantages_against_a_hand_computation():
    from opd.methods.opod import group_advantages

    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0, 7.0, 1.0, 3.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3])
    adv = group_advantages(rewards, groups, eps=1e-4)
    # group 0: mean 0.5, sample std sqrt(((0.5)^2 + (0.5)^2 + 0) / 2) = 0.5
    want = [0.5 / 0.5001, -0.5 / 0.5001, 0.0,
            0.0, 0.0,  # group 1: equal rewards, std 0
            0.0,  # group 2: one row, no baseline
            -1.0 / (math.sqrt(2.0) + 1e-4), 1.0 / (math.sqrt(2.0) + 1e-4)]  # group 3: mean 2, std sqrt(2)
    assert adv.tolist() == pytest.approx(want, abs=1e-12)


def test_verification_reward_terms_against_numpy():
    from opd.methods.opod import answer_confidence, verification_gain, verified_reward

    correct = torch.tensor([True, False, True, True])
    mean_t = torch.tensor([-0.5, -0.1, -3.0, 0.2], dtype=F64)
    a = answer_confidence(correct, mean_t, clip=2.0)
    np.testing.assert_allclose(a.numpy(), np.array([1, 0, 1, 1]) * np.clip(mean_t.numpy(), -2, 0))
    w, wo = torch.tensor([-1.0, -5.0, 0.0], dtype=F64), torch.tensor([-2.0, -1.0, -4.0], dtype=F64)
    b = verification_gain(w, wo, clip=2.0)
    np.testing.assert_allclose(b.numpy(), np.clip(w.numpy() - wo.numpy(), -2, 2))
    r = verified_reward(torch.tensor([1.0, 0.0, 1.0], dtype=F64), a[:3], b)
    np.testing.assert_allclose(r.numpy(), np.array([1.0, 0.0, 1.0]) + 0.2 * a[:3].numpy() + 0.1 * b.numpy())


def test_task_reward_reads_the_answer_with_the_projects_parser():
    from opd.methods.opod import task_reward

    problem = "<image>What colour is the small square?\n(A) red\n(B) green\n(C) blue\n(D) yellow\nAnswer with the letter."
    assert task_reward("B", problem, "B") == 1.0 and task_reward("The answer is (B).", problem, "B") == 1.0
    assert task_reward("C", problem, "B") == 0.0 and task_reward("A or B", problem, "B") == 0.0
    assert task_reward("Yes.", "<image>Is there a dog?", "yes") == 1.0
    assert task_reward("three", "<image>How many?", "3") == 1.0 and task_reward("4", "<image>How many?", "3") == 0.0
