"""The family of on-policy self-distillation methods that share Algorithm 1's loop, as data.

Each method names the student's view, the teacher's view(s), the support of the per-token divergence, the
divergence, the per-token weight and its objective's torch-free spec (`opd.methods.specs`); the loop (`opd/run.py`)
reads the table and never branches on a method's name. BAS-OPD's budgeted selection (Eq. 4, Algorithm 1 lines 4-9)
sits on top of any of them: K = floor(rho |C|) counts rows. `settings` are the method's paper settings, applied over
`--preset` and under the flags given. Methods: bas-opd, vision-opd, rp-opsd, opd-v, opsd, dapd, opod, gkd, tm-opd.
This table is the one registry of methods; docs/EXTENDING.md: adding a method.
Details (the method table): docs/MODULES.md#opdmethodstable.
"""

from dataclasses import dataclass, field

from opd.data.settings import VIEW_NAMES
from opd.maths.loss import NEGATIVE_VIEW, TOKEN_WEIGHT_NAMES, check_loss
from opd.methods.specs import DAPD_SPEC, DISTILL_SPEC, OPOD_SPEC, TM_OPD_SPEC, ObjectiveSpec


@dataclass(frozen=True)
class Method:
    name: str
    paper: str
    """Where the method comes from (paper and public code)."""
    student_view: str = "full"
    """The view the student samples and is trained on (opd.data.settings.VIEW_NAMES)."""
    teacher_view: str = "crop"
    """The (positive) teacher's privileged view: its distributions are the target of the divergence."""
    negative_view: str | None = None
    """A second teacher view whose sampled-token log-probs only weight tokens (OPD-V's masked teacher)."""
    support: str = "student_tail"
    """The divergence's support (opd.maths.loss.SUPPORT_NAMES): the student's top-k + tail bucket (Eq. 3), or the
    teacher's top-k without tail ('teacher') or renormalised over it ('teacher_renorm')."""
    divergence: str = "jsd"
    """'jsd': the generalized JSD of Eq. 3 with --alpha; 'bc_rkl': the bias-corrected reverse KL."""
    token_weight: str = "none"
    """A name of `opd.maths.loss.TOKEN_WEIGHT_NAMES`: 'none', 'trust_region': w_t = ReLU(log pi_T+(y_t) -
    log pi_T-(y_t)) from the two teachers, or 'gate': OPOD's c_t = ReLU(log pi_T(y_t) - log pi_theta(y_t))."""
    objective: ObjectiveSpec = DISTILL_SPEC
    """The objective that runs the method, by its spec (`opd.methods.specs`: the family's distillation, a loss and a
    view; DAPD, OPOD or TM-OPD); its class: `opd.methods.objectives.objective_class`."""
    external_teachers: str = "allowed"
    """'allowed' (--teacher-model / --teachers replace the EMA self-teacher), 'required' (OPOD: its teachers
    are separate checkpoints) or 'refused' (DAPD: its anchors are the policy's own weights)."""
    label: str | None = None
    """The prefix of a run's table label (`learned-25` -> `opsd learned-25`); None: the method's name."""
    settings: dict = field(default_factory=dict)
    """Flags (by name) the method's paper sets for what it is (full querying, its teacher's update, alpha),
    applied over the preset and under the flags given; the toy-world family comparison uses these alone."""
    recipe: dict = field(default_factory=dict)
    """Flags (by name) of the method's published training recipe around its loss (LoRA, learning-rate schedule,
    rollout sampling, loss temperature, aggregation; docs/FAMILY.md cites each): `--method M` applies them too, so
    that M alone runs as published; flags given still win."""

    @property
    def teacher_views(self) -> tuple[str, ...]:
        """Every view a teacher forward runs on, the positive teacher's first."""
        return (self.teacher_view,) + ((self.negative_view,) if self.negative_view else ())

    def check(self) -> None:
        """Refuses an inconsistent table entry (a programming error, not a user error)."""
        for view in (self.student_view, *self.teacher_views):
            assert view in VIEW_NAMES, f"{self.name}: unknown view {view!r}"
        assert isinstance(self.objective, ObjectiveSpec), self.name
        assert self.external_teachers in ("allowed", "required", "refused"), self.name
        if self.objective is not DAPD_SPEC:  # DAPD's loss is its own (opd.methods.dapd)
            check_loss(self.support, self.divergence)  # known names; an unnormalised support only with bc_rkl
        assert self.token_weight in TOKEN_WEIGHT_NAMES
        assert (self.token_weight in NEGATIVE_VIEW) == (self.negative_view is not None), self.name


FULL_QUERY = dict(policy="full", rho=1.0)
VERL = dict(warmup_steps=10, loss_agg="micro-batch")
"""Vision-OPD, OPD-V, RP-OPSD on verl: 10 warm-up steps (lr_warmup_steps / warmup_steps: 10), then constant; verl's
per-micro-batch token mean (RP-OPSD at one row per micro-batch: a per-sequence mean)."""
TRL_SAMPLING = dict(sample_temperature=1.1, sample_top_p=0.95, sample_top_k=20)
"""OPSD's (scripts/run_opsd.sh) and DAPD's rollout sampling."""
TRL_OPTIM = dict(lr_schedule="linear", weight_decay=0.0)
"""transformers' `TrainingArguments` defaults, which OPSD, DAPD and GKD (TRL trainers) keep: linear decay to 0, no
weight decay (the verl siblings' 0.01 is verl's)."""
SEVEN = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
"""OPSD's and DAPD's LoRA targets (run_opsd.sh; DAPD's train.py LORA_TARGETS): not the linear-attention layers."""

METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("bas-opd", "BAS-OPD (arXiv 2609.25891): Vision-OPD with a budgeted teacher", label=""),
        Method("vision-opd", "Vision-OPD (arXiv 2605.18740; VisionOPD/Vision-OPD)", settings=FULL_QUERY, recipe=VERL),
        Method(
            "rp-opsd", "RP-OPSD (arXiv 2607.24447; wmm7777/RP-OPSD, config/best.yaml)",
            student_view="half_resolution", teacher_view="full", support="teacher", divergence="bc_rkl",
            settings=dict(FULL_QUERY, alpha=1.0), recipe=dict(VERL, loss_agg="sequence-mean"),
        ),  # fmt: skip  (scripts/train.sh: ppo_micro_batch_size_per_gpu=1, no dynamic batch: verl's mean is per sequence)
        Method(
            "opd-v", "OPD-V (arXiv 2608.05131; aniri15/OPD-V, random-mask negative, trust-region)",
            negative_view="masked", token_weight="trust_region", settings=FULL_QUERY, recipe=VERL,
        ),  # fmt: skip
        Method(
            "opsd", "OPSD (arXiv 2601.18734; siyan-zhao/OPSD, fixed teacher; full-vocabulary JSD in its recipe)",
            teacher_view="reference_answer", support="teacher_renorm", settings=dict(FULL_QUERY, ema_tau=0.0),
            recipe=dict(
                TRL_SAMPLING, **TRL_OPTIM, lora_r=64, lora_alpha=128.0, lora_dropout=0.0, lora_targets=SEVEN, lr=2e-4,
                loss_temperature=1.1, support="full", loss_agg="sequence-mean",
            ),  # scripts/run_opsd.sh (commit d75fcc7); its main loss is the full-vocabulary JSD (--top_k_loss 0); dropout 0:
            # opsd_trainer.py's disable_dropout_in_model after the adapter is attached
        ),  # fmt: skip
        Method(
            "dapd", "DAPD (arXiv 2608.01735; uanu2002/DAPD, dapd/objective.py, dapd/trainer.py)",
            teacher_view="reference_answer", support="full", divergence="clamped_kl", objective=DAPD_SPEC,
            external_teachers="refused", settings=dict(FULL_QUERY, ema_tau=1.0, ema_every=100),
            recipe=dict(TRL_SAMPLING, **TRL_OPTIM, lora_r=64, lora_alpha=128.0, lora_dropout=0.0, lora_targets=SEVEN,
                        lr=5e-6, grad_clip=0.1, schedule_steps=500, dapd_context_thinking=True),  # fmt: skip
        ),  # fmt: skip
        Method(
            "gkd", "GKD (Agarwal et al. 2024, arXiv 2306.13649; TRL's GKDTrainer): on-policy distillation from a "
            "separate teacher checkpoint", teacher_view="full", support="full", external_teachers="required",
            settings=dict(FULL_QUERY, alpha=0.5),
            recipe=dict(TRL_OPTIM, sample_temperature=0.9, loss_temperature=1.0, lr=2e-5),
        ),  # fmt: skip  (TRL's GKDConfig: beta 0.5, temperature 0.9 for sampling only: GKDTrainer calls generalized_jsd_loss
        # without one; lr 2e-5 SFTConfig's)
        Method(
            "opod", "OPOD (arXiv 2607.20918; no public code, formulas transcribed: medium confidence)",
            teacher_view="full", token_weight="gate", objective=OPOD_SPEC, external_teachers="required",
            settings=FULL_QUERY,
        ),  # fmt: skip
        Method(
            "tm-opd", "Thinking Machines' on-policy distillation (thinking-machines-lab/tinker-cookbook, "
            "tinker_cookbook/distillation/train_on_policy.py; blog post 'On-Policy Distillation', 2025)",
            teacher_view="full", objective=TM_OPD_SPEC, external_teachers="required", settings=FULL_QUERY,
            recipe=dict(lora_r=128, lr=1e-4, rollouts_per_prompt=4, sample_temperature=1.0, weight_decay=0.0,
                        grad_clip=0.0, adam_beta2=0.95, loss_agg="token-sum"),
        ),  # fmt: skip  (recipes/distillation/on_policy_distillation.py; tinker's AdamParams; rl/train.py's optim step)
    )
}


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; known: {', '.join(METHODS)}")
    return METHODS[name]
