"""The loss math every path shares: the head's per-row statistics, the losses written on them, the per-row
coefficients of the one gradient form, the reduction, and the memory policy.

The contract of the head op (logitless.head), for one row (token) i with logits z_j = softcap(x_i . W_j + b_j) / T:

  Stats(m, logs, zt, sw, ent, lse):  m the row max, logs = log sum_j exp(z_j - m) (lse = m + logs), zt = z_t the
  target's logit (0 where the target is outside [0, V)), sw = sum_j w_j (z_j - m) (w_j the class weights, or 1), ent
  the entropy of softmax(z), and where asked for, lse = m + logs once more, with a gradient path of its own (below);
  each (N,) in the accumulation dtype (float32; float64 for float64 inputs).

m and logs are kept apart because z_j - m is exact while a rounded float32 lse of a logit near 1e4 is off by ~1e-3.
Every loss is a PyTorch expression of these statistics (below), so autograd turns the upstream gradients into
gradients of the statistics, and head_coefficients turns those into the per-row (A, B, C, E) of

  dL/dz_j = p_j (A_i + B_i (z_j - m)) - C_i [j == t_i] - E_i w_j,     p_j = exp((z_j - m) - logs)

which one backward per backend computes (docs/math.md derives it); with the entropy, the target's column has a
form of its own (At, head_coefficients). B multiplies z_j - m, not z_j, and A is taken
relative to m accordingly: the difference z_j - mu of the entropy gradient would otherwise cancel catastrophically
at |z| ~ 1e4. For autograd the row max is a constant offset: every use of the statistics is invariant to shifting
m (with logs and sw shifted to match), so its gradient is ignored and logs carries d lse/dz_j = p_j.

The lse statistic carries d lse/dz_j = p_j too, for a term that must not share logs' gradient: the z-loss. Through
logs, autograd would add its 2 z_loss lse to the cross-entropy's w_t into one float32 number, 1.002 say, whose
rounding (an ulp of 1) is most of the target column's gradient at a near-certain row, where that column is
p_t 2 z_loss lse - (1 - p_t) w_t (float32, V = 2, z_loss 1e-4: d_input 100 x PyTorch's error). Float32 inputs only
(head.z_loss_apart): in half precision dL/dz's own rounding dwarfs that ulp.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

# The default memory policy of both backends (workspace_bytes=None): beyond O(N), the work may take the larger of a
# fifth of the bytes that the N x V logits would take in bf16 (2 N V / 5 bytes, whatever the dtype) and, where the
# input's gradient is accumulated in float32 (the Triton backward of a bf16 / fp16 head), that accumulator (4 N D
# bytes) plus POLICY_MIN_BYTES. Both terms are measured choices: the accumulator removes a second pass over 2N
# classes where D is large next to V, and a fifth gives small-vocabulary heads such as gpt2's chunks of 8192 classes,
# still a small fraction of what torch.compile holds (docs/design/backward.md, "The default budget"). Tests
# shrink POLICY_MIN_BYTES to reach the plans of larger heads at small shapes.
POLICY_MIN_BYTES = 16 << 20
POLICY_LOGITS_DIVISOR = 5


def acc_dtype(dtype) -> torch.dtype:
    """Accumulation dtype of every path: float32, or float64 for float64 inputs (which only the PyTorch backend
    accepts)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def default_workspace_bytes(n: int, V: int, acc_bytes: int = 0) -> int:
    """The default memory policy: bytes the work of a head of n tokens and V classes may take beyond O(n), the
    larger of a fifth of n x V bf16 logits (2 n V / 5 bytes) and POLICY_MIN_BYTES (16 MiB) plus `acc_bytes`, the
    float32 input-gradient accumulator that the caller's plan holds (4 n D bytes for a bf16 / fp16 Triton backward;
    0 for the PyTorch path, which keeps to the logits' term)."""
    return max(POLICY_MIN_BYTES + acc_bytes, 2 * n * V // POLICY_LOGITS_DIVISOR)


def one_minus_pt(rest, logs, e_t=None, zt_m=None):
    """1 - p_t = rest / S per row, in [0, 1], without the cancellation of 1 - p_t: at a near-certain row it is the
    small sum of the other classes' mass. With e_t = exp(z_t - m), S = rest + e_t: rest's own rounding then enters
    only as p_t times it, where S = exp(logs) keeps the log's rounding, eps |logs| (2.5 ulp at V = 13, near-uniform,
    against PyTorch's half ulp of 1 - p_t). An empty head (logs = -inf) has rest = 0: 0. Without rest (a forward
    that did not sum it), from zt_m = z_t - m: -expm1(zt_m - logs), which keeps S's rounding as PyTorch's own p_t
    does."""
    if rest is None:
        q = -torch.expm1(zt_m - logs)
    else:
        q = rest * torch.exp(-logs) if e_t is None else rest / (rest + e_t)
    return torch.nan_to_num(q, nan=0.0).clamp_(0.0, 1.0)


class Stats(NamedTuple):
    """Per-row statistics of a head (see the module docstring); None where not asked for."""

    m: torch.Tensor
    logs: torch.Tensor
    zt: torch.Tensor | None
    sw: torch.Tensor | None
    ent: torch.Tensor | None
    lse: torch.Tensor | None = None


def head_coefficients(m, logs, ent, g_logs, g_zt, g_sw, g_ent, mu=None, rest=None, zt=None, g_lse=None):
    """Per-row (A, B, C, E, At) of dL/dz_j = p_j (A + B (z_j - m)) - C [j == t] - E w_j from the upstream gradients of
    the statistics (None where a statistic has none): d logs/dz_j = p_j (m held constant), d zt/dz_j = [j == t],
    d sw/dz_j = w_j, dH/dz_j = -p_j (z_j - (lse - H)). In the statistics' dtype, contiguous.

    mu = sum_j p_j (z_j - m) and rest = sum_{j != t} exp(z_j - m), where the backend has them (mu: the entropy's
    forward; rest: a forward with a target): mu then replaces logs - ent, which cancels for a near-uniform row (both
    ~ log V, mu ~ 0), and with rest the target's column takes its own form, At not None: dL/dz_t = p_t (At + B (z_t
    - m)) - C - E w_t with At = A - C and C = (1 - p_t) C_0 (C_0 the C above) formed from rest (1 - p_t = rest / S,
    S = exp(logs)). The same value as p_t A - C_0, but for a near-certain row p_t A and C_0 agree to all of p_t's
    float32 digits (and S = 1 + r rounds r away: logs, hence p_t, is off by up to half an ulp of 1), so their
    difference was mostly rounding.

    g_lse: the upstream gradient of the lse statistic (the z-loss's), kept apart from g_logs until At = (g_logs +
    g_zt) + g_lse, in which the first two cancel exactly for a plain cross-entropy. The target's column then takes
    that form whenever g_lse is given, with 1 - p_t from rest, or without it from zt (one_minus_pt)."""
    acc = logs.dtype
    A = torch.zeros_like(logs) if g_logs is None else g_logs.to(acc).contiguous()
    if g_lse is not None:
        g_lse = g_lse.to(acc)
        A = (A + g_lse).contiguous()
    B = C = E = At = None
    if g_ent is not None:
        g_ent = g_ent.to(acc)
        # relative to the row max: the backward multiplies B by z - m
        A = A + g_ent * ((logs - ent) if mu is None else mu)
        B = (-g_ent).contiguous()
    if g_zt is not None:
        C = (-g_zt.to(acc)).contiguous()
        if rest is not None or (g_lse is not None and zt is not None):
            # At = A - C, summed from its parts: for log p_t, g_logs + g_zt is exactly 0.
            At = (g_logs.to(acc) if g_logs is not None else torch.zeros_like(logs)) + g_zt.to(acc)
            if g_ent is not None:
                At = At + g_ent * ((logs - ent) if mu is None else mu)
            if g_lse is not None:
                At = At + g_lse
            At = At.contiguous()
            # 1 - p_t in [0, 1]; an empty head (logs = -inf) has rest = 0 and no column.
            zt_m = None if zt is None else zt - m
            q = one_minus_pt(rest, logs, None if rest is None or zt_m is None else torch.exp(zt_m), zt_m)
            C = (C * q).contiguous()
    if g_sw is not None:
        E = (-g_sw.to(acc)).contiguous()
    return A, B, C, E, At


# ---------------------------------------------------------------------------------------------------------------
# Cross-entropy


def ce_row_terms(target, class_w, ignore_index, label_smoothing, V, dtype=torch.float32):
    """Per-row (valid mask, target class weight as `dtype`, 0 where ignored) and the sum of class weights."""
    valid = target != ignore_index
    if class_w is None:
        w_t = valid.to(dtype)
        w_sum = float(V)
    else:
        cw = class_w.to(dtype)
        w_t = cw[torch.where(valid, target, 0)] * valid
        w_sum = cw.sum()
    return valid, w_t, w_sum


def ce_loss_from_stats(m, logs, zt, sw, ref, valid, w_t, w_sum, label_smoothing, z_loss, V, lse=None):
    """Per-token loss (0 at ignored rows) from the per-row statistics (lse = m + logs); sw = sum_j w_j (z_j - ref)
    (ref = m for the head op's statistics). lse: the statistic of that name where the head op gives it, which the
    z-loss then takes (its gradient kept apart from the cross-entropy's; module docstring)."""
    # (Each op here is a launch and an autograd node on the host: none is spent on a factor of exactly 1.)
    eps = float(label_smoothing)
    if eps > 0.0:
        # sum_j w_j (lse - z_j) = W (lse - ref) - sum_j w_j (z_j - ref)
        loss = (1.0 - eps) * w_t * ((m - zt) + logs) + (eps / V) * (w_sum * ((m - ref) + logs) - sw)
    else:
        loss = w_t * ((m - zt) + logs)
    if z_loss > 0.0:
        if lse is None:
            lse = m + logs
        loss = loss + z_loss * lse * lse
    return torch.where(valid, loss, 0.0)


def ce_backward_coef(grad, lse, valid, w_t, w_sum, label_smoothing, z_loss, V):
    """(A, C, E, X) of the cross-entropy's gradient for the upstream `grad`, in the form that cross_entropy on
    given logits computes (its backends write dL/dz without the statistics' autograd): every column is
    p_j A - E w_j, the target's p_t X + (p_t - 1) C with C standing for C + E w_t and X = E (W - w_t) +
    2 g z_loss lse computed apart (W = w_sum): where p_t rounds to 1 (a confident row), p_t A - C - E w_t would lose
    the z-loss term in the cancellation."""
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
    return A, (C if E is None else C + E * w_t), E, X


def reduce_loss(per_token, valid, w_t, reduction, lead_shape):
    """Apply the reduction the way F.cross_entropy does (mean divides by the summed target weights)."""
    if reduction == "none":
        return per_token.reshape(lead_shape)
    total = per_token.sum()
    if reduction == "sum":
        return total
    return total / w_t.sum()


# ---------------------------------------------------------------------------------------------------------------
# Log-probabilities


def log_probs_from_stats(st: Stats, valid):
    """(log p of the target, entropy or None), each 0 at ignored rows."""
    logp = torch.where(valid, (st.zt - st.m) - st.logs, 0.0)
    return logp, (None if st.ent is None else torch.where(valid, st.ent, 0.0))


# ---------------------------------------------------------------------------------------------------------------
# Two heads: the log-ratio of their sums near agreement (RowStats.dl; both backends)


def move_t(t, s_a, w, cs, q_log):
    """T = sum_j e_a expm1(delta_j) of earlier blocks moved to new references (m_a' and zr'): delta moves by cs =
    (m_a' - m_a) - (zr' - zr), so T' = exp(zr - zr') T + alpha s_a expm1(cs), with w = alpha s_a and q_log =
    zr - zr'; the last term as s_a e^q_log - w where |cs| >= 0.5 (w may have underflowed there while the old
    classes' mass relative to the new reference has not)."""
    q = torch.exp(q_log)
    small = cs.abs() < 0.5
    move = torch.where(small, w * torch.expm1(torch.where(small, cs, 0.0)), s_a * q - w)
    return torch.where(s_a > 0, q * t + move, 0.0)


def t_terms(e, delta, eb_ref):
    """Row sums of e_a expm1(delta), delta = (z_b - zr) - (z_a - m_a) (0 at a's argmax), eb_ref = exp(z_b - zr):
    expm1 where |delta| < 0.5 (each term to an ulp of itself however close the heads are), else eb_ref - e_a,
    which has no cancellation there and stays right where e_a underflows to 0 but the other head's mass does not."""
    small = delta.abs() < 0.5
    term = torch.where(small, e * torch.expm1(torch.where(small, delta, 0.0)), eb_ref - e)
    return torch.where(torch.isnan(term), 0.0, term).sum(1)


def log_ratio(s_b, s_a, m_b, zr, t):
    """dl = logs_b - logs_a = log(s_b / s_a), each s relative to its head's maximum. With T = sum_j e_a expm1(delta_j)
    (t; t_terms), s_b / s_a = e^(zr - m_b) (1 + T / s_a): near agreement log1p(T / s_a) is exact to the
    logits' rounding, where log(s_b / s_a) keeps the two sums' roundings (1e-7 against a KL of 1e-4 at V = 2, twice
    PyTorch's error). The log-ratio form where T / s_a is large or not finite (overflow far from agreement)."""
    plain = torch.log(s_b / s_a)
    if t is None:
        return plain
    tn = t / s_a
    near = torch.isfinite(tn) & (tn.abs() <= 1.0)
    return torch.where(near, (zr - m_b) + torch.log1p(torch.where(near, tn, 0.0)), plain)


# ---------------------------------------------------------------------------------------------------------------
# Two heads (logitless.distill): their row statistics, each loss on them, and the student's dL/dz. Both backends'
# statistics are RowStats; the PyTorch backend forms dL/dz with dz_student, the kernels with its Triton twin.

# The losses, by the divergence each row computes (see row_loss):
#   "fkl"  KL(p_t || p_s)          weights p_t   dL/dz_s = p_s - p_t
#   "rkl"  KL(p_s || p_t)          weights p_s   dL/dz_s = p_s (log p_s - log p_t - KL)
#   "ce"   -sum_j p_t log p_s      weights p_t   dL/dz_s = p_s - p_t
#   "jsd"  beta KL(p_t || M) + (1 - beta) KL(p_s || M),  M = beta p_t + (1 - beta) p_s
#                                                 dL/dz_s = (1 - beta) p_s (log p_s - log M - KL(p_s || M))
KINDS = ("fkl", "rkl", "ce", "jsd")


def weights_student(kind: str) -> bool:
    """Whether pass 1's cross sum and reference follow the student's softmax (reverse KL; the JSD, which uses only
    the reference) or the teacher's."""
    return kind in ("rkl", "jsd")


class RowStats(NamedTuple):
    """Per-row float32 statistics of both heads (lse = m + logs for each) and of the weighting head a (the student
    for the reverse KL and the JSD, the teacher otherwise; b the other): ea = E_a[z_a - m_a] (for the soft
    cross-entropy), zr = z_b at a's argmax (the reference), da = E_a[(z_a - m_a) - (z_b - zr)], and
    dl = logs_b - logs_a formed as log(s_b / s_a), or near agreement from sum_j e_a expm1(delta_j) (log_ratio; not
    for the JSD). For the JSD, kt = KL(p_t || M) from the second pass and ks
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


def dz_student(kind: str, beta: float, zs, zt, m_s, logs_s, m_t, logs_t, R, g):
    """dL/dz_s of a block (float32 or float64), rows scaled by the upstream gradient g (0 at ignored rows); m_t is
    row_loss's teacher reference."""
    ls = (zs - m_s[:, None]) - logs_s[:, None]
    ps = torch.exp(ls)
    if kind in ("fkl", "ce"):
        # R is dl = logs_s - logs_t here (row_loss). Near agreement p_s - p_t cancels to ~an ulp of p (3e-8 at
        # p ~ 0.5 against differences of 1e-4); -p_s expm1(u), u = log p_t - log p_s, is exact to an ulp of itself.
        u = lt_minus_ls(zs, zt, m_s, m_t, R)
        near = u.abs() < 0.5
        dz = torch.where(near, -ps * torch.expm1(torch.where(near, u, 0.0)),
                         ps - torch.exp((zt - m_t[:, None]) - logs_t[:, None]))
    else:
        if kind == "rkl":  # m_t is the teacher's logit at the student's argmax and R = da (row_loss)
            inner = (zs - m_s[:, None]) - (zt - m_t[:, None]) - R[:, None]
            scale = 1.0
        else:
            # logs_t is logs_s - logs_t here (row_loss)
            d_ref = mix_terms(R[1], beta)[0]
            inner = (mix_terms(lt_minus_ls(zs, zt, m_s, m_t, logs_t), beta)[0] - d_ref[:, None]) - R[0][:, None]
            scale = 1.0 - beta
        dz = torch.where(ps > 0, ps * inner, 0.0)
        if scale != 1.0:
            dz = dz * scale
    return dz * g[:, None]


def lt_minus_ls(zs, zt, m_s, m_t, dl):
    """log p_t - log p_s of a block from each head's logits relative to its maximum (small where either head's
    mass is) and dl = logs_s - logs_t formed as log(s_s / s_t): neither the logits' size nor the log-sums' (~log V)
    rounding enters it."""
    return ((zt - m_t[:, None]) - (zs - m_s[:, None])) + dl[:, None]


def mix_terms(u, beta):
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

