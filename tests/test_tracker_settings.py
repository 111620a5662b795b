"""The trackers as researchers set them (opd/loop/tracking.py): the learning rate in every tracker, W&B's project from
$WANDB_PROJECT (or --tracker-project), its entity, tags and group; metric names valid in every tracker (MLflow's
rules, the strictest), one mapping; the run says where its logs go. Read back with each tracker's own reader."""

import json
import shlex

import pytest
from bench_fixtures import write_all_fixtures
from tracker_readers import mlflow_client, tensorboard_scalars, wandb_history, wandb_run_record

import train
from opd.loop.ledger import read_ledger
from opd.loop.tracking import MLFLOW_READ, metric_name, mlflow_store, mlflow_where, venv_command

TINY = ["--preset", "tiny", "--steps", "2", "--save-every", "0"]


def test_the_learning_rate_reaches_every_tracker_and_wandb_takes_its_project_tags_and_group(tmp_path, tiny, monkeypatch,
                                                                                            capsys):  # fmt: skip
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "from-the-environment")
    out = tmp_path / "run"
    train.main([*TINY, "--lr-schedule", "linear", "--report-to", "tensorboard,mlflow,wandb", "--tracker-tags",
                "seed0,toy", "--tracker-group", "sweep-1", "--out", str(out)])  # fmt: skip
    printed = capsys.readouterr().out
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # MLflow's defaults for the reader
    assert f"TensorBoard logs in {out / 'tb'}" in printed and "MLflow runs in" in printed
    lrs = [r["lr"] for r in read_ledger(out / "ledger.jsonl")]
    assert lrs[0] > lrs[1] > 0  # the linear schedule: the rate moves, and each tracker must hold it
    assert [v for _, v in tensorboard_scalars(out / "tb")["optim/lr"]] == pytest.approx(lrs, rel=1e-6)
    run_id = json.loads((out / "trackers.json").read_text())["mlflow"]
    client, _ = mlflow_client(printed)
    assert [m.value for m in client.get_metric_history(run_id, "optim/lr")] == pytest.approx(lrs, rel=1e-12)
    assert {"seed0", "toy", "group"} <= set(client.get_run(run_id).data.tags)
    assert [h["optim/lr"] for h in wandb_history(out)] == pytest.approx(lrs, rel=1e-12)
    record = wandb_run_record(out)
    assert record.project == "from-the-environment" and record.run_group == "sweep-1"
    assert list(record.tags) == ["seed0", "toy"]
    monkeypatch.delenv("WANDB_PROJECT")
    train.main([*TINY, "--report-to", "wandb", "--tracker-project", "given", "--out", str(tmp_path / "given")])
    assert wandb_run_record(tmp_path / "given").project == "given"


def test_metric_names_are_valid_in_every_tracker():
    assert metric_name("eval/zoombench@crop") == "eval/zoombench_crop"
    assert metric_name("eval/zoombench@crop_gap") == "eval/zoombench_crop_gap"
    assert metric_name("loss/distill") == "loss/distill" and metric_name("cost/teacher_rows_a:b c.d-e") == (
        "cost/teacher_rows_a:b c.d-e")


def test_every_tracker_holds_the_evaluations_before_and_during_training(tmp_path, tiny, monkeypatch, capsys):
    """--eval-before's scores (the ledger's first row, `eval_before`) reach TensorBoard, MLflow and W&B at step 0 as
    eval/before/<name>, beside the after-step evaluations at their steps, each read back with the tracker's own reader
    and equal to the ledger (before: the ledger alone had them). MLflow refuses '@' in a metric name: the crop view's
    scores reach it under the mapped name, and the run finishes with its checkpoint."""
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    bench = tmp_path / "bench"
    write_all_fixtures(bench)
    out = tmp_path / "run"
    train.main(["--preset", "tiny", "--steps", "2", "--report-to", "tensorboard,mlflow,wandb", "--eval-before",
                "--eval-every", "2", "--eval-data", str(bench), "--eval-benchmarks", "zoombench", "--eval-views",
                "full,crop", "--eval-limit", "4", "--eval-max-new-tokens", "4", "--out", str(out)])  # fmt: skip
    assert (out / "checkpoint-000002").is_dir()
    rows = read_ledger(out / "ledger.jsonl")
    before, after = rows[0]["eval_before"], rows[1]  # the evaluation after the last step is in its row
    names = ("zoombench", "zoombench_crop", "zoombench_crop_gap")
    assert {f"eval/{n}" for n in names} <= set(before) and {f"eval/{n}" for n in names} <= set(after)
    want = {f"eval/before/{n}": [(0, before[f"eval/{n}"])] for n in names}  # tag -> [(step, value)]
    want |= {f"eval/{n}": [(1, after[f"eval/{n}"])] for n in names} | {"cost/eval_before_s": [(0, before["eval_s"])]}
    tb = tensorboard_scalars(out / "tb")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # MLflow's defaults for the reader
    client, _ = mlflow_client(capsys.readouterr().out)
    run_id = json.loads((out / "trackers.json").read_text())["mlflow"]
    history = wandb_history(out)
    for tag, points in want.items():
        steps, values = [s for s, _ in points], [v for _, v in points]
        assert [s for s, _ in tb[tag]] == steps, tag
        assert [v for _, v in tb[tag]] == pytest.approx(values, rel=1e-6, abs=1e-5), tag  # float32 events
        ml = client.get_metric_history(run_id, tag)
        assert [m.step for m in ml] == steps and [m.value for m in ml] == pytest.approx(values, rel=1e-12), tag
        wb = [h for h in history if tag in h]
        assert [h["_step"] for h in wb] == steps and [h[tag] for h in wb] == pytest.approx(values, rel=1e-12), tag


def test_mlflow_writes_its_sqlite_store_and_says_how_to_read_it(tmp_path, monkeypatch):
    """The store: SQLite DIR/mlflow.db (MLflow's default backend) for a new run; a resume keeps the store it began
    with (trackers.json), an earlier run's file store DIR/mlruns too (read with MLFLOW_ALLOW_FILE_STORE=true);
    $MLFLOW_TRACKING_URI wins. Each with the command that reads it back."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    db = f"sqlite:///{(tmp_path / 'mlflow.db').resolve()}"
    assert mlflow_store(tmp_path, {}) == db
    assert mlflow_store(tmp_path, {"mlflow": "abc", "mlflow_uri": db}) == db
    assert mlflow_store(tmp_path, {"mlflow": "abc"}) == (tmp_path / "mlruns").resolve().as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert mlflow_store(tmp_path, {"mlflow_uri": db}) == "http://127.0.0.1:5000"
    python = venv_command("python")
    read = f"MLFLOW_TRACKING_URI={db} {python} -c {shlex.quote(MLFLOW_READ)}"
    assert mlflow_where(db) == f"MLflow runs in {db} (read them back: {read})"
    file_uri = (tmp_path / "mlruns").resolve().as_uri()
    assert mlflow_where(file_uri).endswith(f"MLFLOW_ALLOW_FILE_STORE=true MLFLOW_TRACKING_URI={file_uri} {python} -c "
                                           f"{shlex.quote(MLFLOW_READ)})")
    assert mlflow_where("http://127.0.0.1:5000") == "MLflow runs at http://127.0.0.1:5000"
