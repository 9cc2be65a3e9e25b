"""Naive oracles: every op written as a composition of PyTorch's own ops on materialised logits.

Tests run them in float64 as ground truth and in the input dtype as "PyTorch's own error" (the error rule: ours
<= 2 x PyTorch's + tiny); the benchmark uses them as the eager peer and as its correctness gate. They build the
N x V logits, so they are neither a fallback nor a backend, and nothing in the library imports them. They share
no code with the library either: an oracle that called the code under test could not catch its mistakes.

Each takes the keyword arguments of the public function it mirrors, plus ``upcast``: compute in float32 (or the
input's dtype, if wider) instead of bfloat16/float16.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["naive_cross_entropy", "naive_linear_cross_entropy", "naive_linear_log_probs", "naive_linear_logsumexp",
           "naive_two_heads"]


def _tanh_truth(u: torch.Tensor) -> torch.Tensor:
    """tanh whose autograd derivative stays accurate where tanh saturates, for the float64 truth: PyTorch's
    backward, 1 - tanh(u)^2, is exactly 0 in float64 past |u| ~ 19, where the true slope (4e-24 at |u| = 27) is
    what a float32 kernel still resolves. sign(u) (1 - 2 sigmoid(-2|u|)) differentiates to 4 s (1 - s) with
    s = sigmoid(-2|u|) small and exact; torch.tanh below |u| = 1/2, where its backward does not cancel."""
    a = u.abs()
    far = torch.sign(u) * (1.0 - 2.0 * torch.sigmoid(-2.0 * a))
    return torch.where(a < 0.5, torch.tanh(u), far)


def _softcap(z: torch.Tensor, softcap) -> torch.Tensor:
    """softcap tanh(z / softcap) as PyTorch computes it; in float64 (the truth) accurately differentiable where
    tanh saturates (_tanh_truth)."""
    if softcap is None:
        return z
    tanh = _tanh_truth if z.dtype == torch.float64 else torch.tanh
    return softcap * tanh(z / softcap)


def _upcast(z: torch.Tensor, upcast: bool) -> torch.Tensor:
    return z.float() if upcast and z.dtype in (torch.bfloat16, torch.float16) else z


class _PairwiseLogSoftmax(torch.autograd.Function):
    """log_softmax over the last dimension whose backward forms g_j - p_j sum_k g_k pairwise, as
    sum_k (g_j p_k - p_j g_k) (sum_k p_k = 1): at a near-certain row the target's p_t - 1 is then -sum_{k != t} p_k
    instead of the rounding of p_t - 1 (0 in float64 below 1e-16, where the other columns are not). O(N V^2): the
    float64 truth of the tests, at test sizes."""

    @staticmethod
    def forward(ctx, z):
        out = torch.log_softmax(z, dim=-1)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        p = ctx.saved_tensors[0].exp()
        pairs = g[..., :, None] * p[..., None, :] - p[..., :, None] * g[..., None, :]
        return pairs.sum(-1)


def _log_softmax(z, pairwise: bool):
    return _PairwiseLogSoftmax.apply(z) if pairwise else torch.log_softmax(z, dim=-1)


def naive_cross_entropy(logits, target, *, weight=None, reduction="mean", ignore_index=-100, label_smoothing=0.0,
                        z_loss=0.0, softcap=None, upcast=True, pairwise_grad=False):
    """F.cross_entropy plus the z-loss on the (softcapped) logits. pairwise_grad: the same value through
    _PairwiseLogSoftmax, F.cross_entropy's terms written out (nll of the log-softmax plus label_smoothing / V times
    the weighted sum of all of it): the float64 truth of the tests, accurate also at near-certain rows."""
    logits = _softcap(_upcast(logits, upcast), softcap)
    V = logits.shape[-1]
    z = logits.reshape(-1, V)
    t = target.reshape(-1).long()
    w = None if weight is None else weight.to(z.dtype)
    if pairwise_grad:
        ls = _log_softmax(z, True)
        per = F.nll_loss(ls, t, weight=w, reduction="none", ignore_index=ignore_index)
        if label_smoothing > 0.0:
            smooth = -(ls * (w if w is not None else 1.0)).sum(-1)
            smooth = torch.where(t != ignore_index, smooth, torch.zeros_like(smooth))
            per = (1.0 - label_smoothing) * per + label_smoothing / V * smooth
    else:
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
                               ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None, upcast=True,
                               pairwise_grad=False):
    z = F.linear(input, linear_weight, linear_bias)
    return naive_cross_entropy(z, target, weight=weight, reduction=reduction, ignore_index=ignore_index,
                               label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap, upcast=upcast,
                               pairwise_grad=pairwise_grad)


def naive_linear_log_probs(input, linear_weight, target, *, linear_bias=None, softcap=None, temperature=1.0,
                           ignore_index=-100, return_entropy=False, upcast=True, pairwise_grad=False):
    z = _softcap(_upcast(F.linear(input, linear_weight, linear_bias), upcast), softcap)
    logp_all = _log_softmax(z / temperature, pairwise_grad)
    valid = target != ignore_index
    safe_t = torch.where(valid, target, torch.zeros_like(target)).long()
    logp = logp_all.gather(-1, safe_t.unsqueeze(-1)).squeeze(-1)
    logp = torch.where(valid, logp, torch.zeros_like(logp))
    if not return_entropy:
        return logp
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, torch.where(valid, ent, torch.zeros_like(ent))


def naive_linear_logsumexp(input, linear_weight, *, linear_bias=None, softcap=None, temperature=1.0, upcast=True):
    z = _softcap(_upcast(F.linear(input, linear_weight, linear_bias), upcast), softcap)
    return torch.logsumexp(z / temperature, dim=-1)


def _log_softmax_tail(z):
    """log_softmax over the last dimension with the normaliser as log1p of the mass outside the top class: the top
    class's log-probability is -log1p(rest), where log(1 + rest) is exactly 0 once rest < 1e-16 in float64. Two
    near-certain heads that agree have a divergence of the order of that rest (p_t = 1 - 8.5e-26 and 1 - 1.3e-31
    on the top class: their KL is 1.04e-24, of which the top class's -8.5e-26 was lost)."""
    m = z.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    d = z - m
    e = d.exp()
    top = d.argmax(dim=-1, keepdim=True)
    rest = e.scatter(-1, top, 0.0).sum(-1, keepdim=True)
    return d - torch.log1p(rest)


class _PairwiseDivergence(torch.autograd.Function):
    """Per-row two-head divergence of logits (N, V) whose gradient is formed pairwise, for a float64 truth:
    dL/dz_j = p_j sum_k p_k (f_j - f_k) instead of autograd's p_j f_j - p_j sum_k p_k f_k, whose two terms agree to
    all of float64's digits at a saturated row (the true gradient there is the tiny sum of the other classes' terms,
    and autograd returns 0 or rounding). O(N V^2): for test sizes."""

    @staticmethod
    def forward(ctx, zs, zt, kind, beta):
        ls = _log_softmax_tail(zs)
        lt = _log_softmax_tail(zt)
        ps, pt = ls.exp(), lt.exp()
        if kind == "fkl" or (kind == "jsd" and beta == 0.0):
            per, f, scale = (pt * (lt - ls)).sum(-1), None, 1.0
        elif kind == "rkl" or (kind == "jsd" and beta == 1.0):
            per, f, scale = (ps * (ls - lt)).sum(-1), ls - lt, 1.0
        elif kind == "ce":
            per, f, scale = -(pt * ls).sum(-1), None, 1.0
        else:
            lm = torch.logsumexp(torch.stack([lt + math.log(beta), ls + math.log1p(-beta)]), dim=0)
            per = beta * (pt * (lt - lm)).sum(-1) + (1.0 - beta) * (ps * (ls - lm)).sum(-1)
            f, scale = ls - lm, 1.0 - beta
        ctx.save_for_backward(ps, pt, f, ls, lt)
        ctx.scale = scale
        return per

    @staticmethod
    def backward(ctx, g):
        ps, pt, f, ls, lt = ctx.saved_tensors
        if f is None:  # forward KL, soft cross-entropy: p_s - p_t as -p_s expm1(log p_t - log p_s), which keeps
            # the difference of two probabilities that round to the same float64 (1 - 1.3e-31 and 1 - 8.5e-26)
            gap = lt - ls
            dz = torch.where((ps > 0) & (gap < 700.0), -ps * torch.expm1(gap.clamp(max=700.0)), ps - pt)
        else:
            dz = _pairwise_sums(ps, f)
            dz = torch.where(ps > 0, ps * dz, 0.0) * ctx.scale
        return dz * g[..., None], None, None, None


PAIRWISE_BLOCK = 1 << 26  # elements of one (rows, classes j, classes k) block of _pairwise_sums: 512 MiB in float64


def _pairwise_sums(ps, f):
    """sum_k p_k (f_j - f_k) for every class j, each difference formed before it is weighted (no cancellation between
    two large sums), in blocks of rows and of classes j that hold at most PAIRWISE_BLOCK elements at once."""
    V = f.shape[-1]
    p2, f2 = ps.reshape(-1, V), f.reshape(-1, V)
    out = torch.empty_like(f2)
    cols = max(1, min(V, PAIRWISE_BLOCK // V))
    rows = max(1, PAIRWISE_BLOCK // (cols * V))
    for r in range(0, f2.shape[0], rows):
        pk = p2[r:r + rows, None, :]
        for c in range(0, V, cols):
            diff = f2[r:r + rows, c:c + cols, None] - f2[r:r + rows, None, :]  # f_j - f_k
            out[r:r + rows, c:c + cols] = torch.where(pk > 0, pk * diff, 0.0).sum(-1)
    return out.reshape(f.shape)


def naive_two_heads(student_input, student_weight, teacher_input, teacher_weight, *, kind="fkl", beta=0.5,
                    target=None, ignore_index=-100, temperature=1.0, reduction="mean", student_bias=None,
                    teacher_bias=None, softcap=None, upcast=True, pairwise_grad=False, form="sum"):
    """The losses of logitless.distill by `kind` ("fkl", "rkl", "ce", "jsd" with `beta`); the teacher is detached.
    pairwise_grad: the same value, with the logits' gradient formed pairwise (_PairwiseDivergence): the float64
    truth of the tests, accurate also where every class but one is saturated. form: "sum" writes each divergence
    as a sum over the log-softmaxes, "builtin" through PyTorch's own F.kl_div (log targets) and F.cross_entropy
    (probabilities as the target): two ways a user writes it, whose float32 roundings differ."""
    zs = _upcast(F.linear(student_input, student_weight, student_bias), upcast)
    zt = _upcast(F.linear(teacher_input, teacher_weight, teacher_bias), upcast).detach()
    zs = _softcap(zs, softcap) / temperature
    zt = _softcap(zt, softcap) / temperature
    if pairwise_grad:
        per = _PairwiseDivergence.apply(zs, zt, kind, beta)
    elif form == "builtin":
        ls = torch.log_softmax(zs, dim=-1)
        lt = torch.log_softmax(zt, dim=-1)
        if kind == "fkl" or (kind == "jsd" and beta == 0.0):
            per = F.kl_div(ls, lt, reduction="none", log_target=True).sum(-1)
        elif kind == "rkl" or (kind == "jsd" and beta == 1.0):
            per = F.kl_div(lt, ls, reduction="none", log_target=True).sum(-1)
        elif kind == "ce":
            flat = F.cross_entropy(ls.reshape(-1, ls.shape[-1]), lt.exp().reshape(-1, ls.shape[-1]), reduction="none")
            per = flat.reshape(ls.shape[:-1])
        else:
            lm = torch.logsumexp(torch.stack([lt + math.log(beta), ls + math.log1p(-beta)]), dim=0)
            per = (beta * F.kl_div(lm, lt, reduction="none", log_target=True).sum(-1)
                   + (1.0 - beta) * F.kl_div(lm, ls, reduction="none", log_target=True).sum(-1))
    else:
        ls = torch.log_softmax(zs, dim=-1)
        lt = torch.log_softmax(zt, dim=-1)
        if kind == "fkl" or (kind == "jsd" and beta == 0.0):
            per = (lt.exp() * (lt - ls)).sum(-1)
        elif kind == "rkl" or (kind == "jsd" and beta == 1.0):
            per = (ls.exp() * (ls - lt)).sum(-1)
        elif kind == "ce":
            per = -(lt.exp() * ls).sum(-1)
        else:
            lm = torch.logsumexp(torch.stack([lt + math.log(beta), ls + math.log1p(-beta)]), dim=0)
            per = beta * (lt.exp() * (lt - lm)).sum(-1) + (1.0 - beta) * (ls.exp() * (ls - lm)).sum(-1)
    valid = None
    if target is not None:
        valid = target if target.dtype == torch.bool else target != ignore_index
        per = torch.where(valid, per, torch.zeros_like(per))
    if reduction == "none":
        return per
    if reduction == "sum":
        return per.sum()
    return per.sum() / (valid.sum() if valid is not None else per.numel())
