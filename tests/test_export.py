"""opd.export: every sharded (--fsdp) checkpoint as a save_pretrained folder, in one process, and eval.py on it.

The fast tests write a sharded checkpoint in this process (DCP without a process group, `no_dist=True`) from a
tiny model whose weights were moved off the model folder's, so an export that read the folder's weights instead
of the checkpoint's would fail. The slow one is the issue's: a 2-rank `train.py --fsdp` run checkpointing every
step; its last checkpoint's own policy/ (gathered by the trainer) equals the export of its sharded/, and eval.py
scores the intermediate checkpoint, exporting it first.
"""

import contextlib
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from opd.cli import UserError
from opd.eval.run import resolve_model
from opd.export import export_checkpoint, sharded_without_export

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process, as meant
FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.json", "processor_config.json",
         "chat_template.jinja")  # fmt: skip


def say(msg: str) -> None:
    sys.__stdout__.write(f"\n[export] {msg}\n")


def moved_model(model_dir, dtype="float32", seed=1):
    from opd.models.loading import load_model

    model = load_model(str(model_dir), dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=gen).to(p.dtype))
    return model


def sharded_checkpoint(root: Path, model, run_model, dtype="float32", step=3, **config) -> Path:
    """A checkpoint folder as opd.loop.checkpoint.save_sharded lays it out: sharded/ (DCP of policy and teacher),
    state.pt and train_config.json naming the run's --model and --dtype."""
    ckpt = root / f"checkpoint-{step:06d}"
    policy = {k: v.detach().clone() for k, v in model.state_dict().items()}
    teacher = {k: torch.zeros_like(v) for k, v in policy.items()}  # other values: only the policy's are exported
    dcp.save({"policy": policy, "teacher": teacher}, checkpoint_id=ckpt / "sharded", no_dist=True)
    (ckpt / "state.pt").write_bytes(b"")
    (ckpt / "train_config.json").write_text(json.dumps({"model": run_model, "dtype": dtype, **config}))
    (root / "latest").write_text(ckpt.name + "\n")
    return ckpt


def assert_same_export(a: Path, b: Path) -> None:
    """Equal weights (values, dtypes, names) and the same config, generation config and processor files."""
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert wa[k].dtype == wb[k].dtype and torch.equal(wa[k], wb[k]), k
    for name in FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_is_the_checkpoints_policy_in_save_pretrained_form(tiny, tmp_path, dtype):
    from opd.models.loading import load_processor

    model = moved_model(tiny[0], dtype)
    ckpt = sharded_checkpoint(tmp_path / "run", model, str(tiny[0]), dtype)
    reference = tmp_path / "reference"
    model.save_pretrained(reference)  # what the trainer's export writes (opd.models.sharding.export_pretrained)
    load_processor(str(tiny[0])).save_pretrained(reference)
    t0 = time.perf_counter()
    out = export_checkpoint(ckpt)
    say(f"export of the tiny model ({dtype}) in one process: {time.perf_counter() - t0:.2f} s")
    assert out == ckpt / "policy"
    assert_same_export(out, reference)
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".")]  # the temporary folder is gone
    assert sharded_without_export(ckpt) is None  # exported: eval.py now reads policy/
    with pytest.raises(UserError, match="exists .*give another --out"):
        export_checkpoint(ckpt)


def test_a_run_folder_and_out(tiny, tmp_path):
    model = moved_model(tiny[0])
    ckpt = sharded_checkpoint(tmp_path / "run", model, None)  # --preset tiny without --model: the built-in model
    assert sharded_without_export(tmp_path / "run") == ckpt
    out = export_checkpoint(tmp_path / "run", tmp_path / "elsewhere" / "step3")
    assert out == tmp_path / "elsewhere" / "step3" and not (ckpt / "policy").exists()
    weights = load_file(out / "model.safetensors")
    for k, v in model.state_dict().items():
        assert torch.equal(weights[k], v), k


def test_export_errors_are_one_line(tiny, tmp_path):
    from opd.tiny import build_tiny_model

    model = moved_model(tiny[0])
    gone = sharded_checkpoint(tmp_path / "gone", model, str(tmp_path / "deleted-model"))
    with pytest.raises(UserError, match=r"the run's --model .*deleted-model \(train_config.json field 'model'\) is not "):
        export_checkpoint(gone)
    other = build_tiny_model(tmp_path / "two-layers", layers=2)
    mismatch = sharded_checkpoint(tmp_path / "mismatch", model, str(other))
    with pytest.raises(UserError, match="does not fit the run's --model .*parameters unexpected"):
        export_checkpoint(mismatch)
    lora = sharded_checkpoint(tmp_path / "lora", model, str(tiny[0]), lora_r=8)  # whole-model names: no adapter
    with pytest.raises(UserError, match=r"a LoRA \(--lora-r 8\) run's shards hold no adapter 'default'"):
        export_checkpoint(lora)
    assert not (lora / "merged").exists()
    lora_gone = sharded_checkpoint(tmp_path / "lora-gone", model, str(tmp_path / "deleted-model"), lora_r=8)
    with pytest.raises(UserError, match=r"the run's --model .*deleted-model \(train_config.json field 'model'\)"):
        export_checkpoint(lora_gone)  # a LoRA run's shards are merged into its --model: the base must be there
    plain = tmp_path / "plain" / "checkpoint-000001"
    (plain / "policy").mkdir(parents=True)
    (plain / "state.pt").write_bytes(b"")
    with pytest.raises(UserError, match="has no sharded checkpoint .*its policy/ is already the export"):
        export_checkpoint(plain)
    with pytest.raises(UserError, match="no checkpoint in"):
        export_checkpoint(tmp_path)
    assert not (gone / "policy").exists() and not (mismatch / "policy").exists()

    proc = subprocess.run([sys.executable, "-m", "opd.export", str(tmp_path / "nowhere")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("python -m opd.export: error: no checkpoint in")


def test_a_relative_run_model_is_read_from_the_current_folder(tiny, tmp_path, monkeypatch):
    """train_config.json keeps --model as given: a relative path is read from the current folder (where train.py ran);
    from elsewhere the error names the field and the folder it was looked for in."""
    import shutil

    model = moved_model(tiny[0])
    shutil.copytree(tiny[0], tmp_path / "models" / "base")
    ckpt = sharded_checkpoint(tmp_path / "run", model, "models/base")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    with pytest.raises(UserError) as err:
        export_checkpoint(ckpt)
    assert "\n" not in str(err.value)
    assert (f"the run's --model models/base (train_config.json field 'model'; a relative path is read from the "
            f"current folder, {tmp_path / 'elsewhere'}) is not there") in str(err.value)
    assert "or run from the folder train.py ran in" in str(err.value)
    monkeypatch.chdir(tmp_path)
    weights = load_file(export_checkpoint(ckpt) / "model.safetensors")
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


def test_the_export_folder_has_a_plain_folders_mode(tiny, tmp_path):
    """mkdtemp makes 0700 folders: the export is renamed into place with the mode a mkdir gives (umask applied)."""
    model = moved_model(tiny[0])
    ckpt = sharded_checkpoint(tmp_path / "run", model, str(tiny[0]))
    old = os.umask(0o027)
    try:
        out = export_checkpoint(ckpt)
        (tmp_path / "plain").mkdir()
    finally:
        os.umask(old)
    assert (out.stat().st_mode & 0o777) == (tmp_path / "plain").stat().st_mode & 0o777 == 0o750


def _torchrun(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_every_checkpoint_of_a_sharded_run_is_evaluable(tiny, tmp_path):
    """torchrun 2 ranks, train.py --fsdp --steps 2 --save-every 1 (keeping both checkpoints): checkpoint-000002's
    own policy/ equals the one-process export of its sharded/ (bit for bit, same dtype), and eval.py --model on
    checkpoint-000001 (sharded only) exports it, says so in one line, and scores it."""
    from bench_fixtures import write_vstar_fixture, write_zoombench_fixture

    import eval as eval_py

    run = tmp_path / "run"
    t0 = time.perf_counter()
    _torchrun("train.py", "--preset", "tiny", "--fsdp", "--steps", "2", "--save-every", "1", "--keep-checkpoints", "2", "--out", str(run))
    say(f"torchrun 2 ranks train.py --fsdp --steps 2: {time.perf_counter() - t0:.1f} s")
    first, last = run / "checkpoint-000001", run / "checkpoint-000002"
    assert sorted(p.name for p in first.iterdir()) == ["sharded", "state.pt", "train_config.json"]
    assert (last / "policy" / "config.json").is_file()

    t0 = time.perf_counter()
    exported = export_checkpoint(last, tmp_path / "export-2")
    say(f"export of checkpoint-000002 (sharded/ -> save_pretrained): {time.perf_counter() - t0:.2f} s")
    assert_same_export(exported, last / "policy")  # the trainer's gathered export, bit for bit
    assert load_file(exported / "model.safetensors")["lm_head.weight"].dtype == torch.float32  # --dtype float32

    data = tmp_path / "data"
    write_vstar_fixture(data)
    write_zoombench_fixture(data)
    argv = ["--model", str(first), "--data-dir", str(data), "--out", str(tmp_path / "eval"), "--benchmarks",
            "vstar,zoombench", "--max-new-tokens", "3", "--device", "cpu", "--no-progress"]  # fmt: skip
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        ret = eval_py.main(argv)
    lines = [line for line in buf.getvalue().splitlines() if "exporting" in line]
    assert lines == [(f"eval.py: --model {first}: checkpoint-000001 is a sharded (--fsdp) checkpoint without policy/; "
                      f"exporting it to {first / 'policy'} first (python -m opd.export)")]
    assert ret["meta"]["model_path"] == str((first / "policy").resolve())
    assert {k: v["n"] for k, v in ret["results"].items()} == {"vstar": 4, "zoombench": 4}
    w1, w2 = (load_file(c / "policy" / "model.safetensors") for c in (first, last))
    assert any(not torch.equal(w1[k], w2[k]) for k in w1)  # step 1's weights, not step 2's
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):  # again: policy/ is there now, nothing exported, nothing answered
        again = eval_py.main(argv)
    assert "exporting" not in buf.getvalue() and again["results"] == ret["results"]

    (run / "latest").write_text("checkpoint-000001\n")  # a run folder whose latest is sharded (a stopped run)
    import shutil

    shutil.rmtree(first / "policy")
    assert resolve_model(str(run)) == str((first / "policy").resolve())
