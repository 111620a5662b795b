"""One run per output folder: an exclusive lock on DIR/.lock while a run (or a resume) holds the folder.

The lock is an `fcntl.flock` on the file, which the operating system releases when the process ends,
however it ends (a SIGKILL included): a killed run never leaves its folder locked. The file itself stays
and holds the holder's pid and host, for the refusal message. Within one process the lock is re-entrant
(a test building a second `Run` on a folder it already holds); another process is refused at once.

Departure: `flock` is advisory and, on some network file systems, local to one machine; a multi-machine
run takes the lock on rank 0's machine only (the other ranks never claim the folder themselves).
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

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
