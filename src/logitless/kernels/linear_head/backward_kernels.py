"""Backward kernels of the linear head, per vocabulary chunk: _dz_kernel writes dL/dz of the chunk (and the bias
gradient's per-token-block sums); _dgrad_kernel runs the two gradient products dW[chunk] = dz^T x and
dx_acc += dz W[chunk] (skipping cold pairs from the skip plan's lists); _sum_splits_kernel sums split-K partials of
dW in a fixed order. Launched by launch.backward."""

import triton
import triton.language as tl

from .._device import LOG2E, cast, mma
from .tiles import classes, cold_pair, grouped, hot_pair, logits_tile, transform

# ------------------------------------------------------------------------------------------------------------------
# Backward, step 1 of a vocabulary chunk: dL/dz of the chunk (and the bias gradient's per-token-block sums)


@triton.jit
def _target_column(g, is_t, p, zm, c, at_ptr, bc_ptr, rows_in, HAS_B: tl.constexpr):
    """g with its target entries (is_t) replaced by p_t (At + B (z_t - m)) - C, the target's own form
    (loss_math.head_coefficients: C is then (1 - p_t) C_0, formed without cancelling against p_t A)."""
    at = tl.load(at_ptr + rows_in)
    if HAS_B:
        bc = tl.load(bc_ptr + rows_in)
        gt = tl.where(p > 0, p * (at[:, None] + bc[:, None] * zm), 0.0) - c[:, None]
    else:
        gt = p * at[:, None] - c[:, None]  # one FMA (the other path: a select and a subtraction)
    return tl.where(is_t, gt, g)


@triton.jit
def _dz_tile(
    pid_n, pid_v,
    x_ptr, w_ptr, b_ptr, t_ptr, cw_ptr, perm_ptr, m_ptr, logs_ptr, a_ptr, bc_ptr, c_ptr, e_ptr,
    dz_ptr, dz_desc, dbp_ptr, zs_ptr, zo_ptr, at_ptr,
    N, D, v_begin, v_end,
    stride_xn, stride_xd, stride_wv, stride_wd, stride_dz, stride_dzv, stride_dbp,
    softcap, inv_temp,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_B: tl.constexpr,
    HAS_C: tl.constexpr, HAS_E: tl.constexpr, HAS_CLASS_WEIGHT: tl.constexpr, STORE_DZ: tl.constexpr,
    HAS_DB: tl.constexpr, HAS_PERM: tl.constexpr, LOAD_Z: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr, HAS_AT: tl.constexpr,
    FINE_SLOPE: tl.constexpr, HALF_TANH: tl.constexpr, DZ_TMA: tl.constexpr,
):
    """dL/dz of one (token block, class tile) pair of the chunk [v_begin, v_end): see _dz_kernel."""
    lcol0 = pid_v.to(tl.int64) * BLOCK_V  # column offset inside the chunk
    lcols = lcol0 + tl.arange(0, BLOCK_V)
    row0 = pid_n.to(tl.int64) * BLOCK_N
    rows = row0 + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    col0 = lcol0 + v_begin
    cols = col0 + tl.arange(0, BLOCK_V)
    col_ok = cols < v_end
    cls = classes(perm_ptr, cols, col_ok, HAS_PERM)
    rows_in = tl.minimum(rows, N - 1)  # rows past N repeat the last one (finite values); never stored
    m = tl.load(m_ptr + rows_in)
    ok = row_ok[:, None] & col_ok[None, :]
    # (tile offsets: rows step by stride_dz, columns by stride_dzv; int32 inside a tile)
    offs = tl.arange(0, BLOCK_N)[:, None] * stride_dz + tl.arange(0, BLOCK_V)[None, :] * stride_dzv
    if LOAD_Z:
        # The forward's stash (stash_layout): z minus the running max o at that tile, in float16, where dz goes
        # (class-major), and o per row. Clamped entries (and those masked here) have p = 0.
        d = tl.load(zs_ptr + (row0 * stride_dz + lcol0 * stride_dzv) + offs, mask=ok, other=-60000.0)
        o = tl.load(zo_ptr + (lcol0 // BLOCK_V) * N + rows_in)
        zm = d.to(tl.float32) + (o - m)[:, None]  # z - m
        slope = 1.0
        if HAS_SOFTCAP:
            # Only the capped logit is at hand: (1 - u)(1 + u), exact in 1 - u; the stash holds half-precision
            # inputs' logits, whose own rounding is far above what saturation costs here.
            zc = zm + m[:, None]
            if HAS_TEMP:
                zc = zc / inv_temp
            u = zc / softcap
            slope = (1.0 - u) * (1.0 + u)
    else:
        acc = logits_tile(x_ptr, w_ptr, perm_ptr, row0, col0, N, v_end, D, stride_xn, stride_xd, stride_wv,
                           stride_wd, HAS_PERM, BLOCK_N, BLOCK_V, BLOCK_K, EVEN_K, DOT_PRECISION, UPCAST, USE_TMA)
        z, _, slope = transform(acc, b_ptr, cls, col_ok, softcap, inv_temp, HAS_BIAS, HAS_SOFTCAP, HAS_TEMP,
                                FINE_SLOPE, HALF_TANH)
        zm = z - m[:, None]
    logs2 = tl.load(logs_ptr + rows_in) * LOG2E
    a = tl.load(a_ptr + rows_in)
    # p = exp((z - m) - log S) as 2^((z - m) log2 e - log2 S): z - m stays exact, one multiply-add per element.
    p = tl.exp2(zm * LOG2E - logs2[:, None])
    if HAS_B:
        bc = tl.load(bc_ptr + rows_in)
        g = p * (a[:, None] + bc[:, None] * zm)  # B multiplies z - m: no cancellation at |z|~1e4
        g = tl.where(p > 0, g, 0.0)  # p = 0 at z = -inf (a -inf bias): 0, not 0 * inf
    else:
        g = p * a[:, None]
    if HAS_C:
        tgt = tl.load(t_ptr + rows_in)
        c = tl.load(c_ptr + rows_in)
        if HAS_PERM:
            is_t = cls[None, :] == tgt[:, None]
            if HAS_AT:
                g = _target_column(g, is_t, p, zm, c, at_ptr, bc_ptr, rows_in, HAS_B)
            else:
                g = g - tl.where(is_t, c[:, None], 0.0)
        else:
            inside = (tgt >= col0) & (tgt < tl.minimum(col0 + BLOCK_V, v_end))
            # Most tiles hold none of the block's targets: the per-element select runs only where one does.
            if tl.max(inside.to(tl.int32), axis=0) > 0:
                rel = tl.where(inside, tgt - col0, -1).to(tl.int32)  # the target's offset in the tile, or -1
                is_t = tl.arange(0, BLOCK_V)[None, :] == rel[:, None]
                if HAS_AT:
                    g = _target_column(g, is_t, p, zm, c, at_ptr, bc_ptr, rows_in, HAS_B)
                else:
                    g = g - tl.where(is_t, c[:, None], 0.0)
    if HAS_E:
        e = tl.load(e_ptr + rows_in)
        if HAS_CLASS_WEIGHT:
            cw = tl.load(cw_ptr + cls, mask=col_ok, other=0.0).to(tl.float32)
            g = g - e[:, None] * cw[None, :]
        else:
            g = g - e[:, None]
    if HAS_TEMP:
        g = g * inv_temp
    if HAS_SOFTCAP:
        g = g * slope
    if STORE_DZ:
        # int32 offsets inside the tile (BLOCK_N rows of at most 2^16 chunk columns, or BLOCK_V columns of N rows);
        # a whole tile is stored without a mask (the epilogue is on the critical path).
        out = cast(g, dz_ptr.dtype.element_ty, UPCAST)
        if DZ_TMA:
            # The copy engine stores the tile from shared memory (rows past N and classes past the chunk fall
            # outside the descriptor and are not written); in the persistent loop the wait for it is deferred to
            # the next tile's store, so the write overlaps the next tile's products.
            dz_desc.store([row0.to(tl.int32), lcol0.to(tl.int32)], out)
        else:
            dz_tile = dz_ptr + (row0 * stride_dz + lcol0 * stride_dzv)
            if (row0 + BLOCK_N <= N) & (col0 + BLOCK_V <= v_end):
                tl.store(dz_tile + offs, out)
            else:
                tl.store(dz_tile + offs, out, mask=ok)
    if HAS_DB:
        tl.store(dbp_ptr + pid_n.to(tl.int64) * stride_dbp + lcols, tl.sum(tl.where(ok, g, 0.0), axis=0),
                 mask=col_ok)


@triton.jit
def _dz_kernel(
    # pointers (dz_desc: a tensor descriptor of dz's [BLOCK_N, BLOCK_V] blocks with DZ_TMA)
    x_ptr, w_ptr, b_ptr, t_ptr, cw_ptr, perm_ptr, m_ptr, logs_ptr, a_ptr, bc_ptr, c_ptr, e_ptr, hot_ptr,
    dz_ptr, dz_desc, dbp_ptr, zs_ptr, zo_ptr, at_ptr, list_v_ptr, pairs_ptr,
    # sizes
    N, D, v_begin, v_end, n_vtiles, n_progs, n_blocks,
    # strides
    stride_xn, stride_xd, stride_wv, stride_wd, stride_dz, stride_dzv, stride_dbp,
    # options
    softcap, inv_temp,
    # meta-parameters
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_B: tl.constexpr,
    HAS_C: tl.constexpr, HAS_E: tl.constexpr, HAS_CLASS_WEIGHT: tl.constexpr, STORE_DZ: tl.constexpr,
    HAS_DB: tl.constexpr, HAS_PERM: tl.constexpr, SKIP: tl.constexpr, LOAD_Z: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr, HAS_AT: tl.constexpr,
    FINE_SLOPE: tl.constexpr, HALF_TANH: tl.constexpr, DZ_TMA: tl.constexpr, PERSISTENT: tl.constexpr,
    HOT_LIST: tl.constexpr, SEARCH_STEPS: tl.constexpr,
):
    # Programs that run together share GROUP token blocks and their W tiles in L2. (Token-block-major, each wave
    # re-read the chunk's whole W: docs/design/backward.md has the L2 hit rates.)
    n_nb = tl.cdiv(N, BLOCK_N)
    n_vt = tl.cdiv(v_end - v_begin, BLOCK_V)
    if PERSISTENT:
        # n_progs programs walk the tiles in the same grouped order, one loop over tiles and their products'
        # steps (flattened): the pipeline loads the next tile's operands while this tile's epilogue runs, and its
        # copy-engine store drains during the next tile's products: faster than one program per tile, dz bitwise
        # equal (docs/design/backward.md, "The dz kernel, persistent"). No early return in a loop: not with SKIP.
        for tile in tl.range(tl.program_id(0), n_nb * n_vt, n_progs, flatten=True):
            pid_n, pid_v = grouped(tile, n_nb, n_vt, GROUP)
            _dz_tile(pid_n, pid_v, x_ptr, w_ptr, b_ptr, t_ptr, cw_ptr, perm_ptr, m_ptr, logs_ptr, a_ptr, bc_ptr,
                     c_ptr, e_ptr, dz_ptr, dz_desc, dbp_ptr, zs_ptr, zo_ptr, at_ptr, N, D, v_begin, v_end,
                     stride_xn, stride_xd, stride_wv, stride_wd, stride_dz, stride_dzv, stride_dbp, softcap,
                     inv_temp, HAS_BIAS, HAS_SOFTCAP, HAS_TEMP, HAS_B, HAS_C, HAS_E, HAS_CLASS_WEIGHT, STORE_DZ,
                     HAS_DB, HAS_PERM, LOAD_Z, BLOCK_N, BLOCK_V, BLOCK_K, EVEN_K, DOT_PRECISION, UPCAST, USE_TMA,
                     HAS_AT, FINE_SLOPE, HALF_TANH, DZ_TMA)
    elif HOT_LIST:
        # Skipping, n_progs programs walk the chunk's hot pairs alone, tile by tile (each tile's hot token blocks,
        # the plan's list_v), instead of one program per pair of which most return at once: pairs_ptr holds the
        # hot pairs of all tiles before each tile of the map (tiles.hot_pair finds pair i's).
        t0 = v_begin // BLOCK_V
        first = tl.load(pairs_ptr + t0)
        total = tl.load(pairs_ptr + t0 + n_vt) - first
        for i in range(tl.program_id(0), total, n_progs):
            pid_n, pid_v = hot_pair(pairs_ptr, list_v_ptr, i, first, t0, n_vt, n_blocks, SEARCH_STEPS)
            _dz_tile(pid_n, pid_v, x_ptr, w_ptr, b_ptr, t_ptr, cw_ptr, perm_ptr, m_ptr, logs_ptr, a_ptr, bc_ptr,
                     c_ptr, e_ptr, dz_ptr, dz_desc, dbp_ptr, zs_ptr, zo_ptr, at_ptr, N, D, v_begin, v_end,
                     stride_xn, stride_xd, stride_wv, stride_wd, stride_dz, stride_dzv, stride_dbp, softcap,
                     inv_temp, HAS_BIAS, HAS_SOFTCAP, HAS_TEMP, HAS_B, HAS_C, HAS_E, HAS_CLASS_WEIGHT, STORE_DZ,
                     HAS_DB, HAS_PERM, LOAD_Z, BLOCK_N, BLOCK_V, BLOCK_K, EVEN_K, DOT_PRECISION, UPCAST, USE_TMA,
                     HAS_AT, FINE_SLOPE, HALF_TANH, DZ_TMA)
    else:
        pid_n, pid_v = grouped(tl.program_id(0), n_nb, n_vt, GROUP)
        if SKIP:  # v_begin is a multiple of BLOCK_V, so this program's tile is one tile of the map
            if cold_pair(hot_ptr, dbp_ptr, pid_n, pid_v, n_vtiles, v_begin, v_end, stride_dbp, HAS_DB, BLOCK_V):
                return
        _dz_tile(pid_n, pid_v, x_ptr, w_ptr, b_ptr, t_ptr, cw_ptr, perm_ptr, m_ptr, logs_ptr, a_ptr, bc_ptr, c_ptr,
                 e_ptr, dz_ptr, dz_desc, dbp_ptr, zs_ptr, zo_ptr, at_ptr, N, D, v_begin, v_end,
                 stride_xn, stride_xd, stride_wv, stride_wd, stride_dz, stride_dzv, stride_dbp, softcap, inv_temp,
                 HAS_BIAS, HAS_SOFTCAP, HAS_TEMP, HAS_B, HAS_C, HAS_E, HAS_CLASS_WEIGHT, STORE_DZ, HAS_DB,
                 HAS_PERM, LOAD_Z, BLOCK_N, BLOCK_V, BLOCK_K, EVEN_K, DOT_PRECISION, UPCAST, USE_TMA, HAS_AT,
                 FINE_SLOPE, HALF_TANH, DZ_TMA)


# ------------------------------------------------------------------------------------------------------------------
# Backward, step 2 of a vocabulary chunk: dW[chunk] = dz^T @ x (all tokens) and dx_acc += dz @ W[chunk]


@triton.jit
def _dw_tile(
    tile, dz_ptr, x_ptr, dw_ptr, perm_ptr, list_ptr, pre_ptr, dzt_desc, x_desc,
    N, D, n_vrows, k_per_split, n_out_tiles, n_blocks, tile0,
    stride_dz, stride_xn, stride_xd, stride_dwv, stride_dwd, stride_dws,
    EVEN_K: tl.constexpr, SCATTER: tl.constexpr, SKIP: tl.constexpr, MAP_N: tl.constexpr, MAP_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
):
    ks = tile // n_out_tiles  # split of the token (reduction) dimension; partials go to slice ks of dw_ptr
    pid_m, pid_d = grouped(tile % n_out_tiles, tl.cdiv(n_vrows, BLOCK_M), tl.cdiv(D, BLOCK_D), GROUP)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < n_vrows
    d_ok = offs_d < D
    k_lo = ks.to(tl.int64) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, N)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    dense = True
    if SKIP:
        # The hot token blocks of this tile of the map (MAP_V is a multiple of BLOCK_M; k_lo of MAP_N), ascending:
        # list_ptr[t, pre[t, b_lo] : pre[t, b_hi]]. All of them hot: the dense loop below.
        t = tile0 + (pid_m * BLOCK_M) // MAP_V
        b_lo = k_lo // MAP_N
        b_hi = tl.cdiv(k_hi, MAP_N)
        s_lo = tl.load(pre_ptr + t * (n_blocks + 1) + b_lo)
        s_hi = tl.load(pre_ptr + t * (n_blocks + 1) + b_hi)
        dense = s_hi - s_lo == b_hi - b_lo
        if s_hi - s_lo != b_hi - b_lo:
            # (MAP_N // BLOCK_K reduction steps per token block)
            for s in range(s_lo * (MAP_N // BLOCK_K), s_hi * (MAP_N // BLOCK_K)):
                blk = tl.load(list_ptr + t * n_blocks + s // (MAP_N // BLOCK_K)).to(tl.int64)
                k0 = blk * MAP_N + (s % (MAP_N // BLOCK_K)) * BLOCK_K
                if USE_TMA:
                    # (a split ends on a token block, so a block's steps never reach past k_hi but past N: zeros)
                    a = dzt_desc.load([k0.to(tl.int32), (pid_m * BLOCK_M).to(tl.int32)])
                    b = x_desc.load([k0.to(tl.int32), (pid_d * BLOCK_D).to(tl.int32)])
                    acc = mma(tl.trans(a), b, acc, DOT_PRECISION, UPCAST)
                else:
                    kk = k0 + offs_k
                    k_ok = kk < k_hi
                    a = tl.load(dz_ptr + (kk[None, :] * stride_dz + offs_m[:, None]),
                                mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                    b = tl.load(x_ptr + (kk[:, None] * stride_xn + offs_d[None, :] * stride_xd),
                                mask=k_ok[:, None] & d_ok[None, :], other=0.0)
                    acc = mma(a, b, acc, DOT_PRECISION, UPCAST)
    if USE_TMA:
        if dense:
            # Descriptors of dz [BLOCK_K tokens, BLOCK_M classes] and x [BLOCK_K, BLOCK_D] (no order):
            # reads past N, the chunk or D are zeros, and k_per_split is a multiple of BLOCK_K, so a split's last step
            # never reads into the next split.
            m0 = (pid_m * BLOCK_M).to(tl.int32)
            d0 = (pid_d * BLOCK_D).to(tl.int32)
            k0 = k_lo.to(tl.int32)
            for k in range(0, tl.cdiv((k_hi - k_lo).to(tl.int32), BLOCK_K)):
                a = dzt_desc.load([k0 + k * BLOCK_K, m0])
                b = x_desc.load([k0 + k * BLOCK_K, d0])
                acc = mma(tl.trans(a), b, acc, DOT_PRECISION, UPCAST)
    else:
        if dense:
            # Both operands are contiguous along the output dimension (classes of dz, columns of x): masks there keep
            # the loads vectorised, where clamped indices would not.
            # dz^T [BLOCK_M, BLOCK_K]
            a_ptrs = dz_ptr + k_lo * stride_dz + (offs_k[None, :] * stride_dz + offs_m[:, None])
            b_ptrs = x_ptr + k_lo * stride_xn + (offs_k[:, None] * stride_xn + offs_d[None, :] * stride_xd)  # [K, D]
            for k in range(0, tl.cdiv(k_hi - k_lo, BLOCK_K)):
                if EVEN_K:
                    a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
                    b = tl.load(b_ptrs, mask=d_ok[None, :], other=0.0)
                else:
                    k_ok = offs_k < (k_hi - k_lo) - k * BLOCK_K
                    a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                    b = tl.load(b_ptrs, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
                acc = mma(a, b, acc, DOT_PRECISION, UPCAST)
                a_ptrs += BLOCK_K * stride_dz
                b_ptrs += BLOCK_K * stride_xn
    out_rows = offs_m
    if SCATTER:
        # Vocabulary position -> its class's own row of dW (perm_ptr points at the chunk's first position).
        out_rows = tl.load(perm_ptr + offs_m, mask=m_ok, other=0).to(tl.int64)
    out = dw_ptr + ks.to(tl.int64) * stride_dws + (out_rows[:, None] * stride_dwv + offs_d[None, :] * stride_dwd)
    tl.store(out, cast(acc, dw_ptr.dtype.element_ty, UPCAST), mask=m_ok[:, None] & d_ok[None, :])


@triton.jit
def _dx_tile(
    tile, dz_ptr, w_ptr, dx_ptr, perm_ptr, list_ptr, pre_ptr, dz_desc, w_desc,
    N, D, n_vrows, n_vtiles, tile0, tile1,
    stride_dz, stride_wv, stride_wd, stride_dxn, stride_dxd,
    ACCUMULATE: tl.constexpr, EVEN_K: tl.constexpr, HAS_PERM: tl.constexpr, SKIP: tl.constexpr,
    MAP_N: tl.constexpr, MAP_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
    ks, kfirst, kstep, part_ptr, KSPLIT: tl.constexpr,
):
    # With KSPLIT > 1 the tile's reduction steps may be dealt out to KSPLIT programs: program ks takes steps kfirst,
    # kfirst + kstep, ... (dealt: kfirst = ks, kstep = KSPLIT; not dealt: program 0 takes all, kfirst = 0, kstep = 1,
    # and the others none, kfirst past the end). Program 0 adds its share to dx (ACCUMULATE) as the only program
    # does; a program ks > 0 that has steps adds its share to the float32 partial part_ptr[ks - 1] (contiguous
    # (KSPLIT - 1, N, D), zeros at first), which the launcher adds to dx once, after the last chunk, in split order.
    # One without steps touches nothing.
    pid_m, pid_d = grouped(tile, tl.cdiv(N, BLOCK_M), tl.cdiv(D, BLOCK_D), GROUP)
    row0 = pid_m.to(tl.int64) * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = row0 + offs_m < N
    d_ok = offs_d < D
    m_in = tl.minimum(row0 + offs_m, N - 1)  # rows past N repeat the last one (strided dimension); not stored
    out = dx_ptr + row0 * stride_dxn + (offs_m[:, None] * stride_dxn + offs_d[None, :] * stride_dxd)
    ok = m_ok[:, None] & d_ok[None, :]
    dense = True
    n_steps = tl.cdiv(n_vrows, BLOCK_K)
    if SKIP:
        # The hot tiles of this token block (MAP_N is a multiple of BLOCK_M) inside the chunk's tiles [tile0, tile1),
        # ascending: list_ptr[blk, pre[blk, tile0] : pre[blk, tile1]]. All of them hot: the dense loop below.
        blk = row0 // MAP_N
        s_lo = tl.load(pre_ptr + blk * (n_vtiles + 1) + tile0)
        s_hi = tl.load(pre_ptr + blk * (n_vtiles + 1) + tile1)
        dense = s_hi - s_lo == tile1 - tile0
        if not dense:
            n_steps = (s_hi - s_lo) * (MAP_V // BLOCK_K)
        if ACCUMULATE:  # no hot tile of the block in the chunk: the accumulator's tile is neither read nor written
            ok = ok & (offs_m[:, None] * 0 + s_hi > s_lo)  # (a block mask: the interpreter's masks take no scalar)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    if KSPLIT == 1:
        if ACCUMULATE:
            acc = tl.load(out, mask=ok, other=0.0)
    elif ks == 0:
        if ACCUMULATE:
            acc = tl.load(out, mask=ok, other=0.0)
    elif kfirst < n_steps:
        acc = tl.load(part_ptr + ((ks - 1) * N + row0) * D + (offs_m[:, None] * D + offs_d[None, :]), mask=ok,
                      other=0.0)
    if SKIP:
        if s_hi - s_lo != tile1 - tile0:
            # (MAP_V // BLOCK_K reduction steps per tile)
            for s in range(s_lo * (MAP_V // BLOCK_K) + kfirst, s_hi * (MAP_V // BLOCK_K), kstep):
                t = tl.load(list_ptr + blk * n_vtiles + s // (MAP_V // BLOCK_K))
                k0 = (t - tile0).to(tl.int64) * MAP_V + (s % (MAP_V // BLOCK_K)) * BLOCK_K  # chunk columns
                if USE_TMA:
                    # (columns past the chunk are zeros: both descriptors end there)
                    a = dz_desc.load([row0.to(tl.int32), k0.to(tl.int32)])
                    b = w_desc.load([k0.to(tl.int32), (pid_d * BLOCK_D).to(tl.int32)])
                else:
                    kk = k0 + offs_k
                    k_ok = kk < n_vrows
                    a = tl.load(dz_ptr + (m_in[:, None] * stride_dz + kk[None, :]), mask=k_ok[None, :], other=0.0)
                    wr = kk
                    if HAS_PERM:
                        wr = tl.load(perm_ptr + kk, mask=k_ok, other=0).to(tl.int64)
                    b = tl.load(w_ptr + (wr[:, None] * stride_wv + offs_d[None, :] * stride_wd),
                                mask=k_ok[:, None] & d_ok[None, :], other=0.0)
                acc = mma(a, b, acc, DOT_PRECISION, UPCAST)
    if USE_TMA:
        if dense:
            # Descriptors of dz [BLOCK_M tokens, BLOCK_K classes] and of the chunk's W rows [BLOCK_K, BLOCK_D]: reads
            # past N, the chunk or D are zeros.
            r0 = row0.to(tl.int32)
            d0 = (pid_d * BLOCK_D).to(tl.int32)
            for k in range(kfirst, tl.cdiv(n_vrows, BLOCK_K), kstep):
                a = dz_desc.load([r0, k * BLOCK_K])
                b = w_desc.load([k * BLOCK_K, d0])
                acc = mma(a, b, acc, DOT_PRECISION, UPCAST)
    else:
        if dense:
            k_start = tl.minimum(kfirst, tl.cdiv(n_vrows, BLOCK_K)).to(tl.int64)
            a_ptrs = dz_ptr + (m_in[:, None] * stride_dz + offs_k[None, :]) + k_start * BLOCK_K  # dz [BLOCK_M, BLOCK_K]
            # W[chunk] [BLOCK_K, BLOCK_D]
            b_ptrs = w_ptr + (offs_k[:, None] * stride_wv + offs_d[None, :] * stride_wd) + k_start * BLOCK_K * stride_wv
            for k in range(kfirst, tl.cdiv(n_vrows, BLOCK_K), kstep):
                if HAS_PERM:
                    # W rows of the chunk's classes, gathered (perm_ptr points at the chunk's first position).
                    kk = k * BLOCK_K + offs_k
                    k_ok = kk < n_vrows
                    wr = tl.load(perm_ptr + kk, mask=k_ok, other=0).to(tl.int64)
                    a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                    b = tl.load(w_ptr + (wr[:, None] * stride_wv + offs_d[None, :] * stride_wd),
                                mask=k_ok[:, None] & d_ok[None, :], other=0.0)
                elif EVEN_K:
                    a = tl.load(a_ptrs)
                    b = tl.load(b_ptrs, mask=d_ok[None, :], other=0.0)
                else:
                    k_ok = offs_k < n_vrows - k * BLOCK_K
                    a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                    b = tl.load(b_ptrs, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
                acc = mma(a, b, acc, DOT_PRECISION, UPCAST)
                a_ptrs += kstep * BLOCK_K
                b_ptrs += kstep * BLOCK_K * stride_wv
    if KSPLIT == 1:
        tl.store(out, acc, mask=ok)
    elif ks == 0:
        tl.store(out, acc, mask=ok)
    elif kfirst < n_steps:
        tl.store(part_ptr + ((ks - 1) * N + row0) * D + (offs_m[:, None] * D + offs_d[None, :]), acc, mask=ok)


@triton.jit
def _dgrad_kernel(
    # pointers (dz_ptr, and dw_ptr unless SCATTER, at the chunk's first column / output row; w_ptr at the chunk's
    # first row, or at W itself with a perm; perm_ptr at the chunk's first position)
    dz_ptr, x_ptr, w_ptr, dw_ptr, dx_ptr, perm_ptr, list_n_ptr, pre_n_ptr, list_v_ptr, pre_v_ptr, dx_part_ptr,
    dx_deal_ptr,
    # tensor descriptors (USE_TMA): dz by [BLOCK_K, BLOCK_M] and [BLOCK_M, BLOCK_K], x and W[chunk] by
    # [BLOCK_K, BLOCK_D]
    dzt_desc, dz_desc, x_desc, w_desc,
    # sizes
    N, D, n_vrows, n_dw_tiles, k_per_split, n_dw_out_tiles, n_blocks, n_vtiles, tile0, tile1,
    # strides
    stride_dz, stride_xn, stride_xd, stride_wv, stride_wd, stride_dwv, stride_dwd, stride_dws,
    stride_dxn, stride_dxd,
    # meta-parameters
    DO_DW: tl.constexpr, DO_DX: tl.constexpr, DX_ACCUMULATE: tl.constexpr, DW_EVEN_K: tl.constexpr,
    DX_EVEN_K: tl.constexpr, HAS_PERM: tl.constexpr, DW_SCATTER: tl.constexpr, SKIP: tl.constexpr,
    MAP_N: tl.constexpr, MAP_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, DX_BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
    DX_FIRST: tl.constexpr, DX_SPLIT: tl.constexpr,
):
    # The long dW tiles (reduction over all N tokens) come first so the short dx tiles fill the tail of the grid.
    # Skipping with DX_FIRST, the other way round, last token block first: the rows grouped last need the most
    # tiles, so their dx tiles are the chunk's longest programs, and started last they would end it alone.
    # list_n / pre_n: hot tiles per token block (for dx); list_v / pre_v: hot token blocks per tile (for dW).
    pid = tl.program_id(0)
    if DO_DW and DO_DX and DX_FIRST:
        # (DX_SPLIT programs per dx tile, the tile's splits next to each other)
        # (dx_deal_ptr: whether the tiles' steps are dealt out, decided on the device from the plan)
        n_dx = tl.num_programs(0) - n_dw_tiles
        if pid < n_dx:
            ks = pid % DX_SPLIT
            kfirst = ks
            kstep = DX_SPLIT
            if DX_SPLIT > 1:
                if tl.load(dx_deal_ptr) == 0:
                    kfirst = tl.where(ks == 0, 0, 1 << 30)
                    kstep = 1
            _dx_tile((n_dx - 1 - pid) // DX_SPLIT, dz_ptr, w_ptr, dx_ptr, perm_ptr, list_n_ptr, pre_n_ptr, dz_desc,
                     w_desc, N, D, n_vrows, n_vtiles, tile0, tile1,
                     stride_dz, stride_wv, stride_wd, stride_dxn, stride_dxd, DX_ACCUMULATE, DX_EVEN_K, HAS_PERM,
                     SKIP, MAP_N, MAP_V, BLOCK_M, DX_BLOCK_D, BLOCK_K, GROUP, DOT_PRECISION, UPCAST, USE_TMA,
                     ks, kfirst, kstep, dx_part_ptr, DX_SPLIT)
        else:
            _dw_tile(pid - n_dx, dz_ptr, x_ptr, dw_ptr, perm_ptr, list_v_ptr, pre_v_ptr, dzt_desc, x_desc,
                     N, D, n_vrows, k_per_split, n_dw_out_tiles, n_blocks, tile0,
                     stride_dz, stride_xn, stride_xd, stride_dwv, stride_dwd, stride_dws,
                     DW_EVEN_K, DW_SCATTER, SKIP, MAP_N, MAP_V, BLOCK_M, BLOCK_D, BLOCK_K, GROUP, DOT_PRECISION,
                     UPCAST, USE_TMA)
    elif DO_DW and DO_DX:
        if pid < n_dw_tiles:
            _dw_tile(pid, dz_ptr, x_ptr, dw_ptr, perm_ptr, list_v_ptr, pre_v_ptr, dzt_desc, x_desc,
                     N, D, n_vrows, k_per_split, n_dw_out_tiles, n_blocks, tile0,
                     stride_dz, stride_xn, stride_xd, stride_dwv, stride_dwd, stride_dws,
                     DW_EVEN_K, DW_SCATTER, SKIP, MAP_N, MAP_V, BLOCK_M, BLOCK_D, BLOCK_K, GROUP, DOT_PRECISION,
                     UPCAST, USE_TMA)
        else:
            _dx_tile(pid - n_dw_tiles, dz_ptr, w_ptr, dx_ptr, perm_ptr, list_n_ptr, pre_n_ptr, dz_desc, w_desc,
                     N, D, n_vrows, n_vtiles, tile0, tile1,
                     stride_dz, stride_wv, stride_wd, stride_dxn, stride_dxd, DX_ACCUMULATE, DX_EVEN_K, HAS_PERM,
                     SKIP, MAP_N, MAP_V, BLOCK_M, DX_BLOCK_D, BLOCK_K, GROUP, DOT_PRECISION, UPCAST, USE_TMA,
                     0, 0, 1, dx_part_ptr, 1)
    elif DO_DW:
        _dw_tile(pid, dz_ptr, x_ptr, dw_ptr, perm_ptr, list_v_ptr, pre_v_ptr, dzt_desc, x_desc,
                 N, D, n_vrows, k_per_split, n_dw_out_tiles, n_blocks, tile0,
                 stride_dz, stride_xn, stride_xd, stride_dwv, stride_dwd, stride_dws,
                 DW_EVEN_K, DW_SCATTER, SKIP, MAP_N, MAP_V, BLOCK_M, BLOCK_D, BLOCK_K, GROUP, DOT_PRECISION, UPCAST,
                 USE_TMA)
    else:
        _dx_tile(pid, dz_ptr, w_ptr, dx_ptr, perm_ptr, list_n_ptr, pre_n_ptr, dz_desc, w_desc,
                 N, D, n_vrows, n_vtiles, tile0, tile1,
                 stride_dz, stride_wv, stride_wd, stride_dxn, stride_dxd, DX_ACCUMULATE, DX_EVEN_K, HAS_PERM,
                 SKIP, MAP_N, MAP_V, BLOCK_M, DX_BLOCK_D, BLOCK_K, GROUP, DOT_PRECISION, UPCAST, USE_TMA,
                 0, 0, 1, dx_part_ptr, 1)


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, perm_ptr, n, n_splits, D,
                       SCATTER: tl.constexpr, BLOCK: tl.constexpr, UPCAST: tl.constexpr):
    # out = sum over splits of the float32 partials (n_splits, n), in split order, cast once to out's dtype. With
    # SCATTER, partial row r goes to row perm_ptr[r] of the contiguous (., D) output.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    acc = tl.zeros((BLOCK,), tl.float32)
    ptrs = part_ptr + offs
    for _ in range(0, n_splits):
        acc += tl.load(ptrs, mask=ok, other=0.0)
        ptrs += n
    dst = offs
    if SCATTER:
        dst = tl.load(perm_ptr + offs // D, mask=ok, other=0).to(tl.int64) * D + offs % D
    tl.store(out_ptr + dst, cast(acc, out_ptr.dtype.element_ty, UPCAST), mask=ok)
