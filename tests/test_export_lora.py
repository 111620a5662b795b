"""`python -m opd.export` on a LoRA run: ONE merged model (peft's merge_and_unload) in plain save_pretrained form,
which `from_pretrained` loads and eval.py scores exactly as it scores the LoRA run itself (merged in memory).

The fast tests lay a LoRA run's checkpoint out as train.py writes it (opd.loop.checkpoint.save_checkpoint /
save_sharded with adapters: policy/ = the adapter `default` + the processor, teacher/ = the EMA adapter, or only
sharded/ under peft's names for an intermediate --fsdp checkpoint) from a peft model of the tiny Qwen3.5 whose
adapters are random (a fresh lora_B is zero: a merge would change nothing). The logits of the export are checked
against the unmerged peft forward (base(x) + s B A x, computed apart from the merge) in float64. The train.py tests
train real runs: 2 steps in one process, and (slow) 2 ranks with --fsdp.
"""

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from opd.export import export_checkpoint

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),  # DCP in one process, as meant
              pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")]  # peft, transformers 5
R, ALPHA = 4, 12.0  # scale 3: not peft's default of 1, so a merge that ignored --lora-alpha would show


def peft_policy(model_dir, seed: int = 0):
    """The tiny model with the student adapter `default` and the EMA teacher's `teacher`, both random."""
    from peft import LoraConfig, get_peft_model

    from opd.models.lora import target_modules
    from opd.models.settings import DEFAULT_TARGETS
    from opd.models.loading import load_model

    config = LoraConfig(r=R, lora_alpha=ALPHA, target_modules=target_modules(DEFAULT_TARGETS), bias="none")
    model = get_peft_model(load_model(str(model_dir)), config)
    model.add_adapter("teacher", config)
    model.set_adapter("default")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    return model.eval()


def run_layout(root: Path, model_dir, step: int, sharded: bool, **config) -> Path:
    """checkpoint-N of a LoRA run: state.pt, train_config.json and `latest`; the caller adds policy/ or sharded/."""
    ckpt = root / f"checkpoint-{step:06d}"
    ckpt.mkdir(parents=True)
    (ckpt / "state.pt").write_bytes(b"")
    stored = {"model": str(model_dir), "dtype": "float32", "lora_r": R, "lora_alpha": ALPHA, "fsdp": sharded, **config}
    (ckpt / "train_config.json").write_text(json.dumps(stored))
    (root / "latest").write_text(ckpt.name + "\n")
    return ckpt


def adapter_checkpoint(root: Path, model_dir, model) -> Path:
    """A single-process LoRA run's checkpoint: policy/ and teacher/ hold the adapters (opd.models.lora.save_adapter)."""
    from opd.models.lora import save_adapter
    from opd.models.loading import load_processor

    ckpt = run_layout(root, model_dir, 2, False)
    save_adapter(model, "default", ckpt / "policy")
    load_processor(str(model_dir)).save_pretrained(ckpt / "policy")
    save_adapter(model, "teacher", ckpt / "teacher")
    return ckpt


def sharded_checkpoint(root: Path, model_dir, model) -> Path:
    """An intermediate --fsdp LoRA checkpoint: sharded/ only, the policy under peft's names with both adapters."""
    ckpt = run_layout(root, model_dir, 1, True)
    policy = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dcp.save({"policy": policy}, checkpoint_id=ckpt / "sharded", no_dist=True)
    return ckpt


def token_ids(model_dir) -> torch.Tensor:
    """Two rows of ordinary text tokens (no image or vision special tokens)."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(model_dir)).get_text_config().vocab_size
    return torch.randint(10, min(vocab, 200), (2, 12), generator=torch.Generator().manual_seed(3))


def logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert wa[k].dtype == wb[k].dtype and torch.equal(wa[k], wb[k]), k


def run_eval(model, data: Path, out: Path) -> dict:
    import eval as eval_py

    argv = ["--model", str(model), "--benchmarks", "vstar", "--data-dir", str(data), "--out", str(out),
            "--max-new-tokens", "4", "--device", "cpu", "--no-progress"]  # fmt: skip
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        result = eval_py.main(argv)
    result["stdout"] = buf.getvalue()
    result["rows"] = [json.loads(x) for x in (out / "vstar" / "predictions.jsonl").read_text().splitlines()]
    return result


def assert_same_scores(a: dict, b: dict) -> None:
    assert [(r["index"], r["reply"], r["pred"], r["correct"]) for r in a["rows"]] == [
        (r["index"], r["reply"], r["pred"], r["correct"]) for r in b["rows"]]  # fmt: skip
    assert a["results"] == b["results"]


@pytest.fixture(scope="module")
def vstar(tmp_path_factory) -> Path:
    from bench_fixtures import write_vstar_fixture

    data = tmp_path_factory.mktemp("vstar")
    write_vstar_fixture(data)
    return data


def test_a_lora_checkpoint_exports_one_merged_model(tiny, tmp_path, vstar):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from opd.models.loading import load_model

    model = peft_policy(tiny[0])
    ckpt = adapter_checkpoint(tmp_path / "run", tiny[0], model)
    out = export_checkpoint(tmp_path / "run")  # a run folder: its latest checkpoint
    assert out == ckpt / "merged"
    assert sorted(p.name for p in (ckpt / "policy").iterdir() if p.name.startswith("adapter")) == [
        "adapter_config.json", "adapter_model.safetensors"]  # fmt: skip (policy/ keeps the adapter)
    assert (out / "config.json").is_file() and not (out / "adapter_config.json").exists()
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".")]  # no temporary folder left

    exported = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float64).eval()
    ids = token_ids(tiny[0])
    reference = logits(model.double(), ids)  # unmerged: base(x) + (alpha / r) B A x, adapter `default`
    base = logits(AutoModelForImageTextToText.from_pretrained(tiny[0], dtype=torch.float64).eval(), ids)
    got = logits(exported, ids)
    # the export's merged weights are float32 roundings of W + s B A: about 6e-8 relative each
    torch.testing.assert_close(got, reference, rtol=0, atol=2e-5 * reference.abs().max().item())
    assert (base - reference).abs().max() > 100 * (got - reference).abs().max()  # the adapter's effect is there
    in_memory = load_model(str(ckpt / "policy"), "float32").state_dict()  # what eval.py --model RUN merges
    on_disk = load_file(out / "model.safetensors")
    assert on_disk.keys() == in_memory.keys() and all(torch.equal(on_disk[k], in_memory[k]) for k in on_disk)
    assert AutoProcessor.from_pretrained(out).tokenizer.get_vocab() == AutoProcessor.from_pretrained(
        ckpt / "policy").tokenizer.get_vocab()  # fmt: skip

    assert_same_scores(run_eval(tmp_path / "run", vstar, tmp_path / "eval-run"),
                       run_eval(out, vstar, tmp_path / "eval-export"))
    from opd.cli import UserError

    with pytest.raises(UserError, match="merged exists .*give another --out"):
        export_checkpoint(ckpt)


def test_an_fsdp_lora_checkpoint_is_merged_from_its_shards(tiny, tmp_path, vstar):
    """sharded/ alone (an intermediate --fsdp checkpoint, peft's names, both adapters): its export equals the export
    of the same adapter from policy/, bit for bit; eval.py --model on it merges it first, once, and scores the same."""
    model = peft_policy(tiny[0], seed=5)
    from_adapter = export_checkpoint(adapter_checkpoint(tmp_path / "single", tiny[0], model))
    ckpt = sharded_checkpoint(tmp_path / "fsdp", tiny[0], model)
    out = export_checkpoint(ckpt, tmp_path / "exports" / "step1")
    assert out == tmp_path / "exports" / "step1" and not (ckpt / "merged").exists()
    assert_same_weights(out, from_adapter)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (from_adapter / name).read_bytes(), name

    first = run_eval(ckpt, vstar, tmp_path / "eval-sharded")
    lines = [line for line in first["stdout"].splitlines() if "merging" in line]
    assert lines == [f"eval.py: --model {ckpt}: checkpoint-000001 is a sharded (--fsdp) LoRA checkpoint without an "
                     f"export; merging its adapter into its base in {ckpt / 'merged'} first (python -m opd.export)"]
    assert first["meta"]["model_path"] == str((ckpt / "merged").resolve())
    assert_same_weights(ckpt / "merged", from_adapter)
    again = run_eval(ckpt, vstar, tmp_path / "eval-sharded")  # merged/ is there: nothing exported, nothing answered
    assert "merging" not in again["stdout"] and again["results"] == first["results"]
    assert_same_scores(first, run_eval(tmp_path / "single", vstar, tmp_path / "eval-single"))


def test_a_trained_lora_run_exports_what_eval_scores(tiny, tmp_path, vstar):
    """train.py --lora-r 8, 2 steps in one process: the export's logits are the in-memory merge's (float64 forward
    of float32 weights), and eval.py scores the export as it scores the run."""
    from transformers import AutoModelForImageTextToText

    import train
    from opd.models.loading import load_model

    run = tmp_path / "run"
    train.main(["--preset", "tiny", "--lora-r", "8", "--lora-alpha", "24", "--policy", "random", "--rho", "0.5", "--steps", "2",
                "--lr", "1e-2", "--out", str(run)])  # fmt: skip (a large lr: the adapter moves off zero)
    out = export_checkpoint(run)
    assert out.name == "merged" and (out / "model.safetensors").is_file()
    ids = token_ids(tiny[0])
    merged = load_model(str(out.parent / "policy"), "float32").double().eval()  # eval.py's in-memory merge
    exported = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float64).eval()
    base = AutoModelForImageTextToText.from_pretrained(tiny[0], dtype=torch.float64).eval()
    want, got = logits(merged, ids), logits(exported, ids)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12 * want.abs().max().item())
    assert not torch.equal(logits(base, ids), want)  # two steps moved the adapter
    assert_same_scores(run_eval(run, vstar, tmp_path / "eval-run"), run_eval(out, vstar, tmp_path / "eval-export"))


@pytest.mark.slow
def test_two_rank_fsdp_lora_checkpoints_export_alike(tiny, tmp_path, vstar):
    """torchrun 2 ranks, train.py --fsdp --lora-r 8 --save-every 1: checkpoint-000002 merged from its shards equals it
    merged from its policy/ adapter (the trainer's gathered export), bit for bit; checkpoint-000001 (sharded only)
    exports and eval.py scores it."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "train.py", "--preset", "tiny", "--fsdp",
           "--lora-r", "8", "--policy", "random", "--rho", "0.5", "--steps", "2", "--save-every", "1",
           "--keep-checkpoints", "2", "--lr", "1e-2", "--out", str(run)]  # fmt: skip
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=900,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    first, last = run / "checkpoint-000001", run / "checkpoint-000002"
    assert not (first / "policy").exists() and (last / "policy" / "adapter_config.json").is_file()
    from_policy = export_checkpoint(last)
    import shutil

    shutil.rmtree(last / "policy")  # now only its shards: the export reads them
    from_shards = export_checkpoint(last, tmp_path / "from-shards")
    assert_same_weights(from_shards, from_policy)
    result = run_eval(first, vstar, tmp_path / "eval-1")
    assert result["meta"]["model_path"] == str((first / "merged").resolve()) and result["results"]["vstar"]["n"] > 0
