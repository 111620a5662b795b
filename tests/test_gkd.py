"""GKD (Agarwal et al. 2024; TRL's GKDTrainer) as the family's 8th method: an external teacher on the student's own
view, the generalized JSD with GKD's beta over the full vocabulary, BAS-OPD's budget on top. TRL's loss is written
out here from its definition (trl/trainer/gkd_trainer.py, `generalized_jsd_loss`), not imported."""

import math

import pytest
import torch
import torch.nn.functional as F
from test_training import small_config

import opd.cli
import train
from opd.maths.chunked import budgeted_loss_from_hidden, topk_divergence_from_logits
from opd.maths.family import topk_divergence
from opd.loop.ledger import read_ledger
from opd.run import Run
from opd.methods.table import get_method
from opd.engine.synthetic import fixed_rollouts
from opd.tiny import build_tiny_model

F64 = torch.float64


def trl_generalized_jsd_loss(student_logits, teacher_logits, labels=None, beta=0.5, temperature=1.0, reduction="batchmean"):
    """TRL's GKDTrainer.generalized_jsd_loss, transcribed: log-softmax at the temperature, the mixture in log space,
    F.kl_div(input=log M, target=...) per token, masked by labels != -100, 'batchmean' = sum / number of tokens."""
    student_log_probs = F.log_softmax(student_logits / temperature, dim=-1)
    teacher_log_probs = F.log_softmax(teacher_logits / temperature, dim=-1)
    if beta == 0:
        jsd = F.kl_div(student_log_probs, teacher_log_probs, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(teacher_log_probs, student_log_probs, reduction="none", log_target=True)
    else:
        beta_t = torch.tensor(beta, dtype=student_log_probs.dtype)
        mixture_log_probs = torch.logsumexp(
            torch.stack([student_log_probs + torch.log(1 - beta_t), teacher_log_probs + torch.log(beta_t)]), dim=0
        )
        kl_teacher = F.kl_div(mixture_log_probs, teacher_log_probs, reduction="none", log_target=True)
        kl_student = F.kl_div(mixture_log_probs, student_log_probs, reduction="none", log_target=True)
        jsd = beta_t * kl_teacher + (1 - beta_t) * kl_student
    if labels is not None:
        mask = labels != -100
        jsd = jsd[mask]
    if reduction == "batchmean":
        return jsd.sum() / mask.sum() if labels is not None else jsd.sum() / (jsd.size(0) * jsd.size(1))
    if reduction == "none":
        return jsd
    raise ValueError(reduction)


def logits(n=3, T=5, V=17, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, T, V, generator=g, dtype=F64) * scale, torch.randn(n, T, V, generator=g, dtype=F64) * scale


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_gkd_support_equals_trls_generalized_jsd_per_token_and_as_a_batch_mean(beta):
    z_s, z_t = logits(seed=int(beta * 10))
    labels = torch.ones(3, 5, dtype=torch.long)
    labels[0, 3:] = -100  # padding after EOS
    labels[2, 1:] = -100
    method = get_method("gkd")
    d = topk_divergence(z_s, z_t, 100, beta, support=method.support, divergence=method.divergence)  # (3, 5)
    trl_tokens = trl_generalized_jsd_loss(z_s, z_t, None, beta, reduction="none").sum(-1)  # (3, 5)
    torch.testing.assert_close(d, trl_tokens, rtol=1e-12, atol=1e-14)
    mask = labels != -100
    ours = (d * mask).sum() / mask.sum()  # Eq. 11 with every row selected: the token mean
    torch.testing.assert_close(ours, trl_generalized_jsd_loss(z_s, z_t, labels, beta), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_the_full_vocabulary_support_from_hidden_states_and_logits(chunk):
    """Values and gradients of the chunked paths with support 'full' against autograd on the plain formula."""
    g = torch.Generator().manual_seed(3)
    P, H, V = 9, 6, 23
    h_s = torch.randn(P, H, generator=g, dtype=F64, requires_grad=True)
    w_s = torch.randn(V, H, generator=g, dtype=F64, requires_grad=True)
    h_t, w_t = torch.randn(P, H, generator=g, dtype=F64), torch.randn(V, H, generator=g, dtype=F64)
    weights = torch.linspace(0.2, 1.5, P, dtype=F64)
    loss, d, _ = budgeted_loss_from_hidden(h_s, w_s, h_t, w_t, weights, 5, 0.3, chunk, support="full")
    loss.backward()
    got = h_s.grad.clone(), w_s.grad.clone()
    h_s.grad = w_s.grad = None
    plain = topk_divergence(h_s @ w_s.T, h_t @ w_t.T, 5, 0.3, support="full")
    (weights * plain).sum().backward()
    torch.testing.assert_close(d, plain.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got[0], h_s.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got[1], w_s.grad, rtol=1e-10, atol=1e-12)
    z = (h_s @ w_s.T).detach().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda x: topk_divergence_from_logits(x, (h_t @ w_t.T), 5, 0.3, chunk, support="full")[0], (z,)
    )


@pytest.fixture(scope="module")
def gkd_teacher(tmp_path_factory):
    """A separate tiny checkpoint with the policy's tokenizer (other weights): GKD's larger teacher."""
    return build_tiny_model(tmp_path_factory.mktemp("gkd") / "teacher", seed=5)


def test_a_gkd_step_is_trls_batch_mean_over_the_queried_rows(tmp_path, tiny, gkd_teacher):
    """Full querying: the step's loss equals TRL's batchmean of the generalized JSD over every valid token of the
    rollouts (the student and the external teacher on the student's own prompt, full vocabulary), in float64."""
    from float64 import float64_model

    float64_model()
    cfg = small_config(tmp_path, method="gkd", teacher_model=str(gkd_teacher), policy="full", rho=1.0, alpha=0.7,
                       dtype="float64", lr=0.0, loss_chunk=4, fused_kernel=True)  # fmt: skip
    run = Run(cfg)
    assert run.teachers.names == ["teacher"] and not run.teacher.trainable and run.teacher_views == ("full",)
    rollouts = fixed_rollouts(run, 0)
    from opd.models.chat import collate

    prompts = run.prompts.student(run.prompts.of_step(0))
    inputs = collate([prompts[j] for j in rollouts.prompt_index.tolist()], run.ids["pad"], rollouts.response_ids,
                     rollouts.response_mask)  # fmt: skip
    with torch.no_grad():
        n = rollouts.response_ids.shape[1]
        z_s = run.model(**inputs, logits_to_keep=n + 1, use_cache=False).logits[:, :-1]
        z_t = run.teacher.model(**inputs, logits_to_keep=n + 1, use_cache=False).logits[:, :-1]
    labels = torch.where(rollouts.response_mask, rollouts.response_ids, torch.full_like(rollouts.response_ids, -100))
    want = float(trl_generalized_jsd_loss(z_s.double(), z_t.double(), labels, beta=0.7))
    row = run.step(0, rollouts)
    assert row["selected"] == row["candidates"] == row["teacher_rows"] == int(rollouts.valid.sum())
    assert math.isclose(row["loss"], want, rel_tol=1e-10), (row["loss"], want)


def test_gkd_runs_with_a_budget_and_needs_a_teacher(tmp_path, tiny, gkd_teacher):
    train.main(["--preset", "tiny", "--method", "gkd", "--teacher-model", str(gkd_teacher), "--policy", "learned", "--rho", "0.25",
                "--steps", "2", "--out", str(tmp_path / "g")])  # fmt: skip
    rows = read_ledger(tmp_path / "g" / "ledger.jsonl")
    assert len(rows) == 2 and all(r["selected"] == r["budget"] == r["candidates"] // 4 for r in rows)
    assert all(r["teacher_rows"] == r["selected"] and r["teacher_rows_full"] == r["selected"] for r in rows)
    with pytest.raises(opd.cli.UserError, match="--method gkd distils from a separate teacher checkpoint"):
        train.main(["--preset", "tiny", "--method", "gkd", "--out", str(tmp_path / "none")])
