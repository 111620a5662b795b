"""The part-4 study's two selection arms that train.py does not have, and its measurement of Eq. 7-9's factors
(docs/SELECTION.md, "Part 4"). Each is a hook `harness.experiment.train_one` attaches to a run (job["hook"]).

- Oracle-25 (`Oracle`): S = the top K of C by the true utility u_i (Eq. 9, the teacher on every candidate, as the
  selection audit computes it) each step: the ceiling of any selector of this label. It breaks the budget's rule
  on purpose: its teacher sees all of C (its cost is Full's plus S's; the ledger counts only S's rows).
- Learned-25 with diminishing returns per prompt (`Diminishing`, this study's own design): after f_psi's first update,
  the K - K_e exploit rows are picked greedily by u^_i gamma^(rows of i's prompt already in S) (u^ shifted to be
  positive), then K_e uniform picks; before it, Learned-25's uniform picks. Rows of one prompt point the same way
  (SELECTION.md's mechanism), so a prompt's second row is worth less than another prompt's first.
- `factors`: per candidate row of held batches, the masked means of d (Eq. 7), o (top-k overlap) and c (Eq. 8) on the
  run's support k, at the run's start (seed 0 of Full: the base) and end: the spread of each factor over C, as row
  means and at each row's most divergent token.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from harness.audit import AuditContext, HeldBatch, _micro_batches, _preserved, held_records, sample_batch, score_utility
from opd.maths.divergence import utility_terms
from opd.models.chat import response_logits
from opd.engine.rollout import seeded_generator
from opd.selection.selectors import exploration_count, top_subset, uniform_subset
from opd.data.sources import load_records

LARGE_MIN = 24
"""The smallest large target side (`harness.regime.RegimeConfig.large_min`, the study's worlds' value)."""
GAMMA = 0.5
"""Diminishing returns: a prompt's n-th row in S scores u^ x GAMMA^(n-1)."""


class Captured:
    """The run's sampler, keeping each step's (records, rollouts, student prompts) on the hook (`seen`)."""

    def __init__(self, sampler, hook):
        self.sampler, self.hook = sampler, hook

    def __call__(self, step, records, prompts):
        rollouts, has_entropy = self.sampler(step, records, prompts)
        self.hook.seen = (records, rollouts, prompts)
        return rollouts, has_entropy

    def __getattr__(self, name):
        return getattr(self.sampler, name)


class Hook:
    """Captures each step's records, rollouts and student prompts (the sampler's call) for the arms below, and
    measures the factors at the run's start and end (job["factors"]: held batches; 0 for none)."""

    def __init__(self, run, job: dict):
        self.run, self.job, self.seen = run, job, None
        self.ctx = AuditContext.of(run)
        run.stepper.sampler = Captured(run.stepper.sampler, self)
        self.original = run.selector.select
        run.selector.select = self.select
        self.out = Path(job["folder"])
        self.mix: dict = {"C": {}, "S": {}}
        if job.get("factors_start"):
            self.measure("start")

    def select(self, phi, eligible, budget, step, has_entropy=True, prompt_of=None):
        chosen, pi = self.choose(phi, eligible, budget, step, has_entropy, prompt_of)
        self.tally(eligible, chosen)
        return chosen, pi

    def choose(self, phi, eligible, budget, step, has_entropy=True, prompt_of=None):
        """S (and pi) of the run's own policy; the arms below override it."""
        return self.original(phi, eligible, budget, step, has_entropy, prompt_of)

    def tally(self, eligible: torch.Tensor, chosen: torch.Tensor) -> None:
        """Counts the kinds of rows (harmful, small, large) in C and in S over the run (mix.json at its end)."""
        records, rollouts, _ = self.seen
        kinds = [row_kind(records[j]) for j in rollouts.prompt_index.tolist()]
        for name, rows in (("C", eligible.nonzero().squeeze(-1).tolist()), ("S", chosen.tolist())):
            for i in rows:
                self.mix[name][kinds[i]] = self.mix[name].get(kinds[i], 0) + 1

    def end(self) -> None:
        (self.out / "mix.json").write_text(json.dumps(self.mix) + "\n")
        if self.job.get("factors"):
            self.measure("end")

    def measure(self, when: str) -> None:
        records = load_records(self.job["audit_data"])
        rows = factors(self.ctx, self.run.selector, records, self.job["factors"], self.run.cfg.loss.topk)
        path = self.out / f"factors-{when}.json"
        path.write_text(json.dumps(rows) + "\n")


def row_kind(record) -> str:
    """'harmful' (its crop misses the target), 'small' or 'large' (the JSONL's target side; large from 24 px,
    `harness.regime.RegimeConfig.large_min`)."""
    if int(record.field("harm") or 0):
        return "harmful"
    return "large" if int(record.field("target") or 0) >= LARGE_MIN else "small"


class Oracle(Hook):
    def choose(self, phi, eligible, budget, step, has_entropy=True, prompt_of=None):
        records, rollouts, prompts = self.seen
        batch = HeldBatch(records, rollouts, prompts, phi, eligible, None, has_entropy=has_entropy)
        u = score_utility(self.ctx, batch).double()  # (N,) NaN outside C
        candidates = eligible.nonzero().squeeze(-1)
        chosen = top_subset(torch.nan_to_num(u, nan=-1.0), candidates, budget)
        return chosen.sort().values, None


class Diminishing(Hook):
    def choose(self, phi, eligible, budget, step, has_entropy=True, prompt_of=None):
        chosen, pi = self.original(phi, eligible, budget, step, has_entropy, prompt_of)  # updates the normalizer
        selector = self.run.selector
        if not selector.model.trained:
            return chosen, pi
        candidates = eligible.nonzero().squeeze(-1)
        n_explore = min(exploration_count(budget, selector.epsilon), budget)
        exploit = diminishing_top(selector.model.predict(phi), candidates, prompt_of, budget - n_explore)
        rest = candidates[~torch.isin(candidates, exploit)]
        generator = seeded_generator(selector.cfg.seed + 4343, step)
        return torch.cat([exploit, uniform_subset(rest, n_explore, generator)]).sort().values, None


def diminishing_top(scores: torch.Tensor, candidates: torch.Tensor, prompt_of: torch.Tensor, n: int,
                    gamma: float = GAMMA) -> torch.Tensor:  # fmt: skip
    """n candidates picked one at a time by score x gamma^(rows of the same prompt already picked), the scores
    shifted so that the lowest candidate's is a small positive number; ties to the lower row id."""
    s = scores[candidates].double()
    s = s - s.min() + 1e-6  # (|C|,) positive
    taken: dict[int, int] = {}
    left = torch.ones(candidates.numel(), dtype=torch.bool)
    picked = []
    prompts = prompt_of[candidates].tolist()
    for _ in range(min(n, candidates.numel())):
        value = torch.tensor([s[j] * gamma ** taken.get(prompts[j], 0) for j in range(candidates.numel())],
                             dtype=torch.float64).masked_fill(~left, -1.0)  # fmt: skip
        j = int(torch.argmax(value))  # the first maximum: the lowest row id
        picked.append(j)
        left[j] = False
        taken[prompts[j]] = taken.get(prompts[j], 0) + 1
    return candidates[torch.tensor(picked, dtype=torch.long)]


@torch.no_grad()
def factors(ctx: AuditContext, selector, records, n_batches: int, k: int, seed: int = 4343) -> list[dict]:
    """Per candidate row of `n_batches` held batches: mean d, o, c over its valid tokens on the support k
    (`opd.maths.divergence.utility_terms`: the student's top-k, Eq. 7-8), its u_i = mean d o c (Eq. 9), a_i, and d, o,
    c at its most divergent token ("*_peak": a response's template tokens agree, so the means are diluted)."""
    out = []
    for b, recs in enumerate(held_records(records, ctx.prompts_per_step, n_batches, seed)):
        batch = sample_batch(ctx, selector, recs, seed + b)
        rows = batch.eligible.nonzero().squeeze(-1)
        with _preserved(ctx):
            for sel, s_inputs, t_inputs, mask, width, _, _ in _micro_batches(ctx, batch, rows):
                with ctx.objective.autocast():
                    t_logits = ctx.teacher.logits(t_inputs[0], width)  # (n, T, V) Eq. 2
                    s_logits = response_logits(ctx.model, s_inputs, width)  # (n, T, V) Eq. 1
                d, o, c = utility_terms(s_logits.double(), t_logits.double(), k)  # (n, T) each
                m = mask.double()
                mean = lambda x: ((x * m).sum(-1) / m.sum(-1).clamp(min=1)).tolist()  # noqa: E731
                peak = d.masked_fill(m == 0, -1.0).argmax(-1, keepdim=True)  # (n, 1) the row's most divergent token
                at = lambda x: x.gather(-1, peak).squeeze(-1).tolist()  # noqa: E731
                for j, dj, oj, cj, uj, dp, op, cp in zip(sel.tolist(), mean(d), mean(o), mean(c), mean(d * o * c),
                                                         at(d), at(o), at(c)):  # fmt: skip
                    rec = batch.records[int(batch.rollouts.prompt_index[j])]
                    out.append({"batch": b, "d": dj, "o": oj, "c": cj, "u": uj, "d_peak": dp, "o_peak": op,
                                "c_peak": cp, "area": float(rec.area_ratio), "harm": int(rec.field("harm") or 0)})  # fmt: skip
    return out


def spread(values) -> dict:
    """Quantiles (5, 25, 50, 75, 95 %), mean and standard deviation of a factor over rows."""
    v = np.asarray(values, dtype=float)
    q = np.percentile(v, [5, 25, 50, 75, 95]) if v.size else [float("nan")] * 5
    return {"n": int(v.size), "mean": float(v.mean()) if v.size else float("nan"),
            "std": float(v.std(ddof=1)) if v.size > 1 else float("nan"), "q": [float(x) for x in q]}  # fmt: skip
