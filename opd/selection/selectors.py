"""Choosing S before any teacher computation (Algorithm 1, lines 4-10, 14): Eq. 4's budget, the policies (lines 5-9),
Eq. 5's features phi_i and their running normalizer, Eq. 6's predictor f_psi, its loss (Eq. 10, 12) and its FIFO
replay (line 14). Selectors see the *global* candidates (all ranks' features) and return global row ids; every draw
comes from a seed shared by the ranks, so all ranks select alike. |S| <= K always. Top-K ties go to the lower row.
- full: S = C (rho must be 1). random (Appendix A.1): K uniform picks without replacement.
- entropy (Appendix A.1): the K rows of highest mean token entropy (mean sampled-token NLL without entropies).
- learned (lines 5-9): uniform until f_psi's first update, then the top K - K_e rows by u^ plus K_e = ceil(eps K)
  uniform picks from the rest. Other designs: `opd.selection.designs`; the paper's gaps: docs/DEPARTURES.md 8-10, 24.
Details: docs/MODULES.md#opdselectionselectors."""

import math
import numbers

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from opd.engine.rollout import seeded_generator
from opd.selection.config import POLICIES, PredictorConfig


def query_budget(rho: float, n_eligible: int) -> int:
    """Eq. 4: K = floor(rho |C|), rho in (0, 1]; + 1e-9 against float error (0.29 * 100 must give 29)."""
    if isinstance(rho, bool) or not isinstance(rho, numbers.Real) or not 0.0 < float(rho) <= 1.0:
        raise ValueError(f"the query ratio rho must be a number in (0, 1], got {rho!r}")
    rho = float(rho)
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


def learned_subset(predicted: torch.Tensor, candidates: torch.Tensor, budget: int, n_explore: int,
                   generator: torch.Generator) -> torch.Tensor:  # fmt: skip
    """Algorithm 1, line 9: top K - K_e by u^ plus K_e uniform picks from the remaining candidates."""
    n_explore = min(n_explore, budget)
    exploit = top_subset(predicted, candidates, budget - n_explore)
    rest = candidates[~torch.isin(candidates, exploit)]
    return torch.cat([exploit, uniform_subset(rest, n_explore, generator)])


def entropy_scores(phi: torch.Tensor, has_entropy: bool) -> torch.Tensor:
    """Entropy-25's score: mean token entropy, else (no entropies) mean sampled-token NLL, from phi (Eq. 5)."""
    return feature(phi, "mean_entropy" if has_entropy else "mean_nll")


class Selector:
    """One selection policy: `select` returns (S, pi), `observe` takes the utility labels (line 14)."""

    def __init__(self, policy: str, epsilon: float = 0.10, predictor: PredictorConfig | None = None):
        if policy not in POLICIES:
            raise ValueError(f"unknown selection policy {policy!r}; known: {', '.join(POLICIES)}")
        self.policy, self.epsilon = policy, epsilon
        self.cfg = predictor or PredictorConfig()
        self.model = OnlineUtilityModel(self.cfg) if policy == "learned" else None

    def full_query_tokens(self, lengths: torch.Tensor, eligible: torch.Tensor) -> float | None:
        """Eq. 11's Horvitz-Thompson denominator T_C under a design with one (`opd.selection.designs`), else None."""
        return None

    def select(self, phi: torch.Tensor, eligible: torch.Tensor, budget: int, step: int, has_entropy: bool = True,
               prompt_of: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """S (|S|,) sorted global row ids; pi (|S|,) their inclusion probabilities under a sampling design, else None.
        phi (N, 6) global features (Eq. 5), eligible (N,) bool, budget K (Eq. 4), prompt_of (N,) each row's prompt."""
        candidates = eligible.nonzero().squeeze(-1)  # (|C|,)
        generator = seeded_generator(self.cfg.seed, step)
        if self.policy == "learned":
            self.model.normalizer.update(phi[candidates])  # Algorithm 1, line 4: update on C
        chosen, pi = self.choose(phi, candidates, budget, step, has_entropy, prompt_of, generator)
        chosen, order = chosen.sort()
        pi = pi[order] if pi is not None else None
        if chosen.numel() > budget:  # Eq. 4's budget is never exceeded (an explicit check: not gone under -O)
            raise RuntimeError(f"the query budget was exceeded: |S| = {chosen.numel()} > K = {budget}")
        return chosen, pi

    def choose(self, phi, candidates: torch.Tensor, budget: int, step: int, has_entropy: bool, prompt_of, generator):
        """Lines 5-9 by the paper's policy: (S unsorted, None); a design chooses in its place (`designs`)."""
        if self.policy == "full":
            return candidates, None
        if self.policy == "entropy":
            return top_subset(entropy_scores(phi, has_entropy), candidates, budget), None
        if self.policy == "random" or not self.model.trained:  # learned: lines 5-6 before f_psi's first update
            return uniform_subset(candidates, budget, generator), None
        n_explore = exploration_count(budget, self.epsilon)  # lines 8-9
        return learned_subset(self.model.predict(phi), candidates, budget, n_explore, generator), None

    def predict(self, phi: torch.Tensor) -> torch.Tensor | None:
        """u^ for logging and audits (learned policy only)."""
        return self.model.predict(phi) if self.model is not None and self.model.trained else None

    def observe(self, phi: torch.Tensor, u: torch.Tensor, step: int) -> dict[str, float]:
        """Algorithm 1, line 14 (learned policy only): labelled pairs into replay, then psi updates."""
        return self.model.observe(phi, u, step) if self.model is not None else {}


FEATURE_NAMES = ("mean_nll", "q90_nll", "mean_entropy", "response_len", "prompt_len", "crop_area")


def feature(phi: torch.Tensor, name: str) -> torch.Tensor:
    """phi's column `name` (one of FEATURE_NAMES, Eq. 5's columns in order): (..., 6) -> (...)."""
    return phi[..., FEATURE_NAMES.index(name)]


def masked_quantile(values: torch.Tensor, mask: torch.Tensor, q: float) -> torch.Tensor:
    """Per-row q-quantile over the masked entries, linear interpolation, 0 for an empty row: (N, T) -> (N,)."""
    n = mask.sum(-1)  # (N,)
    ordered = torch.where(mask, values, torch.full_like(values, float("inf"))).sort(-1).values  # (N, T)
    pos = q * (n - 1).clamp(min=0).to(values.dtype)  # (N,)
    lo = pos.floor().long()
    hi = pos.ceil().long()
    v_lo = ordered.gather(-1, lo.unsqueeze(-1)).squeeze(-1)
    v_hi = ordered.gather(-1, hi.unsqueeze(-1)).squeeze(-1)
    out = v_lo + (v_hi - v_lo) * (pos - lo.to(values.dtype))
    return torch.where(n > 0, out, torch.zeros_like(out))


def rollout_features(logp: torch.Tensor, entropy: torch.Tensor | None, mask: torch.Tensor,
                     prompt_len: torch.Tensor | None, area: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """Eq. 5: phi_i = [mean l_i, Q_0.9(l_i), mean H_i, T_i, L_i, a_i] -> (N, 6) float32, from the rollout's statistics.
    l = -logp (sampled-token NLL), H token entropy, T/L response/prompt length, a crop-to-full area ratio. logp,
    entropy, mask: (N, T); prompt_len, area: (N,); a missing entropy, prompt length or area is 0 (Appendix A.2)."""
    mask = mask.bool()
    m = mask.to(torch.float32)
    t_i = m.sum(-1)  # (N,)
    denom = t_i.clamp(min=1.0)
    nll = -logp.float()  # (N, T)
    mean_nll = (nll * m).sum(-1) / denom
    q90 = masked_quantile(nll, mask, 0.9)
    zeros = torch.zeros_like(t_i)
    mean_h = (entropy.float() * m).sum(-1) / denom if entropy is not None else zeros
    l_i = prompt_len.float() if prompt_len is not None else zeros
    a_i = area.float() if area is not None else zeros
    return torch.stack([mean_nll, q90, mean_h, t_i, l_i, a_i], dim=-1)  # (N, 6)


class RunningNormalizer:
    """Normalize of Eq. 6: (phi - mu) / sqrt(var + eps), running stats updated on C (line 4), fixed during replay."""

    def __init__(self, dim: int = 6, momentum: float = 0.99, eps: float = 1e-6):
        self.momentum, self.eps = momentum, eps
        self.mean, self.var, self.count = torch.zeros(dim), torch.ones(dim), 0

    def update(self, phi: torch.Tensor) -> None:
        """mu <- m mu + (1 - m) mean(phi);  var <- m var + (1 - m) var(phi); the first batch sets both."""
        if phi.numel() == 0:
            return
        batch_mean, batch_var = phi.float().mean(0), phi.float().var(0, unbiased=False)
        if self.count == 0:
            self.mean, self.var = batch_mean, batch_var
        else:
            self.mean = self.momentum * self.mean + (1 - self.momentum) * batch_mean
            self.var = self.momentum * self.var + (1 - self.momentum) * batch_var
        self.count += 1

    def __call__(self, phi: torch.Tensor) -> torch.Tensor:
        return (phi.float() - self.mean) / torch.sqrt(self.var + self.eps)


class UtilityPredictor(nn.Module):
    """Eq. 6 of the paper: u^_i = f_psi(Normalize(phi_i)), a LayerNorm + one SiLU hidden layer MLP."""

    def __init__(self, dim: int = 6, hidden: int = 32):
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.SiLU(), nn.Linear(hidden, 1))

    def forward(self, phi_normalized: torch.Tensor) -> torch.Tensor:
        return self.net(phi_normalized).squeeze(-1)  # (N,)


class OnlineUtilityModel:
    """f_psi (CPU, Table 5) with its normalizer, replay buffer and own Adam, trained on Eq. 10 apart from the MLLM."""

    def __init__(self, cfg: PredictorConfig, dim: int = 6):
        self.cfg = cfg
        self.rank_weight = cfg.rank_loss_weight  # lambda_rank of Eq. 10 (0 under --no-rank-loss)
        with torch.random.fork_rng(devices=[]):  # psi's init from the selector seed, same on every rank
            torch.manual_seed(cfg.seed)
            self.net = UtilityPredictor(dim, cfg.hidden)
        self.normalizer = RunningNormalizer(dim, cfg.norm_momentum, cfg.norm_eps)
        self.replay = ReplayBuffer(cfg.replay_capacity, dim)
        self.optimizer = torch.optim.Adam(self.net.parameters(), lr=cfg.lr)
        self.updates = 0

    @property
    def trained(self) -> bool:
        """Whether f_psi has had at least one update (Algorithm 1, line 5)."""
        return self.updates > 0

    @torch.no_grad()
    def predict(self, phi: torch.Tensor) -> torch.Tensor:
        """u^ for raw features phi (N, 6) with the current normalizer."""
        return self.net(self.normalizer(phi))

    def observe(self, phi: torch.Tensor, u: torch.Tensor, step: int) -> dict[str, float]:
        """Algorithm 1, line 14: add the labelled pairs; if new pairs came and |R| >= M, Adam steps on Eq. 10, each on a
        recency-weighted replay minibatch normalized with the current (frozen) statistics. Returns metrics."""
        added = self.replay.add(phi, u, step)
        metrics = {"select/replay_size": float(len(self.replay)), "select/labels_added": float(added)}
        if added == 0 or len(self.replay) < self.cfg.replay_start:
            return metrics
        losses = []
        for j in range(self.cfg.updates_per_step):
            phi_b, u_b, s_b = self.replay.sample(self.cfg.replay_batch, seeded_generator(self.cfg.seed, step, j))
            w = recency_weights(s_b, step, self.cfg.half_life)
            loss = selector_loss(self.net(self.normalizer(phi_b)), u_b, w, self.rank_weight, self.cfg.min_gap)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            self.updates += 1
            losses.append(loss.item())
        metrics["loss/selector"] = float(np.mean(losses))
        return metrics


def recency_weights(collected_at: torch.Tensor, step: int, half_life: float = 10.0) -> torch.Tensor:
    """Appendix A.3: w_i = 2^(-(s - s_i) / h) for an item collected at step s_i, read at step s."""
    return torch.pow(2.0, -(step - collected_at.double()) / half_life).float()


def weighted_huber(pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor, delta: float = 1.0) -> torch.Tensor:
    """Eq. 12 of the paper: L_reg = sum_i w_i Huber(u^_i - u_i) / sum_i w_i (Huber with delta 1)."""
    per_item = F.huber_loss(pred, target, reduction="none", delta=delta)  # (B,)
    return (weights * per_item).sum() / weights.sum().clamp(min=torch.finfo(weights.dtype).tiny)


def pairwise_rank_loss(pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor, min_gap: float = 1e-6):
    """L_rank of Eq. 10 (App. A.3): w_i w_j-weighted mean of softplus(-sgn(u_i - u_j) (u^_i - u^_j)) over unordered
    pairs i < j with |u_i - u_j| > min_gap; 0 when no pair qualifies."""
    du = target.unsqueeze(1) - target.unsqueeze(0)  # (B, B) u_i - u_j
    dp = pred.unsqueeze(1) - pred.unsqueeze(0)  # (B, B) u^_i - u^_j
    ww = weights.unsqueeze(1) * weights.unsqueeze(0)  # (B, B) w_i w_j
    upper = torch.ones_like(du, dtype=torch.bool).triu(diagonal=1)
    pairs = upper & (du.abs() > min_gap)
    if not pairs.any():
        return pred.sum() * 0.0
    terms = F.softplus(-torch.sign(du) * dp)  # (B, B)
    return (ww * terms)[pairs].sum() / ww[pairs].sum()


def selector_loss(pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor, rank_weight: float = 0.2,
                  min_gap: float = 1e-6) -> torch.Tensor:  # fmt: skip
    """Eq. 10 of the paper: L_sel = L_reg + lambda_rank L_rank (L_reg is Eq. 12)."""
    loss = weighted_huber(pred, target, weights)
    if rank_weight:
        loss = loss + rank_weight * pairwise_rank_loss(pred, target, weights, min_gap)
    return loss


class ReplayBuffer:
    """Replay R (line 14; App. A.3, Table 5): bounded FIFO of detached (raw phi_i, label u_i, collection step s_i)."""

    def __init__(self, capacity: int = 512, dim: int = 6):
        self.capacity, self.phi, self.u = capacity, torch.zeros(0, dim), torch.zeros(0)
        self.step = torch.zeros(0, dtype=torch.long)

    def __len__(self) -> int:
        return self.u.numel()

    def add(self, phi: torch.Tensor, u: torch.Tensor, step: int) -> int:
        """Appends the finite pairs, drops the oldest beyond capacity; returns how many were added."""
        keep = torch.isfinite(u) & torch.isfinite(phi).all(-1)
        phi, u = phi[keep].float(), u[keep].float()
        self.phi = torch.cat([self.phi, phi])[-self.capacity :]
        self.u = torch.cat([self.u, u])[-self.capacity :]
        self.step = torch.cat([self.step, torch.full((u.numel(),), step, dtype=torch.long)])[-self.capacity :]
        return int(u.numel())

    def sample(self, size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A uniform minibatch without replacement of min(size, len) items: (phi, u, s)."""
        idx = torch.randperm(len(self), generator=generator)[: min(size, len(self))]
        return self.phi[idx], self.u[idx], self.step[idx]
