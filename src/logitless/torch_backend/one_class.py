"""The closed forms of a head with a single class (V = 1), where the softmax is exactly 1: its logits, and the
public ops' outputs written on them (the head op runs these on either backend)."""

from __future__ import annotations

import torch

from .._autograd import first_order_only
from ..loss_math import acc_dtype, ce_row_terms, reduce_loss
from . import blocks
from .blocks import apply_softcap, chunks


def one_class_logits(x, w, b, softcap, inv_temp):
    """(N,) float64 logits of a head with a single class (V = 1), differentiable with respect to x, w and b. With
    one class the softmax is exactly 1 and lse = z, so cross-entropy, smoothing, log-probs and entropy are exactly 0
    (only the z-loss and the log-sum-exp are not); the general paths reach those zeros only up to the rounding of a
    recomputed logit, which leaves gradients of ~1e-7 where PyTorch's are exactly 0. Every output is a function of
    these N values, so the closed forms work in float64 and round once, to the output's or the gradient's dtype:
    in float32 the weight and bias gradients are sums over the rows as rounded as PyTorch's own (and a temperature
    multiplies by a rounded 1 / T where PyTorch divides), which a sum that cancels turns into 10x PyTorch's error
    whenever PyTorch's rounding happens to be the luckier."""
    with torch.autocast(x.device.type, enabled=False):
        z = _OneClassLinear.apply(x, w, b)
        z = apply_softcap(z, softcap)
        return z * inv_temp if inv_temp != 1.0 else z


def one_class_cross_entropy(x, w, b, target, class_w, reduction, ignore_index, label_smoothing, z_loss, softcap,
                            lead_shape):
    """linear_cross_entropy of a one-class head: lse = z, so the cross-entropy and the smoothing are exactly 0 and
    the z-loss is z^2. Those zeros are weighted by w_t, as PyTorch's are, so their gradient is w_t times the upstream
    one: 0, or NaN where a "mean" over class weights that sum to 0 makes the upstream gradient infinite (PyTorch's
    NaN, not the z-loss term's inf alone). z - z is that zero with that gradient."""
    z = one_class_logits(x, w, b, softcap, 1.0)
    valid, w_t, _ = ce_row_terms(target, class_w, ignore_index, label_smoothing, 1, z.dtype)
    per_token = w_t * (z - z)
    if z_loss > 0.0:
        per_token = per_token + float(z_loss) * z * z
    loss = reduce_loss(torch.where(valid, per_token, 0.0), valid, w_t, reduction, lead_shape)
    return loss.to(acc_dtype(x.dtype))


def one_class_log_probs(x, w, b, target, ignore_index, softcap, inv_temp, want_entropy, lead_shape):
    """(log-probs, entropy or None) of a one-class head: log 1 = 0 and no entropy, exactly."""
    z = one_class_logits(x, w, b, softcap, inv_temp)
    logp = torch.where(target != ignore_index, z * 0.0, 0.0).reshape(lead_shape).to(acc_dtype(x.dtype))
    return logp, (logp.clone() if want_entropy else None)


def one_class_logsumexp(x, w, b, softcap, inv_temp, lead_shape):
    """The log-sum-exp of a one-class head: lse = z, exactly."""
    return one_class_logits(x, w, b, softcap, inv_temp).reshape(lead_shape).to(acc_dtype(x.dtype))


class _OneClassLinear(torch.autograd.Function):
    """x W^T + b for W of one row, in float64 (a (N,) result), over chunks of rows (no float64 copy of x beyond
    CHUNK_ELEMS elements); the backward's gradients are float64 sums, rounded once to the inputs' dtypes."""

    @staticmethod
    def forward(ctx, x, w, b):
        w64 = w[0].to(torch.float64)
        z = torch.empty(x.shape[0], device=x.device, dtype=torch.float64)
        for i0, i1 in chunks(x.shape[0], max(1, blocks.CHUNK_ELEMS // max(1, x.shape[1]))):
            torch.mv(x[i0:i1].to(torch.float64), w64, out=z[i0:i1])
        if b is not None:
            z += b[0].to(torch.float64)
        ctx.save_for_backward(x, w, b)
        return z

    @staticmethod
    @first_order_only
    def backward(ctx, g):
        x, w, b = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        g = g.to(torch.float64)
        w64 = w[0].to(torch.float64)
        dx = torch.empty_like(x) if need_x else None
        dw = torch.zeros(x.shape[1], device=x.device, dtype=torch.float64) if need_w else None
        for i0, i1 in chunks(x.shape[0], max(1, blocks.CHUNK_ELEMS // max(1, x.shape[1]))):
            if need_x:
                dx[i0:i1] = g[i0:i1, None] * w64
            if need_w:
                dw.addmv_(x[i0:i1].to(torch.float64).T, g[i0:i1])
        return (dx, None if dw is None else dw.to(w.dtype)[None, :],
                g.sum().to(b.dtype).reshape(1) if b is not None and need_b else None)

