"""linear_kl_div, linear_jsd and linear_soft_cross_entropy: both backends against float64 full logits, with
PyTorch's full-logits computation in the input dtype as the error yardstick (tests/helpers.py's rule)."""

from __future__ import annotations

import json
import math

import pytest
import torch

import logitless
from logitless import testing

from .helpers import DTYPES, assert_compiled_matches_eager, assert_within_rule, grads, leaves

# kind -> (public function, its extra keyword arguments); "jsd-0" / "jsd-1" are the edges of beta
CASES = {
    "fkl": (logitless.linear_kl_div, {"direction": "forward"}),
    "rkl": (logitless.linear_kl_div, {"direction": "reverse"}),
    "jsd": (logitless.linear_jsd, {"beta": 0.5}),
    "jsd-skew": (logitless.linear_jsd, {"beta": 0.2}),
    "jsd-0": (logitless.linear_jsd, {"beta": 0.0}),
    "jsd-1": (logitless.linear_jsd, {"beta": 1.0}),
    "ce": (None, {}),
}


def _naive_kind(case):
    if case.startswith("jsd"):
        return "jsd"
    return case


def make_pair(dtype, *, n=37, ds=45, dt=29, v=300, bias=True, ignore_frac=0.25, scale=1.0, seed=0, lead=None):
    """Student and teacher heads over one vocabulary (different widths), related so that the divergences are of
    moderate size, and labels with some rows ignored."""
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(n, ds, generator=g) * scale
    ws = torch.randn(v, ds, generator=g) / ds**0.5
    xt = torch.randn(n, dt, generator=g) * scale
    wt = torch.randn(v, dt, generator=g) / dt**0.5
    bs = torch.randn(v, generator=g) * 0.5 if bias else None
    bt = torch.randn(v, generator=g) * 0.5 if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < ignore_frac] = -100
    out = [xs, ws, bs, xt, wt, bt]
    out = [None if a is None else a.to(dtype) for a in out]
    if lead is not None:
        out[0], out[3], t = out[0].reshape(*lead, ds), out[3].reshape(*lead, dt), t.reshape(lead)
    return (*out, t)


def _ours(case, xs, ws, bs, xt, wt, bt, backend, **kw):
    fn, extra = CASES[case]
    if case == "ce":
        return logitless.linear_soft_cross_entropy(xs, ws, xt, wt, linear_bias=bs, target_bias=bt, backend=backend,
                                                   **kw)
    return fn(xs, ws, xt, wt, student_bias=bs, teacher_bias=bt, backend=backend, **extra, **kw)


def _naive(case, xs, ws, bs, xt, wt, bt, upcast, **kw):
    beta = CASES[case][1].get("beta", 0.5)
    return testing.naive_two_heads(xs, ws, xt, wt, kind=_naive_kind(case), beta=beta, student_bias=bs,
                                   teacher_bias=bt, upcast=upcast, **kw)


def check(case, tensors, backend, **kw):
    """Ours (in the inputs' dtype), PyTorch's full logits in that dtype, and float64 truth: the loss and the
    student's gradients (of a random upstream for reduction="none") under the error rule. Returns our loss."""
    xs, ws, bs, xt, wt, bt = tensors
    so = leaves(xs, ws, bs)
    ours = _ours(case, so[0], so[1], so[2], xt, wt, bt, backend, **kw)
    st = leaves(xs, ws, bs)
    theirs = _naive(case, st[0], st[1], st[2], xt, wt, bt, False, **kw)
    s64 = leaves(*(None if a is None else a.double() for a in (xs, ws, bs)))
    t64 = [None if a is None else a.double() for a in (xt, wt, bt)]
    truth = _naive(case, s64[0], s64[1], s64[2], *t64, True, **kw)
    assert ours.dtype == torch.float32 and ours.shape == truth.shape
    assert_within_rule("loss", ours, theirs, truth)
    up = None
    if truth.dim() > 0:
        up = torch.randn(truth.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    names = [n for n, a in zip(("d_input", "d_weight", "d_bias"), (xs, ws, bs), strict=True) if a is not None]
    for name, go, gt, g64 in zip(names, grads(ours, so, up), grads(theirs, st, up), grads(truth, s64, up),
                                 strict=True):
        assert go.dtype == xs.dtype
        assert_within_rule(name, go, gt, g64)
    return ours


# ---------------------------------------------------------------------------------------------------------------
# The PyTorch path (chunked twin): every option


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_all_options(case, dtype):
    # bias, softcap, temperature and ignored rows at once, odd sizes, per-row values
    *tensors, t = make_pair(dtype)
    check(case, tensors, "torch", target=t, temperature=1.7, softcap=4.0, reduction="none")


@pytest.mark.parametrize("case", ["fkl", "rkl", "jsd", "ce"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_torch_reductions_plain(case, reduction):
    # no bias, no target (every row counts), the scalar reductions, a 3-D input
    *tensors, _ = make_pair(torch.float32, bias=False, lead=(3, 11), n=33, v=257)
    check(case, tensors, "torch", reduction=reduction)


def test_torch_float64_matches_truth():
    # float64 runs on the PyTorch path in float64 math: agreement to rounding
    *tensors, t = make_pair(torch.float64)
    for case in ("fkl", "rkl", "jsd", "ce"):
        ours = _ours(case, *tensors, "torch", target=t, reduction="none", temperature=0.8)
        truth = _naive(case, *tensors, True, target=t, reduction="none", temperature=0.8)
        torch.testing.assert_close(ours.double(), truth, rtol=1e-10, atol=1e-12)


def test_torch_extreme_logits():
    # logits in the hundreds (hidden states x 30): the differences of maxima and log-sums must not cancel badly
    *tensors, t = make_pair(torch.float32, scale=30.0, n=16, v=200)
    for case in ("fkl", "rkl", "jsd", "ce"):
        check(case, tensors, "torch", target=t, reduction="sum")


def test_torch_many_chunks(monkeypatch):
    # small chunks force several token and vocabulary chunks: the online statistics across chunks
    from logitless.torch_backend import blocks

    monkeypatch.setattr(blocks, "CHUNK_ELEMS", 256)
    monkeypatch.setattr(blocks, "VOCAB_CHUNK", 64)
    *tensors, t = make_pair(torch.float32, n=33, v=200)
    for case in ("rkl", "jsd", "ce"):  # student-weighted, second pass, teacher-weighted with the entropy sum
        check(case, tensors, "torch", target=t, reduction="none", softcap=5.0)


# ---------------------------------------------------------------------------------------------------------------
# The Triton path (through the interpreter on a CPU: small shapes)

TRITON_SHAPE = dict(n=21, ds=24, dt=16, v=70)  # rows 16-byte aligned: tensor descriptors where the dtype allows
TRITON_ODD = dict(n=19, ds=21, dt=13, v=67)  # pointer loads, masked reductions


@pytest.mark.parametrize("case", ["fkl", "rkl", "jsd-skew", "ce"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_all_options(case, dtype):
    *tensors, t = make_pair(dtype, **TRITON_SHAPE)
    check(case, tensors, "triton", target=t, temperature=1.7, softcap=4.0, reduction="none")


@pytest.mark.parametrize("case", ["fkl", "rkl", "jsd", "ce"])
def test_triton_odd_sizes_plain(case):
    *tensors, _ = make_pair(torch.bfloat16, bias=False, **TRITON_ODD)
    check(case, tensors, "triton", reduction="mean")


@pytest.mark.parametrize("case", ["fkl", "jsd"])
def test_triton_fused_reduction_loop(case, tune):
    # both heads' products in one loop (a sweep option): heads of one width, tensor descriptors
    tune(two_heads_fused_k=True)
    *tensors, t = make_pair(torch.bfloat16, n=21, ds=24, dt=24, v=70)
    check(case, tensors, "triton", target=t, softcap=4.0, reduction="none")


@pytest.mark.parametrize("case", ["fkl", "jsd"])
def test_triton_persistent_dz(case, tune):
    # Tuning.two_heads_dz_persistent: with tensor descriptors the dz launches run a persistent grid (several tiles
    # a program here); the gradients are bitwise those of one program a tile, and within the rule.
    from logitless.kernels.linear_head.configs import TensorDescriptor, interpreter_config

    if TensorDescriptor is None:
        pytest.skip("no tensor descriptors in this Triton")
    records = []  # what each backward decided (Tuning.debug_backwards)
    tune(two_heads_config=interpreter_config().replace(tma=True), debug_backwards=records)
    xs, ws, bs, xt, wt, bt, t = make_pair(torch.bfloat16, n=40, ds=24, dt=16, v=300)
    fn = logitless.linear_kl_div if case == "fkl" else logitless.linear_jsd
    out = {}
    for persistent in (False, True):
        with logitless.kernels.tuning(two_heads_dz_persistent=persistent):
            x, w, b = leaves(xs, ws, bs)
            fn(x, w, xt, wt, student_bias=b, teacher_bias=bt, target=t, backend="triton").backward()
            out[persistent] = (x.grad, w.grad, b.grad)
    for a, c in zip(out[False], out[True], strict=True):
        assert torch.equal(a, c)
    assert [rec.head for rec in records] == ["two_heads"] * 2
    seen = [(launch.programs, launch.persistent) for rec in records for launch in rec.dz]
    assert any(p and n < 4 for n, p in seen) and any(not p for _, p in seen)
    check(case, (xs, ws, bs, xt, wt, bt), "triton", target=t, reduction="mean")


@pytest.mark.parametrize("major,smem", [(9, 232448), (8, 166912), (8, 101376), (12, 101376)])
def test_triton_gpu_tiers(tune, major, smem):
    # The two-head tiles each kind of CUDA device gets (two_heads.arch_config; tools/compile_check.py compiles them
    # per architecture): reduction steps of 32 below Hopper's shared memory, descriptors from compute capability 9;
    # run here through the interpreter at a shape with partial tiles.
    from logitless.kernels import two_heads

    cfg = two_heads.arch_config(torch.bfloat16, major, smem)
    assert cfg.tma == (major >= 9) and cfg.block_k == (64 if smem >= 200 * 1024 else 32)
    assert two_heads.arch_config(torch.float32, major, smem) == two_heads.fp32_config()
    tune(two_heads_config=cfg)
    *tensors, t = make_pair(torch.bfloat16, n=130, ds=40, dt=24, v=300)
    check("fkl", tensors, "triton", target=t, reduction="mean")


def test_triton_jsd_edges_and_sum():
    # beta at the edges is the KL of that direction, on this path too
    *tensors, t = make_pair(torch.float16, **TRITON_ODD)
    for case in ("jsd-0", "jsd-1"):
        check(case, tensors, "triton", target=t, reduction="sum", temperature=0.5)


def test_triton_extreme_logits():
    # logits in the hundreds through the kernels' exp2 and online rescaling
    *tensors, t = make_pair(torch.float32, scale=30.0, **TRITON_ODD)
    for case in ("rkl", "jsd", "ce"):
        check(case, tensors, "triton", target=t, reduction="sum")


def test_triton_weight_gradient_only_and_input_only():
    # a frozen student head (input gradient only), or frozen hidden states (weight and bias only): other plans
    xs, ws, bs, xt, wt, bt, t = make_pair(torch.bfloat16, **TRITON_SHAPE)
    for frozen in ("weight", "input"):
        x = xs.clone().requires_grad_(frozen != "input")
        w = ws.clone().requires_grad_(frozen != "weight")
        b = bs.clone().requires_grad_(frozen != "weight")
        ours = logitless.linear_kl_div(x, w, xt, wt, student_bias=b, teacher_bias=bt, target=t, backend="triton",
                                       direction="reverse")
        ref = logitless.linear_kl_div(x, w, xt, wt, student_bias=b, teacher_bias=bt, target=t, backend="torch",
                                      direction="reverse")
        inputs = [a for a in (x, w, b) if a.requires_grad]
        for go, gr in zip(torch.autograd.grad(ours, inputs), torch.autograd.grad(ref, inputs), strict=True):
            torch.testing.assert_close(go.float(), gr.float(), rtol=2e-2, atol=2e-3)


def test_triton_matches_torch_path_many_chunks(tune):
    # a scratch too small for one chunk of the default plan: the backward walks many chunks and the second pass
    tune(scratch_bytes=21 * 2 * 8)
    xs, ws, bs, xt, wt, bt, t = make_pair(torch.float32, **TRITON_SHAPE)
    for case in ("fkl", "jsd"):
        check(case, (xs, ws, bs, xt, wt, bt), "triton", target=t, reduction="sum")


# ---------------------------------------------------------------------------------------------------------------
# Semantics


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_all_ignored(backend):
    # mean over no rows is NaN (as PyTorch's cross-entropy), sum is 0, and every gradient is exactly 0
    xs, ws, bs, xt, wt, bt, t = make_pair(torch.float32, **TRITON_ODD)
    t = torch.full_like(t, -100)
    x, w = xs.clone().requires_grad_(), ws.clone().requires_grad_()
    mean = logitless.linear_jsd(x, w, xt, wt, target=t, backend=backend)
    assert math.isnan(float(mean))
    total = logitless.linear_kl_div(x, w, xt, wt, target=t, reduction="sum", backend=backend)
    assert float(total) == 0.0
    gx, gw = torch.autograd.grad(total, (x, w))
    assert (gx == 0).all() and (gw == 0).all()


def test_beta_edges_are_the_kl_directions():
    *tensors, t = make_pair(torch.float32)
    xs, ws, bs, xt, wt, bt = tensors
    for beta, direction in ((0.0, "forward"), (1.0, "reverse")):
        jsd = logitless.linear_jsd(xs, ws, xt, wt, beta=beta, target=t, student_bias=bs, teacher_bias=bt)
        kl = logitless.linear_kl_div(xs, ws, xt, wt, direction=direction, target=t, student_bias=bs, teacher_bias=bt)
        assert torch.equal(jsd, kl)


def test_soft_cross_entropy_is_kl_plus_teacher_entropy():
    # CE(p_t, p_s) = KL(p_t || p_s) + H(p_t); H(p_t) from linear_log_probs' entropy
    xs, ws, bs, xt, wt, bt, t = make_pair(torch.float64)
    ce = logitless.linear_soft_cross_entropy(xs, ws, xt, wt, linear_bias=bs, target_bias=bt, temperature=2.0)
    kl = logitless.linear_kl_div(xs, ws, xt, wt, student_bias=bs, teacher_bias=bt, temperature=2.0,
                                 reduction="none")
    _, h = logitless.linear_log_probs(xt, wt, torch.zeros_like(t), linear_bias=bt, temperature=2.0,
                                      return_entropy=True)
    torch.testing.assert_close(ce, kl + h)


def test_teacher_gets_no_gradient_and_bool_mask():
    # the teacher is a constant even when it requires grad; a bool mask is the same as labels with ignore_index
    xs, ws, bs, xt, wt, bt, t = make_pair(torch.float32)
    xt.requires_grad_()
    wt.requires_grad_()
    x = xs.clone().requires_grad_()
    a = logitless.linear_kl_div(x, ws, xt, wt, target=t)
    b = logitless.linear_kl_div(x, ws, xt, wt, target=t != -100)
    assert torch.equal(a, b)
    a.backward()
    assert x.grad is not None and xt.grad is None and wt.grad is None


def test_jsd_is_bounded_and_symmetric_at_half():
    # 0 <= JSD_0.5 <= log 2, and swapping the heads leaves it unchanged
    xs, ws, _, xt, wt, _, _ = make_pair(torch.float64, ds=29, dt=29, scale=5.0)
    ab = logitless.linear_jsd(xs, ws, xt, wt, reduction="none")
    ba = logitless.linear_jsd(xt, wt, xs, ws, reduction="none")
    assert (ab >= -1e-12).all() and (ab <= math.log(2) + 1e-12).all()
    torch.testing.assert_close(ab, ba)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_not_double_differentiable(backend):
    xs, ws, _, xt, wt, _, _ = make_pair(torch.float32, n=5, v=20)
    x = xs.clone().requires_grad_()
    (gx,) = torch.autograd.grad(logitless.linear_jsd(x, ws, xt, wt, backend=backend), x, create_graph=True)
    with pytest.raises(RuntimeError, match="not differentiable"):
        gx.sum().backward()


def test_bad_inputs():
    xs, ws, bs, xt, wt, bt, t = make_pair(torch.float32, n=5, v=20)
    kl = logitless.linear_kl_div
    with pytest.raises(ValueError, match="one vocabulary"):
        kl(xs, ws, xt, wt[:-1])
    with pytest.raises(ValueError, match="leading shape"):
        kl(xs, ws, xt[:-1], wt)
    with pytest.raises(TypeError, match="one dtype"):
        kl(xs, ws, xt.double(), wt.double())
    with pytest.raises(ValueError, match="teacher head.*last dimension"):
        kl(xs, ws, xt, wt[:, :-1])
    with pytest.raises(ValueError, match="direction"):
        kl(xs, ws, xt, wt, direction="backward")
    with pytest.raises(ValueError, match="beta"):
        logitless.linear_jsd(xs, ws, xt, wt, beta=1.5)
    with pytest.raises(TypeError, match="beta"):
        logitless.linear_jsd(xs, ws, xt, wt, beta=torch.tensor(0.5))
    with pytest.raises(ValueError, match="temperature"):
        kl(xs, ws, xt, wt, temperature=0.0)
    with pytest.raises(ValueError, match="target has shape"):
        kl(xs, ws, xt, wt, target=t[:-1])
    with pytest.raises(TypeError, match="target"):
        kl(xs, ws, xt, wt, target=t.float())
    with pytest.raises(ValueError, match="reduction"):
        kl(xs, ws, xt, wt, reduction="batchmean")
    with pytest.raises(TypeError, match="backend='triton' takes"):
        kl(xs.double(), ws.double(), xt.double(), wt.double(), backend="triton")


def test_bench_distill_job(tmp_path):
    # the bench's distill job: the correctness gate passes for ours and the eager peer, and the run is timed
    from logitless.apps.bench import cli as bench_cli

    out = tmp_path / "out"
    argv = ["--job", "distill", "--shape", "40,16,300", "--no-progress", "--budget", "0.01", "--min-reps", "1",
            "--max-reps", "1", "--providers", "logitless-torch,torch-eager,floor", "--out", str(out), "--no-plots"]
    assert bench_cli.main(argv) == 0
    recs = json.loads((out / "results.json").read_text())["results"]
    assert {r["provider"] for r in recs} == {"logitless-torch", "torch-eager", "floor"}
    assert all(r["status"] == "ok" and r["phase_status"] == "ok" and r["phase"] == "fwd+bwd" for r in recs)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["fkl", "rkl", "jsd", "ce"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_tiles(case, dtype):
    # the GPU's tiles and tensor descriptors, several token blocks, splits and vocabulary chunks, and the backward
    # plan that borrows dW rows (V >= 2N)
    tensors = [None if a is None else a.cuda() for a in make_pair(dtype, n=1031, ds=256, dt=192, v=32003)]
    *tensors, t = tensors
    check(case, tensors, "triton", target=t, temperature=1.3, softcap=20.0, reduction="sum")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_torch_compile_fullgraph(backend):
    # the PyTorch twin traces through; the Triton path is two opaque torch.library ops (with fake and autograd
    # registrations): one graph either way, same loss and gradients as eager
    xs, ws, bs, xt, wt, bt, t = make_pair(torch.float32, **TRITON_ODD)

    def loss_fn(x, w, b, t):
        return logitless.linear_jsd(x, w, xt, wt, beta=0.3, target=t, student_bias=b, teacher_bias=bt,
                                    softcap=5.0, backend=backend)

    assert_compiled_matches_eager(loss_fn, xs, ws, bs, t, compile_backend="aot_eager")
