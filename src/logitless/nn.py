"""Thin nn.Module wrappers over the functional ops."""

from __future__ import annotations

import torch

from .cross_entropy import cross_entropy
from .linear_cross_entropy import linear_cross_entropy


class LinearCrossEntropyLoss(torch.nn.Module):
    """Module form of :func:`logitless.linear_cross_entropy`; ``forward(input, linear_weight, target,
    linear_bias=None)``. Class weights, if given, are kept as a buffer."""

    def __init__(self, weight: torch.Tensor | None = None, *, reduction: str = "mean", ignore_index: int = -100,
                 label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float | None = None,
                 backend: str = "auto"):
        super().__init__()
        self.register_buffer("weight", weight)
        self.reduction = reduction
        self.ignore_index = ignore_index
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.softcap = softcap
        self.backend = backend

    def forward(self, input: torch.Tensor, linear_weight: torch.Tensor, target: torch.Tensor,
                linear_bias: torch.Tensor | None = None) -> torch.Tensor:
        return linear_cross_entropy(input, linear_weight, target, linear_bias=linear_bias, weight=self.weight,
                                    reduction=self.reduction, ignore_index=self.ignore_index,
                                    label_smoothing=self.label_smoothing, z_loss=self.z_loss, softcap=self.softcap,
                                    backend=self.backend)

    def extra_repr(self) -> str:
        return (f"reduction={self.reduction!r}, ignore_index={self.ignore_index}, "
                f"label_smoothing={self.label_smoothing}, z_loss={self.z_loss}, softcap={self.softcap}, "
                f"backend={self.backend!r}")


class CrossEntropyLoss(torch.nn.Module):
    """Module form of :func:`logitless.cross_entropy`; ``forward(logits, target)``. With
    ``inplace_backward=True`` the logits passed to forward are overwritten by their gradient (see the function)."""

    def __init__(self, weight: torch.Tensor | None = None, *, reduction: str = "mean", ignore_index: int = -100,
                 label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float | None = None,
                 inplace_backward: bool = False, backend: str = "auto"):
        super().__init__()
        self.inplace_backward = inplace_backward
        self.register_buffer("weight", weight)
        self.reduction = reduction
        self.ignore_index = ignore_index
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.softcap = softcap
        self.backend = backend

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return cross_entropy(logits, target, weight=self.weight, reduction=self.reduction,
                             ignore_index=self.ignore_index, label_smoothing=self.label_smoothing,
                             z_loss=self.z_loss, softcap=self.softcap, inplace_backward=self.inplace_backward,
                             backend=self.backend)

    def extra_repr(self) -> str:
        return (f"reduction={self.reduction!r}, ignore_index={self.ignore_index}, "
                f"label_smoothing={self.label_smoothing}, z_loss={self.z_loss}, softcap={self.softcap}, "
                f"inplace_backward={self.inplace_backward}, backend={self.backend!r}")
