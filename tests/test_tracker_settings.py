"""The trackers as researchers set them (opd/tracking.py): the learning rate in every tracker, W&B's project from
$WANDB_PROJECT (or --tracker-project), its entity, tags and group; metric names valid in every tracker (MLflow's
rules, the strictest), one mapping; the run says where its logs go. Read back with each tracker's own reader."""

import json

import pytest
from bench_fixtures import write_all_fixtures
from tracker_readers import tensorboard_scalars, wandb_history, wandb_run_record

import train
from opd.ledger import read_ledger
from opd.tracking import metric_name

TINY = ["--preset", "tiny", "--steps", "2", "--save-every", "0"]


def test_the_learning_rate_reaches_every_tracker_and_wandb_takes_its_project_tags_and_group(tmp_path, tiny, monkeypatch,
                                                                                            capsys):  # fmt: skip
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "from-the-environment")
    out = tmp_path / "run"
    train.main([*TINY, "--lr-schedule", "linear", "--report-to", "tensorboard,mlflow,wandb", "--tracker-tags",
                "seed0,toy", "--tracker-group", "sweep-1", "--out", str(out)])  # fmt: skip
    printed = capsys.readouterr().out
    assert f"TensorBoard logs in {out / 'tb'}" in printed and "MLflow runs in" in printed
    lrs = [r["lr"] for r in read_ledger(out / "ledger.jsonl")]
    assert lrs[0] > lrs[1] > 0  # the linear schedule: the rate moves, and each tracker must hold it
    assert [v for _, v in tensorboard_scalars(out / "tb")["optim/lr"]] == pytest.approx(lrs, rel=1e-6)
    from mlflow.tracking import MlflowClient

    run_id = json.loads((out / "trackers.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
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


def test_mlflow_with_the_crop_view_of_live_evaluation_trains_to_the_end(tmp_path, tiny, monkeypatch):
    """MLflow refuses '@' in a metric name: the crop view's scores reach it under the mapped name, and the run
    finishes with its checkpoint (a traceback at the first evaluation before)."""
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    bench = tmp_path / "bench"
    write_all_fixtures(bench)
    out = tmp_path / "run"
    train.main(["--preset", "tiny", "--steps", "2", "--report-to", "mlflow", "--eval-every", "2", "--eval-data",
                str(bench), "--eval-benchmarks", "zoombench", "--eval-views", "full,crop", "--eval-limit", "4",
                "--eval-max-new-tokens", "4", "--out", str(out)])  # fmt: skip
    assert (out / "checkpoint-000002").is_dir()
    from mlflow.tracking import MlflowClient

    run_id = json.loads((out / "trackers.json").read_text())["mlflow"]
    keys = set(MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri()).get_run(run_id).data.metrics)
    assert {"eval/zoombench", "eval/zoombench_crop", "eval/zoombench_crop_gap"} <= keys
