"""linear_log_probs and linear_logsumexp: per-token scores of a linear head without materialising its logits.

Both follow linear_cross_entropy's steps: validation (the prepared head, its backend chosen, sharded with
``process_group``) -> one call of the head op (head.linear_log_probs, head.linear_logsumexp: the one-class closed
form, or the statistics of the whole vocabulary) -> the scores written on them (loss_math).
"""

from __future__ import annotations

from typing import Literal, overload

import torch

from . import _validate, head


@overload
def linear_log_probs(input: torch.Tensor, linear_weight: torch.Tensor, target: torch.Tensor, *,
                     linear_bias: torch.Tensor | None = ..., softcap: float | None = ..., temperature: float = ...,
                     ignore_index: int = ..., return_entropy: Literal[False] = ..., backend: str = ...,
                     skip_threshold: float | str | None = ..., workspace_bytes: int | None = ...,
                     process_group=...) -> torch.Tensor: ...


@overload
def linear_log_probs(input: torch.Tensor, linear_weight: torch.Tensor, target: torch.Tensor, *,
                     linear_bias: torch.Tensor | None = ..., softcap: float | None = ..., temperature: float = ...,
                     ignore_index: int = ..., return_entropy: Literal[True], backend: str = ...,
                     skip_threshold: float | str | None = ..., workspace_bytes: int | None = ...,
                     process_group=...) -> tuple[torch.Tensor, torch.Tensor]: ...


def linear_log_probs(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    linear_bias: torch.Tensor | None = None,
    softcap: float | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    backend: str = "auto",
    skip_threshold: float | str | None = "auto",
    workspace_bytes: int | None = None,
    process_group=None,
):
    """Per-token ``log_softmax(z / temperature)[target]`` of ``z = F.linear(input, linear_weight, linear_bias)``.

    ``z`` is softcapped (``softcap * tanh(z / softcap)``) before the temperature when ``softcap`` is set. All math
    is float32. Differentiable with respect to ``input``, ``linear_weight`` and ``linear_bias``.

    Args:
        input: (..., D) float32, bfloat16 or float16; linear_weight: (V, D); target: (...) int64/int32.
        return_entropy: also return the entropy of ``softmax(z / temperature)`` per token.
        skip_threshold: as in :func:`logitless.linear_cross_entropy` (the Triton backward may skip cold tiles that
            hold at most this fraction of a row's probability mass; default ``"auto"``: where it pays, within a
            quarter of the rounding of each row's largest logit), the entropy's gradient included.
        workspace_bytes: memory the Triton backward may allocate, as in :func:`logitless.linear_cross_entropy`.
        process_group: vocabulary-parallel group (``linear_weight`` is this rank's shard); see
            :mod:`logitless.distributed`.

    Returns:
        float32 log-probs of the shape of ``target`` (0 at ``ignore_index`` positions), and with
        ``return_entropy=True`` a tuple ``(log_probs, entropy)``; the entropy is 0 at ignored positions too.
    """
    _validate.check_no_transform("linear_log_probs")
    ignore_index = _validate.ignore_index_arg(ignore_index)
    _validate.check_flag("return_entropy", return_entropy)
    _validate.check_options(softcap=softcap, temperature=temperature, ignore_index=ignore_index)
    _validate.check_workspace(workspace_bytes)
    _validate.check_skip_options(skip_threshold, "none", None, None)
    h = _validate.linear_head(input, linear_weight, target, linear_bias, ignore_index, process_group=process_group,
                              backend=backend, op="linear_log_probs")
    # The entropy's gradient is not bounded by the skipped probability mass alone: no skipping with it.
    skip = head.Skip(skip_threshold, "none")
    logp, ent = head.linear_log_probs(h, ignore_index, softcap, 1.0 / float(temperature), return_entropy, skip=skip,
                                      workspace_bytes=workspace_bytes)
    return (logp, ent) if return_entropy else logp


def linear_logsumexp(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    *,
    linear_bias: torch.Tensor | None = None,
    softcap: float | None = None,
    temperature: float = 1.0,
    backend: str = "auto",
    workspace_bytes: int | None = None,
    process_group=None,
) -> torch.Tensor:
    """Per-row ``logsumexp(z / temperature)`` of ``z = F.linear(input, linear_weight, linear_bias)`` (softcapped
    first when ``softcap`` is set), float32, of the input's leading shape. Differentiable; ``workspace_bytes`` as
    in :func:`logitless.linear_cross_entropy`."""
    _validate.check_no_transform("linear_logsumexp")
    _validate.check_options(softcap=softcap, temperature=temperature)
    _validate.check_workspace(workspace_bytes)
    h = _validate.linear_head(input, linear_weight, None, linear_bias, -100, process_group=process_group,
                              backend=backend, op="linear_logsumexp")
    return head.linear_logsumexp(h, softcap, 1.0 / float(temperature), workspace_bytes=workspace_bytes)
