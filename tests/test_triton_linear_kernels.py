"""The linear head's kernels at work on the Triton path (the interpreter on CPU): tensor descriptors, the
backward's workspaces inside the gradient buffers, the forward's stash of logits, float32-only reductions, the
dz kernel's tiles; each against float64 under the precision rule, with NaN-poisoned buffers.

Split by concern: op semantics in test_triton_linear.py, the kernels' mechanics in test_triton_linear_kernels.py,
their host plans in test_triton_linear_plans.py, skipping in test_triton_linear_skip.py, bad arguments in
test_triton_linear_validation.py; what they share in triton_linear_common.py.
"""

import functools

import pytest
import torch

import logitless
from logitless import testing, triton_backend
from logitless.kernels import linear_head as lh
from logitless.kernels.linear_head import configs as lh_configs
from tests.helpers import (
    assert_within_rule,
    check_log_probs_entropy,
    check_logsumexp,
    grads,
    leaves,
    rel_err,
)
from tests.triton_linear_common import (
    DEV,
    WORKSPACES,
    case,
    lce_check,
    poison,  # noqa: F401 - autouse: every test runs with NaN-poisoned buffers
)

# Tensor descriptors (the copy engine's tiles, zero-filled past N, V and D). D = 48
# and 40 give 16-byte aligned rows in every dtype (D = 45 elsewhere falls back to pointers); 40 leaves a partial
# reduction step; V = 320 makes every vocabulary tile whole (the forward's unmasked epilogue, EVEN_V).
# (reduction, smoothing, softcap, bias, class weights, dtype, D, V, descriptors)
TMA_GRID = [
    ("mean", 0.0, None, False, False, torch.bfloat16, 48, 300, True),
    ("sum", 0.1, 5.0, True, True, torch.float32, 40, 300, True),
    ("none", 0.0, 5.0, True, False, torch.float16, 40, 320, True),
    ("mean", 0.1, None, False, True, torch.bfloat16, 45, 320, False),
]


@pytest.mark.parametrize("reduction,smoothing,softcap,bias,class_w,dtype,d,v,tma", TMA_GRID)
def test_tensor_descriptors(tune, reduction, smoothing, softcap, bias, class_w, dtype, d, v, tma):
    tune(linear_config=lh_configs.config_for(torch.empty(1, device=DEV)).replace(tma=tma, grad_tma=tma))
    x, w, b, t = case(dtype, d=d, v=v, bias=bias, ignore_frac=0.25, scale=3.0)
    assert lh_configs.use_tma(lh_configs.config_for(x), x, w, None) == tma
    cw = (torch.rand(v, generator=torch.Generator().manual_seed(2)) + 0.5).to(DEV) if class_w else None
    lce_check(x, w, b, t, weight=cw, reduction=reduction, label_smoothing=smoothing, softcap=softcap)
    check_log_probs_entropy(x, w, b, t, backend="triton", softcap=softcap)


# slow (the full suite runs them all): the descriptor and torch-product variants of the larger arrangements, and
# the three largest altogether (7-14 s each under the interpreter); the quick run keeps the other arrangements with
# the kernel's products, both other variants on the small ones (and test_tensor_descriptors), and
# test_skip_workspaces' wide and split plans.
LARGE_WORKSPACES = {"alias_split_k", "second_pass_tail_split", "first_pass_split", "wide_chunks", "own_acc",
                    "wide_scratch"}

LARGEST_WORKSPACES = {"second_pass_tail_split", "first_pass_split", "wide_chunks"}


@pytest.mark.parametrize("name,products", [
    pytest.param(n, p, marks=pytest.mark.slow if n in LARGEST_WORKSPACES or (p != "kernel" and n in LARGE_WORKSPACES)
                 else ())
    for n in WORKSPACES for p in ("kernel", "kernel-tma", "torch")])
def test_backward_workspaces(tune, name, products, monkeypatch):
    # products: the gradient products by _dgrad_kernel, reading dz, x and W through descriptors where the workspace
    # is aligned ("kernel-tma") or not, or by torch's matmuls (on the CPU in float32; cuBLAS on CUDA)
    dtype, n, d, v, cols, needs, sms, *budget = WORKSPACES[name]
    cfg = lh_configs.config_for(torch.empty(1, device=DEV)).replace(grad_tma=products == "kernel-tma")
    records = []  # what each backward decided (Tuning.debug_backwards)
    tune(linear_config=cfg, torch_products=products == "torch", debug_backwards=records)
    tune(scratch_bytes=n * cols * torch.empty((), dtype=dtype).element_size())
    monkeypatch.setattr(lh_configs, "backward_sms", lambda device: sms)
    x, w, b, t = case(dtype, n=n, d=d, v=v, bias=True, scale=2.0)
    xs = [x, w, b]
    ours_in = [a.detach().clone().requires_grad_(k in needs) for a, k in zip(xs, "xwb", strict=True)]
    ours = logitless.linear_cross_entropy(*ours_in[:2], t, linear_bias=ours_in[2], backend="triton",
                                          reduction="sum", label_smoothing=0.1,
                                          workspace_bytes=budget[0] if budget else 0)
    theirs_in = [a.detach().clone().requires_grad_(k in needs) for a, k in zip(xs, "xwb", strict=True)]
    theirs = testing.naive_linear_cross_entropy(*theirs_in[:2], t, linear_bias=theirs_in[2], upcast=False,
                                                  reduction="sum", label_smoothing=0.1)
    t64_in = [a.detach().double().requires_grad_(k in needs) for a, k in zip(xs, "xwb", strict=True)]
    truth = testing.naive_linear_cross_entropy(*t64_in[:2], t, linear_bias=t64_in[2], reduction="sum",
                                                 label_smoothing=0.1)
    assert_within_rule("loss", ours, theirs, truth)
    ours_grads = grads(ours, ours_in)
    for grad_name, go, gt, g64 in zip([f"d_{k}" for k in needs], ours_grads, grads(theirs, theirs_in),
                                      grads(truth, t64_in), strict=True):
        assert_within_rule(grad_name, go, gt, g64)
    (rec,) = records
    # the torch products (a bias gradient alone needs none) run under float32-only cuBLAS reductions
    on_torch = [p for p in rec.products if p.torch]
    assert bool(on_torch) == (products == "torch" and needs != "b"), rec.products
    assert all(p.fp32_reductions for p in on_torch)
    if name == "first_pass_split" and products != "torch":
        # the balanced split of a launch of both products: fewer tokens per split than N
        assert any(p.k_per_split < n and p.splits > 1 for p in rec.products if p.dw and p.dx), rec.products
    if name == "second_pass_tail_split" and products != "torch":
        # split partials in the dW rows after their chunk: the storage of the weight's gradient
        dw_at = ours_grads[1].untyped_storage().data_ptr()
        assert any(p.partials == dw_at for p in rec.products), rec.products
    if name in ("own_acc", "wide_scratch", "alias_both"):
        # every dW row in the first pass with an accumulator of its own; else the accumulator in dW's last rows
        own = rec.dx_acc != ours_grads[1].untyped_storage().data_ptr()
        assert own == (rec.dw_end == v) == (name == "own_acc")
        assert tuple(rec.workspace) == (4 * n * cols * 2 if name != "alias_both" else n * cols * 2, name == "own_acc")


# The forward's stash of logits in the weight gradient's buffer (linear_head.stash_layout), used when the gradient
# products are torch's (cuBLAS on CUDA; forced here on the CPU, where they run in float32).
@pytest.fixture
def stash_spy(tune, monkeypatch):
    """Forces the stash's conditions and records the addresses of (stash buffer, dW returned) of each backward that
    used one (not the tensors: a reference held here would make autograd copy the gradient). The interpreter's
    tiles on a GPU too: the GPU's first-pass chunks (8192 classes) leave the tests' small heads no room to stash."""
    tune(torch_products=True, linear_config=lh_configs.interpreter_config())
    used = []
    backward = lh.backward

    def spy(*a, **kw):
        out = backward(*a, **kw)
        if kw.get("stash") is not None:
            used.append((kw["stash"].data_ptr(), out[1].data_ptr()))
        return out

    monkeypatch.setattr(triton_backend, "backward", spy)
    return used


# (dtype, N, D, V, bias, options): N < D and N > D, softcap, smoothing with class weights, z-loss, a frozen input
STASH_CASES = [
    (torch.bfloat16, 20, 100, 700, True, dict(softcap=5.0, label_smoothing=0.1)),
    (torch.float16, 37, 45, 300, False, dict(z_loss=1e-3, reduction="sum")),
    (torch.bfloat16, 50, 64, 900, False, dict(class_weight=True, label_smoothing=0.2, reduction="none")),
    (torch.bfloat16, 64, 32, 900, True, dict(frozen_input=True)),
]


@pytest.mark.parametrize("dtype,n,d,v,bias,opts", STASH_CASES)
def test_stash(stash_spy, dtype, n, d, v, bias, opts):
    opts = dict(opts)
    frozen = opts.pop("frozen_input", False)
    if opts.pop("class_weight", False):
        opts["weight"] = (torch.rand(v, generator=torch.Generator().manual_seed(2)) + 0.5).to(DEV)
    x, w, b, t = case(dtype, n=n, d=d, v=v, bias=bias, ignore_frac=0.25, scale=3.0)
    x[3] *= 200  # a row of extreme logits (|z| ~ 1e2-1e3)
    if frozen:
        wo, bo = leaves(w, b)
        ours = logitless.linear_cross_entropy(x, wo, t, linear_bias=bo, backend="triton", **opts)
        wt, bt = leaves(w, b)
        theirs = testing.naive_linear_cross_entropy(x, wt, t, linear_bias=bt, upcast=False, **opts)
        w64, b64 = leaves(w.double(), b.double())
        truth = testing.naive_linear_cross_entropy(x.double(), w64, t, linear_bias=b64, **opts)
        assert_within_rule("loss", ours, theirs, truth)
        for name, go, gt, g64 in zip(("d_weight", "d_bias"), grads(ours, [wo, bo]), grads(theirs, [wt, bt]),
                                     grads(truth, [w64, b64]), strict=True):
            assert_within_rule(name, go, gt, g64)
    else:
        lce_check(x, w, b, t, **opts)
    assert len(stash_spy) == 1
    stash, dw = stash_spy[0]
    assert dw == stash  # the gradient is written into the forward's buffer, not a copy
    lay = lh.stash_layout(x, w, not frozen, None)
    assert lay is not None and lay.classes >= 64 and lay.classes % 64 == 0


@pytest.mark.parametrize("n", [48, 37])
def test_stash_descriptor_store(tune, stash_spy, monkeypatch, n):
    # The forward writes the stash through a tensor descriptor where its operands use descriptors and the stash's
    # rows are 16-byte aligned (N % 8 == 0: 48, with a partial token block); else with pointer stores (37).
    if lh_configs.TensorDescriptor is None:
        pytest.skip("no tensor descriptors in this Triton")
    tune(linear_config=lh_configs.config_for(torch.empty(1, device=DEV)).replace(tma=True))
    made = []
    real = lh_configs.TensorDescriptor

    class Spy(real):
        @classmethod
        def from_tensor(cls, t, block_shape):
            made.append((t.dtype, tuple(t.shape), tuple(block_shape)))
            return real.from_tensor(t, block_shape)

    monkeypatch.setattr(lh_configs, "TensorDescriptor", Spy)
    x, w, b, t = case(torch.bfloat16, n=n, d=48, v=700, bias=True, ignore_frac=0.25, scale=3.0)
    x[3] *= 200  # extreme logits: clamped entries of the stash
    lce_check(x, w, b, t, label_smoothing=0.1, softcap=5.0)
    assert len(stash_spy) == 1
    lay = lh.stash_layout(x, w, True, None)
    cfg = lh_configs.config_for(x)
    stash_desc = [m for m in made if m[0] == torch.float16]
    assert stash_desc == ([(torch.float16, (lay.classes, n), (cfg.block_v, cfg.block_n))] if n % 8 == 0 else [])


def test_stash_log_probs_entropy(stash_spy):
    # Temperature and softcap (the stash holds the transformed logits), the entropy's gradient (its B term uses
    # z - m from the stash), and linear_logsumexp.
    x, w, b, t = case(torch.bfloat16, n=20, d=100, v=700, bias=True, ignore_frac=0.25, scale=3.0)
    check_log_probs_entropy(x, w, b, t, backend="triton", softcap=5.0, temperature=0.7)
    check_logsumexp(x, w, b, backend="triton")
    assert len(stash_spy) == 2


def test_stash_spent_once(stash_spy):
    # While the graph is kept (retain_graph=True) no backward reads the stash: each recomputes, so any number of them
    # give the same gradients bit for bit, the backward that frees the graph included. A backward that builds a graph
    # recomputes too; the ordinary single backward reads the stash (within rounding of the recomputed ones).
    x, w, b, t = case(torch.bfloat16, n=20, d=100, v=700, ignore_frac=0.25, scale=3.0)
    # The dense plans, which keep the stash: skipping off (skip_gate would probe it at this head's second call).
    lce = functools.partial(logitless.linear_cross_entropy, backend="triton", skip_threshold=None)
    xo, wo = leaves(x, w)
    loss = lce(xo, wo, t)
    first = [g.clone() for g in torch.autograd.grad(loss, (xo, wo), retain_graph=True)]
    second = [g.clone() for g in torch.autograd.grad(loss, (xo, wo), retain_graph=True)]
    last = torch.autograd.grad(loss, (xo, wo))
    assert len(stash_spy) == 0
    for a, c, e in zip(first, second, last, strict=True):
        assert torch.equal(a, c) and torch.equal(a, e)
    xo, wo = leaves(x, w)
    single = torch.autograd.grad(lce(xo, wo, t), (xo, wo))
    assert len(stash_spy) == 1
    for a, c in zip(first, single, strict=True):
        assert rel_err(a, c.double()) < 4e-3
    xo, wo = leaves(x, w)
    loss = lce(xo, wo, t)
    graph = torch.autograd.grad(loss, (xo, wo), create_graph=True)
    assert len(stash_spy) == 1
    for a, c in zip(first, graph, strict=True):
        assert rel_err(a, c.detach().double()) < 4e-3
    with pytest.raises(RuntimeError, match="not differentiable"):
        torch.autograd.grad(graph[0].float().sum(), xo)


def test_stash_becomes_the_gradient(stash_spy):
    # .backward(): the weight's .grad is the forward's buffer itself (AccumulateGrad takes it over, no copy).
    x, w, _, t = case(torch.bfloat16, n=20, d=100, v=700)
    xo, wo = leaves(x, w)
    logitless.linear_cross_entropy(xo, wo, t, backend="triton").backward()
    (stash, _), = stash_spy
    assert wo.grad.data_ptr() == stash and xo.grad is not None


def test_stash_memory(tune, stash_spy):
    # Forward + backward with the stash holds one V x D buffer, the weight's gradient itself: nothing else of that
    # size (a zero "upstream gradient" of the stash output once was), beyond the small scratch.
    from logitless.apps.bench.measure import _cpu_peak

    if DEV != "cpu":
        pytest.skip("CPU allocation events")
    tune(scratch_bytes=20 * 64 * 2)
    x, w, _, t = case(torch.bfloat16, n=20, d=100, v=700)
    xo, wo = leaves(x, w)

    def extra():
        xo.grad = wo.grad = None
        peak, _ = _cpu_peak(lambda: logitless.linear_cross_entropy(xo, wo, t, backend="triton").backward())
        return peak - xo.grad.nbytes - wo.grad.nbytes

    with_stash = extra()
    assert len(stash_spy) == 1
    tune(stash_logits=False)
    plain = extra()  # (the CPU stand-in of the products makes float32 copies of its operands)
    assert len(stash_spy) == 1
    assert with_stash < plain + wo.numel() * 2 // 4, (with_stash, plain)


def test_stash_conditions(tune, monkeypatch):
    x, w, _, t = case(torch.bfloat16, n=20, d=100, v=700)
    tune(torch_products=True, linear_config=lh_configs.interpreter_config())  # the class counts below are its tiles'
    assert lh.stash_layout(x, w, True, None) is not None
    assert lh.stash_layout(x.float(), w.float(), True, None) is None  # float32: dx accumulates in place
    tune(stash_logits=False)
    assert lh.stash_layout(x, w, True, None) is None
    tune(stash_logits=True)
    tune(torch_products=False)  # _dgrad_kernel reads dz row-major only
    assert lh.stash_layout(x, w, True, None) is None
    tune(torch_products=True)
    # (the lean plan: the float32 dx accumulator in dW's last rows leaves room for 576 classes; the default policy
    # gives it its own buffer, and all of dW is room)
    tune(stash_min_flop=2 * 20 * 100 * 576)  # the recomputation it saves here, 576 classes
    assert lh.stash_layout(x, w, True, 0).classes == 576
    assert lh.stash_layout(x, w, True, None).classes > 576
    tune(stash_min_flop=2 * 20 * 100 * 576 + 1)
    assert lh.stash_layout(x, w, True, 0) is None
    tune(stash_min_flop=0)
    used = []
    monkeypatch.setattr(triton_backend, "forward_stats", functools.partial(
        lambda f, *a, **kw: used.append(kw.get("stash") is not None) or f(*a, **kw), lh.forward_stats))
    xo, wo = leaves(x, w)
    with torch.no_grad():
        logitless.linear_cross_entropy(xo, wo, t, backend="triton")  # no graph: no stash
    logitless.linear_cross_entropy(x, w, t, backend="triton")  # no weight gradient: no buffer to keep it in
    logitless.linear_cross_entropy(xo, wo, t, backend="triton", skip_threshold=2**-12)  # skipping plans alone
    assert used == [False, False, False]


def test_fp32_reductions_restore_user_settings():
    # While the backward's products run through cuBLAS, reductions are float32 only; the user's settings (here
    # non-defaults) come back afterwards, also after an error.
    get = (torch._C._get_cublas_allow_bf16_reduced_precision_reduction,
           torch._C._get_cublas_allow_fp16_reduced_precision_reduction,
           torch._C._get_cublas_allow_fp16_accumulation)
    before = tuple(f() for f in get)
    try:
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = (False, False)
        torch._C._set_cublas_allow_fp16_accumulation(True)
        user = tuple(f() for f in get)
        assert not lh.Fp32Reductions.active()
        with pytest.raises(RuntimeError, match="inside"), lh.Fp32Reductions():
            with lh.Fp32Reductions():  # reentrant: the inner exit keeps float32 reductions on
                pass
            inside = tuple(f() for f in get)
            active = lh.Fp32Reductions.active()
            raise RuntimeError("inside")
        assert [v if isinstance(v, bool) else v[0] for v in inside] == [False, False, False] and active
        assert tuple(f() for f in get) == user and not lh.Fp32Reductions.active()
    finally:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = before[0]
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = before[1]
        torch._C._set_cublas_allow_fp16_accumulation(before[2])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_narrow_heads_keep_dz_in_float32(dtype):
    """Below Tuning.narrow_d features the half-precision backward is the float32 backward of the same numbers, cast
    back (bitwise), and closer to the float64 truth than with dL/dz rounded to the input dtype."""
    g = torch.Generator().manual_seed(5)
    n, d, v = 37, 3, 131
    x = (torch.randn(n, d, generator=g) * 3).to(dtype)
    w = torch.randn(v, d, generator=g).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)

    def grads_of(xx, ww, **kw):
        xx, ww = xx.clone().requires_grad_(), ww.clone().requires_grad_()
        logitless.linear_cross_entropy(xx, ww, t, z_loss=1e-3, backend="triton", **kw).backward()
        return xx.grad, ww.grad

    gx, gw = grads_of(x, w)
    fx, fw = grads_of(x.float(), w.float())
    assert gx.dtype == dtype and torch.equal(gx, fx.to(dtype)) and torch.equal(gw, fw.to(dtype))
    from logitless.kernels import tuning

    with tuning(narrow_d=0):  # dL/dz in the input dtype
        hx, hw = grads_of(x, w)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    testing.naive_linear_cross_entropy(x64, w64, t, z_loss=1e-3).backward()
    err = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
    assert err(gx, x64.grad) <= err(hx, x64.grad) and err(gw, w64.grad) <= err(hw, w64.grad)


def dz_launches(records):
    """The dz launches of the backwards recorded in `records` (Tuning.debug_backwards), in order."""
    return [launch for rec in records for launch in rec.dz]


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_softcap_dz_tiles(tune, softcap):
    # With a softcap, the dz launches that recompute their logits take Config.cap_dz_block_v classes (the slope is
    # one more live tile), the stash's launches the forward's tile (its layout); without one, dz_block_v everywhere.
    # The gradients stay within the rule either way.
    # (the interpreter's own config keeps one dz tile: numpy's products round differently per tile shape, and the
    # backward's logits must be the forward's bitwise; at this scale the difference is within the rule)
    cfg = lh_configs.interpreter_config().replace(cap_dz_block_v=32)
    records = []
    tune(torch_products=True, linear_config=cfg, debug_backwards=records)
    x, w, b, t = case(torch.bfloat16, n=48, d=48, v=700, bias=True, ignore_frac=0.25, scale=3.0)
    lce_check(x, w, b, t, softcap=softcap)
    seen = [(launch.block_v, launch.stashed) for launch in dz_launches(records)]
    assert any(stashed for _, stashed in seen), seen  # (the stash's launches are there to check)
    recomputed = {bv for bv, stashed in seen if not stashed}
    assert recomputed == {cfg.cap_dz_block_v if softcap else cfg.dz_block_v}, seen
    assert all(bv == cfg.block_v for bv, stashed in seen if stashed)


@pytest.mark.parametrize("softcap,bias,n,entropy", [(None, False, 48, False), (None, True, 37, False),
                                                     (5.0, True, 37, False), (None, True, 40, True)])
def test_persistent_dz(tune, softcap, bias, n, entropy):
    # Config.dz_persistent: the recomputing dz launches run a persistent grid (several tiles a program here) and
    # store dz through a descriptor, partial tiles included; the gradients are bitwise those of one program a
    # tile with pointer stores, and within the rule. A softcap or the entropy's term keep one program a tile.
    if lh_configs.TensorDescriptor is None:
        pytest.skip("no tensor descriptors in this Triton")
    base = lh_configs.config_for(torch.empty(1, device=DEV)).replace(tma=True)
    x, w, b, t = case(torch.bfloat16, n=n, d=48, v=700, bias=bias, ignore_frac=0.25, scale=3.0)
    def loss(xo, wo, bo):
        if entropy:
            lp, ent = logitless.linear_log_probs(xo, wo, t, linear_bias=bo, temperature=0.7, return_entropy=True,
                                                 backend="triton")
            return lp.sum() + ent.sum()
        return logitless.linear_cross_entropy(xo, wo, t, linear_bias=bo, softcap=softcap, label_smoothing=0.1,
                                              backend="triton")

    records = []
    tune(debug_backwards=records)
    grads = {}
    for persistent in (False, True):
        with logitless.kernels.tuning(linear_config=base.replace(dz_persistent=persistent)):
            xo, wo, bo = leaves(x, w, b)
            loss(xo, wo, bo).backward()
            grads[persistent] = [g.grad for g in (xo, wo, bo) if g is not None]
    for a, c in zip(grads[False], grads[True], strict=True):
        assert torch.equal(a, c)
    # (the skip gate's probe may skip on the second call: its launches walk hot pairs, Tuning.skip_dz_hot_list)
    seen = [(launch.programs, launch.persistent, launch.store_tma, launch.stashed) for launch in dz_launches(records)
            if not launch.skip]
    runs = [s for s in seen if s[1]]
    if softcap is not None or entropy:
        assert seen and not runs
    else:
        assert runs and all(s[2] for s in runs) and not any(s[3] for s in runs)
        assert any(s[0] < 4 for s in runs)  # fewer programs than tiles: a program walks several
    tune(linear_config=base.replace(dz_persistent=True))
    if entropy:
        check_log_probs_entropy(x, w, b, t, backend="triton", temperature=0.7)
    else:
        lce_check(x, w, b, t, softcap=softcap, label_smoothing=0.1)
