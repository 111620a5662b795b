"""Files that survive a stop: atomic files, appended JSON lines, a full disk as one line; JSONL read line by line.

Every file eval.py writes goes through here, and train.py's summaries and checkpoints (`opd.loop.checkpoint`) (`write_atomic`, `Appender`, `write_jsonl_atomic`), and so does
`opd.models.identity.DigestCache.save` and the export's folder (`opd.export`): a write that meets a full disk or a
quota (ENOSPC, EDQUOT) becomes one `DiskFullError` line naming the folder, the file and roughly the space it
needed, and leaves nothing half-written behind:

* an atomic write goes to a temporary sibling (`.NAME.*.tmp`), flushed to disk and renamed into place; on any
  failure the sibling is deleted, so the old file (if any) stays whole;
* an append that fails is cut back to the end of the last whole line (`os.ftruncate` needs no free space), so
  the file holds only complete rows and a rerun resumes after them.

Once there is room, the same command continues where it stopped (docs/EVAL.md, "Outputs and resuming").
The cache of what is built on first use (the built-in names' folders, embedded images): `cache_dir`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from opd.cli import UserError

FULL = tuple(getattr(errno, name) for name in ("ENOSPC", "EDQUOT") if hasattr(errno, name))
"""errno values of a full disk or an exhausted quota."""


class DiskFullError(UserError):
    """A write met a full disk or quota; the message names the folder, the file and the space it needed."""


def size_text(n: float) -> str:
    """1536 -> '1.5 KiB' (bytes, binary units)."""
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{int(n)} bytes" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _free(folder: Path) -> str:
    """The free space of the file system holding `folder` (or its nearest existing parent), in words."""
    for path in (folder, *folder.parents):
        with contextlib.suppress(OSError):
            return size_text(shutil.disk_usage(path).free)
    return "unknown"


AGAIN = "run the same command again: it continues where it stopped"


def disk_full(folder: str | Path, what: str, needed: int, then: str = AGAIN) -> DiskFullError:
    """The one-line error of a write of about `needed` bytes (`what`: the file or folder) into `folder`; `then`:
    how to go on once there is room."""
    folder = Path(folder)
    return DiskFullError(f"{folder}: no space left on the device writing {what} (about {size_text(needed)} needed, "
                         f"{_free(folder)} free); free some space (or raise the quota) and {then}", local=True)


FULL_TEXT = ("No space left on device", "Disk quota exceeded", "StorageFull", "QuotaExceeded")
"""How a full disk reads in errors that are no OSError (safetensors' SafetensorError wraps Rust's io::Error)."""


def is_full(exc: BaseException) -> bool:
    """Whether `exc` is a full disk or quota (an OSError's errno, or the text of a library's own error)."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return exc.errno in FULL
    return any(text in str(exc) for text in FULL_TEXT)


@contextlib.contextmanager
def room(folder: str | Path, what: str, needed: int) -> Iterator[None]:
    """Turns an error of a full disk or quota inside the block (`is_full`) into `disk_full`; others pass."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as exc:
        if is_full(exc):
            raise disk_full(folder, what, needed) from None
        raise


def write_all(fd: int, data: bytes) -> None:
    """All of `data` to the file descriptor (os.write may write less than asked)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Writes `data` to `path` through a temporary sibling, flushed to disk and renamed into place; the sibling
    is deleted on any failure (the old file stays whole), and a full disk is a `DiskFullError`."""
    path = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    with room(path.parent, path.name, len(raw)):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            try:
                write_all(fd, raw)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return path


def drop_temporaries(path: str | Path) -> None:
    """Deletes the temporary siblings a `write_atomic` of `path` killed before its rename left behind
    (`.NAME.*.tmp`, and an earlier version's `.NAME.tmp`). Only for a folder this process holds (a run's lock)."""
    path = Path(path)
    for tmp in path.parent.glob(f".{path.name}.*tmp"):
        tmp.unlink(missing_ok=True)


def json_line(row: dict) -> bytes:
    """One JSONL row as eval.py stores it (UTF-8, non-ASCII kept, unknown types as str)."""
    return (json.dumps(row, ensure_ascii=False, default=str) + "\n").encode("utf-8")


def write_jsonl_atomic(path: str | Path, rows: Iterable[dict]) -> Path:
    """The rows as a JSONL file, written atomically (`write_atomic`)."""
    return write_atomic(path, b"".join(json_line(row) for row in rows))


class Appender:
    """Appends whole JSON lines to a file, each written through to the OS at once (no buffer). A failed append
    is cut back to the end of the last whole line; a full disk is a `DiskFullError` asking for about
    `left` lines of this one's size."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with room(self.path.parent, self.path.name, 4096):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def add(self, row: dict, left: int = 1) -> None:
        """Appends `row` (`left`: rows still to come, this one included, for the space estimate)."""
        line = json_line(row)
        end = os.lseek(self.fd, 0, os.SEEK_END)
        with room(self.path.parent, self.path.name, len(line) * max(1, left)):
            try:
                write_all(self.fd, line)
            except BaseException:
                os.ftruncate(self.fd, end)  # no torn line: the file ends with its last whole row
                raise

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Appender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def append_jsonl(path: str | Path, rows: Iterable[dict]) -> None:
    """Appends the rows as JSON lines (`Appender`)."""
    rows = list(rows)
    with Appender(path) as out:
        for n, row in enumerate(rows):
            out.add(row, len(rows) - n)


def cache_dir() -> Path:
    """Where the built-in default lives: $BAS_OPD_CACHE, else ~/.cache/bas-opd."""
    return Path(os.environ.get("BAS_OPD_CACHE", Path.home() / ".cache" / "bas-opd"))


def jsonl_lines(path: Path, error) -> Iterator[tuple[int, str]]:
    """(line number from 1, text) of each non-blank line of a UTF-8 JSONL file, a byte-order mark at its start
    allowed; a line that is not UTF-8 raises `error(line number, message)` (the caller's error class and place).
    Read line by line (bounded memory); the training data's reader (`opd.data.sources`) and the benchmarks'
    (`opd.eval.bench_rows`)."""
    with Path(path).open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # a byte-order mark is no error
            except UnicodeDecodeError as e:
                raise error(lineno, f"not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1})") from None
            if line.strip():
                yield lineno, line
