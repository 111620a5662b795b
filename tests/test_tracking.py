"""Experiment trackers through accelerate (opd/loop/tracking.py): what train.py --report-to writes, read back with each
tracker's own reader (TensorBoard's event files, MLflow's client on the SQLite store the run printed, under MLflow's
defaults, W&B's offline transaction log parsed with its own protobuf records), not a mock; a resume continues the
same tracker run."""

import json

import pytest
from tracker_readers import mlflow_client, tensorboard_scalars, wandb_history  # noqa: E402 (tests/ on the path)

import train
from opd.cli import UserError
from opd.loop.ledger import read_ledger
from opd.loop.settings import parse_report_to
from opd.loop.tracking import metrics


def test_tensorboard_and_mlflow_hold_the_ledgers_metrics_in_their_namespaces(tmp_path, tiny, monkeypatch, capsys):
    """MLflow's store is read back as the run printed it, with MLflow's defaults (no MLFLOW_ALLOW_FILE_STORE: MLflow 3
    refuses its file store without it, the store this wrote before)."""
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    out = tmp_path / "t"
    train.main(["--preset", "tiny", "--steps", "3", "--report-to", "tensorboard,mlflow", "--out", str(out)])
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # MLflow's defaults for the reader
    client, uri = mlflow_client(capsys.readouterr().out)
    assert uri == f"sqlite:///{(out / 'mlflow.db').resolve()}"
    rows = read_ledger(out / "ledger.jsonl")
    tb = tensorboard_scalars(out / "tb")
    for tag, key in (("loss/distill", "loss"), ("select/selected", "selected"), ("select/budget", "budget"),
                     ("cost/scored_tokens", "scored_tokens"), ("cost/teacher_forward_s", "teacher_forward_s")):  # fmt: skip
        assert [s for s, _ in tb[tag]] == [0, 1, 2], tag
        assert [v for _, v in tb[tag]] == pytest.approx([float(r[key]) for r in rows], rel=1e-6), tag  # float32 events
    assert "cost/teacher_rows_crop" in tb and "select/prompt_coverage" in tb
    state = json.loads((out / "trackers.json").read_text())
    assert state["mlflow_uri"] == uri
    history = client.get_metric_history(state["mlflow"], "loss/distill")
    assert [m.step for m in history] == [0, 1, 2]
    assert [m.value for m in history] == pytest.approx([r["loss"] for r in rows], rel=1e-12)
    params = client.get_run(state["mlflow"]).data.params
    assert params["policy"] == "learned" and params["rho"] == "0.25"  # the run's config
    # a resume continues the same MLflow run and appends to the same TensorBoard folder
    train.main(["--resume", str(out), "--steps", "5"])
    assert json.loads((out / "trackers.json").read_text())["mlflow"] == state["mlflow"]
    assert not (out / "mlruns").exists()  # the SQLite store alone
    assert [m.step for m in client.get_metric_history(state["mlflow"], "loss/distill")] == [0, 1, 2, 3, 4]
    assert sorted({s for s, _ in tensorboard_scalars(out / "tb")["loss/distill"]}) == [0, 1, 2, 3, 4]


@pytest.mark.slow  # an end-to-end run (train, resume or export): -m slow
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


def test_mlflow_without_its_sqlite_packages_is_one_line(monkeypatch):
    """mlflow-skinny alone cannot open the SQLite store: refused before the run, naming what to install."""
    import importlib.util

    pytest.importorskip("mlflow")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "alembic" else real(name, *a))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(UserError, match=r"needs alembic \(pip install -r requirements-trackers.txt"):
        parse_report_to("tensorboard,mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")  # a store of the user's own: not needed
    assert parse_report_to("mlflow") == ["mlflow"]


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
    # --eval-before's scores (the first row's `eval_before`) under eval/before/, apart from the after-step-0 scores;
    # a ledger written before the '_crop' names keeps '@crop', mapped once by metric_name
    row0 = {"step": 0, "eval/zoombench": 60.0, "eval_s": 2.0,
            "eval_before": {"eval/zoombench": 40.0, "eval/zoombench@crop": 90.0, "eval_s": 3.0, "note": "x"}}  # fmt: skip
    assert metrics(row0) == {"loss/skipped": 0.0, "eval/zoombench": 60.0, "cost/eval_s": 2.0,
                             "eval/before/zoombench": 40.0, "eval/before/zoombench_crop": 90.0,
                             "cost/eval_before_s": 3.0}  # fmt: skip
