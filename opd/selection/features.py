"""Selector features: Eq. 5 and the running normalizer of Appendix A.2 (Algorithm 1, line 4).

Everything here is computed from detached rollout statistics; no extra model forward pass.

Interpretations of the paper:
- Q_0.9 is the 90th percentile of a row's valid-token NLLs with linear interpolation (numpy's and
  torch.quantile's default); a row with no valid token gets zeros for its token statistics.
- The running normalizer's first update sets mean and variance to that batch's statistics (an
  exponential average started from zeros would take ~100 steps to forget its start); later updates
  are exponential with momentum 0.99. The variance is the batch's population variance.
"""

import torch

FEATURE_NAMES = ("mean_nll", "q90_nll", "mean_entropy", "response_len", "prompt_len", "crop_area")
"""phi's columns (Eq. 5), in order: read one by name with `feature`."""


def feature(phi: torch.Tensor, name: str) -> torch.Tensor:
    """phi's column `name` (one of FEATURE_NAMES): (..., 6) -> (...)."""
    return phi[..., FEATURE_NAMES.index(name)]


def masked_quantile(values: torch.Tensor, mask: torch.Tensor, q: float) -> torch.Tensor:
    """Per-row q-quantile over the masked entries, linear interpolation; 0 for an empty row.

    values, mask: (N, T) -> (N,).
    """
    n = mask.sum(-1)  # (N,)
    ordered = torch.where(mask, values, torch.full_like(values, float("inf"))).sort(-1).values  # (N, T)
    pos = q * (n - 1).clamp(min=0).to(values.dtype)  # (N,)
    lo = pos.floor().long()
    hi = pos.ceil().long()
    v_lo = ordered.gather(-1, lo.unsqueeze(-1)).squeeze(-1)
    v_hi = ordered.gather(-1, hi.unsqueeze(-1)).squeeze(-1)
    out = v_lo + (v_hi - v_lo) * (pos - lo.to(values.dtype))
    return torch.where(n > 0, out, torch.zeros_like(out))


def rollout_features(
    logp: torch.Tensor,
    entropy: torch.Tensor | None,
    mask: torch.Tensor,
    prompt_len: torch.Tensor | None,
    area: torch.Tensor | None,
) -> torch.Tensor:
    """Eq. 5 of the paper: phi_i = [mean l_i, Q_0.9(l_i), mean H_i, T_i, L_i, a_i].

    l_{i,t} = -log p_old(y_{i,t} | x_i, q_i, y_{i,<t}) is the sampled-token NLL, H_{i,t} the token
    entropy, T_i the response length, L_i the prompt length and a_i the crop-to-full area ratio.
    logp, entropy, mask: (N, T); prompt_len, area: (N,). Unavailable entropy, prompt length or crop
    area is represented by zero (Appendix A.2). Returns (N, 6) float32.
    """
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
    """Normalize(phi) of Eq. 6: (phi - mu) / sqrt(var + eps) with exponential running statistics.

    Updated on crop-eligible candidates during feature extraction (Algorithm 1, line 4) and held
    fixed during replay updates (Appendix A.3).
    """

    def __init__(self, dim: int = 6, momentum: float = 0.99, eps: float = 1e-6):
        self.momentum = momentum
        self.eps = eps
        self.mean = torch.zeros(dim)
        self.var = torch.ones(dim)
        self.count = 0

    def update(self, phi: torch.Tensor) -> None:
        """mu <- m mu + (1 - m) mean(phi);  var <- m var + (1 - m) var(phi); the first batch sets both."""
        if phi.numel() == 0:
            return
        phi = phi.float()
        batch_mean = phi.mean(0)
        batch_var = phi.var(0, unbiased=False)
        if self.count == 0:
            self.mean, self.var = batch_mean, batch_var
        else:
            self.mean = self.momentum * self.mean + (1 - self.momentum) * batch_mean
            self.var = self.momentum * self.var + (1 - self.momentum) * batch_var
        self.count += 1

    def __call__(self, phi: torch.Tensor) -> torch.Tensor:
        return (phi.float() - self.mean) / torch.sqrt(self.var + self.eps)

    def state_dict(self) -> dict:
        return {"mean": self.mean.clone(), "var": self.var.clone(), "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.var, self.count = state["mean"].clone(), state["var"].clone(), int(state["count"])
