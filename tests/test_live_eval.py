"""Evaluation while training (opd/eval/live.py): eval/<benchmark> rows in the ledger and the trackers, the same
scores eval.py gives the step's checkpoint, every rank taking part (no hang), and one-line errors."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench_fixtures import write_all_fixtures

import eval as eval_py
import opd.cli
import opd.config
import opd.run
import train
from opd.cli import UserError
from opd.loop.ledger import read_ledger

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    write_all_fixtures(root)
    return root


def test_eval_rows_are_logged_and_equal_eval_py_on_the_checkpoint(tmp_path, tiny, bench):
    """--eval-every 2 on 4 steps: rows 1 and 3 hold eval/pope (and zoombench in both views); the scores at step 2
    equal eval.py's on checkpoint-000002 with the same items and protocol."""
    out = tmp_path / "run"
    flags = ["--steps", "2", "--save-every", "2", "--keep-checkpoints", "2", "--eval-every", "2", "--eval-data", str(bench), "--eval-benchmarks",
             "pope,zoombench", "--eval-limit", "20", "--eval-views", "full,crop", "--eval-max-new-tokens", "6"]  # fmt: skip
    run = opd.run.Run(opd.config.TrainConfig(**{**opd.config.PRESETS["tiny"], **opd.cli.given_flags(opd.config.TrainConfig, opd.config.PRESETS,
                                                                                      flags + ["--out", str(out)])}))  # fmt: skip
    run.train()
    at_step_2 = dict(run.live.replies)
    train.main(["--resume", str(out), "--steps", "4"])
    rows = read_ledger(out / "ledger.jsonl")
    evaluated = [r["step"] for r in rows if "eval/pope" in r]
    assert evaluated == [1, 3] and all(r["eval_s"] > 0 for r in rows if "eval/pope" in r)
    assert {"eval/zoombench", "eval/zoombench_crop", "eval/zoombench_crop_gap"} <= set(rows[1])
    from opd.loop.tracking import metric_name

    assert [k for k in rows[1] if metric_name(k) != k] == []  # the ledger's names are the trackers' (issue 27)
    res = eval_py.main(["--model", str(out / "checkpoint-000002"), "--benchmarks", "pope,zoombench", "--view", "crop",
                        "--data-dir", str(bench), "--out", str(tmp_path / "eval"), "--limit", "20", "--max-new-tokens",
                        "6", "--batch-size", "8", "--device", "cpu", "--no-progress"])["results"]  # fmt: skip
    import json

    for (name, view), replies in at_step_2.items():  # the same replies, item by item, as eval.py's
        key = name if view == "full" else f"{name}@crop"
        stored = [json.loads(x) for x in (tmp_path / "eval" / key / "predictions.jsonl").read_text().splitlines() if x]
        assert len(replies) == len(stored) > 0 and {r["index"]: r["reply"] for r in stored} == replies, key
    assert rows[1]["eval/pope"] == pytest.approx(res["pope"]["score"])
    assert rows[1]["eval/zoombench"] == pytest.approx(res["zoombench"]["score"])
    assert rows[1]["eval/zoombench_crop"] == pytest.approx(res["zoombench@crop"]["score"])
    from tracker_readers import tensorboard_scalars

    assert [s for s, _ in tensorboard_scalars(out / "tb")["eval/pope"]] == [1, 3]


@pytest.mark.parametrize("flags,message", [
    (["--eval-every", "2"], "--eval-every needs --eval-data"),
    (["--eval-every", "2", "--eval-data", "{bench}", "--eval-benchmarks", "popes"], "--eval-benchmarks 'popes': choose from"),
    (["--eval-every", "2", "--eval-data", "{tmp}"], "no files for zoombench"),
    (["--eval-every", "2", "--eval-data", "{bench}", "--eval-views", "crop"], "--eval-views 'crop': full, or full,crop"),
])  # fmt: skip
def test_bad_eval_flags_are_one_line(tmp_path, tiny, bench, flags, message):
    flags = [f.format(bench=bench, tmp=tmp_path) for f in flags]
    with pytest.raises(UserError, match=message):
        train.main(["--preset", "tiny", *flags, "--out", str(tmp_path / "r")])


@pytest.mark.slow
def test_two_ranks_evaluate_their_shares_without_hanging(tmp_path, tiny, bench):
    """torchrun 2 ranks with --eval-every 2 (and --fsdp, whose sharded generation needs every rank): both finish,
    the ledger has eval/pope on steps 1 and 3."""
    for fsdp in ([], ["--fsdp"]):
        out = tmp_path / ("fsdp" if fsdp else "ddp")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(ROOT / "train.py"),
               "--preset", "tiny", "--steps", "4", "--eval-every", "2", "--eval-data", str(bench), "--eval-benchmarks", "pope",
               "--eval-limit", "20", "--eval-max-new-tokens", "4", "--out", str(out), *fsdp]  # fmt: skip
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows = read_ledger(out / "ledger.jsonl")
        assert [r["step"] for r in rows if "eval/pope" in r] == [1, 3]


def partial_crops(root: Path) -> Path:
    """ZoomBench as a Vision-OPD eval JSON of 4 choice items (gold A), only items z2 and z3 with a crop."""
    import json

    from bench_fixtures import image_bytes

    folder = root / "zoombench"
    folder.mkdir(parents=True)
    rows = []
    for n in range(4):
        (folder / f"z{n}.png").write_bytes(image_bytes(n))
        row = {"source_id": f"z{n}", "query": "<image>Which?\n(A) red\n(B) blue", "response": "A",
               "images": [f"z{n}.png"], "question_format": "multiple_choice"}
        if n >= 2:
            (folder / f"z{n}_crop.png").write_bytes(image_bytes(10 + n))
            row["crop_images"] = [f"z{n}_crop.png"]
        rows.append(row)
    (folder / "zoombench.json").write_text(json.dumps(rows))
    return root


def live_call(live, replies: dict, monkeypatch):
    """`live(...)` on one process with the answering replaced: (index, view) -> reply, no model."""
    import contextlib
    from types import SimpleNamespace

    import torch

    from opd.eval import inference

    def encode(processor, item, view="full", enable_thinking=False, max_prompt_len=None):
        reply = replies[item.index, view]
        if isinstance(reply, Exception):
            raise reply
        return reply

    monkeypatch.setattr(inference, "encode_item", encode)
    monkeypatch.setattr(inference, "generate_replies", lambda model, processor, prompts, max_new: list(prompts))
    accelerator = SimpleNamespace(process_index=0, num_processes=1)
    return live(accelerator, torch.nn.Linear(1, 1), None, False, contextlib.nullcontext)


def test_the_crop_gap_compares_the_same_items_in_both_views(tmp_path, monkeypatch):
    """--eval-limit 3 with crops on z2 and z3 only: the full view answers z0-z2, the crop view z2-z3; the gap is
    crop minus full accuracy on z2 alone (as eval.py's zoom gap), not the difference of two other item sets' scores."""
    from opd.eval.live import LiveEval, LiveEvalConfig

    data = partial_crops(tmp_path / "bench")
    live = LiveEval(LiveEvalConfig(every=1, data=str(data), limit=3, views="full,crop"), steps=1)
    assert [i.index for i in live.items["zoombench", "full"]] == ["z0", "z1", "z2"]
    assert [i.index for i in live.items["zoombench", "crop"]] == ["z2", "z3"]
    replies = {("z0", "full"): "A", ("z1", "full"): "A", ("z2", "full"): "B", ("z2", "crop"): "A", ("z3", "crop"): "B"}
    out = live_call(live, replies, monkeypatch)
    assert out["eval/zoombench"] == pytest.approx(100 * 2 / 3) and out["eval/zoombench_crop"] == pytest.approx(50.0)
    assert out["eval/zoombench_crop_gap"] == pytest.approx(100.0)  # z2: right with its crop, wrong without


def test_a_prompt_that_fails_is_one_line(tmp_path, monkeypatch):
    from opd.eval.live import LiveEval, LiveEvalConfig

    data = partial_crops(tmp_path / "bench")
    live = LiveEval(LiveEvalConfig(every=1, data=str(data), limit=2), steps=1)
    failure = UserError("zoombench.json row 1 field 'images': cannot decode image z1.png: truncated", local=True)
    with pytest.raises(UserError, match=r"^--eval-data: zoombench.json row 1 field 'images': cannot decode image"):
        live_call(live, {("z0", "full"): "A", ("z1", "full"): failure}, monkeypatch)


def test_a_benchmark_that_needs_pyarrow_without_it_is_one_line(tmp_path, monkeypatch):
    from opd.eval import benchmarks
    from opd.eval.live import LiveEval, LiveEvalConfig

    def no_pyarrow(name, data_dir, check_images=True):
        raise ImportError(f"reading {data_dir}/pope/x.parquet needs pyarrow: pip install pyarrow")

    monkeypatch.setattr(benchmarks, "load_benchmark", no_pyarrow)
    with pytest.raises(UserError, match=r"^--eval-data: benchmark 'pope': reading .* needs pyarrow"):
        LiveEval(LiveEvalConfig(every=1, data=str(tmp_path), benchmarks="pope"), steps=1)


def test_a_ledger_written_with_the_old_crop_names_reads_under_todays():
    """A run resumed from a ledger whose live evaluations were named `eval/<name>@crop` (before the names were made
    tracker-valid): its summary has one column per score, under today's `_crop` names."""
    from opd.eval.live import evaluations, score_label

    rows = [{"step": 0, "eval_before": {"eval/zoombench": 40.0, "eval/zoombench@crop": 90.0, "eval/zoombench@crop_gap": 50.0}},
            {"step": 1, "eval/zoombench": 45.0, "eval/zoombench_crop": 95.0, "eval/zoombench_crop_gap": 50.0}]  # fmt: skip
    assert evaluations(rows) == [
        {"after": 0, "eval/zoombench": 40.0, "eval/zoombench_crop": 90.0, "eval/zoombench_crop_gap": 50.0},
        {"after": 2, "eval/zoombench": 45.0, "eval/zoombench_crop": 95.0, "eval/zoombench_crop_gap": 50.0}]
    assert [score_label(k) for k in ("eval/zoombench", "eval/zoombench_crop", "eval/zoombench_crop_gap")] == [
        "zoombench, full image", "zoombench, crop", "zoombench, crop - full"]  # fmt: skip
