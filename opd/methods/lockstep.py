"""The micro-batches of several ranks or shards in lockstep (`lockstep`), the run's schedule past one process.

One process runs its micro-batches one after another (`opd.methods.objective.one_process`). Distributed, every rank
must run the same collectives in the same order, also with nothing to do. DDP: a rank syncs only its last
micro-batch's backward, and one with none runs `dummy_backward`. FSDP2: every rank runs as many micro-batches per group
as the busiest rank (one all-gather of the counts), the missing ones zero-weighted padding, their teacher forwards
uncounted. The family's objectives run it on one process too. Details: docs/MODULES.md#opdmethodslockstep.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from opd.models.chat import micro_batch_inputs
from opd.methods.interface import TeacherCost
from opd.models.ema_teacher import Stopwatch
from opd.models.sharding import reshard


def slot_counts(accelerator, sharded: bool, plans: dict[str, list]) -> dict[str, int]:
    """Micro-batches per group: this rank's; sharded, the busiest rank's (one all-gather, run by every rank)."""
    counts = {g: len(p) for g, p in plans.items()}
    if sharded and plans:
        gathered = accelerator.gather(torch.tensor([list(counts.values())], device=accelerator.device))  # (world, G)
        counts = dict(zip(counts, gathered.max(0).values.tolist()))
    return counts


def slots(accelerator, sharded: bool, plans: dict[str, list], sync: bool = True) -> Iterator[tuple[str, object, bool]]:
    """Lockstep order of this rank's micro-batches: (group, item or None for padding, sync), groups in the plans' order;
    `sync` True for the last real micro-batch when the caller syncs (DDP's all-reduce), never for padding."""
    counts = slot_counts(accelerator, sharded, plans)
    real = [(g, j) for g, p in plans.items() for j in range(len(p))]
    last = real[-1] if real else None
    for g, plan in plans.items():
        for j in range(counts[g]):
            item = plan[j] if j < len(plan) else None
            yield g, item, sync and (g, j) == last


@dataclass
class MicroBatch:
    """One slot of `lockstep` with the padding rules: a real slot holds `item` (local row ids, or a job) of `group`; a
    padding slot (sharded: fewer micro-batches here than on the busiest rank) runs the same forwards and backward on
    row 0, zero-weighted, its teacher forwards uncounted, booking and labelling nothing (`real` False)."""
    group: str
    item: object
    sync: bool  # this slot's last backward syncs DDP's gradients (never padding: sharded runs sync every one)
    accelerator: object
    student: object
    release: tuple = ()  # models whose gathered parameters `backward` frees first (the teachers, sharded)

    @property
    def real(self) -> bool:
        return self.item is not None

    @property
    def rows(self) -> torch.Tensor:
        """Local row ids: the item's, or row 0 for padding."""
        return torch.tensor([0]) if self.item is None else self.item

    def weight(self, w: torch.Tensor) -> torch.Tensor:
        """`w` on a real slot, zeros on padding."""
        return w if self.real else torch.zeros_like(w)

    def teacher(self, teacher):
        """The context of a teacher forward: counted (`Teacher.rows_scored`) on a real slot only."""
        return uncounted(teacher) if not self.real else nullcontext()

    def synced(self, last: bool = True):
        """Forward-and-backward context: syncs DDP's gradients on the slot's (`last`: objective's) final backward."""
        return synced(self.accelerator, self.student, (self.sync and last) or not self.real)

    def free(self) -> None:
        """Frees the teachers' gathered parameters (sharded; a no-op otherwise)."""
        for model in self.release:
            reshard(model)

    def backward(self, loss: torch.Tensor, free: bool = True) -> None:
        """The student's backward, the teachers freed first (free=False: the objective calls `free` itself, later)."""
        if free:
            self.free()
        self.accelerator.backward(loss)


def lockstep(ctx, batch, plans: dict[str, list], sync: bool = True, release=()) -> Iterator[MicroBatch]:
    """`plans` ({group: [items]}, same group order on every rank) as `MicroBatch`es in lockstep: sharded, as many per
    group as the busiest rank; unsharded, a rank with none runs `dummy_backward` if `sync` (else a later pass syncs).
    `ctx` an `ObjectiveContext`, `batch` the `StepBatch`; `release` the teachers, resharded (sharded) before each
    backward and at the end."""
    acc, student = ctx.accelerator, ctx.student
    release = tuple(release) if ctx.sharded else ()  # unsharded: nothing gathered, nothing to free
    ran = False
    try:
        for group, item, last in slots(acc, ctx.sharded, plans, sync):
            ran = ran or item is not None
            yield MicroBatch(group, item, last, acc, student, release)
        if not ran and sync and not ctx.sharded:
            dummy_backward(ctx, batch)
    finally:
        for model in release:
            reshard(model)


@contextmanager
def uncounted(teacher):
    """Forwards inside are not counted in `teacher.rows_scored` (a sharded rank's zero-weighted padding)."""
    teacher.counting = False
    try:
        yield
    finally:
        teacher.counting = True


def dummy_backward(ctx, batch) -> None:
    """A zero-weighted forward and backward on this rank's row 0, so that it joins DDP's gradient all-reduce."""
    ro = batch.rollouts
    prompt = batch.student_prompts[int(ro.prompt_index[0])]
    inputs, _, _ = micro_batch_inputs([prompt], ro, torch.tensor([0]), ctx.ids["pad"], ctx.device)
    with ctx.autocast():
        dummy = ctx.student(**inputs, logits_to_keep=1, use_cache=False).logits.float().sum() * 0.0
    ctx.accelerator.backward(dummy)


def synced(accelerator, student, sync: bool):
    """DDP's `no_sync` context unless this forward and backward syncs the step's gradients (FSDP2: a null context)."""
    return nullcontext() if sync else accelerator.no_sync(student)


@contextmanager
def timed(cost: TeacherCost | None, device):
    """Adds the seconds of the block's device work to `cost.seconds` (None: not booked)."""
    watch = Stopwatch(device)
    try:
        yield
    finally:
        if cost is not None:
            cost.seconds += watch.seconds()
