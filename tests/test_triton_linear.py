"""linear_cross_entropy / linear_log_probs / linear_logsumexp on the Triton path (the interpreter on CPU) against
float64, under the precision rule; tests marked gpu run the four issue shapes, int64 offsets and determinism.

Small shapes (N=37, D=45, V=300) leave partial tiles in every direction with the interpreter's tiles (32 x 64 x 32).
Every test runs with outputs and workspaces poisoned with NaN, so an element that is never written fails the rule.
"""

import functools
import heapq
import itertools
import math

import pytest
import torch

import logitless
from logitless import kernels, testing
from logitless.apps.bench import data
from logitless.kernels import linear_head as lh
from logitless.kernels._common import INTERPRETER_SMS_FORWARD
from logitless.kernels.linear_head import backward_kernels as lh_kernels
from logitless.kernels.linear_head import configs as lh_configs
from logitless.kernels.linear_head import plans as lh_plans
from logitless.kernels.linear_head import products as lh_products
from logitless.linear_cross_entropy import class_counts
from tests.helpers import (
    assert_compiled_matches_eager,
    assert_within_rule,
    check_against_truth,
    check_log_probs_entropy,
    check_logsumexp,
    grads,
    leaves,
    make_case,
    rel_err,
    spy_launches,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def case(*args, **kw):
    """tests.helpers.make_case on the device the kernels run on."""
    return tuple(None if a is None else a.to(DEV) for a in make_case(*args, **kw))


@pytest.fixture(autouse=True)
def poison(tune):
    tune(debug_poison=True)
    # The forward's stash wherever it fits (its threshold of saved work is for GPU-sized heads; where the products
    # are torch's, test_stash_conditions checks the threshold itself).
    tune(stash_min_flop=0)


def lce_check(x, w, b, t, **kw):
    up = None
    if kw.get("reduction") == "none":  # a random upstream gradient, made on the kernels' device
        up = torch.randn(t.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(DEV)
    check_against_truth(logitless.linear_cross_entropy, testing.naive_linear_cross_entropy, x, w, b, t,
                        upstream=up, backend="triton", **kw)


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


def test_tensor_descriptor_conditions():
    # Descriptors only where the copy engine can read the operands; pointer loads everywhere else.
    cfg = lh_configs.config_for(torch.empty(1, device=DEV)).replace(tma=True)
    x = torch.randn(9, 48, dtype=torch.bfloat16, device=DEV)
    w = torch.randn(70, 48, dtype=torch.bfloat16, device=DEV)
    assert lh_configs.use_tma(cfg, x, w, None) or lh_configs.TensorDescriptor is None
    assert not lh_configs.use_tma(cfg.replace(tma=False), x, w, None)
    assert not lh_configs.use_tma(cfg, x, w, torch.arange(70, dtype=torch.int32, device=DEV))  # a vocabulary order
    # 96-byte row strides
    assert lh_configs.use_tma(cfg, x[:, :45], w[:, :45], None) or lh_configs.TensorDescriptor is None
    assert not lh_configs.use_tma(cfg, x[:, :45].contiguous(), w[:, :45].contiguous(), None)  # 90-byte row strides
    assert not lh_configs.use_tma(cfg, x, w.T.contiguous().T, None)  # no unit last stride
    assert not lh_configs.use_tma(cfg, x.view(-1)[1:].as_strided((8, 48), (48, 1)), w, None)  # base 2 bytes off


# The tiles each kind of CUDA device gets (linear_head.gpu_config: Hopper-class shared memory, A100's, and the 99 KB of
# sm_86 / sm_89 / sm_120 cards), run at a shape with partial blocks and tiles in every direction; on the CPU through
# the interpreter (descriptors emulated where the tier uses them). tools/compile_check.py compiles the same tiers
# for each architecture and checks their shared memory.
GPU_TIERS = [(9, 232448), (8, 166912), (8, 101376), (12, 101376)]


@pytest.mark.parametrize("major,smem", GPU_TIERS)
def test_gpu_tiers(tune, major, smem):
    cfg = lh.gpu_config(torch.bfloat16, major, smem)
    assert cfg.tma == cfg.grad_tma == (major >= 9)
    assert (cfg.block_v, cfg.block_k) == ((256, 64) if smem >= 200 * 1024 else (128, 32))
    assert lh.gpu_config(torch.float32, major, smem) == lh_configs.fp32_config()
    tune(linear_config=cfg)
    x, w, b, t = case(torch.bfloat16, n=200, d=48, v=700, bias=True, ignore_frac=0.25, scale=3.0)
    lce_check(x, w, b, t, label_smoothing=0.1)
    check_log_probs_entropy(x, w, b, t, backend="triton")


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


# Where the backward's workspaces live (kernels/linear_head/plans.py, _plan): each case forces one arrangement with a
# small Tuning.scratch_bytes. (dtype, N, D, V, scratch columns, which inputs require grad, SMs seen by the launcher[,
# the caller's workspace_bytes])
WORKSPACES = {
    # bf16, both gradients: dz of D classes in dx, dx accumulator in the last 2N rows of dW; the second pass puts
    # one chunk's dz into still-unwritten dW rows and the last into the scratch.
    "alias_both": (torch.bfloat16, 37, 130, 300, 32, "xwb", 2),
    # ... and the second pass splits the token reduction (few dW tiles, many SMs): float32 partials + sum kernel.
    "alias_split_k": (torch.bfloat16, 140, 64, 300, 120, "xw", 16),
    # ... and the second pass's last chunks, whose dz fills the scratch, put the split partials of their few dW
    # tiles into the dW rows after them (odd N and D).
    "second_pass_tail_split": (torch.bfloat16, 257, 33, 650, 32, "xw", 16),
    # ... and the first pass splits the token reduction of its few dW tiles next to the dx tiles (small D, many SMs).
    "first_pass_split": (torch.bfloat16, 200, 40, 500, 32, "xwb", 16),
    # ... and wide first-pass chunks (128, then 64 classes) put their dz into dW rows after them, then chunks of D.
    "wide_chunks": (torch.bfloat16, 100, 40, 1500, 32, "xwb", 2),
    # float32: dx accumulates in place; dz goes to the scratch, several chunks.
    "fp32_in_place": (torch.float32, 37, 45, 300, 64, "xwb", 2),
    # frozen head: dx only, its float32 accumulator is allocated.
    "dx_only": (torch.float16, 37, 130, 300, 32, "x", 2),
    # frozen input: dW (and bias) only, dz in the scratch.
    "dw_only": (torch.bfloat16, 37, 45, 300, 64, "wb", 2),
    "bias_only": (torch.bfloat16, 37, 45, 300, 64, "b", 2),
    # V < 2N: the dx accumulator does not fit in dW and is allocated.
    "small_vocab": (torch.bfloat16, 70, 80, 100, 64, "xwb", 2),
    # workspace_bytes of 4 N D bytes more than 4 scratches: the dx accumulator gets its own buffer (no second pass),
    # the scratch is 4 times the default.
    "own_acc": (torch.bfloat16, 37, 130, 700, 32, "xwb", 2, 4 * 37 * 130 + 4 * 37 * 32 * 2),
    # ... only 4 scratches: the accumulator stays in dW, the second pass's last chunk in the scratch is wider (one
    # chunk of 124 classes where the default makes two).
    "wide_scratch": (torch.bfloat16, 37, 130, 700, 32, "xwb", 2, 4 * 37 * 32 * 2),
}


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
    tune(linear_config=cfg, torch_products=products == "torch")
    entered = []  # the torch products run under float32-only cuBLAS reductions

    class Fp32Reductions(lh_products._Fp32Reductions):
        def __enter__(self):
            entered.append(self)
            return super().__enter__()

    monkeypatch.setattr(lh_products, "_Fp32Reductions", Fp32Reductions)
    plans, workspaces = [], []
    make_plan, workspace = lh_plans._plan, lh_plans._workspace
    monkeypatch.setattr(lh_plans, "_plan", lambda *a: plans.append(make_plan(*a)) or plans[-1])
    monkeypatch.setattr(lh_plans, "_workspace", lambda *a: workspaces.append(tuple(workspace(*a))) or workspace(*a))
    tune(scratch_bytes=n * cols * torch.empty((), dtype=dtype).element_size())
    monkeypatch.setattr(lh_configs, "backward_sms", lambda device: sms)
    chosen = []
    balanced = lh_plans._balanced_split
    monkeypatch.setattr(lh_plans, "_balanced_split", lambda *a: chosen.append(balanced(*a)) or chosen[-1])
    part_bytes = []  # the storage size behind each launch's split partials: the scratch's, or dW's
    sum_splits = lh_kernels._sum_splits_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(part, *args, **kw):
                part_bytes.append(part.untyped_storage().nbytes())
                return sum_splits[grid](part, *args, **kw)
            return launch

    monkeypatch.setattr(lh_kernels, "_sum_splits_kernel", Recorder())
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
    assert bool(entered) == (products == "torch" and needs != "b")  # (a bias gradient alone needs no product)
    if name == "first_pass_split" and products != "torch":
        assert any(k < n for k in chosen), chosen
    if name == "second_pass_tail_split" and products != "torch":
        assert v * d * 2 in part_bytes, part_bytes
    (plan,) = plans
    if name in ("own_acc", "wide_scratch", "alias_both"):
        # every dW row in the first pass with an accumulator of its own; else the accumulator in dW's last rows
        own = plan.dx_acc.untyped_storage().data_ptr() != ours_grads[1].untyped_storage().data_ptr()
        assert own == (plan.dw_end == v) == (name == "own_acc")
        # (asked by the backward's plan, and by the stash's layout in forward and backward with torch's products)
        assert set(workspaces) == {(4 * n * cols * 2 if name != "alias_both" else n * cols * 2, name == "own_acc")}


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

    monkeypatch.setattr(lh, "backward", spy)
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
    xo, wo = leaves(x, w)
    loss = logitless.linear_cross_entropy(xo, wo, t, backend="triton")
    first = [g.clone() for g in torch.autograd.grad(loss, (xo, wo), retain_graph=True)]
    second = [g.clone() for g in torch.autograd.grad(loss, (xo, wo), retain_graph=True)]
    last = torch.autograd.grad(loss, (xo, wo))
    assert len(stash_spy) == 0
    for a, c, e in zip(first, second, last, strict=True):
        assert torch.equal(a, c) and torch.equal(a, e)
    xo, wo = leaves(x, w)
    single = torch.autograd.grad(logitless.linear_cross_entropy(xo, wo, t, backend="triton"), (xo, wo))
    assert len(stash_spy) == 1
    for a, c in zip(first, single, strict=True):
        assert rel_err(a, c.double()) < 4e-3
    xo, wo = leaves(x, w)
    loss = logitless.linear_cross_entropy(xo, wo, t, backend="triton")
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
    monkeypatch.setattr(lh, "forward_stats", functools.partial(
        lambda f, *a, **kw: used.append(kw.get("stash") is not None) or f(*a, **kw), lh.forward_stats))
    xo, wo = leaves(x, w)
    with torch.no_grad():
        logitless.linear_cross_entropy(xo, wo, t, backend="triton")  # no graph: no stash
    logitless.linear_cross_entropy(x, w, t, backend="triton")  # no weight gradient: no buffer to keep it in
    logitless.linear_cross_entropy(xo, wo, t, backend="triton", skip_threshold=2**-12)  # skipping plans alone
    assert used == [False, False, False]


# Planning only (meta tensors, GPU tiles): the issue shapes and smaller ones, N < D and N > D, with and without the
# input's gradient and with an accumulator of its own. Replays the first pass's memory: a stashed chunk's logits and
# maxima are intact until it reads them, every dz region and dW row range written stays off data still needed.
@pytest.mark.parametrize("n,d,v,need_dx,budget", [
    (8192, 2304, 256000, True, 0), (16384, 4096, 128256, True, 0), (8192, 5120, 131072, True, 0),
    (16384, 1024, 151936, True, 0), (4096, 4096, 128256, True, 0), (1024, 2048, 32000, True, 0),
    (4096, 2048, 32000, False, 0), (16384, 4096, 128256, True, 4 * 16384 * 4096 + (256 << 20)),
    (512, 4096, 32000, True, 0), (8192, 2304, 256000, True, None), (16384, 4096, 128256, True, None),
    (8192, 5120, 131072, True, None), (16384, 768, 50257, True, None)])
def test_stash_layout_timeline(tune, n, d, v, need_dx, budget):
    tune(linear_config=lh_configs.hopper_config(), torch_products=True)
    cfg = lh_configs.hopper_config()
    meta = dict(device="meta", dtype=torch.bfloat16)
    x, w = torch.empty(n, d, **meta), torch.empty(v, d, **meta)
    lay = lh.stash_layout(x, w, need_dx, budget)
    ws = lh_plans._workspace(n, v, d, 2, budget)
    plan = lh_plans._plan(x, torch.empty(n, d, **meta) if need_dx else None, w, n, v, d, cfg, False, ws)
    end = plan.dw_free if need_dx else v * d  # the dx accumulator's first element, where it lives in dW
    assert lay is not None and lay.classes % cfg.block_v == 0 and lay.classes <= plan.dw_end
    # the room is used: fewer than one chunk's worth of classes (plus its tile maxima) would still fit
    per_class = max(n, d) + 2 * n / cfg.block_v
    assert (end - lay.zo_at - 2 * n * lay.classes // cfg.block_v) < (lay.chunk + cfg.block_v) * per_class
    zo = (lay.zo_at, lay.zo_at + 2 * n * lay.classes // cfg.block_v)
    assert lay.at + n * lay.classes <= zo[0] and zo[1] <= end
    chunks = lh_plans._first_pass(n, v, d, cfg, plan, False, True, lay)
    stashed = [c for c in chunks if c[3]]
    assert [c[:2] for c in stashed] == [(v0, min(v0 + lay.chunk, lay.classes)) for v0 in
                                        range(0, lay.classes, lay.chunk)]
    assert chunks[:len(stashed)] == stashed  # they go first

    def overlaps(a, b):
        return a[0] < b[1] and b[0] < a[1]

    written = []  # element ranges of dW written so far
    for v0, v1, dz_at, is_stashed in chunks:
        rows = (v0 * d, min(v1, plan.dw_end) * d) if v0 < plan.dw_end else None
        if is_stashed:
            dz = (lay.at + v0 * n, lay.at + v1 * n)  # read (logits) and written (dz) in place
            later = (lay.at + v1 * n, lay.at + lay.classes * n)  # the logits of the chunks to come
            for r in written + [rows]:
                assert not overlaps(r, dz) and not overlaps(r, later) and not overlaps(r, zo)
        elif dz_at is not None:
            dz = (dz_at, dz_at + n * (v1 - v0))
            assert dz[1] <= end and not any(overlaps(r, dz) for r in written + [rows] if r)
        if rows:
            written.append(rows)
    if lay.classes >= 2 * lay.chunk:
        assert lay.classes / v > {8192: 0.25, 16384: 0.04, 4096: 0.3, 1024: 0.75, 512: 0.75}[n]


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
        with pytest.raises(RuntimeError, match="inside"), lh_products._Fp32Reductions():
            with lh_products._Fp32Reductions():  # reentrant: the inner exit keeps float32 reductions on
                pass
            inside = tuple(f() for f in get)
            raise RuntimeError("inside")
        assert [v if isinstance(v, bool) else v[0] for v in inside] == [False, False, False]
        assert tuple(f() for f in get) == user
    finally:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = before[0]
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = before[1]
        torch._C._set_cublas_allow_fp16_accumulation(before[2])


def test_balanced_split():
    # One program per SM, dW tiles first: few long dW tiles next to many short dx tiles are split; many dW tiles
    # (large D) are not. (qwen3-small's and llama3-8b's first-pass launches on 132 SMs.)
    assert lh_plans._balanced_split(16384, 32, 512, 16, 132, 64, 64, 2) == 8192
    assert lh_plans._balanced_split(16384, 512, 2048, 64, 132, 64, 64, 1) == 16384
    assert lh_plans._balanced_split(16384, 512, 2048, 64, 132, 64, 64, 4) == 16384
    assert lh_plans._balanced_split(16384, 32, 512, 16, 132, 64, 64, 1) == 16384  # no room for partials


def _makespan(n_blocks, layout, sms, group):
    """Finish time, in tiles, of the forward's programs dispatched in launch order to the first free one of `sms`
    multiprocessors (one program each at a time; a program costs its tiles plus 0.1)."""
    n_big, a, n_small, b = layout
    free = [0.0] * sms

    def phase(sizes):
        for first in range(0, n_blocks, group):  # _grouped: a group's blocks, split by split
            for size in sizes:
                for _ in range(min(group, n_blocks - first)):
                    heapq.heappush(free, heapq.heappop(free) + size + 0.1)

    phase([a] * n_big)
    phase([b] * n_small)
    return max(free)


@pytest.mark.parametrize("n_blocks,n_vtiles", [(64, 1000), (128, 501), (64, 512), (128, 594), (32, 125),
                                               (64, 594), (256, 501), (16, 197), (1, 501), (3, 196), (512, 125),
                                               (8, 1024), (151, 640), (339, 971)])
def test_forward_layout_covers_and_balances(n_blocks, n_vtiles):
    # Every tile of a row in exactly one split; on 132 SMs (an H100 / H200), the two phases end within 2% of the
    # even share at the issue shapes (the first four; equal splits: 3.4-4.3% above), and never later than equal
    # splits do (the first layout the planner considers).
    sms, group, waves = 132, 8, 8
    n_big, a, n_small, b = layout = lh_plans._fwd_layout(n_blocks, n_vtiles, sms, group, waves)
    rest = n_vtiles - n_big * a
    assert n_big >= 1 and a >= 1 and rest >= 0
    assert (n_small == 0) == (rest == 0)
    if n_small:
        assert (n_small - 1) * b < rest <= n_small * b
    end = _makespan(n_blocks, layout, sms, group)
    share = n_blocks * n_vtiles / sms
    tps = -(-n_vtiles // max(1, min(n_vtiles, round(waves * sms / n_blocks))))
    equal = (n_vtiles // tps, tps, int(n_vtiles % tps > 0), n_vtiles % tps)
    assert end <= _makespan(n_blocks, equal, sms, group) + 1e-9
    if (n_blocks, n_vtiles) in [(64, 1000), (128, 501), (64, 512), (128, 594)]:
        assert end <= 1.02 * share, (layout, end / share)
        assert _makespan(n_blocks, equal, sms, group) >= 1.03 * share


def test_forward_layout_under_the_interpreter_uses_both_phases():
    # The layout is in chunks of chunk_tiles tiles (the partials' unit). At the batch-invariance test's N = 100, V =
    # 600 on 32 x 64 tiles, programs of several chunks in both phases (a restart of the running statistics inside a
    # program, and a merge of partials from both phases).
    cfg = lh_configs.interpreter_config()
    n_tiles = -(-600 // cfg.block_v)
    n_chunks = -(-n_tiles // cfg.chunk_tiles)
    layout = lh_plans._fwd_layout(-(-100 // cfg.block_n), n_chunks, INTERPRETER_SMS_FORWARD, cfg.group, cfg.waves)
    assert layout[0] >= 1 and layout[1] >= 2 and layout[2] >= 1, layout


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


def test_bad_deterministic_flag():
    x, w, _, t = case(torch.float32)
    with pytest.raises(TypeError, match="deterministic"):
        logitless.linear_cross_entropy(x, w, t, backend="triton", deterministic=1)


# ----------------------------------------------------------------------------------------------------------------
# Sparsity: cold (token block x tile) pairs skipped by the backward. The interpreter's tiles are 32 tokens x 64
# classes, so N = 70, V = 300 make 3 token blocks (the last partial) and 5 tiles (the last of 44 classes).

TAU = 2.0**-12  # the threshold that is safe for bf16/fp16 (skipping is off by default)


@pytest.fixture
def small_tiles(tune):
    # These tests spell out tile maps for the interpreter's 32 x 64 tiles: on a GPU they run with those tiles too.
    # Their maps are by the rows' own order: the plan's grouping of rows is tested on its own.
    tune(linear_config=lh_configs.interpreter_config(), skip_group_rows=False)


def peaked(dtype, hot_sets, n=70, d=24, v=300, seed=0):
    """A head whose rows hold their mass on three 'hot' classes each (a peaked softmax, like a trained LM's). The
    hot classes' W rows are distinct unit vectors, the other rows small and random; row i of token block b has
    x_i = 20 (e_a + e_b) + 18 e_c for three classes drawn from hot_sets[b % len(hot_sets)], and target a. Every other
    class holds ~e^-15 of the row's mass, so a tile is cold for a block where none of its rows has a hot class."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(v, d, generator=g) * (0.3 / d**0.5)
    hot = sorted({c for cs in hot_sets for c in cs})
    for k, c in enumerate(hot):
        w[c] = 0.0
        w[c, k] = 1.0
    x = torch.randn(n, d, generator=g) * 0.1
    t = torch.empty(n, dtype=torch.long)
    for i in range(n):
        cs = hot_sets[(i // 32) % len(hot_sets)]
        a, b, c = (cs[j] for j in torch.randperm(len(cs), generator=g)[:3].tolist())
        x[i, hot.index(a)] += 20.0
        x[i, hot.index(b)] += 20.0
        x[i, hot.index(c)] += 18.0
        t[i] = a
    return x.to(dtype).to(DEV), w.to(dtype).to(DEV), t.to(DEV)


def skip_check(x, w, b, t, tune, needs="xwb", **kw):
    """Loss and gradients of the Triton path (with kw: skip_threshold, vocab_order, ...) against float64 under the
    error rule; returns (the backward's skip plans, our gradients)."""
    plans = []
    tune(debug_plans=plans)
    opts = {k: kw.pop(k) for k in ("skip_threshold", "vocab_order", "workspace_bytes") if k in kw}
    ins = {}
    outs = {}
    for name in ("ours", "torch", "f64"):
        ins[name] = [None if a is None else (a.double() if name == "f64" else a).detach().clone().requires_grad_(
            k in needs) for a, k in zip((x, w, b), "xwb", strict=True)]
        xi, wi, bi = ins[name]
        if name == "ours":
            outs[name] = logitless.linear_cross_entropy(xi, wi, t, linear_bias=bi, backend="triton", **opts, **kw)
        else:
            outs[name] = testing.naive_linear_cross_entropy(xi, wi, t, linear_bias=bi, upcast=name == "f64", **kw)
    assert_within_rule("loss", outs["ours"], outs["torch"], outs["f64"])
    gs = {name: grads(outs[name], ins[name]) for name in outs}
    names = [f"d_{k}" for k, a in zip("xwb", (x, w, b), strict=True) if a is not None and k in needs]
    for name, go, gt, g64 in zip(names, gs["ours"], gs["torch"], gs["f64"], strict=True):
        assert_within_rule(name, go, gt, g64)
    return plans, gs["ours"]


def test_skip_peaked_bf16(tune, small_tiles):
    # Block 0 uses hot classes of tile 0, block 1 of tile 1, block 2 of tiles 0 and 3; two rows have targets in
    # tiles that are otherwise cold for their block (a tile holding a target is never skipped), two are ignored.
    x, w, t = peaked(torch.bfloat16, [[1, 2, 3, 4], [70, 71, 72, 73], [1, 2, 200, 201]])
    t[5], t[40], t[10], t[45] = 150, 290, -100, -100
    plans, _ = skip_check(x, w, None, t, tune, skip_threshold=TAU)
    (plan,) = plans
    expected = torch.tensor([[1, 0, 1, 0, 0], [0, 1, 0, 0, 1], [1, 0, 0, 1, 0]], dtype=torch.uint8)
    assert torch.equal(plan.hot.cpu(), expected)
    assert (plan.row_bound <= TAU).all() and (plan.row_bound > 0).any()
    assert (plan.row_bound[t == -100] == 0).all()  # ignored rows lose nothing: their coefficients are 0


def test_skip_nothing_on_uniform_data_or_by_default(tune, small_tiles):
    # Near-uniform softmax (initialisation): every pair holds ~BLOCK_V / V of each row's mass, far above the budget.
    head = data.make_head("uniform", 37, 24, 300, dtype=torch.bfloat16, seed=3, device=DEV)
    plans, _ = skip_check(head.input, head.weight, None, head.target, tune, skip_threshold=TAU)
    assert len(plans) == 1 and bool(plans[0].hot.all()) and (plans[0].row_bound == 0).all()
    # Skipping is opt-in: no plan by default, on peaked data in any dtype.
    for dtype in (torch.bfloat16, torch.float32):
        x, w, t = peaked(dtype, [[1, 2, 3, 4]], n=32)
        xo, wo = leaves(x, w)
        grads(logitless.linear_cross_entropy(xo, wo, t, backend="triton"), [xo, wo])
    assert plans == [plans[0]]


def test_skip_bound_stops_skipping(tune, small_tiles):
    # Hot classes in tile 0; tile 1 random (cold: ~1e-7 of the mass); tiles 2, 3, 4 hold exactly 0.45, 0.45 and
    # 0.31 x TAU of every row's mass (zero W rows, a bias): each is cold alone, but skipping all three would lose
    # 1.2 TAU, so the plan must stop after two of them (tile 4, then 2 or 3).
    x, w, t = peaked(torch.bfloat16, [[1, 2, 3, 4]], n=40)
    w[128:] = 0
    z = x.double() @ w.double().T
    lse = torch.logsumexp(z[:, :128], 1)
    b = torch.zeros(300, dtype=torch.float64, device=DEV)
    b[128:] = lse.min() + math.log(0.45 * TAU / 64)
    b = b.to(torch.bfloat16)
    plans, (dx, dw, db) = skip_check(x, w, b, t, tune, skip_threshold=TAU)
    (plan,) = plans
    hot = plan.hot.cpu()
    assert (hot[:, 0] == 1).all() and (hot[:, 1] == 0).all() and (hot[:, 4] == 0).all()
    assert (hot[:, 2] + hot[:, 3] == 1).all()
    # The bound holds the skipped mass (float64, from the same bf16 inputs), and it is what stopped the skipping.
    p = torch.softmax(x.double() @ w.double().T + b.double(), 1)
    cold_cols = (1 - hot).repeat_interleave(64, 1)[:, :300].repeat_interleave(32, 0)[:40].to(DEV)
    skipped = (p * cold_cols).sum(1)
    assert (skipped <= plan.row_bound.double() * (1 + 1e-4)).all() and (plan.row_bound <= TAU).all()
    assert all(plan.row_bound[i:i + 32].max() > 0.6 * TAU for i in (0, 32))  # each block's tightest row
    tiles = torch.empty(lh.tile_grid(x, w), device=DEV, dtype=torch.float16)
    m, logs, *_ = lh.forward_stats(x, w, b, t, None, softcap=None, inv_temp=1.0, want_smooth=False,
                                   want_entropy=False, tile_lse=tiles)
    a = torch.ones_like(m)
    loose = lh.skip_plan(tiles, m, logs, a, t, None, 300, 2 * TAU, 32, 64, group_rows=False)
    assert (loose.hot.cpu()[:, 1:] == 0).all()  # with twice the budget, all four go
    # Skipped pairs are not computed: tile 1 is cold for every block, so its dW rows and bias gradient are exactly 0.
    assert (dw[64:128] == 0).all() and (db[64:128] == 0).all() and (dw[:64] != 0).any()


def test_vocab_order_groups_hot_classes(tune, small_tiles):
    # Hot classes one per tile: in identity order every tile is hot for every block. Ordered by the batch's target
    # counts (within the ranges the bf16 workspace layout allows, here [0, 192) and [192, 300)), they share two
    # tiles and the other three go cold. Bias and dW rows go back to their own classes.
    hot_classes = [5, 70, 141, 210, 280]
    x, w, t = peaked(torch.bfloat16, [hot_classes], n=40)
    b = (torch.randn(300, generator=torch.Generator().manual_seed(7)) * 0.1).to(torch.bfloat16).to(DEV)
    t[3] = -100
    # (the leanest plan: with the default policy's own accumulator the order has one range, [0, 300))
    plans, _ = skip_check(x, w, b, t, tune, skip_threshold=TAU, vocab_order="batch", workspace_bytes=0)
    xo, wo = leaves(x, w)
    grads(logitless.linear_cross_entropy(xo, wo, t, skip_threshold=TAU, backend="triton", workspace_bytes=0),
          [xo, wo])
    assert bool(plans[1].hot.all())
    position = torch.argsort(lh.vocab_order(class_counts(t, 300, -100), x, w, 0))  # the order the call used
    tiles = sorted({int(position[c]) // 64 for c in hot_classes})
    assert len(tiles) == 2
    expected = torch.zeros(2, 5, dtype=torch.uint8)
    expected[:, tiles] = 1
    assert torch.equal(plans[0].hot.cpu(), expected)


def interleaved(dtype, n=64, d=24, v=300, seed=0):
    """Rows alternate between two kinds: even rows hold their mass on classes of tile 0 alone, odd rows on classes
    of tiles 1 and 3 (the interpreter's 64-class tiles). In the rows' own order every 32-row block needs tiles 0, 1
    and 3; grouped by how many tiles they need, half the blocks need tile 0 alone and the others tiles 1 and 3."""
    x0, w, t0 = peaked(torch.float32, [[1, 2, 3, 4]], n=n, d=d, v=v, seed=seed)
    x1, _, t1 = peaked(torch.float32, [[70, 71, 200, 201]], n=n, d=d, v=v, seed=seed)
    # (peaked gives both the same W: the hot classes 1-4, 70, 71, 200, 201 are unit vectors of distinct columns in
    # each call's own numbering, so rebuild W for all eight)
    hot = [1, 2, 3, 4, 70, 71, 200, 201]
    g = torch.Generator().manual_seed(seed + 1)
    w = torch.randn(v, d, generator=g) * (0.3 / d**0.5)
    x = torch.randn(n, d, generator=g) * 0.1
    t = torch.empty(n, dtype=torch.long)
    for i in range(n):
        cs = hot[:4] if i % 2 == 0 else hot[4:]
        a, b, c = (cs[j] for j in torch.randperm(4, generator=g)[:3].tolist())
        for cls, lift in ((a, 20.0), (b, 20.0), (c, 18.0)):
            x[i, hot.index(cls)] += lift
        t[i] = a
    for k, c in enumerate(hot):
        w[c] = 0.0
        w[c, k] = 1.0
    return x.to(dtype).to(DEV), w.to(dtype).to(DEV), t.to(DEV)


def test_skip_groups_rows(tune, small_tiles):
    # The plan groups rows by how many tiles they need: interleaved rows whose blocks share nothing cold in their own
    # order share most of it once grouped. The gradients come back in the input's row order (checked against float64
    # by skip_check) and every row keeps within its budget.
    x, w, t = interleaved(torch.bfloat16)
    plans, _ = skip_check(x, w, None, t, tune, skip_threshold=TAU)
    (own,) = plans
    assert own.rows is None and own.hot[:, [0, 1, 3]].all()
    tune(skip_group_rows=True)
    plans, _ = skip_check(x, w, None, t, tune, skip_threshold=TAU)
    (grouped,) = plans
    rows = grouped.rows.cpu()
    assert torch.equal(rows.sort().values, torch.arange(64))
    parity = (rows % 2).view(2, 32)  # each block holds one kind of row
    assert (parity == parity[:, :1]).all() and parity[0, 0] != parity[1, 0]
    hot = grouped.hot.cpu()
    kinds = [hot[b] for b in range(2)]
    need = {0: torch.tensor([1, 0, 0, 0, 0]), 1: torch.tensor([0, 1, 0, 1, 0])}
    for b in range(2):
        assert torch.equal(kinds[b], need[int(parity[b, 0])].to(torch.uint8))
    assert int(grouped.hot.sum()) < int(own.hot.sum())
    assert (grouped.row_bound <= TAU).all() and (grouped.row_bound > 0).any()


def test_skip_vocab_stored_by_mass(tune, small_tiles):
    # Every block's hot classes are scattered over tiles 0-3 in id order, so nothing but tile 4 is cold; with the
    # head stored by the mass of another sample (VocabOrder), they fill tile 0 and the plan skips tiles 1-4 for every
    # block. The sorted problem's loss and gradients stay within the error rule against float64.
    hot_sets = [[1, 70, 140, 210], [2, 71, 141, 211], [3, 72, 142, 212]]
    x, w, t = peaked(torch.bfloat16, hot_sets, n=96)
    plans, _ = skip_check(x, w, None, t, tune, skip_threshold=TAU)
    assert plans[0].hot[:, :4].all()
    sample = peaked(torch.bfloat16, hot_sets, n=96, seed=1)[0]
    order = logitless.VocabOrder.by_mass(sample, w)
    assert set(order.ids[:12].tolist()) == {c for cs in hot_sets for c in cs}
    plans, (dx, dw) = skip_check(x, order.sort(w), None, order.map_ids(t), tune, skip_threshold=TAU)
    assert torch.equal(plans[0].hot.cpu(), torch.tensor([[1, 0, 0, 0, 0]] * 3, dtype=torch.uint8))
    # The same gradients as the problem in id order, up to the permutation of dW's rows.
    xo, wo = leaves(x, w)
    ref = grads(logitless.linear_cross_entropy(xo, wo, t, backend="triton"), [xo, wo])
    torch.testing.assert_close(dx.float(), ref[0].float(), rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(order.unsort(dw).float(), ref[1].float(), rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("split,deal_pct", [(4, 100.0), (3, 0.0), (2, 100.0)])
def test_skip_dx_split(tune, small_tiles, split, deal_pct):
    # The skipping backward may deal each dx tile's reduction steps out to several programs (float32 partials added
    # after the last chunk); dealt out (deal_pct 100) or not (0), the gradients hold the error rule, and equal the
    # undealt ones to float32 rounding.
    x, w, t = peaked(torch.bfloat16, [[1, 2, 3, 4], [70, 71, 72, 73], [1, 2, 200, 201]], n=96)
    tune(skip_dx_split=1)
    _, ref = skip_check(x, w, None, t, tune, skip_threshold=TAU)
    tune(skip_dx_split=split, skip_dx_deal_pct=deal_pct)
    _, got = skip_check(x, w, None, t, tune, skip_threshold=TAU)
    torch.testing.assert_close(got[0].float(), ref[0].float(), rtol=1e-2, atol=1e-4)
    torch.testing.assert_close(got[1].float(), ref[1].float(), rtol=0, atol=0)  # dW: the same programs


def test_skip_auto_budget(tune, small_tiles):
    # skip_threshold="auto": each row may lose 2^-11 max(1, |m_i|) of its mass in bfloat16 (2^-14 in float16), a
    # quarter of the rounding of its largest logit to the dtype; float32 inputs skip nothing. Tile 4 holds 3 x 2^-12
    # of every row's mass (zero W rows and a bias): too much for the fixed 2^-12, within the budget of rows whose
    # largest logit is ~20.
    x, w, t = peaked(torch.bfloat16, [[1, 2, 3, 4], [70, 71, 72, 73]], n=64)
    w[256:] = 0
    lse = torch.logsumexp(x.double() @ w.double().T, 1)
    b = torch.zeros(300, dtype=torch.float64, device=DEV)
    b[256:] = lse.min() + math.log(3 * TAU / 44)
    b = b.to(torch.bfloat16)
    fixed, _ = skip_check(x, w, b, t, tune, skip_threshold=TAU)
    auto, _ = skip_check(x, w, b, t, tune, skip_threshold="auto")
    assert fixed[0].hot[:, 4].all() and not auto[0].hot[:, 4].any()
    m = (x.double() @ w.double().T + b.double()).amax(1)
    assert (auto[0].row_bound.double() <= 2.0**-11 * m.abs().clamp(min=1) * (1 + 1e-3)).all()
    assert (auto[0].row_bound > 2 * TAU).all()
    plans = []
    tune(debug_plans=plans)
    for dtype, none in ((torch.float16, False), (torch.float32, True)):
        plans.clear()
        x, w, t = peaked(dtype, [[1, 2, 3, 4], [70, 71, 72, 73]], n=64)
        xo, wo = leaves(x, w)
        grads(logitless.linear_cross_entropy(xo, wo, t, skip_threshold="auto", backend="triton"), [xo, wo])
        assert (plans == []) == none


def test_skip_bound_holds_when_cold_rows_align(tune, small_tiles):
    # Adversarial: the skipped classes' W rows all point the same way, long (norm 40) and far from every x, so their
    # mass is cold but each unit of it moves dx a long way, all in one direction. The error the skipping adds to
    # each row of dx stays within the documented bound: row_bound_i |A_i| max_j ||w_j||.
    n, d, v = 64, 24, 300
    x, w, t = peaked(torch.float32, [[1, 2, 3, 4], [70, 71, 72, 73]], n=n, d=d, v=v)
    x, w = x.cpu(), w.cpu()
    u = torch.zeros(d)
    u[-1] = 1.0
    x[:, -1] = 0.2
    cold = torch.tensor([c for c in range(v) if c not in (1, 2, 3, 4, 70, 71, 72, 73)])
    w[cold] = 40.0 * u
    # a cold class's logit is 8 = 40 x 0.2 against 20 for the top ones: ~e^-12 each, ~2e-3 of a row in all
    x, w = x.to(torch.bfloat16).to(DEV), w.to(torch.bfloat16).to(DEV)
    tau = 2.0**-8
    out = {}
    for name, thr in (("skip", tau), ("dense", 0.0)):
        plans = []
        tune(debug_plans=plans)
        xo, wo = leaves(x, w)
        out[name] = grads(logitless.linear_cross_entropy(xo, wo, t, reduction="sum", skip_threshold=thr,
                                                         backend="triton"), [xo, wo])[0].double()
        if thr:
            (plan,) = plans
    assert not plan.hot.all()
    bound = plan.row_bound.double() * w.double().norm(dim=1).max()
    diff = (out["skip"] - out["dense"]).norm(dim=1)
    rounding = 2.0**-7 * out["dense"].norm(dim=1)  # the two bf16 results' own rounding
    assert (diff <= bound + rounding + 1e-6).all()
    assert (diff > rounding).any()  # the skipped mass does move dx, along u


# Workspace arrangements (WORKSPACES above) with skipping and a vocabulary order: aligned chunks, dW rows written
# through the order (also from split-K partials), the second pass's dz in dW rows, the dx-only and V < 2N plans;
# and skipping in the vocabulary's own order with wide first-pass chunks (dz in unwritten dW rows, aligned).
# slow: the three larger arrangements; the quick run keeps their plans (test_backward_workspaces), skipping in the
# vocabulary's own order (the skip tests above) and skipping through an order in the five smaller ones here.
@pytest.mark.parametrize("name,order", [("alias_both", "batch"), ("alias_split_k", "batch"), ("dx_only", "batch"),
                                        ("dw_only", "batch"), ("small_vocab", "batch"),
                                        pytest.param("wide_chunks", "none", marks=pytest.mark.slow),
                                        pytest.param("own_acc", "counts", marks=pytest.mark.slow),
                                        pytest.param("wide_scratch", "counts", marks=pytest.mark.slow)])
def test_skip_workspaces(tune, name, order, monkeypatch, small_tiles):
    dtype, n, d, v, cols, needs, sms, *budget = WORKSPACES[name]
    wide, orders, second = [], [], []
    first_pass, make_order, second_pass = lh_plans._first_pass, lh.vocab_order, lh_plans._second_pass
    monkeypatch.setattr(lh_plans, "_first_pass", lambda *a: wide.append(first_pass(*a)) or wide[-1])
    monkeypatch.setattr(lh, "vocab_order", lambda *a: orders.append(make_order(*a)) or orders[-1])
    monkeypatch.setattr(lh_plans, "_second_pass", lambda *a: second.append(second_pass(*a)) or second[-1])
    tune(scratch_bytes=n * cols * torch.empty((), dtype=dtype).element_size())
    monkeypatch.setattr(lh_configs, "backward_sms", lambda device: sms)
    x, w, t = peaked(dtype, [[1, 2, 3, 40], [70, 71, 72, 20], [5, 6, 90, 91]], n=n, d=d, v=v)
    b = (torch.randn(v, generator=torch.Generator().manual_seed(7)) * 0.1).to(dtype).to(DEV)
    if order == "counts":  # per-class counts that reorder every range of the vocabulary
        order = torch.rand(v, generator=torch.Generator().manual_seed(3)).to(DEV)
    plans, _ = skip_check(x, w, b, t, tune, needs=needs, reduction="sum", skip_threshold=TAU,
                          vocab_order=order, workspace_bytes=budget[0] if budget else 0)
    assert len(plans) == 1 and not bool(plans[0].hot.all())
    assert any(dz_at is not None for chunks in wide for _, _, dz_at, _ in chunks) == (isinstance(order, str)
                                                                                 and order == "none")
    # The order was made for the backward's workspaces: each second-pass chunk (it writes back only its own rows)
    # holds its own classes.
    for perm in orders:
        for v0, v1, _ in (c for chunks in second for c in chunks):
            assert torch.equal(perm[v0:v1].sort().values.cpu().long(), torch.arange(v0, v1)), (v0, v1)


@pytest.mark.parametrize("budget_mib", [0, 64, 300, None])
def test_vocab_order_follows_workspace(tune, budget_mib):
    # At llama3-8b's shape with the GPU tiles (planning only, meta tensors): the lean plan (0), a larger scratch that
    # moves the second pass's chunk boundaries (64 MiB), or no second pass (300 MiB, and the default policy's 400
    # MiB: the accumulator's own buffer). The order made for that budget keeps each of the backward's second-pass
    # chunks on its own classes.
    tune(linear_config=lh_configs.hopper_config())
    n, d, v = 16384, 4096, 128256
    budget = None if budget_mib is None else budget_mib << 20
    meta = dict(device="meta", dtype=torch.bfloat16)
    x, w = torch.empty(n, d, **meta), torch.empty(v, d, **meta)
    perm = lh.vocab_order(torch.rand(v, generator=torch.Generator().manual_seed(0)), x, w, budget)
    ws = lh_plans._workspace(n, v, d, 2, budget)
    plan = lh_plans._plan(x, torch.empty(n, d, **meta), w, n, v, d, lh_configs.hopper_config(), True, ws)
    chunks = lh_plans._second_pass(n, v, d, 2, lh_configs.hopper_config(), plan.dw_end, True, ws.scratch)
    own = budget_mib in (300, None)
    assert (plan.dw_end == v) == own and bool(chunks) == (not own)
    for v0, v1, _ in chunks + [(0, plan.dw_end, None)]:
        assert torch.equal(perm[v0:v1].sort().values.long(), torch.arange(v0, v1)), (v0, v1)
    assert not torch.equal(perm.long(), torch.arange(v))


def test_skip_log_probs(tune, small_tiles):
    # linear_log_probs skips too (its gradient is p_j A - C [j = t]; with return_entropy it never does: see
    # test_log_probs_and_entropy).
    x, w, t = peaked(torch.bfloat16, [[1, 2, 3, 4], [70, 71, 72, 73]], n=40)
    plans = []
    tune(debug_plans=plans)
    up = torch.randn(40, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(DEV)
    check_against_truth(functools.partial(logitless.linear_log_probs, skip_threshold=TAU),
                        testing.naive_linear_log_probs, x, w, None, t, upstream=up, backend="triton")
    assert len(plans) == 1 and not bool(plans[0].hot.all())


def test_workspace_bytes_log_probs_and_module(tune, monkeypatch):
    # The budget reaches the backward from linear_log_probs (with the entropy's B term), linear_logsumexp and the
    # loss module: the accumulator gets its own buffer; results within the rule.
    tune(scratch_bytes=37 * 32 * 2)
    budget = 4 * 37 * 130 + 37 * 32 * 2
    seen = []
    workspace = lh_plans._workspace
    monkeypatch.setattr(lh_plans, "_workspace", lambda *a: seen.append(workspace(*a).own_acc) or workspace(*a))
    x, w, b, t = case(torch.bfloat16, n=37, d=130, v=300, bias=True, scale=2.0)
    up = torch.randn(37, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(DEV)
    check_against_truth(functools.partial(logitless.linear_log_probs, temperature=0.8, workspace_bytes=budget),
                        functools.partial(testing.naive_linear_log_probs, temperature=0.8), x, w, b, t,
                        upstream=up, backend="triton")
    xo, wo = leaves(x, w)
    lse = logitless.linear_logsumexp(xo, wo, workspace_bytes=budget, backend="triton")
    ref = torch.logsumexp(xo.detach().double() @ wo.detach().double().T, dim=-1)
    assert rel_err(lse, ref) < 1e-5
    grads(lse.sum(), [xo, wo])
    loss_fn = logitless.LinearCrossEntropyLoss(workspace_bytes=budget, backend="triton")
    assert "workspace_bytes=" in repr(loss_fn)
    xo, wo = leaves(x, w)
    grads(loss_fn(xo, wo, t), [xo, wo])
    # three backwards, each with its own accumulator (on a GPU the forwards' stash layouts read the plan too)
    assert len(seen) >= 3 and all(seen)


def test_bad_workspace_bytes():
    x, w, _, t = case(torch.bfloat16)
    for bad, err in ((-1, ValueError), (1 << 63, ValueError), (1.5, TypeError), (True, TypeError), ("8MB", TypeError)):
        for fn, args in ((logitless.linear_cross_entropy, (x, w, t)), (logitless.linear_log_probs, (x, w, t)),
                         (logitless.linear_logsumexp, (x, w))):
            with pytest.raises(err, match="workspace_bytes"):
                fn(*args, workspace_bytes=bad, backend="triton")


def test_module_running_vocab_order():
    # LinearCrossEntropyLoss(vocab_order="running") keeps decayed target counts across training steps (on the
    # device) and passes them as the order; evaluation does not update them.
    x, w, t = peaked(torch.bfloat16, [[1, 2, 3, 4], [70, 71, 72, 73]], n=40, v=130)
    loss_fn = logitless.LinearCrossEntropyLoss(skip_threshold=TAU, vocab_order="running", backend="triton")
    counts = None
    for _ in range(2):
        xo, wo = leaves(x, w)
        loss = loss_fn(xo, wo, t)
        counts = loss_fn.vocab_counts.clone()
        g = grads(loss, [xo, wo])
    batch = torch.bincount(t.cpu(), minlength=130).float()
    torch.testing.assert_close(counts.cpu(), batch * 0.99 + batch)
    xo, wo = leaves(x, w)
    same = logitless.linear_cross_entropy(xo, wo, t, skip_threshold=TAU, vocab_order=counts, backend="triton")
    assert torch.equal(same, loss) and all(torch.equal(a, c) for a, c in zip(grads(same, [xo, wo]), g, strict=True))
    loss_fn.eval()
    loss_fn(x, w, t)
    assert torch.equal(loss_fn.vocab_counts, counts)


def test_bad_skip_options():
    x, w, _, t = case(torch.bfloat16)
    for bad, err in ((-0.1, ValueError), (1.0, ValueError), ("0.1", ValueError), ("Auto", ValueError),
                     (b"auto", TypeError), (True, TypeError)):
        with pytest.raises(err, match="skip_threshold"):
            logitless.linear_cross_entropy(x, w, t, skip_threshold=bad, backend="triton")
    with pytest.raises(ValueError, match="skip_threshold"):
        logitless.linear_log_probs(x, w, t, skip_threshold=2.0, backend="triton")
    for bad, err in (("frequency", ValueError), (torch.ones(299, device=DEV), ValueError),
                     (torch.ones(300, dtype=torch.bool, device=DEV), TypeError)):
        with pytest.raises(err, match="vocab_order"):
            logitless.linear_cross_entropy(x, w, t, vocab_order=bad, backend="triton")
    with pytest.raises(ValueError, match="vocab_order"):
        logitless.LinearCrossEntropyLoss(vocab_order="batches")


# ----------------------------------------------------------------------------------------------------------------
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


@pytest.mark.parametrize("n,d,v,wide,expect", [
    (100, 40, 1500, 160, (True, True)), (16384, 1024, 151936, 4096, (True, True)),
    (8192, 2304, 256000, 4096, (True, True)), (16384, 4096, 128256, 4096, (False, False)),
    (37, 130, 300, 160, (False, False)), (300, 40, 500, 160, (True, False)), (100, 40, 1500, 0, (False, False))])
@pytest.mark.parametrize("aligned", [False, True])
def test_first_pass_chunks(n, d, v, wide, expect, aligned):
    # Every class once; a chunk's dz borrowed from dW lies in rows not written yet and not the accumulator's.
    cfg = (lh_configs.hopper_config() if n > 1000 else lh_configs.interpreter_config()).replace(wide=wide)
    start, dw_end = lh_plans._acc_region(n, v, d, cfg, aligned) if v * d >= 2 * n * d + 8 else (v * d, v)
    chunk = lh_plans._round_chunk(d, cfg.block_v, aligned)
    plan = lh_plans._Plan(None, chunk, None, dw_end, True, start)
    chunks = lh_plans._first_pass(n, v, d, cfg, plan, aligned, True)
    written = []  # dW row ranges written so far (the first pass writes its chunks' rows below dw_end)
    seen = []
    for v0, v1, dz_at, stashed in chunks:
        assert not stashed
        assert v0 < v1 and (v1 <= dw_end or v0 >= dw_end)
        if aligned:
            assert v0 % cfg.block_v == 0
        mine = (v0, min(v1, dw_end))
        if dz_at is not None:
            assert v1 - v0 > chunk or v1 in (dw_end, v)  # wider than the plan's chunk, unless cut at an end
            lo, hi = dz_at, dz_at + n * lh_plans.dz_cols(v1 - v0)  # dz's rows are 16-byte aligned
            assert 0 <= lo and hi <= start
            assert not any(a * d < hi and b * d > lo for a, b in written + [mine] if a < b)
        written.append(mine)
        seen.append((v0, v1))
    seen.sort()
    assert seen[0][0] == 0 and seen[-1][1] == v
    assert all(a[1] == b[0] for a, b in itertools.pairwise(seen))
    assert any(dz_at is not None for _, _, dz_at, _ in chunks) == expect[aligned]


def test_workspace_chunks_capped_at_wide(tune):
    # Planning only (meta tensors, GPU tiles): a caller's scratch widens the first pass's chunks up to cfg.wide
    # classes and no further (32768-class chunks measured slower), never below the default scratch's width.
    tune(linear_config=lh_configs.hopper_config())
    cfg = lh_configs.hopper_config()
    meta = dict(device="meta", dtype=torch.bfloat16)
    for n, d, v in ((4096, 4096, 128256), (8192, 2304, 256000), (512, 64, 32000)):
        x = torch.empty(n, d, **meta)
        widths = {}
        for name, budget in (("lean", 0), ("default", None), ("ws", 4 * n * d + (256 << 20))):
            ws = lh_plans._workspace(n, v, d, 2, budget)
            plan = lh_plans._plan(x, torch.empty(n, d, **meta), torch.empty(v, d, **meta), n, v, d, cfg, False, ws)
            chunks = lh_plans._first_pass(n, v, d, cfg, plan, False, True)
            widths[name] = max(v1 - v0 for v0, v1, *_ in chunks)
            assert chunks[0][0] == plan.dw_end % v and chunks[-1][1] in (v, plan.dw_end)
        default_cols = lh_plans._scratch_cols(n, 2, cfg.block_v)
        assert max(widths["ws"], widths["default"]) <= max(cfg.wide, default_cols), (n, widths)
        assert lh_plans._scratch_cols(n, 2, cfg.block_v, False, 256 << 20, cfg.wide) == max(
            min(cfg.wide, (256 << 20) // (2 * n)) // cfg.block_v * cfg.block_v, default_cols)


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


def spy_dz_launches(monkeypatch, record):
    """Each launch of the dz kernel until the test ends appends record(grid, its keyword arguments) to the list
    returned."""
    return spy_launches(monkeypatch, lh_kernels, "_dz_kernel", record)


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_softcap_dz_tiles(tune, monkeypatch, softcap):
    # With a softcap, the dz launches that recompute their logits take Config.cap_dz_block_v classes (the slope is
    # one more live tile), the stash's launches the forward's tile (its layout); without one, dz_block_v everywhere.
    # The gradients stay within the rule either way.
    # (the interpreter's own config keeps one dz tile: numpy's products round differently per tile shape, and the
    # backward's logits must be the forward's bitwise; at this scale the difference is within the rule)
    cfg = lh_configs.interpreter_config().replace(cap_dz_block_v=32)
    tune(torch_products=True, linear_config=cfg)
    seen = spy_dz_launches(monkeypatch, lambda grid, kw: (kw["BLOCK_V"], kw["LOAD_Z"]))
    x, w, b, t = case(torch.bfloat16, n=48, d=48, v=700, bias=True, ignore_frac=0.25, scale=3.0)
    lce_check(x, w, b, t, softcap=softcap)
    recomputed = {bv for bv, stashed in seen if not stashed}
    assert recomputed == {cfg.cap_dz_block_v if softcap else cfg.dz_block_v}, seen
    assert all(bv == cfg.block_v for bv, stashed in seen if stashed)


@pytest.mark.parametrize("softcap,bias,n,entropy", [(None, False, 48, False), (None, True, 37, False),
                                                     (5.0, True, 37, False), (None, True, 40, True)])
def test_persistent_dz(tune, monkeypatch, softcap, bias, n, entropy):
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

    seen = spy_dz_launches(monkeypatch, lambda grid, kw: (grid[0], kw["PERSISTENT"], kw["DZ_TMA"], kw["LOAD_Z"]))
    grads = {}
    for persistent in (False, True):
        with logitless.kernels.tuning(linear_config=base.replace(dz_persistent=persistent)):
            xo, wo, bo = leaves(x, w, b)
            loss(xo, wo, bo).backward()
            grads[persistent] = [g.grad for g in (xo, wo, bo) if g is not None]
    for a, c in zip(grads[False], grads[True], strict=True):
        assert torch.equal(a, c)
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
