"""Algorithm 1 of the paper, one step at a time, on every rank in lockstep: `Stepper.step` (lines 3-14).

    line 3       y_i ~ p_theta(. | x_i, q_i) for every prompt of this rank       `Sampler` (opd.engine.rollout)
    line 4       phi_i (Eq. 5), all-gathered; K = floor(rho |C|) (Eq. 4)         `rollout_features`, `query_budget`
    lines 5-9    S from the global candidates, before any teacher computation   `Selector.select` (opd.selection)
    lines 11-12  the teacher on this rank's rows of S; Eq. 11 backpropagated; labels u_i (Eq. 9)    `Objective`
    line 13      AdamW, then theta-bar <- (1 - tau) theta-bar + tau theta        `Stepper.update`, `after_update`
    line 14      the labels of S gathered, (phi_i, u_i) into replay, psi updated  `Selector.observe`

Every rank makes the same selection (a seed shared by the ranks), so every rank runs the same collectives in the same
order. C: the candidates, S: the selected rows, pi_i: a row's inclusion probability; `LedgerRow`: the step's ledger row.
Details: docs/MODULES.md#opdloopstep.
"""

from __future__ import annotations

import math
import time
import warnings
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from opd.engine.rollout import Rollouts
from opd.selection.selectors import query_budget, rollout_features
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
        self.coverage = {  # prompt coverage: distinct prompts (and tokens) among C and in S
            "candidate_prompts": int(cand.prompt_of[rows].unique().numel()),
            "selected_prompts": int(cand.prompt_of[selected].unique().numel()),
            "scored_tokens": int(cand.lengths[selected].sum()),
            "candidate_tokens": int(cand.lengths[rows].sum()),
        }
        self.pi = pi

    def objective(self, res, loss: float, seconds: float, rows_scored: int) -> None:
        """Algorithm 1, lines 11-12 (collectives, every rank): teacher rows and tokens summed over ranks, seconds the
        slowest rank's; `seconds` the objective's wall time, `rows_scored` the teachers' rows this step."""
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


@dataclass
class Candidates:
    """The step's rows over all ranks (rank 0's first): features phi (Eq. 5), eligibility (C), lengths, prompts."""
    phi: torch.Tensor  # (N, 6)
    eligible: torch.Tensor  # (N,) bool
    lengths: torch.Tensor  # (N,) valid response tokens
    prompt_of: torch.Tensor  # (N,) record ids

    @property
    def size(self) -> int:
        """|C|."""
        return int(self.eligible.sum())


def gather_candidates(acc, phi_local, eligible_local, rollouts: Rollouts, prompt_ids: torch.Tensor) -> Candidates:
    """Algorithm 1, line 4 over all ranks: this rank's rows all-gathered (four collectives, every rank)."""
    device = acc.device
    return Candidates(
        acc.gather(phi_local.to(device)).cpu(),  # (N, 6)
        acc.gather(eligible_local.long().to(device)).cpu().bool(),  # (N,)
        acc.gather(rollouts.lengths.to(device)).cpu(),  # (N,)
        acc.gather(prompt_ids.to(device)).cpu(),  # (N,)
    )


def local_rows(selected: torch.Tensor, pi: torch.Tensor | None, rank: int, n_local: int):
    """This rank's rows of S (local ids) and its rows' loss weights: 1 / pi_i on S (Eq. 11), else 1; None without pi."""
    offset = rank * n_local
    mine = (selected >= offset) & (selected < offset + n_local)
    local = selected[mine] - offset
    weights = None
    if pi is not None:
        weights = torch.ones(n_local, dtype=torch.float64)
        weights[local] = 1.0 / pi[mine]
    return local, weights


def clip_gradients(accelerator, student, max_norm: float) -> float:
    """The trained parameters' global gradient norm, clipped to `max_norm` (0: no clip); a missing grad is zeroed."""
    trained = [p for p in student.parameters() if p.requires_grad]  # LoRA: the adapter only
    for p in trained:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    norm = accelerator.clip_grad_norm_(trained, max_norm or math.inf)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # sharded: a DTensor, the global norm


@dataclass
class Stepper:
    """Algorithm 1's step and update over a run's parts (built by `opd.run.Run`)."""
    acc: object  # the accelerator (DDP, or FSDP2 with --fsdp)
    rho: float  # the query ratio of Eq. 4
    grad_clip: float  # the gradient-norm clip before AdamW (0: none)
    records: list
    prompts: object  # `opd.data.records.Prompts`: each step's records, the student's and the teachers' inputs, C
    sampler: object  # line 3 (`opd.engine.rollout.Sampler`; vLLM's: `opd.engine.vllm_sampler`)
    selector: object  # lines 4-10 and 14 (`opd.selection.selectors.Selector`)
    objective: object  # lines 11-13: the method's objective (`opd.methods.objective.Objective`)
    student: torch.nn.Module  # the policy as trained (DDP-wrapped or sharded)
    optimizer: object
    scheduler: object
    teachers: object  # the run's teacher set (its rows scored, for the ledger)
    warned_no_eligible: bool = False
    objective_keys: tuple = ()  # the objective's own ledger fields of the last step (its tracker namespace)

    def step(self, step: int, rollouts: Rollouts | None = None) -> dict:
        """Algorithm 1, lines 3-14, on every rank; `rollouts` may replace sampling (tests). Returns the ledger row."""
        ledger, acc = LedgerRow(self.acc, step), self.acc
        with ledger.phase("prompt"):
            ids = self.prompts.ids(step)
            records = [self.records[i] for i in ids]
            student_prompts = self.prompts.student(records)
        has_entropy = True  # Line 3: y_i ~ p_theta(. | x_i, q_i) for every prompt of this rank.
        with ledger.phase("generation"):
            if rollouts is None:
                rollouts, has_entropy = self.sampler(step, records, student_prompts)
        # Line 4: detached features phi_i (Eq. 5), all-gathered so that every rank sees the global candidates C.
        area = torch.tensor([records[j].area_ratio for j in rollouts.prompt_index.tolist()])
        phi = rollout_features(rollouts.logp, rollouts.entropy, rollouts.response_mask, rollouts.prompt_len, area)
        with ledger.phase("wait"):
            cand = gather_candidates(acc, phi, self.prompts.candidates(records, rollouts), rollouts,
                                     torch.tensor([ids[j] for j in rollouts.prompt_index.tolist()]))  # fmt: skip
        budget = query_budget(self.rho, cand.size)  # Eq. 4: K = floor(rho |C|)
        self._warn_if_empty(step, cand)
        with ledger.phase("select"):  # Lines 5-9: S from the global candidates, before any teacher computation.
            selected, pi = self.selector.select(cand.phi, cand.eligible, budget, step, has_entropy, cand.prompt_of)
        ledger.candidates(cand, budget, selected, pi)
        local, weights = local_rows(selected, pi, acc.process_index, len(rollouts))
        # Lines 11-12: the teacher on this rank's rows of S only; the method's objective backpropagated.
        batch = self.prompts.batch(step, ids, rollouts, student_prompts, local, weights,
                                   self.selector.full_query_tokens(cand.lengths, cand.eligible))  # fmt: skip
        before, t0 = self.rows_scored(), time.perf_counter()
        res = self.objective(batch)
        seconds = time.perf_counter() - t0
        with ledger.phase("wait"):
            loss = float(acc.reduce(torch.tensor(res.share, device=acc.device, dtype=torch.float64), "sum"))
        with ledger.phase("optimizer"):
            grad_norm = clip_gradients(acc, self.student, self.grad_clip)
        ledger.objective(res, loss, seconds, self.rows_scored() - before)
        self.update(step, ledger, loss, grad_norm)  # Line 13: AdamW, then the teachers' update (a valid step only).
        # Line 14: the labels of S (gathered), replay and the selector's update, on every rank alike.
        with ledger.phase("wait"):
            utility = acc.gather(res.utility.to(acc.device)).cpu()  # (N,) NaN outside S
        with ledger.phase("selector"):
            metrics = self.selector.observe(cand.phi[selected], utility[selected], step)
        ledger.selector(float(utility[selected].nanmean()) if selected.numel() else float("nan"), metrics)
        self.objective_keys = tuple(res.metrics)
        return ledger.row()

    def update(self, step: int, ledger: LedgerRow, loss: float, grad_norm: float) -> None:
        """Algorithm 1, line 13: AdamW and `after_update` if loss and gradient are finite; the schedule steps always."""
        valid = math.isfinite(loss) and math.isfinite(grad_norm)
        if valid:
            with ledger.phase("optimizer"):
                self.optimizer.step()
            with ledger.phase("ema"):
                self.objective.after_update(step)
            self.sampler.updated()  # the vLLM engine gets the new weights before its next generation
        else:
            warnings.warn(f"step {step}: non-finite loss or gradient ({loss}, {grad_norm}); update and EMA skipped")
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]  # the rate this step's update used
        self.scheduler.step()
        ledger.update(grad_norm, lr, valid)

    def rows_scored(self) -> int:
        """The teachers' forward rows so far on this rank (a shared teacher once)."""
        return sum(t.rows_scored for t in dict.fromkeys(self.teachers.teachers.values()))

    def _warn_if_empty(self, step: int, cand: Candidates) -> None:
        if cand.size == 0 and not self.warned_no_eligible:
            warnings.warn(f"step {step}: no crop-eligible rollout in the batch; training with zero distillation")
            self.warned_no_eligible = True
