"""Choosing S before any teacher computation: Eq. 4 and the four policies (Algorithm 1, lines 4-9).

Every selector sees the *global* candidate batch (features all-gathered from every rank) and returns
global row indices; it uses no per-rank randomness, so all ranks make the same selection.
|S| <= K always holds; `select` asserts it.

- full: S = C (rho must be 1).
- random (Appendix A.1): K uniform picks without replacement, from a CPU permutation seeded by the
  selector seed and the step.
- entropy (Appendix A.1): the K rows with the highest mean token entropy; mean sampled-token NLL when
  entropy is unavailable. Ties go to the lower row index.
- learned (Algorithm 1, lines 5-9): uniform until f_psi's first update; then the top K - K_e rows by
  predicted utility plus K_e = ceil(eps K) uniform picks from the remaining candidates.
"""

import math
import numbers

import torch

from opd.predictor import OnlineUtilityModel, PredictorConfig
from opd.seeding import seeded_generator

POLICIES = ("full", "random", "entropy", "learned")


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
    """Entropy-25's score: mean token entropy (phi[:, 2]), else mean sampled-token NLL (phi[:, 0])."""
    return phi[:, 2] if has_entropy else phi[:, 0]


class Selector:
    """One selection policy. `select` returns sorted global indices of S; `observe` takes the labels."""

    def __init__(self, policy: str, epsilon: float = 0.10, predictor: PredictorConfig | None = None):
        if policy not in POLICIES:
            raise ValueError(f"unknown selection policy {policy!r}; known: {', '.join(POLICIES)}")
        self.policy = policy
        self.epsilon = epsilon
        self.cfg = predictor or PredictorConfig()
        self.model = OnlineUtilityModel(self.cfg) if policy == "learned" else None

    def select(self, phi: torch.Tensor, eligible: torch.Tensor, budget: int, step: int, has_entropy: bool = True):
        """S for one step. phi (N, 6) global features (Eq. 5), eligible (N,) bool, budget K (Eq. 4)."""
        candidates = eligible.nonzero().squeeze(-1)  # (|C|,)
        if self.policy == "full":
            chosen = candidates
        elif self.policy == "random":
            chosen = uniform_subset(candidates, budget, seeded_generator(self.cfg.seed, step))
        elif self.policy == "entropy":
            chosen = top_subset(entropy_scores(phi, has_entropy), candidates, budget)
        else:
            self.model.normalizer.update(phi[candidates])  # Algorithm 1, line 4: update on C
            generator = seeded_generator(self.cfg.seed, step)
            if not self.model.trained:  # lines 5-6
                chosen = uniform_subset(candidates, budget, generator)
            else:  # lines 8-9
                n_explore = exploration_count(budget, self.epsilon)
                chosen = learned_subset(self.model.predict(phi), candidates, budget, n_explore, generator)
        chosen = chosen.sort().values
        assert chosen.numel() <= budget, f"the query budget was exceeded: |S| = {chosen.numel()} > K = {budget}"
        return chosen

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
