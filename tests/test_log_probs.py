"""linear_log_probs / linear_logsumexp on the PyTorch path against float64 ground truth (the precision rule)."""

import itertools

import pytest
import torch

import logitless
from logitless import testing
from tests.helpers import DTYPES, check_log_probs_entropy, check_logsumexp, make_case

GRID = list(itertools.product((None, 4.0), (1.0, 0.6), (False, True), (False, True), DTYPES))


@pytest.mark.parametrize("softcap,temperature,bias,ignore,dtype,scale", [g + (3.0,) for g in GRID] + [
    # |z| ~ 1e4: the entropy gradient's p_j (z_j - mu) must not be formed as a difference of two large numbers.
    (None, 1.0, True, True, torch.float32, 3000.0), (None, 0.6, False, False, torch.bfloat16, 3000.0)])
def test_log_probs_and_entropy(softcap, temperature, bias, ignore, dtype, scale):
    x, w, b, t = make_case(dtype, bias=bias, ignore_frac=0.3 if ignore else 0.0, scale=scale)
    check_log_probs_entropy(x, w, b, t, softcap=softcap, temperature=temperature)


@pytest.mark.parametrize("softcap,temperature,bias,dtype", list(itertools.product(
    (None, 4.0), (1.0, 1.7), (False, True), DTYPES)))
def test_logsumexp(softcap, temperature, bias, dtype):
    x, w, b, _ = make_case(dtype, bias=bias, scale=3.0)
    check_logsumexp(x, w, b, softcap=softcap, temperature=temperature)


def test_log_probs_shapes_and_return_type():
    x, w, b, t = make_case(torch.float32, n=2 * 5, lead=(2, 5))
    lp = logitless.linear_log_probs(x, w, t)
    assert isinstance(lp, torch.Tensor) and lp.shape == (2, 5)
    lp2, ent = logitless.linear_log_probs(x, w, t, return_entropy=True)
    torch.testing.assert_close(lp, lp2)
    assert ent.shape == (2, 5)
    assert logitless.linear_logsumexp(x, w).shape == (2, 5)


def test_log_probs_extreme_logits_and_no_grad():
    x, w, b, t = make_case(torch.float32, scale=3000.0, ignore_frac=0.0)
    with torch.no_grad():
        lp, ent = logitless.linear_log_probs(x, w, t, return_entropy=True)
    z = (x.double() @ w.double().T).log_softmax(-1)
    torch.testing.assert_close(lp.double(), z.gather(1, t[:, None])[:, 0], rtol=1e-5, atol=1e-2)
    assert torch.isfinite(ent).all() and (ent >= -1e-3).all()


def test_log_probs_leading_dims_int32():
    x, w, b, t = make_case(torch.bfloat16, n=3 * 7, lead=(3, 7))
    a = logitless.linear_log_probs(x, w, t.to(torch.int32))
    r = testing.naive_linear_log_probs(x.double(), w.double(), t)
    torch.testing.assert_close(a.double(), r, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ("torch", "triton"))
def test_strided_target_and_bias(backend):
    # labels[:, 0] and a column of a table are strided views: the kernels must not read them with unit stride.
    x, w, b, t = make_case(torch.float32, bias=True)
    t_strided = torch.stack([t, torch.zeros_like(t)], dim=1)[:, 0]
    b_strided = torch.stack([b, torch.zeros_like(b)], dim=1)[:, 0]
    assert t_strided.stride() == (2,) and b_strided.stride() == (2,)
    want = logitless.linear_log_probs(x.double(), w.double(), t, linear_bias=b.double(), backend="torch")
    got = logitless.linear_log_probs(x, w, t_strided, linear_bias=b_strided, backend=backend)
    assert torch.allclose(got.double(), want, atol=1e-5)
    bo = b_strided.clone().requires_grad_(True)  # gradient of a strided bias: right values, right shape
    loss = logitless.linear_cross_entropy(x, w, t_strided, linear_bias=bo, backend=backend)
    b64 = b.double().requires_grad_(True)
    ref = torch.nn.functional.cross_entropy(torch.nn.functional.linear(x.double(), w.double(), b64), t)
    assert torch.allclose(loss.double(), ref, atol=1e-5)
    (gb,) = torch.autograd.grad(loss, bo)
    (gb64,) = torch.autograd.grad(ref, b64)
    assert torch.allclose(gb.double(), gb64, atol=1e-6)


@pytest.mark.parametrize("backend", ("torch", "triton"))
def test_entropy_with_masked_classes(backend):
    # A -inf bias masks classes out of the vocabulary: p = 0 there, and 0 * (z - m) = 0 * -inf must not turn the
    # entropy or its gradient into NaN. Truth: the same head without the masked classes.
    x, w, _, t = make_case(torch.float32, ignore_frac=0.0)
    V = w.shape[0]
    b = torch.zeros(V)
    b[-7:] = float("-inf")
    t = t.clamp(max=V - 8)
    xo, wo = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    logp, ent = logitless.linear_log_probs(xo, wo, t, linear_bias=b, return_entropy=True, backend=backend)
    (logp.sum() + 0.5 * ent.sum()).backward()
    x64, w64 = x.double().requires_grad_(True), w.double().requires_grad_(True)
    lp64, ent64 = testing.naive_linear_log_probs(x64, w64[:-7], t, return_entropy=True)
    (lp64.sum() + 0.5 * ent64.sum()).backward()
    for name, got, want in (("log p", logp, lp64), ("entropy", ent, ent64), ("d_input", xo.grad, x64.grad),
                            ("d_weight", wo.grad, w64.grad)):
        assert torch.isfinite(got).all(), name
        assert torch.allclose(got.double(), want, atol=2e-5), name
