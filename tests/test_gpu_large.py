"""GPU only: every kernel indexes correctly past 2^31 elements, and the 1-element and empty batches run on the GPU.

The large cases put the last rows (or classes) of a tensor past element 2^31, where a 32-bit offset would wrap,
and compare the whole result with a float64 truth computed a block at a time (no float64 copy of a whole tensor;
float32 for the linear heads, whose 4 GB weights cannot be copied to float64: each test stays under ~45 GB of
GPU memory). A wrapped offset reads or writes the wrong rows, an O(1) error; the
bound is bf16's resolution (2^-7, twice the rounding of a bf16 result), far above a correct result's error and
far below a wrong row's. Run on a CUDA machine with:
    python -m pytest -q tests/test_gpu_large.py
"""

from __future__ import annotations

import pytest
import torch

import logitless
from logitless import testing
from tests.helpers import check_cross_entropy, check_log_probs_entropy, check_logsumexp, make_case

pytestmark = pytest.mark.gpu

BF16_BOUND = 2.0**-7
INT31 = 2**31
DEV = "cuda"


class _Err:
    """||a - truth|| / ||truth|| accumulated over blocks (float64)."""

    def __init__(self):
        self.num = 0.0
        self.den = 0.0

    def add(self, a: torch.Tensor, truth: torch.Tensor) -> None:
        self.num += float((a.detach().double() - truth).square().sum())
        self.den += float(truth.square().sum())

    def value(self) -> float:
        return (self.num / self.den) ** 0.5 if self.den > 0 else self.num**0.5


def _ce_truth(z64, t, up, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None):
    """Per-row loss and g_i * d loss_i / d z_i of a block of float64 logits (reduction="none", upstream up)."""
    z64 = z64.detach().requires_grad_(True)
    loss = testing.naive_cross_entropy(z64, t, reduction="none", ignore_index=ignore_index,
                                         label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap)
    (g,) = torch.autograd.grad(loss, z64, up)
    return loss.detach(), g


@pytest.mark.parametrize("n,v", [(16400, 131072), (262400, 8192)])  # split rows; a whole row in one tile
@pytest.mark.parametrize("inplace", (False, True))
def test_cross_entropy_past_2_31_elements(n, v, inplace):
    assert n * v > INT31
    gen = torch.Generator(device=DEV).manual_seed(0)
    z = (torch.randn(n, v, device=DEV, generator=gen) * 2).to(torch.bfloat16)
    t = torch.randint(0, v, (n,), device=DEV, generator=gen)
    t[::7] = -100
    up = torch.randn(n, device=DEV, generator=gen)
    opts = dict(label_smoothing=0.1, z_loss=1e-4, softcap=30.0)
    zo = z.clone().requires_grad_(True)  # in place, zo is overwritten and z keeps the logits
    loss = logitless.cross_entropy(zo, t, reduction="none", inplace_backward=inplace, backend="triton", **opts)
    (g,) = torch.autograd.grad(loss, zo, up)
    assert (g.data_ptr() == zo.data_ptr()) == inplace
    e_loss, e_grad, e_tail = _Err(), _Err(), _Err()
    rows = max(1, (1 << 27) // v)  # 1 GiB of float64 per block
    for i in range(0, n, rows):
        z64 = z[i:i + rows].double()
        l64, g64 = _ce_truth(z64, t[i:i + rows], up[i:i + rows].double(), **opts)
        e_loss.add(loss[i:i + rows], l64)
        e_grad.add(g[i:i + rows], g64)
        if (i + rows) * v > INT31:
            e_tail.add(g[i:i + rows], g64)
    assert e_loss.value() < 1e-5 and e_grad.value() < BF16_BOUND and e_tail.value() < BF16_BOUND, (
        e_loss.value(), e_grad.value(), e_tail.value())


def _head_truth(x, w, b, t, rows, fn, dtype=torch.float32):
    """Run `fn(x_block, w, b, t_block, first_row)` -> (per-row output, scalar to differentiate) in `dtype` over
    blocks of rows; returns [(row slice, per-row output, dx block)], dW, db. float32 rather than float64: a float64
    copy of a 4 GB weight and its gradient would not fit beside the test's tensors, and float32's error (~1e-6) is
    far below the bound."""
    w_ = w.to(dtype).requires_grad_(True)
    b_ = None if b is None else b.to(dtype).requires_grad_(True)
    dw = db = None
    blocks = []
    for i in range(0, x.shape[0], rows):
        x_ = x[i:i + rows].to(dtype).requires_grad_(True)
        out, s = fn(x_, w_, b_, None if t is None else t[i:i + rows], i)
        gs = torch.autograd.grad(s, [x_, w_] + ([b_] if b is not None else []))
        dw = gs[1] if dw is None else dw.add_(gs[1])
        if b is not None:
            db = gs[2] if db is None else db.add_(gs[2])
        blocks.append((slice(i, i + rows), out.detach(), gs[0]))
        del gs, s, out
    return blocks, dw, db


CASES = [
    # (N, D, V): N*D > 2^31 (input, its gradient, the dx workspace); V*D > 2^31 (weight, its gradient, the stash);
    # N*V > 2^31 (the logits the kernels never store, and the per-(row block, tile) statistics).
    (532500, 4100, 1000),
    (200, 4100, 532500),
    (65600, 256, 33000),
]


@pytest.mark.parametrize("N,D,V", CASES)
@pytest.mark.parametrize("op", ("linear_cross_entropy", "linear_log_probs", "linear_logsumexp"))
def test_linear_ops_past_2_31_elements(N, D, V, op):
    assert max(N * D, V * D, N * V) > INT31
    gen = torch.Generator(device=DEV).manual_seed(1)
    x = torch.randn(N, D, device=DEV, generator=gen).to(torch.bfloat16)
    w = (torch.randn(V, D, device=DEV, generator=gen) / D**0.5).to(torch.bfloat16)
    b = (torch.randn(V, device=DEV, generator=gen) * 0.1).to(torch.bfloat16)
    t = torch.randint(0, V, (N,), device=DEV, generator=gen)
    t[::5] = -100
    up = torch.randn(N, device=DEV, generator=gen, dtype=torch.float64)
    xo, wo, bo = (a.clone().requires_grad_(True) for a in (x, w, b))
    if op == "linear_cross_entropy":
        kw = dict(label_smoothing=0.1, z_loss=1e-4, softcap=30.0)
        out = logitless.linear_cross_entropy(xo, wo, t, linear_bias=bo, reduction="none", backend="triton", **kw)

        def fn(x64, w64, b64, tb, i):
            o = testing.naive_linear_cross_entropy(x64, w64, tb, linear_bias=b64, reduction="none", **kw)
            return o, (o * up[i:i + o.shape[0]].to(o.dtype)).sum()
    elif op == "linear_log_probs":
        kw = dict(softcap=30.0, temperature=0.7)
        lp, ent = logitless.linear_log_probs(xo, wo, t, linear_bias=bo, return_entropy=True, backend="triton", **kw)
        out = lp + 0.5 * ent

        def fn(x64, w64, b64, tb, i):
            lp, ent = testing.naive_linear_log_probs(x64, w64, tb, linear_bias=b64, return_entropy=True, **kw)
            o = lp + 0.5 * ent
            return o, (o * up[i:i + o.shape[0]].to(o.dtype)).sum()
    else:
        kw = dict(temperature=0.7)
        out = logitless.linear_logsumexp(xo, wo, linear_bias=bo, backend="triton", **kw)

        def fn(x64, w64, b64, tb, i):
            o = testing.naive_linear_logsumexp(x64, w64, linear_bias=b64, **kw)
            return o, (o * up[i:i + o.shape[0]].to(o.dtype)).sum()
    dx, dw, db = torch.autograd.grad(out, (xo, wo, bo), up.float())
    del xo, wo, bo
    rows = max(1, min(N, (1 << 27) // max(V, D)))  # 512 MiB of float32 logits per block
    blocks, dw64, db64 = _head_truth(x, w, b, None if op == "linear_logsumexp" else t, rows, fn)
    e_out, e_dx, e_tail = _Err(), _Err(), _Err()
    for sl, o64, dx64 in blocks:
        e_out.add(out[sl], o64)
        e_dx.add(dx[sl], dx64)
        if sl.stop * D > INT31:
            e_tail.add(dx[sl], dx64)
    e_dw, e_dw_tail, e_db = _Err(), _Err(), _Err()
    e_dw.add(dw, dw64)
    tail = max(0, V - (INT31 // D) - 1)
    e_dw_tail.add(dw[tail:], dw64[tail:])
    e_db.add(db, db64)
    errs = dict(out=e_out.value(), dx=e_dx.value(), dx_tail=e_tail.value() if e_tail.den else 0.0, dw=e_dw.value(),
                dw_tail=e_dw_tail.value(), db=e_db.value())
    assert errs["out"] < 1e-3 and all(v < BF16_BOUND for v in errs.values()), errs


# The 1-element and empty batches on the GPU: every op, both in place and not, under the error rule.
SMALL = [(1, 1), (1, 7), (0, 7), (0, 1)]


@pytest.mark.parametrize("n,v", SMALL)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_gpu_one_element_and_empty(n, v, dtype):
    x, w, b, t = (None if a is None else a.to(DEV) for a in make_case(dtype, n=n, d=16, v=v, bias=True,
                                                                      ignore_frac=0.0))
    from tests.helpers import check_against_truth

    for reduction in ("mean", "sum", "none"):
        check_against_truth(logitless.linear_cross_entropy, testing.naive_linear_cross_entropy, x, w, b, t,
                            backend="triton", reduction=reduction, z_loss=1e-3, label_smoothing=0.1)
    check_log_probs_entropy(x, w, b, t, backend="triton", temperature=0.7)
    check_logsumexp(x, w, b, backend="triton", softcap=5.0)
    z = (x.float() @ w.float().T).to(dtype)
    for inplace in (False, True):
        check_cross_entropy(z, t, "triton", inplace, z_loss=1e-3, label_smoothing=0.1, reduction="sum")
        check_cross_entropy(z, t, "triton", inplace, reduction="none", softcap=5.0)
