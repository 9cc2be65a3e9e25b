"""Two heads, no logits: distillation losses (KL, generalized JSD) and the soft cross-entropy between two heads.

Both heads project hidden states onto the same vocabulary: the student's ``z_s = softcap(x_s W_s^T + b_s) / T``
and the teacher's ``z_t = softcap(x_t W_t^T + b_t) / T``. Every loss here is a per-row sum over the vocabulary of
terms in ``p_s = softmax(z_s)`` and ``p_t = softmax(z_t)``, computed tile by tile from per-row statistics
(docs/math.md, "Two heads"): pass 1 runs an online log-sum-exp of both heads, with the cross sum
``sum_j e_a (z_a - z_b)`` of the weighting head ``a`` rescaled as its maximum grows (one pass gives both KL
directions and the soft cross-entropy); the generalized JSD needs the normalised distributions inside its
logarithm and makes a second pass. The backward recomputes both heads' tiles and forms the student's ``dL/dz`` per
tile; only the student gets gradients (the teacher is treated as a constant, whatever its ``requires_grad``).

Layers, as for the other ops: the public functions here (validation, the per-row loss, the reduction) -> the head
op's door, head.two_heads_loss, which chooses a backend: torch_backend.two_heads (the chunked PyTorch twin) or
triton_two_heads (the torch.library ops ``logitless::two_heads_loss`` and ``logitless::two_heads_grad`` around
kernels/two_heads) -> the row statistics and each loss on them, loss_math.RowStats and loss_math.row_loss, shared
by both backends.
logitless.testing.naive_two_heads builds full logits with PyTorch's own ops: ground truth for the tests (in
float64) and the eager peer of the benchmark.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import _validate, head

DIRECTIONS = ("forward", "reverse")


class TwoHeadArgs(NamedTuple):
    """Validated, flattened arguments: xs (N, Ds), ws (V, Ds), xt (N, Dt), wt (V, Dt), valid (N,) bool or None."""

    xs: torch.Tensor
    ws: torch.Tensor
    bs: torch.Tensor | None
    xt: torch.Tensor
    wt: torch.Tensor
    bt: torch.Tensor | None
    valid: torch.Tensor | None
    lead_shape: torch.Size


def _prefixed(prefix: str, fn, *args):
    try:
        return fn(*args)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{prefix}: {e}") from None


def validate(student_input, student_weight, teacher_input, teacher_weight, student_bias, teacher_bias, target,
             ignore_index, names=("student", "teacher")) -> TwoHeadArgs:
    """Check both heads (shapes, dtypes, devices, one vocabulary) and the optional target; the teacher's tensors
    come back detached (no gradient reaches them)."""
    a, b = names
    xs, lead = _prefixed(f"{a} head (input, linear_weight, linear_bias = {a}_input, {a}_weight, {a}_bias)",
                         _validate.check_linear, student_input, student_weight, student_bias)
    xt, lead_t = _prefixed(f"{b} head (input, linear_weight, linear_bias = {b}_input, {b}_weight, {b}_bias)",
                           _validate.check_linear, teacher_input, teacher_weight, teacher_bias)
    if lead != lead_t:
        raise ValueError(f"{a}_input has leading shape {tuple(lead)} but {b}_input has {tuple(lead_t)}: the two "
                         "heads score the same tokens")
    if student_weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(f"{a}_weight has {student_weight.shape[0]} classes but {b}_weight has "
                         f"{teacher_weight.shape[0]}: the two heads need one vocabulary")
    if xs.dtype != xt.dtype:
        raise TypeError(f"{a} head is {xs.dtype} but {b} head is {xt.dtype}: use one dtype for both")
    if xs.device != xt.device:
        raise ValueError(f"{a} head is on {xs.device} but {b} head is on {xt.device}")
    valid = None
    if target is not None:
        if not isinstance(target, torch.Tensor):
            raise TypeError(f"target must be a torch.Tensor or None, got {type(target).__name__}")
        if target.dtype not in _validate.INDEX_DTYPES and target.dtype != torch.bool:
            raise TypeError(f"target must be int64/int32 labels (rows equal to ignore_index are ignored) or a bool "
                            f"mask (True = keep), got {target.dtype}")
        if target.shape != lead:
            raise ValueError(f"target has shape {tuple(target.shape)} but the inputs' leading shape is {tuple(lead)}")
        if target.device != xs.device:
            raise ValueError(f"target is on {target.device} but the inputs are on {xs.device}")
        t = target.reshape(-1)
        valid = (t if t.dtype == torch.bool else t != ignore_index).contiguous()
    bt = None if teacher_bias is None else teacher_bias.detach()
    return TwoHeadArgs(xs, student_weight, student_bias, xt.detach(), teacher_weight.detach(), bt, valid, lead)


def check_beta(beta) -> float:
    if isinstance(beta, (torch.Tensor, bool)) or not isinstance(beta, (int, float)):
        raise TypeError(f"beta must be a Python float, got {type(beta).__name__}")
    if not 0.0 <= float(beta) <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    return float(beta)


def reduce_rows(per_row: torch.Tensor, valid: torch.Tensor | None, reduction: str, lead_shape) -> torch.Tensor:
    """0 at ignored rows; "mean" divides by the number of kept rows (NaN when there are none, as PyTorch's
    cross-entropy does), as a tensor (no host sync)."""
    if valid is not None:
        per_row = torch.where(valid, per_row, 0.0)
    if reduction == "none":
        return per_row.reshape(lead_shape)
    total = per_row.sum()
    if reduction == "sum":
        return total
    count = valid.sum() if valid is not None else per_row.new_tensor(float(per_row.numel()))
    return total / count


def _run(a: TwoHeadArgs, kind, beta, softcap, temperature, reduction, backend, op, workspace_bytes=None,
         skip_threshold=None):
    softcap = None if softcap is None else float(softcap)
    inv_temp = 1.0 / float(temperature)
    per_row = head.two_heads_loss(a.xs, a.ws, a.bs, a.xt, a.wt, a.bt, kind, beta, softcap, inv_temp,
                                  workspace_bytes, backend=head.choose_backend(backend, a.xs, op),
                                  skip_threshold=skip_threshold)
    return reduce_rows(per_row, a.valid, reduction, a.lead_shape)


def _common_checks(reduction, temperature, softcap, ignore_index, workspace_bytes, skip_threshold):
    ignore_index = _validate.ignore_index_arg(ignore_index)
    _validate.check_options(reduction=reduction, temperature=temperature, softcap=softcap, ignore_index=ignore_index)
    _validate.check_workspace(workspace_bytes)
    _validate.check_skip_options(skip_threshold, "none", None, None)
    return ignore_index


# ---------------------------------------------------------------------------------------------------------------
# Public functions


def linear_kl_div(
    student_input: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_input: torch.Tensor,
    teacher_weight: torch.Tensor,
    *,
    target: torch.Tensor | None = None,
    ignore_index: int = -100,
    temperature: float = 1.0,
    direction: str = "forward",
    reduction: str = "mean",
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    softcap: float | None = None,
    backend: str = "auto",
    workspace_bytes: int | None = None,
    skip_threshold: float | str | None = None,
) -> torch.Tensor:
    """KL divergence between the softmaxes of two linear heads, per token, without building either's logits.

    With ``z_s = softcap(student_input @ student_weight.T + student_bias) / temperature`` (softcap, when set, is
    ``softcap * tanh(z / softcap)`` before the temperature; the same for the teacher), ``p_s = softmax(z_s)`` and
    ``p_t = softmax(z_t)``: ``direction="forward"`` gives ``KL(p_t || p_s) = sum_j p_t (log p_t - log p_s)`` (the
    usual distillation loss, mean-seeking), ``"reverse"`` gives ``KL(p_s || p_t)`` (mode-seeking, as in on-policy
    distillation). The loss is not multiplied by ``temperature**2``; multiply it yourself for Hinton's
    scaling. All math is float32.

    Gradients flow to ``student_input``, ``student_weight`` and ``student_bias`` only: the teacher's tensors are
    treated as constants (detached), even if they require grad.

    Args:
        student_input: (..., Ds) float32, bfloat16 or float16 (float64 on the PyTorch path); student_weight:
            (V, Ds). teacher_input: (..., Dt) of the same leading shape, dtype and device; teacher_weight: (V, Dt),
            the same vocabulary. Ds and Dt may differ.
        target: optional labels of the leading shape (int64/int32; rows equal to ``ignore_index`` are ignored, other
            values are not used) or a bool mask (True = keep). None: every row counts.
        reduction: "mean" (over the kept rows; NaN when none is kept), "sum", or "none" (float32 per row, 0 at
            ignored rows).
        backend, workspace_bytes: as in :func:`logitless.linear_cross_entropy`.
        skip_threshold: None (the default: every pair computed), a float in [0, 1) or "auto" (bfloat16 / float16
            only): the Triton backward may leave out the (token block, vocabulary tile) pairs where both heads are
            cold, each row's dL/dz changing by at most that fraction of its scale in L1 (for "auto", a budget
            relative to PyTorch's own rounding, where skipping pays); docs/distill.md, "Skipping cold tiles".

    Returns:
        float32 loss: a scalar, or the leading shape for ``reduction="none"``.
    """
    ignore_index = _common_checks(reduction, temperature, softcap, ignore_index, workspace_bytes, skip_threshold)
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    a = validate(student_input, student_weight, teacher_input, teacher_weight, student_bias, teacher_bias, target,
                 ignore_index)
    kind = "fkl" if direction == "forward" else "rkl"
    return _run(a, kind, 0.0, softcap, temperature, reduction, backend, "linear_kl_div", workspace_bytes,
                skip_threshold)


def linear_jsd(
    student_input: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_input: torch.Tensor,
    teacher_weight: torch.Tensor,
    *,
    beta: float = 0.5,
    target: torch.Tensor | None = None,
    ignore_index: int = -100,
    temperature: float = 1.0,
    reduction: str = "mean",
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    softcap: float | None = None,
    backend: str = "auto",
    workspace_bytes: int | None = None,
    skip_threshold: float | str | None = None,
) -> torch.Tensor:
    """Generalized Jensen-Shannon divergence between the softmaxes of two linear heads, per token, without logits.

    For ``0 < beta < 1``: ``beta * KL(p_t || M) + (1 - beta) * KL(p_s || M)`` with the mixture
    ``M = beta * p_t + (1 - beta) * p_s`` (``beta = 0.5``: the symmetric JSD, at most log 2). ``beta`` is the
    teacher's weight, the same convention as Liger-Kernel's ``LigerFusedLinearJSD(jsd_beta=...)`` and TRL's GKD
    ``beta``, with the same two edges: ``beta = 0`` is the forward ``KL(p_t || p_s)`` and ``beta = 1`` the reverse
    ``KL(p_s || p_t)`` (the limits of the JSD divided by ``beta`` and by ``1 - beta``; the unscaled JSD itself
    tends to 0 there), computed as :func:`linear_kl_div` does. Other arguments, the temperature convention (no
    ``temperature**2`` factor), ``skip_threshold`` and the frozen teacher as in :func:`linear_kl_div`.
    """
    ignore_index = _common_checks(reduction, temperature, softcap, ignore_index, workspace_bytes, skip_threshold)
    beta = check_beta(beta)
    a = validate(student_input, student_weight, teacher_input, teacher_weight, student_bias, teacher_bias, target,
                 ignore_index)
    kind = "fkl" if beta == 0.0 else "rkl" if beta == 1.0 else "jsd"
    return _run(a, kind, beta, softcap, temperature, reduction, backend, "linear_jsd", workspace_bytes, skip_threshold)


def linear_soft_cross_entropy(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target_input: torch.Tensor,
    target_weight: torch.Tensor,
    *,
    target: torch.Tensor | None = None,
    ignore_index: int = -100,
    temperature: float = 1.0,
    reduction: str = "none",
    linear_bias: torch.Tensor | None = None,
    target_bias: torch.Tensor | None = None,
    softcap: float | None = None,
    backend: str = "auto",
    workspace_bytes: int | None = None,
    skip_threshold: float | str | None = None,
) -> torch.Tensor:
    """Cross-entropy of one head's softmax under another's, per token: ``-sum_j q_j log p_j`` with
    ``p = softmax(z)`` of the head (``input``, ``linear_weight``, ``linear_bias``) and ``q = softmax(z')`` of the
    target head (``target_input``, ``target_weight``, ``target_bias``), never building either's logits.

    It is ``KL(q || p) + H(q)``: a soft-label cross-entropy for distillation (same gradient as the forward KL), and,
    with an observer model's head as the first and a performer's as the target head, the cross-perplexity
    (in log form, nats per token) of the Binoculars score (docs/detect.md). Temperature and softcap apply to both
    heads as in :func:`linear_kl_div`. Differentiable with respect to the first head only (the target head is
    treated as constant). ``target`` masks rows and ``skip_threshold`` skips as in :func:`linear_kl_div`;
    ``reduction`` defaults to "none" (float32 per token, 0 at ignored rows).
    """
    ignore_index = _common_checks(reduction, temperature, softcap, ignore_index, workspace_bytes, skip_threshold)
    a = validate(input, linear_weight, target_input, target_weight, linear_bias, target_bias, target, ignore_index,
                 names=("input", "target"))
    return _run(a, "ce", 0.0, softcap, temperature, reduction, backend, "linear_soft_cross_entropy",
                workspace_bytes, skip_threshold)
