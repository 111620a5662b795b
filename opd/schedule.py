"""One lockstep schedule of micro-batches for every objective, and the teacher-cost accounting.

Every objective (the family's distillation, DAPD's pairs, OPOD's passes) splits a rank's selected rows into
micro-batches and runs forwards and backwards on them. Distributed, every rank must run the same collectives
in the same order, also with nothing to do:

- DDP (the policy replicated): gradients are all-reduced in the backward of a synchronised forward, so a rank
  runs its micro-batches unsynchronised (`no_sync`) but for the last one; a rank with no micro-batch runs one
  zero-weighted forward and backward on its row 0 (`dummy_backward`) so that it still joins the all-reduce.
- FSDP2 (`--fsdp`, the policy and teachers sharded): every forward and backward gathers parameters
  collectively, so every rank runs as many micro-batches per group (teacher, pass) as the busiest rank (one
  all-gather of the counts), the missing ones zero-weighted padding on its own row 0 (counted nowhere).

`lockstep` is that schedule, written once: it calls the objective's `run(group, item, sync)` for each of the
rank's micro-batches, `item=None` for padding, `sync=True` for the step's synchronising one. `synced` is the
context a forward and backward run in. `TeacherCost` and `record_forward` book each teacher forward (rows,
tokens, padded tokens, seconds) the same way for every objective; `Stopwatch` times on the device.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from opd.sharding import is_sharded


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


def slots(accelerator, student, plans: dict[str, list], sync: bool = True) -> Iterator[tuple[str, object, bool]]:
    """The lockstep order of this rank's micro-batches: (group, item or None for padding, sync), groups in the
    plans' order (the same on every rank). `sync` is True for the last real micro-batch when the caller syncs
    (DDP: its backward all-reduces the step's gradients); never for padding (sharded runs sync every backward)."""
    sharded = is_sharded(student)
    counts = slot_counts(accelerator, sharded, plans)
    real = [(g, j) for g, p in plans.items() for j in range(len(p))]
    last = real[-1] if real else None
    for g, plan in plans.items():
        for j in range(counts[g]):
            item = plan[j] if j < len(plan) else None
            yield g, item, sync and (g, j) == last


def lockstep(accelerator, student, plans: dict[str, list], run: Callable[[str, object, bool], None],
             dummy: Callable[[], None] | None = None, sync: bool = True) -> None:
    """Runs `run(group, item, sync)` for every micro-batch of `plans` ({group: [items]}, groups in the same order
    on every rank) in lockstep (`slots`): sharded, padding slots call run(group, None, False). Unsharded, a rank
    with nothing to run calls `dummy()` (a zero-weighted forward and backward) when `sync`, so that it joins DDP's
    gradient all-reduce; with sync=False a later pass of the caller synchronises."""
    ran = False
    for group, item, last in slots(accelerator, student, plans, sync):
        run(group, item, last)
        ran = ran or item is not None
    if not ran and sync and dummy is not None and not is_sharded(student):
        dummy()


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
