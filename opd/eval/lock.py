"""One eval.py run per --out folder: the folder's lock (`opd.run_folder`, train.py's) for the whole run.

Two runs into one --out would both skip the same answered items and append the same replies (every row
twice in predictions.jsonl). `holding` takes OUT/.lock before the run reads anything there and gives it back
when the run ends, however it ends; a second run is refused at once, in one line naming the folder and the
holder. Under a launcher rank 0 alone holds the lock (`opd.run_folder`'s departure: the other ranks never claim
the folder), and every rank refuses alike (`Ranks.on_main` hands rank 0's error to all of them).

A start that fails in a folder the run created (a model that does not load) leaves no folder behind: the lock
file is removed, then the folder if nothing else is in it, as train.py does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from opd import run_folder as runlock
from opd.cli import UserError
from opd.storage import disk_full, is_full


def take(out: Path) -> bool:
    """Locks `out` (creating it); True when this call created the folder. A held folder is a UserError."""
    created = not out.exists()
    try:
        runlock.acquire(out)
    except runlock.LockedError as exc:
        raise UserError(f"--out {exc}: wait for it to finish, or give another --out") from None
    except OSError as exc:  # not a folder, not writable, a full disk
        if is_full(exc):
            raise disk_full(out, runlock.LOCK_NAME, 4096) from None
        raise UserError(f"--out {out}: cannot hold an evaluation there ({exc.strerror or exc}); give another --out")
    return created


def _remove_if_only_lock(out: Path) -> None:
    """Deletes the lock file and then `out` itself when nothing else is in it (the lock still held meanwhile, so
    no other run can take the file being removed)."""
    with contextlib.suppress(OSError):
        if [p.name for p in out.iterdir()] == [runlock.LOCK_NAME]:
            (out / runlock.LOCK_NAME).unlink()
            out.rmdir()


@contextlib.contextmanager
def holding(out: Path, ranks) -> Iterator[None]:
    """The block runs with `out` locked by rank 0 (every rank calls it alike); released at its end."""
    created = ranks.on_main(take, Path(out))
    ok = False
    try:
        yield
        ok = True
    finally:
        if ranks.main:
            if created and not ok:
                _remove_if_only_lock(Path(out))
            runlock.release(out)
