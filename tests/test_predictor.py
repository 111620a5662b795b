"""Tests of opd/selection/selectors.py's replay buffer, f_psi (Eq. 6) and its online training (Algorithm 1, line 14;
Appendix A.3, Table 5)."""

import copy
import io

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from opd.selection.config import PredictorConfig
from opd.selection.selectors import OnlineUtilityModel, ReplayBuffer, UtilityPredictor
from opd.selection.state import load_model_state, load_replay_state, model_state, replay_state
from opd.engine.rollout import seeded_generator

# ----------------------------------------------------------------------------- replay buffer


def items(start: int, n: int, dim: int = 6):
    """Rows whose values identify them: phi[r] = (start + r) * [1..dim], u = start + r."""
    ids = torch.arange(start, start + n, dtype=torch.float32)
    return ids.unsqueeze(1) * torch.arange(1, dim + 1).float(), ids


def test_replay_fifo_keeps_newest_in_order():
    buf = ReplayBuffer(capacity=5, dim=3)
    phi, u = items(0, 3, dim=3)
    assert buf.add(phi, u, step=1) == 3
    assert len(buf) == 3
    phi, u = items(3, 4, dim=3)
    assert buf.add(phi, u, step=2) == 4
    assert len(buf) == 5
    assert buf.u.tolist() == [2.0, 3.0, 4.0, 5.0, 6.0]
    assert buf.step.tolist() == [1, 2, 2, 2, 2]
    assert torch.equal(buf.phi, buf.u.unsqueeze(1) * torch.tensor([1.0, 2.0, 3.0]))
    # A batch larger than the capacity keeps its own newest items.
    phi, u = items(10, 8, dim=3)
    buf.add(phi, u, step=3)
    assert buf.u.tolist() == [13.0, 14.0, 15.0, 16.0, 17.0] and buf.step.tolist() == [3] * 5


def test_replay_drops_non_finite_pairs():
    buf = ReplayBuffer(capacity=10, dim=2)
    phi = torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0], [4.0, float("nan")], [5.0, 5.0], [6.0, 6.0]])
    u = torch.tensor([0.1, float("nan"), float("inf"), 0.4, float("-inf"), 0.6])
    assert buf.add(phi, u, step=0) == 2
    assert buf.u.tolist() == pytest.approx([0.1, 0.6])
    assert buf.phi.tolist() == [[1.0, 1.0], [6.0, 6.0]]
    assert buf.add(phi[:0], u[:0], step=1) == 0 and len(buf) == 2
    assert buf.add(phi[1:2], u[1:2], step=1) == 0 and len(buf) == 2


def test_replay_sample_size_without_replacement_and_seeded():
    buf = ReplayBuffer(capacity=100, dim=6)
    phi, u = items(0, 40)
    buf.add(phi[:20], u[:20], step=3)
    buf.add(phi[20:], u[20:], step=4)
    p1, u1, s1 = buf.sample(16, torch.Generator().manual_seed(7))
    assert u1.numel() == 16 and len(set(u1.tolist())) == 16  # no repeats
    # The triples stay aligned.
    assert torch.equal(p1, u1.unsqueeze(1) * torch.arange(1, 7).float())
    assert torch.equal(s1, torch.where(u1 < 20, 3, 4))
    # Same seed -> same minibatch; another seed -> another one.
    p2, u2, s2 = buf.sample(16, torch.Generator().manual_seed(7))
    assert torch.equal(u1, u2) and torch.equal(p1, p2) and torch.equal(s1, s2)
    _, u3, _ = buf.sample(16, torch.Generator().manual_seed(8))
    assert not torch.equal(u1, u3)
    # Capped by the size: every item exactly once.
    _, u_all, _ = buf.sample(256, torch.Generator().manual_seed(7))
    assert sorted(u_all.tolist()) == list(range(40))


def test_replay_state_dict_round_trip():
    buf = ReplayBuffer(capacity=6, dim=6)
    phi, u = items(0, 9)
    buf.add(phi, u, step=5)
    other = ReplayBuffer(capacity=512, dim=6)
    load_replay_state(other, replay_state(buf))
    assert other.capacity == 6
    assert torch.equal(other.u, buf.u) and torch.equal(other.phi, buf.phi) and torch.equal(other.step, buf.step)
    phi, u = items(20, 2)
    buf.add(phi, u, 6)
    other.add(phi, u, 6)
    assert torch.equal(other.u, buf.u) and other.u.tolist() == [5.0, 6.0, 7.0, 8.0, 20.0, 21.0]


# ----------------------------------------------------------------------------- f_psi (Eq. 6)


def test_predictor_architecture():
    net = UtilityPredictor()
    layers = list(net.net)
    assert [type(m) for m in layers] == [nn.LayerNorm, nn.Linear, nn.SiLU, nn.Linear]
    assert layers[0].normalized_shape == (6,)
    assert (layers[1].in_features, layers[1].out_features) == (6, 32)
    assert (layers[3].in_features, layers[3].out_features) == (32, 1)
    assert sum(p.numel() for p in net.parameters()) == 12 + 6 * 32 + 32 + 32 + 1


def test_predictor_forward_matches_manual_computation():
    torch.manual_seed(0)
    net = UtilityPredictor()
    with torch.no_grad():  # non-trivial LayerNorm affine parameters
        net.net[0].weight.uniform_(0.5, 1.5)
        net.net[0].bias.uniform_(-0.5, 0.5)
    x = torch.randn(5, 6, dtype=torch.float64) * 3 + 1
    net = net.double().requires_grad_(False)
    ln, l1, _, l2 = list(net.net)
    want = []
    for row in x.tolist():
        mean = sum(row) / 6
        var = sum((v - mean) ** 2 for v in row) / 6
        h = [(v - mean) / (var + ln.eps) ** 0.5 * float(ln.weight[j]) + float(ln.bias[j]) for j, v in enumerate(row)]
        z = [sum(float(l1.weight[o, j]) * h[j] for j in range(6)) + float(l1.bias[o]) for o in range(32)]
        s = [v / (1 + torch.exp(torch.tensor(-v, dtype=torch.float64)).item()) for v in z]  # SiLU
        want.append(sum(float(l2.weight[0, o]) * s[o] for o in range(32)) + float(l2.bias[0]))
    got = net(x)
    assert got.shape == (5,)
    assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-10, atol=1e-12)


def test_predictor_init_from_selector_seed_not_global_rng():
    torch.manual_seed(1)
    a = OnlineUtilityModel(PredictorConfig(seed=0))
    torch.manual_seed(2)
    b = OnlineUtilityModel(PredictorConfig(seed=0))
    c = OnlineUtilityModel(PredictorConfig(seed=1))
    for pa, pb in zip(a.net.parameters(), b.net.parameters()):
        assert torch.equal(pa, pb)
    assert not torch.equal(a.net.net[1].weight, c.net.net[1].weight)
    # Building the model does not consume the global RNG stream.
    torch.manual_seed(3)
    x = torch.rand(3)
    torch.manual_seed(3)
    OnlineUtilityModel(PredictorConfig(seed=0))
    assert torch.equal(torch.rand(3), x)


def test_predictor_config_defaults_are_table5():
    cfg = PredictorConfig()
    assert (cfg.seed, cfg.lr, cfg.hidden, cfg.norm_momentum, cfg.norm_eps) == (0, 1e-3, 32, 0.99, 1e-6)
    assert (cfg.replay_capacity, cfg.replay_start, cfg.replay_batch, cfg.updates_per_step) == (512, 96, 256, 2)
    assert (cfg.half_life, cfg.rank_weight, cfg.min_gap) == (10.0, 0.2, 1e-6)
    m = OnlineUtilityModel(cfg)
    assert isinstance(m.optimizer, torch.optim.Adam) and m.optimizer.param_groups[0]["lr"] == 1e-3


# ----------------------------------------------------------------------------- online training


MU = torch.tensor([1.0, 3.0, 1.5, 200.0, 400.0, 0.3])
SD = torch.tensor([0.5, 1.0, 0.3, 80.0, 150.0, 0.2])
# A linear utility of phi. Its weights on the standardized features sum to zero: the input LayerNorm
# of f_psi discards each row's mean over its six normalized features, so a utility that depends on
# that mean cannot be ranked well by this architecture (a paper design choice, not tested here).
A = torch.tensor([0.2, -0.2, 0.1, -0.1, 0.05, -0.05])


def feats(n: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(n, 6, generator=g) * SD + MU


def linear_utility(phi: torch.Tensor) -> torch.Tensor:
    return ((phi - MU) / SD) @ A


def pairwise_accuracy(u: torch.Tensor, p: torch.Tensor) -> float:
    du = u.unsqueeze(1) - u.unsqueeze(0)
    dp = p.unsqueeze(1) - p.unsqueeze(0)
    return float(((du * dp) > 0).sum() / (du != 0).sum())


def params(model: OnlineUtilityModel) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.net.parameters()]


def test_observe_waits_for_replay_start_and_new_labels():
    cfg = PredictorConfig(seed=0, replay_start=30, updates_per_step=2)
    m = OnlineUtilityModel(cfg)
    g = torch.Generator().manual_seed(0)
    before = params(m)
    phi = feats(20, g)
    m.normalizer.update(phi)
    out = m.observe(phi, linear_utility(phi), step=0)  # 20 < 30
    assert m.updates == 0 and not m.trained
    assert out["select/replay_size"] == 20 and out["select/labels_added"] == 20 and "loss/selector" not in out
    assert all(torch.equal(a, b) for a, b in zip(before, params(m)))
    phi = feats(15, g)
    out = m.observe(phi, linear_utility(phi), step=1)  # 35 >= 30: two Adam steps
    assert m.updates == 2 and m.trained and torch.isfinite(torch.tensor(out["loss/selector"]))
    after = params(m)
    assert not all(torch.equal(a, b) for a, b in zip(before, after))
    # No new labels (all NaN, or none): no update although |R| >= M.
    m.observe(phi, torch.full((15,), float("nan")), step=2)
    m.observe(phi[:0], torch.zeros(0), step=3)
    assert m.updates == 2 and len(m.replay) == 35
    assert all(torch.equal(a, b) for a, b in zip(after, params(m)))
    # New labels again: exactly updates_per_step more.
    m.observe(phi[:1], linear_utility(phi[:1]), step=4)
    assert m.updates == 4


def test_observe_starts_exactly_at_replay_start():
    m = OnlineUtilityModel(PredictorConfig(seed=0, replay_start=30))
    phi = feats(30, torch.Generator().manual_seed(9))
    m.observe(phi[:29], linear_utility(phi[:29]), step=0)
    assert m.updates == 0 and len(m.replay) == 29
    m.observe(phi[29:], linear_utility(phi[29:]), step=1)  # |R| = M = 30
    assert m.updates == 2


def test_observe_does_updates_per_step_and_freezes_normalizer():
    m = OnlineUtilityModel(PredictorConfig(seed=0, replay_start=8, updates_per_step=3))
    g = torch.Generator().manual_seed(1)
    phi = feats(10, g)
    m.normalizer.update(phi)
    mean, var, count = m.normalizer.mean.clone(), m.normalizer.var.clone(), m.normalizer.count
    for step in range(3):
        m.observe(phi, linear_utility(phi), step)
        assert m.updates == 3 * (step + 1)
    assert torch.equal(m.normalizer.mean, mean) and torch.equal(m.normalizer.var, var)
    assert m.normalizer.count == count


def test_predictor_learns_ranking_of_linear_utility():
    m = OnlineUtilityModel(PredictorConfig(seed=0))
    g = torch.Generator().manual_seed(2)
    test_phi = feats(400, g)
    test_u = linear_utility(test_phi)
    m.normalizer.update(feats(56, torch.Generator().manual_seed(99)))
    start = pairwise_accuracy(test_u, m.predict(test_phi))
    for step in range(150):
        phi = feats(56, g)
        m.normalizer.update(phi)  # as Selector.select does on C
        m.observe(phi, linear_utility(phi), step)
    assert m.updates == 2 * (150 - 1)  # replay_start 96 reached at the second step
    acc = pairwise_accuracy(test_u, m.predict(test_phi))
    assert acc > 0.85, (start, acc)
    assert acc > start + 0.2


def feed(model: OnlineUtilityModel, steps, seed: int):
    g = torch.Generator().manual_seed(seed)
    for step in steps:
        phi = feats(40, g)
        model.normalizer.update(phi)
        model.observe(phi, linear_utility(phi) + 0.05 * torch.randn(40, generator=g), step)


def test_two_instances_fed_the_same_data_agree_exactly():
    a = OnlineUtilityModel(PredictorConfig(seed=0, replay_start=50))
    b = OnlineUtilityModel(PredictorConfig(seed=0, replay_start=50))
    torch.manual_seed(10)
    feed(a, range(12), seed=3)
    torch.manual_seed(20)  # the global RNG plays no part in the minibatch draws
    feed(b, range(12), seed=3)
    assert a.updates == b.updates > 0
    for pa, pb in zip(a.net.parameters(), b.net.parameters()):
        assert torch.equal(pa, pb)
    x = feats(30, torch.Generator().manual_seed(4))
    assert torch.equal(a.predict(x), b.predict(x))


def test_state_dict_round_trip_predicts_and_continues_identically():
    a = OnlineUtilityModel(PredictorConfig(seed=0, replay_start=50))
    feed(a, range(8), seed=5)
    assert a.trained
    buf = io.BytesIO()
    torch.save(model_state(a), buf)
    buf.seek(0)
    b = OnlineUtilityModel(PredictorConfig(seed=0, replay_start=50))  # same config, as on a resume
    with torch.no_grad():
        for p in b.net.parameters():  # a state that the load must overwrite entirely
            p.add_(1.0)
    load_model_state(b, torch.load(buf, weights_only=False))
    assert b.updates == a.updates
    x = feats(30, torch.Generator().manual_seed(6))
    assert torch.equal(a.predict(x), b.predict(x))
    # Both continue with the same calls (including the Adam moments) to identical parameters.
    feed(a, range(8, 14), seed=7)
    feed(b, range(8, 14), seed=7)
    for pa, pb in zip(a.net.parameters(), b.net.parameters()):
        assert torch.equal(pa, pb)
    assert torch.equal(a.predict(x), b.predict(x))
    assert torch.equal(a.replay.u, b.replay.u)


def test_state_dict_without_optimizer_state_would_diverge():
    """Control for the round trip above: a copy that loses the Adam moments does not continue
    identically, so the round-trip test can detect a missing optimizer state."""
    a = OnlineUtilityModel(PredictorConfig(seed=0, replay_start=50))
    feed(a, range(8), seed=5)
    state = copy.deepcopy(model_state(a))
    b = OnlineUtilityModel(PredictorConfig(seed=0, replay_start=50))
    state["optimizer"] = b.optimizer.state_dict()  # fresh Adam moments
    load_model_state(b, state)
    feed(a, range(8, 10), seed=7)
    feed(b, range(8, 10), seed=7)
    assert not torch.equal(a.net.net[1].weight, b.net.net[1].weight)


def test_update_reproduced_by_hand_from_appendix_a3():
    """Each update j of step s draws from replay with seeded_generator(seed, s, j), normalizes with the
    current statistics, weights items by 2^(-(s - s_i)/h) and takes one Adam step on Eq. 10.
    Reproduce two updates by hand (items from two steps, so the recency weights differ)."""
    from opd.selection.selectors import recency_weights, selector_loss

    cfg = PredictorConfig(seed=0, replay_start=20, updates_per_step=2, replay_batch=16)
    m = OnlineUtilityModel(cfg)
    ref = copy.deepcopy(m)
    g = torch.Generator().manual_seed(8)
    phi_old, phi_new = feats(12, g), feats(12, g)
    m.normalizer.update(torch.cat([phi_old, phi_new]))
    ref.normalizer.update(torch.cat([phi_old, phi_new]))
    m.observe(phi_old, linear_utility(phi_old), step=2)  # 12 < 20: stored only
    m.observe(phi_new, linear_utility(phi_new), step=5)  # 24 >= 20: two updates
    assert m.updates == 2
    ref.replay.add(phi_old, linear_utility(phi_old), 2)
    ref.replay.add(phi_new, linear_utility(phi_new), 5)
    seen_steps = set()
    for j in range(2):
        p_b, u_b, s_b = ref.replay.sample(16, seeded_generator(0, 5, j))
        seen_steps |= set(s_b.tolist())
        w = torch.pow(2.0, -(5 - s_b.double()) / 10.0).float()
        assert_close(recency_weights(s_b, 5, 10.0), w)
        loss = selector_loss(ref.net(ref.normalizer(p_b)), u_b, w, 0.2, 1e-6)
        ref.optimizer.zero_grad()
        loss.backward()
        ref.optimizer.step()
    assert seen_steps == {2, 5}
    for pa, pb in zip(m.net.parameters(), ref.net.parameters()):
        assert_close(pa, pb, rtol=0, atol=0)
