"""A training run's --out folder: one run per folder, what a new run replaces, and what a resume must find again.

- The lock (`opd.run_folder`): rank 0 takes DIR/.lock before anything is read; every rank refuses alike when another
  run holds it. A failed start releases it and removes a folder it created (when nothing else is there).
- A new run refuses a folder that holds a run unless --overwrite; --overwrite sets the old run aside in
  DIR/.overwritten/ only once every input is built, and puts it back if the trackers then fail to start. Each move
  is one rename, so a kill anywhere in between is recoverable: the next run into the folder puts a set-aside run
  back before it looks at the folder (`recover`), and only a new run that has started deletes it.
- Identities: every frozen model a resumed run loads again from its path (external teachers, DAPD's base, a sharded
  run's --model) is recorded by its files' digest (`opd.models.identity`), and a resume whose model there has changed is
  refused by name. DIR/.digests.json caches the digests (kept by --overwrite: it describes files outside the run).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import sys
from pathlib import Path

import torch

from opd.builtin import is_builtin
from opd.cli import UserError
from opd.loop.settings import FolderConfig
from opd.models.identity import DigestCache, model_identity
from opd.run_folder import (DIGESTS, DROPPING, LOCK_NAME, OVERWRITING, OVERWRITTEN, LockedError, acquire, put_back, recover,
                             release, remove_path, run_evaluations, run_files)


def eval_command(out: Path, eval_data: str | None, data: str | None) -> str:
    """The eval.py command that scores the run in `out` (printed as the run ends): with the run's --eval-data, else
    the built-in benchmark of its built-in --data ('toy'; none or 'tiny': the tiny one), else a placeholder DIR (a
    folder with one sub-folder per benchmark, docs/EVAL.md). The interpreter is this one (the venv's), relative to
    the current folder when it lies below it."""
    bench = eval_data or ((data or "tiny") if data is None or is_builtin(data, "bench") else "DIR")
    python, script = Path(sys.executable), Path(__file__).resolve().parents[2] / "eval.py"
    here = [_below_cwd(p) for p in (python, script if script.is_file() else Path("eval.py"))]
    return shlex.join([*here, "--model", str(out), "--data-dir", bench]) + (
        " (DIR: a folder with one sub-folder per benchmark, docs/EVAL.md)" if bench == "DIR" else "")


def _below_cwd(path: Path) -> str:
    """`path` relative to the current folder when it lies below it."""
    with contextlib.suppress(ValueError):
        return str(path.relative_to(Path.cwd()))
    return str(path)


def launch_info(world: int) -> dict:
    """What ran: the number of processes, the launcher and this process's command line."""
    env = os.environ
    launcher = ("accelerate" if any(k.startswith("ACCELERATE_") for k in env)
                else "torchrun" if "TORCHELASTIC_RUN_ID" in env else "python")  # fmt: skip
    return {"world_size": world, "launcher": launcher, "command": shlex.join([Path(sys.executable).name, *sys.argv])}


class RunFolder:
    """One run's --out folder, the same object on every rank (rank 0 alone writes)."""

    def __init__(self, accelerator, cfg: FolderConfig):
        self.acc, self.cfg, self.out = accelerator, cfg, Path(cfg.out)
        self.main = accelerator.is_main_process
        self.created = not self.out.exists()
        self.lock()  # one run per folder: a second process is refused before it reads anything
        self.digests = DigestCache(self.out / DIGESTS)
        self.identities: dict[str, str] = {}  # what each frozen model loaded was (its files' digest), by role
        self.stored_identities: dict[str, str] = {}

    def lock(self) -> None:
        """Rank 0 takes --out's lock (`opd.run_folder`); every rank refuses alike when another run holds it."""
        error = ""
        if self.main:
            try:
                acquire(self.out)
                recover(self.out)  # a kill's leftover of an --overwrite, before anyone looks at the folder
            except LockedError as exc:
                error = f"{exc}: wait for it to finish, or give another --out"
            except OSError as exc:  # not a folder, not writable
                error = f"{self.out}: cannot hold a run ({exc.strerror or exc}); give another --out"
        held = self.acc.reduce(torch.tensor([int(bool(error))], device=self.acc.device), "sum")
        if int(held.item()):
            raise UserError(f"--out {error or self.out}" + ("" if error else ": refused on rank 0"))

    def release(self, failed: bool = False) -> None:
        """Releases the lock; after a failed start, a folder this run created is removed (when nothing else is
        there), so a failed start leaves no folder behind."""
        release(self.out)
        if failed and self.created and self.main:
            for name in (LOCK_NAME, DIGESTS):
                (self.out / name).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                self.out.rmdir()  # only if nothing else is there

    def existing_run(self) -> list[Path]:
        """A new run refuses a folder that holds a run, unless --overwrite; returns what it would replace: the run's
        files and eval.py's default evaluations of it (`opd.run_folder.run_evaluations`: they score the old
        weights)."""
        found = [] if self.cfg.resume else run_files(self.out)
        if found and not self.cfg.overwrite:
            names = ", ".join(p.name for p in found[:4]) + (", ..." if len(found) > 4 else "")
            if not (self.out / "latest").is_file():  # stopped (Ctrl-C, a kill) before its first checkpoint
                raise UserError(f"--out {self.out} holds a run that stopped before its first checkpoint ({names}): "
                                "nothing can be resumed; start over with the same command and --overwrite, which "
                                "deletes it")  # fmt: skip
            raise UserError(
                f"--out {self.out} holds a run ({names}): continue it with --resume {self.out}, "
                "or start over with --overwrite, which deletes it"
            )
        return found + run_evaluations(self.out) if found else found

    def set_aside(self, found: list[Path]) -> Path | None:
        """--overwrite: rank 0 moves the old run's files into DIR/.overwriting/, then renames it DIR/.overwritten/, once
        every rank has built everything; `drop` deletes it once the trackers have started, `restore` puts it back if
        they fail (and `recover`, after a kill, at the next start). Returns the folder on rank 0 (None elsewhere, and
        when there is nothing to replace)."""
        self.acc.wait_for_everyone()
        aside = None
        if found and self.main:
            moving, aside = self.out / OVERWRITING, self.out / OVERWRITTEN
            moving.mkdir()
            for path in found:
                path.rename(moving / path.name)
            moving.rename(aside)  # one rename: every file of the old run is aside, none of the new run's is
        self.acc.wait_for_everyone()
        return aside

    def restore(self, aside: Path | None) -> None:
        """The old run's files back in place (rank 0), after a failed start (replacing what it had begun to write)."""
        if aside is not None:
            put_back(self.out)

    def clear(self) -> None:
        """Removes this run's files (rank 0): a run that wrote no checkpoint cannot be resumed, so its folder goes
        back to holding no run."""
        if self.main:
            for path in run_files(self.out):
                remove_path(path)

    @staticmethod
    def drop(aside: Path | None) -> None:
        """Deletes the set-aside old run: renamed first, so that a kill midway leaves no partial run to put back."""
        if aside is not None:
            dropping = aside.with_name(DROPPING)
            aside.rename(dropping)
            shutil.rmtree(dropping)

    def identify(self, path: str, role: str) -> str:
        """Records the identity (`opd.models.identity.model_identity`: its files' digest, or a hub id) of a model that a
        resumed run loads again from its path, and refuses a resume whose model there has changed since the run
        started. Returns `path`."""
        found = model_identity(path, self.digests)
        ident = found["model"] + (f"@{found['model_revision']}" if found["model_revision"] else "")  # a hub commit too
        before = self.stored_identities.get(role)
        if before is not None and before not in (ident, found["model"]):  # (checkpoints before 12/2026: no commit)
            raise UserError(
                f"--resume {self.cfg.resume}: {role} {path} is not the model the run started with ({before[:19]}... "
                f"then, {ident[:19]}... now): a resumed run needs the same weights; restore them or start a new run"
            )
        self.identities[role] = ident
        return path

    def identify_data(self, path: str) -> None:
        """Records the identity of the training data (its file's or folder's digest, or a hub id) and refuses a resume
        whose data changed since the run started, unless --allow-data-change. The images a JSONL names are not
        hashed: the file itself (its problems, answers, crops and image paths) is."""
        target = Path(path)
        if target.is_file():
            ident = "sha256:" + self.digests.file(target)
        elif target.is_dir():
            ident = "sha256:" + self.digests.folder(target)
        else:
            ident = f"hf:{path}"
        before = self.stored_identities.get("--data")
        if before is not None and before != ident and not self.cfg.allow_data_change:
            raise UserError(
                f"--resume {self.cfg.resume}: --data {path} changed since the run started ({before[:19]}... then, "
                f"{ident[:19]}... now): a resumed run trains on its own data; restore it, start a new run, or give "
                "--allow-data-change to continue on the changed data (the result will differ from an uninterrupted run)"
            )
        self.identities["--data"] = ident

    def note_resume(self, ckpt: Path, state: dict) -> None:
        """The line a resumed run starts with (rank 0): its checkpoint and the step it continues at; and one more
        when it resumes on another number of processes (rollouts are seeded per rank)."""
        if self.main:
            print(f"train.py: resuming from {ckpt.name} (step {int(state['step'])}) in {self.out}", flush=True)
        before = state.get("world_size")
        if before is not None and before != self.acc.num_processes and self.main:
            print(f"train.py: note: {ckpt} was trained on {before} process(es) and resumes on {self.acc.num_processes}: "
                  "rollouts are seeded per rank, so the result will differ from a run on one number of processes",
                  file=sys.stderr, flush=True)  # fmt: skip
