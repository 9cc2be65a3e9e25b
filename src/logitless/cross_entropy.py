"""cross_entropy on logits that already exist: the public function (validation, the backend choice, the call).

The two backends are torch_backend/cross_entropy.py (the chunked PyTorch twin) and triton_cross_entropy.py (the
kernels as torch.library ops); each returns the reduced loss, since the Triton form's in-place gradient is that of
the reduced loss.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, overload

import torch

from . import _validate, triton_cross_entropy
from ._dispatch import resolve_backend
from .torch_backend import cross_entropy as torch_cross_entropy


class CrossEntropyOutput(NamedTuple):
    """What ``cross_entropy(..., return_lse=True)`` returns."""

    loss: torch.Tensor  # float32: scalar, or the shape of target for reduction="none"
    lse: torch.Tensor  # float32, shape of target: logsumexp of each row's (softcapped) logits; not differentiable


# ---------------------------------------------------------------------------------------------------------------
# Public function


@overload
def cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, weight: torch.Tensor | None = ...,
                  reduction: str = ..., ignore_index: int = ..., label_smoothing: float = ..., z_loss: float = ...,
                  softcap: float | None = ..., inplace_backward: bool = ..., return_lse: Literal[False] = ...,
                  backend: str = ...) -> torch.Tensor: ...


@overload
def cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, weight: torch.Tensor | None = ...,
                  reduction: str = ..., ignore_index: int = ..., label_smoothing: float = ..., z_loss: float = ...,
                  softcap: float | None = ..., inplace_backward: bool = ..., return_lse: Literal[True],
                  backend: str = ...) -> CrossEntropyOutput: ...


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    weight: torch.Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    inplace_backward: bool = False,
    return_lse: bool = False,
    backend: str = "auto",
) -> torch.Tensor | CrossEntropyOutput:
    """``F.cross_entropy`` on (..., V) logits in float32 math, with the z-loss and softcap options of
    :func:`logitless.linear_cross_entropy`.

    Args:
        logits: (..., V) float32, bfloat16 or float16 (float64 on the PyTorch path).
        target: (...) int64 or int32 class indices in [0, V), or ``ignore_index``.
        weight, reduction, ignore_index, label_smoothing: as in ``F.cross_entropy``; "mean" divides by the number
            (or the summed class weights) of non-ignored tokens.
        z_loss: coefficient of ``logsumexp(z)**2`` added to each non-ignored token's loss.
        softcap: the logits become ``softcap * tanh(logits / softcap)`` first (Gemma 2), or None.
        inplace_backward: **the logits are overwritten.** The gradient w.r.t. the logits is written over the logits
            buffer (by the forward on the Triton path, by the backward on the PyTorch path) instead of a new N x V
            tensor, and returned as that gradient: after the call the logits hold no logits any more. Only when the
            logits require grad and grad mode is on; backward can then run once. Logits strided along the classes
            are copied first (the copy is overwritten). Reading the logits afterwards, or an earlier op that
            saved them for its own backward, sees the gradient (autograd raises in the second case, as the version
            counter is bumped).
        return_lse: also return the per-row log-sum-exp (float32, shape of ``target``, not differentiable).
        backend: "auto" (Triton on CUDA when available, else PyTorch; ``$LOGITLESS_BACKEND`` overrides),
            "triton" or "torch".

    Returns:
        The float32 loss (a scalar, or the shape of ``target`` for ``reduction="none"``), or
        ``CrossEntropyOutput(loss, lse)`` when ``return_lse=True``.
    """
    _validate.check_no_transform("cross_entropy")
    ignore_index = _validate.ignore_index_arg(ignore_index)
    _validate.check_options(reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
                            ignore_index=ignore_index)
    _validate.check_flag("inplace_backward", inplace_backward)
    _validate.check_flag("return_lse", return_lse)
    logits2d, t, lead_shape = _validate.logits_head(logits, target, ignore_index)
    weight = _validate.check_class_weight(weight, logits2d.shape[1], logits.device)
    chosen = resolve_backend(backend, logits.device, "cross_entropy")
    if chosen == "triton" and backend == "auto" and logits2d.dtype not in _validate.KERNEL_DTYPES:
        chosen = "torch"  # float64 has no kernels
    if logits2d.shape[1] == 1:
        # One class: the loss is the z-loss alone (lse = z) and the rest is exactly 0. On a GPU the kernel left an
        # ulp there (1e-8 with softcap, measured on an H100) where PyTorch gives 0; the PyTorch path transforms the
        # logits once and gets the exact zeros. N values: nothing to fuse.
        chosen = "torch"
    # No backward can run without grad mode (torch.no_grad, inference): then nothing is overwritten, on either path.
    inplace_backward = inplace_backward and torch.is_grad_enabled()
    if inplace_backward:
        # a copy where strided: the gradient overwrites it, not the caller's
        logits2d = triton_cross_entropy.unit_class_stride(logits2d)
    run = torch_cross_entropy.cross_entropy if chosen == "torch" else triton_cross_entropy.cross_entropy
    loss, lse = run(logits2d, t, lead_shape, weight, reduction, ignore_index, label_smoothing, z_loss, softcap,
                    inplace_backward)
    return CrossEntropyOutput(loss, lse) if return_lse else loss
