"""Pure-PyTorch twins of every logitless op: the CPU path, the fallback where Triton cannot run, and the reference.

The twins have the public functions' signatures (without `backend`) and never build an N x V tensor: tokens are
processed in chunks of rows and the vocabulary in chunks of columns, with an online log-sum-exp in the forward and a
custom backward that recomputes each chunk's logits. All math is float32 whatever the input dtype.

The `naive_*` functions at the bottom materialise the logits with PyTorch's own ops, in whatever dtype they are
given: tests use them (in float64) as ground truth and (in the input dtype) as "PyTorch's own error", and benchmarks
use them as the eager peer. They are not a fallback.

Notation, for one row (token) i with logits z_j = softcap(x_i . W_j + b_j) / T:
  lse = log sum_j exp(z_j) = m + logs (m the row max),  p_j = exp((z_j - m) - logs)
and every op's gradient has the form (docs/math.md derives each)
  dL/dz_j = p_j (A_i + B_i z_j) - C_i [j == t_i] - E_i w_j
so one backward routine serves cross-entropy, log-probs, entropy and log-sum-exp; only the per-row coefficients
(A, B, C, E) differ. B multiplies z_j - m (the row max), not z_j, and A is taken relative to m accordingly: the
difference z_j - mu of the entropy gradient would otherwise cancel catastrophically at |z| ~ 1e4.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from . import _validate

# The default memory policy of both paths (workspace_bytes=None on the Triton path): beyond O(N) (and the O(N D)
# float32 input-gradient accumulator of this path), the work may take the larger of POLICY_MIN_BYTES and a tenth of
# the bytes that the N x V logits would take in bf16 (N V / 5 bytes), whatever the dtype. A tenth is small next to
# the logits (torch.compile's fwd+bwd holds about all of them) and covers the Triton backward's float32 accumulator
# of its own (4 N D bytes, 2 D / V of the bf16 logits) plus the lean 8 MiB scratch at every shape of BENCHMARKS.md
# (mistral-nemo needs the most, 7.8% + 0.4%), which removes its second pass (kernels/linear_head.py, _workspace):
# 157-475 MiB there. Tests shrink POLICY_MIN_BYTES to reach the plans of larger heads at small shapes.
POLICY_MIN_BYTES = 16 << 20
POLICY_LOGITS_DIVISOR = 10
# This path's (token chunk x vocab chunk) float32 block takes half of the budget, or a third with the options that
# need a temporary of the block's size (the softcap's chain factor in the backward, the entropy, smoothing).
_BLOCK_SHARE = 2
# Vocabulary chunks narrower than this make the products inefficient: below it the tokens are chunked instead.
_MIN_COLS = 1024
# The cross_entropy twin (logits given) walks chunks of this many classes.
_VOCAB_CHUNK = 4096
_CHUNK_ELEMS = 1 << 20


def default_workspace_bytes(n: int, V: int) -> int:
    """The default memory policy: bytes the work of a head of n tokens and V classes may take beyond O(n), the
    larger of POLICY_MIN_BYTES (16 MiB) and a tenth of n x V bf16 logits (n V / 5 bytes)."""
    return max(POLICY_MIN_BYTES, 2 * n * V // POLICY_LOGITS_DIVISOR)


def _block(n: int, V: int, temporaries: bool = False) -> tuple[int, int]:
    """(token rows, vocabulary columns) of one float32 block of this path: half of the policy's budget (a third
    with `temporaries` of the block's size), all n tokens at once while that leaves at least _MIN_COLS classes (the
    backward then writes each dW chunk once, and reads x once), else chunks of tokens."""
    elems = max(1, default_workspace_bytes(n, V) // (4 * (_BLOCK_SHARE + bool(temporaries))))
    cols = min(V, max(_MIN_COLS, elems // max(n, 1)))
    return max(1, min(n, elems // max(cols, 1))), max(1, cols)


NOT_DIFFERENTIABLE = ("logitless: the gradients of its ops (linear_cross_entropy, linear_log_probs, linear_logsumexp, "
                      "cross_entropy) are not differentiable (no double backward / create_graph=True through them)")


class _NotDifferentiable(torch.autograd.Function):
    """Identity on a backward's results; differentiating through it raises NOT_DIFFERENTIABLE. The first
    `n_anchors` arguments (tensors that require grad) only put the results in the graph, so that the error comes when
    they are differentiated, with respect to any of them (with one anchor, a gradient asked for with respect to
    another input would not reach this node, and PyTorch would say that input "appears to not have been used")."""

    @staticmethod
    def forward(ctx, n_anchors, *args):
        return tuple(o.view_as(o) for o in args[n_anchors:])

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(NOT_DIFFERENTIABLE)


def first_order_only(backward):
    """For an autograd.Function's backward, in place of torch's once_differentiable: the backward runs without a
    graph, and with create_graph=True its results come out attached to a node that raises NOT_DIFFERENTIABLE when
    they are differentiated (once_differentiable leaves them detached there, and the user gets torch's generic
    "does not require grad" error instead)."""

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        graph = torch.is_grad_enabled()
        # Before the backward: an in-place one bumps its saved buffer's version, after which it cannot be unpacked.
        anchors = [t for t in (*ctx.saved_tensors, *grads)
                   if isinstance(t, torch.Tensor) and t.requires_grad] if graph else []
        with torch.no_grad():
            outs = backward(ctx, *grads)
        idx = [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor)]
        if not anchors or not idx:
            return outs
        attached = _NotDifferentiable.apply(len(anchors), *anchors, *(outs[i] for i in idx))
        outs = list(outs)
        for i, o in zip(idx, attached, strict=True):
            outs[i] = o
        return tuple(outs)

    return wrapper


def _chunks(n: int, size: int):
    for start in range(0, n, size):
        yield start, min(start + size, n)


def _token_chunk(V: int) -> int:
    return max(16, _CHUNK_ELEMS // min(V, _VOCAB_CHUNK))


def _transform(z: torch.Tensor, softcap: float | None, inv_temp: float) -> torch.Tensor:
    """Raw float32 logits -> softcapped, temperature-scaled logits (in place where possible)."""
    if softcap is not None:
        z = torch.tanh(z / softcap).mul_(softcap)
    if inv_temp != 1.0:
        z = z * inv_temp
    return z


def _acc(dtype) -> torch.dtype:
    """Accumulation dtype: float32, or float64 for float64 inputs (which only the PyTorch path accepts)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _linear_chunk(x_c, w_c, b_c, softcap, inv_temp, out=None):
    """float32 logits of a (token chunk, vocab chunk) block: [Cn, Cv], a new tensor (or `out`), transformed in
    place."""
    acc = _acc(x_c.dtype)
    z = torch.mm(x_c.to(acc), w_c.to(acc).T, out=out)
    if b_c is not None:
        z += b_c.to(acc)
    if softcap is not None:
        z.div_(softcap).tanh_().mul_(softcap)
    if inv_temp != 1.0:
        z.mul_(inv_temp)
    return z


class _RowStats:
    """Online per-row statistics over vocabulary chunks: max, sum of exp, target logit, smoothing and entropy sums."""

    def __init__(self, n, device, dtype, target, ignore_index, want_smooth, want_entropy):
        f32 = dict(device=device, dtype=dtype)
        self.m = torch.full((n,), -math.inf, **f32)
        self.s = torch.zeros(n, **f32)
        self.target = target
        self.ignore_index = ignore_index
        self.zt = torch.zeros(n, **f32) if target is not None else None
        # sum_j w_j (z_j - ref): taken relative to the first chunk's row max to avoid cancellation later.
        self.ref = None
        self.sw = torch.zeros(n, **f32) if want_smooth else None
        # sum_j exp(z_j - m) (z_j - m), rescaled as m grows; gives the entropy without a second pass.
        self.ent = torch.zeros(n, **f32) if want_entropy else None

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
        self.s = self.s * alpha + d.exp_().sum(dim=1)
        self.m = m_new

    def logs(self):
        return torch.log(self.s)

    def entropy(self):
        # H = lse - sum p z = log s - sum exp(z - m)(z - m) / s
        return torch.log(self.s) - self.ent / self.s


def _head_forward(chunk_fn, n, V, device, dtype, target, ignore_index, class_w, want_smooth, want_entropy):
    """Run the online statistics over all (token chunk, vocab chunk) blocks (_block: all tokens at once where the
    budget allows). Returns per-row tensors (m, logs, zt, sw, ref, ent): the row max and log sum_j exp(z_j - m) are
    kept apart (lse = m + logs) because z_j - m is exact while a rounded float32 lse of a logit near 1e4 is off by
    ~1e-3, which would skew every p_j."""
    f = dict(device=device, dtype=dtype)
    m = torch.empty(n, **f)
    logs = torch.empty(n, **f)
    zt = torch.zeros(n, **f) if target is not None else None
    sw = torch.zeros(n, **f) if want_smooth else None
    ref = torch.zeros(n, **f) if want_smooth else None
    ent = torch.zeros(n, **f) if want_entropy else None
    rows, cols = _block(n, V, want_smooth or want_entropy)
    for i0, i1 in _chunks(n, rows):
        t_c = target[i0:i1] if target is not None else None
        st = _RowStats(i1 - i0, device, dtype, t_c, ignore_index, want_smooth, want_entropy)
        for v0, v1 in _chunks(V, cols):
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
    return m, logs, zt, sw, ref, ent


def _dz_chunk(z, m_c, logs_c, A_c, B_c, C_c, E_c, t_c, v0, v1, class_w_c, X_c=None):
    """dL/dz for one block: p (A + B (z - m)) - C [j == t] - E w. With X_c (ce_backward_coef(with_excess=True)), the
    target's column is p_t X + (p_t - 1) C, C then standing for C + E w_t: where p_t rounds to 1 (one class, a
    confident row), p_t A - C - E w_t would lose the z-loss term in the cancellation."""
    p = torch.exp((z - m_c[:, None]) - logs_c[:, None])
    if B_c is not None:
        dz = p * (A_c[:, None] + B_c[:, None] * (z - m_c[:, None]))
        dz = torch.where(p > 0, dz, torch.zeros_like(dz))  # p = 0 at z = -inf: 0, not 0 * inf
    else:
        dz = p.mul_(A_c[:, None])
    if E_c is not None:
        dz -= E_c[:, None] * (class_w_c[None, :] if class_w_c is not None else 1.0)
    if C_c is not None:
        inside = (t_c >= v0) & (t_c < v1)
        idx = (t_c - v0).clamp(0, v1 - v0 - 1)[:, None]
        if X_c is None:
            dz.scatter_add_(1, idx, torch.where(inside, -C_c, torch.zeros_like(C_c))[:, None])
        else:
            p_t = torch.exp((z.gather(1, idx)[:, 0] - m_c) - logs_c)
            d_t = p_t * X_c + (p_t - 1.0) * C_c
            dz.scatter_(1, idx, torch.where(inside, d_t, dz.gather(1, idx)[:, 0])[:, None])
    return dz


def _chain_transform(dz, raw, softcap, inv_temp):
    """dL/dz (after softcap and temperature) -> dL/d(raw logits). `raw` is the logit block before the transform."""
    if inv_temp != 1.0:
        dz = dz * inv_temp
    if softcap is not None:
        dz = dz * _softcap_slope(raw, softcap)
    return dz


def _softcap_slope(raw, softcap):
    """d(softcap tanh(u))/du at u = raw / softcap, as 4 s (1 - s) with s = sigmoid(-2 |u|) (= 1 / cosh(u)^2), in
    one block-sized buffer. PyTorch's 1 - tanh(u)^2 cancels where tanh saturates (20-60x PyTorch's float32 error
    there); this form has no cancellation (s <= 1/2) and stays within a few ulp everywhere."""
    s = (raw / softcap).abs_().mul_(-2.0).sigmoid_()
    return s.addcmul_(s, s, value=-1.0).mul_(4.0)


def _linear_head_backward(x, w, b, target, class_w, m, logs, coef, softcap, inv_temp, needs):
    """Gradients of a linear head given per-row coefficients coef = (A, B, C, E). Vocab-outer, so each chunk of
    dW is accumulated in float32 and written once; dx is accumulated in float32 over all vocabulary chunks. Each
    block's logits are recomputed into one preallocated buffer and turned into dL/dz there, in place; the products
    accumulate into the gradients with addmm_ (into dW directly when all tokens fit in one block). A fifth
    coefficient X (cross-entropy's, ce_backward_coef(with_excess=True)) sets the target's column apart (_dz_block)."""
    A, B, C, E, *excess = coef
    X = excess[0] if excess else None
    n, D = x.shape
    V = w.shape[0]
    need_x, need_w, need_b = needs
    acc = _acc(x.dtype)
    dx = torch.zeros(n, D, device=x.device, dtype=acc) if need_x else None
    dw = torch.empty_like(w) if need_w else None
    db = torch.empty_like(b) if need_b else None
    if n == 0 or V == 0:
        if dw is not None:
            dw.zero_()
        if db is not None:
            db.zero_()
        return (dx.to(x.dtype) if need_x else None), dw, db
    rows, cols = _block(n, V, B is not None or softcap is not None)
    one_block = rows >= n  # every token in each block: x is converted once, dW rows written by one product
    buf = torch.empty(rows * cols, device=x.device, dtype=acc)
    x_all = x.to(acc) if one_block else None
    A2, B2, C2, E2 = (None if c is None else c[:, None] for c in (A, B, C, E))
    m2, logs2 = m[:, None], logs[:, None]
    # p A = exp(z - m) (A / S), S = exp(logs) (at most V): one pass fewer over each block than exp((z - m) - logs) A,
    # and no rounding of (z - m) - logs inside the exponential.
    a_s = (A * torch.exp(-logs))[:, None] if B is None else None
    for v0, v1 in _chunks(V, cols):
        w_c = w[v0:v1].to(acc)
        b_c = b[v0:v1] if b is not None else None
        cw_c = class_w[v0:v1].to(acc) if class_w is not None else None
        direct = need_w and one_block and dw.dtype == acc  # the chunk's dW rows written by one product
        dw_c = None
        if need_w:
            dw_c = dw[v0:v1] if direct else torch.zeros(v1 - v0, D, device=x.device, dtype=acc)
        db_c = torch.zeros(v1 - v0, device=x.device, dtype=acc) if need_b else None
        for i0, i1 in _chunks(n, rows):
            x_c = x_all if one_block else x[i0:i1].to(acc)
            sl = slice(i0, i1)
            z = _linear_chunk(x_c, w_c, b_c, None, 1.0, out=buf[: (i1 - i0) * (v1 - v0)].view(i1 - i0, v1 - v0))
            chain = None
            if softcap is not None:  # the chain factor from the raw logits, then the cap in place
                chain = _softcap_slope(z, softcap)
                z.div_(softcap).tanh_().mul_(softcap)
            if inv_temp != 1.0:
                z.mul_(inv_temp)
            dz = _dz_block(z, m2[sl], logs2[sl], A2[sl] if a_s is None else a_s[sl], None if B2 is None else B2[sl],
                           None if C2 is None else C2[sl], None if E2 is None else E2[sl],
                           None if target is None else target[sl], v0, v1, cw_c,
                           None if X is None else X[sl, None], logs[sl, None])
            del z
            if inv_temp != 1.0:
                dz.mul_(inv_temp)
            if chain is not None:
                dz.mul_(chain)
                del chain
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
    return (dx.to(x.dtype) if need_x else None), dw, db


def _dz_block(z, m2, logs2, A2, B2, C2, E2, t_c, v0, v1, class_w_c, X2=None, lse_logs2=None):
    """dL/dz = p (A + B (z - m)) - C [j == t] - E w for a block of (temperature-scaled) logits z, written over z
    (the per-row coefficients as columns [rows, 1], B, C, E may be None). Without B, A2 is A / S (S = exp(logs)).
    With X2 (and lse_logs2, the rows' log S), the target's column is p_t X + (p_t - 1) C, as in _dz_chunk."""
    if X2 is not None:
        inside_t = ((t_c >= v0) & (t_c < v1))[:, None]
        idx_t = (t_c - v0).clamp(0, v1 - v0 - 1)[:, None]
        p_t = torch.exp((z.gather(1, idx_t) - m2) - lse_logs2)
    z.sub_(m2)  # z - m, exact
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
    if X2 is not None:
        d_t = p_t * X2 + (p_t - 1.0) * C2
        dz.scatter_(1, idx_t, torch.where(inside_t, d_t, dz.gather(1, idx_t)))
    elif C2 is not None:
        inside = (t_c >= v0) & (t_c < v1)
        idx = (t_c - v0).clamp(0, v1 - v0 - 1)
        dz.scatter_add_(1, idx[:, None], torch.where(inside[:, None], -C2, torch.zeros_like(C2)))
    return dz


# ---------------------------------------------------------------------------------------------------------------
# Cross-entropy coefficients, shared with the Triton path so both compute the same function.


def ce_row_terms(target, class_w, ignore_index, label_smoothing, V, dtype=torch.float32):
    """Per-row (valid mask as float, target class weight) and the sum of class weights, all float32."""
    valid = target != ignore_index
    if class_w is None:
        w_t = valid.to(dtype)
        w_sum = float(V)
    else:
        cw = class_w.to(dtype)
        w_t = cw[torch.where(valid, target, 0)] * valid
        w_sum = cw.sum()
    return valid, w_t, w_sum


def ce_loss_from_stats(m, logs, zt, sw, ref, valid, w_t, w_sum, label_smoothing, z_loss, V):
    """Per-token loss (0 at ignored rows) from the per-row forward statistics (lse = m + logs)."""
    # (Each op here is a launch and an autograd node on the host: none is spent on a factor of exactly 1.)
    eps = float(label_smoothing)
    if eps > 0.0:
        # sum_j w_j (lse - z_j) = W (lse - ref) - sum_j w_j (z_j - ref)
        loss = (1.0 - eps) * w_t * ((m - zt) + logs) + (eps / V) * (w_sum * ((m - ref) + logs) - sw)
    else:
        loss = w_t * ((m - zt) + logs)
    if z_loss > 0.0:
        lse = m + logs
        loss = loss + z_loss * lse * lse
    return torch.where(valid, loss, 0.0)


def ce_backward_coef(grad, lse, valid, w_t, w_sum, label_smoothing, z_loss, V, with_excess=False):
    """(A, B, C, E) of dL/dz = p (A + B (z - m)) - C [j == t] - E w for the cross-entropy loss, upstream `grad`.
    with_excess: (A, B, C + E w_t, E, X) for _dz_chunk's target column, X = E (W - w_t) + 2 g z_loss lse computed
    apart (W = w_sum), so that it survives where p_t rounds to 1."""
    eps = float(label_smoothing)
    g = torch.where(valid, grad.to(lse.dtype), torch.zeros_like(lse))
    C = g * (1.0 - eps) * w_t
    A = C + g * (eps / V) * w_sum
    X = g * (eps / V) * (w_sum - w_t)
    if z_loss > 0.0:
        zl = g * (2.0 * z_loss) * lse
        A = A + zl
        X = X + zl
    E = g * (eps / V) if eps > 0.0 else None
    if with_excess:
        return A, None, (C if E is None else C + E * w_t), E, X
    return A, None, C, E


def reduce_loss(per_token, valid, w_t, reduction, lead_shape):
    """Apply the reduction the way F.cross_entropy does (mean divides by the summed target weights)."""
    if reduction == "none":
        return per_token.reshape(lead_shape)
    total = per_token.sum()
    if reduction == "sum":
        return total
    return total / w_t.sum()


# ---------------------------------------------------------------------------------------------------------------
# autograd Functions of the PyTorch path.


class _LinearCrossEntropy(torch.autograd.Function):
    """Outputs (per-token loss, lse); the loss is 0 at ignored rows."""

    @staticmethod
    def forward(ctx, x, w, b, target, class_w, ignore_index, label_smoothing, z_loss, softcap):
        n, V = x.shape[0], w.shape[0]
        chunk = lambda i0, i1, v0, v1: _linear_chunk(
            x[i0:i1], w[v0:v1], None if b is None else b[v0:v1], softcap, 1.0
        )
        m, logs, zt, sw, ref, _ = _head_forward(chunk, n, V, x.device, _acc(x.dtype), target, ignore_index,
                                                class_w, label_smoothing > 0.0, False)
        valid, w_t, w_sum = ce_row_terms(target, class_w, ignore_index, label_smoothing, V, m.dtype)
        loss = ce_loss_from_stats(m, logs, zt, sw, ref, valid, w_t, w_sum, label_smoothing, z_loss, V)
        lse = m + logs
        ctx.save_for_backward(x, w, b, target, class_w, m, logs)
        ctx.opts = (ignore_index, label_smoothing, z_loss, softcap)
        ctx.mark_non_differentiable(lse)
        return loss, lse

    @staticmethod
    @first_order_only
    def backward(ctx, grad_loss, _grad_lse):
        x, w, b, target, class_w, m, logs = ctx.saved_tensors
        ignore_index, label_smoothing, z_loss, softcap = ctx.opts
        V = w.shape[0]
        valid, w_t, w_sum = ce_row_terms(target, class_w, ignore_index, label_smoothing, V, m.dtype)
        coef = ce_backward_coef(grad_loss, m + logs, valid, w_t, w_sum, label_smoothing, z_loss, V, with_excess=True)
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], b is not None and ctx.needs_input_grad[2])
        dx, dw, db = _linear_head_backward(x, w, b, target, class_w, m, logs, coef, softcap, 1.0, needs)
        return dx, dw, db, None, None, None, None, None, None


class _LinearLogProbs(torch.autograd.Function):
    """Outputs (log p of target, entropy, lse), each per row; log p and entropy are 0 at ignored rows."""

    @staticmethod
    def forward(ctx, x, w, b, target, ignore_index, softcap, inv_temp, want_entropy):
        n, V = x.shape[0], w.shape[0]
        chunk = lambda i0, i1, v0, v1: _linear_chunk(
            x[i0:i1], w[v0:v1], None if b is None else b[v0:v1], softcap, inv_temp
        )
        m, logs, zt, _, _, ent = _head_forward(chunk, n, V, x.device, _acc(x.dtype), target, ignore_index, None,
                                               False, want_entropy)
        valid = target != ignore_index
        zero = torch.zeros_like(m)
        logp = torch.where(valid, (zt - m) - logs, zero)
        ent = torch.where(valid, ent, zero) if ent is not None else zero.clone()
        lse = m + logs
        ctx.save_for_backward(x, w, b, target, m, logs, ent)
        ctx.opts = (ignore_index, softcap, inv_temp)
        ctx.mark_non_differentiable(lse)
        return logp, ent, lse

    @staticmethod
    @first_order_only
    def backward(ctx, grad_logp, grad_ent, _grad_lse):
        x, w, b, target, m, logs, ent = ctx.saved_tensors
        ignore_index, softcap, inv_temp = ctx.opts
        coef = log_probs_backward_coef(grad_logp, grad_ent, logs, ent, target != ignore_index)
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], b is not None and ctx.needs_input_grad[2])
        dx, dw, db = _linear_head_backward(x, w, b, target, None, m, logs, coef, softcap, inv_temp, needs)
        return dx, dw, db, None, None, None, None, None


def log_probs_backward_coef(grad_logp, grad_ent, logs, ent, valid):
    """d log p_t/dz_j = [j == t] - p_j ;  dH/dz_j = -p_j (z_j - mu), mu = sum p z = lse - H, written as
    p_j ((logs - H) - (z_j - m)) so that B multiplies z - m (A is relative to the row max m, lse = m + logs)."""
    zero = torch.zeros_like(logs)
    g_lp = torch.where(valid, grad_logp.to(logs.dtype), zero) if grad_logp is not None else zero
    A = -g_lp
    B = None
    if grad_ent is not None:
        g_h = torch.where(valid, grad_ent.to(logs.dtype), zero)
        A = A + g_h * (logs - ent)
        B = -g_h
    return A, B, -g_lp, None


class _LinearLogSumExp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, softcap, inv_temp):
        n, V = x.shape[0], w.shape[0]
        chunk = lambda i0, i1, v0, v1: _linear_chunk(
            x[i0:i1], w[v0:v1], None if b is None else b[v0:v1], softcap, inv_temp
        )
        m, logs = _head_forward(chunk, n, V, x.device, _acc(x.dtype), None, 0, None, False, False)[:2]
        ctx.save_for_backward(x, w, b, m, logs)
        ctx.opts = (softcap, inv_temp)
        return m + logs

    @staticmethod
    @first_order_only
    def backward(ctx, grad_lse):
        x, w, b, m, logs = ctx.saved_tensors
        softcap, inv_temp = ctx.opts
        coef = (grad_lse.to(m.dtype), None, None, None)
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], b is not None and ctx.needs_input_grad[2])
        dx, dw, db = _linear_head_backward(x, w, b, None, None, m, logs, coef, softcap, inv_temp, needs)
        return dx, dw, db, None, None


class _CrossEntropy(torch.autograd.Function):
    """With `inplace`, the backward writes the gradient over the saved logits chunk by chunk (each chunk is read
    before it is overwritten), so no second N x V buffer is allocated; it can then run only once."""

    @staticmethod
    def forward(ctx, logits, target, class_w, ignore_index, label_smoothing, z_loss, softcap, inplace=False):
        n, V = logits.shape
        acc = _acc(logits.dtype)
        chunk = lambda i0, i1, v0, v1: _transform(logits[i0:i1, v0:v1].to(acc), softcap, 1.0)
        m, logs, zt, sw, ref, _ = _head_forward(chunk, n, V, logits.device, acc, target, ignore_index, class_w,
                                                label_smoothing > 0.0, False)
        valid, w_t, w_sum = ce_row_terms(target, class_w, ignore_index, label_smoothing, V, acc)
        loss = ce_loss_from_stats(m, logs, zt, sw, ref, valid, w_t, w_sum, label_smoothing, z_loss, V)
        lse = m + logs
        ctx.save_for_backward(logits, target, class_w, m, logs)
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
        logits, target, class_w, m, logs = ctx.saved_tensors
        ignore_index, label_smoothing, z_loss, softcap = ctx.opts
        n, V = logits.shape
        valid, w_t, w_sum = ce_row_terms(target, class_w, ignore_index, label_smoothing, V, m.dtype)
        A, B, C, E, X = ce_backward_coef(grad_loss, m + logs, valid, w_t, w_sum, label_smoothing, z_loss, V,
                                         with_excess=True)
        grad = logits if ctx.inplace else torch.empty_like(logits)
        for i0, i1 in _chunks(n, _token_chunk(V)):
            sl = slice(i0, i1)
            for v0, v1 in _chunks(V, _VOCAB_CHUNK):
                raw = logits[sl, v0:v1].to(m.dtype)
                z = _transform(raw, softcap, 1.0)
                dz = _dz_chunk(z, m[sl], logs[sl], A[sl], None, C[sl], None if E is None else E[sl], target[sl],
                               v0, v1, None if class_w is None else class_w[v0:v1], X[sl])
                grad[sl, v0:v1] = _chain_transform(dz, raw, softcap, 1.0)
        return grad, None, None, None, None, None, None, None


# ---------------------------------------------------------------------------------------------------------------
# The twins: same signatures as the public functions (minus `backend`). They validate their arguments.


def _class_weight_acc(weight, dtype):
    return None if weight is None else weight.to(_acc(dtype))


def one_class_logits(args, softcap, inv_temp):
    """(N,) logits of a head with a single class (V = 1), through differentiable PyTorch ops. With one class the
    softmax is exactly 1 and lse = z, so cross-entropy, smoothing, log-probs and entropy are exactly 0 (only the
    z-loss and the log-sum-exp are not); the general paths reach those zeros only up to the rounding of a
    recomputed logit, which leaves gradients of ~1e-7 where PyTorch's are exactly 0. N values: nothing to chunk."""
    acc = _acc(args.x.dtype)
    z = args.x.to(acc) @ args.weight[0].to(acc)
    if args.bias is not None:
        z = z + args.bias[0].to(acc)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z * inv_temp if inv_temp != 1.0 else z


def _no_autocast(fn):
    """The PyTorch path computes in the inputs' dtypes (float32 math), as the Triton kernels do: autocast, which
    would run its chunks' products in bfloat16, is off inside (the backward runs without it anyway)."""

    @functools.wraps(fn)
    def wrapper(args, *rest, **kw):
        x = args if isinstance(args, torch.Tensor) else args.x
        with torch.autocast(x.device.type, enabled=False):
            return fn(args, *rest, **kw)

    return wrapper


@_no_autocast
def lce_torch(args, weight, reduction, ignore_index, label_smoothing, z_loss, softcap):
    """PyTorch path on validated arguments (see linear_cross_entropy)."""
    class_w = _class_weight_acc(weight, args.x.dtype)
    if args.weight.shape[0] == 1:
        z = one_class_logits(args, softcap, 1.0)
        valid, w_t, _ = ce_row_terms(args.target, class_w, ignore_index, label_smoothing, 1, z.dtype)
        per_token = torch.where(valid, z * z * float(z_loss), 0.0)  # (lse - z_t) and smoothing are exactly 0
        return reduce_loss(per_token, valid, w_t, reduction, args.lead_shape)
    per_token, _ = _LinearCrossEntropy.apply(
        args.x, args.weight, args.bias, args.target, class_w, ignore_index, float(label_smoothing), float(z_loss),
        None if softcap is None else float(softcap),
    )
    valid, w_t, _ = ce_row_terms(args.target, class_w, ignore_index, label_smoothing, args.weight.shape[0],
                                 per_token.dtype)
    return reduce_loss(per_token, valid, w_t, reduction, args.lead_shape)


def linear_cross_entropy(input, linear_weight, target, *, linear_bias=None, weight=None, reduction="mean",
                         ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None):
    """Chunked PyTorch twin of :func:`logitless.linear_cross_entropy`."""
    _validate.check_no_transform("reference.linear_cross_entropy")
    ignore_index = _validate.ignore_index_arg(ignore_index)
    _validate.check_options(reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
                            ignore_index=ignore_index)
    args = _validate.linear_head(input, linear_weight, target, linear_bias, ignore_index)
    weight = _validate.check_class_weight(weight, linear_weight.shape[0], input.device)
    return lce_torch(args, weight, reduction, ignore_index, label_smoothing, z_loss, softcap)


@_no_autocast
def log_probs_torch(args, ignore_index, softcap, temperature, return_entropy):
    if args.weight.shape[0] == 1:
        zero = one_class_logits(args, softcap, 1.0 / float(temperature)) * 0.0  # log 1 = 0, and no entropy
        logp = torch.where(args.target != ignore_index, zero, 0.0).reshape(args.lead_shape)
        return (logp, logp.clone()) if return_entropy else logp
    logp, ent, _ = _LinearLogProbs.apply(
        args.x, args.weight, args.bias, args.target, ignore_index, None if softcap is None else float(softcap),
        1.0 / float(temperature), bool(return_entropy),
    )
    logp = logp.reshape(args.lead_shape)
    if return_entropy:
        return logp, ent.reshape(args.lead_shape)
    return logp


def linear_log_probs(input, linear_weight, target, *, linear_bias=None, softcap=None, temperature=1.0,
                     ignore_index=-100, return_entropy=False):
    """Chunked PyTorch twin of :func:`logitless.linear_log_probs`."""
    _validate.check_no_transform("reference.linear_log_probs")
    ignore_index = _validate.ignore_index_arg(ignore_index)
    _validate.check_flag("return_entropy", return_entropy)
    _validate.check_options(softcap=softcap, temperature=temperature, ignore_index=ignore_index)
    args = _validate.linear_head(input, linear_weight, target, linear_bias, ignore_index)
    return log_probs_torch(args, ignore_index, softcap, temperature, return_entropy)


@_no_autocast
def logsumexp_torch(args, softcap, temperature):
    if args.weight.shape[0] == 1:
        return one_class_logits(args, softcap, 1.0 / float(temperature)).reshape(args.lead_shape)
    lse = _LinearLogSumExp.apply(args.x, args.weight, args.bias, None if softcap is None else float(softcap),
                                 1.0 / float(temperature))
    return lse.reshape(args.lead_shape)


def linear_logsumexp(input, linear_weight, *, linear_bias=None, softcap=None, temperature=1.0):
    """Chunked PyTorch twin of :func:`logitless.linear_logsumexp`."""
    _validate.check_no_transform("reference.linear_logsumexp")
    _validate.check_options(softcap=softcap, temperature=temperature)
    args = _validate.linear_head(input, linear_weight, None, linear_bias, -100)
    return logsumexp_torch(args, softcap, temperature)


@_no_autocast
def cross_entropy_torch(logits2d, target, lead_shape, weight, reduction, ignore_index, label_smoothing, z_loss,
                        softcap, return_lse=False, inplace_backward=False):
    class_w = _class_weight_acc(weight, logits2d.dtype)
    per_token, lse = _CrossEntropy.apply(logits2d, target, class_w, ignore_index, float(label_smoothing),
                                         float(z_loss), None if softcap is None else float(softcap),
                                         bool(inplace_backward))
    valid, w_t, _ = ce_row_terms(target, class_w, ignore_index, label_smoothing, logits2d.shape[1], per_token.dtype)
    loss = reduce_loss(per_token, valid, w_t, reduction, lead_shape)
    return (loss, lse.reshape(lead_shape)) if return_lse else loss


def cross_entropy(logits, target, *, weight=None, reduction="mean", ignore_index=-100, label_smoothing=0.0,
                  z_loss=0.0, softcap=None, inplace_backward=False, return_lse=False):
    """Chunked PyTorch twin of :func:`logitless.cross_entropy` (`return_lse` gives a plain (loss, lse) tuple)."""
    _validate.check_no_transform("reference.cross_entropy")
    ignore_index = _validate.ignore_index_arg(ignore_index)
    _validate.check_options(reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
                            ignore_index=ignore_index)
    logits2d, t, lead_shape = _validate.logits_head(logits, target, ignore_index)
    weight = _validate.check_class_weight(weight, logits2d.shape[1], logits.device)
    return cross_entropy_torch(logits2d, t, lead_shape, weight, reduction, ignore_index, label_smoothing, z_loss,
                               softcap, return_lse=return_lse, inplace_backward=inplace_backward)


# ---------------------------------------------------------------------------------------------------------------
# Materialising compositions of PyTorch ops (ground truth for tests, the eager peer in benchmarks).


def _tanh_truth(u: torch.Tensor) -> torch.Tensor:
    """tanh whose autograd derivative stays accurate where tanh saturates, for the float64 truth: PyTorch's
    backward, 1 - tanh(u)^2, is exactly 0 in float64 past |u| ~ 19, where the true slope (4e-24 at |u| = 27) is
    what a float32 kernel still resolves. sign(u) (1 - 2 sigmoid(-2|u|)) differentiates to 4 s (1 - s) with
    s = sigmoid(-2|u|) small and exact; torch.tanh below |u| = 1/2, where its backward does not cancel."""
    a = u.abs()
    far = torch.sign(u) * (1.0 - 2.0 * torch.sigmoid(-2.0 * a))
    return torch.where(a < 0.5, torch.tanh(u), far)


def naive_softcap(z: torch.Tensor, softcap: float) -> torch.Tensor:
    """softcap tanh(z / softcap) as PyTorch computes it; in float64 (the tests' truth) accurately differentiable
    where tanh saturates (_tanh_truth)."""
    tanh = _tanh_truth if z.dtype == torch.float64 else torch.tanh
    return softcap * tanh(z / softcap)


def naive_logits(input, linear_weight, linear_bias=None, softcap=None, temperature=1.0):
    z = F.linear(input, linear_weight, linear_bias)
    if softcap is not None:
        z = naive_softcap(z, softcap)
    if temperature != 1.0:
        z = z / temperature
    return z


def naive_cross_entropy(logits, target, *, weight=None, reduction="mean", ignore_index=-100, label_smoothing=0.0,
                        z_loss=0.0, softcap=None, upcast=True):
    """F.cross_entropy plus z-loss on materialised logits; computes in float32 (or the logits' dtype if wider)
    when `upcast`, else in the logits' own dtype."""
    if upcast and logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    if softcap is not None:
        logits = naive_softcap(logits, softcap)
    V = logits.shape[-1]
    z = logits.reshape(-1, V)
    t = target.reshape(-1).long()
    w = None if weight is None else weight.to(z.dtype)
    per = F.cross_entropy(z, t, weight=w, reduction="none", ignore_index=ignore_index,
                          label_smoothing=label_smoothing)
    valid = t != ignore_index
    if z_loss > 0.0:
        lse = torch.logsumexp(z, dim=-1)
        per = per + torch.where(valid, z_loss * lse * lse, torch.zeros_like(lse))
    if reduction == "none":
        return per.reshape(target.shape)
    if reduction == "sum":
        return per.sum()
    safe_t = torch.where(valid, t, torch.zeros_like(t))
    denom = valid.to(z.dtype).sum() if w is None else (w[safe_t] * valid).sum()
    return per.sum() / denom


def naive_linear_cross_entropy(input, linear_weight, target, *, linear_bias=None, weight=None, reduction="mean",
                               ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None, upcast=True):
    z = F.linear(input, linear_weight, linear_bias)
    return naive_cross_entropy(z, target, weight=weight, reduction=reduction, ignore_index=ignore_index,
                               label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap, upcast=upcast)


def naive_linear_log_probs(input, linear_weight, target, *, linear_bias=None, softcap=None, temperature=1.0,
                           ignore_index=-100, return_entropy=False, upcast=True):
    z = F.linear(input, linear_weight, linear_bias)
    if upcast and z.dtype in (torch.bfloat16, torch.float16):
        z = z.float()
    if softcap is not None:
        z = naive_softcap(z, softcap)
    z = z / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    valid = target != ignore_index
    safe_t = torch.where(valid, target, torch.zeros_like(target)).long()
    logp = logp_all.gather(-1, safe_t.unsqueeze(-1)).squeeze(-1)
    logp = torch.where(valid, logp, torch.zeros_like(logp))
    if not return_entropy:
        return logp
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, torch.where(valid, ent, torch.zeros_like(ent))


def naive_linear_logsumexp(input, linear_weight, *, linear_bias=None, softcap=None, temperature=1.0, upcast=True):
    z = F.linear(input, linear_weight, linear_bias)
    if upcast and z.dtype in (torch.bfloat16, torch.float16):
        z = z.float()
    if softcap is not None:
        z = naive_softcap(z, softcap)
    return torch.logsumexp(z / temperature, dim=-1)
