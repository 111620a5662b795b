"""Algorithm 1 of the paper, one step at a time, on every rank in lockstep: `Stepper.step` (lines 3-14).

    line 3       y_i ~ p_theta(. | x_i, q_i) for every prompt of this rank       `Sampler` (opd.engine.rollout)
    line 4       phi_i (Eq. 5), all-gathered; K = floor(rho |C|) (Eq. 4)         `rollout_features`, `query_budget`
    lines 5-9    S from the global candidates, before any teacher computation   `Selector.select` (opd.selection)
    lines 11-12  the teacher on this rank's rows of S; Eq. 11 backpropagated; labels u_i (Eq. 9)    `Objective`
    line 13      AdamW, then theta-bar <- (1 - tau) theta-bar + tau theta        `Stepper.update`, `after_update`
    line 14      the labels of S gathered, (phi_i, u_i) into replay, psi updated  `Selector.observe`

Every rank makes the same selection (a seed shared by the ranks), so every rank runs the same collectives in the same
order. C: the candidates, S: the selected rows, pi_i: a row's inclusion probability. The step returns what it did
(`StepOutcome`); its ledger row is booked after it (`opd.loop.row`). Details: docs/MODULES.md#opdloopstep."""

from __future__ import annotations

import math
import time
import warnings
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from opd.engine.rollout import Rollouts
from opd.loop.row import StepOutcome
from opd.models.ema_teacher import Stopwatch
from opd.selection.selectors import query_budget, rollout_features


class PhaseTimer:
    """Seconds per phase of one step (`opd.loop.ledger.PHASES`), the device's work included (`Stopwatch`)."""
    def __init__(self, device: torch.device):
        self.device, self.seconds = device, defaultdict(float)

    @contextmanager
    def __call__(self, phase: str):
        watch = Stopwatch(self.device)
        try:
            yield
        finally:
            self.seconds[phase] += watch.seconds()


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
    objective: object  # lines 11-13: the method's objective (`opd.methods.interface.Objective`)
    student: torch.nn.Module  # the policy as trained (DDP-wrapped or sharded)
    optimizer: object
    scheduler: object
    teachers: object  # the run's teacher set (its rows scored, for the ledger)
    warned_no_eligible: bool = False
    objective_keys: tuple = ()  # the objective's own ledger fields of the last step (its tracker namespace)

    def step(self, step: int, rollouts: Rollouts | None = None) -> StepOutcome:
        """Algorithm 1, lines 3-14, on every rank; `rollouts` may replace sampling (tests). Returns what it did."""
        acc, timer, t0 = self.acc, PhaseTimer(self.acc.device), time.perf_counter()
        with timer("prompt"):
            ids = self.prompts.ids(step)
            records = [self.records[i] for i in ids]
            student_prompts = self.prompts.student(records)
        has_entropy = True  # Line 3: y_i ~ p_theta(. | x_i, q_i) for every prompt of this rank.
        with timer("generation"):
            if rollouts is None:
                rollouts, has_entropy = self.sampler(step, records, student_prompts)
        # Line 4: detached features phi_i (Eq. 5), all-gathered so that every rank sees the global candidates C.
        area = torch.tensor([records[j].area_ratio for j in rollouts.prompt_index.tolist()])
        phi = rollout_features(rollouts.logp, rollouts.entropy, rollouts.response_mask, rollouts.prompt_len, area)
        with timer("wait"):
            cand = gather_candidates(acc, phi, self.prompts.candidates(records, rollouts), rollouts,
                                     torch.tensor([ids[j] for j in rollouts.prompt_index.tolist()]))  # fmt: skip
        budget = query_budget(self.rho, cand.size)  # Eq. 4: K = floor(rho |C|)
        self._warn_if_empty(step, cand)
        with timer("select"):  # Lines 5-9: S from the global candidates, before any teacher computation.
            selected, pi = self.selector.select(cand.phi, cand.eligible, budget, step, has_entropy, cand.prompt_of)
        local, weights = local_rows(selected, pi, acc.process_index, len(rollouts))
        # Lines 11-12: the teacher on this rank's rows of S only; the method's objective backpropagated.
        batch = self.prompts.batch(step, ids, rollouts, student_prompts, local, weights,
                                   self.selector.full_query_tokens(cand.lengths, cand.eligible))  # fmt: skip
        before, t_obj = self.rows_scored(), time.perf_counter()
        res = self.objective(batch)
        seconds = time.perf_counter() - t_obj
        with timer("wait"):
            loss = float(acc.reduce(torch.tensor(res.loss_share, device=acc.device, dtype=torch.float64), "sum"))
        with timer("optimizer"):
            grad_norm = clip_gradients(acc, self.student, self.grad_clip)
        rows_scored = self.rows_scored() - before
        lr, valid = self.update(step, timer, loss, grad_norm)  # Line 13: AdamW, then the teachers' update (if valid).
        # Line 14: the labels of S (gathered), replay and the selector's update, on every rank alike.
        with timer("wait"):
            utility = acc.gather(res.utility.to(acc.device)).cpu()  # (N,) NaN outside S
        with timer("selector"):
            metrics = self.selector.observe(cand.phi[selected], utility[selected], step)
        self.objective_keys = tuple(res.metrics)
        u_mean = float(utility[selected].nanmean()) if selected.numel() else float("nan")
        return StepOutcome(step, t0, timer, cand, budget, selected, pi, res, loss, seconds, rows_scored, grad_norm, lr,
                           valid, u_mean, metrics)  # fmt: skip

    def update(self, step: int, timer: PhaseTimer, loss: float, grad_norm: float) -> tuple[float, bool]:
        """Algorithm 1, line 13: AdamW and `after_update` if loss and gradient are finite; the schedule steps always.
        Returns (the rate this update used, whether it was applied)."""
        valid = math.isfinite(loss) and math.isfinite(grad_norm)
        if valid:
            with timer("optimizer"):
                self.optimizer.step()
            with timer("ema"):
                self.objective.after_update(step)
            self.sampler.updated()  # the vLLM engine gets the new weights before its next generation
        else:
            warnings.warn(f"step {step}: non-finite loss or gradient ({loss}, {grad_norm}); update and EMA skipped")
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        return lr, valid

    def rows_scored(self) -> int:
        """The teachers' forward rows so far on this rank (a shared teacher once)."""
        return sum(t.rows_scored for t in dict.fromkeys(self.teachers.teachers.values()))

    def _warn_if_empty(self, step: int, cand: Candidates) -> None:
        if cand.size == 0 and not self.warned_no_eligible:
            warnings.warn(f"step {step}: no crop-eligible rollout in the batch; training with zero distillation")
            self.warned_no_eligible = True
