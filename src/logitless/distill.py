"""Two heads, no logits: distillation losses (KL, generalized JSD) and the soft cross-entropy between two heads.

Both heads project hidden states onto the same vocabulary: the student's ``z_s = softcap(x_s W_s^T + b_s) / T``
and the teacher's ``z_t = softcap(x_t W_t^T + b_t) / T``. Every loss here is a per-row sum over the vocabulary of
terms in ``p_s = softmax(z_s)`` and ``p_t = softmax(z_t)``, computed tile by tile from per-row statistics
(docs/math.md, "Two heads"): pass 1 runs an online log-sum-exp of both heads, with the cross sum
``sum_j e_a (z_a - z_b)`` of the weighting head ``a`` rescaled as its maximum grows (one pass gives both KL
directions and the soft cross-entropy); the generalized JSD needs the normalised distributions inside its
logarithm and makes a second pass. The backward recomputes both heads' tiles and forms the student's ``dL/dz`` per
tile; only the student gets gradients (the teacher is treated as a constant, whatever its ``requires_grad``).

Layers, as for the other ops: public functions (validation, dispatch, reduction) -> per backend an autograd
node (``_TwoHeadsTorch``, the chunked PyTorch twin; the torch.library ops ``logitless::two_heads_loss`` and
``logitless::two_heads_grad`` around kernels/two_heads.py) -> per-row statistics -> ``row_loss``, shared by both
backends. logitless.testing.naive_two_heads builds full logits with PyTorch's own ops: ground truth for the tests
(in float64) and the eager peer of the benchmark.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from . import _validate, loss_math
from ._autograd import first_order_only, no_double_backward, no_setup
from .head import choose_backend
from .torch_backend import blocks
from .torch_backend.blocks import chunks, token_chunk

# The losses, by the divergence each row computes (see row_loss):
#   "fkl"  KL(p_t || p_s)          weights p_t   dL/dz_s = p_s - p_t
#   "rkl"  KL(p_s || p_t)          weights p_s   dL/dz_s = p_s (log p_s - log p_t - KL)
#   "ce"   -sum_j p_t log p_s      weights p_t   dL/dz_s = p_s - p_t
#   "jsd"  beta KL(p_t || M) + (1 - beta) KL(p_s || M),  M = beta p_t + (1 - beta) p_s
#                                                 dL/dz_s = (1 - beta) p_s (log p_s - log M - KL(p_s || M))
KINDS = ("fkl", "rkl", "ce", "jsd")
DIRECTIONS = ("forward", "reverse")


def weights_student(kind: str) -> bool:
    """Whether pass 1's cross sum and reference follow the student's softmax (reverse KL; the JSD, which uses only
    the reference) or the teacher's."""
    return kind in ("rkl", "jsd")


class TwoHeadArgs(NamedTuple):
    """Validated, flattened arguments: xs (N, Ds), ws (V, Ds), xt (N, Dt), wt (V, Dt), valid (N,) bool or None."""

    xs: torch.Tensor
    ws: torch.Tensor
    bs: torch.Tensor | None
    xt: torch.Tensor
    wt: torch.Tensor
    bt: torch.Tensor | None
    valid: torch.Tensor | None
    lead_shape: torch.Size


def _prefixed(prefix: str, fn, *args):
    try:
        return fn(*args)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{prefix}: {e}") from None


def validate(student_input, student_weight, teacher_input, teacher_weight, student_bias, teacher_bias, target,
             ignore_index, names=("student", "teacher")) -> TwoHeadArgs:
    """Check both heads (shapes, dtypes, devices, one vocabulary) and the optional target; the teacher's tensors
    come back detached (no gradient reaches them)."""
    a, b = names
    xs, lead = _prefixed(f"{a} head (input, linear_weight, linear_bias = {a}_input, {a}_weight, {a}_bias)",
                         _validate.check_linear, student_input, student_weight, student_bias)
    xt, lead_t = _prefixed(f"{b} head (input, linear_weight, linear_bias = {b}_input, {b}_weight, {b}_bias)",
                           _validate.check_linear, teacher_input, teacher_weight, teacher_bias)
    if lead != lead_t:
        raise ValueError(f"{a}_input has leading shape {tuple(lead)} but {b}_input has {tuple(lead_t)}: the two "
                         "heads score the same tokens")
    if student_weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(f"{a}_weight has {student_weight.shape[0]} classes but {b}_weight has "
                         f"{teacher_weight.shape[0]}: the two heads need one vocabulary")
    if xs.dtype != xt.dtype:
        raise TypeError(f"{a} head is {xs.dtype} but {b} head is {xt.dtype}: use one dtype for both")
    if xs.device != xt.device:
        raise ValueError(f"{a} head is on {xs.device} but {b} head is on {xt.device}")
    valid = None
    if target is not None:
        if not isinstance(target, torch.Tensor):
            raise TypeError(f"target must be a torch.Tensor or None, got {type(target).__name__}")
        if target.dtype not in _validate.INDEX_DTYPES and target.dtype != torch.bool:
            raise TypeError(f"target must be int64/int32 labels (rows equal to ignore_index are ignored) or a bool "
                            f"mask (True = keep), got {target.dtype}")
        if target.shape != lead:
            raise ValueError(f"target has shape {tuple(target.shape)} but the inputs' leading shape is {tuple(lead)}")
        if target.device != xs.device:
            raise ValueError(f"target is on {target.device} but the inputs are on {xs.device}")
        t = target.reshape(-1)
        valid = (t if t.dtype == torch.bool else t != ignore_index).contiguous()
    bt = None if teacher_bias is None else teacher_bias.detach()
    return TwoHeadArgs(xs, student_weight, student_bias, xt.detach(), teacher_weight.detach(), bt, valid, lead)


def check_beta(beta) -> float:
    if isinstance(beta, (torch.Tensor, bool)) or not isinstance(beta, (int, float)):
        raise TypeError(f"beta must be a Python float, got {type(beta).__name__}")
    if not 0.0 <= float(beta) <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    return float(beta)


# ---------------------------------------------------------------------------------------------------------------
# Per-row statistics -> per-row loss and the backward's row term; shared by both backends.


class RowStats(NamedTuple):
    """Per-row float32 statistics of both heads (lse = m + logs for each) and of the weighting head a (the student
    for the reverse KL and the JSD, the teacher otherwise; b the other): ea = E_a[z_a - m_a] (for the soft
    cross-entropy), zr = z_b at a's argmax (the reference), da = E_a[(z_a - m_a) - (z_b - zr)], and
    dl = logs_b - logs_a formed as log(s_b / s_a), or near agreement from sum_j e_a expm1(delta_j) (loss_math.log_ratio;
    not for the JSD). For the JSD, kt = KL(p_t || M) from the second pass and ks
    relative to the reference: sum_j p_s (d_j - d_ref), d = log p_s - log M and d_ref its value at the student's
    argmax (dref; None otherwise). Both of da's terms, and d - d_ref, are 0 at a's argmax: where p_a is nearly one-hot,
    the sums are the small terms of the other classes instead of differences of logit-sized numbers; and near
    agreement the two log-sums are ~log V each, whose own roundings (2.4e-7 at V = 100) would be most of a small
    divergence's error (docs/math.md)."""

    m_s: torch.Tensor
    logs_s: torch.Tensor
    m_t: torch.Tensor
    logs_t: torch.Tensor
    ea: torch.Tensor | None
    da: torch.Tensor | None
    kt: torch.Tensor | None = None
    ks: torch.Tensor | None = None
    zr: torch.Tensor | None = None
    dl: torch.Tensor | None = None
    dref: torch.Tensor | None = None


def row_loss(kind: str, beta: float, st: RowStats):
    """(per-row loss, the row term R of the student's gradient or None, and the teacher's two row statistics of
    dz_student, t_ref and t_aux: m_t and logs_t, but for the reverse KL t_ref is the teacher's logit at the
    student's argmax, and for the JSD t_aux is logs_s - logs_t). The terms are each small where the loss is
    (docs/math.md): no difference of logit-sized numbers is left to cancel."""
    if kind == "fkl":  # E_t[z_t - z_s] - lse_t + lse_s, with E_t[z_t - z_s] = da + m_t - zr
        # R = dl: dL/dz_s = p_s - p_t = -p_s expm1(log p_t - log p_s) near agreement (dz_student)
        return st.da + ((st.m_s - st.zr) + st.dl), st.dl, st.m_t, st.logs_t
    if kind == "rkl":  # E_s[z_s - z_t] - lse_s + lse_t
        # dL/dz_s = p_s (l_s - l_t - KL) = p_s ((z_s - m_s) - (z_t - zr) - da): da is R, zr the teacher's reference.
        return st.da + ((st.m_t - st.zr) + st.dl), st.da, st.zr, st.logs_t
    if kind == "ce":  # lse_s - E_t[z_s] = (m_s - zr) + logs_s - E_t[z_t - m_t] + da
        return st.da + ((st.m_s - st.zr) + st.logs_s - st.ea), st.dl, st.m_t, st.logs_t
    # R: (ks, u at the student's argmax); dz_student's row term is d - d_ref - ks, 0 at the argmax's own class
    # (a = the student: dl = logs_t - logs_s, so u = lt - ls takes -dl)
    u_ref = (st.zr - st.m_t) - st.dl
    return beta * st.kt + (1.0 - beta) * (st.ks + st.dref), torch.stack([st.ks, u_ref]), st.m_t, -st.dl


def reduce_rows(per_row: torch.Tensor, valid: torch.Tensor | None, reduction: str, lead_shape) -> torch.Tensor:
    """0 at ignored rows; "mean" divides by the number of kept rows (NaN when there are none, as PyTorch's
    cross-entropy does), as a tensor (no host sync)."""
    if valid is not None:
        per_row = torch.where(valid, per_row, 0.0)
    if reduction == "none":
        return per_row.reshape(lead_shape)
    total = per_row.sum()
    if reduction == "sum":
        return total
    count = valid.sum() if valid is not None else per_row.new_tensor(float(per_row.numel()))
    return total / count


def dz_student(kind: str, beta: float, zs, zt, m_s, logs_s, m_t, logs_t, R, g):
    """dL/dz_s of a block (float32 or float64), rows scaled by the upstream gradient g (0 at ignored rows); m_t is
    row_loss's teacher reference."""
    ls = (zs - m_s[:, None]) - logs_s[:, None]
    ps = torch.exp(ls)
    if kind in ("fkl", "ce"):
        # R is dl = logs_s - logs_t here (row_loss). Near agreement p_s - p_t cancels to ~an ulp of p (3e-8 at
        # p ~ 0.5 against differences of 1e-4); -p_s expm1(u), u = log p_t - log p_s, is exact to an ulp of itself.
        u = _lt_minus_ls(zs, zt, m_s, m_t, R)
        near = u.abs() < 0.5
        dz = torch.where(near, -ps * torch.expm1(torch.where(near, u, 0.0)),
                         ps - torch.exp((zt - m_t[:, None]) - logs_t[:, None]))
    else:
        if kind == "rkl":  # m_t is the teacher's logit at the student's argmax and R = da (row_loss)
            inner = (zs - m_s[:, None]) - (zt - m_t[:, None]) - R[:, None]
            scale = 1.0
        else:
            # logs_t is logs_s - logs_t here (row_loss)
            d_ref = _mix_terms(R[1], beta)[0]
            inner = (_mix_terms(_lt_minus_ls(zs, zt, m_s, m_t, logs_t), beta)[0] - d_ref[:, None]) - R[0][:, None]
            scale = 1.0 - beta
        dz = torch.where(ps > 0, ps * inner, 0.0)
        if scale != 1.0:
            dz = dz * scale
    return dz * g[:, None]


def _lt_minus_ls(zs, zt, m_s, m_t, dl):
    """log p_t - log p_s of a block from each head's logits relative to its maximum (small where either head's
    mass is) and dl = logs_s - logs_t formed as log(s_s / s_t): neither the logits' size nor the log-sums' (~log V)
    rounding enters it."""
    return ((zt - m_t[:, None]) - (zs - m_s[:, None])) + dl[:, None]


def _mix_terms(u, beta):
    """(log p_s - log M, log p_t - log M) for u = log p_t - log p_s, 0 < beta < 1, from
    L = log1p(beta expm1(u)) for u <= 1 and log1p((1 - beta) / beta e^-u) for u > 1 (no overflow; that form
    cancels near u = 0): -L - [u > 1] (u + log beta) and [u > 1] (-log beta - L) + [u <= 1] (u + log p_s - log M).
    From l_s and log M taken apart, both ~log V, the difference kept their roundings (2.4e-7 each at V = 100)
    against values of 1e-3 where the heads nearly agree."""
    big = u > 1.0
    L = torch.log1p(torch.where(big, (1.0 - beta) / beta * torch.exp(-u.clamp(min=1.0)),
                                beta * torch.expm1(u.clamp(max=1.0))))
    d_s = -L - torch.where(big, u + math.log(beta), 0.0)
    d_t = torch.where(big, -math.log(beta) - L, u + d_s)
    return d_s, d_t


# ---------------------------------------------------------------------------------------------------------------
# The chunked PyTorch twin


def _chunk_logits(x, w, b, i0, i1, v0, v1, softcap, inv_temp):
    return blocks.linear_chunk(x[i0:i1], w[v0:v1], None if b is None else b[v0:v1], softcap, inv_temp)


def torch_stats(a: TwoHeadArgs, kind: str, beta: float, softcap, inv_temp) -> RowStats:
    """RowStats in token chunks x vocabulary chunks (never N x V): pass 1 online, pass 2 for the JSD."""
    n, V = a.xs.shape[0], a.ws.shape[0]
    acc = blocks.acc_dtype(a.xs.dtype)
    f = dict(device=a.xs.device, dtype=acc)
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
            zs = _chunk_logits(a.xs, a.ws, a.bs, i0, i1, v0, v1, softcap, inv_temp)
            zt = _chunk_logits(a.xt, a.wt, a.bt, i0, i1, v0, v1, softcap, inv_temp)
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
                tsum = loss_math.move_t(tsum, s_a, w, (ref - new_ref) - shift, ref - new_ref) + loss_math.t_terms(
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
        out["dl"][sl] = loss_math.log_ratio(s_b, s_a, m_b, ref, tsum if want_t else None)
    if kind != "jsd":
        return RowStats(out["m_s"], out["logs_s"], out["m_t"], out["logs_t"], out["ea"], out["da"], zr=out["zr"],
                        dl=out["dl"])
    d_ref = _mix_terms((out["zr"] - out["m_t"]) - out["dl"], beta)[0]  # at the student's argmax (RowStats)
    for i0, i1 in chunks(n, cn):
        sl = slice(i0, i1)
        kt = torch.zeros(i1 - i0, **f)
        ks = torch.zeros(i1 - i0, **f)
        for v0, v1 in chunks(V, blocks.VOCAB_CHUNK):
            zs = _chunk_logits(a.xs, a.ws, a.bs, i0, i1, v0, v1, softcap, inv_temp)
            zt = _chunk_logits(a.xt, a.wt, a.bt, i0, i1, v0, v1, softcap, inv_temp)
            ls = (zs - out["m_s"][sl, None]) - out["logs_s"][sl, None]
            lt = (zt - out["m_t"][sl, None]) - out["logs_t"][sl, None]
            u = _lt_minus_ls(zs, zt, out["m_s"][sl], out["m_t"][sl], -out["dl"][sl])
            d_s, d_t = _mix_terms(u, beta)  # l_s - log M, l_t - log M
            pt, ps = torch.exp(lt), torch.exp(ls)
            kt += torch.where(pt > 0, pt * d_t, 0.0).sum(1)
            ks += torch.where(ps > 0, ps * (d_s - d_ref[sl, None]), 0.0).sum(1)
        out["kt"][sl], out["ks"][sl] = kt, ks
    return RowStats(out["m_s"], out["logs_s"], out["m_t"], out["logs_t"], None, None, out["kt"], out["ks"],
                    zr=out["zr"], dl=out["dl"], dref=d_ref)


def torch_backward(a: TwoHeadArgs, kind, beta, softcap, inv_temp, st: RowStats, R, g, needs):
    """(dx_s, dW_s, db_s) for the upstream per-row gradient g: vocabulary-outer, each dW_s block accumulated in
    float32 and written once, dx_s accumulated in float32; both heads' blocks recomputed."""
    xs, ws, bs = a.xs, a.ws, a.bs
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
            zt = _chunk_logits(a.xt, a.wt, a.bt, i0, i1, v0, v1, softcap, inv_temp)
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
    """Per-row loss of the student head against the teacher head (PyTorch path); gradients to xs, ws, bs."""

    @staticmethod
    def forward(ctx, xs, ws, bs, a, kind, beta, softcap, inv_temp):
        a = a._replace(xs=xs, ws=ws, bs=bs)
        st = torch_stats(a, kind, beta, softcap, inv_temp)
        loss, R, t_ref, t_aux = row_loss(kind, beta, st)
        ctx.save_for_backward(xs, ws, bs, a.xt, a.wt, a.bt, st.m_s, st.logs_s, t_ref, t_aux, R)
        ctx.opts = (kind, beta, softcap, inv_temp)
        return loss

    @staticmethod
    @first_order_only
    def backward(ctx, g):
        xs, ws, bs, xt, wt, bt, m_s, logs_s, m_t, logs_t, R = ctx.saved_tensors
        kind, beta, softcap, inv_temp = ctx.opts
        a = TwoHeadArgs(xs, ws, bs, xt, wt, bt, None, xs.shape[:-1])
        st = RowStats(m_s, logs_s, m_t, logs_t, None, None)
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bs is not None and ctx.needs_input_grad[2])
        dx, dw, db = torch_backward(a, kind, beta, softcap, inv_temp, st, R, g.to(m_s.dtype), needs)
        return dx, dw, db, None, None, None, None, None


# The Triton path as two torch.library ops (torch.compile sees each as one opaque op): the per-row loss with the
# statistics its backward needs, and the student's gradients.

_LOSS_SCHEMA = ("(Tensor xs, Tensor ws, Tensor? bs, Tensor xt, Tensor wt, Tensor? bt, str kind, float beta, "
                "float? softcap, float inv_temp, int? workspace_bytes) -> (Tensor, Tensor, Tensor, Tensor, Tensor, "
                "Tensor)")
_GRAD_SCHEMA = ("(Tensor xs, Tensor ws, Tensor? bs, Tensor xt, Tensor wt, Tensor? bt, Tensor m_s, Tensor logs_s, "
                "Tensor m_t, Tensor logs_t, Tensor R, Tensor g, str kind, float beta, float? softcap, "
                "float inv_temp, bool need_dx, bool need_dw, bool need_db, int? workspace_bytes) "
                "-> (Tensor, Tensor, Tensor)")


@torch.library.custom_op("logitless::two_heads_loss", mutates_args=(), schema=_LOSS_SCHEMA)
def _loss_op(xs, ws, bs, xt, wt, bt, kind, beta, softcap, inv_temp, workspace_bytes):
    """(per-row loss, m_s, logs_s, m_t, logs_t, R), float32, (N,) each but R (2, N): the row terms of the student's
    gradient (row_loss; zeros where the kind has none). workspace_bytes is for the backward."""
    from .kernels import two_heads

    bs = None if bs is None else bs.contiguous()  # the kernels read biases with unit stride
    bt = None if bt is None else bt.contiguous()
    st = RowStats(*two_heads.forward_stats(xs, ws, bs, xt, wt, bt, kind=kind, beta=beta, softcap=softcap,
                                           inv_temp=inv_temp))
    loss, R, t_ref, t_aux = row_loss(kind, beta, st)
    return (loss, *(t.clone() for t in (st.m_s, st.logs_s, t_ref, t_aux)), _rows2(R, loss))


def _rows2(R, like):
    # The gradient's row terms as one (2, N) tensor (the op's fixed output): R's rows, zeros where there is none.
    out = torch.zeros((2, like.shape[0]), dtype=like.dtype, device=like.device)
    if R is not None and R.dim() == 1:
        out[0] = R
    elif R is not None:
        out.copy_(R)
    return out


@_loss_op.register_fake
def _(xs, ws, bs, xt, wt, bt, kind, beta, softcap, inv_temp, workspace_bytes):
    return tuple(xs.new_empty(xs.shape[0], dtype=torch.float32) for _ in range(5)) + (
        xs.new_empty((2, xs.shape[0]), dtype=torch.float32),)


@torch.library.custom_op("logitless::two_heads_grad", mutates_args=(), schema=_GRAD_SCHEMA)
def _grad_op(xs, ws, bs, xt, wt, bt, m_s, logs_s, m_t, logs_t, R, g, kind, beta, softcap, inv_temp, need_dx,
             need_dw, need_db, workspace_bytes):
    """(dx_s, dW_s, db_s) for the upstream per-row gradient g; a gradient not asked for is empty."""
    from .kernels import current_tuning, two_heads

    if xs.dtype != torch.float32 and 0 < xs.shape[1] < current_tuning().narrow_d:
        # A student of a handful of features (as linear_head's narrow rule): dL/dz rounded to bf16 / fp16 before
        # the products is then the whole error, and a sum over a few nearly cancelling terms amplifies it (D = 1:
        # one bf16 ulp of d_input where PyTorch's rounds to the nearest). The PyTorch path's backward keeps dz in
        # float32, chunked; at this width its products cost next to nothing. Its statistics are its own pass: the
        # kernels' are of other roundings of the same logits, and a recomputed logit must meet its own maximum
        # exactly (at V = 1 the gradient is exactly 0, and was 1.6e-8 on the kernels' statistics).
        a = TwoHeadArgs(xs, ws, bs, xt, wt, bt, None, xs.shape[:-1])
        st = torch_stats(a, kind, beta, softcap, inv_temp)
        _, R, t_ref, t_aux = row_loss(kind, beta, st)
        st = RowStats(st.m_s, st.logs_s, t_ref, t_aux, None, None)
        out = torch_backward(a, kind, beta, softcap, inv_temp, st, R, g.float(),
                             (need_dx, need_dw, bs is not None and need_db))
        return tuple(t if t is not None else xs.new_empty(0) for t in out)
    bs = None if bs is None else bs.contiguous()
    bt = None if bt is None else bt.contiguous()
    out = two_heads.backward(xs, ws, bs, xt, wt, bt, m_s, logs_s, m_t, logs_t, R, g.float().contiguous(),
                             kind=kind, beta=beta, softcap=softcap, inv_temp=inv_temp, need_dx=need_dx,
                             need_dw=need_dw, need_db=need_db, workspace_bytes=workspace_bytes)
    return tuple(t if t is not None else xs.new_empty(0) for t in out)


@_grad_op.register_fake
def _(xs, ws, bs, xt, wt, bt, m_s, logs_s, m_t, logs_t, R, g, kind, beta, softcap, inv_temp, need_dx, need_dw,
      need_db, workspace_bytes):
    dx = torch.empty_like(xs, memory_format=torch.contiguous_format) if need_dx else xs.new_empty(0)
    dw = torch.empty_like(ws, memory_format=torch.contiguous_format) if need_dw else xs.new_empty(0)
    db = torch.empty_like(bs) if need_db and bs is not None else xs.new_empty(0)
    return dx, dw, db


def _loss_setup_context(ctx, inputs, output):
    xs, ws, bs, xt, wt, bt, kind, beta, softcap, inv_temp, workspace_bytes = inputs
    _, m_s, logs_s, m_t, logs_t, R = output
    ctx.save_for_backward(xs, ws, bs, xt, wt, bt, m_s, logs_s, m_t, logs_t, R)
    ctx.opts = (kind, beta, softcap, inv_temp, workspace_bytes)
    ctx.mark_non_differentiable(m_s, logs_s, m_t, logs_t, R)


def _loss_backward(ctx, g, *_ignored):
    xs, ws, bs, xt, wt, bt, m_s, logs_s, m_t, logs_t, R = ctx.saved_tensors
    kind, beta, softcap, inv_temp, workspace_bytes = ctx.opts
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_db = bs is not None and ctx.needs_input_grad[2]
    if g is None or not (need_dx or need_dw or need_db):
        return (None,) * 11
    dx, dw, db = _grad_op(xs, ws, bs, xt, wt, bt, m_s, logs_s, m_t, logs_t, R, g, kind, beta, softcap, inv_temp,
                          need_dx, need_dw, need_db, workspace_bytes)
    return (dx if need_dx else None, dw if need_dw else None, db if need_db else None) + (None,) * 8


torch.library.register_autograd("logitless::two_heads_loss", _loss_backward, setup_context=_loss_setup_context)
torch.library.register_autograd("logitless::two_heads_grad", no_double_backward, setup_context=no_setup)


def _run(a: TwoHeadArgs, kind, beta, softcap, temperature, reduction, backend, op, workspace_bytes=None):
    softcap = None if softcap is None else float(softcap)
    inv_temp = 1.0 / float(temperature)
    if choose_backend(backend, a.xs, op) == "triton":
        per_row = _loss_op(a.xs, a.ws, a.bs, a.xt, a.wt, a.bt, kind, float(beta), softcap, inv_temp,
                           workspace_bytes)[0]
    else:
        per_row = _TwoHeadsTorch.apply(a.xs, a.ws, a.bs, a, kind, beta, softcap, inv_temp)
    return reduce_rows(per_row, a.valid, reduction, a.lead_shape)


def _common_checks(reduction, temperature, softcap, ignore_index, workspace_bytes):
    ignore_index = _validate.ignore_index_arg(ignore_index)
    _validate.check_options(reduction=reduction, temperature=temperature, softcap=softcap, ignore_index=ignore_index)
    _validate.check_workspace(workspace_bytes)
    return ignore_index


# ---------------------------------------------------------------------------------------------------------------
# Public functions


def linear_kl_div(
    student_input: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_input: torch.Tensor,
    teacher_weight: torch.Tensor,
    *,
    target: torch.Tensor | None = None,
    ignore_index: int = -100,
    temperature: float = 1.0,
    direction: str = "forward",
    reduction: str = "mean",
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    softcap: float | None = None,
    backend: str = "auto",
    workspace_bytes: int | None = None,
) -> torch.Tensor:
    """KL divergence between the softmaxes of two linear heads, per token, without building either's logits.

    With ``z_s = softcap(student_input @ student_weight.T + student_bias) / temperature`` (softcap, when set, is
    ``softcap * tanh(z / softcap)`` before the temperature; the same for the teacher), ``p_s = softmax(z_s)`` and
    ``p_t = softmax(z_t)``: ``direction="forward"`` gives ``KL(p_t || p_s) = sum_j p_t (log p_t - log p_s)`` (the
    usual distillation loss, mean-seeking), ``"reverse"`` gives ``KL(p_s || p_t)`` (mode-seeking, as in on-policy
    distillation). The loss is not multiplied by ``temperature**2``; multiply it yourself for Hinton's
    scaling. All math is float32.

    Gradients flow to ``student_input``, ``student_weight`` and ``student_bias`` only: the teacher's tensors are
    treated as constants (detached), even if they require grad.

    Args:
        student_input: (..., Ds) float32, bfloat16 or float16 (float64 on the PyTorch path); student_weight:
            (V, Ds). teacher_input: (..., Dt) of the same leading shape, dtype and device; teacher_weight: (V, Dt),
            the same vocabulary. Ds and Dt may differ.
        target: optional labels of the leading shape (int64/int32; rows equal to ``ignore_index`` are ignored, other
            values are not used) or a bool mask (True = keep). None: every row counts.
        reduction: "mean" (over the kept rows; NaN when none is kept), "sum", or "none" (float32 per row, 0 at
            ignored rows).
        backend, workspace_bytes: as in :func:`logitless.linear_cross_entropy`.

    Returns:
        float32 loss: a scalar, or the leading shape for ``reduction="none"``.
    """
    ignore_index = _common_checks(reduction, temperature, softcap, ignore_index, workspace_bytes)
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    a = validate(student_input, student_weight, teacher_input, teacher_weight, student_bias, teacher_bias, target,
                 ignore_index)
    kind = "fkl" if direction == "forward" else "rkl"
    return _run(a, kind, 0.0, softcap, temperature, reduction, backend, "linear_kl_div", workspace_bytes)


def linear_jsd(
    student_input: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_input: torch.Tensor,
    teacher_weight: torch.Tensor,
    *,
    beta: float = 0.5,
    target: torch.Tensor | None = None,
    ignore_index: int = -100,
    temperature: float = 1.0,
    reduction: str = "mean",
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    softcap: float | None = None,
    backend: str = "auto",
    workspace_bytes: int | None = None,
) -> torch.Tensor:
    """Generalized Jensen-Shannon divergence between the softmaxes of two linear heads, per token, without logits.

    For ``0 < beta < 1``: ``beta * KL(p_t || M) + (1 - beta) * KL(p_s || M)`` with the mixture
    ``M = beta * p_t + (1 - beta) * p_s`` (``beta = 0.5``: the symmetric JSD, at most log 2). ``beta`` is the
    teacher's weight, the same convention as Liger-Kernel's ``LigerFusedLinearJSD(jsd_beta=...)`` and TRL's GKD
    ``beta``, with the same two edges: ``beta = 0`` is the forward ``KL(p_t || p_s)`` and ``beta = 1`` the reverse
    ``KL(p_s || p_t)`` (the limits of the JSD divided by ``beta`` and by ``1 - beta``; the unscaled JSD itself
    tends to 0 there), computed as :func:`linear_kl_div` does. Other arguments, the temperature convention (no
    ``temperature**2`` factor) and the frozen teacher as in :func:`linear_kl_div`.
    """
    ignore_index = _common_checks(reduction, temperature, softcap, ignore_index, workspace_bytes)
    beta = check_beta(beta)
    a = validate(student_input, student_weight, teacher_input, teacher_weight, student_bias, teacher_bias, target,
                 ignore_index)
    kind = "fkl" if beta == 0.0 else "rkl" if beta == 1.0 else "jsd"
    return _run(a, kind, beta, softcap, temperature, reduction, backend, "linear_jsd", workspace_bytes)


def linear_soft_cross_entropy(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target_input: torch.Tensor,
    target_weight: torch.Tensor,
    *,
    target: torch.Tensor | None = None,
    ignore_index: int = -100,
    temperature: float = 1.0,
    reduction: str = "none",
    linear_bias: torch.Tensor | None = None,
    target_bias: torch.Tensor | None = None,
    softcap: float | None = None,
    backend: str = "auto",
    workspace_bytes: int | None = None,
) -> torch.Tensor:
    """Cross-entropy of one head's softmax under another's, per token: ``-sum_j q_j log p_j`` with
    ``p = softmax(z)`` of the head (``input``, ``linear_weight``, ``linear_bias``) and ``q = softmax(z')`` of the
    target head (``target_input``, ``target_weight``, ``target_bias``), never building either's logits.

    It is ``KL(q || p) + H(q)``: a soft-label cross-entropy for distillation (same gradient as the forward KL), and,
    with an observer model's head as the first and a performer's as the target head, the cross-perplexity
    (in log form, nats per token) of the Binoculars score (docs/detect.md). Temperature and softcap apply to both
    heads as in :func:`linear_kl_div`. Differentiable with respect to the first head only (the target head is
    treated as constant). ``target`` masks rows as in :func:`linear_kl_div`; ``reduction`` defaults to "none"
    (float32 per token, 0 at ignored rows).
    """
    ignore_index = _common_checks(reduction, temperature, softcap, ignore_index, workspace_bytes)
    a = validate(input, linear_weight, target_input, target_weight, linear_bias, target_bias, target, ignore_index,
                 names=("input", "target"))
    return _run(a, "ce", 0.0, softcap, temperature, reduction, backend, "linear_soft_cross_entropy",
                workspace_bytes)
