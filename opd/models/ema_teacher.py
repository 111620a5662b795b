"""The crop-conditioned EMA teacher theta-bar (Eq. 2; Algorithm 1, lines 1, 11 and 13).

`EMATeacher` (full fine-tuning): a separate copy of the policy initialised from the same weights, without
gradients (no optimizer moves it), updated only by theta-bar <- (1 - tau) theta-bar + tau theta after a valid
student update. With LoRA (`opd.models.adapter_teacher`) it is no copy: the policy's own base with the adapter
`teacher`, the adapter updated the same way. Either scores the student's own response tokens after its
privileged prompt, only for selected rows, detached. `rows_scored` and `batches` count every row and batch it
has been asked about, so the budget can be audited.

`Teacher` is a fixed one (an external checkpoint, DAPD's `base` anchor): the same scoring and counting, no update.
`TeacherSet` is the run's teachers in a fixed order (the EMA teacher alone by default; routes:
`opd.models.external_teachers`). Under `--fsdp` the teacher is sharded like the policy and lines 1 and 13 run on each
rank's own shards; forwards that only keep the ranks in step are not counted (`uncounted`).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field

import torch

from opd.models.chat import response_hidden, response_logits


class Teacher:
    """A frozen teacher: a model that scores the student's responses after its own prompt, detached, and
    counts every row and batch it is asked about (the budget audit). `update` leaves it as it is.

    An external teacher (`--teacher-model`, `--teachers`, `opd.models.external_teachers`) is one; so is DAPD's `base`
    anchor. `processor` encodes its prompts (None: the policy's)."""

    def __init__(self, model: torch.nn.Module, processor=None, *, freeze: bool = True):
        """freeze=False (`opd.models.adapter_teacher.AdapterTeacher`): `model` is the policy itself, left in its mode
        and trainable."""
        self.model = model.eval().requires_grad_(False) if freeze else model
        self.processor = processor
        self.rows_scored = 0
        self.batches: list[int] = []
        self._counting = True

    trainable = False
    """Whether `update` changes the weights (then a checkpoint must hold them)."""

    def _record(self, inputs: dict[str, torch.Tensor]) -> None:
        """Counts the rows of every teacher batch (the budget audit)."""
        if not self._counting:
            return
        n = inputs["input_ids"].shape[0]
        self.rows_scored += n
        self.batches.append(n)

    @contextlib.contextmanager
    def uncounted(self):
        """Forwards inside are not counted: they score nothing (a sharded rank's zero-weighted micro-batch)."""
        self._counting = False
        try:
            yield
        finally:
            self._counting = True

    def update(self, student: torch.nn.Module, tau: float) -> None:
        """A frozen teacher does not follow the student."""

    def logits(self, inputs: dict[str, torch.Tensor], n_response: int) -> torch.Tensor:
        """Eq. 2 of the paper: p^T_{i,t} = p_theta-bar(. | x~_i, q_i, y_{i,<t}) as detached logits (n, T, V)."""
        self._record(inputs)
        with torch.no_grad():
            return response_logits(self.model, inputs, n_response).detach()

    def hidden(self, inputs: dict[str, torch.Tensor], n_response: int) -> torch.Tensor:
        """Eq. 2 as final hidden states (n, T, H): logits = hidden @ lm_head_weight(model)^T."""
        self._record(inputs)
        with torch.no_grad():
            return response_hidden(self.model, inputs, n_response).detach()


def update_due(every: int, step: int) -> bool:
    """Whether the teachers' update follows step index `step`: every `every` steps (--ema-every)."""
    return (step + 1) % max(1, every) == 0


def ema_(pairs, tau: float) -> None:
    """Algorithm 1, line 13 on (teacher tensor, student tensor) pairs, in place: theta-bar <- (1 - tau) theta-bar +
    tau theta (`lerp_`, the student cast to the teacher's dtype); tau = 1 copies (DAPD's snapshot refresh)."""
    with torch.no_grad():
        for t, s in pairs:
            if tau == 1.0:
                t.copy_(s.detach())
            else:
                t.lerp_(s.detach().to(t.dtype), tau)


def parameter_pairs(teacher: torch.nn.Module, student: torch.nn.Module):
    """(teacher, student) parameter pairs, in order: what line 13 moves in an unsharded teacher."""
    return zip(teacher.parameters(), student.parameters(), strict=True)


class EMATeacher(Teacher):
    trainable = True

    def __init__(self, student: torch.nn.Module, copy_weights: bool = True, pairs=None):
        """Algorithm 1, line 1: theta-bar <- theta (copy_weights=False adopts a loaded teacher as is; a
        sharded model cannot be deep-copied: give a separately built one and call `copy_from`). `pairs`
        (teacher, student) -> the tensor pairs line 13 moves: None, every parameter in order; a sharded teacher's
        `opd.models.sharding.local_pairs` (each rank's local shards)."""
        super().__init__(copy.deepcopy(student) if copy_weights else student)
        self.pairs = pairs

    def copy_from(self, student: torch.nn.Module) -> None:
        """Algorithm 1, line 1 for a teacher built separately: theta-bar <- theta, shard by shard (`pairs`: a sharded
        teacher's `opd.models.sharding.local_pairs`)."""
        with torch.no_grad():
            for t, s in (self.pairs or parameter_pairs)(self.model, student):
                t.copy_(s)
            for t, s in zip(self.model.buffers(), student.buffers(), strict=True):
                t.copy_(s)

    def update(self, student: torch.nn.Module, tau: float) -> None:
        """Algorithm 1, line 13: theta-bar <- (1 - tau) theta-bar + tau theta (parameters; buffers copied).
        Sharded models: on each rank's local shards (`pairs`). tau = 1 copies the student (DAPD's snapshot refresh)."""
        with torch.no_grad():
            ema_((self.pairs or parameter_pairs)(self.model, student), tau)
            for t, s in zip(self.model.buffers(), student.buffers(), strict=True):
                t.copy_(s)


@dataclass
class TeacherSet:
    """The run's teachers by name, in a fixed order (every rank the same), and the route of each record."""

    teachers: dict = field(default_factory=dict)
    """name -> `Teacher` (or `EMATeacher`)."""
    routes: object = None
    """The routing table (`opd.data.routes.Routes`); None: every record goes to the first (and only)
    teacher."""

    @property
    def single(self) -> bool:
        return len(self.teachers) == 1

    @property
    def names(self) -> list[str]:
        return list(self.teachers)

    def route(self, record) -> str | None:
        """The name of the teacher of a record's rows (None: none, the record is not a candidate)."""
        return self.routes.route(record) if self.routes is not None else self.names[0]

    def label(self, name: str, view: str) -> str:
        """The ledger label of one teacher's forwards in one view: the view with one teacher, `<teacher>:<view>` with
        several (routes, DAPD's anchors)."""
        return view if self.single else f"{name}:{view}"
