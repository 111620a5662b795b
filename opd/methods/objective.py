"""The objective boundary, and the family's distillation pass behind it (Algorithm 1, lines 11-12).

The step (`opd.loop.step.Stepper.step`) selects S, then calls the method's objective once with the step's `StepBatch`
(`opd.data.records`); the objective runs the teacher(s) on S only, backpropagates its share of the loss and returns an
`ObjectiveResult`; after a valid optimizer step the loop calls `after_update`. An objective sees only
`ObjectiveContext`, its own config (`Objective.Config`, flags `--<name>-<field>`) and `initial_teacher()`. The method
table names each method's objective by its torch-free spec (`opd.methods.specs`; the class:
`opd.methods.objectives.objective_class`). `distill` is the default objective's call (`Distillation`, the family's;
OPOD's gated term): a rank's rows of S in micro-batches by length, each running Eq. 2, 1 and 3 (through autograd), its
share of Eq. 11 backpropagated at once and Eq. 7-9's labels. Memory per micro-batch: about five (n, T, V) float32
tensors (20 n T V bytes; Qwen3.5's 4 x 1,024 x 248,320: 20 GB); past `opd.maths.loss.PLAIN_LOGITS_LIMIT` the fused
kernel (`opd.methods.micro_batch`). Details: docs/MODULES.md#opdmethodsobjective, docs/TRAINING.md#the-distillation-pass;
adding a method: docs/EXTENDING.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from types import MethodType

import torch

from opd.data.records import StepBatch
from opd.maths.divergence import generalized_jsd, labels_from_terms, upcast, utility_terms, weighted_sum
from opd.maths.family import AGGREGATION_WEIGHTS, DENOMINATORS, SUPPORTS, bias_corrected_reverse_kl
from opd.methods.lockstep import MicroBatch, Stopwatch, TeacherCost, lockstep, plan_rows, record_forward
from opd.methods.micro_batch import micro_batch_loss
from opd.methods.specs import DISTILL_SPEC, ObjectiveSpec
from opd.models.chat import micro_batch_inputs, response_logits
from opd.models.ema_teacher import update_due


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
    """The interface of an objective (`Distillation` below, `opd.methods.dapd.DAPD`, `opd.methods.opod.OPOD`,
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


def distill(objective, batch: StepBatch, row_weights: torch.Tensor | None = None, sync: bool = True,
            token_sums: dict | None = None, labels: list[str] | None = None) -> ObjectiveResult:  # fmt: skip
    """Eq. 11 on S against the run's teacher(s), backpropagated micro-batch by micro-batch; returns its sums and the
    labels u_i of S (Eq. 9). The default objective's call (`Distillation.__call__`), so each micro-batch's Eq. 1, 2, 3
    and 11 run right here; the fused kernel, token weights and OPD-V's second view run `micro_batch_loss`.

    `objective.ctx`: the run's `ObjectiveContext` (teachers in a fixed order, each row routed to one by `batch.route`).
    row_weights (N_local,): each row's Eq. 11 weights, numerator only (OPOD's beta); `batch.weights`: unbiased
    selection's 1 / pi_i (Eq. 11's Hajek form). sync=False: no backward synchronises DDP (the caller's later pass
    does). token_sums (a dict), with a token weight: per row sums of w_t and log pi_T(y_t) (OPOD). labels: the
    result's teacher labels (default `distill_labels`). Memory: module docstring."""
    ctx = objective.ctx
    cfg, ro, teachers = ctx.loss, batch.rollouts, ctx.teachers
    res = ObjectiveResult.begin(ctx, batch, labels or distill_labels(ctx))
    sums: dict = {}
    if token_sums is not None and (cfg.token_weight != "none" or cfg.is_clip):
        sums = token_sums
        sums.update(token_weight=torch.zeros(len(ro)), teacher_logp=torch.zeros(len(ro)))
    if res.empty:  # S is empty everywhere: no teacher call, zero distillation term
        return res
    row_w = torch.ones(len(ro)) if row_weights is None else row_weights.float().cpu()  # (N_local,) OPOD's beta
    float64 = next(ctx.student.parameters()).dtype == torch.float64  # Eq. 11's weights in float64 for a float64 policy
    dtype, scale = torch.float64 if float64 else torch.float32, ctx.accelerator.num_processes  # DDP averages ranks
    weighted = cfg.token_weight != "none" or bool(cfg.is_clip)  # a token weight w_t (`opd.maths.weights`)
    plain = not (cfg.kernel or weighted or len(ctx.teacher_views) > 1)
    temp, k = cfg.temperature, cfg.topk
    for mb in lockstep(ctx, batch, teacher_plans(ctx, batch, ctx.teacher_views[0]), sync, release=ctx.teacher_models):
        teacher, rows = teachers.teachers[mb.group], mb.rows  # padding: zero weights, nothing counted or labelled
        views = [teacher_inputs(ctx, batch, mb, view, res) for view in ctx.teacher_views]  # booked
        mask, width = views[0][1], views[0][2]
        s_inputs, _, _ = micro_batch_inputs([batch.student_prompts[p] for p in ro.prompt_index[rows].tolist()], ro,
                                            rows, ctx.ids["pad"], ctx.device)  # fmt: skip
        w_i = None if batch.weights is None else batch.weights[rows].to(ctx.device)  # (n,) 1 / pi_i
        aggregate = AGGREGATION_WEIGHTS[cfg.aggregation]  # Eq. 11's budgeted_weights (or the method's aggregation)
        weights = mb.weight(aggregate(row_w[rows].to(ctx.device), mask, res.global_tokens, dtype, w_i) * scale)  # (n, T)
        extras: dict = {}
        with mb.synced():
            with ctx.autocast(), mb.teacher(teacher):
                if plain:  # one micro-batch's logits (n, T, V), autograd through opd.maths.divergence
                    watch = Stopwatch(ctx.device)
                    t_logits = tempered(teacher.logits(views[0][0], width), temp)  # (n, T, V) Eq. 2, detached
                    seconds = [watch.seconds()]
                    s_logits = tempered(response_logits(ctx.student, s_inputs, width), temp)  # (n, T, V) Eq. 1
                    s_logp, t_logp = SUPPORTS[cfg.support](s_logits, t_logits, k)  # (n, T, k + 1) Eq. 3's support
                    d = (generalized_jsd(s_logp, t_logp, cfg.alpha) if cfg.divergence == "jsd"  # (n, T) Eq. 3
                         else bias_corrected_reverse_kl(s_logp, t_logp))  # fmt: skip
                    loss = weighted_sum(d, weights)  # this micro-batch's share of Eq. 11
                    terms = torch.stack(utility_terms(s_logits.detach(), t_logits, k), -1)  # (n, T, 3) Eq. 7-8
                    u = labels_from_terms(terms, mask, not cfg.no_overlap, not cfg.no_confidence)  # (n,) Eq. 9
                else:
                    loss, _, u, seconds = micro_batch_loss(
                        ctx.student, teacher, s_inputs, [v[0] for v in views], mask, width, weights, cfg,
                        ro.response_ids[rows, :width].to(ctx.device), ro.logp[rows, :width].to(ctx.device), extras,
                    )  # fmt: skip
            mb.backward(loss)  # sharded: the teacher's gathered root (LM head) is freed before the student's backward
        if not mb.real:
            continue
        res.loss_sum += float(loss.detach()) * res.global_tokens / scale  # its share of the loss, times the denominator
        res.utility[rows] = u.float().cpu()
        for key in sums:  # with a token weight: its per-row sums (OPOD's gate and teacher log-probs)
            sums[key][rows] = extras[key].sum(-1).float().cpu()
        for (_, _, _, cost), sec in zip(views, seconds):
            cost.seconds += sec
    return res


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logits divided by the loss temperature (OPSD's 1.1; float64 stays float64); at 1 the logits themselves."""
    return logits if temperature == 1.0 else upcast(logits) / temperature


def distill_labels(ctx) -> list[str]:
    """The ledger labels of the pass's teacher forwards: every teacher in every teacher view, in a fixed order."""
    t = ctx.teachers
    return [t.label(n, v) for n in t.names for v in ctx.teacher_views]


class Distillation(Objective):
    """Eq. 11 on S against the run's teacher(s), then the teachers' update after a valid step."""

    spec = DISTILL_SPEC  # its name (`opd.methods.specs`)

    @property
    def labels(self) -> list[str]:
        """The ledger labels of every teacher forward this objective can run, in a fixed order."""
        return distill_labels(self.ctx)

    @property
    def __call__(self) -> Callable[[StepBatch], ObjectiveResult]:
        """The pass itself, bound to this objective: `objective(batch)` is `distill(objective, batch)`, so the step's
        call lands in the micro-batch loop where Eq. 1-3 and 11 run (a method calling `distill` would put one call
        more between the step and Eq. 3: tests/test_house.py)."""
        return MethodType(distill, self)

    def after_update(self, step: int) -> None:
        """Algorithm 1, line 13 after a valid update: theta-bar <- (1 - tau) theta-bar + tau theta for each of the run's
        teachers once (a shared one once), every `ema.every` steps (DAPD's snapshot: tau = 1); frozen ones stay."""
        ctx = self.ctx
        if update_due(ctx.ema.every, step):
            with torch.no_grad():
                for t in dict.fromkeys(ctx.teachers.teachers.values()):
                    t.update(ctx.model(), ctx.ema.tau)
