"""Checkpoints: everything a run needs to continue to the same result, written atomically.

DIR/checkpoint-NNNNNN/ holds policy/ (`save_pretrained`, loadable by eval.py), teacher/ (the EMA teacher or DAPD's
snapshot; a frozen external teacher is reloaded from its path instead), state.pt (step, optimizer, selector, the
objective's state and the config; no global RNG state: draws are seeded from the run's seed and the step) and
train_config.json. It is written into a temporary folder and renamed into place; DIR/latest then names it. Older
checkpoints beyond `keep` are removed only after the new one is complete.

Sharded runs (`save_sharded`, `load_sharded`): checkpoint-NNNNNN/sharded/ is one torch.distributed.checkpoint of the
policy, the EMA teacher and the AdamW state; the last checkpoint is also exported in `save_pretrained` form. DCP
reshards on load, so another number of processes can resume it.
Details: docs/MODULES.md#opdloopcheckpoint.
"""

import contextlib
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                     set_state_dict)

from opd.models.lora import save_adapter
from opd.models.sharding import export_pretrained
from opd.run_folder import find_latest
from opd.storage import disk_full, is_full, write_atomic


WRITE_FAILED = ("PytorchStreamWriter failed", "unexpected pos", "file write failed")
"""How torch.save reports a write that the disk refused (its C++ writer's RuntimeError carries no errno)."""


def folder_bytes(folder: Path) -> int:
    """The bytes of the files below `folder` (0 when it is missing)."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


@contextlib.contextmanager
def written_whole(out_dir: Path, tmp: Path, name: str):
    """A checkpoint's temporary folder either completes or is removed: on any failure `tmp` is deleted, and a full
    disk or quota (`opd.storage.is_full`, or torch.save's failed writer) is one `DiskFullError` line naming the
    folder, the checkpoint and about the space it needs (the last checkpoint's size, else what was written)."""
    try:
        yield
    except BaseException as exc:
        written = folder_bytes(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, Exception) and (is_full(exc) or any(t in str(exc) for t in WRITE_FAILED)):
            before = find_latest(out_dir)
            then = (f"continue with --resume {out_dir} (from {before.name})" if before is not None else
                    "run the same command again (no checkpoint was written: the run starts over)")  # fmt: skip
            raise disk_full(out_dir, name, max(written, folder_bytes(before) if before else 0), then) from None
        raise


def save_checkpoint(out_dir: str | Path, step: int, model, processor, teacher, state: dict, keep: int = 1,
                    adapters: dict | None = None) -> Path:  # fmt: skip
    """Writes checkpoint-{step} (step = the next step to run) and points DIR/latest at it. `adapters` (LoRA,
    `opd.models.lora`): {"policy": adapter, "teacher": adapter or None}: policy/ and teacher/ hold those adapters of
    `model` instead of whole models. A failed write leaves no temporary folder (`written_whole`)."""
    out_dir = Path(out_dir)
    final = out_dir / f"checkpoint-{step:06d}"
    tmp = out_dir / f".checkpoint-{step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with written_whole(out_dir, tmp, final.name):
        _write_checkpoint(tmp, model, processor, teacher, state, step, adapters)
    return _publish(out_dir, tmp, final, state, keep)


def _write_checkpoint(tmp: Path, model, processor, teacher, state: dict, step: int, adapters: dict | None) -> None:
    if adapters is not None:
        save_adapter(model, adapters["policy"], tmp / "policy")
        if adapters.get("teacher"):
            save_adapter(model, adapters["teacher"], tmp / "teacher")
    else:
        model.save_pretrained(tmp / "policy")
    processor.save_pretrained(tmp / "policy")
    if teacher is not None:  # None: a frozen external teacher, reloaded from its own checkpoint on resume
        teacher.save_pretrained(tmp / "teacher")
    torch.save({**state, "step": step}, tmp / "state.pt")
    if "config" in state:
        (tmp / "train_config.json").write_text(json.dumps(state["config"], indent=2) + "\n")


def _sync_tree(folder: Path) -> None:
    """fsync of every file below `folder` and of the folders themselves: on disk before the rename publishes it."""
    for path in sorted(folder.rglob("*"), key=lambda p: -len(p.parts)) + [folder]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _publish(out_dir: Path, tmp: Path, final: Path, state: dict, keep: int) -> Path:
    """Writes train_config.json, flushes the complete temporary folder to disk and renames it into place, points
    DIR/latest at it and removes checkpoints beyond `keep`. A folder already named `final` (a resume from an
    earlier checkpoint writes that step again) is renamed aside first and deleted only once `latest` names the
    new one."""
    _sync_tree(tmp)
    replaced = final.with_name(f".{final.name}.old")
    shutil.rmtree(replaced, ignore_errors=True)
    if final.exists():
        final.rename(replaced)
    tmp.rename(final)
    if "config" in state:  # the run's settings beside its checkpoints too: `train.py --config DIR/train_config.json`
        write_atomic(out_dir / "train_config.json", json.dumps(state["config"], indent=2) + "\n")
    write_atomic(out_dir / "latest", final.name + "\n")
    shutil.rmtree(replaced, ignore_errors=True)
    prune(out_dir, keep)
    return final


def prune(out_dir: Path, keep: int) -> None:
    """Keeps the `keep` newest checkpoints, the one DIR/latest names among them; removes the rest and a kill's
    leftovers (`.checkpoint-*.tmp`, `.checkpoint-*.old`). Run after every save and when a run resumes (a kill
    between `latest` and the pruning left an old checkpoint beside the new one)."""
    out_dir = Path(out_dir)
    final = find_latest(out_dir)
    if final is None:
        return
    old = sorted(p for p in out_dir.glob("checkpoint-*") if p.is_dir() and p != final)
    for p in old[: max(0, len(old) - (keep - 1))]:
        shutil.rmtree(p, ignore_errors=True)
    for p in out_dir.glob(".checkpoint-*"):
        shutil.rmtree(p, ignore_errors=True)


def _sharded_state(model, teacher, optimizer) -> dict:
    """The DCP state of a sharded run: {policy, teacher, optimizer}, each rank's shards (DTensors)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"policy": model_sd, "optimizer": optim_sd}
    if teacher is not None:  # None: a frozen external teacher (not saved)
        state["teacher"] = get_model_state_dict(teacher)
    return state


def save_sharded(out_dir: str | Path, step: int, model, teacher, optimizer, state: dict, keep: int = 1,
                 processor=None, adapters: dict | None = None) -> Path:
    """Every rank: checkpoint-{step} with sharded/ (DCP: model, teacher, AdamW), state.pt and
    train_config.json written by rank 0; with `processor` also the policy/ and teacher/ export. Renamed into
    place by rank 0 once every rank has written; returns the final folder."""
    out_dir = Path(out_dir)
    final = out_dir / f"checkpoint-{step:06d}"
    tmp = out_dir / f".checkpoint-{step:06d}.tmp"
    main = dist.get_rank() == 0
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    with written_whole(out_dir, tmp, final.name):
        dcp.save(_sharded_state(model, teacher, optimizer), checkpoint_id=tmp / "sharded")
        if processor is not None:
            _export_sharded(tmp, model, teacher, processor, adapters)
        if main:
            torch.save({**state, "step": step}, tmp / "state.pt")
            if "config" in state:
                (tmp / "train_config.json").write_text(json.dumps(state["config"], indent=2) + "\n")
    if main:
        _publish(out_dir, tmp, final, state, keep)
    dist.barrier()
    return final


def _export_sharded(tmp: Path, model, teacher, processor, adapters: dict | None) -> None:
    """The last sharded checkpoint's policy/ and teacher/ exports (LoRA: the adapters; the teacher's is an adapter
    of the model)."""
    if adapters is not None:
        export_pretrained(model, tmp / "policy", processor, adapters["policy"])
        if adapters.get("teacher"):
            export_pretrained(model, tmp / "teacher", None, adapters["teacher"])
    else:
        export_pretrained(model, tmp / "policy", processor)
        if teacher is not None:
            export_pretrained(teacher, tmp / "teacher")


def load_sharded(ckpt: str | Path, model, teacher, optimizer) -> None:
    """Restores a `save_sharded` checkpoint into a sharded model, teacher and optimizer (every rank reads
    its own shards; the world size may differ from the one that wrote it)."""
    path = Path(ckpt) / "sharded"
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{ckpt} has no sharded checkpoint ({path}/.metadata): was it written with --fsdp?")
    sd = _sharded_state(model, teacher, optimizer)
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=sd["policy"], optim_state_dict=sd["optimizer"])
    if teacher is not None:
        set_model_state_dict(teacher, sd["teacher"])


def load_state(ckpt: Path) -> dict:
    return torch.load(Path(ckpt) / "state.pt", map_location="cpu", weights_only=False)
