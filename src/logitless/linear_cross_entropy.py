"""linear_cross_entropy: the loss of a linear head without materialising its logits.

The call, top to bottom: validation (_validate, which prepares the head: flattened, its backend chosen (Triton
kernels or the chunked PyTorch path), with its sharding where ``process_group`` is given) -> one call of the head op
(head.linear_cross_entropy), which chooses the plan: the head op's per-row statistics (row max, log-sum-exp,
target logit, smoothing sum; of the whole vocabulary where it is sharded, shards.exchange) -> the cross-entropy
written on them (loss_math, the same code on every path) -> the reduction. The backward is autograd's through that
expression, down to the head op's one generic backward (loss_math describes the form of the gradient). A reduced
loss with a gradient wanted may take a fused plan instead (the backend's fused_plan: on the PyTorch backend always
where the budget holds, on Triton where the policy finds it faster; the gradients in the forward, the same loss_math
terms), and a one-class head a closed form (torch_backend/one_class.py).
"""

from __future__ import annotations

import torch

from . import _validate, head
from ._validate import check_workspace
from .head import HALF_SKIP_THRESHOLD
from .vocab import class_counts

# Names of the skip option and helpers that callers import from here.
__all__ = ["HALF_SKIP_THRESHOLD", "check_workspace", "class_counts", "linear_cross_entropy"]


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
    skip_threshold: float | str | None = "auto",
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
        deterministic: gradients that are bitwise identical run to run, whatever the calls before. Both backends'
            plans give them (the Triton backward uses no atomics; its kernels reduce in a fixed order and its
            cuBLAS products are reproducible on a given GPU). What can differ between two identical calls is the
            plan: with ``skip_threshold="auto"`` each call chooses between the dense and the skipping plans from
            the head's earlier calls (both within the precision rule, not the same bits). ``deterministic=True``
            runs the dense plans in place of ``"auto"``; a numeric ``skip_threshold`` skips on every call.
        skip_threshold: the largest fraction of each row's probability mass whose gradient the Triton backward may
            skip (cold tiles of the softmax, neither recomputed nor multiplied); each gradient row then changes by
            at most that fraction times its coefficient (in L1 over the classes). ``"auto"``: for bfloat16 / float16
            inputs, each row's budget is a quarter of the rounding of its largest logit ``m`` to the dtype
            (``2**-11 * max(1, |m|)`` in bfloat16, ``2**-14 * max(1, |m|)`` in float16), the rounding that sets
            PyTorch's own error in that gradient row; float32 inputs skip nothing. ``"auto"`` is the default, and
            it skips only where it pays: each head (its weight) keeps skipping while its plans skip a large share of
            the work, and runs the dense plans where its softmax is flat (a head at initialisation), probing again
            at growing intervals; decided from earlier calls' plans without a host sync, and under torch.compile
            inside the backward op (docs/design/skipping.md). A float: that budget for every row, skipping on every
            call (``HALF_SKIP_THRESHOLD``, 2**-12, is a fixed setting). ``None`` or 0: nothing is skipped. A tile
            holding a target is never skipped, and nothing is skipped with ``label_smoothing > 0`` or on the
            PyTorch path; with ``process_group``, each rank skips within its shard (its own largest logit for
            ``"auto"``).
        vocab_order: how the Triton path orders the vocabulary when it skips, so that frequent classes share
            tiles: "none" (default), "batch" (by the counts of this batch's targets), or a (V,) tensor of per-class
            counts (e.g. kept across steps; ``LinearCrossEntropyLoss(vocab_order="running")`` does that). The
            result does not depend on it beyond rounding; an order costs time (its W rows are gathered).
        workspace_bytes: memory the Triton backward may allocate for its workspaces, beyond a few float32 values per
            token. ``None`` (default): the memory policy, the larger of a fifth of what the N x V logits would take in
            bfloat16 (``2 * N * V // 5`` bytes) and, for bfloat16 / float16 inputs, ``4 * N * D`` bytes plus 16 MiB
            (``logitless.loss_math.default_workspace_bytes``), spent on the fastest plan that fits: at least
            ``4 * N * D`` bytes more than 8 MiB (N tokens, D features) give the float32 accumulator of the input's
            gradient its own buffer, which removes the second pass that recomputes the logits of the weight-gradient
            rows it would otherwise borrow (bfloat16 / float16); the rest widens the vocabulary chunks (up to 8192
            classes) and holds split partials. ``0`` (anything up to 8 MiB): the leanest plan, 8 MiB. A number: that
            budget, spent the same way (at the benchmark's shapes ``4 * N * D + 256 MiB`` made forward + backward
            faster than the leanest plan: docs/usage.md, BENCHMARKS.md). The result does not depend on it beyond
            float32 summation order. With bf16 inputs, D >= 2048 and a reduced loss whose gradient is wanted, the
            default budget is half of the bf16 logits (``N * V`` bytes) and buys the row-chunk plan (the gradients
            in the forward over chunks of full rows of logits, three products; docs/design/row_chunks.md), whose
            logits are rounded to bf16 as PyTorch's are. Ignored on the PyTorch path (which sizes its blocks by the
            same policy); with ``process_group``, each rank's budget for its shard.
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
    _validate.check_options(reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
                            ignore_index=ignore_index)
    _validate.check_flag("deterministic", deterministic)
    _validate.check_workspace(workspace_bytes)
    _validate.check_skip_options(skip_threshold, vocab_order, None, None)  # before the group: the same errors
    h = _validate.linear_head(input, linear_weight, target, linear_bias, ignore_index, weight=weight,
                              process_group=process_group, backend=backend, op="linear_cross_entropy")
    _validate.check_skip_options(skip_threshold, vocab_order, h.weight.shape[0], h.x.device)  # a tensor of counts
    if deterministic and isinstance(skip_threshold, str):  # "auto" depends on the head's history (skip_gate)
        skip_threshold = None
    # Label smoothing adds -E w_j to every class's gradient: a skipped tile would lose that too, so no skipping.
    skip = head.Skip(skip_threshold, vocab_order, bounded=label_smoothing == 0.0)
    return head.linear_cross_entropy(h, reduction, ignore_index, label_smoothing, z_loss, softcap, skip=skip,
                                     workspace_bytes=workspace_bytes)


def _check_torch_options(options) -> None:
    torch_options = getattr(torch.nn, "LinearCrossEntropyOptions", None)
    if options is None or (torch_options is not None and isinstance(options, torch_options)):
        return
    raise TypeError("options must be None or a torch.nn.LinearCrossEntropyOptions (accepted for compatibility with "
                    f"torch.nn.functional.linear_cross_entropy, and ignored), got {type(options).__name__}")
