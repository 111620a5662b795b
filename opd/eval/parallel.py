"""eval.py over several processes (`torchrun --nproc_per_node N eval.py ...`, `accelerate launch eval.py ...`).

Every process loads the model and answers its own share of each benchmark's unanswered items (`Ranks.share`:
items r, r + N, r + 2N, ... of the list every process computes alike from the same files), writing its replies
to OUT/<key>/predictions.rank<r>.jsonl as they come. Rank 0 alone writes what the folder shares: settings.json,
the merge of the part files into predictions.jsonl (`opd.eval.evaluate.merge_parts`, in item order, after a
barrier), the digest cache, scored.jsonl, results.json and results.md. A stopped run leaves its part files;
the next run (with any number of processes) merges them first, so every process skips the same answered items.

Communication is torch.distributed over gloo (CPU tensors, also on GPU machines: only small Python objects
travel): `on_main` runs a step on rank 0 and hands its result, or its error, to every rank, so no rank waits
on a step that failed; torchrun stops the other processes when one exits with an error.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from opd.cli import UserError

TIMEOUT = datetime.timedelta(hours=6)
"""How long a process waits at a barrier for the others (a slow rank's share of a large benchmark)."""


@dataclass
class Ranks:
    """This process's place among the launched ones (rank 0 of 1 without a launcher)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    def share(self, items: list) -> list:
        """This rank's items: every world-th one from its rank on (equal shares within one item)."""
        return list(items[self.rank :: self.world])

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank (pickled)."""
        if self.world == 1:
            return obj

        box = [obj if self.main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def on_main(self, fn: Callable, *args, **kwargs):
        """fn(*args, **kwargs) on rank 0 only; its result on every rank. An exception there is raised on every
        rank: a UserError with its message (printed once, by rank 0), anything else as a RuntimeError naming it."""
        if self.world == 1:
            return fn(*args, **kwargs)
        outcome, error = None, None
        if self.main:
            try:
                outcome = ("ok", fn(*args, **kwargs))
            except UserError as exc:
                outcome, error = ("user", str(exc)), exc
            except BaseException as exc:  # noqa: BLE001 (re-raised below, after the others are told)
                outcome, error = ("error", f"{type(exc).__name__}: {exc}"), exc
        outcome = self.broadcast(outcome)
        if error is not None:
            raise error
        if outcome[0] == "user":
            raise UserError(outcome[1])
        if outcome[0] == "error":
            raise RuntimeError(f"rank 0 failed: {outcome[1]}")
        return outcome[1]

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank (pickled; a collective: every rank calls it)."""
        if self.world == 1:
            return [obj]

        box: list = [None] * self.world
        dist.all_gather_object(box, obj)
        return box

    def close(self, ok: bool = True) -> None:
        """Ends the group. `ok` (the run finished): once every rank got here (a rank that tears gloo down while
        another still writes can abort: seen under load), then destroyed. After an error (`ok` False) it is
        destroyed at once, without a barrier: the other ranks may be waiting in another collective, which a
        barrier would never match (a hang until TIMEOUT); this process exits and the launcher stops the rest."""
        if self.world > 1:
            if dist.is_initialized():
                try:
                    if ok:
                        dist.barrier()
                finally:
                    dist.destroy_process_group()


def init_ranks() -> Ranks:
    """Ranks from the launcher's environment (WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR/PORT); with more than
    one process a gloo process group is started (once)."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return Ranks()

    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=TIMEOUT)
    return Ranks(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0") or 0))


def visible_gpu(local_rank: int, environ=None) -> str:
    """The CUDA_VISIBLE_DEVICES of process `local_rank`'s own engine (one GPU per process): entry `local_rank` of
    the mask already set (CUDA_VISIBLE_DEVICES=4,5,6,7: local rank 1 gets 5), else the GPU numbered `local_rank`;
    a mask with fewer entries than the launched processes is a UserError naming it."""
    mask = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")
    if mask is None or not mask.strip():
        return str(local_rank)
    entries = [e.strip() for e in mask.split(",") if e.strip()]
    if local_rank >= len(entries):
        raise UserError(f"CUDA_VISIBLE_DEVICES={mask} lists {len(entries)} GPU(s), too few for local rank "
                        f"{local_rank}: launch at most {len(entries)} processes per machine, one GPU each", local=True)
    return entries[local_rank]


def rank_device(device: str, ranks: Ranks) -> str:
    """A process's device: a bare 'cuda' becomes cuda:<local rank> under a launcher (one GPU per process)."""
    return f"cuda:{ranks.local_rank}" if device == "cuda" and ranks.world > 1 else device
