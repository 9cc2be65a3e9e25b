"""linear_log_probs and linear_logsumexp: per-token scores of a linear head without materialising its logits.

Both follow linear_cross_entropy's steps: validation -> the backend (head.choose_backend) -> the head op's per-row
statistics (head.stats) -> the scores written on them (loss_math); with ``process_group``, distributed.py.
"""

from __future__ import annotations

from typing import Literal, overload

import torch

from . import _validate, distributed, head, loss_math


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
    if process_group is not None:
        return distributed.linear_log_probs(
            input, linear_weight, target, linear_bias=linear_bias, softcap=softcap, temperature=temperature,
            ignore_index=ignore_index, return_entropy=return_entropy, backend=backend, skip_threshold=skip_threshold,
            workspace_bytes=workspace_bytes, process_group=process_group,
        )
    _validate.check_options(softcap=softcap, temperature=temperature, ignore_index=ignore_index)
    args = _validate.linear_head(input, linear_weight, target, linear_bias, ignore_index)
    _validate.check_skip_options(skip_threshold, "none", linear_weight.shape[0], input.device)
    _validate.check_workspace(workspace_bytes)
    chosen = head.choose_backend(backend, args.x, "linear_log_probs")
    valid = args.target != ignore_index
    if linear_weight.shape[0] == 1:
        # One class: log 1 = 0 and no entropy, exactly (head.one_class_logits), on either backend.
        z = head.one_class_logits(args.x, args.weight, args.bias, softcap, 1.0 / float(temperature))
        logp = torch.where(valid, z * 0.0, 0.0).reshape(args.lead_shape).to(loss_math.acc_dtype(args.x.dtype))
        return (logp, logp.clone()) if return_entropy else logp
    # The entropy's gradient is not bounded by the skipped probability mass alone: no skipping with it.
    skip = head.Skip(skip_threshold, "none")
    st = head.stats(args.x, args.weight, args.bias, args.target, None, softcap, 1.0 / float(temperature), False,
                    bool(return_entropy), backend=chosen, skip=skip, ignore_index=ignore_index,
                    workspace_bytes=workspace_bytes)
    logp, ent = loss_math.log_probs_from_stats(st, valid)
    if return_entropy:
        return logp.reshape(args.lead_shape), ent.reshape(args.lead_shape)
    return logp.reshape(args.lead_shape)


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
        return distributed.linear_logsumexp(input, linear_weight, linear_bias=linear_bias, softcap=softcap,
                                            temperature=temperature, backend=backend,
                                            workspace_bytes=workspace_bytes, process_group=process_group)
    _validate.check_options(softcap=softcap, temperature=temperature)
    args = _validate.linear_head(input, linear_weight, None, linear_bias, -100)
    _validate.check_workspace(workspace_bytes)
    chosen = head.choose_backend(backend, args.x, "linear_logsumexp")
    inv_temp = 1.0 / float(temperature)
    if linear_weight.shape[0] == 1:  # one class: lse = z, exactly
        z = head.one_class_logits(args.x, args.weight, args.bias, softcap, inv_temp)
        return z.reshape(args.lead_shape).to(loss_math.acc_dtype(args.x.dtype))
    st = head.stats(args.x, args.weight, args.bias, None, None, softcap, inv_temp, False, False, backend=chosen,
                    workspace_bytes=workspace_bytes)
    return (st.m + st.logs).reshape(args.lead_shape)
