"""eval.py over several processes (opd.eval.parallel): each rank answers its share, rank 0 merges and scores.

The slow tests launch `torchrun --nproc_per_node 2 eval.py` on fixture copies of all seven benchmarks (and
ZoomBench's crop view) against one `python eval.py` process: greedy decoding, so the same predictions and
scores; and a 2-rank run that resumes a stopped one (its part files and a torn line) ends with the same files.
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
            "--max-new-tokens", str(MAX_NEW), "--device", "cpu", "--no-progress", "--view", "crop", *map(str, extra)]


def launch(nproc: int, args: list[str], timeout: int = 600) -> float:
    """Seconds `python eval.py` (nproc 1) or `torchrun --nproc_per_node N eval.py` took, start to exit."""
    cmd = [sys.executable, "eval.py"]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), "eval.py"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd + args, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
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
def one_process(tiny, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "eval"
    seconds = launch(1, argv(tiny[0], data.dir, out))
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
def test_two_ranks_give_one_processs_predictions_and_scores(tiny, data, one_process, tmp_path):
    out = tmp_path / "two"
    seconds = launch(2, argv(tiny[0], data.dir, out))
    n = sum(len(rows(one_process.out / key)) for key in KEYS)
    meta1, meta2 = (json.loads((o / "results.json").read_text())["meta"] for o in (one_process.out, out))
    answer1, answer2 = (sum(m["answer_s"].values()) for m in (meta1, meta2))
    say(f"{n} items, --max-new-tokens {MAX_NEW}: start to exit 1 process {one_process.seconds:.1f} s, torchrun 2 "
        f"ranks {seconds:.1f} s; answering (rank 0, merges included) {answer1:.2f} s vs {answer2:.2f} s")
    assert_same_run(one_process.out, out)
    assert meta2["world_size"] == 2 and meta1["world_size"] == 1


@pytest.mark.slow
def test_two_ranks_resume_a_stopped_run(tiny, data, one_process, tmp_path):
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
    launch(2, argv(tiny[0], data.dir, out))
    assert_same_run(one_process.out, out)


# ----------------------------------------------------------------------------- one process, no launcher


def test_ranks_without_a_launcher():
    ranks = Ranks()
    assert ranks.main and ranks.world == 1 and ranks.share([1, 2, 3]) == [1, 2, 3]
    assert ranks.on_main(lambda x: x + 1, 1) == 2 and ranks.broadcast("x") == "x"
    assert Ranks(1, 3).share(list(range(8))) == [1, 4, 7]  # every world-th item from the rank on
    assert sorted(i for r in range(3) for i in Ranks(r, 3).share(list(range(8)))) == list(range(8))


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


def test_one_process_merges_the_parts_a_stopped_launch_left(tiny, data, tmp_path, monkeypatch):
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
