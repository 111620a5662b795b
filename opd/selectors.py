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
`opd.divergence.budgeted_weights`). The budget is unchanged. Before f_psi's first update the learned scores are
uniform (pi = K / |C|, every w_i equal: plain Eq. 11).

A per-prompt cap (`max_per_prompt`, `--max-per-prompt N`): at most N rows of S per prompt, for the top-K and
uniform policies (spreading the supervision over prompts; `capped`); with fewer than K rows allowed, S is smaller.
"""

import math
import numbers
from dataclasses import dataclass

import torch

from opd.cli import Section
from opd.predictor import OnlineUtilityModel, PredictorConfig
from opd.seeding import seeded_generator

POLICIES = ("full", "random", "entropy", "learned")


@dataclass
class SelectionConfig(Section):
    """Which rows of C the teacher scores: Eq. 4's budget and the policy of Algorithm 1, lines 4-9."""

    policy: str = "learned"
    """Selection policy: full, random, entropy or learned."""
    rho: float = 0.25
    """Query ratio rho in (0, 1]; the budget is K = floor(rho |C|) per step (Eq. 4)."""
    explore: float = 0.10
    """Exploration ratio eps of the learned selector: K_e = ceil(eps K); with --unbiased the uniform share of the
    inclusion probabilities."""
    unbiased: bool = False
    """Sample S with inclusion probabilities that grow with the score (learned: predicted utility; entropy: mean
    entropy) instead of taking the top K, and weigh each row's loss by 1 / pi (Eq. 11's Hajek form; opd/selectors.py)."""
    max_per_prompt: int = 0
    """At most N rows of S per prompt (top-K and uniform policies); 0 = no cap."""
    no_exploration: bool = False
    """Ablation: learned selection without random exploration (K_e = 0)."""

    @property
    def epsilon(self) -> float:
        """eps of Algorithm 1, line 8 (0 under --no-exploration)."""
        return 0.0 if self.no_exploration else self.explore

    @property
    def label(self) -> str:
        """The table label: policy-percent, e.g. learned-25."""
        return f"{self.policy}-{round(100 * self.rho)}"

    def check(self) -> list[str]:
        problems = []
        if self.policy not in POLICIES:
            problems.append(f"--policy {self.policy!r}: choose one of {', '.join(POLICIES)}")
        if not 0.0 < self.rho <= 1.0:
            problems.append(f"--rho {self.rho}: the query ratio must lie in (0, 1]")
        if self.policy == "full" and self.rho != 1.0:
            problems.append(f"--policy full queries every candidate: it needs --rho 1, got {self.rho}")
        if not 0.0 <= self.explore < 1.0:
            problems.append(f"--explore {self.explore}: must lie in [0, 1)")
        if self.unbiased and self.policy == "random":
            problems.append("--unbiased with --policy random: uniform selection is already unbiased (every row has "
                            "pi = K / |C|)")
        elif self.unbiased and self.policy not in ("entropy", "learned"):
            problems.append(f"--unbiased samples by a score: it needs --policy entropy or learned, not {self.policy}")
        if self.unbiased and self.epsilon == 0:
            problems.append("--unbiased needs exploration (--explore > 0, no --no-exploration): rows scored 0 would "
                            "get pi = 0 and never be drawn, and the 1 / pi weighting would not be unbiased")
        if self.max_per_prompt < 0:
            problems.append(f"--max-per-prompt {self.max_per_prompt}: must be at least 1 (0 = no cap)")
        if self.unbiased and self.max_per_prompt:
            problems.append("--unbiased and --max-per-prompt: a cap would change the inclusion probabilities; choose one")
        return problems


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
    """One selection policy. `select` returns sorted global indices of S and keeps their inclusion probabilities in
    `last_pi` when unbiased (the loss weighs row i by 1 / pi_i; None otherwise); `observe` takes the labels."""

    def __init__(self, policy: str, epsilon: float = 0.10, predictor: PredictorConfig | None = None,
                 unbiased: bool = False, max_per_prompt: int = 0):  # fmt: skip
        if policy not in POLICIES:
            raise ValueError(f"unknown selection policy {policy!r}; known: {', '.join(POLICIES)}")
        if unbiased and policy not in ("entropy", "learned"):
            raise ValueError(f"unbiased selection samples by a score: entropy or learned, not {policy!r}")
        if unbiased and max_per_prompt:
            raise ValueError("a per-prompt cap would change the inclusion probabilities of unbiased selection")
        self.policy = policy
        self.epsilon = epsilon
        self.unbiased = unbiased
        self.max_per_prompt = max_per_prompt
        self.cfg = predictor or PredictorConfig()
        self.model = OnlineUtilityModel(self.cfg) if policy == "learned" else None
        self.last_pi: torch.Tensor | None = None

    @classmethod
    def from_config(cls, selection: SelectionConfig, predictor: PredictorConfig) -> "Selector":
        return cls(selection.policy, selection.epsilon, predictor, selection.unbiased, selection.max_per_prompt)

    def select(self, phi: torch.Tensor, eligible: torch.Tensor, budget: int, step: int, has_entropy: bool = True,
               prompt_of: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """S for one step, sorted global row ids. phi (N, 6) global features (Eq. 5), eligible (N,) bool, budget K
        (Eq. 4), prompt_of (N,) each row's prompt (for the per-prompt cap). Unbiased: `last_pi` (|S|,) holds the
        inclusion probabilities of S's rows, in S's order."""
        chosen, self.last_pi = self._select(phi, eligible, budget, step, has_entropy, prompt_of)
        return chosen

    def _select(self, phi, eligible, budget, step, has_entropy, prompt_of):
        candidates = eligible.nonzero().squeeze(-1)  # (|C|,)
        cap = self.max_per_prompt
        generator = seeded_generator(self.cfg.seed, step)
        pi = None
        if self.policy == "learned":
            self.model.normalizer.update(phi[candidates])  # Algorithm 1, line 4: update on C
        if self.unbiased:
            if self.policy == "entropy":
                scores = entropy_scores(phi, has_entropy)[candidates]
            elif self.model.trained:
                scores = self.model.predict(phi)[candidates]
            else:  # before f_psi's first update: uniform
                scores = torch.ones(candidates.numel())
            check_finite(scores, self.policy, has_entropy, step)
            pi_c = inclusion_probabilities(scores, budget, self.epsilon)  # (|C|,)
            picked = sample_with_probabilities(pi_c, generator)
            chosen, pi = candidates[picked], pi_c[picked]
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
