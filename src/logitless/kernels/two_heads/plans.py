"""Which (token block, tile) pairs the two-head backward may skip: per-pair bounds on what skipping costs the
student's dL/dz, from both heads' tile records of the forward, and the plan over them (linear_head's cold_pairs).
Device ops only, no host sync (docs/math.md, "Skipping cold tiles of two heads").

For a row with student and teacher masses r_s, r_t in a tile (bounds from the tile's log-sum-exps), the L1 norm of
the student's dL/dz over the tile, per unit of the kind's scale kappa (1; 1 - beta for the JSD), is at most:

- forward KL and soft cross-entropy (p_s - p_t): r_s + r_t;
- reverse KL (p_s (log p_s - log p_t - KL)): r_s (h + KL) + r_t, h = lse_t - min_j z_t,j over the tile;
- JSD (p_s (log p_s - log M - KL(p_s || M))): 2 r_s log(1 / (1 - beta)) + beta r_t.
"""

from __future__ import annotations

import math

import torch

from .._common import cdiv
from ..linear_head import SkipPlan, cold_pairs, shared_budget
from .configs import config, dz_config

# The tile records are float32 sums and logs (exp and log of the GPU's fast forms: a few ulps): the exponent of a
# mass bound is widened by 2^-20 of its terms' size and by 2^-16, far above those roundings.
_WIDEN = 2.0**-20


def skip_supported(x: torch.Tensor) -> bool:
    """Whether the two-head backward can skip for this input: its dz tiles are the forward's (the map's pairs), and
    the products' tiles (product_config) nest inside them."""
    f, c = config(x), dz_config(x)
    p = product_config(c)
    return (f.block_n == c.block_n and f.block_v == c.block_v and c.block_v % p.block_m == 0
            and c.block_v % p.block_kg == 0 and c.block_n % p.block_m == 0 and c.block_n % p.block_kg == 0)


def product_config(cfg):
    """The dz config with product tiles no taller than a token block (the interpreter's blocks are 16 tokens)."""
    return cfg.replace(block_m=min(cfg.block_m, cfg.block_n), block_kg=min(cfg.block_kg, cfg.block_n))


def tile_count(x: torch.Tensor, V: int) -> int:
    return cdiv(V, config(x).block_v)


def _mass(lse_tile, lse):
    u = lse_tile - lse[:, None]
    widen = (lse_tile.abs() + lse.abs()[:, None]) * _WIDEN + 2.0**-16
    return torch.nan_to_num(u + widen, nan=0.0).exp_().clamp_(max=1.0)


def pair_costs(tiles, m_s, logs_s, m_t, logs_t, loss, kind: str, beta: float):
    """From the forward's tile records (3, N, T) and the rows' statistics: (cost (N, T), err (2, N)), float32.
    cost bounds the L1 change of a row's dL/dz (per unit of kappa and of the upstream gradient) if the pair is
    skipped (the module docstring); err holds e_i and b_i of PyTorch's own rounding error in the row's gradient
    in units of the rounding of a logit (shared_budget): max(1, |m|) (1 - p_max) of each head summed, and the same
    without the factor 1 - p_max."""
    lse_s, lse_t = m_s + logs_s, m_t + logs_t
    r_s, r_t = _mass(tiles[0], lse_s), _mass(tiles[1], lse_t)
    if kind in ("fkl", "ce"):
        cost = r_s + r_t
    elif kind == "rkl":
        h = (lse_t[:, None] - tiles[2]).clamp_(min=0.0) * (1.0 + 2.0**-16)
        cost = r_s * (h + loss.abs()[:, None] * (1.0 + 2.0**-16)) + r_t
    else:
        cost = r_s * (-2.0 * math.log1p(-beta)) + beta * r_t
    cost = torch.where(torch.isfinite(cost), cost, math.inf)
    big_s, big_t = m_s.abs().clamp(min=1.0), m_t.abs().clamp(min=1.0)
    e = big_s * -torch.expm1(-logs_s) + big_t * -torch.expm1(-logs_t)
    return cost, torch.stack([e, big_s + big_t])


def skip_plan(cost, err, g, threshold: float, block_n: int, group_rows: bool, bound: bool = False) -> SkipPlan:
    """The cold pairs for upstream gradients g (N,): each row's skipped pairs change its dL/dz by at most T_i in L1,
    T_i = threshold |g_i| kappa for threshold > 0, or shared_budget's share of |threshold| times PyTorch's
    error (err) for threshold < 0. Rows with g = 0 (ignored) lose nothing. bound: SkipPlan.row_bound gets each
    row's sum of cost |g| over its skipped pairs (tests and tools)."""
    ga = g.float().abs()
    budget = ga * threshold if threshold > 0 else shared_budget(ga * err[0], ga * err[1], threshold)
    scaled = cost * ga[:, None]
    q = scaled / budget.clamp(min=1e-30)[:, None]
    q.masked_fill_((ga == 0)[:, None], 0.0)
    return cold_pairs(q, block_n, group_rows, scaled if bound else None)
