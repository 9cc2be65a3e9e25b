"""The skip plan's (N, T) work in three Triton launches instead of some hundred PyTorch ops.

skip_plans.skip_plan computes, for each (row, tile) pair, its cost relative to the row's budget q_it, then per block of
(grouped) rows the tiles it may skip, then the lists the gradient products walk. As PyTorch ops that is about a
hundred launches, many of them passes over (N, T) float32 arrays, each also a cost to the host that issues it
(docs/design/skipping.md, "The plan in three launches"). Here:

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


def hot_counts(u, lse, abs_a, abs_b, budget, tgt, hot: float, widen: float, log_bv: float):
    """(N,) int32: per row, the tiles whose q is over `hot`."""
    N, T = u.shape
    count = torch.empty(N, dtype=torch.int32, device=u.device)
    rows, cols = 16, 128
    _hot_count_kernel[(cdiv(N, rows),)](
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
    _cold_kernel[(n_blocks,)](
        u, lse, abs_a, abs_b if abs_b is not None else abs_a, budget, tgt, rows if rows is not None else tgt,
        order, rank, hot, list_n, pre_n, N, T, u.stride(0),
        LIMIT=limit, WIDEN=widen, LOG_BV=log_bv, HAS_B=abs_b is not None, HAS_ROWS=rows is not None,
        BLOCK_N=block_n, T_POW2=t_pow2, SUB=sub, COLS=64, num_warps=8)
    tiles = 64
    _tile_lists_kernel[(cdiv(T, tiles),)](hot, list_v, pre_v, n_blocks, T, TILES=tiles, BLOCKS=32, num_warps=4)
    return hot, list_n, pre_n, list_v, pre_v
