"""The front door as a new user meets it (issue 44): a bad --config file is one line, as fast as a bad flag; its
key given twice names both lines; --overwrite keeps a user's own folders and survives a kill; a run stopped before
its first checkpoint says plainly that nothing can be resumed; every hint the run prints runs as printed; a rank
whose peer failed exits in one line."""

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tracker_readers import mlflow_history

import opd.run
import train
from opd.cli import UserError
from opd import run_folder as runfolder
from opd.loop.ledger import read_ledger

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--preset", "tiny", "--report-to", "none"]


def test_a_config_file_that_is_not_utf8_is_one_line_naming_its_line(tmp_path):
    path = tmp_path / "run.yaml"
    raw = "rho: 0.5\n# r\u00e9glages\nsteps: 2\n".encode("latin-1")  # saved in Latin-1, as an old editor might
    path.write_bytes(raw)
    line = raw[: raw.index(b"\xe9")].count(b"\n") + 1  # the bad byte's line, counted here
    assert line == 2
    with pytest.raises(UserError, match=rf"^{re.escape(str(path))}:{line}: not UTF-8 text \(byte 0xe9\)"):
        train.main(["--config", str(path), "--print-config"])


@pytest.mark.parametrize("second", ["rho", "--rho"])
def test_a_key_given_twice_in_a_config_file_names_both_lines(tmp_path, second):
    path = tmp_path / "run.yaml"
    path.write_text(f"rho: 0.5\nsteps: 2\n{second}: 0.75\n")  # YAML itself keeps the last one silently
    with pytest.raises(UserError, match=rf"{re.escape(str(path))}:3: key '{second}' given twice \(also on line 1\)"):
        train.main(["--config", str(path), "--print-config"])
    (tmp_path / "two.yaml").write_text("lora-r: 4\nlora_r: 8\n")  # two spellings of one flag
    with pytest.raises(UserError, match="two.yaml:2: key 'lora_r' given twice"):
        train.main(["--config", str(tmp_path / "two.yaml"), "--print-config"])


def test_a_bad_setting_answers_before_torch_is_imported(tmp_path):
    """A --config file's problem (and a bad flag value) is found before any heavy import: it took 19 s (torch,
    transformers and accelerate loaded by the settings' checks), a mistyped flag 1 s."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("rho: 2.5\nbogus_key: 1\n")
    code = "\n".join([
        "import sys, train", "from opd.cli import UserError",
        f"for argv in ({['--config', str(bad)]!r}, ['--rho', '2.5'], ['--dtype', 'float8']):",
        "    try:", "        train.main(argv)", "    except UserError as e:",
        "        print('ERR', str(e).replace(chr(10), ' | '))",
        "print('torch' in sys.modules, 'accelerate' in sys.modules)",
    ])  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120).stdout
    assert out.count("ERR ") == 3 and "unknown key 'bogus_key'" in out and "--dtype 'float8'" in out, out
    assert out.strip().endswith("False False"), out


def test_tracker_availability_is_accelerates_own():
    """--report-to is checked without importing accelerate (torch): its names and availability match accelerate's."""
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers

    from opd.loop.settings import PACKAGES, parse_report_to

    assert list(PACKAGES) == list(LOGGER_TYPE_TO_CLASS)
    available = {str(t) for t in get_available_trackers()}
    for name in PACKAGES:
        try:
            parse_report_to(name)
            ours = True
        except UserError as exc:
            ours = "not installed" not in str(exc)  # (mlflow without its SQLite packages: installed)
        assert ours == (name in available), name


def test_overwrite_replaces_only_the_evaluations_eval_py_wrote(tmp_path):
    """RUN/eval-mynotes is the user's; RUN/eval and RUN/eval-checkpoint-N[-merged] are eval.py's default --out, and
    only when eval.py's lock file or results are in them."""
    names = {"eval": ".lock", "eval-checkpoint-000060": "results.json", "eval-checkpoint-000060-merged": ".lock",
             "eval-mynotes": ".lock", "eval-checkpoint-000060-old": "results.json", "evaluation": ".lock",
             "eval-checkpoint-000002": None}  # fmt: skip
    for name, marker in names.items():
        (tmp_path / name).mkdir()
        if marker:
            (tmp_path / name / marker).write_text("x")
    (tmp_path / "eval-file").write_text("a file")
    found = [p.name for p in runfolder.run_evaluations(tmp_path)]
    assert found == ["eval", "eval-checkpoint-000060", "eval-checkpoint-000060-merged"]


def _aside(out: Path, partial: str) -> dict:
    """The run in `out` as a kill leaves it: set aside by --overwrite (`partial`: 'whole', into .overwritten/, with
    the new run's first tracker files written; 'moving', half moved into .overwriting/; 'restoring', half moved
    back). Returns the old run's files (hidden ones aside) before."""
    before = {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()
              and not p.name.startswith(".")}  # fmt: skip
    found = runfolder.run_files(out)
    target = out / {"whole": runfolder.OVERWRITTEN, "moving": runfolder.OVERWRITING,
                    "restoring": runfolder.RESTORING}[partial]  # fmt: skip
    target.mkdir()
    for path in found if partial == "whole" else found[: len(found) // 2]:
        path.rename(target / path.name)
    if partial == "whole":
        (out / "tb").mkdir()
        (out / "tb" / "events.new-run").write_text("the new run's")
        (out / "trackers.json").write_text("{}")
    return before


def _files(out: Path) -> dict:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()
            and not p.name.startswith(".")}  # fmt: skip


def test_a_run_killed_while_overwrite_had_the_old_one_aside_is_put_back(tmp_path, tiny, capsys):
    """A kill between --overwrite moving the old run aside and the new run starting left it in DIR/.overwritten/,
    where the next --overwrite deleted it unseen. Now the next run into the folder puts it back first: the same
    command is refused as before (the old run is there), --resume continues it."""
    out = tmp_path / "run"
    train.main([*TINY, "--steps", "2", "--out", str(out)])
    for partial in ("whole", "moving", "restoring"):
        before = _aside(out, partial)
        with pytest.raises(UserError, match="holds a run .*continue it with --resume"):
            train.main([*TINY, "--steps", "2", "--out", str(out)])
        assert _files(out) == before, partial
        assert not any((out / n).exists() for n in runfolder.ASIDE), partial
        assert "an interrupted --overwrite had set aside" in capsys.readouterr().err
    _aside(out, "whole")
    train.main([*TINY, "--resume", str(out), "--steps", "3"])  # --resume finds it (before any lock: checkpoint_of)
    assert [r["step"] for r in read_ledger(out / "ledger.jsonl")] == [0, 1, 2]


def test_ctrl_c_before_the_first_checkpoint_says_plainly_nothing_can_be_resumed(tmp_path, tiny, monkeypatch):
    """The README's first run checkpoints only at its end: Ctrl-C before it offered --resume, which then failed.
    What it prints, and what the same command then says, are run as printed."""
    out = tmp_path / "run"
    real = opd.run.Run.step

    def interrupted(self, step, rollouts=None):
        if step == 1:
            raise KeyboardInterrupt
        return real(self, step, rollouts)

    with monkeypatch.context() as m:
        m.setattr(opd.run.Run, "step", interrupted)
        with pytest.raises(KeyboardInterrupt, match="at step 1, before its first checkpoint .*nothing can be resumed; "
                           "the same command with --overwrite starts over"):  # fmt: skip
            train.main([*TINY, "--steps", "3", "--save-every", "0", "--out", str(out)])
    with pytest.raises(UserError, match="stopped before its first checkpoint .*nothing can be resumed; start over with "
                       "the same command and --overwrite") as again:  # fmt: skip
        train.main([*TINY, "--steps", "3", "--save-every", "0", "--out", str(out)])
    assert "--resume" not in str(again.value)
    with pytest.raises(UserError, match="stopped before its first checkpoint, so nothing can be resumed"):
        train.main([*TINY, "--resume", str(out)])
    train.main([*TINY, "--steps", "3", "--save-every", "0", "--out", str(out), "--overwrite"])  # as the lines say
    assert [r["step"] for r in read_ledger(out / "ledger.jsonl")] == [0, 1, 2]


def test_the_tracker_hints_run_as_printed(tmp_path, tiny, monkeypatch, capsys):
    """TensorBoard's hint is the venv's own tensorboard (not on $PATH); MLflow's reads the store back with what
    requirements-trackers.txt installs (mlflow-skinny has no `mlflow ui`: flask is missing). Each is run in a shell,
    exactly as printed, from the folder the run was started in."""
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    train.main(["--preset", "tiny", "--steps", "2", "--report-to", "tensorboard,mlflow", "--out", str(out)])
    printed = capsys.readouterr().out
    tb = re.search(r"TensorBoard logs in \S+ \((.*)\)$", printed, re.M).group(1)
    ml = re.search(r"MLflow runs in \S+ \(read them back: (.*)\)$", printed, re.M).group(1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["PATH"] = "/usr/bin:/bin"  # a fresh shell: the venv is not activated
    read = subprocess.run(["bash", "-c", ml], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert read.returncode == 0, read.stderr[-2000:]
    loss = dict(mlflow_history(out, "loss/distill"))[1]
    assert "FINISHED" in read.stdout and f"'loss/distill': {loss!r}" in read.stdout, read.stdout
    assert shlex.split(tb)[0].endswith("tensorboard") and "--logdir" in tb
    server = subprocess.Popen(["bash", "-c", f"exec {tb} --port 0"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        line, deadline = "", time.time() + 90
        while "http://" not in line and time.time() < deadline and server.poll() is None:
            line = server.stdout.readline()
        assert "TensorBoard" in line and "http://" in line, line
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=30)


def test_a_rank_the_launcher_terminates_says_one_line(monkeypatch, capsys):
    """torchrun sends SIGTERM to the other ranks when one ends, often before their collective notices (CI saw
    rank 0 die silently that way): under a launcher with 2 processes it is one line and exit code 1; the
    process's own SIGTERM handler is back afterwards. Deterministic: the process signals itself."""
    from opd.cli import run_cli

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    before = signal.getsignal(signal.SIGTERM)
    reached = []

    def main(argv):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(10**7):  # the handler runs at the next bytecode; never reached in full
            pass
        reached.append("end")

    with pytest.raises(SystemExit) as stop:
        run_cli(main, [], "train.py")
    assert stop.value.code == 1 and reached == []
    assert "train.py: [rank 0] stopped: another process of the run ended, or the launcher was stopped (SIGTERM)" in (
        capsys.readouterr().err)
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_rank_other_than_0_leaves_a_shared_error_to_rank_0(tmp_path):
    """CI saw a 2-rank refusal print no error line: rank 1 exited at once and the launcher ended rank 0 before it
    printed. Now rank 1 waits: ended by the launcher (SIGTERM) it is silent with exit code 2; rank 0 still running
    after the grace period, it prints the line itself. Deterministic: the wait is replaced in the child."""
    child = tmp_path / "rank1.py"
    child.write_text("\n".join([
        "import os, signal, sys", "sys.path.insert(0, sys.argv[1])", "import opd.cli",
        "from opd.cli import UserError, run_cli",
        "if sys.argv[2] == 'launcher-ends-it':",
        "    opd.cli.time.sleep = lambda s: (os.kill(os.getpid(), signal.SIGTERM), [0 for _ in range(10**7)])",
        "else:", "    opd.cli.RANK_ZERO_GRACE_S = 0.0",
        "def main(argv):", "    raise UserError('--rho must be in (0, 1] (test)')",
        "run_cli(main, [], 'train.py')", "",
    ]))  # fmt: skip
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2"}
    ended = subprocess.run([sys.executable, str(child), str(ROOT), "launcher-ends-it"], env=env,
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert ended.returncode == 2 and ended.stderr == "", ended.stderr
    alone = subprocess.run([sys.executable, str(child), str(ROOT), "rank-0-never-ends"], env=env,
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert alone.returncode == 2 and alone.stderr == "train.py: error: [rank 1] --rho must be in (0, 1] (test)\n"


def test_the_rank_whose_peer_failed_says_one_line(tmp_path, tiny):
    """Two ranks, rank 1 failing with its own error: rank 0, waiting in a collective, printed gloo's traceback
    ('Connection closed by peer'); now one line."""
    worker = tmp_path / "worker.py"
    worker.write_text("\n".join([
        "import sys", "sys.path.insert(0, sys.argv.pop(1))", "import opd.run, train",
        "from opd.cli import UserError, run_cli", "real = opd.run.Run.step",
        "def step(self, step, rollouts=None):", "    if step == 1 and self.acc.process_index == 1:",
        "        raise UserError('a prompt of its own shard (test)', local=True)", "    return real(self, step, rollouts)",
        "opd.run.Run.step = step", "run_cli(train.main, sys.argv[1:], 'train.py')", "",
    ]))  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(worker),
           str(ROOT), *TINY, "--steps", "3", "--out", str(tmp_path / "two")]  # fmt: skip
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    err = proc.stderr.replace("\r", "\n")
    assert proc.returncode != 0 and "train.py: error: [rank 1] a prompt of its own shard (test)" in err
    assert "train.py: [rank 0] stopped: another process of the run ended" in err, err[-3000:]
    assert "[rank0]: Traceback" not in err and "Connection closed by peer" not in err, err[-3000:]


def test_the_torch_free_choices_are_the_loaders_own():
    """The settings name --dtype's, --fsdp-generation's and --teacher-view's choices without importing torch: the
    same as the modules that use them."""
    from opd.data.records import VIEWS
    from opd.data.settings import VIEW_NAMES
    from opd.models.loading import DTYPES
    from opd.models.settings import DTYPE_NAMES, GENERATION_MODES
    from opd.models.sharding import GENERATION

    assert DTYPE_NAMES == tuple(DTYPES) and GENERATION_MODES == tuple(GENERATION) and VIEW_NAMES == tuple(VIEWS)


def test_python_train_py_runs_one_thread_per_process_as_the_launchers_do():
    """`python train.py` sets OMP_NUM_THREADS=1 unless it is set, as accelerate launch and torchrun do: the README's
    plain command is then the same process as `accelerate launch train.py` (the default run's ledgers were
    bit-identical, timings aside), and 4x faster than torch's thread per core beside another job on 2 cores."""
    code = ("import os, runpy, sys\nsys.argv = ['train.py', '--print-config']\nimport contextlib, io\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n    runpy.run_path('train.py', run_name='__main__')\n"
            "import torch\nprint(os.environ['OMP_NUM_THREADS'], torch.get_num_threads())")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.stdout.split() == ["1", "1"], run.stderr[-2000:]
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**env, "OMP_NUM_THREADS": "2"},
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.stdout.split() == ["2", "2"], run.stderr[-2000:]


@pytest.mark.slow  # an end-to-end run (train, resume or export): -m slow
def test_a_sigkill_while_overwrite_starts_loses_nothing(tmp_path, tiny):
    """The kill itself: --overwrite has set the old run aside and is starting its trackers when it is SIGKILLed; the
    same command without --overwrite then finds the old run, byte for byte, and is refused as before."""
    out = tmp_path / "run"
    train.main([*TINY, "--steps", "2", "--out", str(out)])
    before = _files(out)
    worker = tmp_path / "worker.py"
    worker.write_text("\n".join([
        "import sys, time", "sys.path.insert(0, sys.argv.pop(1))", "import opd.run, train",
        "def stalled(*args, **kwargs):", "    print('aside', flush=True)", "    time.sleep(600)",
        "opd.run.Trackers = stalled", "train.main(sys.argv[1:])", "",
    ]))  # fmt: skip
    proc = subprocess.Popen([sys.executable, str(worker), str(ROOT), *TINY, "--steps", "2", "--out", str(out),
                             "--overwrite"], stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "aside"
        assert (out / runfolder.OVERWRITTEN).is_dir() and not (out / "ledger.jsonl").exists()
    finally:
        proc.kill()
        proc.wait()
    with pytest.raises(UserError, match="holds a run .*continue it with --resume"):
        train.main([*TINY, "--steps", "2", "--out", str(out)])
    assert _files(out) == before and not (out / runfolder.OVERWRITTEN).exists()
