"""Autograd hygiene shared by every hand-written backward: they are first-order only, and say so clearly."""

from __future__ import annotations

import functools

import torch

NOT_DIFFERENTIABLE = ("logitless: the gradients of its ops (linear_cross_entropy, linear_log_probs, linear_logsumexp, "
                      "cross_entropy) are not differentiable (no double backward / create_graph=True through them)")


class _NotDifferentiable(torch.autograd.Function):
    """Identity on a backward's results; differentiating through it raises NOT_DIFFERENTIABLE. The first
    `n_anchors` arguments (tensors that require grad) only put the results in the graph, so that the error comes when
    they are differentiated, with respect to any of them (with one anchor, a gradient asked for with respect to
    another input would not reach this node, and PyTorch would say that input "appears to not have been used")."""

    @staticmethod
    def forward(ctx, n_anchors, *args):
        return tuple(o.view_as(o) for o in args[n_anchors:])

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(NOT_DIFFERENTIABLE)


def grads_wanted(*tensors) -> bool:
    """Whether a backward may follow this call: grad mode on and one of `tensors` (None allowed) requiring grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def first_order_only(backward):
    """For an autograd.Function's backward, in place of torch's once_differentiable: the backward runs without a
    graph, and with create_graph=True its results come out attached to a node that raises NOT_DIFFERENTIABLE when
    they are differentiated (once_differentiable leaves them detached there, and the user gets torch's generic
    "does not require grad" error instead)."""

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        graph = torch.is_grad_enabled()
        # Before the backward: an in-place one bumps its saved buffer's version, after which it cannot be unpacked.
        anchors = [t for t in (*ctx.saved_tensors, *grads)
                   if isinstance(t, torch.Tensor) and t.requires_grad] if graph else []
        with torch.no_grad():
            outs = backward(ctx, *grads)
        idx = [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor)]
        if not anchors or not idx:
            return outs
        attached = _NotDifferentiable.apply(len(anchors), *anchors, *(outs[i] for i in idx))
        outs = list(outs)
        for i, o in zip(idx, attached, strict=True):
            outs[i] = o
        return tuple(outs)

    return wrapper


def graph_kept() -> bool:
    """Whether the backward pass running now keeps the graph (``retain_graph=True``, which ``torch.autograd.grad``
    and gradcheck ask for): a backward that hands out buffers computed in its forward may scale them in place only
    when it is not, since a kept graph may be differentiated again. Where this torch has no such query the answer is
    True: fresh outputs are always right, in place is only cheaper."""
    query = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    if query is None:
        return True
    try:
        return bool(query())
    except RuntimeError:  # called outside a backward pass
        return True


def scale_forward_grads(ctx, g, scale_=None) -> tuple:
    """The backward of a loss whose gradients were computed in its forward for an upstream gradient of 1:
    ctx.grads holds them (a tuple, None where not wanted), ctx.dtypes the dtypes to return them in, and the inputs
    are saved tensors. While the graph is kept, each backward scales them into fresh tensors, so any number of
    backwards give the same gradients; the backward that frees the graph scales them in place (`scale_(t, g)`, by
    default t.mul_(g)) and drops ctx's reference, so that AccumulateGrad takes them over as .grad without a copy.
    After that, PyTorch's own error for a freed graph."""
    grads = ctx.grads
    if grads is None:
        _ = ctx.saved_tensors  # raises PyTorch's error for a freed graph
        raise RuntimeError("logitless: backward through a graph that was already freed; pass retain_graph=True to "
                           "the earlier backward")
    if graph_kept():
        return tuple(None if t is None else (t * g).to(dt) for t, dt in zip(grads, ctx.dtypes, strict=True))
    ctx.grads = None
    scale_ = scale_ or (lambda t, s: t.mul_(s))
    return tuple(None if t is None else scale_(t, g).to(dt) for t, dt in zip(grads, ctx.dtypes, strict=True))


def no_setup(ctx, inputs, output):
    """setup_context of a torch.library op whose autograd formula only refuses (no_double_backward)."""


def no_double_backward(ctx, *grads):
    """The autograd formula of a gradient op: differentiating a gradient raises NOT_DIFFERENTIABLE (without one,
    PyTorch would say "no autograd formula was registered")."""
    raise RuntimeError(NOT_DIFFERENTIABLE)
