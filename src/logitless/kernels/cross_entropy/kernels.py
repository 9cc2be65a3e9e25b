"""The @triton.jit kernels of cross-entropy on stored logits (the package docstring has the algorithm): the forward
with its in-place and lagged gradients (_ce_fwd_kernel), the second-launch backward (_ce_bwd_kernel) and the
scaling of a stored gradient (_ce_scale_kernel). Launched by launch.py."""

import triton
import triton.language as tl

from .._device import LOG2E, cast, sech2, tanh_libdevice


@triton.jit
def _load_tile(logits_ptr, rows64, cols, row_mask, col_mask, stride_row, softcap,
               HAS_SOFTCAP: tl.constexpr, INTERPRET: tl.constexpr, MASK_COLS: tl.constexpr, FILL: tl.constexpr,
               EVICT: tl.constexpr):
    """float32 logits of a tile after the softcap, and their derivative 1 - tanh(x / softcap)^2 for the chain rule
    (unused, and so not computed, where only statistics are taken). Rows past N read 0
    (finite), so no NaN appears in them; they are never stored. MASK_COLS: columns past V are not read (and read 0);
    FILL: they are -inf in the result (for a max or a sum of exponentials; a caller that never stores them needs no
    per-element select). MASK_COLS=False: the caller knows that every column is below V (pass 1 is issue-bound, not
    memory-bound). EVICT: the load's L2 eviction policy."""
    ptrs = (logits_ptr + rows64 * stride_row)[:, None] + cols[None, :]
    if MASK_COLS:
        x = tl.load(ptrs, mask=row_mask[:, None] & col_mask[None, :], other=0.0,
                    eviction_policy=EVICT).to(tl.float32)  # [BLOCK_N, BLOCK_V]
    else:
        x = tl.load(ptrs, mask=row_mask[:, None], other=0.0, eviction_policy=EVICT).to(tl.float32)
    if HAS_SOFTCAP:
        y = x / softcap
        th = tanh_libdevice(y, INTERPRET)
        z = softcap * th
        th = sech2(y, th)
    else:
        th = x
        z = x
    if MASK_COLS and FILL:
        z = tl.where(col_mask[None, :], z, float("-inf"))
    return z, th


@triton.jit
def _fold_tile(logits_ptr, class_w_ptr, rows64, cols, row_mask, col_mask, stride_row, softcap, m_run, s_run, sw_run,
               W_run, HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
               INTERPRET: tl.constexpr, MASK_COLS: tl.constexpr, EVICT: tl.constexpr):
    """Reads a tile and folds it into the rows' running statistics (max m, sum of exp(z - m), and for smoothing
    sum w (z - m) and sum w). Returns them updated, with the tile's logits, 1 - tanh^2 and exponentials
    [BLOCK_N, BLOCK_V]
    (exp(z - m), 0 past V)."""
    z, th = _load_tile(logits_ptr, rows64, cols, row_mask, col_mask, stride_row, softcap, HAS_SOFTCAP, INTERPRET,
                       MASK_COLS, MASK_COLS, EVICT)
    m_new = tl.maximum(m_run, tl.max(z, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile wholly past V (or of -inf logits) leaves -inf
    e = tl.exp2((z - m_safe[:, None]) * LOG2E)  # [BLOCK_N, BLOCK_V], 0 past V
    s_run = s_run * tl.exp2((m_run - m_safe) * LOG2E) + tl.sum(e, axis=1)
    if HAS_SMOOTHING:
        d = tl.where(col_mask[None, :], z - m_safe[:, None], 0.0)
        if HAS_WEIGHT:
            w = tl.load(class_w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            sw_t = tl.sum(d * w[None, :], axis=1)
            W_t = tl.sum(w, axis=0)
        else:
            sw_t = tl.sum(d, axis=1)
            W_t = tl.sum(col_mask.to(tl.float32), axis=0)
        sw_run = tl.where(W_run > 0, sw_run + W_run * (m_run - m_safe), 0.0) + sw_t
        W_run += W_t
    return m_new, s_run, sw_run, W_run, z, th, e


@triton.jit
def _row_terms(target_ptr, class_w_ptr, rows, row_mask, ignore_index, HAS_WEIGHT: tl.constexpr):
    """Per row: target (-1 where ignored or past N), valid mask, class weight of the target (0 where ignored)."""
    t = tl.load(target_ptr + rows, mask=row_mask, other=ignore_index)
    valid = (t != ignore_index) & row_mask
    t = tl.where(valid, t, -1)
    if HAS_WEIGHT:
        w_t = tl.load(class_w_ptr + tl.where(valid, t, 0), mask=valid, other=0.0).to(tl.float32)
    else:
        w_t = valid.to(tl.float32)
    return t, valid, w_t


@triton.jit
def _row_coef(g, lse, w_t, w_sum_ptr, eps, z_loss, V, HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
              HAS_ZLOSS: tl.constexpr):
    """(A, X, Ct, E) of dL/dz_j = p_j A - C [j == t] - E w_j; g is 0 on ignored rows. w_sum_ptr: the class
    weights' sum W (read with HAS_WEIGHT and HAS_SMOOTHING; V without class weights). The target's column is
    p_t X + (p_t - 1) Ct with Ct = C + E w_t and X = E (W - w_t) + 2 g z_loss lse, the same value: where p_t rounds
    to 1 (one class, a confident row) the z-loss term would be lost in cancelling p_t A against C + E w_t."""
    C = g * (1.0 - eps) * w_t
    A = C
    X = g * 0.0
    E = g * 0.0
    if HAS_SMOOTHING:
        E = g * (eps / V)
        if HAS_WEIGHT:
            W = tl.load(w_sum_ptr)
        else:
            W = V * 1.0
        A += E * W
        X = E * (W - w_t)
        C += E * w_t
    if HAS_ZLOSS:
        zl = g * (2.0 * z_loss) * lse
        A += zl
        X += zl
    return A, X, C, E


@triton.jit
def _grad_tile(p, A, X, dtanh, cols, t, C, E, class_w_ptr, col_mask,
               HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
               ONE_HOT: tl.constexpr = True):
    """dL/d(raw logits) of a tile from the probabilities p, in float32: [BLOCK_N, BLOCK_V]. ONE_HOT=False: the
    caller knows that no row's target is among these columns. dtanh: 1 - tanh^2 of the softcap."""
    dz = p * A[:, None]
    if HAS_SMOOTHING:
        if HAS_WEIGHT:
            w = tl.load(class_w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            dz -= E[:, None] * w[None, :]
        else:
            dz -= E[:, None]
    if ONE_HOT:
        # The target's column from (X, Ct) of _row_coef (PyTorch's error there is 1e-7 where p_t rounds to 1).
        dz = tl.where(cols[None, :] == t[:, None], p * X[:, None] + (p - 1.0) * C[:, None], dz)
    if HAS_SOFTCAP:
        dz = dz * dtanh
    return dz


@triton.jit
def _store_grad_tile(logits_ptr, out_ptr, rows64, cols, row_mask, col_mask, stride_row, stride_out_row, t, M, logS,
                     A, X, C, E, class_w_ptr, softcap, HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
                     HAS_SOFTCAP: tl.constexpr, INTERPRET: tl.constexpr):
    """Read a tile of logits, store its dL/dz (p_j = exp((z - M) - log S)) into out (which may be the logits)."""
    z, th = _load_tile(logits_ptr, rows64, cols, row_mask, col_mask, stride_row, softcap, HAS_SOFTCAP, INTERPRET,
                       True, True, "")
    p = tl.exp2(((z - M[:, None]) - logS[:, None]) * LOG2E)
    dz = _grad_tile(p, A, X, th, cols, t, C, E, class_w_ptr, col_mask, HAS_WEIGHT, HAS_SMOOTHING, HAS_SOFTCAP)
    tl.store(out_ptr + rows64[:, None] * stride_out_row + cols[None, :],
             cast(dz, out_ptr.dtype.element_ty, INTERPRET), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _target_logit(logits_ptr, rows64, t, valid, stride_row, softcap, HAS_SOFTCAP: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """The (softcapped) logit of each row's target, gathered from memory; 0 on ignored rows."""
    x = tl.load(logits_ptr + rows64 * stride_row + tl.where(valid, t, 0), mask=valid, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        x = softcap * tanh_libdevice(x / softcap, INTERPRET)
    return x


@triton.jit
def _finish_rows(loss_ptr, lse_ptr, stats_ptr, rows, rows64, row_mask, valid, w_t, M, logS, zt, smooth, eps, z_loss,
                 V, HAS_SMOOTHING: tl.constexpr, HAS_ZLOSS: tl.constexpr):
    """Store the per-row loss (0 on ignored rows), lse and (M, log S)."""
    loss = (1.0 - eps) * w_t * ((M - zt) + logS)
    if HAS_SMOOTHING:
        loss += (eps / V) * smooth
    lse_row = M + logS
    if HAS_ZLOSS:
        loss += z_loss * lse_row * lse_row
    tl.store(loss_ptr + rows, tl.where(valid, loss, 0.0), mask=row_mask)
    tl.store(lse_ptr + rows, lse_row, mask=row_mask)
    tl.store(stats_ptr + rows64 * 2, M, mask=row_mask)
    tl.store(stats_ptr + rows64 * 2 + 1, logS, mask=row_mask)


@triton.jit
def _grad_coef(scale_ptr, w_sum_ptr, valid, w_t, M, logS, eps, z_loss, V, HAS_SCALE: tl.constexpr,
               HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_ZLOSS: tl.constexpr):
    """(A, X, C, E) for upstream 1 (times the mean's 1 / denominator when HAS_SCALE)."""
    g = tl.where(valid, 1.0, 0.0)
    if HAS_SCALE:
        g = tl.where(valid, tl.load(scale_ptr), 0.0)  # 1 / 0 = inf when every row is ignored: never multiplied
    return _row_coef(g, M + logS, w_t, w_sum_ptr, eps, z_loss, V, HAS_WEIGHT, HAS_SMOOTHING, HAS_ZLOSS)


@triton.jit
def _ce_fwd_kernel(
    # tensors
    logits_ptr, target_ptr, class_w_ptr, w_sum_ptr, scale_ptr,
    loss_ptr, lse_ptr, stats_ptr, part_ptr, count_ptr,
    # sizes and strides
    N, V, K, n_units, lag, stride_row,
    # options
    ignore_index, eps, z_loss, softcap,
    # meta-parameters
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, TILES: tl.constexpr, K_POW2: tl.constexpr, SPLIT: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_ZLOSS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_SCALE: tl.constexpr, WRITE_GRAD: tl.constexpr, LAGGED: tl.constexpr, STATS_EVICT: tl.constexpr,
    GRAD_EVICT: tl.constexpr, GRAD_STORE_CM: tl.constexpr, STAGES: tl.constexpr, INTERPRET: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    if pid < n_units:
        _ce_stats_unit(pid, logits_ptr, target_ptr, class_w_ptr, w_sum_ptr, scale_ptr, loss_ptr, lse_ptr, stats_ptr,
                       part_ptr, count_ptr, N, V, K, stride_row, ignore_index, eps, z_loss, softcap, BLOCK_N, BLOCK_V,
                       TILES, K_POW2, SPLIT, HAS_WEIGHT, HAS_SMOOTHING, HAS_ZLOSS, HAS_SOFTCAP, HAS_SCALE,
                       WRITE_GRAD, LAGGED, STATS_EVICT, STAGES, INTERPRET)
    if LAGGED:
        if pid >= lag:
            _ce_lagged_grad_unit(pid - lag, logits_ptr, target_ptr, class_w_ptr, w_sum_ptr, scale_ptr, stats_ptr,
                                 count_ptr, N, V, K, stride_row, ignore_index, eps, z_loss, softcap, BLOCK_N,
                                 BLOCK_V, TILES, SPLIT, HAS_WEIGHT, HAS_SMOOTHING, HAS_ZLOSS, HAS_SOFTCAP, HAS_SCALE,
                                 GRAD_EVICT, GRAD_STORE_CM, INTERPRET)


@triton.jit
def _ce_stats_unit(
    pid, logits_ptr, target_ptr, class_w_ptr, w_sum_ptr, scale_ptr, loss_ptr, lse_ptr, stats_ptr, part_ptr, count_ptr,
    N, V, K, stride_row, ignore_index, eps, z_loss, softcap,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, TILES: tl.constexpr, K_POW2: tl.constexpr, SPLIT: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_ZLOSS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_SCALE: tl.constexpr, WRITE_GRAD: tl.constexpr, LAGGED: tl.constexpr, EVICT: tl.constexpr,
    STAGES: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Pass 1 of one work unit (TILES tiles of a row block): its statistics, and the row block's loss once they are
    all in. WRITE_GRAD (a whole row in one tile, TILES == 1, not SPLIT): also its gradient, from registers. LAGGED:
    the program that finishes a row block then publishes it (its counter past K, release) for the gradient units
    that wait on it."""
    NSTAT: tl.constexpr = 4 if HAS_SMOOTHING else 2
    rb = pid // K  # row block
    kt = pid % K  # which TILES * BLOCK_V columns of it
    rows = rb * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    rows64 = rows.to(tl.int64)
    t, valid, w_t = _row_terms(target_ptr, class_w_ptr, rows, row_mask, ignore_index, HAS_WEIGHT)

    # Pass 1: online max / sum of exp (and smoothing sums) over this program's TILES tiles.
    m_run = tl.full([BLOCK_N], float("-inf"), tl.float32)
    s_run = tl.zeros([BLOCK_N], tl.float32)
    sw_run = tl.zeros([BLOCK_N], tl.float32)  # sum_j w_j (z_j - m_run)
    W_run = tl.zeros([BLOCK_N], tl.float32)  # sum_j w_j
    if STAGES > 1:
        # Statistics alone: the whole tiles in a software-pipelined loop (their loads run STAGES - 1 tiles ahead
        # through shared memory, holding no registers), then the tile that crosses V, if this program has it.
        c_unit = kt * (TILES * BLOCK_V)
        n_full = tl.minimum(tl.maximum(V - c_unit, 0) // BLOCK_V, TILES)
        for i in tl.range(0, n_full, num_stages=STAGES):
            cols = (c_unit + i * BLOCK_V + tl.arange(0, BLOCK_V)).to(tl.int32)
            m_run, s_run, sw_run, W_run, _z, _th, _e = _fold_tile(
                logits_ptr, class_w_ptr, rows64, cols, row_mask, cols < V, stride_row, softcap, m_run, s_run,
                sw_run, W_run, HAS_WEIGHT, HAS_SMOOTHING, HAS_SOFTCAP, INTERPRET, False, EVICT)
        c0 = c_unit + n_full * BLOCK_V
        if (n_full < TILES) & (c0 < V):
            cols = (c0 + tl.arange(0, BLOCK_V)).to(tl.int32)
            m_run, s_run, sw_run, W_run, _z, _th, _e = _fold_tile(
                logits_ptr, class_w_ptr, rows64, cols, row_mask, cols < V, stride_row, softcap, m_run, s_run,
                sw_run, W_run, HAS_WEIGHT, HAS_SMOOTHING, HAS_SOFTCAP, INTERPRET, True, EVICT)
    else:
        # In place: unrolled tiles (the pipelined loop's asynchronous copies drop the L2 hint that keeps these
        # logits for the lagged gradient pass; measured slower, docs/cross_entropy.md).
        for i in tl.static_range(TILES):
            c0 = kt * (TILES * BLOCK_V) + i * BLOCK_V
            cols = (c0 + tl.arange(0, BLOCK_V)).to(tl.int32)
            col_mask = cols < V
            if WRITE_GRAD and TILES == 1:
                # The row stays in registers for its gradient (below): one tile, masked.
                m_run, s_run, sw_run, W_run, z, th, e = _fold_tile(
                    logits_ptr, class_w_ptr, rows64, cols, row_mask, col_mask, stride_row, softcap, m_run, s_run,
                    sw_run, W_run, HAS_WEIGHT, HAS_SMOOTHING, HAS_SOFTCAP, INTERPRET, True, EVICT)
            elif c0 + BLOCK_V <= V:
                m_run, s_run, sw_run, W_run, _z, _th, _e = _fold_tile(
                    logits_ptr, class_w_ptr, rows64, cols, row_mask, col_mask, stride_row, softcap, m_run, s_run,
                    sw_run, W_run, HAS_WEIGHT, HAS_SMOOTHING, HAS_SOFTCAP, INTERPRET, False, EVICT)
            else:
                m_run, s_run, sw_run, W_run, _z, _th, _e = _fold_tile(
                    logits_ptr, class_w_ptr, rows64, cols, row_mask, col_mask, stride_row, softcap, m_run, s_run,
                    sw_run, W_run, HAS_WEIGHT, HAS_SMOOTHING, HAS_SOFTCAP, INTERPRET, True, EVICT)

    if SPLIT:
        pbase = part_ptr + (rows64 * K + kt) * NSTAT
        tl.store(pbase, m_run, mask=row_mask)
        tl.store(pbase + 1, s_run, mask=row_mask)
        if HAS_SMOOTHING:
            tl.store(pbase + 2, sw_run, mask=row_mask)
            tl.store(pbase + 3, W_run, mask=row_mask)
        # Every thread's stores above happen before the release below (the barrier orders them within the program).
        tl.debug_barrier()
        prev = tl.atomic_add(count_ptr + rb, 1, sem="acq_rel")
        if prev == K - 1:
            # Last program of this row block to finish: merge the K partial statistics.
            ks = tl.arange(0, K_POW2)
            pmask = row_mask[:, None] & (ks < K)[None, :]
            pk = part_ptr + (rows64[:, None] * K + ks[None, :]) * NSTAT
            mk = tl.load(pk, mask=pmask, other=float("-inf"), cache_modifier=".cg")  # [BLOCK_N, K_POW2]
            sk = tl.load(pk + 1, mask=pmask, other=0.0, cache_modifier=".cg")
            M = tl.where(row_mask, tl.max(mk, axis=1), 0.0)
            S = tl.sum(sk * tl.exp2((mk - M[:, None]) * LOG2E), axis=1)
            logS = tl.log(tl.where(row_mask, S, 1.0))
            smooth = logS * 0.0
            if HAS_SMOOTHING:
                swk = tl.load(pk + 2, mask=pmask, other=0.0, cache_modifier=".cg")
                Wk = tl.load(pk + 3, mask=pmask, other=0.0, cache_modifier=".cg")
                # sum_j w_j (lse - z_j), every term >= 0: no cancellation
                smooth = tl.sum(tl.where(pmask, Wk * ((M[:, None] - mk) + logS[:, None]) - swk, 0.0), axis=1)
            # No program has written this row block yet: the target logits are still in memory.
            zt = _target_logit(logits_ptr, rows64, t, valid, stride_row, softcap, HAS_SOFTCAP, INTERPRET)
            _finish_rows(loss_ptr, lse_ptr, stats_ptr, rows, rows64, row_mask, valid, w_t, M, logS, zt, smooth, eps,
                         z_loss, V, HAS_SMOOTHING, HAS_ZLOSS)
            if LAGGED:
                _publish(count_ptr + rb)
    else:
        M = tl.where(row_mask, m_run, 0.0)
        logS = tl.log(tl.where(row_mask, s_run, 1.0))
        zt = _target_logit(logits_ptr, rows64, t, valid, stride_row, softcap, HAS_SOFTCAP, INTERPRET)
        _finish_rows(loss_ptr, lse_ptr, stats_ptr, rows, rows64, row_mask, valid, w_t, M, logS, zt,
                     W_run * logS - sw_run, eps, z_loss, V, HAS_SMOOTHING, HAS_ZLOSS)
        if LAGGED:
            _publish(count_ptr + rb)
        if WRITE_GRAD:
            # The whole row is in registers: p_j = exp(z_j - M) / S reuses pass 1's exponentials.
            A, X, C, E = _grad_coef(scale_ptr, w_sum_ptr, valid, w_t, M, logS, eps, z_loss, V, HAS_SCALE,
                                 HAS_WEIGHT, HAS_SMOOTHING, HAS_ZLOSS)
            p = e * tl.exp2(-logS * LOG2E)[:, None]
            dz = _grad_tile(p, A, X, th, cols, t, C, E, class_w_ptr, col_mask, HAS_WEIGHT, HAS_SMOOTHING,
                            HAS_SOFTCAP)
            tl.store(logits_ptr + rows64[:, None] * stride_row + cols[None, :],
                     cast(dz, logits_ptr.dtype.element_ty, INTERPRET), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _publish(flag_ptr):
    """Release a row block's statistics: the barrier orders every thread's stores of them before the one release."""
    tl.debug_barrier()
    tl.atomic_add(flag_ptr, 1, sem="release")


@triton.jit
def _ce_lagged_grad_unit(
    u, logits_ptr, target_ptr, class_w_ptr, w_sum_ptr, scale_ptr, stats_ptr, count_ptr,
    N, V, K, stride_row, ignore_index, eps, z_loss, softcap,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, TILES: tl.constexpr, SPLIT: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_ZLOSS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_SCALE: tl.constexpr, EVICT: tl.constexpr, STORE_CM: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Pass 2 of work unit u, `lag` units behind the program's pass 1: wait until u's row block is published, then
    read u's tiles again (read from DRAM `lag` units ago, so mostly from L2 now) and write their gradient over them.
    Every unit of that row block has a lower program id than this one (lag >= K), so the wait is only ever on programs
    started before this one, which never wait on it: the order in which the GPU starts the programs of a launch is
    all that is assumed, as in a decoupled look-back scan. The interpreter runs programs in order: it never waits."""
    rb = u // K
    kt = u % K
    rows = rb * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    rows64 = rows.to(tl.int64)
    if SPLIT:
        done = K + 1  # K arrivals, then the merging program's release
    else:
        done = 1  # the one program's release
    # Spin on an acquire read-modify-write (it reads the counter's latest value and synchronizes with the release that
    # published); the barrier then orders every thread's loads below after it.
    n = tl.atomic_add(count_ptr + rb, 0, sem="acquire")
    while n < done:
        n = tl.atomic_add(count_ptr + rb, 0, sem="acquire")
    tl.debug_barrier()
    M = tl.load(stats_ptr + rows64 * 2, mask=row_mask, other=0.0, cache_modifier=".cg")
    logS = tl.load(stats_ptr + rows64 * 2 + 1, mask=row_mask, other=0.0, cache_modifier=".cg")
    t, valid, w_t = _row_terms(target_ptr, class_w_ptr, rows, row_mask, ignore_index, HAS_WEIGHT)
    A, X, C, E = _grad_coef(scale_ptr, w_sum_ptr, valid, w_t, M, logS, eps, z_loss, V, HAS_SCALE, HAS_WEIGHT,
                         HAS_SMOOTHING, HAS_ZLOSS)
    # This pass shares the SM's instruction issue with pass 1, so it is lean: no -inf fill of the columns past V (they
    # are never stored), one fused multiply-add for the exponent, and the target's one-hot only in the tile where a
    # row's target lies.
    neg_log2S = logS * -LOG2E
    for i in tl.static_range(TILES):
        c0 = kt * (TILES * BLOCK_V) + i * BLOCK_V
        cols = (c0 + tl.arange(0, BLOCK_V)).to(tl.int32)
        col_mask = cols < V
        z, th = _load_tile(logits_ptr, rows64, cols, row_mask, col_mask, stride_row, softcap, HAS_SOFTCAP,
                           INTERPRET, True, False, EVICT)
        p = tl.exp2(tl.fma(z - M[:, None], LOG2E, neg_log2S[:, None]))
        if tl.max(((t >= c0) & (t < c0 + BLOCK_V)).to(tl.int32), axis=0) > 0:
            dz = _grad_tile(p, A, X, th, cols, t, C, E, class_w_ptr, col_mask, HAS_WEIGHT, HAS_SMOOTHING, HAS_SOFTCAP,
                            True)
        else:
            dz = _grad_tile(p, A, X, th, cols, t, C, E, class_w_ptr, col_mask, HAS_WEIGHT, HAS_SMOOTHING, HAS_SOFTCAP,
                            False)
        tl.store(logits_ptr + rows64[:, None] * stride_row + cols[None, :],
                 cast(dz, logits_ptr.dtype.element_ty, INTERPRET), mask=row_mask[:, None] & col_mask[None, :],
                 cache_modifier=STORE_CM)


@triton.jit
def _ce_bwd_kernel(
    # tensors
    grad_ptr, logits_ptr, out_ptr, target_ptr, class_w_ptr, w_sum_ptr, scale_ptr, stats_ptr,
    # sizes and strides
    N, V, stride_row, stride_out_row,
    # options
    ignore_index, eps, z_loss, softcap,
    # meta-parameters
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, HAS_GRAD: tl.constexpr, GRAD_PER_ROW: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_ZLOSS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_SCALE: tl.constexpr, INTERPRET: tl.constexpr,
):
    """out = upstream * dL/d(logits) from the saved (M, log S) per row; out may be the logits buffer itself."""
    pid_n = tl.program_id(0).to(tl.int64)
    pid_v = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    rows64 = rows.to(tl.int64)
    cols = (pid_v * BLOCK_V + tl.arange(0, BLOCK_V)).to(tl.int32)
    col_mask = cols < V

    t, valid, w_t = _row_terms(target_ptr, class_w_ptr, rows, row_mask, ignore_index, HAS_WEIGHT)
    g = tl.where(valid, 1.0, 0.0)
    if HAS_GRAD:
        if GRAD_PER_ROW:
            g = g * tl.load(grad_ptr + rows, mask=valid, other=0.0).to(tl.float32)
        else:
            g = g * tl.load(grad_ptr).to(tl.float32)
        g = tl.where(valid, g, 0.0)
    if HAS_SCALE:
        g = tl.where(valid, g * tl.load(scale_ptr), 0.0)
    M = tl.load(stats_ptr + rows64 * 2, mask=row_mask, other=0.0)
    logS = tl.load(stats_ptr + rows64 * 2 + 1, mask=row_mask, other=0.0)
    A, X, C, E = _row_coef(g, M + logS, w_t, w_sum_ptr, eps, z_loss, V, HAS_WEIGHT, HAS_SMOOTHING, HAS_ZLOSS)

    _store_grad_tile(logits_ptr, out_ptr, rows64, cols, row_mask, col_mask, stride_row, stride_out_row, t, M, logS,
                     A, X, C, E, class_w_ptr, softcap, HAS_WEIGHT, HAS_SMOOTHING, HAS_SOFTCAP, INTERPRET)


@triton.jit
def _ce_scale_kernel(
    # tensors
    buf_ptr, grad_ptr,
    # sizes and strides
    N, V, stride_row, n_row_blocks,
    # meta-parameters
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, GRAD_PER_ROW: tl.constexpr, INTERPRET: tl.constexpr,
):
    """buf *= upstream gradient, skipping (on the device) every row block whose upstream is exactly 1 (all of them,
    after one check, for a scalar upstream): the usual backward of an in-place forward then moves no data."""
    g_all = tl.load(grad_ptr).to(tl.float32)
    # g != 1 is also true for NaN, which must propagate
    if GRAD_PER_ROW or g_all != 1.0:
        for rb in range(tl.program_id(0), n_row_blocks, tl.num_programs(0)):
            rows = rb * BLOCK_N + tl.arange(0, BLOCK_N)
            row_mask = rows < N
            rows64 = rows.to(tl.int64)
            if GRAD_PER_ROW:
                g = tl.load(grad_ptr + rows, mask=row_mask, other=1.0).to(tl.float32)
            else:
                g = g_all + tl.zeros([BLOCK_N], dtype=tl.float32)
            if tl.sum(tl.where(g != 1.0, 1, 0), axis=0) > 0:
                for j in range(0, tl.cdiv(V, BLOCK_V)):
                    cols = (j * BLOCK_V + tl.arange(0, BLOCK_V)).to(tl.int32)
                    mask = row_mask[:, None] & (cols < V)[None, :]
                    ptrs = buf_ptr + rows64[:, None] * stride_row + cols[None, :]
                    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
                    tl.store(ptrs, cast(x * g[:, None], buf_ptr.dtype.element_ty, INTERPRET), mask=mask)

