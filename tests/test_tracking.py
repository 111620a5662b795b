"""Experiment trackers through accelerate (opd/tracking.py): what train.py --report-to writes, read back with each
tracker's own reader (TensorBoard's event files, MLflow's client on its local file store, W&B's offline transaction
log parsed with its own protobuf records), not a mock; a resume continues the same tracker run."""

import json

import pytest
from tracker_readers import tensorboard_scalars, wandb_history  # noqa: E402 (tests/ on the path)

import train
from opd.cli import UserError
from opd.ledger import read_ledger
from opd.tracking import metrics, parse_report_to


def test_tensorboard_and_mlflow_hold_the_ledgers_metrics_in_their_namespaces(tmp_path, tiny, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "t"
    train.main(["--preset", "tiny", "--steps", "3", "--report-to", "tensorboard,mlflow", "--out", str(out)])
    rows = read_ledger(out / "ledger.jsonl")
    tb = tensorboard_scalars(out / "tb")
    for tag, key in (("loss/distill", "loss"), ("select/selected", "selected"), ("select/budget", "budget"),
                     ("cost/scored_tokens", "scored_tokens"), ("cost/teacher_forward_s", "teacher_forward_s")):  # fmt: skip
        assert [s for s, _ in tb[tag]] == [0, 1, 2], tag
        assert [v for _, v in tb[tag]] == pytest.approx([float(r[key]) for r in rows], rel=1e-6), tag  # float32 events
    assert "cost/teacher_rows_crop" in tb and "select/prompt_coverage" in tb
    from mlflow.tracking import MlflowClient

    state = json.loads((out / "trackers.json").read_text())
    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    history = client.get_metric_history(state["mlflow"], "loss/distill")
    assert [m.step for m in history] == [0, 1, 2]
    assert [m.value for m in history] == pytest.approx([r["loss"] for r in rows], rel=1e-12)
    params = client.get_run(state["mlflow"]).data.params
    assert params["policy"] == "learned" and params["rho"] == "0.25"  # the run's config
    # a resume continues the same MLflow run and appends to the same TensorBoard folder
    train.main(["--resume", str(out), "--steps", "5"])
    assert json.loads((out / "trackers.json").read_text())["mlflow"] == state["mlflow"]
    assert [m.step for m in client.get_metric_history(state["mlflow"], "loss/distill")] == [0, 1, 2, 3, 4]
    assert sorted({s for s, _ in tensorboard_scalars(out / "tb")["loss/distill"]}) == [0, 1, 2, 3, 4]


def test_wandb_offline_holds_the_ledgers_metrics(tmp_path, tiny, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "w"
    train.main(["--preset", "tiny", "--steps", "2", "--report-to", "wandb", "--method", "dapd", "--policy", "random", "--rho", "0.5",
                "--out", str(out)])  # fmt: skip
    rows = read_ledger(out / "ledger.jsonl")
    history = wandb_history(out)
    assert [h["_step"] for h in history] == [0, 1]
    assert [h["loss/distill"] for h in history] == pytest.approx([r["loss"] for r in rows], rel=1e-12)
    assert [h["dapd/kl_entangled_rollout"] for h in history] == pytest.approx([r["kl_entangled_rollout"] for r in rows])
    assert json.loads((out / "trackers.json").read_text())["wandb"]


def test_tracker_names_are_checked_in_one_line():
    assert parse_report_to("none") == [] and parse_report_to("") == []
    assert parse_report_to("tensorboard, tensorboard") == ["tensorboard"]
    with pytest.raises(UserError, match="unknown tracker tensorbord; choose from"):
        parse_report_to("tensorbord")
    with pytest.raises(UserError, match=r"aim not installed \(pip install aim"):
        parse_report_to("aim")
    with pytest.raises(UserError, match="unknown tracker"):
        train.main(["--preset", "tiny", "--report-to", "neptune", "--out", "/nonexistent/x"])


def test_metrics_namespaces_leave_out_what_is_not_a_number():
    row = {"step": 3, "loss": 0.5, "grad_norm": float("nan"), "selected": 4, "candidates": 16, "budget": 4,
           "candidate_prompts": 4, "selected_prompts": 2, "step_s": 1.5, "teacher_rows_crop": 4, "kl_x": 0.1,
           "skipped": False, "launch": {"world_size": 1}}  # fmt: skip
    got = metrics(row, "dapd", ["kl_x"])
    assert got == {"loss/distill": 0.5, "loss/skipped": 0.0, "select/selected": 4.0, "select/candidates": 16.0,
                   "select/budget": 4.0, "select/candidate_prompts": 4.0, "select/selected_prompts": 2.0,
                   "select/prompt_coverage": 0.5, "cost/step_s": 1.5, "cost/teacher_rows_crop": 4.0, "dapd/kl_x": 0.1}
