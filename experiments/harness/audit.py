"""Selection diagnostics of the paper's Figures 3 and 4, for any run (the toy or a real model).

The audits receive what they read of a run, not the run: an `AuditContext` (`AuditContext.of(run)` builds it from an
`opd.run.Run`) and, where they score or select, the run's selector. On held batches sampled as the run samples,
the teacher scores *every* candidate, so the true utility u_i (Eq. 9) of all of them is known:

- Figure 3 (`audit_utility`): the utility the frozen selector's ranking captures (`capture_curve`, `pooled_capture`)
  and per predicted-rank band (`rank_bands`: `bootstrap_ci`, `sign_flip_pvalue`, `holm`);
- Figure 4 (`gradient_geometry`, `geometry_summary`): ||g_S||, ||g_U|| and cos(g_S, g_U) for S = the frozen top
  floor(rho |C|) rows and U = the rest (`opd_gradient`: the run's loss over a row set, nothing stepped);
- `selection_audit`: the run's own selector's budgeted gradient against the full-query gradient of the batch.

The run's state is left as it was (a forked RNG, the teacher's counters restored, the selector only read); on a DDP
run call these on one process. Details: docs/MODULES.md#harnessaudit.
"""

from __future__ import annotations

import copy
import itertools
import math
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from opd.models.chat import micro_batch_inputs
from opd.cli import UserError
from opd.data.records import Record, step_prompt_indices
from opd.methods.micro_batch import micro_batch_loss
from opd.maths.divergence import budgeted_weights
from opd.maths.family import aggregation_weights
from opd.engine.rollout import Rollouts, generate_rollouts
from opd.engine.sampling import SamplingConfig
from opd.methods.objective import plan_rows
from opd.engine.rollout import mix_seed
from opd.selection.selectors import entropy_scores, query_budget, rollout_features, top_subset

# ----------------------------------------------------------------------------- statistics


def top_count(n: int, fraction: float) -> int:
    """floor(f n) (Eq. 4's rounding, with its float tolerance)."""
    return int(math.floor(fraction * n + 1e-9))


def capture_curve(utility: torch.Tensor, scores: torch.Tensor, fractions) -> np.ndarray:
    """Share of sum(utility) held by the top floor(f n) rows by `scores` (ties: lower index), per f."""
    u = utility.double()
    order = torch.sort(scores.double(), descending=True, stable=True).indices
    cum = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(u[order], 0)])
    total = float(u.sum())
    return np.array([float(cum[top_count(len(u), f)]) / total if total > 0 else 0.0 for f in fractions])


def pooled_capture(batches: list[tuple[torch.Tensor, torch.Tensor]], fractions) -> np.ndarray:
    """capture_curve over several batches, each ranked on its own: sum of captured / sum of totals."""
    captured = np.zeros(len(fractions))
    total = 0.0
    for u, s in batches:
        t = float(u.double().sum())
        captured += capture_curve(u, s, fractions) * t
        total += t
    return captured / total if total > 0 else captured


def random_capture(n: int, fractions) -> np.ndarray:
    """Expected share captured by a uniform random floor(f n) of n rows: floor(f n) / n."""
    return np.array([top_count(n, f) / n for f in fractions])


def band_index(scores: torch.Tensor, n_bands: int = 4) -> torch.Tensor:
    """Band of each row by its rank (0 = highest scores): rank r of n goes to floor(r n_bands / n)."""
    n = scores.numel()
    order = torch.sort(scores.double(), descending=True, stable=True).indices
    band = torch.empty(n, dtype=torch.long)
    band[order] = torch.arange(n) * n_bands // max(n, 1)
    return band


def bootstrap_ci(values, n_boot: int = 2000, level: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): percentile bootstrap interval of the mean, resampling values with replacement."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return float("nan"), float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(n_boot, x.size))].mean(1)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(x.mean()), float(lo), float(hi)


def sign_flip_pvalue(diffs, n_perm: int = 20000, seed: int = 0) -> float:
    """One-sided paired sign-flip test of mean(diffs) > 0: P(mean of randomly signed diffs >= observed).

    Exact (all 2^n sign patterns) when 2^n <= n_perm, else Monte Carlo with the observed pattern
    counted (p >= 1 / (n_perm + 1)).
    """
    d = np.asarray(diffs, dtype=np.float64)
    if d.size == 0:
        return 1.0
    observed = d.mean()
    if 2 ** d.size <= n_perm:
        signs = np.array(list(itertools.product([1.0, -1.0], repeat=d.size)))
        return float(np.mean((signs * d).mean(1) >= observed - 1e-15))
    rng = np.random.default_rng(seed)
    signs = rng.choice([1.0, -1.0], size=(n_perm, d.size))
    return float((1 + np.sum((signs * d).mean(1) >= observed - 1e-15)) / (n_perm + 1))


def holm(pvalues) -> list[float]:
    """Holm-Bonferroni adjusted p-values (monotone, capped at 1), in the input order."""
    p = np.asarray(pvalues, dtype=np.float64)
    m = p.size
    order = np.argsort(p, kind="stable")
    adjusted = np.empty(m)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, (m - rank) * p[i])
        adjusted[i] = min(1.0, running)
    return adjusted.tolist()


def rank_bands(batches: list[tuple[torch.Tensor, torch.Tensor]], n_bands: int = 4, n_boot: int = 2000,
               seed: int = 0) -> dict:
    """Figure 3b: mean utility per predicted-rank band, bootstrap 95% intervals, adjacent-band tests.

    batches: (utility, score) per held batch; bands are cut within each batch. Returns
    {"bands": [{"band", "n", "mean", "low", "high"}], "tests": [{"bands", "p", "p_holm"}],
    "top_over_next": mean(band 0) / mean(band 1)}. Each test pairs the per-batch band means.
    """
    pooled = [[] for _ in range(n_bands)]
    per_batch = np.full((len(batches), n_bands), np.nan)
    for b, (u, s) in enumerate(batches):
        band = band_index(s, n_bands)
        for k in range(n_bands):
            values = u[band == k].double().tolist()
            pooled[k] += values
            if values:
                per_batch[b, k] = float(np.mean(values))
    bands = []
    for k in range(n_bands):
        mean, lo, hi = bootstrap_ci(pooled[k], n_boot, 0.95, seed + k)
        bands.append({"band": k, "n": len(pooled[k]), "mean": mean, "low": lo, "high": hi})
    tests = []
    for k in range(n_bands - 1):
        d = per_batch[:, k] - per_batch[:, k + 1]
        tests.append({"bands": [k, k + 1], "p": sign_flip_pvalue(d[~np.isnan(d)], seed=seed + k)})
    for t, p in zip(tests, holm([t["p"] for t in tests])):
        t["p_holm"] = p
    ratio = bands[0]["mean"] / bands[1]["mean"] if n_bands > 1 and bands[1]["mean"] else float("nan")
    return {"bands": bands, "tests": tests, "top_over_next": ratio}


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """cos(a, b) of two flat vectors (0 when either is zero)."""
    na, nb = float(a.double().norm()), float(b.double().norm())
    return float(a.double() @ b.double()) / (na * nb) if na > 0 and nb > 0 else 0.0


def geometry_summary(rows: list[dict]) -> dict:
    """Figure 4 over batches: ratio of mean norms ||g_S|| / ||g_U||, mean cosine, and their ranges."""
    s = np.array([r["norm_selected"] for r in rows], dtype=np.float64)
    u = np.array([r["norm_unselected"] for r in rows], dtype=np.float64)
    c = np.array([r["cosine"] for r in rows], dtype=np.float64)
    ratio = s / np.where(u > 0, u, np.nan)
    return {
        "batches": len(rows),
        "mean_norm_selected": float(s.mean()) if s.size else float("nan"),
        "mean_norm_unselected": float(u.mean()) if u.size else float("nan"),
        "norm_ratio": float(s.mean() / u.mean()) if u.size and u.mean() > 0 else float("nan"),
        "ratio_min": float(np.nanmin(ratio)) if ratio.size else float("nan"),
        "ratio_max": float(np.nanmax(ratio)) if ratio.size else float("nan"),
        "mean_cosine": float(c.mean()) if c.size else float("nan"),
        "cosine_min": float(c.min()) if c.size else float("nan"),
        "cosine_max": float(c.max()) if c.size else float("nan"),
        "angle_deg": float(np.degrees(np.arccos(np.clip(c.mean(), -1, 1)))) if c.size else float("nan"),
    }


# ----------------------------------------------------------------------------- held batches of a run


@dataclass
class AuditContext:
    """What the audits read of a run."""

    objective: object
    """The run's `opd.methods.objective.ObjectiveContext`: the policy, its teachers (the first scores), ids, autocast, loss."""
    prompts: object
    """The run's `opd.data.records.Prompts`: the student's prompts, the teachers' views, the candidates C."""
    sampling: SamplingConfig
    rho: float
    prompts_per_step: int
    has_entropy: bool = True
    """False for a vLLM run: Eq. 5's entropy feature is 0, Entropy-25 ranks by the mean NLL (training's)."""
    sharded_ranks: bool = False
    """A policy sharded over several processes (refused: the audits run one process's forwards)."""

    @classmethod
    def of(cls, run) -> AuditContext:
        """The context of an `opd.run.Run`."""
        cfg = run.cfg
        return cls(run.context, run.prompts, cfg.sampling, cfg.selection.rho, cfg.data.prompts_per_step,
                   not cfg.engine.vllm, cfg.model.fsdp and run.acc.num_processes > 1)  # fmt: skip

    @property
    def model(self):
        """The policy unwrapped."""
        return self.objective.model()

    @property
    def teacher(self):
        """The teacher the audits score with (the run's first)."""
        return next(iter(self.objective.teachers.teachers.values()))


@dataclass
class HeldBatch:
    """One held batch of rollouts with everything the audits need (all on the CPU, detached)."""

    records: list[Record]
    rollouts: Rollouts
    student_prompts: list
    phi: torch.Tensor  # (N, 6) Eq. 5
    eligible: torch.Tensor  # (N,) bool: the candidates C
    predicted: torch.Tensor | None  # (N,) u^ of the frozen selector, None when it has no update yet
    utility: torch.Tensor | None = None  # (N,) u_i of every candidate (NaN outside C), after `score_utility`
    has_entropy: bool = True  # False for a vLLM run: Eq. 5's entropy feature is 0, Entropy-25 ranks by NLL (training's)


def held_records(records: list[Record], prompts: int, n_batches: int, seed: int = 1234) -> list[list[Record]]:
    """n_batches disjoint-within-an-epoch prompt batches drawn like training steps (seeded)."""
    return [[records[i] for i in step_prompt_indices(len(records), prompts, b, seed)] for b in range(n_batches)]


@contextmanager
def _preserved(ctx: AuditContext):
    """Forks the RNG of the policy's device and restores the teacher's call counters afterwards."""
    device = next(ctx.model.parameters()).device
    teacher = ctx.teacher
    rows, batches = teacher.rows_scored, len(teacher.batches)
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        teacher.rows_scored = rows
        del teacher.batches[batches:]


def check_auditable(ctx: AuditContext) -> None:
    """The audits run one process's forwards outside the training loop; a policy sharded over several
    processes (--fsdp) would wait for the other ranks' gathers, so it is refused."""
    if ctx.sharded_ranks:
        raise UserError("the Figure 3/4 audits run on one process: audit a --fsdp run launched with one process, "
                        "or its exported checkpoint")


def sample_batch(ctx: AuditContext, selector, records: list[Record], seed: int) -> HeldBatch:
    """Rollouts of `records` by the run's current student (as in Algorithm 1, line 3, with the run's sampling
    distribution and prefill sharing), features and the selector's u^. A vLLM run's features have no entropy
    (zeros, as the engine's rollouts in training), and `has_entropy` is False."""
    check_auditable(ctx)
    s = ctx.sampling
    with _preserved(ctx):
        torch.manual_seed(seed)
        prompts = ctx.prompts.student(records)
        with ctx.objective.autocast():
            ro = generate_rollouts(ctx.model, prompts, s.rollouts_per_prompt, s.max_response_len, s.rollout_batch,
                                   s.share_prefill, **s.distribution)  # fmt: skip
    if not ctx.has_entropy:
        ro.entropy = torch.zeros_like(ro.entropy)
    rows = ro.prompt_index.tolist()
    eligible = torch.tensor([ctx.prompts.eligible(records[j]) for j in rows], dtype=torch.bool) & ro.valid
    area = torch.tensor([records[j].area_ratio for j in rows])
    phi = rollout_features(ro.logp, ro.entropy, ro.response_mask, ro.prompt_len, area)
    return HeldBatch(records, ro, prompts, phi, eligible, selector.predict(phi), has_entropy=ctx.has_entropy)


def _micro_batches(ctx: AuditContext, batch: HeldBatch, rows: torch.Tensor):
    """(sel, student inputs, teacher inputs per teacher view, mask, width, response, old log-probs) per
    micro-batch of `rows`, as `opd.methods.objective` forms them on one rank (`distill.plan_rows`: grouped by teacher length,
    --micro-batch rows and --micro-batch-tokens; the teachers on the run's privileged views, the student on its
    own view; a view's randomness seeded by the record's place)."""
    obj = ctx.objective
    cfg, device, ro, pad = obj.loss, obj.device, batch.rollouts, obj.ids["pad"]
    teacher_prompts: dict[tuple[str, int], object] = {}

    def teacher_prompt(view: str, j: int):
        if (view, j) not in teacher_prompts:
            teacher_prompts[view, j] = ctx.prompts.encode(view, batch.records[j], j)
        return teacher_prompts[view, j]

    for sel in plan_rows(ro, teacher_prompt, rows, cfg.micro_batch, cfg.micro_batch_tokens, obj.teacher_views[0]):
        pids = ro.prompt_index[sel].tolist()
        t_inputs = []
        for view in obj.teacher_views:
            prompts = [teacher_prompt(view, j) for j in pids]
            inputs, mask, width = micro_batch_inputs(prompts, ro, sel, pad, device)
            t_inputs.append(inputs)
        s_inputs, _, _ = micro_batch_inputs([batch.student_prompts[j] for j in pids], ro, sel, pad, device)
        response, old_logp = ro.response_ids[sel, :width].to(device), ro.logp[sel, :width].to(device)
        yield sel, s_inputs, t_inputs, mask, width, response, old_logp


@torch.no_grad()
def score_utility(ctx: AuditContext, batch: HeldBatch) -> torch.Tensor:
    """u_i (Eq. 9) of every candidate of the batch from the run's teacher; stores and returns it."""
    cfg, device = ctx.objective.loss, ctx.objective.device
    utility = torch.full((len(batch.rollouts),), float("nan"))
    rows = batch.eligible.nonzero().squeeze(-1)
    with _preserved(ctx):
        for sel, s_inputs, t_inputs, mask, width, response, old_logp in _micro_batches(ctx, batch, rows):
            weights = budgeted_weights(torch.ones(len(sel), device=device), mask)
            with ctx.objective.autocast():
                _, _, u, _ = micro_batch_loss(ctx.model, ctx.teacher, s_inputs, t_inputs, mask, width, weights, cfg,
                                              response, old_logp)  # fmt: skip
            utility[sel] = u.float().cpu()
    batch.utility = utility
    return utility


def audit_utility(ctx: AuditContext, selector, records: list[Record], n_batches: int = 10, seed: int = 1234,
                  fractions=(0.1, 0.25, 0.5, 0.75, 1.0), n_boot: int = 2000) -> dict:
    """Figure 3 on `n_batches` held batches of `records` (prompts_per_step prompts each).

    Returns capture curves (oracle, learned, entropy, random) at `fractions` (also a fine grid under
    "curve"), the rank-band statistics of the learned (or, without a trained selector, the entropy)
    ranking, and the per-batch utilities. The selector must have had an update for "learned".
    """
    batches = []
    for b, recs in enumerate(held_records(records, ctx.prompts_per_step, n_batches, seed)):
        batch = sample_batch(ctx, selector, recs, mix_seed(seed, b))
        score_utility(ctx, batch)
        batches.append(batch)
    grid = np.round(np.linspace(0, 1, 41), 4).tolist()
    fractions = list(fractions)

    def pairs(key: str):
        out = []
        for batch in batches:
            c = batch.eligible
            u = batch.utility[c]
            score = {"oracle": u, "entropy": entropy_scores(batch.phi, batch.has_entropy)[c],
                     "learned": batch.predicted[c] if batch.predicted is not None else None}[key]
            if score is None:
                return None
            out.append((u, score))
        return out

    result = {"batches": n_batches, "candidates": int(sum(int(b.eligible.sum()) for b in batches)),
              "fractions": fractions, "grid": grid, "capture": {}, "curve": {}}
    n_per = [int(b.eligible.sum()) for b in batches]
    for key in ("oracle", "learned", "entropy"):
        p = pairs(key)
        if p is not None:
            result["capture"][key] = pooled_capture(p, fractions).tolist()
            result["curve"][key] = pooled_capture(p, grid).tolist()
    result["capture"]["random"] = np.average([random_capture(n, fractions) for n in n_per], 0, n_per).tolist()
    result["curve"]["random"] = np.average([random_capture(n, grid) for n in n_per], 0, n_per).tolist()
    result["prompts_per_batch"] = float(np.mean([len(b.records) for b in batches]))
    result["coverage"] = prompt_coverage(batches, 0.25, seed)
    ranking = "learned" if pairs("learned") is not None else "entropy"
    result["bands_by"] = ranking
    result["bands"] = rank_bands(pairs(ranking), 4, n_boot, seed)
    result["utility"] = [b.utility[b.eligible].tolist() for b in batches]
    return result


def prompt_coverage(batches: list[HeldBatch], fraction: float = 0.25, seed: int = 0, draws: int = 200) -> dict:
    """Mean number of distinct prompts among the top floor(f |C|) candidates of each ranking (random:
    averaged over `draws` seeded uniform subsets). Near-duplicate rollouts of one prompt score alike,
    so a score-based top-K can spend the whole budget on a few prompts."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, list[float]] = {"oracle": [], "learned": [], "entropy": [], "random": []}
    for b in batches:
        c = b.eligible.nonzero().squeeze(-1)
        k = top_count(c.numel(), fraction)
        prompts = b.rollouts.prompt_index[c]
        scores = {"oracle": b.utility[c], "entropy": entropy_scores(b.phi, b.has_entropy)[c],
                  "learned": b.predicted[c] if b.predicted is not None else None}
        for key, score in scores.items():
            if score is not None:
                top = torch.sort(score.double(), descending=True, stable=True).indices[:k]
                out[key].append(float(prompts[top].unique().numel()))
        out["random"].append(float(np.mean([prompts[torch.randperm(c.numel(), generator=gen)[:k]].unique().numel()
                                            for _ in range(draws)])))
    return {key: float(np.mean(v)) for key, v in out.items() if v}


# ----------------------------------------------------------------------------- gradient geometry


def opd_gradient(ctx: AuditContext, batch: HeldBatch, rows: torch.Tensor,
                 sample_weights: torch.Tensor | None = None, full_tokens: float | None = None) -> torch.Tensor:  # fmt: skip
    """Flat gradient of the run's loss over `rows` (global row ids of the batch) w.r.t. the policy: Eq. 11's token
    mean, or the run's --loss-agg (`opd.maths.family.aggregation_weights`, its denominator over `rows`).

    Uses the training path (`opd.methods.micro_batch.micro_batch_loss` with the aggregation's weights, the run's
    micro-batches: the teacher on its privileged view, the student on its own, the method's divergence); nothing is
    stepped and no .grad is written. `sample_weights` (len(rows),): Eq. 11's Hajek form with these w_i (unbiased
    selection's 1 / pi_i; token-mean only, as train.py requires); with `full_tokens` (T_C) its Horvitz-Thompson form
    instead (--estimator ht, `opd.maths.family.loss_denominator`).
    """
    cfg, device, ro, model = ctx.objective.loss, ctx.objective.device, batch.rollouts, ctx.model
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    w_of = None if sample_weights is None else dict(zip(rows.tolist(), sample_weights.double().tolist()))
    if cfg.aggregation != "token-mean":  # sequence-mean, micro-batch: |S|, the rows with a valid token
        denominator = int((ro.lengths[rows] > 0).sum())
    elif w_of is not None and full_tokens is not None and int(ro.lengths[rows].sum()):
        denominator = float(full_tokens)
    elif w_of is not None:
        denominator = float(sum(w_of[i] * int(ro.lengths[i]) for i in rows.tolist()))
    else:
        denominator = int(ro.lengths[rows].sum())
    if denominator == 0:
        return torch.cat([t.flatten() for t in total])
    dtype = torch.float64 if next(model.parameters()).dtype == torch.float64 else torch.float32  # as distill's
    with _preserved(ctx):
        for sel, s_inputs, t_inputs, mask, width, response, old_logp in _micro_batches(ctx, batch, rows):
            w = None if w_of is None else torch.tensor([w_of[i] for i in sel.tolist()], device=device)
            weights = aggregation_weights(cfg.aggregation, torch.ones(len(sel), device=device), mask, denominator,
                                          dtype, w)  # (n, T) the run's loss over `rows`  # fmt: skip
            with ctx.objective.autocast():
                loss, _, _, _ = micro_batch_loss(model, ctx.teacher, s_inputs, t_inputs, mask, width, weights, cfg,
                                                 response, old_logp)  # fmt: skip
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            for t, g in zip(total, grads):
                if g is not None:
                    t += g.detach()
    return torch.cat([t.flatten().double().cpu() for t in total])


def frozen_selection(batch: HeldBatch, rho: float) -> torch.Tensor:
    """S for the geometry audit: top floor(rho |C|) by the frozen selector's u^ (entropy before its
    first update), no exploration."""
    candidates = batch.eligible.nonzero().squeeze(-1)
    scores = batch.predicted if batch.predicted is not None else entropy_scores(batch.phi, batch.has_entropy)
    return top_subset(scores, candidates, query_budget(rho, candidates.numel())).sort().values


def gradient_geometry(ctx: AuditContext, selector, records: list[Record], rho: float = 0.25, n_batches: int = 5,
                      seed: int = 4321) -> dict:  # fmt: skip
    """Figure 4 at the run's current state: per held batch ||g_S||, ||g_U||, cos(g_S, g_U); summary."""
    rows = []
    for b, recs in enumerate(held_records(records, ctx.prompts_per_step, n_batches, seed)):
        batch = sample_batch(ctx, selector, recs, mix_seed(seed, b))
        selected = frozen_selection(batch, rho)
        candidates = batch.eligible.nonzero().squeeze(-1)
        unselected = candidates[~torch.isin(candidates, selected)]
        g_s, g_u = opd_gradient(ctx, batch, selected), opd_gradient(ctx, batch, unselected)
        rows.append({"batch": b, "selected": int(selected.numel()), "unselected": int(unselected.numel()),
                     "norm_selected": float(g_s.norm()), "norm_unselected": float(g_u.norm()),
                     "cosine": cosine(g_s, g_u), "by": "learned" if batch.predicted is not None else "entropy"})
    return {"rho": rho, "rows": rows, "summary": geometry_summary(rows)}


def selection_audit(ctx: AuditContext, selector, records: list[Record], n_batches: int = 5, draws: int = 4,
                    seed: int = 4321) -> dict:  # fmt: skip
    """What the run's own selection does to the gradient, at its current state, on held batches.

    Per batch: the full-query gradient g_C (Eq. 11 over every candidate) and, for `draws` draws of the run's
    selector as it trains (a copy of it, so the run's selector is untouched; top-K, uniform, capped or sampled
    with its inclusion probabilities), the budgeted gradient g_S (with unbiased selection's 1 / pi_i weights,
    Eq. 11's Hajek form, or Horvitz-Thompson's under --estimator ht). Reports cos(g_S, g_C) per draw (bias and
    noise), cos(mean over draws of g_S, g_C) (mostly the bias: the noise averages out over draws), and the utility
    S captures: sum_S u_i / sum_C u_i with every candidate's true utility (Eq. 9, the teacher on all of C)."""
    check_auditable(ctx)
    rows = []
    for b, recs in enumerate(held_records(records, ctx.prompts_per_step, n_batches, seed)):
        batch = sample_batch(ctx, selector, recs, mix_seed(seed, b))
        candidates = batch.eligible.nonzero().squeeze(-1)
        if candidates.numel() == 0:
            continue
        u = score_utility(ctx, batch).double()
        g_c = opd_gradient(ctx, batch, candidates)
        budget = query_budget(ctx.rho, candidates.numel())
        prompt_of = batch.rollouts.prompt_index
        grads, cos, captured = [], [], []
        for d in range(draws):
            draw = copy.deepcopy(selector)
            chosen, pi = draw.select(batch.phi, batch.eligible, budget, 10**6 + b * draws + d, batch.has_entropy,
                                     prompt_of)  # fmt: skip
            w = None if pi is None else 1.0 / pi
            g = opd_gradient(ctx, batch, chosen, w, draw.full_query_tokens(batch.rollouts.lengths, batch.eligible))
            grads.append(g)
            cos.append(cosine(g, g_c))
            total = float(u[candidates].sum())
            captured.append(float(u[chosen].sum()) / total if total > 0 else float("nan"))
        mean_g = torch.stack(grads).mean(0)
        rows.append({"batch": b, "candidates": int(candidates.numel()), "budget": budget,
                     "cosine": float(np.mean(cos)), "cosine_of_mean": cosine(mean_g, g_c),
                     "norm_ratio": float(mean_g.norm() / g_c.norm()) if g_c.norm() > 0 else float("nan"),
                     "captured": float(np.nanmean(captured))})  # fmt: skip
    keys = ("cosine", "cosine_of_mean", "norm_ratio", "captured")
    summary = {k: float(np.nanmean([r[k] for r in rows])) if rows else float("nan") for k in keys}
    return {"draws": draws, "rows": rows, "summary": summary}

