"""Selection designs beyond the paper's policies, which choose S in `Selector.select`'s place (`DesignSelector.choose`).

- `PerPromptCap` (`--max-per-prompt N`): at most N rows of S per prompt, for the top-K and uniform policies
  (spreading the supervision over prompts; `capped`); with fewer than K rows allowed, S is smaller.
- `Unbiased` (`--unbiased`; entropy or learned): S *sampled* with inclusion probabilities pi_i that grow with the
  score, mixed with the uniform distribution (weight eps), summing to K and capped at 1 (`inclusion_probabilities`,
  `sample_with_probabilities`); the loss weighs row i by 1 / pi_i (Eq. 11's Hajek form). Its further choices: the
  estimator (`--estimator hajek|ht`: Horvitz-Thompson over T_C, `full_query_tokens`), the design (`--strata prompt`:
  one stratum per prompt, `stratified_probabilities`, `sample_stratified`) and what pi is proportional to
  (`--inclusion-size score|gradient`, `inclusion_sizes`). Why, and the measurements: docs/SELECTION.md.

`selector` builds a `Selector` with its design from the flags (`selector_from_config`: from the run's sections).
"""

import torch

from opd.selection.config import ESTIMATORS, INCLUSION_SIZES, STRATA, PredictorConfig, SelectionConfig
from opd.selection.selectors import Selector, entropy_scores, exploration_count, feature, top_subset


def selector(policy: str, epsilon: float = 0.10, predictor: PredictorConfig | None = None, unbiased: bool = False,
             max_per_prompt: int = 0, estimator: str = "hajek", strata: str = "none",
             inclusion_size: str = "score") -> Selector:  # fmt: skip
    """A `Selector` with the design these settings name (none: the paper's policy); ValueError for a combination that
    does not apply."""
    if unbiased and policy not in ("entropy", "learned"):
        raise ValueError(f"unbiased selection samples by a score: entropy or learned, not {policy!r}")
    if unbiased and max_per_prompt:
        raise ValueError("a per-prompt cap would change the inclusion probabilities of unbiased selection")
    if estimator not in ESTIMATORS or strata not in STRATA or inclusion_size not in INCLUSION_SIZES:
        raise ValueError(f"unknown estimator {estimator!r}, strata {strata!r} or inclusion size {inclusion_size!r}")
    if not unbiased and (estimator, strata, inclusion_size) != ("hajek", "none", "score"):
        raise ValueError("the estimator, strata and inclusion size apply to unbiased (sampled) selection only")
    if unbiased:
        return DesignSelector(policy, epsilon, predictor, Unbiased(estimator, strata, inclusion_size))
    if max_per_prompt:
        return DesignSelector(policy, epsilon, predictor, PerPromptCap(max_per_prompt))
    return Selector(policy, epsilon, predictor)


def selector_from_config(selection: SelectionConfig, predictor: PredictorConfig) -> Selector:
    """The run's selector (`opd.run.Run`)."""
    return selector(selection.policy, selection.epsilon, predictor, selection.unbiased, selection.max_per_prompt,
                    selection.estimator, selection.strata, selection.inclusion_size)  # fmt: skip


class DesignSelector(Selector):
    """A `Selector` whose lines 5-9 are a design's (`PerPromptCap`, `Unbiased`) in place of the paper's policy."""

    def __init__(self, policy: str, epsilon: float, predictor: PredictorConfig | None, design):
        super().__init__(policy, epsilon, predictor)
        self.design = design

    def full_query_tokens(self, lengths: torch.Tensor, eligible: torch.Tensor) -> float | None:
        return self.design.full_query_tokens(lengths, eligible)

    def choose(self, phi, candidates, budget, step, has_entropy, prompt_of, generator):
        return self.design(self, phi, candidates, budget, step, has_entropy, prompt_of, generator)


class PerPromptCap:
    """At most `cap` rows of S per prompt: the policy's preference order, taken within the cap."""

    def __init__(self, cap: int):
        self.cap = cap

    def full_query_tokens(self, lengths: torch.Tensor, eligible: torch.Tensor) -> None:
        return None

    def __call__(self, sel: Selector, phi, candidates, budget, step, has_entropy, prompt_of, generator):
        """(S, None): the policy's choice (`Selector.select`) under the cap."""
        cap = self.cap
        if sel.policy == "full":
            return capped(candidates, candidates.numel(), prompt_of, cap), None
        if sel.policy == "random" or (sel.policy == "learned" and not sel.model.trained):
            shuffled = candidates[torch.randperm(candidates.numel(), generator=generator)]
            return capped(shuffled, budget, prompt_of, cap), None
        if sel.policy == "entropy":
            order = top_subset(entropy_scores(phi, has_entropy), candidates, candidates.numel())
            return capped(order, budget, prompt_of, cap), None
        # lines 8-9 under the cap: the exploit part by u^, then uniform picks, both within the cap
        n_explore = min(exploration_count(budget, sel.epsilon), budget)
        exploit = capped(top_subset(sel.model.predict(phi), candidates, candidates.numel()), budget - n_explore,
                         prompt_of, cap)  # fmt: skip
        rest = candidates[~torch.isin(candidates, exploit)]
        rest = rest[torch.randperm(rest.numel(), generator=generator)]
        return capped(torch.cat([exploit, rest]), exploit.numel() + n_explore, prompt_of, cap), None


class Unbiased:
    """S sampled with inclusion probabilities pi growing with the score (or the predicted gradient size), in one
    sample or one per prompt; Eq. 11 weighs row i by 1 / pi_i."""

    def __init__(self, estimator: str = "hajek", strata: str = "none", inclusion_size: str = "score"):
        self.estimator, self.strata, self.inclusion_size = estimator, strata, inclusion_size

    def full_query_tokens(self, lengths: torch.Tensor, eligible: torch.Tensor) -> float | None:
        """Eq. 11's Horvitz-Thompson denominator under --estimator ht: T_C = sum_{i in C} T_i, the valid response
        tokens of every candidate (lengths, eligible (N,): the global rows, gathered over ranks; known before the
        teacher runs), so that sum_{i in S} w_i sum_t m_it D_it / T_C is exactly unbiased for the full-query token
        mean. None under the Hajek form (the objectives' sum_S w_i T_i)."""
        return float(lengths[eligible].sum()) if self.estimator == "ht" else None

    def __call__(self, sel: Selector, phi, candidates, budget, step, has_entropy, prompt_of, generator):
        """(S (global ids), the inclusion probabilities of its rows)."""
        if sel.policy == "entropy":
            scores = entropy_scores(phi, has_entropy)[candidates]
        elif sel.model.trained:
            scores = sel.model.predict(phi)[candidates]
        else:  # before f_psi's first update: uniform
            scores = torch.ones(candidates.numel())
        check_finite(scores, sel.policy, has_entropy, step)
        sizes = inclusion_sizes(scores, feature(phi, "response_len")[candidates], self.inclusion_size)  # (|C|,) T_i
        if self.strata == "prompt":
            if prompt_of is None:
                raise ValueError("--strata prompt needs each row's prompt (prompt_of)")
            stratum = torch.unique(prompt_of[candidates], return_inverse=True)[1]  # (|C|,) 0..H-1 by prompt id
            pi_c, low, high, r = stratified_probabilities(sizes, stratum, budget, sel.epsilon)  # (|C|,)
            picked = sample_stratified(low, high, stratum, r, generator)
        else:
            pi_c = inclusion_probabilities(sizes, budget, sel.epsilon)  # (|C|,)
            picked = sample_with_probabilities(pi_c, generator)
        return candidates[picked], pi_c[picked]


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
