"""The chunked PyTorch backend: the head op's statistics and its generic backward on blocks, never N x V.

The backend of the head op (logitless.head) wherever Triton cannot run: CPU tensors, float64, backend="torch".
Tokens are processed in chunks of rows and the vocabulary in chunks of columns (a block sized by the memory policy,
loss_math.default_workspace_bytes), with an online log-sum-exp in the forward (_RowStats) and a backward that
recomputes each block's logits and turns them into dL/dz in place. All math is float32 whatever the input dtype
(float64 for float64 inputs). The contract (the statistics, the coefficients) is loss_math's.

linear_cross_entropy's training step with a reduced loss takes a fused path instead (fused_linear_cross_entropy):
chunks of rows over the full vocabulary whose gradients are computed in the forward, three products instead of four.

Also here: the PyTorch backend of cross_entropy on given logits (same statistics, its own backward), the closed
forms of a one-class head, and the block helpers that the two-head losses (distill.py) share.
"""

from __future__ import annotations

import math

import torch

from ._autograd import first_order_only, scale_forward_grads
from .loss_math import (
    Stats,
    ce_backward_coef,
    ce_loss_from_stats,
    ce_row_terms,
    default_workspace_bytes,
    head_coefficients,
    one_minus_pt,
    reduce_loss,
)

# This path's (token chunk x vocab chunk) float32 block takes half of the budget, or a third with the options that
# need a temporary of the block's size (the softcap's chain factor in the backward, the entropy, smoothing).
_BLOCK_SHARE = 2
# Vocabulary chunks narrower than this make the products inefficient: below it the tokens are chunked instead.
_MIN_COLS = 1024
# Part of the budget that the blocks of the fused training path and of the forward leave to the products' own
# buffers (at most a quarter of the budget): MKL's sgemm takes 6-10 MiB of packing space for a product against all of
# W (measured as peak RSS, at V = 32000 and D = 128 to 1024).
_PRODUCTS_RESERVE = 8 << 20
# The fused training path's full-vocabulary row chunks: with fewer rows than this its products turn into reads of W
# (three per chunk), and the generic path, which reads it twice in all, is taken instead.
_MIN_FUSED_ROWS = 32
# The head op's blocks (head_forward, head_backward) are products of a multiple of ROW_BLOCK rows (the input padded
# with zero rows to a multiple of it) and HEAD_COLS classes (the last chunk V mod HEAD_COLS): CPU GEMM kernels round a
# row differently with the number of rows of the product when it is small or odd (MKL: 1-3, 5-7 and 9-11 rows differ
# from 16 and more), not between multiples of 16, and the chunk width sets where the online statistics rescale. Both
# fixed, a row's statistics and its input gradient do not depend on the batch it is in (docs/rl.md;
# tests/test_batch_invariance.py checks it on the machine it runs on). One product per block, not one per ROW_BLOCK
# rows, which were several times slower (docs/rl.md).
ROW_BLOCK = 16
HEAD_COLS = 2048
# cross_entropy on given logits and the two-head losses walk chunks of this many classes...
VOCAB_CHUNK = 4096
# ... and of token_chunk(V) rows: blocks of at most this many elements.
CHUNK_ELEMS = 1 << 20


def _block(n: int, V: int, temporaries: bool = False, share: int = _BLOCK_SHARE, item: int = 4,
           budget: int | None = None) -> tuple[int, int]:
    """(token rows, vocabulary columns) of one block of this path (`item` bytes an element: float32, or float64):
    1 / `share` of `budget` (by default the policy's) (of share + 1 with `temporaries` of the block's size; by
    default half, or a third), all n tokens at once while that leaves at least _MIN_COLS classes (the
    backward then writes each dW chunk once, and reads x once), else chunks of tokens."""
    budget = default_workspace_bytes(n, V) if budget is None else budget
    elems = max(1, budget // (item * (share + bool(temporaries))))
    cols = min(V, max(_MIN_COLS, elems // max(n, 1)))
    return max(1, min(n, elems // max(cols, 1))), max(1, cols)


def chunks(n: int, size: int):
    for start in range(0, n, size):
        yield start, min(start + size, n)


def token_chunk(V: int) -> int:
    return max(16, CHUNK_ELEMS // min(V, VOCAB_CHUNK))


def acc_dtype(dtype) -> torch.dtype:
    """Accumulation dtype: float32, or float64 for float64 inputs (which only the PyTorch path accepts)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def apply_softcap(z: torch.Tensor, softcap: float | None, *, inplace: bool = False) -> torch.Tensor:
    """softcap * tanh(z / softcap), the logit cap of every PyTorch-side path (None: z unchanged). `inplace` writes
    it over z (a block that owns its memory, differentiated by chain_transform); otherwise a new tensor whose
    autograd slope is softcap_slope's (_Softcap)."""
    if softcap is None:
        return z
    if inplace:
        return z.div_(softcap).tanh_().mul_(softcap)
    return _Softcap.apply(z, float(softcap))


def transform(raw: torch.Tensor, softcap: float | None, inv_temp: float) -> torch.Tensor:
    """Raw float32 logits -> softcapped, temperature-scaled logits, in a new tensor (raw is kept for the chain
    rule, chain_transform)."""
    z = apply_softcap(raw.clone() if softcap is not None else raw, softcap, inplace=True)
    return z * inv_temp if inv_temp != 1.0 else z


def chain_transform(dz, raw, softcap, inv_temp):
    """dL/dz (after softcap and temperature) -> dL/d(raw logits). `raw` is the logit block before the transform."""
    if inv_temp != 1.0:
        dz = dz * inv_temp
    if softcap is not None:
        dz = dz * softcap_slope(raw, softcap)
    return dz


def softcap_slope(raw, softcap):
    """d(softcap tanh(u))/du at u = raw / softcap, as 4 s (1 - s) with s = sigmoid(-2 |u|) (= 1 / cosh(u)^2), in
    one block-sized buffer. PyTorch's 1 - tanh(u)^2 cancels where tanh saturates (20-60x PyTorch's float32 error
    there); this form has no cancellation (s <= 1/2) and stays within a few ulp everywhere."""
    s = (raw / softcap).abs_().mul_(-2.0).sigmoid_()
    return s.addcmul_(s, s, value=-1.0).mul_(4.0)



def linear_chunk(x_c, w_c, b_c, softcap, inv_temp, out=None):
    """float32 logits of a (token chunk, vocab chunk) block: [Cn, Cv], a new tensor (or `out`), transformed in
    place."""
    acc = acc_dtype(x_c.dtype)
    # The bias enters the product's accumulation (addmm: one rounding of x w^T + b, as F.linear), not after it:
    # with few features a separate add's rounding was as large as the product's (entropy gradients at D = 3 went
    # from 2.7 to 1.0 x PyTorch's typical error).
    if b_c is None:
        z = torch.mm(x_c.to(acc), w_c.to(acc).T, out=out)
    else:
        z = torch.addmm(b_c.to(acc), x_c.to(acc), w_c.to(acc).T, out=out)
    apply_softcap(z, softcap, inplace=True)
    if inv_temp != 1.0:
        z.mul_(inv_temp)
    return z


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
        return _log(self.s)

    def mu(self):
        # sum_j p_j (z_j - m) = sum exp(z - m)(z - m) / s
        return self.ent / self.s

    def entropy(self):
        # H = lse - sum p z = log s - mu
        return _log(self.s) - self.mu()


def _log(s: torch.Tensor) -> torch.Tensor:
    # PyTorch's CPU log rounds an element of a vector's scalar tail differently from one in its SIMD lanes, so the
    # log of a row's sum would depend on the row's position and on the batch's length. Taken in float64 and rounded
    # once, the two agree unless the float64 results straddle a rounding boundary of the float32 one (a chance of
    # about 2^-29 per row).
    if s.dtype == torch.float32 and s.device.type == "cpu":
        return torch.log(s.double()).float()
    return torch.log(s)


def _budget_beside_products(n: int, V: int) -> int:
    """The policy's budget less the products' own buffers (_PRODUCTS_RESERVE): what the blocks of the fused
    training path and of the forward may take."""
    budget = default_workspace_bytes(n, V)
    return budget - min(budget // 4, _PRODUCTS_RESERVE)


def _stats_block(n: int, V: int, temporaries: bool, item: int) -> tuple[int, int]:
    """(token rows, vocabulary columns) of the forward's blocks on a linear head whose weight is already in the
    accumulation dtype: _block's shape with the whole budget beside the products' buffers for the block (and a
    temporary of its size for the smoothing and the entropy, _RowStats.update), since the forward holds nothing
    else of that size. Fewer blocks, hence calls, than the backward's half budget: on a loaded 2-core machine each
    call waits for both threads (at (512, 128, 32000), 2 threads, 4 blocks against 8: 290 ms against 480; 1 thread:
    80 against 76). Full-vocabulary rows, as many blocks, were slower (340 ms, and 87 with 1 thread): each block's
    product packs all of W."""
    return _block(n, V, temporaries, share=1, item=item, budget=_budget_beside_products(n, V))


def pad_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x with zero rows added up to a multiple of ROW_BLOCK (x itself when it is one), and that row count."""
    n = x.shape[0]
    n_pad = -(-n // ROW_BLOCK) * ROW_BLOCK
    return (x if n_pad == n else torch.nn.functional.pad(x, (0, 0, 0, n_pad - n))), n_pad


def fixed_block(elems: int, V: int) -> tuple[int, int]:
    """(rows, cols) of a block of about `elems` elements for the head op's fixed shapes: HEAD_COLS classes (all V
    when fewer) and a multiple of ROW_BLOCK rows (at least one). A budget below ROW_BLOCK x HEAD_COLS elements
    halves the classes until one row block fits (down to 128): the policy's floor (loss_math.POLICY_MIN_BYTES) is
    far above that, so only a budget set below it makes the width, and with it the rounding, depend on N."""
    cols = min(V, HEAD_COLS)
    while cols > 128 and elems < ROW_BLOCK * cols:
        cols //= 2
    return max(1, elems // (cols * ROW_BLOCK)) * ROW_BLOCK, cols


def _row_stats(chunk_fn, n, V, device, dtype, target, class_w, want_smooth, want_entropy, block=None):
    """Run the online statistics over all (token chunk, vocab chunk) blocks of chunk_fn(i0, i1, v0, v1) (`block`
    (rows, cols), by default _block's: all tokens at once where the budget allows). Returns per-row tensors (m,
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
    rows, cols = block or _block(n, V, want_smooth or want_entropy, item=dtype.itemsize)
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
    block = (_stats_block(n_pad, V, temporaries, acc.itemsize) if w.dtype == acc
             else _block(n_pad, V, temporaries, item=acc.itemsize))
    block = fixed_block(block[0] * block[1], V)
    m, logs, zt, sw, ref, ent, mu, rest = (None if t is None else t[:n] for t in _row_stats(
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
            st = st._replace(lse=st.m + st.logs)
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


def stats(x, w, b, target, class_w, softcap, inv_temp, want_smooth, want_entropy, want_lse=False) -> Stats:
    """The head op's statistics through this backend, differentiable with respect to x, w and b. It computes in
    the inputs' dtypes (float32 math), as the Triton kernels do: autocast, which would run its blocks' products in
    bfloat16, is off inside (the backward runs without it anyway). x may be wider than w (float32 hidden states of
    a bfloat16 head): dx then comes back in x's dtype, before any rounding to w's. want_lse: the lse statistic
    (loss_math's module docstring)."""
    cw = None if class_w is None else class_w.to(acc_dtype(x.dtype))
    with torch.autocast(x.device.type, enabled=False):
        out = _HeadStats.apply(x, w, b, target, cw, softcap, inv_temp, bool(want_smooth), bool(want_entropy),
                               bool(want_lse))
    m, logs, zt, sw, ent, lse = out
    return Stats(m, logs, zt if target is not None else None, sw if want_smooth else None,
                 ent if want_entropy else None, lse if want_lse else None)


def one_class_logits(x, w, b, softcap, inv_temp):
    """(N,) float64 logits of a head with a single class (V = 1), differentiable with respect to x, w and b. With
    one class the softmax is exactly 1 and lse = z, so cross-entropy, smoothing, log-probs and entropy are exactly 0
    (only the z-loss and the log-sum-exp are not); the general paths reach those zeros only up to the rounding of a
    recomputed logit, which leaves gradients of ~1e-7 where PyTorch's are exactly 0. Every output is a function of
    these N values, so the closed forms work in float64 and round once, to the output's or the gradient's dtype:
    in float32 the weight and bias gradients are sums over the rows as rounded as PyTorch's own (and a temperature
    multiplies by a rounded 1 / T where PyTorch divides), which a sum that cancels turns into 10x PyTorch's error
    whenever PyTorch's rounding happens to be the luckier."""
    with torch.autocast(x.device.type, enabled=False):
        z = _OneClassLinear.apply(x, w, b)
        z = apply_softcap(z, softcap)
        return z * inv_temp if inv_temp != 1.0 else z


class _OneClassLinear(torch.autograd.Function):
    """x W^T + b for W of one row, in float64 (a (N,) result), over chunks of rows (no float64 copy of x beyond
    CHUNK_ELEMS elements); the backward's gradients are float64 sums, rounded once to the inputs' dtypes."""

    @staticmethod
    def forward(ctx, x, w, b):
        w64 = w[0].to(torch.float64)
        z = torch.empty(x.shape[0], device=x.device, dtype=torch.float64)
        for i0, i1 in chunks(x.shape[0], max(1, CHUNK_ELEMS // max(1, x.shape[1]))):
            torch.mv(x[i0:i1].to(torch.float64), w64, out=z[i0:i1])
        if b is not None:
            z += b[0].to(torch.float64)
        ctx.save_for_backward(x, w, b)
        return z

    @staticmethod
    @first_order_only
    def backward(ctx, g):
        x, w, b = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        g = g.to(torch.float64)
        w64 = w[0].to(torch.float64)
        dx = torch.empty_like(x) if need_x else None
        dw = torch.zeros(x.shape[1], device=x.device, dtype=torch.float64) if need_w else None
        for i0, i1 in chunks(x.shape[0], max(1, CHUNK_ELEMS // max(1, x.shape[1]))):
            if need_x:
                dx[i0:i1] = g[i0:i1, None] * w64
            if need_w:
                dw.addmv_(x[i0:i1].to(torch.float64).T, g[i0:i1])
        return (dx, None if dw is None else dw.to(w.dtype)[None, :],
                g.sum().to(b.dtype).reshape(1) if b is not None and need_b else None)


class _Softcap(torch.autograd.Function):
    """softcap tanh(z / softcap) with the slope of softcap_slope: 1 - tanh^2, the slope of torch.tanh's backward,
    cancels where tanh saturates (and is exactly 0 past |u| ~ 19 in float64)."""

    @staticmethod
    def forward(ctx, z, softcap):
        ctx.save_for_backward(z)
        ctx.softcap = softcap
        return softcap * torch.tanh(z / softcap)

    @staticmethod
    @first_order_only
    def backward(ctx, g):
        (z,) = ctx.saved_tensors
        return g * softcap_slope(z, ctx.softcap), None


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
    rows, cols = _block(n, V, B is not None or softcap is not None, item=acc.itemsize)
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


# ---------------------------------------------------------------------------------------------------------------
# cross_entropy on given logits


def _dz_logits_chunk(z, m_c, logs_c, A_c, C_c, E_c, X_c, t_c, v0, v1, class_w_c, q_c):
    """dL/dz of cross-entropy for one block of given logits (loss_math.ce_backward_coef): p A - E w, and at the
    target's column p_t X - q C with q = 1 - p_t from the forward's rest (loss_math.head_coefficients): p_t - 1
    cancels for a near-certain row."""
    dz = torch.exp((z - m_c[:, None]) - logs_c[:, None]).mul_(A_c[:, None])
    if E_c is not None:
        dz -= E_c[:, None] * (class_w_c[None, :] if class_w_c is not None else 1.0)
    inside = (t_c >= v0) & (t_c < v1)
    idx = (t_c - v0).clamp(0, v1 - v0 - 1)[:, None]
    p_t = torch.exp((z.gather(1, idx)[:, 0] - m_c) - logs_c)
    d_t = p_t * X_c - q_c * C_c
    return dz.scatter_(1, idx, torch.where(inside, d_t, dz.gather(1, idx)[:, 0])[:, None])


class _CrossEntropy(torch.autograd.Function):
    """(N, V) logits -> (per-token loss, lse). With `inplace`, the backward writes the gradient over the saved
    logits chunk by chunk (each chunk is read before it is overwritten), so no second N x V buffer is allocated; it
    can then run only once."""

    @staticmethod
    def forward(ctx, logits, target, class_w, ignore_index, label_smoothing, z_loss, softcap, inplace=False):
        n, V = logits.shape
        acc = acc_dtype(logits.dtype)
        chunk = lambda i0, i1, v0, v1: transform(logits[i0:i1, v0:v1].to(acc), softcap, 1.0)
        m, logs, zt, sw, ref, _, _, rest = _row_stats(chunk, n, V, logits.device, acc, target, class_w,
                                                      label_smoothing > 0.0, False)
        valid, w_t, w_sum = ce_row_terms(target, class_w, ignore_index, label_smoothing, V, acc)
        loss = ce_loss_from_stats(m, logs, zt, sw, ref, valid, w_t, w_sum, label_smoothing, z_loss, V)
        lse = m + logs
        ctx.save_for_backward(logits, target, class_w, m, logs, rest, zt)
        ctx.opts = (ignore_index, label_smoothing, z_loss, softcap)
        ctx.inplace = bool(inplace)
        ctx.mark_non_differentiable(lse)
        return loss, lse

    @staticmethod
    @first_order_only
    def backward(ctx, grad_loss, _grad_lse):
        if ctx.inplace:
            if getattr(ctx, "consumed", False):
                raise RuntimeError("cross_entropy(inplace_backward=True): the gradient was already written over the "
                                   "logits by an earlier backward; it can run only once")
            ctx.consumed = True
        logits, target, class_w, m, logs, rest, zt = ctx.saved_tensors
        ignore_index, label_smoothing, z_loss, softcap = ctx.opts
        n, V = logits.shape
        valid, w_t, w_sum = ce_row_terms(target, class_w, ignore_index, label_smoothing, V, m.dtype)
        A, C, E, X = ce_backward_coef(grad_loss, m + logs, valid, w_t, w_sum, label_smoothing, z_loss, V)
        q = one_minus_pt(rest, logs, torch.exp(zt - m))
        grad = logits if ctx.inplace else torch.empty_like(logits)
        for i0, i1 in chunks(n, token_chunk(V)):
            sl = slice(i0, i1)
            for v0, v1 in chunks(V, VOCAB_CHUNK):
                raw = logits[sl, v0:v1].to(m.dtype)
                z = transform(raw, softcap, 1.0)
                dz = _dz_logits_chunk(z, m[sl], logs[sl], A[sl], C[sl], None if E is None else E[sl], X[sl],
                                      target[sl], v0, v1, None if class_w is None else class_w[v0:v1], q[sl])
                grad[sl, v0:v1] = chain_transform(dz, raw, softcap, 1.0)
        return grad, None, None, None, None, None, None, None


# ---------------------------------------------------------------------------------------------------------------
# The fused training path of linear_cross_entropy

def fused_rows(x, w, b, softcap, reduction) -> int:
    """Rows per chunk of the fused path of linear_cross_entropy (fused_linear_cross_entropy), or 0 where it does
    not apply: it needs a reduced loss ("mean" / "sum"), a gradient wanted now (grad mode, an input that requires
    grad; not while torch.compile traces, which keeps the generic path), and the policy's budget
    (loss_math.default_workspace_bytes) holding chunks of at least _MIN_FUSED_ROWS full-vocabulary rows (all rows
    when there are fewer) next to the accumulators that a bfloat16 / float16 head needs in float32 (its weight, and
    the gradients until the backward) and the products' own buffers (_PRODUCTS_RESERVE)."""
    from ._validate import _is_compiling

    n, D = x.shape
    V = w.shape[0]
    needs = (x.requires_grad, w.requires_grad, b is not None and b.requires_grad)
    if reduction == "none" or n == 0 or V < 2 or not torch.is_grad_enabled() or not any(needs) or _is_compiling():
        return 0
    acc = acc_dtype(x.dtype)
    item = acc.itemsize
    fixed = 0
    if w.dtype != acc:  # W in the accumulation dtype, and the weight gradient's accumulator
        fixed += item * V * D * (1 + needs[1])
    per_row = item * V * (1 + (softcap is not None))  # the block, and the softcap's chain factor
    if x.dtype != acc:  # the chunk of x in the accumulation dtype, and the input gradient's accumulator
        per_row += item * D * (1 + needs[0])
    rows = (_budget_beside_products(n, V) - fixed) // per_row
    return min(n, rows) if rows >= min(n, _MIN_FUSED_ROWS) else 0


class _FusedCrossEntropy(torch.autograd.Function):
    """(x, W, b) -> the reduced cross-entropy, with the gradients computed in the forward (_fused_forward); the
    backward scales them by the upstream gradient: into fresh tensors while the graph is kept (any number of
    backwards with retain_graph=True give the same gradients), in place in the backward that frees the graph."""

    @staticmethod
    def forward(ctx, x, w, b, target, class_w, reduction, ignore_index, eps, z_loss, softcap, rows):
        needs = (x.requires_grad, w.requires_grad, b is not None and b.requires_grad)
        loss, grads = _fused_forward(x, w, b, target, class_w, reduction, ignore_index, eps, z_loss, softcap, rows,
                                     needs)
        # Saved only for first_order_only: with create_graph=True they tie the gradients to a node that refuses a
        # second differentiation. The backward itself does not read them.
        ctx.save_for_backward(x, w, b)
        ctx.grads = grads
        ctx.dtypes = (x.dtype, w.dtype, None if b is None else b.dtype)
        return loss

    @staticmethod
    @first_order_only
    def backward(ctx, g):
        return (*scale_forward_grads(ctx, g), None, None, None, None, None, None, None, None)


def fused_linear_cross_entropy(x, w, b, target, class_w, reduction, ignore_index, label_smoothing, z_loss, softcap,
                               rows):
    """linear_cross_entropy's reduced loss on validated (N, D) / (V, D) inputs through the fused path (fused_rows
    gives `rows`); autocast is off inside, as in stats()."""
    with torch.autocast(x.device.type, enabled=False):
        return _FusedCrossEntropy.apply(x, w, b, target, class_w, reduction, ignore_index, float(label_smoothing),
                                        float(z_loss), None if softcap is None else float(softcap), rows)


def _fused_forward(x, w, b, target, class_w, reduction, ignore_index, eps, z_loss, softcap, rows, needs):
    """(loss, (dx, dW, db)) of the reduced cross-entropy, the gradients for an upstream gradient of 1 (None where
    not needed) in the accumulation dtype. Rows outer, over the full vocabulary: each chunk's logits are computed
    once into one buffer, give the rows' statistics (m, logs, zt, sw: loss_math's contract), become dL/dz there in
    place, and go into the products dx_c = dz W and dW += dz^T x_c: three products in all, against the generic
    path's four (its backward recomputes the logits). dL/dz_j = p_j A - C [j == t] - E w_j with, for a valid row of
    reduction factor r (1, or 1 / the summed target weights): A = r ((1 - eps) w_t + eps W / V + 2 z_loss lse),
    C = r (1 - eps) w_t, E = r eps / V (loss_math.head_coefficients for this loss); 0 for an ignored row."""
    n, D = x.shape
    V = w.shape[0]
    acc = acc_dtype(x.dtype)
    need_x, need_w, need_b = needs
    f = dict(device=x.device, dtype=acc)
    wa = w if w.dtype == acc else w.to(acc)
    ba = None if b is None else b.to(acc)
    valid, w_t, w_sum = ce_row_terms(target, class_w, ignore_index, eps, V, acc)
    # The reduction's factor per row, 0 where ignored (where(): 1 / 0 when every row is ignored must not reach them).
    r = valid.to(acc) if reduction == "sum" else torch.where(valid, 1.0 / w_t.sum(), 0.0)
    C = (r * w_t) * (1.0 - eps) if eps < 1.0 else None
    A_s = r * ((eps / V) * w_sum) if eps > 0.0 else None  # A less C: the target column's own A (At)
    A = C if A_s is None else (A_s if C is None else C + A_s)
    E = r * (eps / V) if eps > 0.0 else None
    inside = (target >= 0) & (target < V)
    idx = torch.where(inside, target, 0)
    if E is not None:
        E_t = E * (w_t if class_w is not None else 1.0)  # E w_t (w_t is 0 at an ignored row, and so is E)
    m = torch.empty(n, **f)
    logs = torch.empty(n, **f)
    zt = torch.empty(n, **f)
    sw = torch.empty(n, **f) if eps > 0.0 else None
    dx = torch.empty(n, D, **f) if need_x else None
    dw = torch.empty(V, D, **f) if need_w else None
    db = torch.zeros(V, **f) if need_b else None
    buf = torch.empty(rows * V, **f)
    slope_buf = torch.empty(rows * V, **f) if softcap is not None else None
    for i0, i1 in chunks(n, rows):
        sl = slice(i0, i1)
        x_c = x[sl] if x.dtype == acc else x[sl].to(acc)
        z = buf[: (i1 - i0) * V].view(i1 - i0, V)
        if ba is not None:
            torch.addmm(ba, x_c, wa.T, out=z)
        else:
            torch.mm(x_c, wa.T, out=z)
        slope = None
        if softcap is not None:  # the chain factor from the raw logits (softcap_slope's form), then the cap
            slope = slope_buf[: z.numel()].view_as(z)
            torch.div(z, softcap, out=slope).abs_().mul_(-2.0).sigmoid_()
            slope.addcmul_(slope, slope, value=-1.0).mul_(4.0)
            apply_softcap(z, softcap, inplace=True)
        m_c = z.amax(dim=1)
        m[sl] = m_c
        ix = idx[sl, None]
        zt[sl] = torch.where(inside[sl], z.gather(1, ix)[:, 0], 0.0)
        z.sub_(m_c[:, None])  # z - m, exact
        if sw is not None:
            sw[sl] = z.sum(dim=1) if class_w is None else z @ class_w
        z.exp_()
        # S = rest + e_t, rest summed without the target (loss_math.head_coefficients): 1 - p_t = rest / S, which
        # p_t - 1 loses for a near-certain row.
        ins = inside[sl]
        e_t = z.gather(1, ix)[:, 0]
        z.scatter_(1, ix, torch.where(ins, 0.0, e_t)[:, None])
        rest_c = z.sum(dim=1)
        z.scatter_(1, ix, e_t[:, None])
        s_c = rest_c + torch.where(ins, e_t, 0.0)
        logs_c = torch.log(s_c)
        logs[sl] = logs_c
        a_c = A[sl]
        at_c = None if A_s is None else A_s[sl]
        if z_loss > 0.0:
            zl = r[sl] * (2.0 * z_loss) * (m_c + logs_c)
            a_c = a_c + zl
            at_c = zl if at_c is None else at_c + zl
        # p A = exp(z - m) (A / S), A / S rounded once from the sum itself (head_backward has only logs: A /
        # exp(logs)). A exp(-logs) rounded more: where p_j W - w_j cancels (label smoothing with class weights near
        # W / V, V = 2) it put ours at 1.2 x PyTorch's median d_input error, where A / S is at 0.9 x.
        z.mul_((a_c / s_c)[:, None])
        if E is not None:
            if class_w is not None:
                z.addcmul_(E[sl, None], class_w[None, :], value=-1.0)
            else:
                z.sub_(E[sl, None])
        if C is not None:
            # The target's column: p_t At - (1 - p_t) C - E w_t, not p_t A - C (- E w_t), which cancels.
            d_t = -one_minus_pt(rest_c, logs_c, torch.where(ins, e_t, 0.0)) * C[sl]
            if at_c is not None:
                d_t = d_t + e_t * (at_c / s_c)
            if E is not None:
                d_t = d_t - E_t[sl]
            z.scatter_(1, ix, torch.where(ins, d_t, z.gather(1, ix)[:, 0])[:, None])
        if slope is not None:
            z.mul_(slope)
        if need_x:
            torch.mm(z, wa, out=dx[sl])
        if need_w:
            if i0 == 0:
                torch.mm(z.T, x_c, out=dw)
            else:
                dw.addmm_(z.T, x_c)
        if need_b:
            db += z.sum(dim=0)
    del buf, slope_buf
    per_token = ce_loss_from_stats(m, logs, zt, sw, m, valid, w_t, w_sum, eps, z_loss, V)
    return reduce_loss(per_token, valid, w_t, reduction, ()), (dx, dw, db)


def cross_entropy(logits2d, target, lead_shape, weight, reduction, ignore_index, label_smoothing, z_loss, softcap,
                  inplace_backward=False):
    """cross_entropy on validated (N, V) logits through this backend: (reduced loss, lse of the lead shape)."""
    class_w = None if weight is None else weight.to(acc_dtype(logits2d.dtype))
    with torch.autocast(logits2d.device.type, enabled=False):
        per_token, lse = _CrossEntropy.apply(logits2d, target, class_w, ignore_index, float(label_smoothing),
                                             float(z_loss), None if softcap is None else float(softcap),
                                             bool(inplace_backward))
    valid, w_t, _ = ce_row_terms(target, class_w, ignore_index, label_smoothing, logits2d.shape[1], per_token.dtype)
    return reduce_loss(per_token, valid, w_t, reduction, lead_shape), lse.reshape(lead_shape)
