"""Each tracker's own files read back with its own reader (TensorBoard's event files; W&B's offline transaction log
parsed with its own protobuf records), for the tracker tests."""

import glob
import json
from pathlib import Path


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_records(folder: Path) -> list:
    """The records of a W&B offline run: its .wandb transaction log (a 7-byte ':W&B' header, then LevelDB log blocks
    of 32 KiB holding W&B's own protobuf `Record`s), parsed with wandb's protobuf module."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

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
