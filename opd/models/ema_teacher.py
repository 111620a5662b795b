"""The crop-conditioned EMA teacher theta-bar (Eq. 2; Algorithm 1, lines 1, 11 and 13).

`EMATeacher`: a gradient-free copy of the policy, moved only by line 13 after a valid update; it scores the student's
own response tokens after its privileged prompt, for selected rows only, and counts every row it is asked about
(`rows_scored`: the budget audit). `Teacher`: a fixed one; `TeacherSet`: the run's teachers in a fixed order;
`book_forward`: a forward's cost (the ledger). LoRA's: `opd.models.adapter_teacher`.
Details: docs/MODULES.md#opdmodelsema_teacher."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch

from opd.models.chat import response_logits
from opd.models.hidden import response_hidden


class Teacher:
    """A frozen teacher (`--teacher-model`, DAPD's anchor): scores responses after its own prompt, detached, and
    counts every row and batch (the budget audit). `processor` encodes its prompts (None: the policy's)."""

    def __init__(self, model: torch.nn.Module, processor=None, *, freeze: bool = True):
        """freeze=False (LoRA's `AdapterTeacher`): `model` is the policy itself, left trainable."""
        self.model = model.eval().requires_grad_(False) if freeze else model
        self.processor = processor
        self.rows_scored = 0
        self.batches: list[int] = []
        self.counting = True  # False: forwards not counted (`opd.methods.lockstep.uncounted`)

    trainable = False  # whether `update` changes the weights (then a checkpoint holds them)

    def _count(self, inputs: dict[str, torch.Tensor]) -> None:
        if not self.counting:
            return
        n = inputs["input_ids"].shape[0]
        self.rows_scored += n
        self.batches.append(n)

    def update(self, student: torch.nn.Module, tau: float) -> None:
        """A frozen teacher does not follow the student."""

    def logits(self, inputs: dict[str, torch.Tensor], n_response: int) -> torch.Tensor:
        """Eq. 2 of the paper: p^T_{i,t} = p_theta-bar(. | x~_i, q_i, y_{i,<t}) as detached logits (n, T, V)."""
        self._count(inputs)
        with torch.no_grad():
            return response_logits(self.model, inputs, n_response).detach()

    def hidden(self, inputs: dict[str, torch.Tensor], n_response: int) -> torch.Tensor:
        """Eq. 2 as final hidden states (n, T, H): logits = hidden @ lm_head_weight(model)^T."""
        self._count(inputs)
        with torch.no_grad():
            return response_hidden(self.model, inputs, n_response).detach()


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


def book_forward(cost, inputs: dict, mask: torch.Tensor, prompt_tokens: int, seconds: float = 0.0) -> None:
    """Books one teacher forward in `cost` (`opd.methods.interface.TeacherCost`): rows, real tokens (prompts + valid
    completion tokens), padded tokens, seconds."""
    cost.rows += int(inputs["input_ids"].shape[0])
    cost.tokens += int(mask.sum()) + int(prompt_tokens)
    cost.padded_tokens += int(inputs["input_ids"].numel())
    cost.seconds += seconds


def update_due(every: int, step: int) -> bool:
    """Whether the teachers' update follows step index `step`: every `every` steps (--ema-every)."""
    return (step + 1) % max(1, every) == 0


def ema_(pairs, tau: float) -> None:
    """Line 13 in place on (teacher, student) pairs: theta-bar <- (1 - tau) theta-bar + tau theta; tau = 1 copies."""
    with torch.no_grad():
        for t, s in pairs:
            if tau == 1.0:
                t.copy_(s.detach())
            else:
                t.lerp_(s.detach().to(t.dtype), tau)


def parameter_pairs(teacher: torch.nn.Module, student: torch.nn.Module):
    """(teacher, student) parameter pairs in order: what line 13 moves, unsharded."""
    return zip(teacher.parameters(), student.parameters(), strict=True)


class EMATeacher(Teacher):
    trainable = True

    def __init__(self, student: torch.nn.Module, copy_weights: bool = True, pairs=None):
        """Line 1: theta-bar <- theta (copy_weights=False adopts `student` as the teacher, e.g. a sharded one built
        apart, then `opd.loop.build.copy_weights`). `pairs`: the pairs line 13 moves (None: every parameter)."""
        super().__init__(copy.deepcopy(student) if copy_weights else student)
        self.pairs = pairs

    def update(self, student: torch.nn.Module, tau: float) -> None:
        """Line 13: theta-bar <- (1 - tau) theta-bar + tau theta (buffers copied; sharded: local shards)."""
        with torch.no_grad():
            ema_((self.pairs or parameter_pairs)(self.model, student), tau)
            for t, s in zip(self.model.buffers(), student.buffers(), strict=True):
                t.copy_(s)


@dataclass
class TeacherSet:
    """The run's teachers by name, in a fixed order (every rank the same), and the route of each record."""

    teachers: dict = field(default_factory=dict)  # name -> Teacher
    routes: object = None  # `opd.data.routes.Routes`; None: every record to the first (only) teacher

    @property
    def single(self) -> bool:
        return len(self.teachers) == 1

    @property
    def names(self) -> list[str]:
        return list(self.teachers)

    def route(self, record) -> str | None:
        """The teacher of a record's rows (None: the record is not a candidate)."""
        return self.routes.route(record) if self.routes is not None else self.names[0]

    def label(self, name: str, view: str) -> str:
        """The ledger label of a teacher's forwards in a view: the view alone, or `<teacher>:<view>` with several."""
        return view if self.single else f"{name}:{view}"
