"""A vocabulary stored in another order: the head's rows permuted once, so that the classes that take the
probability sit together and whole tiles of the rest are cold.

The skipping backward (`skip_threshold`) leaves out (token block, vocabulary tile) pairs whose mass is negligible.
In a tokenizer's own id order the classes a batch uses are scattered over most tiles; stored by decreasing mass
(or frequency) they fill the first tiles, and the backward skips most of the others (measured on a real model's
head: docs/kernels.md, "Sparsity").

The permutation is physical: the weight (and bias, class weights) are kept in the new order, targets and input ids
are mapped to their positions. Every loss and gradient is the same up to that permutation. Reading W through an
index on every call instead (the ops' `vocab_order` option) costs a gather per tile; a copy per call costs a V x D
buffer; keeping the order costs nothing per step.

    order = VocabOrder.by_mass(hidden_sample, lm_head.weight)   # or VocabOrder.by_counts(token_counts)
    w = order.sort(lm_head.weight)                              # keep this as the head's weight
    loss = linear_cross_entropy(x, w, order.map_ids(labels), skip_threshold="auto")
    lm_head_weight_in_id_order = order.unsort(w)                # to save or export

A model whose input embedding is tied to the head sees its embedding rows permuted with it: feed it
`order.map_ids(input_ids)`; logits it returns are in stored order (`order.unsort(logits, dim=-1)`).

The ops' own orders per call come from class counts: this batch's (class_counts, `vocab_order="batch"`) or counts
kept across steps (running_class_counts, `LinearCrossEntropyLoss(vocab_order="running")`).
"""

from __future__ import annotations

import torch

__all__ = ["VocabOrder"]


class VocabOrder:
    """A permutation of a vocabulary of V classes: stored position k holds class `ids[k]`.

    ids: a 1-D integer tensor holding each of 0 .. V-1 once (checked here, once: this synchronises with the device,
    as building a model does, never in a forward or backward)."""

    def __init__(self, ids: torch.Tensor):
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1:
            raise TypeError(f"ids must be a 1-D tensor of class ids, got {type(ids).__name__}"
                            + (f" of shape {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else ""))
        if ids.dtype.is_floating_point or ids.is_complex() or ids.dtype == torch.bool:
            raise TypeError(f"ids must be an integer tensor, got {ids.dtype}")
        ids = ids.to(torch.int64)
        V = ids.numel()
        if V == 0:
            raise ValueError("ids is empty: a vocabulary has at least one class")
        seen = torch.zeros(V, dtype=torch.int64, device=ids.device)
        in_range = bool(((ids >= 0) & (ids < V)).all())
        if in_range:
            seen.index_add_(0, ids, torch.ones_like(ids))
        if not in_range or not bool((seen == 1).all()):
            raise ValueError(f"ids must hold each class id 0 .. {V - 1} exactly once (a permutation)")
        self.ids = ids
        self.positions = torch.empty_like(ids)
        self.positions[ids] = torch.arange(V, device=ids.device)

    # ------------------------------------------------------------------ building an order
    @classmethod
    def by_counts(cls, counts: torch.Tensor) -> VocabOrder:
        """Classes by decreasing count (token frequencies of the training data, or any per-class weight); ties
        keep id order."""
        if not isinstance(counts, torch.Tensor) or counts.dim() != 1:
            raise TypeError("counts must be a 1-D tensor with one number per class")
        if counts.is_complex() or counts.dtype == torch.bool:
            raise TypeError(f"counts must be real numbers, got {counts.dtype}")
        return cls(torch.argsort(counts.double(), descending=True, stable=True))

    @classmethod
    def by_mass(cls, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                softcap: float | None = None, temperature: float = 1.0, rows: int = 1024) -> VocabOrder:
        """Classes by decreasing softmax mass summed over the rows of `hidden` (a sample of the model's last hidden
        states, (..., D)), with the head (weight (V, D), bias) as the loss sees it. Float32 logits, `rows` rows at
        a time: a rows x V block, never N x V. Take the sample from other batches than the ones it will serve
        (measured: an order from held-out text skips as much as the batch's own)."""
        if hidden.dim() < 1 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
            raise ValueError(f"hidden (..., D) and weight (V, D) must share D, got {tuple(hidden.shape)} and "
                             f"{tuple(weight.shape)}")
        if temperature <= 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        if rows < 1:
            raise ValueError(f"rows must be at least 1, got {rows}")
        x = hidden.reshape(-1, hidden.shape[-1])
        w = weight.detach().float()
        b = None if bias is None else bias.detach().float()
        mass = torch.zeros(w.shape[0], dtype=torch.float64, device=w.device)
        with torch.no_grad():
            for i in range(0, x.shape[0], rows):
                z = x[i:i + rows].detach().float() @ w.T
                if b is not None:
                    z += b
                if softcap is not None:
                    z = softcap * torch.tanh(z / softcap)
                mass += torch.softmax(z / temperature, dim=1).sum(0, dtype=torch.float64)
        return cls(torch.argsort(mass, descending=True, stable=True))

    # ------------------------------------------------------------------ using it
    def __len__(self) -> int:
        return self.ids.numel()

    def __repr__(self) -> str:
        return f"VocabOrder(V={len(self)}, first ids {self.ids[:5].tolist()})"

    def to(self, device) -> VocabOrder:
        out = object.__new__(VocabOrder)
        out.ids, out.positions = self.ids.to(device), self.positions.to(device)
        return out

    def _check(self, t: torch.Tensor, dim: int, what: str) -> None:
        if t.shape[dim] != len(self):
            raise ValueError(f"{what} has {t.shape[dim]} classes along dim {dim}, the order {len(self)}")

    def sort(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """`tensor` (the head's weight (V, D), its bias, class weights, or logits along `dim`) from class-id order
        to stored order: a new tensor."""
        self._check(tensor, dim, "tensor")
        return tensor.index_select(dim, self.ids.to(tensor.device))

    def unsort(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """The inverse of sort: stored order back to class-id order (to save the head, or read logits)."""
        self._check(tensor, dim, "tensor")
        return tensor.index_select(dim, self.positions.to(tensor.device))

    def map_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Class ids (targets, labels, input ids) to their stored positions; values outside 0 .. V-1 (ignore_index,
        padding, or an out-of-range target that the loss then reports) are left as they are."""
        return self._remap(ids, self.positions, "ids")

    def unmap_ids(self, positions: torch.Tensor) -> torch.Tensor:
        """Stored positions (e.g. a sampled or argmax index over sorted logits) back to class ids."""
        return self._remap(positions, self.ids, "positions")

    def _remap(self, t: torch.Tensor, table: torch.Tensor, what: str) -> torch.Tensor:
        if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.is_complex() or t.dtype == torch.bool:
            raise TypeError(f"{what} must be an integer tensor")
        table = table.to(t.device)
        ok = (t >= 0) & (t < len(self))
        return torch.where(ok, table[t.clamp(0, len(self) - 1).long()].to(t.dtype), t)


def class_counts(target: torch.Tensor, num_classes: int, ignore_index: int) -> torch.Tensor:
    """(V,) float32 count of each class among the non-ignored targets, on the targets' device, without a host sync
    (no bincount: its output size would need one)."""
    t = target.reshape(-1)
    valid = (t != ignore_index) & (t >= 0) & (t < num_classes)
    idx = torch.where(valid, t, num_classes)
    counts = torch.zeros(num_classes + 1, device=t.device, dtype=torch.float32)
    return counts.scatter_add_(0, idx, torch.ones_like(idx, dtype=torch.float32))[:num_classes]


# Per-step decay of LinearCrossEntropyLoss's running class counts (vocab_order="running"): about 100 steps of memory.
RUNNING_DECAY = 0.99


def running_class_counts(counts, target: torch.Tensor, num_classes: int, ignore_index: int, update: bool = True):
    """counts * RUNNING_DECAY + this batch's class counts, in place and on the device (no host sync); a new (V,)
    float32 tensor of the batch's counts when counts is None or of another size or device. update=False returns
    the counts unchanged (evaluation)."""
    if counts is None or counts.shape != (num_classes,) or counts.device != target.device:
        return class_counts(target, num_classes, ignore_index)
    if update:
        with torch.no_grad():
            counts.mul_(RUNNING_DECAY).add_(class_counts(target, num_classes, ignore_index))
    return counts
