"""The family's objective: every method that is a loss and a view (`opd.methods.table`: BAS-OPD, Vision-OPD, RP-OPSD,
OPD-V, OPSD, GKD).

Each step it runs the family's distillation pass on S (`opd.methods.objective.distill`: Eq. 1, 2, 3, 9 and 11 against the
run's teacher(s) in the method's views, support, divergence and token weight), and after a valid update it moves the
teachers (Algorithm 1, line 13: the EMA, every --ema-every steps; a frozen teacher does not move).
"""

from __future__ import annotations

from collections.abc import Callable
from types import MethodType

import torch

from opd.data.records import StepBatch
from opd.methods.objective import Objective, ObjectiveResult, distill, distill_labels
from opd.methods.specs import DISTILL_SPEC
from opd.models.ema_teacher import update_due


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
