"""The fused training path of linear_cross_entropy on this backend: chunks of rows over the full vocabulary whose
gradients are computed in the forward (three products instead of the generic path's four).

For a head whose weight's gradient an autograd node of the caller's takes after the rest of the model's backward (a
head tied to the input embedding on a CPU, integrations/tied.py, through logitless.later_grad), the forward makes
the weight's gradient of the first classes only and the backward leaves a maker of the rest to that node: the part
made later never lives beside the activations the backbone saved, for one more product over that part of the
vocabulary (docs/design/tied_head.md)."""

from __future__ import annotations

import torch

from .. import later_grad
from .._autograd import first_order_only, graph_kept, scale_forward_grads
from ..loss_math import acc_dtype, ce_loss_from_stats, ce_row_terms, one_minus_pt, reduce_loss
from .blocks import apply_softcap, budget_beside_products, chunks

# The fused training path's full-vocabulary row chunks: with fewer rows than this its products turn into reads of W
# (three per chunk), and the generic path, which reads it twice in all, is taken instead.
_MIN_FUSED_ROWS = 32

def fused_rows(x, w, b, softcap, reduction) -> int:
    """Rows per chunk of the fused path of linear_cross_entropy (fused_cross_entropy), or 0 where it does
    not apply: it needs a reduced loss ("mean" / "sum"), a gradient wanted now (grad mode, an input that requires
    grad; not while torch.compile traces, which keeps the generic path), and the policy's budget
    (loss_math.default_workspace_bytes) holding chunks of at least _MIN_FUSED_ROWS full-vocabulary rows (all rows
    when there are fewer) next to the accumulators that a bfloat16 / float16 head needs in float32 (its weight, and
    the gradients until the backward) and the products' own buffers (blocks.budget_beside_products)."""
    from .._dispatch import is_compiling

    n, D = x.shape
    V = w.shape[0]
    needs = (x.requires_grad, w.requires_grad, b is not None and b.requires_grad)
    if reduction == "none" or n == 0 or V < 2 or not torch.is_grad_enabled() or not any(needs) or is_compiling():
        return 0
    acc = acc_dtype(x.dtype)
    item = acc.itemsize
    fixed = 0
    if w.dtype != acc:  # W in the accumulation dtype, and the weight gradient's accumulator
        fixed += item * V * D * (1 + needs[1])
    per_row = item * V * (1 + (softcap is not None))  # the block, and the softcap's chain factor
    if x.dtype != acc:  # the chunk of x in the accumulation dtype, and the input gradient's accumulator
        per_row += item * D * (1 + needs[0])
    rows = (budget_beside_products(n, V) - fixed) // per_row
    return min(n, rows) if rows >= min(n, _MIN_FUSED_ROWS) else 0


class _FusedCrossEntropy(torch.autograd.Function):
    """(x, W, b) -> the reduced cross-entropy, with the gradients computed in the forward (_fused_forward); the
    backward scales them by the upstream gradient: into fresh tensors while the graph is kept (any number of
    backwards with retain_graph=True give the same gradients), in place in the backward that frees the graph.
    With `later` (later_grad.claim's (node, LaterWeightGrad)), the forward makes W's gradient for the classes below
    later_grad.split(V) only; a backward that frees the graph hands that part and a maker of the rest to the
    LaterWeightGrad, for the node to assemble, and any other makes the whole gradient itself."""

    @staticmethod
    def forward(ctx, x, w, b, target, class_w, reduction, ignore_index, eps, z_loss, softcap, rows, later):
        needs = (x.requires_grad, w.requires_grad, b is not None and b.requires_grad)
        ctx.later = later if needs[1] else None
        split = later_grad.split(w.shape[0]) if ctx.later is not None else None
        loss, grads, stats = _fused_forward(x, w, b, target, class_w, reduction, ignore_index, eps, z_loss, softcap,
                                            rows, needs, dw_rows=split)
        # For first_order_only: with create_graph=True they tie the gradients to a node that refuses a second
        # differentiation. With `later`, also the inputs of the rest of W's gradient.
        ctx.save_for_backward(x, w, b, target, class_w)
        ctx.grads = grads
        ctx.dtypes = (x.dtype, w.dtype, None if b is None else b.dtype)
        ctx.rest = None if split is None else (split, stats, (reduction, ignore_index, eps, z_loss, softcap, rows))
        return loss

    @staticmethod
    def backward(ctx, g):
        # Left to the node only in a plain backward that frees the graph and runs the node; otherwise (a kept graph,
        # create_graph=True, a pass that does not reach the node) the whole gradient is made here.
        if (ctx.rest is not None and not torch.is_grad_enabled() and not graph_kept()
                and later_grad.will_run(ctx.later[0])):
            return _leave_rest(ctx, g)
        return _backward(ctx, g)


@first_order_only
def _backward(ctx, g):
    dx, dw, db = scale_forward_grads(ctx, g)
    if ctx.rest is not None and dw is not None:
        dw = _whole_weight_grad(ctx, dw, g)()
    return dx, dw, db, *[None] * 9


@first_order_only
def _leave_rest(ctx, g):
    dx, dw_first, db = scale_forward_grads(ctx, g)
    ctx.later[1].add(_whole_weight_grad(ctx, dw_first, g))
    ctx.rest = None  # the graph is freed: the maker holds what it needs
    return dx, None, db, *[None] * 9


def _whole_weight_grad(ctx, dw_first, g):
    """A maker of W's whole gradient for the upstream gradient g: the rows made in the forward (dw_first, scaled)
    and the rest made now from the saved inputs and the forward's row statistics, in W's dtype, each rounded once."""
    x, w, b, target, class_w = (None if t is None else t.detach() for t in ctx.saved_tensors)
    split, stats, options = ctx.rest
    g = g.detach()

    def make():
        dw = torch.empty_like(w)
        dw[:split] = dw_first
        dw[split:] = _fused_forward(x, w, b, target, class_w, *options, (False, True, False),
                                    known=(split, *stats))[1][1].mul_(g)
        return dw

    return make


def fused_plan(x, w, b, softcap, reduction, skip, workspace_bytes):
    """(rows per chunk of the fused path or None where it does not apply, this call's skip resolved: nothing is
    skipped on this backend), as the head op asks every backend (fused_rows; workspace_bytes is the Triton
    backward's: this backend sizes its blocks by the memory policy)."""
    rows = fused_rows(x, w, b, softcap, reduction)
    return (rows or None), type(skip)(None, skip.vocab_order, skip.bounded, True, False)


def fused_cross_entropy(x, w, b, target, class_w, reduction, ignore_index, label_smoothing, z_loss, softcap, rows):
    """linear_cross_entropy's reduced loss on validated (N, D) / (V, D) inputs through the fused path (fused_plan
    gives `rows`); autocast is off inside, as in linear_head.stats(). Within later_grad.weight_grad_later for this
    very `w`, part of W's gradient is made later (the module docstring)."""
    later = later_grad.claim(w)
    with torch.autocast(x.device.type, enabled=False):
        return _FusedCrossEntropy.apply(x, w, b, target, class_w, reduction, ignore_index, float(label_smoothing),
                                        float(z_loss), None if softcap is None else float(softcap), rows, later)


def _fused_forward(x, w, b, target, class_w, reduction, ignore_index, eps, z_loss, softcap, rows, needs,
                   dw_rows=None, known=None):
    """(loss, (dx, dW, db), (m, rest, e_t)) of the reduced cross-entropy, the gradients for an upstream gradient of 1
    (None where not needed) in the accumulation dtype, and the rows' statistics (below). Rows outer, over the full
    vocabulary: each chunk's logits are computed once into one buffer, give the rows' statistics (m, logs, zt, sw:
    loss_math's contract), become dL/dz there in place, and go into the products dx_c = dz W and dW += dz^T x_c:
    three products in all, against the generic path's four (its backward recomputes the logits). dL/dz_j = p_j A -
    C [j == t] - E w_j with, for a valid row of reduction factor r (1, or 1 / the summed target weights): A = r ((1 -
    eps) w_t + eps W / V + 2 z_loss lse), C = r (1 - eps) w_t, E = r eps / V (loss_math.head_coefficients for this
    loss); 0 for an ignored row.
    dw_rows: W's gradient for the first dw_rows classes only (None: all of them). known: (c0, m, rest, e_t) from an
    earlier call on the same inputs (each row's max, its exp-sum without the target, the target's exp term): W's
    gradient for the classes [c0, V) alone, the chunks' logits over those classes only and the same dL/dz (the loss
    and the other gradients left out: (None, (None, dW, None), known))."""
    n, D = x.shape
    V = w.shape[0]
    acc = acc_dtype(x.dtype)
    need_x, need_w, need_b = needs
    f = dict(device=x.device, dtype=acc)
    valid, w_t, w_sum = ce_row_terms(target, class_w, ignore_index, eps, V, acc)
    # The reduction's factor per row, 0 where ignored (where(): 1 / 0 when every row is ignored must not reach them).
    r = valid.to(acc) if reduction == "sum" else torch.where(valid, 1.0 / w_t.sum(), 0.0)
    C = (r * w_t) * (1.0 - eps) if eps < 1.0 else None
    A_s = r * ((eps / V) * w_sum) if eps > 0.0 else None  # A less C: the target column's own A (At)
    A = C if A_s is None else (A_s if C is None else C + A_s)
    E = r * (eps / V) if eps > 0.0 else None
    inside = (target >= 0) & (target < V)
    if E is not None:
        E_t = E * (w_t if class_w is not None else 1.0)  # E w_t (w_t is 0 at an ignored row, and so is E)
    c0 = 0
    if known is not None:
        c0, m, rest, e_t_all = known
        need_x = need_b = False
    else:
        m = torch.empty(n, **f)
        rest = torch.empty(n, **f) if dw_rows is not None else None
        e_t_all = torch.empty(n, **f) if dw_rows is not None else None
    cols = V - c0  # the classes [c0, V) this call's logits cover
    # W (and b) in the accumulation dtype, over the classes this call covers only (a half-precision head's copy).
    wa = w[c0:] if w.dtype == acc else w[c0:].to(acc)
    bk = None if b is None else b[c0:].to(acc)
    cwk = None if class_w is None else class_w[c0:]
    # The target's column among them: where a row's target lies in [c0, V).
    here = inside & (target >= c0)
    idx = torch.where(here, target - c0, 0)
    logs = torch.empty(n, **f) if known is None else None
    zt = torch.empty(n, **f) if known is None else None
    sw = torch.empty(n, **f) if eps > 0.0 and known is None else None
    dx = torch.empty(n, D, **f) if need_x else None
    k_w = cols if dw_rows is None else dw_rows  # W's gradient rows made here: [c0, c0 + k_w)
    dw = torch.empty(k_w, D, **f) if need_w else None
    db = torch.zeros(V, **f) if need_b else None
    buf = torch.empty(rows * cols, **f)
    slope_buf = torch.empty(rows * cols, **f) if softcap is not None else None
    for i0, i1 in chunks(n, rows):
        sl = slice(i0, i1)
        x_c = x[sl] if x.dtype == acc else x[sl].to(acc)
        z = buf[: (i1 - i0) * cols].view(i1 - i0, cols)
        if bk is not None:
            torch.addmm(bk, x_c, wa.T, out=z)
        else:
            torch.mm(x_c, wa.T, out=z)
        slope = None
        if softcap is not None:  # the chain factor from the raw logits (softcap_slope's form), then the cap
            slope = slope_buf[: z.numel()].view_as(z)
            torch.div(z, softcap, out=slope).abs_().mul_(-2.0).sigmoid_()
            slope.addcmul_(slope, slope, value=-1.0).mul_(4.0)
            apply_softcap(z, softcap, inplace=True)
        ix = idx[sl, None]
        ins = inside[sl]
        if known is None:
            m_c = z.amax(dim=1)
            m[sl] = m_c
            zt[sl] = torch.where(ins, z.gather(1, ix)[:, 0], 0.0)
        else:
            m_c = m[sl]
        z.sub_(m_c[:, None])  # z - m, exact
        if sw is not None:
            sw[sl] = z.sum(dim=1) if class_w is None else z @ class_w
        z.exp_()
        # S = rest + e_t, rest summed without the target (loss_math.head_coefficients): 1 - p_t = rest / S, which
        # p_t - 1 loses for a near-certain row.
        if known is None:
            e_t = z.gather(1, ix)[:, 0]
            z.scatter_(1, ix, torch.where(ins, 0.0, e_t)[:, None])
            rest_c = z.sum(dim=1)
            z.scatter_(1, ix, e_t[:, None])
            if rest is not None:
                rest[sl] = rest_c
                e_t_all[sl] = e_t
        else:
            rest_c, e_t = rest[sl], e_t_all[sl]
        s_c = rest_c + torch.where(ins, e_t, 0.0)
        logs_c = torch.log(s_c)
        if logs is not None:
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
            if cwk is not None:
                z.addcmul_(E[sl, None], cwk[None, :], value=-1.0)
            else:
                z.sub_(E[sl, None])
        if C is not None:
            # The target's column: p_t At - (1 - p_t) C - E w_t, not p_t A - C (- E w_t), which cancels.
            d_t = -one_minus_pt(rest_c, logs_c, torch.where(ins, e_t, 0.0)) * C[sl]
            if at_c is not None:
                d_t = d_t + e_t * (at_c / s_c)
            if E is not None:
                d_t = d_t - E_t[sl]
            z.scatter_(1, ix, torch.where(here[sl], d_t, z.gather(1, ix)[:, 0])[:, None])
        if slope is not None:
            z.mul_(slope)
        if need_x:
            torch.mm(z, wa, out=dx[sl])
        if need_w:
            zw = z if k_w == cols else z[:, :k_w]
            if i0 == 0:
                torch.mm(zw.T, x_c, out=dw)
            else:
                dw.addmm_(zw.T, x_c)
        if need_b:
            db += z.sum(dim=0)
    del buf, slope_buf
    if known is not None:
        return None, (None, dw, None), known[1:]
    per_token = ce_loss_from_stats(m, logs, zt, sw, m, valid, w_t, w_sum, eps, z_loss, V)
    return reduce_loss(per_token, valid, w_t, reduction, ()), (dx, dw, db), (m, rest, e_t_all)
