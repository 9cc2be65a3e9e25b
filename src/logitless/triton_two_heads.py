"""The two-head losses' Triton backend: the launchers of the kernels/two_heads package as two torch.library ops.

``logitless::two_heads_loss`` returns the per-row loss (loss_math.row_loss on the kernels' loss_math.RowStats) with
the statistics its backward needs, and is differentiable: its autograd formula calls ``logitless::two_heads_grad``,
the student's gradients. As torch.library ops, torch.compile sees each as one opaque op. The teacher gets no
gradient.

This module imports Triton: head.py imports it only inside the call that chose the Triton backend.
"""

from __future__ import annotations

import torch

from . import skip_gate
from ._autograd import no_double_backward, no_setup
from .kernels import current_tuning, narrow
from .kernels.two_heads import backward as two_heads_backward
from .kernels.two_heads import config as two_heads_config
from .kernels.two_heads import forward_stats as two_heads_stats
from .kernels.two_heads import pair_costs, skip_supported, tile_count
from .kernels.two_heads import skip_plan as two_heads_skip_plan
from .loss_math import RowStats, row_loss
from .torch_backend import two_heads as torch_two_heads

_LOSS_SCHEMA = ("(Tensor xs, Tensor ws, Tensor? bs, Tensor xt, Tensor wt, Tensor? bt, str kind, float beta, "
                "float? softcap, float inv_temp, int? workspace_bytes, float skip_threshold) -> (Tensor, Tensor, "
                "Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
_GRAD_SCHEMA = ("(Tensor xs, Tensor ws, Tensor? bs, Tensor xt, Tensor wt, Tensor? bt, Tensor m_s, Tensor logs_s, "
                "Tensor m_t, Tensor logs_t, Tensor R, Tensor g, str kind, float beta, float? softcap, "
                "float inv_temp, bool need_dx, bool need_dw, bool need_db, int? workspace_bytes, Tensor cost, "
                "Tensor err, float skip_threshold) -> (Tensor, Tensor, Tensor)")


def _records(xs, ws, skip_threshold) -> bool:
    """Whether the forward records the tiles for skipping (shapes and options only: the fake agrees). Not at the
    narrow D, whose backward is the PyTorch backend's."""
    return (skip_threshold != 0.0 and xs.shape[0] > 0 and ws.shape[0] > 0 and not narrow(xs)
            and skip_supported(xs))


def _cost_shapes(xs, ws, skip_threshold):
    if not _records(xs, ws, skip_threshold):
        return (0, 0), (2, 0)
    return (xs.shape[0], tile_count(xs, ws.shape[0])), (2, xs.shape[0])


@torch.library.custom_op("logitless::two_heads_loss", mutates_args=(), schema=_LOSS_SCHEMA)
def _loss_op(xs, ws, bs, xt, wt, bt, kind, beta, softcap, inv_temp, workspace_bytes, skip_threshold):
    """(per-row loss, m_s, logs_s, m_t, logs_t, R, cost, err), float32, (N,) each but R (2, N): the row terms of
    the student's gradient (row_loss; zeros where the kind has none), and where the backward may skip (_records),
    the pair costs (N, tiles) and the rows' error scales (2, N) of kernels/two_heads' pair_costs (else empty).
    workspace_bytes and skip_threshold (0: dense; > 0 a fixed budget; < 0 "auto"'s unit) are for the backward."""
    bs = None if bs is None else bs.contiguous()  # the kernels read biases with unit stride
    bt = None if bt is None else bt.contiguous()
    shape, err_shape = _cost_shapes(xs, ws, skip_threshold)
    tiles = torch.empty((3, *shape), device=xs.device, dtype=torch.float32) if shape[0] else None
    st = RowStats(*two_heads_stats(xs, ws, bs, xt, wt, bt, kind=kind, beta=beta, softcap=softcap, inv_temp=inv_temp,
                                   tiles=tiles))
    loss, R, t_ref, t_aux = row_loss(kind, beta, st)
    if tiles is not None:
        cost, err = pair_costs(tiles, st.m_s, st.logs_s, st.m_t, st.logs_t, loss, kind, beta)
    else:
        cost, err = loss.new_empty(shape), loss.new_empty(err_shape)
    return (loss, *(t.clone() for t in (st.m_s, st.logs_s, t_ref, t_aux)), _rows2(R, loss), cost, err)


def _rows2(R, like):
    # The gradient's row terms as one (2, N) tensor (the op's fixed output): R's rows, zeros where there is none.
    out = torch.zeros((2, like.shape[0]), dtype=like.dtype, device=like.device)
    if R is not None and R.dim() == 1:
        out[0] = R
    elif R is not None:
        out.copy_(R)
    return out


@_loss_op.register_fake
def _loss_fake(xs, ws, bs, xt, wt, bt, kind, beta, softcap, inv_temp, workspace_bytes, skip_threshold):
    shape, err_shape = _cost_shapes(xs, ws, skip_threshold)
    return tuple(xs.new_empty(xs.shape[0], dtype=torch.float32) for _ in range(5)) + (
        xs.new_empty((2, xs.shape[0]), dtype=torch.float32), xs.new_empty(shape, dtype=torch.float32),
        xs.new_empty(err_shape, dtype=torch.float32))


@torch.library.custom_op("logitless::two_heads_grad", mutates_args=(), schema=_GRAD_SCHEMA)
def _grad_op(xs, ws, bs, xt, wt, bt, m_s, logs_s, m_t, logs_t, R, g, kind, beta, softcap, inv_temp, need_dx,
             need_dw, need_db, workspace_bytes, cost, err, skip_threshold):
    """(dx_s, dW_s, db_s) for the upstream per-row gradient g; a gradient not asked for is empty. With the
    forward's pair costs (cost not empty), the cold pairs are skipped: always for a fixed threshold, and for
    "auto" (skip_threshold < 0) where skip_gate finds that it pays for this student head."""
    if narrow(xs):
        # The narrow-D rule (kernels.narrow) through the PyTorch backend's backward, which keeps dz in
        # float32, chunked. Its statistics are its own pass: the kernels' are of other roundings of the same logits,
        # and a recomputed logit must meet its own maximum exactly (at V = 1 the gradient is exactly 0, and was
        # 1.6e-8 on the kernels' statistics).
        out = torch_two_heads.grads_on_own_stats(xs, ws, bs, xt, wt, bt, kind, beta, softcap, inv_temp, g.float(),
                                                 (need_dx, need_dw, bs is not None and need_db))
        return tuple(t if t is not None else xs.new_empty(0) for t in out)
    bs = None if bs is None else bs.contiguous()
    bt = None if bt is None else bt.contiguous()
    g = g.float().contiguous()
    sp = None
    if cost.numel() > 0 and (need_dx or need_dw or need_db) and (
            skip_threshold > 0 or skip_gate.decide(ws, current_tuning().skip_min_share)):
        sink = current_tuning().debug_plans
        sp = two_heads_skip_plan(cost, err, g, skip_threshold, two_heads_config(xs).block_n,
                                 current_tuning().skip_group_rows, bound=sink is not None)
        if sink is not None:
            sink.append(sp)
        if skip_threshold < 0:  # the plan's skipped share tells skip_gate whether skipping pays for this head
            skip_gate.observe(ws, sp)
    out = two_heads_backward(xs, ws, bs, xt, wt, bt, m_s, logs_s, m_t, logs_t, R, g, kind=kind,
                             beta=beta, softcap=softcap, inv_temp=inv_temp, need_dx=need_dx, need_dw=need_dw,
                             need_db=need_db, workspace_bytes=workspace_bytes, sp=sp)
    return tuple(t if t is not None else xs.new_empty(0) for t in out)


@_grad_op.register_fake
def _grad_fake(xs, ws, bs, xt, wt, bt, m_s, logs_s, m_t, logs_t, R, g, kind, beta, softcap, inv_temp, need_dx,
               need_dw, need_db, workspace_bytes, cost, err, skip_threshold):
    dx = torch.empty_like(xs, memory_format=torch.contiguous_format) if need_dx else xs.new_empty(0)
    dw = torch.empty_like(ws, memory_format=torch.contiguous_format) if need_dw else xs.new_empty(0)
    db = torch.empty_like(bs) if need_db and bs is not None else xs.new_empty(0)
    return dx, dw, db


def _loss_setup_context(ctx, inputs, output):
    xs, ws, bs, xt, wt, bt, kind, beta, softcap, inv_temp, workspace_bytes, skip_threshold = inputs
    _, m_s, logs_s, m_t, logs_t, R, cost, err = output
    ctx.save_for_backward(xs, ws, bs, xt, wt, bt, m_s, logs_s, m_t, logs_t, R, cost, err)
    ctx.opts = (kind, beta, softcap, inv_temp, workspace_bytes, skip_threshold)
    ctx.mark_non_differentiable(m_s, logs_s, m_t, logs_t, R, cost, err)


def _loss_backward(ctx, g, *_ignored):
    xs, ws, bs, xt, wt, bt, m_s, logs_s, m_t, logs_t, R, cost, err = ctx.saved_tensors
    kind, beta, softcap, inv_temp, workspace_bytes, skip_threshold = ctx.opts
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_db = bs is not None and ctx.needs_input_grad[2]
    if g is None or not (need_dx or need_dw or need_db):
        return (None,) * 12
    dx, dw, db = _grad_op(xs, ws, bs, xt, wt, bt, m_s, logs_s, m_t, logs_t, R, g, kind, beta, softcap, inv_temp,
                          need_dx, need_dw, need_db, workspace_bytes, cost, err, skip_threshold)
    return (dx if need_dx else None, dw if need_dw else None, db if need_db else None) + (None,) * 9


torch.library.register_autograd("logitless::two_heads_loss", _loss_backward, setup_context=_loss_setup_context)
torch.library.register_autograd("logitless::two_heads_grad", no_double_backward, setup_context=no_setup)


def loss(xs, ws, bs, xt, wt, bt, kind, beta, softcap, inv_temp, workspace_bytes, skip_threshold=0.0) -> torch.Tensor:
    """The per-row loss through the kernels (differentiable with respect to xs, ws and bs; float32, bfloat16 or
    float16 heads of one dtype); workspace_bytes for the backward (None: the memory policy); skip_threshold: 0
    (dense), > 0 (a fixed budget per row) or < 0 ("auto": budgets in that unit of PyTorch's rounding, gated by
    skip_gate), kernels/two_heads' skip_plan."""
    return _loss_op(xs, ws, bs, xt, wt, bt, kind, float(beta), softcap, inv_temp, workspace_bytes,
                    float(skip_threshold))[0]
