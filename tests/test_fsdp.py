"""FSDP2 (--fsdp) on 2 CPU ranks (gloo) against the unsharded 1-process run, checkpoints and generation.

Each test launches tests/fsdp_worker.py (one process for the reference, torchrun with 2 processes for the
sharded run); the worker gathers the full weights, so values are compared here.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train
from opd.cli import UserError
from opd.loop.ledger import read_ledger

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("bas-opd", "vision-opd", "rp-opsd", "opd-v", "opsd")
COUNTS = ("rollouts", "candidates", "budget", "selected", "overrun", "teacher_rows", "scored_tokens",
          "candidate_tokens", "teacher_tokens", "skipped")  # fmt: skip
"""Ledger columns that do not depend on how a rank groups its rows (the padding does)."""


def _launch(out: Path, nproc: int, script: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(script)]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), str(script)]
    proc = subprocess.run(cmd + list(args), env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _worker(out: Path, nproc: int, *args: str) -> Path:
    _launch(out, nproc, ROOT / "tests" / "fsdp_worker.py", "--out", str(out), *args)
    return out


def _assert_same_run(one: dict, two: dict, method: str) -> None:
    """Same selections and counts, the same loss, and weights equal, both runs in float64 (--dtype float64,
    tests/float64.py): the sharded run sums each gradient in another order (reduce-scatter, other micro-batches), which
    in float32 moved a few weights by a good part of an Adam update, depending on the CPU."""
    from float64 import assert_same_weights

    assert [s.tolist() for s in one["selected"]] == [s.tolist() for s in two["selected"]]
    for r1, r2 in zip(one["rows"], two["rows"], strict=True):
        for key in COUNTS:
            assert r1[key] == r2[key], key
        assert r1["loss"] == pytest.approx(r2["loss"], rel=1e-9), method  # float64 sums of the same terms (~1e-15)
    for name in ("params", "teacher"):  # fsdp_worker: 2 steps at lr 1e-3 (BASE)
        assert_same_weights(one[name], two[name], lr=1e-3, steps=2, what=f"{method} {name}")
    per_rank = two["teacher_rows"]  # (2 ranks, 2 steps): the teacher rows each rank scored
    assert per_rank.sum(0).tolist() == [r["teacher_rows"] for r in two["rows"]]


@pytest.mark.slow
def test_fsdp_two_ranks_equal_one_unsharded_rank_when_one_rank_has_no_selected_row(tmp_path, tiny):
    """Same selection, parameters and EMA teacher after 2 steps; every selected row lies on rank 0, so rank 1
    pads every micro-batch with a zero-weighted one (its teacher scores nothing) and still completes."""
    args = ["--policy", "entropy", "--skew", "--dtype", "float64"]
    one = torch.load(_worker(tmp_path / "one", 1, *args) / "bas-opd.pt", weights_only=False)
    two = torch.load(_worker(tmp_path / "two", 2, *args, "--fsdp") / "bas-opd.pt", weights_only=False)
    _assert_same_run(one, two, "bas-opd")
    assert two["teacher_rows"][1].tolist() == [0, 0] and two["teacher_rows"][0].sum() > 0


@pytest.mark.slow
def test_fsdp_each_method_equals_one_unsharded_rank(tmp_path, tiny):
    """Every method of the family (views, supports, divergences, OPD-V's two teachers) sharded on 2 ranks,
    with micro-batches split by tokens so the ranks hold different numbers of them, and activation
    checkpointing (recomputation inside FSDP's backward) on both sides."""
    args = ["--methods", ",".join(METHODS), "--micro-batch-tokens", "300", "--grad-checkpointing", "--dtype", "float64"]
    one, two = _worker(tmp_path / "one", 1, *args), _worker(tmp_path / "two", 2, *args, "--fsdp")
    for method in METHODS:
        a, b = (torch.load(d / f"{method}.pt", weights_only=False) for d in (one, two))
        assert a["rows"][1]["selected"] > 0, method
        _assert_same_run(a, b, method)


@pytest.mark.slow
def test_fsdp_dapd_equals_one_unsharded_rank_when_one_rank_has_no_selected_row(tmp_path, tiny):
    """DAPD sharded on 2 ranks: both anchors sharded like the policy; rank 1 holds no selected row and pads every
    micro-batch (six anchor forwards, four student forwards and backwards) with zero-weighted ones."""
    args = ["--methods", "dapd", "--policy", "entropy", "--skew", "--dtype", "float64"]
    one = torch.load(_worker(tmp_path / "one", 1, *args) / "dapd.pt", weights_only=False)
    two = torch.load(_worker(tmp_path / "two", 2, *args, "--fsdp") / "dapd.pt", weights_only=False)
    _assert_same_run(one, two, "dapd")
    assert two["teacher_names"] == ["snapshot", "base"]
    per = two["per_teacher"]  # rows each anchor scored on each rank: 2 and 4 per selected row, none on rank 1
    assert per[1].tolist() == [0, 0] and per[0, 1] == 2 * per[0, 0] > 0


@pytest.mark.slow
def test_fsdp_opod_equals_one_unsharded_rank_when_one_rank_has_no_selected_row(tmp_path, tiny):
    """OPOD sharded on 2 ranks with an external teacher and the KL's reference: the gated distillation, B's forwards
    and the policy-gradient pass run in lockstep (rank 1, without selected rows, pads each with uncounted ones)."""
    from opd.tiny import build_tiny_model

    teacher = build_tiny_model(tmp_path / "t1", seed=1)
    args = ["--methods", "opod", "--policy", "entropy", "--skew", "--teacher-model", str(teacher), "--opod-kl", "0.1",
            "--dtype", "float64"]
    one = torch.load(_worker(tmp_path / "one", 1, *args) / "opod.pt", weights_only=False)
    two = torch.load(_worker(tmp_path / "two", 2, *args, "--fsdp") / "opod.pt", weights_only=False)
    _assert_same_run(one, two, "opod")
    for r1, r2 in zip(one["rows"], two["rows"]):
        for key in ("teacher_rows_full", "teacher_rows_verify", "teacher_rows_answer"):
            assert r1[key] == r2[key], key
        for key in ("reward_mean", "pg_loss", "kl_loss", "gate_mean_teacher"):  # float64 means and sums: ~1e-15
            assert r1[key] == pytest.approx(r2[key], rel=1e-9, abs=1e-12), key
    assert two["per_teacher"][1].tolist() == [0] and two["per_teacher"][0, 0] > 0


@pytest.mark.slow
def test_fsdp_tm_opd_equals_one_unsharded_rank_when_one_rank_has_no_selected_row(tmp_path, tiny):
    """Thinking Machines' on-policy distillation sharded on 2 ranks: the external teacher sharded like the policy, its
    forward inside the policy-gradient pass's micro-batches (rank 1, without selected rows, pads each with an
    uncounted one); the importance-sampled token sum equals the unsharded run's."""
    from opd.tiny import build_tiny_model

    teacher = build_tiny_model(tmp_path / "t1", seed=1)
    args = ["--methods", "tm-opd", "--policy", "entropy", "--skew", "--teacher-model", str(teacher), "--dtype", "float64"]
    one = torch.load(_worker(tmp_path / "one", 1, *args) / "tm-opd.pt", weights_only=False)
    two = torch.load(_worker(tmp_path / "two", 2, *args, "--fsdp") / "tm-opd.pt", weights_only=False)
    _assert_same_run(one, two, "tm-opd")
    for r1, r2 in zip(one["rows"], two["rows"]):
        assert r1["teacher_rows_full"] == r2["teacher_rows_full"]
        assert r1["teacher_kl"] == pytest.approx(r2["teacher_kl"], rel=1e-9, abs=1e-12)
    assert two["per_teacher"][1].tolist() == [0] and two["per_teacher"][0, 0] > 0


@pytest.mark.slow
def test_fsdp_routed_external_teachers_equal_one_unsharded_rank(tmp_path, tiny):
    """--teachers on 2 sharded ranks: each external teacher is sharded like the policy and runs as many micro-batches
    on every rank as on the busiest one (rank 1, which holds no selected row, pads every teacher's with
    zero-weighted ones, not counted); the run equals the unsharded one, teacher by teacher."""
    from test_teachers import route_file, routed_data

    from opd.tiny import build_tiny_model

    t1, t2 = build_tiny_model(tmp_path / "t1", seed=1), build_tiny_model(tmp_path / "t2", seed=2)
    routes = route_file(tmp_path, {"colour": str(t1), "count": str(t2)})
    args = ["--policy", "entropy", "--skew", "--teachers", str(routes), "--data", str(routed_data(tiny[1])), "--dtype", "float64"]
    one = torch.load(_worker(tmp_path / "one", 1, *args) / "bas-opd.pt", weights_only=False)
    two = torch.load(_worker(tmp_path / "two", 2, *args, "--fsdp") / "bas-opd.pt", weights_only=False)
    _assert_same_run(one, two, "routed")
    assert one["teacher_names"] == two["teacher_names"] == ["colour", "count"]
    per = two["per_teacher"]  # (2 ranks, 2 teachers): rows each teacher scored on each rank
    assert per[1].tolist() == [0, 0] and per[0].sum() > 0
    assert per.sum(0).tolist() == one["per_teacher"].sum(0).tolist()


@pytest.mark.slow
def test_fsdp_resume_equals_uninterrupted_and_the_export_loads(tmp_path, tiny):
    """A sharded checkpoint (DCP) resumes to the uninterrupted run's weights; the last checkpoint's
    save_pretrained export loads with from_pretrained and gives the in-memory model's logits."""
    out = _worker(tmp_path, 2, "--scenario", "resume")
    r = torch.load(out / "resume.pt", weights_only=False)
    assert r["start"] == 2
    assert r["checkpoint"] == ["policy", "sharded", "state.pt", "teacher", "train_config.json"]
    for name in ("params", "teacher"):
        for k, v in r["whole"][name].items():
            torch.testing.assert_close(r["resumed"][name][k], v, rtol=0, atol=1e-6)
    torch.testing.assert_close(r["export_logits"], r["in_memory_logits"], rtol=0, atol=1e-5)
    for k, v in r["resumed"]["teacher"].items():
        torch.testing.assert_close(r["export_teacher"][k], v, rtol=0, atol=0)
    whole = read_ledger(tmp_path / "whole" / "ledger.jsonl")
    split = read_ledger(tmp_path / "split" / "ledger.jsonl")
    assert [row["step"] for row in split] == [0, 1, 2]
    for a, b in zip(whole, split, strict=True):
        for key in COUNTS + ("loss", "grad_norm", "utility_mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, nan_ok=True), key
    assert (tmp_path / "split" / "checkpoint-000002").exists() is False  # keep_checkpoints 1
    from opd.eval.run import resolve_model  # eval.py's --model takes the run folder

    assert resolve_model(str(tmp_path / "split")) == str((tmp_path / "split" / "checkpoint-000003" / "policy").resolve())


@pytest.mark.slow
def test_sharded_generation_samples_what_the_unsharded_model_samples(tmp_path, tiny):
    """Both generation modes of a sharded policy draw the same tokens and log-probs as an unsharded copy
    from the same seed, and leave the policy resharded."""
    r = torch.load(_worker(tmp_path, 2, "--scenario", "generate") / "generate.pt", weights_only=False)
    modes = len(r["modes"])
    for rank in r["per_rank"].tolist():
        same, logp, resharded = rank[:modes], rank[modes : 2 * modes], rank[-1]
        assert same == [1.0] * modes and max(logp) <= 1e-5 and resharded == 1.0


@pytest.mark.slow
def test_fsdp_cli_run_keeps_the_ddp_ledger(tmp_path, tiny):
    """The issue's command, shortened to 3 steps: `torchrun --nproc_per_node 2 train.py --fsdp --policy learned
    --rho 0.25` writes the same selections and counts as the DDP run, and the same losses. Both in float64
    (tests/float64_train.py: train.py with the model's float32 casts in float64): the runs reduce the gradients
    otherwise (all-reduce, reduce-scatter), and in float32 the weights' differences could flip a sampled token of a
    later step's rollouts on another CPU; in float64 the losses agree to float64 summation order."""
    common = ["--preset", "tiny", "--policy", "learned", "--rho", "0.25", "--steps", "3", "--dtype", "float64"]
    script = ROOT / "tests" / "float64_train.py"
    _launch(tmp_path, 2, script, *common, "--out", str(tmp_path / "ddp"))
    _launch(tmp_path, 2, script, *common, "--fsdp", "--out", str(tmp_path / "fsdp"))
    ddp, fsdp = read_ledger(tmp_path / "ddp" / "ledger.jsonl"), read_ledger(tmp_path / "fsdp" / "ledger.jsonl")
    assert len(ddp) == len(fsdp) == 3
    for a, b in zip(ddp, fsdp):
        for key in COUNTS + ("teacher_padded_tokens",):  # both runs group the same rows per rank
            assert a[key] == b[key], (a["step"], key)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-9)
        assert a["world_size"] == b["world_size"] == 2
    ckpt = tmp_path / "fsdp" / (tmp_path / "fsdp" / "latest").read_text().strip()
    assert (ckpt / "policy" / "config.json").is_file() and (ckpt / "sharded" / ".metadata").is_file()


@pytest.mark.slow
def test_fsdp_live_evaluation_gives_the_ddp_replies_before_and_during_training(tmp_path, tiny):
    """torchrun 2 ranks, train.py --eval-before --eval-every 2 (fsdp_worker.py --scenario live): with --fsdp, in both
    generation modes, every reply of the evaluation before step 0 and of the one after step 2 is the 2-rank DDP run's
    (each rank answering the same share of the items; one pads its share), and so is every score. In float64: the
    sharded run reduces its gradients otherwise, weights ~1e-12 apart after 2 steps, far below any gap between two
    greedy choices (issue 33: the evaluation before training crashed, and 'layerwise' crashed in any evaluation)."""
    from bench_fixtures import write_all_fixtures

    from opd.models.sharding import GENERATION

    write_all_fixtures(tmp_path / "bench")
    args = ["--scenario", "live", "--eval-data", str(tmp_path / "bench"), "--dtype", "float64"]

    def scores(rows: list[dict]) -> str:  # before training, after step 2 (NaN, no item scored, equal as text)
        evaluations = (rows[0]["eval_before"], rows[1])
        return json.dumps([{k: v for k, v in r.items() if k.startswith("eval/")} for r in evaluations])

    ddp = torch.load(_worker(tmp_path / "ddp", 2, *args) / "live.pt", weights_only=False)
    assert len(ddp["replies"]) == 2 and [len(ddp["replies"][0][k]) for k in sorted(ddp["replies"][0])] == [5, 4, 4]
    assert all(len(s) == 4 for s in json.loads(scores(ddp["rows"])))
    for mode in GENERATION:
        out = _worker(tmp_path / mode, 2, *args, "--fsdp", "--generation", mode)
        fsdp = torch.load(out / "live.pt", weights_only=False)
        assert fsdp["replies"] == ddp["replies"], mode
        assert scores(fsdp["rows"]) == scores(ddp["rows"]), mode


def test_a_sharded_policy_samples_its_first_rollouts_without_shared_prefill(tmp_path, tiny):
    """--fsdp --no-share-prefill (one process): the first rollouts are the policy's first forward, and generate encodes
    the images before it (opd.models.sharding.init_root; it crashed as issue 33's --eval-before did). The run trains."""
    import torch.distributed as dist

    try:
        train.main(["--preset", "tiny", "--fsdp", "--no-share-prefill", "--steps", "1", "--out", str(tmp_path / "run")])
    finally:
        if dist.is_initialized():  # a failed run leaves its one-process group
            dist.destroy_process_group()
    rows = read_ledger(tmp_path / "run" / "ledger.jsonl")
    assert [r["step"] for r in rows] == [0] and rows[0]["rollouts"] > 0


def test_an_unknown_generation_mode_is_refused_by_name(tmp_path):
    with pytest.raises(UserError, match="--fsdp-generation 'eager': choose one of gathered, layerwise"):
        train.main(["--preset", "tiny", "--fsdp", "--fsdp-generation", "eager", "--out", str(tmp_path)])


@pytest.mark.slow
def test_gpu_check_runs_on_the_cpu_and_fsdp_matches_ddp(tmp_path):
    """bench/gpu_check.py's code on the tiny model (tied embeddings, as Qwen3.5-4B's): both strategies run
    and FSDP2 over a one-process group matches DDP on the fixed step."""
    out = tmp_path / "gpu_check.json"
    proc = _launch(tmp_path, 1, ROOT / "bench" / "gpu_check.py", "--device", "cpu", "--model", "tiny", "--steps", "2",
                   "--out", str(out))  # fmt: skip
    assert "| DDP |" in proc.stdout and "| FSDP2 |" in proc.stdout
    assert "FSDP2 on one device matches DDP: **yes**" in proc.stdout
    saved = json.loads(out.read_text())
    assert saved["match"]["same_selection_and_counts"] and saved["match"]["max_param_diff"] <= 1e-6
    for r in saved["results"]:
        assert len(r["rows"]) == 2 and all(row["generated_tokens"] > 0 and row["teacher_flops"] > 0 for row in r["rows"])


def test_memory_table_counts_and_terms(tmp_path):
    """The parameter counts of the meta-device model equal a real model's (the tiny config); each row's
    peak is its terms; the README's 9B launch on 4 x 80 GB fits and DDP never fits 9B."""
    from bench import memory_table as mt
    from opd.tiny import tiny_config, tiny_processor

    config = tiny_config(tiny_processor().tokenizer)
    shape = mt.model_shape(config)
    from transformers import Qwen3_5ForConditionalGeneration

    real = Qwen3_5ForConditionalGeneration(config)
    layers = [*real.model.language_model.layers, *real.model.visual.blocks]
    assert shape.params == sum(p.numel() for p in real.parameters())
    assert shape.root == shape.params - sum(p.numel() for u in layers for p in u.parameters())
    assert shape.block == max(sum(p.numel() for p in u.parameters()) for u in layers)
    report = mt.main(["--micro-batch", "1", "--rollout-batch", "16", "--out", str(tmp_path / "m.json")])
    rows = {(r["model"], r["strategy"], r["gpus"]): r for r in report["rows"]}
    assert len(rows) == 14  # DDP and FSDP2 on 1, 4, 8 GPUs, and LoRA r 64 on one, per model
    for name in ("4b", "9b"):  # LoRA: a bf16 base (2P) and float32 adapters of r (in + out) per adapted layer
        r, m = rows[name, "lora-r64", 1], report["shapes"][name]
        A = 64 * m.lora_per_rank
        assert r["adapter_params"] == A and r["policy"] == 2 * m.params + 4 * A and r["adamw"] == 8 * A
        assert r["peak"] == pytest.approx(r["policy"] + r["gradients"] + r["adamw"] + r["teacher"]
                                          + max(r["training_transient"], r["generation"]))  # fmt: skip
    assert rows["4b", "lora-r64", 1]["peak"] <= 24e9 and rows["9b", "lora-r64", 1]["peak"] <= 48e9
    rows = {k: v for k, v in rows.items() if not k[1].startswith("lora")}
    for (name, strategy, gpus), r in rows.items():
        P = report["shapes"][name].params
        shards = gpus if strategy == "fsdp2" else 1
        assert r["policy"] == r["gradients"] == r["teacher"] == 4 * P / shards and r["adamw"] == 8 * P / shards
        persistent = r["policy"] + r["gradients"] + r["adamw"] + r["teacher"] + r["ddp_buckets"]
        assert r["peak"] == pytest.approx(persistent + max(r["training_transient"], r["generation"]))
    assert rows["9b", "fsdp2", 4]["peak"] <= 80e9
    assert all(rows["9b", "ddp", n]["peak"] > 80e9 for n in (1, 4, 8))


@pytest.mark.slow
def test_fsdp_generation_benchmark_quick(tmp_path, capsys):
    from bench import fsdp_generation

    out = tmp_path / "gen.json"
    report = fsdp_generation.main(["--quick", "--out", str(out)])
    assert "| tiny | gathered |" in report["markdown"] and "| tiny | layerwise |" in report["markdown"]
    saved = json.loads(out.read_text())
    assert [r["mode"] for r in saved["results"]] == ["gathered", "layerwise"]
    assert all(len(r["per_rank"]) == 2 for r in saved["results"])
