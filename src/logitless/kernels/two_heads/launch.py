"""The two-head launchers, forward_stats and backward (the package docstring has their contract): grids, the
forward's vocabulary splits and their merge, and the backward's walk over the vocabulary on linear_head's
workspace plans and products."""

from __future__ import annotations

import contextlib
import math

import torch

from ...loss_math import log_ratio, move_t
from .._common import INTERPRETER_SMS_BACKWARD, INTERPRETER_SMS_FORWARD, cdiv, gradient_buffers, new_buffer, num_sms
from .._launch import launch
from .._tuning import current_tuning
from ..linear_head import (
    MM_OUT_DTYPE,
    Fp32Reductions,
    acc_forced,
    backward_plan,
    dz_rows,
    first_pass_chunks,
    hot_products,
    products_torch,
    scratch_ld,
    second_pass_chunks,
    workspace_plan,
)
from ..linear_head.configs import descriptor, dot_flags, operands, tma_ok, use_tma
from ..linear_head.records import BackwardRecord, DzLaunch, ProductsCall, storage_address
from .configs import config, dz_config
from .kernels import _two_dz_kernel, _two_fwd_kernel
from .plans import product_config

_MODES = {"fkl": 0, "ce": 0, "rkl": 1, "jsd": 2}


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
    """linear_head's products_torch (dW rows = dz^T x, dx_acc = or += dz wc, float32 reductions); where torch
    cannot write a bfloat16/float16 product into a float32 output (torch < 2.8 on CUDA), dx_acc takes float32
    products of column slices of dz instead (slower, as exact)."""
    if not (xs.is_cuda and xs.dtype != torch.float32 and not MM_OUT_DTYPE) or dx_acc is None:
        products_torch(dz, xs, wc, dw_rows, dx_acc, accumulate)
        return
    products_torch(dz, xs, wc, dw_rows, None, accumulate)
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


def forward_stats(xs, ws, bs, xt, wt, bt, *, kind, beta, softcap, inv_temp, tiles=None):
    """(m_s, logs_s, m_t, logs_t, ea, da, kt, ks) per row; see the module docstring. tiles: None, or a (3, N,
    plans.tile_count) float32 buffer that receives the tile records of the backward's skipping (_two_fwd_kernel)."""
    N, Ds = xs.shape
    V = ws.shape[0]
    f32 = dict(device=xs.device, dtype=torch.float32)
    if N == 0:
        e = torch.empty(0, **f32)
        return (e, e, e, e, e, e) + ((e, e) if kind == "jsd" else (None, None)) + (e, e) + (
            (e,) if kind == "jsd" else (None,))
    cfg = config(xs)
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
    if tiles is not None:
        assert tiles.shape == (3, N, n_vtiles) and tiles.dtype == torch.float32 and tiles.is_contiguous()
    launch(_two_fwd_kernel, grid, *args, None, part, tiles, N, V, Ds, xt.shape[1], n_splits, per, *strides, *opts,
           MODE=0, WEIGHT_S=kind in ("rkl", "jsd"), HAS_ENT=kind == "ce", HAS_D=kind != "jsd", HAS_REF=True,
           HAS_T=want_t, RECORD_TILES=tiles is not None, EVEN_V=V % cfg.block_v == 0, **meta)
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
    launch(_two_fwd_kernel, grid, *args, torch.stack([big_s, logs_s, big_t, logs_t, dl, u_ref]), part2, None, N, V,
           Ds, xt.shape[1], n_splits, per, *strides, *opts, MODE=2, WEIGHT_S=False, HAS_ENT=False, HAS_D=False,
           HAS_REF=False, HAS_T=False, RECORD_TILES=False, EVEN_V=V % cfg.block_v == 0, **meta)
    kt, ks = part2[:2].sum(1).unbind(0)
    # RowStats.dl is logs_b - logs_a with a = the student here; row_loss negates it back (exactly). d_ref: the
    # kernel's own log p_s - log M at the student's argmax, which ks is relative to (every split wrote it).
    return big_s, logs_s, big_t, logs_t, None, None, kt, ks, zr_row, -dl, part2[2, 0]


def backward(xs, ws, bs, xt, wt, bt, m_s, logs_s, m_t, logs_t, R, g, *, kind, beta, softcap, inv_temp, need_dx,
             need_dw, need_db, workspace_bytes=None, sp=None):
    """Gradients (dx_s, dW_s, db_s) of the student head; see the module docstring. sp: None, or the SkipPlan of
    plans.skip_plan (skip_supported(xs)): its cold pairs are neither recomputed nor multiplied, and the rows run
    in its order (sp.rows)."""
    N, D = xs.shape
    V = ws.shape[0]
    need_db = bool(need_db and bs is not None)
    dx, dw, db, empty = gradient_buffers(xs, ws, need_dx, need_dw, need_db)
    if empty:
        return dx, dw, None if db is None else db.to(bs.dtype)
    cfg = dz_config(xs)
    skip = sp is not None
    rows = sp.rows if skip else None
    if skip:
        cfg = product_config(cfg)
    if rows is not None:
        # The plan's token blocks are blocks of its row order: copies of both inputs and the row vectors in that
        # order (O(N D)), dx back in the input's order at the end.
        xs, xt, m_s, logs_s, m_t, logs_t, g = (t.index_select(0, rows) for t in (xs, xt, m_s, logs_s, m_t, logs_t, g))
        R = R.index_select(R.dim() - 1, rows)
    ws_plan = workspace_plan(N, V, D, xs.element_size(), workspace_bytes, acc_forced(xs, need_dx, need_dw, N, V, D))
    plan = backward_plan(xs, dx, dw, N, V, D, cfg, skip, ws_plan)
    rec = None
    records = current_tuning().debug_backwards
    if records is not None:
        rec = BackwardRecord("two_heads", ws_plan, skip, None, plan.chunk, plan.dw_end, plan.dz_main is not None,
                             storage_address(plan.dx_acc))
        records.append(rec)
    args, strides, meta = _common(xs, ws, bs, xt, wt, bt, cfg, softcap, inv_temp)
    stats = torch.stack([m_s, logs_s, m_t, logs_t])
    beta_args = _beta_args(kind, beta)
    mode = _MODES[kind]
    scale = 1.0 - beta if kind == "jsd" else 1.0
    n_blocks = cdiv(N, cfg.block_n)
    f32 = dict(device=xs.device, dtype=torch.float32)
    scratch = []

    def scratch_view(cols):
        ld = scratch_ld(N, cols, xs.element_size(), ws_plan.scratch)
        if not scratch or scratch[0].numel() < N * ld:  # as large as the chunk needs (the budget is a bound)
            scratch[:] = []  # freed first: the peak holds one buffer
            scratch[:] = [new_buffer(N * ld, device=xs.device, dtype=xs.dtype)]
        return dz_rows(scratch[0], N, cols, ld)

    def dz_in_dw(start, cols):
        return dz_rows(dw.view(-1)[start:], N, cols)

    def dz_pass(v0, v1, dz, with_db):
        store = dz is not None
        dz_tma = store and current_tuning().two_heads_dz_store_tma and meta["USE_TMA"] and tma_ok(dz)
        dz_arg = dz
        if dz_tma:
            dz_arg = descriptor(dz, [cfg.block_n, cfg.block_v])
        dbp = new_buffer((n_blocks, v1 - v0), **f32) if with_db else None
        n_tiles = n_blocks * cdiv(v1 - v0, cfg.block_v)
        persistent = dz_tma and current_tuning().two_heads_dz_persistent and not skip
        n_progs = min(n_tiles, num_sms(xs.device, INTERPRETER_SMS_BACKWARD)) if persistent else n_tiles
        if rec is not None:
            rec.dz.append(DzLaunch(v0, v1, n_progs, cfg.block_v, False, bool(persistent), bool(dz_tma), skip))
        launch(_two_dz_kernel, (n_progs,),
            *args, stats, R, g, dz_arg, dbp, sp.hot if skip else None,
            N, D, xt.shape[1], v0, v1, n_progs, sp.hot.shape[1] if skip else 0, *strides, dz.stride(0) if store else 0,
            dbp.stride(0) if with_db else 0, float(softcap or 1.0), float(inv_temp), *beta_args, scale,
            MODE=mode, STORE_DZ=store, HAS_DB=with_db, DZ_TMA=dz_tma, FINE_SLOPE=xs.dtype == torch.float32,
            PERSISTENT=persistent, SKIP=skip, **meta)
        if with_db:
            torch.sum(dbp, dim=0, out=db[v0:v1])

    def products(v0, v1, dz, dw_rows, dx_acc, accumulate):
        if rec is not None:
            rec.products.append(ProductsCall(v0, v1, dw_rows is not None, dx_acc is not None, not skip,
                                             Fp32Reductions.active(), v1 - v0, dz.stride(), N, 1, None))
        if skip:
            hot_products(dz, xs, ws[v0:v1], dw_rows, dx_acc, accumulate, sp, cfg, v0, v1)
        else:
            _products(dz, xs, ws[v0:v1], dw_rows, dx_acc, accumulate)

    need_dz = need_dx or need_dw
    # cuBLAS's float32-reduction settings saved and restored once, not around each chunk's products (none without
    # a product: a bias gradient alone)
    with Fp32Reductions() if need_dz else contextlib.nullcontext():
        first = True
        chunks = first_pass_chunks(N, V, D, cfg, plan, skip, need_dz, None)
        if rec is not None:
            rec.first_pass = list(chunks)
        for v0, v1, dz_at, _ in chunks:
            dz = None
            if dz_at is not None:
                dz = dz_in_dw(dz_at, v1 - v0)
            elif need_dz:
                dz = plan.dz_main[:, : v1 - v0] if plan.dz_main is not None else scratch_view(v1 - v0)
            dz_pass(v0, v1, dz, need_db)
            if need_dz:
                dw_rows = dw[v0:v1] if need_dw and v1 <= plan.dw_end else None
                products(v0, v1, dz, dw_rows, plan.dx_acc, not first)
                first = False
        if need_dx and plan.cast_dx:
            dx.copy_(plan.dx_acc)
        if need_dw and plan.dw_end < V:
            # The dW rows that held the dx accumulator: recomputed now that dx is final.
            chunks = second_pass_chunks(N, V, D, xs.element_size(), cfg, plan.dw_end, skip, ws_plan.scratch)
            if rec is not None:
                rec.second_pass = list(chunks)
            for v0, v1, in_dw in chunks:
                if in_dw:
                    dz = dz_in_dw(v1 * D, v1 - v0)
                else:
                    dz = scratch_view(v1 - v0)
                dz_pass(v0, v1, dz, False)
                products(v0, v1, dz, dw[v0:v1], None, False)
    if rows is not None and dx is not None:
        dx = torch.empty_like(dx).index_copy_(0, rows, dx)
    return dx, dw, None if db is None else db.to(bs.dtype)


