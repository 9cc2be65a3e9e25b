"""linear_cross_entropy on the PyTorch path against float64 ground truth, under the precision rule (CONTRIBUTING.md)."""

import itertools

import pytest
import torch
import torch.nn.functional as F

import logitless
from logitless import testing
from tests.helpers import DTYPES, V, assert_compiled_matches_eager, check_against_truth, make_case

# reduction x ignored tokens x label smoothing x z-loss x softcap x bias x class weights x dtype
GRID = list(itertools.product(
    ("mean", "sum", "none"), (0.0, 0.3), (0.0, 0.1), (0.0, 1e-3), (None, 5.0), (False, True), (False, True), DTYPES
))


@pytest.mark.parametrize("reduction,ignore_frac,smoothing,z_loss,softcap,bias,class_w,dtype", GRID)
def test_option_grid(reduction, ignore_frac, smoothing, z_loss, softcap, bias, class_w, dtype):
    x, w, b, t = make_case(dtype, bias=bias, ignore_frac=ignore_frac, scale=3.0)
    cw = torch.rand(V, generator=torch.Generator().manual_seed(2)) + 0.5 if class_w else None
    check_against_truth(logitless.linear_cross_entropy, testing.naive_linear_cross_entropy, x, w, b, t,
                        weight=cw, reduction=reduction, label_smoothing=smoothing, z_loss=z_loss, softcap=softcap)


@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_logits(dtype):
    # Logits of magnitude ~1e4: an exp without the max shift overflows, a bad online rescale gives NaN.
    x, w, b, t = make_case(dtype, scale=3000.0, bias=True)
    check_against_truth(logitless.linear_cross_entropy, testing.naive_linear_cross_entropy, x, w, b, t,
                        label_smoothing=0.1, z_loss=1e-6)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_odd_large_vocab_single_token(dtype):
    # N = 1, D = 123, V = 50257 (GPT-2): several vocabulary chunks with a ragged last one.
    x, w, b, t = make_case(dtype, n=1, d=123, v=50257, ignore_frac=0.0, bias=True)
    check_against_truth(logitless.linear_cross_entropy, testing.naive_linear_cross_entropy, x, w, b, t,
                        reduction="mean", label_smoothing=0.05)


def test_many_token_chunks():
    # More rows than one token chunk, so the chunk loop and its bookkeeping run more than once.
    x, w, b, t = make_case(torch.float32, n=700, d=16, v=5000, bias=True)
    check_against_truth(logitless.linear_cross_entropy, testing.naive_linear_cross_entropy, x, w, b, t,
                        reduction="sum", label_smoothing=0.2, z_loss=1e-3, softcap=4.0)


def test_leading_dims_int32_noncontiguous():
    x, w, b, t = make_case(torch.float32, n=2 * 3 * 7, lead=(2, 3, 7))
    x_nc = x.transpose(0, 1)  # (3, 2, 7, D), non-contiguous
    t_nc = t.transpose(0, 1).to(torch.int32)
    check_against_truth(logitless.linear_cross_entropy, testing.naive_linear_cross_entropy, x_nc, w, b, t_nc,
                        reduction="none")
    out = logitless.linear_cross_entropy(x_nc, w, t_nc, reduction="none")
    assert out.shape == (3, 2, 7)
    assert (out[t_nc == -100] == 0).all()


@pytest.mark.parametrize("reduction", ("mean", "sum", "none"))
def test_all_ignored_and_empty_follow_pytorch(reduction):
    x, w, _, t = make_case(torch.float32)
    t_all = torch.full_like(t, -100)
    for xx, tt in ((x, t_all), (x[:0], t[:0])):
        xo = xx.clone().requires_grad_(True)
        ours = logitless.linear_cross_entropy(xo, w, tt, reduction=reduction)
        ref = F.cross_entropy(F.linear(xx, w), tt, reduction=reduction)
        torch.testing.assert_close(ours, ref, equal_nan=True)
        (g,) = torch.autograd.grad(ours.sum(), xo)
        if reduction != "mean":
            assert (g == 0).all()


def test_custom_ignore_index_and_none():
    x, w, b, t = make_case(torch.float32)
    t = torch.where(t == -100, torch.full_like(t, 7), t)  # class 7 is ignored
    check_against_truth(logitless.linear_cross_entropy, testing.naive_linear_cross_entropy, x, w, b, t,
                        ignore_index=7)
    a = logitless.linear_cross_entropy(x, w, torch.where(t == 7, -100, t), ignore_index=None)
    torch.testing.assert_close(a, F.cross_entropy(F.linear(x, w), torch.where(t == 7, -100, t)))


@pytest.mark.skipif(not hasattr(F, "linear_cross_entropy"), reason="torch has no F.linear_cross_entropy")
def test_drop_in_for_torch_linear_cross_entropy():
    x, w, b, t = make_case(torch.float32, bias=True)
    cw = torch.rand(V) + 0.5
    for kw in (dict(), dict(reduction="sum", label_smoothing=0.1), dict(weight=cw, reduction="none")):
        ours = logitless.linear_cross_entropy(x, w, t, linear_bias=b, **kw)
        theirs = F.linear_cross_entropy(x, w, t, linear_bias=b, **kw)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    # torch's chunking options are accepted (and mean nothing here); anything else is refused by name
    kw = dict(linear_bias=b, ignore_index=None)
    if hasattr(torch.nn, "LinearCrossEntropyOptions"):
        kw["options"] = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=8)
    torch.testing.assert_close(logitless.linear_cross_entropy(x, w, t, **kw), F.linear_cross_entropy(x, w, t, **kw),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="options must be None or a torch.nn.LinearCrossEntropyOptions"):
        logitless.linear_cross_entropy(x, w, t, options={"batch_chunk_size": 8})


@pytest.mark.skipif(not hasattr(F, "linear_cross_entropy"), reason="torch has no F.linear_cross_entropy")
def test_signature_covers_torch_linear_cross_entropy():
    # Every parameter of torch's function is ours too, of the same kind, positional ones in the same order.
    import inspect

    theirs = inspect.signature(F.linear_cross_entropy).parameters
    ours = inspect.signature(logitless.linear_cross_entropy).parameters
    for name, p in theirs.items():
        assert name in ours, name
        assert ours[name].kind == p.kind, name
    positional = [n for n, p in theirs.items() if p.kind != inspect.Parameter.KEYWORD_ONLY]
    assert list(ours)[: len(positional)] == positional


def test_only_requested_gradients():
    x, w, b, t = make_case(torch.float32, bias=True)
    wo = w.clone().requires_grad_(True)
    loss = logitless.linear_cross_entropy(x, wo, t, linear_bias=b)
    (gw,) = torch.autograd.grad(loss, [wo])
    truth = torch.autograd.grad(F.cross_entropy(F.linear(x.double(), wo.double(), b.double()), t), [wo])[0]
    torch.testing.assert_close(gw, truth, rtol=1e-4, atol=1e-6)


def test_module_matches_function():
    x, w, b, t = make_case(torch.float32, bias=True)
    cw = torch.rand(V) + 0.5
    mod = logitless.LinearCrossEntropyLoss(cw, label_smoothing=0.1, z_loss=1e-4, softcap=10.0)
    a = mod(x, w, t, b)
    f = logitless.linear_cross_entropy(x, w, t, linear_bias=b, weight=cw, label_smoothing=0.1, z_loss=1e-4,
                                       softcap=10.0)
    torch.testing.assert_close(a, f)
    assert "label_smoothing=0.1" in repr(mod)


@pytest.mark.slow  # torch.compile's tracing and code generation; the quick run keeps the eager paths
def test_torch_compile_fullgraph():
    x, w, b, t = make_case(torch.float32, bias=True)

    def loss_fn(x, w, b, t):
        return logitless.linear_cross_entropy(x, w, t, linear_bias=b, label_smoothing=0.1, z_loss=1e-3,
                                              backend="torch")

    assert_compiled_matches_eager(loss_fn, x, w, b, t)


def test_running_counts_load_from_used_and_fresh_checkpoints():
    # vocab_order="running" keeps its counts in a buffer that exists from the first forward on: strict loading
    # must take the checkpoint of a used module into a fresh one and back, alone and inside a model.
    x, w, _, t = make_case(torch.float32)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.loss = logitless.LinearCrossEntropyLoss(vocab_order="running")

    used, fresh = Model(), Model()
    used.loss(x, w, t)
    used.loss(x, w, t.flip(0))
    saved = {k: v.clone() for k, v in used.state_dict().items()}  # state_dict() aliases the buffer
    assert list(saved) == ["loss.vocab_counts"]
    fresh.load_state_dict(used.state_dict())
    counts = fresh.loss.vocab_counts
    assert counts.shape == (V,) and counts.dtype == torch.float32 and counts.device == x.device
    torch.testing.assert_close(counts, saved["loss.vocab_counts"], rtol=0, atol=0)
    # The next forward updates the loaded counts, as the used module's own.
    fresh.loss(x, w, t)
    used.loss(x, w, t)
    torch.testing.assert_close(fresh.loss.vocab_counts, used.loss.vocab_counts)
    assert not torch.equal(fresh.loss.vocab_counts, saved["loss.vocab_counts"])
    # A fresh module's state resets the counts.
    used.load_state_dict(Model().state_dict())
    assert used.loss.vocab_counts is None and used.state_dict() == {}
    # Alone, counts of another dtype (after .double()) come in as saved; .to() moves them as any buffer.
    lone = logitless.LinearCrossEntropyLoss(vocab_order="running")
    lone.load_state_dict({"vocab_counts": saved["loss.vocab_counts"].double()})
    assert lone.vocab_counts.dtype == torch.float64
    assert lone.to(torch.float32).vocab_counts.dtype == torch.float32
    # Without running counts the module has no state to save or load.
    plain = logitless.LinearCrossEntropyLoss(vocab_order="batch")
    plain(x, w, t)
    assert plain.state_dict() == {}
    plain.load_state_dict({})
