"""Unbiased selection, part 2 (opd/selection/selectors.py, opd/maths/loss.py; docs/SELECTION.md): the Horvitz-Thompson estimator
(--estimator ht), the design stratified by prompt (--strata prompt) and the gradient-size inclusion map
(--inclusion-size gradient), each against an independent computation in float64 over many seeded draws."""

import math

import pytest
import torch
from test_training import small_config

import opd.cli
import opd.run
import train
from opd.config import TrainConfig
from opd.maths.family import aggregation_weights, loss_denominator
from opd.selection.designs import (
    inclusion_probabilities,
    inclusion_sizes,
    sample_stratified,
    sample_with_probabilities,
    stratified_probabilities,
    stratum_allocation,
)
from opd.selection.designs import selector as Selector  # a Selector with the design its flags name
from opd.engine.synthetic import fixed_rollouts

F64 = torch.float64


class OneRank:
    """The accelerator's part loss_denominator uses, for one process: reduce is the identity."""

    device = torch.device("cpu")

    @staticmethod
    def reduce(t, op):
        return t


def toy_rows(seed: int, n: int = 40, T: int = 6):
    """Rows whose per-token loss D grows with a score that tracks it, of lengths 1..T (the bias case)."""
    g = torch.Generator().manual_seed(seed)
    loss = torch.rand(n, generator=g, dtype=F64) ** 2  # (n,) each row's D, the same at each of its tokens
    lengths = torch.randint(1, T + 1, (n,), generator=g)  # (n,)
    mask = torch.arange(T)[None, :] < lengths[:, None]  # (n, T)
    score = loss + 0.05 * torch.rand(n, generator=g, dtype=F64)  # (n,)
    return loss, lengths, mask, score


def explicit_estimates(loss, lengths, chosen, pi_of):
    """HT and Hajek estimates of the full-query token mean for one S, as sums written out (no library code)."""
    total_tokens = sum(int(t) for t in lengths)
    num = sum(float(loss[i]) * int(lengths[i]) / float(pi_of[i]) for i in chosen)
    den = sum(int(lengths[i]) / float(pi_of[i]) for i in chosen)
    return num / total_tokens, num / den


def test_horvitz_thompson_is_unbiased_where_the_hajek_ratio_is_not():
    """n = 40, K = 10, eps 0.1, score tracking the loss: over 10,000 draws the HT estimate's mean is within 4 standard
    errors of the full-query token mean; the Hajek ratio's mean is more than 20 of them away (its O(1/K) bias: +22%
    here, 42 standard errors). The
    training path's weights (loss_denominator with T_C, aggregation_weights) give the explicit HT sum on every draw."""
    loss, lengths, mask, score = toy_rows(8)
    n, k = loss.numel(), 10
    full = float((loss * lengths).sum() / lengths.sum())  # the full-query token mean
    pi = inclusion_probabilities(score, k, 0.1)
    t_c = float(lengths.sum())
    gen = torch.Generator().manual_seed(2)
    ht, hajek = [], []
    per_token = loss[:, None].expand(mask.shape)  # (n, T)
    for d in range(10_000):
        s = sample_with_probabilities(pi, gen)
        a, b = explicit_estimates(loss, lengths, s.tolist(), pi)
        ht.append(a)
        hajek.append(b)
        if d < 50:  # the library's path: Eq. 11's weights with the Horvitz-Thompson denominator
            w = torch.ones(n, dtype=F64)
            w[s] = 1.0 / pi[s]
            z = torch.zeros(n, dtype=F64)
            z[s] = 1.0
            denominator = loss_denominator(OneRank, "token-mean", lengths, s, w, full_tokens=t_c)
            assert denominator == t_c
            weights = aggregation_weights("token-mean", z, mask, denominator, F64, w)  # (n, T)
            assert math.isclose(float((weights * per_token).sum()), a, rel_tol=1e-12)
    ht, hajek = torch.tensor(ht, dtype=F64), torch.tensor(hajek, dtype=F64)
    se_ht, se_hajek = float(ht.std()) / math.sqrt(len(ht)), float(hajek.std()) / math.sqrt(len(hajek))
    assert abs(float(ht.mean()) - full) <= 4 * se_ht
    assert abs(float(hajek.mean()) - full) > 20 * se_hajek  # biased, and the test would see it
    assert float(hajek.mean()) > full  # upward: the favoured rows carry the large losses


def test_the_ht_denominator_needs_a_token_of_s_and_applies_to_the_token_mean_only():
    lengths = torch.tensor([3, 0, 2, 5])
    w = torch.tensor([2.0, 1.0, 4.0, 1.0], dtype=F64)
    assert loss_denominator(OneRank, "token-mean", lengths, torch.tensor([0, 2]), w, full_tokens=10.0) == 10.0
    assert loss_denominator(OneRank, "token-mean", lengths, torch.tensor([1]), w, full_tokens=10.0) == 0  # no token
    assert loss_denominator(OneRank, "token-mean", lengths, torch.tensor([], dtype=torch.long), w, full_tokens=10.0) == 0
    assert loss_denominator(OneRank, "token-mean", lengths, torch.tensor([0, 2]), w) == 2 * 3 + 4 * 2  # Hajek
    assert loss_denominator(OneRank, "token-sum", lengths, torch.tensor([0, 2]), w, full_tokens=10.0) == 14  # no mean
    sel = Selector("entropy", 0.1, unbiased=True, estimator="ht")
    eligible = torch.tensor([True, False, True, True])
    assert sel.full_query_tokens(lengths, eligible) == 10.0
    assert Selector("entropy", 0.1, unbiased=True).full_query_tokens(lengths, eligible) is None
    assert Selector("random").full_query_tokens(lengths, eligible) is None


def water_level(counts: list[int], k: int) -> list[float]:
    """The even allocation by bisection on the level lambda (sum_h min(c_h, lambda) = k): independent of the
    library's pass-by-pass fill."""
    lo, hi = 0.0, float(max(counts))
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(min(c, mid) for c in counts) < k else (lo, mid)
    return [min(c, hi) for c in counts]


@pytest.mark.parametrize("counts,k", [([2] * 32, 16), ([8] * 8, 16), ([1, 2, 8], 4), ([1, 2, 8], 5), ([1, 2, 8], 11),
                                      ([3, 1, 7, 2, 5], 9), ([4, 4, 1], 0)])  # fmt: skip
def test_the_even_allocation_is_the_water_level(counts, k):
    a = stratum_allocation(torch.tensor(counts), k)
    assert a.dtype == F64 and abs(float(a.sum()) - k) <= 1e-12 * max(1, k)
    for got, want, c in zip(a.tolist(), water_level(counts, k), counts):
        assert abs(got - want) <= 1e-9 and 0 <= got <= c
    with pytest.raises(ValueError):
        stratum_allocation(torch.tensor(counts), sum(counts) + 1)


def draw_many(low, high, stratum, r, draws, seed):
    """Inclusion counts per row and, per draw, the rows drawn of each stratum."""
    gen = torch.Generator().manual_seed(seed)
    n_strata = r.numel()
    counts = torch.zeros(low.numel(), dtype=F64)
    per_stratum = torch.zeros(draws, n_strata, dtype=torch.long)
    chosen = []
    for d in range(draws):
        s = sample_stratified(low, high, stratum, r, gen)
        counts[s] += 1
        per_stratum[d] = torch.bincount(stratum[s], minlength=n_strata)
        chosen.append(s)
    return counts, per_stratum, chosen


@pytest.mark.parametrize("sizes_of,k,mix", [((2,) * 16, 8, 0.1), ((8,) * 4, 8, 0.1), ((1, 3, 5, 2, 9), 7, 0.3),
                                            ((4, 1, 6), 10, 0.5), ((2,) * 6, 6, 0.1)])  # fmt: skip
def test_stratified_selection_has_exact_per_stratum_probabilities_and_exactly_k_rows(sizes_of, k, mix):
    """Per stratum h: its rows' pi sum to its share a_h; each pi_i is (1 - r_h) pi_i(f_h) + r_h pi_i(f_h + 1) with
    pi_i(n) the stratum's own exactly-n probabilities; over 6,000 draws every row's inclusion frequency is within 5
    binomial standard errors of pi_i, every stratum draws f_h or f_h + 1 rows (f_h + 1 with frequency r_h), and
    every draw has exactly k distinct rows. Strata given out of order (ids interleaved)."""
    g = torch.Generator().manual_seed(len(sizes_of) + k)
    stratum = torch.cat([torch.full((c,), h) for h, c in enumerate(sizes_of)])
    stratum = stratum[torch.randperm(stratum.numel(), generator=g)]  # (n,) interleaved
    scores = torch.rand(stratum.numel(), generator=g, dtype=F64) ** 3
    pi, low, high, r = stratified_probabilities(scores, stratum, k, mix)
    share = [round(a, 9) for a in water_level(list(sizes_of), k)]
    for h, a_h in enumerate(share):
        rows = stratum == h
        f = math.floor(a_h + 1e-9)
        assert abs(float(pi[rows].sum()) - a_h) <= 1e-9
        assert abs(float(r[h]) - (a_h - f)) <= 1e-9
        want = (1 - (a_h - f)) * inclusion_probabilities(scores[rows], f, mix)
        if a_h - f > 1e-9:
            want = want + (a_h - f) * inclusion_probabilities(scores[rows], f + 1, mix)
        torch.testing.assert_close(pi[rows], want, rtol=0, atol=1e-12)
    draws = 6_000
    counts, per_stratum, chosen = draw_many(low, high, stratum, r, draws, seed=5)
    assert all(s.numel() == k and s.unique().numel() == k for s in chosen)  # exactly k, never more
    freq = counts / draws
    se = (pi * (1 - pi) / draws).sqrt()
    assert bool(((freq - pi).abs() <= 5 * se + 1e-12).all()), (freq, pi)
    for h, a_h in enumerate(share):
        f = math.floor(a_h + 1e-9)
        got = per_stratum[:, h]
        assert bool(((got == f) | (got == f + 1)).all())
        p_extra = a_h - f
        assert abs(float((got == f + 1).double().mean()) - p_extra) <= 5 * math.sqrt(p_extra * (1 - p_extra) / draws) + 1e-12


@pytest.mark.slow  # a Monte Carlo check over many draws (about 26 s): -m slow
def test_stratified_ht_recovers_the_full_query_mean():
    """The letter task's shape (32 prompts x 2 rollouts, K = 16: half the prompts get one row) and the explain task's
    (8 x 8, K = 16): over 6,000 draws the stratified HT estimate's mean is within 4 standard errors of the
    full-query token mean, with the score tracking the loss."""
    for prompts, rollouts, seed in ((32, 2, 1), (8, 8, 2)):
        n = prompts * rollouts
        loss, lengths, _, score = toy_rows(seed, n)
        stratum = torch.arange(n) // rollouts
        full = float((loss * lengths).sum() / lengths.sum())
        pi, low, high, r = stratified_probabilities(score, stratum, 16, 0.1)
        gen = torch.Generator().manual_seed(seed)
        ht = []
        for _ in range(6_000):
            s = sample_stratified(low, high, stratum, r, gen)
            ht.append(explicit_estimates(loss, lengths, s.tolist(), pi)[0])
        ht = torch.tensor(ht, dtype=F64)
        assert abs(float(ht.mean()) - full) <= 4 * float(ht.std()) / math.sqrt(len(ht)), prompts


def poisson_variance(pi: torch.Tensor, norms: torch.Tensor) -> float:
    """sum_i (1 / pi_i - 1) ||g_i||^2: the HT estimate's squared error under independent inclusions."""
    return float(((1.0 / pi - 1.0) * norms**2).sum())


def test_pi_proportional_to_the_gradient_size_minimises_the_variance():
    """The rule behind --inclusion-size gradient: with pi proportional to ||g_i|| (capped at 1) the variance
    sum_i (1 / pi_i - 1) ||g_i||^2 is below that of 2,000 random feasible pi (the same sum, in (0, 1]); under the
    sampler itself (systematic, exactly K) the measured E||G^ - G||^2 over 20,000 draws is lower with pi ~ ||g_i||
    than with pi ~ ||g_i||^2 (a score that overshoots) or uniform pi. The map's values: T_i sqrt(max(score, 0))."""
    g = torch.Generator().manual_seed(3)
    n, k, dim = 24, 6, 5
    grads = torch.randn(n, dim, generator=g, dtype=F64) * (torch.rand(n, 1, generator=g, dtype=F64) ** 2 + 0.05)
    norms = grads.norm(dim=-1)  # (n,)
    best = inclusion_probabilities(norms, k, 0.0)
    for _ in range(2000):
        x = torch.rand(n, generator=g, dtype=F64) + 0.01
        other = inclusion_probabilities(x, k, 0.0)
        assert poisson_variance(best, norms) <= poisson_variance(other, norms) + 1e-12
    total = grads.sum(0)
    measured = {}
    for name, pi in (("size", best), ("square", inclusion_probabilities(norms**2, k, 0.0)),
                     ("uniform", torch.full((n,), k / n, dtype=F64))):  # fmt: skip
        gen = torch.Generator().manual_seed(9)
        err = 0.0
        for _ in range(20_000):
            s = sample_with_probabilities(pi, gen)
            err += float(((grads[s] / pi[s, None]).sum(0) - total).pow(2).sum())
        measured[name] = err / 20_000
    assert measured["size"] < 0.8 * measured["square"] and measured["size"] < 0.8 * measured["uniform"], measured
    scores = torch.tensor([0.25, -1.0, 4.0, 0.0])
    lengths = torch.tensor([4.0, 7.0, 3.0, 2.0])
    assert inclusion_sizes(scores, lengths, "gradient").tolist() == [2.0, 0.0, 6.0, 0.0]
    assert inclusion_sizes(scores, lengths, "score") is scores  # today's map: the scores as they are


def test_the_selector_samples_the_design_and_never_exceeds_the_budget():
    """Selector(--strata prompt): over random batches (eligibility, prompts of several sizes, every K from 0 to |C|)
    S has exactly K rows of C and its last_pi are the stratified design's pi of those rows (T_i-sized under
    --inclusion-size gradient); the same step gives the same S (seeded), another step another."""
    g = torch.Generator().manual_seed(6)
    for trial in range(30):
        n = int(torch.randint(4, 40, (1,), generator=g))
        phi = torch.rand(n, 6, generator=g)
        phi[:, 3] = torch.randint(1, 30, (n,), generator=g).float()  # T_i
        eligible = torch.rand(n, generator=g) > 0.2
        prompt_of = torch.randint(100, 100 + max(1, n // 3), (n,), generator=g)
        c = eligible.nonzero().squeeze(-1)
        size = "gradient" if trial % 2 else "score"
        for k in sorted({0, 1, c.numel() // 2, c.numel()}):
            sel = Selector("entropy", 0.2, unbiased=True, strata="prompt", inclusion_size=size, estimator="ht")
            s, pi_s = sel.select(phi, eligible, k, trial, prompt_of=prompt_of)
            assert s.numel() == k and bool(eligible[s].all()) and s.unique().numel() == k
            stratum = torch.unique(prompt_of[c], return_inverse=True)[1]
            x = phi[c, 3].double() * phi[c, 2].double().sqrt() if size == "gradient" else phi[c, 2]
            pi = stratified_probabilities(x, stratum, k, 0.2)[0]
            want = {int(i): float(p) for i, p in zip(c, pi)}
            assert pi_s.tolist() == pytest.approx([want[int(i)] for i in s], abs=1e-12)
    a = Selector("learned", 0.1, unbiased=True, strata="prompt")
    b = Selector("learned", 0.1, unbiased=True, strata="prompt")
    assert a.select(phi, eligible, 3, 7, prompt_of=prompt_of)[0].tolist() == b.select(phi, eligible, 3, 7, prompt_of=prompt_of)[0].tolist()
    draws = {tuple(Selector("entropy", 0.1, unbiased=True, strata="prompt").select(phi, eligible, 3, step,
                                                                                   prompt_of=prompt_of)[0].tolist())
             for step in range(20)}  # fmt: skip
    assert len(draws) > 1
    with pytest.raises(ValueError, match="prompt_of"):
        Selector("entropy", 0.1, unbiased=True, strata="prompt").select(phi, eligible, 2, 0)[0]


@pytest.mark.parametrize("flags,message", [
    (dict(estimator="ht"), "--estimator ht applies to sampled selection: it needs --unbiased"),
    (dict(strata="prompt", policy="entropy"), "--strata prompt applies to sampled selection"),
    (dict(inclusion_size="gradient"), "--inclusion-size gradient applies to sampled selection"),
    (dict(unbiased=True, estimator="horvitz"), "--estimator 'horvitz': choose one of hajek, ht"),
    (dict(unbiased=True, strata="answer"), "--strata 'answer': choose one of none, prompt"),
    (dict(unbiased=True, inclusion_size="norm"), "--inclusion-size 'norm': choose one of score, gradient"),
    (dict(unbiased=True, max_per_prompt=2), "--strata prompt spreads an unbiased S over the prompts"),
    (dict(method="dapd", unbiased=True, estimator="ht"), "--method dapd: --estimator does not apply"),
])  # fmt: skip
def test_the_new_flags_are_checked(flags, message):
    problems = TrainConfig(**flags).problems()
    assert any(message in p for p in problems), problems
    assert not TrainConfig(unbiased=True, estimator="ht", strata="prompt", inclusion_size="gradient").problems()
    assert not TrainConfig(method="dapd", unbiased=True, strata="prompt").problems()


def test_a_bad_estimator_is_one_line(tmp_path):
    with pytest.raises(opd.cli.UserError, match="--estimator ht applies to sampled selection"):
        train.main(["--preset", "tiny", "--estimator", "ht", "--out", str(tmp_path)])


@pytest.mark.parametrize("strata", ["none", "prompt"])
def test_one_training_step_takes_the_horvitz_thompson_form(tmp_path, tiny, strata):
    """One step of --policy entropy --unbiased --estimator ht (float64): the objective's batch carries T_C, the
    tokens of every candidate; the ledger's loss is sum_{i in S} (1 / pi_i) sum_t D_it / T_C of the per-token D on
    full logits (an explicit sum), not the Hajek ratio; with --strata prompt every prompt's rows in S are the floor
    or the ceiling of its even share and |S| = K."""
    from float64 import float64_model
    from test_training import divergence_before_update, perturb

    float64_model()
    run = opd.run.Run(small_config(tmp_path, policy="entropy", unbiased=True, estimator="ht", strata=strata, rho=0.5,
                                    dtype="float64"))  # fmt: skip
    perturb(run.teacher.model)
    rollouts = fixed_rollouts(run, 0)
    records = run.prompts.of_step(0)
    index = rollouts.prompt_index.tolist()
    d = divergence_before_update(run, rollouts, records).double()  # (N, T) Eq. 3, before the update
    seen = {}
    step_batch, select = run.prompts.batch, run.selector.select
    run.prompts.batch = lambda *a, **kw: seen.setdefault("batch", step_batch(*a, **kw))
    run.selector.select = lambda *a, **kw: seen.setdefault("selection", select(*a, **kw))
    row = run.step(0, rollouts)
    batch, pi = seen["batch"], seen["selection"][1]
    eligible = torch.tensor([records[j].eligible for j in index])
    t_c = float(rollouts.lengths[eligible].sum())
    assert batch.full_tokens == t_c and row["candidate_tokens"] == t_c
    mask = rollouts.response_mask
    ht = sum(float((d[i] * mask[i]).sum()) / float(p) for i, p in zip(batch.selected.tolist(), pi.tolist())) / t_c
    hajek_den = sum(float(mask[i].sum()) / float(p) for i, p in zip(batch.selected.tolist(), pi.tolist()))
    assert row["loss"] == pytest.approx(ht, rel=1e-10)
    assert row["loss"] != pytest.approx(ht * t_c / hajek_den, rel=1e-6)  # not the Hajek form
    assert row["selected"] == row["budget"] == batch.selected.numel() > 0
    if strata == "prompt":
        counts = torch.bincount(rollouts.prompt_index[eligible]).tolist()
        share = water_level([c for c in counts if c], row["budget"])
        got = torch.bincount(rollouts.prompt_index[batch.selected], minlength=len(counts)).tolist()
        got = [g_ for g_, c in zip(got, counts) if c]
        assert all(math.floor(a + 1e-9) <= x <= math.ceil(a - 1e-9) for x, a in zip(got, share)), (got, share)


def test_the_audit_takes_the_horvitz_thompson_form(tmp_path, tiny):
    """harness.audit.opd_gradient with T_C is the Hajek-form gradient times sum_S w_i T_i / T_C (float64): the two
    estimators point the same way on one draw and differ in length."""
    from float64 import float64_model

    from harness import audit

    float64_model()
    run = opd.run.Run(small_config(tmp_path, policy="entropy", rho=0.5, dtype="float64"))
    ctx = audit.AuditContext.of(run)
    records = run.prompts.of_step(0)
    ro = fixed_rollouts(run, 0)
    eligible = torch.tensor([records[j].eligible for j in ro.prompt_index.tolist()])
    held = audit.HeldBatch(records, ro, run.prompts.student(records), torch.zeros(len(ro), 6), eligible, None)
    c = eligible.nonzero().squeeze(-1)
    s = c[::3]
    w = torch.linspace(1.5, 6.0, s.numel(), dtype=F64)
    t_c = float(ro.lengths[c].sum())
    g_hajek = audit.opd_gradient(ctx, held, s, w)
    g_ht = audit.opd_gradient(ctx, held, s, w, t_c)
    scale = float((w * ro.lengths[s].double()).sum()) / t_c
    assert float(g_hajek.norm()) > 0 and abs(scale - 1) > 0.05
    torch.testing.assert_close(g_ht, g_hajek * scale, rtol=1e-10, atol=1e-12 * float(g_hajek.abs().max()))
