"""OPOD (`--method opod`, opd/methods/opod.py) on the tiny model: two steps with one teacher and with routed teachers (the
ledger's counts per teacher and view, the controller), the KL term, and resume."""

import math

import pytest
import torch
from test_teachers import route_file, routed_data, teacher_models  # noqa: F401  (the fixture)
from test_training import TIMING, params_of, small_config

from opd.loop.ledger import read_ledger
from opd.run import Run
from opd.methods.table import METHODS
from opd.engine.synthetic import fixed_rollouts


def opod_config(tmp_path, **kw):
    return small_config(tmp_path, **{**METHODS["opod"].settings, "method": "opod", **kw})


def test_two_steps_of_opod_with_one_teacher(tmp_path, tiny, teacher_models):  # noqa: F811
    """Per selected row: one gated forward in the teacher's view and one 'verify' forward (B), plus one 'answer'
    forward per prompt with a selected row; the teacher never moves; the controller observes each step's gate."""
    run = Run(opod_config(tmp_path, teacher_model=str(teacher_models[0]), policy="random", rho=0.5, opod_warmup=1,
                          opod_eta=2.0, opod_kl=0.1))  # fmt: skip
    teacher_before = params_of(run.teacher.model)
    seen = []
    run.teacher.model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].shape[0]), with_kwargs=True)
    select = run.selector.select
    chosen = []
    run.selector.select = lambda *a, **k: chosen.append(select(*a, **k)) or chosen[-1]
    betas = []
    for step in range(3):
        seen.clear()
        ro = fixed_rollouts(run, step)
        row = run.step(step, ro)
        run.log(row)
        s = row["selected"]
        prompts = len(set(ro.prompt_index[chosen[-1][0]].tolist()))
        assert not row["skipped"] and s == row["budget"] > 0
        assert (row["teacher_rows_full"], row["teacher_rows_verify"], row["teacher_rows_answer"]) == (s, s, prompts)
        assert sum(seen) == row["teacher_rows"] == 2 * s + prompts
        assert row["teacher_tokens"] == sum(row[f"teacher_tokens_{v}"] for v in ("full", "verify", "answer"))
        for key in ("loss", "grad_norm", "reward_mean", "pg_loss", "kl_loss", "gate_mean_teacher"):
            assert math.isfinite(row[key]), key
        assert row["gate_mean_teacher"] > 0 and row["kl_loss"] >= 0 and 0.0 <= row["task_reward_mean"] <= 1.0
        betas.append(row["beta_teacher"])
    assert betas[0] == betas[1] == 1.0  # warm-up of one step, then the controller: beta moves at step 2
    assert betas[2] != 1.0 and run.objective.controller.eps["teacher"] >= 0.02
    assert all(torch.equal(v, params_of(run.teacher.model)[k]) for k, v in teacher_before.items())
    summary = run.finish()
    assert summary["teachers"]["full"]["rows"] == summary["calls"]


def test_opod_routes_each_response_to_its_teacher(tmp_path, tiny, teacher_models):  # noqa: F811
    """Two routes: each teacher scores only its rows (full, verify) and the prompts of its rows (answer); one beta per
    teacher."""
    t1, t2 = teacher_models
    routes = route_file(tmp_path, {"colour": str(t1), "count": str(t2)})
    run = Run(opod_config(tmp_path, data=str(routed_data(tiny[1])), teachers=str(routes), policy="full", rho=1.0))
    seen = {n: [] for n in run.teachers.names}
    for n, t in run.teachers.teachers.items():
        t.model.register_forward_pre_hook(lambda m, a, kw, n=n: seen[n].append(kw["input_ids"].shape[0]), with_kwargs=True)
    ro = fixed_rollouts(run, 0)
    row = run.step(0, ro)
    records = run.prompts.of_step(0)
    for n in seen:
        rows = [i for i in range(len(ro)) if records[int(ro.prompt_index[i])].field("task") == n]
        prompts = len({int(ro.prompt_index[i]) for i in rows})
        assert row[f"teacher_rows_{n}:full"] == row[f"teacher_rows_{n}:verify"] == len(rows), n
        assert row[f"teacher_rows_{n}:answer"] == prompts and sum(seen[n]) == 2 * len(rows) + prompts, n
        assert f"beta_{n}" in row and f"gate_mean_{n}" in row
    assert row["teacher_rows"] == sum(sum(v) for v in seen.values())


@pytest.mark.slow
def test_opod_resume_equals_the_uninterrupted_run(tmp_path, tiny, teacher_models):  # noqa: F811
    """The controller's state (beta, eps, warm-up) is in the checkpoint: stopped after 2 of 4 steps and resumed gives
    the same policy and ledger (betas included)."""
    kw = dict(teacher_model=str(teacher_models[0]), policy="random", rho=0.5, steps=4, opod_warmup=1, opod_eta=2.0)
    whole = Run(opod_config(tmp_path / "whole", **kw))
    whole.train()
    Run(opod_config(tmp_path / "split", **{**kw, "steps": 2})).train()
    resumed = Run(opod_config(tmp_path / "split", **kw, resume=str(tmp_path / "split" / "run")))
    assert resumed.start == 2 and resumed.objective.controller.eps["teacher"] is not None
    resumed.train()
    for k, v in params_of(whole.model).items():
        torch.testing.assert_close(params_of(resumed.model)[k], v, rtol=0, atol=1e-6)
    assert resumed.objective.controller.beta == pytest.approx(whole.objective.controller.beta)
    ra, rb = (read_ledger(tmp_path / d / "run" / "ledger.jsonl") for d in ("whole", "split"))
    assert [r["step"] for r in rb] == [0, 1, 2, 3] and ra[3]["beta_teacher"] != 1.0
    for x, y in zip(ra, rb, strict=True):
        for key in x.keys() - TIMING - {"launch"} - {k for k in x if k.startswith("teacher_forward_s_")}:
            assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-9, nan_ok=True), key


def test_opods_kl_is_a_hajek_token_mean_under_unbiased_selection(tmp_path, tiny, teacher_models):  # noqa: F811
    """--unbiased: OPOD's KL(pi_theta || pi_ref) term weighs row i's k3 terms by w_i = 1 / pi_i over the Hajek
    denominator sum_i w_i T_i, as its policy gradient and its distillation do; against the sum written out from the
    reference's float64 log-probs (the initial policy, which the policy still is at step 0; the loss reads them from
    hidden states chunk by chunk, ~1e-15 relative from this forward's logits, far inside rel 1e-9). The unweighted
    sum over the same denominator (the old numerator) is far off."""
    from float64 import float64_model

    from opd.models.chat import collate
    from opd.models.chat import response_logits

    float64_model()
    run = Run(opod_config(tmp_path, teacher_model=str(teacher_models[0]), policy="entropy", unbiased=True, rho=0.5,
                          opod_kl=0.3, dtype="float64"))  # fmt: skip
    ro = fixed_rollouts(run, 0)
    records = run.prompts.of_step(0)
    index = ro.prompt_index.tolist()
    s_in = collate([run.prompts.student(records)[j] for j in index], run.ids["pad"], ro.response_ids, ro.response_mask)
    with torch.no_grad():
        z = response_logits(run.objective.reference.model, s_in, ro.response_ids.shape[1]).double()  # (N, T, V)
    ref = torch.log_softmax(z, -1).gather(-1, ro.response_ids[..., None]).squeeze(-1)  # (N, T) log pi_ref(y_t)
    seen = {}
    step_batch = run.prompts.batch
    run.prompts.batch = lambda *a, **k: seen.setdefault("batch", step_batch(*a, **k))
    row = run.step(0, ro)
    batch = seen["batch"]
    assert batch.weights is not None and row["selected"] > 0
    num = unweighted = den = 0.0
    for i in batch.selected.tolist():
        w_i = float(batch.weights[i])
        for t in range(ro.response_ids.shape[1]):
            if ro.response_mask[i, t]:
                r = float(ref[i, t]) - float(ro.logp[i, t])
                k3 = math.exp(r) - r - 1.0
                num, unweighted, den = num + w_i * k3, unweighted + k3, den + w_i
    assert row["kl_loss"] == pytest.approx(0.3 * num / den, rel=1e-9)
    assert row["kl_loss"] != pytest.approx(0.3 * unweighted / den, rel=1e-3)
