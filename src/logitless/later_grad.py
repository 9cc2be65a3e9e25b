"""A weight's gradient made in part later, by the autograd node that takes it.

A head tied to the input embedding, on a CPU (integrations/tied.py), routes the weight through one autograd node
whose backward runs last, once the backbone's backward has freed the activations it saved. Within
`weight_grad_later(weight, node, later)`, the PyTorch backend's fused loss on that very weight makes its gradient for
the classes below `split(V)` in its forward (as it makes every gradient there) and leaves the rest to `later`, a
`LaterWeightGrad`: the node's backward calls `later.take()`, which makes the rest from the loss's saved inputs and
row statistics and returns the whole gradient. The part made later never lives beside the activations; it costs one
more product over that part of the vocabulary (its logits again). docs/design/tied_head.md has the measurement.

Shared by the backend (torch_backend/fused.py) and the integration (integrations/tied.py): neither imports the
other.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

# The share of the vocabulary whose rows of the weight's gradient are made later: more lowers the peak further and
# recomputes more logits (docs/design/tied_head.md, "Half of it later").
LATER_SHARE = 0.5


def split(V: int) -> int:
    """The first class whose row of the weight's gradient is made later."""
    return V - int(V * LATER_SHARE)


class LaterWeightGrad:
    """The weight gradients that fused losses left for later: `take()` makes them (each for the upstream gradient its
    loss's backward received) and sums them; None where none is pending."""

    def __init__(self):
        self._makers = []

    def add(self, maker) -> None:
        self._makers.append(maker)

    def take(self) -> torch.Tensor | None:
        makers, self._makers = self._makers, []
        total = None
        for make in makers:
            g = make()
            total = g if total is None else total.add_(g)
        return total


_LATER: contextvars.ContextVar = contextvars.ContextVar("logitless_later_grad", default=None)


@contextlib.contextmanager
def weight_grad_later(weight: torch.Tensor, node, later: LaterWeightGrad):
    """Within: a fused loss on exactly this `weight` tensor leaves part of its gradient to `later`; `node` is the
    autograd node whose backward calls later.take() (a backward pass that will not run it makes the whole gradient
    in the loss's own backward)."""
    token = _LATER.set((weight, node, later))
    try:
        yield
    finally:
        _LATER.reset(token)


def claim(weight: torch.Tensor):
    """(node, LaterWeightGrad) where `weight` is the tensor of the current weight_grad_later, else None."""
    cur = _LATER.get()
    return cur[1:] if cur is not None and cur[0] is weight else None


def will_run(node) -> bool:
    """Whether the backward pass now running will run `node` (and so call its LaterWeightGrad)."""
    return bool(torch._C._will_engine_execute_node(node))
