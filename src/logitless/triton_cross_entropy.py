"""cross_entropy on logits that already exist, through the Triton kernels: the launchers of the kernels/cross_entropy
package as torch.library ops, and the autograd node around them.

With ``inplace_backward=True`` the forward writes d(loss)/d(logits) over the logits in the same pass that computes
the loss (one read and one write of the logits for forward and backward together), and the backward only scales
that buffer by the upstream gradient, on the device and only where the upstream gradient is not exactly 1. The loss
is reduced here, not by the caller: the in-place gradient is that of the reduced loss, so the forward needs the
mean's scale.

This module imports Triton: head.py imports it only inside the call that chose the Triton backend.
"""

from __future__ import annotations

import torch

from ._autograd import first_order_only
from ._dispatch import KERNEL_DTYPES
from .kernels.cross_entropy import cross_entropy_bwd, cross_entropy_fwd, scale_rows_
from .torch_backend.cross_entropy import unit_class_stride

# torch.library ops around the launchers, so torch.compile sees each launch as one opaque op.

_OPT_ARGS = "int ignore_index, float label_smoothing, float z_loss, float? softcap"


def _fwd_impl(logits, target, class_w, w_sum, scale, ignore_index, label_smoothing, z_loss, softcap, write_grad):
    return cross_entropy_fwd(logits, target, class_w, w_sum, scale, ignore_index=ignore_index,
                             label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap, write_grad=write_grad)


def _fwd_fake(logits, *args):
    N = logits.shape[0]
    f32 = dict(device=logits.device, dtype=torch.float32)
    return logits.new_empty(N, **f32), logits.new_empty(N, **f32), logits.new_empty(N, 2, **f32)


def _fwd(logits, target, class_w, w_sum, scale, ignore_index, label_smoothing, z_loss, softcap):
    return _fwd_impl(logits, target, class_w, w_sum, scale, ignore_index, label_smoothing, z_loss, softcap, False)


def _fwd_inplace(logits, target, class_w, w_sum, scale, ignore_index, label_smoothing, z_loss, softcap):
    return _fwd_impl(logits, target, class_w, w_sum, scale, ignore_index, label_smoothing, z_loss, softcap, True)


_fwd_op = torch.library.custom_op(
    "logitless::cross_entropy_fwd", mutates_args=(),
    schema=f"(Tensor logits, Tensor target, Tensor? class_w, Tensor? w_sum, Tensor? scale, {_OPT_ARGS}) "
           "-> (Tensor, Tensor, Tensor)",
)(_fwd)
_fwd_op.register_fake(_fwd_fake)

_fwd_inplace_op = torch.library.custom_op(
    "logitless::cross_entropy_fwd_inplace", mutates_args=("logits",),
    schema=f"(Tensor(a!) logits, Tensor target, Tensor? class_w, Tensor? w_sum, Tensor? scale, {_OPT_ARGS}) "
           "-> (Tensor, Tensor, Tensor)",
)(_fwd_inplace)
_fwd_inplace_op.register_fake(_fwd_fake)


def _bwd_impl(grad, logits, target, class_w, w_sum, scale, stats, ignore_index, label_smoothing, z_loss, softcap):
    out = torch.empty_like(logits, memory_format=torch.contiguous_format)
    return cross_entropy_bwd(grad, logits, target, class_w, w_sum, scale, stats, out, ignore_index=ignore_index,
                             label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap)


_bwd_op = torch.library.custom_op(
    "logitless::cross_entropy_bwd", mutates_args=(),
    schema=f"(Tensor grad, Tensor logits, Tensor target, Tensor? class_w, Tensor? w_sum, Tensor? scale, "
           f"Tensor stats, {_OPT_ARGS}) -> Tensor",
)(_bwd_impl)


@_bwd_op.register_fake
def _bwd_fake(grad, logits, *args):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _scale_impl(buf, grad):
    scale_rows_(buf, grad)


_scale_op = torch.library.custom_op(
    "logitless::cross_entropy_scale_", mutates_args=("buf",), schema="(Tensor(a!) buf, Tensor grad) -> ()",
)(_scale_impl)


@_scale_op.register_fake
def _scale_fake(buf, grad):
    return None


# ---------------------------------------------------------------------------------------------------------------
# autograd


class _TritonCrossEntropy(torch.autograd.Function):
    """(N, V) logits -> (reduced loss, per-row lse). In place, the forward leaves the gradient of the reduced loss
    (upstream 1) in the logits buffer and the backward scales it; otherwise the backward recomputes it."""

    @staticmethod
    def forward(ctx, logits, target, class_w, reduction, ignore_index, label_smoothing, z_loss, softcap, inplace):
        valid = target != ignore_index
        w_sum = class_w.sum() if class_w is not None and label_smoothing > 0.0 else None
        denom = scale = None
        if reduction == "mean":
            if class_w is None:
                denom = valid.sum(dtype=torch.float32)
            else:
                denom = (class_w[torch.where(valid, target, 0)] * valid).sum()
            scale = denom.reciprocal()  # inf when every row is ignored; the kernels never multiply by it then
        opts = (ignore_index, float(label_smoothing), float(z_loss), softcap)
        write = inplace and ctx.needs_input_grad[0]
        op = _fwd_inplace_op if write else _fwd_op
        loss_rows, lse, stats = op(logits, target, class_w, w_sum, scale, *opts)
        if reduction == "none":
            loss = loss_rows
        else:
            loss = loss_rows.sum()
            if denom is not None:
                loss = loss / denom
        ctx.inplace = write
        ctx.reduction = reduction
        ctx.opts = opts
        if write:
            ctx.save_for_backward(logits)
        else:
            ctx.save_for_backward(logits, target, class_w, w_sum, scale, stats)
        ctx.mark_non_differentiable(lse)
        return loss, lse

    @staticmethod
    @first_order_only
    def backward(ctx, grad_loss, _grad_lse):
        if not ctx.needs_input_grad[0]:
            return (None,) * 9
        grad_loss = grad_loss.float()
        if ctx.reduction == "none":
            grad_loss = grad_loss.contiguous()  # an expanded upstream (from .sum()) has stride 0
        if ctx.inplace:
            if getattr(ctx, "consumed", False):
                raise RuntimeError("cross_entropy(inplace_backward=True): the gradient was already written over the "
                                   "logits and consumed by an earlier backward; it can run only once")
            ctx.consumed = True
            (buf,) = ctx.saved_tensors
            _scale_op(buf, grad_loss)
            return buf, None, None, None, None, None, None, None, None
        logits, target, class_w, w_sum, scale, stats = ctx.saved_tensors
        dlogits = _bwd_op(grad_loss, logits, target, class_w, w_sum, scale, stats, *ctx.opts)
        return dlogits, None, None, None, None, None, None, None, None


def cross_entropy(logits2d, target, lead_shape, weight, reduction, ignore_index, label_smoothing, z_loss, softcap,
                  inplace_backward=False):
    """cross_entropy on validated (N, V) logits through the kernels: (reduced loss, lse of the lead shape)."""
    if logits2d.dtype not in KERNEL_DTYPES:
        raise TypeError(f"cross_entropy: the Triton kernels take float32, bfloat16 or float16 logits, got "
                        f"{logits2d.dtype}; use backend='torch'")
    logits2d = unit_class_stride(logits2d)  # the kernels read rows with unit stride
    class_w = None if weight is None else weight.to(torch.float32).contiguous()
    loss, lse = _TritonCrossEntropy.apply(logits2d, target, class_w, reduction, ignore_index,
                                          float(label_smoothing), float(z_loss),
                                          None if softcap is None else float(softcap), bool(inplace_backward))
    if reduction == "none":
        loss = loss.reshape(lead_shape)
    return loss, lse.reshape(lead_shape)

