"""The learned utility predictor f_psi (Eq. 6) and its online training from replay (Algorithm 1, line 14).

f_psi is LayerNorm -> Linear(6, 32) -> SiLU -> Linear(32, 1) on the CPU (Appendix A.2, Table 5),
trained by its own Adam (lr 1e-3) on Eq. 10, separately from the MLLM. Its state - network,
normalizer, replay and optimizer - is identical on every rank: the inputs are all-gathered and every
random draw comes from a generator seeded by (selector seed, step, update).
"""

import numpy as np
import torch
from torch import nn

from opd.selection.features import RunningNormalizer
from opd.selection.replay import ReplayBuffer
from opd.seeding import seeded_generator
from opd.selection.config import PredictorConfig
from opd.maths.utility import recency_weights, selector_loss


class UtilityPredictor(nn.Module):
    """Eq. 6 of the paper: u^_i = f_psi(Normalize(phi_i)), a LayerNorm + one SiLU hidden layer MLP."""

    def __init__(self, dim: int = 6, hidden: int = 32):
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.SiLU(), nn.Linear(hidden, 1))

    def forward(self, phi_normalized: torch.Tensor) -> torch.Tensor:
        return self.net(phi_normalized).squeeze(-1)  # (N,)


class OnlineUtilityModel:
    """f_psi with its normalizer, replay buffer and optimizer."""

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
        """Algorithm 1, line 14: add the labelled pairs; if new pairs came and |R| >= M, update psi.

        Each update draws a replay minibatch, normalizes it with the current (frozen) statistics,
        weights items by recency and takes one Adam step on Eq. 10. Returns metrics.
        """
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

    def state_dict(self) -> dict:
        return {
            "net": self.net.state_dict(),
            "normalizer": self.normalizer.state_dict(),
            "replay": self.replay.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "updates": self.updates,
        }

    def load_state_dict(self, state: dict) -> None:
        self.net.load_state_dict(state["net"])
        self.normalizer.load_state_dict(state["normalizer"])
        self.replay.load_state_dict(state["replay"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.updates = int(state["updates"])
