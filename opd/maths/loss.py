"""The loss every objective shares: its settings (`LossConfig`) and Eq. 11's aggregation over S.

Every objective receives one `LossConfig`, resolved for the run's method (`for_method`) and the policy's vocabulary
(`for_vocabulary`: the fused kernel past `PLAIN_LOGITS_LIMIT`). The aggregation turns per-token divergences into
the step's loss:

    token-mean     sum_{i,t} z_i m_it D_it / sum_{i,t} z_i m_it                       (Eq. 11; BAS-OPD)
    sequence-mean  (1 / |S|) sum_{i in S} (1 / T_i) sum_t m_it D_it                     (OPSD)
    micro-batch    sum_b (n_b / |S|) sum_{i in b, t} m_it D_it / sum_{i in b, t} m_it   (verl)
    token-sum      sum_{i,t} z_i m_it D_it                                              (tinker)

The denominators are global (one all-reduce, run by every rank), so that the ranks' and micro-batches' parts add up
to the step's loss. The functions are `opd.maths.divergence`'s (Eq. 11) and, by name, `opd.maths.family`'s tables
(`SUPPORTS`, `AGGREGATION_WEIGHTS`, `DENOMINATORS`) and `opd.maths.weights.TOKEN_WEIGHTS`; this module holds only
settings and the names they accept (`check_loss`), so it loads without torch. Details: docs/MODULES.md#opdmathsloss."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from opd.cli import Section, resumable

PLAIN_LOGITS_LIMIT = 2**28
"""The most logits (rows x positions x vocabulary) the plain path holds per micro-batch and side before a run turns
the fused kernel on: 2^28 float32 values, 1 GiB (the plain path's peak is about five such tensors, docs/EQUATIONS.md)."""

AGGREGATIONS = ("token-mean", "sequence-mean", "micro-batch", "token-sum")
"""How Eq. 11 averages over S (`LossConfig.aggregation`, `--loss-agg`): see the module docstring."""
SUPPORT_NAMES = ("student_tail", "teacher", "teacher_renorm", "full")
"""The divergence's supports by name (`LossConfig.support`; their functions: `opd.maths.family.SUPPORTS`)."""
DIVERGENCES = ("jsd", "bc_rkl")
"""The family's divergences by name: the generalized JSD of Eq. 3, RP-OPSD's bias-corrected reverse KL
(`opd.maths.family.token_divergence`); DAPD's clamped forward KL is its own."""
TOKEN_WEIGHT_NAMES = ("none", "trust_region", "gate")
"""The methods' per-token weights by name (`LossConfig.token_weight`; their functions:
`opd.maths.weights.TOKEN_WEIGHTS`)."""
NEGATIVE_VIEW = ("trust_region",)
"""The token weights that read a second teacher view's log-probs (`opd.maths.weights.SampledLogp.negative`)."""


def check_loss(support: str, divergence: str) -> None:
    """ValueError for an unknown support or divergence, and for the teacher's top-k support without
    renormalisation under the JSD (its sides are not distributions; only 'bc_rkl' takes them)."""
    if support not in SUPPORT_NAMES:
        raise ValueError(f"unknown support {support!r}: use one of {', '.join(SUPPORT_NAMES)}")
    if divergence not in DIVERGENCES:
        raise ValueError(f"unknown divergence {divergence!r}: use one of {', '.join(DIVERGENCES)}")
    if support == "teacher" and divergence != "bc_rkl":
        raise ValueError(
            "support 'teacher' (the teacher's top-k, full softmax, no tail) is not a distribution: it goes only "
            "with divergence 'bc_rkl' (RP-OPSD); for the JSD use 'teacher_renorm' (OPSD) or 'student_tail'"
        )


@dataclass
class LossConfig(Section):
    """The divergence, its support and aggregation, and how its forwards are batched (shared by every objective)."""

    topk: int = 100
    """Top-k support of the distillation loss and the utility terms."""
    alpha: float = 0.5
    """Generalized JSD mixture weight (0.5: symmetric JSD); unused by rp-opsd's reverse KL."""
    support: str | None = None
    """The divergence's support (opd/maths/family.py: student_tail, teacher, teacher_renorm, full); none = the method's."""
    temperature: float = 1.0
    """Both sides' logits divided by it before the divergence (OPSD: 1.1); the utility labels use it too."""
    aggregation: str = "token-mean"
    """Eq. 11's aggregation: token-mean (one mean over S's tokens, BAS-OPD), sequence-mean (each row's token mean,
    averaged over rows: OPSD), micro-batch (a token mean per micro-batch, summed weighted by rows: verl's) or token-sum
    (the tokens' sum, no mean: tinker's, Thinking Machines' on-policy distillation)."""
    is_clip: float = 0.0
    """Importance-ratio clip c (Vision-OPD's is_clip 2): each token's loss times min(pi/pi_old, c); 0 = off."""
    micro_batch: int = resumable(4, unless=("loss_agg", "micro-batch"))
    """Most rows per student/teacher forward."""
    micro_batch_tokens: int = resumable(0, unless=("loss_agg", "micro-batch"))
    """Most padded teacher tokens per forward (rows grouped by length under it); 0 = rows only."""
    fused_kernel: bool = resumable(False)
    """The fused hidden-state kernel (opd/maths/chunked.py, the TRL/Liger use_liger_kernel convention): the LM head
    and the loss chunk by chunk, never a micro-batch's logits; off, the plain path (autograd through
    opd/maths/divergence.py on one micro-batch's logits). The paper-4b/-9b presets turn it on; a run whose plain
    path would hold more than PLAIN_LOGITS_LIMIT logits turns it on itself, saying so in one line."""
    chunk: int = resumable(512)
    """Response positions per LM-head chunk of the fused kernel (--fused-kernel; 0: the plain path)."""
    no_overlap: bool = False
    """Ablation: utility without the top-k overlap factor (o = 1)."""
    no_confidence: bool = False
    """Ablation: utility without the teacher-confidence factor (c = 1)."""
    divergence: str = "jsd"
    """The method's divergence ('jsd': Eq. 3 with alpha; 'bc_rkl'; 'clamped_kl'): set by the method table."""
    token_weight: str = "none"
    """The method's per-token weight (a name of `TOKEN_WEIGHT_NAMES`): set by the method table."""

    kernel: bool = dataclasses.field(default=False, init=False)
    """Whether the family's distillation runs the fused kernel (on, with a chunk) or the plain path: set from
    fused_kernel and chunk when the settings are made (not a flag)."""

    FLAGS = {"temperature": "loss_temperature", "aggregation": "loss_agg", "chunk": "loss_chunk"}
    INTERNAL = ("divergence", "token_weight", "kernel")

    def __post_init__(self):
        self.kernel = self.fused_kernel and self.chunk > 0

    def for_method(self, method) -> LossConfig:
        """These settings for `method` (`opd.methods.table.Method`): its support unless --support names one, its divergence
        and token weight."""
        return dataclasses.replace(self, support=self.support or method.support, divergence=method.divergence,
                                   token_weight=method.token_weight)  # fmt: skip

    def for_vocabulary(self, vocab: int, max_response_len: int) -> tuple[LossConfig, str | None]:
        """These settings for a policy of `vocab` ids: the fused kernel turned on, with a one-line message, when the
        plain path's micro-batch logits (micro_batch x max_response_len x vocab, per side) exceed PLAIN_LOGITS_LIMIT."""
        held = self.micro_batch * max_response_len * vocab
        if self.kernel or held <= PLAIN_LOGITS_LIMIT:
            return self, None
        note = (f"--fused-kernel on: the plain path would hold {held:,} logits per micro-batch and side "
                f"(--micro-batch {self.micro_batch} x {max_response_len} positions x {vocab:,} ids > "
                f"{PLAIN_LOGITS_LIMIT:,}); the loss runs --loss-chunk {self.chunk or 512} positions at a time")
        return dataclasses.replace(self, fused_kernel=True, chunk=self.chunk or 512), note

    def check(self) -> list[str]:
        problems = []
        if not 0.0 <= self.alpha <= 1.0:
            problems.append(f"--alpha {self.alpha}: must lie in [0, 1]")
        if self.topk < 2:
            problems.append(f"--topk {self.topk}: must be at least 2")
        if not self.temperature > 0:
            problems.append(f"--loss-temperature {self.temperature}: must be > 0")
        if self.aggregation not in AGGREGATIONS:
            problems.append(f"--loss-agg {self.aggregation!r}: choose one of {', '.join(AGGREGATIONS)}")
        if not self.is_clip >= 0:  # NaN too
            problems.append(f"--is-clip {self.is_clip}: must be >= 0 (0 = off)")
        if self.micro_batch < 1:
            problems.append(f"--micro-batch {self.micro_batch}: must be at least 1")
        if self.micro_batch_tokens < 0 or self.chunk < 0:
            problems.append("--micro-batch-tokens and --loss-chunk must be >= 0")
        return problems

    def check_support(self, divergence: str) -> list[str]:
        """--support against the method's divergence (an unnormalised support only with 'bc_rkl')."""
        if self.support is None:
            return []
        try:
            check_loss(self.support, divergence)
        except ValueError as exc:
            return [f"--support {self.support!r}: {exc}"]
        return []
