"""linear_cross_entropy: the loss of a linear head without materialising its logits.

The Triton path is one differentiable torch.library op, ``logitless::linear_head_stats``, that returns per-row
statistics of the head (row max, log-sum-exp, target logit, smoothing sum, entropy); every loss of this file and of
log_probs.py is a PyTorch expression of those statistics (reference.ce_loss_from_stats, the same function as the
PyTorch path), so autograd turns the upstream gradients into the per-row coefficients (A, B, C, E) of one generic
backward op, ``logitless::linear_head_grad`` (see reference.py for the form of the gradient).
"""

from __future__ import annotations

import torch

from . import _validate, reference
from ._dispatch import resolve_backend

# ---------------------------------------------------------------------------------------------------------------
# torch.library ops around the launchers of kernels/linear_head.py, so torch.compile sees each as one opaque op.


def _kernels():
    from .kernels import linear_head

    return linear_head


_STATS_SCHEMA = ("(Tensor x, Tensor weight, Tensor? bias, Tensor? target, Tensor? class_weight, float? softcap, "
                 "float inv_temp, bool want_smooth, bool want_entropy, Tensor? perm, bool want_tiles, "
                 "float skip_threshold, int? workspace_bytes, bool want_stash, bool stash_dx) "
                 "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")


def _stash_layout(x, weight, want_stash, stash_dx, workspace_bytes):
    return _kernels().stash_layout(x, weight, stash_dx, workspace_bytes) if want_stash else None


@torch.library.custom_op("logitless::linear_head_stats", mutates_args=(), schema=_STATS_SCHEMA)
def _stats_op(x, weight, bias, target, class_weight, softcap, inv_temp, want_smooth, want_entropy, perm, want_tiles,
              skip_threshold, workspace_bytes, want_stash, stash_dx):
    """(m, logs, zt, sw, ent), each (N,) float32, the per-(token block, tile) log-sum-exp maxima that the
    backward's skipping needs (empty unless want_tiles), and the stash: the buffer of the weight's gradient, in
    which the forward keeps logits for the backward (kernels/linear_head.py, stash_layout; empty unless want_stash
    and there is room). lse = m + logs and sw = sum_j w_j (z_j - m). For autograd the row max m is a constant offset
    (every use of these statistics is invariant to shifting it), so its gradient is ignored and logs carries
    d lse/dz_j = p_j. perm (a vocabulary order), skip_threshold, workspace_bytes and stash_dx (the backward
    computes the input's gradient) are for the backward."""
    lh = _kernels()
    # The kernels read the bias with unit stride; a strided one (a column of a table) is copied here, inside the
    # op, so autograd still sees the caller's tensor. (Targets and class weights arrive contiguous.)
    bias = None if bias is None else bias.contiguous()
    tiles = lh._new(lh.tile_grid(x, weight), device=x.device, dtype=torch.float32) if want_tiles else None
    layout = _stash_layout(x, weight, want_stash, stash_dx, workspace_bytes)
    stash = lh._new(weight.shape, device=x.device, dtype=weight.dtype) if layout is not None else None
    extra = {} if stash is None else {"stash": (stash, layout)}
    stats = lh.forward_stats(x, weight, bias, target, class_weight, softcap=softcap, inv_temp=inv_temp,
                             want_smooth=want_smooth, want_entropy=want_entropy, perm=perm, tile_lse=tiles, **extra)
    if tiles is None or x.shape[0] == 0:
        tiles = x.new_empty(0, dtype=torch.float32)
    return (*stats, tiles, stash if stash is not None else weight.new_empty(0))


@_stats_op.register_fake
def _(x, weight, bias, target, class_weight, softcap, inv_temp, want_smooth, want_entropy, perm, want_tiles,
      skip_threshold, workspace_bytes, want_stash, stash_dx):
    tiles = (x.new_empty(_kernels().tile_grid(x, weight), dtype=torch.float32)
             if want_tiles and x.shape[0] != 0 else x.new_empty(0, dtype=torch.float32))
    layout = _stash_layout(x, weight, want_stash, stash_dx, workspace_bytes)
    stash = weight.new_empty(weight.shape if layout is not None else 0)
    return (*(x.new_empty(x.shape[0], dtype=torch.float32) for _ in range(5)), tiles, stash)


_GRAD_ARGS = ("Tensor x, Tensor weight, Tensor? bias, Tensor? target, Tensor? class_weight, Tensor m, Tensor logs, "
              "Tensor A, Tensor? B, Tensor? C, Tensor? E, float? softcap, float inv_temp, bool need_dx, "
              "bool need_dw, bool need_db, Tensor? perm, Tensor? tile_lse, float skip_threshold, "
              "int? workspace_bytes")
_GRAD_SCHEMA = f"({_GRAD_ARGS}) -> (Tensor, Tensor, Tensor)"


def _backward(x, weight, bias, target, class_weight, m, logs, A, B, C, E, softcap, inv_temp, need_dx, need_dw,
              need_db, perm, tile_lse, skip_threshold, workspace_bytes, stash=None):
    bias = None if bias is None else bias.contiguous()  # as in _stats_op
    extra = {} if stash is None else {"stash": stash}
    return _kernels().backward(x, weight, bias, target, class_weight, m, logs, A, B, C, E, softcap=softcap,
                               inv_temp=inv_temp, need_dx=need_dx, need_dw=need_dw, need_db=need_db, perm=perm,
                               tile_lse=tile_lse, skip_threshold=skip_threshold, workspace_bytes=workspace_bytes,
                               **extra)


@torch.library.custom_op("logitless::linear_head_grad", mutates_args=(), schema=_GRAD_SCHEMA)
def _grad_op(x, weight, bias, target, class_weight, m, logs, A, B, C, E, softcap, inv_temp, need_dx, need_dw,
             need_db, perm, tile_lse, skip_threshold, workspace_bytes):
    """(dx, dW, db) for dL/dz_j = p_j (A + B (z_j - m)) - C [j == t] - E w_j; a gradient not asked for is empty.
    With tile_lse and skip_threshold > 0, cold (token block, tile) pairs are skipped (kernels/linear_head.py)."""
    dx, dw, db = _backward(x, weight, bias, target, class_weight, m, logs, A, B, C, E, softcap, inv_temp, need_dx,
                           need_dw, need_db, perm, tile_lse, skip_threshold, workspace_bytes)
    # Outputs must not alias one another: a fresh empty tensor for each gradient not asked for.
    return tuple(g if g is not None else x.new_empty(0) for g in (dx, dw, db))


@_grad_op.register_fake
def _(x, weight, bias, target, class_weight, m, logs, A, B, C, E, softcap, inv_temp, need_dx, need_dw, need_db,
      perm, tile_lse, skip_threshold, workspace_bytes):
    dx = torch.empty_like(x, memory_format=torch.contiguous_format) if need_dx else x.new_empty(0)
    dw = torch.empty_like(weight, memory_format=torch.contiguous_format) if need_dw else x.new_empty(0)
    db = torch.empty_like(bias) if need_db and bias is not None else x.new_empty(0)
    return dx, dw, db


@torch.library.custom_op("logitless::linear_head_grad_into", mutates_args=("stash",),
                         schema=f"({_GRAD_ARGS}, Tensor(a!) stash) -> (Tensor, Tensor)")
def _grad_into_op(x, weight, bias, target, class_weight, m, logs, A, B, C, E, softcap, inv_temp, need_dx, need_dw,
                  need_db, perm, tile_lse, skip_threshold, workspace_bytes, stash):
    """linear_head_grad with the forward's stash (need_dw set): dW is written into it (the logits it holds are
    used up); returns (dx, db), empty where not asked for. Eager backward only (head_stats, _stats_backward)."""
    dx, _, db = _backward(x, weight, bias, target, class_weight, m, logs, A, B, C, E, softcap, inv_temp, need_dx,
                          need_dw, need_db, perm, tile_lse, skip_threshold, workspace_bytes, stash)
    return tuple(g if g is not None else x.new_empty(0) for g in (dx, db))


@_grad_into_op.register_fake
def _(x, weight, bias, target, class_weight, m, logs, A, B, C, E, softcap, inv_temp, need_dx, need_dw, need_db,
      perm, tile_lse, skip_threshold, workspace_bytes, stash):
    dx = torch.empty_like(x, memory_format=torch.contiguous_format) if need_dx else x.new_empty(0)
    db = torch.empty_like(bias) if need_db and bias is not None else x.new_empty(0)
    return dx, db


def _stats_setup_context(ctx, inputs, output):
    (x, weight, bias, target, class_weight, softcap, inv_temp, want_smooth, want_entropy, perm, want_tiles, tau,
     ws, _want_stash, _stash_dx) = inputs
    m, logs, _, _, ent, tiles, stash = output
    ctx.save_for_backward(x, weight, bias, target, class_weight, m, logs, ent, perm,
                          tiles if want_tiles and x.shape[0] != 0 else None)
    ctx.opts = (softcap, inv_temp, want_smooth, want_entropy, tau, ws)
    # The stash is not a saved tensor: the backward writes dW over it (a saved tensor's version check would fail)
    # and hands it on as the weight's gradient after dropping this reference, so that AccumulateGrad takes it over
    # without a copy. Non-differentiable, so it holds no reference back to this node.
    ctx.mark_non_differentiable(stash)
    ctx.stash = stash if stash.numel() else None
    # Outputs without an upstream gradient get None, not zeros: a zero "gradient" of the stash would be V x D.
    ctx.set_materialize_grads(False)


def _stats_backward(ctx, _g_m, g_logs, g_zt, g_sw, g_ent, _g_tiles, _g_stash):
    x, weight, bias, target, class_weight, m, logs, ent, perm, tiles = ctx.saved_tensors
    softcap, inv_temp, want_smooth, want_entropy, tau, ws = ctx.opts
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_db = bias is not None and ctx.needs_input_grad[2]
    if not (need_dx or need_dw or need_db):
        return (None,) * 15
    A, B, C, E = head_coefficients(m, logs, ent, g_logs, g_zt if target is not None else None,
                                   g_sw if want_smooth else None, g_ent if want_entropy else None)
    # The stash is used up by the first backward (it becomes dW); another one (retain_graph=True) recomputes, and
    # so does a backward that builds a graph (create_graph=True: the functional op, whose double backward raises).
    stash, ctx.stash = ctx.stash, None
    if stash is not None and not torch.is_grad_enabled() and need_dw:
        dx, db = _grad_into_op(x, weight, bias, target, class_weight, m, logs, A, B, C, E, softcap, inv_temp,
                               need_dx, need_dw, need_db, perm, tiles, tau, ws, stash)
        dw = stash
    else:
        dx, dw, db = _grad_op(x, weight, bias, target, class_weight, m, logs, A, B, C, E, softcap, inv_temp,
                              need_dx, need_dw, need_db, perm, tiles, tau, ws)
    return (dx if need_dx else None, dw if need_dw else None, db if need_db else None) + (None,) * 12


torch.library.register_autograd("logitless::linear_head_stats", _stats_backward, setup_context=_stats_setup_context)


def _no_setup(ctx, inputs, output):
    pass


def _no_double_backward(ctx, *grads):
    raise RuntimeError(reference.NOT_DIFFERENTIABLE)


# Without this, differentiating the gradients fails with "no autograd formula was registered".
torch.library.register_autograd("logitless::linear_head_grad", _no_double_backward, setup_context=_no_setup)


def head_coefficients(m, logs, ent, g_logs, g_zt, g_sw, g_ent):
    """Per-row (A, B, C, E) of dL/dz_j = p_j (A + B (z_j - m)) - C [j == t] - E w_j from the upstream gradients of the
    statistics: d logs/dz_j = p_j (m held constant), d zt/dz_j = [j == t], d sw/dz_j = w_j,
    dH/dz_j = -p_j (z_j - (lse - H))."""
    A = torch.zeros_like(logs) if g_logs is None else g_logs.float().contiguous()
    B = C = E = None
    if g_ent is not None:
        g_ent = g_ent.float()
        A = A + g_ent * (logs - ent)  # relative to the row max: the kernel multiplies B by z - m
        B = (-g_ent).contiguous()
    if g_zt is not None:
        C = (-g_zt.float()).contiguous()
    if g_sw is not None:
        E = (-g_sw.float()).contiguous()
    return A, B, C, E


# ---------------------------------------------------------------------------------------------------------------
# Sparsity options: the skip threshold and the vocabulary order

# The skipped-mass budget per row that bf16/fp16 inputs can ask for safely: 1/8 of the 2^-9 relative error that
# PyTorch's own bf16 softmax makes in every gradient row (docs/kernels.md). Too large for float32 inputs.
HALF_SKIP_THRESHOLD = 2.0**-12
# What skip_threshold=None means: no skipping, for every dtype. Measured on an H200 (notes/linear_head.md): on the
# benchmark's LM-like data at most 0.6% of the (token block x tile) pairs are cold at HALF_SKIP_THRESHOLD, while the
# bookkeeping costs up to 10% of fwd+bwd (15-22% with the batch vocabulary order), so skipping is opt-in.
DEFAULT_SKIP_THRESHOLD = 0.0
VOCAB_ORDERS = ("batch", "none")


def check_skip_options(skip_threshold, vocab_order, num_classes: int, device) -> None:
    """ValueError/TypeError for a bad skip_threshold (None or a float in [0, 1)) or vocab_order ("batch", "none",
    or a (V,) tensor of per-class counts on the input's device)."""
    if skip_threshold is not None:
        if isinstance(skip_threshold, bool) or not isinstance(skip_threshold, (int, float)):
            raise TypeError(f"skip_threshold must be None or a Python float, got {type(skip_threshold).__name__}")
        if not 0.0 <= float(skip_threshold) < 1.0:
            raise ValueError(f"skip_threshold must be in [0, 1) (a fraction of each row's probability mass), "
                             f"got {skip_threshold}")
    if isinstance(vocab_order, torch.Tensor):
        if vocab_order.shape != (num_classes,):
            raise ValueError(f"vocab_order as a tensor must hold one count per class, shape ({num_classes},), "
                             f"got {tuple(vocab_order.shape)}")
        if vocab_order.device != device:
            raise ValueError(f"vocab_order is on {vocab_order.device}, input on {device}")
        if vocab_order.is_complex() or vocab_order.dtype == torch.bool:
            raise TypeError(f"vocab_order counts must be real numbers, got {vocab_order.dtype}")
    elif vocab_order not in VOCAB_ORDERS:
        raise ValueError(f"vocab_order must be one of {VOCAB_ORDERS} or a tensor of per-class counts, "
                         f"got {vocab_order!r}")


def check_workspace(workspace_bytes) -> None:
    """TypeError/ValueError unless workspace_bytes is None or a non-negative Python int."""
    if workspace_bytes is None:
        return
    if isinstance(workspace_bytes, bool) or not isinstance(workspace_bytes, int):
        raise TypeError(f"workspace_bytes must be None or a Python int (bytes), got {type(workspace_bytes).__name__}")
    if not 0 <= workspace_bytes < 1 << 63:
        raise ValueError(f"workspace_bytes must be in [0, 2**63), got {workspace_bytes}")


def class_counts(target: torch.Tensor, num_classes: int, ignore_index: int) -> torch.Tensor:
    """(V,) float32 count of each class among the non-ignored targets, on the targets' device, without a host sync
    (no bincount: its output size would need one)."""
    t = target.reshape(-1)
    valid = (t != ignore_index) & (t >= 0) & (t < num_classes)
    idx = torch.where(valid, t, num_classes)
    counts = torch.zeros(num_classes + 1, device=t.device, dtype=torch.float32)
    return counts.scatter_add_(0, idx, torch.ones_like(idx, dtype=torch.float32))[:num_classes]


# Per-step decay of LinearCrossEntropyLoss's running class counts (vocab_order="running"): about 100 steps of memory.
RUNNING_DECAY = 0.99


def running_class_counts(counts, target: torch.Tensor, num_classes: int, ignore_index: int, update: bool = True):
    """counts * RUNNING_DECAY + this batch's class counts, in place and on the device (no host sync); a new (V,)
    float32 tensor of the batch's counts when counts is None or of another size or device. update=False returns
    the counts unchanged (evaluation)."""
    if counts is None or counts.shape != (num_classes,) or counts.device != target.device:
        return class_counts(target, num_classes, ignore_index)
    if update:
        with torch.no_grad():
            counts.mul_(RUNNING_DECAY).add_(class_counts(target, num_classes, ignore_index))
    return counts


def skip_setup(args: _validate.HeadArgs, skip_threshold, vocab_order, ignore_index, bounded: bool,
               workspace_bytes=None):
    """(perm, want_tiles, threshold) for the Triton path: tiles are recorded, and the vocabulary ordered, only when
    the backward may skip (a positive threshold, a gradient to compute, a gradient whose error the skipped
    probability mass bounds, tiles that allow it). The order depends on the backward's workspace_bytes."""
    x, w = args.x, args.weight
    tau = DEFAULT_SKIP_THRESHOLD if skip_threshold is None else float(skip_threshold)
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, w, args.bias))
    if not (tau > 0.0 and grads and bounded and x.shape[0] > 0 and _kernels().skip_supported(x)):
        return None, False, 0.0
    perm = None
    if isinstance(vocab_order, torch.Tensor):
        perm = _kernels().vocab_order(vocab_order.detach(), x, w, workspace_bytes)
    elif vocab_order == "batch" and args.target is not None:
        perm = _kernels().vocab_order(class_counts(args.target, w.shape[0], ignore_index), x, w, workspace_bytes)
    return perm, True, tau


def head_stats(args: _validate.HeadArgs, class_weight, softcap, inv_temp, want_smooth, want_entropy, perm=None,
               want_tiles=False, skip_threshold=0.0, *, workspace_bytes=None):
    """Per-row statistics (m, logs, zt, sw, ent) of a validated head, through the Triton kernels (differentiable);
    perm / want_tiles / skip_threshold from skip_setup; workspace_bytes for the backward (check_workspace)."""
    cw = None if class_weight is None else class_weight.float().contiguous()
    # The forward keeps logits for the backward in the weight gradient's buffer where it has room (STASH_LOGITS in
    # kernels/linear_head.py): not when tracing for torch.compile, whose backward graph must not depend on whether
    # the stash was already spent, nor with skipping (its tiles and orders plan the backward's memory).
    want_stash = (torch.is_grad_enabled() and args.weight.requires_grad and not want_tiles and perm is None
                  and not torch.compiler.is_compiling())
    return _stats_op(args.x, args.weight, args.bias, args.target, cw, None if softcap is None else float(softcap),
                     float(inv_temp), bool(want_smooth), bool(want_entropy), perm, bool(want_tiles),
                     float(skip_threshold), workspace_bytes, want_stash, args.x.requires_grad)[:5]


def check_kernel_dtype(x: torch.Tensor, backend: str) -> bool:
    """True when the Triton kernels take this dtype; float64 raises for an explicit backend="triton" and falls back
    to the PyTorch path under "auto"."""
    if x.dtype in _validate.KERNEL_DTYPES:
        return True
    if backend == "triton":
        raise TypeError(f"backend='triton' takes float32, bfloat16 or float16 inputs, got {x.dtype}; "
                        "use backend='torch' for float64")
    return False


# ---------------------------------------------------------------------------------------------------------------
# Public function


def linear_cross_entropy(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    linear_bias: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    backend: str = "auto",
    deterministic: bool = False,
    skip_threshold: float | None = None,
    vocab_order: str | torch.Tensor = "none",
    workspace_bytes: int | None = None,
    process_group=None,
    options=None,
) -> torch.Tensor:
    """Cross-entropy of ``F.linear(input, linear_weight, linear_bias)`` against ``target``, never building the logits.

    Equal to ``F.cross_entropy(z, target, weight=weight, reduction=reduction, ignore_index=ignore_index,
    label_smoothing=label_smoothing)`` computed in float32 with ``z = F.linear(input, linear_weight, linear_bias)``,
    ``z = softcap * tanh(z / softcap)`` when ``softcap`` is set, plus ``z_loss * logsumexp(z)**2`` added to the loss
    of every non-ignored token before the reduction. Argument names and order match
    ``torch.nn.functional.linear_cross_entropy``.

    Args:
        input: (..., D) float32, bfloat16 or float16 hidden states.
        linear_weight: (V, D) classifier, same dtype and device as ``input``.
        target: (...) int64 or int32 class indices in [0, V), or ``ignore_index``.
        linear_bias: optional (V,) bias.
        weight: optional (V,) class weights (as in ``F.cross_entropy``).
        reduction: "mean" (divides by the number, or the summed class weights, of non-ignored tokens), "sum"
            or "none" (one float32 value per token, 0 where ignored).
        ignore_index: target value that contributes neither loss nor gradient (``None`` means -100).
        label_smoothing: in [0, 1].
        z_loss: coefficient of PaLM's auxiliary ``logsumexp(z)**2`` loss, >= 0.
        softcap: positive logit cap (Gemma 2), or None.
        backend: "auto" (Triton on CUDA when available, else PyTorch; ``$LOGITLESS_BACKEND`` overrides),
            "triton" or "torch".
        deterministic: ask for gradients that are bitwise identical run to run. Both backends already give them
            (the Triton backward uses no atomics; its kernels reduce in a fixed order and its cuBLAS products are
            reproducible on a given GPU), so this never changes the result.
        skip_threshold: the largest fraction of each row's probability mass whose gradient the Triton backward may
            skip (cold tiles of the softmax, neither recomputed nor multiplied); each gradient row then changes by
            at most ``skip_threshold`` times its coefficient. ``None`` or 0 (default): nothing is skipped. 2**-12
            (``from logitless.linear_cross_entropy import HALF_SKIP_THRESHOLD``) is safe for bfloat16/float16 inputs
            (below their resolution); float32 needs a far smaller value. A tile holding a target is never skipped, and
            nothing is skipped with ``label_smoothing > 0``, on the PyTorch path or with ``process_group``. Opt-in
            because it pays only on very peaked softmaxes (docs/kernels.md has the measurements).
        vocab_order: how the Triton path orders the vocabulary when it skips, so that frequent classes share
            tiles: "none" (default), "batch" (by the counts of this batch's targets), or a (V,) tensor of per-class
            counts (e.g. kept across steps; ``LinearCrossEntropyLoss(vocab_order="running")`` does that). The
            result does not depend on it beyond rounding; an order costs time (its W rows are gathered).
        workspace_bytes: memory the Triton backward may allocate for its workspaces, beyond a few float32 values
            per token. ``None`` (default): the memory policy, the larger of 16 MiB and a tenth of what the N x V
            logits would take in bfloat16 (``N * V // 5`` bytes; ``logitless.reference.default_workspace_bytes``),
            spent on the fastest plan that fits: at least ``4 * N * D`` bytes more than 8 MiB (N tokens, D
            features) give the float32 accumulator of the input's gradient its own buffer, which removes the second
            pass that recomputes the logits of the weight-gradient rows it would otherwise borrow (bfloat16 /
            float16); the rest widens the vocabulary chunks (up to 8192 classes) and holds split partials. ``0``
            (anything up to 8 MiB): the leanest plan, 8 MiB. A number: that budget, spent the same way (on an
            H200 at the benchmark's shapes, ``4 * N * D + 256 MiB`` made forward + backward 1-10% faster than the
            leanest plan; BENCHMARKS.md). The result does not depend on it beyond float32 summation order.
            Ignored on the PyTorch path (which sizes its blocks by the same policy) and with ``process_group``.
        process_group: a ``torch.distributed`` group over which the vocabulary is sharded: ``linear_weight``
            (and ``linear_bias``, ``weight``) hold this rank's contiguous rows, in rank order; targets are global.
            See :mod:`logitless.distributed`.
        options: accepted so that calls written for ``torch.nn.functional.linear_cross_entropy`` run unchanged:
            ``None`` or a ``torch.nn.LinearCrossEntropyOptions``, whose chunking settings have no meaning here
            (the logits are never built, whatever they say) and are ignored.

    Returns:
        float32 loss: a scalar, or the shape of ``target`` for ``reduction="none"``.
    """
    _validate.check_no_transform("linear_cross_entropy")
    _check_torch_options(options)
    ignore_index = _validate.ignore_index_arg(ignore_index)
    if process_group is not None:
        from . import distributed

        return distributed.linear_cross_entropy(
            input, linear_weight, target, linear_bias=linear_bias, weight=weight, reduction=reduction,
            ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
            backend=backend, process_group=process_group,
        )
    _validate.check_options(reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
                            ignore_index=ignore_index)
    _validate.check_flag("deterministic", deterministic)
    args = _validate.linear_head(input, linear_weight, target, linear_bias, ignore_index)
    weight = _validate.check_class_weight(weight, linear_weight.shape[0], input.device)
    check_skip_options(skip_threshold, vocab_order, linear_weight.shape[0], input.device)
    check_workspace(workspace_bytes)
    chosen = resolve_backend(backend, input.device, "linear_cross_entropy")
    # One class: closed forms on the PyTorch path (reference.one_class_logits), on either backend.
    if chosen == "triton" and check_kernel_dtype(args.x, backend) and linear_weight.shape[0] > 1:
        return _lce_triton(args, weight, reduction, ignore_index, label_smoothing, z_loss, softcap, skip_threshold,
                           vocab_order, workspace_bytes)
    return reference.lce_torch(args, weight, reduction, ignore_index, label_smoothing, z_loss, softcap)


def _check_torch_options(options) -> None:
    torch_options = getattr(torch.nn, "LinearCrossEntropyOptions", None)
    if options is None or (torch_options is not None and isinstance(options, torch_options)):
        return
    raise TypeError("options must be None or a torch.nn.LinearCrossEntropyOptions (accepted for compatibility with "
                    f"torch.nn.functional.linear_cross_entropy, and ignored), got {type(options).__name__}")


def _lce_triton(args, weight, reduction, ignore_index, label_smoothing, z_loss, softcap, skip_threshold,
                vocab_order, workspace_bytes=None):
    V = args.weight.shape[0]
    class_w = None if weight is None else weight.float()
    # Label smoothing adds -E w_j to every class's gradient: a skipped tile would lose that too, so no skipping.
    skip = skip_setup(args, skip_threshold, vocab_order, ignore_index, bounded=label_smoothing == 0.0,
                      workspace_bytes=workspace_bytes)
    m, logs, zt, sw, _ = head_stats(args, class_w, softcap, 1.0, label_smoothing > 0.0, False, *skip,
                                    workspace_bytes=workspace_bytes)
    valid, w_t, w_sum = reference.ce_row_terms(args.target, class_w, ignore_index, label_smoothing, V, m.dtype)
    # sw is taken relative to the row max, so ref = m.
    per_token = reference.ce_loss_from_stats(m, logs, zt, sw, m, valid, w_t, w_sum, label_smoothing, z_loss, V)
    return reference.reduce_loss(per_token, valid, w_t, reduction, args.lead_shape)
