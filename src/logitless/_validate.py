"""One place that checks shapes, dtypes, devices and options, and raises errors that name the problem.

Every public function calls into here before the head op, so a bad argument never reaches a kernel; linear_head
prepares the head that the head op takes (head.HeadArgs), its sharding included, so this module stands above the
head op. Checks that would need the values of a device tensor (targets out of range) never synchronise with the
host: on CPU they raise at once, on other devices they go through a device-side assertion that fires by the next
synchronisation.
"""

from __future__ import annotations

import operator

import torch

from . import head, shards
from ._dispatch import is_compiling
from .head import HeadArgs
from .loss_math import acc_dtype

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
INDEX_DTYPES = (torch.int64, torch.int32)
REDUCTIONS = ("mean", "sum", "none")
VOCAB_ORDERS = ("batch", "none")


def _check_float_tensor(name: str, t, allow_dtypes=FLOAT_DTYPES) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in allow_dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in allow_dtypes)
        raise TypeError(f"{name} must have a floating dtype ({names}), got {t.dtype}")


# The options are used in float32 arithmetic (and handed to the kernels as float32 scalars): a value that float32
# cannot hold as a normal number would become inf or 0 there (softcap=1e300: a NaN loss), or a float64 kernel
# argument (label_smoothing=1e-40), so it is refused instead.
F32_MAX = float(torch.finfo(torch.float32).max)
F32_TINY = float(torch.finfo(torch.float32).tiny)  # smallest normal float32, 2**-126


def _check_float_option(name: str, value) -> float:
    if isinstance(value, (torch.Tensor, bool)) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a Python float, got {type(value).__name__}")
    v = float(value)
    if v != 0.0 and not F32_TINY <= abs(v) <= F32_MAX:
        raise ValueError(f"{name} must be 0 or a number that float32 holds as a normal number ({F32_TINY:.3g} to "
                         f"{F32_MAX:.3g} in magnitude: the math is float32), got {value}")
    return v


def check_options(
    *,
    reduction: str | None = None,
    label_smoothing: float | None = None,
    z_loss: float | None = None,
    softcap: float | None = None,
    temperature: float | None = None,
    ignore_index=-100,
) -> None:
    if reduction is not None and reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if label_smoothing is not None:
        if not 0.0 <= _check_float_option("label_smoothing", label_smoothing) <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if z_loss is not None:
        if not _check_float_option("z_loss", z_loss) >= 0.0:
            raise ValueError(f"z_loss must be >= 0, got {z_loss}")
    if softcap is not None:
        if isinstance(softcap, (torch.Tensor, bool)) or not isinstance(softcap, (int, float)):
            raise TypeError(f"softcap must be a Python float or None, got {type(softcap).__name__}")
        if not float(softcap) > 0.0 or softcap == float("inf"):
            raise ValueError(f"softcap must be a positive finite number or None, got {softcap}")
        _check_float_option("softcap", softcap)
    if temperature is not None:
        if isinstance(temperature, (torch.Tensor, bool)) or not isinstance(temperature, (int, float)):
            raise TypeError(f"temperature must be a Python float, got {type(temperature).__name__}")
        if not float(temperature) > 0.0 or temperature == float("inf"):
            raise ValueError(f"temperature must be a positive finite number, got {temperature}")
        # The logits are multiplied by 1 / temperature: both must be normal float32 numbers.
        _check_float_option("temperature", temperature)
        if not F32_TINY <= 1.0 / float(temperature) <= F32_MAX:
            raise ValueError(f"temperature must be a positive number whose reciprocal float32 holds as a normal "
                             f"number ({1.0 / F32_MAX:.3g} to {1.0 / F32_TINY:.3g}), got {temperature}")
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")


_TRANSFORM_NAMES = {
    "Grad": "torch.func.grad (or vjp, jacrev, hessian)",
    "Jvp": "torch.func.jvp (or jacfwd, hessian)",
    "Vmap": "torch.func.vmap (or jacrev, jacfwd)",
    "Functionalize": "torch.func.functionalize",
}


def check_no_transform(op: str) -> None:
    """Raise a clear error inside a torch.func transform. Each op's backward is written by hand (an autograd.Function
    or a torch.library op), with no forward-mode, batching or functional rule: left alone, PyTorch raises a generic
    error for some transforms and, for jvp through a torch.library op, silently returns a zero tangent. Ordinary
    autograd (loss.backward(), torch.autograd.grad) and torch.func.functional_call are unaffected."""
    if is_compiling():
        return
    peek = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)
    if peek is None or peek() is None:
        return
    from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter

    key = retrieve_current_functorch_interpreter().key()
    name = _TRANSFORM_NAMES.get(getattr(key, "name", ""), f"the torch.func transform {key}")
    raise RuntimeError(
        f"logitless.{op} does not support {name}: its gradients are computed by a hand-written backward that "
        "torch.func transforms cannot trace. Use loss.backward() or torch.autograd.grad (a loop over the batch "
        "instead of vmap); torch.func.functional_call works."
    )


def ignore_index_arg(ignore_index) -> int:
    """`ignore_index` as a Python int: None means -100 (as in torch.nn.functional.linear_cross_entropy), and any
    integer type (a NumPy integer, a 0-d index tensor is not one) is accepted; bools and floats are not."""
    if ignore_index is None:
        return -100
    if isinstance(ignore_index, (bool, torch.Tensor)):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    try:
        return operator.index(ignore_index)
    except TypeError:
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}") from None


def check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def check_target(target, lead_shape: torch.Size, num_classes, ignore_index: int, device) -> torch.Tensor:
    """Check `target` against the leading shape and the class count; return it flattened, contiguous (the kernels
    read it with unit stride: labels[:, 0] is a strided view), as int64. num_classes: an int, or a 0-d device tensor
    (all shards' rows over a process group, exchanged between GPUs), whose range check is asynchronous."""
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if target.dtype not in INDEX_DTYPES:
        raise TypeError(f"target must hold class indices as int64 or int32, got {target.dtype}")
    if target.shape != lead_shape:
        raise ValueError(
            f"target has shape {tuple(target.shape)} but the input's leading shape is {tuple(lead_shape)}"
        )
    if target.device != device:
        raise ValueError(f"target is on {target.device} but the input is on {device}")
    t = target.reshape(-1).long().contiguous()
    bad = (t != ignore_index) & ((t < 0) | (t >= num_classes))
    if isinstance(num_classes, torch.Tensor):
        torch._assert_async(~bad.any(), "target holds class indices outside [0, V) (V: all shards' rows over "
                            f"process_group) that are not ignore_index={ignore_index}")
        return t
    msg = f"target holds class indices outside [0, {num_classes}) that are not ignore_index={ignore_index}"
    if is_compiling() or t.device.type != "cpu":
        # Fires by the next synchronisation instead of stalling the stream now.
        torch._assert_async(~bad.any(), msg)
    elif t.numel() and bool(bad.any()):
        raise ValueError(msg)
    return t


def check_class_weight(weight, num_classes: int, device) -> torch.Tensor | None:
    if weight is None:
        return None
    _check_float_tensor("weight", weight)
    if weight.dim() != 1 or weight.shape[0] != num_classes:
        raise ValueError(f"weight (class weights) must have shape ({num_classes},), got {tuple(weight.shape)}")
    if weight.device != device:
        raise ValueError(f"weight (class weights) is on {weight.device} but the input is on {device}")
    return weight


def check_linear(input, linear_weight, linear_bias) -> tuple[torch.Tensor, torch.Size]:
    """Check a (..., D) input against a (V, D) weight and an optional (V,) bias; return (x as (N, D), lead shape)."""
    _check_float_tensor("input", input)
    _check_float_tensor("linear_weight", linear_weight)
    if linear_weight.dim() != 2:
        raise ValueError(f"linear_weight must be 2-D (V, D), got shape {tuple(linear_weight.shape)}")
    if input.dim() < 1:
        raise ValueError("input must have at least one dimension (..., D), got a 0-d tensor")
    V, D = linear_weight.shape
    if input.shape[-1] != D:
        raise ValueError(
            f"input's last dimension is {input.shape[-1]} but linear_weight has shape ({V}, {D}): they must match"
        )
    if input.device != linear_weight.device:
        raise ValueError(f"input is on {input.device} but linear_weight is on {linear_weight.device}")
    if input.dtype != linear_weight.dtype:
        raise TypeError(f"input is {input.dtype} but linear_weight is {linear_weight.dtype}: use one dtype")
    if linear_bias is not None:
        _check_float_tensor("linear_bias", linear_bias)
        if linear_bias.shape != (V,):
            raise ValueError(f"linear_bias must have shape ({V},), got {tuple(linear_bias.shape)}")
        if linear_bias.device != linear_weight.device:
            raise ValueError(f"linear_bias is on {linear_bias.device} but linear_weight is on {linear_weight.device}")
    if V == 0:
        raise ValueError("linear_weight has no rows: the vocabulary must not be empty")
    lead_shape = input.shape[:-1]
    return input.reshape(lead_shape.numel(), D), lead_shape  # -1 cannot be inferred when D == 0


def linear_head(input, linear_weight, target, linear_bias, ignore_index, *, weight=None, process_group=None,
                backend: str = "auto", op: str) -> HeadArgs:
    """The prepared head of the public op `op`: its arguments checked and flattened (weight: the class weights, or
    None) and its backend chosen (head.choose_backend); with a process_group (or a shards.Sharding), the
    vocabulary-parallel head, sharding included."""
    if process_group is not None:
        return _sharded_head(input, linear_weight, target, linear_bias, ignore_index, weight, process_group, backend,
                             op)
    x, lead_shape = check_linear(input, linear_weight, linear_bias)
    V = linear_weight.shape[0]
    t = None
    if target is not None:
        t = check_target(target, lead_shape, V, ignore_index, input.device)
    cw = check_class_weight(weight, V, input.device)
    return HeadArgs(x, linear_weight, linear_bias, t, lead_shape, cw, V, head.choose_backend(backend, x, op))


def _sharded_head(input, linear_weight, target, linear_bias, ignore_index, weight, process_group, backend,
                  op) -> HeadArgs:
    """linear_head over a vocabulary sharded on process_group: this rank's rows (a DTensor's local shard), the
    input and target replicated, the targets global ids checked against all shards' rows (shards.layout)."""
    given = process_group if isinstance(process_group, shards.Sharding) else shards.Sharding(process_group)
    group = shards.resolve_group(given.process_group)
    w, lay_w = shards.local_shard(linear_weight, "linear_weight", group)
    b, lay_b = shards.local_shard(linear_bias, "linear_bias", group)
    cw, lay_c = shards.local_shard(weight, "weight (class weights)", group)
    x = shards.replicated_input(input, "input", group)
    target = shards.replicated_input(target, "target", group)
    if isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[0] == 0:  # this rank's shard may be empty
        if b is not None and isinstance(b, torch.Tensor) and b.shape != (0,):
            raise ValueError(f"linear_bias must have shape (0,) like this rank's empty shard, got {tuple(b.shape)}")
        # Same checks against a one-row stand-in of the same dtype and device.
        x2d, lead = check_linear(x, w.new_empty((1, w.shape[1])), None if b is None else b.new_empty(1))
    else:
        x2d, lead = check_linear(x, w, b)
    cw = check_class_weight(cw, w.shape[0], x.device)
    layout = shards.layout(w.shape[0], (lay_w, lay_b, lay_c), given.vocab_start, given.vocab_size, group, x.device)
    t = None
    if target is not None:
        if isinstance(layout.vocab, int) and layout.vocab == 0:
            raise ValueError("the shards of linear_weight over process_group hold no rows: the vocabulary is empty")
        t = check_target(target, lead, layout.vocab, ignore_index, x.device)
    chosen = head.choose_backend(backend, x2d, op)
    if chosen == "torch":
        # The PyTorch backend returns dx in x's dtype: upcast, so that the shards' parts are summed before the one
        # rounding.
        x2d = x2d.to(acc_dtype(x2d.dtype))
    x2d = shards.sum_grad_over_group(x2d, group)
    return HeadArgs(x2d, w, b, t, lead, cw, layout.vocab, chosen, shards.Shard(group, layout.start))


def logits_head(logits, target, ignore_index) -> tuple[torch.Tensor, torch.Tensor, torch.Size]:
    """Check (..., V) logits and a target of the leading shape; return (logits as (N, V), target (N,), lead)."""
    _check_float_tensor("logits", logits)
    if logits.dim() < 1:
        raise ValueError("logits must have at least one dimension (..., V), got a 0-d tensor")
    V = logits.shape[-1]
    if V == 0:
        raise ValueError("logits have an empty class dimension")
    lead_shape = logits.shape[:-1]
    t = check_target(target, lead_shape, V, ignore_index, logits.device)
    return logits.reshape(-1, V), t, lead_shape


def check_skip_options(skip_threshold, vocab_order, num_classes: int | None, device) -> None:
    """ValueError/TypeError for a bad skip_threshold (None, "auto" or a float in [0, 1)) or vocab_order ("batch",
    "none", or a (V,) tensor of per-class counts on the input's device; num_classes None: any tensor, checked later)."""
    if isinstance(skip_threshold, str):
        if skip_threshold != "auto":
            raise ValueError(f"skip_threshold must be None, \"auto\" or a float in [0, 1), got {skip_threshold!r}")
    elif skip_threshold is not None:
        if isinstance(skip_threshold, bool) or not isinstance(skip_threshold, (int, float)):
            raise TypeError(f"skip_threshold must be None, \"auto\" or a Python float, got "
                            f"{type(skip_threshold).__name__}")
        if not 0.0 <= float(skip_threshold) < 1.0:
            raise ValueError(f"skip_threshold must be in [0, 1) (a fraction of each row's probability mass), "
                             f"got {skip_threshold}")
    if isinstance(vocab_order, torch.Tensor):
        if num_classes is None:
            return
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
