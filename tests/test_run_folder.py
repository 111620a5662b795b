"""The run folder is safe: --overwrite deletes nothing until every input is built, one run per folder, a resume
refuses changed teachers and repairs a missing summary, every prompt is checked before step 0, and bad input is
one line (exit 2)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_training import small_config

import opd.run
import opd.loop.folder
import train
from opd import run_folder as runlock
from opd.models.chat import encode_prompt
from opd.data.checks import prompt_length
from opd.cli import UserError
from opd.data.sources import load_records
from opd.loop.ledger import read_ledger
from opd.models.loading import load_processor
from opd.tiny import build_tiny_model
from opd.data.records import VIEWS
from opd.data.checks import LAYOUTS

ROOT = Path(__file__).resolve().parents[1]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file of a folder (hidden ones aside) by relative path, with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.name.startswith(".")}  # fmt: skip


def tiny_rows(tiny) -> list[dict]:
    """The tiny default's records as dicts, image paths made absolute (so edited copies can live anywhere)."""
    rows = [json.loads(line) for line in tiny[1].read_text().splitlines() if line.strip()]
    for r in rows:
        for key in ("images", "image", "teacher_images"):
            if isinstance(r.get(key), list):
                r[key] = [str(tiny[1].parent / p) for p in r[key]]
            elif isinstance(r.get(key), str):
                r[key] = str(tiny[1].parent / r[key])
    return rows


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def other_models(tmp_path_factory, tiny):
    """A tiny checkpoint with other weights, one with another tokenizer (two letters' ids swapped), one with an
    unknown model_type."""
    root = tmp_path_factory.mktemp("others")
    same = build_tiny_model(root / "same", seed=1)
    other = root / "other"
    shutil.copytree(same, other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["A"], vocab["B"] = vocab["B"], vocab["A"]
    (other / "tokenizer.json").write_text(json.dumps(spec))
    unknown = root / "unknown"
    shutil.copytree(same, unknown)
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "qwen9_9"}))
    return {"same": same, "other": other, "unknown": unknown}


@pytest.mark.slow  # an end-to-end run (train, resume or export): -m slow
def test_overwrite_deletes_nothing_until_every_input_is_built(tmp_path, tiny, other_models, monkeypatch):
    """Each bad input of the audit stops `--overwrite` with one UserError and the old run byte for byte intact; so
    does a tracker that fails to start (after it began writing DIR/tb)."""
    out = tmp_path / "x"
    train.main(["--preset", "tiny", "--steps", "2", "--out", str(out)])
    before = snapshot(out)
    rows = tiny_rows(tiny)
    two_marks = write_rows(tmp_path / "marks.jsonl", [rows[0] | {"problem": "<image>" + rows[0]["problem"]}]
                           + rows[1:])  # fmt: skip
    missing_route = tmp_path / "missing.json"
    missing_route.write_text(json.dumps({"field": "task", "teachers": {"a": str(tmp_path / "gone")}, "default": "a"}))
    no_default = tmp_path / "nodefault.json"
    no_default.write_text(json.dumps({"field": "task", "teachers": {"a": "tiny"}}))
    cases = [
        (["--teacher-model", "/no/such"], "--teacher-model /no/such: no such model folder"),
        (["--teacher-model", str(other_models["other"])], "its tokenizer differs from the policy's"),
        (["--method", "opod", "--teachers", str(missing_route)], "no such model folder"),
        (["--method", "opod", "--teachers", str(no_default)], "no field 'task' in --teachers"),
        (["--model", str(other_models["unknown"])], "field 'model_type': 'qwen9_9' is not a model type"),
        (["--lr", "-1"], "--lr -1.0: must be >= 0"),
        (["--max-prompt-len", "10"], r"train.jsonl:1: its 'full' prompt has \d+ tokens, over --max-prompt-len 10"),
        (["--data", str(two_marks)], r"marks.jsonl:1: field 'problem': 2 '<image>' marks"),
    ]
    for flags, error in cases:
        with pytest.raises(UserError, match=error):
            train.main(["--preset", "tiny", "--steps", "3", "--out", str(out), "--overwrite", *flags])
        assert snapshot(out) == before, flags

    def failing(*args, **kwargs):
        (out / "tb").mkdir(exist_ok=True)
        (out / "tb" / "events.partial").write_text("x")
        raise RuntimeError("wandb: not logged in")

    with monkeypatch.context() as m:
        m.setattr(opd.run, "Trackers", failing)
        with pytest.raises(RuntimeError, match="not logged in"):
            train.main(["--preset", "tiny", "--steps", "3", "--out", str(out), "--overwrite"])
    assert snapshot(out) == before and not (out / opd.loop.folder.OVERWRITTEN).exists()
    (out / "eval").mkdir()  # eval.py's evaluations of the old run (its default --out), and a file of the user's
    (out / "eval" / "results.json").write_text("{}")
    (out / "eval-checkpoint-000002-merged").mkdir()
    (out / "eval-checkpoint-000002-merged" / ".lock").write_text("pid 1 on host\n")  # eval.py's lock file
    (out / "notes.txt").write_text("mine")
    train.main(["--preset", "tiny", "--steps", "1", "--out", str(out), "--overwrite"])  # a good one still replaces the run
    assert not (out / opd.loop.folder.OVERWRITTEN).exists()
    assert [r["step"] for r in read_ledger(out / "ledger.jsonl")] == [0]
    assert not (out / "eval").exists() and not (out / "eval-checkpoint-000002-merged").exists()
    assert (out / "notes.txt").read_text() == "mine"


def test_a_second_run_is_refused_while_another_process_holds_the_folder(tmp_path, tiny):
    """The lock is held by a live process (here a plain one, as a running train.py holds it) and released by the
    operating system when that process is killed: a killed run never leaves its folder locked."""
    out = tmp_path / "held"
    holder = subprocess.Popen(
        [sys.executable, "-c", f"from opd import run_folder as runlock; runlock.acquire({str(out)!r}); print('held', flush=True); "
         "import time; time.sleep(600)"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UserError, match=rf"{out} is in use by another run \(pid {holder.pid} on .*\): wait"):
            train.main(["--preset", "tiny", "--steps", "1", "--out", str(out)])
        assert not (out / "ledger.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()
    train.main(["--preset", "tiny", "--steps", "1", "--out", str(out)])  # the kill released it
    assert [r["step"] for r in read_ledger(out / "ledger.jsonl")] == [0]


def test_two_runs_started_at_once_into_one_folder_one_is_refused(tmp_path, tiny):
    """The audit's race: two train.py processes at once into one new folder. Exactly one trains; the other exits 2
    with one line; the ledger has one row per step."""
    out = tmp_path / "race"
    cmd = [sys.executable, str(ROOT / "train.py"), "--preset", "tiny", "--steps", "2", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]  # fmt: skip
    results = [(p.wait(timeout=600), p.stderr.read()) for p in procs]
    codes = sorted(code for code, _ in results)
    refused = [err for code, err in results if code == 2]
    assert codes == [0, 2], results
    lines = [line for line in refused[0].splitlines() if line.strip()]
    # in use (the two overlapped, as they nearly always do) or, on a machine slow enough that the second started
    # after the first had finished, the refusal of a folder that holds a run: either way one line, nothing written
    assert len(lines) == 1 and ("is in use by another run" in lines[0] or "--overwrite" in lines[0]), refused[0]
    assert [r["step"] for r in read_ledger(out / "ledger.jsonl")] == [0, 1]


def test_an_out_that_is_a_file_is_one_line(tmp_path, tiny):
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError, match=r"^--out .*f: is a file; a run needs a folder$"):
        train.main(["--preset", "tiny", "--steps", "1", "--out", str(tmp_path / "f")])
    assert (tmp_path / "f").read_text() == "x"


def test_in_one_process_the_lock_is_reentrant_and_released_by_the_last_holder(tmp_path):
    path = runlock.acquire(tmp_path / "r")
    assert runlock.acquire(tmp_path / "r") == path
    runlock.release(tmp_path / "r")
    code = "from opd import run_folder as runlock; import sys\ntry:\n runlock.acquire(sys.argv[1])\nexcept runlock.LockedError:\n sys.exit(3)"
    other = lambda: subprocess.run([sys.executable, "-c", code, str(tmp_path / "r")], cwd=ROOT).returncode  # noqa: E731
    assert other() == 3  # still held once
    runlock.release(tmp_path / "r")
    assert other() == 0


@pytest.mark.slow  # an end-to-end run (train, resume or export): -m slow
def test_resume_refuses_a_teacher_whose_weights_changed(tmp_path, tiny, other_models):
    """Retraining (here: one changed weight byte) the folder --teacher-model names, then --resume: refused by name;
    with the original weights back the resume runs."""
    teacher = tmp_path / "teacher"
    shutil.copytree(other_models["same"], teacher)
    out = tmp_path / "t"
    train.main(["--preset", "tiny", "--steps", "2", "--save-every", "1", "--out", str(out), "--teacher-model", str(teacher)])
    weights = teacher / "model.safetensors"
    original = weights.read_bytes()
    changed = bytearray(original)
    changed[-1] ^= 1
    weights.write_bytes(bytes(changed))
    with pytest.raises(UserError, match=rf"--teacher-model {teacher} .*is not the model the run started with"):
        train.main(["--resume", str(out), "--steps", "3"])
    weights.write_bytes(original)
    train.main(["--resume", str(out), "--steps", "3"])
    assert [r["step"] for r in read_ledger(out / "ledger.jsonl")] == [0, 1, 2]


@pytest.mark.slow  # an end-to-end run (train, resume or export): -m slow
def test_resume_of_a_complete_run_rewrites_a_missing_or_stale_summary(tmp_path, tiny, capsys):
    out = tmp_path / "s"
    train.main(["--preset", "tiny", "--steps", "3", "--out", str(out)])
    good = json.loads((out / "summary.json").read_text())
    md = (out / "summary.md").read_text()
    stamp = lambda: ((st := (out / "summary.json").stat()).st_ino, st.st_mtime_ns)  # noqa: E731 (a rewrite renames)
    before = stamp()
    train.main(["--resume", str(out)])  # complete and current: nothing rewritten
    assert stamp() == before
    for damage in ("missing", "stale", "torn"):
        if damage == "missing":
            (out / "summary.json").unlink()
        elif damage == "stale":  # as a kill after step 2's checkpoint of an earlier launch would leave it
            (out / "summary.json").write_text(json.dumps({**good, "steps": 2}))
        else:
            (out / "summary.json").write_text('{"steps": 3, "cand')
            (out / ".summary.json.tmp").write_text("half")  # an earlier version's temporary
            (out / ".summary.json.k2q9x1.tmp").write_text("half")  # storage.write_atomic's, killed before its rename
        train.main(["--resume", str(out)])
        assert json.loads((out / "summary.json").read_text()) == good, damage
        assert (out / "summary.md").read_text() == md
        assert list(out.glob(".summary.*")) == []


def test_a_resume_on_another_number_of_processes_says_so(tmp_path, tiny, capsys):
    out = tmp_path / "w"
    train.main(["--preset", "tiny", "--steps", "1", "--out", str(out)])
    state_path = out / "checkpoint-000001" / "state.pt"
    state = torch.load(state_path, weights_only=False)
    assert state["world_size"] == 1
    torch.save({**state, "world_size": 2}, state_path)  # as if trained on 2 ranks
    capsys.readouterr()
    train.main(["--resume", str(out), "--steps", "2"])
    captured = capsys.readouterr()
    assert "was trained on 2 process(es) and resumes on 1: rollouts are seeded per rank" in captured.err
    assert f"train.py: resuming from checkpoint-000001 (step 1) in {out}" in captured.out


def test_what_a_tiny_run_prints_and_writes_works_as_printed(tmp_path, tiny, monkeypatch, capsys):
    """A --preset tiny run's closing hint is an eval.py command that runs (it lacked --data-dir, and 'tiny' was no
    benchmark folder); its folder's train_config.json is there for --config (it was only in checkpoint-N/); its
    resume names the checkpoint and step it continues from."""
    import shlex

    from opd.eval import cli

    monkeypatch.chdir(tmp_path)
    train.main(["--preset", "tiny", "--steps", "2", "--report-to", "none", "--out", "runs/t"])
    printed = capsys.readouterr().out
    hint = printed.split("evaluate it with: ")[1].split(")\n")[0]
    python, script, *args = shlex.split(hint)
    assert Path(script).resolve() == ROOT / "eval.py" and Path(python).resolve() == Path(sys.executable).resolve()
    assert args == ["--model", "runs/t", "--data-dir", "tiny"]
    result = cli.main([*args, "--limit", "2", "--max-new-tokens", "2", "--no-progress"])
    assert result["results"]["zoombench"]["n"] == 2 and result["meta"]["out"] == "runs/t/eval"
    stored = json.loads((tmp_path / "runs/t/checkpoint-000002/train_config.json").read_text())
    assert json.loads((tmp_path / "runs/t/train_config.json").read_text()) == stored
    again = train.main(["--config", "runs/t/train_config.json", "--out", "runs/t2", "--print-config"])
    assert again == {**stored, "out": "runs/t2"}
    capsys.readouterr()
    train.main(["--resume", "runs/t", "--steps", "3", "--report-to", "none"])
    assert "train.py: resuming from checkpoint-000002 (step 2) in runs/t\n" in capsys.readouterr().out
    assert json.loads((tmp_path / "runs/t/train_config.json").read_text())["steps"] == 3  # the latest checkpoint's


def test_every_prompt_is_checked_before_step_0(tmp_path, tiny):
    """A record far down the file whose prompt is too long stops the run before it trains, naming file:line; its
    'reference_answer' prompt (OPSD's teacher) is checked too, not only the student's."""
    rows = tiny_rows(tiny)
    long = write_rows(tmp_path / "long.jsonl", rows[:20] + [rows[20] | {"problem": "word " * 600}] + rows[21:])
    with pytest.raises(UserError, match=r"long.jsonl:21: its 'full' prompt has \d+ tokens, over --max-prompt-len 512"):
        opd.run.Run(small_config(tmp_path, data=str(long)))
    assert not (tmp_path / "run" / "ledger.jsonl").exists()
    ref = write_rows(tmp_path / "ref.jsonl", rows[:7] + [rows[7] | {"solution": "step " * 600}] + rows[8:])
    opd.run.Run(small_config(tmp_path, data=str(ref), out=str(tmp_path / "bas")))  # bas-opd's views do not show it
    with pytest.raises(UserError, match=r"ref.jsonl:8: its 'reference_answer' prompt has \d+ tokens"):
        opd.run.Run(small_config(tmp_path, data=str(ref), method="opsd", out=str(tmp_path / "opsd")))


@pytest.mark.parametrize("view", sorted(VIEWS))
def test_the_prompt_length_check_counts_what_the_encoder_gives(tiny, view):
    """`prompt_length` from a view's layout (no image decoded) equals the length of the encoded prompt, for every
    view, on records of many sizes, with and without thinking."""
    processor = load_processor(str(tiny[0]))
    records = [r for r in load_records(tiny[1]) if VIEWS[view].eligible(r)][:12]
    assert records
    for r in records:
        for thinking in (False, True):
            images, question = VIEWS[view](r, seed=3)
            sizes, text = LAYOUTS[view](r)
            assert sizes == [im.size for im in images] and text == question
            assert prompt_length(processor, sizes, text, thinking) == len(encode_prompt(processor, images, question, thinking))


def run_train_py(*argv, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *map(str, argv)], cwd=cwd, capture_output=True,
                          text=True, timeout=600)  # fmt: skip


@pytest.mark.slow
def test_the_audits_bad_inputs_are_one_line_with_exit_code_2(tmp_path, tiny, other_models):
    """Each case of the audit's list: one line 'train.py: error: ...' naming the flag, file, line or field, exit 2,
    no traceback (three through the real command line; the others as the UserError that line prints)."""
    rows = tiny_rows(tiny)
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(write_rows(tmp_path / "l.jsonl", rows).read_bytes().replace(b"colour", "col\u00f6ur".encode("latin-1"), 1))
    parquet = tmp_path / "train.parquet"
    parquet.write_bytes(b"PAR1" + b"\0" * 16 + b"PAR1")
    empty_crop = write_rows(tmp_path / "empty.jsonl", rows[:3] + [rows[3] | {"teacher_images": []}] + rows[4:])
    empty = tmp_path / "empty"
    empty.mkdir()
    reserved = tmp_path / "reserved.json"
    reserved.write_text(json.dumps({"field": "problem", "teachers": {"a": "tiny"}, "default": "a"}))
    out = tmp_path / "o"
    cases = {
        "non-UTF-8 data": (["--data", latin1], f"{latin1}:1: not UTF-8 text (byte 0xf6"),
        "broken parquet": (["--data", parquet], "train.parquet: cannot read parquet file"),
        "negative lr": (["--lr", "-1"], "--lr -1.0: must be >= 0"),
        "unknown model_type": (["--model", other_models["unknown"]], "'qwen9_9' is not a model type"),
        "resume and overwrite": (["--resume", out, "--overwrite"], "choose one"),
        "ema tau": (["--ema-tau", "2"], "--ema-tau 2.0: the EMA rate must lie in [0, 1]"),
        "empty crop list": (["--data", empty_crop], "empty.jsonl:4: field 'teacher_images': expected exactly one image, got 0"),
        "data folder": (["--data", empty], "is a folder holding neither parquet files nor a dataset saved by"),
        "reserved route field": (["--method", "opod", "--teachers", reserved], "field 'problem' is one the records' own"),
        "flag typo": (["--polcy", "learned"], "unknown flag --polcy; did you mean --policy?"),
    }
    through_the_command_line = ("non-UTF-8 data", "flag typo", "unknown model_type")  # the rest in this process
    for case, (flags, expected) in cases.items():
        if case in through_the_command_line:
            proc = run_train_py("--preset", "tiny", "--steps", "1", "--out", out, *flags)
            lines = [line for line in proc.stderr.splitlines() if line.strip()]
            assert proc.returncode == 2 and len(lines) == 1, (case, proc.stderr[-2000:])
            assert lines[0].startswith("train.py: error: ") and expected in lines[0], (case, lines[0])
        else:  # the same UserError that run_cli prints as that one line (tests/test_training.py checks run_cli)
            with pytest.raises(UserError) as caught:
                train.main(["--preset", "tiny", "--steps", "1", "--out", str(out), *map(str, flags)])
            assert expected in str(caught.value) and "\n" not in str(caught.value), (case, str(caught.value))


def test_model_accepts_a_train_py_run_folder_as_eval_py_does(tmp_path, tiny):
    """--model RUN starts from the run's exported policy (its last checkpoint), as eval.py --model and
    --teacher-model take it."""
    first = tmp_path / "first"
    train.main(["--preset", "tiny", "--steps", "1", "--out", str(first)])
    run = opd.run.Run(small_config(tmp_path, model=str(first)))
    ckpt = first / (first / "latest").read_text().strip()
    assert run.initial_model == str(ckpt / "policy")
    exported = load_processor(str(ckpt / "policy"))
    assert run.processor.tokenizer.get_vocab() == exported.tokenizer.get_vocab()
