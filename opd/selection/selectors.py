"""Choosing S before any teacher computation: Eq. 4 and the paper's policies (Algorithm 1, lines 4-9).

Every selector sees the *global* candidates (features all-gathered from every rank) and returns global row ids; its
draws come from a seed shared by the ranks, so all ranks make the same selection. |S| <= K always holds; `select`
checks it (a RuntimeError otherwise). (Not a top-level selectors.py: it would shadow the standard library's.)

- full: S = C (rho must be 1).
- random (Appendix A.1): K uniform picks without replacement (a CPU permutation seeded by the seed and the step).
- entropy (Appendix A.1): the K rows of highest mean token entropy (mean sampled-token NLL when entropy is
  unavailable); ties go to the lower row index.
- learned (Algorithm 1, lines 5-9): uniform until f_psi's first update; then the top K - K_e rows by predicted
  utility plus K_e = ceil(eps K) uniform picks from the remaining candidates.

Other designs (a per-prompt cap, unbiased sampling with 1 / pi weights) are `opd.selection.designs`, called in place
of the policy's choice through `Selector.design`."""

import math
import numbers

import torch

from opd.selection.predictor import OnlineUtilityModel
from opd.seeding import seeded_generator
from opd.selection.config import POLICIES, PredictorConfig
from opd.selection.features import feature


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


def entropy_scores(phi: torch.Tensor, has_entropy: bool) -> torch.Tensor:
    """Entropy-25's score: mean token entropy, else (no entropies) mean sampled-token NLL, from phi (Eq. 5)."""
    return feature(phi, "mean_entropy" if has_entropy else "mean_nll")


class Selector:
    """One selection policy. `select` returns S (sorted global indices) and, under a design that samples S, their
    inclusion probabilities pi (the loss weighs row i by 1 / pi_i; None otherwise); `observe` takes the labels."""

    def __init__(self, policy: str, epsilon: float = 0.10, predictor: PredictorConfig | None = None, design=None):
        """`design` (`opd.selection.designs`): chooses S in place of the policy (None: the paper's policy)."""
        if policy not in POLICIES:
            raise ValueError(f"unknown selection policy {policy!r}; known: {', '.join(POLICIES)}")
        self.policy = policy
        self.epsilon = epsilon
        self.design = design
        self.cfg = predictor or PredictorConfig()
        self.model = OnlineUtilityModel(self.cfg) if policy == "learned" else None

    def full_query_tokens(self, lengths: torch.Tensor, eligible: torch.Tensor) -> float | None:
        """Eq. 11's Horvitz-Thompson denominator T_C under a design that has one (`--estimator ht`), else None."""
        return self.design.full_query_tokens(lengths, eligible) if self.design is not None else None

    def select(self, phi: torch.Tensor, eligible: torch.Tensor, budget: int, step: int, has_entropy: bool = True,
               prompt_of: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """(S, pi) for one step: S the sorted global row ids (|S|,), and under a sampling design pi (|S|,) the
        inclusion probabilities of S's rows, in S's order (None otherwise). phi (N, 6) global features (Eq. 5),
        eligible (N,) bool, budget K (Eq. 4), prompt_of (N,) each row's prompt (for a design by prompt)."""
        candidates = eligible.nonzero().squeeze(-1)  # (|C|,)
        generator = seeded_generator(self.cfg.seed, step)
        pi = None
        if self.policy == "learned":
            self.model.normalizer.update(phi[candidates])  # Algorithm 1, line 4: update on C
        if self.design is not None:
            chosen, pi = self.design(self, phi, candidates, budget, step, has_entropy, prompt_of, generator)
        elif self.policy == "full":
            chosen = candidates
        elif self.policy == "entropy":
            chosen = top_subset(entropy_scores(phi, has_entropy), candidates, budget)
        elif self.policy == "random" or not self.model.trained:  # learned: lines 5-6 before f_psi's first update
            chosen = uniform_subset(candidates, budget, generator)
        else:  # lines 8-9
            n_explore = exploration_count(budget, self.epsilon)
            chosen = learned_subset(self.model.predict(phi), candidates, budget, n_explore, generator)
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
