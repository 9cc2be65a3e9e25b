"""Triton device functions of the linear-head family, shared by its forward and backward kernels and by the two-head
kernels: the logits of a tile, the class of a vocabulary position, the bias / softcap / temperature transform, the
grouped program order, the entropy sum's rescaling, and the skip plan's cold and hot pairs."""

import triton
import triton.language as tl

from .._device import mma, tanh_slope


@triton.jit
def logits_tile(
    x_ptr, w_ptr, perm_ptr, row0, col0, N, col_end, D,
    stride_xn, stride_xd, stride_wv, stride_wd,
    HAS_PERM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
):
    """Raw float32 logits [BLOCK_N, BLOCK_V] of rows row0.. and vocabulary positions col0.. (int64 scalars; the
    classes perm[col] with a perm). Rows >= N and positions >= col_end repeat the last valid one (no masks in the
    loop); the caller masks them. With USE_TMA, x_ptr and w_ptr are tensor descriptors of blocks [BLOCK_N, BLOCK_K]
    and [BLOCK_V, BLOCK_K] (no perm): the copy engine moves the tiles and fills reads past N, V or D with zeros."""
    # One return at the end: the compiler generates the code after a constant `if` that returns, too.
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    if USE_TMA:
        r0 = row0.to(tl.int32)
        c0 = col0.to(tl.int32)
        for k in range(0, tl.cdiv(D, BLOCK_K)):
            xt = x_ptr.load([r0, k * BLOCK_K])
            wt = w_ptr.load([c0, k * BLOCK_K])
            acc = mma(xt, tl.trans(wt), acc, DOT_PRECISION, UPCAST)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        rows = tl.minimum(row0 + tl.arange(0, BLOCK_N), N - 1)
        cols = tl.minimum(col0 + tl.arange(0, BLOCK_V), col_end - 1)
        if HAS_PERM:
            cols = tl.load(perm_ptr + cols).to(tl.int64)
        x_ptrs = x_ptr + (rows[:, None] * stride_xn + offs_k[None, :] * stride_xd)
        w_ptrs = w_ptr + (cols[:, None] * stride_wv + offs_k[None, :] * stride_wd)
        for k in range(0, tl.cdiv(D, BLOCK_K)):
            if EVEN_K:
                xt = tl.load(x_ptrs)
                wt = tl.load(w_ptrs)
            else:
                k_ok = offs_k < D - k * BLOCK_K
                xt = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
                wt = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
            acc = mma(xt, tl.trans(wt), acc, DOT_PRECISION, UPCAST)
            x_ptrs += BLOCK_K * stride_xd
            w_ptrs += BLOCK_K * stride_wd
    return acc


@triton.jit
def classes(perm_ptr, cols, col_ok, HAS_PERM: tl.constexpr):
    # Vocabulary positions -> class indices (rows of W, entries of the bias and class weights); -1 where masked.
    if HAS_PERM:
        return tl.load(perm_ptr + cols, mask=col_ok, other=-1).to(tl.int64)
    return tl.where(col_ok, cols, -1)


@triton.jit
def transform(acc, b_ptr, cols, col_ok, softcap, inv_temp,
               HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_TEMP: tl.constexpr,
               FINE_SLOPE: tl.constexpr = False, HALF_TANH: tl.constexpr = False):
    """Raw logits -> (z, zc, slope): zc = softcap * tanh((acc + b) / softcap) (or acc + b), z = zc * inv_temp, and
    slope = dzc / d(acc + b) (1.0 without a softcap; callers that do not use it pay nothing; FINE_SLOPE: tanh_slope's
    finer form near 0, for a float32 dz; HALF_TANH: its shorter form for bf16 / fp16 heads, and the softcap's
    reciprocal taken once). `cols` are class indices (masked by col_ok)."""
    if HAS_BIAS:
        bias = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    zc = acc
    slope = 1.0
    if HAS_SOFTCAP:
        if HALF_TANH:
            th, slope = tanh_slope(acc * (1.0 / softcap), FINE_SLOPE, True)
        else:
            th, slope = tanh_slope(acc / softcap, FINE_SLOPE)
        zc = softcap * th
    z = zc
    if HAS_TEMP:
        z = zc * inv_temp
    return z, zc, slope


@triton.jit
def grouped(tile, n_rows, n_cols, GROUP: tl.constexpr):
    # Tiles of GROUP consecutive row blocks run together, so their operands are reused from L2.
    per_group = GROUP * n_cols
    group = tile // per_group
    first = group * GROUP
    size = tl.minimum(n_rows - first, GROUP)
    r = first + (tile % per_group) % size
    c = (tile % per_group) // size
    return r, c


@triton.jit
def rescale_ent(ent, s, alpha, dm):
    # sum e d moved to a new max: alpha (ent + dm s), with alpha = exp(dm) and dm = m_old - m_new <= 0. Where alpha
    # underflows to 0, dm s may overflow to -inf (maxima near float32's range): the term is 0 there, not NaN.
    w = alpha * s
    return alpha * ent + tl.where(w > 0, w * dm, 0.0)


@triton.jit
def cold_pair(hot_ptr, dbp_ptr, pid_n, pid_v, n_vtiles, v_begin, v_end, stride_dbp,
              HAS_DB: tl.constexpr, BLOCK_V: tl.constexpr):
    """Whether the dz kernels' (token block pid_n, tile pid_v of the chunk from v_begin, a multiple of BLOCK_V) pair
    is cold in the skip plan's (blocks, tiles) map hot_ptr. A cold pair is neither recomputed nor stored (the
    products read hot pairs only); its bias-gradient partials are written here as zeros."""
    cold = tl.load(hot_ptr + pid_n.to(tl.int64) * n_vtiles + v_begin // BLOCK_V + pid_v) == 0
    if HAS_DB:
        if cold:
            lcols = pid_v.to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
            tl.store(dbp_ptr + pid_n.to(tl.int64) * stride_dbp + lcols, tl.zeros((BLOCK_V,), tl.float32),
                     mask=lcols < v_end - v_begin)
    return cold


@triton.jit
def hot_pair(pairs_ptr, list_v_ptr, i, first, t0, n_vt, n_blocks, SEARCH_STEPS: tl.constexpr):
    """(token block, tile of the chunk) of the chunk's hot pair i, the chunk's tiles t0 .. t0 + n_vt - 1 of the skip
    plan's map walked tile by tile, each tile's hot blocks in its list (list_v_ptr, n_blocks a tile): pairs_ptr[t]
    is the hot pairs of the map's tiles before t, first = pairs_ptr[t0], so the pair's tile is the last whose count
    is <= i (a binary search, SEARCH_STEPS >= log2(n_vt) halvings; tiles without hot blocks are passed over)."""
    lo = t0
    hi = t0 + n_vt
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        go = tl.load(pairs_ptr + mid) - first <= i
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    pid_n = tl.load(list_v_ptr + lo.to(tl.int64) * n_blocks + (i + first - tl.load(pairs_ptr + lo)))
    return pid_n, lo - t0
