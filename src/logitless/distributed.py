"""Vocabulary-parallel (tensor-parallel) linear cross-entropy, log-probs and log-sum-exp over torch.distributed.

Each rank of ``process_group`` holds a contiguous block of rows of the classifier (its vocabulary shard; shards
in rank order, sizes may differ), the same input rows and the same global targets. The math (docs/distributed.md):

1. Each rank runs the head op (logitless.head, either backend) on its shard, with targets shifted by its first row
   (a target outside [0, V_r) is "in another shard": it contributes no target logit here). Per row it gets the
   shard's max m_r, log-sum s_r = log sum_{j in r} exp(z_j - m_r), target logit, smoothing sum
   sum_j w_j (z_j - m_r) and entropy.
2. One all-gather of those few floats per row gives every rank the same global statistics, combined in the same
   order on every rank (so every rank returns bit-identical values): M = max_r m_r, logs = log sum_r
   exp((m_r - M) + s_r), the target logit and smoothing sums add up, and the entropy of the mixture is
   H = sum_r q_r (H_r - log q_r) with q_r = exp(lse_r - lse) the share of the probability mass in shard r. The
   losses are the single-device ones, written on these statistics with the same code (loss_math).
3. Backward: autograd takes the gradient through the combination and the all-gather (each rank keeps its own
   slot) to the statistics of the shard, whose head op runs its generic backward there: each rank keeps its weight
   (and bias) gradient, and the input gradient, a sum over shards, is all-reduced in float32.

Every option of the head op's backward works here as on one device: ``workspace_bytes``, ``skip_threshold`` /
``vocab_order`` (on the shard's own vocabulary: a tile that holds at most that fraction of the shard's mass holds
at most that fraction of the row's) and the Triton forward's stash.

Collectives per call: forward, one all-gather of the shard sizes (skipped when the layout is known: ``vocab_start``
and ``vocab_size`` given, or a DTensor weight) and one all-gather of the statistics; backward, one all-reduce of the
input gradient (when the input requires one). No host synchronisation is added: the exchanged sizes stay on the
device (on CPU they are read at once). No N x V_r tensor is built.

The sharding is a property of the head that validation prepares (shards.py: the layout, the exchange, the
collectives), so the public ops run the same steps with or without it; the functions here are those ops with the
layout given.
"""

from __future__ import annotations

import torch

from . import log_probs
from .linear_cross_entropy import linear_cross_entropy as linear_cross_entropy_op
from .shards import Sharding

__all__ = ["linear_cross_entropy", "linear_log_probs", "linear_logsumexp"]


# ---------------------------------------------------------------------------------------------------------------
# The public ops with the layout given (also reached, without it, through process_group= on
# logitless.linear_cross_entropy & co.).

_PG_DOC = """process_group: the ``torch.distributed`` group (or 1-D DeviceMesh) over which the vocabulary is
            sharded. ``linear_weight`` (and ``linear_bias``, class ``weight``) are this rank's contiguous rows, in
            rank order; sizes may differ between ranks. A DTensor placed Shard(0) on that group is used through its
            local shard (other DTensors are gathered first). ``input`` and ``target`` are the same on every rank
            (or DTensors on that group, gathered); targets are global ids in [0, V).
        vocab_start, vocab_size: this rank's first global row and the global V, when known (Megatron: rank *
            V_padded / P and V_padded); they spare the forward the all-gather of the shard sizes."""


def linear_cross_entropy(input, linear_weight, target, *, linear_bias=None, weight=None, reduction="mean",
                         ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None, backend="auto",
                         skip_threshold="auto", vocab_order="none", workspace_bytes=None, deterministic=False,
                         process_group, vocab_start=None, vocab_size=None) -> torch.Tensor:
    """Vocabulary-parallel :func:`logitless.linear_cross_entropy`: the same loss as on one device over the
    concatenated shards, returned identically on every rank of ``process_group``.

    Args:
        (as :func:`logitless.linear_cross_entropy`; the class ``weight`` and a ``vocab_order`` tensor of counts are
        this rank's (V_r,) shards), and
        {pg}

    Returns:
        float32 loss, a scalar or the shape of ``target`` for ``reduction="none"``. The input gradient comes back
        complete (all-reduced over the group) on every rank; each rank gets the gradient of its own shard.
    """
    return linear_cross_entropy_op(
        input, linear_weight, target, linear_bias=linear_bias, weight=weight, reduction=reduction,
        ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap, backend=backend,
        skip_threshold=skip_threshold, vocab_order=vocab_order, workspace_bytes=workspace_bytes,
        deterministic=deterministic, process_group=Sharding(process_group, vocab_start, vocab_size))


def linear_log_probs(input, linear_weight, target, *, linear_bias=None, softcap=None, temperature=1.0,
                     ignore_index=-100, return_entropy=False, backend="auto", skip_threshold="auto",
                     workspace_bytes=None, process_group, vocab_start=None, vocab_size=None):
    """Vocabulary-parallel :func:`logitless.linear_log_probs`: per-token log-probs (and entropy) of the full
    vocabulary, identical on every rank.

    Args:
        (as :func:`logitless.linear_log_probs`), and
        {pg}

    Returns:
        float32 log-probs of the shape of ``target`` (0 where ignored), or ``(log_probs, entropy)`` with
        ``return_entropy=True``.
    """
    return log_probs.linear_log_probs(
        input, linear_weight, target, linear_bias=linear_bias, softcap=softcap, temperature=temperature,
        ignore_index=ignore_index, return_entropy=return_entropy, backend=backend, skip_threshold=skip_threshold,
        workspace_bytes=workspace_bytes, process_group=Sharding(process_group, vocab_start, vocab_size))


def linear_logsumexp(input, linear_weight, *, linear_bias=None, softcap=None, temperature=1.0, backend="auto",
                     workspace_bytes=None, process_group, vocab_start=None, vocab_size=None) -> torch.Tensor:
    """Vocabulary-parallel :func:`logitless.linear_logsumexp`: the per-row log-partition function over the whole
    vocabulary, float32, identical on every rank.

    Args:
        (as :func:`logitless.linear_logsumexp`), and
        {pg}
    """
    return log_probs.linear_logsumexp(
        input, linear_weight, linear_bias=linear_bias, softcap=softcap, temperature=temperature, backend=backend,
        workspace_bytes=workspace_bytes, process_group=Sharding(process_group, vocab_start, vocab_size))


for _f in (linear_cross_entropy, linear_log_probs, linear_logsumexp):
    if _f.__doc__:  # None under python -OO
        _f.__doc__ = _f.__doc__.replace("{pg}", _PG_DOC)
del _f
