"""End-to-end checks of Algorithm 1 on the built-in tiny Qwen3.5 (CPU, seeded)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import opd.maths.chunked
import opd.methods.objective
import opd.methods.micro_batch
import opd.config
import opd.run
import opd.methods.table
import opd.engine.rollout
import opd.data.records
import train
from opd.models.chat import collate, encode_prompt
from opd.cli import UserError
from opd.config import TrainConfig
from opd.data.sources import load_records
from opd.data.records import step_prompt_indices, student_view
from opd.models.chat import response_logits
from opd.loop.ledger import read_ledger
from opd.run import Run
from opd.models.loading import load_model, load_processor, special_ids
from opd.engine.rollout import generate_rollouts, response_mask
from opd.engine.synthetic import fixed_rollouts

ROOT = Path(__file__).resolve().parents[1]
TIMING = {"prompt_s", "generation_s", "select_s", "teacher_forward_s", "student_s", "optimizer_s", "ema_s", "selector_s", "wait_s", "step_s"}


def small_config(tmp_path: Path, **kw) -> TrainConfig:
    base = dict(
        out=str(tmp_path / "run"), prompts_per_step=4, rollouts_per_prompt=4, max_response_len=8, steps=2,
        lr=1e-3, micro_batch=3, replay_start=4, replay_batch=16, max_prompt_len=512,
    )  # fmt: skip
    base.update(kw)
    return TrainConfig(**base)


def params_of(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


@torch.no_grad()
def perturb(model, scale: float = 0.05, seed: int = 7) -> None:
    """Moves a teacher away from the student so the divergence is far above float rounding."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=gen) * scale)


def divergence_before_update(run, rollouts, records) -> torch.Tensor:
    """d (N, T): Eq. 3 per token of `rollouts` from whole logits, the student on the full image and the teacher on
    each record's crop (the full image where it has none), with the run's top-k and alpha, before any update: the
    independent side of the tests that write a step's loss out."""
    from opd.models.chat import collate
    from opd.maths.family import topk_divergence
    from opd.models.chat import response_logits

    index = rollouts.prompt_index.tolist()
    s_in = collate([run.prompts.student(records)[j] for j in index], run.ids["pad"], rollouts.response_ids,
                   rollouts.response_mask)  # fmt: skip
    crop = [run.prompts.encode("crop", r, 0) if r.eligible else run.prompts.student([r])[0] for r in records]
    t_in = collate([crop[j] for j in index], run.ids["pad"], rollouts.response_ids, rollouts.response_mask)
    with torch.no_grad():
        width = rollouts.response_ids.shape[1]
        return topk_divergence(response_logits(run.model, s_in, width), response_logits(run.teacher.model, t_in, width),
                               run.cfg.loss.topk, run.cfg.loss.alpha)  # fmt: skip


class Spy:
    """Wraps a function and keeps every result."""

    def __init__(self, fn):
        self.fn, self.results = fn, []

    def __call__(self, *args, **kwargs):
        out = self.fn(*args, **kwargs)
        self.results.append(out)
        return out


def stats_tolerance(logits: torch.Tensor) -> float:
    """How far generate()'s recorded log-probs and entropies may be from the float64 values of the same logits: RolloutStats
    (opd/engine/rollout.py) computes them in float32 from the logits cast to float32, also for a float64 model, so each is a
    few float32 roundings of numbers up to max|z| + log V off (measured: 0.5 and 0.7 F32_EPS max|z| here)."""
    from float64 import F32_EPS

    return 4 * F32_EPS * (float(logits[torch.isfinite(logits)].abs().max()) + math.log(logits.shape[-1]))


def sampled_logits(model, prompts, ro) -> torch.Tensor:
    """(N, T, V) float64 logits of a forward over the finished sequences, as sampling saw them."""
    ids = special_ids(model)
    inputs = collate([prompts[j] for j in ro.prompt_index.tolist()], ids["pad"], ro.response_ids, ro.response_mask)
    with torch.no_grad():
        logits = response_logits(model, inputs, ro.response_ids.shape[1]).double()  # (N, T, V)
    logits[..., ids["vision"]] = -math.inf  # sampling suppresses the vision special tokens
    return logits


@pytest.mark.parametrize("share_prefill", [True, False])
def test_rollout_stats_equal_a_forward_over_the_finished_sequence(tiny, share_prefill, float64_model):
    """The log-probs and entropies recorded during generate() are those of the sampling distribution. In float64
    (tests/float64.py): generate()'s recurrent linear attention and the forward's chunked one are two algorithms, whose
    float32 round-off differed by ~6e-5 (70 F32_EPS max|z|), CPU-dependent; in float64 what is left is RolloutStats'
    own float32 (stats_tolerance). A top-k truncation or an unsuppressed vision token would differ by > 1e-2."""
    model_dir, data = tiny
    model, processor = load_model(str(model_dir), "float64"), load_processor(str(model_dir))
    records = load_records(data)[:3]
    prompts = [encode_prompt(processor, *student_view(r)) for r in records]
    ro = generate_rollouts(model, prompts, 3, 12, batch_rows=6, share_prefill=share_prefill)
    ids = special_ids(model)
    logits = sampled_logits(model, prompts, ro)
    logp = torch.log_softmax(logits, -1)
    expected_logp = logp.gather(-1, ro.response_ids.unsqueeze(-1)).squeeze(-1)
    p = logp.exp()
    expected_entropy = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)
    m = ro.response_mask
    assert m.any()
    tol = stats_tolerance(logits)
    torch.testing.assert_close(ro.logp[m].double(), expected_logp[m], atol=tol, rtol=0)
    torch.testing.assert_close(ro.entropy[m].double(), expected_entropy[m], atol=tol, rtol=0)
    assert not torch.isin(ro.response_ids[m], torch.tensor(ids["vision"])).any()
    assert ro.prompt_index.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_shared_prefill_samples_the_same_responses(tiny, float64_model):
    """One prefill per prompt expanded to its rollouts, or one per rollout: the same computation in other batch shapes,
    so in float64 (tests/float64.py) the same samples and, but for RolloutStats' float32, the same statistics."""
    model_dir, data = tiny
    model, processor = load_model(str(model_dir), "float64"), load_processor(str(model_dir))
    prompts = [encode_prompt(processor, *student_view(r)) for r in load_records(data)[:4]]
    outs = []
    for share in (True, False):
        torch.manual_seed(3)
        outs.append(generate_rollouts(model, prompts, 4, 10, share_prefill=share))
    assert torch.equal(outs[0].response_ids, outs[1].response_ids)
    tol = 2 * stats_tolerance(sampled_logits(model, prompts, outs[0]))  # each side within one tolerance of float64
    torch.testing.assert_close(outs[0].logp, outs[1].logp, atol=tol, rtol=0)
    torch.testing.assert_close(outs[0].entropy, outs[1].entropy, atol=tol, rtol=0)


def test_response_mask_keeps_tokens_up_to_the_first_eos():
    ids = torch.tensor([[5, 6, 2, 0, 0], [5, 2, 7, 2, 0], [5, 6, 7, 8, 9], [2, 0, 0, 0, 0]])
    expected = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(response_mask(ids, [2]), expected)


def test_teacher_sees_exactly_the_selected_rows(tmp_path, tiny, monkeypatch):
    plan = Spy(opd.methods.objective.plan_micro_batches)
    monkeypatch.setattr(opd.methods.objective, "plan_micro_batches", plan)
    run = Run(small_config(tmp_path, policy="random", rho=0.5, micro_batch=2))
    select = Spy(run.selector.select)
    run.selector.select = select
    seen = []
    run.teacher.model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].clone()), with_kwargs=True)
    for step in range(2):
        seen.clear()
        ro = fixed_rollouts(run, step)
        before = run.teacher.rows_scored
        row = run.step(step, ro)
        chosen = select.results[-1][0]
        assert run.teacher.rows_scored - before == chosen.numel() == row["selected"] == row["teacher_rows"] > 0
        assert all(batch.shape[0] <= 2 for batch in seen)
        assert len(seen) == math.ceil(chosen.numel() / 2)
        # Teacher batch b holds the selected rows of plan group b: each row ends with that row's response.
        groups = plan.results[-1]
        assert sorted(torch.cat(groups).tolist()) == list(range(chosen.numel()))
        for batch, group in zip(seen, groups, strict=True):
            rows = chosen[group]
            width = int(ro.lengths[rows].max())
            for r, i in zip(batch, rows.tolist(), strict=True):
                n = int(ro.lengths[i])
                assert torch.equal(r[-width:][:n], ro.response_ids[i, :n])
        eligible = torch.tensor([run.prompts.of_step(step)[j].eligible for j in ro.prompt_index.tolist()])
        assert eligible[chosen].all()
        assert row["budget"] == math.floor(0.5 * int(eligible.sum()))
        assert row["scored_tokens"] == int(ro.lengths[chosen].sum())
        assert row["candidate_tokens"] == int(ro.lengths[eligible].sum())


@pytest.mark.parametrize("policy,rho", [("full", 1.0), ("random", 0.25), ("entropy", 0.25), ("learned", 0.25)])
def test_two_steps_of_each_policy(tmp_path, tiny, monkeypatch, policy, rho):
    gen = Spy(opd.engine.rollout.generate_rollouts)
    monkeypatch.setattr(opd.engine.rollout, "generate_rollouts", gen)
    run = Run(small_config(tmp_path, policy=policy, rho=rho, replay_start=4, replay_batch=8))
    select = Spy(run.selector.select)
    run.selector.select = select
    rows = []
    for step in range(2):
        student_before, teacher_before = params_of(run.model), params_of(run.teacher.model)
        row = run.step(step)
        run.log(row)
        rows.append(row)
        student_after, teacher_after = params_of(run.model), params_of(run.teacher.model)
        assert not row["skipped"]
        assert any(not torch.equal(student_before[k], student_after[k]) for k in student_after)
        for k in teacher_after:  # theta-bar <- (1 - tau) theta-bar + tau theta
            torch.testing.assert_close(teacher_after[k], 0.95 * teacher_before[k] + 0.05 * student_after[k])
        ro, chosen = gen.results[-1], select.results[-1][0]
        eligible = torch.tensor([run.prompts.of_step(step)[j].eligible for j in ro.prompt_index.tolist()]) & ro.valid
        assert row["candidates"] == int(eligible.sum())
        assert row["budget"] == math.floor(rho * row["candidates"])
        assert row["selected"] == chosen.numel() == row["budget"]
        assert row["overrun"] == 0 and eligible[chosen].all()
        assert row["scored_tokens"] == int(ro.lengths[chosen].sum())
        assert row["teacher_rows"] == row["selected"]
        prompt_of = ro.prompt_index.tolist()  # prompt coverage: distinct prompts of C and of S, counted by hand
        assert row["candidate_prompts"] == len({prompt_of[i] for i in range(len(prompt_of)) if eligible[i]})
        assert row["selected_prompts"] == len({prompt_of[i] for i in chosen.tolist()})
        assert math.isfinite(row["loss"]) and row["loss"] > 0
    ledger = read_ledger(Path(run.cfg.folder.out) / "ledger.jsonl")
    assert [r["step"] for r in ledger] == [0, 1]
    assert [r["scored_tokens"] for r in ledger] == [r["scored_tokens"] for r in rows]
    if policy == "learned":
        assert run.selector.model.trained  # the labels of two steps reached replay_start = 4


@pytest.mark.parametrize("method", ["vision-opd", "rp-opsd", "opd-v", "opsd"])
def test_two_steps_of_each_method(tmp_path, tiny, method):
    """Each method of the family trains on the tiny model; its teacher(s) see exactly the selected rows,
    one forward per row and teacher view, and the ledger counts them per view."""
    settings = opd.methods.table.METHODS[method].settings
    run = Run(small_config(tmp_path, **{**settings, "method": method, "policy": "random", "rho": 0.5, "ema_tau": 0.05}))
    assert run.teacher_views == opd.methods.table.METHODS[method].teacher_views
    seen = []
    run.teacher.model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].shape[0]), with_kwargs=True)
    before = params_of(run.model)
    for step in range(2):
        seen.clear()
        row = run.step(step)
        run.log(row)
        views = run.teacher_views
        assert not row["skipped"] and row["selected"] == row["budget"] > 0
        assert sum(seen) == row["teacher_rows"] == row["selected"] * len(views)
        assert all(row[f"teacher_rows_{v}"] == row["selected"] for v in views)
        assert row["teacher_tokens"] == sum(row[f"teacher_tokens_{v}"] for v in views)
        assert math.isfinite(row["loss"]) and row["loss"] >= 0 and row["grad_norm"] > 0
    after = params_of(run.model)
    assert any(not torch.equal(before[k], after[k]) for k in after)
    summary = run.finish()
    assert list(summary["teachers"]) == list(views)
    assert summary["teachers"][views[0]]["rows"] == summary["calls"]


def test_rp_opsd_student_sees_half_the_resolution(tmp_path, tiny):
    run = Run(small_config(tmp_path, method="rp-opsd", policy="full", rho=1.0))
    record = run.records[0]
    (image,), _ = opd.data.records.get_view(run.method.student_view)(record)
    (full,), _ = opd.data.records.get_view("full")(record)
    assert image.size == (full.width // 2, full.height // 2)


def test_importance_ratio_scales_each_token_up_to_the_clip(tmp_path, tiny):
    """With old log-probs far below the current ones every ratio is clipped at c: the loss is exactly c times
    the unweighted one (Vision-OPD's is_clip), on both loss paths."""
    for chunk in (512, 0):
        losses = []
        for is_clip in (0.0, 2.0):
            run = Run(small_config(tmp_path / f"{chunk}-{is_clip}", policy="full", rho=1.0, is_clip=is_clip, loss_chunk=chunk,
                                      fused_kernel=True))
            ro = fixed_rollouts(run, 0)
            ro.logp = torch.where(ro.response_mask, torch.full_like(ro.logp, -100.0), ro.logp)
            losses.append(run.step(0, ro)["loss"])
        assert losses[1] == pytest.approx(2.0 * losses[0], rel=1e-5)


def test_teacher_on_the_students_own_view_gives_zero_loss(tmp_path, tiny, monkeypatch, float64_model):
    """A new privileged view is one entry in VIEWS; with the student's view the teacher equals the student. In float64
    (tests/float64.py): the teacher's forward (no grad) and the student's (with grad) may round otherwise, and each
    token's D sums k + 1 <= V = 105 terms p (log p - log m) with |log p| <= ~20, so it is off 0 by <= ~105 * 20 *
    F64_EPS = 5e-13 (float32 gave 1.5e-9, against a bound of 1e-6); the crop view gives a loss of ~3e-5."""
    run = Run(small_config(tmp_path, policy="full", rho=1.0, teacher_view="full", dtype="float64"))  # the student's own view
    row = run.step(0, fixed_rollouts(run, 0))
    assert row["selected"] > 0
    assert abs(row["loss"]) < 1e-12 and abs(row["utility_mean"]) < 1e-12


def test_micro_batch_size_does_not_change_the_loss_or_gradient(tmp_path, tiny, float64_model):
    """One row per micro-batch against eight (left-padded to the longest prompt): in float64 (tests/float64.py) only the
    order of the float64 sums differs, ~1e-15 relative; float32 rounding was ~1e-7 to 1e-6 here, CPU-dependent."""
    rows = []
    for mb in (1, 8):
        run = Run(small_config(tmp_path / f"mb{mb}", policy="full", rho=1.0, micro_batch=mb, dtype="float64"))
        perturb(run.teacher.model)
        rows.append(run.step(0, fixed_rollouts(run, 0)))
    assert rows[0]["loss"] == pytest.approx(rows[1]["loss"], rel=1e-9)
    assert rows[0]["grad_norm"] == pytest.approx(rows[1]["grad_norm"], rel=1e-9)


def test_empty_selection_is_a_valid_step_without_teacher(tmp_path, tiny):
    run = Run(small_config(tmp_path, policy="random", rho=0.01))
    teacher_before = params_of(run.teacher.model)
    row = run.step(0, fixed_rollouts(run, 0))
    assert row["budget"] == 0 and row["selected"] == 0 and row["teacher_rows"] == 0
    assert run.teacher.rows_scored == 0 and run.teacher.batches == []
    assert row["loss"] == 0.0 and not row["skipped"]
    assert math.isnan(row["utility_mean"])
    student = params_of(run.model)
    for k, v in params_of(run.teacher.model).items():  # the EMA still follows the (zero-gradient) update
        torch.testing.assert_close(v, 0.95 * teacher_before[k] + 0.05 * student[k])


def test_non_finite_loss_skips_update_and_ema(tmp_path, tiny, monkeypatch):
    run = Run(small_config(tmp_path, policy="full", rho=1.0))
    nan_jsd = lambda s, t, a: (s * float("nan")).sum(-1)  # noqa: E731
    monkeypatch.setattr(opd.methods.objective, "generalized_jsd", nan_jsd)  # Eq. 3 on the plain path
    monkeypatch.setattr(opd.maths.chunked, "generalized_jsd", nan_jsd)  # and in the fused kernel
    student_before, teacher_before = params_of(run.model), params_of(run.teacher.model)
    with pytest.warns(UserWarning, match="non-finite"):
        row = run.step(0, fixed_rollouts(run, 0))
    assert row["skipped"]
    for k, v in params_of(run.model).items():
        assert torch.equal(v, student_before[k])
    for k, v in params_of(run.teacher.model).items():
        assert torch.equal(v, teacher_before[k])


def test_batch_without_eligible_rows_trains_without_distillation_and_warns_once(tmp_path, tiny):
    _, data = tiny
    lines = data.read_text().splitlines()
    used = {i for s in range(2) for i in step_prompt_indices(len(lines), 4, s, 42)}  # the records of steps 0-1
    keep = next(i for i, line in enumerate(lines) if i not in used and ("bbox" in line or "teacher_images" in line))
    strip = lambda line: line.replace('"teacher_images"', '"unused"').replace('"bbox"', '"unused_bbox"')  # noqa: E731
    no_crop = data.parent / "few_crops.jsonl"  # one record of 32 keeps its crop, outside the first two steps
    no_crop.write_text("\n".join(line if i == keep else strip(line) for i, line in enumerate(lines)) + "\n")
    run = Run(small_config(tmp_path, data=str(no_crop), policy="random"))
    with pytest.warns(UserWarning, match="no crop-eligible") as record:
        rows = [run.step(s, fixed_rollouts(run, s)) for s in range(2)]
    assert sum("no crop-eligible" in str(w.message) for w in record) == 1
    assert all(r["candidates"] == 0 and r["selected"] == 0 and r["loss"] == 0.0 for r in rows)
    assert run.teacher.rows_scored == 0


def test_runs_that_would_do_nothing_are_refused(tmp_path, tiny):
    _, data = tiny
    lines = data.read_text().splitlines()
    no_crop = data.parent / "no_crop.jsonl"
    no_crop.write_text("\n".join(line.replace('"teacher_images"', '"x"').replace('"bbox"', '"y"') for line in lines) + "\n")
    with pytest.raises(UserError, match="no record has a crop"):
        Run(small_config(tmp_path, data=str(no_crop), out=str(tmp_path / "a")))
    few = data.parent / "few.jsonl"
    few.write_text("\n".join(lines[:3]) + "\n")
    for steps in (0, 5):
        with pytest.raises(UserError, match="3 records cannot fill one step of --prompts-per-step 4"):
            Run(small_config(tmp_path, data=str(few), steps=steps, out=str(tmp_path / "b")))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.slow  # an end-to-end run (train, resume or export): -m slow
def test_resume_continues_to_the_same_result(tmp_path, tiny):
    kw = dict(policy="learned", rho=0.5, steps=4, replay_start=8, replay_batch=8)
    whole = Run(small_config(tmp_path / "whole", **kw))
    whole.train()
    first = Run(small_config(tmp_path / "split", **{**kw, "steps": 2}))
    first.train()
    resumed = Run(small_config(tmp_path / "split", **kw, resume=str(tmp_path / "split" / "run")))
    assert resumed.start == 2
    resumed.train()
    for k, v in params_of(whole.model).items():
        torch.testing.assert_close(params_of(resumed.model)[k], v, rtol=0, atol=1e-6)
    for k, v in params_of(whole.teacher.model).items():
        torch.testing.assert_close(params_of(resumed.teacher.model)[k], v, rtol=0, atol=1e-6)
    a = read_ledger(tmp_path / "whole" / "run" / "ledger.jsonl")
    b = read_ledger(tmp_path / "split" / "run" / "ledger.jsonl")
    assert [r["step"] for r in b] == [0, 1, 2, 3]
    for ra, rb in zip(a, b):
        for key in ra.keys() - TIMING - {"launch"} - {k for k in ra if k.startswith("teacher_forward_s_")}:
            assert ra[key] == pytest.approx(rb[key], rel=1e-6, nan_ok=True), key
    assert ["launch" in r for r in b] == [True, False, True, False]  # each launch's first row says what ran
    assert whole.selector.model.updates == resumed.selector.model.updates > 0
    torch.testing.assert_close(whole.selector.model.replay.u, resumed.selector.model.replay.u)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--rho", "0"], "--rho 0.0"),
        (["--rho", "1.5"], "--rho 1.5"),
        (["--policy", "full", "--rho", "0.25"], "--policy full"),
        (["--policy", "greedy"], "--policy 'greedy'"),
        (["--preset", "paper-4b"], "--data is required"),
        (["--prompts-per-step", "0"], "--prompts-per-step 0"),
        (["--teacher-view", "zoom"], "--teacher-view 'zoom'"),
        (["--mixed-precision", "fp8"], "--mixed-precision 'fp8'"),
    ],
)
def test_impossible_flags_are_refused_by_name(tmp_path, flags, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        train.main(["--preset", "tiny", *flags, "--out", str(tmp_path)])


@pytest.mark.parametrize("args,words", [
    (["--rho", "2"], "--rho 2.0: the query ratio must lie in (0, 1]"),
    (["--data", "missing.jsonl"], "missing.jsonl: training data file not found"),
    (["--resume", "no/such/run"], "--resume no/such/run: no checkpoint in no/such/run"),
])  # fmt: skip
def test_user_errors_are_one_line_with_exit_code_2(tmp_path, args, words):
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "--preset", "tiny", *args, "--out", str(tmp_path / "r")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [f"train.py: error: {lines[0].split('error: ', 1)[1]}"] and words in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_default_run_prints_the_cost_summary_and_writes_a_loadable_checkpoint(tmp_path, tiny, capsys):
    out = tmp_path / "cli"
    summary = train.main(["--preset", "tiny", "--policy", "learned", "--rho", "0.25", "--steps", "3", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "| Policy | Candidates | Teacher calls | Query ratio | Scored tokens" in printed
    assert "| learned-25 |" in printed
    ledger = read_ledger(out / "ledger.jsonl")
    assert len(ledger) == 3
    assert summary["calls"] == sum(r["selected"] for r in ledger)
    assert summary["candidates"] == sum(r["candidates"] for r in ledger)
    assert summary["max_overrun"] <= 0
    ckpt = out / (out / "latest").read_text().strip()
    model, processor = load_model(str(ckpt / "policy")), load_processor(str(ckpt / "policy"))
    assert type(model).__name__ == "Qwen3_5ForConditionalGeneration"
    assert type(processor).__name__ == "Qwen3VLProcessor"
    assert (out / "summary.md").read_text().startswith("| Policy |")


@pytest.mark.slow  # an end-to-end run (train, resume or export): -m slow
def test_a_new_run_refuses_a_folder_holding_a_run_and_overwrite_replaces_it(tmp_path, tiny):
    out = str(tmp_path / "x")
    train.main(["--preset", "tiny", "--steps", "3", "--save-every", "1", "--keep-checkpoints", "3", "--out", out])
    before = (tmp_path / "x" / "ledger.jsonl").read_text()
    with pytest.raises(UserError, match=rf"--out {out} holds a run .*--resume {out}.*--overwrite"):
        train.main(["--preset", "tiny", "--steps", "2", "--out", out])
    assert (tmp_path / "x" / "ledger.jsonl").read_text() == before  # untouched
    assert sorted(p.name for p in (tmp_path / "x").glob("checkpoint-*")) == [f"checkpoint-00000{i}" for i in (1, 2, 3)]
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"id": "a", "image": \n')
    for flags, error in ((["--model", str(tmp_path / "no-such-model")], "no such model folder"),
                         (["--data", str(broken)], f"{broken}:1")):  # fmt: skip
        with pytest.raises(UserError, match=error):  # checked before --overwrite deletes anything
            train.main(["--preset", "tiny", "--steps", "2", "--out", out, "--overwrite", *flags])
        assert (tmp_path / "x" / "ledger.jsonl").read_text() == before
    train.main(["--preset", "tiny", "--steps", "2", "--out", out, "--overwrite"])
    assert [r["step"] for r in read_ledger(tmp_path / "x" / "ledger.jsonl")] == [0, 1]
    assert sorted(p.name for p in (tmp_path / "x").glob("checkpoint-*")) == ["checkpoint-000002"]


def test_ctrl_c_keeps_the_checkpoints_and_says_how_to_go_on(tmp_path, tiny, monkeypatch, capsys):
    out = tmp_path / "c"
    step = opd.run.Run.step

    def stopped_at_2(self, k):
        if k == 2:
            raise KeyboardInterrupt
        return step(self, k)

    monkeypatch.setattr(opd.run.Run, "step", stopped_at_2)
    with pytest.raises(SystemExit) as stop:
        train.run_cli(train.main, ["--preset", "tiny", "--steps", "4", "--save-every", "1", "--out", str(out)], "train.py")
    assert stop.value.code == 130
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == f"train.py: interrupted: at step 2; {out} keeps checkpoint-000002: continue with --resume {out} " \
                  "(the ledger's later rows are retrained)"
    with pytest.raises(KeyboardInterrupt, match="before its first checkpoint .*nothing can be resumed.*--overwrite"):
        train.main(["--preset", "tiny", "--steps", "4", "--save-every", "3", "--out", str(tmp_path / "d")])
    with pytest.raises(UserError, match="no checkpoint in .*nothing can be resumed: start over with the same command "
                       "and --overwrite"):  # fmt: skip
        train.main(["--resume", str(tmp_path / "d")])
    monkeypatch.setattr(opd.run.Run, "step", step)
    train.main(["--resume", str(out)])
    assert [r["step"] for r in read_ledger(out / "ledger.jsonl")] == [0, 1, 2, 3]


@pytest.mark.slow  # an end-to-end run (train, resume or export): -m slow
def test_resume_takes_the_runs_own_settings_and_refuses_method_changes(tmp_path, tiny, capsys):
    out = str(tmp_path / "r")
    train.main(["--preset", "tiny", "--steps", "3", "--save-every", "2", "--keep-checkpoints", "2", "--policy", "random", "--rho", "0.5", "--out", out])
    (tmp_path / "r" / "latest").write_text("checkpoint-000002\n")  # as if stopped after step 2
    for flags, field in ((["--rho", "0.25"], "--rho 0.25"), (["--policy", "entropy"], "--policy 'entropy'"),
                         (["--seed", "1"], "--seed 1"), (["--preset", "paper-4b"], "--preset 'paper-4b'")):  # fmt: skip
        with pytest.raises(UserError, match=f"{field} \\(the run has .*a resumed run keeps its own settings"):
            train.main(["--resume", out, *flags])
    summary = train.main(["--resume", out])  # no flags: the run's 3 steps, its policy and rho
    rows = read_ledger(tmp_path / "r" / "ledger.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2] and summary["steps"] == 3
    assert all(r["budget"] == r["candidates"] // 2 for r in rows)  # rho 0.5 throughout
    assert "| random-50 |" in capsys.readouterr().out
    stamp = lambda: ((st := (tmp_path / "r" / "summary.json").stat()).st_ino, st.st_mtime_ns)  # noqa: E731 (renamed when rewritten)
    before = stamp()
    assert train.main(["--resume", out]) == summary  # complete: nothing trained, nothing rewritten
    assert "is complete (3 of 3 steps)" in capsys.readouterr().out
    assert stamp() == before
    summary = train.main(["--resume", out, "--steps", "4"])  # run-length flags may change
    assert summary["steps"] == 4 and [r["step"] for r in read_ledger(tmp_path / "r" / "ledger.jsonl")] == [0, 1, 2, 3]


def test_micro_batching_may_change_on_resume_unless_the_loss_is_a_mean_per_micro_batch(tmp_path):
    for agg in ("token-mean", "sequence-mean", "micro-batch"):
        stored = {**opd.config.TrainConfig(loss_agg=agg).flags(), "micro_batch": 8}
        cfg = opd.config.TrainConfig(loss_agg=agg, micro_batch=2)
        if agg != "micro-batch":
            opd.config.refuse_changed_settings(cfg, stored, tmp_path, {"micro_batch"})
            continue
        with pytest.raises(UserError, match=r"--micro-batch 2 \(the run has 8\).*objective's own under --loss-agg micro"):
            opd.config.refuse_changed_settings(cfg, stored, tmp_path, {"micro_batch"})


@pytest.mark.slow
def test_torchrun_two_processes_record_two_ranks(tmp_path, tiny):
    """The README's 2-process CPU command runs two ranks, and the run says so."""
    out = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(ROOT / "train.py"),
           "--preset", "tiny", "--steps", "1", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    first = read_ledger(out / "ledger.jsonl")[0]
    assert summary["world_size"] == 2 and first["world_size"] == 2
    assert first["launch"]["world_size"] == 2 and first["launch"]["launcher"] == "torchrun"
    assert summary["launches"] == [first["launch"]] and "train.py --preset tiny --steps 1" in first["launch"]["command"]


def _run_worker(out: Path, nproc: int, *args: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    worker = str(ROOT / "tests" / "ddp_worker.py")
    if nproc == 1:
        cmd = [sys.executable, worker]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), worker]
    proc = subprocess.run(cmd + ["--out", str(out), *args], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(out / "result.pt", weights_only=False)


@pytest.mark.slow
@pytest.mark.parametrize("policy,skew,method", [("random", False, "bas-opd"), ("entropy", True, "bas-opd"),
                                                ("learned", False, "rp-opsd"), ("random", False, "dapd"),
                                                ("entropy", True, "opod")])  # fmt: skip
def test_two_process_ddp_matches_one_process(tmp_path, tiny, policy, skew, method):
    """DAPD (four student backwards per micro-batch, one synchronised) and OPOD (the distillation pass unsynchronised,
    the policy-gradient pass synchronised; with --skew rank 1 has no selected row) too. Both sides in float64
    (tests/float64.py): the two runs group the same rows into other micro-batches and sum the gradients in another
    order, which in float32 moved a few weights by ~0.3 of an Adam update (3e-4), depending on the CPU."""
    from float64 import assert_same_weights

    args = ["--policy", policy, "--method", method, "--dtype", "float64"] + (["--skew"] if skew else [])
    if method == "opod":
        from opd.tiny import build_tiny_model

        args += ["--teacher-model", str(build_tiny_model(tmp_path / "teacher", seed=1))]
    one = _run_worker(tmp_path / "one", 1, *args)
    two = _run_worker(tmp_path / "two", 2, *args)
    for r1, r2 in zip(one["rows"], two["rows"], strict=True):
        for key in ("candidates", "budget", "selected", "scored_tokens", "teacher_rows"):
            assert r1[key] == r2[key], key
        # a float64 sum of >= 0 per-token terms over the same tokens in another order: ~1e-15 relative (5e-14
        # measured, rp-opsd's loss of 6e-5 being JSDs of nearly equal distributions)
        assert r1["loss"] == pytest.approx(r2["loss"], rel=1e-9)
    assert [s.tolist() for s in one["selected"]] == [s.tolist() for s in two["selected"]]
    for name in ("params", "teacher"):  # ddp_worker: 2 steps at lr 1e-3; the EMA teacher moves less
        assert_same_weights(one[name], two[name], lr=1e-3, steps=2, what=name)
    per_rank = two["teacher_rows"]  # (2 ranks, 2 steps)
    assert per_rank.sum(0).tolist() == [r["teacher_rows"] for r in two["rows"]]
    if skew:  # every selected row lies on rank 0; rank 1 held none and still finished both steps
        assert per_rank[1].tolist() == [0, 0] and per_rank[0].sum() > 0


@pytest.mark.slow
def test_accelerate_launch_runs_the_default(tmp_path, tiny):
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--cpu",
           str(ROOT / "train.py"), "--preset", "tiny", "--policy", "learned", "--rho", "0.25", "--steps", "2", "--out",
           str(tmp_path / "acc")]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| learned-25 |" in proc.stdout
    assert len(read_ledger(tmp_path / "acc" / "ledger.jsonl")) == 2


def test_help_lists_ablation_switches_once(capsys):
    with pytest.raises(SystemExit):
        train.main(["--help"])
    text = capsys.readouterr().out
    assert "--no-overlap" in text and "--no-exploration" in text and "--overwrite" in text
    assert "--no-no-" not in text and "--share-prefill, --no-share-prefill" in text


def test_the_teachers_lm_head_inside_the_fused_loss_is_teacher_time(tmp_path, tiny, monkeypatch):
    """Table 8's teacher-forward time includes the teacher's LM-head work done inside the chunked loss."""
    fused = opd.methods.micro_batch.budgeted_loss_from_hidden

    def slow_teacher_head(*args, timing=None, **kwargs):
        out = fused(*args, timing=timing, **kwargs)
        if timing is not None:
            timing["teacher_s"] = timing.get("teacher_s", 0.0) + 7.0  # as if the teacher's logits took 7 s
        return out

    monkeypatch.setattr(opd.methods.micro_batch, "budgeted_loss_from_hidden", slow_teacher_head)
    run = Run(small_config(tmp_path, policy="full", rho=1.0, micro_batch=64, fused_kernel=True))
    row = run.step(0, fixed_rollouts(run, 0))
    assert row["teacher_forward_s"] >= 7.0 and row["teacher_forward_s_crop"] >= 7.0
    assert row["student_s"] < 7.0
