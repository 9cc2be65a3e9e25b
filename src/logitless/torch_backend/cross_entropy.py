"""cross_entropy on logits that already exist, on this backend: the head op's online statistics over chunks of the
given logits and a backward of its own (loss_math.ce_backward_coef), optionally written over the logits."""

from __future__ import annotations

import torch

from .._autograd import first_order_only
from ..loss_math import acc_dtype, ce_backward_coef, ce_loss_from_stats, ce_row_terms, one_minus_pt, reduce_loss
from . import blocks
from .blocks import chain_transform, chunks, transform
from .linear_head import row_stats


def _dz_logits_chunk(z, m_c, logs_c, A_c, C_c, E_c, X_c, t_c, v0, v1, class_w_c, q_c):
    """dL/dz of cross-entropy for one block of given logits (loss_math.ce_backward_coef): p A - E w, and at the
    target's column p_t X - q C with q = 1 - p_t from the forward's rest (loss_math.head_coefficients): p_t - 1
    cancels for a near-certain row."""
    dz = torch.exp((z - m_c[:, None]) - logs_c[:, None]).mul_(A_c[:, None])
    if E_c is not None:
        dz -= E_c[:, None] * (class_w_c[None, :] if class_w_c is not None else 1.0)
    inside = (t_c >= v0) & (t_c < v1)
    idx = (t_c - v0).clamp(0, v1 - v0 - 1)[:, None]
    p_t = torch.exp((z.gather(1, idx)[:, 0] - m_c) - logs_c)
    d_t = p_t * X_c - q_c * C_c
    return dz.scatter_(1, idx, torch.where(inside, d_t, dz.gather(1, idx)[:, 0])[:, None])


class _CrossEntropy(torch.autograd.Function):
    """(N, V) logits -> (per-token loss, lse). With `inplace`, the backward writes the gradient over the saved
    logits chunk by chunk (each chunk is read before it is overwritten), so no second N x V buffer is allocated; it
    can then run only once."""

    @staticmethod
    def forward(ctx, logits, target, class_w, ignore_index, label_smoothing, z_loss, softcap, inplace=False):
        n, V = logits.shape
        acc = acc_dtype(logits.dtype)
        chunk = lambda i0, i1, v0, v1: transform(logits[i0:i1, v0:v1].to(acc), softcap, 1.0)
        m, logs, zt, sw, ref, _, _, rest = row_stats(chunk, n, V, logits.device, acc, target, class_w,
                                                      label_smoothing > 0.0, False)
        valid, w_t, w_sum = ce_row_terms(target, class_w, ignore_index, label_smoothing, V, acc)
        loss = ce_loss_from_stats(m, logs, zt, sw, ref, valid, w_t, w_sum, label_smoothing, z_loss, V)
        lse = m + logs
        ctx.save_for_backward(logits, target, class_w, m, logs, rest, zt)
        ctx.opts = (ignore_index, label_smoothing, z_loss, softcap)
        ctx.inplace = bool(inplace)
        ctx.mark_non_differentiable(lse)
        return loss, lse

    @staticmethod
    @first_order_only
    def backward(ctx, grad_loss, _grad_lse):
        if ctx.inplace:
            if getattr(ctx, "consumed", False):
                raise RuntimeError("cross_entropy(inplace_backward=True): the gradient was already written over the "
                                   "logits by an earlier backward; it can run only once")
            ctx.consumed = True
        logits, target, class_w, m, logs, rest, zt = ctx.saved_tensors
        ignore_index, label_smoothing, z_loss, softcap = ctx.opts
        n, V = logits.shape
        valid, w_t, w_sum = ce_row_terms(target, class_w, ignore_index, label_smoothing, V, m.dtype)
        A, C, E, X = ce_backward_coef(grad_loss, m + logs, valid, w_t, w_sum, label_smoothing, z_loss, V)
        q = one_minus_pt(rest, logs, torch.exp(zt - m))
        grad = logits if ctx.inplace else torch.empty_like(logits)
        for i0, i1 in chunks(n, blocks.token_chunk(V)):
            sl = slice(i0, i1)
            for v0, v1 in chunks(V, blocks.VOCAB_CHUNK):
                raw = logits[sl, v0:v1].to(m.dtype)
                z = transform(raw, softcap, 1.0)
                dz = _dz_logits_chunk(z, m[sl], logs[sl], A[sl], C[sl], None if E is None else E[sl], X[sl],
                                      target[sl], v0, v1, None if class_w is None else class_w[v0:v1], q[sl])
                grad[sl, v0:v1] = chain_transform(dz, raw, softcap, 1.0)
        return grad, None, None, None, None, None, None, None


def cross_entropy(logits2d, target, lead_shape, weight, reduction, ignore_index, label_smoothing, z_loss, softcap,
                  inplace_backward=False):
    """cross_entropy on validated (N, V) logits through this backend: (reduced loss, lse of the lead shape)."""
    class_w = None if weight is None else weight.to(acc_dtype(logits2d.dtype))
    with torch.autocast(logits2d.device.type, enabled=False):
        per_token, lse = _CrossEntropy.apply(logits2d, target, class_w, ignore_index, float(label_smoothing),
                                             float(z_loss), None if softcap is None else float(softcap),
                                             bool(inplace_backward))
    valid, w_t, _ = ce_row_terms(target, class_w, ignore_index, label_smoothing, logits2d.shape[1], per_token.dtype)
    return reduce_loss(per_token, valid, w_t, reduction, lead_shape), lse.reshape(lead_shape)


def unit_class_stride(logits2d: torch.Tensor) -> torch.Tensor:
    """(N, V) logits with unit stride along the classes: a copy where they are strided, else the same memory. The
    stride of a class dimension of size 1 (or of an empty tensor) means nothing, and contiguous() keeps whatever it
    is (a transposed (1, N) tensor has stride N there): such a tensor gets a view with stride 1 instead."""
    if logits2d.stride(1) == 1:
        return logits2d
    if logits2d.shape[1] == 1 or logits2d.numel() == 0:
        return logits2d.as_strided(logits2d.shape, (logits2d.stride(0), 1))
    return logits2d.contiguous()

