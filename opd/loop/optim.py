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

import torch
from transformers import get_scheduler

from opd.loop.settings import OptimConfig


def lr_scheduler(optimizer: torch.optim.Optimizer, schedule: str, warmup_steps: int, span: int):
    """The LambdaLR of `schedule` over `span` steps with `warmup_steps` of linear warm-up from 0, held at its
    value of step `span` from there on: lr(s) = lr_peak * f(min(s, T))."""
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


def adamw(cfg: OptimConfig, params) -> torch.optim.AdamW:
    """AdamW over `params` with the run's --lr, --adam-beta1/2, --adam-eps and --weight-decay."""
    return torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                             weight_decay=cfg.weight_decay)  # fmt: skip
