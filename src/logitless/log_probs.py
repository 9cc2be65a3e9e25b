"""linear_log_probs and linear_logsumexp: per-token scores of a linear head without materialising its logits."""

from __future__ import annotations

from typing import Literal, overload

import torch

from . import _validate, reference
from ._dispatch import resolve_backend
from .linear_cross_entropy import check_kernel_dtype, check_skip_options, check_workspace, head_stats, skip_setup


@overload
def linear_log_probs(input: torch.Tensor, linear_weight: torch.Tensor, target: torch.Tensor, *,
                     linear_bias: torch.Tensor | None = ..., softcap: float | None = ..., temperature: float = ...,
                     ignore_index: int = ..., return_entropy: Literal[False] = ..., backend: str = ...,
                     skip_threshold: float | None = ..., workspace_bytes: int | None = ...,
                     process_group=...) -> torch.Tensor: ...


@overload
def linear_log_probs(input: torch.Tensor, linear_weight: torch.Tensor, target: torch.Tensor, *,
                     linear_bias: torch.Tensor | None = ..., softcap: float | None = ..., temperature: float = ...,
                     ignore_index: int = ..., return_entropy: Literal[True], backend: str = ...,
                     skip_threshold: float | None = ..., workspace_bytes: int | None = ...,
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
    skip_threshold: float | None = None,
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
            hold at most this fraction of a row's probability mass; default: no skipping); nothing is skipped with
            ``return_entropy``.
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
    if process_group is not None:
        from . import distributed

        return distributed.linear_log_probs(
            input, linear_weight, target, linear_bias=linear_bias, softcap=softcap, temperature=temperature,
            ignore_index=ignore_index, return_entropy=return_entropy, backend=backend, process_group=process_group,
        )
    _validate.check_options(softcap=softcap, temperature=temperature, ignore_index=ignore_index)
    args = _validate.linear_head(input, linear_weight, target, linear_bias, ignore_index)
    check_skip_options(skip_threshold, "none", linear_weight.shape[0], input.device)
    check_workspace(workspace_bytes)
    chosen = resolve_backend(backend, input.device, "linear_log_probs")
    # One class: closed forms on the PyTorch path (reference.one_class_logits), on either backend.
    if chosen == "triton" and check_kernel_dtype(args.x, backend) and linear_weight.shape[0] > 1:
        # The entropy's gradient is not bounded by the skipped probability mass alone: no skipping with it.
        skip = skip_setup(args, skip_threshold, "none", ignore_index, bounded=not return_entropy)
        m, logs, zt, _, ent = head_stats(args, None, softcap, 1.0 / float(temperature), False, return_entropy, *skip,
                                         workspace_bytes=workspace_bytes)
        valid = args.target != ignore_index
        logp = torch.where(valid, (zt - m) - logs, 0.0).reshape(args.lead_shape)
        if return_entropy:
            return logp, torch.where(valid, ent, 0.0).reshape(args.lead_shape)
        return logp
    return reference.log_probs_torch(args, ignore_index, softcap, temperature, return_entropy)


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
    if process_group is not None:
        from . import distributed

        return distributed.linear_logsumexp(input, linear_weight, linear_bias=linear_bias, softcap=softcap,
                                            temperature=temperature, backend=backend, process_group=process_group)
    _validate.check_options(softcap=softcap, temperature=temperature)
    args = _validate.linear_head(input, linear_weight, None, linear_bias, -100)
    check_workspace(workspace_bytes)
    chosen = resolve_backend(backend, input.device, "linear_logsumexp")
    if chosen == "triton" and check_kernel_dtype(args.x, backend) and linear_weight.shape[0] > 1:
        m, logs = head_stats(args, None, softcap, 1.0 / float(temperature), False, False,
                             workspace_bytes=workspace_bytes)[:2]
        return (m + logs).reshape(args.lead_shape)
    return reference.logsumexp_torch(args, softcap, temperature)
