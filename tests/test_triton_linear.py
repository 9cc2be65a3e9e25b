"""linear_cross_entropy / linear_log_probs / linear_logsumexp on the Triton path (the interpreter on CPU) against
float64, under the precision rule: every option, extreme inputs, determinism, torch.compile, the backend's
routing, workspace_bytes through every entry point; tests marked gpu run the four issue shapes, int64 offsets
and determinism.

Small shapes (N=37, D=45, V=300) leave partial tiles in every direction with the interpreter's tiles (32 x 64 x 32).
Every test runs with outputs and workspaces poisoned with NaN, so an element that is never written fails the rule.

Split by concern: op semantics in test_triton_linear.py, the kernels' mechanics in test_triton_linear_kernels.py,
their host plans in test_triton_linear_plans.py, skipping in test_triton_linear_skip.py, bad arguments in
test_triton_linear_validation.py; what they share in triton_linear_common.py.
"""

import functools

import pytest
import torch

import logitless
from logitless import kernels, testing
from logitless.apps.bench import data
from logitless.kernels import linear_head as lh
from tests.helpers import (
    assert_compiled_matches_eager,
    check_against_truth,
    check_log_probs_entropy,
    check_logsumexp,
    grads,
    leaves,
    rel_err,
)
from tests.triton_linear_common import (
    DEV,
    case,
    lce_check,
    poison,  # noqa: F401 - autouse: every test runs with NaN-poisoned buffers
)

# (reduction, ignored fraction, label smoothing, z-loss, softcap, bias, class weights, dtype): a covering set rather
# than the product (each case costs ~1 s in the interpreter); every option appears in every dtype.
GRID = [
    ("mean", 0.25, 0.0, 0.0, None, False, False, torch.float32),
    ("mean", 0.25, 0.0, 0.0, None, False, False, torch.bfloat16),
    ("mean", 0.25, 0.0, 0.0, None, False, False, torch.float16),
    ("sum", 0.0, 0.1, 1e-3, 5.0, True, False, torch.float32),
    ("sum", 0.25, 0.1, 1e-3, 5.0, True, False, torch.bfloat16),
    ("none", 0.25, 0.1, 0.0, None, True, True, torch.float16),
    ("none", 0.3, 0.0, 1e-3, 5.0, False, True, torch.float32),
    ("mean", 0.3, 0.2, 0.0, None, False, True, torch.bfloat16),
    ("mean", 0.0, 0.0, 1e-3, 5.0, True, True, torch.float16),
    ("sum", 0.25, 0.0, 0.0, 5.0, False, False, torch.bfloat16),
    ("none", 0.0, 0.0, 0.0, None, True, False, torch.bfloat16),
    ("mean", 0.25, 1.0, 0.0, None, True, True, torch.float32),
]


@pytest.mark.parametrize("reduction,ignore_frac,smoothing,z_loss,softcap,bias,class_w,dtype", GRID)
def test_option_grid(reduction, ignore_frac, smoothing, z_loss, softcap, bias, class_w, dtype):
    x, w, b, t = case(dtype, bias=bias, ignore_frac=ignore_frac, scale=3.0)
    cw = (torch.rand(300, generator=torch.Generator().manual_seed(2)) + 0.5).to(DEV) if class_w else None
    lce_check(x, w, b, t, weight=cw, reduction=reduction, label_smoothing=smoothing, z_loss=z_loss,
              softcap=softcap)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("softcap", [20.0, 60.0])
def test_half_tanh_near_zero(dtype, softcap):
    # bf16 / fp16 heads take a shorter tanh: u - u^3 / 3 below |u| = 1/16, (1 - e) / (1 + e) above
    # (_device.tanh_slope(HALF)). Logits of ~3 under a cap of 20 or 60 put most u = r / cap on both sides of 1/16.
    x, w, b, t = case(dtype, bias=True, ignore_frac=0.25, scale=3.0, seed=5)
    lce_check(x, w, b, t, reduction="sum", softcap=softcap)
    up = torch.randn(t.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(DEV)
    check_against_truth(logitless.linear_log_probs, testing.naive_linear_log_probs, x, w, b, t, upstream=up,
                        backend="triton", softcap=softcap, return_entropy=False)


@pytest.mark.parametrize("kind", ("lm", "uniform"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_peaked_and_uniform_data(kind, dtype):
    # The two synthetic heads of the benchmark: a peaked softmax (most tiles hold tiny probabilities) and a
    # near-uniform one (every class matters).
    head = data.make_head(kind, 37, 45, 300, dtype=dtype, seed=5, device=DEV)
    t = head.target.clone()
    t[::4] = -100
    lce_check(head.input, head.weight, None, t, label_smoothing=0.05)


def test_logits_near_float_max():
    # Two classes with a 3e38 bias: every row's softmax is one-hot on them, p = 1/2 each. m log2(e) overflows float32
    # there (exponents must be (z - m) log2(e)), and the entropy's rescale to a new max must give 0, not
    # 0 x -inf. The targets are those classes (any other would make the loss ~3e38).
    x, w, b, t = case(torch.float32, bias=True)
    b = b.clone()
    b[3] = b[10] = 3.0e38
    t = torch.where(t >= 0, torch.where(t % 2 == 0, 3, 10), t)
    lce_check(x, w, b, t)
    for backend in ("triton", "torch"):
        check_log_probs_entropy(x, w, b, t, backend)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
def test_extreme_logits(dtype):
    # Logits ~1e4: an exp without the max shift overflows, a bad online rescale gives NaN, and the max must be kept
    # apart from the log-sum (a rounded float32 lse would skew every p_j). In float32 the logits are 1e4 + O(3) (a
    # bias offset), so both sides round z the same way; a 3000x input scale would make the gradient hinge on the
    # last bit of a few near-tied logits, i.e. on which BLAS the reference happens to use.
    if dtype == torch.float32:
        x, w, b, t = case(dtype, scale=3.0, bias=True)
        b = b + 1e4
    else:
        x, w, b, t = case(dtype, scale=3000.0 if dtype == torch.bfloat16 else 300.0, bias=True)
    lce_check(x, w, b, t, label_smoothing=0.1, z_loss=1e-6)


@pytest.mark.parametrize("softcap,temperature,bias,dtype", [
    (None, 1.0, False, torch.float32),
    (4.0, 0.6, True, torch.float32),
    (None, 0.6, True, torch.bfloat16),
    (4.0, 1.0, False, torch.bfloat16),
    (4.0, 1.7, True, torch.float16),
])
def test_log_probs_and_entropy(tune, softcap, temperature, bias, dtype):
    plans = []
    tune(debug_plans=plans)  # the entropy's gradient is never skipped
    x, w, b, t = case(dtype, bias=bias, ignore_frac=0.3, scale=3.0)
    check_log_probs_entropy(x, w, b, t, "triton", softcap=softcap, temperature=temperature)
    assert plans == []


def test_log_probs_without_entropy_matches():
    x, w, b, t = case(torch.bfloat16, bias=True, scale=3.0)
    lp = logitless.linear_log_probs(x, w, t, linear_bias=b, backend="triton")
    lp2, _ = logitless.linear_log_probs(x, w, t, linear_bias=b, return_entropy=True, backend="triton")
    assert isinstance(lp, torch.Tensor) and torch.equal(lp, lp2)


@pytest.mark.parametrize("softcap,temperature,bias,dtype", [
    (None, 1.0, True, torch.float32), (4.0, 1.7, False, torch.bfloat16), (None, 0.5, True, torch.float16)])
def test_logsumexp(softcap, temperature, bias, dtype):
    x, w, b, _ = case(dtype, bias=bias, scale=3.0, lead=None)
    x = x.reshape(1, 37, -1)  # leading dimensions are kept
    ours = check_logsumexp(x, w, b, backend="triton", softcap=softcap, temperature=temperature)
    assert ours.shape == (1, 37)


def test_single_token_all_ignored_and_empty():
    x, w, b, t = case(torch.bfloat16, n=1, ignore_frac=0.0, bias=True)
    lce_check(x, w, b, t, label_smoothing=0.05)
    x, w, _, t = case(torch.float32)
    for xx, tt in ((x, torch.full_like(t, -100)), (x[:0], t[:0])):
        for reduction in ("mean", "sum"):
            xo = xx.clone().requires_grad_(True)
            ours = logitless.linear_cross_entropy(xo, w, tt, reduction=reduction, backend="triton")
            ref = torch.nn.functional.cross_entropy(torch.nn.functional.linear(xx, w), tt, reduction=reduction)
            torch.testing.assert_close(ours, ref, equal_nan=True)
            (g,) = torch.autograd.grad(ours, xo)
            if reduction == "sum":
                assert (g == 0).all()


def test_launchers_treat_out_of_shard_targets_as_absent():
    # The vocabulary-parallel module calls the launchers on a shard of W with target - shard_start: targets outside
    # [0, V_shard) contribute no target logit and no one-hot term, and the shards' statistics combine to the full ones.
    x, w, b, t = case(torch.float32, bias=True, ignore_frac=0.0, scale=2.0)
    cut = 130
    stats = [lh.forward_stats(x, w[s], b[s], t - s.start, None, softcap=None, inv_temp=1.0, want_smooth=True,
                              want_entropy=False) for s in (slice(0, cut), slice(cut, 300))]
    m_full, logs_full, zt_full, _, _ = lh.forward_stats(x, w, b, t, None, softcap=None, inv_temp=1.0,
                                                        want_smooth=True, want_entropy=False)
    lse = torch.logsumexp(torch.stack([m + logs for m, logs, *_ in stats]), 0)
    torch.testing.assert_close(lse, m_full + logs_full)
    torch.testing.assert_close(stats[0][2] + stats[1][2], zt_full)
    z = torch.nn.functional.linear(x, w, b)
    torch.testing.assert_close(stats[0][2], torch.where(t < cut, z.gather(1, t[:, None])[:, 0], 0.0))
    # Backward: dL/dz = p - onehot per shard, with the full lse; the shards' dx add up and their dW stack.
    ones = torch.ones(37, device=DEV)
    parts = []
    for s, (m, logs, *_) in zip((slice(0, cut), slice(cut, 300)), stats, strict=True):
        shift = (m_full + logs_full) - (m + logs)  # p_j = exp(z_j - m - logs - shift): use the full lse
        parts.append(lh.backward(x, w[s], b[s], t - s.start, None, m + shift, logs, ones, None, ones, None,
                                 softcap=None, inv_temp=1.0, need_dx=True, need_dw=True, need_db=True))
    zr = z.detach().requires_grad_(True)
    loss = torch.nn.functional.cross_entropy(zr, t, reduction="sum")
    (dz,) = torch.autograd.grad(loss, zr)
    torch.testing.assert_close(parts[0][0] + parts[1][0], dz @ w, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.cat([parts[0][1], parts[1][1]]), dz.T @ x, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.cat([parts[0][2], parts[1][2]]), dz.sum(0), rtol=1e-4, atol=1e-5)


def test_deterministic_bitwise():
    x, w, b, t = case(torch.bfloat16, bias=True, scale=2.0)
    runs = []
    for _ in range(2):
        xo, wo, bo = leaves(x, w, b)
        loss = logitless.linear_cross_entropy(xo, wo, t, linear_bias=bo, backend="triton", deterministic=True)
        runs.append((loss,) + tuple(grads(loss, [xo, wo, bo])))
    assert all(torch.equal(a, c) for a, c in zip(*runs, strict=True))


@pytest.mark.slow  # torch.compile's tracing and code generation; the quick run keeps the eager paths
def test_torch_compile_fullgraph():
    # The custom ops (and their fake and autograd registrations) let dynamo trace the whole loss in one graph.
    x, w, b, t = case(torch.float32, bias=True)

    def loss_fn(x, w, b, t):
        # With a skip threshold the op also records tiles, and the vocabulary order (device ops) is in the graph.
        return logitless.linear_cross_entropy(x, w, t, linear_bias=b, z_loss=1e-3, skip_threshold=2.0**-12,
                                              vocab_order="batch", backend="triton")

    assert_compiled_matches_eager(loss_fn, x, w, b, t, compile_backend="aot_eager")


def test_float64_is_refused_by_triton_and_routed_by_auto():
    x, w, _, t = case(torch.float64)
    with pytest.raises(TypeError, match="float64"):
        logitless.linear_cross_entropy(x, w, t, backend="triton")
    with pytest.raises(TypeError, match="float64"):
        logitless.linear_log_probs(x, w, t, backend="triton")
    with pytest.raises(TypeError, match="float64"):
        logitless.linear_logsumexp(x, w, backend="triton")
    assert logitless.linear_cross_entropy(x, w, t, backend="auto").dtype == torch.float64


def test_workspace_bytes_log_probs_and_module(tune):
    # The budget reaches the backward from linear_log_probs (with the entropy's B term), linear_logsumexp and the
    # loss module: the accumulator gets its own buffer; results within the rule. The dense plans' budget: no
    # skipping, whose plan holds the forward's tile records out of the budget (no own accumulator then). Under
    # "auto" a call skips when skip_gate finds the head called before, and its record is keyed by the weight's
    # address: a weight allocated where an earlier call's was freed (which the allocator's state, left by the tests
    # before, decides) counts as that head's second call and probes.
    records = []
    tune(scratch_bytes=37 * 32 * 2, debug_backwards=records)
    budget = 4 * 37 * 130 + 37 * 32 * 2
    x, w, b, t = case(torch.bfloat16, n=37, d=130, v=300, bias=True, scale=2.0)
    up = torch.randn(37, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(DEV)
    check_against_truth(functools.partial(logitless.linear_log_probs, temperature=0.8, workspace_bytes=budget,
                                          skip_threshold=None),
                        functools.partial(testing.naive_linear_log_probs, temperature=0.8), x, w, b, t,
                        upstream=up, backend="triton")
    xo, wo = leaves(x, w)
    lse = logitless.linear_logsumexp(xo, wo, workspace_bytes=budget, backend="triton")
    ref = torch.logsumexp(xo.detach().double() @ wo.detach().double().T, dim=-1)
    assert rel_err(lse, ref) < 1e-5
    grads(lse.sum(), [xo, wo])
    loss_fn = logitless.LinearCrossEntropyLoss(workspace_bytes=budget, backend="triton", skip_threshold=None)
    assert "workspace_bytes=" in repr(loss_fn)
    xo, wo = leaves(x, w)
    grads(loss_fn(xo, wo, t), [xo, wo])
    # three backwards, each with its own accumulator
    assert len(records) == 3 and all(rec.workspace.own_acc for rec in records), records


# GPU: the issue's four shapes (checked on 1024 tokens at full D and V), int64 offsets, determinism.
SHAPES = {
    "gemma2-2b": (8192, 2304, 256000),
    "llama3-8b": (16384, 4096, 128256),
    "mistral-nemo": (8192, 5120, 131072),
    "qwen3-small": (16384, 1024, 151936),
}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kind", ("lm", "uniform"))
def test_gpu_issue_shapes(shape, kind):
    _, D, V = SHAPES[shape]
    head = data.make_head(kind, 1024, D, V, device="cuda")
    t = head.target.clone()
    t[::10] = -100
    lce_check(head.input, head.weight, None, t, label_smoothing=0.1, z_loss=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("N,D,V", [(524411, 4100, 1000), (300, 4100, 524411)])
def test_gpu_int64_offsets(N, D, V):
    # N * D > 2^31 (input and the dz workspace), V * D > 2^31 (weight and its gradient): against the PyTorch path.
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(N, D, device="cuda", generator=g, dtype=torch.bfloat16)
    w = (torch.randn(V, D, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    t = torch.randint(0, V, (N,), device="cuda", generator=g)
    outs = []
    for backend in ("triton", "torch"):
        xo, wo = leaves(x, w)
        loss = logitless.linear_cross_entropy(xo, wo, t, reduction="sum", backend=backend)
        outs.append((loss,) + tuple(torch.autograd.grad(loss, (xo, wo))))
        del xo, wo
    for name, a, r in zip(("loss", "d_input", "d_weight"), *outs, strict=True):
        assert _rows_rel_err(a, r) < 5e-3, name
        assert _rows_rel_err(a[-64:], r[-64:]) < 5e-3 if a.dim() else True, name  # where a 32-bit offset would wrap


def _rows_rel_err(a: torch.Tensor, r: torch.Tensor, rows: int = 1 << 16) -> float:
    """rel_err (||a - r|| / ||r||, float64) a block of rows at a time: float64 copies of whole 4 GB gradients do not
    fit next to the test's tensors on an 80 GB GPU. NaN in a makes the result NaN, which fails the comparison."""
    if a.dim() == 0:
        return rel_err(a, r)
    num = den = 0.0
    for i in range(0, a.shape[0], rows):
        r64 = r[i:i + rows].double()
        num += float((a[i:i + rows].double() - r64).square().sum())
        den += float(r64.square().sum())
    return (num / den) ** 0.5 if den > 0 else num ** 0.5


@pytest.mark.gpu
def test_gpu_deterministic():
    head = data.uniform(16384, 1024, 151936, device="cuda", seed=3)
    runs = []
    for _ in range(2):
        xo, wo = leaves(head.input, head.weight)
        loss = logitless.linear_cross_entropy(xo, wo, head.target, backend="triton", deterministic=True)
        runs.append(torch.autograd.grad(loss, (xo, wo)))
    assert all(torch.equal(a, c) for a, c in zip(*runs, strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["qwen3-small", "llama3-8b"])
def test_gpu_workspace_bytes(shape):
    # A budget that gives the dx accumulator its own buffer and a 256 MiB scratch: the same loss and gradients as
    # the lean default up to float32 summation order, at the full shape.
    # The column plan's budgets (the row-chunk plan, which the default picks at llama3-8b, rounds its logits to bf16
    # as PyTorch does: tests/test_row_chunks.py holds it to the precision rule).
    N, D, V = SHAPES[shape]
    head = data.uniform(N, D, V, device="cuda", seed=5)
    runs = []
    for budget in (None, 4 * N * D + (256 << 20)):
        xo, wo = leaves(head.input, head.weight)
        with kernels.tuning(row_chunks=False):
            loss = logitless.linear_cross_entropy(xo, wo, head.target, backend="triton", workspace_bytes=budget)
        runs.append((loss, *torch.autograd.grad(loss, (xo, wo))))
        del xo, wo
    for name, a, r in zip(("loss", "d_input", "d_weight"), *runs, strict=True):
        assert _rows_rel_err(a, r) < 2e-3, name


@pytest.mark.gpu
def test_gpu_auto_picks_triton():
    x, w, _, t = case(torch.bfloat16)
    from logitless._dispatch import resolve_backend

    assert resolve_backend("auto", x.device, "linear_cross_entropy") == "triton"
    assert resolve_backend("auto", x.device, "linear_log_probs") == "triton"
    assert resolve_backend("auto", x.device, "linear_logsumexp") == "triton"
