"""The selector's replay buffer ℛ (Algorithm 1, line 14; Appendix A.3, Table 5).

A bounded first-in, first-out buffer of detached (phi_i, u_i, s_i): raw features (normalized at
update time with the current statistics), the utility label, and the step it was collected at.
Minibatches are drawn uniformly without replacement, capped by the current size, from a generator
the caller seeds (so every rank draws the same minibatch).
"""

import torch


class ReplayBuffer:
    def __init__(self, capacity: int = 512, dim: int = 6):
        self.capacity = capacity
        self.phi = torch.zeros(0, dim)
        self.u = torch.zeros(0)
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

    def state_dict(self) -> dict:
        return {"phi": self.phi.clone(), "u": self.u.clone(), "step": self.step.clone(), "capacity": self.capacity}

    def load_state_dict(self, state: dict) -> None:
        self.phi, self.u, self.step = state["phi"].clone(), state["u"].clone(), state["step"].clone()
        self.capacity = int(state["capacity"])
