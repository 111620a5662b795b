"""The seam every objective sits behind: what it is given once per run (`ObjectiveContext`), what it implements
(`Objective`: called once per step with its `StepBatch`, after a valid update, in a checkpoint) and what it returns
(`ObjectiveResult`). Its class attributes are its spec's (`opd.methods.specs`); the default objective and its pass:
`opd.methods.objective` (`Distillation`, `distill`). Details: docs/MODULES.md#opdmethodsobjective."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch

from opd.maths.divergence import labels_from_terms
from opd.methods.specs import ObjectiveSpec


@dataclass
class TeacherCost:
    """What one teacher label cost on this rank: forward rows, real and padded input tokens, seconds."""
    rows: int = 0
    tokens: int = 0
    padded_tokens: int = 0
    seconds: float = 0.0


@dataclass
class ObjectiveResult:
    """What an objective returns for one step on this rank (`opd.methods.objective.begin` starts one)."""

    loss_sum: float = 0.0
    """This rank's share of the loss times `global_tokens`: the local numerator (OPOD: its gated term only)."""
    global_tokens: float = 0
    """The loss's denominator over all ranks (`opd.maths.family.DENOMINATORS`); 0: S is empty everywhere."""
    utility: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    """(N_local,) u_i for selected rows, NaN for unselected rows (they get no label)."""
    teachers: dict[str, TeacherCost] = field(default_factory=dict)
    """Per ledger label (view, or teacher:view): rows, prompt + valid response tokens, padded tokens, seconds."""
    loss_share: float = 0.0
    """This rank's share of the step's loss (summed over ranks: the loss), set by the objective's pass."""
    metrics: dict = field(default_factory=dict)
    """Extra ledger fields of the objective (already the same on every rank)."""

    @property
    def empty(self) -> bool:
        return self.global_tokens == 0

    def label(self, rows: torch.Tensor, terms: torch.Tensor, mask: torch.Tensor, loss) -> None:
        """Eq. 9's labels u_i of `rows` from their terms (d, o, c), (P, 3) or (n, T, 3), with `loss`'s ablations."""
        u = labels_from_terms(terms, mask, not loss.no_overlap, not loss.no_confidence)
        self.utility[rows] = u.float().cpu()

    @property
    def teacher_s(self) -> float:
        return sum(c.seconds for c in self.teachers.values())



@dataclass
class ObjectiveContext:
    """Everything an objective may use, built once per run by the loop."""

    accelerator: object
    student: torch.nn.Module
    """The policy as trained (DDP-wrapped, or FSDP2-sharded): its forwards and backwards."""
    model: Callable[[], torch.nn.Module]
    """() -> the policy unwrapped (its config, its weights for the teachers' update)."""
    teachers: object
    """The run's teachers (`opd.models.external_teachers.TeacherSet`), in a fixed order."""
    encode: Callable
    """(view, record, seed=0, processor=None, thinking=None) -> EncodedPrompt (`opd.data.records.Prompts.encode`)."""
    processor: object  # the policy's processor (its tokenizer decodes rollouts)
    ids: dict  # the policy's special ids: eos, pad, vision
    autocast: Callable  # () -> the forwards' mixed-precision context
    student_view: str
    teacher_views: tuple[str, ...]
    """The teacher views of a scored row, the positive one first (OPD-V: crop, then masked)."""
    loss: object
    """The shared loss settings (`opd.maths.loss.LossConfig`, resolved for the method)."""
    max_response_len: int
    ema: object
    """The teachers' update (`opd.models.settings.EMAConfig`): rate tau (0: fixed; 1: a copy), every `every` steps."""
    sharded: bool = False  # FSDP2-sharded policy and teachers (`--fsdp`): the lockstep pads and frees for it
    distill_pass: Callable | None = None  # in `distill`'s place (the run's choice): `micro_batch.fused_distill`
    schedule: Callable | None = None  # `distill`'s micro-batches: None one process's, several ranks' `lockstep`

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def teacher_models(self) -> list:
        return [t.model for t in self.teachers.teachers.values()]

    @property
    def tokenizer(self):
        return self.processor.tokenizer


class Objective:
    """The interface of an objective; its class attributes are its `spec`'s (`opd.methods.specs`), set per subclass."""

    spec: ObjectiveSpec = ObjectiveSpec("")
    name: str = ""
    Config: type | None = None
    refuses: dict[str, str] = {}
    needs_ema_teacher: str = ""
    aggregations: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for f in fields(ObjectiveSpec):
            setattr(cls, f.name, getattr(cls.spec, f.name))

    @classmethod
    def build_teachers(cls, teachers, initial_teacher: Callable[[], object]):
        return teachers

    def __init__(self, ctx, config=None, initial_teacher: Callable[[], object] | None = None):
        """`ctx` the run's `opd.methods.objective.ObjectiveContext`; `config` the method's settings (its `Config`)."""
        self.ctx, self.config, self.initial_teacher = ctx, config, initial_teacher

    @property
    def labels(self) -> list[str]:
        """The ledger labels of every teacher forward this objective can run, in a fixed order."""
        raise NotImplementedError

    def __call__(self, batch):
        """The step's `StepBatch` -> an `ObjectiveResult`, this rank's loss share backpropagated (lines 11-12)."""
        raise NotImplementedError

    def after_update(self, step: int) -> None:
        """After a valid optimizer step (step index `step`)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
