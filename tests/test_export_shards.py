"""A damaged sharded (--fsdp) checkpoint is one line, from `python -m opd.export` and from `eval.py --model`; and
`python -m opd.export` runs from any folder, with only the `opd` package importable (as once pip-installed).

The checkpoint is written in this process (DCP without a process group) as two shard files (two writer threads),
as a 2-rank run writes one per rank; a shard is then deleted or cut short.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from opd.cli import UserError
from opd.export import export_checkpoint

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def two_shard_checkpoint(root: Path, model_dir) -> Path:
    """checkpoint-000003 laid out as opd.loop.checkpoint.save_sharded writes it, its DCP in two shard files."""
    from opd.models.loading import load_model

    ckpt = root / "checkpoint-000003"
    policy = {k: v.detach().clone() for k, v in load_model(str(model_dir)).state_dict().items()}
    teacher = {k: torch.zeros_like(v) for k, v in policy.items()}
    dcp.save({"policy": policy, "teacher": teacher}, storage_writer=FileSystemWriter(ckpt / "sharded", thread_count=2),
             no_dist=True)
    (ckpt / "state.pt").write_bytes(b"")
    (ckpt / "train_config.json").write_text(json.dumps({"model": str(model_dir), "dtype": "float32"}))
    (root / "latest").write_text(ckpt.name + "\n")
    return ckpt


def policy_files(ckpt: Path) -> dict[str, int]:
    """shard file -> the bytes the policy's entries need in it, from DCP's own index (independent of check_shards)."""
    storage = FileSystemReader(str(ckpt / "sharded")).read_metadata().storage_data
    need: dict[str, int] = {}
    for index, info in storage.items():
        if index.fqn.startswith("policy."):
            need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    return need


def one_line(proc: subprocess.CompletedProcess, prog: str) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), proc.stderr[-3000:]
    return lines[0]


@pytest.mark.slow  # an end-to-end run (train, resume or export): -m slow
def test_a_missing_or_truncated_shard_is_one_line_naming_it(tiny, tmp_path):
    ckpt = two_shard_checkpoint(tmp_path / "run", tiny[0])
    need = policy_files(ckpt)
    assert len(need) == 2  # both shards hold policy entries
    first, second = sorted(need)
    originals = {name: (ckpt / "sharded" / name).read_bytes() for name in need}
    (ckpt / "sharded" / second).write_bytes(originals[second][: need[second] // 2])  # cut within the policy's part
    with pytest.raises(UserError) as err:
        export_checkpoint(ckpt)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{ckpt}: an incomplete sharded (--fsdp) checkpoint")
    assert f"truncated: {second} ({need[second] // 2} of at least {need[second]} bytes)" in message
    (ckpt / "sharded" / first).unlink()
    with pytest.raises(UserError, match=rf"1 of its 2 shard files holding the policy are missing \({first}\); "
                                        rf"truncated: {second}"):
        export_checkpoint(ckpt)
    assert not (ckpt / "policy").exists() and not [p for p in ckpt.iterdir() if p.name.startswith(".")]

    script = [sys.executable, "-m", "opd.export", str(ckpt)]
    proc = subprocess.run(script, cwd=ROOT, capture_output=True, text=True, timeout=300)
    line = one_line(proc, "python -m opd.export")
    assert f"{ckpt}: an incomplete sharded (--fsdp) checkpoint" in line and f"missing ({first})" in line
    data = tmp_path / "data"
    from bench_fixtures import write_vstar_fixture

    write_vstar_fixture(data)
    evaluate = [sys.executable, str(ROOT / "eval.py"), "--model", str(ckpt), "--data-dir", str(data), "--benchmarks",
                "vstar", "--out", str(tmp_path / "eval"), "--device", "cpu", "--no-progress"]
    line = one_line(subprocess.run(evaluate, cwd=ROOT, capture_output=True, text=True, timeout=300), "eval.py")
    assert f"{ckpt}: an incomplete sharded (--fsdp) checkpoint" in line and f"missing ({first})" in line
    assert not (tmp_path / "eval").exists()  # refused before anything was written

    (ckpt / "sharded" / first).write_bytes(originals[first])  # the files back: it exports
    (ckpt / "sharded" / second).write_bytes(originals[second])
    from safetensors.torch import load_file

    weights = load_file(export_checkpoint(ckpt) / "model.safetensors")
    reference = load_file(Path(tiny[0]) / "model.safetensors")
    assert weights.keys() == reference.keys() and all(torch.equal(weights[k], reference[k]) for k in weights)


def test_an_unreadable_metadata_file_is_one_line(tiny, tmp_path):
    ckpt = two_shard_checkpoint(tmp_path / "run", tiny[0])
    meta = ckpt / "sharded" / ".metadata"
    meta.write_bytes(meta.read_bytes()[:40])
    with pytest.raises(UserError) as err:
        export_checkpoint(ckpt)
    assert "\n" not in str(err.value)
    assert str(err.value).startswith(f"{ckpt}: cannot read {ckpt / 'sharded'}/.metadata (")


def installed_copy(tmp_path: Path) -> dict:
    """The environment of a pip-installed project, as far as imports go: only the `opd` package on the path (no
    train.py, eval.py or tests), the current folder elsewhere."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "opd").symlink_to(ROOT / "opd")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}


def test_python_m_opd_export_runs_from_any_folder(tiny, tmp_path):
    env = installed_copy(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    helped = subprocess.run([sys.executable, "-m", "opd.export", "--help"], cwd=elsewhere, env=env,
                            capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.startswith("usage: python -m opd.export [-h] [--out OUT] checkpoint")
    assert "merged/" in helped.stdout  # the LoRA default, named in --out's help
    ckpt = two_shard_checkpoint(tmp_path / "run", tiny[0])
    proc = subprocess.run([sys.executable, "-m", "opd.export", str(ckpt), "--out", "exported"], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from safetensors.torch import load_file

    weights = load_file(elsewhere / "exported" / "model.safetensors")  # a relative --out: the current folder's
    reference = load_file(Path(tiny[0]) / "model.safetensors")
    assert weights.keys() == reference.keys() and all(torch.equal(weights[k], reference[k]) for k in weights)
