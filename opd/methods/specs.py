"""What the settings know of each objective, without its code: its name, its section, what it refuses.

`opd.config` builds train.py's flags and checks a run's settings from the method table (`opd.methods.table`), which
names each method's objective by its `ObjectiveSpec`; the objectives' code (`opd.methods.interface.Objective` and its
subclasses, torch) takes its class-level facts from these specs, and `opd.methods.objectives.objective_class` maps a
spec to its class. The objectives' own settings sections (DAPD's, OPOD's, TM-OPD's flags) live here for the same
reason: `train.py --help` loads them without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from opd.cli import Section


@dataclass(frozen=True)
class ObjectiveSpec:
    """An objective's class-level facts (`opd.methods.interface.Objective` has each as a class attribute)."""

    name: str
    """The prefix of its flags, its section in TrainConfig (`cfg.dapd`) and its trackers' namespace."""
    Config: type[Section] | None = None
    """Its settings section (flags `--<name>-<field>`), or None."""
    refuses: dict[str, str] = field(default_factory=dict)
    """The run's flags that do not apply to it, {flag name: reason}: `opd.config` refuses the run, naming the flag and
    the reason, when the field's value differs from TrainConfig's default, whether or not the flag was given; the
    method's own settings must leave these fields at their defaults."""
    needs_ema_teacher: str = ""
    """A reason when the objective anchors on the run's EMA teacher, so --ema-tau 0 (a fixed teacher) is refused;
    '': none."""
    aggregations: tuple[str, ...] = ()
    """The --loss-agg values it implements ((): every one of `opd.maths.loss.AGGREGATIONS`)."""


@dataclass
class DAPDConfig(Section):
    """DAPD's own settings (flags `--dapd-<field>`)."""

    temperature: float = 1.1
    """Temperature of both sides of the clamped forward KL (DAPD's 1.1)."""
    clip: float = 0.05
    """Upper clamp of each vocabulary entry's KL contribution (DAPD's 0.05)."""
    context_thinking: bool = False
    """The reference and rollout contexts with the thinking generation prompt (enable_thinking=True), as DAPD's code
    (dapd/data.py); the none context is the student's own prompt, with the run's --enable-thinking either way (DAPD's
    plain context has no thinking prompt: --enable-thinking off, the default, matches it). Off: every context with
    the run's --enable-thinking."""

    PREFIX = "dapd_"

    def check(self) -> list[str]:
        return [] if self.temperature > 0 and self.clip > 0 else ["--dapd-temperature and --dapd-clip must be positive"]


@dataclass
class OPODConfig(Section):
    """OPOD's own settings (flags `--opod-<field>`); each says whether its value is the paper's or a guess."""

    beta_init: float = 1.0
    """Initial strength beta_m of every teacher's gated term (not in the paper; a guess)."""
    beta_min: float = 0.1
    """Lower bound of beta_m (the paper's 0.1)."""
    beta_max: float = 2.0
    """Upper bound of beta_m (not in the paper; a guess)."""
    eta: float = 0.1
    """Controller rate eta of beta_m <- clip(beta_m + eta (mean c_m - eps_m)) (not in the paper; a guess)."""
    warmup: int = 10
    """Steps (with tokens of a teacher) whose mean gate sets that teacher's target eps_m (the paper's 10)."""
    eps_floor: float = 0.02
    """Floor of the controller target eps_m (the paper's 0.02)."""
    reward_a: float = 0.2
    """Weight of A (teacher confidence on a correct response) in r = r_task + 0.2 A + 0.1 B (the paper's)."""
    reward_b: float = 0.1
    """Weight of B (how much the response raises the teacher's log-prob of the answer); 0 skips its forwards."""
    reward_clip: float = 2.0
    """C, the clip of A to [-C, 0] and of B to [-C, C] (the paper's 2)."""
    pg_weight: float = 1.0
    """Weight of the group-relative policy-gradient term (the paper adds it unweighted)."""
    adv_eps: float = 1e-4
    """eps of the group advantage (r - mean) / (std + eps) (not in the paper; TRL's GRPO value)."""
    kl: float = 0.0
    """Weight of KL(pi_theta || pi_ref), pi_ref the initial policy (the paper's weight is unknown; 0 = off)."""

    PREFIX = "opod_"

    def check(self) -> list[str]:
        problems = []
        if not 0 < self.beta_min <= self.beta_init <= self.beta_max:
            problems.append(f"--opod-beta-min {self.beta_min}, --opod-beta-init {self.beta_init}, --opod-beta-max "
                            f"{self.beta_max}: need 0 < min <= init <= max")
        if self.warmup < 1 or self.reward_clip <= 0 or self.adv_eps <= 0 or self.kl < 0:
            problems.append("--opod-warmup must be >= 1, --opod-reward-clip and --opod-adv-eps > 0, --opod-kl >= 0")
        return problems


@dataclass
class TMOPDConfig(Section):
    """Thinking Machines' on-policy distillation's own settings (flags `--tm-opd-<field>`), their defaults theirs."""

    kl_coef: float = 1.0
    """lambda of A_t = -lambda (log pi_old - log pi_T) (their kl_penalty_coef, 1)."""
    discount: float = 0.0
    """gamma of the discounted future sum of the advantages (their kl_discount_factor, 0: none)."""

    PREFIX = "tm_opd_"

    def check(self) -> list[str]:
        problems = []
        if not self.kl_coef > 0:
            problems.append(f"--tm-opd-kl-coef {self.kl_coef}: must be > 0")
        if not 0 <= self.discount <= 1:
            problems.append(f"--tm-opd-discount {self.discount}: must lie in [0, 1]")
        return problems


DISTILL_SPEC = ObjectiveSpec("distill")
"""The family's distillation (`opd.methods.objective.Distillation`): every method that is a loss and a view."""
DAPD_SPEC = ObjectiveSpec(
    "dapd", DAPDConfig,
    refuses={"teacher_view": "its contexts are fixed: none, reference, rollout",
             "is_clip": "its clamped KL has no importance ratio",
             "loss_agg": "each pair is a token mean over its completion's tokens",
             "loss_temperature": "its clamped KL has its own temperature (--dapd-temperature)",
             "support": "its KL is over the full vocabulary",
             "estimator": "its reference completions' tokens over C, a Horvitz-Thompson denominator, are not counted; "
                          "--estimator hajek weighs its pairs"},
    needs_ema_teacher="its snapshot anchor is the run's EMA teacher, refreshed by --ema-tau (DAPD's 1)",
)  # fmt: skip
"""DAPD's six KL pairs against two anchors (`opd.methods.dapd.DAPD`)."""
OPOD_SPEC = ObjectiveSpec(
    "opod", OPODConfig, refuses={"loss_agg": "its gated term and policy gradient share one token mean"},
)  # fmt: skip
"""OPOD's gated distillation, controller and policy gradient (`opd.methods.opod.OPOD`)."""
TM_OPD_SPEC = ObjectiveSpec(
    "tm_opd", TMOPDConfig,
    refuses={"loss_temperature": "its advantages are the sampled tokens' log-probs at temperature 1",
             "is_clip": "its importance ratio is the loss itself (tinker's importance_sampling)"},
    aggregations=("token-sum", "token-mean"),
)  # fmt: skip
"""Thinking Machines' on-policy distillation (`opd.methods.tm_opd.TMOPD`)."""
