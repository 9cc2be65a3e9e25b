"""Error rule shared by every test: ours must be no worse than 2x PyTorch's own same-dtype error against float64."""

from __future__ import annotations

import torch

# One definition of the relative error for tests and the benchmark gate (which cannot import tests).
from logitless.apps.bench.check import rel_err

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def assert_within_rule(name: str, ours: torch.Tensor, torch_same_dtype: torch.Tensor, truth: torch.Tensor,
                       factor: float = 2.0, tiny: float = 1e-6) -> None:
    """err(ours) <= factor * err(PyTorch in the same dtype) + tiny, all against the float64 truth."""
    e_ours = rel_err(ours, truth)
    e_torch = rel_err(torch_same_dtype, truth)
    assert e_ours <= factor * e_torch + tiny, (
        f"{name}: our relative error {e_ours:.3e} exceeds {factor} x PyTorch's {e_torch:.3e} + {tiny:g}"
    )


def grads(out: torch.Tensor, inputs, upstream: torch.Tensor | None = None):
    """Gradients of sum(out * upstream) (or of out when it is a scalar) w.r.t. the tensors that require grad."""
    inputs = [t for t in inputs if t is not None and t.requires_grad]
    if upstream is None:
        upstream = torch.ones_like(out)
    return torch.autograd.grad(out, inputs, grad_outputs=upstream.to(device=out.device, dtype=out.dtype),
                               allow_unused=False)


N, D, V = 37, 45, 300  # odd sizes: no dimension is a multiple of a chunk or a tile


def make_case(dtype, *, n=N, d=D, v=V, bias=False, ignore_frac=0.25, scale=1.0, seed=0, lead=None):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, d, generator=g) * scale).to(dtype)
    w = (torch.randn(v, d, generator=g) / d**0.5).to(dtype)
    b = (torch.randn(v, generator=g) * 0.5).to(dtype) if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < ignore_frac] = -100
    if lead is not None:
        x, t = x.reshape(*lead, d), t.reshape(lead)
    return x, w, b, t


def leaves(*ts):
    return [None if t is None else t.detach().clone().requires_grad_(True) for t in ts]


def check_against_truth(fn_ours, fn_naive, x, w, b, t, upstream=None, backend="torch", **kw):
    """Run ours (same dtype), PyTorch (same dtype, no upcast) and float64 truth; compare value and gradients."""
    xo, wo, bo = leaves(x, w, b)
    ours = fn_ours(xo, wo, t, linear_bias=bo, backend=backend, **kw)
    xt, wt, bt = leaves(x, w, b)
    theirs = fn_naive(xt, wt, t, linear_bias=bt, upcast=False, **kw)
    x64, w64, b64 = leaves(*(None if a is None else a.double() for a in (x, w, b)))
    kw64 = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kw.items()}
    truth = fn_naive(x64, w64, t, linear_bias=b64, **kw64)
    assert ours.dtype == torch.float32 and ours.shape == truth.shape
    assert_within_rule("loss", ours, theirs, truth)
    if upstream is None and truth.dim() > 0:
        upstream = torch.randn(truth.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    names = [n for n, a in zip(("d_input", "d_weight", "d_bias"), (x, w, b), strict=True) if a is not None]
    for name, go, gt, g64 in zip(
        names,
        grads(ours, [xo, wo, bo], upstream),
        grads(theirs, [xt, wt, bt], upstream),
        grads(truth, [x64, w64, b64], upstream),
        strict=True,
    ):
        assert go.dtype == x.dtype
        assert_within_rule(name, go, gt, g64)


def check_logsumexp(x, w, b, backend="torch", **kw):
    """linear_logsumexp (ours on `backend`, PyTorch in the same dtype, float64 truth): value and the gradients of a
    random upstream, under the error rule. Returns ours."""
    from logitless import linear_logsumexp, testing

    xo, wo, bo = leaves(x, w, b)
    ours = linear_logsumexp(xo, wo, linear_bias=bo, backend=backend, **kw)
    xt, wt, bt = leaves(x, w, b)
    theirs = testing.naive_linear_logsumexp(xt, wt, linear_bias=bt, upcast=False, **kw)
    x64, w64, b64 = leaves(*(None if a is None else a.double() for a in (x, w, b)))
    truth = testing.naive_linear_logsumexp(x64, w64, linear_bias=b64, **kw)
    assert ours.dtype == torch.float32 and ours.shape == truth.shape
    assert_within_rule("logsumexp", ours, theirs, truth)
    up = torch.randn(truth.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64).to(x.device)
    names = [n for n, a in zip(("d_input", "d_weight", "d_bias"), (x, w, b), strict=True) if a is not None]
    for name, go, gt, g64 in zip(names, grads(ours, [xo, wo, bo], up), grads(theirs, [xt, wt, bt], up),
                                 grads(truth, [x64, w64, b64], up), strict=True):
        assert_within_rule(name, go, gt, g64)
    return ours


def check_log_probs_entropy(x, w, b, t, backend="torch", **kw):
    """linear_log_probs with the entropy (ours on `backend`, PyTorch in the same dtype, float64 truth): values and
    the gradients of a random mix of both outputs, under the error rule. Returns (log_probs, entropy)."""
    from logitless import linear_log_probs, testing

    def run(xs, ours, upcast=True):
        xo, wo, bo = leaves(*xs)
        if ours:
            out = linear_log_probs(xo, wo, t, linear_bias=bo, return_entropy=True, backend=backend, **kw)
        else:
            out = testing.naive_linear_log_probs(xo, wo, t, linear_bias=bo, upcast=upcast, return_entropy=True,
                                                   **kw)
        return out, [xo, wo, bo]

    (lp, ent), ins = run((x, w, b), True)
    (lp_t, ent_t), ins_t = run((x, w, b), False, upcast=False)
    (lp_64, ent_64), ins_64 = run(tuple(None if a is None else a.double() for a in (x, w, b)), False)
    assert lp.dtype == ent.dtype == torch.float32
    assert_within_rule("log_probs", lp, lp_t, lp_64)
    assert_within_rule("entropy", ent, ent_t, ent_64)
    assert (lp[t == -100] == 0).all() and (ent[t == -100] == 0).all()
    # RL losses backpropagate through both outputs: random upstream gradients for each.
    gen = torch.Generator().manual_seed(3)
    g_lp = torch.randn(lp.shape, generator=gen).to(lp.device)
    g_ent = torch.randn(lp.shape, generator=gen).to(lp.device)

    def total(lp, ent):
        return (lp * g_lp.to(lp.dtype)).sum() + (ent * g_ent.to(ent.dtype)).sum()

    names = [n for n, a in zip(("d_input", "d_weight", "d_bias"), (x, w, b), strict=True) if a is not None]
    for name, go, gt, g64 in zip(names, grads(total(lp, ent), ins), grads(total(lp_t, ent_t), ins_t),
                                 grads(total(lp_64, ent_64), ins_64), strict=True):
        assert_within_rule(name, go, gt, g64)
    return lp, ent


def check_cross_entropy(z, t, backend="torch", inplace=False, upstream_seed=1, **kw):
    """cross_entropy on logits (ours on `backend`, PyTorch in z's dtype, float64 truth): loss and d(logits) under
    a random upstream gradient, within the error rule. Returns our gradient."""
    from logitless import cross_entropy, testing

    zo = z.clone().requires_grad_(True)
    ours = cross_entropy(zo, t, backend=backend, inplace_backward=inplace, **kw)
    zt = z.clone().requires_grad_(True)
    theirs = testing.naive_cross_entropy(zt, t, upcast=False, **kw)
    z64 = z.double().requires_grad_(True)
    kw64 = {k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    truth = testing.naive_cross_entropy(z64, t, **kw64)
    assert ours.dtype == torch.float32 and ours.shape == truth.shape
    assert_within_rule("loss", ours, theirs, truth)
    up = torch.randn(truth.shape, generator=torch.Generator().manual_seed(upstream_seed), dtype=torch.float64)
    up = up.to(z.device)
    (go,) = torch.autograd.grad(ours, zo, up.float())
    (gt,) = torch.autograd.grad(theirs, zt, up.to(theirs.dtype))
    (g64,) = torch.autograd.grad(truth, z64, up)
    assert go.dtype == z.dtype
    assert_within_rule("d_logits", go, gt, g64)
    if inplace:
        assert go.data_ptr() == zo.data_ptr()  # the gradient lives in the logits buffer
    return go


def assert_compiled_matches_eager(loss_fn, x, w, b, t, compile_backend="inductor"):
    """torch.compile(fullgraph=True) of loss_fn(x, w, b, t) gives the eager loss and gradients."""
    compiled = torch.compile(loss_fn, fullgraph=True, backend=compile_backend)
    xo, wo, bo = leaves(x, w, b)
    xc, wc, bc = leaves(x, w, b)
    eager = loss_fn(xo, wo, bo, t)
    comp = compiled(xc, wc, bc, t)
    torch.testing.assert_close(comp, eager)
    for ge, gc in zip(grads(eager, [xo, wo, bo]), grads(comp, [xc, wc, bc]), strict=True):
        torch.testing.assert_close(gc, ge)


def spy_later_grads(monkeypatch) -> list:
    """A list that gets one entry each time a fused loss leaves part of a weight's gradient to a later node
    (logitless.later_grad.LaterWeightGrad.add), until the test ends."""
    from logitless import later_grad

    left = []
    add = later_grad.LaterWeightGrad.add
    monkeypatch.setattr(later_grad.LaterWeightGrad, "add", lambda self, maker: left.append(1) or add(self, maker))
    return left
