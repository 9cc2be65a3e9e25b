"""linear_cross_entropy: the loss of a linear head without materialising its logits."""

from __future__ import annotations

import torch

from . import _validate, reference
from ._dispatch import resolve_backend


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
    args = _validate.linear_head(input, linear_weight, target, linear_bias, ignore_index)
    weight = _validate.check_class_weight(weight, linear_weight.shape[0], input.device)
    resolve_backend(backend, input.device, "linear_cross_entropy")
    return reference.lce_torch(args, weight, reduction, ignore_index, label_smoothing, z_loss, softcap)
