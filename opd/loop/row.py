"""One step's ledger row, booked after the step from what it did (`StepOutcome`).

Collectives, run by every rank in the same order: the teachers' rows and tokens summed over ranks, the slowest rank's
seconds per teacher label and per phase; every rank returns the same row. Its fields: `opd.loop.ledger`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from opd.loop.ledger import PHASES


@dataclass
class StepOutcome:
    """What one step did on this rank (`opd.loop.step.Stepper.step` returns it), for its ledger row."""
    step: int
    t0: float  # the step's start (perf_counter)
    timer: object  # `opd.loop.step.PhaseTimer`: seconds per phase (`opd.loop.ledger.PHASES`)
    cand: object  # `opd.loop.step.Candidates`: C over all ranks
    budget: int  # K (Eq. 4)
    selected: torch.Tensor  # S, global row ids
    pi: torch.Tensor | None  # S's inclusion probabilities under a sampling design
    res: object  # the objective's `ObjectiveResult` (its teachers' costs, its metrics)
    loss: float  # the step's loss (summed over ranks)
    seconds: float  # the objective's wall time
    rows_scored: int  # the teachers' forward rows of this step on this rank
    grad_norm: float
    lr: float  # the rate the update used
    valid: bool  # whether the update was applied (finite loss and gradient)
    utility_mean: float  # the mean label u_i of S
    selector_metrics: dict


def ledger_row(acc, out: StepOutcome) -> dict:
    """The ledger row of a step's outcome `out` on every rank (`acc` the accelerator)."""
    device, res, timer = acc.device, out.res, out.timer
    timer.seconds["teacher_forward"] += res.teacher_s
    timer.seconds["student"] += out.seconds - res.teacher_s
    labels = list(res.teachers)  # the objective's labels, the same on every rank
    with timer("wait"):
        costs = [[c.rows, c.tokens, c.padded_tokens] for c in res.teachers.values()]
        counts = [out.rows_scored, *(x for c in costs for x in c)]
        sums = acc.reduce(torch.tensor(counts, device=device, dtype=torch.float64), "sum").cpu()
        view_s = [[c.seconds for c in res.teachers.values()]]
        view_s = acc.gather(torch.tensor(view_s, device=device, dtype=torch.float64)).cpu().max(0).values
    per_view = sums[1:].view(len(labels), 3).long()  # (labels, 3)
    with timer("wait"):
        phases = torch.tensor([[timer.seconds[p] for p in PHASES]], device=device, dtype=torch.float64)
        phases = acc.gather(phases).cpu().max(0).values  # the slowest rank's seconds per phase
    row = {**selection_fields(out), "teacher_rows": int(sums[0]), **coverage(out),
           "teacher_tokens": int(per_view[:, 1].sum()), "teacher_padded_tokens": int(per_view[:, 2].sum()),
           "loss": out.loss, "grad_norm": out.grad_norm, "lr": out.lr, "skipped": not out.valid,
           "utility_mean": out.utility_mean}  # fmt: skip
    pi = out.pi
    if pi is not None:
        row |= {"min_pi": float(pi.min()) if pi.numel() else float("nan"),
                "max_weight": float(1.0 / pi.min()) if pi.numel() else float("nan")}  # fmt: skip
    row |= {f"{p}_s": float(v) for p, v in zip(PHASES, phases)}
    row |= {k.split("/")[-1]: v for k, v in out.selector_metrics.items()}
    for lab, (rows_v, tokens_v, _), sec in zip(labels, per_view.tolist(), view_s.tolist()):
        row |= {f"teacher_rows_{lab}": rows_v, f"teacher_tokens_{lab}": tokens_v, f"teacher_forward_s_{lab}": sec}
    row |= res.metrics
    row["world_size"] = acc.num_processes
    row["step_s"] = time.perf_counter() - out.t0
    return row


def selection_fields(out) -> dict:
    """C and S of Algorithm 1, lines 4-9: rollouts, |C|, K, |S| and any overrun of K."""
    n = int(out.selected.numel())
    return {"step": out.step, "rollouts": int(out.cand.eligible.numel()), "candidates": out.cand.size,
            "budget": out.budget, "selected": n, "overrun": max(0, n - out.budget)}  # fmt: skip


def coverage(out) -> dict:
    """Prompt coverage: distinct prompts (and valid tokens) among C and in S."""
    cand, selected = out.cand, out.selected
    rows = cand.eligible.nonzero().squeeze(-1)
    return {
        "candidate_prompts": int(cand.prompt_of[rows].unique().numel()),
        "selected_prompts": int(cand.prompt_of[selected].unique().numel()),
        "scored_tokens": int(cand.lengths[selected].sum()),
        "candidate_tokens": int(cand.lengths[rows].sum()),
    }
