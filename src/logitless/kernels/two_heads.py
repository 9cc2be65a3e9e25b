"""Triton kernels of two linear heads over one vocabulary (distillation losses, soft cross-entropy), never stored.

Launchers (no autograd here). Inputs are validated: the student's xs (N, Ds), ws (V, Ds), bs (V,) or None and the
teacher's xt (N, Dt), wt (V, Dt), bt or None, all of one dtype (float32, bfloat16 or float16). Logits of both
heads are z = softcap(x W^T + b) * inv_temp; `kind` is one of distill.KINDS.

    forward_stats(xs, ws, bs, xt, wt, bt, *, kind, beta, softcap, inv_temp)
        -> (m_s, logs_s, m_t, logs_t, ea, da, kt, ks, zr, dl, dref), each (N,) float32 or None (distill.RowStats):
           pass 1,
           one kernel, folds both heads' tiles into online log-sum-exps and the weighting head a's sums
           sum_j e_a (z_a - m_a) and sum_j e_a ((z_a - m_a) - (z_b - zr)), zr = z_b at a's argmax (moved as m_a
           grows); for the JSD, pass 2 (the same
           kernel, MODE 2) sums p_t (log p_t - log M) and p_s (log p_s - log M) with the final log-sum-exps.
    backward(xs, ws, bs, xt, wt, bt, m_s, logs_s, m_t, logs_t, R, g, *, kind, beta, softcap, inv_temp, need_dx,
             need_dw, need_db, workspace_bytes=None)
        -> (dx_s | None, dW_s | None, db_s | None) for the per-row upstream gradient g (float32, 0 at ignored rows);
           m_t and R as distill.row_loss gives them (for the reverse KL, the teacher's reference and da).

Forward: programs own (token block x vocabulary split); each computes both heads' logit tiles with the linear-head
kernels' _logits_tile (tensor descriptors where possible) and the splits' partials are merged with a few PyTorch
ops on (splits, N) floats. Backward: the linear-head backward's machinery with another dz kernel: the vocabulary is
walked in chunks, _two_dz_kernel recomputes both heads' tiles and writes the student's dL/dz of the chunk, and the
two gradient products (dW_s rows = dz^T x_s, dx_s += dz W_s[chunk]) run through linear_head's
products._products_torch (cuBLAS for bfloat16 / float16 on CUDA, float32 reductions). The workspaces follow
linear_head's plans (_plan, _first_pass, _second_pass): dz and the float32 dx accumulator live in rows of dW_s
not written yet, so the extra memory is the same O(N) plus scratch as the single-head backward's. Nothing here
synchronises with the host.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import triton
import triton.language as tl

from ..loss_math import log_ratio, move_t
from ._common import (
    INTERPRETER_SMS_BACKWARD,
    INTERPRETER_SMS_FORWARD,
    cdiv,
    device_index,
    gradient_buffers,
    max_shared_mem,
    new_buffer,
    num_sms,
)
from ._device import LOG2E, cast, exp, mma
from ._tuning import current_tuning
from .linear_head import plans
from .linear_head.configs import Config, descriptor, dot_flags, fp32_config, operands, tma_ok, use_tma
from .linear_head.products import _MM_OUT_DTYPE, _Fp32Reductions, _products_torch
from .linear_head.tiles import grouped, logits_tile, rescale_ent, transform


def gpu_config() -> Config:
    """bfloat16 / float16 on a GPU with the copy engine. Two accumulators of logits are live at once, so the tiles
    are half the single-head forward's (128 x 256 fp32 would need every register of the thread for the accumulators
    alone). H100 sweep (docs/distill.md): 4 stages against 3 made the forward 15% and the backward 8% faster; 5-6
    stages, 64 x 256, block_k 32 or 128, 16 warps and both heads in one reduction loop were no faster. The forward
    fields (block_n, block_v, block_k, fwd_warps, fwd_stages) serve the forward and dz kernels, dz_block_v the dz
    kernel's classes, and wide the backward's widest first-pass chunk; the gradient products are cuBLAS's."""
    return Config(block_n=128, block_v=128, block_k=64, fwd_warps=8, fwd_stages=4,
                  block_m=128, block_d=256, block_kg=64, grad_warps=8, grad_stages=4,
                  group=8, waves=8, dz_block_v=128, tma=True, wide=8192)


def interpreter_config() -> Config:
    """The Triton interpreter: tiles small enough that the tests' shapes have several partial tiles each way."""
    return Config(block_n=16, block_v=32, block_k=16, fwd_warps=1, fwd_stages=1,
                  block_m=32, block_d=32, block_kg=32, grad_warps=1, grad_stages=1,
                  group=2, waves=4, dz_block_v=32, tma=True, wide=96)


def arch_config(dtype: torch.dtype, major: int, max_smem: int) -> Config:
    """The two-head tiles for a CUDA device of compute capability `major`.x whose blocks may use `max_smem` bytes of
    shared memory (tools/compile_check.py compiles them per architecture). Below Hopper's shared memory, reduction
    steps of 32: with 64, the dz kernel's stages and its copy-engine store took 129 KiB on sm_120 (99 KiB there)."""
    if dtype == torch.float32:
        return fp32_config()
    cfg = gpu_config()
    if max_smem < 200 * 1024:
        cfg = cfg.replace(block_k=32)
    if major < 9:
        cfg = cfg.replace(tma=False)
    return cfg


@functools.cache
def _device_config(index: int, dtype: torch.dtype) -> Config:
    return arch_config(dtype, torch.cuda.get_device_capability(index)[0], max_shared_mem(index))


def _config(x: torch.Tensor) -> Config:
    override = current_tuning().two_heads_config
    if override is not None:
        return override
    if x.device.type != "cuda":
        return interpreter_config()
    return _device_config(device_index(x.device), x.dtype)


def _dz_config(x: torch.Tensor) -> Config:
    """The backward's config: the dz kernel's tiles in the forward fields (block_n, block_v, block_k, fwd_warps,
    fwd_stages), which the memory plan also reads (chunks rounded to dz tiles); Tuning.two_heads_dz on CUDA."""
    cfg = _config(x)
    dz_tiles = current_tuning().two_heads_dz
    if dz_tiles is not None and x.device.type == "cuda":
        bn, bv, bk, warps, stages = dz_tiles
        return cfg.replace(block_n=bn, block_v=bv, block_k=bk, fwd_warps=warps, fwd_stages=stages, dz_block_v=bv)
    return cfg.replace(block_v=cfg.dz_block_v)


_MODES = {"fkl": 0, "ce": 0, "rkl": 1, "jsd": 2}


@triton.jit
def _two_tiles(
    xs_ptr, ws_ptr, bs_ptr, xt_ptr, wt_ptr, bt_ptr, row0, col0, N, V, Ds, Dt,
    sxs_n, sxs_d, sws_v, sws_d, sxt_n, sxt_d, swt_v, swt_d, softcap, inv_temp,
    HAS_BS: tl.constexpr, HAS_BT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_TEMP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_KS: tl.constexpr,
    EVEN_KT: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
    FUSED: tl.constexpr, FINE_SLOPE: tl.constexpr, HALF_TANH: tl.constexpr,
):
    """Both heads' transformed logits [BLOCK_N, BLOCK_V] at (row0, col0), the slope of the student's softcap
    (its derivative; 1.0 without one), and the column mask. FUSED (tensor descriptors, Ds == Dt): both products in
    one reduction loop, one software pipeline per tile instead of one per head."""
    cols = col0 + tl.arange(0, BLOCK_V)
    col_ok = cols < V
    if FUSED:
        acc_s = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
        acc_t = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
        r0 = row0.to(tl.int32)
        c0 = col0.to(tl.int32)
        for k in range(0, tl.cdiv(Ds, BLOCK_K)):
            a = xs_ptr.load([r0, k * BLOCK_K])
            b = ws_ptr.load([c0, k * BLOCK_K])
            acc_s = mma(a, tl.trans(b), acc_s, DOT_PRECISION, UPCAST)
            a2 = xt_ptr.load([r0, k * BLOCK_K])
            b2 = wt_ptr.load([c0, k * BLOCK_K])
            acc_t = mma(a2, tl.trans(b2), acc_t, DOT_PRECISION, UPCAST)
    else:
        acc_s = logits_tile(xs_ptr, ws_ptr, xs_ptr, row0, col0, N, V, Ds, sxs_n, sxs_d, sws_v, sws_d, False,
                                BLOCK_N, BLOCK_V, BLOCK_K, EVEN_KS, DOT_PRECISION, UPCAST, USE_TMA)
        acc_t = logits_tile(xt_ptr, wt_ptr, xt_ptr, row0, col0, N, V, Dt, sxt_n, sxt_d, swt_v, swt_d, False,
                                BLOCK_N, BLOCK_V, BLOCK_K, EVEN_KT, DOT_PRECISION, UPCAST, USE_TMA)
    zs, _, slope_s = transform(acc_s, bs_ptr, cols, col_ok, softcap, inv_temp, HAS_BS, HAS_SOFTCAP, HAS_TEMP,
                               FINE_SLOPE, HALF_TANH)
    zt, _, _ = transform(acc_t, bt_ptr, cols, col_ok, softcap, inv_temp, HAS_BT, HAS_SOFTCAP, HAS_TEMP, False,
                         HALF_TANH)
    return zs, zt, slope_s, col_ok


@triton.jit
def _log1p(u):
    # log(1 + u) for u in [0, 1] to an ulp or two: log(w) + (u - (w - 1)) / w with w = 1 + u rounded (w - 1 is
    # exact), whose second term puts back w's rounding (up to 6e-8, against values down to 1e-3 where two heads
    # nearly agree); a correction that small needs no exact division.
    w = 1.0 + u
    return tl.log(w) + tl.fdiv(u - (w - 1.0), w, ieee_rounding=False)


@triton.jit
def _expm1_small(u):
    # expm1(u) for |u| < 0.5 to an ulp or two (Taylor to u^9: 3e-10 at 0.5), where exp(u) - 1 keeps exp's rounding
    return u * (1.0 + u * (0.5 + u * (1.0 / 6.0 + u * (1.0 / 24.0 + u * (1.0 / 120.0 + u * (1.0 / 720.0 + u * (
        1.0 / 5040.0 + u * (1.0 / 40320.0 + u * (1.0 / 362880.0)))))))))


@triton.jit
def _mix_terms(u, log_beta, log_1mb, c0):
    # (log p_s - log M, log p_t - log M) for u = log p_t - log p_s (distill._mix_terms), as two-term log-sum-exps
    # -LSE(u + log beta, log(1 - beta)) and -LSE(log beta, log(1 - beta) - u), whose arguments differ by the same
    # |u - c0|, c0 = log((1 - beta) / beta): one exp and one log for both. With u exact to the logits' rounding,
    # each is off by an ulp of max(|log beta|, |log(1 - beta)|), not of log V as log p - log M from log-probabilities
    # is; expm1 / log1p forms (an ulp of the value) measured 1.2-1.3 x slower on the JSD.
    t = _log1p(exp(-tl.abs(u - c0)))
    d_s = -tl.maximum(u + log_beta, log_1mb) - t
    # Near agreement (|u| < 0.1) the sum above keeps an ulp of log(1 - beta) or log(beta) (6e-8 at beta = 0.5)
    # against values ~1e-3: there -log(1 - beta + beta e^u) is the Bernoulli cumulant series, to u^5 (1e-9).
    b = tl.exp(log_beta)
    v = b * (1.0 - b)
    k5 = u * (b + u * (v * 0.5 + u * (v * (1.0 - 2.0 * b) / 6.0 + u * (v * (1.0 - 6.0 * v) / 24.0 + u * (
        v * (1.0 - 2.0 * b) * (1.0 - 12.0 * v) / 120.0)))))
    d_s = tl.where(tl.abs(u) < 0.1, -k5, d_s)
    d_t = tl.where(tl.abs(u) < 0.1, u + d_s, -tl.maximum(log_beta, log_1mb - u) - t)
    return d_s, d_t


@triton.jit
def _two_fwd_kernel(
    # pointers
    xs_ptr, ws_ptr, bs_ptr, xt_ptr, wt_ptr, bt_ptr, stats_ptr, part_ptr,
    # sizes
    N, V, Ds, Dt, n_splits, tiles_per_split,
    # strides
    sxs_n, sxs_d, sws_v, sws_d, sxt_n, sxt_d, swt_v, swt_d,
    # options
    softcap, inv_temp, log_beta, log_1mb, c0,
    # meta-parameters
    MODE: tl.constexpr, WEIGHT_S: tl.constexpr, HAS_ENT: tl.constexpr, HAS_D: tl.constexpr, HAS_REF: tl.constexpr,
    HAS_T: tl.constexpr, HAS_BS: tl.constexpr, HAS_BT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_TEMP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    EVEN_KS: tl.constexpr, EVEN_KT: tl.constexpr, EVEN_V: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr, FUSED: tl.constexpr,
    HALF_TANH: tl.constexpr,
):
    # MODE 0/1 (pass 1): per (split, row) partials [m_s, s_s, m_t, s_t, ent_a, d_a, zr, t_a] of the split's tiles,
    # with a = the student (WEIGHT_S) or the teacher: s = sum e, e = exp(z - m); ent_a = sum e_a (z_a - m_a);
    # zr = z_b at a's argmax, d_a = sum e_a ((z_a - m_a) - (z_b - zr)), t_a = sum e_a expm1((z_b - zr) - (z_a - m_a))
    # (loss_math.t_terms), each only where asked for (HAS_ENT, HAS_D, HAS_T; 0 otherwise). MODE 2 (the JSD's pass
    # 2): partials [kt, ks] from stats_ptr's (6, N) final (m_s, logs_s, m_t, logs_t, logs_s - logs_t, u_ref), ks
    # relative to the student's argmax (distill.RowStats).
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(N, BLOCK_N)
    pid_n, split = grouped(pid, n_blocks, n_splits, GROUP)
    row0 = pid_n.to(tl.int64) * BLOCK_N
    rows = row0 + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    n_vtiles = tl.cdiv(V, BLOCK_V)
    j0 = split * tiles_per_split
    j1 = tl.minimum(j0 + tiles_per_split, n_vtiles)
    col0 = j0.to(tl.int64) * BLOCK_V
    out = part_ptr + split.to(tl.int64) * N + rows
    if MODE == 2:
        rows_in = tl.minimum(rows, N - 1)
        ms = tl.load(stats_ptr + rows_in)
        lss = tl.load(stats_ptr + N + rows_in)
        mt = tl.load(stats_ptr + 2 * N + rows_in)
        lst = tl.load(stats_ptr + 3 * N + rows_in)
        dl = tl.load(stats_ptr + 4 * N + rows_in)  # logs_s - logs_t, formed as log(S_s / S_t)
        # u at the student's argmax: its log p_s - log M is the reference of ks (distill.RowStats), computed by the
        # same function as each class's, so that the argmax's own term is exactly 0
        d_ref, _ = _mix_terms(tl.load(stats_ptr + 5 * N + rows_in), log_beta, log_1mb, c0)
        kt = tl.zeros((BLOCK_N,), tl.float32)
        ks = tl.zeros((BLOCK_N,), tl.float32)
        for _ in range(j0, j1):
            zs, zt, _slope, col_ok = _two_tiles(
                xs_ptr, ws_ptr, bs_ptr, xt_ptr, wt_ptr, bt_ptr, row0, col0, N, V, Ds, Dt,
                sxs_n, sxs_d, sws_v, sws_d, sxt_n, sxt_d, swt_v, swt_d, softcap, inv_temp,
                HAS_BS, HAS_BT, HAS_SOFTCAP, HAS_TEMP, BLOCK_N, BLOCK_V, BLOCK_K, EVEN_KS, EVEN_KT,
                DOT_PRECISION, UPCAST, USE_TMA, FUSED, False, HALF_TANH)
            cs = zs - ms[:, None]
            ct = zt - mt[:, None]
            ls = cs - lss[:, None]
            lt = ct - lst[:, None]
            u = (ct - cs) + dl[:, None]  # log p_t - log p_s (distill._lt_minus_ls)
            d_s, d_t = _mix_terms(u, log_beta, log_1mb, c0)  # log p_s - log M, log p_t - log M
            ps = exp(ls)
            pt = exp(lt)
            ok = col_ok[None, :] & (ps > 0)
            ks += tl.sum(tl.where(ok, ps * (d_s - d_ref[:, None]), 0.0), axis=1)
            ok = col_ok[None, :] & (pt > 0)
            kt += tl.sum(tl.where(ok, pt * d_t, 0.0), axis=1)
            col0 += BLOCK_V
        tl.store(out, kt, mask=row_ok)
        tl.store(out + n_splits * N, ks, mask=row_ok)
        tl.store(out + 2 * n_splits * N, d_ref, mask=row_ok)
    else:
        # m starts finite so that (m_old - m_new) terms stay finite (times a zero sum) on the first tile.
        m_a = tl.full((BLOCK_N,), -1e30, tl.float32)
        m_b = tl.full((BLOCK_N,), -1e30, tl.float32)
        s_a = tl.zeros((BLOCK_N,), tl.float32)
        s_b = tl.zeros((BLOCK_N,), tl.float32)
        ent = tl.zeros((BLOCK_N,), tl.float32)
        d_a = tl.zeros((BLOCK_N,), tl.float32)
        zr = tl.zeros((BLOCK_N,), tl.float32)
        t_a = tl.zeros((BLOCK_N,), tl.float32)
        for _ in range(j0, j1):
            zs, zt, _slope, col_ok = _two_tiles(
                xs_ptr, ws_ptr, bs_ptr, xt_ptr, wt_ptr, bt_ptr, row0, col0, N, V, Ds, Dt,
                sxs_n, sxs_d, sws_v, sws_d, sxt_n, sxt_d, swt_v, swt_d, softcap, inv_temp,
                HAS_BS, HAS_BT, HAS_SOFTCAP, HAS_TEMP, BLOCK_N, BLOCK_V, BLOCK_K, EVEN_KS, EVEN_KT,
                DOT_PRECISION, UPCAST, USE_TMA, FUSED, False, HALF_TANH)
            if WEIGHT_S:
                za = zs
                zb = zt
            else:
                za = zt
                zb = zs
            if not EVEN_V:
                za = tl.where(col_ok[None, :], za, float("-inf"))
                zb = tl.where(col_ok[None, :], zb, float("-inf"))
            top = tl.max(za, axis=1)
            ma_new = tl.maximum(m_a, top)
            alpha = exp(m_a - ma_new)
            da = za - ma_new[:, None]
            e = exp(da)
            live = e > 0  # 0 at masked columns and -inf logits: their products would be NaN
            mb_new = tl.maximum(m_b, tl.max(zb, axis=1))
            eb = exp(zb - mb_new[:, None])
            if HAS_ENT:
                ent = rescale_ent(ent, s_a, alpha, m_a - ma_new) + tl.sum(tl.where(live, e * da, 0.0), axis=1)
            if HAS_REF:
                # The reference zr is b's logit at a's argmax (distill.RowStats): it moves with the maximum, and
                # the old terms of d_a move with both, by (m_a - m_a') - (zr - zr') each.
                zr_new = tl.where(top > m_a, tl.max(tl.where(za == top[:, None], zb, float("-inf")), axis=1), zr)
                if HAS_D:
                    w = alpha * s_a
                    d_a = (alpha * d_a + tl.where(w > 0, w * ((m_a - ma_new) - (zr - zr_new)), 0.0)
                           + tl.sum(tl.where(live, e * (da - (zb - zr_new[:, None])), 0.0), axis=1))
                if HAS_T:
                    # loss_math.move_t and t_terms: the old terms move with both references (delta by cs); a
                    # term is e_a expm1(delta) near 0 and exp(z_b - zr) - e_a (from eb) elsewhere.
                    q = exp(zr - zr_new)
                    cs = (zr - zr_new) - (m_a - ma_new)
                    w = alpha * s_a
                    move = tl.where(tl.abs(cs) < 0.5, w * _expm1_small(cs), s_a * q - w)
                    delta = (zb - zr_new[:, None]) - da
                    term = tl.where(tl.abs(delta) < 0.5, e * _expm1_small(delta),
                                    eb * exp(mb_new - zr_new)[:, None] - e)
                    if not EVEN_V:
                        term = tl.where(col_ok[None, :], term, 0.0)
                    t_a = tl.where(s_a > 0, q * t_a + move, 0.0) + tl.sum(term, axis=1)
                zr = zr_new
            s_a = s_a * alpha + tl.sum(e, axis=1)
            m_a = ma_new
            s_b = s_b * exp(m_b - mb_new) + tl.sum(eb, axis=1)
            m_b = mb_new
            col0 += BLOCK_V
        step = n_splits * N
        if WEIGHT_S:
            tl.store(out, m_a, mask=row_ok)
            tl.store(out + step, s_a, mask=row_ok)
            tl.store(out + 2 * step, m_b, mask=row_ok)
            tl.store(out + 3 * step, s_b, mask=row_ok)
        else:
            tl.store(out, m_b, mask=row_ok)
            tl.store(out + step, s_b, mask=row_ok)
            tl.store(out + 2 * step, m_a, mask=row_ok)
            tl.store(out + 3 * step, s_a, mask=row_ok)
        tl.store(out + 4 * step, ent, mask=row_ok)
        tl.store(out + 5 * step, d_a, mask=row_ok)
        tl.store(out + 6 * step, zr, mask=row_ok)
        tl.store(out + 7 * step, t_a, mask=row_ok)


@triton.jit
def _two_dz_tile(
    pid_n, pid_v,
    xs_ptr, ws_ptr, bs_ptr, xt_ptr, wt_ptr, bt_ptr, stats_ptr, r_ptr, g_ptr, dz_ptr, dbp_ptr,
    N, Ds, Dt, v_begin, v_end,
    sxs_n, sxs_d, sws_v, sws_d, sxt_n, sxt_d, swt_v, swt_d, stride_dz, stride_dbp,
    softcap, inv_temp, log_beta, log_1mb, c0, scale,
    MODE: tl.constexpr, HAS_BS: tl.constexpr, HAS_BT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_TEMP: tl.constexpr, STORE_DZ: tl.constexpr, HAS_DB: tl.constexpr, DZ_TMA: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_KS: tl.constexpr, EVEN_KT: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    USE_TMA: tl.constexpr, FUSED: tl.constexpr, HALF_TANH: tl.constexpr, FINE_SLOPE: tl.constexpr,
):
    """One (token block, tile) pair of _two_dz_kernel."""
    lcol0 = pid_v.to(tl.int64) * BLOCK_V
    row0 = pid_n.to(tl.int64) * BLOCK_N
    rows = row0 + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows_in = tl.minimum(rows, N - 1)
    col0 = lcol0 + v_begin
    # Tiles past the chunk's end are masked here (the logits tile reads up to V, its own bound).
    zs, zt, slope_s, col_ok = _two_tiles(
        xs_ptr, ws_ptr, bs_ptr, xt_ptr, wt_ptr, bt_ptr, row0, col0, N, v_end, Ds, Dt,
        sxs_n, sxs_d, sws_v, sws_d, sxt_n, sxt_d, swt_v, swt_d, softcap, inv_temp,
        HAS_BS, HAS_BT, HAS_SOFTCAP, HAS_TEMP, BLOCK_N, BLOCK_V, BLOCK_K, EVEN_KS, EVEN_KT,
        DOT_PRECISION, UPCAST, USE_TMA, FUSED, FINE_SLOPE, HALF_TANH)
    ms = tl.load(stats_ptr + rows_in)
    lss = tl.load(stats_ptr + N + rows_in)
    mt = tl.load(stats_ptr + 2 * N + rows_in)
    lst = tl.load(stats_ptr + 3 * N + rows_in)
    g = tl.load(g_ptr + rows_in)
    cs = zs - ms[:, None]
    ls = cs - lss[:, None]
    ps = tl.exp2(ls * LOG2E)
    r = tl.load(r_ptr + rows_in)
    if MODE == 0:
        # r is logs_s - logs_t (distill.dz_student): -p_s expm1(log p_t - log p_s) near agreement, where p_s - p_t
        # would cancel to an ulp of p
        u = ((zt - mt[:, None]) - cs) + r[:, None]
        gz = tl.where(tl.abs(u) < 0.5, -ps * _expm1_small(u), ps - tl.exp2(((zt - mt[:, None]) - lst[:, None]) * LOG2E))
    else:
        if MODE == 1:
            # mt is the teacher's logit at the student's argmax and r = E_s[(z_s - m_s) - (z_t - mt)]
            # (distill.row_loss): both terms are 0 at the argmax, so a saturated row leaves no rounding of
            # logit-sized numbers in its gradient.
            inner = cs - (zt - mt[:, None]) - r[:, None]
        else:
            # lst is logs_s - logs_t and r_ptr's second row u at the student's argmax here (distill.row_loss)
            u = ((zt - mt[:, None]) - cs) + lst[:, None]
            d_s, _ = _mix_terms(u, log_beta, log_1mb, c0)
            d_ref, _ = _mix_terms(tl.load(r_ptr + N + rows_in), log_beta, log_1mb, c0)
            inner = (d_s - d_ref[:, None]) - r[:, None]
        gz = tl.where(ps > 0, ps * inner, 0.0) * scale
    gz = gz * g[:, None]
    if HAS_TEMP:
        gz = gz * inv_temp
    if HAS_SOFTCAP:
        gz = gz * slope_s
    ok = row_ok[:, None] & col_ok[None, :]
    if STORE_DZ:
        if DZ_TMA:
            # dz_ptr: a descriptor of the chunk's (N, v_end - v_begin) dz; the copy engine drops what falls past it.
            dz_ptr.store([row0.to(tl.int32), lcol0.to(tl.int32)], cast(gz, dz_ptr.dtype, UPCAST))
        else:
            offs = tl.arange(0, BLOCK_N)[:, None] * stride_dz + tl.arange(0, BLOCK_V)[None, :]
            tl.store(dz_ptr + (row0 * stride_dz + lcol0) + offs, cast(gz, dz_ptr.dtype.element_ty, UPCAST),
                     mask=ok)
    if HAS_DB:
        lcols = lcol0 + tl.arange(0, BLOCK_V)
        tl.store(dbp_ptr + pid_n.to(tl.int64) * stride_dbp + lcols, tl.sum(tl.where(ok, gz, 0.0), axis=0),
                 mask=col_ok)


@triton.jit
def _two_dz_kernel(
    # pointers
    xs_ptr, ws_ptr, bs_ptr, xt_ptr, wt_ptr, bt_ptr, stats_ptr, r_ptr, g_ptr, dz_ptr, dbp_ptr,
    # sizes (n_progs: programs of a persistent launch)
    N, Ds, Dt, v_begin, v_end, n_progs,
    # strides
    sxs_n, sxs_d, sws_v, sws_d, sxt_n, sxt_d, swt_v, swt_d, stride_dz, stride_dbp,
    # options
    softcap, inv_temp, log_beta, log_1mb, c0, scale,
    # meta-parameters
    MODE: tl.constexpr, HAS_BS: tl.constexpr, HAS_BT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_TEMP: tl.constexpr, STORE_DZ: tl.constexpr, HAS_DB: tl.constexpr, DZ_TMA: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    EVEN_KS: tl.constexpr, EVEN_KT: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    USE_TMA: tl.constexpr, FUSED: tl.constexpr, HALF_TANH: tl.constexpr, FINE_SLOPE: tl.constexpr,
    PERSISTENT: tl.constexpr,
):
    # The student's dL/d(raw logit) of one (token block, tile) of the chunk [v_begin, v_end), times g per row:
    # MODE 0: p_s - p_t; MODE 1: p_s (log p_s - log p_t - KL); MODE 2: scale p_s (log p_s - log M - R).
    # PERSISTENT: n_progs programs walk the tiles in the grouped order (as the single head's _dz_kernel).
    n_nb = tl.cdiv(N, BLOCK_N)
    n_vt = tl.cdiv(v_end - v_begin, BLOCK_V)
    if PERSISTENT:
        for tile in tl.range(tl.program_id(0), n_nb * n_vt, n_progs, flatten=True):
            pid_n, pid_v = grouped(tile, n_nb, n_vt, GROUP)
            _two_dz_tile(pid_n, pid_v, xs_ptr, ws_ptr, bs_ptr, xt_ptr, wt_ptr, bt_ptr, stats_ptr, r_ptr, g_ptr, dz_ptr,
                          dbp_ptr, N, Ds, Dt, v_begin, v_end, sxs_n, sxs_d, sws_v, sws_d, sxt_n, sxt_d, swt_v,
                          swt_d, stride_dz, stride_dbp, softcap, inv_temp, log_beta, log_1mb, c0, scale, MODE,
                          HAS_BS, HAS_BT, HAS_SOFTCAP, HAS_TEMP, STORE_DZ, HAS_DB, DZ_TMA, BLOCK_N, BLOCK_V,
                          BLOCK_K, EVEN_KS, EVEN_KT, DOT_PRECISION, UPCAST, USE_TMA, FUSED, HALF_TANH, FINE_SLOPE)
    else:
        pid_n, pid_v = grouped(tl.program_id(0), n_nb, n_vt, GROUP)
        _two_dz_tile(pid_n, pid_v, xs_ptr, ws_ptr, bs_ptr, xt_ptr, wt_ptr, bt_ptr, stats_ptr, r_ptr, g_ptr, dz_ptr,
                     dbp_ptr, N, Ds, Dt, v_begin, v_end, sxs_n, sxs_d, sws_v, sws_d, sxt_n, sxt_d, swt_v,
                     swt_d, stride_dz, stride_dbp, softcap, inv_temp, log_beta, log_1mb, c0, scale, MODE,
                     HAS_BS, HAS_BT, HAS_SOFTCAP, HAS_TEMP, STORE_DZ, HAS_DB, DZ_TMA, BLOCK_N, BLOCK_V,
                     BLOCK_K, EVEN_KS, EVEN_KT, DOT_PRECISION, UPCAST, USE_TMA, FUSED, HALF_TANH, FINE_SLOPE)


def _splits(n_blocks: int, n_vtiles: int, sms: int) -> int:
    """Vocabulary splits per token block for the forward: the fewest that fill every multiprocessor, then more while
    the last wave is under 90% full (each split costs a few float32 partials per row)."""
    best, best_eff = 1, 0.0
    for s in range(max(1, cdiv(sms, n_blocks)), min(n_vtiles, 64) + 1):
        programs = n_blocks * s
        eff = programs / (cdiv(programs, sms) * sms)
        if eff >= 0.9:
            return s
        if eff > best_eff:
            best, best_eff = s, eff
    return min(best, n_vtiles)


def _common(xs, ws, bs, xt, wt, bt, cfg, softcap, inv_temp):
    """Operands (descriptors where both heads allow them), strides and flags shared by the kernels."""
    tma = use_tma(cfg, xs, ws, None) and use_tma(cfg, xt, wt, None)
    xso, wso = operands(xs, ws, tma, cfg.block_n, cfg.block_v, cfg.block_k)
    xto, wto = operands(xt, wt, tma, cfg.block_n, cfg.block_v, cfg.block_k)
    args = (xso, wso, bs, xto, wto, bt)  # an absent bias is None: a constexpr the kernels' flags keep unread
    strides = (xs.stride(0), xs.stride(1), ws.stride(0), ws.stride(1), xt.stride(0), xt.stride(1), wt.stride(0),
               wt.stride(1))
    meta = dict(HAS_BS=bs is not None, HAS_BT=bt is not None, HAS_SOFTCAP=softcap is not None,
                HAS_TEMP=inv_temp != 1.0, BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_K=cfg.block_k,
                GROUP=cfg.group, EVEN_KS=xs.shape[1] % cfg.block_k == 0, EVEN_KT=xt.shape[1] % cfg.block_k == 0,
                **dot_flags(xs), USE_TMA=tma,
                FUSED=bool(current_tuning().two_heads_fused_k and tma and xs.shape[1] == xt.shape[1]),
                HALF_TANH=xs.dtype != torch.float32, num_warps=cfg.fwd_warps, num_stages=cfg.fwd_stages)
    return args, strides, meta


# Columns of dz per float32 product where torch has no matmul with a float32 output (torch < 2.8, see _products).
_UPCAST_COLS = 1024


def _products(dz, xs, wc, dw_rows, dx_acc, accumulate: bool) -> None:
    """linear_head's _products_torch (dW rows = dz^T x, dx_acc = or += dz wc, float32 reductions); where torch
    cannot write a bfloat16/float16 product into a float32 output (torch < 2.8 on CUDA), dx_acc takes float32
    products of column slices of dz instead (slower, as exact)."""
    if not (xs.is_cuda and xs.dtype != torch.float32 and not _MM_OUT_DTYPE) or dx_acc is None:
        _products_torch(dz, xs, wc, dw_rows, dx_acc, accumulate)
        return
    _products_torch(dz, xs, wc, dw_rows, None, accumulate)
    if not accumulate:
        dx_acc.zero_()
    for c0 in range(0, dz.shape[1], _UPCAST_COLS):
        c1 = min(c0 + _UPCAST_COLS, dz.shape[1])
        dx_acc.addmm_(dz[:, c0:c1].float(), wc[c0:c1].float())


def _beta_args(kind, beta):
    # (log beta, log(1 - beta), log((1 - beta) / beta)) of the JSD, from the host's float64.
    if kind != "jsd":
        return 0.0, 0.0, 0.0
    return math.log(beta), math.log1p(-beta), math.log1p(-beta) - math.log(beta)


def forward_stats(xs, ws, bs, xt, wt, bt, *, kind, beta, softcap, inv_temp):
    """(m_s, logs_s, m_t, logs_t, ea, da, kt, ks) per row; see the module docstring."""
    N, Ds = xs.shape
    V = ws.shape[0]
    f32 = dict(device=xs.device, dtype=torch.float32)
    if N == 0:
        e = torch.empty(0, **f32)
        return (e, e, e, e, e, e) + ((e, e) if kind == "jsd" else (None, None)) + (e, e) + (
            (e,) if kind == "jsd" else (None,))
    cfg = _config(xs)
    n_blocks = cdiv(N, cfg.block_n)
    n_vtiles = cdiv(V, cfg.block_v)
    sms = num_sms(xs.device, INTERPRETER_SMS_FORWARD)
    n_splits = _splits(n_blocks, n_vtiles, sms)
    per = cdiv(n_vtiles, n_splits)
    n_splits = cdiv(n_vtiles, per)
    args, strides, meta = _common(xs, ws, bs, xt, wt, bt, cfg, softcap, inv_temp)
    grid = (n_blocks * n_splits,)
    opts = (float(softcap or 1.0), float(inv_temp), *_beta_args(kind, beta))
    want_t = kind != "jsd"  # the log-ratio near agreement (loss_math.log_ratio)
    part = new_buffer((8, n_splits, N), **f32)
    # (The JSD uses only the log-sum-exps of this pass. They come from this kernel, not from the single-head
    # forward, so that its logits are bitwise those the backward recomputes with the same tiles: the JSD's and the
    # reverse KL's gradients subtract the row's divergence from per-class terms, and a logit rounded differently
    # in the two passes (float32 sums of another order: 1e-5 at |z| ~ 300) would survive the cancellation.)
    _two_fwd_kernel[grid](*args, None, part, N, V, Ds, xt.shape[1], n_splits, per, *strides, *opts,
                          MODE=0, WEIGHT_S=kind in ("rkl", "jsd"), HAS_ENT=kind == "ce", HAS_D=kind != "jsd",
                          HAS_REF=True, HAS_T=want_t,
                          EVEN_V=V % cfg.block_v == 0, **meta)
    # Merge the splits: every partial moved to the row's overall maxima.
    m_s, s_s, m_t, s_t, ent, d_a, zr, t_a = part.unbind(0)
    big_s, big_t = m_s.amax(0), m_t.amax(0)
    sc_s, sc_t = torch.exp(m_s - big_s), torch.exp(m_t - big_t)
    S_s, S_t = (s_s * sc_s).sum(0), (s_t * sc_t).sum(0)
    w_s = kind in ("rkl", "jsd")
    m_a, s_a, sc_a, S_a, big_a = (m_s, s_s, sc_s, S_s, big_s) if w_s else (m_t, s_t, sc_t, S_t, big_t)
    w = sc_a * s_a
    ent = (sc_a * ent + torch.where(w > 0, w * (m_a - big_a), 0.0)).sum(0)
    # The row's reference is the split holding its maximum; the others' d_a move to it.
    zr_row = zr.gather(0, m_a.argmax(0, keepdim=True)).squeeze(0)
    d_a = (sc_a * d_a + torch.where(w > 0, w * ((m_a - big_a) - (zr - zr_row)), 0.0)).sum(0)
    logs_s, logs_t = torch.log(S_s), torch.log(S_t)
    if kind != "jsd":
        S_b, big_b = (S_t, big_t) if w_s else (S_s, big_s)
        t_row = None
        if want_t:
            t_row = move_t(t_a, s_a, w, (zr - zr_row) - (m_a - big_a), zr - zr_row).sum(0)
        dl = log_ratio(S_b, S_a, big_b, zr_row, t_row)
        return big_s, logs_s, big_t, logs_t, ent / S_a, d_a / S_a, None, None, zr_row, dl, None
    part2 = new_buffer((3, n_splits, N), **f32)
    dl = torch.log(S_s / S_t)  # logs_s - logs_t without the log-sums' own roundings
    u_ref = (zr_row - big_t) + dl  # log p_t - log p_s at the student's argmax, as the kernels form it per class
    _two_fwd_kernel[grid](*args, torch.stack([big_s, logs_s, big_t, logs_t, dl, u_ref]), part2, N, V, Ds,
                          xt.shape[1],
                          n_splits, per, *strides, *opts, MODE=2, WEIGHT_S=False, HAS_ENT=False, HAS_D=False,
                          HAS_REF=False, HAS_T=False,
                          EVEN_V=V % cfg.block_v == 0, **meta)
    kt, ks = part2[:2].sum(1).unbind(0)
    # RowStats.dl is logs_b - logs_a with a = the student here; row_loss negates it back (exactly). d_ref: the
    # kernel's own log p_s - log M at the student's argmax, which ks is relative to (every split wrote it).
    return big_s, logs_s, big_t, logs_t, None, None, kt, ks, zr_row, -dl, part2[2, 0]


def backward(xs, ws, bs, xt, wt, bt, m_s, logs_s, m_t, logs_t, R, g, *, kind, beta, softcap, inv_temp, need_dx,
             need_dw, need_db, workspace_bytes=None):
    """Gradients (dx_s, dW_s, db_s) of the student head; see the module docstring."""
    N, D = xs.shape
    V = ws.shape[0]
    need_db = bool(need_db and bs is not None)
    dx, dw, db, empty = gradient_buffers(xs, ws, need_dx, need_dw, need_db)
    if empty:
        return dx, dw, None if db is None else db.to(bs.dtype)
    cfg = _dz_config(xs)
    ws_plan = plans._workspace(N, V, D, xs.element_size(), workspace_bytes,
                               plans.acc_forced(xs, need_dx, need_dw, N, V, D))
    plan = plans._plan(xs, dx, dw, N, V, D, cfg, False, ws_plan)
    args, strides, meta = _common(xs, ws, bs, xt, wt, bt, cfg, softcap, inv_temp)
    stats = torch.stack([m_s, logs_s, m_t, logs_t])
    beta_args = _beta_args(kind, beta)
    mode = _MODES[kind]
    scale = 1.0 - beta if kind == "jsd" else 1.0
    n_blocks = cdiv(N, cfg.block_n)
    f32 = dict(device=xs.device, dtype=torch.float32)
    scratch = []

    def scratch_view(cols):
        ld = plans.scratch_ld(N, cols, xs.element_size(), ws_plan.scratch)
        if not scratch or scratch[0].numel() < N * ld:  # as large as the chunk needs (the budget is a bound)
            scratch[:] = []  # freed first: the peak holds one buffer
            scratch[:] = [new_buffer(N * ld, device=xs.device, dtype=xs.dtype)]
        return plans.dz_rows(scratch[0], N, cols, ld)

    def dz_in_dw(start, cols):
        return plans.dz_rows(dw.view(-1)[start:], N, cols)

    def dz_pass(v0, v1, dz, with_db):
        store = dz is not None
        dz_tma = store and current_tuning().two_heads_dz_store_tma and meta["USE_TMA"] and tma_ok(dz)
        dz_arg = dz
        if dz_tma:
            dz_arg = descriptor(dz, [cfg.block_n, cfg.block_v])
        dbp = new_buffer((n_blocks, v1 - v0), **f32) if with_db else None
        n_tiles = n_blocks * cdiv(v1 - v0, cfg.block_v)
        persistent = dz_tma and current_tuning().two_heads_dz_persistent
        n_progs = min(n_tiles, num_sms(xs.device, INTERPRETER_SMS_BACKWARD)) if persistent else n_tiles
        _two_dz_kernel[(n_progs,)](
            *args, stats, R, g, dz_arg, dbp,
            N, D, xt.shape[1], v0, v1, n_progs, *strides, dz.stride(0) if store else 0,
            dbp.stride(0) if with_db else 0, float(softcap or 1.0), float(inv_temp), *beta_args, scale,
            MODE=mode, STORE_DZ=store, HAS_DB=with_db, DZ_TMA=dz_tma, FINE_SLOPE=xs.dtype == torch.float32,
            PERSISTENT=persistent, **meta)
        if with_db:
            torch.sum(dbp, dim=0, out=db[v0:v1])

    need_dz = need_dx or need_dw
    # cuBLAS's float32-reduction settings saved and restored once, not around each chunk's products (none without
    # a product: a bias gradient alone)
    with _Fp32Reductions() if need_dz else contextlib.nullcontext():
        first = True
        for v0, v1, dz_at, _ in plans._first_pass(N, V, D, cfg, plan, False, need_dz, None):
            dz = None
            if dz_at is not None:
                dz = dz_in_dw(dz_at, v1 - v0)
            elif need_dz:
                dz = plan.dz_main[:, : v1 - v0] if plan.dz_main is not None else scratch_view(v1 - v0)
            dz_pass(v0, v1, dz, need_db)
            if need_dz:
                dw_rows = dw[v0:v1] if need_dw and v1 <= plan.dw_end else None
                _products(dz, xs, ws[v0:v1], dw_rows, plan.dx_acc, not first)
                first = False
        if need_dx and plan.cast_dx:
            dx.copy_(plan.dx_acc)
        if need_dw and plan.dw_end < V:
            # The dW rows that held the dx accumulator: recomputed now that dx is final.
            for v0, v1, in_dw in plans._second_pass(N, V, D, xs.element_size(), cfg, plan.dw_end, False,
                                                    ws_plan.scratch):
                if in_dw:
                    dz = dz_in_dw(v1 * D, v1 - v0)
                else:
                    dz = scratch_view(v1 - v0)
                dz_pass(v0, v1, dz, False)
                _products(dz, xs, ws[v0:v1], dw[v0:v1], None, False)
    return dx, dw, None if db is None else db.to(bs.dtype)


