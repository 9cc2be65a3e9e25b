"""Thin nn.Module wrappers over the functional ops."""

from __future__ import annotations

import torch

from . import _validate
from .cross_entropy import cross_entropy
from .linear_cross_entropy import linear_cross_entropy
from .vocab import running_class_counts


class _LossOptions(torch.nn.Module):
    """The options both losses share; class weights, if given, are kept as a buffer."""

    _repr_fields: tuple[str, ...] = ("reduction", "ignore_index", "label_smoothing", "z_loss", "softcap", "backend")

    def __init__(self, weight, reduction, ignore_index, label_smoothing, z_loss, softcap, backend):
        super().__init__()
        self.register_buffer("weight", weight)
        self.reduction = reduction
        self.ignore_index = _validate.ignore_index_arg(ignore_index)  # None -> -100, as the functions take it
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.softcap = softcap
        self.backend = backend

    def extra_repr(self) -> str:
        return ", ".join(f"{name}={getattr(self, name)!r}" for name in self._repr_fields)


class LinearCrossEntropyLoss(_LossOptions):
    """Module form of :func:`logitless.linear_cross_entropy`; ``forward(input, linear_weight, target,
    linear_bias=None)``. Class weights, if given, are kept as a buffer. ``skip_threshold``, ``vocab_order``,
    ``workspace_bytes`` and ``deterministic`` are the function's (skipping where it pays, the memory policy by
    default);
    ``vocab_order="running"`` orders the vocabulary by target counts kept across training steps (the
    ``vocab_counts`` buffer, decayed by 0.99 per step, updated on the device; in the state_dict from the first
    forward on, and a state without it loads as a fresh module's)."""

    def __init__(self, weight: torch.Tensor | None = None, *, reduction: str = "mean", ignore_index: int = -100,
                 label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float | None = None,
                 backend: str = "auto", skip_threshold: float | str | None = "auto", vocab_order: str = "none",
                 workspace_bytes: int | None = None, deterministic: bool = False):
        if vocab_order not in ("batch", "running", "none"):
            raise ValueError(f"vocab_order must be 'batch', 'running' or 'none', got {vocab_order!r}")
        super().__init__(weight, reduction, ignore_index, label_smoothing, z_loss, softcap, backend)
        self.skip_threshold = skip_threshold
        self.vocab_order = vocab_order
        self.workspace_bytes = workspace_bytes
        self.deterministic = deterministic
        self.register_buffer("vocab_counts", None)

    def forward(self, input: torch.Tensor, linear_weight: torch.Tensor, target: torch.Tensor,
                linear_bias: torch.Tensor | None = None) -> torch.Tensor:
        order = self.vocab_order
        if order == "running":
            counts = self.vocab_counts
            if counts is not None and counts.device != target.device:
                counts = counts.to(target.device)  # loaded from a checkpoint elsewhere: keep, do not restart them
            self.vocab_counts = running_class_counts(counts, target, linear_weight.shape[0], self.ignore_index,
                                                     update=self.training)
            order = self.vocab_counts
        return linear_cross_entropy(input, linear_weight, target, linear_bias=linear_bias, weight=self.weight,
                                    reduction=self.reduction, ignore_index=self.ignore_index,
                                    label_smoothing=self.label_smoothing, z_loss=self.z_loss, softcap=self.softcap,
                                    backend=self.backend, skip_threshold=self.skip_threshold, vocab_order=order,
                                    workspace_bytes=self.workspace_bytes, deterministic=self.deterministic)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # The counts exist from the first forward on, so a checkpoint holds them or not, and strict loading would
        # refuse one of the two. Saved counts are copied into a buffer made like them (shape, dtype, device; .to()
        # moves it as any buffer) unless one of their shape exists; a state without counts is a fresh module's.
        if self.vocab_order == "running":
            saved = state_dict.get(prefix + "vocab_counts")
            if saved is None:
                self.vocab_counts = None
            elif isinstance(saved, torch.Tensor) and (self.vocab_counts is None
                                                      or self.vocab_counts.shape != saved.shape):
                self.vocab_counts = torch.empty_like(saved)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    _repr_fields = _LossOptions._repr_fields + ("skip_threshold", "vocab_order", "workspace_bytes", "deterministic")


class CrossEntropyLoss(_LossOptions):
    """Module form of :func:`logitless.cross_entropy`; ``forward(logits, target)``. With
    ``inplace_backward=True`` the logits passed to forward are overwritten by their gradient (see the function)."""

    def __init__(self, weight: torch.Tensor | None = None, *, reduction: str = "mean", ignore_index: int = -100,
                 label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float | None = None,
                 inplace_backward: bool = False, backend: str = "auto"):
        super().__init__(weight, reduction, ignore_index, label_smoothing, z_loss, softcap, backend)
        self.inplace_backward = inplace_backward

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return cross_entropy(logits, target, weight=self.weight, reduction=self.reduction,
                             ignore_index=self.ignore_index, label_smoothing=self.label_smoothing,
                             z_loss=self.z_loss, softcap=self.softcap, inplace_backward=self.inplace_backward,
                             backend=self.backend)

    _repr_fields = _LossOptions._repr_fields + ("inplace_backward",)
