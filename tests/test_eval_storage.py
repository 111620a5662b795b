"""eval.py on a full disk (opd.storage): every write (predictions, settings.json, model_digests.json, scored.jsonl,
results.json, results.md, the judge cache, opd.export's folder) that meets ENOSPC is one line naming the folder,
the file and roughly the space needed; no temporary file is left, no torn row; once there is room the same
command continues to the result an undisturbed run gives.

The full disk is `full_disk`: the one low-level write of opd.storage (`write_all`) writes half of what it is
given to the named file, then raises OSError(ENOSPC), as a write that reaches the end of the disk does.
"""

import contextlib
import errno
import io
import json
import os
import re
import shutil
from pathlib import Path

import pytest
from bench_fixtures import write_vstar_fixture

import eval as eval_py
from opd import storage
from opd.cli import UserError, run_cli

KEY = "vstar"


def full_disk(monkeypatch, pattern: str, after: int = 0) -> None:
    """Writes to files whose name matches `pattern` (a regex) fail as on a full disk once `after` of them went
    through: half the bytes written, then ENOSPC."""
    real, done = storage.write_all, []

    def write_all(fd: int, data: bytes) -> None:
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        if re.fullmatch(pattern, name):
            if len(done) >= after:
                real(fd, data[: len(data) // 2])
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            done.append(name)
        real(fd, data)

    monkeypatch.setattr(storage, "write_all", write_all)


def argv(model, data, out) -> list[str]:
    return ["--model", str(model), "--data-dir", str(data), "--out", str(out), "--benchmarks", KEY, "--batch-size", "2",
            "--max-new-tokens", "3", "--device", "cpu", "--no-progress"]  # fmt: skip


def quiet(args) -> dict:
    with contextlib.redirect_stdout(io.StringIO()):
        return eval_py.main(args)


def temporary_files(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.name.endswith(".tmp") or ".export-" in p.name)


def lines(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    assert text == "" or text.endswith("\n"), "a torn last row"
    return text.splitlines()


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("vstar")
    write_vstar_fixture(root)
    return root


@pytest.fixture(scope="module")
def reference(tiny, data, tmp_path_factory) -> Path:
    """An undisturbed run: what a run that met a full disk must end with once there is room."""
    out = tmp_path_factory.mktemp("reference") / "out"
    quiet(argv(tiny[0], data, out))
    return out


def assert_same_as(out: Path, reference: Path) -> None:
    assert lines(out / KEY / "predictions.jsonl") == lines(reference / KEY / "predictions.jsonl")
    scores = [json.loads((o / "results.json").read_text())["benchmarks"] for o in (out, reference)]
    assert scores[0] == scores[1]
    assert temporary_files(out) == []


def test_a_full_disk_while_answering_is_one_line_and_the_run_resumes(tiny, data, reference, tmp_path, monkeypatch,
                                                                      capsys):  # fmt: skip
    out = tmp_path / "out"
    full_disk(monkeypatch, "predictions.jsonl", after=2)
    with pytest.raises(SystemExit) as stop:
        with contextlib.redirect_stdout(io.StringIO()):
            run_cli(eval_py.main, argv(tiny[0], data, out), "eval.py")
    assert stop.value.code == 2
    stderr = capsys.readouterr().err
    err = [line for line in stderr.splitlines() if "Loading weights" not in line and line.strip()]  # tqdm's bar
    assert len(err) == 1 and "Traceback" not in stderr, stderr
    size = len(lines(reference / KEY / "predictions.jsonl")[2].encode()) + 1
    assert re.fullmatch(rf"eval\.py: error: {re.escape(str(out / KEY))}: no space left on the device writing "
                        r"predictions\.jsonl \(about [0-9.]+ (bytes|KiB) needed, .* free\); free some space .* and "
                        r"run the same command again: it continues where it stopped", err[0]), err[0]
    needed = re.search(r"about ([0-9.]+) (bytes|KiB)", err[0])
    assert float(needed.group(1)) * (1024 if needed.group(2) == "KiB" else 1) >= 2 * size * 0.9  # the 2 rows left
    stored = lines(out / KEY / "predictions.jsonl")
    assert stored == lines(reference / KEY / "predictions.jsonl")[:2]  # whole rows only: the third was cut back
    assert temporary_files(out) == []
    monkeypatch.undo()  # room again
    quiet(argv(tiny[0], data, out))
    assert_same_as(out, reference)


@pytest.mark.parametrize("name,folder", [("settings.json", KEY), ("model_digests.json", "")])
def test_a_full_disk_at_the_start_leaves_no_temporary_file(tiny, data, reference, tmp_path, monkeypatch, name, folder):
    """settings.json (written once the model has loaded) and the digest cache (the issue's `.model_digests.json.*.tmp`
    left behind)."""
    out = tmp_path / "out"
    full_disk(monkeypatch, rf"\.{re.escape(name)}\..*\.tmp")
    with pytest.raises(UserError) as err:
        quiet(argv(tiny[0], data, out))
    assert "\n" not in str(err.value)
    assert str(err.value).startswith(f"{out / folder if folder else out}: no space left on the device writing {name} "
                                     "(about ")
    assert not out.exists() or temporary_files(out) == []
    assert not (out / KEY / "predictions.jsonl").exists()  # nothing answered into a folder without its settings
    monkeypatch.undo()
    quiet(argv(tiny[0], data, out))
    assert_same_as(out, reference)


@pytest.mark.parametrize("name", ["scored.jsonl", "results.json", "results.md"])
def test_a_full_disk_while_scoring_keeps_the_old_file_whole(tiny, data, reference, tmp_path, monkeypatch, name):
    """A rescoring run (everything answered: no model loaded) that cannot write a result file: one line, the old file
    as it was, no temporary file; with room, the same command writes it."""
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    path = out / (KEY if name == "scored.jsonl" else "") / name
    before = path.read_bytes()
    full_disk(monkeypatch, rf"\.{re.escape(name)}\..*\.tmp")
    with pytest.raises(UserError, match=rf"^{re.escape(str(path.parent))}: no space left on the device writing "
                                        rf"{re.escape(name)} \(about "):
        quiet(argv(tiny[0], data, out))
    assert path.read_bytes() == before and temporary_files(out) == []
    monkeypatch.undo()
    quiet(argv(tiny[0], data, out))
    assert_same_as(out, reference)


def test_a_full_disk_for_the_judge_cache_keeps_whole_verdicts(tmp_path, monkeypatch):
    from opd.eval.evaluate import read_jsonl
    from opd.eval.judge import Judge

    cache = tmp_path / "out" / "judge_cache.jsonl"
    judge = Judge("http://127.0.0.1:9/v1", "judge-model", cache)
    monkeypatch.setattr(judge, "_ask", lambda prompt: "correct")
    assert judge.verdict("q1", "red", "red car") == "correct"
    full_disk(monkeypatch, "judge_cache.jsonl")
    with pytest.raises(UserError, match=rf"^{re.escape(str(cache.parent))}: no space left on the device writing "
                                        r"judge_cache\.jsonl"):
        judge.verdict("q2", "blue", "a blue one")
    assert [r["question"] for r in read_jsonl(cache)] == ["q1"] and len(lines(cache)) == 1
    monkeypatch.undo()  # room again
    monkeypatch.setattr(judge, "_ask", lambda prompt: "correct")
    assert Judge("http://127.0.0.1:9/v1", "judge-model", cache).cache.keys() == judge.cache.keys()  # it reads whole
    assert judge.verdict("q2", "blue", "a blue one") == "correct"
    assert [r["question"] for r in read_jsonl(cache)] == ["q1", "q2"]


def test_a_full_disk_while_exporting_leaves_no_temporary_folder(tiny, tmp_path, monkeypatch):
    """save_pretrained's safetensors file on a full disk (safetensors raises its own SafetensorError, the OS error in
    its text): one line naming the folder and the model's size; no temporary folder, no export."""
    import transformers.modeling_utils
    from safetensors import SafetensorError

    from opd.export import write_export
    from opd.models.loading import load_model

    model = load_model(str(tiny[0]))
    real = transformers.modeling_utils.safe_save_file

    def save_file(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 100)
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space '
                              'left on device" })')

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", save_file)
    out = tmp_path / "exports" / "step3"
    size = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    with pytest.raises(UserError) as err:
        write_export(model, None, str(tiny[0]), out)
    assert str(err.value).startswith(f"{out.parent}: no space left on the device writing the export step3/ (about "
                                     f"{storage.size_text(size)} needed, ")
    assert not out.exists() and list(out.parent.iterdir()) == []
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", real)
    assert (write_export(model, None, str(tiny[0]), out) / "model.safetensors").is_file()
