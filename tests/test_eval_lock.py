"""One eval.py run per --out (opd.eval.lock over opd.run_folder's lock): a second run into a folder another one holds is refused
at once, in one line naming the folder, before it reads or writes anything there; under a launcher every rank
refuses alike.

The other run is stood in for by an flock on OUT/.lock taken through its own file descriptor, as another process
takes it (flock locks belong to the open file, so this process's eval.py is refused exactly like a second process);
no test waits on time.
"""

import contextlib
import fcntl
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench_fixtures import write_vstar_fixture

import eval as eval_py
from opd.cli import UserError

ROOT = Path(__file__).resolve().parents[1]
HOLDER = "pid 4242 on other-host"


@contextlib.contextmanager
def held(out: Path):
    """OUT/.lock held as another run holds it (opd.run_folder's format: the holder's pid and host in the file)."""
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, 0)
        os.write(fd, f"{HOLDER}\n".encode())
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def argv(model, data, out, *extra) -> list[str]:
    return ["--model", str(model), "--data-dir", str(data), "--out", str(out), "--benchmarks", "vstar",
            "--max-new-tokens", "3", "--device", "cpu", "--no-progress", *map(str, extra)]  # fmt: skip


def quiet(args) -> dict:
    with contextlib.redirect_stdout(io.StringIO()):
        return eval_py.main(args)


def test_a_second_run_into_a_held_folder_is_refused_in_one_line(tiny, tmp_path):
    write_vstar_fixture(tmp_path / "data")
    out = tmp_path / "out"
    with held(out):
        with pytest.raises(UserError) as err:
            quiet(argv(tiny[0], tmp_path / "data", out))
        assert str(err.value) == (f"--out {out} is in use by another run ({HOLDER}): wait for it to finish, or give "
                                  "another --out")
        assert sorted(p.name for p in out.iterdir()) == [".lock"]  # nothing read, nothing written
        proc = subprocess.run([sys.executable, str(ROOT / "eval.py"), *argv(tiny[0], tmp_path / "data", out)],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and lines == [f"eval.py: error: --out {out} is in use by another run ({HOLDER}): "
                                                  "wait for it to finish, or give another --out"], proc.stderr
    first = quiet(argv(tiny[0], tmp_path / "data", out))  # the holder is gone: it runs
    rows = (out / "vstar" / "predictions.jsonl").read_text().splitlines()
    assert first["results"]["vstar"]["n"] == len(rows) == 4
    with held(out):  # ... and gave the folder back when it ended
        pass
    with held(out), pytest.raises(UserError, match="is in use by another run"):  # a rescoring run is refused too
        quiet(argv(tiny[0], tmp_path / "data", out))
    assert (out / "vstar" / "predictions.jsonl").read_text().splitlines() == rows  # every row once


def test_a_failed_start_gives_the_folder_back_and_leaves_none(tiny, tmp_path):
    """A model that does not load: the lock is released and the folder the run created is removed; a folder that
    was there keeps its files (its .lock file stays, unlocked)."""
    import shutil

    write_vstar_fixture(tmp_path / "data")
    broken = tmp_path / "broken"
    shutil.copytree(tiny[0], broken)
    (broken / "model.safetensors").write_bytes(b"\0" * 64)
    out = tmp_path / "out"
    with pytest.raises(Exception):
        quiet(argv(broken, tmp_path / "data", out))
    assert not out.exists()
    (out / "notes").mkdir(parents=True)
    with pytest.raises(Exception):
        quiet(argv(broken, tmp_path / "data", out))
    assert sorted(p.name for p in out.iterdir()) == [".lock", "notes"]
    with held(out):  # not held any more
        pass


@pytest.mark.slow
def test_every_rank_refuses_a_held_folder(tiny, tmp_path):
    """torchrun 2 ranks into a held folder: rank 0 holds the check, both ranks stop with the same error, printed once;
    no rank answers anything."""
    write_vstar_fixture(tmp_path / "data")
    out = tmp_path / "out"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd = [*launcher, str(ROOT / "eval.py"), *argv(tiny[0], tmp_path / "data", out)]
    with held(out):
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "eval.py: error:" in line]
    assert errors == [f"eval.py: error: --out {out} is in use by another run ({HOLDER}): wait for it to finish, or "
                      "give another --out"], proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == [".lock"]
