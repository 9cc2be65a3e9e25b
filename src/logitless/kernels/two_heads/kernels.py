"""The two-head @triton.jit kernels: both heads' logit tiles (_two_tiles), the forward's passes (_two_fwd_kernel)
and the student's dL/dz of a vocabulary chunk (_two_dz_kernel). Launched by launch.py."""

import triton
import triton.language as tl

from .._device import LOG2E, cast, exp, mma
from ..linear_head.tiles import cold_pair, grouped, logits_tile, rescale_ent, transform


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
    # (log p_s - log M, log p_t - log M) for u = log p_t - log p_s (loss_math.mix_terms), as two-term log-sum-exps
    # -LSE(u + log beta, log(1 - beta)) and -LSE(log beta, log(1 - beta) - u), whose arguments differ by the same
    # |u - c0|, c0 = log((1 - beta) / beta): one exp and one log for both. With u exact to the logits' rounding,
    # each is off by an ulp of max(|log beta|, |log(1 - beta)|), not of log V as log p - log M from log-probabilities
    # is; expm1 / log1p forms (an ulp of the value) were slower on the JSD (docs/math.md).
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
    xs_ptr, ws_ptr, bs_ptr, xt_ptr, wt_ptr, bt_ptr, stats_ptr, part_ptr, tiles_ptr,
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
    HALF_TANH: tl.constexpr, RECORD_TILES: tl.constexpr,
):
    # MODE 0/1 (pass 1): per (split, row) partials [m_s, s_s, m_t, s_t, ent_a, d_a, zr, t_a] of the split's tiles,
    # with a = the student (WEIGHT_S) or the teacher: s = sum e, e = exp(z - m); ent_a = sum e_a (z_a - m_a);
    # zr = z_b at a's argmax, d_a = sum e_a ((z_a - m_a) - (z_b - zr)), t_a = sum e_a expm1((z_b - zr) - (z_a - m_a))
    # (loss_math.t_terms), each only where asked for (HAS_ENT, HAS_D, HAS_T; 0 otherwise). MODE 2 (the JSD's pass
    # 2): partials [kt, ks] from stats_ptr's (6, N) final (m_s, logs_s, m_t, logs_t, logs_s - logs_t, u_ref), ks
    # relative to the student's argmax (loss_math.RowStats). RECORD_TILES (pass 1): tiles_ptr's (3, N, tiles)
    # float32 receive per (row, tile) the student's and the teacher's log sum_j exp(z_j) over the tile and the
    # teacher's smallest logit in it, which bound what the backward may skip (two_heads.plans.pair_costs).
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
        # u at the student's argmax: its log p_s - log M is the reference of ks (loss_math.RowStats), computed by the
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
            u = (ct - cs) + dl[:, None]  # log p_t - log p_s (loss_math.lt_minus_ls)
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
            if RECORD_TILES:
                tile = rows * n_vtiles + col0 // BLOCK_V
                lse_a = ma_new + tl.log(tl.sum(e, axis=1))
                lse_b = mb_new + tl.log(tl.sum(eb, axis=1))
                tl.store(tiles_ptr + tile, lse_a if WEIGHT_S else lse_b, mask=row_ok)
                tl.store(tiles_ptr + N * n_vtiles + tile, lse_b if WEIGHT_S else lse_a, mask=row_ok)
                low_t = tl.min(tl.where(col_ok[None, :], zt, float("inf")), axis=1)
                tl.store(tiles_ptr + 2 * N * n_vtiles + tile, low_t, mask=row_ok)
            if HAS_ENT:
                ent = rescale_ent(ent, s_a, alpha, m_a - ma_new) + tl.sum(tl.where(live, e * da, 0.0), axis=1)
            if HAS_REF:
                # The reference zr is b's logit at a's argmax (loss_math.RowStats): it moves with the maximum, and
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
        # r is logs_s - logs_t (loss_math.dz_student): -p_s expm1(log p_t - log p_s) near agreement, where p_s - p_t
        # would cancel to an ulp of p
        u = ((zt - mt[:, None]) - cs) + r[:, None]
        gz = tl.where(tl.abs(u) < 0.5, -ps * _expm1_small(u), ps - tl.exp2(((zt - mt[:, None]) - lst[:, None]) * LOG2E))
    else:
        if MODE == 1:
            # mt is the teacher's logit at the student's argmax and r = E_s[(z_s - m_s) - (z_t - mt)]
            # (loss_math.row_loss): both terms are 0 at the argmax, so a saturated row leaves no rounding of
            # logit-sized numbers in its gradient.
            inner = cs - (zt - mt[:, None]) - r[:, None]
        else:
            # lst is logs_s - logs_t and r_ptr's second row u at the student's argmax here (loss_math.row_loss)
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
    xs_ptr, ws_ptr, bs_ptr, xt_ptr, wt_ptr, bt_ptr, stats_ptr, r_ptr, g_ptr, dz_ptr, dbp_ptr, hot_ptr,
    # sizes (n_progs: programs of a persistent launch; n_vtiles: tiles of hot_ptr's map)
    N, Ds, Dt, v_begin, v_end, n_progs, n_vtiles,
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
    PERSISTENT: tl.constexpr, SKIP: tl.constexpr,
):
    # The student's dL/d(raw logit) of one (token block, tile) of the chunk [v_begin, v_end), times g per row:
    # MODE 0: p_s - p_t; MODE 1: p_s (log p_s - log p_t - KL); MODE 2: scale p_s (log p_s - log M - R).
    # PERSISTENT: n_progs programs walk the tiles in the grouped order (as the single head's _dz_kernel). SKIP:
    # hot_ptr is the skip plan's (token blocks, tiles) map, 0 at the pairs left out.
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
        if SKIP:  # the skip plan's cold pairs (never persistent)
            if cold_pair(hot_ptr, dbp_ptr, pid_n, pid_v, n_vtiles, v_begin, v_end, stride_dbp, HAS_DB, BLOCK_V):
                return
        _two_dz_tile(pid_n, pid_v, xs_ptr, ws_ptr, bs_ptr, xt_ptr, wt_ptr, bt_ptr, stats_ptr, r_ptr, g_ptr, dz_ptr,
                     dbp_ptr, N, Ds, Dt, v_begin, v_end, sxs_n, sxs_d, sws_v, sws_d, sxt_n, sxt_d, swt_v,
                     swt_d, stride_dz, stride_dbp, softcap, inv_temp, log_beta, log_1mb, c0, scale, MODE,
                     HAS_BS, HAS_BT, HAS_SOFTCAP, HAS_TEMP, STORE_DZ, HAS_DB, DZ_TMA, BLOCK_N, BLOCK_V,
                     BLOCK_K, EVEN_KS, EVEN_KT, DOT_PRECISION, UPCAST, USE_TMA, FUSED, HALF_TANH, FINE_SLOPE)
