"""The PyTorch path's fused training path of linear_cross_entropy (torch_backend.fused_cross_entropy): where
it applies, the precision rule with every option, the upstream gradient, a second backward, its memory; and the
generic path where it does not apply (no gradient, reduction="none", a budget too small)."""

import functools

import pytest
import torch
import torch.nn.functional as F

import logitless
from logitless import loss_math, testing, torch_backend
from logitless.apps.bench.measure import _cpu_peak
from tests.helpers import V, assert_within_rule, check_against_truth, grads, leaves, make_case, spy_later_grads

lce = functools.partial(logitless.linear_cross_entropy, backend="torch")


def _fused(loss) -> bool:
    return type(loss.grad_fn).__name__.startswith("_FusedCrossEntropy")


@pytest.fixture
def small_budget(monkeypatch):
    """A policy floor of 128 KiB: the fused path's chunks hold 81 rows at V = 300 (40 with the softcap; a quarter of
    the budget is left to the products), several at N = 160."""
    monkeypatch.setattr(loss_math, "POLICY_MIN_BYTES", 128 << 10)


OPTIONS = [dict(), dict(label_smoothing=0.1), dict(z_loss=1e-3), dict(softcap=5.0), dict(weight=True),
           dict(weight=True, label_smoothing=0.2, z_loss=1e-3, softcap=3.0), dict(label_smoothing=1.0)]


@pytest.mark.parametrize("chunked", (False, True))
@pytest.mark.parametrize("bias", (False, True))
@pytest.mark.parametrize("reduction", ("mean", "sum"))
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(o) or "plain")
def test_fused_path_options(opts, reduction, bias, chunked, monkeypatch):
    if chunked:
        monkeypatch.setattr(loss_math, "POLICY_MIN_BYTES", 128 << 10)
    n = 160 if chunked else 37
    x, w, b, t = make_case(torch.float32, n=n, bias=bias, ignore_frac=0.3, scale=3.0)
    rows = torch_backend.fused_rows(x.requires_grad_(True), w, b, opts.get("softcap"), reduction)
    x = x.detach()
    assert (rows < n) == chunked and rows >= 1
    kw = dict(opts, reduction=reduction)
    if kw.pop("weight", False):
        kw["weight"] = torch.rand(V, generator=torch.Generator().manual_seed(2)) + 0.5
    xo, wo = leaves(x, w)
    assert _fused(lce(xo, wo, t, **kw))
    # the precision rule, loss and every gradient, with an upstream gradient other than 1
    check_against_truth(logitless.linear_cross_entropy, testing.naive_linear_cross_entropy, x, w, b, t,
                        upstream=torch.tensor(-2.5, dtype=torch.float64), **kw)


@pytest.mark.parametrize("dtype", (torch.float64, torch.bfloat16, torch.float16))
def test_fused_path_other_dtypes(dtype):
    # float64 accumulates in float64; bfloat16 / float16 in float32 (the accumulators fit the budget at this size).
    x, w, b, t = make_case(dtype, bias=True, scale=2.0)
    xo, wo, bo = leaves(x, w, b)
    loss = lce(xo, wo, t, linear_bias=bo, label_smoothing=0.1)
    assert _fused(loss)
    loss.backward()
    assert xo.grad.dtype == wo.grad.dtype == bo.grad.dtype == dtype
    if dtype == torch.float64:  # against float64 PyTorch (check_against_truth's rule is for the other dtypes)
        xr, wr, br = leaves(x, w, b)
        ref = F.cross_entropy(F.linear(xr, wr, br), t, label_smoothing=0.1)
        ref.backward()
        torch.testing.assert_close(loss, ref, rtol=1e-12, atol=0)
        for ours, theirs in ((xo, xr), (wo, wr), (bo, br)):
            torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-10, atol=1e-14)
        return
    check_against_truth(logitless.linear_cross_entropy, testing.naive_linear_cross_entropy, x, w, b, t,
                        label_smoothing=0.1, z_loss=1e-4, softcap=4.0)


def test_half_precision_head_too_large_for_the_budget_keeps_the_generic_path(small_budget):
    # bf16: W and its gradient in float32 (2 x 4 V D = 108 KB here) do not fit 128 KiB
    x, w, b, t = make_case(torch.bfloat16, n=160)
    xo, wo = leaves(x, w)
    assert not _fused(lce(xo, wo, t))
    check_against_truth(logitless.linear_cross_entropy, testing.naive_linear_cross_entropy, x, w, b, t,
                        label_smoothing=0.1)


@pytest.mark.parametrize("which", ("x", "w", "b", "xw", "xwb"))
def test_fused_path_gradients_to_some_inputs(which, small_budget):
    x, w, b, t = make_case(torch.float32, n=160, bias=True, scale=2.0)
    ins = dict(zip("xwb", (x, w, b), strict=True))
    ours = {k: v.clone().requires_grad_(k in which) for k, v in ins.items()}
    ref = {k: v.double().requires_grad_(k in which) for k, v in ins.items()}
    loss = lce(ours["x"], ours["w"], t, linear_bias=ours["b"], label_smoothing=0.1, z_loss=1e-3)
    assert _fused(loss)
    (3.0 * loss).backward()
    truth = F.cross_entropy(F.linear(ref["x"], ref["w"], ref["b"]), t, label_smoothing=0.1)
    truth = truth + 1e-3 * (torch.logsumexp(F.linear(ref["x"], ref["w"], ref["b"]), 1)[t != -100] ** 2).sum() / (
        (t != -100).sum())
    (3.0 * truth).backward()
    for k in "xwb":
        if k in which:
            torch.testing.assert_close(ours[k].grad, ref[k].grad.float(), rtol=1e-4, atol=1e-6)
        else:
            assert ours[k].grad is None


@pytest.mark.parametrize("reduction", ("mean", "sum"))
def test_fused_path_all_ignored_and_one_valid_row(reduction, small_budget):
    x, w, _, t = make_case(torch.float32, n=160)
    for tt in (torch.full_like(t, -100), torch.full_like(t, -100).index_fill_(0, torch.tensor([100]), 3)):
        xo, wo = leaves(x, w)
        loss = lce(xo, wo, tt, reduction=reduction, label_smoothing=0.1)
        assert _fused(loss)
        xr, wr = leaves(x, w)
        ref = F.cross_entropy(F.linear(xr, wr), tt, reduction=reduction, label_smoothing=0.1)
        torch.testing.assert_close(loss, ref, equal_nan=True)
        loss.backward()
        ref.backward()
        torch.testing.assert_close(xo.grad, xr.grad, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(wo.grad, wr.grad, rtol=1e-5, atol=1e-7)
        assert torch.isfinite(xo.grad).all() and torch.isfinite(wo.grad).all()


def test_fused_path_gradients_accumulate_and_leading_dims():
    x, w, _, t = make_case(torch.float32, n=2 * 3 * 7, lead=(2, 3, 7))
    xo, wo = leaves(x, w)
    xr, wr = leaves(x, w)
    for _ in range(2):
        loss = lce(xo, wo, t)
        assert _fused(loss)
        loss.backward()
        F.cross_entropy(F.linear(xr, wr).flatten(0, -2), t.flatten()).backward()
    assert xo.grad.shape == x.shape
    torch.testing.assert_close(xo.grad, xr.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(wo.grad, wr.grad, rtol=1e-5, atol=1e-7)


def test_fused_path_backward_any_number_of_times():
    # PyTorch's contract: while the graph is kept, every backward gives the same gradients (fresh tensors, the
    # forward's stay unscaled); the backward that frees the graph scales in place; after it, PyTorch's own error.
    x, w, _, t = make_case(torch.float32)
    xo, wo = leaves(x, w)
    loss = lce(xo, wo, t)
    assert _fused(loss)
    grads = [torch.autograd.grad(loss * s, (xo, wo), retain_graph=True) for s in (1.0, 3.0, 1.0)]
    last = torch.autograd.grad(loss, (xo, wo))
    for a, b in zip(grads[0], grads[2], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(grads[0], last, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(3.0 * a, b)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()
    # .backward(retain_graph=True) twice accumulates twice the same gradient
    loss = lce(xo, wo, t)
    loss.backward(retain_graph=True)
    g = xo.grad.clone()
    loss.backward()
    assert torch.equal(xo.grad, g + g)


def test_fused_path_gradcheck():
    # float64 gradcheck through the default call (it takes many backwards through one kept graph)
    x, w, b, t = make_case(torch.float64, bias=True)
    x, w, b, t = x[:5], w[:11], b[:11], t[:5] % 11
    xo, wo, bo = leaves(x, w, b)
    assert _fused(lce(xo, wo, t, linear_bias=bo))
    for kw in (dict(), dict(reduction="sum", label_smoothing=0.2), dict(z_loss=1e-2, softcap=3.0)):
        assert torch.autograd.gradcheck(lambda x_, w_, b_, kw=kw: lce(x_, w_, t, linear_bias=b_, **kw), (xo, wo, bo))


def test_generic_path_where_the_fused_one_does_not_apply():
    x, w, b, t = make_case(torch.float32, bias=True)
    xo, wo, bo = leaves(x, w, b)
    fused = lce(xo, wo, t, linear_bias=bo, label_smoothing=0.1, reduction="sum")
    assert _fused(fused)
    none = lce(xo, wo, t, linear_bias=bo, label_smoothing=0.1, reduction="none")
    assert not _fused(none) and none.grad_fn is not None
    torch.testing.assert_close(none.sum(), fused)
    with torch.no_grad():
        nograd = lce(xo, wo, t, linear_bias=bo, label_smoothing=0.1, reduction="sum")
    assert nograd.grad_fn is None
    torch.testing.assert_close(nograd, fused.detach())
    # no input requires grad: the generic path (nothing to compute in the forward)
    assert not _fused(lce(x, w, t))
    # the generic path's gradients of reduction="none" agree with the fused path's
    (gx_none, gw_none) = torch.autograd.grad(none.sum(), [xo, wo])
    (gx, gw) = torch.autograd.grad(fused, [xo, wo])
    torch.testing.assert_close(gx_none, gx, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gw_none, gw, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("softcap", (None, 4.0))
def test_fused_path_peak_within_budget(softcap, monkeypatch):
    # Above the returned gradients, the fused path's peak is its block(s) and O(N) per-row values: within the budget.
    monkeypatch.setattr(loss_math, "POLICY_MIN_BYTES", 1 << 20)
    n, d, v = 300, 24, 2500
    x, w, b, t = make_case(torch.float32, n=n, d=d, v=v, bias=True)
    xo, wo, bo = leaves(x, w, b)
    assert 1 <= torch_backend.fused_rows(xo, wo, bo, softcap, "mean") < n

    def run():
        loss = lce(xo, wo, t, linear_bias=bo, softcap=softcap, label_smoothing=0.1, z_loss=1e-4)
        assert _fused(loss)
        loss.backward()

    peak, _ = _cpu_peak(run)
    extra = peak - xo.grad.nbytes - wo.grad.nbytes - bo.grad.nbytes
    assert extra <= loss_math.default_workspace_bytes(n, v) + 64 * 4 * n + (16 << 10), extra


@pytest.mark.parametrize("chunked", (False, True))
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(o) or "plain")
def test_weight_gradient_made_in_part_later(opts, chunked, monkeypatch):
    # A head tied to the input embedding on a CPU (integrations.tied): within head_grad_later the fused forward makes
    # W's gradient for the classes below later_grad.split(V) and the tied node, which runs last, makes the rest.
    # The whole gradient, and the others, within the rule; the rest was left to the node.
    from logitless.integrations import tied

    if chunked:
        monkeypatch.setattr(loss_math, "POLICY_MIN_BYTES", 128 << 10)
    n = 160 if chunked else 37
    x, w, b, t = make_case(torch.float32, n=n, bias=True, ignore_frac=0.3, scale=3.0)
    kw = dict(opts)
    if kw.pop("weight", False):
        kw["weight"] = torch.rand(V, generator=torch.Generator().manual_seed(2)) + 0.5
    left = spy_later_grads(monkeypatch)
    up = torch.tensor(-2.5, dtype=torch.float64)
    emb = torch.nn.Embedding(V, w.shape[1])
    emb.weight = torch.nn.Parameter(w.clone())
    ids = torch.randint(0, V, (5,), generator=torch.Generator().manual_seed(3))
    xo, bo = leaves(x, b)
    with tied.tied_rows(emb, emb.weight) as w_head:
        unused = emb(ids).sum() * 0.0  # the embedding's own use: a sparse gradient of zeros
    with tied.head_grad_later(w_head):
        ours = lce(xo, w_head, t, linear_bias=bo, **kw)
    assert _fused(ours)
    (ours * up.float() + unused).backward()
    assert left == [1]
    xt, wt, bt = leaves(x, w, b)
    theirs = testing.naive_linear_cross_entropy(xt, wt, t, linear_bias=bt, upcast=False, **kw)
    x64, w64, b64 = leaves(x.double(), w.double(), b.double())
    kw64 = {k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    truth = testing.naive_linear_cross_entropy(x64, w64, t, linear_bias=b64, **kw64)
    assert_within_rule("loss", ours, theirs, truth)
    for name, go, gt, g64 in zip(("d_input", "d_weight", "d_bias"), (xo.grad, emb.weight.grad, bo.grad),
                                 grads(theirs, [xt, wt, bt], up), grads(truth, [x64, w64, b64], up), strict=True):
        assert_within_rule(name, go, gt, g64)


def test_weight_gradient_in_part_later_other_backwards(monkeypatch):
    # The part left to the tied node only in a plain backward that frees the graph and runs the node: a kept graph,
    # autograd.grad of the input alone and create_graph=True make the whole gradient in the loss's own backward, the
    # same numbers.
    from logitless.integrations import tied

    left = spy_later_grads(monkeypatch)
    x, w, _, t = make_case(torch.float32, n=37, ignore_frac=0.3, scale=3.0)

    def run():
        emb = torch.nn.Embedding(V, w.shape[1])
        emb.weight = torch.nn.Parameter(w.clone())
        xo = x.clone().requires_grad_()
        with tied.tied_rows(emb, emb.weight) as w_head:
            pass
        with tied.head_grad_later(w_head):
            loss = lce(xo, w_head, t, label_smoothing=0.1)
        return xo, emb.weight, loss

    xo, wp, loss = run()
    loss.backward()
    assert left == [1]
    ref = (xo.grad.clone(), wp.grad.clone())
    xo, wp, loss = run()
    loss.backward(retain_graph=True)
    assert left == [1]  # the kept graph's backward made the whole gradient itself
    loss.backward()
    assert left == [1, 1]  # the one that frees it left the rest to the node
    torch.testing.assert_close(xo.grad, 2 * ref[0])
    torch.testing.assert_close(wp.grad, 2 * ref[1])
    xo, wp, loss = run()
    (dx,) = torch.autograd.grad(loss, xo)
    assert left == [1, 1] and wp.grad is None
    torch.testing.assert_close(dx, ref[0])
    xo, wp, loss = run()
    dx, dw = torch.autograd.grad(loss, (xo, wp), create_graph=True)
    assert left == [1, 1]
    torch.testing.assert_close(dw, ref[1])
    with pytest.raises(RuntimeError, match="not differentiable"):
        dw.sum().backward()
