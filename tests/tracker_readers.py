"""Each tracker's own files read back with its own reader (TensorBoard's event files; MLflow's client on the store
the run printed, under MLflow's defaults; W&B's offline transaction log parsed with its own protobuf records), for
the tracker tests."""

import glob
import json
import os
import re
import shlex
from pathlib import Path


def mlflow_client(printed: str):
    """MLflow's client on the store whose read-back command the run printed (`MLFLOW_TRACKING_URI=URI .venv/bin/python
    -c ...`, `opd.loop.tracking.MLFLOW_READ`), under MLflow's defaults: the command must need no other environment (no
    MLFLOW_ALLOW_FILE_STORE=true: MLflow 3 refuses its file store by default), and the client runs without
    MLFLOW_ALLOW_FILE_STORE or MLFLOW_TRACKING_URI set (the caller's monkeypatch has removed them)."""
    from mlflow.tracking import MlflowClient

    line = next(line for line in printed.splitlines() if "MLflow runs in" in line)
    found = re.search(r"read them back: (.*)\)$", line)
    assert found, f"the run prints no command that reads MLflow's store back: {line}"
    words = shlex.split(found.group(1))
    assert words[0].startswith("MLFLOW_TRACKING_URI=") and words[2] == "-c", line  # the URI, no other environment
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ and "MLFLOW_TRACKING_URI" not in os.environ
    uri = words[0].split("=", 1)[1]
    return MlflowClient(tracking_uri=uri), uri


def mlflow_history(out: Path, key: str) -> list[tuple[int, float]]:
    """(step, value) of metric `key` in the MLflow run of the run folder `out`: its run id and store from
    DIR/trackers.json (SQLite DIR/mlflow.db unless MLFLOW_TRACKING_URI named another), read by MLflow's client."""
    from mlflow.tracking import MlflowClient

    state = json.loads((Path(out) / "trackers.json").read_text())
    client = MlflowClient(tracking_uri=state["mlflow_uri"])
    return [(m.step, m.value) for m in client.get_metric_history(state["mlflow"], key)]


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_records(folder: Path) -> list:
    """The records of a W&B offline run: its .wandb transaction log (a 7-byte ':W&B' header, then LevelDB log blocks
    of 32 KiB holding W&B's own protobuf `Record`s), parsed with wandb's protobuf module."""
    import struct

    import wandb
    from wandb.proto import wandb_internal_pb2 as pb

    wandb.teardown()  # W&B's service may still be writing the log after run.finish() returns: wait for it to close
    data = Path(glob.glob(str(folder / "wandb" / "offline-run-*" / "run-*.wandb"))[0]).read_bytes()
    pos, raw, part = 7, [], b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:
            raw.append(chunk)
        elif kind in (2, 3):
            part = chunk if kind == 2 else part + chunk
        elif kind == 4:
            raw.append(part + chunk)
    records = []
    for r in raw:
        rec = pb.Record()
        rec.ParseFromString(r)
        records.append(rec)
    assert records and records[-1].WhichOneof("record_type") == "exit", "the W&B log ends before its exit record"
    return records


def wandb_run_record(folder: Path):
    """The run record (project, entity, tags, group) of a W&B offline run."""
    return next(r.run for r in wandb_records(folder) if r.WhichOneof("record_type") == "run")


def wandb_history(folder: Path) -> list[dict]:
    """The history rows (metric name -> value) of a W&B offline run."""
    history = []
    for rec in wandb_records(folder):
        if rec.WhichOneof("record_type") == "history":
            history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    return history
