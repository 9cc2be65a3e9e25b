"""A head tied to the input embedding, on a CPU: its two gradients summed in place, never two dense (V, D) at once.

A tied weight gets two gradients in one backward: the head's, dense (V, D), and the input embedding's, whose
nonzero rows are the N token ids of the batch. Stock autograd makes the embedding's dense too (a zeroed (V, D)
into which the N rows are added) and then adds the two; on a CPU the fused loss computes the head's in its forward,
so both exist at once: at Gemma 3 270M's vocabulary, two 671 MiB float32 tensors. PyTorch's own sparse embedding
gradient does not help alone: autograd's sum of a dense and a sparse gradient of one tensor is out of place, into
a third (V, D).

`tied_embedding_forward` routes the two uses of the weight through one node (`_TiedRows`): the head reads one of its
outputs and the embedding, asked for a sparse gradient, the other; its backward adds the embedding's N rows into
the head's gradient in place and hands the sum on. The parameter's ``.grad`` stays dense (an embedding's gradient
alone is made dense), in the order the rows are stored in. The head's gradient comes from logitless's own
backward, which hands out a tensor nobody else holds, so adding into it is safe.

The same node makes part of the head's gradient, where the loss takes the PyTorch backend's fused path: within
`head_grad_later`, that path makes the gradient's rows of the first classes in its forward and leaves the rest to
`_TiedRows`'s backward (logitless.later_grad), which runs last, once the backbone's backward has freed its
activations: that part never lives beside them, for one more product over its classes
(docs/design/tied_head.md).

Where it applies: eager mode (torch.compile traces the model as stock: its graph sums the two gradients itself),
gradients wanted, the weight on a CPU (a sparse embedding backward with a ``padding_idx`` synchronises with a GPU
to drop that row), a plain ``nn.Embedding`` (or subclass) holding the head's weight without ``max_norm`` (an in-place
renormalisation of the weight) or ``scale_grad_by_freq`` (which has no sparse backward).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from .. import later_grad
from .._validate import is_compiling


class _TiedRows(torch.autograd.Function):
    """weight -> (the head's weight, the embedding's weight), two views; the backward makes what the head's loss
    left for it (`later`), and sums the gradients, the embedding's (sparse, or absent) into the head's in place."""

    @staticmethod
    def forward(ctx, weight, later):
        ctx.set_materialize_grads(False)  # an unused output gives None, not a zeroed (V, D)
        ctx.later = later
        return weight.view_as(weight), weight.view_as(weight)

    @staticmethod
    def backward(ctx, g_head, g_embedding):
        made = ctx.later.take()  # a fresh tensor of our own, or None
        if made is not None:
            g_head = made if g_head is None else made.add_(g_head)
        return _sum(g_head, g_embedding), None


def _sum(g_head, g_embedding):
    """The head's gradient plus the embedding's: in place into the head's, which is logitless's own."""
    if g_embedding is None:
        return g_head
    if g_head is None:
        return g_embedding.to_dense() if g_embedding.is_sparse else g_embedding
    if torch.is_grad_enabled():  # create_graph=True: the sum must be recorded, not done in place
        return g_head + g_embedding
    return g_head.add_(g_embedding)


def tied_embedding(model: nn.Module, weight: torch.Tensor) -> nn.Embedding | None:
    """The model's input embedding where it holds `weight` and the in-place sum applies now, else None."""
    if is_compiling() or not torch.is_grad_enabled() or not weight.requires_grad or weight.device.type != "cpu":
        return None
    try:
        emb = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    if not isinstance(emb, nn.Embedding) or emb._parameters.get("weight") is not weight:
        return None
    if emb.max_norm is not None or emb.scale_grad_by_freq:
        return None
    return emb


@contextlib.contextmanager
def tied_rows(emb: nn.Embedding, weight: torch.Tensor):
    """Within: `emb` reads the embedding's view of `weight` with a sparse gradient; yields the head's view. The
    embedding is as it was on exit."""
    w_head, w_emb = _TiedRows.apply(weight, later_grad.LaterWeightGrad())
    sparse = emb.sparse
    # A plain tensor in the parameter's slot for the duration of the call, as torch.func.functional_call does.
    emb._parameters["weight"] = w_emb
    emb.sparse = True
    try:
        yield w_head
    finally:
        emb._parameters["weight"] = weight
        emb.sparse = sparse


def head_grad_later(w_head: torch.Tensor):
    """Within: the fused loss on `w_head` (the view tied_rows yielded) leaves part of the head's weight gradient to
    the tied node's backward."""
    node = w_head.grad_fn
    return later_grad.weight_grad_later(w_head, node, node.later)
