"""The models' settings, torch-free (`train.py --help` and a config's checks import nothing heavy): the policy's
checkpoint and how it is held (`opd.loop.build`, `opd.models.loading`, `opd.models.sharding`), the EMA self-teacher
(`opd.models.ema_teacher`), LoRA (`opd.models.lora`)."""

from __future__ import annotations

from dataclasses import dataclass

from opd.cli import Section, resumable

DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64")
"""--dtype's choices: `opd.models.loading.DTYPES`'s names, here without torch (a settings check imports nothing
heavy)."""


GENERATION_MODES = ("gathered", "layerwise")
"""--fsdp-generation's choices: `opd.models.sharding.GENERATION`, here without torch."""


@dataclass
class ModelConfig(Section):
    """The policy's checkpoint and how it is held: dtype, mixed precision, activation recomputation, sharding."""

    model: str | None = None
    """HF image-text-to-text checkpoint (folder or hub id), a train.py run folder, or a built-in name: 'toy' (the
    default preset's: the toy world's base, trained on crops) or 'tiny' (a random-weight tiny Qwen3.5); none (--preset
    tiny): the tiny one."""
    dtype: str = "float32"
    """Weight dtype of policy and teacher (float32 keeps lr 2e-6 updates representable)."""
    mixed_precision: str = "no"
    """Autocast of the forwards: no, bf16 or fp16 (weights stay in --dtype)."""
    grad_checkpointing: bool = resumable(False)
    """Recompute activations in backward (long responses on a real model)."""
    fsdp: bool = False
    """Shard the policy, its gradients and AdamW state, and the EMA teacher over the processes (FSDP2, torch's
    fully_shard) instead of replicating them (DDP); checkpoints are then sharded."""
    fsdp_generation: str = resumable("gathered")
    """With --fsdp: 'gathered' all-gathers the policy once per generate() call; 'layerwise' gathers it layer by layer
    at every generated token (less memory, far more communication)."""

    def check(self) -> list[str]:  # torch-free: a bad --config answers before any heavy import
        problems = []
        if self.mixed_precision not in ("no", "bf16", "fp16"):
            problems.append(f"--mixed-precision {self.mixed_precision!r}: choose no, bf16 or fp16")
        if self.dtype not in DTYPE_NAMES:
            problems.append(f"--dtype {self.dtype!r}: choose one of {', '.join(DTYPE_NAMES)}")
        if self.fsdp_generation not in GENERATION_MODES:
            problems.append(f"--fsdp-generation {self.fsdp_generation!r}: choose one of {', '.join(GENERATION_MODES)}")
        return problems


@dataclass
class EMAConfig(Section):
    """How the self-teacher moves (Algorithm 1, line 13): theta-bar <- (1 - tau) theta-bar + tau theta."""

    tau: float = 0.05
    """EMA rate tau of the crop teacher, applied after each valid update."""
    every: int = 1
    """Apply the teacher update every N steps (1: the EMA of every step; DAPD's snapshot: 100, with --ema-tau 1)."""

    PREFIX = "ema_"

    def check(self) -> list[str]:
        problems = []
        if not 0.0 <= self.tau <= 1.0:
            problems.append(f"--ema-tau {self.tau}: the EMA rate must lie in [0, 1] (0: a fixed teacher, 1: a copy)")
        if self.every < 1:
            problems.append(f"--ema-every {self.every}: must be at least 1")
        return problems


DEFAULT_TARGETS = (
    r".*language_model.*\.(self_attn\.(q_proj|k_proj|v_proj|o_proj)|mlp\.(gate_proj|up_proj|down_proj)"
    r"|linear_attn\.(in_proj_qkv|in_proj_z|out_proj))"
)
"""The language model's linear layers (Qwen3.5: full and linear attention, MLP), as a regex over module names."""


@dataclass
class LoRAConfig(Section):
    """LoRA's settings (train.py's --lora-*): 0 = full fine-tuning (BAS-OPD's)."""

    r: int = 0
    """LoRA rank (peft; opd/models/lora.py): 0 = full fine-tuning (BAS-OPD's); else the policy trains an adapter on a frozen
    base and its teachers are that base with another adapter (EMA) or none (fixed, DAPD's base)."""
    alpha: float = 0.0
    """LoRA alpha: the adapter's output times alpha / r; 0 = 2 r (OPSD's 128 for r 64)."""
    dropout: float = 0.0
    """Dropout on the adapter's input in the student's forwards (teachers run without it)."""
    targets: str = DEFAULT_TARGETS
    """Modules LoRA adapts: a regex over module names, or comma-separated module names (default: the language
    model's attention, MLP and linear-attention projections)."""

    PREFIX = "lora_"

    @property
    def scale_alpha(self) -> float:
        return self.alpha or 2.0 * self.r

    def check(self) -> list[str]:
        problems = []
        if self.r < 0:
            problems.append(f"--lora-r {self.r}: must be >= 0 (0 = full fine-tuning)")
        if self.alpha < 0:
            problems.append(f"--lora-alpha {self.alpha}: must be >= 0 (0 = 2 r)")
        if not 0 <= self.dropout < 1:
            problems.append(f"--lora-dropout {self.dropout}: must lie in [0, 1)")
        if self.r == 0:
            unused = [f for f, v in (("alpha", self.alpha), ("dropout", self.dropout), ("targets", self.targets))
                      if v != getattr(LoRAConfig, f)]  # fmt: skip
            problems += [f"--lora-{f} has no effect without --lora-r (full fine-tuning): give --lora-r N to train "
                         "an adapter, or drop it" for f in unused]  # fmt: skip
        return problems
