"""The tiles of cross-entropy on stored logits (config) and the in-place path's lag (inplace_lag_bytes), from
kernels.Tuning's ce_* fields and the device."""

from __future__ import annotations

import dataclasses

import torch
import triton

from .._common import INTERPRETER_SMS_CE, cdiv, device_index, dram_bytes_per_s
from .._common import num_sms as _num_sms
from .._tuning import current_tuning

# The tiles' sizes (columns per tile, tiles per program, the narrowest tile; in place; statistics alone) and the
# in-place path's lag are fields of kernels.Tuning (ce_*), with their measurements.


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    block_n: int  # rows per tile
    block_v: int  # columns per tile
    num_warps: int
    tiles: int = 1  # tiles per program in the forward pass


def inplace_lag_bytes(device: torch.device) -> int | None:
    """Logits between a work unit's statistics and its gradient in the one-launch in-place path:
    Tuning.ce_inplace_lag_bytes, or less on a GPU whose DRAM moves fewer bytes in Tuning.ce_inplace_lag_seconds
    (None: a second launch)."""
    tune = current_tuning()
    lag = tune.ce_inplace_lag_bytes
    if lag is None or device.type != "cuda":
        return lag
    bw = dram_bytes_per_s(device_index(device))
    return lag if bw is None else min(lag, int(bw * tune.ce_inplace_lag_seconds))


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; a small stand-in under the interpreter (_common)."""
    return _num_sms(device, INTERPRETER_SMS_CE)


def default_config(N: int, V: int, device: torch.device, tiles_per_program: int | None = None,
                   tile_elems: int | None = None) -> Config:
    """Tiles of up to `tile_elems` elements (Tuning.ce_tile_elems by default); a program reads `tiles_per_program`
    of them (Tuning.ce_tiles_per_program by default) along a row in pass 1, so a long row is split over several
    programs. With too few
    programs to fill the device (small N), fewer tiles per program, then narrower tiles; short rows share a tile
    (BLOCK_N > 1)."""
    tune = current_tuning()
    n_sm = num_sms(device)
    tile_elems = tile_elems or tune.ce_tile_elems
    block_v = min(triton.next_power_of_2(V), tile_elems)
    tiles = max(1, min(tiles_per_program or tune.ce_tiles_per_program, cdiv(V, block_v)))
    while N * cdiv(V, block_v * tiles) < 4 * n_sm:
        if tiles > 1:
            tiles //= 2
        elif block_v > tune.ce_min_block_v:
            block_v //= 2
        else:
            break
    block_n = max(1, min(tile_elems // block_v, triton.next_power_of_2(N)))
    while block_n > 1 and cdiv(N, block_n) * cdiv(V, block_v * tiles) < 4 * n_sm:
        block_n //= 2
    num_warps = max(4, min(16, block_n * block_v // 1024))
    return Config(block_n=block_n, block_v=block_v, num_warps=num_warps, tiles=tiles)
