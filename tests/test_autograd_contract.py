"""PyTorch's autograd contract through the default call and each backend: a loss can be differentiated any number
of times while its graph is kept (retain_graph=True, torch.autograd.grad), each time with the same gradients bit
for bit, whether the gradients were computed in the forward (the PyTorch path's fused training path), read from the
forward's stash (the kernels), or recomputed; the backward that frees the graph gives them once more, and after it
PyTorch's own error. Second-order gradients stay refused with a clear error. PyTorch's own float64 gradcheck samples
run in tests/test_peer_suites.py."""

from __future__ import annotations

import pytest
import torch

import logitless
from tests.helpers import leaves, make_case

# (dtype, options): every loss option at least once; the kernels run through the interpreter on a CPU.
LCE_OPTIONS = [
    (torch.float32, dict()),
    (torch.float32, dict(reduction="sum", label_smoothing=0.1, bias=True)),
    (torch.float32, dict(reduction="none", z_loss=1e-3, softcap=4.0)),
    (torch.bfloat16, dict(class_weight=True, label_smoothing=0.2)),
    (torch.bfloat16, dict(reduction="sum", z_loss=1e-2, softcap=3.0, bias=True)),
]


def _kept_backwards_equal(loss_fn, inputs, upstream):
    """Three backwards through one graph (two kept, the last freeing it), by autograd.grad and by .backward: all
    bitwise equal; then PyTorch's error for a backward through the freed graph."""
    loss = loss_fn(*inputs)
    up = upstream(loss)
    first = [g.clone() for g in torch.autograd.grad(loss, inputs, up, retain_graph=True)]
    second = [g.clone() for g in torch.autograd.grad(loss, inputs, up, retain_graph=True)]
    last = torch.autograd.grad(loss, inputs, up)
    for a, b, c in zip(first, second, last, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        torch.autograd.grad(loss, inputs, up)
    # .backward(retain_graph=True) twice accumulates the same gradient twice
    loss = loss_fn(*inputs)
    for t in inputs:
        t.grad = None
    loss.backward(up, retain_graph=True)
    once = [t.grad.clone() for t in inputs]
    loss.backward(up)
    for t, g in zip(inputs, once, strict=True):
        torch.testing.assert_close(t.grad, g + g, rtol=0, atol=0)


def _upstream(loss):
    if loss.dim() == 0:
        return torch.tensor(1.7, dtype=loss.dtype)
    return torch.randn(loss.shape, generator=torch.Generator().manual_seed(3)).to(loss.dtype)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype,opts", LCE_OPTIONS)
def test_linear_cross_entropy_kept_graph(backend, dtype, opts):
    opts = dict(opts)
    x, w, b, t = make_case(dtype, n=37, d=24, v=151, bias=opts.pop("bias", False), ignore_frac=0.25, scale=2.0)
    cw = torch.rand(151, generator=torch.Generator().manual_seed(1)) + 0.5 if opts.pop("class_weight", False) else None
    ins = leaves(x, w) + ([] if b is None else leaves(b))

    def fn(x_, w_, *b_):
        return logitless.linear_cross_entropy(x_, w_, t, linear_bias=b_[0] if b_ else None, weight=cw,
                                              backend=backend, **opts)

    _kept_backwards_equal(fn, ins, _upstream)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_log_probs_and_logsumexp_kept_graph(backend):
    x, w, _, t = make_case(torch.bfloat16, n=29, d=24, v=151, ignore_frac=0.2, scale=2.0)

    def lp(x_, w_):
        lp_, ent = logitless.linear_log_probs(x_, w_, t, return_entropy=True, backend=backend)
        return lp_ + 0.5 * ent

    _kept_backwards_equal(lp, leaves(x, w), _upstream)
    _kept_backwards_equal(lambda x_, w_: logitless.linear_logsumexp(x_, w_, backend=backend), leaves(x, w),
                          _upstream)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_second_order_refused(backend):
    x, w, _, t = make_case(torch.float32, n=11, d=8, v=31)
    xo, wo = leaves(x, w)
    loss = logitless.linear_cross_entropy(xo, wo, t, backend=backend)
    (gx,) = torch.autograd.grad(loss, xo, create_graph=True)
    with pytest.raises(RuntimeError, match="not differentiable"):
        torch.autograd.grad(gx.sum(), wo)
