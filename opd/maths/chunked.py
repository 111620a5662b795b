"""Eq. 3 and the utility terms of Eq. 7-8 without (positions x vocabulary) tensors beyond one chunk.

With Qwen3.5's 248,320-token vocabulary a micro-batch's logits do not fit, so a method's per-position divergence D
on its top-k support (`family.topk_divergence`) and the detached utility terms of Eq. 7-8 are computed one chunk of
positions at a time, with an analytic gradient instead of autograd's stored intermediates:

- `budgeted_loss_from_hidden` (Eq. 11, what training calls): from final hidden states and the LM head, four LM-head
  products in all, memory O(P k + V H) (a frozen LM head: three products, O(P k));
- `topk_divergence_from_logits` (alias `topk_jsd_from_logits`): the same D from given logits;
- `sampled_logp_from_hidden` / `sampled_logp`: detached log p(y_t) of the sampled tokens;
- `clamped_kl_from_hidden`: DAPD's clamped forward KL(anchor || student);
- `weighted_logp_from_hidden`: sum_p a_p log p(y_p) with gradient (OPOD's policy-gradient term).

Tests compare values and gradients with `topk_divergence` on full logits, autograd in float64 and gradcheck.
Details (the gradient per support, memory): docs/MODULES.md#opdmathschunked."""

from collections.abc import Callable

import torch

from opd.maths.divergence import generalized_jsd, upcast, utility_terms
from opd.maths.family import bias_corrected_reverse_kl
from opd.maths.loss import check_loss
from opd.maths.weights import TokenWeight


def _support_(z, z_t, lse, lse_t, top, support: str):
    """The support of one block (C, V) from its top-k: ids (C, k), the student's and teacher's log-probs
    s, t (C, k + 1) with the tail or (C, k) without, and the shift of `_logit_grad` (C, 1) or None.
    'student_tail' masks the top-k in z and z_t (their own buffers, no copy)."""
    if support == "full":  # the whole vocabulary: no ids, no tail; the log-probs in z's and z_t's own buffers
        return None, z.sub_(lse), z_t.sub_(lse_t), None  # (C, V) each
    if support == "student_tail":
        ids = top.indices  # (C, k) the student's top-k
        t_k = z_t.gather(-1, ids) - lse_t  # (C, k) the teacher at the student's ids
        shift = _masked_lse_(z, ids)  # (C, 1) lse(z_{v not in I})
        s = torch.cat([top.values - lse, shift - lse], dim=-1)  # (C, k + 1) Eq. 3's support
        t = torch.cat([t_k, _masked_lse_(z_t, ids) - lse_t], dim=-1)  # (C, k + 1)
        return ids, s, t, shift
    t_top = z_t.topk(top.indices.shape[-1], dim=-1)  # the teacher's top-k
    ids, s_k = t_top.indices, z.gather(-1, t_top.indices)  # (C, k)
    if support == "teacher":
        return ids, s_k - lse, t_top.values - lse_t, lse  # full softmax, no tail
    return ids, torch.log_softmax(s_k, -1), torch.log_softmax(t_top.values, -1), None  # renormalised


def _loss_parts(z: torch.Tensor, z_t: torch.Tensor, lse_t, k: int, alpha: float, support: str, divergence: str):
    """One block of logits (C, V) and the teacher's lse(z_t) (C, 1); overwrites z and z_t. Returns D (C,),
    g = dD/ds (C, k [+ 1]), ids (C, k), s (C, k [+ 1]), shift (C, 1) or None, and (d, o, c) (C, 3) on the
    student's top-k whatever the support."""
    k = min(k, z.shape[-1])
    lse = torch.logsumexp(z, dim=-1, keepdim=True)  # (C, 1)
    top = z.topk(k, dim=-1)  # the student's top-k
    terms = torch.stack(utility_terms(z, z_t, k, student_topk=(top.values, top.indices)), dim=-1)  # (C, 3) Eq. 7-8
    ids, s_sup, t_sup, shift = _support_(z, z_t, lse, lse_t, top, support)
    if support == "full":  # (C, V) supports: D and g a block of rows at a time, g into t's buffer (t is then spent)
        rows = _block_rows(z)
        d = torch.cat([_divergence_grad(s_sup[j : j + rows], t_sup[j : j + rows], alpha, divergence, out=True)
                       for j in range(0, z.shape[0], rows)])  # fmt: skip
        return d, t_sup, ids, s_sup, shift, terms
    d, g = _divergence_grad(s_sup, t_sup, alpha, divergence)
    return d, g, ids, s_sup, shift, terms


FULL_BLOCKS = 16
"""The full-vocabulary support computes D and its gradient on 1/FULL_BLOCKS of a chunk's rows at a time: autograd
through the divergence holds about ten (rows, V) temporaries, which over a whole chunk were ten (C, V) tensors
(5 GB at C = 512 and Qwen3.5's V); a block's are 1/16 of that."""


def _block_rows(z: torch.Tensor) -> int:
    return max(1, -(-z.shape[0] // FULL_BLOCKS))


def _divergence_grad(s_sup, t_sup, alpha: float, divergence: str, out: bool = False):
    """D (c,) and g = dD/ds (c, k [+ 1] or V) by autograd on the support; `out`: g written into t_sup's buffer
    (which the caller no longer needs) and only D returned."""
    with torch.enable_grad():
        s_leaf = s_sup.detach().requires_grad_(True)
        if divergence == "jsd":
            d = generalized_jsd(s_leaf, t_sup, alpha)  # (c,) Eq. 3
        else:
            d = bias_corrected_reverse_kl(s_leaf, t_sup)  # (c,) RP-OPSD
        (g,) = torch.autograd.grad(d.sum(), s_leaf)  # (c, k [+ 1] or V)
    if out:
        t_sup.copy_(g)
        return d.detach()
    return d.detach(), g


def _masked_lse_(z: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """logsumexp over the entries outside ids (C, k), -inf when ids hold them all: `divergence.tail_logp`
    + lse(z), with the ids masked in z's own buffer (no (C, V) copy)."""
    if ids.shape[-1] >= z.shape[-1]:
        return torch.full_like(z[:, :1], float("-inf"))
    return torch.logsumexp(z.scatter_(-1, ids, float("-inf")), dim=-1, keepdim=True)  # (C, 1)


def _logit_grad(z: torch.Tensor, ids, s_sup, g, shift, support: str, inplace: bool = False) -> torch.Tensor:
    """dD/dz (C, V) by the formulas in the module docstring, in one (C, V) buffer (z's own when `inplace`).

    z may have its top-k entries masked to -inf (they are overwritten). shift (C, 1): lse(z_{not I})
    for 'student_tail', lse(z) for 'teacher', unused for 'teacher_renorm'.
    """
    G = g.sum(-1, keepdim=True)  # (C, 1)
    if support == "full":  # dD/dz_v = g_v - p_v G over every v, a block of rows at a time (s_sup may be z's buffer)
        out = z if inplace else torch.empty_like(z)
        rows = _block_rows(z)
        for j in range(0, z.shape[0], rows):
            b = slice(j, j + rows)
            torch.sub(g[b], s_sup[b].exp().mul_(G[b]), out=out[b])
        return out
    k = ids.shape[-1]
    if support == "teacher_renorm":
        dz = z.zero_() if inplace else torch.zeros_like(z)  # (C, V) nothing outside I
    else:
        b = g[:, k:] - s_sup[:, k:].exp() * G if support == "student_tail" else -G  # (C, 1) g_tail - q G, or -G
        shift = shift.clamp(min=torch.finfo(z.dtype).min)  # an empty tail: z - shift stays finite or -inf
        dz = z.sub_(shift) if inplace else torch.sub(z, shift)  # (C, V)
        dz.clamp_(max=0.0).exp_().mul_(b)  # v not in I: r_v (g_tail - q G), or -p_v G; r_v, p_v <= 1
    return dz.scatter_(-1, ids, g[:, :k] - s_sup[:, :k].exp() * G)  # v in I: g_v - p_v G (P_v), overwritten


def sampled_logp(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log p(y_t) = z_{y_t} - lse(z) for logits (..., V) and sampled ids (...) -> (...), in float32 (half-precision
    logits upcast) or float64."""
    z = upcast(logits)
    return z.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)


def _owned(x: torch.Tensor) -> torch.Tensor:
    """A float32/float64 copy of a block of logits that `_loss_parts` may overwrite."""
    return x.float() if x.dtype not in (torch.float32, torch.float64) else x.clone()


def _teacher_logits(h_t: torch.Tensor, w_t: torch.Tensor, timing: dict | None, stopwatch: Callable | None,
                    temperature: float = 1.0):  # fmt: skip
    """The teacher's logits z_t = h_t W_t^T / T (C, V) and lse(z_t) (C, 1); with `timing`, their seconds are
    added to timing['teacher_s'], measured by `stopwatch(device)` (`_check_timing`)."""
    watch = stopwatch(h_t.device) if timing is not None else None
    z_t = upcast(h_t @ w_t.T)  # (C, V)
    if temperature != 1.0:
        z_t = z_t.div_(temperature)
    lse_t = torch.logsumexp(z_t, dim=-1, keepdim=True)  # (C, 1)
    if watch is not None:
        timing["teacher_s"] = timing.get("teacher_s", 0.0) + watch.seconds()
    return z_t, lse_t


def _check_timing(timing: dict | None, stopwatch: Callable | None) -> None:
    """`timing` is measured by the caller's `stopwatch`: `stopwatch(device)` starts a timer whose `.seconds()` are
    the seconds since (`opd.models.ema_teacher.Stopwatch` synchronises the device before the start and at the reading)."""
    if timing is not None and stopwatch is None:
        raise ValueError("timing needs the caller's stopwatch (e.g. opd.models.ema_teacher.Stopwatch)")


class _FromLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z_s, z_t, k: int, alpha: float, chunk: int, support: str, divergence: str):
        parts = []
        for j in range(0, max(z_s.shape[0], 1), chunk):  # one empty chunk when there are no positions
            z, z_tc = _owned(z_s[j : j + chunk]), _owned(z_t[j : j + chunk])  # (C, V)
            lse_t = torch.logsumexp(z_tc, dim=-1, keepdim=True)  # (C, 1)
            parts.append(_loss_parts(z, z_tc, lse_t, k, alpha, support, divergence))
        d, g, ids, s_sup, shift, terms = (None if p[0] is None else torch.cat(p) for p in zip(*parts))
        ctx.save_for_backward(z_s, ids, s_sup, g, shift)
        ctx.chunk, ctx.support = chunk, support
        ctx.mark_non_differentiable(terms)
        return d, terms

    @staticmethod
    def backward(ctx, grad_d, _grad_terms):
        z_s, ids, s_sup, g, shift = ctx.saved_tensors
        g = g * grad_d.unsqueeze(-1)
        dz = torch.empty_like(z_s)  # (N, V) the gradient, filled one chunk at a time
        for j in range(0, z_s.shape[0], ctx.chunk):
            c = slice(j, j + ctx.chunk)
            shift_c = None if shift is None else shift[c]
            ids_c = None if ids is None else ids[c]
            dz[c] = _logit_grad(upcast(z_s[c]), ids_c, s_sup[c], g[c], shift_c, ctx.support)
        return dz, None, None, None, None, None, None


def topk_divergence_from_logits(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    k: int = 100,
    alpha: float = 0.5,
    chunk: int = 512,
    *,
    support: str = "student_tail",
    divergence: str = "jsd",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position D (...) with gradient to the student logits (..., V), and detached (d, o, c) (..., 3).

    Same values as family.topk_divergence(student_logits, teacher_logits, k, alpha, support=...,
    divergence=...) (defaults: Eq. 3 on the student's top-k + tail). Positions are processed `chunk`
    at a time (the forward's working copies are O(chunk V)); the backward holds one (N, V) buffer
    (the gradient itself) instead of autograd's log-softmax copies.
    """
    check_loss(support, divergence)
    shape = student_logits.shape[:-1]
    vocab = student_logits.shape[-1]
    d, terms = _FromLogits.apply(
        student_logits.reshape(-1, vocab), teacher_logits.detach().reshape(-1, vocab), k, alpha, chunk, support,
        divergence,
    )
    return d.reshape(shape), terms.reshape(*shape, 3)


topk_jsd_from_logits = topk_divergence_from_logits  # the name before the seed family


class _FromHidden(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_s, w_s, h_t, w_t, weights, k, alpha, chunk, support, divergence, tokens, timing, stopwatch,
                extras, temperature):  # fmt: skip
        w = w_s.to(h_s.dtype)  # one cast per call under mixed precision (a no-op otherwise)
        w_t = w_t.to(h_t.dtype)
        grad_h = torch.empty_like(h_s)  # (P, H) dL/dh, one row per position
        acc_dtype = torch.float32 if w_s.dtype != torch.float64 else w_s.dtype  # dL/dW accumulates in fp32 (or fp64)
        grad_w = None  # (V, H) dL/dW: the first chunk's product, later chunks added in place (no zero-filled buffer)
        want_w = ctx.needs_input_grad[1]  # a frozen LM head (LoRA): no dL/dW at all
        loss = torch.zeros((), dtype=torch.float64, device=h_s.device)
        d_all, terms_all = [], []
        for j in range(0, h_s.shape[0], chunk):
            h_c = h_s[j : j + chunk]  # (C, H)
            z = upcast(h_c @ w.T)  # (C, V) student logits
            z_t, lse_t = _teacher_logits(h_t[j : j + chunk], w_t, timing, stopwatch, temperature)  # (C, V), (C, 1)
            if temperature != 1.0:  # the loss temperature: both sides' logits divided (dz below divided again)
                z = z.div_(temperature)
            w_c = weights[j : j + chunk].to(z.dtype)  # (C,) Eq. 11's weights
            if tokens is not None:  # times the method's token weight w_t (opd.maths.weights), detached
                y = tokens.ids[j : j + chunk].unsqueeze(-1)  # (C, 1)
                t_y = (z_t.gather(-1, y) - lse_t).squeeze(-1)  # (C,) log pi_T(y_t)
                s_y = sampled_logp(z, y.squeeze(-1))  # (C,) log pi_theta(y_t)
                w_tok = tokens.at(slice(j, j + chunk), s_y, t_y)  # (C,)
                w_c = w_c * w_tok
                extras.setdefault("token_weight", []).append(w_tok)
                extras.setdefault("teacher_logp", []).append(t_y)
            d, g, ids, s_sup, shift, terms = _loss_parts(z, z_t, lse_t, k, alpha, support, divergence)  # overwrites z
            del z_t
            g_w = g.mul_(w_c.unsqueeze(-1)) if support == "full" else g * w_c.unsqueeze(-1)  # full: g is z_t's buffer
            dz = _logit_grad(z, ids, s_sup, g_w, shift, support, inplace=True)  # (C, V) dL/d(z / T)
            if temperature != 1.0:
                dz = dz.div_(temperature)  # dL/dz = dL/d(z / T) / T
            dz = dz.to(h_s.dtype)
            del z
            grad_h[j : j + chunk] = dz @ w  # (C, H)
            if want_w:
                grad_w = _accumulate(grad_w, dz, h_c, acc_dtype)  # (V, H)
            del dz
            loss += (w_c * d).sum()  # Eq. 11's sum over the chunk (`divergence.weighted_sum`)
            d_all.append(d)
            terms_all.append(terms)
        ctx.save_for_backward(grad_h, _as_weight(grad_w, w_s))
        d_all, terms_all = torch.cat(d_all), torch.cat(terms_all)
        ctx.mark_non_differentiable(d_all, terms_all)
        return loss, d_all, terms_all

    @staticmethod
    def backward(ctx, grad_loss, _grad_d, _grad_terms):
        grad_h, grad_w = _saved_grads(ctx, grad_loss)
        return (grad_h, grad_w) + (None,) * 13


def budgeted_loss_from_hidden(
    h_s: torch.Tensor,
    w_s: torch.Tensor,
    h_t: torch.Tensor,
    w_t: torch.Tensor,
    weights: torch.Tensor,
    k: int = 100,
    alpha: float = 0.5,
    chunk: int = 512,
    *,
    support: str = "student_tail",
    divergence: str = "jsd",
    tokens: TokenWeight | None = None,
    timing: dict | None = None,
    stopwatch: Callable | None = None,
    extras: dict | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eq. 11 from hidden states: sum_p weights_p w_p D(p) (`divergence.weighted_sum` of `divergence.budgeted_weights`
    times the method's token weights; D per position as `family.topk_divergence` with this support and
    divergence, Eq. 3 by default), differentiable to h_s and w_s; plus the detached per-position D (P,) and
    (d, o, c) (P, 3).

    h_s, h_t: (P, H) final hidden states of the student and the teacher at the same response positions; w_s, w_t:
    (V, H) their LM-head weights; weights: (P,) Eq. 11's. `tokens` (`weights.TokenWeight`): the method's token
    weight w_p from the chunk's own logits (the sampled tokens' log-probs of both sides; OPD-V's trust region,
    Vision-OPD's importance ratio, OPOD's gate), detached; None: w_p = 1. At most `chunk` positions' logits exist
    at once. Weights in another dtype than the hidden states (fp32 master weights under bf16 autocast) are cast
    once per call; dL/dW is accumulated in fp32. `timing` (a dict): timing['teacher_s'] gains the seconds of the
    teacher's LM-head products and log-softmax normalisers (its top-k and gathers, O(C V) each, are not counted),
    measured by the caller's `stopwatch` (`_check_timing`).
    `extras` (a dict), with `tokens`: receives 'token_weight' (w_p) and 'teacher_logp' (log pi_T(y_p)), (P,).
    `temperature` T: both sides' logits divided by T before everything (D, the token weights, the utility terms),
    the gradient chained through the division (OPSD's loss temperature).
    """
    check_loss(support, divergence)
    _check_timing(timing, stopwatch)
    if h_s.shape[0] == 0:
        zero = (h_s.sum() + w_s.sum()) * 0.0  # keeps the graph (and DDP's gradient hooks) intact
        if extras is not None and tokens is not None:
            extras.update(token_weight=h_s.new_zeros(0, dtype=torch.float32), teacher_logp=h_s.new_zeros(0, dtype=torch.float32))
        return zero, h_s.new_zeros(0, dtype=torch.float32), h_s.new_zeros(0, 3, dtype=torch.float32)
    parts: dict = {}
    out = _FromHidden.apply(
        h_s, w_s, h_t.detach(), w_t.detach(), weights.detach(), k, alpha, chunk, support, divergence, tokens, timing,
        stopwatch, parts, float(temperature),
    )
    if extras is not None and tokens is not None:
        extras.update({key: torch.cat(v) for key, v in parts.items()})
    return out


@torch.no_grad()
def sampled_logp_from_hidden(
    h: torch.Tensor, w: torch.Tensor, token_ids: torch.Tensor, chunk: int = 512, temperature: float = 1.0
) -> torch.Tensor:
    """Detached log p(y_t) = z_{y_t} - logsumexp(z), z = h W^T / T, for hidden states h (P, H), an LM-head
    weight w (V, H) and sampled ids token_ids (P,) -> (P,), `chunk` positions' logits at a time
    (OPD-V's negative teacher for `weights.trust_region`, at the loss temperature T as the positive one in
    `budgeted_loss_from_hidden`; OPOD's answer log-probs and KL reference at T = 1)."""
    w = w.to(h.dtype)
    out = []
    for j in range(0, h.shape[0], chunk):
        z = upcast(h[j : j + chunk] @ w.T)  # (C, V)
        if temperature != 1.0:
            z = z.div_(temperature)
        out.append(sampled_logp(z, token_ids[j : j + chunk]))
    return torch.cat(out) if out else h.new_zeros(0, dtype=upcast(h[:0]).dtype)


def _as_weight(grad_w: torch.Tensor | None, w: torch.Tensor) -> torch.Tensor | None:
    """The accumulated dL/dW in the weight's dtype; None when it was not computed (a frozen weight)."""
    return None if grad_w is None else grad_w.to(w.dtype)


def _saved_grads(ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The (dL/dh, dL/dW) a fused forward saved, times the incoming grad_loss: a scaled copy when the loss was
    scaled after the call, else the buffers themselves (autograd then takes dL/dW as .grad without a (V, H) copy).
    dL/dW is None for a weight that needs no gradient (never computed)."""
    grad_h, grad_w = ctx.saved_tensors
    if not bool(grad_loss == 1):
        grad_h = grad_h * grad_loss.to(grad_h.dtype)
        grad_w = None if grad_w is None else grad_w * grad_loss.to(grad_w.dtype)
    return grad_h, grad_w


def _accumulate(grad_w, dz: torch.Tensor, h_c: torch.Tensor, acc_dtype):
    """dL/dW (V, H) += dz^T h_c: the first chunk's product (no zero-filled buffer), later ones in place."""
    if grad_w is None:
        return (dz.T @ h_c).to(acc_dtype)
    if grad_w.dtype == dz.dtype:
        return grad_w.addmm_(dz.T, h_c)
    return grad_w.add_(dz.T @ h_c)


def _clamped_kl_parts(z: torch.Tensor, z_a: torch.Tensor, temperature: float, clip: float):
    """One chunk of DAPD's clamped forward KL from logits (C, V), both overwritten: D (C,) and dD/dz (C, V)
    in z's buffer, by the formula in `clamped_kl_from_hidden`."""
    a = torch.log_softmax(z_a.div_(temperature), dim=-1)  # (C, V) the anchor's log-probs at tau
    del z_a
    s = z.div_(temperature)
    s = s.sub_(torch.logsumexp(s, dim=-1, keepdim=True))  # (C, V) the student's log-probs at tau, in z
    p_a = a.exp()  # (C, V)
    c = torch.where(p_a > 0, a.sub_(s), torch.zeros_like(s)).mul_(p_a)  # (C, V) contributions
    del a
    below = c <= clip  # (C, V) where the clamp passes the gradient (torch's clamp: x <= max)
    d = c.clamp_(max=clip).sum(-1)  # (C,)
    del c
    g = p_a.mul_(below).neg_()  # (C, V) dD/ds_v = -p_a,v [c_v <= clip]
    G = g.sum(-1, keepdim=True)  # (C, 1)
    dz = s.exp_().mul_(-G).add_(g).div_(temperature)  # (C, V) (g - p G) / tau, in z's buffer
    return d, dz


class _ClampedKLFromHidden(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_s, w_s, anchors, temperature, clip, chunk, utility_k, timing, stopwatch, out):
        w = w_s.to(h_s.dtype)
        anchors = [(h_a, w_a.to(h_a.dtype), weights) for h_a, w_a, weights in anchors]
        grad_h = torch.empty_like(h_s)  # (P, H)
        acc_dtype = torch.float32 if w_s.dtype != torch.float64 else w_s.dtype
        grad_w = None
        want_w = ctx.needs_input_grad[1]  # a frozen LM head (LoRA): no dL/dW at all
        loss = torch.zeros((), dtype=torch.float64, device=h_s.device)
        d_all, terms_all = [[] for _ in anchors], []
        for j in range(0, h_s.shape[0], chunk):
            h_c = h_s[j : j + chunk]  # (C, H)
            z_s = upcast(h_c @ w.T)  # (C, V) student logits
            dz_sum = None
            for a, (h_a, w_a, weights) in enumerate(anchors):
                z_a, _ = _teacher_logits(h_a[j : j + chunk], w_a, timing, stopwatch)  # (C, V) this anchor's logits
                if utility_k and a == 0:  # Eq. 7-8 at temperature 1 on the student's top-k (the selector's labels)
                    terms_all.append(torch.stack(utility_terms(z_s, z_a, utility_k), dim=-1))  # (C, 3)
                w_c = weights[j : j + chunk].to(z_s.dtype)  # (C,)
                z = z_s.clone() if a < len(anchors) - 1 else z_s  # the last anchor may overwrite the student's
                d, dz = _clamped_kl_parts(z, z_a, temperature, clip)
                del z_a
                dz = dz.mul_(w_c.unsqueeze(-1))  # (C, V)
                dz_sum = dz if dz_sum is None else dz_sum.add_(dz)
                del dz, z
                loss += (w_c * d).sum()
                d_all[a].append(d)
            dz_sum = dz_sum.to(h_s.dtype)
            grad_h[j : j + chunk] = dz_sum @ w  # (C, H): one pair of LM-head products for every anchor
            if want_w:
                grad_w = _accumulate(grad_w, dz_sum, h_c, acc_dtype)  # (V, H)
            del dz_sum, z_s
        ctx.save_for_backward(grad_h, _as_weight(grad_w, w_s))
        d_all = torch.stack([torch.cat(d) for d in d_all])  # (anchors, P)
        if utility_k:
            out.append(torch.cat(terms_all))
        ctx.mark_non_differentiable(d_all)
        return loss, d_all

    @staticmethod
    def backward(ctx, grad_loss, _grad_d):
        grad_h, grad_w = _saved_grads(ctx, grad_loss)
        return (grad_h, grad_w) + (None,) * 8


def clamped_kl_from_hidden(
    h_s: torch.Tensor,
    w_s: torch.Tensor,
    h_a,
    w_a,
    weights,
    temperature: float = 1.1,
    clip: float = 0.05,
    chunk: int = 512,
    *,
    utility_k: int = 0,
    timing: dict | None = None,
    stopwatch: Callable | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """DAPD's weighted sum sum_p weights_p D_p of `family.clamped_forward_kl`(anchor, student) from
    final hidden states, `chunk` positions' full-vocabulary logits at a time, differentiable to h_s and w_s
    (the anchor is detached); plus the detached per-position D (P,), and, with `utility_k`, the utility
    terms (d, o, c) of Eq. 7-8 (P, 3) between the student and the (first) anchor at temperature 1, else None.

    h_s, h_a: (P, H) the student's and the anchor's final hidden states at the same completion positions;
    w_s, w_a: (V, H) their LM-head weights; weights (P,). Several anchors against one student forward (DAPD
    pairs that share the student's context): h_a, w_a and weights as equal-length lists; the loss is the
    sum over anchors and D is (anchors, P). The gradient is analytic and chunk-local: with
    s = log_softmax(z / tau), p = exp(s), a the anchor's log-probs at tau and c_v = exp(a_v)(a_v - s_v),

        dD/ds_v = g_v = -exp(a_v) [c_v <= clip],    dD/dz_u = (g_u - p_u sum_v g_v) / tau,

    summed over anchors and accumulated into dL/dh (P, H) and dL/dW (V, H) during the forward, as
    `budgeted_loss_from_hidden` does (two LM-head products for the gradient whatever the number of
    anchors; memory O(chunk V + V H)). `timing['teacher_s']` gains the anchors' LM-head seconds (by `stopwatch`).
    """
    if temperature <= 0 or clip <= 0:
        raise ValueError(f"temperature and clip must be positive, got {temperature} and {clip}")
    _check_timing(timing, stopwatch)
    several = isinstance(h_a, (list, tuple))
    anchors = list(zip(h_a, w_a, weights)) if several else [(h_a, w_a, weights)]
    if h_s.shape[0] == 0:
        zero = (h_s.sum() + w_s.sum()) * 0.0
        d = h_s.new_zeros((len(anchors), 0) if several else (0,), dtype=torch.float32)
        return zero, d, (h_s.new_zeros(0, 3, dtype=torch.float32) if utility_k else None)
    terms: list = []
    anchors = tuple((h.detach(), w.detach(), x.detach()) for h, w, x in anchors)
    loss, d = _ClampedKLFromHidden.apply(
        h_s, w_s, anchors, temperature, clip, chunk, min(utility_k, w_s.shape[0]), timing, stopwatch, terms
    )  # fmt: skip
    return loss, (d if several else d[0]), (terms[0] if terms else None)


class _WeightedLogp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, token_ids, coef, chunk, old_logp=None):
        w_c = w.to(h.dtype)
        grad_h = torch.empty_like(h)  # (P, H)
        acc_dtype = torch.float32 if w.dtype != torch.float64 else w.dtype
        grad_w = None
        want_w = ctx.needs_input_grad[1]  # a frozen LM head (LoRA): no dL/dW at all
        loss = torch.zeros((), dtype=torch.float64, device=h.device)
        logp_all = []
        for j in range(0, h.shape[0], chunk):
            h_c = h[j : j + chunk]  # (C, H)
            z = upcast(h_c @ w_c.T)  # (C, V)
            y = token_ids[j : j + chunk]  # (C,)
            a = coef[j : j + chunk].to(z.dtype)  # (C,)
            logp = sampled_logp(z, y)  # (C,) log p(y_t)
            if old_logp is None:
                loss += (a * logp).sum()
            else:  # the importance-sampled form a rho, rho = p(y) / p_old(y): d (a rho) = a rho d log p(y)
                rho = torch.exp(logp - old_logp[j : j + chunk].to(z.dtype))  # (C,)
                loss += (a * rho).sum()
                a = a * rho
            dz = torch.softmax(z, dim=-1).mul_(-a.unsqueeze(-1))  # (C, V) -a p_v
            dz.scatter_add_(-1, y.unsqueeze(-1), a.unsqueeze(-1))  # + a at y: a (onehot(y) - p)
            dz = dz.to(h.dtype)
            del z
            grad_h[j : j + chunk] = dz @ w_c
            if want_w:
                grad_w = _accumulate(grad_w, dz, h_c, acc_dtype)
            del dz
            logp_all.append(logp)
        ctx.save_for_backward(grad_h, _as_weight(grad_w, w))
        logp_all = torch.cat(logp_all)
        ctx.mark_non_differentiable(logp_all)
        return loss, logp_all

    @staticmethod
    def backward(ctx, grad_loss, _grad_logp):
        grad_h, grad_w = _saved_grads(ctx, grad_loss)
        return grad_h, grad_w, None, None, None, None


def weighted_logp_from_hidden(
    h: torch.Tensor, w: torch.Tensor, token_ids: torch.Tensor, coef: torch.Tensor, chunk: int = 512,
    old_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_p coef_p log p(y_p), z = h W^T, differentiable to h (P, H) and w (V, H), with the sampled ids
    token_ids (P,) and detached coefficients coef (P,) (a policy-gradient term: coef = -A_i / N); plus the
    detached log p(y_p) (P,). `chunk` positions' logits at a time, analytic gradient:

        d/dz_v [ a log p(y) ] = a ([v = y] - p_v)

    accumulated into dL/dh and dL/dW chunk by chunk (no (P, V) tensor). With `old_logp` (P,) the importance-sampled
    form sum_p coef_p rho_p, rho_p = p(y_p) / p_old(y_p) (tinker's `importance_sampling` loss), whose gradient is
    sum_p coef_p rho_p d log p(y_p): the same accumulation with a_p = coef_p rho_p."""
    if h.shape[0] == 0:
        return (h.sum() + w.sum()) * 0.0, h.new_zeros(0, dtype=torch.float32)
    old = None if old_logp is None else old_logp.detach()
    return _WeightedLogp.apply(h, w, token_ids, coef.detach(), chunk, old)
