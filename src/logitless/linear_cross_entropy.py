"""linear_cross_entropy: the loss of a linear head without materialising its logits.

The Triton path is one differentiable torch.library op, ``logitless::linear_head_stats``, that returns per-row
statistics of the head (row max, log-sum-exp, target logit, smoothing sum, entropy); every loss of this file and of
log_probs.py is a PyTorch expression of those statistics (reference.ce_loss_from_stats, the same function as the
PyTorch path), so autograd turns the upstream gradients into the per-row coefficients (A, B, C, E) of one generic
backward op, ``logitless::linear_head_grad`` (see reference.py for the form of the gradient).
"""

from __future__ import annotations

import torch

from . import _validate, reference
from ._dispatch import resolve_backend

# ---------------------------------------------------------------------------------------------------------------
# torch.library ops around the launchers of kernels/linear_head.py, so torch.compile sees each as one opaque op.


def _kernels():
    from .kernels import linear_head

    return linear_head


_STATS_SCHEMA = ("(Tensor x, Tensor weight, Tensor? bias, Tensor? target, Tensor? class_weight, float? softcap, "
                 "float inv_temp, bool want_smooth, bool want_entropy) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")


@torch.library.custom_op("logitless::linear_head_stats", mutates_args=(), schema=_STATS_SCHEMA)
def _stats_op(x, weight, bias, target, class_weight, softcap, inv_temp, want_smooth, want_entropy):
    """(m, logs, zt, sw, ent), each (N,) float32; lse = m + logs and sw = sum_j w_j (z_j - m). For autograd the row
    max m is a constant offset (every use of these statistics is invariant to shifting it), so its gradient is
    ignored and logs carries d lse/dz_j = p_j."""
    return _kernels().forward_stats(x, weight, bias, target, class_weight, softcap=softcap, inv_temp=inv_temp,
                                    want_smooth=want_smooth, want_entropy=want_entropy)


@_stats_op.register_fake
def _(x, weight, bias, target, class_weight, softcap, inv_temp, want_smooth, want_entropy):
    return tuple(x.new_empty(x.shape[0], dtype=torch.float32) for _ in range(5))


_GRAD_SCHEMA = ("(Tensor x, Tensor weight, Tensor? bias, Tensor? target, Tensor? class_weight, Tensor m, Tensor logs, "
                "Tensor A, Tensor? B, Tensor? C, Tensor? E, float? softcap, float inv_temp, bool need_dx, "
                "bool need_dw, bool need_db) -> (Tensor, Tensor, Tensor)")


@torch.library.custom_op("logitless::linear_head_grad", mutates_args=(), schema=_GRAD_SCHEMA)
def _grad_op(x, weight, bias, target, class_weight, m, logs, A, B, C, E, softcap, inv_temp, need_dx, need_dw,
             need_db):
    """(dx, dW, db) for dL/dz_j = p_j (A + B (z_j - m)) - C [j == t] - E w_j; a gradient not asked for is empty."""
    dx, dw, db = _kernels().backward(x, weight, bias, target, class_weight, m, logs, A, B, C, E, softcap=softcap,
                                     inv_temp=inv_temp, need_dx=need_dx, need_dw=need_dw, need_db=need_db)
    # Outputs must not alias one another: a fresh empty tensor for each gradient not asked for.
    return tuple(g if g is not None else x.new_empty(0) for g in (dx, dw, db))


@_grad_op.register_fake
def _(x, weight, bias, target, class_weight, m, logs, A, B, C, E, softcap, inv_temp, need_dx, need_dw, need_db):
    dx = torch.empty_like(x, memory_format=torch.contiguous_format) if need_dx else x.new_empty(0)
    dw = torch.empty_like(weight, memory_format=torch.contiguous_format) if need_dw else x.new_empty(0)
    db = torch.empty_like(bias) if need_db and bias is not None else x.new_empty(0)
    return dx, dw, db


def _stats_setup_context(ctx, inputs, output):
    x, weight, bias, target, class_weight, softcap, inv_temp, want_smooth, want_entropy = inputs
    m, logs, _, _, ent = output
    ctx.save_for_backward(x, weight, bias, target, class_weight, m, logs, ent)
    ctx.opts = (softcap, inv_temp, want_smooth, want_entropy)


def _stats_backward(ctx, _g_m, g_logs, g_zt, g_sw, g_ent):
    x, weight, bias, target, class_weight, m, logs, ent = ctx.saved_tensors
    softcap, inv_temp, want_smooth, want_entropy = ctx.opts
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_db = bias is not None and ctx.needs_input_grad[2]
    if not (need_dx or need_dw or need_db):
        return (None,) * 9
    A, B, C, E = head_coefficients(m, logs, ent, g_logs, g_zt if target is not None else None,
                                   g_sw if want_smooth else None, g_ent if want_entropy else None)
    dx, dw, db = _grad_op(x, weight, bias, target, class_weight, m, logs, A, B, C, E, softcap, inv_temp,
                          need_dx, need_dw, need_db)
    return (dx if need_dx else None, dw if need_dw else None, db if need_db else None) + (None,) * 6


torch.library.register_autograd("logitless::linear_head_stats", _stats_backward, setup_context=_stats_setup_context)


def head_coefficients(m, logs, ent, g_logs, g_zt, g_sw, g_ent):
    """Per-row (A, B, C, E) of dL/dz_j = p_j (A + B (z_j - m)) - C [j == t] - E w_j from the upstream gradients of the
    statistics: d logs/dz_j = p_j (m held constant), d zt/dz_j = [j == t], d sw/dz_j = w_j,
    dH/dz_j = -p_j (z_j - (lse - H))."""
    A = torch.zeros_like(logs) if g_logs is None else g_logs.float().contiguous()
    B = C = E = None
    if g_ent is not None:
        g_ent = g_ent.float()
        A = A + g_ent * (logs - ent)  # relative to the row max: the kernel multiplies B by z - m
        B = (-g_ent).contiguous()
    if g_zt is not None:
        C = (-g_zt.float()).contiguous()
    if g_sw is not None:
        E = (-g_sw.float()).contiguous()
    return A, B, C, E


def head_stats(args: _validate.HeadArgs, class_weight, softcap, inv_temp, want_smooth, want_entropy):
    """Per-row statistics (m, logs, zt, sw, ent) of a validated head, through the Triton kernels (differentiable)."""
    cw = None if class_weight is None else class_weight.float().contiguous()
    return _stats_op(args.x, args.weight, args.bias, args.target, cw, None if softcap is None else float(softcap),
                     float(inv_temp), bool(want_smooth), bool(want_entropy))


def check_kernel_dtype(x: torch.Tensor, backend: str) -> bool:
    """True when the Triton kernels take this dtype; float64 raises for an explicit backend="triton" and falls back
    to the PyTorch path under "auto"."""
    if x.dtype in _validate.KERNEL_DTYPES:
        return True
    if backend == "triton":
        raise TypeError(f"backend='triton' takes float32, bfloat16 or float16 inputs, got {x.dtype}; "
                        "use backend='torch' for float64")
    return False


# ---------------------------------------------------------------------------------------------------------------
# Public function


def linear_cross_entropy(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    linear_bias: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    backend: str = "auto",
    deterministic: bool = False,
    process_group=None,
) -> torch.Tensor:
    """Cross-entropy of ``F.linear(input, linear_weight, linear_bias)`` against ``target``, never building the logits.

    Equal to ``F.cross_entropy(z, target, weight=weight, reduction=reduction, ignore_index=ignore_index,
    label_smoothing=label_smoothing)`` computed in float32 with ``z = F.linear(input, linear_weight, linear_bias)``,
    ``z = softcap * tanh(z / softcap)`` when ``softcap`` is set, plus ``z_loss * logsumexp(z)**2`` added to the loss
    of every non-ignored token before the reduction. Argument names and order match
    ``torch.nn.functional.linear_cross_entropy``.

    Args:
        input: (..., D) float32, bfloat16 or float16 hidden states.
        linear_weight: (V, D) classifier, same dtype and device as ``input``.
        target: (...) int64 or int32 class indices in [0, V), or ``ignore_index``.
        linear_bias: optional (V,) bias.
        weight: optional (V,) class weights (as in ``F.cross_entropy``).
        reduction: "mean" (divides by the number, or the summed class weights, of non-ignored tokens), "sum"
            or "none" (one float32 value per token, 0 where ignored).
        ignore_index: target value that contributes neither loss nor gradient (``None`` means -100).
        label_smoothing: in [0, 1].
        z_loss: coefficient of PaLM's auxiliary ``logsumexp(z)**2`` loss, >= 0.
        softcap: positive logit cap (Gemma 2), or None.
        backend: "auto" (Triton on CUDA when available, else PyTorch; ``$LOGITLESS_BACKEND`` overrides),
            "triton" or "torch".
        deterministic: ask for gradients that are bitwise identical run to run. Both backends already give them
            (the Triton backward uses no atomics and reduces in a fixed order), so this never changes the result.
        process_group: a ``torch.distributed`` group over which the vocabulary is sharded: ``linear_weight``
            (and ``linear_bias``, ``weight``) hold this rank's contiguous rows, in rank order; targets are global.
            See :mod:`logitless.distributed`.

    Returns:
        float32 loss: a scalar, or the shape of ``target`` for ``reduction="none"``.
    """
    ignore_index = -100 if ignore_index is None else ignore_index
    if process_group is not None:
        from . import distributed

        return distributed.linear_cross_entropy(
            input, linear_weight, target, linear_bias=linear_bias, weight=weight, reduction=reduction,
            ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
            backend=backend, process_group=process_group,
        )
    _validate.check_options(reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
                            ignore_index=ignore_index)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    args = _validate.linear_head(input, linear_weight, target, linear_bias, ignore_index)
    weight = _validate.check_class_weight(weight, linear_weight.shape[0], input.device)
    chosen = resolve_backend(backend, input.device, "linear_cross_entropy")
    if chosen == "triton" and check_kernel_dtype(args.x, backend):
        return _lce_triton(args, weight, reduction, ignore_index, label_smoothing, z_loss, softcap)
    return reference.lce_torch(args, weight, reduction, ignore_index, label_smoothing, z_loss, softcap)


def _lce_triton(args, weight, reduction, ignore_index, label_smoothing, z_loss, softcap):
    V = args.weight.shape[0]
    class_w = None if weight is None else weight.float()
    m, logs, zt, sw, _ = head_stats(args, class_w, softcap, 1.0, label_smoothing > 0.0, False)
    valid, w_t, w_sum = reference.ce_row_terms(args.target, class_w, ignore_index, label_smoothing, V, m.dtype)
    # sw is taken relative to the row max, so ref = m.
    per_token = reference.ce_loss_from_stats(m, logs, zt, sw, m, valid, w_t, w_sum, label_smoothing, z_loss, V)
    return reference.reduce_loss(per_token, valid, w_t, reduction, args.lead_shape)
