"""A training run's folder on disk, for everything that reads or writes one (training, evaluation, export, the engine).

- Its layout: what a run writes (`RUN_FILES`, `RUN_PREFIXES`), eval.py's evaluations in it (`run_evaluations`),
  its checkpoints (`find_latest`, `find_checkpoint`, `checkpoint_of`), its stored settings (`load_config`), its
  exported policy (`policy_of`).
- Its lock: one run per folder, an `fcntl.flock` on DIR/.lock that the operating system releases when the process
  ends, however it ends (a SIGKILL included); the file keeps the holder's pid and host for the refusal. Re-entrant
  within one process; another process is refused at once. Departure: `flock` is advisory and, on some network file
  systems, local to one machine; a multi-machine run takes the lock on rank 0's machine only.
- What an interrupted --overwrite left (`recover`, `put_back`): the old run it had set aside goes back.
Torch-free, below every layer that uses it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import socket
import sys
from pathlib import Path

from opd.cli import UserError

LOCK_NAME = ".lock"
_held: dict[str, tuple[int, int]] = {}  # resolved folder -> (file descriptor, holders in this process)


class LockedError(RuntimeError):
    """The folder is held by another process; the message names it."""


def acquire(folder: str | Path) -> Path:
    """Takes the folder's lock (creating the folder), or raises LockedError naming the holder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    key = str(folder.resolve())
    if key in _held:
        fd, count = _held[key]
        _held[key] = (fd, count + 1)
        return folder / LOCK_NAME
    path = folder / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 200).decode("utf-8", "replace").strip() or "another process"
        os.close(fd)
        raise LockedError(f"{folder} is in use by another run ({holder})") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
    _held[key] = (fd, 1)
    return path


def release(folder: str | Path) -> None:
    """Gives one hold of the folder's lock back; the last one unlocks it (a folder not held: nothing)."""
    key = str(Path(folder).resolve())
    if key not in _held:
        return
    fd, count = _held.pop(key)
    if count > 1:
        _held[key] = (fd, count - 1)
        return
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


VLLM_PUSH = ".vllm-push"
"""DIR/.vllm-push/: a sharded run's gathered weights for the vLLM engine (`opd.engine.vllm_server`), removed at the
end."""
OVERWRITTEN = ".overwritten"
"""DIR/.overwritten/: an --overwrite's old run, set aside until the new one has started its trackers."""
OVERWRITING = ".overwriting"
"""DIR/.overwriting/: the old run's files while they move aside (renamed .overwritten once all are there)."""
RESTORING = ".restoring"
"""DIR/.restoring/: the old run's files while they move back (after the new run's own were deleted)."""
DROPPING = ".overwritten.drop"
"""DIR/.overwritten.drop/: the old run being deleted, once the new one has started (a kill's leftover is deleted)."""
ASIDE = (OVERWRITTEN, OVERWRITING, RESTORING, DROPPING)
RUN_FILES = ("ledger.jsonl", "summary.json", "summary.md", "latest", "train_config.json", "tb", "mlruns", "wandb",
             "trackers.json", *ASIDE, VLLM_PUSH)  # fmt: skip
"""What a training run writes into its --out folder, besides checkpoint-NNNNNN/ (and a kill's leftovers: temporary
siblings of the checkpoints and of the summaries, RUN_PREFIXES)."""
RUN_PREFIXES = ("checkpoint-", ".checkpoint-", ".summary.", ".ledger.", ".latest.", ".train_config.")
DIGESTS = ".digests.json"
"""DIR/.digests.json: the digest cache of the frozen models a run loads (`opd.models.identity.DigestCache`)."""


RUN_EVAL = "eval"
"""A train.py run's evaluations by eval.py without --out: RUN/eval, RUN/eval-<checkpoint>[-merged] (`opd.eval.config.default_out`).
They score the run's own weights, so an --overwrite of the run replaces them with it (`run_evaluations`)."""


RUN_EVAL_NAME = re.compile(rf"{RUN_EVAL}(-checkpoint-\d+(-merged)?)?")
"""The names `default_out` gives a run's evaluations, and only those: RUN/eval-mynotes is the user's."""


EVAL_MARKERS = (".lock", "results.json")
"""What eval.py leaves in every --out it ran in (its lock file, `opd.eval.lock`; its results): a folder with the
right name but neither was not written by eval.py."""


def run_evaluations(run: Path) -> list[Path]:
    """The evaluations eval.py wrote by default into the train.py run folder `run` (`opd.eval.config.default_out`): a folder with one
    of its names (`RUN_EVAL_NAME`) holding eval.py's lock file or results (`EVAL_MARKERS`)."""
    return sorted(p for p in run.iterdir() if p.is_dir() and RUN_EVAL_NAME.fullmatch(p.name)
                  and any((p / m).is_file() for m in EVAL_MARKERS))  # fmt: skip


def find_latest(out_dir: Path) -> Path | None:
    """The checkpoint DIR/latest names, when it is there."""
    latest = Path(out_dir) / "latest"
    if not latest.is_file():
        return None
    ckpt = Path(out_dir) / latest.read_text().strip()
    return ckpt if ckpt.is_dir() else None


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder from a run folder (via DIR/latest) or the checkpoint folder itself."""
    path = Path(path)
    if (path / "state.pt").is_file():
        return path
    latest = path / "latest"
    if latest.is_file():
        ckpt = path / latest.read_text().strip()
        if (ckpt / "state.pt").is_file():
            return ckpt
        raise FileNotFoundError(f"{latest} names {ckpt.name}, which is missing or incomplete")
    raise FileNotFoundError(f"no checkpoint in {path} (expected {path}/latest or {path}/state.pt)")


def run_files(out: Path) -> list[Path]:
    """The files and folders of a training run in `out` (none when it holds no run)."""
    if not out.is_dir():
        return []
    return sorted(p for p in out.iterdir() if p.name in RUN_FILES or p.name.startswith(RUN_PREFIXES))


def checkpoint_of(path: str) -> Path:
    """The checkpoint a --resume path names, or a UserError saying what is missing. A run an interrupted --overwrite
    had set aside is put back first (one process: under the folder's lock; several: named in the error)."""
    try:
        return find_checkpoint(path)
    except FileNotFoundError as exc:
        error = exc
    out = Path(path)
    if out.is_dir() and any((out / name).exists() for name in ASIDE):
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise UserError(f"--resume {path}: {error}; {path}/{OVERWRITTEN}/ holds the run an interrupted --overwrite "
                            "set aside: resume it once on one process, which puts it back") from None
        with contextlib.suppress(LockedError):  # a run is using it: its own --overwrite, live
            acquire(out)
            try:
                recover(out)
            finally:
                release(out)
            with contextlib.suppress(FileNotFoundError):
                return find_checkpoint(path)
    hint = ""
    if run_files(out):  # a run stopped before its first checkpoint
        hint = (f"; the run in {path} stopped before its first checkpoint, so nothing can be resumed: start over with "
                "the same command and --overwrite (which deletes it)")
    raise UserError(f"--resume {path}: {error}{hint}") from None


def remove_path(path: Path) -> None:
    """Deletes a file or a folder (a link: the link only)."""
    shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink(missing_ok=True)


def put_back(out: Path) -> bool:
    """Puts an old run set aside by --overwrite (`RunFolder.set_aside`) back in `out`, from wherever a failed start or
    a kill left it; True when there was one. From DIR/.overwritten/ (set aside whole; the new run may have begun to
    write its trackers' files): the new run's files are deleted, then it moves back through DIR/.restoring/; from
    .overwriting/ or .restoring/ (a kill midway): the files still there move back, over nothing of the new run's.
    DIR/.overwritten.drop/ (a kill while the old run was deleted, the new one started) is deleted."""
    if (out / DROPPING).exists():
        shutil.rmtree(out / DROPPING)
    whole = out / OVERWRITTEN
    if whole.is_dir():
        for path in run_files(out):
            if path.name not in ASIDE:
                remove_path(path)
        whole.rename(out / RESTORING)
    found = False
    for name in (OVERWRITING, RESTORING):
        if (out / name).is_dir():
            found = True
            for path in (out / name).iterdir():
                if (out / path.name).exists():  # (a file of the new run's set-aside run: not expected)
                    remove_path(out / path.name)
                path.rename(out / path.name)
            (out / name).rmdir()
    return found


def recover(out: Path) -> None:
    """What a kill left of an --overwrite in `out`, under the folder's lock (no run is using it): the old run it had
    set aside is put back (a note says so), so that the same command, --resume or --overwrite, meets it again."""
    if put_back(out):
        print(f"train.py: note: {out} held a run an interrupted --overwrite had set aside ({OVERWRITTEN}/): put back",
              file=sys.stderr, flush=True)  # fmt: skip


def policy_of(path: str, what: str) -> str:
    """What a model flag's value loads when it names a run: a `train.py` run folder or one of its checkpoint folders (a
    folder without config.json, holding `latest` or `state.pt`) its checkpoint's `policy/` export; any other folder
    (made a path, `~` expanded) or name (a hub id) unchanged. `what` names the flag in errors. Built-in names
    ('tiny', 'toy') are resolved before: `opd.builtin.model_source`."""
    folder = Path(path).expanduser()
    run_like = (folder / "latest").is_file() or (folder / "state.pt").is_file()
    if not folder.is_dir() or (folder / "config.json").is_file() or not run_like:
        return str(folder) if folder.exists() else path  # '~/x' quoted past the shell: the folder, not a hub id
    try:
        ckpt = find_checkpoint(folder)
    except FileNotFoundError as exc:
        raise UserError(f"{what}: {exc}") from None
    if not (ckpt / "policy").is_dir():
        if (ckpt / "sharded").is_dir():
            raise UserError(f"{what}: {ckpt} is a sharded (--fsdp) training checkpoint without an export; only a "
                            "run's last checkpoint holds policy/ (give the finished run)")
        raise UserError(f"{what}: {ckpt} holds no exported policy/")
    return str(ckpt / "policy")


def load_config(ckpt: Path) -> dict:
    """The run's settings stored with a checkpoint (train_config.json; state.pt for older checkpoints)."""
    path = Path(ckpt) / "train_config.json"
    if path.is_file():
        return json.loads(path.read_text())
    import torch  # torch-free module: only a checkpoint older than train_config.json needs it (state.pt)

    return torch.load(path.parent / "state.pt", map_location="cpu", weights_only=False).get("config", {})
