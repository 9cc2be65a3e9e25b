"""The launchers of cross-entropy on stored logits: cross_entropy_fwd (loss, lse and statistics; the in-place
gradient), cross_entropy_bwd (the gradient by a second launch) and scale_rows_ (a stored gradient times the upstream
one). Checks, allocation, grid and launch; no autograd."""

from __future__ import annotations

import torch
import triton

from .._common import cdiv
from .._launch import launch
from .._tuning import current_tuning
from .configs import Config, default_config, inplace_lag_bytes, num_sms
from .kernels import _ce_bwd_kernel, _ce_fwd_kernel, _ce_scale_kernel


def _interpreting(t: torch.Tensor) -> bool:
    return t.device.type != "cuda"


def _flags(class_w, label_smoothing, z_loss, softcap):
    return dict(HAS_WEIGHT=class_w is not None, HAS_SMOOTHING=label_smoothing > 0.0, HAS_ZLOSS=z_loss > 0.0,
                HAS_SOFTCAP=softcap is not None)


def cross_entropy_fwd(logits, target, class_w, w_sum, scale, *, ignore_index: int, label_smoothing: float,
                      z_loss: float, softcap: float | None, write_grad: bool, config: Config | None = None,
                      lag: int | None = None):
    """Per-row loss (0 on ignored rows), per-row log-sum-exp, and per-row (max, log sum exp) statistics.

    logits: (N, V) float32/bfloat16/float16 with unit column stride. target: (N,) int64. class_w: (V,) float32 or
    None; w_sum: 0-d float32 sum of class_w (needed with class weights and smoothing). scale: 0-d float32 factor of
    the gradient of every non-ignored row (1 / denominator for reduction="mean") or None.
    write_grad: overwrite `logits` with d(loss)/d(logits) (upstream 1, times `scale`) in the same launch.
    lag: with write_grad, work units between a unit's statistics and its gradient (None: inplace_lag_bytes of
    logits; a second launch if that is None too).
    Returns (loss (N,) float32, lse (N,) float32, stats (N, 2) float32).
    """
    assert logits.dim() == 2 and logits.stride(1) == 1
    N, V = logits.shape
    dev = logits.device
    loss = torch.empty(N, device=dev, dtype=torch.float32)
    lse = torch.empty(N, device=dev, dtype=torch.float32)
    stats = torch.empty(N, 2, device=dev, dtype=torch.float32)
    if N == 0:
        return loss, lse, stats
    tune = current_tuning()
    if config is not None:
        cfg = config
    elif write_grad:
        cfg = default_config(N, V, dev, tune.ce_inplace_tiles_per_program)
    else:
        cfg = default_config(N, V, dev, tune.ce_stats_tiles, tune.ce_stats_tile_elems)
    K = cdiv(V, cfg.block_v * cfg.tiles)
    n_blocks = cdiv(N, cfg.block_n)
    split = K > 1
    n_units = n_blocks * K
    # A row in registers is written back in the same pass; a longer row `lag` units behind its statistics in the
    # same launch (inplace_lag_bytes of logits), or by a second launch (None).
    in_registers = write_grad and not split and cfg.tiles == 1
    if lag is None:
        lag_bytes = inplace_lag_bytes(dev)
        if lag_bytes is not None:
            lag = lag_bytes // (cfg.block_n * cfg.block_v * cfg.tiles * logits.element_size())
    lagged = write_grad and not in_registers and lag is not None
    lag = max(K, min(lag, n_units)) if lagged else 0
    # Absent operands (class weights, their sum, the scale, the split partials and counters) are None: constexprs
    # that the kernel's flags keep unread.
    if split:
        nstat = 4 if label_smoothing > 0.0 else 2
        part = torch.empty(N * K * nstat, device=dev, dtype=torch.float32)
    else:
        part = None
    count = torch.zeros(n_blocks, device=dev, dtype=torch.int32) if split or lagged else None
    launch(_ce_fwd_kernel, (n_units + lag,),
        logits, target, class_w, w_sum, scale,
        loss, lse, stats, part, count,
        N, V, K, n_units, lag, logits.stride(0),
        ignore_index, float(label_smoothing), float(z_loss), float(softcap) if softcap is not None else 1.0,
        BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, TILES=cfg.tiles, K_POW2=triton.next_power_of_2(K), SPLIT=split,
        HAS_SCALE=scale is not None, WRITE_GRAD=in_registers, LAGGED=lagged,
        STATS_EVICT="evict_last" if lagged else "", GRAD_EVICT="evict_first" if lagged else "",
        GRAD_STORE_CM=".cs" if lagged else "", STAGES=1 if write_grad else tune.ce_stats_stages,
        INTERPRET=_interpreting(logits),
        **_flags(class_w, label_smoothing, z_loss, softcap),
        num_warps=cfg.num_warps,
    )
    if write_grad and not in_registers and not lagged:
        cross_entropy_bwd(None, logits, target, class_w, w_sum, scale, stats, logits, ignore_index=ignore_index,
                          label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap, config=cfg)
    return loss, lse, stats


def cross_entropy_bwd(grad, logits, target, class_w, w_sum, scale, stats, out, *, ignore_index: int,
                      label_smoothing: float, z_loss: float, softcap: float | None, config: Config | None = None):
    """out = grad * d(loss)/d(logits), written into `out` ((N, V), unit column stride; may be `logits` itself).

    grad: upstream gradient, 0-d (scalar reductions) or (N,) (reduction="none"), or None for 1. The other arguments
    are those of cross_entropy_fwd and its returned `stats`. Returns `out`.
    """
    assert out.shape == logits.shape and out.stride(1) == 1 and logits.stride(1) == 1
    N, V = logits.shape
    if N == 0:
        return out
    cfg = config or default_config(N, V, logits.device)
    grid = (cdiv(N, cfg.block_n), cdiv(V, cfg.block_v))
    launch(_ce_bwd_kernel, grid,
        grad, logits, out, target, class_w, w_sum, scale, stats,
        N, V, logits.stride(0), out.stride(0),
        ignore_index, float(label_smoothing), float(z_loss), float(softcap) if softcap is not None else 1.0,
        BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, HAS_GRAD=grad is not None,
        GRAD_PER_ROW=grad is not None and grad.dim() == 1, HAS_SCALE=scale is not None,
        INTERPRET=_interpreting(logits), **_flags(class_w, label_smoothing, z_loss, softcap),
        num_warps=cfg.num_warps,
    )
    return out


def scale_rows_(buf, grad, config: Config | None = None):
    """buf *= grad in place, grad 0-d or (N,) float; tiles whose upstream is exactly 1 are skipped on the device.
    Returns `buf`."""
    assert buf.dim() == 2 and buf.stride(1) == 1
    N, V = buf.shape
    if N == 0:
        return buf
    cfg = config or default_config(N, V, buf.device)
    n_row_blocks = cdiv(N, cfg.block_n)
    # A few programs per SM, each looping over row blocks: when nothing is to be scaled the launch costs microseconds.
    grid = (min(n_row_blocks, 8 * num_sms(buf.device)),)
    launch(_ce_scale_kernel, grid,
        buf, grad, N, V, buf.stride(0), n_row_blocks,
        BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, GRAD_PER_ROW=grad.dim() == 1,
        INTERPRET=_interpreting(buf), num_warps=cfg.num_warps,
    )
    return buf
