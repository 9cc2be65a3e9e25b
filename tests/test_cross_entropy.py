"""cross_entropy on existing logits, PyTorch path, against float64 ground truth (the precision rule)."""

import itertools

import pytest
import torch
import torch.nn.functional as F

import logitless
from tests.helpers import DTYPES, check_cross_entropy

N, V = 37, 5003  # V spans two vocabulary chunks with a ragged tail

GRID = list(itertools.product(("mean", "sum", "none"), (0.0, 0.3), (0.0, 0.1), (0.0, 1e-3), (None, 5.0), (False, True),
                              DTYPES))


def make_logits(dtype, scale=3.0, ignore_frac=0.25, seed=0, n=N, v=V):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(n, v, generator=g) * scale).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < ignore_frac] = -100
    return z, t


@pytest.mark.parametrize("reduction,ignore_frac,smoothing,z_loss,softcap,class_w,dtype", GRID)
def test_option_grid(reduction, ignore_frac, smoothing, z_loss, softcap, class_w, dtype):
    z, t = make_logits(dtype, ignore_frac=ignore_frac)
    cw = torch.rand(V, generator=torch.Generator().manual_seed(2)) + 0.5 if class_w else None
    check_cross_entropy(z, t, weight=cw, reduction=reduction, label_smoothing=smoothing, z_loss=z_loss, softcap=softcap)


@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_logits(dtype):
    z, t = make_logits(dtype, scale=1e4)
    check_cross_entropy(z, t, label_smoothing=0.1, z_loss=1e-8)


def test_leading_dims_and_module():
    z, t = make_logits(torch.float32, n=2 * 9)
    z3, t3 = z.reshape(2, 9, V), t.reshape(2, 9).to(torch.int32)
    out = logitless.cross_entropy(z3, t3, reduction="none")
    assert out.shape == (2, 9)
    torch.testing.assert_close(out, F.cross_entropy(z, t, reduction="none").reshape(2, 9))
    torch.testing.assert_close(logitless.CrossEntropyLoss(label_smoothing=0.2)(z, t),
                               F.cross_entropy(z, t, label_smoothing=0.2))


def test_all_ignored_and_empty():
    z, t = make_logits(torch.float32)
    for zz, tt in ((z, torch.full_like(t, -100)), (z[:0], t[:0])):
        for red in ("mean", "sum", "none"):
            torch.testing.assert_close(logitless.cross_entropy(zz, tt, reduction=red),
                                       F.cross_entropy(zz, tt, reduction=red), equal_nan=True)


@pytest.mark.parametrize("backend", ("torch", "triton"))
def test_inplace_leaves_logits_alone_without_grad_mode(backend):
    # Under torch.no_grad no backward can run, so nothing may be overwritten (on either path).
    z, t = make_logits(torch.float32, n=6, v=33)
    a = z.clone().requires_grad_(True)
    with torch.no_grad():
        loss = logitless.cross_entropy(a, t, inplace_backward=True, backend=backend)
    assert torch.equal(a.detach(), z)
    assert torch.allclose(loss, F.cross_entropy(z.double(), t).float())


@pytest.mark.parametrize("backend", ("torch", "triton"))
def test_inplace_transposed_logits_are_copied(backend):
    # Logits strided along the classes are copied first; the copy takes the gradient, the caller's tensor keeps
    # its logits (README), and the gradient is right.
    z, t = make_logits(torch.float32, n=6, v=33)
    base = z.t().contiguous().t().requires_grad_(True)
    assert base.stride(1) != 1
    logitless.cross_entropy(base, t, inplace_backward=True, backend=backend).backward()
    assert torch.equal(base.detach(), z)
    z64 = z.double().requires_grad_(True)
    F.cross_entropy(z64, t).backward()
    assert torch.allclose(base.grad.double(), z64.grad, atol=1e-6)
