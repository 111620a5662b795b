"""Faults a run meets and how it comes out of them: a full disk at a checkpoint, a kill between `latest` and the
pruning, changed training data on resume, missing teacher checkpoints. Each is one line (exit 2 from the command
line), leaves nothing half-written, and says how to go on."""

import json
import shutil

import pytest
import torch

import train
from opd.cli import UserError
from opd.loop.ledger import read_ledger

TINY = ["--preset", "tiny", "--report-to", "none", "--max-response-len", "6"]


def full_disk_at(monkeypatch, step: int):
    """torch.save of checkpoint-<step>'s state.pt writes half, then fails as PyTorch's writer does on a full disk."""
    real = torch.save

    def save(obj, path, *a, **k):
        if f"checkpoint-{step:06d}" in str(path):
            with open(path, "wb") as f:
                f.write(b"\0" * 1024)
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")
        return real(obj, path, *a, **k)

    monkeypatch.setattr(torch, "save", save)  # opd.loop.checkpoint saves through torch.save (the module attribute)


def leftovers(out) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.startswith(".checkpoint-") or p.name.endswith(".tmp"))


def test_a_full_disk_at_the_first_checkpoint_is_one_line_and_the_same_command_starts_again(tmp_path, tiny, monkeypatch):
    out = tmp_path / "run"
    flags = [*TINY, "--steps", "2", "--save-every", "0", "--out", str(out)]
    full_disk_at(monkeypatch, 2)
    with pytest.raises(UserError) as err:
        train.main(flags)
    text = str(err.value)
    assert "no space left on the device writing checkpoint-000002" in text and "needed" in text and "free" in text
    assert "run the same command again" in text and "\n" not in text
    assert leftovers(out) == [] and not (out / "ledger.jsonl").exists()  # no temporary, no stranded run
    monkeypatch.undo()
    train.main(flags)  # once there is room, the same command runs
    assert len(read_ledger(out / "ledger.jsonl")) == 2 and (out / "checkpoint-000002").is_dir()


def test_a_full_disk_at_a_later_checkpoint_says_resume_and_resume_continues(tmp_path, tiny, monkeypatch):
    out = tmp_path / "run"
    full_disk_at(monkeypatch, 4)
    with pytest.raises(UserError, match=f"continue with --resume {out} \\(from checkpoint-000002\\)"):
        train.main([*TINY, "--steps", "4", "--save-every", "2", "--out", str(out)])
    assert leftovers(out) == [] and (out / "latest").read_text().strip() == "checkpoint-000002"
    monkeypatch.undo()
    train.main(["--resume", str(out)])
    assert [r["step"] for r in read_ledger(out / "ledger.jsonl")] == [0, 1, 2, 3]


def test_a_resume_prunes_the_checkpoint_a_kill_left_beside_the_latest(tmp_path, tiny):
    out = tmp_path / "run"
    train.main([*TINY, "--steps", "2", "--save-every", "1", "--keep-checkpoints", "1", "--out", str(out)])
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-000002"]
    shutil.copytree(out / "checkpoint-000002", out / "checkpoint-000001")  # as if killed right after `latest` moved
    (out / ".checkpoint-000003.tmp").mkdir()  # and a half-written one
    train.main(["--resume", str(out), "--steps", "3"])
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-000003"] and leftovers(out) == []


def test_a_resume_refuses_changed_data_by_name_unless_allowed(tmp_path, tiny):
    data = tmp_path / "data"
    shutil.copytree(tiny[1].parent, data)
    jsonl = data / tiny[1].name
    out = tmp_path / "run"
    train.main([*TINY, "--steps", "1", "--data", str(jsonl), "--out", str(out)])
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    jsonl.write_text("".join(json.dumps({**r, "answer": "Z"}) + "\n" for r in rows))  # the answers edited
    with pytest.raises(UserError, match=f"--data {jsonl} changed since the run started.*--allow-data-change"):
        train.main(["--resume", str(out), "--steps", "2"])
    train.main(["--resume", str(out), "--steps", "2", "--allow-data-change"])
    assert [r["step"] for r in read_ledger(out / "ledger.jsonl")] == [0, 1]


def test_a_missing_teacher_checkpoint_names_its_flag_or_route_file_once(tmp_path, tiny):
    with pytest.raises(UserError) as err:
        train.main([*TINY, "--method", "gkd", "--teacher-model", str(tmp_path / "nope"), "--out", str(tmp_path / "g")])
    assert str(err.value) == f"--teacher-model {tmp_path / 'nope'}: no such model folder"
    route = tmp_path / "route.json"
    route.write_text(json.dumps({"field": "task", "teachers": {"a": str(tmp_path / "gone")}, "default": "a"}))
    with pytest.raises(UserError, match=f"--teachers {route}: route 'a'"):
        train.main([*TINY, "--method", "opod", "--teachers", str(route), "--out", str(tmp_path / "o")])


@pytest.mark.slow
def test_auto_resume_continues_a_killed_run_and_starts_an_empty_folder(tmp_path, tiny):
    """The same command with --auto-resume, requeued after a SIGKILL, continues from the last checkpoint; on an empty
    folder it starts the run; a flag that differs from the stored run's is refused as --resume refuses it."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "run"
    cmd = [sys.executable, str(root / "train.py"), *TINY, "--steps", "12", "--save-every", "1", "--auto-resume",
           "--out", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not (out / "latest").is_file() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)  # preempted, right after its first checkpoint
    proc.wait()
    assert (out / "latest").is_file()
    killed_at = int((out / "latest").read_text().split("-")[1])
    assert killed_at < 12
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert [r["step"] for r in read_ledger(out / "ledger.jsonl")] == list(range(12))
    refused = subprocess.run([*cmd, "--rho", "0.5"], env=env, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "--rho 0.5 (the run has 0.25)" in refused.stderr
    fresh = subprocess.run([*cmd[:-1], str(tmp_path / "empty")], env=env, capture_output=True, text=True, timeout=300)
    assert fresh.returncode == 0 and len(read_ledger(tmp_path / "empty" / "ledger.jsonl")) == 12
