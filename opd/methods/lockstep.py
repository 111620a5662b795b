"""One lockstep schedule of micro-batches for every objective, and the teacher-cost accounting.

Distributed, every rank must run the same collectives in the same order, also with nothing to do. DDP: a rank runs
its micro-batches unsynchronised but the last (whose backward all-reduces the gradients); a rank with none runs one
zero-weighted forward and backward (`dummy_backward`). FSDP2: every rank runs as many micro-batches per group as the
busiest rank (one all-gather of the counts), the missing ones zero-weighted padding on its row 0.

`lockstep` is that schedule, written once: it yields a `MicroBatch` per slot, which carries the padding rules and
the synchronisation (`synced`). `TeacherCost` and `record_forward` book each teacher forward (rows, tokens, padded
tokens, seconds) alike for every objective; `Stopwatch` times on the device.
Details: docs/MODULES.md#opdmethodslockstep.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from opd.models.chat import micro_batch_inputs
from opd.models.sharding import reshard


def cuda_sync(device: torch.device | str) -> None:
    """Waits for the device's queued work (CUDA only), so that host timers measure it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class Stopwatch:
    """Seconds of device work: the device is synchronised before the start and at each reading."""

    def __init__(self, device: torch.device | str):
        self.device = device
        cuda_sync(device)
        self.t0 = time.perf_counter()

    def seconds(self) -> float:
        cuda_sync(self.device)
        return time.perf_counter() - self.t0


@dataclass
class TeacherCost:
    """What one teacher label cost on this rank: forward rows, real and padded input tokens, seconds."""

    rows: int = 0
    tokens: int = 0
    padded_tokens: int = 0
    seconds: float = 0.0


def record_forward(cost: TeacherCost, inputs: dict, mask: torch.Tensor, prompt_tokens: int, seconds: float = 0.0) -> None:
    """Books one teacher forward: its rows, its real tokens (prompts + valid completion tokens), its input tokens
    with padding, and its seconds."""
    cost.rows += int(inputs["input_ids"].shape[0])
    cost.tokens += int(mask.sum()) + int(prompt_tokens)
    cost.padded_tokens += int(inputs["input_ids"].numel())
    cost.seconds += seconds


def plan_micro_batches(lengths: torch.Tensor, max_rows: int, max_tokens: int = 0) -> list[torch.Tensor]:
    """Groups rows by length: sorted longest first, filled greedily while rows <= max_rows and
    rows x longest <= max_tokens (a row longer than max_tokens goes alone). Returns index tensors."""
    order = torch.sort(lengths, descending=True, stable=True).indices.tolist()
    batches, current = [], []
    for i in order:
        longest = int(lengths[current[0]]) if current else int(lengths[i])
        if current and (len(current) == max_rows or (max_tokens and (len(current) + 1) * longest > max_tokens)):
            batches.append(torch.tensor(current))
            current = []
        current.append(i)
    if current:
        batches.append(torch.tensor(current))
    return batches


def slot_counts(accelerator, sharded: bool, plans: dict[str, list]) -> dict[str, int]:
    """Micro-batches per group on this rank: its own counts; sharded, the busiest rank's per group (one
    all-gather, run by every rank)."""
    counts = {g: len(p) for g, p in plans.items()}
    if sharded and plans:
        gathered = accelerator.gather(torch.tensor([list(counts.values())], device=accelerator.device))  # (world, G)
        counts = dict(zip(counts, gathered.max(0).values.tolist()))
    return counts


def slots(accelerator, sharded: bool, plans: dict[str, list], sync: bool = True) -> Iterator[tuple[str, object, bool]]:
    """The lockstep order of this rank's micro-batches: (group, item or None for padding, sync), groups in the
    plans' order (the same on every rank). `sync` is True for the last real micro-batch when the caller syncs
    (DDP: its backward all-reduces the step's gradients); never for padding (sharded runs sync every backward)."""
    counts = slot_counts(accelerator, sharded, plans)
    real = [(g, j) for g, p in plans.items() for j in range(len(p))]
    last = real[-1] if real else None
    for g, plan in plans.items():
        for j in range(counts[g]):
            item = plan[j] if j < len(plan) else None
            yield g, item, sync and (g, j) == last


@dataclass
class MicroBatch:
    """One slot of the lockstep schedule (`lockstep`), and the padding rules every objective follows in it.

    A real slot holds `item` (the plan's: local row ids, or an objective's job) of `group`. A padding slot (sharded:
    this rank has fewer micro-batches of the group than the busiest rank) runs the same forwards and backward on the
    rank's row 0: `rows` is [0], `weight` zeroes what it is given, `teacher` leaves a teacher's counters alone (its
    forward is no teacher call), and `real` is False, so the objective books and labels nothing. `backward` frees
    the teachers' gathered roots (their LM heads, sharded) before the student's backward; `synced` is the context of
    the step's synchronising backward (DDP) or of one that is not."""

    group: str
    item: object
    sync: bool
    """This slot's last backward synchronises DDP's gradients (never a padding slot: sharded runs sync every one)."""
    accelerator: object
    student: object
    release: tuple = ()
    """Models whose gathered parameters `backward` frees first (the teachers, sharded)."""

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
        return teacher.uncounted() if not self.real else nullcontext()

    def synced(self, last: bool = True):
        """The context of a forward and backward: synchronising DDP's gradients when this is the slot's (and, with
        `last`, the objective's) final backward of the step."""
        return synced(self.accelerator, self.student, (self.sync and last) or not self.real)

    def free(self) -> None:
        """Frees the teachers' gathered parameters (sharded; a no-op otherwise)."""
        for model in self.release:
            reshard(model)

    def backward(self, loss: torch.Tensor, free: bool = True) -> None:
        """The student's backward, the teachers freed first (free=False: an objective that still reads a teacher's LM
        head in a later forward of this micro-batch frees them itself, `free`)."""
        if free:
            self.free()
        self.accelerator.backward(loss)


def lockstep(ctx, batch, plans: dict[str, list], sync: bool = True, release=()) -> Iterator[MicroBatch]:
    """The micro-batches of `plans` ({group: [items]}, groups in the same order on every rank) as `MicroBatch`es in
    lockstep (`slots`): sharded, every rank yields as many per group as the busiest rank, padding included.
    Unsharded, a rank with nothing to run runs one zero-weighted forward and backward on its row 0
    (`dummy_backward`) when `sync`, so that it joins DDP's gradient all-reduce; with sync=False a later pass of the
    caller synchronises. `ctx` an `opd.methods.objective.ObjectiveContext`, `batch` the step's `StepBatch`; `release` the
    teachers' models, resharded before each backward and at the end when sharded (`ctx.sharded`)."""
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


def dummy_backward(ctx, batch) -> None:
    """A zero-weighted forward and backward on this rank's first row: a rank with nothing to train still joins DDP's
    gradient all-reduce (every rank runs the same collectives)."""
    ro = batch.rollouts
    prompt = batch.student_prompts[int(ro.prompt_index[0])]
    inputs, _, _ = micro_batch_inputs([prompt], ro, torch.tensor([0]), ctx.ids["pad"], ctx.device)
    with ctx.autocast():
        dummy = ctx.student(**inputs, logits_to_keep=1, use_cache=False).logits.float().sum() * 0.0
    ctx.accelerator.backward(dummy)


def plan_rows(rollouts, teacher_prompt, selected: torch.Tensor, micro_batch: int, micro_batch_tokens: int,
              view: str) -> list[torch.Tensor]:  # fmt: skip
    """This rank's micro-batches of `selected` (local row ids), grouped by teacher length (prompt + response)."""
    if not selected.numel():
        return []
    prompt_of = rollouts.prompt_index[selected].tolist()
    t_len = torch.tensor([len(teacher_prompt(view, j)) for j in prompt_of]) + rollouts.lengths[selected]
    return [selected[g] for g in plan_micro_batches(t_len, micro_batch, micro_batch_tokens)]


def synced(accelerator, student, sync: bool):
    """The context of a forward and backward: DDP's `no_sync` unless this one synchronises the step's gradients
    (FSDP2 modules have no `no_sync`: accelerate then returns a null context)."""
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
