"""Triton kernels of a linear head z = x @ W.T (+ b), softcapped and temperature-scaled, never stored whole.

Launchers (no autograd here). Inputs are 2-D and already validated: x (N, D) and W (V, D) of one dtype (float32,
bfloat16 or float16), b (V,) or None, class weights (V,) float32 or None. Strides are free (no copies are made).

    forward_stats(x, w, b, target, class_w, *, softcap, inv_temp, want_smooth, want_entropy, perm=None,
                  tile_lse=None)
        -> (m, logs, zt, sw, ent), each (N,) float32:
           m = max_j z_j;  logs = log sum_j exp(z_j - m) (lse = m + logs, kept apart so that z - m stays exact);
           zt = z_target;  sw = sum_j w_j (z_j - m) (w_j the class weights, or 1);  ent = entropy of softmax(z).
           zt / sw / ent are 0 when not asked for (target None, want_smooth / want_entropy False).
           tile_lse, a float32 buffer of tile_grid(x, w), receives per (token block b, vocabulary tile t) the
           largest log sum_{j in t} exp(z_ij) over the rows i of b: the statistic that bounds what the backward
           may skip (skip_plan).
    backward(x, w, b, target, class_w, m, logs, A, B, C, E, *, softcap, inv_temp, need_dx, need_dw, need_db,
             perm=None, tile_lse=None, skip_threshold=0.0)
        -> (dx | None, dw | None, db | None), in the dtypes of x, W and b, for the per-row float32 coefficients of
           dL/dz_j = p_j (A + B (z_j - m)) - C [j == target] - E w_j  (B, C, E may be None: that term is absent).
           With tile_lse and skip_threshold > 0 (and no B or E term), the (token block, tile) pairs that skip_plan
           finds cold are skipped: neither recomputed nor multiplied.

`perm` (optional, (V,) int32 from vocab_order) is an order of the vocabulary: tile t holds the classes
perm[t BLOCK_V ...], so that frequent classes share tiles. The kernels read W rows, bias and class weights through it
and write each dW row back to its own row; nothing of size V x D is copied. Forward and backward take the same perm.

`target` is (N,) int64 of class indices *local to W*: a value outside [0, V) (ignore_index, or a class held by
another vocabulary shard, the caller passing target - shard_start) contributes no target logit (zt = 0) and no
one-hot term. No function here synchronises with the host; grids and workspaces depend on shapes only.

Forward: programs own (token block x vocabulary split) and run an online log-sum-exp over their split's vocabulary
tiles (long splits first, then short ones that fill the grid's last wave: _fwd_layout); a second small kernel merges
the splits. Backward (docs/kernels.md): the vocabulary is walked in chunks; per
chunk one kernel recomputes the logits and writes dL/dz for the chunk into a workspace, then the two gradient
products run: dW rows of the chunk (reduction over all tokens in float32, written once) and the float32 dx
accumulator (read-modify-write once per chunk), through cuBLAS for bfloat16 / float16 on CUDA (torch.mm, and
torch.addmm with a float32 output, under _Fp32Reductions), else through _dgrad_kernel. The workspaces are carved
out of the gradient buffers before they are written, so the extra memory stays O(N) plus a bounded scratch. Nothing
uses atomics; _dgrad_kernel reduces in a fixed order, and cuBLAS is bitwise reproducible run to run on one GPU
model (NVIDIA's documented guarantee), so every gradient is.

Sparsity (docs/kernels.md): on a peaked softmax most (token block x tile) pairs hold a probability mass far below the
input dtype's resolution. skip_plan bounds, per row, the mass of the pairs it skips by skip_threshold and never skips
a tile that holds a row's target; the dz kernel returns at once on a cold pair, and both products walk only the hot
pairs (a list per token block and per tile, built on the device).
"""

from __future__ import annotations

import functools
import threading
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import _dispatch
from ..loss_math import default_workspace_bytes
from ._common import LOG2E, cdiv, cuda_facts

try:  # Triton >= 3.4
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

# Bytes of the one scratch buffer of the leanest plan (workspace_bytes <= SCRATCH_BYTES, e.g. 0): dL/dz of a
# vocabulary chunk when it cannot borrow a gradient buffer, and split-K partials. Tests shrink it to force many
# chunks. A larger budget (_workspace) buys a larger scratch and, past 4 N D bytes more, a float32 dx accumulator of
# its own.
SCRATCH_BYTES = 8 << 20
# Tests set this: every output and workspace starts as NaN, so an element that is never written shows up.
DEBUG_POISON = False
# The backward's two gradient products of a chunk (dW rows = dz^T x, dx_acc += dz W[chunk]) through cuBLAS
# (torch.mm / torch.addmm with a float32 output for dx) instead of _dgrad_kernel: None = for bfloat16 / float16
# on CUDA, without skipping or a vocabulary order, where torch has matmuls with a float32 output (>= 2.8). Tests
# set True to run the same calls on the CPU (there in float32). H200: fwd+bwd 2-5% faster at D >= 2304, 5-6% at
# qwen3-small (notes/linear_head.md, v17).
TORCH_PRODUCTS: bool | None = None
_MM_OUT_DTYPE = hasattr(torch.ops.aten.addmm, "dtype_out") and hasattr(torch.ops.aten.mm, "dtype_out")
# The forward keeps the logits of the first classes for the backward where the weight's gradient buffer has room for
# them before it is written (stash_layout): their recomputation is skipped. Tests and A/B runs turn it off.
STASH_LOGITS = True
# ... when it saves at least this many FLOP of recomputation (2 N D per stashed class): below, the stash's fixed
# costs (host time, the forward's stashing loop) outweigh it. H200 A/B: fwd+bwd 0.3% faster at qwen3-small's 2.2e11,
# 6.5% slower at (4096, 2048, 32000)'s 1.3e11, 2.5-16% faster from 2.4e12 up (notes/linear_head.md, v19).
STASH_MIN_FLOP = 5e11
# The forward writes the stash through a tensor descriptor (the copy engine) where its operands use them and the
# stash's rows are 16-byte aligned (N % 8 == 0); else with pointer stores. A/B runs turn it off.
STASH_TMA = True


def _new(shape, **kw) -> torch.Tensor:
    t = torch.empty(shape, **kw)
    return t.fill_(float("nan")) if DEBUG_POISON and t.is_floating_point() else t


# ------------------------------------------------------------------------------------------------------------------
# Device helpers


@triton.jit
def _tanh(y):
    # No tanh in the interpreter's libdevice: odd Taylor series near 0 (truncation < 1e-9 relative for |y| < 0.3),
    # (1 - e^-2|y|) / (1 + e^-2|y|) elsewhere (no cancellation there).
    th, _ = _tanh_slope(y)
    return th


@triton.jit
def _tanh_slope(y):
    """(tanh(y), 1 - tanh(y)^2). The slope is 4 t / (1 + t)^2 with t = e^-2|y|, from the exponential tanh already
    takes: no cancellation where tanh saturates (1 - th^2 there was 20-60x PyTorch's float32 error), a few ulp
    everywhere, and no second exponential."""
    a = tl.abs(y)
    t = tl.exp(-2.0 * a)
    big = (1.0 - t) / (1.0 + t)
    y2 = y * y
    p = y * (1.0 + y2 * (-0.3333333333333333 + y2 * (0.13333333333333333 + y2 * (
        -0.05396825396825397 + y2 * (0.021869488536155203 + y2 * -0.008863235529902197)))))
    th = tl.where(a < 0.3, p, tl.where(y < 0, -big, big))
    return th, 4.0 * t / ((1.0 + t) * (1.0 + t))


@triton.jit
def _exp(x):
    # e^x as 2^(x log2 e): Triton's exp adds a range test and two multiplies per element to return subnormal
    # results (below 2^-126); exp2 flushes those to zero, which no float32 sum or gradient here can resolve anyway.
    return tl.exp2(x * LOG2E)


@triton.jit
def _mma(a, b, acc, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # UPCAST (the interpreter, bfloat16): its bfloat16 dot is wrong in some Triton versions; bf16 products are exact
    # in float32.
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _cast(x, dtype: tl.constexpr, UPCAST: tl.constexpr):
    # float32 -> dtype rounding to nearest even; the interpreter truncates float32 -> bfloat16, so round by hand there.
    if UPCAST and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


@triton.jit
def _logits_tile(
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
            acc = _mma(xt, tl.trans(wt), acc, DOT_PRECISION, UPCAST)
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
            acc = _mma(xt, tl.trans(wt), acc, DOT_PRECISION, UPCAST)
            x_ptrs += BLOCK_K * stride_xd
            w_ptrs += BLOCK_K * stride_wd
    return acc


@triton.jit
def _classes(perm_ptr, cols, col_ok, HAS_PERM: tl.constexpr):
    # Vocabulary positions -> class indices (rows of W, entries of the bias and class weights); -1 where masked.
    if HAS_PERM:
        return tl.load(perm_ptr + cols, mask=col_ok, other=-1).to(tl.int64)
    return tl.where(col_ok, cols, -1)


@triton.jit
def _transform(acc, b_ptr, cols, col_ok, softcap, inv_temp,
               HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_TEMP: tl.constexpr):
    """Raw logits -> (z, zc, slope): zc = softcap * tanh((acc + b) / softcap) (or acc + b), z = zc * inv_temp, and
    slope = dzc / d(acc + b) (1.0 without a softcap; callers that do not use it pay nothing). `cols` are class
    indices (masked by col_ok)."""
    if HAS_BIAS:
        bias = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    zc = acc
    slope = 1.0
    if HAS_SOFTCAP:
        th, slope = _tanh_slope(acc / softcap)
        zc = softcap * th
    z = zc
    if HAS_TEMP:
        z = zc * inv_temp
    return z, zc, slope


@triton.jit
def _grouped(tile, n_rows, n_cols, GROUP: tl.constexpr):
    # Tiles of GROUP consecutive row blocks run together, so their operands are reused from L2.
    per_group = GROUP * n_cols
    group = tile // per_group
    first = group * GROUP
    size = tl.minimum(n_rows - first, GROUP)
    r = first + (tile % per_group) % size
    c = (tile % per_group) // size
    return r, c


# ------------------------------------------------------------------------------------------------------------------
# Forward: online log-sum-exp, target logit, smoothing and entropy sums, per (token block, vocabulary split)


@triton.jit
def _rescale_ent(ent, s, alpha, dm):
    # sum e d moved to a new max: alpha (ent + dm s), with alpha = exp(dm) and dm = m_old - m_new <= 0. Where alpha
    # underflows to 0, dm s may overflow to -inf (maxima near float32's range): the term is 0 there, not NaN.
    w = alpha * s
    return alpha * ent + tl.where(w > 0, w * dm, 0.0)


@triton.jit
def _fold_tile(z, col_ok, cls, cw_ptr, m, s, ent, sw, wsum,
               MASKED: tl.constexpr, HAS_SMOOTH: tl.constexpr, HAS_CLASS_WEIGHT: tl.constexpr,
               HAS_ENTROPY: tl.constexpr):
    """Folds a tile of logits z [BLOCK_N, BLOCK_V] into its rows' running statistics (see _fwd_kernel): max m, sum
    of exponentials s relative to m, entropy sum ent, smoothing sum sw, class-weight sum wsum. MASKED: columns
    where col_ok is false are past the vocabulary and do not count. Returns (m, s, ent, sw, wsum) updated and the
    tile's own sum of exponentials (relative to the new m)."""
    if MASKED:
        m_new = tl.maximum(m, tl.max(tl.where(col_ok[None, :], z, float("-inf")), axis=1))
    else:
        m_new = tl.maximum(m, tl.max(z, axis=1))
    alpha = _exp(m - m_new)
    d = z - m_new[:, None]
    e = _exp(d)
    if MASKED:
        e = tl.where(col_ok[None, :], e, 0.0)
    if HAS_ENTROPY:
        # A class at -inf (masked by a -inf bias) has e = 0 and adds 0, not 0 * -inf = NaN.
        ent = _rescale_ent(ent, s, alpha, m - m_new) + tl.sum(tl.where(e > 0, e * d, 0.0), axis=1)
    e_sum = tl.sum(e, axis=1)
    s = s * alpha + e_sum
    if HAS_SMOOTH:
        if HAS_CLASS_WEIGHT:
            cw = tl.load(cw_ptr + cls, mask=col_ok, other=0.0).to(tl.float32)
        else:
            cw = col_ok.to(tl.float32)
        sw = sw - wsum * (m_new - m) + tl.sum(cw[None, :] * d, axis=1)
        wsum += tl.sum(cw, axis=0)
    return m_new, s, ent, sw, wsum, e_sum


@triton.jit
def _fwd_step(
    x_ptr, w_ptr, b_ptr, cw_ptr, perm_ptr, tiles_out, zs_out, zo_out,
    N, V, D, n_vtiles, stride_xn, stride_xd, stride_wv, stride_wd, softcap, inv_temp,
    pid_n, row0, rows, row_ok, tgt, col0, m, s, zt, sw, ent, wsum,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_TARGET: tl.constexpr,
    HAS_SMOOTH: tl.constexpr, HAS_CLASS_WEIGHT: tl.constexpr, HAS_ENTROPY: tl.constexpr, HAS_PERM: tl.constexpr,
    RECORD_TILES: tl.constexpr, STASH: tl.constexpr, STASH_TMA: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
    EVEN_V: tl.constexpr,
):
    """One vocabulary tile of _fwd_kernel: the tile at col0 folded into the rows' running statistics; returns them
    and the next tile's col0. STASH: the tile's logits are also kept for the backward (STASH_TMA: zs_out is a
    tensor descriptor of [BLOCK_V, BLOCK_N] blocks of the (classes, N) stash)."""
    cols = col0 + tl.arange(0, BLOCK_V)  # vocabulary positions
    col_ok = cols < V
    cls = _classes(perm_ptr, cols, col_ok, HAS_PERM)
    acc = _logits_tile(x_ptr, w_ptr, perm_ptr, row0, col0, N, V, D, stride_xn, stride_xd, stride_wv, stride_wd,
                       HAS_PERM, BLOCK_N, BLOCK_V, BLOCK_K, EVEN_K, DOT_PRECISION, UPCAST, USE_TMA)
    z, zc, _ = _transform(acc, b_ptr, cls, col_ok, softcap, inv_temp, HAS_BIAS, HAS_SOFTCAP, HAS_TEMP)
    # Classes past V (only in the last tile unless EVEN_V) hold finite values and must not count: the masked
    # fold runs on that tile alone, since the epilogue is on the critical path. (With EVEN_V, a constant, the
    # `or` is decided at compile time: no run-time test.)
    if EVEN_V or col0 + BLOCK_V <= V:
        m_new, s, ent, sw, wsum, e_sum = _fold_tile(z, col_ok, cls, cw_ptr, m, s, ent, sw, wsum, False,
                                                    HAS_SMOOTH, HAS_CLASS_WEIGHT, HAS_ENTROPY)
    else:
        m_new, s, ent, sw, wsum, e_sum = _fold_tile(z, col_ok, cls, cw_ptr, m, s, ent, sw, wsum, True,
                                                    HAS_SMOOTH, HAS_CLASS_WEIGHT, HAS_ENTROPY)
    if RECORD_TILES:
        # The tile's log-sum-exp per row (exact: m_new + log of its own sum), maxed over the block's rows. A
        # sum that underflows gives -inf: its classes hold < 1e-38 of the row's mass each.
        tile_lse = tl.where(row_ok, m_new + tl.log(e_sum), float("-inf"))
        tl.store(tiles_out + pid_n.to(tl.int64) * n_vtiles + col0 // BLOCK_V, tl.max(tile_lse, axis=0))
    if STASH:
        # Classes [0, n_stash) (whole tiles) keep their logits for the backward (stash_layout): z minus the
        # running max, <= 0, in float16 (2^-11 relative), class-major, and the max itself per row and tile.
        # Clamped above float16's -65504: such a class has p = 0 either way.
        d = tl.maximum(z - m_new[:, None], -60000.0).to(tl.float16)
        if STASH_TMA:
            # The copy engine writes the transposed tile from shared memory (rows past N fall outside the
            # descriptor's bounds and are not written): no pointer tensor of the tile in registers, whose scattered
            # stores spilled (H200: the stashing loop's extra time fell from ~1 ms to ~0.6 ms a forward at
            # gemma2-2b; notes/linear_head.md, v20).
            zs_out.store([col0.to(tl.int32), row0.to(tl.int32)], tl.trans(d))
        else:
            zs = zs_out + (col0 * N + row0)
            offs = tl.arange(0, BLOCK_N)[:, None] + tl.arange(0, BLOCK_V)[None, :] * N
            tl.store(zs + offs, d, mask=row_ok[:, None])
        tl.store(zo_out + (col0 // BLOCK_V) * N + rows, m_new, mask=row_ok)
    if HAS_TARGET:
        # A target outside this launch's classes (ignored, or on another vocabulary shard) never matches.
        if HAS_PERM:
            zt += tl.sum(tl.where((cls[None, :] == tgt[:, None]) & col_ok[None, :], z, 0.0), axis=1)
        else:
            inside = (tgt >= col0) & (tgt < tl.minimum(col0 + BLOCK_V, V))
            # Most tiles hold none of the block's targets: the per-element select runs only where one does.
            if tl.max(inside.to(tl.int32), axis=0) > 0:
                # The target's offset in this tile per row (-1 outside it): one int32 compare per element.
                rel = tl.where(inside, tgt - col0, -1).to(tl.int32)
                zt += tl.sum(tl.where(tl.arange(0, BLOCK_V)[None, :] == rel[:, None], z, 0.0), axis=1)
    return m_new, s, zt, sw, ent, wsum, col0 + BLOCK_V


@triton.jit
def _fwd_kernel(
    # pointers
    x_ptr, w_ptr, b_ptr, t_ptr, cw_ptr, perm_ptr,
    m_out, s_out, zt_out, sw_out, ent_out, ws_out, tiles_out, zs_out, zo_out,
    # sizes
    N, V, D, n_big, tiles_big, n_small, tiles_small, n_vtiles, n_stash,
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
    EVEN_V: tl.constexpr,
):
    # Two phases of programs (_fwd_layout): first n_big splits of tiles_big tiles for every token block, then the
    # rest of each block's tiles in n_small splits of tiles_small, which fill the multiprocessors the first phase
    # leaves idle at its end. Split k of a block always covers the same tiles; the partials are per split.
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(N, BLOCK_N)
    if pid < n_blocks * n_big:
        pid_n, split = _grouped(pid, n_blocks, n_big, GROUP)
        j0 = split * tiles_big
        j1 = j0 + tiles_big
    else:
        pid_n, s2 = _grouped(pid - n_blocks * n_big, n_blocks, n_small, GROUP)
        split = n_big + s2
        j0 = n_big * tiles_big + s2 * tiles_small
        j1 = tl.minimum(j0 + tiles_small, n_vtiles)
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
            m, s, zt, sw, ent, wsum, col0 = _fwd_step(
                x_ptr, w_ptr, b_ptr, cw_ptr, perm_ptr, tiles_out, zs_out, zo_out,
                N, V, D, n_vtiles, stride_xn, stride_xd, stride_wv, stride_wd, softcap, inv_temp,
                pid_n, row0, rows, row_ok, tgt, col0, m, s, zt, sw, ent, wsum,
                HAS_BIAS, HAS_SOFTCAP, HAS_TEMP, HAS_TARGET, HAS_SMOOTH, HAS_CLASS_WEIGHT, HAS_ENTROPY, HAS_PERM,
                RECORD_TILES, phase == 0, STASH_TMA and phase == 0, BLOCK_N, BLOCK_V, BLOCK_K, EVEN_K,
                DOT_PRECISION, UPCAST, USE_TMA, EVEN_V)
    out = split.to(tl.int64) * N + rows
    tl.store(m_out + out, m, mask=row_ok)
    tl.store(s_out + out, s, mask=row_ok)
    if HAS_TARGET:
        tl.store(zt_out + out, zt, mask=row_ok)
    if HAS_SMOOTH:
        tl.store(sw_out + out, sw, mask=row_ok)
        if pid_n == 0:
            tl.store(ws_out + split, wsum)
    if HAS_ENTROPY:
        tl.store(ent_out + out, ent, mask=row_ok)


@triton.jit
def _combine_kernel(
    # pointers
    m_in, s_in, zt_in, sw_in, ent_in, ws_in,
    m_out, logs_out, zt_out, sw_out, ent_out,
    # sizes
    N, n_splits,
    # meta-parameters
    HAS_TARGET: tl.constexpr, HAS_SMOOTH: tl.constexpr, HAS_ENTROPY: tl.constexpr, BLOCK: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < N
    big_m = tl.full((BLOCK,), -1e30, tl.float32)
    off = rows
    for _ in range(0, n_splits):
        big_m = tl.maximum(big_m, tl.load(m_in + off, mask=ok, other=-1e30))
        off += N
    big_s = tl.zeros((BLOCK,), tl.float32)
    zt = tl.zeros((BLOCK,), tl.float32)
    sw = tl.zeros((BLOCK,), tl.float32)
    ent = tl.zeros((BLOCK,), tl.float32)
    off = rows
    for sp in range(0, n_splits):
        mi = tl.load(m_in + off, mask=ok, other=-1e30)
        si = tl.load(s_in + off, mask=ok, other=0.0)
        sc = _exp(mi - big_m)
        big_s += si * sc
        if HAS_TARGET:
            zt += tl.load(zt_in + off, mask=ok, other=0.0)
        if HAS_SMOOTH:
            sw += tl.load(sw_in + off, mask=ok, other=0.0) + tl.load(ws_in + sp) * (mi - big_m)
        if HAS_ENTROPY:
            ent += _rescale_ent(tl.load(ent_in + off, mask=ok, other=0.0), si, sc, mi - big_m)
        off += N
    big_s = tl.where(ok, big_s, 1.0)
    log_s = tl.log(big_s)
    tl.store(m_out + rows, big_m, mask=ok)
    tl.store(logs_out + rows, log_s, mask=ok)
    tl.store(zt_out + rows, zt, mask=ok)
    tl.store(sw_out + rows, sw, mask=ok)
    if HAS_ENTROPY:
        ent = log_s - ent / big_s
    tl.store(ent_out + rows, ent, mask=ok)


# ------------------------------------------------------------------------------------------------------------------
# Backward, step 1 of a vocabulary chunk: dL/dz of the chunk (and the bias gradient's per-token-block sums)


@triton.jit
def _dz_kernel(
    # pointers
    x_ptr, w_ptr, b_ptr, t_ptr, cw_ptr, perm_ptr, m_ptr, logs_ptr, a_ptr, bc_ptr, c_ptr, e_ptr, hot_ptr,
    dz_ptr, dbp_ptr, zs_ptr, zo_ptr,
    # sizes
    N, D, v_begin, v_end, n_vtiles,
    # strides
    stride_xn, stride_xd, stride_wv, stride_wd, stride_dz, stride_dzv, stride_dbp,
    # options
    softcap, inv_temp,
    # meta-parameters
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_B: tl.constexpr,
    HAS_C: tl.constexpr, HAS_E: tl.constexpr, HAS_CLASS_WEIGHT: tl.constexpr, STORE_DZ: tl.constexpr,
    HAS_DB: tl.constexpr, HAS_PERM: tl.constexpr, SKIP: tl.constexpr, LOAD_Z: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
):
    # Programs that run together share GROUP token blocks and their W tiles in L2. (Token-block-major, each wave
    # re-read the chunk's whole W: at gemma2-2b's first chunk the L2 hit rate rose from 67% to 78% with GROUP 8.)
    pid = tl.program_id(0)
    n_vt = tl.cdiv(v_end - v_begin, BLOCK_V)
    pid_n, pid_v = _grouped(pid, tl.cdiv(N, BLOCK_N), n_vt, GROUP)
    lcol0 = pid_v.to(tl.int64) * BLOCK_V  # column offset inside the chunk
    lcols = lcol0 + tl.arange(0, BLOCK_V)
    if SKIP:
        # A cold (token block, tile) pair: no recomputation, no dz (the products never read it), no bias gradient.
        # v_begin is a multiple of BLOCK_V, so this program's tile is one tile of the map.
        hot = tl.load(hot_ptr + pid_n.to(tl.int64) * n_vtiles + v_begin // BLOCK_V + pid_v)
        if hot == 0:
            if HAS_DB:
                tl.store(dbp_ptr + pid_n.to(tl.int64) * stride_dbp + lcols, tl.zeros((BLOCK_V,), tl.float32),
                         mask=lcols < v_end - v_begin)
            return
    row0 = pid_n.to(tl.int64) * BLOCK_N
    rows = row0 + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    col0 = lcol0 + v_begin
    cols = col0 + tl.arange(0, BLOCK_V)
    col_ok = cols < v_end
    cls = _classes(perm_ptr, cols, col_ok, HAS_PERM)
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
        acc = _logits_tile(x_ptr, w_ptr, perm_ptr, row0, col0, N, v_end, D, stride_xn, stride_xd, stride_wv,
                           stride_wd, HAS_PERM, BLOCK_N, BLOCK_V, BLOCK_K, EVEN_K, DOT_PRECISION, UPCAST, USE_TMA)
        z, _, slope = _transform(acc, b_ptr, cls, col_ok, softcap, inv_temp, HAS_BIAS, HAS_SOFTCAP, HAS_TEMP)
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
            g = g - tl.where(cls[None, :] == tgt[:, None], c[:, None], 0.0)
        else:
            inside = (tgt >= col0) & (tgt < tl.minimum(col0 + BLOCK_V, v_end))
            # Most tiles hold none of the block's targets: the per-element select runs only where one does.
            if tl.max(inside.to(tl.int32), axis=0) > 0:
                rel = tl.where(inside, tgt - col0, -1).to(tl.int32)  # the target's offset in the tile, or -1
                g = g - tl.where(tl.arange(0, BLOCK_V)[None, :] == rel[:, None], c[:, None], 0.0)
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
        dz_tile = dz_ptr + (row0 * stride_dz + lcol0 * stride_dzv)
        out = _cast(g, dz_ptr.dtype.element_ty, UPCAST)
        if (row0 + BLOCK_N <= N) & (col0 + BLOCK_V <= v_end):
            tl.store(dz_tile + offs, out)
        else:
            tl.store(dz_tile + offs, out, mask=ok)
    if HAS_DB:
        tl.store(dbp_ptr + pid_n.to(tl.int64) * stride_dbp + lcols, tl.sum(tl.where(ok, g, 0.0), axis=0),
                 mask=col_ok)


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
    pid_m, pid_d = _grouped(tile % n_out_tiles, tl.cdiv(n_vrows, BLOCK_M), tl.cdiv(D, BLOCK_D), GROUP)
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
                kk = blk * MAP_N + (s % (MAP_N // BLOCK_K)) * BLOCK_K + offs_k
                k_ok = kk < k_hi
                a = tl.load(dz_ptr + (kk[None, :] * stride_dz + offs_m[:, None]), mask=m_ok[:, None] & k_ok[None, :],
                            other=0.0)
                b = tl.load(x_ptr + (kk[:, None] * stride_xn + offs_d[None, :] * stride_xd),
                            mask=k_ok[:, None] & d_ok[None, :], other=0.0)
                acc = _mma(a, b, acc, DOT_PRECISION, UPCAST)
    if USE_TMA:
        # Descriptors of dz [BLOCK_K tokens, BLOCK_M classes] and x [BLOCK_K, BLOCK_D] (no skipping, no order):
        # reads past N, the chunk or D are zeros, and k_per_split is a multiple of BLOCK_K, so a split's last step
        # never reads into the next split.
        m0 = (pid_m * BLOCK_M).to(tl.int32)
        d0 = (pid_d * BLOCK_D).to(tl.int32)
        k0 = k_lo.to(tl.int32)
        for k in range(0, tl.cdiv((k_hi - k_lo).to(tl.int32), BLOCK_K)):
            a = dzt_desc.load([k0 + k * BLOCK_K, m0])
            b = x_desc.load([k0 + k * BLOCK_K, d0])
            acc = _mma(tl.trans(a), b, acc, DOT_PRECISION, UPCAST)
    elif dense:
        # Both operands are contiguous along the output dimension (classes of dz, columns of x): masks there keep
        # the loads vectorised, where clamped indices would not.
        a_ptrs = dz_ptr + k_lo * stride_dz + (offs_k[None, :] * stride_dz + offs_m[:, None])  # dz^T [BLOCK_M, BLOCK_K]
        b_ptrs = x_ptr + k_lo * stride_xn + (offs_k[:, None] * stride_xn + offs_d[None, :] * stride_xd)  # [K, D]
        for k in range(0, tl.cdiv(k_hi - k_lo, BLOCK_K)):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=d_ok[None, :], other=0.0)
            else:
                k_ok = offs_k < (k_hi - k_lo) - k * BLOCK_K
                a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
            acc = _mma(a, b, acc, DOT_PRECISION, UPCAST)
            a_ptrs += BLOCK_K * stride_dz
            b_ptrs += BLOCK_K * stride_xn
    out_rows = offs_m
    if SCATTER:
        # Vocabulary position -> its class's own row of dW (perm_ptr points at the chunk's first position).
        out_rows = tl.load(perm_ptr + offs_m, mask=m_ok, other=0).to(tl.int64)
    out = dw_ptr + ks.to(tl.int64) * stride_dws + (out_rows[:, None] * stride_dwv + offs_d[None, :] * stride_dwd)
    tl.store(out, _cast(acc, dw_ptr.dtype.element_ty, UPCAST), mask=m_ok[:, None] & d_ok[None, :])


@triton.jit
def _dx_tile(
    tile, dz_ptr, w_ptr, dx_ptr, perm_ptr, list_ptr, pre_ptr, dz_desc, w_desc,
    N, D, n_vrows, n_vtiles, tile0, tile1,
    stride_dz, stride_wv, stride_wd, stride_dxn, stride_dxd,
    ACCUMULATE: tl.constexpr, EVEN_K: tl.constexpr, HAS_PERM: tl.constexpr, SKIP: tl.constexpr,
    MAP_N: tl.constexpr, MAP_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
):
    pid_m, pid_d = _grouped(tile, tl.cdiv(N, BLOCK_M), tl.cdiv(D, BLOCK_D), GROUP)
    row0 = pid_m.to(tl.int64) * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = row0 + offs_m < N
    d_ok = offs_d < D
    m_in = tl.minimum(row0 + offs_m, N - 1)  # rows past N repeat the last one (strided dimension); not stored
    out = dx_ptr + row0 * stride_dxn + (offs_m[:, None] * stride_dxn + offs_d[None, :] * stride_dxd)
    ok = m_ok[:, None] & d_ok[None, :]
    if ACCUMULATE:
        acc = tl.load(out, mask=ok, other=0.0)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    dense = True
    if SKIP:
        # The hot tiles of this token block (MAP_N is a multiple of BLOCK_M) inside the chunk's tiles [tile0, tile1),
        # ascending: list_ptr[blk, pre[blk, tile0] : pre[blk, tile1]]. All of them hot: the dense loop below.
        blk = row0 // MAP_N
        s_lo = tl.load(pre_ptr + blk * (n_vtiles + 1) + tile0)
        s_hi = tl.load(pre_ptr + blk * (n_vtiles + 1) + tile1)
        dense = s_hi - s_lo == tile1 - tile0
        if s_hi - s_lo != tile1 - tile0:
            # (MAP_V // BLOCK_K reduction steps per tile)
            for s in range(s_lo * (MAP_V // BLOCK_K), s_hi * (MAP_V // BLOCK_K)):
                t = tl.load(list_ptr + blk * n_vtiles + s // (MAP_V // BLOCK_K))
                kk = (t - tile0).to(tl.int64) * MAP_V + (s % (MAP_V // BLOCK_K)) * BLOCK_K + offs_k  # chunk columns
                k_ok = kk < n_vrows
                a = tl.load(dz_ptr + (m_in[:, None] * stride_dz + kk[None, :]), mask=k_ok[None, :], other=0.0)
                wr = kk
                if HAS_PERM:
                    wr = tl.load(perm_ptr + kk, mask=k_ok, other=0).to(tl.int64)
                b = tl.load(w_ptr + (wr[:, None] * stride_wv + offs_d[None, :] * stride_wd),
                            mask=k_ok[:, None] & d_ok[None, :], other=0.0)
                acc = _mma(a, b, acc, DOT_PRECISION, UPCAST)
    if USE_TMA:
        # Descriptors of dz [BLOCK_M tokens, BLOCK_K classes] and of the chunk's W rows [BLOCK_K, BLOCK_D]: reads
        # past N, the chunk or D are zeros.
        r0 = row0.to(tl.int32)
        d0 = (pid_d * BLOCK_D).to(tl.int32)
        for k in range(0, tl.cdiv(n_vrows, BLOCK_K)):
            a = dz_desc.load([r0, k * BLOCK_K])
            b = w_desc.load([k * BLOCK_K, d0])
            acc = _mma(a, b, acc, DOT_PRECISION, UPCAST)
    elif dense:
        a_ptrs = dz_ptr + (m_in[:, None] * stride_dz + offs_k[None, :])  # dz [BLOCK_M, BLOCK_K]
        b_ptrs = w_ptr + (offs_k[:, None] * stride_wv + offs_d[None, :] * stride_wd)  # W[chunk] [BLOCK_K, BLOCK_D]
        for k in range(0, tl.cdiv(n_vrows, BLOCK_K)):
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
            acc = _mma(a, b, acc, DOT_PRECISION, UPCAST)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K * stride_wv
    tl.store(out, acc, mask=ok)


@triton.jit
def _dgrad_kernel(
    # pointers (dz_ptr, and dw_ptr unless SCATTER, at the chunk's first column / output row; w_ptr at the chunk's
    # first row, or at W itself with a perm; perm_ptr at the chunk's first position)
    dz_ptr, x_ptr, w_ptr, dw_ptr, dx_ptr, perm_ptr, list_n_ptr, pre_n_ptr, list_v_ptr, pre_v_ptr,
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
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
):
    # The long dW tiles (reduction over all N tokens) come first so the short dx tiles fill the tail of the grid.
    # list_n / pre_n: hot tiles per token block (for dx); list_v / pre_v: hot token blocks per tile (for dW).
    pid = tl.program_id(0)
    if DO_DW and DO_DX:
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
                     SKIP, MAP_N, MAP_V, BLOCK_M, BLOCK_D, BLOCK_K, GROUP, DOT_PRECISION, UPCAST, USE_TMA)
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
                 SKIP, MAP_N, MAP_V, BLOCK_M, BLOCK_D, BLOCK_K, GROUP, DOT_PRECISION, UPCAST, USE_TMA)


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
    tl.store(out_ptr + dst, _cast(acc, out_ptr.dtype.element_ty, UPCAST), mask=ok)


# ------------------------------------------------------------------------------------------------------------------
# The gradient products through torch (cuBLAS)


def _torch_products(x: torch.Tensor, w: torch.Tensor, skip: bool, has_perm: bool) -> bool:
    # Rows with unit stride only: cuBLAS would need a copy of an operand strided otherwise.
    if skip or has_perm or x.stride(1) != 1 or w.stride(1) != 1:
        return False
    if TORCH_PRODUCTS is not None:
        return TORCH_PRODUCTS
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and _MM_OUT_DTYPE


class _Fp32Reductions:
    """While active, cuBLAS reduces bfloat16 / float16 products in float32 only: by default PyTorch lets it reduce
    split-K partials in the output's dtype (and a user may turn on float16 accumulation), which would be bf16 / fp16
    accumulation across tiles. Reentrant and thread-safe (autograd runs one backward thread per GPU): the first
    entry saves the user's settings, the last exit restores them, and in between every cuBLAS call of the process
    reduces in float32 (never less precise than the user asked)."""

    _lock = threading.Lock()
    _active = 0
    _saved: dict = {}

    def __enter__(self):
        with self._lock:
            if _Fp32Reductions._active == 0:
                saved = {}
                for k in ("bf16", "fp16"):
                    get = getattr(torch._C, f"_get_cublas_allow_{k}_reduced_precision_reduction", None)
                    if get is not None:
                        saved[k] = get()
                        setattr(torch.backends.cuda.matmul, f"allow_{k}_reduced_precision_reduction", False)
                if hasattr(torch._C, "_get_cublas_allow_fp16_accumulation"):
                    saved["acc"] = torch._C._get_cublas_allow_fp16_accumulation()
                    torch._C._set_cublas_allow_fp16_accumulation(False)
                _Fp32Reductions._saved = saved
            _Fp32Reductions._active += 1
        return self

    def __exit__(self, *exc):
        with self._lock:
            _Fp32Reductions._active -= 1
            if _Fp32Reductions._active == 0:
                saved = _Fp32Reductions._saved
                for k in ("bf16", "fp16"):
                    if k in saved:
                        v = saved[k]
                        setattr(torch.backends.cuda.matmul, f"allow_{k}_reduced_precision_reduction",
                                v if isinstance(v, bool) else tuple(v))
                if "acc" in saved:
                    torch._C._set_cublas_allow_fp16_accumulation(saved["acc"])
        return False


def _products_torch(dz, x, wc, dw_rows, dx_acc, accumulate: bool) -> None:
    """dw_rows = dz^T @ x (float32 accumulation, one rounding to dw_rows' dtype) and dx_acc (float32) = or +=
    dz @ wc, for dz (N, rows) and wc (rows, D); either output may be None."""
    with _Fp32Reductions():
        if not x.is_cuda:  # the tests' stand-in: the same products in float32
            if dw_rows is not None:
                dw_rows.copy_(dz.t().float() @ x.float())
            if dx_acc is not None:
                torch.addmm(dx_acc, dz.float(), wc.float(), beta=1.0 if accumulate else 0.0, out=dx_acc)
            return
        # (float32 operands, only when a test forces this path on CUDA: the plain float32 products)
        to_f32 = dict(out_dtype=torch.float32) if dz.dtype != torch.float32 else {}
        if dw_rows is not None:
            torch.mm(dz.t(), x, out=dw_rows)
        if dx_acc is not None:
            if accumulate:
                torch.addmm(dx_acc, dz, wc, **to_f32, out=dx_acc)
            else:
                torch.mm(dz, wc, **to_f32, out=dx_acc)


# ------------------------------------------------------------------------------------------------------------------
# Configuration


class Config(NamedTuple):
    block_n: int  # forward / dz tiles: tokens
    block_v: int  # forward / dz tiles: classes
    block_k: int  # reduction step of the logits product
    fwd_warps: int
    fwd_stages: int
    block_m: int  # gradient products: output rows
    block_d: int  # gradient products: output columns
    block_kg: int  # gradient products: reduction step
    grad_warps: int
    grad_stages: int
    group: int
    waves: int  # forward: programs per multiprocessor of the equal-split layout _fwd_layout starts from (and bounds)
    dz_block_v: int  # classes per dz tile (its epilogue is heavier than the forward's)
    tma: bool = False  # forward / dz operands through tensor descriptors (the copy engine) where possible
    balance: bool = True  # split the dW reduction when a chunk's few long dW tiles would idle most of the GPU
    wide: int = 4096  # first-pass chunks up to this many classes while their dz fits in unwritten dW rows
    grad_tma: bool = False  # gradient products' operands through tensor descriptors where possible


# Hopper-class GPUs, bf16/fp16 (H200, llama3-8b uniform; notes/linear_head.md): forward 128 x 256 x 64 tiles, 8
# warps, 3 stages (28.2 ms against 34.2 for 128 x 128); dz tiles 128 x 256 (fwd+bwd 134.5 ms against 140.2 for
# 128 x 128); gradient products 128 x 256 x 64, 4 stages (137.1 against 140.2 for 3 stages). Forward and dz operands
# through tensor descriptors (v6: no-grad log-probs 1.01-1.07 x one cuBLAS product at three of the four shapes,
# against 1.24-1.28 x with pointer loads, each in its own timing loop; fwd+bwd 5-8% faster); a flattened tile loop
# (tl.range(flatten=True)) was 30% slower and is not used. v7: the gradient products' operands through descriptors
# too (fwd+bwd 1-4% faster), and first-pass chunks of up to 4096 classes (qwen3-small 51 -> 46 ms, gemma2-2b 73 -> 68).
# v8: up to 8192 (half the dx accumulator's round trips at llama3-8b and mistral-nemo, whose chunks were D wide):
# fwd+bwd 0.4-1.2% faster at all four shapes in an interleaved A/B (scripts/gpu_ab.py), gradients bitwise the same.
_GPU_CONFIG = Config(128, 256, 64, 8, 3, 128, 256, 64, 8, 4, 8, 8, 256, tma=True, grad_tma=True, wide=8192)
_GPU_CONFIG_FP32 = Config(64, 64, 32, 4, 2, 64, 64, 32, 4, 2, 8, 8, 64)
# The interpreter: small tiles so that small test shapes still have several partial tiles in every direction.
_INTERPRETER_CONFIG = Config(32, 64, 32, 1, 1, 32, 32, 32, 1, 1, 2, 4, 64, wide=160)
# Tests and the GPU script may set this to try other tiles.
CONFIG_OVERRIDE: Config | None = None


def gpu_config(dtype: torch.dtype, major: int, max_smem: int) -> Config:
    """The tiles for a CUDA device of compute capability `major`.x whose blocks may use `max_smem` bytes of shared
    memory. Hopper-class memory (>= 200 KB a block) gets the measured tiles above. Smaller (A100's 163 KB, the 99 KB
    of sm_86 / sm_89 / sm_120 cards) gets 128 x 128 x 32 tiles everywhere: the Hopper tiles' gradient products need
    112 KB there, and on sm_80 every big-tile kernel spills (scripts/compile_check.py: 96-1736 bytes of stack per
    thread), while these compile in at most 48 KB with at most 8 bytes of stack on sm_80, sm_86, sm_89 and sm_120.
    Not timed: no such GPU was at hand. Tensor descriptors wherever the copy engine exists (compute capability >= 9)."""
    if dtype == torch.float32:
        return _GPU_CONFIG_FP32
    if max_smem >= 200 * 1024:
        cfg = _GPU_CONFIG
    else:
        cfg = _GPU_CONFIG._replace(block_v=128, block_k=32, block_d=128, block_kg=32, dz_block_v=128)
    if major < 9:
        cfg = cfg._replace(tma=False, grad_tma=False)
    return cfg


@functools.cache
def _device_config(index: int, dtype: torch.dtype) -> Config:
    from triton.runtime import driver

    smem = driver.active.utils.get_device_properties(index)["max_shared_mem"]
    return gpu_config(dtype, torch.cuda.get_device_capability(index)[0], smem)


def _config(x: torch.Tensor) -> Config:
    if CONFIG_OVERRIDE is not None:
        return CONFIG_OVERRIDE
    if x.device.type != "cuda":
        return _INTERPRETER_CONFIG
    return _device_config(x.device.index if x.device.index is not None else torch.cuda.current_device(), x.dtype)


def _dot_flags(x: torch.Tensor) -> dict:
    # float32 inputs get true float32 products (PyTorch's default), not tf32.
    upcast = x.device.type != "cuda" and x.dtype == torch.bfloat16
    return dict(DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", UPCAST=upcast)


# The forward's stand-in under the interpreter: enough multiprocessors that the tests' small shapes split each row
# over both phases of _fwd_layout (with _num_sms's 2, most would run whole rows in one program).
_INTERPRETER_FWD_SMS = 8


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return cuda_facts(device.index)[0]
    return 2


def _use_tma(cfg: Config, x: torch.Tensor, w: torch.Tensor, perm) -> bool:
    """Tensor descriptors need Triton's descriptor API, a GPU with the copy engine (Hopper or newer; the interpreter
    emulates it), no vocabulary order (the copy engine reads whole blocks of rows, not gathered ones), a unit last
    stride and 16-byte aligned bases and row strides."""
    return cfg.tma and perm is None and _tma_ok(x, w)


def _tma_ok(*tensors: torch.Tensor) -> bool:
    # The descriptor API, the copy engine, and 2-D operands it can address (see _use_tma).
    if TensorDescriptor is None:
        return False
    if tensors[0].device.type == "cuda" and not cuda_facts(tensors[0].device.index)[1]:
        return False
    return all(t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
               for t in tensors)


def _operands(x, w, use_tma: bool, block_n: int, block_v: int, block_k: int):
    # What the logits product reads: the tensors, or descriptors of their [block, block_k] tiles.
    if not use_tma:
        return x, w
    return (TensorDescriptor.from_tensor(x, [block_n, block_k]), TensorDescriptor.from_tensor(w, [block_v, block_k]))


def _dummy(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(1)


# ------------------------------------------------------------------------------------------------------------------
# Sparsity: the vocabulary order, and which (token block, tile) pairs the backward may skip


def skip_supported(x: torch.Tensor) -> bool:
    """Whether this input's tiles allow skipping: the dz tiles are the forward's (token block x tile), and the
    gradient products' output tiles and reduction steps nest inside them."""
    c = _config(x)
    return (c.dz_block_v == c.block_v and c.block_v % c.block_m == 0 and c.block_v % c.block_kg == 0
            and c.block_n % c.block_m == 0 and c.block_n % c.block_kg == 0)


def tile_grid(x: torch.Tensor, w: torch.Tensor) -> tuple[int, int]:
    """(token blocks, vocabulary tiles) of the forward's tiles: the shape of forward_stats' tile_lse."""
    cfg = _config(x)
    return cdiv(x.shape[0], cfg.block_n), cdiv(w.shape[0], cfg.block_v)


def _segments(N: int, V: int, D: int, elt: int, cfg: Config, ws: _Workspace) -> list[int]:
    # Boundaries of the vocabulary ranges an order may permute within (the positions of a range hold the classes of
    # that range). With bf16/fp16 inputs the backward keeps its workspaces in rows of dW that are not written yet:
    # the dx accumulator in the rows after the first pass, and each second-pass chunk's dz in the rows after the
    # chunk. A chunk may therefore write back only its own rows.
    if elt == 4 or ws.own_acc or V * D < 2 * N * D + 8:
        return [0, V]
    _, dw_end = _acc_region(N, V, D, cfg, True)
    return [0, dw_end] + [v1 for _, v1, _ in _second_pass(N, V, D, elt, cfg, dw_end, True, ws.scratch)]


def vocab_order(counts: torch.Tensor, x: torch.Tensor, w: torch.Tensor, workspace_bytes: int | None = None
                ) -> torch.Tensor:
    """(V,) int32 order of the vocabulary for per-class counts (V,): the classes of each range of _segments by
    decreasing count (ties by index), so that frequent classes share tiles. Device ops only, no host sync. The
    backward that uses it must get the same workspace_bytes (the ranges depend on where its workspaces live)."""
    V = w.shape[0]
    N, D = x.shape
    by_count = torch.sort(counts.reshape(V), descending=True, stable=True).indices
    key = torch.argsort(by_count)  # rank of each class in the global order
    ws = _workspace(N, V, D, x.element_size(), workspace_bytes)
    for bound in _segments(N, V, D, x.element_size(), _config(x), ws)[1:-1]:
        key[bound:] += V
    return torch.sort(key).indices.to(torch.int32)


class SkipPlan(NamedTuple):
    """Which (token block, tile) pairs of the forward's tiles the backward computes, and the lists its kernels walk."""

    hot: torch.Tensor  # (n_blocks, n_vtiles) uint8: 1 where the pair is computed
    list_n: torch.Tensor  # (n_blocks, n_vtiles) int32: per token block, its hot tiles first, ascending
    pre_n: torch.Tensor  # (n_blocks, n_vtiles + 1) int32: hot tiles of the block before each tile
    list_v: torch.Tensor  # (n_vtiles, n_blocks) int32: per tile, its hot token blocks first, ascending
    pre_v: torch.Tensor  # (n_vtiles, n_blocks + 1) int32: hot blocks of the tile before each block
    row_bound: torch.Tensor  # (N,) float32: bound on each row's skipped probability mass (0 where A = 0)


# Fixed-point unit of the skipped-mass sums: threshold / 2^20 (each bound rounded up). An integer running sum is
# exact, so the plan, and the gradients, are the same on every run.
_UNIT = float(1 << 20)
_NEVER = 1 << 40


def skip_plan(tile_lse, m, logs, A, target, perm, V, threshold, block_n, block_v) -> SkipPlan:
    """The cold pairs for the backward, on the device (no host sync).

    Pair (b, t) holds, for each row i of block b, the probability mass sum_{j in t} p_ij <= exp(tile_lse[b, t] -
    lse_i). Per block, tiles are skipped coldest first while the sum of their bounds stays <= threshold for the
    block's smallest lse_i among rows with A_i != 0 (rows with A_i = 0 have no p term to lose); a tile holding a
    row's target is never skipped (the one-hot term). So every row loses at most `threshold` of its mass, and each
    gradient row at most threshold * |A_i| (docs/kernels.md)."""
    B, T = tile_lse.shape
    N = m.shape[0]
    inf = float("inf")
    lse = m + logs
    active = A != 0
    lse_act = torch.where(active, lse, torch.full_like(lse, inf))
    low = torch.nn.functional.pad(lse_act, (0, B * block_n - N), value=inf).view(B, block_n).amin(1)  # (B,)
    log_bound = tile_lse.double() - low.double()[:, None]  # -inf for a block with no active row: all cold
    q = (torch.exp(log_bound) * (_UNIT / threshold)).nan_to_num(nan=inf).clamp(max=_NEVER).ceil().to(torch.int64)
    if target is not None:
        pos = target
        if perm is not None:
            pos = torch.argsort(perm)[target.clamp(0, V - 1)]
        valid = (target >= 0) & (target < V)
        tile = torch.where(valid, pos // block_v, T)
        rows_block = torch.arange(N, device=m.device) // block_n
        forced = torch.zeros(B * (T + 1), device=m.device, dtype=torch.bool)
        forced.index_fill_(0, rows_block * (T + 1) + tile, True)
        q = torch.where(forced.view(B, T + 1)[:, :T], _NEVER, q)
    q_sorted, order = torch.sort(q, dim=1, stable=True)
    cold = torch.zeros_like(q, dtype=torch.bool).scatter_(1, order, q_sorted.cumsum(1) <= _UNIT)
    hot = ~cold
    mass = torch.where(cold, torch.exp(log_bound), 0.0).sum(1)  # per block, in units of exp(-low)
    blk = torch.arange(N, device=m.device) // block_n
    row_bound = torch.where(active, mass[blk] * torch.exp(low.double()[blk] - lse.double()), 0.0).float()
    cold_i, cold_t = cold.to(torch.int32), cold.t().contiguous().to(torch.int32)
    pad = torch.nn.functional.pad
    return SkipPlan(
        hot.to(torch.uint8).contiguous(),
        torch.sort(cold_i, dim=1, stable=True).indices.to(torch.int32).contiguous(),
        pad(hot.to(torch.int32).cumsum(1, dtype=torch.int32), (1, 0)).contiguous(),
        torch.sort(cold_t, dim=1, stable=True).indices.to(torch.int32).contiguous(),
        pad((1 - cold_t).cumsum(1, dtype=torch.int32), (1, 0)).contiguous(),
        row_bound,
    )


# Tests and the GPU script set this to a list: backward appends each SkipPlan it uses.
DEBUG_PLANS: list | None = None


# ------------------------------------------------------------------------------------------------------------------
# Launchers


def forward_stats(x, w, b, target, class_w, *, softcap, inv_temp, want_smooth, want_entropy, perm=None,
                  tile_lse=None, stash=None):
    """Per-row (m, logs, zt, sw, ent) float32 of the head (and tile_lse filled when given); see the module
    docstring. stash: None, or (buffer, layout), a (V, D) tensor of W's dtype that will be the weight's gradient
    and its stash_layout: the logits of the layout's classes are kept there for backward(stash=buffer)."""
    N, D = x.shape
    V = w.shape[0]
    f32 = dict(device=x.device, dtype=torch.float32)
    outs = [_new(N, **f32) for _ in range(5)]
    if N == 0:
        return tuple(outs)
    cfg = _config(x)
    n_blocks = cdiv(N, cfg.block_n)
    n_vtiles = cdiv(V, cfg.block_v)
    if tile_lse is not None:
        assert tile_lse.shape == (n_blocks, n_vtiles) and tile_lse.dtype == torch.float32
        assert tile_lse.is_contiguous()
    sms = _num_sms(x.device) if x.device.type == "cuda" else _INTERPRETER_FWD_SMS
    n_big, tiles_big, n_small, tiles_small = _fwd_layout(n_blocks, n_vtiles, sms, cfg.group, cfg.waves)
    n_splits = n_big + n_small
    has_target = target is not None
    dummy = _dummy(x)
    # Partial statistics per split: m and s always, the others only where asked for.
    kept = [True, True, has_target, bool(want_smooth), bool(want_entropy)]
    part = _new((sum(kept), n_splits, N), **f32)
    part = [part[sum(kept[:i])] if k else dummy for i, k in enumerate(kept)]
    wsum = _new(n_splits, **f32)
    tma = _use_tma(cfg, x, w, perm)
    xo, wo = _operands(x, w, tma, cfg.block_n, cfg.block_v, cfg.block_k)
    zs = zo = dummy
    n_stash = 0
    stash_tma = False
    if stash is not None:
        buf, lay = stash
        assert perm is None and buf.shape == (V, D) and buf.is_contiguous() and lay.classes % cfg.block_v == 0
        zs, zo = _stash_views(buf, lay, N, cfg)
        n_stash = lay.classes
        stash_tma = STASH_TMA and tma and _tma_ok(zs)
        if stash_tma:
            zs = TensorDescriptor.from_tensor(zs, [cfg.block_v, cfg.block_n])
    _fwd_kernel[(n_blocks * n_splits,)](
        xo, wo, b if b is not None else dummy, target if has_target else dummy,
        class_w if class_w is not None else dummy, perm if perm is not None else dummy,
        part[0], part[1], part[2], part[3], part[4], wsum, tile_lse if tile_lse is not None else dummy, zs, zo,
        N, V, D, n_big, tiles_big, n_small, tiles_small, n_vtiles, n_stash,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1),
        float(softcap or 1.0), float(inv_temp),
        HAS_BIAS=b is not None, HAS_SOFTCAP=softcap is not None, HAS_TEMP=inv_temp != 1.0, HAS_TARGET=has_target,
        HAS_SMOOTH=bool(want_smooth), HAS_CLASS_WEIGHT=class_w is not None, HAS_ENTROPY=bool(want_entropy),
        HAS_PERM=perm is not None, RECORD_TILES=tile_lse is not None, STASH=stash is not None,
        STASH_TMA=stash_tma, BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_K=cfg.block_k, GROUP=cfg.group,
        EVEN_K=D % cfg.block_k == 0, **_dot_flags(x), USE_TMA=tma, EVEN_V=V % cfg.block_v == 0,
        num_warps=cfg.fwd_warps, num_stages=cfg.fwd_stages,
    )
    block = 256 if x.device.type == "cuda" else 32
    _combine_kernel[(cdiv(N, block),)](
        part[0], part[1], part[2], part[3], part[4], wsum,
        outs[0], outs[1], outs[2], outs[3], outs[4],
        N, n_splits,
        HAS_TARGET=has_target, HAS_SMOOTH=bool(want_smooth), HAS_ENTROPY=bool(want_entropy), BLOCK=block,
        num_warps=4,
    )
    return tuple(outs)


@functools.lru_cache(maxsize=1024)
def _fwd_layout(n_blocks: int, n_vtiles: int, sms: int, group: int, waves: int) -> tuple[int, int, int, int]:
    """Vocabulary splits of the forward: (n_big, tiles_big, n_small, tiles_small). Every token block's tiles are
    cut the same way: n_big splits of tiles_big, then the remaining tiles in n_small splits of tiles_small (the
    last one shorter). The n_blocks * n_big programs of the first phase run before those of the second.

    One program per multiprocessor runs at a time, so with equal splits the last wave leaves most of the GPU idle
    while a few programs finish (3-4% of the forward at the issue shapes, 6-12% at smaller ones). Here the first
    phase is sized to end, on the busiest multiprocessors, at the even share of all tiles, and the second phase's
    short programs fill the others up to it; what is left is about half a short program. A split count keeps about
    sms / 2 programs on one group of token blocks at a time (their x blocks and W tiles shared in L2), and at most
    max(sms / (2 group), 2 waves sms / n_blocks) + 32 splits keep the partials small (float32 per row and split). The
    plan is estimated in tiles (each program also costs ~0.1 tile: its first loads and its partial stores), and
    taken only where it beats the equal splits of `waves` programs per multiprocessor."""
    total = n_blocks * n_vtiles
    share = total / sms
    g = min(group, n_blocks)
    n_lo = max(1, min(n_vtiles, cdiv(sms, 2 * g)))
    want = max(1, min(n_vtiles, round(waves * sms / n_blocks)))

    def estimate(n_big, a, n_small, b):
        programs = n_blocks * (n_big + n_small)
        if n_small == 0:  # equal splits (the last may be shorter): the waves of the first phase alone
            end = cdiv(programs, sms) * a
        else:
            rounds = cdiv(n_blocks * n_big, sms)
            end = max(rounds * a, share) + b / 2
        return end + 0.1 * programs / sms + 1e-3 * (n_big + n_small)

    # Equal splits of a tiles (the last one shorter, as a second phase of one split).
    a = cdiv(n_vtiles, want)
    best = (estimate(cdiv(n_vtiles, a), a, 0, 0), n_vtiles // a, a, int(n_vtiles % a > 0), n_vtiles % a)
    # First-phase split counts: the few above n_lo, and those that make the first phase about k full waves.
    hi = max(n_lo, 2 * want)
    counts = set(range(n_lo, min(hi, n_lo + 16) + 1))
    for k in range(1, 65):
        counts.update((k * sms // n_blocks, cdiv(k * sms, n_blocks)))
    max_small = min(2 * n_lo, 32)
    for n_big in sorted(c for c in counts if n_lo <= c <= hi):
        rounds = cdiv(n_blocks * n_big, sms)
        a = min(n_vtiles // n_big, int(total // (sms * rounds)))
        if a < 1:
            break
        rest = n_vtiles - n_big * a
        if rest == 0:
            cand = [(n_big, a, 0, 0)]
        else:
            b_min = cdiv(rest, max_small)
            cand = [(n_big, a, cdiv(rest, b), b) for b in range(b_min, min(rest, b_min + 8) + 1)]
        for c in cand:
            e = estimate(*c)
            if e < best[0]:
                best = (e, *c)
    return best[1:]


class StashLayout(NamedTuple):
    """Where the forward keeps logits for the backward, inside the weight's gradient buffer (bf16/fp16, V x D)
    before the backward writes it. The logits of classes [0, classes) are stored class-major, (classes, N), as
    float16 z - o (<= 0), o being the running row max of the forward when it folded the tile (so the rounding error
    of a logit is at most 2^-11 (m - z), small exactly where p is not), and o as float32 per (tile, row). The
    backward walks these classes first, in chunks of `chunk`, computes each chunk's dL/dz from the stash in place
    (no recomputed product) and writes its dW rows below the chunk's own stash: `at` leaves room for that."""
    classes: int  # a multiple of the forward's tile width
    chunk: int
    at: int  # element offset in the buffer of the (classes, N) float16 block
    zo_at: int  # element offset (a multiple of 8) of the (classes / block_v, N) float32 maxima


def stash_layout(x: torch.Tensor, w: torch.Tensor, need_dx: bool, workspace_bytes: int | None
                 ) -> StashLayout | None:
    """The layout of the logits the forward can keep for a backward that computes dW (and dx when need_dx) with
    this workspace_bytes, or None (STASH_LOGITS off, float32, a backward whose products are not cuBLAS's (they
    read dz column-major), tiles that differ between forward and dz kernel, too little room, or less than
    STASH_MIN_FLOP of recomputation saved). The room is the part of
    dW that the backward does not borrow for the float32 dx accumulator (_plan): (V - 2N) D elements of V D by
    default, all of them with an accumulator of its own. Shapes only: forward and backward compute the same."""
    N, D = x.shape
    V = w.shape[0]
    if not (STASH_LOGITS and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype and N > 0 and D > 0
            and _torch_products(x, w, False, False)):
        return None
    cfg = _config(x)
    bv = cfg.block_v
    if cfg.dz_block_v != bv or N * bv >= 1 << 31:
        return None
    ws = _workspace(N, V, D, 2, workspace_bytes)
    end = V * D
    if need_dx and V * D >= 2 * N * D + 8 and not ws.own_acc:
        end = _acc_region(N, V, D, cfg, False)[0]  # the float32 dx accumulator's bytes start here
    rows = end // D // bv * bv  # dW rows of the first pass
    chunk = _round_chunk(cfg.wide, bv, True)
    per_class = max(N, D) + cdiv(2 * N, bv)
    classes = min(rows, max(0, end - chunk * min(N, D)) // per_class // bv * bv)
    while classes >= bv:
        c = min(chunk, classes)
        # A chunk's dW rows [v0, v1) must lie below its own stash (it is read while they are written) and every
        # later chunk's: at >= v1 D - v0 N for every chunk.
        at = max(0, max(min(v0 + c, classes) * D - v0 * N for v0 in range(0, classes, c)))
        at = cdiv(at, 8) * 8
        zo_at = cdiv(at + classes * N, 8) * 8
        if zo_at + 2 * N * (classes // bv) <= end:
            return StashLayout(classes, c, at, zo_at) if 2 * N * D * classes >= STASH_MIN_FLOP else None
        classes -= bv
    return None


def _stash_views(buf: torch.Tensor, lay: StashLayout, N: int, cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    # The float16 (classes, N) logits and the float32 (tiles, N) maxima inside the buffer.
    flat = buf.view(-1)
    zs = flat.view(torch.float16)[lay.at: lay.at + lay.classes * N].view(lay.classes, N)
    zo = flat[lay.zo_at: lay.zo_at + 2 * N * (lay.classes // cfg.block_v)].view(torch.float32)
    return zs, zo.view(lay.classes // cfg.block_v, N)


class _Plan(NamedTuple):
    dz_main: torch.Tensor | None  # (N, chunk) workspace of dL/dz for the first pass, or None: use the scratch
    chunk: int  # classes per chunk in the first pass (unless a wider one fits in dW, _first_pass)
    dx_acc: torch.Tensor | None  # (N, D) float32 accumulator of dx
    dw_end: int  # the first pass writes dW rows [0, dw_end); rows [dw_end, V) hold dx_acc until it is done
    cast_dx: bool  # dx_acc is not dx itself: copy it into dx at the end
    dw_free: int  # dW elements [0, dw_free) are not the dx accumulator's: a chunk's dz may borrow those after it


def _balanced_split(N: int, n_out: int, n_dx: int, dx_steps: int, sms: int, unit: int, block_k: int,
                    max_splits: int) -> int:
    """Tokens per split of the dW reduction for a gradient-products launch of n_out dW tiles (N tokens each) and
    n_dx dx tiles (dx_steps reduction steps each), one program per multiprocessor, dW tiles first. The estimated
    makespan, in reduction steps, is the longer of the dW tiles' waves and the even share of all the work; a split
    count is taken only when it shortens that by more than 3% (it costs a float32 partial per split and a sum)."""
    best_k, best = N, None
    for s in range(1, max(1, max_splits) + 1):
        k = cdiv(cdiv(N, s), unit) * unit
        n_dw = n_out * cdiv(N, k)
        steps = cdiv(k, block_k)
        span = max(cdiv(n_dw, sms) * steps, (n_dw * steps + n_dx * dx_steps) / sms + dx_steps)
        if best is None or span < 0.97 * best:
            best_k, best = k, span
    return best_k


def _round_chunk(cols: int, block: int, aligned: bool = False) -> int:
    # At most 2^16 classes per chunk keeps every in-chunk offset times a row stride within int32. Aligned (skipping,
    # or a vocabulary order): a multiple of the tile, so that chunks are made of whole tiles of the map.
    cols = min(cols, 1 << 16)
    if aligned:
        return max(block, cols // block * block)
    return cols // block * block if cols >= block else max(cols, 1)


def _scratch_cols(N: int, elt: int, block: int, aligned: bool = False, scratch: int | None = None,
                  wide: int | None = None) -> int:
    # Classes of dz in a scratch of `scratch` bytes (SCRATCH_BYTES by default). Aligned, a chunk of one tile may
    # need more than that (N > scratch / (elt * block)). A caller's larger scratch widens the chunks up to `wide`
    # classes (cfg.wide), never below what the default scratch gives: wider ones measured slower (H200, interleaved:
    # 29.2 -> 27.7 ms at N, D, V = 4096, 4096, 128256 and 63.9 -> 62.4 ms at gemma2-2b with chunks of 32768 and
    # 16384 classes capped to 8192; notes/linear_head.md, v13).
    scratch = SCRATCH_BYTES if scratch is None else scratch
    cols = max(1, scratch // max(1, N * elt))
    if wide is not None and scratch > SCRATCH_BYTES:
        cols = max(min(cols, wide), SCRATCH_BYTES // max(1, N * elt))
    return _round_chunk(cols, block, aligned)


class _Workspace(NamedTuple):
    scratch: int  # bytes the scratch buffer may take (allocated when first needed, as large as a chunk needs)
    own_acc: bool  # allocate the float32 dx accumulator (4 N D bytes) instead of borrowing dW rows


def acc_forced(x, need_dx: bool, need_dw: bool, N: int, V: int, D: int) -> bool:
    """Whether the float32 dx accumulator must have its own buffer whatever the budget: a half-precision dx with no
    dW rows to borrow (a frozen head, or V < 2N; _plan)."""
    return need_dx and x.dtype != torch.float32 and not (need_dw and V * D >= 2 * N * D + 8)


def _workspace(N: int, V: int, D: int, elt: int, workspace_bytes: int | None, acc_forced: bool = False
               ) -> _Workspace:
    """How the backward spends a budget of workspace_bytes (None: default_workspace_bytes(N, V); at most
    SCRATCH_BYTES, e.g. 0: the leanest plan, SCRATCH_BYTES of scratch). With bf16/fp16 inputs, a budget of at least
    4 N D + SCRATCH_BYTES first buys the float32 dx accumulator its own buffer: the dW rows it would borrow no longer
    wait for a second pass that recomputes their logits (2N of the V classes). What is left (or all of it) enlarges
    the scratch: wider vocabulary chunks when the dW rows run out (up to cfg.wide classes, _scratch_cols) and room
    for split partials. The accumulator is allocated in any case when there is no dW to borrow (a frozen head, or
    V < 2N: acc_forced); it then counts against the budget, and the scratch gets the rest (SCRATCH_BYTES at least).
    Shapes only: the forward (stash_layout, vocab_order) and the backward compute the same."""
    budget = default_workspace_bytes(N, V) if workspace_bytes is None else workspace_bytes
    if budget <= SCRATCH_BYTES:
        return _Workspace(SCRATCH_BYTES, False)
    acc = 4 * N * D
    if acc_forced:
        return _Workspace(max(SCRATCH_BYTES, budget - acc), True)
    if elt != 4 and budget >= acc + SCRATCH_BYTES:
        return _Workspace(budget - acc, True)
    return _Workspace(budget, False)


def _acc_region(N: int, V: int, D: int, cfg: Config, aligned: bool) -> tuple[int, int]:
    # (element offset in dW of the float32 dx accumulator, 16-byte aligned; first dW row the first pass leaves out).
    start = (V * D - 2 * N * D) // 8 * 8
    end = start // D
    return start, (end // cfg.block_v * cfg.block_v if aligned else end)


def _second_pass(N: int, V: int, D: int, elt: int, cfg: Config, v0: int, aligned: bool, scratch: int | None = None
                 ) -> list:
    """(v0, v1, dz_in_dw) chunks of the second pass over dW rows [v0, V): dL/dz of a chunk goes into dW rows that are
    still unwritten (after the chunk) while they last (N c <= (V - v0 - c) D), then into the scratch (`scratch`
    bytes)."""
    scratch_cols = _scratch_cols(N, elt, cfg.block_v, aligned, scratch, cfg.wide)
    chunks = []
    while v0 < V:
        fits = _round_chunk((V - v0) * D // (N + D), cfg.block_v)
        v1 = min(v0 + (fits if fits >= scratch_cols else scratch_cols), V)
        chunks.append((v0, v1, fits >= scratch_cols))
        v0 = v1
    return chunks


def _plan(x, dx, dw, N, V, D, cfg, aligned, ws: _Workspace | None = None) -> _Plan:
    """Where the backward's workspaces live. Only O(N) plus the scratch (SCRATCH_BYTES by default) is allocated when
    both gradients are wanted in bfloat16/float16 and V >= 2N (the usual LM head) and ws does not ask for an own
    accumulator, or for float32 inputs."""
    ws = ws or _Workspace(SCRATCH_BYTES, False)
    scratch_cols = _scratch_cols(N, x.element_size(), cfg.block_v, aligned, ws.scratch, cfg.wide)
    if dx is None:  # weight (and/or bias) gradient only
        return _Plan(None, scratch_cols, None, V, False, V * D if dw is not None else 0)
    if x.dtype == torch.float32:  # dx is float32: accumulate in place
        return _Plan(None, scratch_cols, dx, V, False, V * D if dw is not None else 0)
    # dx (bf16/fp16) is not written until the end: it holds dL/dz of a chunk of D classes meanwhile.
    chunk = _round_chunk(D, cfg.block_v, aligned)
    dz_main = dx.view(-1)[: N * chunk].view(N, chunk) if scratch_cols <= chunk <= D else None
    if dz_main is None:
        chunk = scratch_cols
    if dw is not None and V * D >= 2 * N * D + 8 and not ws.own_acc:
        # The float32 dx accumulator takes the bytes of the last 2N rows of dW (16-byte aligned); those dW rows
        # are computed after dx is final.
        start, dw_end = _acc_region(N, V, D, cfg, aligned)
        dx_acc = dw.view(-1)[start: start + 2 * N * D].view(torch.float32).view(N, D)
        return _Plan(dz_main, chunk, dx_acc, dw_end, True, start)
    return _Plan(dz_main, chunk, _new((N, D), device=x.device, dtype=torch.float32), V, True,
                 V * D if dw is not None else 0)


def _first_pass(N: int, V: int, D: int, cfg: Config, plan: _Plan, aligned: bool, wide_ok: bool,
                stash: StashLayout | None = None) -> list:
    """(v0, v1, dz_at, stashed) chunks of the first pass, in order; dz_at is the element offset in dW of the chunk's
    dz, or None (the plan's dz_main or the scratch, or, when stashed, the forward's stash in place). The stashed
    classes [0, stash.classes) go first. Each gradient-products launch re-reads and re-writes the float32 dx
    accumulator (8 N D bytes) and has few dW tiles when D is small, so wider chunks are cheaper: a chunk of up to
    cfg.wide classes puts its dz into dW rows that are not written yet and are not the accumulator's. The rows the
    first pass leaves to the second ([dw_end, V), dx only) go next, their dz at the start of dW's unwritten rows;
    then the rest of [0, dw_end) in order, each chunk's dz in the rows after it while v1 D + N c <= dw_free."""
    def chunk(v0, v_end, fits):
        c = _round_chunk(min(fits, cfg.wide), cfg.block_v, aligned) if wide_ok else 0
        if plan.chunk < c <= fits:
            return min(v0 + c, v_end), True
        return min(v0 + plan.chunk, v_end), False

    chunks = []
    s = 0
    if stash is not None:
        s = stash.classes
        chunks = [(v0, min(v0 + stash.chunk, s), None, True) for v0 in range(0, s, stash.chunk)]
    base = cdiv(s * D, 8) * 8  # dW's first unwritten element once the stashed chunks are done
    for lo, hi, left in ((plan.dw_end, V, True), (s, plan.dw_end, False)):
        v0 = lo
        while v0 < hi:
            if left:  # the rows left to the second pass: dz in dW from base
                v1, wide = chunk(v0, hi, max(0, min(plan.dw_free, plan.dw_end * D) - base) // N)
                chunks.append((v0, v1, base if wide else None, False))
            else:
                v1, wide = chunk(v0, hi, (plan.dw_free - v0 * D) // (N + D))
                chunks.append((v0, v1, v1 * D if wide else None, False))
            v0 = v1
    return chunks


def backward(x, w, b, target, class_w, m, logs, A, B, C, E, *, softcap, inv_temp, need_dx, need_dw, need_db,
             perm=None, tile_lse=None, skip_threshold=0.0, workspace_bytes=None, stash=None):
    """Gradients (dx, dw, db) of the head for the per-row coefficients (A, B, C, E); see the module docstring.
    perm and tile_lse are the forward's (same x and w; perm made with the same workspace_bytes); pairs are skipped
    only with skip_threshold > 0 and without a B or E term (their error is not bounded by the probability mass
    alone). workspace_bytes: what the workspaces may take beyond O(N) (_workspace; None: the default policy,
    default_workspace_bytes).
    stash: the buffer the forward kept logits in (forward_stats(stash=...), its layout from stash_layout with this
    need_dx and workspace_bytes); it becomes dw (need_dw must be set), and its contents are used up."""
    N, D = x.shape
    V = w.shape[0]
    need_db = bool(need_db and b is not None)
    lay = None
    if stash is not None:
        lay = stash_layout(x, w, need_dx, workspace_bytes)
        assert need_dw and lay is not None and stash.shape == (V, D) and stash.dtype == w.dtype
    dx = _new((N, D), device=x.device, dtype=x.dtype) if need_dx else None
    dw = stash if stash is not None else _new((V, D), device=x.device, dtype=w.dtype) if need_dw else None
    db = _new(V, device=x.device, dtype=torch.float32) if need_db else None  # in vocabulary positions until the end
    if N == 0 or D == 0:
        for g in (dx, dw, db):
            if g is not None:
                g.zero_()
        return dx, dw, None if db is None else db.to(b.dtype)
    cfg = _config(x)
    has_perm = perm is not None
    aligned = has_perm or tile_lse is not None
    skip = (tile_lse is not None and skip_threshold > 0 and B is None and E is None and skip_supported(x))
    ws = _workspace(N, V, D, x.element_size(), workspace_bytes, acc_forced(x, need_dx, need_dw, N, V, D))
    plan = _plan(x, dx, dw, N, V, D, cfg, aligned, ws)
    dummy = _dummy(x)
    f32 = dict(device=x.device, dtype=torch.float32)
    dot = _dot_flags(x)
    n_blocks = cdiv(N, cfg.block_n)
    n_vtiles = cdiv(V, cfg.block_v)
    sms = _num_sms(x.device)
    sp = None
    if skip:
        sp = skip_plan(tile_lse, m, logs, A, target if C is not None else None, perm, V, float(skip_threshold),
                       cfg.block_n, cfg.block_v)
        if DEBUG_PLANS is not None:
            DEBUG_PLANS.append(sp)
    lists = (sp.list_n, sp.pre_n, sp.list_v, sp.pre_v) if skip else (dummy,) * 4
    torch_products = _torch_products(x, w, skip, has_perm)
    dz_tma = _use_tma(cfg, x, w, perm)
    dz_x, dz_w = _operands(x, w, dz_tma, cfg.block_n, cfg.dz_block_v, cfg.block_k)
    # One lazily allocated buffer, as large as the largest view asked for so far: at most ws.scratch bytes (more
    # only if one row of N tokens needs more). No view outlives the next request, so a larger one replaces it.
    scratch = []
    x_desc = []  # the gradient products' descriptor of x, made once

    def scratch_view(shape, dtype):
        n = shape[0] * shape[1]
        nbytes = n * dtype.itemsize
        if not scratch or scratch[0].numel() * 4 < nbytes:
            scratch.clear()  # freed first: the peak holds one buffer
            scratch.append(_new(cdiv(nbytes, 4), **f32))
        return scratch[0].view(dtype)[:n].view(shape)

    def dz_pass(v0, v1, dz, with_db, stashed=False):
        # stashed: dz (N, v1 - v0), column-major, is where the forward kept these logits (zs, zo: _stash_views)
        assert not skip or v0 % cfg.block_v == 0
        store = dz is not None
        dbp = _new((n_blocks, v1 - v0), **f32) if with_db else None
        zs = zo = dummy
        if stashed:
            zs = stash_zs[v0: v1]
            zo = stash_zo[v0 // cfg.block_v:]
        _dz_kernel[(n_blocks * cdiv(v1 - v0, cfg.dz_block_v),)](
            dz_x, dz_w, b if b is not None else dummy, target if target is not None else dummy,
            class_w if class_w is not None else dummy, perm if has_perm else dummy, m, logs, A,
            B if B is not None else dummy, C if C is not None else dummy, E if E is not None else dummy,
            sp.hot if skip else dummy, dz if store else dummy, dbp if with_db else dummy, zs, zo,
            N, D, v0, v1, n_vtiles,
            x.stride(0), x.stride(1), w.stride(0), w.stride(1), dz.stride(0) if store else 0,
            dz.stride(1) if store else 1, dbp.stride(0) if with_db else 0,
            float(softcap or 1.0), float(inv_temp),
            HAS_BIAS=b is not None, HAS_SOFTCAP=softcap is not None, HAS_TEMP=inv_temp != 1.0,
            HAS_B=B is not None, HAS_C=C is not None and target is not None, HAS_E=E is not None,
            HAS_CLASS_WEIGHT=class_w is not None, STORE_DZ=store, HAS_DB=with_db, HAS_PERM=has_perm, SKIP=skip,
            LOAD_Z=stashed,
            BLOCK_N=cfg.block_n, BLOCK_V=cfg.dz_block_v, BLOCK_K=cfg.block_k, GROUP=cfg.group,
            EVEN_K=D % cfg.block_k == 0, **dot,
            USE_TMA=dz_tma,
            num_warps=cfg.fwd_warps, num_stages=cfg.fwd_stages,
        )
        if with_db:
            torch.sum(dbp, dim=0, out=db[v0:v1])

    def grad_pass(v0, v1, dz, do_dw, dx_acc, accumulate, scratch_free, room=None):
        # room: where float32 split partials may go when the scratch holds dz (free dW rows, or None)
        rows = v1 - v0
        do_dx = dx_acc is not None
        if not (do_dw or do_dx):
            return
        if torch_products:
            _products_torch(dz, x, w[v0:v1], dw[v0:v1] if do_dw else None, dx_acc, accumulate)
            return
        n_out = cdiv(rows, cfg.block_m) * cdiv(D, cfg.block_d)
        n_dx_tiles = cdiv(N, cfg.block_m) * cdiv(D, cfg.block_d) if do_dx else 0
        splits, k_per_split, part = 1, N, None
        room_bytes = ws.scratch if scratch_free else (0 if room is None else room.numel() * room.element_size())
        if do_dw and do_dx and scratch_free and cfg.balance:
            # A few dW tiles, each reducing over all N tokens, next to many short dx tiles (small D): the dW tiles
            # would set the kernel's time while most multiprocessors idle. Split their reduction (float32 partials
            # in the scratch, summed in a fixed order) as far as it shortens the estimated makespan.
            unit = cfg.block_n if skip else cfg.block_kg
            k_per_split = _balanced_split(N, n_out, n_dx_tiles, cdiv(rows, cfg.block_kg), sms, unit,
                                          cfg.block_kg, room_bytes // (4 * rows * D))
            splits = cdiv(N, k_per_split)
        elif do_dw and not do_dx and n_out < sms and room_bytes:
            # Too few dW tiles to fill the GPU: split the token reduction into float32 partials in the scratch (or,
            # when dz is there, in the room given), summed in a fixed order by a second kernel. Skipping, the
            # splits are made of whole token blocks.
            splits = max(1, min(sms // n_out, cdiv(N, 4 * cfg.block_kg), room_bytes // (4 * rows * D)))
            unit = cfg.block_n if skip else cfg.block_kg
            k_per_split = cdiv(cdiv(N, splits), unit) * unit
            splits = cdiv(N, k_per_split)
        if splits > 1:  # float32 partials [splits, rows, D], in the scratch or the room
            n = splits * rows * D
            part = (scratch_view((1, n), torch.float32) if scratch_free else room.view(torch.float32)[:n])
            part = part.view(splits, rows, D)
        scatter = do_dw and has_perm and part is None  # dW rows written straight to their classes' rows
        if not do_dw:
            dw_out = dummy
        elif part is not None:
            dw_out = part
        else:
            dw_out = dw if scatter else dw[v0:v1]
        n_dw_tiles = n_out * splits if do_dw else 0
        wv = w if has_perm else w[v0:v1]
        descs = (dummy,) * 4
        use_tma = cfg.grad_tma and not (skip or has_perm) and _tma_ok(dz, x, wv)
        if use_tma:
            kg, bm, bd = cfg.block_kg, cfg.block_m, cfg.block_d
            if not x_desc:  # the same for every chunk (host time: a launch costs tens of microseconds already)
                x_desc.append(TensorDescriptor.from_tensor(x, [kg, bd]))
            descs = (TensorDescriptor.from_tensor(dz, [kg, bm]), TensorDescriptor.from_tensor(dz, [bm, kg]),
                     x_desc[0], TensorDescriptor.from_tensor(wv, [kg, bd]))
        _dgrad_kernel[(n_dw_tiles + n_dx_tiles,)](
            dz, x, wv, dw_out, dx_acc if do_dx else dummy,
            perm[v0:] if has_perm else dummy, *lists, *descs,
            N, D, rows, n_dw_tiles, k_per_split, n_out, n_blocks, n_vtiles, v0 // cfg.block_v,
            cdiv(v1, cfg.block_v),
            dz.stride(0), x.stride(0), x.stride(1), w.stride(0), w.stride(1),
            dw_out.stride(-2) if do_dw else 0, dw_out.stride(-1) if do_dw else 0,
            part.stride(0) if part is not None else 0,
            dx_acc.stride(0) if do_dx else 0, dx_acc.stride(1) if do_dx else 0,
            DO_DW=do_dw, DO_DX=do_dx, DX_ACCUMULATE=accumulate,
            DW_EVEN_K=N % cfg.block_kg == 0 and k_per_split % cfg.block_kg == 0,
            DX_EVEN_K=rows % cfg.block_kg == 0, HAS_PERM=has_perm, DW_SCATTER=scatter, SKIP=skip,
            MAP_N=cfg.block_n, MAP_V=cfg.block_v,
            BLOCK_M=cfg.block_m, BLOCK_D=cfg.block_d, BLOCK_K=cfg.block_kg, GROUP=cfg.group, **dot, USE_TMA=use_tma,
            num_warps=cfg.grad_warps, num_stages=cfg.grad_stages,
        )
        if part is not None:
            n = rows * D
            _sum_splits_kernel[(cdiv(n, 1024),)](part, dw if has_perm else dw[v0:v1],
                                                        perm[v0:] if has_perm else dummy, n, splits, D,
                                                        SCATTER=has_perm, BLOCK=1024, UPCAST=dot["UPCAST"])

    need_dz = need_dx or need_dw
    if lay is not None:
        stash_zs, stash_zo = _stash_views(dw, lay, N, cfg)
        stash_dz = dw.view(-1)[lay.at: lay.at + lay.classes * N].view(lay.classes, N)
    # First pass: every class once; dW rows below plan.dw_end, dx accumulated over all chunks.
    first = True
    # (A vocabulary order gets no wide chunks: its dW rows are scattered over the first pass's range.)
    for v0, v1, dz_at, stashed in _first_pass(N, V, D, cfg, plan, aligned, need_dz and not has_perm, lay):
        dz = None
        if stashed:  # dz replaces the chunk's stashed logits: (N, v1 - v0), column-major
            dz = stash_dz[v0: v1].t()
            dz_pass(v0, v1, dz, need_db, stashed=True)
            grad_pass(v0, v1, dz, True, plan.dx_acc, not first, True)
            first = False
            continue
        if dz_at is not None:
            dz = dw.view(-1)[dz_at: dz_at + N * (v1 - v0)].view(N, v1 - v0)
        elif need_dz:
            dz = plan.dz_main[:, : v1 - v0] if plan.dz_main is not None else scratch_view((N, v1 - v0), x.dtype)
        dz_pass(v0, v1, dz, need_db)
        if need_dz:
            grad_pass(v0, v1, dz, need_dw and v1 <= plan.dw_end, plan.dx_acc, not first,
                      dz_at is not None or plan.dz_main is not None)
            first = False
    if need_dx and plan.cast_dx:
        dx.copy_(plan.dx_acc)
    # Second pass: the dW rows that held the dx accumulator.
    if need_dw and plan.dw_end < V:
        for v0, v1, in_dw in _second_pass(N, V, D, x.element_size(), cfg, plan.dw_end, aligned, ws.scratch):
            room = None
            if in_dw:
                dz = dw.view(-1)[v1 * D: v1 * D + N * (v1 - v0)].view(N, v1 - v0)
            else:
                dz = scratch_view((N, v1 - v0), x.dtype)
                # The dW rows after the chunk are not written yet (its classes' rows are its own, also with an
                # order): room for the split partials of its few long dW tiles, 16-byte aligned.
                lo, hi = cdiv(v1 * D, 8) * 8, V * D // 8 * 8
                room = dw.view(-1)[lo:hi] if hi > lo else None
            dz_pass(v0, v1, dz, False)
            grad_pass(v0, v1, dz, True, None, False, in_dw, room)
    if db is not None and has_perm:
        db = db[torch.argsort(perm)]  # position order -> class order
    return dx, dw, None if db is None else db.to(b.dtype)


_dispatch.register_triton_op("linear_cross_entropy")
_dispatch.register_triton_op("linear_log_probs")
_dispatch.register_triton_op("linear_logsumexp")
