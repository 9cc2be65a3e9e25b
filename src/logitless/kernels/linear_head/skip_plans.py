"""The skip plan: which (token block, tile) pairs of the forward's tiles the backward may leave out, and the lists
its kernels walk. Each pair's cost relative to its row's budget comes from the forward's float16 tile record; per
block of grouped rows the cheapest tiles are skipped while every row stays within its budget (docs/kernels.md,
"Sparsity"). skip_plan builds it with plan_kernels' three launches (the backward's way) or with PyTorch ops (the
CPU tools, and cold_pairs for the two-head losses' costs). Device ops only, no host sync.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .._common import cdiv
from .._tuning import current_tuning
from . import plan_kernels


class SkipPlan(NamedTuple):
    """Which (token block, tile) pairs of the forward's tiles the backward computes, and the lists its kernels walk.
    The token blocks are blocks of the rows in the order `rows` (the identity when rows is None)."""

    hot: torch.Tensor  # (n_blocks, n_vtiles) uint8: 1 where the pair is computed
    list_n: torch.Tensor  # (n_blocks, n_vtiles) int32: per token block, its hot tiles first, ascending
    pre_n: torch.Tensor  # (n_blocks, n_vtiles + 1) int32: hot tiles of the block before each tile
    list_v: torch.Tensor  # (n_vtiles, n_blocks) int32: per tile, its hot token blocks first, ascending
    pre_v: torch.Tensor  # (n_vtiles, n_blocks + 1) int32: hot blocks of the tile before each block
    pairs: torch.Tensor  # (n_vtiles + 1,) int32: hot pairs of the tiles before each tile; pairs[-1]: all of them
    # (N,) float32: bound on each row's skipped probability mass (0 where A = 0); computed only for those who read
    # it (Tuning.debug_plans set: tests, tools), None otherwise (an N x V/256 pass the backward does not need).
    row_bound: torch.Tensor | None
    rows: torch.Tensor | None  # (N,) int64: row k of the backward's order is row rows[k] of the input; or None


# A row's float16 tile log-sum-exp u is within 2^-11 |u| of the float32 one: the plan widens it by this much (and
# the float32 value by as much again) before bounding a mass with it.
_WIDEN = 2.0**-10
# Rows are grouped by how many tiles hold more than this fraction of their budget each (their "hot count").
_HOT_FRACTION = 2.0**-6
# Rows of the greedy at a time: its temporaries are a few (rows x tiles) float32 arrays.
_PLAN_ROWS = 4096


def row_budget(m: torch.Tensor, logs: torch.Tensor, threshold: float, A: torch.Tensor,
               B: torch.Tensor | None = None) -> torch.Tensor:
    """(N,) float32 error each gradient row may take from the skipped pairs, in L1 over the row's dL/dz (the cost of
    skipping is skip_cost's). threshold > 0: threshold (|A_i| + |B_i|), so that a row without an entropy term loses
    at most threshold of its probability mass. threshold < 0: in units of |threshold| max(1, |m_i|), the rounding of
    the row's largest logit to the input dtype, which moves each p_ij by about that relative amount; PyTorch's own
    error in the row's gradient scales with it, with the row's coefficients and with its mass outside its top class
    (1 - p_max,i = -expm1(-logs_i)): e_i = max(1, |m_i|) (|A_i| + |B_i|) (1 - p_max,i), b_i the same without the
    last factor. The rule the budget keeps is the batch's (the error of the whole gradient against PyTorch's), so
    the rows share it: T_i = |threshold| sqrt((e_i^2 + R^2 b_i^2) / 2) with R^2 = sum e^2 / sum b^2, hence
    sum_i T_i^2 = threshold^2 sum_i e_i^2, what budgets of |threshold| e_i per row would allow; but a near-certain
    row among uncertain ones may lose more than its own tiny share, and no row gets less than 1/sqrt(2) of its own
    (docs/kernels.md, "Sparsity"). A batch of near-certain rows has R ~ 1 - p_max: it skips nothing."""
    coef = A.float().abs() if B is None else A.float().abs() + B.float().abs()
    if threshold > 0:
        return coef * threshold
    b = m.abs().clamp(min=1.0) * coef
    return shared_budget(b * -torch.expm1(-logs.float()), b, threshold)


def shared_budget(e: torch.Tensor, b: torch.Tensor, threshold: float) -> torch.Tensor:
    """(N,) float32 budgets T_i = |threshold| sqrt((e_i^2 + R^2 b_i^2) / 2), R^2 = sum e^2 / sum b^2, for rows
    whose gradient PyTorch rounds to an error of about e_i (in units of the rounding of one logit) and b_i the same
    without the factor of the mass outside the top class (row_budget): the batch's sum of T_i^2 is that of
    |threshold| e_i, shared so that no row gets less than 1/sqrt(2) of its own share."""
    r2 = e.square().sum() / b.square().sum().clamp(min=1e-30)
    return ((e.square() + r2 * b.square()) * 0.5).sqrt_().mul_(-threshold)


def skip_cost(r: torch.Tensor, A: torch.Tensor, B: torch.Tensor | None, block_v: int) -> torch.Tensor:
    """(N, T) bound on the L1 error skipping each (row, tile) pair puts in the row's dL/dz_j = p_j (A + B (z_j -
    m)), from r (N, T), a bound on the row's mass in the tile: p_j |A + B (z_j - m)| <= |A| p_j + |B| p_j (m - z_j)
    and m - z_j <= -log p_j, so over a tile of n classes holding mass s <= r <= 1 the error is at most |A| r +
    |B| r log(n / r) (the sum of -p log p for a mass s over n classes is largest spread evenly, and s log(n / s)
    grows with s up to n / e)."""
    c = r * A.float().abs()[:, None]
    if B is not None:
        c += B.float().abs()[:, None] * (r * math.log(block_v) - torch.special.xlogy(r, r))
    return c


def skip_plan(tile_lse, m, logs, A, target, perm, V, threshold, block_n, block_v, group_rows=True, B=None,
              kernels=False) -> SkipPlan:
    """The cold pairs for the backward, on the device (no host sync).

    tile_lse (N, T) float16 holds each row's log-sum-exp over each tile, so row i's probability mass in tile t is
    at most r_it = exp(widened tile_lse[i, t] - lse_i). Skipping the pair costs the row's gradient at most c_it
    (skip_cost: |A_i| r_it, plus a term with the entropy's coefficient B_i); each row may take T_i (row_budget) in
    all. Rows with A_i = B_i = 0 have nothing to lose; a tile holding a row's target is never skipped for its block
    (the one-hot term). cold_pairs picks the pairs from c_it / T_i. So each gradient row changes by at most T_i in
    L1, and without B, every row loses at most T_i / |A_i| of its mass (docs/kernels.md).

    kernels: build the plan with the Triton launches of plan_kernels (the linear-head backward's choice,
    Tuning.skip_plan_kernels) instead of PyTorch ops over (N, T) arrays; the same plan up to pairs at the float32
    rounding of a budget's edge."""
    if kernels and plan_kernels.supported(tile_lse.shape[1]):
        return _kernel_plan(tile_lse, m, logs, A, B, target, perm, V, threshold, block_n, block_v, group_rows)
    lse = m + logs
    # c_it / T_i for every row and tile (float32, N x T: a quarter of the bytes of the bf16 logits of one tile
    # column per row), +inf at each row's target tile, 0 for rows without coefficients. The exponent is widened by
    # the float16 rounding of u (_WIDEN) and by that of lse (2^-20 |lse|, far above float32's).
    r = _tile_mass(tile_lse, lse)
    budget = row_budget(m, logs, threshold, A, B)
    q = skip_cost(r, A, B, block_v).div_(budget.clamp(min=1e-30)[:, None])
    if current_tuning().debug_plans is None:
        del r
    if target is not None:
        tt = _target_tiles(target, perm, V, block_v).long()[:, None]
        valid = tt >= 0
        tt = tt.clamp(min=0)
        q.scatter_(1, tt, torch.where(valid, float("inf"), q.gather(1, tt)))
    q.masked_fill_((budget == 0)[:, None], 0.0)
    bound = None
    if current_tuning().debug_plans is not None:
        bound = torch.where((budget > 0)[:, None], r, 0.0)  # the skipped mass, 0 for rows without coefficients
    return cold_pairs(q, block_n, group_rows, bound)


def _tile_mass(tile_lse: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    # (N, T) float32 bound r_it on row i's probability mass in tile t: the float16 record widened by its rounding
    # (_WIDEN) and lse by 2^-20 |lse|, far above float32's (plan_kernels._pair_cost computes the same).
    u = tile_lse.float()
    return (u + u.abs() * _WIDEN - lse[:, None] + lse.abs()[:, None] * 2.0**-20).exp_().clamp_(max=1.0)


def _target_tiles(target, perm, V, block_v) -> torch.Tensor:
    # (N,) int32: the vocabulary tile holding each row's target, -1 for targets out of [0, V) (ignored rows).
    pos = target
    if perm is not None:
        pos = torch.argsort(perm)[target.clamp(0, V - 1)]
    valid = (target >= 0) & (target < V)
    return torch.where(valid, pos // block_v, -1).to(torch.int32)


def _kernel_plan(tile_lse, m, logs, A, B, target, perm, V, threshold, block_n, block_v, group_rows) -> SkipPlan:
    # skip_plan through plan_kernels: the per-row vectors in one or two launches, the (N, T) work in three.
    N, T = tile_lse.shape
    u = tile_lse if tile_lse.stride(1) == 1 else tile_lse.contiguous()
    tgt = None if target is None or perm is None else _target_tiles(target, perm, V, block_v)
    lse, abs_a, abs_b, budget, tgt = plan_kernels.row_vectors(m, logs, A, B, target, tgt, V, threshold, block_v)
    args = (u, lse, abs_a, abs_b, budget, tgt)
    log_bv = math.log(block_v)
    rows = None
    if group_rows and cdiv(N, block_n) > 1:
        count = plan_kernels.hot_counts(*args, _HOT_FRACTION, _WIDEN, log_bv)
        rows = torch.sort(count, stable=True).indices
    hot, list_n, pre_n, list_v, pre_v = plan_kernels.block_plan(*args, rows, block_n, 1.0 - 2.0**-16, _WIDEN, log_bv)
    row_bound = None
    if current_tuning().debug_plans is not None:
        row_bound = _row_bound(torch.where((budget > 0)[:, None], _tile_mass(u, lse), 0.0), hot == 0, rows, block_n)
    return SkipPlan(hot, list_n, pre_n, list_v, pre_v, _pairs(pre_v), row_bound, rows)


def _pairs(pre_v: torch.Tensor) -> torch.Tensor:
    # SkipPlan.pairs from the per-tile prefix counts: each tile's hot blocks are its last prefix count.
    return torch.nn.functional.pad(pre_v[:, -1].cumsum(0, dtype=torch.int32), (1, 0))


def _row_bound(bound: torch.Tensor, cold: torch.Tensor, rows: torch.Tensor | None, block_n: int) -> torch.Tensor:
    # Each row's sum of `bound` (N, T) over its skipped pairs (cold: (blocks, T) bool), in input row order.
    N = bound.shape[0]
    blk = torch.arange(N, device=bound.device) // block_n
    if rows is not None:
        blk = torch.empty_like(blk).index_copy_(0, rows, blk)
    return torch.where(cold[blk], bound, 0.0).sum(1, dtype=torch.float64).float()


def cold_pairs(q: torch.Tensor, block_n: int, group_rows: bool = True, bound: torch.Tensor | None = None
               ) -> SkipPlan:
    """The SkipPlan of the (N, T) costs q, each (row, tile) pair's cost relative to its row's budget (+inf where
    the pair must be computed, 0 where it costs nothing), on the device (no host sync). With group_rows, rows are
    first sorted (stably) by the number of tiles whose q is over _HOT_FRACTION, so that a block's rows share
    their cold tiles (the plan's blocks are blocks of that order: SkipPlan.rows). Per block, tiles are skipped in
    increasing order of their largest q over the block's rows while every row's running sum stays <= 1. bound:
    (N, T) or None, the quantity SkipPlan.row_bound sums over each row's skipped pairs."""
    N, T = q.shape
    n_blocks = cdiv(N, block_n)
    dev = q.device
    rows = None
    if group_rows and n_blocks > 1:
        rows = torch.sort((q > _HOT_FRACTION).sum(1), stable=True).indices
    # Per block of (ordered) rows: the longest prefix of its tiles, sorted by their largest relative mass, that
    # keeps every row's running sum within its budget (float32 sums: the 2^-16 margin covers their rounding).
    cold = torch.zeros(n_blocks, T, dtype=torch.bool, device=dev)
    step = max(1, _PLAN_ROWS // block_n) * block_n
    for lo in range(0, N, step):
        hi = min(lo + step, N)
        nb = cdiv(hi - lo, block_n)
        qb = q[lo:hi] if rows is None else q[rows[lo:hi]]
        qb = torch.nn.functional.pad(qb, (0, 0, 0, nb * block_n - (hi - lo))).view(nb, block_n, T)
        order = torch.sort(qb.amax(1), dim=1, stable=True).indices
        run = torch.gather(qb, 2, order[:, None, :].expand(nb, block_n, T)).cumsum(2).amax(1)
        cold[lo // block_n: lo // block_n + nb].scatter_(1, order, run <= 1.0 - 2.0**-16)
    hot = ~cold
    row_bound = None if bound is None else _row_bound(bound, cold, rows, block_n)
    cold_i, cold_t = cold.to(torch.int32), cold.t().contiguous().to(torch.int32)
    pad = torch.nn.functional.pad
    pre_v = pad((1 - cold_t).cumsum(1, dtype=torch.int32), (1, 0)).contiguous()
    return SkipPlan(
        hot.to(torch.uint8).contiguous(),
        torch.sort(cold_i, dim=1, stable=True).indices.to(torch.int32).contiguous(),
        pad(hot.to(torch.int32).cumsum(1, dtype=torch.int32), (1, 0)).contiguous(),
        torch.sort(cold_t, dim=1, stable=True).indices.to(torch.int32).contiguous(),
        pre_v,
        _pairs(pre_v),
        row_bound,
        rows,
    )
