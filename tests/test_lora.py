"""LoRA (opd/models/lora.py) and the recipe knobs of the siblings' published recipes: the adapter's gradient against
autograd on the merged weights, one base in memory for the student and its teachers, checkpoints holding adapters
that eval.py scores and --resume continues exactly, the lr schedule per step, the sampled distribution under
temperature / top-k / top-p, the loss temperature, each aggregation against an explicit loop, and the bad flags."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bench_fixtures import write_vstar_fixture
from test_training import small_config

import opd.run
import train
from opd.models.chat import collate, encode_prompt
from opd.maths.chunked import budgeted_loss_from_hidden
from opd.cli import UserError
from opd.maths.family import aggregation_weights
from opd.maths.family import budgeted_loss, topk_divergence
from opd.models.adapter_teacher import AdapterTeacher
from opd.models.chat import response_logits
from opd.loop.ledger import read_ledger
from opd.models.lora import LoRAConfig, adapter_state, base_parameters, wrap
from opd.models.loading import load_model, load_processor, special_ids
from opd.engine.rollout import generate_rollouts
from opd.engine.synthetic import fixed_rollouts
from opd.data.records import student_view

ROOT = Path(__file__).resolve().parents[1]
F64 = torch.float64


def storages(*models) -> dict[int, int]:
    """Distinct parameter storages of the models (data pointer -> elements)."""
    seen = {}
    for m in models:
        for p in m.parameters():
            seen[p.untyped_storage().data_ptr()] = p.numel()
    return seen


def test_a_lora_runs_teachers_share_the_students_base(tmp_path, tiny):
    """One copy of the base in memory: the EMA teacher is an adapter of the policy itself; AdamW holds the student's
    adapter alone; the teacher's adapter starts as the student's copy and moves only by the EMA."""
    run = opd.run.Run(small_config(tmp_path, lora_r=4, policy="full", rho=1.0))
    assert isinstance(run.teacher, AdapterTeacher) and run.teacher.model is run.model and run.teacher.adapter == "teacher"
    plain = load_model(str(tiny[0]))
    base = sum(p.numel() for p in plain.parameters())
    assert base_parameters(run.model) == base
    held = storages(run.model, run.teacher.model)  # every parameter once
    assert sum(held.values()) == sum(p.numel() for p in run.model.parameters()) < 2 * base
    trained = {id(p) for g in run.optimizer.param_groups for p in g["params"]}
    names = [n for n, p in run.model.named_parameters() if id(p) in trained]
    assert names and all("lora_" in n and ".default." in n for n in names)
    student, teacher = adapter_state(run.model, "default"), adapter_state(run.model, "teacher")
    assert student.keys() == teacher.keys() and all(torch.equal(student[k], teacher[k]) for k in student)
    run.step(0, fixed_rollouts(run, 0))
    moved = adapter_state(run.model, "default")
    after = adapter_state(run.model, "teacher")
    for k in student:  # theta-bar <- (1 - tau) theta-bar + tau theta, on the adapter
        torch.testing.assert_close(after[k], (1 - 0.05) * teacher[k] + 0.05 * moved[k], rtol=1e-6, atol=1e-7)
    assert any(not torch.equal(moved[k], student[k]) for k in student)
    frozen = [n for n, p in run.model.named_parameters() if not p.requires_grad]
    assert frozen and all(p.grad is None for p in run.model.parameters() if not p.requires_grad)  # no base-size grads


def test_the_adapters_gradient_is_autograd_on_the_merged_weights(tiny):
    """dL/dA = s B^T dL/dW and dL/dB = s dL/dW A^T with W = W_0 + s B A (s = alpha / r): one loss of the training
    path (the chunked Eq. 11 against a perturbed teacher) through the adapted model, against the gradient of the same
    loss with each adapted layer's weight merged into a plain leaf, in float64."""
    from float64 import float64_model

    float64_model()
    model_dir, data = tiny
    processor = load_processor(str(model_dir))
    settings = LoRAConfig(r=4, alpha=6.0)
    torch.manual_seed(0)
    peft_model = wrap(load_model(str(model_dir), "float64"), settings).train()
    with torch.no_grad():  # B = 0 at init would make dL/dA zero: move it
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)
    from opd.data.sources import load_records

    records = load_records(data)[:2]
    prompts = [encode_prompt(processor, *student_view(r)) for r in records]
    ids = special_ids(peft_model)
    a, b, c, d = processor.tokenizer.convert_tokens_to_ids(list("abcd"))
    response = torch.tensor([[a, b, c, ids["eos"][0]], [d, a, ids["eos"][0], ids["pad"]]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    inputs = collate(prompts, ids["pad"], response, mask)
    teacher = load_model(str(model_dir), "float64")
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1), dtype=F64) * 0.05)
        h_t = teacher(**inputs, logits_to_keep=1, output_hidden_states=True, use_cache=False).hidden_states[-1][:, -5:-1][mask]
    w_t = teacher.get_output_embeddings().weight.detach()

    def loss_of(model):
        h = model(**inputs, logits_to_keep=1, output_hidden_states=True, use_cache=False).hidden_states[-1][:, -5:-1][mask]
        w = model.get_output_embeddings().weight
        return budgeted_loss_from_hidden(h, w, h_t, w_t, torch.full((int(mask.sum()),), 1 / mask.sum(), dtype=F64), 7, 0.5, 3)[0]

    loss_of(peft_model).backward()
    scale = settings.scale_alpha / settings.r
    merged = load_model(str(model_dir), "float64")
    layers = {}
    for name, module in peft_model.named_modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
            A, B = module.lora_A["default"].weight, module.lora_B["default"].weight
            target = merged.get_submodule(name.removeprefix("base_model.model."))
            with torch.no_grad():
                target.weight.add_(scale * B.detach() @ A.detach())
            layers[name] = (A, B, target.weight)
    assert len(layers) > 5
    merged.requires_grad_(False)
    for _, _, w in layers.values():
        w.requires_grad_(True)
    loss_of(merged).backward()
    for name, (A, B, w) in layers.items():
        torch.testing.assert_close(A.grad, scale * B.detach().T @ w.grad, rtol=1e-9, atol=1e-13, msg=name)
        torch.testing.assert_close(B.grad, scale * w.grad @ A.detach().T, rtol=1e-9, atol=1e-13, msg=name)


@pytest.mark.slow  # an end-to-end run (train, resume or export): -m slow
def test_a_lora_run_checkpoints_adapters_eval_scores_it_and_resume_is_exact(tmp_path, tiny):
    """`train.py --lora-r 8`: its checkpoint holds adapters (no base), eval.py --model RUN scores it (the adapter
    merged into its base), and 2 + 2 resumed steps equal 4 uninterrupted ones (ledger and adapters)."""
    import eval as eval_py

    common = ["--preset", "tiny", "--lora-r", "8", "--policy", "learned", "--rho", "0.5", "--save-every", "2"]
    train.main([*common, "--steps", "4", "--out", str(tmp_path / "whole")])
    train.main([*common, "--steps", "2", "--out", str(tmp_path / "split")])
    train.main(["--resume", str(tmp_path / "split"), "--steps", "4"])
    timing = lambda k: k.endswith("_s") or k.startswith("teacher_forward_s_") or k == "launch"  # noqa: E731
    a, b = (read_ledger(tmp_path / n / "ledger.jsonl") for n in ("whole", "split"))
    assert [{k: v for k, v in r.items() if not timing(k)} for r in a] == [{k: v for k, v in r.items() if not timing(k)} for r in b]
    ckpt_a, ckpt_b = (tmp_path / n / "checkpoint-000004" for n in ("whole", "split"))
    assert sorted(p.name for p in (ckpt_a / "policy").iterdir() if p.name.startswith("adapter")) == [
        "adapter_config.json", "adapter_model.safetensors"]  # fmt: skip
    assert not (ckpt_a / "policy" / "model.safetensors").exists() and (ckpt_a / "teacher" / "adapter_model.safetensors").exists()
    from safetensors.torch import load_file

    for part in ("policy", "teacher"):
        x, y = (load_file(str(c / part / "adapter_model.safetensors")) for c in (ckpt_a, ckpt_b))
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    write_vstar_fixture(tmp_path / "bench")
    res = eval_py.main(["--model", str(tmp_path / "whole"), "--benchmarks", "vstar", "--data-dir", str(tmp_path / "bench"),
                        "--out", str(tmp_path / "eval"), "--max-new-tokens", "3", "--device", "cpu", "--no-progress"])  # fmt: skip
    assert "vstar" in res["results"] and res["results"]["vstar"]["n"] > 0


def lr_formula(name: str, step: int, peak: float, warmup: int, total: int) -> float:
    """transformers' schedules written out: linear warm-up from 0, then constant, linear to 0 or half a cosine to 0,
    held at 0 after `total` steps (opd/loop/optim.py: transformers' cosine would climb back)."""
    if step < warmup:
        return peak * step / max(1, warmup)
    if name == "constant":
        return peak
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if name == "linear":
        return peak * max(0.0, 1 - progress)
    return peak * max(0.0, 0.5 * (1 + math.cos(math.pi * progress)))


@pytest.mark.slow  # an end-to-end run (train, resume or export): -m slow
@pytest.mark.parametrize("name,warmup,span", [("constant", 3, 0), ("linear", 2, 0), ("cosine", 1, 12), ("cosine", 1, 4)])
def test_the_learning_rate_per_step_follows_its_schedule(tmp_path, tiny, name, warmup, span):
    """The ledger's lr of each step (the rate its update used) against the formula; a resume continues the schedule
    it started with (its span: --schedule-steps, else the first launch's --steps, restored with the scheduler)."""
    out = tmp_path / name
    flags = ["--preset", "tiny", "--lr", "1e-3", "--lr-schedule", name, "--warmup-steps", str(warmup), "--schedule-steps", str(span),
             "--policy", "random", "--rho", "0.5", "--save-every", "3"]  # fmt: skip
    train.main([*flags, "--steps", "3", "--out", str(out)])
    train.main(["--resume", str(out), "--steps", "6"])
    lrs = [r["lr"] for r in read_ledger(out / "ledger.jsonl")]
    total = span or 3  # the first launch's 3 steps
    assert lrs == pytest.approx([lr_formula(name, s, 1e-3, warmup, total) for s in range(6)], rel=1e-9, abs=1e-15)


def warp(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The sampling distribution written out: logits / T, then the k largest kept, then the smallest set of the
    largest whose probability reaches p (the first token always kept); the rest -inf."""
    z = logits / temperature
    if top_k:
        kth = z.topk(top_k, dim=-1).values[..., -1:]
        z = torch.where(z < kth, torch.full_like(z, -math.inf), z)
    if top_p < 1:
        order = z.argsort(dim=-1, descending=True)
        p = torch.softmax(z, -1).gather(-1, order)
        before = p.cumsum(-1) - p  # mass of the tokens ranked above
        drop = torch.zeros_like(z, dtype=torch.bool).scatter(-1, order, before >= top_p)
        z = torch.where(drop, torch.full_like(z, -math.inf), z)
    return z


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.1, 20, 0.95), (0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.6)])
def test_rollout_stats_are_those_of_the_warped_distribution(tiny, temperature, top_k, top_p):
    """The recorded log-probs and entropies equal a forward over the finished sequence warped independently
    (float64), and every sampled token lies in the warped distribution's support."""
    from float64 import float64_model

    float64_model()
    model_dir, data = tiny
    model, processor = load_model(str(model_dir), "float64"), load_processor(str(model_dir))
    from opd.data.sources import load_records

    records = load_records(data)[:2]
    prompts = [encode_prompt(processor, *student_view(r)) for r in records]
    torch.manual_seed(0)
    ro = generate_rollouts(model, prompts, 4, 10, temperature=temperature, top_k=top_k, top_p=top_p)
    ids = special_ids(model)
    inputs = collate([prompts[j] for j in ro.prompt_index.tolist()], ids["pad"], ro.response_ids, ro.response_mask)
    with torch.no_grad():
        logits = response_logits(model, inputs, ro.response_ids.shape[1]).double()  # (N, T, V)
    logits[..., ids["vision"]] = -math.inf
    logp = torch.log_softmax(warp(logits, temperature, top_k, top_p), -1)
    mask = ro.response_mask
    got = logp.gather(-1, ro.response_ids.unsqueeze(-1)).squeeze(-1)
    assert torch.isfinite(got[mask]).all()  # every sampled token inside the kept set
    torch.testing.assert_close(ro.logp[mask].double(), got[mask], rtol=0, atol=1e-6)
    p = logp.exp()
    entropy = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)
    torch.testing.assert_close(ro.entropy[mask].double(), entropy[mask], rtol=0, atol=1e-6)


@pytest.mark.parametrize("support", ["student_tail", "teacher_renorm", "full"])
def test_the_loss_temperature_divides_both_sides_logits(support):
    """The chunked loss at temperature T equals D(z_s / T, z_t / T) by autograd, values and gradients (float64)."""
    g = torch.Generator().manual_seed(2)
    P, H, V = 8, 5, 19
    h_s = torch.randn(P, H, generator=g, dtype=F64, requires_grad=True)
    w_s = torch.randn(V, H, generator=g, dtype=F64, requires_grad=True)
    h_t, w_t = torch.randn(P, H, generator=g, dtype=F64), torch.randn(V, H, generator=g, dtype=F64)
    weights = torch.linspace(0.3, 1.2, P, dtype=F64)
    loss, d, _ = budgeted_loss_from_hidden(h_s, w_s, h_t, w_t, weights, 6, 0.5, 3, support=support, temperature=1.1)
    loss.backward()
    got = h_s.grad.clone(), w_s.grad.clone()
    h_s.grad = w_s.grad = None
    plain = topk_divergence((h_s @ w_s.T) / 1.1, (h_t @ w_t.T) / 1.1, 6, 0.5, support=support)
    (weights * plain).sum().backward()
    torch.testing.assert_close(d, plain.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got[0], h_s.grad, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(got[1], w_s.grad, rtol=1e-10, atol=1e-13)
    untempered = budgeted_loss_from_hidden(h_s, w_s, h_t, w_t, weights, 6, 0.5, 3, support=support)[0]
    assert abs(float(untempered) - float(loss)) > 1e-6


def test_each_aggregation_against_an_explicit_loop():
    """aggregation_weights per micro-batch, summed over micro-batches (each with its own token count), against the
    formulas of opd.maths.family.AGGREGATION_WEIGHTS written as loops."""
    g = torch.Generator().manual_seed(3)
    D = torch.rand(7, 5, generator=g, dtype=F64)
    mask = torch.rand(7, 5, generator=g) > 0.35
    mask[:, 0] = True
    micro = [torch.tensor([0, 1, 2]), torch.tensor([3, 4]), torch.tensor([5, 6])]
    n_rows, n_tokens = 7, int(mask.sum())
    ones = torch.ones(7, dtype=F64)
    for agg in ("token-mean", "sequence-mean", "micro-batch"):
        denominator = n_tokens if agg == "token-mean" else n_rows
        total = sum(float((D[b] * aggregation_weights(agg, ones[b], mask[b], denominator, F64)).sum()) for b in micro)
        if agg == "token-mean":
            want = sum(float(D[i, t]) for i in range(7) for t in range(5) if mask[i, t]) / n_tokens
        elif agg == "sequence-mean":
            want = sum(sum(float(D[i, t]) for t in range(5) if mask[i, t]) / int(mask[i].sum()) for i in range(7)) / n_rows
        else:
            want = sum(len(b) / n_rows * sum(float(D[i, t]) for i in b.tolist() for t in range(5) if mask[i, t])
                       / int(mask[b].sum()) for b in micro)  # fmt: skip
        assert math.isclose(total, want, rel_tol=1e-13), agg


def test_a_sequence_mean_training_step_is_the_mean_of_each_rows_token_mean(tmp_path, tiny):
    """--loss-agg sequence-mean through opd.run.Run (float64): the step's loss is (1 / |S|) sum_i mean_t D_it from full
    logits (a different number from the token mean, since the rows differ in length)."""
    from float64 import float64_model
    from test_training import divergence_before_update, perturb

    float64_model()
    run = opd.run.Run(small_config(tmp_path, policy="full", rho=1.0, loss_agg="sequence-mean", dtype="float64", lr=0.0))
    perturb(run.teacher.model)
    rollouts = fixed_rollouts(run, 0)
    records = run.prompts.of_step(0)
    index = rollouts.prompt_index.tolist()
    d = divergence_before_update(run, rollouts, records)  # (N, T) Eq. 3
    row = run.step(0, rollouts)
    eligible = torch.tensor([records[j].eligible for j in index])
    mask = rollouts.response_mask
    per_row = (d * mask).sum(-1) / mask.sum(-1)
    assert row["loss"] == pytest.approx(float(per_row[eligible].mean()), rel=1e-10)
    assert row["loss"] != pytest.approx(float(budgeted_loss(d, eligible.double(), mask)), rel=1e-6)


@pytest.mark.parametrize("flags,message", [
    (["--lora-r", "-1"], "--lora-r -1: must be >= 0"),
    (["--lora-r", "4", "--lora-targets", "no_such_proj"], "--lora-targets 'no_such_proj': matches no linear module"),
    (["--warmup-steps", "9", "--steps", "2"], "--warmup-steps 9: beyond the schedule's 2 steps"),
    (["--sample-top-p", "0"], r"--sample-top-p 0.0: must lie in \(0, 1\]"),
    (["--sample-top-p", "1.5"], r"--sample-top-p 1.5: must lie in \(0, 1\]"),
    (["--loss-agg", "token-median"], "--loss-agg 'token-median': choose one of token-mean, sequence-mean, micro-batch, token-sum"),
    (["--lr-schedule", "step"], "--lr-schedule 'step': choose one of constant, linear, cosine"),
    (["--method", "dapd", "--loss-agg", "sequence-mean"], "--method dapd: --loss-agg does not apply"),
    (["--method", "dapd", "--lora-r", "4", "--ema-tau", "0"], "--method dapd: --ema-tau 0 .a fixed teacher. does not apply"),
    (["--method", "dapd", "--ema-tau", "0"], "--method dapd: --ema-tau 0 .a fixed teacher. does not apply"),
])  # fmt: skip
def test_bad_lora_and_recipe_flags_are_one_line(tmp_path, tiny, flags, message):
    with pytest.raises(UserError, match=message):
        train.main(["--preset", "tiny", *flags, "--out", str(tmp_path / "r")])


@pytest.mark.slow
def test_every_method_alone_records_its_published_recipe(tmp_path, tiny):
    """train.py --method M --steps 2 writes the recipe of opd.methods.table (the values the README's table shows) into
    train_config.json; a flag given wins over the recipe."""
    from opd.methods.table import METHODS

    for name, method in METHODS.items():
        if not method.recipe:
            continue
        extra = ["--teacher-model", "tiny"] if method.external_teachers == "required" else []
        out = tmp_path / name
        train.main(["--preset", "tiny", "--method", name, "--steps", "1", "--out", str(out), *extra])
        stored = json.loads((out / "checkpoint-000001" / "train_config.json").read_text())
        assert {k: stored[k] for k in method.recipe} == method.recipe, name
    train.main(["--preset", "tiny", "--method", "opsd", "--steps", "1", "--lora-r", "0", "--loss-agg", "token-mean", "--out", str(tmp_path / "w")])
    stored = json.loads((tmp_path / "w" / "checkpoint-000001" / "train_config.json").read_text())
    assert stored["lora_r"] == 0 and stored["loss_agg"] == "token-mean" and stored["sample_temperature"] == 1.1


@pytest.mark.slow
def test_two_rank_fsdp_lora_equals_two_rank_ddp_lora(tmp_path, tiny):
    """torchrun --nproc_per_node 2 train.py --fsdp --lora-r 8 against the 2-rank DDP run with the same flags, both in
    float64 (tests/float64_train.py): the same selections, budgets and teacher rows, losses within float64 rounding,
    and the same adapters at the end; a sharded run stopped after 2 steps and resumed ends with the same adapters (its
    EMA teacher's adapter is in the policy's shards; a warm-up schedule's rate is restored with the optimizer)."""
    script = ROOT / "tests" / "float64_train.py"
    common = ["--preset", "tiny", "--lora-r", "8", "--policy", "learned", "--rho", "0.25", "--dtype", "float64", "--lr-schedule", "linear",
              "--warmup-steps", "1", "--schedule-steps", "3", "--save-every", "2"]  # fmt: skip

    def launch(*args):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script), *args]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env={"OMP_NUM_THREADS": "1",
                              **{k: v for k, v in __import__("os").environ.items()}})  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]

    launch(*common, "--steps", "3", "--out", str(tmp_path / "ddp"))
    launch(*common, "--steps", "3", "--fsdp", "--out", str(tmp_path / "fsdp"))
    launch(*common, "--steps", "2", "--fsdp", "--out", str(tmp_path / "split"))
    launch("--resume", str(tmp_path / "split"), "--steps", "3")
    ddp, fsdp = (read_ledger(tmp_path / n / "ledger.jsonl") for n in ("ddp", "fsdp"))
    assert len(ddp) == len(fsdp) == 3
    for a, b in zip(ddp, fsdp):
        for key in ("candidates", "budget", "selected", "scored_tokens", "teacher_rows"):
            assert a[key] == b[key], (a["step"], key)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-9)
    from safetensors.torch import load_file

    x, y, z = (load_file(str(tmp_path / n / "checkpoint-000003" / "policy" / "adapter_model.safetensors"))
               for n in ("ddp", "fsdp", "split"))  # fmt: skip
    assert x.keys() == y.keys() == z.keys()
    for k in x:
        torch.testing.assert_close(x[k], y[k], rtol=0, atol=3 * 1e-4 * 1e-7, msg=k)  # steps x lr x 1e-7 (tests/float64.py)
        torch.testing.assert_close(z[k], y[k], rtol=0, atol=3 * 1e-4 * 1e-7, msg=k)
    split = read_ledger(tmp_path / "split" / "ledger.jsonl")
    assert [r["lr"] for r in split] == pytest.approx([r["lr"] for r in fsdp], rel=1e-12)


def test_loading_an_adapter_checks_every_tensor(tmp_path, tiny):
    """load_adapter restores the saved adapter exactly, and refuses a file that lacks some of the adapter's LoRA
    tensors (saved with fewer --lora-targets): a silently kept initial value would train from the wrong start."""
    from opd.models.lora import load_adapter, save_adapter

    torch.manual_seed(0)
    saved = wrap(load_model(str(tiny[0])), LoRAConfig(r=4, targets="q_proj,v_proj"))
    with torch.no_grad():
        for n, p in saved.named_parameters():
            if "lora_" in n:
                p.normal_()  # lora_B starts at zero: make every tensor distinct from a fresh adapter
    save_adapter(saved, "default", tmp_path / "qv")
    same = wrap(load_model(str(tiny[0])), LoRAConfig(r=4, targets="q_proj,v_proj"))
    load_adapter(same, "default", tmp_path / "qv")
    want, got = adapter_state(saved, "default"), adapter_state(same, "default")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    wider = wrap(load_model(str(tiny[0])), LoRAConfig(r=4, targets="q_proj,k_proj,v_proj"))
    with pytest.raises(ValueError, match="missing"):
        load_adapter(wider, "default", tmp_path / "qv")
