"""cross_entropy on logits that already exist."""

from __future__ import annotations

import torch

from . import _validate, reference
from ._dispatch import resolve_backend


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
    backend: str = "auto",
) -> torch.Tensor:
    """``F.cross_entropy`` on (..., V) logits in float32 math, with the z-loss and softcap options of
    :func:`logitless.linear_cross_entropy`. Returns a float32 scalar, or per-token losses for ``reduction="none"``."""
    ignore_index = -100 if ignore_index is None else ignore_index
    _validate.check_options(reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
                            ignore_index=ignore_index)
    logits2d, t, lead_shape = _validate.logits_head(logits, target, ignore_index)
    weight = _validate.check_class_weight(weight, logits2d.shape[1], logits.device)
    resolve_backend(backend, logits.device, "cross_entropy")
    return reference.cross_entropy_torch(logits2d, t, lead_shape, weight, reduction, ignore_index, label_smoothing,
                                         z_loss, softcap)
