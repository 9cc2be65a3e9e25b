"""The skip plan's work in Triton launches instead of some hundred PyTorch ops: two over the rows, three over (N, T).

skip_plans.skip_plan computes, for each (row, tile) pair, its cost relative to the row's budget q_it, then per block of
(grouped) rows the tiles it may skip, then the lists the gradient products walk. As PyTorch ops that is about a
hundred launches, many of them passes over (N, T) float32 arrays, each also a cost to the host that issues it
(docs/design/skipping.md, "The plan in three launches"). Here:

0. _row_prep_kernel and, for the shared budget of skip_plans.row_budget (threshold < 0), _shared_budget_kernel: the
   per-row vectors the others read (lse, |A|, |B|, the budget, the target's tile), in float32 as the PyTorch ops
   compute them, the batch's two sums of shared_budget taken in a fixed order over per-program partials;
1. _hot_count_kernel: per row, how many tiles hold more than skip_plans._HOT_FRACTION of its budget (the key rows are
   grouped by; PyTorch then sorts the N counts stably);
2. _cold_kernel: per block of grouped rows, the largest q of each tile over the block's rows, the tiles sorted by it
   (ties by index), and the longest prefix of that order whose running sums stay within every row's budget: those
   tiles are cold. It writes the block's hot map, its list of hot tiles then cold ones, and their prefix counts;
3. _tile_lists_kernel: per tile, its hot blocks then its cold ones, and their prefix counts.

q is recomputed from the float16 tile record wherever it is needed (twice per pair, plus once for the counts)
rather than stored: the record has half the bytes of a float32 q. The results are the plan of the PyTorch
ops, but for pairs whose running sum lands within float32 rounding of the budget's edge (the sums are taken in
another order): either side of that edge keeps the bound, which has a 2^-16 margin for exactly that.
"""

import torch
import triton
import triton.language as tl

from .._common import cdiv
from .._launch import launch


@triton.jit
def _neg_expm1(x):
    # -expm1(-x) for x >= 0 (a row's mass outside its top class, 1 - exp(-logs)): a Taylor polynomial where
    # 1 - exp(-x) would cancel (its terms past x^8 are below float32's rounding for x < 1/2), else 1 - exp(-x).
    y = -x
    poly = y * (1.0 + y * (0.5 + y * (0.16666666666666666 + y * (0.041666666666666664 + y * (
        0.008333333333333333 + y * (0.001388888888888889 + y * (0.0001984126984126984 + y * 2.48015873015873e-05)))))))
    return -tl.where(x < 0.5, poly, tl.exp(y) - 1.0)


@triton.jit
def _row_prep_kernel(m_ptr, logs_ptr, a_ptr, b_ptr, target_ptr, vec_ptr, part_ptr, tgt_ptr, N, V, n_parts, threshold,
                     stride_m, stride_logs, stride_a, stride_b, stride_t, BLOCK_V: tl.constexpr, HAS_B: tl.constexpr,
                     HAS_TARGET: tl.constexpr, WRITE_TGT: tl.constexpr,
                     SHARED: tl.constexpr, BLOCK: tl.constexpr):
    # vec (6, N) float32: lse, |A|, |B|, the budget (unless SHARED), and e, b of shared_budget (SHARED), whose
    # per-program sums of squares go to part (2, n_parts); tgt (N,) int32: the target's tile or -1.
    pid = tl.program_id(0)
    rows = pid * BLOCK + tl.arange(0, BLOCK)
    ok = rows < N
    m = tl.load(m_ptr + rows * stride_m, mask=ok, other=0.0).to(tl.float32)
    logs = tl.load(logs_ptr + rows * stride_logs, mask=ok, other=0.0).to(tl.float32)
    tl.store(vec_ptr + rows, m + logs, mask=ok)
    coef = tl.abs(tl.load(a_ptr + rows * stride_a, mask=ok, other=0.0).to(tl.float32))
    tl.store(vec_ptr + N + rows, coef, mask=ok)
    if HAS_B:
        abs_b = tl.abs(tl.load(b_ptr + rows * stride_b, mask=ok, other=0.0).to(tl.float32))
        tl.store(vec_ptr + 2 * N + rows, abs_b, mask=ok)
        coef = coef + abs_b
    if SHARED:
        b = tl.maximum(tl.abs(m), 1.0, propagate_nan=tl.PropagateNan.ALL) * coef
        e = b * _neg_expm1(logs)
        tl.store(vec_ptr + 4 * N + rows, e, mask=ok)
        tl.store(vec_ptr + 5 * N + rows, b, mask=ok)
        tl.store(part_ptr + pid, tl.sum(tl.where(ok, e * e, 0.0), axis=0))
        tl.store(part_ptr + n_parts + pid, tl.sum(tl.where(ok, b * b, 0.0), axis=0))
    else:
        tl.store(vec_ptr + 3 * N + rows, coef * threshold, mask=ok)
    if WRITE_TGT:
        tile = tl.full((BLOCK,), -1, tl.int64)
        if HAS_TARGET:
            t = tl.load(target_ptr + rows * stride_t, mask=ok, other=-1).to(tl.int64)
            tile = tl.where((t >= 0) & (t < V), t // BLOCK_V, -1)
        tl.store(tgt_ptr + rows, tile.to(tl.int32), mask=ok)


@triton.jit
def _shared_budget_kernel(vec_ptr, part_ptr, N, n_parts, scale, BLOCK: tl.constexpr, PARTS: tl.constexpr):
    # The budgets of shared_budget from the e, b rows of vec and the partial sums of _row_prep_kernel (summed in the
    # same order by every program): |threshold| sqrt((e^2 + R^2 b^2) / 2), R^2 = sum e^2 / sum b^2.
    se = tl.zeros((PARTS,), dtype=tl.float32)
    sb = tl.zeros((PARTS,), dtype=tl.float32)
    for p0 in range(0, n_parts, PARTS):
        p = p0 + tl.arange(0, PARTS)
        se += tl.load(part_ptr + p, mask=p < n_parts, other=0.0)
        sb += tl.load(part_ptr + n_parts + p, mask=p < n_parts, other=0.0)
    r2 = tl.sum(se, axis=0) / tl.maximum(tl.sum(sb, axis=0), 1e-30)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < N
    e = tl.load(vec_ptr + 4 * N + rows, mask=ok, other=0.0)
    b = tl.load(vec_ptr + 5 * N + rows, mask=ok, other=0.0)
    tl.store(vec_ptr + 3 * N + rows, tl.sqrt_rn((e * e + r2 * (b * b)) * 0.5) * scale, mask=ok)


@triton.jit
def _pair_cost(u16, lse, abs_a, abs_b, budget, tgt, tiles, valid, WIDEN: tl.constexpr, LOG_BV: tl.constexpr,
               HAS_B: tl.constexpr):
    # q of skip_plans.skip_plan for float16 tile log-sum-exps u16 [R, C] of rows with per-row vectors [R, 1] (tgt: the
    # row's target tile or -1) at tile indices tiles [1, C]; 0 where not valid (rows past N, tiles past T).
    u = u16.to(tl.float32)
    r = tl.exp(u + tl.abs(u) * WIDEN - lse + tl.abs(lse) * 0.00000095367431640625)  # 2^-20
    r = tl.minimum(r, 1.0, propagate_nan=tl.PropagateNan.ALL)  # a NaN stays one, as in torch.clamp
    c = r * abs_a
    if HAS_B:
        xlogy = tl.where(r == 0.0, 0.0, r * tl.log(r))
        c += abs_b * (r * LOG_BV - xlogy)
    q = c / tl.maximum(budget, 1e-30)
    q = tl.where(tgt == tiles, float("inf"), q)
    q = tl.where(budget == 0.0, 0.0, q)
    return tl.where(valid, q, 0.0)


@triton.jit
def _row_vectors(rows, row_ok, lse_ptr, a_ptr, b_ptr, budget_ptr, tgt_ptr, HAS_B: tl.constexpr):
    # The per-row inputs of _pair_cost for rows (int64 [R]) as [R, 1] columns; neutral values where not row_ok.
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)[:, None]
    abs_a = tl.load(a_ptr + rows, mask=row_ok, other=0.0)[:, None]
    abs_b = tl.load(b_ptr + rows, mask=row_ok, other=0.0)[:, None] if HAS_B else abs_a
    budget = tl.load(budget_ptr + rows, mask=row_ok, other=0.0)[:, None]
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)[:, None]
    return lse, abs_a, abs_b, budget, tgt


@triton.jit
def _hot_count_kernel(u_ptr, lse_ptr, a_ptr, b_ptr, budget_ptr, tgt_ptr, count_ptr, N, T, stride_u,
                      HOT: tl.constexpr, WIDEN: tl.constexpr, LOG_BV: tl.constexpr, HAS_B: tl.constexpr,
                      ROWS: tl.constexpr, COLS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < N
    lse, abs_a, abs_b, budget, tgt = _row_vectors(rows, row_ok, lse_ptr, a_ptr, b_ptr, budget_ptr, tgt_ptr, HAS_B)
    count = tl.zeros((ROWS,), dtype=tl.int32)
    for c0 in range(0, T, COLS):
        tiles = c0 + tl.arange(0, COLS)[None, :]
        ok = row_ok[:, None] & (tiles < T)
        u = tl.load(u_ptr + rows[:, None].to(tl.int64) * stride_u + tiles, mask=ok, other=0.0)
        q = _pair_cost(u, lse, abs_a, abs_b, budget, tgt, tiles, ok, WIDEN, LOG_BV, HAS_B)
        count += tl.sum((q > HOT).to(tl.int32), axis=1)
    tl.store(count_ptr + rows, count, mask=row_ok)


@triton.jit
def _cold_kernel(u_ptr, lse_ptr, a_ptr, b_ptr, budget_ptr, tgt_ptr, rows_ptr, order_ptr, rank_ptr,
                 hot_ptr, list_ptr, pre_ptr, N, T, stride_u,
                 LIMIT: tl.constexpr, WIDEN: tl.constexpr, LOG_BV: tl.constexpr, HAS_B: tl.constexpr,
                 HAS_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, T_POW2: tl.constexpr, SUB: tl.constexpr,
                 COLS: tl.constexpr):
    blk = tl.program_id(0)
    pos = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    pos_ok = pos < N
    rows = tl.load(rows_ptr + pos, mask=pos_ok, other=0).to(tl.int64) if HAS_ROWS else pos.to(tl.int64)
    scratch = blk.to(tl.int64) * T_POW2

    # 1. The largest q of each tile over the block's rows, SUB rows at a time (rows past N count as 0, as the
    #    PyTorch plan's zero padding).
    all_tiles = tl.arange(0, T_POW2)
    amax = tl.zeros((T_POW2,), dtype=tl.float32)
    for s0 in range(0, BLOCK_N, SUB):
        p = blk * BLOCK_N + s0 + tl.arange(0, SUB)
        p_ok = p < N
        r = tl.load(rows_ptr + p, mask=p_ok, other=0).to(tl.int64) if HAS_ROWS else p.to(tl.int64)
        ok = p_ok[:, None] & (all_tiles[None, :] < T)
        u = tl.load(u_ptr + r[:, None] * stride_u + all_tiles[None, :], mask=ok, other=0.0)
        lse, abs_a, abs_b, budget, tgt = _row_vectors(r, p_ok, lse_ptr, a_ptr, b_ptr, budget_ptr, tgt_ptr, HAS_B)
        q = _pair_cost(u, lse, abs_a, abs_b, budget, tgt, all_tiles[None, :], ok, WIDEN, LOG_BV, HAS_B)
        q = tl.where(q == q, q, float("inf"))  # a NaN pair (a NaN record) is hot, its tile sorted last: as +inf
        amax = tl.maximum(amax, tl.max(q, axis=0))

    # 2. The tiles by increasing largest q, ties by index: q >= 0, so its bits order as the values do; padding
    #    tiles after every real one.
    key = (amax.to(tl.int32, bitcast=True).to(tl.int64) << 32) | all_tiles.to(tl.int64)
    key = tl.where(all_tiles < T, key, all_tiles.to(tl.int64) | (0x7FFFFFFF << 32))
    order = (tl.sort(key) & 0xFFFFFFFF).to(tl.int32)
    tl.store(order_ptr + scratch + all_tiles, order)
    tl.store(rank_ptr + scratch + order, all_tiles.to(tl.int32), mask=order < T)
    tl.debug_barrier()

    # 3. Walk that order COLS tiles at a time with every row's running sum: the cold tiles are the positions
    #    before the first where some row's sum passes the limit.
    lse, abs_a, abs_b, budget, tgt = _row_vectors(rows, pos_ok, lse_ptr, a_ptr, b_ptr, budget_ptr, tgt_ptr, HAS_B)
    run = tl.zeros((BLOCK_N,), dtype=tl.float32)
    n_cold = T
    for c0 in range(0, T, COLS):
        j = c0 + tl.arange(0, COLS)
        j_ok = j < T
        tiles = tl.load(order_ptr + scratch + j, mask=j_ok, other=0)[None, :]
        ok = pos_ok[:, None] & j_ok[None, :]
        u = tl.load(u_ptr + rows[:, None] * stride_u + tiles, mask=ok, other=0.0)
        q = _pair_cost(u, lse, abs_a, abs_b, budget, tgt, tiles, ok, WIDEN, LOG_BV, HAS_B)
        q = tl.where(q == q, q, float("inf"))
        sums = tl.cumsum(q, axis=1) + run[:, None]
        over = (tl.max(sums, axis=0) > LIMIT) & j_ok
        n_cold = tl.minimum(n_cold, tl.min(tl.where(over, j, T), axis=0))
        run = tl.max(sums, axis=1)

    # 4. This block's hot map, its tiles listed hot first then cold (each ascending), and the hot tiles before each.
    n_hot = T - n_cold
    seen = tl.full((), 0, tl.int32)
    row_out = blk.to(tl.int64) * T
    for c0 in range(0, T, COLS):
        t = c0 + tl.arange(0, COLS)
        t_ok = t < T
        hot = (tl.load(rank_ptr + scratch + t, mask=t_ok, other=0) >= n_cold) & t_ok
        h = hot.to(tl.int32)
        before = seen + tl.cumsum(h, axis=0) - h
        tl.store(hot_ptr + row_out + t, h.to(tl.uint8), mask=t_ok)
        tl.store(pre_ptr + blk.to(tl.int64) * (T + 1) + t, before, mask=t_ok)
        slot = tl.where(hot, before, n_hot + t - before)
        tl.store(list_ptr + row_out + slot, t, mask=t_ok)
        seen += tl.sum(h, axis=0)
    tl.store(pre_ptr + blk.to(tl.int64) * (T + 1) + T, n_hot)


@triton.jit
def _tile_lists_kernel(hot_ptr, list_ptr, pre_ptr, n_blocks, T, TILES: tl.constexpr, BLOCKS: tl.constexpr):
    t = tl.program_id(0) * TILES + tl.arange(0, TILES)
    t_ok = t < T
    n_hot = tl.zeros((TILES,), dtype=tl.int32)
    for b0 in range(0, n_blocks, BLOCKS):
        b = b0 + tl.arange(0, BLOCKS)
        ok = (b < n_blocks)[:, None] & t_ok[None, :]
        n_hot += tl.sum(tl.load(hot_ptr + b[:, None].to(tl.int64) * T + t[None, :], mask=ok, other=0).to(tl.int32),
                        axis=0)
    seen = tl.zeros((TILES,), dtype=tl.int32)
    for b0 in range(0, n_blocks, BLOCKS):
        b = b0 + tl.arange(0, BLOCKS)
        ok = (b < n_blocks)[:, None] & t_ok[None, :]
        h = tl.load(hot_ptr + b[:, None].to(tl.int64) * T + t[None, :], mask=ok, other=0).to(tl.int32)
        before = seen[None, :] + tl.cumsum(h, axis=0) - h
        tl.store(pre_ptr + t[None, :].to(tl.int64) * (n_blocks + 1) + b[:, None], before, mask=ok)
        slot = tl.where(h != 0, before, n_hot[None, :] + b[:, None] - before)
        tl.store(list_ptr + t[None, :].to(tl.int64) * n_blocks + slot, b[:, None] + tl.zeros_like(slot), mask=ok)
        seen += tl.sum(h, axis=0)
    tl.store(pre_ptr + t.to(tl.int64) * (n_blocks + 1) + n_blocks, n_hot, mask=t_ok)


# Tiles a _cold_kernel program sorts at once: its first phase holds SUB x T_POW2 float32 values and the sort key
# T_POW2 int64 ones; beyond this the PyTorch ops build the plan.
MAX_TILES = 4096


def supported(T: int) -> bool:
    """Whether the kernels build plans over T tiles per row."""
    return 0 < T <= MAX_TILES


def row_vectors(m, logs, A, B, target, tgt, V: int, threshold: float, block_v: int):
    """(lse, |A|, |B| or None, budget, target tile) of skip_plans.skip_plan's rows (float32, the tiles int32), for
    threshold > 0 or < 0 (skip_plans.row_budget). tgt: the target tiles when the caller made them (a vocabulary
    order), else None (from target, or -1 everywhere without one)."""
    N = m.shape[0]
    dev = m.device
    block = 1024 if dev.type == "cuda" else 64
    n_parts = cdiv(N, block)
    shared = threshold < 0
    vec = torch.empty((6, N), dtype=torch.float32, device=dev)
    part = torch.empty((2, n_parts), dtype=torch.float32, device=dev) if shared else None
    out_tgt = torch.empty(N, dtype=torch.int32, device=dev) if tgt is None else tgt
    launch(_row_prep_kernel, (n_parts,),
        m, logs, A, B, target, vec, part, out_tgt, N, V, n_parts, float(threshold), m.stride(0), logs.stride(0),
        A.stride(0), 0 if B is None else B.stride(0), 0 if target is None else target.stride(0), BLOCK_V=block_v,
        HAS_B=B is not None, HAS_TARGET=target is not None, WRITE_TGT=tgt is None, SHARED=shared, BLOCK=block,
        num_warps=4)
    if shared:
        launch(_shared_budget_kernel, (n_parts,), vec, part, N, n_parts, float(-threshold), BLOCK=block,
               PARTS=min(256, triton.next_power_of_2(n_parts)), num_warps=4)
    return vec[0], vec[1], (vec[2] if B is not None else None), vec[3], out_tgt


def hot_counts(u, lse, abs_a, abs_b, budget, tgt, hot: float, widen: float, log_bv: float):
    """(N,) int32: per row, the tiles whose q is over `hot`."""
    N, T = u.shape
    count = torch.empty(N, dtype=torch.int32, device=u.device)
    rows, cols = 16, 128
    launch(_hot_count_kernel, (cdiv(N, rows),),
        u, lse, abs_a, abs_b if abs_b is not None else abs_a, budget, tgt, count, N, T, u.stride(0),
        HOT=hot, WIDEN=widen, LOG_BV=log_bv, HAS_B=abs_b is not None, ROWS=rows, COLS=cols, num_warps=4)
    return count


def block_plan(u, lse, abs_a, abs_b, budget, tgt, rows, block_n: int, limit: float, widen: float, log_bv: float):
    """(hot, list_n, pre_n, list_v, pre_v) of a skip_plans.SkipPlan, rows in the order `rows` (None: as given)."""
    N, T = u.shape
    n_blocks = cdiv(N, block_n)
    dev = u.device
    t_pow2 = max(16, triton.next_power_of_2(T))
    order = torch.empty(n_blocks, t_pow2, dtype=torch.int32, device=dev)
    rank = torch.empty(n_blocks, t_pow2, dtype=torch.int32, device=dev)
    hot = torch.empty(n_blocks, T, dtype=torch.uint8, device=dev)
    list_n = torch.empty(n_blocks, T, dtype=torch.int32, device=dev)
    pre_n = torch.empty(n_blocks, T + 1, dtype=torch.int32, device=dev)
    list_v = torch.empty(T, n_blocks, dtype=torch.int32, device=dev)
    pre_v = torch.empty(T, n_blocks + 1, dtype=torch.int32, device=dev)
    sub = max(1, min(block_n, 8192 // t_pow2))
    launch(_cold_kernel, (n_blocks,),
        u, lse, abs_a, abs_b if abs_b is not None else abs_a, budget, tgt, rows if rows is not None else tgt,
        order, rank, hot, list_n, pre_n, N, T, u.stride(0),
        LIMIT=limit, WIDEN=widen, LOG_BV=log_bv, HAS_B=abs_b is not None, HAS_ROWS=rows is not None,
        BLOCK_N=block_n, T_POW2=t_pow2, SUB=sub, COLS=64, num_warps=8)
    tiles = 64
    launch(_tile_lists_kernel, (cdiv(T, tiles),), hot, list_v, pre_v, n_blocks, T, TILES=tiles, BLOCKS=32,
           num_warps=4)
    return hot, list_n, pre_n, list_v, pre_v
