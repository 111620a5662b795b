"""The policy's optimizer (Algorithm 1, line 13): AdamW on the trained parameters and the
learning-rate schedule (--lr-schedule, --warmup-steps, --schedule-steps): transformers' schedulers (the peers' own:
verl's and TRL's warm-up, DAPD's linear decay), held at their end value after their span.

Where this departs from transformers: `get_cosine_schedule_with_warmup` is 0.5 (1 + cos(pi p)) with the progress
p = (s - w) / (T - w) unclamped, so past T steps its rate climbs back toward the peak (p = 1.5 gives half of it).
A run longer than its schedule (--schedule-steps below --steps, or a resume with a larger --steps: the span is
fixed when the run starts) would then train at a rising rate. Here every schedule is evaluated at min(s, T), so
linear and cosine stay at 0 after T, and constant stays constant (docs/TRAINING.md, "LoRA and the siblings'
recipes"). The gradient-norm clip is the step's own (`opd.loop.step.clip_gradients`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from opd.cli import Section

if TYPE_CHECKING:
    import torch

LR_SCHEDULES = ("constant", "linear", "cosine")
"""--lr-schedule's names (transformers.get_scheduler's, 'constant' becoming 'constant_with_warmup' with a warm-up)."""


@dataclass
class OptimConfig(Section):
    """The policy's AdamW, its gradient clip and its learning-rate schedule."""

    lr: float = 2e-6
    """AdamW learning rate of the policy (the peak of --lr-schedule)."""
    lr_schedule: str = "constant"
    """The learning rate over the steps (transformers' schedulers): constant, linear (to 0) or cosine (to 0), each
    after --warmup-steps of linear warm-up from 0."""
    warmup_steps: int = 0
    """Steps of linear warm-up (Vision-OPD, OPD-V, RP-OPSD: 10)."""
    schedule_steps: int = 0
    """Steps the schedule spans (its decay reaches 0 there); 0 = --steps (DAPD: a 500-step schedule)."""
    weight_decay: float = 0.01
    """AdamW weight decay of the policy."""
    grad_clip: float = 1.0
    """Gradient-norm clip of the policy update (not in the paper; the peers' 1.0); 0 = no clipping."""
    adam_beta1: float = 0.9
    """AdamW's beta1 (torch's default)."""
    adam_beta2: float = 0.999
    """AdamW's beta2 (torch's default; tinker's: 0.95)."""
    adam_eps: float = 1e-8
    """AdamW's epsilon (torch's default)."""

    def check(self) -> list[str]:
        problems = []
        if self.lr_schedule not in LR_SCHEDULES:
            problems.append(f"--lr-schedule {self.lr_schedule!r}: choose one of {', '.join(LR_SCHEDULES)}")
        if self.warmup_steps < 0 or self.schedule_steps < 0:
            problems.append("--warmup-steps and --schedule-steps must be >= 0")
        for flag, value in (("lr", self.lr), ("weight-decay", self.weight_decay)):
            if not value >= 0:  # NaN too
                problems.append(f"--{flag} {value}: must be >= 0")
        if not self.grad_clip >= 0:
            problems.append(f"--grad-clip {self.grad_clip}: must be >= 0 (0 = no clipping)")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1):
            problems.append(f"--adam-beta1 {self.adam_beta1} and --adam-beta2 {self.adam_beta2}: each must lie in [0, 1)")
        if not self.adam_eps > 0:
            problems.append(f"--adam-eps {self.adam_eps}: must be > 0")
        return problems

    def adamw(self, params) -> torch.optim.AdamW:
        import torch

        return torch.optim.AdamW(params, lr=self.lr, betas=(self.adam_beta1, self.adam_beta2), eps=self.adam_eps,
                                 weight_decay=self.weight_decay)  # fmt: skip


def lr_scheduler(optimizer: torch.optim.Optimizer, schedule: str, warmup_steps: int, span: int):
    """The LambdaLR of `schedule` over `span` steps with `warmup_steps` of linear warm-up from 0, held at its
    value of step `span` from there on: lr(s) = lr_peak * f(min(s, T))."""
    from transformers import get_scheduler

    name = "constant_with_warmup" if schedule == "constant" and warmup_steps else schedule
    span = max(1, span)
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=warmup_steps, num_training_steps=span)
    if name == "constant":  # f = 1 at every step: nothing to hold
        return scheduler
    inner = list(scheduler.lr_lambdas)  # transformers' f, one per parameter group
    # closures, so that LambdaLR.state_dict() stores none of them (transformers' partials are rebuilt here)
    scheduler.lr_lambdas = [lambda s, f=f: f(min(s, span)) for f in inner]
    return scheduler


def restore_group_lr(optimizer: torch.optim.Optimizer, scheduler) -> None:
    """Each parameter group's lr set to the scheduler's current one: needed when the optimizer's state was loaded
    before the scheduler was built (the sharded resume), since building a scheduler resets the groups' lr to
    the schedule's step 0 and `load_state_dict` restores only the scheduler's own counters."""
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr
