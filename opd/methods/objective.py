"""The objective boundary: what the loop hands a method's objective, and what the objective gives back.

The step (`opd.loop.step.Stepper.step`) selects S, then calls the method's objective once with the step's
`StepBatch` (`opd.data.records`); the objective runs the teacher(s) on S only, backpropagates its share of the loss
and returns an `ObjectiveResult` (its sums, the labels of S, its teacher costs, its metrics). After a valid optimizer
step the loop calls `after_update` (the EMA, DAPD's snapshot). An objective sees only `ObjectiveContext` (built once
per run), its own config dataclass (`Objective.Config`, flags `--<name>-<field>`) and `initial_teacher()`; one with
teachers of its own says so in `build_teachers`. The method table (`opd.methods.table.METHODS`) names each method's
objective by its torch-free spec (`opd.methods.specs`; the class: `opd.methods.objectives.objective_class`); shared
pieces are modules of their own (`opd.methods.distill`, `policy_gradient`, `lockstep`, `opd.maths.loss`).
Details: docs/MODULES.md#opdmethodsobjective; adding a method: docs/EXTENDING.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch

from opd.data.records import StepBatch
from opd.maths.divergence import labels_from_terms
from opd.maths.family import DENOMINATORS
from opd.methods.lockstep import MicroBatch, TeacherCost, plan_rows, record_forward
from opd.methods.specs import ObjectiveSpec
from opd.models.chat import micro_batch_inputs


def _no_labels() -> torch.Tensor:
    """ObjectiveResult.utility's default: no row."""
    return torch.zeros(0)


@dataclass
class ObjectiveResult:
    """What an objective returns for one step on this rank."""

    loss_sum: float = 0.0
    """This rank's share of the loss times `global_tokens`: the local part of the loss's numerator. Token-mean (Eq.
    11): sum over this rank's selected valid tokens of w D (w the token weight times OPOD's beta; with unbiased
    selection times 1 / pi_i); sequence-mean: sum over its rows of S of the row's mean D; micro-batch: sum over its
    micro-batches of n_b times the micro-batch's token mean. OPOD: of its gated distillation term only (its
    `loss_share` adds the policy gradient and the KL)."""
    global_tokens: float = 0
    """The loss's denominator over all ranks (`opd.maths.family.loss_denominator`): token-mean, the selected valid tokens
    (an int), or sum_i w_i T_i with unbiased selection's weights (a float); sequence-mean and micro-batch, the
    number |S| of selected rows with a valid token; DAPD, the rollout completions' tokens (weighted alike). 0: S is
    empty everywhere."""
    utility: torch.Tensor = field(default_factory=_no_labels)
    """(N_local,) u_i for selected rows, NaN for unselected rows (they get no label)."""
    teachers: dict[str, TeacherCost] = field(default_factory=dict)
    """Per ledger label (teacher view, or teacher:view): rows, prompt + valid response tokens, input tokens
    with padding, seconds."""
    loss_share: float | None = None
    """This rank's share of the step's loss (summed over ranks: the loss); None: loss_sum / global_tokens."""
    metrics: dict = field(default_factory=dict)
    """Extra ledger fields of the objective (already the same on every rank)."""

    @classmethod
    def begin(cls, ctx: ObjectiveContext, batch: StepBatch, labels: list[str]) -> ObjectiveResult:
        """The step's result before any teacher forward: no row labelled (NaN), every label's cost zero, and the
        loss's global denominator (`opd.maths.family.DENOMINATORS`, Eq. 11's `divergence.global_denominator`: one
        all-reduce, run by every rank). `empty`: S holds no token on any rank, so no teacher runs and the distillation
        term is zero (Appendix A.3)."""
        ro = batch.rollouts
        res = cls(utility=torch.full((len(ro),), float("nan")), teachers={lab: TeacherCost() for lab in labels})
        denominator = DENOMINATORS[ctx.loss.aggregation]
        res.global_tokens = denominator(ctx.accelerator, ro.lengths, batch.selected, batch.weights, batch.full_tokens)
        return res

    @property
    def empty(self) -> bool:
        """S holds no valid token on any rank."""
        return self.global_tokens == 0

    def label(self, rows: torch.Tensor, terms: torch.Tensor, mask: torch.Tensor, loss) -> None:
        """Eq. 9's labels u_i of `rows` from their per-position terms (d, o, c) ((P, 3) or (n, T, 3);
        `opd.maths.divergence.labels_from_terms`), with the run's ablations (`loss`: the `opd.maths.loss.LossConfig`)."""
        u = labels_from_terms(terms, mask, not loss.no_overlap, not loss.no_confidence)
        self.utility[rows] = u.float().cpu()

    @property
    def teacher_s(self) -> float:
        return sum(c.seconds for c in self.teachers.values())

    @property
    def share(self) -> float:
        """This rank's share of the step's loss."""
        return self.loss_share if self.loss_share is not None else self.loss_sum / max(1, self.global_tokens)


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
    """(view or View, record, seed=0, processor=None, thinking=None) -> EncodedPrompt, with the run's thinking flag
    (unless `thinking` says otherwise) and --max-prompt-len; a prompt that does not fit is a one-line error naming
    its record (`opd.data.records.Prompts.encode`)."""
    processor: object
    """The policy's processor (its tokenizer decodes rollouts)."""
    ids: dict
    """The policy's special ids (`opd.models.loading.special_ids`): eos, pad, vision."""
    autocast: Callable
    """() -> the mixed-precision context of the forwards."""
    student_view: str
    teacher_views: tuple[str, ...]
    """The teacher views of a scored row, the positive one first (OPD-V: crop, then masked)."""
    loss: object
    """The shared loss settings (`opd.maths.loss.LossConfig`, resolved for the method: its support, divergence and token
    weight): top-k, alpha, temperature, aggregation, micro-batch and chunk sizes, utility ablations."""
    max_response_len: int
    ema: object
    """The teachers' update (`opd.models.settings.EMAConfig`): rate tau after a valid step (0: fixed; 1: a copy), every
    `every` steps."""
    sharded: bool = False
    """The policy and teachers are FSDP2-sharded (`--fsdp`): `opd.methods.lockstep` pads and frees for it."""

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def teacher_models(self) -> list:
        """The teachers' models, in the teachers' order: what a micro-batch frees before the student's backward
        (`lockstep(..., release=)`, sharded)."""
        return [t.model for t in self.teachers.teachers.values()]

    @property
    def tokenizer(self):
        return self.processor.tokenizer


def teacher_plans(ctx: ObjectiveContext, batch: StepBatch, view: str) -> dict[str, list[torch.Tensor]]:
    """S's rows routed to each teacher ({name: micro-batches of local row ids}, in the teachers' fixed order), each
    teacher's rows grouped by their length in `view` (prompt + response; `opd.methods.lockstep.plan_rows`)."""
    cfg = ctx.loss
    return {n: plan_rows(batch.rollouts, lambda v, j, n=n: batch.teacher_prompt(n, v, j), batch.routed(n),
                         cfg.micro_batch, cfg.micro_batch_tokens, view) for n in ctx.teachers.names}  # fmt: skip


def teacher_inputs(ctx: ObjectiveContext, batch: StepBatch, mb: MicroBatch, view: str, res: ObjectiveResult):
    """The micro-batch's inputs for its teacher (`mb.group`) in `view`: (inputs, mask (n, T), width, cost). A real
    slot's forward is booked (rows, tokens) under its ledger label and `cost` is that label's `TeacherCost` (for its
    seconds); a padding slot runs on the student's prompts, booked nowhere (cost None)."""
    ro, pids = batch.rollouts, batch.rollouts.prompt_index[mb.rows].tolist()
    prompts = [batch.teacher_prompt(mb.group, view, p) if mb.real else batch.student_prompts[p] for p in pids]
    inputs, mask, width = micro_batch_inputs(prompts, ro, mb.rows, ctx.ids["pad"], ctx.device)
    cost = res.teachers[ctx.teachers.label(mb.group, view)] if mb.real else None
    if cost is not None:
        record_forward(cost, inputs, mask, sum(len(p) for p in prompts))
    return inputs, mask, width, cost


class Objective:
    """The interface of an objective (`opd.methods.distillation.Distillation`, `opd.methods.dapd.DAPD`, `opd.methods.opod.OPOD`,
    `opd.methods.tm_opd.TMOPD`).

    Its class attributes `name`, `Config`, `refuses`, `needs_ema_teacher` and `aggregations` are its `spec`'s
    (`opd.methods.specs.ObjectiveSpec`, which says what each means; the settings read the spec without this code),
    set when a subclass is made."""

    spec: ObjectiveSpec = ObjectiveSpec("")
    name: str = ""
    Config: type | None = None
    refuses: dict[str, str] = {}
    needs_ema_teacher: str = ""
    aggregations: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs):
        """The subclass's facts from its spec: one source (`opd.methods.specs`)."""
        super().__init_subclass__(**kwargs)
        for f in fields(ObjectiveSpec):
            setattr(cls, f.name, getattr(cls.spec, f.name))

    @classmethod
    def build_teachers(cls, teachers, initial_teacher: Callable[[], object]):
        """The run's teacher set for this objective, from the loop's default (the EMA self-teacher or the external
        ones); the default is kept."""
        return teachers

    def __init__(self, ctx: ObjectiveContext, config=None, initial_teacher: Callable[[], object] | None = None):
        self.ctx, self.config, self.initial_teacher = ctx, config, initial_teacher

    @property
    def labels(self) -> list[str]:
        """The ledger labels of every teacher forward this objective can run, in a fixed order."""
        raise NotImplementedError

    def __call__(self, batch: StepBatch) -> ObjectiveResult:
        raise NotImplementedError

    def after_update(self, step: int) -> None:
        """After a valid optimizer step (step index `step`)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
