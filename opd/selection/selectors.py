"""Choosing S before any teacher computation: Eq. 4 and the four policies (Algorithm 1, lines 4-9).

(Inside opd/: a top-level selectors.py would shadow the standard library's `selectors` module and break
`import torch`.)

Every selector sees the *global* candidate batch (features all-gathered from every rank) and returns
global row indices; it uses no per-rank randomness, so all ranks make the same selection.
|S| <= K always holds; `select` checks it (a RuntimeError otherwise).

- full: S = C (rho must be 1).
- random (Appendix A.1): K uniform picks without replacement, from a CPU permutation seeded by the
  selector seed and the step.
- entropy (Appendix A.1): the K rows with the highest mean token entropy; mean sampled-token NLL when
  entropy is unavailable. Ties go to the lower row index.
- learned (Algorithm 1, lines 5-9): uniform until f_psi's first update; then the top K - K_e rows by
  predicted utility plus K_e = ceil(eps K) uniform picks from the remaining candidates.

Unbiased (`unbiased=True`, `--unbiased`; entropy or learned): a top-K by a score is a biased sample of the
on-policy gradient (docs/TOY_COLLAPSE.md). Instead S is *sampled*: inclusion probabilities pi_i grow with the
score, mixed with the uniform distribution (weight eps, the exploration ratio), sum to K and are capped at 1
(`inclusion_probabilities`); exactly K distinct rows are drawn with those probabilities (`sample_with_probabilities`,
systematic sampling over a random order), and the loss weighs row i by w_i = 1 / pi_i (Eq. 11 in its Hajek form,
`opd.maths.divergence.budgeted_weights`). The budget is unchanged. Before f_psi's first update the learned scores are
uniform (pi = K / |C|, every w_i equal: plain Eq. 11).

A per-prompt cap (`max_per_prompt`, `--max-per-prompt N`): at most N rows of S per prompt, for the top-K and
uniform policies (spreading the supervision over prompts; `capped`); with fewer than K rows allowed, S is smaller.

Unbiased selection's three further choices (docs/SELECTION.md, departures 61-63):

- the estimator (`--estimator`): hajek (the default, above) or ht, Horvitz-Thompson: the weighted token sum over
  T_C, the tokens of every candidate in C (known before the teacher runs; `Selector.full_query_tokens`), exactly
  unbiased for the full-query token mean where the Hajek ratio is biased O(1/K);
- the design (`--strata`): none (one sample of K from C) or prompt: each prompt's candidates a stratum, K spread
  over them evenly (`stratum_allocation`), exactly K rows in all, sampled inside each stratum with exact
  per-stratum inclusion probabilities (`stratified_probabilities`, `sample_stratified`);
- what pi is proportional to (`--inclusion-size`): the score, or the predicted size of the row's gradient
  contribution T_i sqrt(score), the variance-minimising rule with the score as the proxy (`inclusion_sizes`).
"""

import math
import numbers

import torch

from opd.selection.predictor import OnlineUtilityModel
from opd.seeding import seeded_generator
from opd.selection.config import (
    ESTIMATORS,
    INCLUSION_SIZES,
    POLICIES,
    STRATA,
    PredictorConfig,
    SelectionConfig,
)


def query_budget(rho: float, n_eligible: int) -> int:
    """Eq. 4 of the paper: K = floor(rho |C|), rho in (0, 1]."""
    if isinstance(rho, bool) or not isinstance(rho, numbers.Real) or not 0.0 < float(rho) <= 1.0:
        raise ValueError(f"the query ratio rho must be a number in (0, 1], got {rho!r}")
    rho = float(rho)
    # A tiny tolerance against float error: 0.29 * 100 = 28.999999999999996 must give 29.
    return int(math.floor(rho * n_eligible + 1e-9))


def exploration_count(budget: int, epsilon: float) -> int:
    """Algorithm 1, line 8: K_e = ceil(eps K) exploration picks (0 when eps = 0)."""
    return int(math.ceil(epsilon * budget - 1e-9)) if epsilon > 0 else 0


def uniform_subset(candidates: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    """n of the candidate indices uniformly without replacement (a seeded CPU permutation)."""
    return candidates[torch.randperm(candidates.numel(), generator=generator)[:n]]


def top_subset(scores: torch.Tensor, candidates: torch.Tensor, n: int) -> torch.Tensor:
    """The n candidates with the highest scores; ties go to the lower index (stable sort)."""
    order = torch.sort(scores[candidates].double(), descending=True, stable=True).indices
    return candidates[order[:n]]


def learned_subset(
    predicted: torch.Tensor, candidates: torch.Tensor, budget: int, n_explore: int, generator: torch.Generator
) -> torch.Tensor:
    """Algorithm 1, line 9: top K - K_e by u^ plus K_e uniform picks from the remaining candidates."""
    n_explore = min(n_explore, budget)
    exploit = top_subset(predicted, candidates, budget - n_explore)
    rest = candidates[~torch.isin(candidates, exploit)]
    return torch.cat([exploit, uniform_subset(rest, n_explore, generator)])


def capped(order: torch.Tensor, n: int, prompt_of: torch.Tensor | None, cap: int) -> torch.Tensor:
    """The first n rows of `order` (global row ids, in preference order) taking at most `cap` rows of any one
    prompt (`prompt_of`: each row's prompt id); cap 0 or no prompt ids: simply the first n."""
    if not cap or prompt_of is None or n <= 0:
        return order[: max(n, 0)]
    taken: dict[int, int] = {}
    keep = []
    for i in order.tolist():
        p = int(prompt_of[i])
        if taken.get(p, 0) < cap:
            taken[p] = taken.get(p, 0) + 1
            keep.append(i)
            if len(keep) == n:
                break
    return torch.tensor(keep, dtype=order.dtype)


def inclusion_probabilities(scores: torch.Tensor, k: int, uniform_mix: float = 0.0) -> torch.Tensor:
    """pi (n,) for sampling exactly k of n rows: proportional to the score mixed with the uniform distribution,

        p_i = (1 - m) s_i / sum_j s_j + m / n,    s_i = max(score_i, 0),    m = uniform_mix,
        pi_i = min(1, c p_i),  c such that sum_i pi_i = k,

    the rows that reach 1 capped and their excess spread over the others in proportion to p (repeated until no
    row exceeds 1). All non-positive scores give the uniform pi = k / n. pi is non-decreasing in the score. float64.
    With m = 0 and some scores positive, a row with score <= 0 gets pi = 0: it is never drawn, and the Hajek
    weights 1 / pi then estimate the full-query mean over the positive-score rows only (train.py refuses
    --unbiased without exploration). Non-finite scores: ValueError."""
    n = scores.numel()
    if not 0 <= k <= n:
        raise ValueError(f"cannot sample {k} of {n} rows")
    if not 0.0 <= uniform_mix <= 1.0:
        raise ValueError(f"uniform_mix must lie in [0, 1], got {uniform_mix}")
    if n == 0 or k == 0:
        return torch.zeros(n, dtype=torch.float64)
    bad = int((~torch.isfinite(scores.double())).sum())
    if bad:
        raise ValueError(f"scores must be finite: {bad} of {n} are NaN or infinite")
    s = scores.double().clamp(min=0.0)  # (n,)
    total = s.sum()
    p = torch.full((n,), 1.0 / n, dtype=torch.float64) if total <= 0 else (1 - uniform_mix) * s / total + uniform_mix / n
    pi = torch.zeros(n, dtype=torch.float64)
    full = torch.zeros(n, dtype=torch.bool)
    for _ in range(n):  # each pass caps at least one more row, or ends
        free = ~full
        remaining = k - int(full.sum())
        mass = p[free].sum()
        if remaining == 0 or mass <= 0:  # the rest share what is left uniformly (or nothing)
            pi[free] = remaining / max(1, int(free.sum()))
            break
        pi[free] = remaining * p[free] / mass
        over = free & (pi >= 1.0)
        if not over.any():
            break
        full |= over
        pi[full] = 1.0
    return pi


def sample_with_probabilities(pi: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Exactly k = sum(pi) distinct row indices, row i included with probability pi_i: systematic sampling over a
    random permutation. The rows, in a random order, are laid end to end on [0, k) with lengths pi_i; one uniform
    u in [0, 1) picks the rows covering u, u + 1, ..., u + k - 1. A row's interval has length pi_i <= 1, so it holds
    at most one of the points and holds one with probability exactly pi_i, whatever the order (first-order inclusion
    probabilities exact, size exactly k). The random order makes every pair of rows possible together. Chosen over
    conditional Poisson sampling: exact pi without an iterative fit, O(n), two draws of the generator. pi (n,)
    float64 with an integer sum (`inclusion_probabilities`). Rows with pi_i = 0 are left out of the line (after
    the permutation, so the draws are the same): they are never drawn, also when the last end is set to exactly
    k against cumsum rounding."""
    k = int(round(float(pi.sum())))
    if k == 0:
        return torch.zeros(0, dtype=torch.long)
    perm = torch.randperm(pi.numel(), generator=generator)  # (n,)
    perm = perm[pi[perm] > 0]  # (n',) the rows that can be drawn
    ends = torch.cumsum(pi[perm].double(), 0)  # (n',) the right end of each row's interval
    ends[-1] = float(k)  # the exact total (cumsum rounding)
    points = torch.rand(1, generator=generator, dtype=torch.float64) + torch.arange(k, dtype=torch.float64)  # (k,)
    positions = torch.searchsorted(ends, points, right=True).clamp(max=perm.numel() - 1)  # (k,)
    return perm[positions]


def inclusion_sizes(scores: torch.Tensor, lengths: torch.Tensor, rule: str = "score") -> torch.Tensor:
    """x (n,): what unbiased selection's pi is proportional to before the uniform mix (`inclusion_probabilities`).

        score:     x_i = score_i                      (pi proportional to the predicted utility, or the entropy)
        gradient:  x_i = T_i sqrt(max(score_i, 0))    (pi proportional to the predicted size of row i's gradient)

    Why the second (docs/SELECTION.md, "The variance"): the Horvitz-Thompson estimate sum_{i in S} g_i / pi_i of the
    full-query gradient G = sum_{i in C} g_i has, for independent inclusions, E||G^ - G||^2 = sum_i (1 / pi_i - 1)
    ||g_i||^2; minimised under sum_i pi_i = K (Lagrange: ||g_i||^2 / pi_i^2 = lambda) it gives pi_i proportional to
    ||g_i||, capped at 1. Row i's part of Eq. 11 is g_i = sum_t grad D_it / T_C; the JSD is quadratic in the logits'
    gap near agreement, so ||grad D_it|| grows as sqrt(D_it), and for a row whose tokens push one way
    ||g_i|| T_C ~ sum_t sqrt(D_it) <= T_i sqrt(mean_t D_it) (Cauchy-Schwarz). u_i (Eq. 9) is that mean times
    overlap and confidence, and the score is its prediction: x_i = T_i sqrt(u^_i). lengths (n,) T_i, known before
    the teacher runs (phi's response length). float64 for 'gradient'; 'score' returns the scores as given."""
    if rule == "score":
        return scores
    if rule != "gradient":
        raise ValueError(f"unknown inclusion size {rule!r}; known: {', '.join(INCLUSION_SIZES)}")
    return lengths.double() * scores.double().clamp(min=0.0).sqrt()  # (n,)


def stratum_allocation(counts: torch.Tensor, k: int) -> torch.Tensor:
    """a (H,) float64: the budget k spread evenly over H strata of counts c_h (water-filling),

        a_h = min(c_h, lambda),    lambda such that sum_h a_h = k,

    a stratum smaller than the even share taken whole and its remainder shared by the others; 0 <= a_h <= c_h.
    A share within 1e-9 of an integer is set to it (so that rounding leaves no near-zero fraction)."""
    c = counts.double()  # (H,)
    if not 0 <= k <= float(c.sum()):
        raise ValueError(f"cannot allocate {k} rows over strata of {int(c.sum())}")
    a = torch.zeros_like(c)
    full = torch.zeros(c.numel(), dtype=torch.bool)
    for _ in range(c.numel()):  # each pass takes at least one more stratum whole, or ends
        free = ~full
        if not free.any():
            break
        share = (k - float(c[full].sum())) / int(free.sum())
        whole = free & (c <= share)
        if not whole.any():
            a[free] = share
            break
        full |= whole
        a[full] = c[full]
    near = (a - a.round()).abs() < 1e-9
    return torch.where(near, a.round(), a)


def stratified_probabilities(sizes: torch.Tensor, stratum: torch.Tensor, k: int, uniform_mix: float):
    """Inclusion probabilities of the stratified design (`sample_stratified`): pi (n,), and the within-stratum
    probabilities given the stratum's count, low (n,) for f_h rows and high (n,) for f_h + 1, and r (H,).

    Stratum h (rows with stratum == h, ids 0..H-1) gets a_h of the k rows (`stratum_allocation`), a_h = f_h + r_h
    with f_h = floor(a_h): f_h + 1 rows with probability r_h, else f_h (drawn jointly so that the counts sum to k).
    Given n rows, stratum h samples them with pi_i(n) = `inclusion_probabilities`(x_h, n, uniform_mix), so

        pi_i = (1 - r_h) pi_i(f_h) + r_h pi_i(f_h + 1)        (exact; sum over the stratum = a_h, over C = k)."""
    n_strata = int(stratum.max()) + 1 if stratum.numel() else 0
    counts = torch.bincount(stratum, minlength=n_strata)  # (H,)
    a = stratum_allocation(counts, k)  # (H,)
    f = a.floor()
    r = a - f  # (H,) in [0, 1)
    low = torch.zeros(stratum.numel(), dtype=torch.float64)
    high = torch.zeros_like(low)
    for h in range(n_strata):
        rows = (stratum == h).nonzero().squeeze(-1)  # (c_h,)
        low[rows] = inclusion_probabilities(sizes[rows], int(f[h]), uniform_mix)
        high[rows] = inclusion_probabilities(sizes[rows], int(f[h]) + 1, uniform_mix) if r[h] > 0 else low[rows]
    pi = (1 - r[stratum]) * low + r[stratum] * high  # (n,)
    return pi, low, high, r


def sample_stratified(low: torch.Tensor, high: torch.Tensor, stratum: torch.Tensor, r: torch.Tensor,
                      generator: torch.Generator) -> torch.Tensor:  # fmt: skip
    """The rows (indices into the n candidates) of one stratified draw (`stratified_probabilities`): the strata that
    get f_h + 1 rows drawn with probabilities r (`sample_with_probabilities`: exactly sum_h r_h of them, so the
    counts sum to k), then each stratum in order sampled with its probabilities for its count (high where it got the
    extra row, else low). Every row's inclusion probability is exactly the design's pi; |S| = k exactly."""
    extra = torch.zeros(r.numel(), dtype=torch.bool)
    extra[sample_with_probabilities(r, generator)] = True  # (H,)
    chosen = []
    for h in range(r.numel()):
        rows = (stratum == h).nonzero().squeeze(-1)  # (c_h,)
        pi_h = high[rows] if extra[h] else low[rows]
        chosen.append(rows[sample_with_probabilities(pi_h, generator)])
    return torch.cat(chosen) if chosen else torch.zeros(0, dtype=torch.long)


def check_finite(scores: torch.Tensor, policy: str, has_entropy: bool, step: int) -> None:
    """RuntimeError, before sampling, when unbiased selection's scores hold NaN or infinity: names their source
    (f_psi's predicted utilities, or the rollouts' mean entropy / NLL features) and the remedy."""
    bad = int((~torch.isfinite(scores.double())).sum())
    if not bad:
        return
    if policy == "learned":
        what = "the utility predictor f_psi's outputs u^"
        remedy = ("f_psi has diverged: lower --selector-lr, or resume from an earlier checkpoint; check that the "
                  "utility labels (Eq. 9) of past steps were finite")
    else:
        what = "the rollouts' mean token " + ("entropy" if has_entropy else "NLL") + " (Eq. 5's feature)"
        remedy = "the policy's sampling log-probs are non-finite: check the rollouts (and the loss) of the last steps"
    raise RuntimeError(f"step {step}: unbiased selection cannot sample: {bad} of {scores.numel()} candidates' scores "
                       f"are NaN or infinite ({what}); {remedy}")


def entropy_scores(phi: torch.Tensor, has_entropy: bool) -> torch.Tensor:
    """Entropy-25's score: mean token entropy (phi[:, 2]), else mean sampled-token NLL (phi[:, 0])."""
    return phi[:, 2] if has_entropy else phi[:, 0]


class Selector:
    """One selection policy. `select` returns S (sorted global indices) and, when unbiased, their inclusion
    probabilities pi (the loss weighs row i by 1 / pi_i; None otherwise); `observe` takes the labels."""

    def __init__(self, policy: str, epsilon: float = 0.10, predictor: PredictorConfig | None = None,
                 unbiased: bool = False, max_per_prompt: int = 0, estimator: str = "hajek", strata: str = "none",
                 inclusion_size: str = "score"):  # fmt: skip
        if policy not in POLICIES:
            raise ValueError(f"unknown selection policy {policy!r}; known: {', '.join(POLICIES)}")
        if unbiased and policy not in ("entropy", "learned"):
            raise ValueError(f"unbiased selection samples by a score: entropy or learned, not {policy!r}")
        if unbiased and max_per_prompt:
            raise ValueError("a per-prompt cap would change the inclusion probabilities of unbiased selection")
        if estimator not in ESTIMATORS or strata not in STRATA or inclusion_size not in INCLUSION_SIZES:
            raise ValueError(f"unknown estimator {estimator!r}, strata {strata!r} or inclusion size {inclusion_size!r}")
        if not unbiased and (estimator, strata, inclusion_size) != ("hajek", "none", "score"):
            raise ValueError("the estimator, strata and inclusion size apply to unbiased (sampled) selection only")
        self.policy = policy
        self.epsilon = epsilon
        self.unbiased = unbiased
        self.max_per_prompt = max_per_prompt
        self.estimator, self.strata, self.inclusion_size = estimator, strata, inclusion_size
        self.cfg = predictor or PredictorConfig()
        self.model = OnlineUtilityModel(self.cfg) if policy == "learned" else None

    @classmethod
    def from_config(cls, selection: SelectionConfig, predictor: PredictorConfig) -> "Selector":
        return cls(selection.policy, selection.epsilon, predictor, selection.unbiased, selection.max_per_prompt,
                   selection.estimator, selection.strata, selection.inclusion_size)  # fmt: skip

    def full_query_tokens(self, lengths: torch.Tensor, eligible: torch.Tensor) -> float | None:
        """Eq. 11's Horvitz-Thompson denominator under --estimator ht: T_C = sum_{i in C} T_i, the valid response
        tokens of every candidate (lengths, eligible (N,): the global rows, gathered over ranks; known before the
        teacher runs), so that sum_{i in S} w_i sum_t m_it D_it / T_C is exactly unbiased for the full-query token
        mean. None under the Hajek form (the objectives' sum_S w_i T_i) and without --unbiased."""
        if not self.unbiased or self.estimator != "ht":
            return None
        return float(lengths[eligible].sum())

    def select(self, phi: torch.Tensor, eligible: torch.Tensor, budget: int, step: int, has_entropy: bool = True,
               prompt_of: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """(S, pi) for one step: S the sorted global row ids (|S|,), and under unbiased selection pi (|S|,) the
        inclusion probabilities of S's rows, in S's order (None otherwise). phi (N, 6) global features (Eq. 5),
        eligible (N,) bool, budget K (Eq. 4), prompt_of (N,) each row's prompt (for the per-prompt cap)."""
        candidates = eligible.nonzero().squeeze(-1)  # (|C|,)
        cap = self.max_per_prompt
        generator = seeded_generator(self.cfg.seed, step)
        pi = None
        if self.policy == "learned":
            self.model.normalizer.update(phi[candidates])  # Algorithm 1, line 4: update on C
        if self.unbiased:
            chosen, pi = self._sample(phi, candidates, budget, step, has_entropy, prompt_of, generator)
        elif self.policy == "full":
            chosen = capped(candidates, candidates.numel(), prompt_of, cap)
        elif self.policy == "random":
            chosen = capped(candidates[torch.randperm(candidates.numel(), generator=generator)], budget, prompt_of, cap)
        elif self.policy == "entropy":
            chosen = capped(top_subset(entropy_scores(phi, has_entropy), candidates, candidates.numel()), budget,
                            prompt_of, cap)  # fmt: skip
        elif not self.model.trained:  # lines 5-6
            chosen = capped(candidates[torch.randperm(candidates.numel(), generator=generator)], budget, prompt_of, cap)
        elif not cap:  # lines 8-9
            n_explore = exploration_count(budget, self.epsilon)
            chosen = learned_subset(self.model.predict(phi), candidates, budget, n_explore, generator)
        else:  # lines 8-9 under the cap: the exploit part by u^, then uniform picks, both within the cap
            n_explore = min(exploration_count(budget, self.epsilon), budget)
            exploit = capped(top_subset(self.model.predict(phi), candidates, candidates.numel()), budget - n_explore,
                             prompt_of, cap)  # fmt: skip
            rest = candidates[~torch.isin(candidates, exploit)]
            rest = rest[torch.randperm(rest.numel(), generator=generator)]
            chosen = capped(torch.cat([exploit, rest]), exploit.numel() + n_explore, prompt_of, cap)
        chosen, order = chosen.sort()
        pi = pi[order] if pi is not None else None
        if chosen.numel() > budget:  # Eq. 4's budget is never exceeded (an explicit check: not gone under -O)
            raise RuntimeError(f"the query budget was exceeded: |S| = {chosen.numel()} > K = {budget}")
        return chosen, pi

    def _sample(self, phi, candidates, budget, step, has_entropy, prompt_of, generator):
        """Unbiased selection: S (global ids) and its rows' inclusion probabilities, sampled from C with pi growing
        with the score (or the predicted gradient size), in one sample or one per prompt."""
        if self.policy == "entropy":
            scores = entropy_scores(phi, has_entropy)[candidates]
        elif self.model.trained:
            scores = self.model.predict(phi)[candidates]
        else:  # before f_psi's first update: uniform
            scores = torch.ones(candidates.numel())
        check_finite(scores, self.policy, has_entropy, step)
        sizes = inclusion_sizes(scores, phi[candidates, 3], self.inclusion_size)  # (|C|,) phi[:, 3]: T_i (Eq. 5)
        if self.strata == "prompt":
            if prompt_of is None:
                raise ValueError("--strata prompt needs each row's prompt (prompt_of)")
            stratum = torch.unique(prompt_of[candidates], return_inverse=True)[1]  # (|C|,) 0..H-1 by prompt id
            pi_c, low, high, r = stratified_probabilities(sizes, stratum, budget, self.epsilon)  # (|C|,)
            picked = sample_stratified(low, high, stratum, r, generator)
        else:
            pi_c = inclusion_probabilities(sizes, budget, self.epsilon)  # (|C|,)
            picked = sample_with_probabilities(pi_c, generator)
        return candidates[picked], pi_c[picked]

    def predict(self, phi: torch.Tensor) -> torch.Tensor | None:
        """u^ for logging and audits (learned policy only)."""
        return self.model.predict(phi) if self.model is not None and self.model.trained else None

    def observe(self, phi: torch.Tensor, u: torch.Tensor, step: int) -> dict[str, float]:
        """Algorithm 1, line 14 (learned policy only): labelled pairs into replay, then psi updates."""
        return self.model.observe(phi, u, step) if self.model is not None else {}

    def state_dict(self) -> dict:
        return {"policy": self.policy, "model": self.model.state_dict() if self.model is not None else None}

    def load_state_dict(self, state: dict) -> None:
        if state["policy"] != self.policy:
            raise ValueError(f"checkpoint selector is {state['policy']!r}, this run uses {self.policy!r}")
        if self.model is not None:
            self.model.load_state_dict(state["model"])
