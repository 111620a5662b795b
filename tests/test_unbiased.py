"""Budgeted selection that does not bias the gradient (opd/selection/selectors.py): inclusion probabilities, the exactly-K
sampler, Eq. 11's Hajek form, the per-prompt cap, and --unbiased through the training loop."""

import json
import math

import pytest
import torch
from test_training import _run_worker, small_config

import opd.cli
import opd.run
import train
from opd.maths.family import budgeted_loss
from opd.loop.ledger import read_ledger
from opd.engine.rollout import seeded_generator
from opd.selection.designs import capped, inclusion_probabilities, sample_with_probabilities
from opd.selection.designs import selector as Selector  # a Selector with the design its flags name
from opd.selection.selectors import query_budget
from opd.engine.synthetic import fixed_rollouts

F64 = torch.float64


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mix", [0.0, 0.1, 0.5])
def test_inclusion_probabilities_sum_to_k_are_capped_and_grow_with_the_score(seed, mix):
    g = torch.Generator().manual_seed(seed)
    n = 30
    scores = torch.rand(n, generator=g, dtype=F64) ** 4 - 0.1  # a few large, several negative (count as 0)
    scores[seed] = 50.0  # an outlier that must be capped at 1
    for k in (1, 5, 12, 29, 30):
        pi = inclusion_probabilities(scores, k, mix)
        assert pi.dtype == F64 and pi.shape == (n,)
        assert abs(float(pi.sum()) - k) <= 1e-12 * n
        assert bool((pi >= 0).all()) and bool((pi <= 1 + 1e-15).all())
        order = torch.argsort(scores.clamp(min=0), stable=True)
        assert bool((pi[order].diff() >= -1e-15).all())  # non-decreasing in the score
        # independent form: uncapped rows are c p_i for one c; the capped rows are the largest p
        s = scores.clamp(min=0)
        p = (1 - mix) * s / s.sum() + mix / n
        free = pi < 1 - 1e-12
        if free.sum() > 1 and p[free].min() > 0:
            ratio = pi[free] / p[free]
            assert float(ratio.max() - ratio.min()) <= 1e-9 * float(ratio.max())
        if (~free).any() and free.any():
            assert float(p[~free].min()) >= float(p[free].max()) - 1e-15
    assert inclusion_probabilities(torch.full((8,), -1.0), 3, 0.1).tolist() == [3 / 8] * 8  # all non-positive
    assert inclusion_probabilities(torch.zeros(4), 0).tolist() == [0.0] * 4
    with pytest.raises(ValueError):
        inclusion_probabilities(torch.ones(3), 4)


def test_the_sampler_draws_exactly_k_distinct_rows_with_their_inclusion_probabilities():
    """Empirical inclusion frequencies over 20,000 draws within 5 binomial standard errors of pi."""
    g = torch.Generator().manual_seed(3)
    scores = torch.rand(12, generator=g, dtype=F64) ** 3
    pi = inclusion_probabilities(scores, 4, 0.1)
    draws = 20_000
    counts = torch.zeros(12, dtype=F64)
    gen = torch.Generator().manual_seed(11)
    for _ in range(draws):
        s = sample_with_probabilities(pi, gen)
        assert s.numel() == 4 and s.unique().numel() == 4
        counts[s] += 1
    freq = counts / draws
    se = (pi * (1 - pi) / draws).sqrt()
    assert bool(((freq - pi).abs() <= 5 * se + 1e-12).all()), (freq, pi)
    capped_pi = inclusion_probabilities(torch.tensor([100.0, 1, 1, 1, 1]), 2, 0.0)  # row 0 capped at 1: always drawn
    assert capped_pi[0] == 1.0 and all(0 in sample_with_probabilities(capped_pi, gen).tolist() for _ in range(200))


def test_rows_with_zero_inclusion_probability_are_never_drawn(monkeypatch):
    """Without exploration a row scored <= 0 gets pi = 0 and must never be drawn (its weight would be 1 / 0), also
    where the last point falls past the positive rows' rounded cumsum: ten rows of pi = 0.1 end at
    0.9999999999999999 < 1 = k, and the largest float64 below 1 as the uniform u (a value torch.rand can return)
    used to land on a trailing pi = 0 row. The search skips them, over seeds that put zero rows last."""
    pi = torch.cat([torch.full((10,), 0.1, dtype=F64), torch.zeros(5, dtype=F64)])
    assert float(torch.cumsum(pi[:10], 0)[-1]) < 1.0 and round(float(pi.sum())) == 1
    u = 1.0 - 2.0**-53  # the largest float64 in [0, 1)
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.tensor([u], dtype=F64))
    last_zero = 0
    for seed in range(60):
        perm = torch.randperm(15, generator=torch.Generator().manual_seed(seed))
        last_zero += int(pi[perm[-1]] == 0)
        s = sample_with_probabilities(pi, torch.Generator().manual_seed(seed))
        assert s.numel() == 1 and bool((pi[s] > 0).all()), seed
        assert s.tolist() == [int(perm[pi[perm] > 0][-1])]  # the point u lies in the last positive row's interval
    assert last_zero > 10  # the case that used to draw a pi = 0 row was exercised
    monkeypatch.undo()
    scores = torch.tensor([3.0, -1.0, 0.0, 2.0, 1.0, -2.0], dtype=F64)
    pi = inclusion_probabilities(scores, 2, 0.0)
    assert pi[[1, 2, 5]].tolist() == [0.0, 0.0, 0.0]
    gen = torch.Generator().manual_seed(1)
    assert all(set(sample_with_probabilities(pi, gen).tolist()) <= {0, 3, 4} for _ in range(2000))


def test_non_finite_scores_of_unbiased_selection_are_a_clear_error(monkeypatch):
    """NaN or infinite scores stop unbiased selection with a RuntimeError naming their source and the remedy (no
    silent fallback); inclusion_probabilities alone raises a ValueError that counts them."""
    g = torch.Generator().manual_seed(4)
    phi = torch.rand(12, 6, generator=g)
    eligible = torch.ones(12, dtype=torch.bool)
    bad = phi.clone()
    bad[3, 2] = float("nan")
    with pytest.raises(RuntimeError, match=r"step 5: .*1 of 12 candidates' scores are NaN or infinite .*entropy"):
        Selector("entropy", 0.1, unbiased=True).select(bad, eligible, 3, 5)[0]
    bad[3, 0] = float("inf")
    with pytest.raises(RuntimeError, match=r"mean token NLL"):
        Selector("entropy", 0.1, unbiased=True).select(bad, eligible, 3, 5, has_entropy=False)[0]
    learned = Selector("learned", 0.1, unbiased=True)
    learned.model.updates = 1  # as after f_psi's first update
    monkeypatch.setattr(learned.model, "predict", lambda p: torch.full((p.shape[0],), float("nan")))
    with pytest.raises(RuntimeError, match=r"utility predictor f_psi's outputs .*--selector-lr"):
        learned.select(phi, eligible, 3, 0)[0]
    with pytest.raises(ValueError, match="2 of 3 are NaN or infinite"):
        inclusion_probabilities(torch.tensor([1.0, float("nan"), -float("inf")]), 1, 0.1)


def test_the_budget_is_checked_without_assert(monkeypatch):
    """|S| <= K is an explicit check (a RuntimeError, kept under python -O), and the per-prompt cap never exceeds a
    budget of 0 (K = 0, or the exploit part of K - K_e = 0 rows, used to return a cap's worth of rows)."""
    import opd.selection.selectors

    order, prompts = torch.tensor([5, 4, 3, 2, 1, 0]), torch.tensor([0, 0, 0, 1, 1, 1])
    assert capped(order, 0, prompts, 2).tolist() == [] and capped(order, 0, None, 0).tolist() == []
    phi, eligible = torch.rand(6, 6, generator=torch.Generator().manual_seed(2)), torch.ones(6, dtype=torch.bool)
    for policy, budget in (("random", 0), ("entropy", 0), ("learned", 1)):  # learned: K_e = ceil(0.1) = 1
        selector = Selector(policy, 0.1, max_per_prompt=2)
        if policy == "learned":
            selector.model.updates = 1
        assert selector.select(phi, eligible, budget, 0, prompt_of=prompts)[0].numel() <= budget
    monkeypatch.setattr(opd.selection.selectors, "uniform_subset", lambda candidates, n, generator: candidates)  # broken
    with pytest.raises(RuntimeError, match=r"the query budget was exceeded: \|S\| = 6 > K = 2"):
        Selector("random").select(phi, eligible, 2, 0)[0]


def test_weighted_eq_11_is_the_hajek_sum_written_out():
    g = torch.Generator().manual_seed(5)
    per_token = torch.rand(6, 4, generator=g, dtype=F64)
    mask = torch.rand(6, 4, generator=g) > 0.3
    selected = torch.tensor([1, 0, 1, 1, 0, 1], dtype=F64)
    w = torch.tensor([4.0, 9.0, 1.5, 2.0, 7.0, 1.25], dtype=F64)
    num = den = 0.0
    for i in range(6):
        for t in range(4):
            if selected[i] and mask[i, t]:
                num += float(w[i] * per_token[i, t])
                den += float(w[i])
    assert math.isclose(float(budgeted_loss(per_token, selected, mask, sample_weights=w)), num / den, rel_tol=1e-14)
    plain = budgeted_loss(per_token, selected, mask)  # without weights: today's Eq. 11
    assert math.isclose(float(plain), float((per_token * mask * selected[:, None]).sum() / (mask * selected[:, None]).sum()),
                        rel_tol=1e-14)  # fmt: skip


def test_averaging_the_weighted_loss_over_draws_recovers_the_full_query_mean_and_the_top_k_does_not():
    """Rows whose utility (the score) correlates with their loss: the top-K's loss is far above the full-query token
    mean (2.7x here); the sampled S's Horvitz-Thompson sums (numerator and denominator of the Hajek form) are unbiased,
    their averages within 5 standard errors of the full sums. The Hajek ratio itself is consistent, not unbiased: with
    weights up to 1 / (rho eps) = 30 its average is 21% above the full mean at eps = 0.1 and 7% at 0.5 (measured),
    still a small fraction of the top-K's error."""
    g = torch.Generator().manual_seed(8)
    n, T, k = 40, 6, 10
    loss = torch.rand(n, generator=g, dtype=F64) ** 2  # per-row D, the same for each of its tokens
    lengths = torch.randint(1, T + 1, (n,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    per_token = loss[:, None].expand(n, T)
    score = loss + 0.05 * torch.rand(n, generator=g, dtype=F64)  # the selector's score tracks the loss
    full = float(budgeted_loss(per_token, torch.ones(n, dtype=F64), mask))
    top = torch.zeros(n, dtype=F64)
    top[torch.argsort(score, descending=True)[:k]] = 1.0
    top_k = float(budgeted_loss(per_token, top, mask))
    pi = inclusion_probabilities(score, k, 0.1)
    gen = torch.Generator().manual_seed(2)
    hajek, ht_num, ht_den = [], [], []
    for _ in range(20_000):
        s = sample_with_probabilities(pi, gen)
        z = torch.zeros(n, dtype=F64)
        z[s] = 1.0
        w = 1.0 / pi
        hajek.append(float(budgeted_loss(per_token, z, mask, sample_weights=w)))
        ht_num.append(float((w * z * loss * lengths).sum()))
        ht_den.append(float((w * z * lengths).sum()))
    num, den = torch.tensor(ht_num), torch.tensor(ht_den)
    assert abs(float(num.mean()) - float((loss * lengths).sum())) <= 5 * float(num.std()) / math.sqrt(len(num))
    assert abs(float(den.mean()) - float(lengths.sum())) <= 5 * float(den.std()) / math.sqrt(len(den))
    assert top_k > 2 * full  # the top-K's estimate is biased
    assert abs(sum(hajek) / len(hajek) - full) < 0.2 * (top_k - full)  # the ratio's O(1 / K) bias: far smaller


def test_the_per_prompt_cap_keeps_preference_order_within_the_cap():
    order = torch.tensor([5, 4, 3, 2, 1, 0])
    prompts = torch.tensor([0, 0, 0, 1, 1, 1])  # rows 0-2 prompt 0, rows 3-5 prompt 1
    assert capped(order, 4, prompts, 1).tolist() == [5, 2]  # one per prompt: fewer than asked
    assert capped(order, 3, prompts, 2).tolist() == [5, 4, 2]
    assert capped(order, 3, prompts, 0).tolist() == [5, 4, 3]  # no cap
    g = torch.Generator().manual_seed(0)
    phi = torch.rand(24, 6, generator=g)
    prompt_of = torch.arange(24) // 8  # 3 prompts x 8 rows
    eligible = torch.ones(24, dtype=torch.bool)
    for policy in ("random", "entropy", "full"):
        sel = Selector(policy, max_per_prompt=2).select(phi, eligible, 24 if policy == "full" else 6, 0, prompt_of=prompt_of)[0]
        assert sel.numel() == 6 and torch.bincount(prompt_of[sel]).tolist() == [2, 2, 2]


def test_unbiased_selection_is_seeded_by_the_step_and_keeps_the_budget():
    g = torch.Generator().manual_seed(4)
    phi = torch.rand(32, 6, generator=g)
    eligible = torch.rand(32, generator=g) > 0.25
    k = query_budget(0.25, int(eligible.sum()))
    a, b = Selector("entropy", 0.1, unbiased=True), Selector("entropy", 0.1, unbiased=True)
    (s1, pi1), (s2, pi2) = a.select(phi, eligible, k, 3), b.select(phi, eligible, k, 3)
    assert s1.tolist() == s2.tolist() and pi1.tolist() == pi2.tolist()
    assert s1.numel() == k and eligible[s1].all()
    pi = inclusion_probabilities(phi[eligible.nonzero().squeeze(-1), 2], k, 0.1)
    want = eligible.nonzero().squeeze(-1)[sample_with_probabilities(pi, seeded_generator(0, 3))].sort()
    assert s1.tolist() == want.values.tolist() and pi1.tolist() == pi[sample_with_probabilities(
        pi, seeded_generator(0, 3))][want.indices].tolist()  # fmt: skip
    assert Selector("entropy", unbiased=True).select(phi, eligible, k, 4)[0].tolist() != s1.tolist()
    with pytest.raises(ValueError, match="entropy or learned"):
        Selector("random", unbiased=True)


def test_unbiased_training_weighs_each_selected_row_by_one_over_pi(tmp_path, tiny):
    """One step of --policy entropy --unbiased: the objective gets w_i = 1 / pi_i for S's rows, and the ledger's loss
    is Eq. 11's Hajek form of the per-token D the objective computed (its own sums), min_pi and max_weight recorded."""
    from float64 import float64_model
    from test_training import perturb

    from opd.models.chat import collate
    from opd.maths.family import topk_divergence
    from opd.models.chat import response_logits

    float64_model()
    run = opd.run.Run(small_config(tmp_path, policy="entropy", unbiased=True, rho=0.5, dtype="float64"))
    perturb(run.teacher.model)  # D far above rounding
    rollouts = fixed_rollouts(run, 0)
    records = run.prompts.of_step(0)
    index = rollouts.prompt_index.tolist()
    s_in = collate([run.prompts.student(records)[j] for j in index], run.ids["pad"], rollouts.response_ids, rollouts.response_mask)
    crop = [run.prompts.encode("crop", r, 0) if r.eligible else run.prompts.student([r])[0] for r in records]  # (no crop: not in C)
    t_in = collate([crop[j] for j in index], run.ids["pad"], rollouts.response_ids, rollouts.response_mask)
    with torch.no_grad():
        width = rollouts.response_ids.shape[1]
        d = topk_divergence(response_logits(run.model, s_in, width), response_logits(run.teacher.model, t_in, width),
                            run.cfg.loss.topk, run.cfg.loss.alpha)  # (N, T) Eq. 3 on full logits, before the update  # fmt: skip
    seen = {}
    step_batch, select = run.prompts.batch, run.selector.select

    def spy(*args, **kw):
        seen["batch"] = step_batch(*args, **kw)
        return seen["batch"]

    run.prompts.batch = spy
    run.selector.select = lambda *a, **kw: seen.setdefault("selection", select(*a, **kw))
    row = run.step(0, rollouts)
    batch = seen["batch"]
    pi = seen["selection"][1]
    z = torch.zeros(len(rollouts), dtype=F64)
    z[batch.selected] = 1.0
    want = budgeted_loss(d, z, rollouts.response_mask, sample_weights=batch.weights)  # Eq. 11's Hajek form
    assert row["loss"] == pytest.approx(float(want), rel=1e-10)
    assert row["loss"] != pytest.approx(float(budgeted_loss(d, z, rollouts.response_mask)), rel=1e-6)  # not the plain
    assert batch.weights is not None and row["selected"] == row["budget"] == pi.numel() > 0
    torch.testing.assert_close(batch.weights[batch.selected], 1.0 / pi, rtol=0, atol=0)
    assert (batch.weights[[i for i in range(len(batch.weights)) if i not in batch.selected.tolist()]] == 1).all()
    assert row["min_pi"] == pytest.approx(float(pi.min())) and row["max_weight"] == pytest.approx(float(1 / pi.min()))


@pytest.mark.parametrize("flags,message", [
    (["--policy", "random", "--unbiased"], "uniform selection is already unbiased"),
    (["--policy", "full", "--rho", "1", "--unbiased"], "needs --policy entropy or learned"),
    (["--max-per-prompt", "-1"], "--max-per-prompt -1: must be at least 1"),
    (["--unbiased", "--max-per-prompt", "2"], "a cap would change the inclusion probabilities"),
])  # fmt: skip
def test_bad_selection_flags_are_one_line(tmp_path, flags, message):
    with pytest.raises(opd.cli.UserError, match=message):
        train.main(["--preset", "tiny", *flags, "--out", str(tmp_path)])


def test_the_ledger_obeys_eq_4_with_unbiased_and_capped_selection(tmp_path, tiny):
    for name, flags in (("u", ["--policy", "learned", "--unbiased"]), ("c", ["--policy", "learned", "--max-per-prompt", "2"])):
        train.main(["--preset", "tiny", *flags, "--rho", "0.25", "--steps", "4", "--out", str(tmp_path / name)])
        rows = read_ledger(tmp_path / name / "ledger.jsonl")
        assert len(rows) == 4
        for r in rows:
            assert r["budget"] == math.floor(0.25 * r["candidates"] + 1e-9) and r["selected"] <= r["budget"]
            assert r["overrun"] == 0 and r["teacher_rows"] == r["selected"]
            if name == "u":
                assert r["selected"] == r["budget"] and 0 < r["min_pi"] <= 1 and r["max_weight"] == pytest.approx(1 / r["min_pi"])
    summary = json.loads((tmp_path / "u" / "summary.json").read_text())
    assert summary["max_overrun"] <= 0


@pytest.mark.slow
def test_two_ranks_equal_one_rank_with_unbiased_selection(tmp_path, tiny):
    """--policy learned --unbiased on 2 CPU ranks equals 1 rank (float64): the same S and pi (one seeded draw on
    every rank), the same budget, losses and weights within float64 rounding."""
    from float64 import assert_same_weights

    args = ["--policy", "learned", "--unbiased", "--dtype", "float64"]
    one = _run_worker(tmp_path / "one", 1, *args)
    two = _run_worker(tmp_path / "two", 2, *args)
    assert [s.tolist() for s in one["selected"]] == [s.tolist() for s in two["selected"]]
    assert [p.tolist() for p in one["pi"]] == [p.tolist() for p in two["pi"]]
    assert any(p is not None and p.numel() for p in one["pi"])
    for r1, r2 in zip(one["rows"], two["rows"], strict=True):
        for key in ("candidates", "budget", "selected", "teacher_rows", "min_pi"):
            assert r1[key] == r2[key], key
        assert r1["loss"] == pytest.approx(r2["loss"], rel=1e-9)
    assert_same_weights(one["params"], two["params"], lr=1e-3, steps=2, what="params")


@pytest.mark.slow
def test_the_selection_experiment_smoke(tmp_path, tiny):
    """experiments/selection.py --smoke on one task and three variants: all run, their ledgers hold, the report has
    the audit's columns and the pairing with Random-25 (the full experiment: docs/SELECTION.md); the stratified
    run queries exactly K rows, one per prompt (K = 16 of 32 prompts x 2 rollouts: half the prompts, a row each)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "experiments" / "selection.py"
    spec = importlib.util.spec_from_file_location("selection_experiment", path)
    driver = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = driver  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(driver)
    out = tmp_path / "sel"
    text = driver.main(["--smoke", "--tasks", "letter", "--variants", "random-25,learned-25-unbiased,learned-25-cap",
                        "--out", str(out)])  # fmt: skip
    assert "all hold." in text and "| Learned-25 unbiased |" in text and "| Learned-25 capped per prompt |" in text
    assert "of 1 above |" in text  # paired with Random-25's seed
    data = json.loads((out / "report.json").read_text())
    unbiased = data["runs"]["letter"]["learned-25-unbiased"][0]
    assert unbiased["selection"]["cosine"] <= 1 and 0 <= unbiased["selection"]["captured"] <= 1
    capped_rows = read_ledger(out / "runs" / "letter" / "learned-25-cap" / "seed0" / "ledger.jsonl")
    assert all(r["selected_prompts"] == r["selected"] for r in capped_rows)  # K = 16 of 32 prompts: one row each
    text = driver.main(["--smoke", "--tasks", "letter", "--variants", "learned-25-strat", "--out", str(out)])
    assert "| Learned-25 stratified by prompt (HT) |" in text and "all hold." in text
    strat_rows = read_ledger(out / "runs" / "letter" / "learned-25-strat" / "seed0" / "ledger.jsonl")
    assert all(r["selected_prompts"] == r["selected"] == r["budget"] for r in strat_rows)


def test_the_audits_sample_and_aggregate_as_the_run_trains(tmp_path, tiny, monkeypatch):
    """harness.audit on a --loss-agg sequence-mean run with its own sampling settings: held batches are sampled with the
    run's temperature / top-k / top-p and prefill sharing; the audited gradient is the run's objective, a mean over
    rows (g_C = (|S| g_S + |U| g_U) / |C|, float64 sums in other orders: far inside 1e-9 of the largest entry), not
    Eq. 11's token mean; a vLLM run's held batch has no entropy feature and its selection audit ranks as training
    does (has_entropy False)."""
    from float64 import float64_model

    import opd.selection.selectors
    from harness import audit

    float64_model()
    run = opd.run.Run(small_config(tmp_path, policy="entropy", rho=0.5, loss_agg="sequence-mean", dtype="float64",
                                 sample_temperature=1.3, sample_top_k=5, sample_top_p=0.9, share_prefill=False))  # fmt: skip
    calls = []
    generate = audit.generate_rollouts
    monkeypatch.setattr(audit, "generate_rollouts", lambda *a, **k: calls.append((a, k)) or generate(*a, **k))
    ctx = audit.AuditContext.of(run)
    batch = audit.sample_batch(ctx, run.selector, run.records[:4], seed=3)
    (args, kwargs), = calls
    assert args[5:] == (False,) and kwargs == {"temperature": 1.3, "top_k": 5, "top_p": 0.9}
    records = run.prompts.of_step(0)
    ro = fixed_rollouts(run, 0)  # responses of several lengths (the tiny policy's own run to the length limit)
    eligible = torch.tensor([records[j].eligible for j in ro.prompt_index.tolist()])
    held = audit.HeldBatch(records, ro, run.prompts.student(records), torch.zeros(len(ro), 6), eligible, None)
    c = eligible.nonzero().squeeze(-1)
    lengths = ro.lengths
    s, u = c[: c.numel() // 2], c[c.numel() // 2 :]
    assert c.numel() >= 4 and lengths[s].sum() * u.numel() != lengths[u].sum() * s.numel()
    g_s, g_u, g_c = (audit.opd_gradient(ctx, held, rows) for rows in (s, u, c))
    by_rows = (s.numel() * g_s + u.numel() * g_u) / c.numel()
    by_tokens = (lengths[s].sum() * g_s + lengths[u].sum() * g_u) / lengths[c].sum()
    bound = 1e-9 * float(g_c.abs().max())
    assert float((g_c - by_rows).abs().max()) <= bound
    assert float((g_c - by_tokens).abs().max()) > 1e3 * bound

    ctx.has_entropy = False  # as a vLLM run: the engine's rollouts carry no token entropy
    batch = audit.sample_batch(ctx, run.selector, run.records[:4], seed=3)
    assert not batch.has_entropy and bool((batch.phi[:, 2] == 0).all())
    seen = []
    select = opd.selection.selectors.Selector.select
    monkeypatch.setattr(opd.selection.selectors.Selector, "select", lambda self, *a, **k: seen.append(a[4]) or select(self, *a, **k))
    monkeypatch.setattr(audit, "sample_batch", lambda *a, **k: batch)
    audit.selection_audit(ctx, run.selector, run.records, n_batches=1, draws=1)
    assert seen == [False]
