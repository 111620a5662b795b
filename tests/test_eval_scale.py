"""eval.py over several processes (opd.eval.parallel): each rank answers its share, rank 0 merges and scores.

The slow tests launch `torchrun --nproc_per_node 2 eval.py` on fixture copies of all seven benchmarks (and
ZoomBench's crop view) against one `python eval.py` process: greedy decoding, so the same predictions and
scores; and a 2-rank run that resumes a stopped one (its part files and a torn line) ends with the same files.
The two launches batch the items differently (each rank its own share), so they compute in float64 (--dtype
float64, with tests/float64.py's patch of the tiny Qwen3.5's float32 casts: F64 below): a float32 greedy reply of
another batching can part at a near-tie, float64 logits of two batchings agree to ~1e-16 relative.
"""

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from bench_fixtures import write_all_fixtures

import eval as eval_py
from opd.eval import evaluate, inference
from opd.eval.parallel import Ranks

ROOT = Path(__file__).resolve().parents[1]
KEYS = ["vstar", "zoombench", "zoombench@crop", "hrbench4k", "mmvp", "cvbench", "mmstar", "pope"]
MAX_NEW = 4


def say(msg: str) -> None:
    sys.__stdout__.write(f"\n[eval-scale] {msg}\n")


def argv(model, data_dir, out, *extra) -> list[str]:
    return ["--model", str(model), "--data-dir", str(data_dir), "--out", str(out), "--batch-size", "4",
            "--max-new-tokens", str(MAX_NEW), "--device", "cpu", "--dtype", "float64", "--no-progress", "--view", "crop",
            *map(str, extra)]


F64 = """# eval.py with the tiny Qwen3.5's float32 casts in float64 for float64 weights (tests/float64.py)
import runpy, sys
sys.path[:0] = [{root!r}, {tests!r}]
from float64 import float64_model
float64_model()
sys.argv[0] = {script!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.fixture(scope="module")
def eval_f64(tmp_path_factory) -> Path:
    """A script that runs eval.py in float64 (F64): what the launches run."""
    path = tmp_path_factory.mktemp("f64") / "eval_f64.py"
    path.write_text(F64.format(root=str(ROOT), tests=str(ROOT / "tests"), script=str(ROOT / "eval.py")))
    return path


def command(nproc: int, script) -> list[str]:
    if nproc > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), str(script)]
    return [sys.executable, str(script)]


def launch(nproc: int, args: list[str], script, timeout: int = 600) -> float:
    """Seconds `python SCRIPT` (nproc 1) or `torchrun --nproc_per_node N SCRIPT` (eval.py in float64) took."""
    t0 = time.perf_counter()
    proc = subprocess.run(command(nproc, script) + args, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return time.perf_counter() - t0


def rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "predictions.jsonl").read_text(encoding="utf-8").splitlines()]


def scores(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())["benchmarks"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("benchdata")
    return SimpleNamespace(dir=root, golds=write_all_fixtures(root))


@pytest.fixture(scope="module")
def one_process(tiny, data, tmp_path_factory, eval_f64):
    out = tmp_path_factory.mktemp("one") / "eval"
    seconds = launch(1, argv(tiny[0], data.dir, out), eval_f64)
    return SimpleNamespace(out=out, seconds=seconds)


def assert_same_run(a: Path, b: Path) -> None:
    """The same prediction rows (modulo order; here also in order) and the same scores."""
    for key in KEYS:
        ra, rb = rows(a / key), rows(b / key)
        assert sorted(ra, key=lambda r: r["index"]) == sorted(rb, key=lambda r: r["index"]), key
        assert ra == rb, key  # rank 0 merges the parts in item order
        assert not list((b / key).glob("predictions.rank*.jsonl")), key
    assert scores(a) == scores(b)


@pytest.mark.slow
def test_two_ranks_give_one_processs_predictions_and_scores(tiny, data, one_process, tmp_path, eval_f64):
    out = tmp_path / "two"
    seconds = launch(2, argv(tiny[0], data.dir, out), eval_f64)
    n = sum(len(rows(one_process.out / key)) for key in KEYS)
    meta1, meta2 = (json.loads((o / "results.json").read_text())["meta"] for o in (one_process.out, out))
    answer1, answer2 = (sum(m["answer_s"].values()) for m in (meta1, meta2))
    say(f"{n} items, --max-new-tokens {MAX_NEW}: start to exit 1 process {one_process.seconds:.1f} s, torchrun 2 "
        f"ranks {seconds:.1f} s; answering (rank 0, merges included) {answer1:.2f} s vs {answer2:.2f} s")
    assert_same_run(one_process.out, out)
    assert meta2["world_size"] == 2 and meta1["world_size"] == 1


@pytest.mark.slow
def test_two_ranks_resume_a_stopped_run(tiny, data, one_process, tmp_path, eval_f64):
    """A stopped 2-rank run left predictions.jsonl with some rows and each rank's part file, one with a torn last
    line: the next 2-rank run merges them first, so both ranks skip the same items, and ends as one process."""
    out = tmp_path / "resumed"
    shutil.copytree(one_process.out, out)
    (out / "results.json").unlink()
    for key in ("hrbench4k", "pope"):
        full = rows(out / key)
        (out / key / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in full[:2]))
        (out / key / "predictions.rank0.jsonl").write_text(json.dumps(full[2]) + "\n")
        (out / key / "predictions.rank1.jsonl").write_text(json.dumps(full[3]) + "\n" + json.dumps(full[4])[:20])
    launch(2, argv(tiny[0], data.dir, out), eval_f64)
    assert_same_run(one_process.out, out)


FAIL_ON_RANK_1 = """# eval.py whose rank 1 cannot load the model (its own error, as a process whose GPU is full meets)
import os, runpy, sys
sys.path[:0] = [{root!r}]
import opd.models.loading
from opd.cli import UserError
if os.environ.get("RANK") == "1":
    def load_model(*args, **kwargs):
        raise UserError("no room for the model on this GPU (the test's failure)", local=True)
    opd.models.loading.load_model = load_model
sys.argv[0] = {script!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_an_error_on_one_rank_ends_the_launch_with_its_line(tiny, data, tmp_path):
    """Rank 1 fails alone (loading its model) while rank 0 goes on into the next collective: rank 1 prints its one
    line and exits without waiting at a barrier for rank 0 (which would wait for it in another collective until
    the 6-hour timeout), so the launch ends with an error instead of hanging."""
    script = tmp_path / "fail_on_rank_1.py"
    script.write_text(FAIL_ON_RANK_1.format(root=str(ROOT), script=str(ROOT / "eval.py")))
    args = [*argv(tiny[0], data.dir, tmp_path / "out"), "--benchmarks", "vstar", "--view", "full", "--dtype", "float32"]
    proc = subprocess.run(command(2, script) + args, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=300, cwd=ROOT)  # a hang would last hours: this bound fails it
    assert proc.returncode != 0
    assert "eval.py: error: [rank 1] no room for the model on this GPU (the test's failure)" in proc.stderr, proc.stderr


# ----------------------------------------------------------------------------- one process, no launcher


def test_ranks_without_a_launcher():
    ranks = Ranks()
    assert ranks.main and ranks.world == 1 and ranks.share([1, 2, 3]) == [1, 2, 3]
    assert ranks.on_main(lambda x: x + 1, 1) == 2 and ranks.broadcast("x") == "x" and ranks.gather(3) == [3]
    assert Ranks(1, 3).share(list(range(8))) == [1, 4, 7]  # every world-th item from the rank on
    assert sorted(i for r in range(3) for i in Ranks(r, 3).share(list(range(8)))) == list(range(8))


def test_closing_after_an_error_does_not_wait_at_a_barrier(monkeypatch):
    """After an error the group is destroyed at once (the other ranks may be in another collective); after a
    finished run every rank first meets the others at a barrier."""
    import torch.distributed as dist

    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: calls.append("barrier"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **k: calls.append("destroy"))
    Ranks(1, 2).close(ok=False)
    assert calls == ["destroy"]
    Ranks(1, 2).close()
    assert calls == ["destroy", "barrier", "destroy"]


def test_merge_parts_in_item_order_once_each(tmp_path):
    folder = tmp_path / "key"
    folder.mkdir()
    (folder / "predictions.jsonl").write_text('{"index": "a", "reply": "1"}\n{"index": "b", "rep')  # torn tail
    (folder / "predictions.rank1.jsonl").write_text('{"index": "d", "reply": "4"}\n{"index": "b", "reply": "2"}\n')
    (folder / "predictions.rank0.jsonl").write_text('{"index": "c", "reply": "3"}\n{"index": "a", "reply": "x"}\n'
                                                    '{"index": "e", "re')  # a rank killed mid-write
    stored = evaluate.merge_parts(folder, ["a", "b", "c", "d", "e"])
    assert {k: v["reply"] for k, v in stored.items()} == {"a": "1", "b": "2", "c": "3", "d": "4"}
    assert [r["index"] for r in evaluate.read_jsonl(folder / "predictions.jsonl")] == ["a", "b", "c", "d"]
    assert sorted(p.name for p in folder.iterdir()) == ["predictions.jsonl"]


def test_one_process_merges_the_parts_a_stopped_launch_left(tiny, data, tmp_path, monkeypatch, float64_model):
    """Without a launcher the parts are merged too, and only the items none of them holds are answered."""
    full = tmp_path / "full"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        eval_py.main(argv(tiny[0], data.dir, full, "--benchmarks", "mmvp", "--view", "full"))
    done = rows(full / "mmvp")
    out = tmp_path / "stopped"
    shutil.copytree(full, out)
    (out / "mmvp" / "predictions.jsonl").write_text(json.dumps(done[0]) + "\n")
    (out / "mmvp" / "predictions.rank1.jsonl").write_text(json.dumps(done[2]) + "\n")
    real, asked = inference.answer_items, []

    def recording(model, processor, items, *a, **k):
        items = list(items)
        asked.extend(i.index for i in items)
        return real(model, processor, items, *a, **k)

    monkeypatch.setattr(inference, "answer_items", recording)
    with contextlib.redirect_stdout(buf):
        eval_py.main(argv(tiny[0], data.dir, out, "--benchmarks", "mmvp", "--view", "full"))
    assert sorted(asked) == sorted([done[1]["index"], done[3]["index"]])
    assert sorted(rows(out / "mmvp"), key=lambda r: r["index"]) == sorted(done, key=lambda r: r["index"])
    assert not list((out / "mmvp").glob("predictions.rank*"))
