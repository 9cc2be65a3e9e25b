"""The cases of the peers' own test suites, rewritten to call logitless where the semantics match.

- PyTorch: the OpInfo samples of F.linear_cross_entropy and F.cross_entropy (imported from torch's test utilities,
  so new samples arrive with new PyTorch releases);
- Liger-Kernel: its fused linear cross-entropy and cross-entropy tests (options, z-loss with return_z_loss, class
  weights, ignore_index inside the vocabulary, softcap, autocast, a loss that is not the last layer);
- Cut Cross-Entropy: its forward and backward tests (the shift option, 3-D inputs, bias, softcap, partial gradients).

Every comparison uses this project's rule (err(ours) <= 2 x err(PyTorch in the same dtype) against float64), not
the peers' tolerances. Where a peer's semantics differ, the test either converts (shown in the code) or checks that
logitless refuses the input clearly; docs/peers.md lists every difference.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.nn.functional as F

import logitless
from tests.helpers import assert_within_rule

BACKENDS = ("torch", "triton")


def _both(cases, on_triton):
    """pytest params (backend, *case): every case on the PyTorch path, and those `on_triton(case)` picks through
    the Triton kernels too (the interpreter costs seconds per case on CPU: a covering subset, every option value at
    least once)."""
    cases = [c if isinstance(c, tuple) else (c,) for c in cases]
    return ([pytest.param("torch", *c, id=f"torch-{i}") for i, c in enumerate(cases)]
            + [pytest.param("triton", *c, id=f"triton-{i}") for i, c in enumerate(cases) if on_triton(c)])


def _leaves(*ts):
    return [None if t is None else t.detach().clone().requires_grad_(True) for t in ts]


def _grads(out, inputs, upstream=None):
    inputs = [t for t in inputs if t is not None and t.requires_grad]
    if upstream is None:
        upstream = torch.ones_like(out)
    return torch.autograd.grad(out, inputs, upstream.to(out.dtype))


def _rule_with_grads(name, run, tensors, n_diff=None, upstream_seed=0, grads=True):
    """run(*tensors, kind) -> output, kind "ours" or "torch". Ours, PyTorch in the tensors' dtype, and PyTorch in
    float64: the output and (grads=True) the gradient of each of the first n_diff tensors (all by default; None
    entries skipped) under the error rule, for a random upstream gradient."""
    n_diff = len(tensors) if n_diff is None else n_diff
    float_idx = [i for i, t in enumerate(tensors) if t is not None and t.is_floating_point()]
    diff_idx = [i for i in float_idx if i < n_diff] if grads else []

    def call(kind, cast):
        ts = [None if t is None else (cast(t) if i in float_idx else t) for i, t in enumerate(tensors)]
        leaves = [t.detach().clone().requires_grad_(True) if i in diff_idx else t for i, t in enumerate(ts)]
        out = run(*leaves, kind)
        return out, [leaves[i] for i in diff_idx]

    ours, l_o = call("ours", lambda t: t)
    theirs, l_t = call("torch", lambda t: t)
    truth, l_64 = call("torch", lambda t: t.double())
    assert_within_rule(f"{name}: value", ours, theirs, truth)
    if not diff_idx:
        return
    up = torch.randn(truth.shape, generator=torch.Generator().manual_seed(upstream_seed), dtype=torch.float64)
    for i, go, gt, g64 in zip(diff_idx, _grads(ours, l_o, up), _grads(theirs, l_t, up), _grads(truth, l_64, up),
                              strict=True):
        assert go.dtype == tensors[i].dtype
        assert_within_rule(f"{name}: gradient of argument {i}", go, gt, g64)


# ---------------------------------------------------------------------------------------------------------------
# PyTorch's OpInfo samples

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _samples(name, dtype):
    """PyTorch's OpInfo sample generator `name` (its test utilities need the expecttest package: [dev] extra)."""
    cmi = pytest.importorskip("torch.testing._internal.common_methods_invocations")
    if not hasattr(cmi, name):
        pytest.skip(f"this PyTorch has no {name}")
    torch.manual_seed(0)
    random.seed(0)
    return list(getattr(cmi, name)(None, "cpu", dtype, requires_grad=False))


@pytest.mark.parametrize("backend,dtype", _both(DTYPES, lambda c: c[0] == torch.float32))
def test_pytorch_linear_cross_entropy_samples(backend, dtype):
    compared = refused = 0
    for s in _samples("sample_inputs_linear_cross_entropy", dtype):
        w, t = s.args
        kw = dict(s.kwargs)
        if w.dim() != 2:
            # K-dimensional losses from an N-d weight: not supported (docs/peers.md)
            with pytest.raises(ValueError, match="linear_weight must be 2-D"):
                logitless.linear_cross_entropy(s.input, w, t, backend=backend, **kw)
            refused += 1
            continue
        if t.is_floating_point():
            # class probabilities as targets: not supported
            with pytest.raises(TypeError, match="target must hold class indices"):
                logitless.linear_cross_entropy(s.input, w, t, backend=backend, **kw)
            refused += 1
            continue
        cw = kw.pop("weight", None)
        bias = kw.pop("linear_bias", None)

        def run(x, w_, b, cw_, kind, kw=kw, t=t):
            if kind == "ours":
                return logitless.linear_cross_entropy(x, w_, t, linear_bias=b, weight=cw_, backend=backend, **kw)
            return F.linear_cross_entropy(x, w_, t, linear_bias=b, weight=cw_, **kw)

        _rule_with_grads(f"sample {tuple(s.input.shape)} {s.kwargs}", run, [s.input, w, bias, cw], n_diff=3)
        compared += 1
    assert compared >= 20 and refused >= 10, (compared, refused)


@pytest.mark.parametrize("backend,dtype", _both(DTYPES, lambda c: c[0] == torch.float32))
def test_pytorch_cross_entropy_samples(backend, dtype):
    compared = refused = 0
    for s in _samples("sample_inputs_cross_entropy", dtype):
        (t,) = s.args
        kw = dict(s.kwargs)
        if t.is_floating_point():
            with pytest.raises(TypeError, match="target must hold class indices"):
                logitless.cross_entropy(s.input.movedim(1, -1), t, backend=backend, **kw)
            refused += 1
            continue
        cw = kw.pop("weight", None)

        def run(z, cw_, kind, kw=kw, t=t):
            if kind == "ours":
                # F.cross_entropy takes the classes in dimension 1, logitless in the last one.
                return logitless.cross_entropy(z.movedim(1, -1), t, weight=cw_, backend=backend, **kw)
            return F.cross_entropy(z, t, weight=cw_, **kw)

        _rule_with_grads(f"sample {tuple(s.input.shape)} {s.kwargs}", run, [s.input, cw], n_diff=1)
        compared += 1
    assert compared >= 10 and refused >= 5, (compared, refused)


# ---------------------------------------------------------------------------------------------------------------
# PyTorch's float64 gradchecks (its OpInfo samples and the ModuleInfo inputs of nn.LinearCrossEntropyLoss) through
# the default call: gradcheck takes many backwards through one kept graph, and checks undefined upstream gradients.
# Batched gradients (is_grads_batched=True, a vmap over the backward) are not supported (docs/peers.md), and
# neither is forward-mode AD: both are off here.


def _opinfos(name):
    cmi = pytest.importorskip("torch.testing._internal.common_methods_invocations")
    ops = [o for o in cmi.op_db if o.name == name]
    if not ops:
        pytest.skip(f"this PyTorch has no OpInfo for {name}")
    return ops


def _gradcheck(fn, inputs):
    assert torch.autograd.gradcheck(fn, inputs, check_batched_grad=False, check_undefined_grad=True)


def test_pytorch_linear_cross_entropy_gradchecks():
    checked = 0
    for op in _opinfos("nn.functional.linear_cross_entropy"):  # its variants: plain, chunked, chunked_none
        torch.manual_seed(0)
        for s in op.sample_inputs("cpu", torch.float64, requires_grad=True):
            w, t = s.args
            if w.dim() != 2 or t.is_floating_point():  # refused with a clear error: test_pytorch_*_samples
                continue
            kw = dict(s.kwargs)
            cw, b = kw.pop("weight", None), kw.pop("linear_bias", None)

            def fn(x, w_, *b_, t=t, kw=kw, cw=cw):
                return logitless.linear_cross_entropy(x, w_, t, linear_bias=b_[0] if b_ else None, weight=cw, **kw)

            _gradcheck(fn, [s.input, w] + ([] if b is None else [b]))
            checked += 1
    assert checked >= 80, checked


def test_pytorch_cross_entropy_gradchecks():
    checked = 0
    for op in _opinfos("nn.functional.cross_entropy"):
        torch.manual_seed(0)
        for s in op.sample_inputs("cpu", torch.float64, requires_grad=True):
            (t,) = s.args
            if t.is_floating_point():
                continue
            kw = dict(s.kwargs)
            cw = kw.pop("weight", None)

            def fn(z, t=t, kw=kw, cw=cw):  # logitless takes the classes in the last dimension
                return logitless.cross_entropy(z.movedim(1, -1) if z.dim() > 1 else z, t, weight=cw, **kw)

            _gradcheck(fn, [s.input])
            checked += 1
    assert checked >= 10, checked


def test_pytorch_linear_cross_entropy_module_gradchecks():
    cm = pytest.importorskip("torch.testing._internal.common_modules")
    infos = [m for m in cm.module_db if m.module_cls.__name__ == "LinearCrossEntropyLoss"]
    if not infos:
        pytest.skip("this PyTorch has no ModuleInfo for LinearCrossEntropyLoss")
    info, checked = infos[0], 0
    torch.manual_seed(0)
    for mi in info.module_inputs_func(info, "cpu", torch.float64, True, True):
        ck = mi.constructor_input.kwargs
        x, t = mi.forward_input.args
        if ck.get("out_features", ()) != () or t.is_floating_point():  # K-dimensional / probability targets
            continue
        module = info.module_cls(*mi.constructor_input.args, **ck)
        params = list(module.parameters())  # the weight, then the bias if any
        kw = dict(reduction=ck.get("reduction", "mean"), label_smoothing=ck.get("label_smoothing", 0.0),
                  weight=ck.get("weight"))
        if ck.get("ignore_index") is not None:
            kw["ignore_index"] = ck["ignore_index"]

        def fn(x_, w_, *b_, t=t, kw=kw):
            return logitless.linear_cross_entropy(x_, w_, t, linear_bias=b_[0] if b_ else None, **kw)

        with torch.no_grad():
            want = module(x, t)
            got = fn(x, *params)
        torch.testing.assert_close(got, want)
        _gradcheck(fn, [x, *params])
        checked += 1
    assert checked >= 200, checked


# ---------------------------------------------------------------------------------------------------------------
# Liger-Kernel: fused linear cross-entropy and cross-entropy


def _liger_z_loss(lse, valid, z, reduction):
    """Liger's z-loss term: z * lse^2 on non-ignored rows, divided by their number for "mean" (not by the class
    weights' sum, which logitless's mean divides its whole loss by)."""
    zl = torch.where(valid, z * lse * lse, 0.0)
    if reduction == "mean":
        return zl.sum() / valid.sum()
    return zl.sum() if reduction == "sum" else zl


def _liger_head_torch(x, w, b, t, cw, ignore_index, z, ls, reduction, softcap):
    """Liger's reference semantics in PyTorch ops, in the dtype of x: (total loss, z-loss term)."""
    return _liger_ce_torch(F.linear(x, w, b), t, cw, ignore_index, ls, z, reduction, softcap)


def _liger_head_ours(x, w, b, t, cw, ignore_index, z, ls, reduction, softcap, backend):
    """The same loss through logitless: its z-loss divides like the cross-entropy term, so with class weights and
    "mean" Liger's z-loss term is added from linear_logsumexp instead (without class weights, z_loss= gives it)."""
    kw = dict(linear_bias=b, weight=cw, ignore_index=ignore_index, label_smoothing=ls, reduction=reduction,
              softcap=softcap, backend=backend)
    ce = logitless.linear_cross_entropy(x, w, t, **kw)
    lse = logitless.linear_logsumexp(x, w, linear_bias=b, softcap=softcap, backend=backend)
    zl = _liger_z_loss(lse, t != ignore_index, z, reduction)
    if cw is None:
        direct = logitless.linear_cross_entropy(x, w, t, z_loss=z, **kw)
        torch.testing.assert_close(direct, ce + zl, rtol=1e-5, atol=1e-6)
    return ce + zl, zl


def _liger_targets(n, v, ignore_index, gen):
    t = torch.randint(0, v, (n,), generator=gen)
    k = int(torch.randint(1, n // 2, (1,), generator=gen))
    t[torch.randperm(n, generator=gen)[:k]] = ignore_index
    return t


# (has_ce_weight, label_smoothing, ignore_index, z-loss, softcap): Liger's two option sets
LIGER_OPTIONS = [(False, 0.0, -100, 0.0, None), (True, 0.1, 42, 1e-4, 30.0)]


LIGER_FLCE_CASES = list(itertools.product(("mean", "sum", "none"), (torch.bfloat16, torch.float32), (True, False),
                                         LIGER_OPTIONS))
LIGER_FLCE_TRITON = {("mean", torch.bfloat16, True, LIGER_OPTIONS[1]), ("sum", torch.float32, False, LIGER_OPTIONS[0]),
                     ("none", torch.bfloat16, False, LIGER_OPTIONS[1]), ("none", torch.float32, True, LIGER_OPTIONS[0])}


@pytest.mark.parametrize("backend,reduction,dtype,bias,options",
                         _both(LIGER_FLCE_CASES, lambda c: c in LIGER_FLCE_TRITON))
def test_liger_fused_linear_cross_entropy(backend, reduction, dtype, bias, options):
    # B, T, H, V = 4, 47, 31, 123 (Liger's odd shape); weights uniform in [0, 1) as Liger draws them.
    has_w, ls, ii, z, softcap = options
    gen = torch.Generator().manual_seed(0)
    n, h, v = 4 * 47, 31, 123
    x = torch.randn(n, h, generator=gen).to(dtype)
    w = torch.rand(v, h, generator=gen).to(dtype)
    b = torch.rand(v, generator=gen).to(dtype) if bias else None
    cw = torch.rand(v, generator=gen) if has_w else None
    t = _liger_targets(n, v, ii, gen)
    for part in (0, 1):  # the total loss, then the z-loss term alone (Liger's return_z_loss)
        if part == 1 and z == 0.0:
            continue

        def run(x_, w_, b_, kind, part=part):
            if kind == "ours":
                return _liger_head_ours(x_, w_, b_, t, cw, ii, z, ls, reduction, softcap, backend)[part]
            return _liger_head_torch(x_, w_, b_, t, cw, ii, z, ls, reduction, softcap)[part]

        _rule_with_grads(f"part {part}", run, [x, w, b])


@pytest.mark.parametrize("backend", BACKENDS)
def test_liger_fused_linear_autocast(backend):
    # Liger's amp test runs float32 inputs under autocast. logitless is no autocast op: it computes in the inputs'
    # dtypes (float32 here) whatever autocast says, so the result is the one without autocast, bit for bit.
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(94, 31, generator=gen), torch.rand(123, 31, generator=gen)
    t = torch.randint(0, 123, (94,), generator=gen)
    want = logitless.linear_cross_entropy(x, w, t, backend=backend)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = logitless.linear_cross_entropy(x, w, t, backend=backend)
    assert got.dtype == torch.float32 and torch.equal(got, want)


def _liger_ce_torch(z, t, cw, ignore_index, ls, zl, reduction, softcap):
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    ce = F.cross_entropy(z, t, weight=None if cw is None else cw.to(z.dtype), ignore_index=ignore_index,
                         label_smoothing=ls, reduction=reduction)
    zterm = _liger_z_loss(torch.logsumexp(z, -1), t != ignore_index, zl, reduction)
    return ce + zterm, zterm


def _liger_ce_ours(z, t, cw, ignore_index, ls, zl, reduction, softcap, backend):
    """Liger's (total, z-loss term) through logitless. Without class weights z_loss= is Liger's total; with them
    (and "mean") the z-loss term divides by the number of tokens, not the weights' sum: the term is then added from
    the logits' log-sum-exp in PyTorch ops. The z-loss term alone comes from the (non-differentiable) returned lse,
    as Liger's return_z_loss value."""
    kw = dict(weight=cw, ignore_index=ignore_index, label_smoothing=ls, reduction=reduction, softcap=softcap,
              backend=backend)
    ce, lse = logitless.cross_entropy(z, t, return_lse=True, **kw)
    zterm = _liger_z_loss(lse, t != ignore_index, zl, reduction)
    if cw is None:
        return logitless.cross_entropy(z, t, z_loss=zl, **kw), zterm
    capped = z.float() if softcap is None else softcap * torch.tanh(z.float() / softcap)
    return ce + _liger_z_loss(torch.logsumexp(capped, -1), t != ignore_index, zl, reduction), zterm


# (reduction, scale, ignore_index, label_smoothing, z-loss, softcap, class weights): Liger's cases, one per line
LIGER_CE_CASES = [
    ("mean", 1.0, -100, 0.0, 0.0, None, False),  # plain
    ("sum", 10.0, -100, 0.0, 0.0, None, False),
    ("none", 0.1, -100, 0.0, 0.0, None, False),
    ("mean", 1.0, 2, 0.0, 0.0, None, False),  # ignore_index inside the vocabulary
    ("sum", 1.0, 42, 0.0, 0.0, None, False),
    ("mean", 1.0, -100, 0.1, 0.0, None, False),  # label smoothing, then with ignore_index
    ("mean", 1.0, 42, 0.1, 0.0, None, False),
    ("none", 1.0, -100, 0.0, 0.0, 30.0, False),  # softcap
    ("mean", 1.0, -100, 0.0, 1e-4, None, False),  # z-loss (and return_z_loss), then with the other options
    ("sum", 1.0, 42, 0.1, 1e-4, None, False),
    ("none", 1.0, 42, 0.1, 1e-4, None, False),
    ("mean", 1.0, -100, 0.0, 0.0, None, True),  # class weights, then with every other option
    ("sum", 1.0, -100, 0.0, 0.0, None, True),
    ("mean", 1.0, 42, 0.1, 1e-4, 30.0, True),
    ("none", 1.0, 42, 0.1, 1e-4, 30.0, True),
]


# Through the Triton kernels: plain, ignore_index inside the vocabulary, smoothing, softcap, z-loss (alone and with
# everything), class weights (alone and with everything), in alternating dtypes.
LIGER_CE_TRITON = {0, 3, 5, 7, 8, 10, 11, 14}


@pytest.mark.parametrize("backend,dtype,case", _both(
    [(dt, c) for i, c in enumerate(LIGER_CE_CASES) for dt in (torch.bfloat16, torch.float32)],
    lambda c: LIGER_CE_CASES.index(c[1]) in LIGER_CE_TRITON
    and c[0] == (torch.bfloat16, torch.float32)[LIGER_CE_CASES.index(c[1]) % 2]))
def test_liger_cross_entropy(backend, dtype, case):
    reduction, scale, ii, ls, zl, softcap, has_w = case
    gen = torch.Generator().manual_seed(2)
    n, v = 3 * 47, 1023  # Liger's (3, 423, 32000), smaller for the interpreter; odd sizes
    z = (torch.randn(n, v, generator=gen) * scale).to(dtype)
    cw = torch.rand(v, generator=gen) if has_w else None
    t = _liger_targets(n, v, ii, gen)
    for part in (0, 1) if zl else (0,):
        def run(z_, kind, part=part):
            if kind == "ours":
                return _liger_ce_ours(z_, t, cw, ii, ls, zl, reduction, softcap, backend)[part]
            return _liger_ce_torch(z_, t, cw, ii, ls, zl, reduction, softcap)[part]

        _rule_with_grads(f"part {part}", run, [z], grads=part == 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_liger_cross_entropy_not_last_layer_and_out_of_bounds(backend):
    gen = torch.Generator().manual_seed(3)
    z, t = torch.randn(94, 257, generator=gen), torch.randint(0, 257, (94,), generator=gen)
    # the loss is not the last op (loss * 3): the upstream gradient is 3
    _rule_with_grads("loss * 3", lambda z_, kind: 3 * (logitless.cross_entropy(z_, t, backend=backend)
                                                        if kind == "ours" else F.cross_entropy(z_, t)), [z])
    # targets outside [0, V) that are not ignore_index: a clear error (Liger: "out of bounds")
    t[::3] = torch.randint(257, 514, (32,), generator=gen)
    with pytest.raises(ValueError, match=r"outside \[0, 257\)"):
        logitless.cross_entropy(z.bfloat16(), t, backend=backend)


# ---------------------------------------------------------------------------------------------------------------
# Cut Cross-Entropy: forward and backward tests


def _cce_inputs(shape, dtype, bias, invalids, seed=0):
    """CCE's inputs: e ~ N(0, 1/D), c ~ N(0, 1) with its first rows copied from e (large logits), a small bias,
    20% ignored targets, e viewed as (4, N/4, D)."""
    n, v, d = shape
    gen = torch.Generator().manual_seed(seed)
    e = torch.randn(n, d, generator=gen) / d**0.5
    c = torch.randn(v, d, generator=gen)
    c[: min(n, v) // 2] = e[: min(n, v) // 2]
    b = torch.randn(v, generator=gen) * 0.02 if bias else None
    t = torch.randint(0, v, (n,), generator=gen)
    if invalids:
        t[torch.randperm(n, generator=gen)[: int(0.2 * n)]] = -100
    e, t = e.view(4, -1, d), t.view(4, -1)
    return e.to(dtype), c.to(dtype), None if b is None else b.to(dtype), t


def _cce_shifted(e, t, shift):
    """CCE's shift=k (predict the token k ahead): the same loss as logitless on e[:, :-k] against t[:, k:]."""
    return (e[:, :-shift], t[:, shift:]) if shift else (e, t)


# (shape, dtype, softcap, bias, shift, invalids, reduction): a covering subset of CCE's grid, every value of each
# parameter at least twice, the odd shape (252, 507, 123) on both backends.
CCE_CASES = [
    ((256, 512, 128), torch.float32, None, False, 0, False, "none"),
    ((252, 507, 128), torch.float16, 20.0, True, 2, True, "mean"),
    ((252, 507, 123), torch.bfloat16, None, True, 1, True, "sum"),
    ((252, 507, 123), torch.float32, 20.0, False, 2, True, "none"),
    ((256, 512, 128), torch.bfloat16, 20.0, True, 0, True, "mean"),
    ((252, 507, 123), torch.float16, None, False, 1, False, "sum"),
]


@pytest.mark.parametrize("backend,case", _both([(c,) for c in CCE_CASES], lambda c: CCE_CASES.index(c[0]) in (2, 3)))
def test_cce_forward_backward(backend, case):
    shape, dtype, softcap, bias, shift, invalids, reduction = case
    e, c, b, t = _cce_inputs(shape, dtype, bias, invalids)

    def run(e_, c_, b_, kind):
        es, ts = _cce_shifted(e_, t, shift)
        if kind == "ours":
            return logitless.linear_cross_entropy(es, c_, ts, linear_bias=b_, softcap=softcap, reduction=reduction,
                                                  backend=backend)
        z = F.linear(es, c_, b_)
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        out = F.cross_entropy(z.flatten(0, -2), ts.flatten(), reduction=reduction)
        return out.view(ts.shape) if reduction == "none" else out

    _rule_with_grads("cce", run, [e, c, b])


@pytest.mark.parametrize("backend,wanted", _both([((True, False, True),), ((False, True, False),),
                                                  ((False, False, True),)], lambda c: c[0] == (True, False, True)))
def test_cce_partial_gradients(backend, wanted):
    # Only the tensors that require grad get a gradient (CCE's test_loss_partials).
    e, c, b, t = _cce_inputs((256, 512, 128), torch.bfloat16, True, False)
    for tensor, want in zip((e, c, b), wanted, strict=True):
        tensor.requires_grad_(want)
    logitless.linear_cross_entropy(e, c, t, linear_bias=b, backend=backend).backward()
    assert tuple(x.grad is not None for x in (e, c, b)) == wanted
