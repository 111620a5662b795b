"""Eq. 3 and the utility terms of Eq. 7-8 from final hidden states, one chunk of positions at a time.

With Qwen3.5's 248,320-token vocabulary one position's fp32 logits take about 1 MB, so logits over a
micro-batch of responses (positions x V) do not fit. This path takes the student's and teacher's final
hidden states (P, H) of the valid response positions and the LM-head weights, and for each chunk of
positions computes both sides' logits, the student's top-k, the teacher gathered there, the top-k JSD
(Eq. 3) and the detached utility terms d, o, c (Eq. 7-8), then drops the logits. Backward recomputes
the chunk's student logits (one extra LM-head product) instead of storing them: the memory held
between forward and backward is O(P k), not O(P V).

The gradient of Eq. 3 with respect to the student logits z of one position, with support
s = [z_I - lse(z), log q], q = sum_{v not in I} p_v, and g = dD/ds, is

    dD/dz_v = [v in I] g_v + [v not in I] g_tail p_v / q - p_v (sum_{i in I} g_i + g_tail),

where p = softmax(z) and I the student's top-k ids. `topk_jsd_from_hidden` is numerically the same as
`topk_support` + `generalized_jsd` on full logits (a test compares values and gradients).
"""

import torch

from opd.divergence import generalized_jsd, tail_logp, upcast
from opd.utility import utility_terms


class _ChunkTopKJSD(torch.autograd.Function):
    """D (C,) for one chunk of positions, and the detached utility terms (C, 3) = (d, o, c)."""

    @staticmethod
    def forward(ctx, h_s, w_s, h_t, w_t, k: int, alpha: float):
        z = upcast(h_s @ w_s.T)  # (C, V) student logits
        with torch.no_grad():
            z_t = upcast(h_t @ w_t.T)  # (C, V) teacher logits
        k = min(k, z.shape[-1])
        lse = torch.logsumexp(z, dim=-1, keepdim=True)  # (C, 1)
        top = z.topk(k, dim=-1)
        s_k = top.values - lse  # (C, k)
        s_sup = torch.cat([s_k, tail_logp(s_k)], dim=-1)  # (C, k + 1)
        t_k = torch.log_softmax(z_t, dim=-1).gather(-1, top.indices)  # (C, k)
        t_sup = torch.cat([t_k, tail_logp(t_k)], dim=-1)  # (C, k + 1)
        with torch.enable_grad():
            s_leaf = s_sup.detach().requires_grad_(True)
            d_alpha = generalized_jsd(s_leaf, t_sup, alpha)  # (C,) Eq. 3
            (g,) = torch.autograd.grad(d_alpha.sum(), s_leaf)  # (C, k + 1) dD/ds
        d, o, c = utility_terms(z, z_t, k)  # (C,) each, Eq. 7-8
        terms = torch.stack([d, o, c], dim=-1)
        ctx.save_for_backward(h_s, w_s, top.indices, lse, s_sup[:, -1:].exp(), g)
        ctx.mark_non_differentiable(terms)
        return d_alpha.detach(), terms

    @staticmethod
    def backward(ctx, grad_d, _grad_terms):
        h_s, w_s, ids, lse, q, g = ctx.saved_tensors
        z = upcast(h_s @ w_s.T)  # (C, V) recomputed
        p = torch.exp(z - lse)  # (C, V)
        g = g * grad_d.unsqueeze(-1)  # (C, k + 1)
        g_top, g_tail = g[:, :-1], g[:, -1:]
        tail_scale = g_tail / q  # (C, 1)
        dz = p * (tail_scale - g.sum(-1, keepdim=True))  # every v: [v not in I] term and -p_v sum(g)
        dz.scatter_add_(-1, ids, g_top - p.gather(-1, ids) * tail_scale)  # v in I: + g_v, no tail term
        dz = dz.to(h_s.dtype)
        grad_h = dz @ w_s  # (C, H)
        grad_w = dz.T @ h_s  # (V, H)
        return grad_h, grad_w, None, None, None, None


def topk_jsd_from_hidden(
    h_s: torch.Tensor,
    w_s: torch.Tensor,
    h_t: torch.Tensor,
    w_t: torch.Tensor,
    k: int = 100,
    alpha: float = 0.5,
    chunk: int = 512,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position D_alpha (P,) with gradient to h_s and w_s, and detached (d, o, c) (P, 3).

    h_s, h_t: (P, H) final hidden states of the student and the teacher at the same response
    positions; w_s, w_t: (V, H) their LM-head weights. At most `chunk` positions' logits exist at once.
    Weights in another dtype than the hidden states (fp32 master weights under bf16 autocast) are cast
    once here, not per chunk; autograd carries the gradient back to the original weight.
    """
    if h_s.shape[0] == 0:
        return h_s.new_zeros(0, dtype=torch.float32), h_s.new_zeros(0, 3, dtype=torch.float32)
    w_s = w_s if w_s.dtype == h_s.dtype else w_s.to(h_s.dtype)
    w_t = w_t.detach() if w_t.dtype == h_t.dtype else w_t.detach().to(h_t.dtype)
    outs = [
        _ChunkTopKJSD.apply(h_s[j : j + chunk], w_s, h_t[j : j + chunk].detach(), w_t, k, alpha)
        for j in range(0, h_s.shape[0], chunk)
    ]
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])
