"""The Triton backend of the head op: the launchers of the kernels/linear_head package as torch.library ops.

``logitless::linear_head_stats`` returns the statistics of loss_math's contract (plus the tiles and the stash that
the backward's options need) and is differentiable: its autograd formula turns the statistics' upstream gradients
into the per-row coefficients (A, B, C, E) (loss_math.head_coefficients) of ``logitless::linear_head_grad``, the
generic backward. As torch.library ops, torch.compile sees each as one opaque op.

This module imports Triton (through the kernels it launches): head.py imports it only inside the calls that chose
the Triton backend, the one lazy boundary that keeps `import logitless` free of Triton.

The head op calls it as it calls the PyTorch backend, through the same three names: fused_plan (the row-chunk plan
of a reduced loss whose gradient is wanted, or skipping cold tiles where that pays: this call's skip decided here),
fused_cross_entropy (that plan's loss) and stats (the statistics, with the backward's skipping planned here).
"""

from __future__ import annotations

import torch

from . import skip_gate, vocab
from ._autograd import first_order_only, grads_wanted, graph_kept, no_double_backward, no_setup, scale_forward_grads
from ._dispatch import is_compiling
from .kernels import current_tuning, new_buffer
from .kernels.cross_entropy import scale_rows_
from .kernels.linear_head import backward, forward_stats, skip_supported, stash_layout, tile_grid, vocab_order
from .kernels.linear_head.row_chunk_plan import row_chunk_plan as plan_row_chunks
from .kernels.linear_head.row_chunks import forward_with_grads
from .loss_math import Stats, head_coefficients

__all__ = ["fused_cross_entropy", "fused_plan", "resolve_skip", "row_chunk_plan", "stats"]

# skip_threshold="auto": the rows' budgets add up to a quarter of the rounding error PyTorch's own gradient has in the
# input dtype, in units of u max(1, |m_i|) / 4 with u = 2^-9 (bfloat16) or 2^-12 (float16), shared over the batch
# by each row's mass outside its top class (docs/kernels.md, "Sparsity"). Passed to the kernels as a negative
# threshold (plans.row_budget).
AUTO_SKIP_UNIT = {torch.bfloat16: 2.0**-11, torch.float16: 2.0**-14}


def auto_threshold(dtype: torch.dtype) -> float:
    """The kernels' threshold for skip_threshold="auto" in `dtype`: negative, meaning a budget per row of this unit
    times max(1, |m_i|) (1 - p_max,i), scaled by Tuning.skip_budget_scale; 0 (nothing skipped) where the dtype has
    no unit."""
    return -AUTO_SKIP_UNIT.get(dtype, 0.0) * current_tuning().skip_budget_scale


_STATS_SCHEMA = ("(Tensor x, Tensor weight, Tensor? bias, Tensor? target, Tensor? class_weight, float? softcap, "
                 "float inv_temp, bool want_smooth, bool want_entropy, Tensor? perm, bool want_tiles, "
                 "float skip_threshold, int? workspace_bytes, bool want_stash, bool stash_dx, bool want_lse, "
                 "bool gate_skip, bool want_rest) "
                 "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")


def _has_rest(target, perm, want_entropy, grads) -> bool:
    """Whether the forward sums rest = sum_{j != t} exp(z_j - m) for the backward's 1 - p_t: with the entropy and a
    target (not with a vocabulary order, whose kernels would find the target's column by a compare in every tile),
    when a backward may follow (grads: a gradient is wanted; a no-grad pass, an RL reference or old-policy pass,
    has no use for it). Not for every target: summed in every forward (the loss alone too), it made the forward
    markedly slower, for a precision that only near-certain rows' target column needs (docs/design/forward.md,
    "Tried and rejected"). The other statistics do not depend on it, bit for bit."""
    return target is not None and perm is None and bool(want_entropy) and bool(grads)


def _stash_layout(x, weight, want_stash, stash_dx, workspace_bytes):
    return stash_layout(x, weight, stash_dx, workspace_bytes) if want_stash else None


@torch.library.custom_op("logitless::linear_head_stats", mutates_args=(), schema=_STATS_SCHEMA)
def _stats_op(x, weight, bias, target, class_weight, softcap, inv_temp, want_smooth, want_entropy, perm, want_tiles,
              skip_threshold, workspace_bytes, want_stash, stash_dx, want_lse, gate_skip, want_rest):
    """(m, logs, zt, sw, ent), each (N,) float32, each row's float16 log-sum-exp per vocabulary tile that the
    backward's skipping needs (empty unless want_tiles), the stash: the buffer of the weight's gradient, in which
    the forward keeps logits for the backward (kernels/linear_head/plans.py, stash_layout; empty unless want_stash and
    there is room), and with want_rest (_has_rest) the backward's (mu, rest)
    (loss_math.head_coefficients; mu only with the entropy; else empty). lse = m + logs and sw = sum_j w_j (z_j -
    m). For autograd the row max m is a constant offset (every use of these statistics is invariant to shifting it),
    so its gradient is ignored and logs carries d lse/dz_j = p_j. perm (a vocabulary order), skip_threshold,
    workspace_bytes, stash_dx (the backward computes the input's gradient) and gate_skip (the backward asks
    skip_gate whether to skip) are for the backward. Last, with
    want_lse, lse = m + logs as a statistic with a gradient of its own (loss_math's module docstring; else
    empty)."""
    # The kernels read the bias with unit stride; a strided one (a column of a table) is copied here, inside the
    # op, so autograd still sees the caller's tensor. (Targets and class weights arrive contiguous.)
    bias = None if bias is None else bias.contiguous()
    tiles = new_buffer(tile_grid(x, weight), device=x.device, dtype=torch.float16) if want_tiles else None
    layout = _stash_layout(x, weight, want_stash, stash_dx, workspace_bytes)
    stash = new_buffer(weight.shape, device=x.device, dtype=weight.dtype) if layout is not None else None
    extra = {} if stash is None else {"stash": (stash, layout)}
    mu_rest = None
    if want_rest:
        mu_rest = extra["mu_rest"] = new_buffer((2, x.shape[0]), device=x.device, dtype=torch.float32)
    stats = forward_stats(x, weight, bias, target, class_weight, softcap=softcap, inv_temp=inv_temp,
                             want_smooth=want_smooth, want_entropy=want_entropy, perm=perm, tile_lse=tiles, **extra)
    if tiles is None or x.shape[0] == 0:
        tiles = x.new_empty(0, dtype=torch.float16)
    mu, rest = (mu_rest[0], mu_rest[1]) if mu_rest is not None else (x.new_empty(0, dtype=torch.float32),) * 2
    lse = stats[0] + stats[1] if want_lse else x.new_empty(0, dtype=torch.float32)
    return (*stats, tiles, stash if stash is not None else weight.new_empty(0), mu.clone(), rest.clone(), lse)


@_stats_op.register_fake
def _stats_fake(x, weight, bias, target, class_weight, softcap, inv_temp, want_smooth, want_entropy, perm,
                want_tiles, skip_threshold, workspace_bytes, want_stash, stash_dx, want_lse, gate_skip, want_rest):
    tiles = (x.new_empty(tile_grid(x, weight), dtype=torch.float16)
             if want_tiles and x.shape[0] != 0 else x.new_empty(0, dtype=torch.float16))
    layout = _stash_layout(x, weight, want_stash, stash_dx, workspace_bytes)
    stash = weight.new_empty(weight.shape if layout is not None else 0)
    n_mu = x.shape[0] if want_rest else 0
    return (*(x.new_empty(x.shape[0], dtype=torch.float32) for _ in range(5)), tiles, stash,
            x.new_empty(n_mu, dtype=torch.float32), x.new_empty(n_mu, dtype=torch.float32),
            x.new_empty(x.shape[0] if want_lse else 0, dtype=torch.float32))


_GRAD_ARGS = ("Tensor x, Tensor weight, Tensor? bias, Tensor? target, Tensor? class_weight, Tensor m, Tensor logs, "
              "Tensor A, Tensor? B, Tensor? C, Tensor? E, float? softcap, float inv_temp, bool need_dx, "
              "bool need_dw, bool need_db, Tensor? perm, Tensor? tile_lse, float skip_threshold, "
              "int? workspace_bytes, Tensor? At, bool gate_skip")
_GRAD_SCHEMA = f"({_GRAD_ARGS}) -> (Tensor, Tensor, Tensor)"


def _backward(x, weight, bias, target, class_weight, m, logs, A, B, C, E, softcap, inv_temp, need_dx, need_dw,
              need_db, perm, tile_lse, skip_threshold, workspace_bytes, At, gate_skip, stash=None):
    bias = None if bias is None else bias.contiguous()  # as in _stats_op
    extra = {} if stash is None else {"stash": stash}
    if (gate_skip and tile_lse is not None and perm is None
            and not skip_gate.decide(weight, _min_share(x, weight, False))):
        tile_lse = None  # the dense plans (the forward recorded the tiles for either answer)
    if skip_threshold < 0:  # "auto": the plan's skipped share tells skip_gate whether skipping pays for this head
        extra["on_plan"] = lambda plan: skip_gate.observe(weight, plan)
    return backward(x, weight, bias, target, class_weight, m, logs, A, B, C, E, softcap=softcap, inv_temp=inv_temp,
                    need_dx=need_dx, need_dw=need_dw, need_db=need_db, perm=perm, tile_lse=tile_lse,
                    skip_threshold=skip_threshold, workspace_bytes=workspace_bytes, At=At, **extra)


@torch.library.custom_op("logitless::linear_head_grad", mutates_args=(), schema=_GRAD_SCHEMA)
def _grad_op(x, weight, bias, target, class_weight, m, logs, A, B, C, E, softcap, inv_temp, need_dx, need_dw,
             need_db, perm, tile_lse, skip_threshold, workspace_bytes, At, gate_skip):
    """(dx, dW, db) for dL/dz_j = p_j (A + B (z_j - m)) - C [j == t] - E w_j (with At, the target's column
    p_t (At + B (z_t - m)) - C - E w_t: loss_math.head_coefficients); a gradient not asked for is empty.
    With tile_lse and skip_threshold > 0, cold (token block, tile) pairs are skipped
    (kernels/linear_head/plans.py, skip_plan); with gate_skip, where skip_gate finds that skipping pays."""
    dx, dw, db = _backward(x, weight, bias, target, class_weight, m, logs, A, B, C, E, softcap, inv_temp, need_dx,
                           need_dw, need_db, perm, tile_lse, skip_threshold, workspace_bytes, At, gate_skip)
    # Outputs must not alias one another: a fresh empty tensor for each gradient not asked for.
    return tuple(g if g is not None else x.new_empty(0) for g in (dx, dw, db))


@_grad_op.register_fake
def _grad_fake(x, weight, bias, target, class_weight, m, logs, A, B, C, E, softcap, inv_temp, need_dx, need_dw,
               need_db, perm, tile_lse, skip_threshold, workspace_bytes, At, gate_skip):
    dx = torch.empty_like(x, memory_format=torch.contiguous_format) if need_dx else x.new_empty(0)
    dw = torch.empty_like(weight, memory_format=torch.contiguous_format) if need_dw else x.new_empty(0)
    db = torch.empty_like(bias) if need_db and bias is not None else x.new_empty(0)
    return dx, dw, db


@torch.library.custom_op("logitless::linear_head_grad_into", mutates_args=("stash",),
                         schema=f"({_GRAD_ARGS}, Tensor(a!) stash) -> (Tensor, Tensor)")
def _grad_into_op(x, weight, bias, target, class_weight, m, logs, A, B, C, E, softcap, inv_temp, need_dx, need_dw,
                  need_db, perm, tile_lse, skip_threshold, workspace_bytes, At, gate_skip, stash):
    """linear_head_grad with the forward's stash (need_dw set): dW is written into it (the logits it holds are
    used up); returns (dx, db), empty where not asked for. Eager backward only (stats, _stats_backward)."""
    dx, _, db = _backward(x, weight, bias, target, class_weight, m, logs, A, B, C, E, softcap, inv_temp, need_dx,
                          need_dw, need_db, perm, tile_lse, skip_threshold, workspace_bytes, At, gate_skip, stash)
    return tuple(g if g is not None else x.new_empty(0) for g in (dx, db))


@_grad_into_op.register_fake
def _grad_into_fake(x, weight, bias, target, class_weight, m, logs, A, B, C, E, softcap, inv_temp, need_dx, need_dw,
                    need_db, perm, tile_lse, skip_threshold, workspace_bytes, At, gate_skip, stash):
    dx = torch.empty_like(x, memory_format=torch.contiguous_format) if need_dx else x.new_empty(0)
    db = torch.empty_like(bias) if need_db and bias is not None else x.new_empty(0)
    return dx, db


def _stats_setup_context(ctx, inputs, output):
    (x, weight, bias, target, class_weight, softcap, inv_temp, want_smooth, want_entropy, perm, want_tiles, tau,
     ws, _want_stash, _stash_dx, want_lse, gate_skip, has_rest) = inputs
    m, logs, zt, _, ent, tiles, stash, mu, rest, _lse = output
    ctx.save_for_backward(x, weight, bias, target, class_weight, m, logs, ent, perm,
                          tiles if want_tiles and x.shape[0] != 0 else None, mu if has_rest and want_entropy else None,
                          rest if has_rest else None, zt if has_rest or (want_lse and target is not None) else None)
    ctx.opts = (softcap, inv_temp, want_smooth, want_entropy, tau, ws, want_lse, gate_skip)
    # The stash is not a saved tensor: the backward writes dW over it (a saved tensor's version check would fail)
    # and hands it on as the weight's gradient after dropping this reference, so that AccumulateGrad takes it over
    # without a copy. Non-differentiable, so it holds no reference back to this node.
    ctx.mark_non_differentiable(stash, mu, rest)
    ctx.stash = stash if stash.numel() else None
    # Outputs without an upstream gradient get None, not zeros: a zero "gradient" of the stash would be V x D.
    ctx.set_materialize_grads(False)


def _stats_backward(ctx, _g_m, g_logs, g_zt, g_sw, g_ent, _g_tiles, _g_stash, _g_mu, _g_rest, g_lse):
    x, weight, bias, target, class_weight, m, logs, ent, perm, tiles, mu, rest, zt = ctx.saved_tensors
    softcap, inv_temp, want_smooth, want_entropy, tau, ws, want_lse, gate_skip = ctx.opts
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_db = bias is not None and ctx.needs_input_grad[2]
    if not (need_dx or need_dw or need_db):
        return (None,) * 18
    A, B, C, E, At = head_coefficients(m, logs, ent, g_logs, g_zt if target is not None else None,
                                       g_sw if want_smooth else None, g_ent if want_entropy else None, mu, rest,
                                       zt, g_lse if want_lse else None)
    # The stash is used up by the first backward (it becomes dW), and only by one that frees the graph: while the
    # graph is kept (retain_graph=True, autograd.grad, gradcheck) every backward recomputes, so that all of them give
    # the same gradients bit for bit. A backward that builds a graph (create_graph=True: the functional op, whose
    # double backward raises) recomputes too.
    stash, ctx.stash = ctx.stash, None
    if stash is not None and not torch.is_grad_enabled() and need_dw and not graph_kept():
        dx, db = _grad_into_op(x, weight, bias, target, class_weight, m, logs, A, B, C, E, softcap, inv_temp,
                               need_dx, need_dw, need_db, perm, tiles, tau, ws, At, gate_skip, stash)
        dw = stash
    else:
        dx, dw, db = _grad_op(x, weight, bias, target, class_weight, m, logs, A, B, C, E, softcap, inv_temp,
                              need_dx, need_dw, need_db, perm, tiles, tau, ws, At, gate_skip)
    return (dx if need_dx else None, dw if need_dw else None, db if need_db else None) + (None,) * 15


torch.library.register_autograd("logitless::linear_head_stats", _stats_backward, setup_context=_stats_setup_context)


torch.library.register_autograd("logitless::linear_head_grad", no_double_backward, setup_context=no_setup)


def stats(x, weight, bias, target, class_weight, softcap, inv_temp, want_smooth, want_entropy, *, skip,
          ignore_index=-100, workspace_bytes=None, want_lse=False) -> Stats:
    """The head op's statistics through the kernels (differentiable; float32, bfloat16 or float16 inputs of one
    dtype, at least one class); skip (head.Skip, decided here by resolve_skip unless the caller did) shapes the
    backward: tiles are recorded, and the vocabulary ordered (ignore_index keeps ignored targets out of the "batch"
    order), only where it may skip; workspace_bytes for the backward (None: the memory policy); want_lse: the lse
    statistic (loss_math's module docstring)."""
    skip = resolve_skip(skip, x, weight, bias)
    perm, want_tiles, tau = _skip_plan(x, weight, target, skip, ignore_index, workspace_bytes)
    cw = None if class_weight is None else class_weight.float().contiguous()
    # The forward keeps logits for the backward in the weight gradient's buffer where it has room (kernels.Tuning's
    # stash_logits; the layout: kernels/linear_head/plans.py): not when tracing for torch.compile, whose backward
    # graph must not depend on whether the stash was already spent, nor with skipping (its tiles and orders plan the
    # backward's memory).
    want_stash = (torch.is_grad_enabled() and weight.requires_grad and not want_tiles and perm is None
                  and not torch.compiler.is_compiling())
    grads = grads_wanted(x, weight, bias)
    out = _stats_op(x, weight, bias, target, cw, None if softcap is None else float(softcap), float(inv_temp),
                    bool(want_smooth), bool(want_entropy), perm, want_tiles, tau, workspace_bytes, want_stash,
                    x.requires_grad, bool(want_lse), skip.in_backward,
                    _has_rest(target, perm, want_entropy, grads))
    m, logs, zt, sw, ent = out[:5]
    return Stats(m, logs, zt if target is not None else None, sw if want_smooth else None,
                 ent if want_entropy else None, out[9] if want_lse else None)


def resolve_skip(skip, x, weight, bias, dense_row_chunks: bool = False):
    """This call's skipping (a head.Skip), decided once on the host (no sync): `skip` with resolved=True and
    threshold None where the call runs the dense plans. Nothing is skipped where the dtype (float32 has no "auto"
    budget), the loss (`bounded`), the call (no gradient wanted, no rows) or the device leave nothing to skip; a
    fixed threshold skips wherever it can; "auto" asks skip_gate whether skipping pays for this head, or under
    torch.compile leaves the question to the backward (in_backward), so that the compiled graph never depends on the
    answer. dense_row_chunks: the call's dense alternative is the row-chunk plan (three cuBLAS products), against
    which skipping must leave out a larger share to pay (Tuning.skip_min_share_row_chunks) than against the column
    plan (Tuning.skip_min_share)."""
    if skip.resolved:
        return skip
    # Built field by field, never with NamedTuple._replace: torch 2.11's dynamo fails on it (IndexError).
    dense = type(skip)(None, skip.vocab_order, skip.bounded, True, False)
    if skip.threshold is None or (not isinstance(skip.threshold, str) and float(skip.threshold) == 0.0):
        return dense
    grads = grads_wanted(x, weight, bias)
    if not (grads and skip.bounded and x.shape[0] > 0 and weight.shape[0] > 0
            and (skip.threshold != "auto" or x.dtype in AUTO_SKIP_UNIT)):
        return dense
    if not skip_supported(x):
        return dense
    done = type(skip)(skip.threshold, skip.vocab_order, skip.bounded, True, False)
    if skip.threshold != "auto":
        return done
    if is_compiling():
        return type(skip)(skip.threshold, skip.vocab_order, skip.bounded, True, True)
    if skip_gate.decide(weight, _min_share(x, weight, dense_row_chunks)):
        return done
    return dense


def _min_share(x, weight, dense_row_chunks: bool) -> float:
    """The skipped share from which skipping pays for this call (kernels.Tuning): against the row-chunk plan, for a
    small head (one product under skip_small_flop), or against the column plan."""
    tune = current_tuning()
    if dense_row_chunks:
        return tune.skip_min_share_row_chunks
    base = tune.skip_min_share
    if base > 0 and 2.0 * x.shape[0] * x.shape[-1] * weight.shape[0] < tune.skip_small_flop:
        return max(base, tune.skip_min_share_small)
    return base  # 0: skip wherever a plan is possible (tests, A/B runs)


def _skip_plan(x, w, target, skip, ignore_index, workspace_bytes):
    """(perm, want_tiles, threshold) from a resolved skip: tiles are recorded, and the vocabulary ordered, only when
    the backward may skip. The order depends on the backward's workspace_bytes."""
    if skip.threshold is None:
        return None, False, 0.0
    tau = auto_threshold(x.dtype) if skip.threshold == "auto" else float(skip.threshold)
    perm = None
    if isinstance(skip.vocab_order, torch.Tensor):
        perm = vocab_order(skip.vocab_order.detach(), x, w, workspace_bytes)
    elif skip.vocab_order == "batch" and target is not None:
        perm = vocab_order(vocab.class_counts(target, w.shape[0], ignore_index), x, w, workspace_bytes)
    return perm, True, tau


# ---------------------------------------------------------------------------------------------------------------
# The row-chunk plan of a reduced loss with a gradient wanted (kernels/linear_head/row_chunks.py)


def fused_plan(x, w, b, softcap, reduction, skip, workspace_bytes):
    """(the row-chunk plan or None, this call's skip, resolved): the dense plan of a reduced loss whose gradient is
    wanted, where the policy finds it faster within the budget (row_chunk_plan), against which skipping cold tiles
    is judged (resolve_skip) and, where it pays, replaces it (the statistics then run, with the skip)."""
    plan = row_chunk_plan(x, w, b, reduction, workspace_bytes)
    skip = resolve_skip(skip, x, w, b, dense_row_chunks=plan is not None)
    return (plan if skip.threshold is None else None), skip


def row_chunk_plan(x, w, b, reduction, workspace_bytes):
    """The row-chunk plan (kernels.linear_head.plans.row_chunk_plan) for validated 2-D inputs, or None where the
    column plan runs: a loss that is not reduced, no gradient wanted now, while torch.compile traces (it keeps the
    op's graph: a forward that computes gradients would hide them from it), an empty or strided operand. (A call
    that skips cold tiles runs the column plan: the caller asks only for a dense call.)"""
    needs = (x.requires_grad, w.requires_grad, b is not None and b.requires_grad)
    if (reduction == "none" or not torch.is_grad_enabled() or not any(needs) or is_compiling()
            or x.shape[0] == 0 or w.dtype != x.dtype or (b is not None and b.dtype != x.dtype)
            or x.stride(1) != 1 or w.stride(1) != 1):
        return None
    return plan_row_chunks(x.shape[0], w.shape[0], x.shape[1], x.dtype, needs[1], workspace_bytes)


class _RowChunkCrossEntropy(torch.autograd.Function):
    """(x, W, b) -> the reduced cross-entropy, its gradients computed in the forward (row_chunks.forward_with_grads);
    the backward scales them by the upstream gradient: into fresh tensors while the graph is kept (any number of
    backwards with retain_graph=True give the same gradients), in place in the backward that frees the graph (dx and
    dW through a kernel that leaves them untouched when the upstream gradient is exactly 1), so that AccumulateGrad
    takes them over without a copy."""

    @staticmethod
    def forward(ctx, x, w, b, target, class_w, reduction, ignore_index, eps, z_loss, softcap, plan):
        needs = (x.requires_grad, w.requires_grad, b is not None and b.requires_grad)
        loss, dx, dw, db = forward_with_grads(x, w, b, target, class_w, reduction, ignore_index, eps, z_loss, softcap,
                                              plan, needs)
        ctx.save_for_backward(x, w, b)  # for first_order_only's anchors only
        ctx.grads = (dx, dw, db)
        ctx.dtypes = (x.dtype, w.dtype, None if b is None else b.dtype)
        return loss

    @staticmethod
    @first_order_only
    def backward(ctx, g):
        # dx and dW through a kernel that leaves them untouched where the upstream gradient is exactly 1
        scale_ = lambda t, s: scale_rows_(t, s) if t.dim() == 2 else t.mul_(s)
        return (*scale_forward_grads(ctx, g.float(), scale_), None, None, None, None, None, None, None, None)


def fused_cross_entropy(x, w, b, target, class_w, reduction, ignore_index, label_smoothing, z_loss, softcap, plan):
    """linear_cross_entropy's reduced loss through the row-chunk plan (row_chunk_plan gives `plan`); autocast off
    inside, as in stats()."""
    cw = None if class_w is None else class_w.float().contiguous()
    with torch.autocast(x.device.type, enabled=False):
        return _RowChunkCrossEntropy.apply(x, w, b, target, cw, reduction, ignore_index, float(label_smoothing),
                                           float(z_loss), None if softcap is None else float(softcap), plan)
