"""The head op: one contract, the backends behind it, and the only door from a public op to a backend.

``stats(...)`` returns the per-row statistics of a linear head (loss_math.Stats: row max, log-sum-exp, target
logit, smoothing sum, entropy), differentiable with respect to the input, the weight and the bias; its backward is
the one generic backward of loss_math's contract, whichever backend computes it:

- "triton": the kernels, through the torch.library ops of triton_backend.py (also what torch.compile sees);
- "torch":  the chunked PyTorch backend, torch_backend.py (CPU tensors, float64, backend="torch", an empty head).

The public ops (linear_cross_entropy.py, log_probs.py) and the vocabulary-parallel path (distributed.py, which
exchanges the statistics of each rank's shard) write their losses on these statistics with loss_math, so every
path shares the loss code and every option of the backward: ``workspace_bytes`` (the memory the Triton backward may
take; the PyTorch backend sizes its blocks by the default policy and ignores it), ``skip_threshold`` /
``vocab_order`` (cold tiles the Triton backward may skip; the PyTorch backend computes every block), and the stash
(the Triton forward keeps logits for the backward where the weight gradient's buffer has room).

Every other backend choice of a public op is made here too, behind one call each: the fused plans of a reduced
cross-entropy whose gradient is wanted (fused_plan, fused_cross_entropy), the one-class closed form
(one_class_logits), the two-head losses (two_heads_loss) and cross-entropy on given logits (logits_cross_entropy).

The Triton backends (triton_backend.py, triton_two_heads.py, triton_cross_entropy.py) import Triton with the kernels
they launch, by plain names. This module imports them inside the calls that chose Triton, and no other module of
the package does: that is the one lazy boundary that keeps `import logitless` working where Triton is absent or
cannot run (a CPU-only install).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import loss_math, shards, skip_gate, torch_backend
from ._dispatch import KERNEL_DTYPES, check_kernel_dtype, is_compiling, resolve_backend
from .kernels import current_tuning
from .loss_math import Stats
from .torch_backend import cross_entropy as torch_cross_entropy
from .torch_backend import two_heads as torch_two_heads

__all__ = ["HALF_SKIP_THRESHOLD", "FusedPlan", "Skip", "Stats", "choose_backend", "class_counts",
           "fused_cross_entropy", "fused_plan", "linear_cross_entropy", "linear_log_probs", "linear_logsumexp",
           "logits_cross_entropy", "one_class_logits", "resolve_skip", "running_class_counts", "stats",
           "two_heads_loss"]

# The skipped-mass budget per row that bf16/fp16 inputs can ask for safely: 1/8 of the 2^-9 relative error that
# PyTorch's own bf16 softmax makes in every gradient row (docs/kernels.md). Too large for float32 inputs.
HALF_SKIP_THRESHOLD = 2.0**-12
# skip_threshold="auto": the rows' budgets add up to a quarter of the rounding error PyTorch's own gradient has in the
# input dtype, in units of u max(1, |m_i|) / 4 with u = 2^-9 (bfloat16) or 2^-12 (float16), shared over the batch
# by each row's mass outside its top class (docs/kernels.md, "Sparsity"). Passed to the kernels as a negative
# threshold (plans.row_budget).
AUTO_SKIP_UNIT = {torch.bfloat16: 2.0**-11, torch.float16: 2.0**-14}


class Skip(NamedTuple):
    """What the backward may skip: at most `threshold` of each row's probability mass (None or 0: nothing; "auto":
    a budget per row from its largest logit, AUTO_SKIP_UNIT, where skip_gate finds that it pays), with the
    vocabulary ordered by `vocab_order` ("none", "batch": this batch's target counts, or a (V,) tensor of counts);
    `bounded` is False for a loss whose gradient error the skipped mass does not bound (nothing is skipped then).
    `resolved`: resolve_skip has decided this call (threshold None where it runs dense); `in_backward`: "auto"
    left to the backward's own decision (torch.compile)."""

    threshold: float | str | None = None
    vocab_order: str | torch.Tensor = "none"
    bounded: bool = True
    resolved: bool = False
    in_backward: bool = False


NO_SKIP = Skip()


class HeadArgs(NamedTuple):
    """A prepared linear head, the head op's input: validated, flattened arguments, `x` (N, D), `target` (N,) int64
    (global class ids) or None, the class weights or None. `vocab` is the number of classes; with `shard` (a
    vocabulary-parallel head: shards.Shard), `weight`, `bias` and `class_weight` are this rank's rows and `vocab`
    is all shards' (an int, or a 0-d device tensor where the shard sizes were exchanged between GPUs)."""

    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    target: torch.Tensor | None
    lead_shape: torch.Size
    class_weight: torch.Tensor | None = None
    vocab: int | torch.Tensor = 0
    shard: shards.Shard | None = None


# ---------------------------------------------------------------------------------------------------------------
# The public ops' calls: one per loss, on a prepared head (_validate.linear_head), whatever its backend, its size
# (one class: a closed form), its plan (fused, or the statistics) and its sharding (the statistics of the shard,
# exchanged: shards.exchange).


def linear_cross_entropy(h: HeadArgs, reduction, ignore_index, label_smoothing, z_loss, softcap, *, backend: str,
                         skip: Skip, workspace_bytes) -> torch.Tensor:
    """logitless.linear_cross_entropy's loss on a prepared head: the one-class closed form, a fused plan, or the
    statistics (of the whole vocabulary where the head is sharded) and loss_math's cross-entropy on them."""
    chosen = choose_backend(backend, h.x, "linear_cross_entropy")
    acc = loss_math.acc_dtype(h.x.dtype)
    class_w = None if h.class_weight is None else h.class_weight.to(acc)
    if h.shard is None and h.vocab == 1:
        # One class: lse = z, so the cross-entropy and the smoothing are exactly 0 and the z-loss is z^2; a closed
        # form gives PyTorch's exact zeros (one_class_logits, float64), on either backend. Those zeros are weighted
        # by w_t, as PyTorch's are, so their gradient is w_t times the upstream one: 0, or NaN where a "mean" over
        # class weights that sum to 0 makes the upstream gradient infinite (PyTorch's NaN, not the z-loss term's inf
        # alone). z - z is that zero with that gradient.
        z = one_class_logits(h.x, h.weight, h.bias, softcap, 1.0)
        valid, w_t, _ = loss_math.ce_row_terms(h.target, class_w, ignore_index, label_smoothing, 1, z.dtype)
        per_token = w_t * (z - z)
        if z_loss > 0.0:
            per_token = per_token + float(z_loss) * z * z
        loss = loss_math.reduce_loss(torch.where(valid, per_token, 0.0), valid, w_t, reduction, h.lead_shape)
        return loss.to(acc)
    if h.shard is None:
        # The dense plan of this call: for a reduced loss whose gradient is wanted, the gradients in the forward
        # where the backend's plan finds room (fused_plan). Whether skipping cold tiles pays (Triton only) is judged
        # against it.
        fused = fused_plan(h.x, h.weight, h.bias, softcap, reduction, chosen, workspace_bytes)
        skip = resolve_skip(skip, h.x, h.weight, h.bias, chosen, dense_row_chunks=fused is not None)
        if fused is not None and skip.threshold is None:
            return fused_cross_entropy(fused, h.x, h.weight, h.bias, h.target, class_w, reduction, ignore_index,
                                       label_smoothing, z_loss, softcap)
    st, w_t, w_sum = _head_stats(h, class_w, softcap, 1.0, label_smoothing > 0.0, False, backend=chosen, skip=skip,
                                 ignore_index=ignore_index, workspace_bytes=workspace_bytes,
                                 want_lse=loss_math.z_loss_apart(z_loss, h.x, h.weight))
    if h.shard is None:
        valid, w_t, w_sum = loss_math.ce_row_terms(h.target, class_w, ignore_index, label_smoothing, h.vocab,
                                                   st.m.dtype)
    else:
        valid = h.target != ignore_index
        w_t = valid.to(st.m.dtype) if w_t is None else torch.where(valid, w_t, 0.0)
    per_token = loss_math.ce_loss_from_stats(st.m, st.logs, st.zt, st.sw, st.m, valid, w_t, w_sum, label_smoothing,
                                             z_loss, h.vocab, lse=st.lse)
    return loss_math.reduce_loss(per_token, valid, w_t, reduction, h.lead_shape)


def linear_log_probs(h: HeadArgs, ignore_index, softcap, inv_temp, want_entropy: bool, *, backend: str, skip: Skip,
                     workspace_bytes) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs of the targets, entropy or None), of the lead shape, 0 where ignored, on a prepared head."""
    chosen = choose_backend(backend, h.x, "linear_log_probs")
    valid = h.target != ignore_index
    if h.shard is None and h.vocab == 1:
        # One class: log 1 = 0 and no entropy, exactly (one_class_logits), on either backend.
        z = one_class_logits(h.x, h.weight, h.bias, softcap, inv_temp)
        logp = torch.where(valid, z * 0.0, 0.0).reshape(h.lead_shape).to(loss_math.acc_dtype(h.x.dtype))
        return logp, (logp.clone() if want_entropy else None)
    st, _, _ = _head_stats(h, None, softcap, inv_temp, False, want_entropy, backend=chosen, skip=skip,
                           ignore_index=ignore_index, workspace_bytes=workspace_bytes)
    logp, ent = loss_math.log_probs_from_stats(st, valid)
    return logp.reshape(h.lead_shape), (None if ent is None else ent.reshape(h.lead_shape))


def linear_logsumexp(h: HeadArgs, softcap, inv_temp, *, backend: str, workspace_bytes) -> torch.Tensor:
    """The per-row log-sum-exp of the lead shape on a prepared head."""
    chosen = choose_backend(backend, h.x, "linear_logsumexp")
    if h.shard is None and h.vocab == 1:  # one class: lse = z, exactly
        z = one_class_logits(h.x, h.weight, h.bias, softcap, inv_temp)
        return z.reshape(h.lead_shape).to(loss_math.acc_dtype(h.x.dtype))
    st, _, _ = _head_stats(h, None, softcap, inv_temp, False, False, backend=chosen, skip=NO_SKIP, ignore_index=-100,
                           workspace_bytes=workspace_bytes)
    return (st.m + st.logs).reshape(h.lead_shape)


def _head_stats(h: HeadArgs, class_w, softcap, inv_temp, want_smooth, want_entropy, *, backend: str, skip: Skip,
                ignore_index: int, workspace_bytes, want_lse: bool = False):
    """(Stats, the target's class weight, the sum of the class weights) of the whole vocabulary: stats() on the
    head, and where it is sharded, on the shard with its targets shifted by its first row (a target outside [0,
    V_r) is in another shard, or ignored: no target logit here), exchanged (shards.exchange; the two weights come
    from there, None otherwise)."""
    x, target = h.x, h.target
    if h.shard is not None:
        if backend == "torch":
            # The PyTorch backend returns dx in x's dtype: upcast, the shards' parts are summed before the one
            # rounding.
            x = x.to(loss_math.acc_dtype(x.dtype))
        x = shards.sum_grad_over_group(x, h.shard.group)
        if target is not None:
            target = torch.where(target != ignore_index, target - h.shard.start, -1)
        ignore_index = -1
    st = stats(x, h.weight, h.bias, target, class_w, softcap, inv_temp, want_smooth, want_entropy, backend=backend,
               skip=skip, ignore_index=ignore_index, workspace_bytes=workspace_bytes, want_lse=want_lse)
    if h.shard is None:
        return st, None, None
    return shards.exchange(st, target, class_w, want_smooth, h.weight.shape[0], h.shard.group)


def choose_backend(backend: str, x: torch.Tensor, op: str) -> str:
    """"triton" or "torch" for running `op` on x: _dispatch's choice, and float64 (which has no kernels) on the
    PyTorch path under "auto" (a TypeError for an explicit backend="triton")."""
    chosen = resolve_backend(backend, x.device, op)
    if chosen == "triton" and not check_kernel_dtype(x, backend):
        return "torch"
    return chosen


def resolve_skip(skip: Skip, x, weight, bias, backend: str, dense_row_chunks: bool = False) -> Skip:
    """This call's skipping, decided once on the host (no sync): `skip` with resolved=True and threshold None where
    the call runs the dense plans. Nothing is skipped where the backend, the dtype (float32 has no "auto" budget),
    the loss (`bounded`) or the call (no gradient wanted, no rows) leave nothing to skip; a fixed threshold skips
    wherever it can; "auto" asks skip_gate whether skipping pays for this head, or under torch.compile leaves the
    question to the backward (in_backward), so that the compiled graph never depends on the answer.
    dense_row_chunks: the call's dense alternative is the row-chunk plan (three cuBLAS products), against which
    skipping must leave out a larger share to pay (Tuning.skip_min_share_row_chunks) than against the column plan
    (Tuning.skip_min_share)."""
    if skip.resolved:
        return skip
    done = Skip(skip.threshold, skip.vocab_order, skip.bounded, True, False)
    if skip.threshold is None or (not isinstance(skip.threshold, str) and float(skip.threshold) == 0.0):
        return Skip(None, skip.vocab_order, skip.bounded, True, False)
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    if not (backend == "triton" and grads and skip.bounded and x.shape[0] > 0 and weight.shape[0] > 0
            and (skip.threshold != "auto" or x.dtype in AUTO_SKIP_UNIT)):
        return Skip(None, skip.vocab_order, skip.bounded, True, False)
    from .triton_backend import skip_supported

    if not skip_supported(x):
        return Skip(None, skip.vocab_order, skip.bounded, True, False)
    if skip.threshold != "auto":
        return done
    if is_compiling():
        return Skip(skip.threshold, skip.vocab_order, skip.bounded, True, True)
    tune = current_tuning()
    if skip_gate.decide(weight, tune.skip_min_share_row_chunks if dense_row_chunks else tune.skip_min_share):
        return done
    return Skip(None, skip.vocab_order, skip.bounded, True, False)


def stats(x, weight, bias, target, class_weight, softcap, inv_temp, want_smooth, want_entropy, *, backend: str,
          skip: Skip = NO_SKIP, ignore_index: int = -100, workspace_bytes: int | None = None,
          want_lse: bool = False) -> Stats:
    """The statistics of the head softcap(x W^T + b) * inv_temp on validated (N, D) / (V, D) inputs, through
    `backend` (choose_backend). target: (N,) int64 class ids or None (zt); a target outside [0, V) (ignored, or in
    another shard) has zt = 0. class_weight: (V,) or None, the w_j of sw. want_smooth / want_entropy: sw / ent
    (None otherwise). skip (decided here by resolve_skip unless the caller did) and workspace_bytes shape the Triton
    backward (see the module docstring); ignore_index only keeps ignored targets out of the "batch" vocabulary
    order. want_lse: the lse statistic, for a term whose gradient must stay apart from logs' (the z-loss;
    loss_math's module docstring)."""
    if backend == "triton" and weight.shape[0] > 0:
        from . import triton_backend

        skip = resolve_skip(skip, x, weight, bias, backend)
        perm, want_tiles, tau = _skip_plan(x, weight, target, skip, ignore_index, workspace_bytes)
        return triton_backend.stats(x, weight, bias, target, class_weight, softcap, inv_temp, want_smooth,
                                    want_entropy, perm=perm, want_tiles=want_tiles, skip_threshold=tau,
                                    workspace_bytes=workspace_bytes, want_lse=want_lse,
                                    gate_in_backward=skip.in_backward)
    return torch_backend.stats(x, weight, bias, target, class_weight, softcap, inv_temp, want_smooth, want_entropy,
                               want_lse)


def one_class_logits(x, weight, bias, softcap, inv_temp) -> torch.Tensor:
    """The (N,) float64 logits of a head with one class (V = 1), differentiable, whatever the backend: its softmax
    is exactly 1, and every loss of it is a closed form of these logits that gives PyTorch's exact zeros where the
    general paths leave a rounding (torch_backend.one_class_logits says why float64)."""
    return torch_backend.one_class_logits(x, weight, bias, softcap, inv_temp)


class FusedPlan(NamedTuple):
    """A plan of linear_cross_entropy that computes the gradients in the forward: `backend`'s, with `plan` its
    rows per chunk ("torch") or its row-chunk plan ("triton")."""

    backend: str
    plan: object


def fused_plan(x, weight, bias, softcap, reduction: str, backend: str, workspace_bytes) -> FusedPlan | None:
    """The dense plan of a reduced cross-entropy whose gradient is wanted now, where one computes the gradients in
    the forward, or None where the head op's statistics run: on the PyTorch backend, chunks of rows over the full
    vocabulary (torch_backend.fused_rows: three products instead of four); on Triton, where the policy finds it
    faster within the budget, chunks of full rows of logits (triton_backend.row_chunk_plan,
    docs/design/row_chunks.md). On Triton, skipping cold tiles is judged against this plan (resolve_skip's
    dense_row_chunks) and, where it pays, replaces it."""
    if backend == "torch":
        rows = torch_backend.fused_rows(x, weight, bias, softcap, reduction)
        return FusedPlan(backend, rows) if rows else None
    from .triton_backend import row_chunk_plan

    plan = row_chunk_plan(x, weight, bias, reduction, workspace_bytes)
    return None if plan is None else FusedPlan(backend, plan)


def fused_cross_entropy(fused: FusedPlan, x, weight, bias, target, class_weight, reduction, ignore_index,
                        label_smoothing, z_loss, softcap) -> torch.Tensor:
    """The reduced cross-entropy through a plan of fused_plan, on validated inputs (class_weight in the
    accumulation dtype): the same loss_math terms as the statistics' path."""
    if fused.backend == "torch":
        return torch_backend.fused_linear_cross_entropy(x, weight, bias, target, class_weight, reduction,
                                                        ignore_index, label_smoothing, z_loss, softcap, fused.plan)
    from .triton_backend import row_chunk_linear_cross_entropy

    return row_chunk_linear_cross_entropy(x, weight, bias, target, class_weight, reduction, ignore_index,
                                          label_smoothing, z_loss, softcap, fused.plan)


def two_heads_loss(xs, ws, bs, xt, wt, bt, kind: str, beta: float, softcap, inv_temp: float, workspace_bytes, *,
                   backend: str) -> torch.Tensor:
    """The per-row loss `kind` (loss_math.KINDS) of two validated heads over one vocabulary, (N,) float32 (float64
    for float64 heads), differentiable with respect to the student's xs, ws and bs; through `backend`
    (choose_backend): the kernels (triton_two_heads) or the chunked PyTorch twin (torch_backend.two_heads).
    workspace_bytes is for the Triton backward."""
    if backend == "triton":
        from . import triton_two_heads

        return triton_two_heads.loss(xs, ws, bs, xt, wt, bt, kind, beta, softcap, inv_temp, workspace_bytes)
    return torch_two_heads.loss(xs, ws, bs, xt, wt, bt, kind, beta, softcap, inv_temp)


def logits_cross_entropy(logits2d, target, lead_shape, weight, reduction, ignore_index, label_smoothing, z_loss,
                         softcap, inplace_backward: bool, backend: str):
    """cross_entropy on validated (N, V) logits: (the reduced loss, lse of the lead shape), through the kernels
    (triton_cross_entropy) or the chunked PyTorch twin (torch_backend.cross_entropy), chosen from `backend` as the
    dispatcher says; float64 under "auto", and a one-class head, on the PyTorch path. Each backend reduces the loss
    itself: the Triton form's in-place gradient is that of the reduced loss."""
    chosen = resolve_backend(backend, logits2d.device, "cross_entropy")
    if chosen == "triton" and backend == "auto" and logits2d.dtype not in KERNEL_DTYPES:
        chosen = "torch"  # float64 has no kernels
    if logits2d.shape[1] == 1:
        # One class: the loss is the z-loss alone (lse = z) and the rest is exactly 0. On a GPU the kernel left an
        # ulp there (1e-8 with softcap, measured on an H100) where PyTorch gives 0; the PyTorch path transforms the
        # logits once and gets the exact zeros. N values: nothing to fuse.
        chosen = "torch"
    # No backward can run without grad mode (torch.no_grad, inference): then nothing is overwritten, on either path.
    inplace_backward = inplace_backward and torch.is_grad_enabled()
    if inplace_backward:
        # a copy where strided: the gradient overwrites it, not the caller's
        logits2d = torch_cross_entropy.unit_class_stride(logits2d)
    if chosen == "torch":
        run = torch_cross_entropy.cross_entropy
    else:
        from .triton_cross_entropy import cross_entropy as run
    return run(logits2d, target, lead_shape, weight, reduction, ignore_index, label_smoothing, z_loss, softcap,
               inplace_backward)


def _skip_plan(x, w, target, skip: Skip, ignore_index, workspace_bytes):
    """(perm, want_tiles, threshold) for the Triton backend from a resolved skip: tiles are recorded, and the
    vocabulary ordered, only when the backward may skip. The order depends on the backward's workspace_bytes."""
    if skip.threshold is None:
        return None, False, 0.0
    from .triton_backend import vocab_order

    tau = -AUTO_SKIP_UNIT[x.dtype] if skip.threshold == "auto" else float(skip.threshold)
    perm = None
    if isinstance(skip.vocab_order, torch.Tensor):
        perm = vocab_order(skip.vocab_order.detach(), x, w, workspace_bytes)
    elif skip.vocab_order == "batch" and target is not None:
        perm = vocab_order(class_counts(target, w.shape[0], ignore_index), x, w, workspace_bytes)
    return perm, True, tau


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
