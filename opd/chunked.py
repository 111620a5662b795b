"""Eq. 3 and the utility terms of Eq. 7-8 without (positions x vocabulary) tensors beyond one chunk.

With Qwen3.5's 248,320-token vocabulary one position's fp32 logits take about 1 MB, so logits over a
micro-batch of responses do not fit. Two functions compute the top-k JSD of Eq. 3 (student top-k
support plus a tail bucket, as `topk_support` + `generalized_jsd`) and the detached utility terms
d, o, c of Eq. 7-8 with an analytic gradient instead of autograd's stored intermediates:

- `budgeted_loss_from_hidden`: from the student's and teacher's final hidden states (P, H) and the
  LM-head weights, one chunk of positions at a time: both sides' logits, the loss terms, and the
  chunk's gradient contributions, which are accumulated into dL/dh (P, H) and dL/dW (V, H) during the
  forward (dL/dW starts as the first chunk's product, not a zero-filled buffer); the chunk's logits
  are then dropped. Backward hands the buffers to autograd as they are (a scaled copy only when the
  loss was scaled after the call), so dL/dW can become .grad without a (V, H) copy. Four LM-head
  products in all (student, teacher, dL/dh, dL/dW), the minimum; memory O(P k + V H).
  It returns the weighted sum of Eq. 11 directly (per-token weights are the Eq. 11 weights).
- `topk_jsd_from_logits`: the same per-position D from given logits, `chunk` positions at a time;
  backward builds the gradient in one (N, V) buffer.

The gradient of D at one position with respect to the student logits z, with p = softmax(z), I the
student's top-k ids, the support s = [z_I - lse(z), log q] where the tail

    log q = lse(z_{v not in I}) - lse(z),   q = sum_{v not in I} p_v,

is computed exactly (the top-k masked to -inf), and g = dD/ds, G = sum of all k + 1 entries of g, is

    dD/dz_v = g_v - p_v G                       for v in I,
    dD/dz_v = g_tail p_v / q - p_v G
            = r_v (g_tail - q G)                for v not in I,  r_v = exp(z_v - lse(z_{not I})) = p_v / q.

The second form has no 1 / q (q may underflow or be 0 at k = V) and r_v, q <= 1, so nothing large is
added and subtracted again: the buffer is filled with r_v (g_tail - q G) and the top-k entries are
then overwritten with g_v - p_v G. At k = V the tail is empty (log q = -inf, g_tail = 0) and every
entry is a top-k entry.

Tests compare values and gradients with `topk_support` + `generalized_jsd` on full logits, and with
autograd through an exact float64 support (the endpoints alpha = 0 and 1, k = V, peaked logits).
"""

import torch

from opd.divergence import generalized_jsd, upcast
from opd.utility import utility_terms


def _loss_parts(z: torch.Tensor, z_t: torch.Tensor, k: int, alpha: float):
    """One block of logits (C, V), which it overwrites (the top-k masked to -inf):
    D (C,), g = dD/ds (C, k + 1), ids (C, k), s = the student's support (C, k + 1), shift = lse(z_{not I}) (C, 1),
    (d, o, c) (C, 3)."""
    k = min(k, z.shape[-1])
    lse = torch.logsumexp(z, dim=-1, keepdim=True)  # (C, 1)
    lse_t = torch.logsumexp(z_t, dim=-1, keepdim=True)  # (C, 1)
    top = z.topk(k, dim=-1)  # I
    terms = torch.stack(utility_terms(z, z_t, k, student_topk=(top.values, top.indices)), dim=-1)  # (C, 3) Eq. 7-8
    t_k = z_t.gather(-1, top.indices) - lse_t  # (C, k) teacher at the student's ids
    shift = _masked_lse_(z, top.indices)  # (C, 1) lse(z_{v not in I})
    s_sup = torch.cat([top.values - lse, shift - lse], dim=-1)  # (C, k + 1) Eq. 3's student support
    t_sup = torch.cat([t_k, _masked_lse_(z_t, top.indices) - lse_t], dim=-1)  # (C, k + 1)
    with torch.enable_grad():
        s_leaf = s_sup.detach().requires_grad_(True)
        d_alpha = generalized_jsd(s_leaf, t_sup, alpha)  # (C,) Eq. 3
        (g,) = torch.autograd.grad(d_alpha.sum(), s_leaf)  # (C, k + 1)
    return d_alpha.detach(), g, top.indices, s_sup, shift, terms


def _masked_lse_(z: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """logsumexp over the entries outside ids (C, k), -inf when ids hold them all: `divergence.tail_logp`
    + lse(z), with the ids masked in z's own buffer (no (C, V) copy)."""
    if ids.shape[-1] >= z.shape[-1]:
        return torch.full_like(z[:, :1], float("-inf"))
    return torch.logsumexp(z.scatter_(-1, ids, float("-inf")), dim=-1, keepdim=True)  # (C, 1)


def _logit_grad(z: torch.Tensor, ids, s_sup, g, shift, inplace: bool = False) -> torch.Tensor:
    """dD/dz (C, V) by the formula in the module docstring, in one (C, V) buffer (z's own when `inplace`).

    z may have its top-k entries masked to -inf (they are overwritten); shift = lse(z_{not I}) (C, 1).
    """
    k = ids.shape[-1]
    G = g.sum(-1, keepdim=True)  # (C, 1)
    b = g[:, k:] - s_sup[:, k:].exp() * G  # (C, 1) g_tail - q G
    shift = shift.clamp(min=torch.finfo(z.dtype).min)  # an empty tail: z - shift stays finite or -inf
    dz = z.sub_(shift) if inplace else torch.sub(z, shift)  # (C, V)
    dz.clamp_(max=0.0).exp_().mul_(b)  # v not in I: r_v (g_tail - q G); r_v <= 1 there
    return dz.scatter_(-1, ids, g[:, :k] - s_sup[:, :k].exp() * G)  # v in I: g_v - p_v G, overwritten


def _owned(x: torch.Tensor) -> torch.Tensor:
    """A float32/float64 copy of a block of logits that `_loss_parts` may overwrite."""
    return x.float() if x.dtype not in (torch.float32, torch.float64) else x.clone()


class _FromLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z_s, z_t, k: int, alpha: float, chunk: int):
        parts = [_loss_parts(_owned(z_s[j : j + chunk]), _owned(z_t[j : j + chunk]), k, alpha) for j in range(0, z_s.shape[0], chunk)]
        d_alpha, g, ids, s_sup, shift, terms = (torch.cat(p) for p in zip(*parts))
        ctx.save_for_backward(z_s, ids, s_sup, g, shift)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(terms)
        return d_alpha, terms

    @staticmethod
    def backward(ctx, grad_d, _grad_terms):
        z_s, ids, s_sup, g, shift = ctx.saved_tensors
        g = g * grad_d.unsqueeze(-1)
        dz = torch.empty_like(z_s)  # (N, V) the gradient, filled one chunk at a time
        for j in range(0, z_s.shape[0], ctx.chunk):
            c = slice(j, j + ctx.chunk)
            dz[c] = _logit_grad(upcast(z_s[c]), ids[c], s_sup[c], g[c], shift[c])
        return dz, None, None, None, None


def topk_jsd_from_logits(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, k: int = 100, alpha: float = 0.5, chunk: int = 512
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position D_alpha (...) with gradient to the student logits, and detached (d, o, c) (..., 3).

    Same values as generalized_jsd(*topk_support(student_logits, teacher_logits, k), alpha). Positions
    are processed `chunk` at a time (the forward's working copies are O(chunk V)); the backward holds
    one (N, V) buffer (the gradient itself) instead of autograd's log-softmax copies.
    """
    shape = student_logits.shape[:-1]
    vocab = student_logits.shape[-1]
    d_alpha, terms = _FromLogits.apply(
        student_logits.reshape(-1, vocab), teacher_logits.detach().reshape(-1, vocab), k, alpha, chunk
    )
    return d_alpha.reshape(shape), terms.reshape(*shape, 3)


class _FromHidden(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_s, w_s, h_t, w_t, weights, k: int, alpha: float, chunk: int):
        w = w_s.to(h_s.dtype)  # one cast per call under mixed precision (a no-op otherwise)
        w_t = w_t.to(h_t.dtype)
        grad_h = torch.empty_like(h_s)  # (P, H) dL/dh, one row per position
        acc_dtype = torch.float32 if w_s.dtype != torch.float64 else w_s.dtype  # dL/dW accumulates in fp32 (or fp64)
        grad_w = None  # (V, H) dL/dW: the first chunk's product, later chunks added in place (no zero-filled buffer)
        loss = torch.zeros((), dtype=torch.float64, device=h_s.device)
        d_all, terms_all = [], []
        for j in range(0, h_s.shape[0], chunk):
            h_c = h_s[j : j + chunk]  # (C, H)
            z = upcast(h_c @ w.T)  # (C, V) student logits
            z_t = upcast(h_t[j : j + chunk] @ w_t.T)  # (C, V) teacher logits
            d_alpha, g, ids, s_sup, shift, terms = _loss_parts(z, z_t, k, alpha)  # overwrites z, z_t
            del z_t
            w_c = weights[j : j + chunk].to(g.dtype)
            dz = _logit_grad(z, ids, s_sup, g * w_c.unsqueeze(-1), shift, inplace=True).to(h_s.dtype)  # (C, V)
            del z
            grad_h[j : j + chunk] = dz @ w  # (C, H)
            if grad_w is None:
                grad_w = (dz.T @ h_c).to(acc_dtype)  # (V, H)
            elif grad_w.dtype == dz.dtype:
                grad_w.addmm_(dz.T, h_c)  # (V, H), accumulated in place
            else:
                grad_w.add_(dz.T @ h_c)  # bf16 products summed in fp32
            del dz
            loss += (w_c * d_alpha).sum()
            d_all.append(d_alpha)
            terms_all.append(terms)
        ctx.save_for_backward(grad_h, grad_w.to(w_s.dtype))
        d_all, terms_all = torch.cat(d_all), torch.cat(terms_all)
        ctx.mark_non_differentiable(d_all, terms_all)
        return loss, d_all, terms_all

    @staticmethod
    def backward(ctx, grad_loss, _grad_d, _grad_terms):
        grad_h, grad_w = ctx.saved_tensors
        if not bool(grad_loss == 1):  # the loss was scaled after the call: a scaled copy
            grad_h, grad_w = grad_h * grad_loss.to(grad_h.dtype), grad_w * grad_loss.to(grad_w.dtype)
        # else the buffers themselves: autograd can take dL/dW as .grad without a (V, H) copy
        return grad_h, grad_w, None, None, None, None, None, None


def budgeted_loss_from_hidden(
    h_s: torch.Tensor,
    w_s: torch.Tensor,
    h_t: torch.Tensor,
    w_t: torch.Tensor,
    weights: torch.Tensor,
    k: int = 100,
    alpha: float = 0.5,
    chunk: int = 512,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """sum_p weights_p D_alpha(p) (Eq. 11 with its per-token weights, Eq. 3 per position), differentiable
    to h_s and w_s; plus the detached per-position D (P,) and (d, o, c) (P, 3).

    h_s, h_t: (P, H) final hidden states of the student and the teacher at the same response
    positions; w_s, w_t: (V, H) their LM-head weights; weights: (P,). At most `chunk` positions'
    logits exist at once. Weights in another dtype than the hidden states (fp32 master weights under
    bf16 autocast) are cast once per call; dL/dW is accumulated in fp32.
    """
    if h_s.shape[0] == 0:
        zero = (h_s.sum() + w_s.sum()) * 0.0  # keeps the graph (and DDP's gradient hooks) intact
        return zero, h_s.new_zeros(0, dtype=torch.float32), h_s.new_zeros(0, 3, dtype=torch.float32)
    return _FromHidden.apply(h_s, w_s, h_t.detach(), w_t.detach(), weights.detach(), k, alpha, chunk)
