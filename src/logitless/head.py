"""The head op: one contract, the backends behind it, and the only door from a public op to a backend.

``stats(...)`` returns the per-row statistics of a linear head (loss_math.Stats: row max, log-sum-exp, target
logit, smoothing sum, entropy), differentiable with respect to the input, the weight and the bias; its backward is
the one generic backward of loss_math's contract, whichever backend computes it:

- "triton": the kernels, through the torch.library ops of triton_backend.py (also what torch.compile sees);
- "torch":  the chunked PyTorch backend, torch_backend.py (CPU tensors, float64, backend="torch", an empty head).

The public ops call it once per loss, on the head that validation prepared (_validate.linear_head, which also
chooses its backend with choose_backend): linear_cross_entropy, linear_log_probs and linear_logsumexp run the
one-class closed forms (torch_backend/one_class.py), the fused plan of a reduced cross-entropy whose gradient is
wanted, or the statistics, of the whole vocabulary where the head is sharded (shards.exchange), and write the loss on
them with loss_math, so every path shares the loss code and every option of the backward: ``workspace_bytes`` (the
memory the Triton backward may take; the PyTorch backend sizes its blocks by the default policy and ignores it),
``skip_threshold`` / ``vocab_order`` (cold tiles the Triton backward may skip, decided by that backend; the PyTorch
backend computes every block), and the stash (the Triton forward keeps logits for the backward where the weight
gradient's buffer has room). Both backends answer the same three calls: stats, fused_plan, fused_cross_entropy.

Every other backend choice of a public op is made here too, behind one call each: the two-head losses
(two_heads_loss) and cross-entropy on given logits (logits_cross_entropy).

The Triton backends (triton_backend.py, triton_two_heads.py, triton_cross_entropy.py) import Triton with the kernels
they launch, by plain names. This module imports them inside the calls that chose Triton, and no other module of
the package does: that is the one lazy boundary that keeps `import logitless` working where Triton is absent or
cannot run (a CPU-only install).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import loss_math, shards, torch_backend
from ._autograd import grads_wanted
from ._dispatch import KERNEL_DTYPES, check_kernel_dtype, resolve_backend
from .loss_math import Stats
from .torch_backend import cross_entropy as torch_cross_entropy
from .torch_backend import two_heads as torch_two_heads

__all__ = ["HALF_SKIP_THRESHOLD", "HeadArgs", "Skip", "Stats", "choose_backend", "linear_cross_entropy",
           "linear_log_probs", "linear_logsumexp", "logits_cross_entropy", "stats", "two_heads_loss", "z_loss_apart"]

# The skipped-mass budget per row that bf16/fp16 inputs can ask for safely: 1/8 of the 2^-9 relative error that
# PyTorch's own bf16 softmax makes in every gradient row (docs/kernels.md). Too large for float32 inputs.
HALF_SKIP_THRESHOLD = 2.0**-12


class Skip(NamedTuple):
    """What the backward may skip: at most `threshold` of each row's probability mass (None or 0: nothing; "auto":
    a budget per row from its largest logit, triton_backend.AUTO_SKIP_UNIT, where skip_gate finds that it pays),
    with the vocabulary ordered by `vocab_order` ("none", "batch": this batch's target counts, or a (V,) tensor of
    counts); `bounded` is False for a loss whose gradient error the skipped mass does not bound (nothing is skipped
    then). `resolved`: the backend has decided this call (threshold None where it runs dense;
    triton_backend.resolve_skip); `in_backward`: "auto" left to the backward's own decision (torch.compile)."""

    threshold: float | str | None = None
    vocab_order: str | torch.Tensor = "none"
    bounded: bool = True
    resolved: bool = False
    in_backward: bool = False


NO_SKIP = Skip()


class HeadArgs(NamedTuple):
    """A prepared linear head, the head op's input (_validate.linear_head): validated, flattened arguments, `x`
    (N, D), `target` (N,) int64 (global class ids) or None, the class weights or None, the number of classes
    `vocab`, and the `backend` that runs it (choose_backend). With `shard` (a vocabulary-parallel head:
    shards.Shard), `weight`, `bias` and `class_weight` are this rank's rows, `vocab` is all shards' (an int, or a
    0-d device tensor where the shard sizes were exchanged between GPUs), and `x` is the replicated input as the
    backend takes it, its gradient summed over the group (shards.sum_grad_over_group)."""

    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    target: torch.Tensor | None
    lead_shape: torch.Size
    class_weight: torch.Tensor | None = None
    vocab: int | torch.Tensor = 0
    backend: str = "torch"
    shard: shards.Shard | None = None

    def local_target(self, ignore_index: int):
        """(the targets as ids of this head's rows, the ignore_index that goes with them): as given on one device;
        on a shard, shifted by its first row, ignored ones -1 (a target outside [0, V_r) is in another shard, or
        ignored: no target logit here)."""
        if self.shard is None or self.target is None:
            return self.target, ignore_index
        return torch.where(self.target != ignore_index, self.target - self.shard.start, -1), -1


# ---------------------------------------------------------------------------------------------------------------
# The public ops' calls: one per loss, on a prepared head, whatever its backend, its size (one class: the closed
# forms of torch_backend/one_class.py), its plan (fused, or the statistics) and its sharding (the statistics of the
# shard, exchanged: shards.exchange). Each runs down once: the backend, then the exchange, then loss_math.


def linear_cross_entropy(h: HeadArgs, reduction, ignore_index, label_smoothing, z_loss, softcap, *, skip: Skip,
                         workspace_bytes) -> torch.Tensor:
    """logitless.linear_cross_entropy's loss on a prepared head: the one-class closed form, a fused plan, or the
    statistics (of the whole vocabulary where the head is sharded) and loss_math's cross-entropy on them."""
    backend = _backend(h.backend, h.weight)
    target, local_ignore = h.local_target(ignore_index)
    class_w = None if h.class_weight is None else h.class_weight.to(loss_math.acc_dtype(h.x.dtype))
    want_lse = z_loss_apart(z_loss, h.x, h.weight)
    if h.shard is None and h.vocab == 1:
        # A closed form gives PyTorch's exact zeros (one_class_logits, float64), on either backend.
        return torch_backend.one_class_cross_entropy(h.x, h.weight, h.bias, h.target, class_w, reduction,
                                                     ignore_index, label_smoothing, z_loss, softcap, h.lead_shape)
    if h.shard is None:
        # The dense plan of this call: for a reduced loss whose gradient is wanted, the gradients in the forward
        # where the backend's plan finds room (on the PyTorch backend always where the budget holds, on Triton where
        # the policy finds it faster). Whether skipping cold tiles pays (Triton only) is judged against it, and
        # decided there.
        plan, skip = backend.fused_plan(h.x, h.weight, h.bias, softcap, reduction, skip, workspace_bytes)
        if plan is not None:
            return backend.fused_cross_entropy(h.x, h.weight, h.bias, h.target, class_w, reduction, ignore_index,
                                               label_smoothing, z_loss, softcap, plan)
    st = backend.stats(h.x, h.weight, h.bias, target, class_w, softcap, 1.0, label_smoothing > 0.0, False, skip=skip,
                       ignore_index=local_ignore, workspace_bytes=workspace_bytes, want_lse=want_lse)
    if h.shard is None:
        valid, w_t, w_sum = loss_math.ce_row_terms(h.target, class_w, ignore_index, label_smoothing, h.vocab,
                                                   st.m.dtype)
    else:
        st, w_t, w_sum = shards.exchange(st, target, class_w, h.weight.shape[0], h.shard.group)
        valid = h.target != ignore_index
        w_t = valid.to(st.m.dtype) if w_t is None else torch.where(valid, w_t, 0.0)
    per_token = loss_math.ce_loss_from_stats(st.m, st.logs, st.zt, st.sw, st.m, valid, w_t, w_sum, label_smoothing,
                                             z_loss, h.vocab, lse=st.lse)
    return loss_math.reduce_loss(per_token, valid, w_t, reduction, h.lead_shape)


def linear_log_probs(h: HeadArgs, ignore_index, softcap, inv_temp, want_entropy: bool, *, skip: Skip,
                     workspace_bytes) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs of the targets, entropy or None), of the lead shape, 0 where ignored, on a prepared head."""
    backend = _backend(h.backend, h.weight)
    target, local_ignore = h.local_target(ignore_index)
    if h.shard is None and h.vocab == 1:
        return torch_backend.one_class_log_probs(h.x, h.weight, h.bias, h.target, ignore_index, softcap, inv_temp,
                                                 want_entropy, h.lead_shape)
    st = backend.stats(h.x, h.weight, h.bias, target, None, softcap, inv_temp, False, want_entropy, skip=skip,
                       ignore_index=local_ignore, workspace_bytes=workspace_bytes)
    if h.shard is not None:
        st, _, _ = shards.exchange(st, target, None, h.weight.shape[0], h.shard.group)
    logp, ent = loss_math.log_probs_from_stats(st, h.target != ignore_index)
    return logp.reshape(h.lead_shape), (None if ent is None else ent.reshape(h.lead_shape))


def linear_logsumexp(h: HeadArgs, softcap, inv_temp, *, workspace_bytes) -> torch.Tensor:
    """The per-row log-sum-exp of the lead shape on a prepared head."""
    backend = _backend(h.backend, h.weight)
    if h.shard is None and h.vocab == 1:
        return torch_backend.one_class_logsumexp(h.x, h.weight, h.bias, softcap, inv_temp, h.lead_shape)
    st = backend.stats(h.x, h.weight, h.bias, None, None, softcap, inv_temp, False, False, skip=NO_SKIP,
                       workspace_bytes=workspace_bytes)
    if h.shard is not None:
        st, _, _ = shards.exchange(st, None, None, h.weight.shape[0], h.shard.group)
    return (st.m + st.logs).reshape(h.lead_shape)


def z_loss_apart(z_loss: float, *tensors: torch.Tensor) -> bool:
    """Whether the head op asks the backend for the lse statistic, which the z-loss then takes (loss_math's module
    docstring): with float32 (or float64) inputs. In half precision the backward rounds dL/dz to the input's dtype
    (2^-9 relative in bf16), which dwarfs the ulp of 1 that logs' summed gradient loses, so those calls keep the
    plain path, the faster one (docs/math.md)."""
    return z_loss > 0.0 and all(t.dtype.itemsize >= 4 for t in tensors)


def choose_backend(backend: str, x: torch.Tensor, op: str) -> str:
    """"triton" or "torch" for running `op` on x: _dispatch's choice, and float64 (which has no kernels) on the
    PyTorch path under "auto" (a TypeError for an explicit backend="triton")."""
    chosen = resolve_backend(backend, x.device, op)
    if chosen == "triton" and not check_kernel_dtype(x, backend):
        return "torch"
    return chosen


def stats(x, weight, bias, target, class_weight, softcap, inv_temp, want_smooth, want_entropy, *, backend: str,
          skip: Skip = NO_SKIP, ignore_index: int = -100, workspace_bytes: int | None = None,
          want_lse: bool = False) -> Stats:
    """The statistics of the head softcap(x W^T + b) * inv_temp on validated (N, D) / (V, D) inputs, through
    `backend` (choose_backend). target: (N,) int64 class ids or None (zt); a target outside [0, V) (ignored, or in
    another shard) has zt = 0. class_weight: (V,) or None, the w_j of sw. want_smooth / want_entropy: sw / ent
    (None otherwise). skip and workspace_bytes shape the Triton backward (see the module docstring; the backend
    decides the skip unless the caller did); ignore_index only keeps ignored targets out of the "batch" vocabulary
    order. want_lse: the lse statistic, for a term whose gradient must stay apart from logs' (the z-loss;
    loss_math's module docstring)."""
    return _backend(backend, weight).stats(x, weight, bias, target, class_weight, softcap, inv_temp, want_smooth,
                                           want_entropy, skip=skip, ignore_index=ignore_index,
                                           workspace_bytes=workspace_bytes, want_lse=want_lse)


def _backend(backend: str, weight):
    """The module that runs the head op for `backend`: triton_backend (imported here, inside the call that chose
    it: the one lazy boundary) or torch_backend, which also runs a head of no classes (an empty vocabulary shard).
    Both answer the same calls: stats, fused_plan, fused_cross_entropy."""
    if backend == "triton" and weight.shape[0] > 0:
        from . import triton_backend

        return triton_backend
    return torch_backend


def two_heads_loss(xs, ws, bs, xt, wt, bt, kind: str, beta: float, softcap, inv_temp: float, workspace_bytes, *,
                   backend: str, skip_threshold: float | str | None = None) -> torch.Tensor:
    """The per-row loss `kind` (loss_math.KINDS) of two validated heads over one vocabulary, (N,) float32 (float64
    for float64 heads), differentiable with respect to the student's xs, ws and bs; through `backend`
    (choose_backend): the kernels (triton_two_heads) or the chunked PyTorch twin (torch_backend.two_heads).
    workspace_bytes and skip_threshold (None or 0: dense; a float; "auto": bf16/fp16 only,
    triton_backend.AUTO_SKIP_UNIT, where skip_gate finds that it pays) are for the Triton backward
    (docs/distill.md, "Skipping cold tiles")."""
    if backend == "triton":
        from . import triton_backend, triton_two_heads

        tau = 0.0
        grads = grads_wanted(xs, ws, bs)
        if grads and skip_threshold == "auto":
            tau = triton_backend.auto_threshold(xs.dtype)
        elif grads and skip_threshold is not None:
            tau = float(skip_threshold)
        return triton_two_heads.loss(xs, ws, bs, xt, wt, bt, kind, beta, softcap, inv_temp, workspace_bytes, tau)
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
        # ulp there where PyTorch gives 0 (docs/cross_entropy.md); the PyTorch path transforms the logits once and
        # gets the exact zeros. N values: nothing to fuse.
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
