"""The ledger row of one step (DIR/ledger.jsonl, Appendix C's cost ledger), gathered as the step runs.

The step (`opd.loop.step.Stepper`) hands `LedgerRow` what each line of Algorithm 1 produced; the row times the
phases (`phase`), sums the teacher's cost over ranks and keeps the slowest rank's seconds. Every method here runs the
same collectives on every rank, in the same order (`objective`: one all-reduce of the counts, one all-gather of the
teacher seconds; `row`: one all-gather of the phases).

Fields: step, rollouts, candidates |C|, budget K (Eq. 4), selected |S|, overrun max(0, |S| - K), teacher_rows
(teacher forward rows), candidate_prompts / selected_prompts (distinct prompts in C and in S), scored_tokens and
candidate_tokens (response tokens of S and of C), teacher_tokens / teacher_padded_tokens (teacher input tokens,
real and with padding), loss (Eq. 11 or the method's), grad_norm, lr (the rate of this step's update), skipped (a
non-finite update), utility_mean (mean u_i over S, Eq. 9), min_pi / max_weight (unbiased selection), the phases'
seconds (`opd.loop.ledger.PHASES`), the selector's metrics, per teacher label its rows, tokens and forward seconds,
the objective's own metrics, world_size and step_s.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from opd.loop.ledger import PHASES


class PhaseTimer:
    """Seconds per phase of one step; on CUDA the device is synchronised at each phase boundary."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.seconds: dict[str, float] = defaultdict(float)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def __call__(self, phase: str):
        self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[phase] += time.perf_counter() - t0


class LedgerRow:
    """One step's ledger row on this rank (the same row on every rank once gathered)."""

    def __init__(self, accelerator, step: int):
        self.acc, self.device = accelerator, accelerator.device
        self.t0 = time.perf_counter()
        self.timer = PhaseTimer(self.device)
        self.fields: dict = {"step": step}

    @contextmanager
    def phase(self, name: str):
        """Times the block as phase `name` (`opd.loop.ledger.PHASES`)."""
        with self.timer(name):
            yield

    def candidates(self, cand, budget: int, selected: torch.Tensor, pi: torch.Tensor | None) -> None:
        """C and S (global row ids) of Algorithm 1, lines 4-9."""
        rows = cand.eligible.nonzero().squeeze(-1)
        self.fields |= {
            "rollouts": int(cand.eligible.numel()),
            "candidates": int(rows.numel()),
            "budget": budget,
            "selected": int(selected.numel()),
            "overrun": max(0, int(selected.numel()) - budget),
        }
        # prompt coverage: distinct prompts among the candidates C and in S (a top-K spending the budget on a few
        # prompts shows as selected_prompts far below min(K, candidate_prompts))
        self.coverage = {
            "candidate_prompts": int(cand.prompt_of[rows].unique().numel()),
            "selected_prompts": int(cand.prompt_of[selected].unique().numel()),
            "scored_tokens": int(cand.lengths[selected].sum()),
            "candidate_tokens": int(cand.lengths[rows].sum()),
        }
        self.pi = pi

    def objective(self, res, loss: float, seconds: float, rows_scored: int) -> None:
        """The objective's result on this rank (Algorithm 1, lines 11-12): its teacher forwards (rows, real and padded
        tokens, summed over ranks; seconds, the slowest rank's), and the step's loss (the ranks' shares summed by the
        step). `seconds` the objective's wall time (teacher and student), `rows_scored` the teachers' rows this step."""
        self.timer.seconds["teacher_forward"] += res.teacher_s
        self.timer.seconds["student"] += seconds - res.teacher_s
        self.labels = list(res.teachers)  # the objective's labels, the same on every rank
        self.metrics = res.metrics
        with self.phase("wait"):
            costs = [[c.rows, c.tokens, c.padded_tokens] for c in res.teachers.values()]
            counts = [rows_scored, *(x for c in costs for x in c)]
            sums = self.acc.reduce(torch.tensor(counts, device=self.device, dtype=torch.float64), "sum").cpu()
            view_s = [c.seconds for c in res.teachers.values()]
            view_s = self.acc.gather(torch.tensor([view_s], device=self.device, dtype=torch.float64)).cpu().max(0).values
        self.loss, self.teacher_rows = loss, int(sums[0])
        self.per_view = sums[1:].view(len(self.labels), 3).long()  # (labels, 3)
        self.view_s = view_s

    def update(self, grad_norm: float, lr: float, valid: bool) -> None:
        """Algorithm 1, line 13: the update's gradient norm and rate, and whether it was applied."""
        self.applied = {"grad_norm": grad_norm, "lr": lr, "skipped": not valid}

    def selector(self, utility_mean: float, metrics: dict) -> None:
        """Algorithm 1, line 14: the mean label of S and the selector's metrics."""
        self.utility_mean, self.selector_metrics = utility_mean, metrics

    def row(self) -> dict:
        """The ledger row (gathers the slowest rank's phase seconds: a collective, run by every rank)."""
        with self.phase("wait"):
            phases = torch.tensor([[self.timer.seconds[p] for p in PHASES]], device=self.device, dtype=torch.float64)
            phases = self.acc.gather(phases).cpu().max(0).values  # the slowest rank's seconds per phase
        pi = self.pi
        row = {
            **self.fields, "teacher_rows": self.teacher_rows, **self.coverage,
            "teacher_tokens": int(self.per_view[:, 1].sum()),
            "teacher_padded_tokens": int(self.per_view[:, 2].sum()),
            "loss": self.loss, **self.applied, "utility_mean": self.utility_mean,
        }  # fmt: skip
        if pi is not None:
            row |= {"min_pi": float(pi.min()) if pi.numel() else float("nan"),
                    "max_weight": float(1.0 / pi.min()) if pi.numel() else float("nan")}  # fmt: skip
        row |= {f"{p}_s": float(v) for p, v in zip(PHASES, phases)}
        row |= {k.split("/")[-1]: v for k, v in self.selector_metrics.items()}
        for lab, (rows_v, tokens_v, _), sec in zip(self.labels, self.per_view.tolist(), self.view_s.tolist()):
            row |= {f"teacher_rows_{lab}": rows_v, f"teacher_tokens_{lab}": tokens_v, f"teacher_forward_s_{lab}": sec}
        row |= self.metrics
        row["world_size"] = self.acc.num_processes
        row["step_s"] = time.perf_counter() - self.t0
        return row
