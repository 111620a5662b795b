"""DAPD (`--method dapd`, opd/methods/dapd.py) on the tiny model: the six pairs' contexts and completions as token ids on
a hand-made example, the snapshot refresh every N steps, two steps with the ledger's counts, resume."""

import math

import pytest
import torch
from test_training import TIMING, params_of, small_config

from opd.models.chat import encode_prompt
from opd.methods.dapd import PAIRS, student_groups
from opd.data.records import full_image
from opd.loop.ledger import read_ledger
from opd.run import Run
from opd.engine.rollout import Rollouts
from opd.engine.synthetic import fixed_rollouts
from opd.data.family_views import reference_prompt


def dapd_config(tmp_path, **kw):
    return small_config(tmp_path, **{"method": "dapd", "ema_tau": 1.0, "ema_every": 100, **kw})


def test_the_six_pairs_see_the_specified_contexts_and_completions(tmp_path, tiny):
    """One selected rollout "C<|im_end|>" of a record whose answer is its letter: every anchor and student forward
    holds exactly (context prompt) + (completion) ids, with none = the plain question, reference = the answer in
    OPSD's template, rollout = the rollout's text in that slot; anchors in DAPD's order, then one student forward
    per student context."""
    run = Run(dapd_config(tmp_path, policy="full", rho=1.0))
    tok, eos = run.processor.tokenizer, run.ids["eos"][0]
    record_ids = run.prompts.ids(0)
    records = [run.records[i] for i in record_ids]
    response = torch.tensor([[tok.convert_tokens_to_ids("C"), eos]])
    prompts = run.prompts.student(records)
    ro = Rollouts(prompt_index=torch.tensor([0]), response_ids=response, response_mask=torch.ones(1, 2, dtype=torch.bool),
                  logp=torch.zeros(1, 2), entropy=torch.zeros(1, 2), prompt_len=torch.tensor([len(prompts[0])]),
                  valid=torch.tensor([True]))  # fmt: skip
    seen = []
    models = {"snapshot": run.teacher.model, "base": run.teachers.teachers["base"].model, "student": run.model}
    for name, model in models.items():
        model.register_forward_pre_hook(lambda m, a, kw, name=name: seen.append((name, kw["input_ids"][0].tolist())),
                                        with_kwargs=True)  # fmt: skip
    res = run.objective(run.prompts.batch(0, record_ids, ro, prompts, torch.tensor([0])))

    r = records[0]
    image = full_image(r)
    context_ids = {
        "none": encode_prompt(run.processor, [image], r.problem).input_ids.tolist(),
        "reference": encode_prompt(run.processor, [image], reference_prompt(r.problem, r.answer)).input_ids.tolist(),
        "rollout": encode_prompt(run.processor, [image], reference_prompt(r.problem, "C")).input_ids.tolist(),
    }
    completion_ids = {"rollout": response[0].tolist(), "reference": tok(r.answer, add_special_tokens=False)["input_ids"] + [eos]}
    assert len(completion_ids["reference"]) == 2 and tok.decode(context_ids["rollout"]).count("visible to you only): C") == 1
    want = [(p.anchor, context_ids[p.anchor_context] + completion_ids[p.completion]) for p in PAIRS]
    want += [("student", context_ids[ctx] + completion_ids[c]) for c, ctx in student_groups()]
    assert seen == want
    assert [len(v) for v in student_groups().values()] == [1, 2, 2, 1]  # four student forwards for six pairs
    assert all(res.teachers[f"{p.anchor}:{p.name}"].rows == 1 for p in PAIRS)
    assert math.isfinite(res.loss_share) and res.utility[0] >= 0


@pytest.mark.slow  # an end-to-end run (train, resume or export): -m slow
def test_snapshot_is_refreshed_every_n_steps_and_base_stays(tmp_path, tiny):
    run = Run(dapd_config(tmp_path, policy="full", rho=1.0, ema_every=2, steps=3))
    initial = params_of(run.model)
    base = run.teachers.teachers["base"].model
    after = []
    for step in range(3):
        row = run.step(step, fixed_rollouts(run, step))
        assert not row["skipped"]
        after.append(params_of(run.model))
        snap, b = params_of(run.teacher.model), params_of(base)
        for k, v in initial.items():
            assert torch.equal(b[k], v)  # the base anchor never moves
        want = initial if step == 0 else after[1]  # refreshed after step index 1 ((1 + 1) % 2 == 0), not after 0 or 2
        assert all(torch.equal(snap[k], want[k]) for k in want), step
    assert any(not torch.equal(after[2][k], after[1][k]) for k in initial)  # the policy moved on after the refresh


def test_two_steps_of_dapd_with_the_ledgers_counts(tmp_path, tiny):
    """Every selected rollout enters the six pairs: six anchor forwards per row of S (four of the base, two of the
    snapshot), counted per anchor:pair and per anchor; nothing for unselected rows."""
    run = Run(dapd_config(tmp_path, policy="random", rho=0.5))
    counts = {name: [] for name in ("snapshot", "base")}
    for name in counts:
        run.teachers.teachers[name].model.register_forward_pre_hook(
            lambda m, a, kw, name=name: counts[name].append(kw["input_ids"].shape[0]), with_kwargs=True)
    before = params_of(run.model)
    for step in range(2):
        for c in counts.values():
            c.clear()
        row = run.step(step)
        run.log(row)
        s = row["selected"]
        assert not row["skipped"] and s == row["budget"] > 0
        assert sum(counts["base"]) == 4 * s and sum(counts["snapshot"]) == 2 * s
        assert row["teacher_rows"] == 6 * s and all(row[f"teacher_rows_{p.anchor}:{p.name}"] == s for p in PAIRS)
        assert row["teacher_tokens"] == sum(row[f"teacher_tokens_{p.anchor}:{p.name}"] for p in PAIRS)
        assert math.isfinite(row["loss"]) and row["loss"] >= 0 and row["grad_norm"] > 0
        total = sum(p.weight * row[f"kl_{p.name}"] for p in PAIRS)
        assert row["loss"] == pytest.approx(total, rel=1e-6, abs=1e-9)
    assert any(not torch.equal(before[k], v) for k, v in params_of(run.model).items())
    summary = run.finish()
    assert summary["teacher_models"]["base"]["rows"] == 4 * summary["calls"]
    assert summary["teacher_models"]["snapshot"]["rows"] == 2 * summary["calls"]


@pytest.mark.slow
def test_dapd_resume_equals_the_uninterrupted_run(tmp_path, tiny):
    """Stopped after 2 of 3 steps and resumed: the same policy, snapshot (refreshed after step 2, in the resumed part)
    and ledger."""
    kw = dict(policy="learned", rho=0.25, steps=3, replay_start=4, replay_batch=8, ema_every=3)
    whole = Run(dapd_config(tmp_path / "whole", **kw))
    whole.train()
    Run(dapd_config(tmp_path / "split", **{**kw, "steps": 2})).train()
    resumed = Run(dapd_config(tmp_path / "split", **kw, resume=str(tmp_path / "split" / "run")))
    assert resumed.start == 2
    resumed.train()
    for a, b in ((whole.model, resumed.model), (whole.teacher.model, resumed.teacher.model)):
        for k, v in params_of(a).items():
            torch.testing.assert_close(params_of(b)[k], v, rtol=0, atol=1e-6)
    ra, rb = (read_ledger(tmp_path / d / "run" / "ledger.jsonl") for d in ("whole", "split"))
    assert [r["step"] for r in rb] == [0, 1, 2] and resumed.selector.model.trained
    for x, y in zip(ra, rb):
        for key in x.keys() - TIMING - {"launch"} - {k for k in x if k.startswith("teacher_forward_s_")}:
            assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-9, nan_ok=True), key


def test_thinking_contexts_are_encoded_once_per_step_and_hold_the_thinking_prompt(tmp_path, tiny):
    """--dapd-context-thinking: the reference context is encoded once per prompt of the step and the rollout context
    once per row (not once per row, completion and micro-batch), and every forward still holds exactly the ids of
    its context encoded with the thinking prompt (the none context: the student's own prompt), here with two rollouts
    of one prompt in two micro-batches."""
    run = Run(dapd_config(tmp_path, policy="full", rho=1.0, dapd_context_thinking=True, micro_batch=1))
    tok, eos = run.processor.tokenizer, run.ids["eos"][0]
    record_ids = run.prompts.ids(0)
    records = [run.records[i] for i in record_ids]
    letters = [tok.convert_tokens_to_ids(c) for c in "CD"]
    response = torch.tensor([[letters[0], eos], [letters[1], eos]])
    prompts = run.prompts.student(records)
    ro = Rollouts(prompt_index=torch.tensor([0, 0]), response_ids=response, response_mask=torch.ones(2, 2, dtype=torch.bool),
                  logp=torch.zeros(2, 2), entropy=torch.zeros(2, 2), prompt_len=torch.tensor([len(prompts[0])] * 2),
                  valid=torch.tensor([True, True]))  # fmt: skip
    encoded = []
    encode = run.objective.ctx.encode
    run.objective.ctx.encode = lambda view, *a, **k: encoded.append(view if isinstance(view, str) else "rollout") or encode(
        view, *a, **k)  # fmt: skip
    seen = []
    models = {"snapshot": run.teacher.model, "base": run.teachers.teachers["base"].model, "student": run.model}
    for name, model in models.items():
        model.register_forward_pre_hook(lambda m, a, kw, name=name: seen.append((name, kw["input_ids"].tolist())),
                                        with_kwargs=True)  # fmt: skip
    res = run.objective(run.prompts.batch(0, record_ids, ro, prompts, torch.tensor([0, 1])))
    assert sorted(encoded) == ["reference_answer", "rollout", "rollout"]  # once per prompt, once per row

    r = records[0]
    image = full_image(r)
    context_ids = {
        "none": lambda i: prompts[0].input_ids.tolist(),
        "reference": lambda i: encode_prompt(run.processor, [image], reference_prompt(r.problem, r.reference),
                                             True).input_ids.tolist(),
        "rollout": lambda i: encode_prompt(run.processor, [image], reference_prompt(r.problem, "CD"[i]),
                                           True).input_ids.tolist(),
    }  # fmt: skip
    completion = {"rollout": lambda i: response[i].tolist(),
                  "reference": lambda i: (tok(r.reference, add_special_tokens=False)["input_ids"] + [eos])[:8]}  # fmt: skip
    want = []
    for i in (0, 1):  # one micro-batch per row: six anchor forwards, then four student forwards
        want += [(p.anchor, [context_ids[p.anchor_context](i) + completion[p.completion](i)]) for p in PAIRS]
        want += [("student", [context_ids[ctx](i) + completion[c](i)]) for c, ctx in student_groups()]
    assert sorted(seen) == sorted(want) and len(seen) == len(want) == 20
    assert math.isfinite(res.loss_share) and all(res.teachers[f"{p.anchor}:{p.name}"].rows == 2 for p in PAIRS)
