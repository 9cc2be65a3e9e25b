"""The Triton path's row-chunk plan of linear_cross_entropy (plans.row_chunk_plan, kernels/linear_head/row_chunks.py):
the policy on shapes alone, the precision rule with every option over several chunks (bf16 and float32 weight-gradient
accumulation), ignored rows at chunk edges, the cap on bf16 accumulation where it is hardest (small D), PyTorch's
autograd contract, and the column plan where the row plan does not apply. At small shapes the interpreter runs the
cross-entropy kernel; the products are the float32 stand-in of the CPU."""

import pytest
import torch
import torch.nn.functional as F

import logitless
from logitless import testing
from logitless.kernels.linear_head import plans, row_chunk_plan
from tests.helpers import assert_within_rule, check_against_truth, leaves, make_case

DEV = "cuda" if torch.cuda.is_available() else "cpu"
N_ROWS = 160  # three chunks of 56 rows under the fixture's budget (V = 300: 304-element rows)


def _row_plan(loss) -> bool:
    return type(loss.grad_fn).__name__.startswith("_RowChunkCrossEntropy")


# Bytes per row of a chunk at V = 300, D = 45: 304-element bf16 logits and, the vocabulary being unaligned, float32 dx
PER_ROW = 2 * 304 + 4 * 45


@pytest.fixture
def rows(tune, monkeypatch):
    """The row plan wherever the budget allows it, with chunks of a few rows; rows(f32) sets the default budget to
    three chunks of 56 rows at N = 160, with (f32) or without room for the float32 weight-gradient accumulator."""
    tune(row_chunks=True, row_chunk_min_rows=16, scratch_bytes=1024, debug_poison=True)

    def set_budget(f32=False):
        budget = 56 * PER_ROW + (4 * 300 * 45 if f32 else 0)
        monkeypatch.setattr(row_chunk_plan, "row_chunk_budget", lambda N, V: budget)
    set_budget()
    return set_budget


def case(*args, **kw):
    return tuple(None if a is None else a.to(DEV) for a in make_case(*args, **kw))


# (reduction, label smoothing, z-loss, softcap, bias, class weights, float32 dW): every option, both accumulators.
GRID = [
    ("mean", 0.0, 0.0, None, False, False, False),
    ("sum", 0.1, 1e-3, 5.0, True, False, False),
    ("mean", 0.2, 0.0, None, False, True, True),
    ("mean", 0.0, 1e-3, 5.0, True, True, False),
    ("sum", 0.0, 0.0, None, False, True, True),
]


@pytest.mark.parametrize("reduction,eps,zl,cap,bias,cw,f32", GRID)
def test_row_plan_options(rows, reduction, eps, zl, cap, bias, cw, f32):
    rows(f32)
    plan = plans.row_chunk_plan(N_ROWS, 300, 45, torch.bfloat16, True, None)
    assert plan.chunks == 3 and plan.f32_dw == f32
    x, w, b, t = case(torch.bfloat16, n=N_ROWS, bias=bias, ignore_frac=0.3, scale=3.0)
    kw = dict(reduction=reduction, label_smoothing=eps, z_loss=zl, softcap=cap)
    if cw:
        kw["weight"] = (torch.rand(300, generator=torch.Generator().manual_seed(2)) + 0.5).to(DEV)
    xo, wo = leaves(x, w)
    assert _row_plan(logitless.linear_cross_entropy(xo, wo, t, backend="triton", **kw))
    check_against_truth(logitless.linear_cross_entropy, testing.naive_linear_cross_entropy, x, w, b, t,
                        upstream=torch.tensor(-2.5, dtype=torch.float64), backend="triton", **kw)


def test_row_plan_ignored_rows_at_chunk_edges(rows):
    x, w, b, t = case(torch.bfloat16, n=N_ROWS, bias=True, ignore_frac=0.0)
    t[[0, 55, 56, 111, 112, 159]] = -100  # the first and last rows of each chunk of 56
    check_against_truth(logitless.linear_cross_entropy, testing.naive_linear_cross_entropy, x, w, b, t,
                        backend="triton", label_smoothing=0.1)
    # every row ignored: the loss is PyTorch's NaN ("mean") or 0 ("sum"), the gradients zeros
    for reduction in ("mean", "sum"):
        tt = torch.full_like(t, -100)
        xo, wo = leaves(x, w)
        # (the dense plan: skipping off, as skip_gate would probe it at this head's second call)
        loss = logitless.linear_cross_entropy(xo, wo, tt, backend="triton", reduction=reduction, skip_threshold=None)
        assert _row_plan(loss)
        ref = F.cross_entropy(F.linear(x.float(), w.float()), tt, reduction=reduction)
        torch.testing.assert_close(loss, ref, equal_nan=True)
        loss.backward()
        assert not xo.grad.any() and not wo.grad.any()


@pytest.mark.parametrize("seed", (0, 1))
def test_bf16_weight_gradient_at_the_chunk_cap(rows, tune, seed):
    # The hardest case for the bf16 accumulator: small D (each dW entry sums few large terms per row) and the most
    # chunks the cap allows, each one rounding of the running sum; N = 512, V = 300, D = 8 (narrow_d).
    tune(row_chunk_min_rows=8, row_chunk_f32_dw=False)
    n, d = 512, 8
    budget = (2 * 304 + 4 * d) * 128  # chunks of 128 rows: 4, the cap
    plan = plans.row_chunk_plan(n, 300, d, torch.bfloat16, True, budget)
    assert plan.chunks == 4 and not plan.f32_dw
    assert plans.row_chunk_plan(n, 300, d, torch.bfloat16, True, budget - 8 * (2 * 304 + 4 * d)) is None  # 5 > the cap
    x, w, b, t = case(torch.bfloat16, n=n, d=d, ignore_frac=0.1, scale=4.0, seed=seed)
    xo, wo = leaves(x, w)
    loss = logitless.linear_cross_entropy(xo, wo, t, backend="triton", workspace_bytes=budget)
    assert _row_plan(loss)
    loss.backward()
    xt, wt = leaves(x, w)
    testing.naive_linear_cross_entropy(xt, wt, t, upcast=False).backward()
    x64, w64 = leaves(x.double(), w.double())
    testing.naive_linear_cross_entropy(x64, w64, t).backward()
    assert_within_rule("d_weight", wo.grad, wt.grad, w64.grad)
    assert_within_rule("d_input", xo.grad, xt.grad, x64.grad)


def test_row_plan_backward_any_number_of_times(rows):
    x, w, b, t = case(torch.bfloat16, n=N_ROWS, bias=True)
    xo, wo, bo = leaves(x, w, b)
    loss = logitless.linear_cross_entropy(xo, wo, t, linear_bias=bo, backend="triton")
    assert _row_plan(loss)
    kept = [torch.autograd.grad(loss * s, (xo, wo, bo), retain_graph=True) for s in (1.0, 3.0, 1.0)]
    last = torch.autograd.grad(loss, (xo, wo, bo))
    for a, c, d in zip(kept[0], kept[2], last, strict=True):
        assert torch.equal(a, c) and torch.equal(a, d)
    for a, c in zip(kept[0], kept[1], strict=True):
        torch.testing.assert_close(3.0 * a.float(), c.float(), rtol=1e-2, atol=1e-6)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()
    # .backward(retain_graph=True) twice accumulates the same gradient twice; the last backward hands its own
    # buffers over (AccumulateGrad takes them as .grad without a copy)
    loss = logitless.linear_cross_entropy(xo, wo, t, linear_bias=bo, backend="triton")
    xo.grad = wo.grad = bo.grad = None
    loss.backward(retain_graph=True)
    g = xo.grad.clone()
    loss.backward()
    assert torch.equal(xo.grad, g + g)
    xo.grad = wo.grad = None
    loss = logitless.linear_cross_entropy(xo, wo, t, linear_bias=bo, backend="triton")
    held = loss.grad_fn.grads[0].data_ptr(), loss.grad_fn.grads[1].data_ptr()
    loss.backward()
    assert (xo.grad.data_ptr(), wo.grad.data_ptr()) == held


def test_column_plan_where_the_row_plan_does_not_apply(rows):
    x, w, b, t = case(torch.bfloat16, n=N_ROWS)
    xo, wo = leaves(x, w)
    lce = logitless.linear_cross_entropy
    assert not _row_plan(lce(xo, wo, t, backend="triton", reduction="none"))
    assert not _row_plan(lce(xo, wo, t, backend="triton", skip_threshold="auto"))
    assert not _row_plan(lce(xo, wo, t, backend="triton", workspace_bytes=0))
    assert not _row_plan(lce(x, w, t, backend="triton"))  # nothing requires grad
    with torch.no_grad():
        assert lce(xo, wo, t, backend="triton").grad_fn is None
    xh, wh = leaves(x.half(), w.half())
    assert not _row_plan(lce(xh, wh, t, backend="triton"))  # float16: its logits would overflow where ours do not


def test_row_chunk_policy(tune):
    presets = [(8192, 4096, 128256), (16384, 4096, 128256), (8192, 2560, 262144), (16384, 3584, 151655),
               (4096, 2304, 256000), (16384, 768, 50257)]
    for N, D, V in presets:
        plan = plans.row_chunk_plan(N, V, D, torch.bfloat16, True, None)
        if D < 2048:
            assert plan is None
            continue
        # within half of torch.compile's peak (the bf16 logits, 2 N V bytes), chunks of at least 1024 rows
        per_row = 2 * plan.ld + (4 * D if V % 8 else 0)
        assert plan.rows * per_row + (4 * V * D if plan.f32_dw else 0) <= N * V
        assert plan.rows >= 1024 and plan.chunks * plan.rows >= N and plan.ld % 8 == 0
        assert plan.f32_dw or plan.chunks <= 4
        assert plans.row_chunk_plan(N, V, D, torch.float16, True, None) is None
        assert plans.row_chunk_plan(N, V, D, torch.bfloat16, True, 0) is None
        assert plans.row_chunk_plan(N, V, D, torch.bfloat16, True, per_row * (N // 5)) is None  # 5+ bf16 chunks
    tune(row_chunks=False)
    assert plans.row_chunk_plan(8192, 128256, 4096, torch.bfloat16, True, None) is None
