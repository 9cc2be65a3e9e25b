"""cross_entropy on logits that already exist: the public function (validation, then the call).

head.logits_cross_entropy chooses the backend: torch_backend/cross_entropy.py (the chunked PyTorch twin) or
triton_cross_entropy.py (the kernels as torch.library ops); each returns the reduced loss, since the Triton form's
in-place gradient is that of the reduced loss.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, overload

import torch

from . import _validate, head


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
    loss, lse = head.logits_cross_entropy(logits2d, t, lead_shape, weight, reduction, ignore_index, label_smoothing,
                                          z_loss, softcap, inplace_backward, backend)
    return CrossEntropyOutput(loss, lse) if return_lse else loss
