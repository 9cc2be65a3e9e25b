"""cross_entropy on existing logits, Triton path (the interpreter on CPU), against float64 (the precision rule).

Small shapes run through the interpreter; tests marked gpu run the in-place kernel at real vocabulary sizes, where
its gradient units really wait for rows whose statistics other programs are still computing (the interpreter runs
programs one after another, in order, so there they never wait).
"""

import pytest
import torch

import logitless
from logitless.cross_entropy import CrossEntropyOutput
from logitless.kernels import Tuning
from logitless.kernels import cross_entropy as kce
from tests.helpers import DTYPES, check_cross_entropy

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DEFAULT = Tuning()


@pytest.fixture
def small_tiles(tune):
    """Tiles of 256 columns, two per program: V = 1000 spreads over 2 programs per row, the second one's last tile
    ragged (the split path: partial statistics merged by the last program, which writes the in-place gradient)."""
    tune(ce_tile_elems=256, ce_tiles_per_program=2, ce_stats_tile_elems=256, ce_stats_tiles=2, ce_min_block_v=64)


def make(n, v, dtype, scale=3.0, ignore_frac=0.25, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(n, v, generator=g) * scale).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < ignore_frac] = -100
    return z.to(DEV), t.to(DEV)


def check(z, t, inplace=False, upstream_seed=1, **kw):
    return check_cross_entropy(z, t, "triton", inplace, upstream_seed, **kw)


# (reduction, label_smoothing, z_loss, softcap, class weights, dtype, inplace): a covering set, not the product;
# every option appears with and without the split path, in place and not, in each dtype.
GRID = [
    ("mean", 0.0, 0.0, None, False, torch.float32, False),
    ("mean", 0.0, 0.0, None, False, torch.bfloat16, True),
    ("sum", 0.1, 0.0, None, False, torch.float16, True),
    ("none", 0.0, 1e-3, None, False, torch.float32, True),
    ("none", 0.0, 0.0, 5.0, False, torch.bfloat16, False),
    ("mean", 0.1, 1e-3, 5.0, True, torch.float32, True),
    ("mean", 0.2, 0.0, None, True, torch.bfloat16, False),
    ("sum", 0.0, 1e-3, 5.0, True, torch.float16, False),
    ("none", 0.3, 1e-3, 5.0, True, torch.bfloat16, True),
]


@pytest.mark.parametrize("reduction,smoothing,z_loss,softcap,class_w,dtype,inplace", GRID)
def test_split_rows(small_tiles, reduction, smoothing, z_loss, softcap, class_w, dtype, inplace):
    # V = 1000: two programs per row (see small_tiles); 25% ignored rows.
    z, t = make(17, 1000, dtype)
    cw = (torch.rand(1000, generator=torch.Generator().manual_seed(2)) + 0.5).to(DEV) if class_w else None
    check(z, t, inplace, weight=cw, reduction=reduction, label_smoothing=smoothing, z_loss=z_loss, softcap=softcap)


@pytest.mark.parametrize("bandwidth, expected", [
    (3.352e12, int(3.352e12 * DEFAULT.ce_inplace_lag_seconds)),  # H100 SXM: 6.0 MB
    (4.8e12, DEFAULT.ce_inplace_lag_bytes),  # H200: the 8 MiB it was tuned at
    (None, DEFAULT.ce_inplace_lag_bytes),  # the driver does not say
])
def test_in_place_lag_follows_dram_bandwidth(monkeypatch, bandwidth, expected):
    monkeypatch.setattr(kce.configs, "dram_bytes_per_s", lambda index: bandwidth)
    assert kce.inplace_lag_bytes(torch.device("cuda", 0)) == expected
    assert kce.inplace_lag_bytes(torch.device("cpu")) == DEFAULT.ce_inplace_lag_bytes


# slow: the quick run keeps every lag and tiling with the first options row, and every options row with every lag
# at V = 1000 in 2 tiles; the full run crosses all three.
@pytest.mark.parametrize("reduction,smoothing,z_loss,softcap,class_w,dtype,lag_bytes,v,tiles", [
    pytest.param(*g[:6], lag, v, tiles, marks=() if k == 0 or (v, tiles) == (1000, 2) else pytest.mark.slow)
    for k, g in enumerate(GRID[1::2]) for lag in (None, 1, 7 * 256 * 4, 1 << 30)
    for v, tiles in ((1000, 2), (500, 2), (1000, 4))])
def test_in_place_lag(small_tiles, tune, v, tiles, lag_bytes, reduction, smoothing, z_loss, softcap, class_w,
                      dtype):
    # The in-place gradient of rows longer than one tile, in the same launch `lag` work units behind the statistics
    # (1 byte is raised to K units, a whole row block; 7 x 256 x 4 bytes is 1-7 units; 1 GiB is lowered to all
    # units: every gradient after every statistic), or by a second launch (None). Tiles of 256 columns: V = 1000 is
    # 2 programs of 2 tiles per row, V = 500 one program of 2 tiles, and with 4 tiles one program whose last tile is
    # ragged.
    tune(ce_inplace_lag_bytes=lag_bytes, ce_inplace_tiles_per_program=tiles)
    z, t = make(17, v, dtype)
    cw = (torch.rand(v, generator=torch.Generator().manual_seed(2)) + 0.5).to(DEV) if class_w else None
    check(z, t, True, weight=cw, reduction=reduction, label_smoothing=smoothing, z_loss=z_loss, softcap=softcap)


def test_in_place_is_one_launch(small_tiles, tune, monkeypatch):
    # By default the in-place gradient of split rows comes from the forward launch: the second-launch kernel is
    # never called (the lagged tests above would pass on it too).
    def no_second_launch(*a, **k):
        raise AssertionError("in-place gradient written by a second launch")

    monkeypatch.setattr(kce.launch, "cross_entropy_bwd", no_second_launch)
    z, t = make(17, 1000, torch.bfloat16)
    check(z, t, True)
    tune(ce_inplace_lag_bytes=None)
    with pytest.raises(AssertionError, match="second launch"):
        check(z, t, True)


@pytest.mark.parametrize("reduction,smoothing,z_loss,softcap,class_w,dtype,inplace", GRID[::2])
def test_whole_rows(reduction, smoothing, z_loss, softcap, class_w, dtype, inplace):
    # V = 300 fits one tile; several rows per program (BLOCK_N > 1) with a ragged last row block.
    z, t = make(61, 300, dtype)
    cw = (torch.rand(300, generator=torch.Generator().manual_seed(2)) + 0.5).to(DEV) if class_w else None
    check(z, t, inplace, weight=cw, reduction=reduction, label_smoothing=smoothing, z_loss=z_loss, softcap=softcap)


@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_logits(small_tiles, dtype):
    # +-1e4 logits: the loss is computed as (max - z_t) + log(sum), so nothing cancels at that magnitude.
    z, t = make(9, 1000, dtype, scale=1e4)
    for inplace in (False, True):
        check(z, t, inplace, label_smoothing=0.1, z_loss=1e-8)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_logits_near_float_max(small_tiles, dtype):
    # |z| up to 3.2e38: m log2(e) overflows float32 there, so exponents must be (z - m) log2(e), never
    # z log2(e) - m log2(e); row 4's max is tied (p = 1/2 each). 2e8: rows one-hot after rounding.
    for scale in (2e8, 5e37):
        z, t = make(9, 1000, dtype, scale=scale)
        if scale > 1e37:
            z[::2, 7] = 3.0e38
            z[4, 5] = 3.0e38
            z[1::3, 11] = -3.2e38
            t[4] = 5
        assert torch.isfinite(z).all()
        for inplace in (False, True):
            check(z, t, inplace)


def test_all_ignored_and_empty(small_tiles):
    z, t = make(7, 1000, torch.float32)
    for zz, tt in ((z, torch.full_like(t, -100)), (z[:0], t[:0])):
        for red in ("mean", "sum", "none"):
            for inplace in (False, True):
                zo = zz.clone().requires_grad_(True)
                ours = logitless.cross_entropy(zo, tt, reduction=red, backend="triton", inplace_backward=inplace)
                ref = torch.nn.functional.cross_entropy(zz, tt, reduction=red)
                torch.testing.assert_close(ours, ref, equal_nan=True)
                (g,) = torch.autograd.grad(ours.sum(), zo)
                assert not g.isnan().any() and (g == 0).all()  # PyTorch's gradient is 0 there too


def test_return_lse_both_paths(small_tiles):
    z, t = make(2 * 5, 1000, torch.bfloat16)
    z3, t3 = z.reshape(2, 5, 1000), t.reshape(2, 5)
    truth = torch.logsumexp(5.0 * torch.tanh(z3.double() / 5.0), dim=-1)
    for backend in ("triton", "torch"):
        out = logitless.cross_entropy(z3.clone().requires_grad_(True), t3, softcap=5.0, reduction="none",
                                      return_lse=True, backend=backend)
        assert isinstance(out, CrossEntropyOutput)
        loss, lse = out
        assert loss.shape == lse.shape == (2, 5) and lse.dtype == torch.float32 and not lse.requires_grad
        torch.testing.assert_close(lse.double(), truth, rtol=1e-6, atol=1e-5)


def test_inplace_overwrites_and_guards():
    z, t = make(8, 300, torch.float32)
    for backend in ("triton", "torch"):
        zo = z.clone().requires_grad_(True)
        loss = logitless.cross_entropy(zo, t, inplace_backward=True, backend=backend)
        loss.backward(retain_graph=True)
        expected = torch.func.grad(lambda x: torch.nn.functional.cross_entropy(x, t))(z)
        torch.testing.assert_close(zo.grad, expected)
        torch.testing.assert_close(zo.detach(), expected)  # the logits now hold the gradient
        with pytest.raises(RuntimeError, match="only once"):
            loss.backward()
        # An op that saved the logits for its own backward is caught by the version counter, not silently wrong.
        x = z.clone().requires_grad_(True)
        y = torch.tanh(x)  # saves its output
        out = logitless.cross_entropy(y, t, inplace_backward=True, backend=backend)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.backward()


def test_inplace_without_grad_leaves_logits():
    z, t = make(8, 300, torch.bfloat16)
    zc = z.clone()
    logitless.cross_entropy(zc, t, inplace_backward=True, backend="triton")
    assert torch.equal(zc, z)


def test_upstream_scaling_skips_only_ones(small_tiles):
    # reduction="none" in place: rows whose upstream is exactly 1 are left as the forward wrote them.
    z, t = make(12, 1000, torch.float32, ignore_frac=0.0)
    up = torch.ones(12, device=DEV)
    up[3], up[7] = 2.5, 0.0
    zo = z.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(logitless.cross_entropy(zo, t, reduction="none", inplace_backward=True,
                                                       backend="triton"), zo, up)
    zr = z.clone().requires_grad_(True)
    (gr,) = torch.autograd.grad(torch.nn.functional.cross_entropy(zr, t, reduction="none"), zr, up)
    torch.testing.assert_close(g, gr)


def test_every_gradient_element_written(small_tiles):
    # The backward kernel into a NaN-poisoned buffer: every element must be overwritten.
    z, t = make(11, 1000, torch.bfloat16)
    loss, lse, stats = kce.cross_entropy_fwd(z, t, None, None, None, ignore_index=-100, label_smoothing=0.0,
                                             z_loss=0.0, softcap=None, write_grad=False)
    out = torch.full_like(z, float("nan"))
    kce.cross_entropy_bwd(torch.ones(11, device=DEV), z, t, None, None, None, stats, out, ignore_index=-100,
                          label_smoothing=0.0, z_loss=0.0, softcap=None)
    assert not out.isnan().any()
    assert not loss.isnan().any() and not lse.isnan().any()


def test_strided_rows_and_int32_target():
    # A row stride larger than V (a slice of a wider tensor) and int32 targets.
    zw, t = make(10, 400, torch.float32)
    z = zw[:, :300]
    t = torch.where(t >= 300, t - 300, t).to(torch.int32)
    check(z, t, label_smoothing=0.1)


def test_bad_inputs():
    z, t = make(4, 300, torch.float32)
    with pytest.raises(TypeError, match="inplace_backward"):
        logitless.cross_entropy(z, t, inplace_backward=1, backend="triton")
    with pytest.raises(TypeError, match="return_lse"):
        logitless.cross_entropy(z, t, return_lse="yes", backend="triton")
    with pytest.raises(TypeError, match="float64"):
        logitless.cross_entropy(z.double(), t, backend="triton")


# ---------------------------------------------------------------------------------------------------------------
# GPU: the in-place kernel at real vocabulary sizes.


@pytest.mark.gpu
@pytest.mark.parametrize("n,v", [(3, 128256), (200, 50257), (64, 256000), (1000, 32000)])
def test_gpu_fused(n, v):
    # N = 3: rows split over ~126 programs each; the others over 4 to 32.
    z, t = make(n, v, torch.bfloat16)
    check(z, t, inplace=True)
    check(z, t, inplace=True, label_smoothing=0.1, z_loss=1e-4, softcap=30.0, reduction="none")
    check(z, t, inplace=False, label_smoothing=0.1, z_loss=1e-4, softcap=30.0)
    cw = torch.rand(v, device=DEV) + 0.5
    check(z, t, inplace=True, weight=cw, label_smoothing=0.2, reduction="sum")
    for dtype in (torch.float16, torch.float32):
        z, t = make(n, v, dtype)
        check(z, t, inplace=True)


@pytest.mark.gpu
def test_gpu_fused_extreme_and_repeatable():
    z, t = make(256, 128256, torch.bfloat16, scale=1e4)
    g1 = check(z, t, inplace=True, label_smoothing=0.1, z_loss=1e-8)
    g2 = check(z, t, inplace=True, label_smoothing=0.1, z_loss=1e-8)
    # The merge order is fixed, so a race (a tile reading statistics before they are published) would show up
    # as a difference between two runs.
    assert torch.equal(g1, g2)
    # Extreme logits in every dtype: the fold subtracts the running max before scaling by log2(e) (at |z| ~ 1e4
    # a rounded m log2(e) alone would be off by ~1e-3 in the loss; at 5e37, m log2(e) is near float32's range).
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        z, t = make(256, 128256, dtype, scale=1e4)
        check(z, t, inplace=False)
    for scale in (2e8, 5e37):
        for dtype in (torch.bfloat16, torch.float32):
            z, t = make(64, 128256, dtype, scale=scale)
            check(z, t, inplace=False)


@pytest.mark.slow  # torch.compile's tracing and code generation; the quick run keeps the eager paths
def test_torch_compile_fullgraph():
    # The launches are torch.library ops, so the whole call traces into one graph, in place or not.
    z, t = make(6, 300, torch.float32)
    for inplace in (False, True):
        fn = torch.compile(lambda x, tt, inplace=inplace: logitless.cross_entropy(
            x, tt, backend="triton", inplace_backward=inplace, label_smoothing=0.1), fullgraph=True)
        x = z.clone().requires_grad_(True)
        loss = fn(x, t)
        (g,) = torch.autograd.grad(loss, x)
        xr = z.clone().requires_grad_(True)
        ref = torch.nn.functional.cross_entropy(xr, t, label_smoothing=0.1)
        (gr,) = torch.autograd.grad(ref, xr)
        torch.testing.assert_close(loss, ref)
        torch.testing.assert_close(g, gr)
