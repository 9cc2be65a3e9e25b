"""The head op's statistics and its generic backward on this backend (loss_math's contract), in blocks.

head_forward runs an online log-sum-exp over (token chunk x vocabulary chunk) blocks (_RowStats, row_stats), and
head_backward recomputes each block's logits and turns them into dL/dz in place for the per-row coefficients of
loss_math.head_coefficients. stats() is the differentiable op that logitless.head calls.
"""

from __future__ import annotations

import math

import torch

from .._autograd import first_order_only
from ..loss_math import Stats, head_coefficients
from .blocks import (
    acc_dtype,
    apply_softcap,
    budget_block,
    chunks,
    fixed_block,
    linear_chunk,
    pad_rows,
    row_log,
    softcap_slope,
    stats_block,
)


class _RowStats:
    """Online per-row statistics over vocabulary chunks: max, sum of exp, target logit, smoothing and entropy sums."""

    def __init__(self, n, device, dtype, target, want_smooth, want_entropy):
        f32 = dict(device=device, dtype=dtype)
        self.m = torch.full((n,), -math.inf, **f32)
        self.s = torch.zeros(n, **f32)
        self.target = target  # a target outside [0, V) (ignored, or in another shard) has no target logit
        self.zt = torch.zeros(n, **f32) if target is not None else None
        # sum_j w_j (z_j - ref): taken relative to the first chunk's row max to avoid cancellation later.
        self.ref = None
        self.sw = torch.zeros(n, **f32) if want_smooth else None
        # sum_j exp(z_j - m) (z_j - m), rescaled as m grows; gives the entropy without a second pass.
        self.ent = torch.zeros(n, **f32) if want_entropy else None
        # With a target: sum_{j != t} exp(z_j - m), the mass outside the target summed without it (the backward's
        # 1 - p_t, which s rounds away for a near-certain row; loss_math.head_coefficients).
        self.rest = torch.zeros(n, **f32) if target is not None else None

    def update(self, z, v0, v1, class_w_c):
        """Folds the block z [rows, v1 - v0] in; z is used up (overwritten) unless it is a view of another tensor."""
        m_c = z.amax(dim=1)
        m_new = torch.maximum(self.m, m_c)
        # Rows whose max is still -inf (empty so far) must not produce NaN from (-inf) - (-inf).
        m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        alpha = torch.exp(self.m - m_safe)
        if self.target is not None:
            t = self.target
            inside = (t >= v0) & (t < v1)
            idx = (t - v0).clamp(0, v1 - v0 - 1)
            self.zt = self.zt + torch.where(inside, z.gather(1, idx[:, None])[:, 0], torch.zeros_like(self.zt))
        if self.sw is not None:
            if self.ref is None:
                self.ref = m_c
            d = z - self.ref[:, None]
            self.sw = self.sw + (d.sum(dim=1) if class_w_c is None else d @ class_w_c.to(d.dtype))
            del d
        # e = exp(z - m), in z's own memory when it owns it (a new block), else in a new one.
        d = z.sub_(m_safe[:, None]) if z._base is None else z - m_safe[:, None]
        if self.ent is not None:
            # A class at -inf (a vocabulary masked by a -inf bias) has e = 0 and adds 0, not 0 * -inf.
            e = torch.exp(d)
            ed = e.mul_(d).nan_to_num_(nan=0.0)
            shift = (self.m - m_safe).nan_to_num(0.0, posinf=0.0, neginf=0.0)
            self.ent = alpha * (self.ent + shift * self.s) + ed.sum(dim=1)
            del e, ed
        e = d.exp_()
        if self.rest is not None:
            e_t = e.gather(1, idx[:, None])[:, 0]
            e.scatter_(1, idx[:, None], torch.where(inside, 0.0, e_t)[:, None])
            rest_c = e.sum(dim=1)
            self.rest = self.rest * alpha + rest_c
            self.s = self.s * alpha + (rest_c + torch.where(inside, e_t, 0.0))
        else:
            self.s = self.s * alpha + e.sum(dim=1)
        self.m = m_new

    def logs(self):
        return row_log(self.s)

    def mu(self):
        # sum_j p_j (z_j - m) = sum exp(z - m)(z - m) / s
        return self.ent / self.s

    def entropy(self):
        # H = lse - sum p z = log s - mu
        return row_log(self.s) - self.mu()


def row_stats(chunk_fn, n, V, device, dtype, target, class_w, want_smooth, want_entropy, block=None):
    """Run the online statistics over all (token chunk, vocab chunk) blocks of chunk_fn(i0, i1, v0, v1) (`block`
    (rows, cols), by default budget_block's: all tokens at once where the budget allows). Returns per-row tensors (m,
    logs, zt, sw, ref, ent, mu, rest), sw relative to ref (the first block's row max), mu (_RowStats) with the
    entropy, rest with a target."""
    f = dict(device=device, dtype=dtype)
    m = torch.empty(n, **f)
    logs = torch.empty(n, **f)
    zt = torch.zeros(n, **f) if target is not None else None
    sw = torch.zeros(n, **f) if want_smooth else None
    ref = torch.zeros(n, **f) if want_smooth else None
    ent = torch.zeros(n, **f) if want_entropy else None
    mu = torch.zeros(n, **f) if want_entropy else None
    rest = torch.zeros(n, **f) if target is not None else None
    rows, cols = block or budget_block(n, V, want_smooth or want_entropy, item=dtype.itemsize)
    for i0, i1 in chunks(n, rows):
        t_c = target[i0:i1] if target is not None else None
        st = _RowStats(i1 - i0, device, dtype, t_c, want_smooth, want_entropy)
        for v0, v1 in chunks(V, cols):
            st.update(chunk_fn(i0, i1, v0, v1), v0, v1, None if class_w is None else class_w[v0:v1])
        m[i0:i1] = st.m
        logs[i0:i1] = st.logs()
        if zt is not None:
            zt[i0:i1] = st.zt
        if sw is not None:
            sw[i0:i1] = st.sw
            ref[i0:i1] = st.ref
        if ent is not None:
            ent[i0:i1] = st.entropy()
            mu[i0:i1] = st.mu()
        if rest is not None:
            rest[i0:i1] = st.rest
    return m, logs, zt, sw, ref, ent, mu, rest


def head_forward(x, w, b, target, class_w, softcap, inv_temp, want_smooth, want_entropy):
    """(Stats, mu, rest): the head op's statistics (loss_math.Stats; sw relative to m) of the logits softcap(x W^T +
    b) * inv_temp, and the backward's mu (with the entropy) and rest (with a target) (loss_math.head_coefficients;
    else None). A target outside [0, V) has zt = 0; a head of no classes (an empty vocabulary shard) has m = logs =
    -inf."""
    n, V = x.shape[0], w.shape[0]
    acc = acc_dtype(x.dtype)
    if V == 0:
        neg_inf = torch.full((n,), -math.inf, device=x.device, dtype=acc)
        zeros = (lambda want: torch.zeros(n, device=x.device, dtype=acc) if want else None)
        return (Stats(neg_inf, neg_inf.clone(), zeros(target is not None), zeros(want_smooth), zeros(want_entropy)),
                zeros(want_entropy), zeros(target is not None))
    xp, n_pad = pad_rows(x)
    tp = None if target is None else torch.nn.functional.pad(target, (0, n_pad - n), value=-1)

    def chunk(i0, i1, v0, v1):  # i0, i1: multiples of ROW_BLOCK
        return linear_chunk(xp[i0:i1], w[v0:v1], None if b is None else b[v0:v1], softcap, inv_temp)

    temporaries = want_smooth or want_entropy
    # (A weight of another dtype is converted block by block: a copy of the block's W rows next to it.)
    block = (stats_block(n_pad, V, temporaries, acc.itemsize) if w.dtype == acc
             else budget_block(n_pad, V, temporaries, item=acc.itemsize))
    block = fixed_block(block[0] * block[1], V)
    m, logs, zt, sw, ref, ent, mu, rest = (None if t is None else t[:n] for t in row_stats(
        chunk, n_pad, V, x.device, acc, tp, class_w, want_smooth, want_entropy, block))
    if sw is not None:
        # Accumulated relative to the first block's row max (no cancellation while the max grows): re-based on m.
        w_sum = class_w.sum() if class_w is not None else float(V)
        sw = sw + w_sum * (ref - m)
    return Stats(m, logs, zt, sw, ent), mu, rest


class _HeadStats(torch.autograd.Function):
    """The head op on this backend: (x, W, b) -> Stats as six tensors (empty where not asked for); the backward
    turns the statistics' upstream gradients into (A, B, C, E) (loss_math.head_coefficients) for head_backward."""

    @staticmethod
    def forward(ctx, x, w, b, target, class_w, softcap, inv_temp, want_smooth, want_entropy, want_lse):
        st, mu, rest = head_forward(x, w, b, target, class_w, softcap, inv_temp, want_smooth, want_entropy)
        if want_lse:
            st = Stats(st.m, st.logs, st.zt, st.sw, st.ent, st.m + st.logs)
        empty = st.m.new_empty(0)
        out = tuple(empty.clone() if s is None else s for s in st)
        ctx.save_for_backward(x, w, b, target, class_w, st.m, st.logs, out[4], mu, rest, st.zt)
        ctx.opts = (softcap, inv_temp, want_smooth, want_entropy, want_lse)
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, _g_m, g_logs, g_zt, g_sw, g_ent, g_lse):
        x, w, b, target, class_w, m, logs, ent, mu, rest, zt = ctx.saved_tensors
        softcap, inv_temp, want_smooth, want_entropy, want_lse = ctx.opts
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], b is not None and ctx.needs_input_grad[2])
        coef = head_coefficients(m, logs, ent, g_logs, g_zt if target is not None else None,
                                 g_sw if want_smooth else None, g_ent if want_entropy else None, mu, rest, zt,
                                 g_lse if want_lse else None)
        dx, dw, db = head_backward(x, w, b, target, class_w, m, logs, coef, softcap, inv_temp, needs)
        return dx, dw, db, None, None, None, None, None, None, None


def stats(x, w, b, target, class_w, softcap, inv_temp, want_smooth, want_entropy, *, skip=None, ignore_index=-100,
          workspace_bytes=None, want_lse=False) -> Stats:
    """The head op's statistics through this backend, differentiable with respect to x, w and b. It computes in
    the inputs' dtypes (float32 math), as the Triton kernels do: autocast, which would run its blocks' products in
    bfloat16, is off inside (the backward runs without it anyway). x may be wider than w (float32 hidden states of
    a bfloat16 head): dx then comes back in x's dtype, before any rounding to w's. want_lse: the lse statistic
    (loss_math's module docstring). skip, ignore_index and workspace_bytes are the Triton backend's options of the
    backward, which the head op passes to either backend: this one computes every block and sizes its blocks by the
    memory policy."""
    cw = None if class_w is None else class_w.to(acc_dtype(x.dtype))
    with torch.autocast(x.device.type, enabled=False):
        out = _HeadStats.apply(x, w, b, target, cw, softcap, inv_temp, bool(want_smooth), bool(want_entropy),
                               bool(want_lse))
    m, logs, zt, sw, ent, lse = out
    return Stats(m, logs, zt if target is not None else None, sw if want_smooth else None,
                 ent if want_entropy else None, lse if want_lse else None)


# ---------------------------------------------------------------------------------------------------------------
# The chunked generic backward


def head_backward(x, w, b, target, class_w, m, logs, coef, softcap, inv_temp, needs):
    """The generic backward: (dx, dW, db) of a linear head for the per-row coefficients coef = (A, B, C, E) of
    dL/dz_j = p_j (A + B (z_j - m)) - C [j == t] - E w_j (B, C, E may be None); needs = (dx, dW, db) wanted.
    Vocab-outer, so each chunk of dW is accumulated in float32 and written once; dx is accumulated in float32 over
    all vocabulary chunks. Each block's logits are recomputed into one preallocated buffer and turned into dL/dz
    there, in place; the products accumulate into the gradients with addmm_ (into dW directly when all tokens fit in
    one block). dx comes back in x's dtype."""
    A, B, C, E, At = coef
    n, D = x.shape
    V = w.shape[0]
    need_x, need_w, need_b = needs
    acc = acc_dtype(x.dtype)
    dw = torch.empty_like(w) if need_w else None
    db = torch.empty_like(b) if need_b else None
    if n == 0 or V == 0:
        if dw is not None:
            dw.zero_()
        if db is not None:
            db.zero_()
        return (torch.zeros_like(x) if need_x else None), dw, db
    # Products of a multiple of ROW_BLOCK rows and HEAD_COLS classes, the input padded with zero rows whose
    # coefficients are 0 (their dL/dz is 0): each row's dx is the same whatever the batch (ROW_BLOCK).
    x_in, n_in = x, n
    x, n = pad_rows(x)
    if n != n_in:
        pad = lambda c, value=0.0: None if c is None else torch.nn.functional.pad(c, (0, n - n_in), value=value)
        A, B, C, E, At, m, logs = (pad(c) for c in (A, B, C, E, At, m, logs))
        target = pad(target, -1)
    dx = torch.zeros(n, D, device=x.device, dtype=acc) if need_x else None
    rows, cols = budget_block(n, V, B is not None or softcap is not None, item=acc.itemsize)
    rows, cols = fixed_block(rows * cols, V)
    one_block = rows >= n  # every token in each block: x is converted once, dW rows written by one product
    buf = torch.empty(rows * cols, device=x.device, dtype=acc)
    x_all = x.to(acc) if one_block else None
    A2, B2, C2, E2, At2 = (None if c is None else c[:, None] for c in (A, B, C, E, At))
    m2, logs2 = m[:, None], logs[:, None]
    # p A = exp(z - m) (A / S), S = exp(logs) (at most V): one pass fewer over each block than exp((z - m) - logs) A,
    # and no rounding of (z - m) - logs inside the exponential. A / exp(logs), not A exp(-logs): one rounding
    # fewer where p_j W - w_j cancels (label smoothing with class weights, V = 2: 1.2 -> 1.0 x PyTorch's median
    # d_input error).
    a_s = (A / torch.exp(logs))[:, None] if B is None else None
    for v0, v1 in chunks(V, cols):
        w_c = w[v0:v1].to(acc)
        b_c = b[v0:v1] if b is not None else None
        cw_c = class_w[v0:v1].to(acc) if class_w is not None else None
        direct = need_w and one_block and dw.dtype == acc  # the chunk's dW rows written by one product
        dw_c = None
        if need_w:
            dw_c = dw[v0:v1] if direct else torch.zeros(v1 - v0, D, device=x.device, dtype=acc)
        db_c = torch.zeros(v1 - v0, device=x.device, dtype=acc) if need_b else None
        for i0, i1 in chunks(n, rows):
            x_c = x_all if one_block else x[i0:i1].to(acc)
            sl = slice(i0, i1)
            z = linear_chunk(x_c, w_c, b_c, None, 1.0, out=buf[: (i1 - i0) * (v1 - v0)].view(i1 - i0, v1 - v0))
            chain = None
            if softcap is not None:  # the chain factor from the raw logits, then the cap in place
                chain = softcap_slope(z, softcap)
                apply_softcap(z, softcap, inplace=True)
            if inv_temp != 1.0:
                z.mul_(inv_temp)
            dz = _dz_block(z, m2[sl], logs2[sl], A2[sl] if a_s is None else a_s[sl], None if B2 is None else B2[sl],
                           None if C2 is None else C2[sl], None if E2 is None else E2[sl],
                           None if target is None else target[sl], v0, v1, cw_c, None if At2 is None else At2[sl])
            del z
            if inv_temp != 1.0:
                dz.mul_(inv_temp)
            if chain is not None:
                dz.mul_(chain)
                del chain
            if i1 > n_in:  # padding rows: no gradient (their p alone could overflow)
                dz[max(0, n_in - i0):].zero_()
            if need_x:
                dx[sl].addmm_(dz, w_c)
            if need_w:
                if direct:
                    torch.mm(dz.T, x_c, out=dw_c)
                else:
                    dw_c.addmm_(dz.T, x_c)
            if need_b:
                db_c += dz.sum(dim=0)
        if need_w and not direct:
            dw[v0:v1] = dw_c
        if need_b:
            db[v0:v1] = db_c
    return (dx[:n_in].to(x_in.dtype) if need_x else None), dw, db


def _dz_block(z, m2, logs2, A2, B2, C2, E2, t_c, v0, v1, class_w_c, At2=None):
    """dL/dz = p (A + B (z - m)) - C [j == t] - E w for a block of (temperature-scaled) logits z, written over z
    (the per-row coefficients as columns [rows, 1], B, C, E may be None). Without B, A2 is A / S (S = exp(logs)).
    With At2, the target's column is p_t (At + B (z_t - m)) - C - E w_t (loss_math.head_coefficients)."""
    z.sub_(m2)  # z - m, exact
    if At2 is not None:
        inside = (t_c >= v0) & (t_c < v1)
        idx = (t_c - v0).clamp(0, v1 - v0 - 1)[:, None]
        d_t = z.gather(1, idx)
        p_t = (d_t - logs2).exp_()
        g_t = At2 if B2 is None else At2 + B2 * d_t
        dz_t = torch.where(p_t > 0, p_t * g_t, 0.0) - C2
        if E2 is not None:
            dz_t = dz_t - E2 * (class_w_c[idx] if class_w_c is not None else 1.0)
    if B2 is not None:
        g = z.mul(B2).add_(A2)  # A + B (z - m): B multiplies z - m, no cancellation at |z| ~ 1e4
        dz = z.sub_(logs2).exp_()
        zero = dz == 0  # p = 0 at z = -inf: 0, not 0 * inf
        dz.mul_(g).masked_fill_(zero, 0.0)
        del g, zero
    else:
        dz = z.exp_().mul_(A2)
    if E2 is not None:
        if class_w_c is not None:
            dz.addcmul_(E2, class_w_c[None, :], value=-1.0)
        else:
            dz.sub_(E2)
    if At2 is not None:
        dz.scatter_(1, idx, torch.where(inside[:, None], dz_t, dz.gather(1, idx)))
    elif C2 is not None:
        inside = (t_c >= v0) & (t_c < v1)
        idx = (t_c - v0).clamp(0, v1 - v0 - 1)
        dz.scatter_add_(1, idx[:, None], torch.where(inside[:, None], -C2, torch.zeros_like(C2)))
    return dz

