"""The row-chunk plan's launcher: a reduced cross-entropy of a bf16 linear head and its gradients in one forward.

forward_with_grads walks the rows in chunks of plans.row_chunk_plan. Each chunk's full rows of logits are one
product into a bf16 buffer (cuBLAS, as F.linear computes them); the cross-entropy kernel on existing logits
(kernels/cross_entropy/, in place) takes each row's statistics and loss and writes dL/dz over the logits in one
memory pass; two products take the gradients from there: dx_c = dz W (the chunk's rows of dx, written once) and
dW += dz^T x_c, into a float32 accumulator where the plan has one, else into dW itself (bf16, one rounding per
chunk: the bound is in docs/design/row_chunks.md). Three products in all, against the column plan's
3 + (1 - stashed share). The gradients are those of an upstream gradient of 1; the caller scales them.
No host synchronisation: the mean's factor is a device scalar that the kernel reads.
"""

from __future__ import annotations

import contextlib

import torch

from .. import cross_entropy as ce
from .products import _Fp32Reductions
from .row_chunk_plan import RowChunkPlan


def _mm(out, a, b, bias=None, accumulate=False):
    """out = a @ b (+ bias) (+ out when accumulate), float32 accumulation, one rounding to out's dtype: cuBLAS on
    CUDA (addmm with a float32 output for a float32 out), a float32 stand-in on the CPU (the tests)."""
    if not out.is_cuda:
        r = a.float() @ b.float()
        if bias is not None:
            r += bias.float()
        if accumulate:
            r += out.float()
        out.copy_(r)
        return
    f32 = dict(out_dtype=torch.float32) if out.dtype == torch.float32 and a.dtype != torch.float32 else {}
    if accumulate:
        torch.addmm(out, a, b, **f32, out=out)
    elif bias is not None:
        torch.addmm(bias, a, b, out=out)
    else:
        torch.mm(a, b, **f32, out=out)


def _split(V):
    # cuBLAS's bf16 products leave their fast path at a class count that is not a multiple of 8 (an odd vocabulary:
    # docs/design/row_chunks.md): the aligned classes, then the few left.
    main = V // 8 * 8
    return [(0, main), (main, V)] if 0 < main < V else [(0, V)]


def forward_with_grads(x, w, b, target, class_w, reduction, ignore_index, eps, z_loss, softcap, plan: RowChunkPlan,
                       needs):
    """(loss, dx, dw, db) for x (N, D) and w (V, D) bfloat16 (b (V,) or None), target (N,) int64, class_w (V,)
    float32 or None: the reduced ("mean" / "sum") cross-entropy (float32 scalar) and its gradients for an upstream
    gradient of 1, dx and dw in bf16, db in float32 (None where `needs` (x, w, b) says not wanted)."""
    N, D = x.shape
    V = w.shape[0]
    need_x, need_w, need_b = needs
    dev = x.device
    valid = target != ignore_index
    w_sum = class_w.sum() if class_w is not None and eps > 0.0 else None
    denom = scale = None
    if reduction == "mean":
        denom = (valid.sum(dtype=torch.float32) if class_w is None
                 else (class_w[torch.where(valid, target, 0)] * valid).sum())
        scale = denom.reciprocal()  # inf when every row is ignored: the kernel never multiplies by it then
    dx = torch.empty_like(x, memory_format=torch.contiguous_format) if need_x else None
    dw = torch.empty_like(w, memory_format=torch.contiguous_format) if need_w else None
    acc = torch.empty(V, D, device=dev, dtype=torch.float32) if need_w and plan.f32_dw else dw
    db = torch.zeros(V, device=dev, dtype=torch.float32) if need_b else None
    loss_rows = torch.empty(N, device=dev, dtype=torch.float32)
    buf = torch.empty(plan.rows * plan.ld, device=dev, dtype=x.dtype)
    parts = _split(V)
    # With an unaligned tail, a chunk's dx sums two products: in float32, rounded once into dx.
    dx32 = (torch.empty(plan.rows, D, device=dev, dtype=torch.float32) if need_x and len(parts) > 1 else None)
    with _Fp32Reductions() if x.is_cuda else contextlib.nullcontext():
        for i, i0 in enumerate(range(0, N, plan.rows)):
            i1 = min(i0 + plan.rows, N)
            x_c = x[i0:i1]
            z = buf[: (i1 - i0) * plan.ld].view(i1 - i0, plan.ld)[:, :V]
            for v0, v1 in parts:
                _mm(z[:, v0:v1], x_c, w[v0:v1].t(), bias=None if b is None else b[v0:v1])
            rows_loss, _, _ = ce.cross_entropy_fwd(z, target[i0:i1], class_w, w_sum, scale,
                                                   ignore_index=ignore_index, label_smoothing=eps, z_loss=z_loss,
                                                   softcap=softcap, write_grad=True)
            loss_rows[i0:i1] = rows_loss
            if need_x:
                out = dx[i0:i1] if dx32 is None else dx32[: i1 - i0]
                for k, (v0, v1) in enumerate(parts):
                    _mm(out, z[:, v0:v1], w[v0:v1], accumulate=k > 0)
                if dx32 is not None:
                    dx[i0:i1].copy_(out)
            if need_w:
                for v0, v1 in parts:
                    _mm(acc[v0:v1], z[:, v0:v1].t(), x_c, accumulate=i > 0)
            if need_b:
                db += z.sum(0, dtype=torch.float32)
    del buf, dx32
    if acc is not None and acc is not dw:
        dw.copy_(acc)
        del acc
    loss = loss_rows.sum()
    if denom is not None:
        loss = loss / denom
    return loss, dx, dw, db
