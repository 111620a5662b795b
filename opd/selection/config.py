"""The settings of selection: which rows of C the teacher scores (`SelectionConfig`: Eq. 4's budget and the policy
of Algorithm 1, lines 4-9) and the learned selector f_psi (`PredictorConfig`: Table 5, Eq. 6, 10, 12).

Their code is `opd.selection.selectors`, which needs torch to load (f_psi is a torch module); the two sections are
here, torch-free, so that train.py's settings (`opd.config`, --help, --print-config) load without it (tests/test_config.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from opd.cli import Section, flag_text

POLICIES = ("full", "random", "entropy", "learned")
ESTIMATORS = ("hajek", "ht")
"""Unbiased selection's normalisation of Eq. 11 (`SelectionConfig.estimator`): Hajek's ratio or Horvitz-Thompson."""
STRATA = ("none", "prompt")
"""Unbiased selection's design (`SelectionConfig.strata`): one sample from C, or one per prompt."""
INCLUSION_SIZES = ("score", "gradient")
"""What unbiased selection's pi is proportional to (`SelectionConfig.inclusion_size`, `inclusion_sizes`)."""


@dataclass
class SelectionConfig(Section):
    """Which rows of C the teacher scores: Eq. 4's budget and the policy of Algorithm 1, lines 4-9."""

    policy: str = "learned"
    """Selection policy: full, random, entropy or learned."""
    rho: float = 0.25
    """Query ratio rho in (0, 1]; the budget is K = floor(rho |C|) per step (Eq. 4)."""
    explore: float = 0.10
    """Exploration ratio eps of the learned selector: K_e = ceil(eps K); with --unbiased the uniform share of the
    inclusion probabilities."""
    unbiased: bool = False
    """Sample S with inclusion probabilities that grow with the score (learned: predicted utility; entropy: mean
    entropy) instead of taking the top K, and weigh each row's loss by 1 / pi (Eq. 11's Hajek form; opd/selection/designs.py)."""
    estimator: str = "hajek"
    """With --unbiased, how the 1 / pi-weighted token sum of Eq. 11 is normalised: hajek (by sum_S w_i T_i:
    consistent, biased O(1/K); today's runs) or ht (Horvitz-Thompson: by the tokens of every candidate in C, known
    before the teacher runs: exactly unbiased). Under --loss-agg token-sum both are the same weighted sum."""
    strata: str = "none"
    """With --unbiased: none (S one sample of K rows from C) or prompt (stratified: each prompt's candidates a
    stratum, K spread evenly over them, exactly K rows in all, per-stratum inclusion probabilities)."""
    inclusion_size: str = "score"
    """With --unbiased, what pi is proportional to before the uniform mix: score, or gradient (T_i sqrt(score), the
    predicted size of the row's gradient contribution: the variance-minimising rule, docs/SELECTION.md)."""
    max_per_prompt: int = 0
    """At most N rows of S per prompt (top-K and uniform policies); 0 = no cap."""
    no_exploration: bool = False
    """Ablation: learned selection without random exploration (K_e = 0)."""

    @property
    def epsilon(self) -> float:
        """eps of Algorithm 1, line 8 (0 under --no-exploration)."""
        return 0.0 if self.no_exploration else self.explore

    @property
    def label(self) -> str:
        """The table label: policy-percent, e.g. learned-25."""
        return f"{self.policy}-{round(100 * self.rho)}"

    def check(self) -> list[str]:
        problems = []
        if self.policy not in POLICIES:
            problems.append(f"--policy {self.policy!r}: choose one of {', '.join(POLICIES)}")
        if not 0.0 < self.rho <= 1.0:
            problems.append(f"--rho {self.rho}: the query ratio must lie in (0, 1]")
        if self.policy == "full" and self.rho != 1.0:
            problems.append(f"--policy full queries every candidate: it needs --rho 1, got {self.rho}")
        if not 0.0 <= self.explore < 1.0:
            problems.append(f"--explore {self.explore}: must lie in [0, 1)")
        if self.unbiased and self.policy == "random":
            problems.append("--unbiased with --policy random: uniform selection is already unbiased (every row has "
                            "pi = K / |C|)")
        elif self.unbiased and self.policy not in ("entropy", "learned"):
            problems.append(f"--unbiased samples by a score: it needs --policy entropy or learned, not {self.policy}")
        if self.unbiased and self.epsilon == 0:
            problems.append("--unbiased needs exploration (--explore > 0, no --no-exploration): rows scored 0 would "
                            "get pi = 0 and never be drawn, and the 1 / pi weighting would not be unbiased")
        if self.max_per_prompt < 0:
            problems.append(f"--max-per-prompt {self.max_per_prompt}: must be at least 1 (0 = no cap)")
        if self.unbiased and self.max_per_prompt:
            problems.append("--unbiased and --max-per-prompt: a cap would change the inclusion probabilities; choose one "
                            "(--strata prompt spreads an unbiased S over the prompts)")
        return problems + self.check_unbiased_design()

    def check_unbiased_design(self) -> list[str]:
        """--estimator, --strata, --inclusion-size: a known value, and other than the default only with --unbiased."""
        problems = []
        for flag, value, known, default in (("--estimator", self.estimator, ESTIMATORS, "hajek"),
                                            ("--strata", self.strata, STRATA, "none"),
                                            ("--inclusion-size", self.inclusion_size, INCLUSION_SIZES, "score")):  # fmt: skip
            if value not in known:
                problems.append(f"{flag} {value!r}: choose one of {', '.join(known)}")
            elif value != default and not self.unbiased:
                problems.append(f"{flag} {value} applies to sampled selection: it needs --unbiased")
        return problems


@dataclass
class PredictorConfig(Section):
    """Table 5 of the paper: the learned selector f_psi, its normalizer, replay and training (Eq. 6, 10, 12)."""

    seed: int = 0
    """Seed of the selector's initialisation and of every selection/replay draw."""
    lr: float = 1e-3
    """Adam learning rate of the selector."""
    hidden: int = 32
    """Hidden width of the selector MLP."""
    norm_momentum: float = 0.99
    """Momentum of the running feature normalizer."""
    norm_eps: float = 1e-6
    """Epsilon of the running normalizer's standard deviation."""
    replay_capacity: int = 512
    """FIFO replay capacity."""
    replay_start: int = 96
    """Labels in replay before the first selector update."""
    replay_batch: int = 256
    """Replay minibatch size."""
    updates_per_step: int = 2
    """Selector updates per step that brought new labels."""
    half_life: float = 10.0
    """Replay age half-life h in steps (recency weight 2^(-age/h))."""
    rank_weight: float = 0.2
    """Weight lambda_rank of the pairwise ranking loss (Eq. 10)."""
    min_gap: float = 1e-6
    """Minimum utility gap for a ranking pair."""
    no_rank_loss: bool = False
    """Ablation: selector trained without the ranking loss."""

    FLAGS = {"seed": "selector_seed", "lr": "selector_lr", "hidden": "selector_hidden",
             "updates_per_step": "selector_updates"}  # fmt: skip

    @property
    def rank_loss_weight(self) -> float:
        """lambda_rank of Eq. 10 as trained: 0 under --no-rank-loss."""
        return 0.0 if self.no_rank_loss else self.rank_weight

    def check(self) -> list[str]:
        problems = []
        for attr in ("lr", "rank_weight", "min_gap", "replay_start"):
            if not getattr(self, attr) >= 0:  # NaN too
                problems.append(f"{flag_text(self.flag_of(attr))} {getattr(self, attr)}: must be >= 0")
        for attr in ("hidden", "replay_capacity", "replay_batch", "updates_per_step"):
            if getattr(self, attr) < 1:
                problems.append(f"{flag_text(self.flag_of(attr))} {getattr(self, attr)}: must be at least 1")
        if not self.half_life > 0:
            problems.append(f"--half-life {self.half_life}: the replay's age half-life must be > 0 steps")
        if not 0.0 <= self.norm_momentum < 1.0:
            problems.append(f"--norm-momentum {self.norm_momentum}: must lie in [0, 1)")
        if not self.norm_eps > 0:
            problems.append(f"--norm-eps {self.norm_eps}: must be > 0")
        return problems
