"""The two-head losses on this backend (logitless.distill): both heads' row statistics in blocks and the student's
backward, never N x V.

two_head_stats() computes loss_math.RowStats of the student head (xs, ws, bs) and the teacher head (xt, wt, bt)
over token chunks x vocabulary chunks: pass 1 folds both heads' blocks into online log-sum-exps and the weighting
head's sums; the JSD makes a second pass. backward() recomputes both heads' blocks vocabulary-outer and turns them
into the student's dL/dz (loss_math.dz_student). loss() is the differentiable per-row loss; gradients reach the
student only.
"""

from __future__ import annotations

import math

import torch

from .._autograd import first_order_only
from ..loss_math import (
    RowStats,
    dz_student,
    log_ratio,
    lt_minus_ls,
    mix_terms,
    move_t,
    row_loss,
    t_terms,
    weights_student,
)
from . import blocks
from .blocks import chunks, token_chunk


def _chunk_logits(x, w, b, i0, i1, v0, v1, softcap, inv_temp):
    return blocks.linear_chunk(x[i0:i1], w[v0:v1], None if b is None else b[v0:v1], softcap, inv_temp)


def two_head_stats(xs, ws, bs, xt, wt, bt, kind: str, beta: float, softcap, inv_temp) -> RowStats:
    """RowStats in token chunks x vocabulary chunks (never N x V): pass 1 online, pass 2 for the JSD."""
    n, V = xs.shape[0], ws.shape[0]
    acc = blocks.acc_dtype(xs.dtype)
    f = dict(device=xs.device, dtype=acc)
    out = {k: torch.empty(n, **f) for k in ("m_s", "logs_s", "m_t", "logs_t", "ea", "da", "kt", "ks", "zr", "dl")}
    w_student = weights_student(kind)
    want_t = kind != "jsd"  # dl near agreement (loss_math.log_ratio)
    cn = token_chunk(V)
    for i0, i1 in chunks(n, cn):
        c = i1 - i0
        m_s = torch.full((c,), -math.inf, **f)
        m_t = torch.full((c,), -math.inf, **f)
        s_s, s_t, ent, dsum, ref, tsum = (torch.zeros(c, **f) for _ in range(6))
        for v0, v1 in chunks(V, blocks.VOCAB_CHUNK):
            zs = _chunk_logits(xs, ws, bs, i0, i1, v0, v1, softcap, inv_temp)
            zt = _chunk_logits(xt, wt, bt, i0, i1, v0, v1, softcap, inv_temp)
            za, zb = (zs, zt) if w_student else (zt, zs)
            m_a, s_a = (m_s, s_s) if w_student else (m_t, s_t)
            top, arg = za.max(1)
            new_a = torch.maximum(m_a, top)
            # The reference follows a's argmax (the first chunk's, then any chunk whose maximum is larger).
            new_ref = torch.where(top > m_a, zb.gather(1, arg[:, None]).squeeze(1), ref)
            safe_a = torch.where(torch.isfinite(new_a), new_a, 0.0)
            alpha = torch.exp(m_a - safe_a)
            e = torch.exp(za - safe_a[:, None])
            shift = (m_a - safe_a).nan_to_num(0.0, posinf=0.0, neginf=0.0)
            ent = alpha * (ent + shift * s_a) + torch.where(e > 0, e * (za - safe_a[:, None]), 0.0).sum(1)
            # dsum's terms move with both references: + (m_a - m_a') - (ref - ref') each, for the old mass.
            w = alpha * s_a
            dsum = (alpha * dsum + torch.where(w > 0, w * (shift - (ref - new_ref)), 0.0)
                    + torch.where(e > 0, e * ((za - safe_a[:, None]) - (zb - new_ref[:, None])), 0.0).sum(1))
            if want_t:
                tsum = move_t(tsum, s_a, w, (ref - new_ref) - shift, ref - new_ref) + t_terms(
                    e, (zb - new_ref[:, None]) - (za - safe_a[:, None]), torch.exp(zb - new_ref[:, None]))
            ref = new_ref
            s_a = s_a * alpha + e.sum(1)
            # the other head: its max and sum only
            m_b, s_b = (m_t, s_t) if w_student else (m_s, s_s)
            new_b = torch.maximum(m_b, zb.amax(1))
            safe_b = torch.where(torch.isfinite(new_b), new_b, 0.0)
            s_b = s_b * torch.exp(m_b - safe_b) + torch.exp(zb - safe_b[:, None]).sum(1)
            if w_student:
                m_s, s_s, m_t, s_t = new_a, s_a, new_b, s_b
            else:
                m_t, s_t, m_s, s_s = new_a, s_a, new_b, s_b
        sl = slice(i0, i1)
        s_a = s_s if w_student else s_t
        out["m_s"][sl], out["logs_s"][sl] = m_s, torch.log(s_s)
        out["m_t"][sl], out["logs_t"][sl] = m_t, torch.log(s_t)
        out["ea"][sl], out["da"][sl], out["zr"][sl] = ent / s_a, dsum / s_a, ref
        s_b, m_b = (s_t, m_t) if w_student else (s_s, m_s)
        out["dl"][sl] = log_ratio(s_b, s_a, m_b, ref, tsum if want_t else None)
    if kind != "jsd":
        return RowStats(out["m_s"], out["logs_s"], out["m_t"], out["logs_t"], out["ea"], out["da"], zr=out["zr"],
                        dl=out["dl"])
    d_ref = mix_terms((out["zr"] - out["m_t"]) - out["dl"], beta)[0]  # at the student's argmax (RowStats)
    for i0, i1 in chunks(n, cn):
        sl = slice(i0, i1)
        kt = torch.zeros(i1 - i0, **f)
        ks = torch.zeros(i1 - i0, **f)
        for v0, v1 in chunks(V, blocks.VOCAB_CHUNK):
            zs = _chunk_logits(xs, ws, bs, i0, i1, v0, v1, softcap, inv_temp)
            zt = _chunk_logits(xt, wt, bt, i0, i1, v0, v1, softcap, inv_temp)
            ls = (zs - out["m_s"][sl, None]) - out["logs_s"][sl, None]
            lt = (zt - out["m_t"][sl, None]) - out["logs_t"][sl, None]
            u = lt_minus_ls(zs, zt, out["m_s"][sl], out["m_t"][sl], -out["dl"][sl])
            d_s, d_t = mix_terms(u, beta)  # l_s - log M, l_t - log M
            pt, ps = torch.exp(lt), torch.exp(ls)
            kt += torch.where(pt > 0, pt * d_t, 0.0).sum(1)
            ks += torch.where(ps > 0, ps * (d_s - d_ref[sl, None]), 0.0).sum(1)
        out["kt"][sl], out["ks"][sl] = kt, ks
    return RowStats(out["m_s"], out["logs_s"], out["m_t"], out["logs_t"], None, None, out["kt"], out["ks"],
                    zr=out["zr"], dl=out["dl"], dref=d_ref)


def backward(xs, ws, bs, xt, wt, bt, kind, beta, softcap, inv_temp, st: RowStats, R, g, needs):
    """(dx_s, dW_s, db_s) for the upstream per-row gradient g: vocabulary-outer, each dW_s block accumulated in
    float32 and written once, dx_s accumulated in float32; both heads' blocks recomputed."""
    need_x, need_w, need_b = needs
    n, D = xs.shape
    V = ws.shape[0]
    acc = blocks.acc_dtype(xs.dtype)
    dx = torch.zeros(n, D, device=xs.device, dtype=acc) if need_x else None
    dw = torch.empty_like(ws) if need_w else None
    db = torch.empty_like(bs) if need_b else None
    cn = token_chunk(V)
    for v0, v1 in chunks(V, blocks.VOCAB_CHUNK):
        w_c = ws[v0:v1].to(acc)
        dw_c = torch.zeros(v1 - v0, D, device=xs.device, dtype=acc) if need_w else None
        db_c = torch.zeros(v1 - v0, device=xs.device, dtype=acc) if need_b else None
        for i0, i1 in chunks(n, cn):
            sl = slice(i0, i1)
            raw = _chunk_logits(xs, ws, bs, i0, i1, v0, v1, None, 1.0)  # the chain rule needs the raw logits
            zs = blocks.transform(raw, softcap, inv_temp)
            zt = _chunk_logits(xt, wt, bt, i0, i1, v0, v1, softcap, inv_temp)
            dz = dz_student(kind, beta, zs, zt, st.m_s[sl], st.logs_s[sl], st.m_t[sl], st.logs_t[sl],
                            None if R is None else R[..., sl], g[sl])
            dz = blocks.chain_transform(dz, raw, softcap, inv_temp)
            if need_x:
                dx[sl] += dz @ w_c
            if need_w:
                dw_c += dz.T @ xs[sl].to(acc)
            if need_b:
                db_c += dz.sum(0)
        if need_w:
            dw[v0:v1] = dw_c
        if need_b:
            db[v0:v1] = db_c
    return (dx.to(xs.dtype) if need_x else None), dw, db


class _TwoHeadsTorch(torch.autograd.Function):
    """Per-row loss of the student head against the teacher head; gradients to xs, ws, bs (the teacher's tensors
    are constants)."""

    @staticmethod
    def forward(ctx, xs, ws, bs, xt, wt, bt, kind, beta, softcap, inv_temp):
        st = two_head_stats(xs, ws, bs, xt, wt, bt, kind, beta, softcap, inv_temp)
        loss, R, t_ref, t_aux = row_loss(kind, beta, st)
        ctx.save_for_backward(xs, ws, bs, xt, wt, bt, st.m_s, st.logs_s, t_ref, t_aux, R)
        ctx.opts = (kind, beta, softcap, inv_temp)
        return loss

    @staticmethod
    @first_order_only
    def backward(ctx, g):
        xs, ws, bs, xt, wt, bt, m_s, logs_s, m_t, logs_t, R = ctx.saved_tensors
        kind, beta, softcap, inv_temp = ctx.opts
        st = RowStats(m_s, logs_s, m_t, logs_t, None, None)
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bs is not None and ctx.needs_input_grad[2])
        dx, dw, db = backward(xs, ws, bs, xt, wt, bt, kind, beta, softcap, inv_temp, st, R, g.to(m_s.dtype), needs)
        return dx, dw, db, None, None, None, None, None, None, None


def loss(xs, ws, bs, xt, wt, bt, kind, beta, softcap, inv_temp) -> torch.Tensor:
    """The per-row loss (loss_math.row_loss) on validated (N, Ds) / (V, Ds) student and (N, Dt) / (V, Dt) teacher
    heads, differentiable with respect to xs, ws and bs."""
    return _TwoHeadsTorch.apply(xs, ws, bs, xt, wt, bt, kind, beta, softcap, inv_temp)


def grads_on_own_stats(xs, ws, bs, xt, wt, bt, kind, beta, softcap, inv_temp, g, needs):
    """(dx_s, dW_s, db_s) for the upstream per-row gradient g, from this backend's own statistics of the same
    logits (a recomputed logit then meets its own row maximum exactly)."""
    st = two_head_stats(xs, ws, bs, xt, wt, bt, kind, beta, softcap, inv_temp)
    _, R, t_ref, t_aux = row_loss(kind, beta, st)
    st = RowStats(st.m_s, st.logs_s, t_ref, t_aux, None, None)
    return backward(xs, ws, bs, xt, wt, bt, kind, beta, softcap, inv_temp, st, R, g, needs)
