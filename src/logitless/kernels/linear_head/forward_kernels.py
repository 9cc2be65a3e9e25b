"""Forward kernels of the linear head: online log-sum-exp, target logit, smoothing and entropy sums per (token block,
vocabulary chunk) (_fwd_kernel, optionally keeping the first classes' logits for the backward: the stash), then the
merge of the chunks per row, in chunk order (_combine_kernel). Launched by launch.forward_stats."""

import triton
import triton.language as tl

from .._device import exp
from .tiles import classes, grouped, logits_tile, rescale_ent, transform


@triton.jit
def _fold_tile(z, col_ok, cls, cw_ptr, m, s, ent, sw, wsum,
               MASKED: tl.constexpr, HAS_SMOOTH: tl.constexpr, HAS_CLASS_WEIGHT: tl.constexpr,
               HAS_ENTROPY: tl.constexpr):
    """Folds a tile of logits z [BLOCK_N, BLOCK_V] into its rows' running statistics (see _fwd_kernel): max m, sum
    of exponentials s relative to m, entropy sum ent, smoothing sum sw, class-weight sum wsum. MASKED: columns
    where col_ok is false are past the vocabulary and do not count. Returns (m, s, ent, sw, wsum) updated and the
    tile's own sum of exponentials (relative to the new m) and exponentials e [BLOCK_N, BLOCK_V]."""
    if MASKED:
        m_new = tl.maximum(m, tl.max(tl.where(col_ok[None, :], z, float("-inf")), axis=1))
    else:
        m_new = tl.maximum(m, tl.max(z, axis=1))
    alpha = exp(m - m_new)
    d = z - m_new[:, None]
    e = exp(d)
    if MASKED:
        e = tl.where(col_ok[None, :], e, 0.0)
    if HAS_ENTROPY:
        # A class at -inf (masked by a -inf bias) has e = 0 and adds 0, not 0 * -inf = NaN.
        ent = rescale_ent(ent, s, alpha, m - m_new) + tl.sum(tl.where(e > 0, e * d, 0.0), axis=1)
    e_sum = tl.sum(e, axis=1)
    s = s * alpha + e_sum
    if HAS_SMOOTH:
        if HAS_CLASS_WEIGHT:
            cw = tl.load(cw_ptr + cls, mask=col_ok, other=0.0).to(tl.float32)
        else:
            cw = col_ok.to(tl.float32)
        sw = sw - wsum * (m_new - m) + tl.sum(cw[None, :] * d, axis=1)
        wsum += tl.sum(cw, axis=0)
    return m_new, s, ent, sw, wsum, e_sum, e


@triton.jit
def _fwd_step(
    x_ptr, w_ptr, b_ptr, cw_ptr, perm_ptr, tiles_out, zs_out, zo_out,
    N, V, D, n_vtiles, stride_xn, stride_xd, stride_wv, stride_wd, softcap, inv_temp,
    pid_n, row0, rows, row_ok, tgt, col0, m, s, zt, sw, ent, wsum, rest,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_TARGET: tl.constexpr,
    HAS_SMOOTH: tl.constexpr, HAS_CLASS_WEIGHT: tl.constexpr, HAS_ENTROPY: tl.constexpr, HAS_PERM: tl.constexpr,
    RECORD_TILES: tl.constexpr, STASH: tl.constexpr, STASH_TMA: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
    EVEN_V: tl.constexpr, HAS_REST: tl.constexpr, HALF_TANH: tl.constexpr,
):
    """One vocabulary tile of _fwd_kernel: the tile at col0 folded into the rows' running statistics; returns them
    and the next tile's col0. STASH: the tile's logits are also kept for the backward (STASH_TMA: zs_out is a
    tensor descriptor of [BLOCK_V, BLOCK_N] blocks of the (classes, N) stash)."""
    cols = col0 + tl.arange(0, BLOCK_V)  # vocabulary positions
    col_ok = cols < V
    cls = classes(perm_ptr, cols, col_ok, HAS_PERM)
    acc = logits_tile(x_ptr, w_ptr, perm_ptr, row0, col0, N, V, D, stride_xn, stride_xd, stride_wv, stride_wd,
                       HAS_PERM, BLOCK_N, BLOCK_V, BLOCK_K, EVEN_K, DOT_PRECISION, UPCAST, USE_TMA)
    z, zc, _ = transform(acc, b_ptr, cls, col_ok, softcap, inv_temp, HAS_BIAS, HAS_SOFTCAP, HAS_TEMP, False,
                         HALF_TANH)
    # Classes past V (only in the last tile unless EVEN_V) hold finite values and must not count: the masked
    # fold runs on that tile alone, since the epilogue is on the critical path. (With EVEN_V, a constant, the
    # `or` is decided at compile time: no run-time test.)
    if EVEN_V or col0 + BLOCK_V <= V:
        m_new, s, ent, sw, wsum, e_sum, e = _fold_tile(z, col_ok, cls, cw_ptr, m, s, ent, sw, wsum, False,
                                                       HAS_SMOOTH, HAS_CLASS_WEIGHT, HAS_ENTROPY)
    else:
        m_new, s, ent, sw, wsum, e_sum, e = _fold_tile(z, col_ok, cls, cw_ptr, m, s, ent, sw, wsum, True,
                                                       HAS_SMOOTH, HAS_CLASS_WEIGHT, HAS_ENTROPY)
    rest_tile = e_sum
    if RECORD_TILES:
        # Each row's log-sum-exp over the tile (m_new + log of the tile's own sum), as float16 in the row's
        # (N, n_vtiles) record: 2^-11 relative, which the plan widens upwards before it bounds a mass with it. A sum
        # that underflows gives -inf: its classes hold < 1e-38 of the row's mass each.
        tile_lse = m_new + tl.log(e_sum)
        tl.store(tiles_out + rows * n_vtiles + col0 // BLOCK_V, tile_lse.to(tl.float16), mask=row_ok)
    if STASH:
        # Classes [0, n_stash) (whole tiles) keep their logits for the backward (stash_layout): z minus the
        # running max, <= 0, in float16 (2^-11 relative), class-major, and the max itself per row and tile.
        # Clamped above float16's -65504: such a class has p = 0 either way.
        d = tl.maximum(z - m_new[:, None], -60000.0).to(tl.float16)
        if STASH_TMA:
            # The copy engine writes the transposed tile from shared memory (rows past N fall outside the
            # descriptor's bounds and are not written): no pointer tensor of the tile in registers, whose scattered
            # stores spilled (docs/design/stash.md, "The forward's store").
            zs_out.store([col0.to(tl.int32), row0.to(tl.int32)], tl.trans(d))
        else:
            zs = zs_out + (col0 * N + row0)
            offs = tl.arange(0, BLOCK_N)[:, None] + tl.arange(0, BLOCK_V)[None, :] * N
            tl.store(zs + offs, d, mask=row_ok[:, None])
        tl.store(zo_out + (col0 // BLOCK_V) * N + rows, m_new, mask=row_ok)
    if HAS_TARGET:
        # A target outside this launch's classes (ignored, or on another vocabulary shard) never matches.
        if HAS_PERM:
            is_t = (cls[None, :] == tgt[:, None]) & col_ok[None, :]
            zt += tl.sum(tl.where(is_t, z, 0.0), axis=1)
            if HAS_REST:
                rest_tile = tl.sum(tl.where(is_t, 0.0, e), axis=1)
        else:
            inside = (tgt >= col0) & (tgt < tl.minimum(col0 + BLOCK_V, V))
            # Most tiles hold none of the block's targets: the per-element select runs only where one does.
            if tl.max(inside.to(tl.int32), axis=0) > 0:
                # The target's offset in this tile per row (-1 outside it): one int32 compare per element.
                rel = tl.where(inside, tgt - col0, -1).to(tl.int32)
                is_t = tl.arange(0, BLOCK_V)[None, :] == rel[:, None]
                zt += tl.sum(tl.where(is_t, z, 0.0), axis=1)
                if HAS_REST:
                    rest_tile = tl.sum(tl.where(is_t, 0.0, e), axis=1)
    if HAS_REST:
        # The mass outside the target, summed without it (s - exp(z_t - m) would cancel for a near-certain row).
        rest = rest * exp(m - m_new) + rest_tile
    return m_new, s, zt, sw, ent, wsum, rest, col0 + BLOCK_V


@triton.jit
def _fwd_kernel(
    # pointers
    x_ptr, w_ptr, b_ptr, t_ptr, cw_ptr, perm_ptr,
    m_out, s_out, zt_out, sw_out, ent_out, ws_out, tiles_out, zs_out, zo_out, rest_out,
    # sizes
    N, V, D, n_big, chunks_big, n_small, chunks_small, n_vtiles, n_stash,
    # strides
    stride_xn, stride_xd, stride_wv, stride_wd,
    # options
    softcap, inv_temp,
    # meta-parameters
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_TARGET: tl.constexpr,
    HAS_SMOOTH: tl.constexpr, HAS_CLASS_WEIGHT: tl.constexpr, HAS_ENTROPY: tl.constexpr, HAS_PERM: tl.constexpr,
    RECORD_TILES: tl.constexpr, STASH: tl.constexpr, STASH_TMA: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
    EVEN_V: tl.constexpr, HAS_REST: tl.constexpr, HALF_TANH: tl.constexpr, CHUNK: tl.constexpr,
):
    # Two phases of programs (_fwd_layout, in chunks of CHUNK tiles): first n_big splits of chunks_big chunks for
    # every token block, then the rest of each block's chunks in n_small splits of chunks_small, which fill the
    # multiprocessors the first phase leaves idle at its end. The partials are per chunk, not per split: a program
    # restarts its running statistics at each chunk's first tile, so a row's partials, and their merge in chunk
    # order, are the same whatever the split layout, which depends on N (batch invariance, docs/rl.md).
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(N, BLOCK_N)
    if pid < n_blocks * n_big:
        pid_n, split = grouped(pid, n_blocks, n_big, GROUP)
        j0 = split * chunks_big * CHUNK
        j1 = tl.minimum(j0 + chunks_big * CHUNK, n_vtiles)
    else:
        pid_n, s2 = grouped(pid - n_blocks * n_big, n_blocks, n_small, GROUP)
        j0 = (n_big * chunks_big + s2 * chunks_small) * CHUNK
        j1 = tl.minimum(j0 + chunks_small * CHUNK, n_vtiles)
    row0 = pid_n.to(tl.int64) * BLOCK_N
    rows = row0 + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    tgt = rows
    if HAS_TARGET:
        tgt = tl.load(t_ptr + rows, mask=row_ok, other=-1)
    # m starts finite so that 0 * (m_new - m) terms stay 0 on the first tile.
    m = tl.full((BLOCK_N,), -1e30, tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    zt = tl.zeros((BLOCK_N,), tl.float32)
    sw = tl.zeros((BLOCK_N,), tl.float32)  # sum w_j (z_j - m), kept relative to the running max
    ent = tl.zeros((BLOCK_N,), tl.float32)  # sum exp(z_j - m) (z_j - m)
    rest = tl.zeros((BLOCK_N,), tl.float32)  # sum_{j != t} exp(z_j - m)
    wsum = tl.sum(tl.zeros((1,), tl.float32), axis=0)  # class weights seen so far (the same for every row)
    col0 = j0.to(tl.int64) * BLOCK_V  # int64: the interpreter's loop counters are Python ints
    # With STASH, tiles [j0, j_mid) are stashed, in a loop of their own (phase 0; unrolled at compile time): the
    # store's registers would otherwise spill in every tile's loop (84 spills at the GPU tiles, Triton 3.6).
    j_mid = j0
    if STASH:
        j_mid = tl.minimum(tl.maximum(n_stash // BLOCK_V, j0), j1)
    for phase in tl.static_range(0 if STASH else 1, 2):
        lo = j0 if phase == 0 else j_mid
        hi = j_mid if phase == 0 else j1
        for _ in range(lo, hi):
            m, s, zt, sw, ent, wsum, rest, col0 = _fwd_step(
                x_ptr, w_ptr, b_ptr, cw_ptr, perm_ptr, tiles_out, zs_out, zo_out,
                N, V, D, n_vtiles, stride_xn, stride_xd, stride_wv, stride_wd, softcap, inv_temp,
                pid_n, row0, rows, row_ok, tgt, col0, m, s, zt, sw, ent, wsum, rest,
                HAS_BIAS, HAS_SOFTCAP, HAS_TEMP, HAS_TARGET, HAS_SMOOTH, HAS_CLASS_WEIGHT, HAS_ENTROPY, HAS_PERM,
                RECORD_TILES, phase == 0, STASH_TMA and phase == 0, BLOCK_N, BLOCK_V, BLOCK_K, EVEN_K,
                DOT_PRECISION, UPCAST, USE_TMA, EVEN_V, HAS_REST, HALF_TANH)
            j = col0 // BLOCK_V  # the next tile
            if (j % CHUNK == 0) | (j >= n_vtiles):  # the chunk's last tile: its partials, and a fresh start
                out = ((j - 1) // CHUNK).to(tl.int64) * N + rows
                tl.store(m_out + out, m, mask=row_ok)
                tl.store(s_out + out, s, mask=row_ok)
                if HAS_TARGET:
                    tl.store(zt_out + out, zt, mask=row_ok)
                if HAS_SMOOTH:
                    tl.store(sw_out + out, sw, mask=row_ok)
                    if pid_n == 0:
                        tl.store(ws_out + (j - 1) // CHUNK, wsum)
                if HAS_ENTROPY:
                    tl.store(ent_out + out, ent, mask=row_ok)
                if HAS_REST:
                    tl.store(rest_out + out, rest, mask=row_ok)
                m = tl.full((BLOCK_N,), -1e30, tl.float32)
                s = tl.zeros((BLOCK_N,), tl.float32)
                zt = tl.zeros((BLOCK_N,), tl.float32)
                sw = tl.zeros((BLOCK_N,), tl.float32)
                ent = tl.zeros((BLOCK_N,), tl.float32)
                rest = tl.zeros((BLOCK_N,), tl.float32)
                wsum = tl.sum(tl.zeros((1,), tl.float32), axis=0)


@triton.jit
def _combine_kernel(
    # pointers
    m_in, s_in, zt_in, sw_in, ent_in, ws_in, rest_in,
    m_out, logs_out, zt_out, sw_out, ent_out, mu_out, rest_out,
    # sizes
    N, n_chunks,
    # meta-parameters
    HAS_TARGET: tl.constexpr, HAS_SMOOTH: tl.constexpr, HAS_ENTROPY: tl.constexpr, HAS_REST: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # With HAS_REST (rest_out given), also rest = sum_{j != t} exp(z_j - m), and with the entropy
    # mu = sum_j p_j (z_j - m) (loss_math.head_coefficients).
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < N
    big_m = tl.full((BLOCK,), -1e30, tl.float32)
    off = rows
    for _ in range(0, n_chunks):
        big_m = tl.maximum(big_m, tl.load(m_in + off, mask=ok, other=-1e30))
        off += N
    big_s = tl.zeros((BLOCK,), tl.float32)
    zt = tl.zeros((BLOCK,), tl.float32)
    sw = tl.zeros((BLOCK,), tl.float32)
    ent = tl.zeros((BLOCK,), tl.float32)
    rest = tl.zeros((BLOCK,), tl.float32)
    off = rows
    for sp in range(0, n_chunks):
        mi = tl.load(m_in + off, mask=ok, other=-1e30)
        si = tl.load(s_in + off, mask=ok, other=0.0)
        sc = exp(mi - big_m)
        big_s += si * sc
        if HAS_TARGET:
            zt += tl.load(zt_in + off, mask=ok, other=0.0)
        if HAS_SMOOTH:
            sw += tl.load(sw_in + off, mask=ok, other=0.0) + tl.load(ws_in + sp) * (mi - big_m)
        if HAS_ENTROPY:
            ent += rescale_ent(tl.load(ent_in + off, mask=ok, other=0.0), si, sc, mi - big_m)
        if HAS_REST:
            rest += tl.load(rest_in + off, mask=ok, other=0.0) * sc
        off += N
    big_s = tl.where(ok, big_s, 1.0)
    log_s = tl.log(big_s)
    tl.store(m_out + rows, big_m, mask=ok)
    tl.store(logs_out + rows, log_s, mask=ok)
    tl.store(zt_out + rows, zt, mask=ok)
    tl.store(sw_out + rows, sw, mask=ok)
    if HAS_REST:
        tl.store(rest_out + rows, rest, mask=ok)
    if HAS_ENTROPY:
        mu = ent / big_s
        if HAS_REST:
            tl.store(mu_out + rows, mu, mask=ok)
        ent = log_s - mu
    tl.store(ent_out + rows, ent, mask=ok)
