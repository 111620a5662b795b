"""Thinking Machines' on-policy distillation (opd/methods/tm_opd.py, --method tm-opd) against its formula written out.

The run's gradient equals autograd's of the published loss over S written on whole logits in float64,

    L = - sum_{i in S, t} A_t exp(log pi_theta(y_t) - log pi_old(y_t)),   A_t = -(log pi_old(y_t) - log pi_T(y_t)),

with S budgeted (Eq. 4) and the teacher run on S's rows only. The fixed rollouts' log-probs pi_old are random, not
the policy's, so the importance ratio is far from 1 and the test sees it.
"""

import math

import pytest
import torch
from float64 import float64_model

from opd.models.chat import micro_batch_inputs
from opd.config import resolve
from opd.models.chat import response_logits
from opd.run import Run
from opd.engine.synthetic import fixed_rollouts
from opd.tiny import build_tiny_model
from opd.methods.tm_opd import discounted_future_sum, token_advantages


def test_token_advantages_and_their_discounted_sum_are_the_formulas():
    old, teacher = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.5, -1.0, -0.5])
    assert torch.equal(token_advantages(old, teacher, 2.0), torch.tensor([-1.0, 2.0, -0.0]))
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 5, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    out = discounted_future_sum(a, mask, 0.7)
    for i in range(3):  # the double loop: sum over the valid s >= t of gamma^(s - t) a_s
        n = int(mask[i].sum())
        for t in range(5):
            want = sum(0.7 ** (s - t) * float(a[i, s]) for s in range(t, n)) if t < n else 0.0
            assert math.isclose(float(out[i, t]), want, rel_tol=1e-12, abs_tol=1e-15)
    assert torch.equal(discounted_future_sum(a, mask, 0.0), a * mask)


def test_a_budgeted_step_is_the_published_loss_written_out_in_float64(tmp_path, tiny):
    float64_model()
    teacher_dir = build_tiny_model(tmp_path / "teacher", seed=1)
    cfg = resolve(dict(preset="tiny", out=str(tmp_path / "run"), method="tm-opd", teacher_model=str(teacher_dir), policy="random",
                       rho=0.5, max_response_len=8, steps=1, micro_batch=3, dtype="float64", lora_r=4,
                       lr=0.0))  # fmt: skip (lr 0: the formula below reads the weights the step's gradient saw)
    assert (cfg.loss.aggregation, cfg.sampling.rollouts_per_prompt, cfg.optim.adam_beta2) == ("token-sum", 4, 0.95)
    run = Run(cfg)
    seen, grads = {}, {}
    batch_of = run.prompts.batch
    run.prompts.batch = lambda *a, **k: seen.setdefault("batch", batch_of(*a, **k))
    step = run.optimizer.step
    trained = {n: p for n, p in run.model.named_parameters() if p.requires_grad}

    def record_then_step(*a, **k):
        grads.update({n: p.grad.detach().clone() for n, p in trained.items()})
        return step(*a, **k)

    run.optimizer.step = record_then_step
    teacher = run.teacher
    before = teacher.rows_scored
    row = run.step(0, fixed_rollouts(run, 0))
    batch = seen["batch"]
    ro, sel = batch.rollouts, batch.selected
    assert row["budget"] == math.floor(0.5 * row["candidates"]) == row["selected"] == sel.numel() > 0
    assert teacher.rows_scored - before == row["teacher_rows"] == sel.numel()

    for p in trained.values():
        p.grad = None
    loss = torch.zeros((), dtype=torch.float64)
    for i in sel.tolist():  # the formula, row by row, on whole logits
        j, rows = int(ro.prompt_index[i]), torch.tensor([i])
        s_in, mask, width = micro_batch_inputs([batch.student_prompts[j]], ro, rows, run.ids["pad"], run.acc.device)
        t_in, _, _ = micro_batch_inputs([batch.teacher_prompt("teacher", "full", j)], ro, rows, run.ids["pad"],
                                        run.acc.device)  # fmt: skip
        y = ro.response_ids[rows, :width]
        logp = torch.log_softmax(response_logits(run.model, s_in, width).double(), -1).gather(-1, y[..., None])[..., 0]
        with torch.no_grad():
            t_logp = torch.log_softmax(response_logits(teacher.model, t_in, width).double(), -1).gather(-1, y[..., None])[..., 0]
        old = ro.logp[rows, :width].double()
        advantage = -(old - t_logp)
        loss = loss - (advantage * torch.exp(logp - old))[mask].sum()
    loss.backward()
    assert row["loss"] == pytest.approx(float(loss), rel=1e-9)
    for name, p in trained.items():
        want = p.grad if p.grad is not None else torch.zeros_like(p)
        bound = 1e-9 * float(want.abs().max()) + 1e-300
        assert float((grads[name] - want).abs().max()) <= bound, name
    assert any(float(g.abs().max()) > 0 for g in grads.values())
