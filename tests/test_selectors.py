"""Tests of opd/selection/selectors.py: the query budget (Eq. 4) and the selection policies (Algorithm 1, lines 4-9)."""

import math

import pytest
import torch

from opd.selection.config import PredictorConfig
from opd.engine.rollout import seeded_generator
from opd.selection.selectors import (
    Selector,
    entropy_scores,
    exploration_count,
    learned_subset,
    query_budget,
    top_subset,
    uniform_subset,
)
from opd.selection.state import load_selector_state, selector_state

# ----------------------------------------------------------------------------- Eq. 4 and K_e


@pytest.mark.parametrize(
    "rho, n, want",
    [
        (0.25, 7, 1),
        (0.25, 8, 2),
        (0.25, 224, 56),
        (0.29, 100, 29),
        (0.1, 9, 0),
        (0.1, 224, 22),
        (0.5, 224, 112),
        (1.0, 224, 224),
        (1.0, 0, 0),
        (0.7, 10, 7),
        (0.3, 10, 3),
        (1, 5, 5),
    ],
)

def test_query_budget_floor(rho, n, want):
    assert query_budget(rho, n) == want
    assert want == math.floor(round(rho * n, 9))  # the independent floor (with float noise removed)


@pytest.mark.parametrize("rho", [0, 0.0, -0.1, 1.5, 1.0000001, float("nan")])
def test_query_budget_rejects_rho_outside_unit_interval(rho):
    with pytest.raises(ValueError):
        query_budget(rho, 10)


def test_query_budget_paper_totals():
    # Table 7: 111 steps x 224 candidates at rho = 0.25 -> 6,216 calls.
    assert sum(query_budget(0.25, 224) for _ in range(111)) == 6216


@pytest.mark.parametrize("K, eps, want", [(56, 0.1, 6), (10, 0.1, 1), (0, 0.1, 0), (56, 0.0, 0), (22, 0.1, 3), (1, 0.1, 1), (20, 0.25, 5)])
def test_exploration_count(K, eps, want):
    assert exploration_count(K, eps) == want


# ----------------------------------------------------------------------------- helpers


def make_phi(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    phi = torch.randn(n, 6, generator=g)
    phi[:, 3] = torch.randint(1, 200, (n,), generator=g).float()  # response length
    phi[:, 4] = torch.randint(10, 500, (n,), generator=g).float()  # prompt length
    phi[:, 5] = torch.rand(n, generator=g)  # crop area
    return phi


def make_eligible(n: int, seed: int, p: float = 0.7) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1000)
    return torch.rand(n, generator=g) < p


def trained_selector(seed: int = 0, n_steps: int = 3, epsilon: float = 0.1) -> Selector:
    """A learned selector whose predictor has had updates (replay_start reached)."""
    sel = Selector("learned", epsilon, PredictorConfig(seed=seed, replay_start=16))
    for step in range(n_steps):
        phi = make_phi(40, seed=100 + step)
        eligible = torch.ones(40, dtype=torch.bool)
        chosen = sel.select(phi, eligible, 20, step)[0]
        u = phi[chosen, 0] * 0.3 + 0.5
        sel.observe(phi[chosen], u, step)
    assert sel.model.trained
    return sel


def check_valid(chosen: torch.Tensor, eligible: torch.Tensor, budget: int):
    ids = chosen.tolist()
    assert chosen.dtype == torch.long
    assert all(bool(eligible[i]) for i in ids), "a non-eligible row was selected"
    assert len(set(ids)) == len(ids), "duplicate selections"
    assert ids == sorted(ids), "selection is not sorted"
    assert len(ids) <= budget
    assert len(ids) == min(budget, int(eligible.sum()))


# ----------------------------------------------------------------------------- policies


@pytest.mark.parametrize("policy", ["random", "entropy", "learned", "learned-trained"])
@pytest.mark.parametrize("n, budget", [(50, 12), (50, 1), (30, 21), (20, 5)])
def test_policies_return_valid_subsets(policy, n, budget):
    sel = trained_selector() if policy == "learned-trained" else Selector(policy)
    for step in range(3):
        phi = make_phi(n, seed=step)
        eligible = make_eligible(n, seed=step)
        chosen = sel.select(phi, eligible, budget, 10 + step)[0]
        check_valid(chosen, eligible, budget)


@pytest.mark.parametrize("policy", ["random", "entropy", "learned", "learned-trained"])
def test_budget_larger_than_candidates_returns_all_candidates(policy):
    sel = trained_selector() if policy == "learned-trained" else Selector(policy)
    phi = make_phi(12, seed=5)
    eligible = make_eligible(12, seed=5, p=0.5)
    chosen = sel.select(phi, eligible, 50, 4)[0]
    assert chosen.tolist() == eligible.nonzero().squeeze(-1).tolist()


def test_full_returns_all_candidates():
    phi = make_phi(30, seed=1)
    eligible = make_eligible(30, seed=1)
    n_c = int(eligible.sum())
    chosen = Selector("full").select(phi, eligible, query_budget(1.0, n_c), 0)[0]
    assert chosen.tolist() == [i for i in range(30) if eligible[i]]


def test_unknown_policy_raises():
    with pytest.raises(ValueError):
        Selector("oracle")


@pytest.mark.parametrize("policy", ["random", "entropy", "learned", "learned-trained"])
def test_zero_budget_selects_nothing(policy):
    sel = trained_selector() if policy == "learned-trained" else Selector(policy)
    phi = make_phi(20, seed=2)
    chosen = sel.select(phi, torch.ones(20, dtype=torch.bool), 0, 7)[0]
    assert chosen.numel() == 0


@pytest.mark.parametrize("policy", ["full", "random", "entropy", "learned", "learned-trained"])
def test_no_candidates_selects_nothing(policy):
    sel = trained_selector() if policy == "learned-trained" else Selector(policy)
    chosen = sel.select(make_phi(10, seed=3), torch.zeros(10, dtype=torch.bool), 0, 2)[0]
    assert chosen.numel() == 0


def test_random_is_deterministic_per_seed_and_step():
    phi = make_phi(60, seed=4)
    eligible = make_eligible(60, seed=4)
    a = Selector("random", predictor=PredictorConfig(seed=0))
    b = Selector("random", predictor=PredictorConfig(seed=0))
    torch.manual_seed(123)  # the global RNG must play no part
    sa = a.select(phi, eligible, 10, 5)[0]
    torch.manual_seed(456)
    sb = b.select(phi, eligible, 10, 5)[0]
    assert torch.equal(sa, sb)
    assert torch.equal(a.select(phi, eligible, 10, 5)[0], sa)  # calling again: same draw
    assert not torch.equal(a.select(phi, eligible, 10, 6)[0], sa)  # another step
    c = Selector("random", predictor=PredictorConfig(seed=1))
    assert not torch.equal(c.select(phi, eligible, 10, 5)[0], sa)  # another selector seed
    # The draw is the seeded CPU permutation of A.1 (seed, step).
    cand = eligible.nonzero().squeeze(-1)
    perm = torch.randperm(cand.numel(), generator=seeded_generator(0, 5))[:10]
    assert sa.tolist() == sorted(cand[perm].tolist())


def test_random_is_roughly_uniform_over_candidates():
    phi = make_phi(20, seed=6)
    eligible = torch.ones(20, dtype=torch.bool)
    eligible[[3, 7]] = False
    sel = Selector("random")
    counts = torch.zeros(20)
    for step in range(400):
        counts[sel.select(phi, eligible, 5, step)[0]] += 1
    assert counts[3] == 0 and counts[7] == 0
    expected = 400 * 5 / 18  # ~111 per candidate
    live = counts[eligible]
    assert (live > 0.6 * expected).all() and (live < 1.4 * expected).all(), live


def test_entropy_picks_top_by_mean_entropy_ties_to_lower_index():
    n = 10
    phi = torch.zeros(n, 6)
    phi[:, 2] = torch.tensor([0.5, 0.9, 0.9, 0.1, 0.9, 0.3, 0.95, 0.2, 0.9, 0.0])
    phi[:, 0] = torch.tensor([5.0, 0.0, 0.0, 4.0, 0.0, 3.0, 0.0, 2.0, 0.0, 1.0])  # NLL: a different order
    eligible = torch.ones(n, dtype=torch.bool)
    eligible[2] = False
    sel = Selector("entropy")
    # Top-3 by entropy among eligible: 6 (0.95), then the 0.9 ties 1, 4, 8 -> lowest indices 1, 4.
    assert sel.select(phi, eligible, 3, 0)[0].tolist() == [1, 4, 6]
    assert sel.select(phi, eligible, 1, 0)[0].tolist() == [6]
    # Without entropy: mean NLL (phi[:, 0]) -> 0 (5), 3 (4), 5 (3).
    assert sel.select(phi, eligible, 3, 0, has_entropy=False)[0].tolist() == [0, 3, 5]
    # Independent check on random features: the K largest phi[:, 2] among eligible.
    phi = make_phi(40, seed=8)
    eligible = make_eligible(40, seed=8)
    cand = [i for i in range(40) if eligible[i]]
    want = sorted(sorted(cand, key=lambda i: -float(phi[i, 2]))[:9])
    assert sel.select(phi, eligible, 9, 3)[0].tolist() == want
    want_nll = sorted(sorted(cand, key=lambda i: -float(phi[i, 0]))[:9])
    assert sel.select(phi, eligible, 9, 3, has_entropy=False)[0].tolist() == want_nll


def test_entropy_ties_to_lower_index_on_a_large_batch():
    """Many tied scores (an unstable sort reorders ties once there are ~100 of them)."""
    n = 300
    phi = torch.zeros(n, 6)
    phi[::3, 2] = 1.0  # 100 rows tied at the top score, 200 tied at 0
    eligible = torch.ones(n, dtype=torch.bool)
    eligible[0] = False
    chosen = Selector("entropy").select(phi, eligible, 120, 0)[0]
    # All 99 eligible top rows, then the 21 lowest-index rows among the zeros.
    zeros = [i for i in range(1, n) if i % 3 != 0][:21]
    assert chosen.tolist() == sorted(list(range(3, n, 3)) + zeros)
    cand = torch.arange(n)
    assert top_subset(phi[:, 2], cand, 5).tolist() == [0, 3, 6, 9, 12]


def test_entropy_scores_and_top_subset():
    phi = make_phi(8, seed=9)
    assert torch.equal(entropy_scores(phi, True), phi[:, 2])
    assert torch.equal(entropy_scores(phi, False), phi[:, 0])
    scores = torch.tensor([1.0, 3.0, 3.0, 2.0, 3.0, 0.0])
    cand = torch.tensor([0, 2, 3, 4, 5])
    assert top_subset(scores, cand, 2).tolist() == [2, 4]
    assert top_subset(scores, cand, 3).tolist() == [2, 4, 3]


def test_uniform_subset_without_replacement_and_seeded():
    cand = torch.tensor([2, 5, 7, 11, 13, 17, 19])
    a = uniform_subset(cand, 4, seeded_generator(3, 1))
    b = uniform_subset(cand, 4, seeded_generator(3, 1))
    assert torch.equal(a, b)
    assert len(set(a.tolist())) == 4 and set(a.tolist()) <= set(cand.tolist())
    assert uniform_subset(cand, 0, seeded_generator(3, 1)).numel() == 0
    assert sorted(uniform_subset(cand, 10, seeded_generator(3, 1)).tolist()) == cand.tolist()


def test_learned_subset_top_plus_exploration():
    pred = torch.tensor([0.9, 0.1, 0.8, 0.7, 0.2, 0.6, 0.3, 0.5, 0.4, 0.0])
    cand = torch.arange(10)
    out = learned_subset(pred, cand, budget=4, n_explore=1, generator=seeded_generator(0, 0))
    assert out[:3].tolist() == [0, 2, 3]
    assert out.numel() == 4 and int(out[3]) not in (0, 2, 3)
    # n_explore larger than the budget is capped: all K from exploration.
    out = learned_subset(pred, cand, budget=2, n_explore=5, generator=seeded_generator(0, 0))
    assert out.numel() == 2 and len(set(out.tolist())) == 2


def test_learned_is_uniform_before_first_update():
    phi = make_phi(50, seed=10)
    eligible = make_eligible(50, seed=10)
    for seed in (0, 3):
        learned = Selector("learned", predictor=PredictorConfig(seed=seed))
        rnd = Selector("random", predictor=PredictorConfig(seed=seed))
        for step in (0, 1, 7):
            assert torch.equal(learned.select(phi, eligible, 12, step)[0], rnd.select(phi, eligible, 12, step)[0])
        # Labels below the replay threshold: still no update, still uniform.
        learned.observe(phi[:20], torch.rand(20), 7)
        assert not learned.model.trained and learned.predict(phi) is None
        assert torch.equal(learned.select(phi, eligible, 12, 8)[0], rnd.select(phi, eligible, 12, 8)[0])


def test_learned_after_updates_exploits_top_and_explores_rest():
    sel = trained_selector(seed=0, n_steps=4)
    hits_outside_next = 0
    for step in range(10, 16):
        phi = make_phi(80, seed=step)
        eligible = make_eligible(80, seed=step)
        K = query_budget(0.25, int(eligible.sum()))
        K_e = exploration_count(K, 0.1)
        assert K_e >= 1 and K - K_e >= 1
        chosen = sel.select(phi, eligible, K, step)[0]
        check_valid(chosen, eligible, K)
        pred = sel.predict(phi)  # same normalizer state as inside select
        cand = [i for i in range(80) if eligible[i]]
        ranked = sorted(cand, key=lambda i: -float(pred[i]))
        top = set(ranked[: K - K_e])
        chosen_set = set(chosen.tolist())
        assert top <= chosen_set, "the top K - K_e predicted candidates must all be selected"
        explore = chosen_set - top
        assert len(explore) == K_e and explore <= set(ranked[K - K_e :])
        # Exploration is uniform over the rest, not simply the next-best candidates.
        hits_outside_next += len(explore - set(ranked[K - K_e : K]))
    assert hits_outside_next > 0


def test_learned_selection_independent_of_global_rng_and_rank_agreement():
    """Two ranks (instances) given the same global features make identical selections and end with
    identical predictor parameters, whatever their global RNG states."""
    a = Selector("learned", predictor=PredictorConfig(seed=0, replay_start=16))
    b = Selector("learned", predictor=PredictorConfig(seed=0, replay_start=16))
    for step in range(8):
        phi = make_phi(40, seed=200 + step)
        eligible = make_eligible(40, seed=200 + step)
        K = query_budget(0.5, int(eligible.sum()))
        torch.manual_seed(step)
        sa = a.select(phi, eligible, K, step)[0]
        torch.manual_seed(1000 + step)
        torch.rand(17)
        sb = b.select(phi, eligible, K, step)[0]
        assert torch.equal(sa, sb), step
        u = torch.sin(phi[sa, 0]) + 0.1 * phi[sa, 2]
        a.observe(phi[sa], u, step)
        b.observe(phi[sb], u, step)
    assert a.model.trained and b.model.trained
    for pa, pb in zip(a.model.net.parameters(), b.model.net.parameters()):
        assert torch.equal(pa, pb)
    phi = make_phi(40, seed=300)
    assert torch.equal(a.predict(phi), b.predict(phi))


def test_learned_selector_updates_normalizer_on_candidates_only():
    sel = Selector("learned")
    phi = make_phi(30, seed=11)
    eligible = make_eligible(30, seed=11)
    sel.select(phi, eligible, 5, 0)[0]
    cand = phi[eligible].double()
    torch.testing.assert_close(sel.model.normalizer.mean.double(), cand.mean(0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sel.model.normalizer.var.double(), cand.var(0, unbiased=False), rtol=1e-5, atol=1e-5)


def test_selector_state_dict_round_trip():
    a = trained_selector(seed=0, n_steps=3)
    state = selector_state(a)
    b = Selector("learned", predictor=PredictorConfig(seed=0, replay_start=16))
    import copy

    load_selector_state(b, copy.deepcopy(state))
    phi = make_phi(50, seed=12)
    eligible = make_eligible(50, seed=12)
    assert torch.equal(a.select(phi, eligible, 10, 20)[0], b.select(phi, eligible, 10, 20)[0])
    with pytest.raises(ValueError):
        load_selector_state(Selector("random"), state)


def test_non_learned_policies_observe_nothing():
    for policy in ("full", "random", "entropy"):
        assert Selector(policy).observe(make_phi(4, 0), torch.rand(4), 0) == {}
