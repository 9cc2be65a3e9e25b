"""TRL's trainers with their per-token log-probs and entropies from ``logitless.linear_log_probs``.

TRL's trainers (GRPO, RLOO, DPO, KTO, SFT, and the async GRPO trainer) score tokens through one hook: at
construction they give the policy and the reference model a *fused LM head* (``trl.trainer.utils.add_fused_lm_head``,
an instance ``forward``), and every per-token log-prob pass, with gradients (the loss) or without (the reference
model's and the old policy's log-probs), calls ``model(..., labels=labels, fused_lm_head=True)``, which returns
``FusedCausalLMOutput(loss, log_probs, entropy, ...)``. ``patch(trainer)`` puts a forward in front of that one on
the same instances: the ``fused_lm_head=True`` calls run the backbone, then ``linear_log_probs`` on the final hidden
states (with ``return_entropy=True`` where TRL asks for the entropy); every other call (generation, evaluation
without the fused head) goes to TRL's forward unchanged. Only instances change; ``unpatch`` puts TRL's forward back.

What TRL's head does, reproduced field by field:
  - the shift (position i scores label i + 1, or ``shift_labels`` as given), ``-100`` labels give 0 in every field;
  - the temperature TRL gave the head (GRPO's and RLOO's ``temperature``), read from the head TRL installed;
  - the model's logit transform (a final softcap, a logit scale, a scale of the hidden states), found by ``heads``,
    which also refuses a forward whose transform it does not know;
  - autocast (the head runs in the autocast dtype, the log-prob math in float32) and ``cast_lm_head_to_fp32``;
  - the loss: ``-sum(log_probs) / num_items_in_batch`` (the count of scored tokens when not given);
  - ``mean_logits`` (a closed form without a softcap), ``log_sum_sq_probs`` (two ``linear_logsumexp``) and
    ``is_top1`` (a chunked scan): metric fields, without gradient, none of them building the N x V logits.
TRL's batch chunking and completion slicing happen in the trainer, around these calls, and are unchanged.

Where the head is not a plain ``nn.Linear`` (quantised, LoRA on ``lm_head``, hooks, a DTensor), the forward's
transform is unknown, or an MoE model asks for its router loss, the call goes to TRL's own head with a warning the
first time (``strict=True`` raises instead).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from typing import Any

import torch
from torch import nn

from .. import _validate
from .._dispatch import BACKENDS
from ..log_probs import linear_log_probs, linear_logsumexp
from . import heads

# Fields of TRL's FusedCausalLMOutput that this module computes.
FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
# Elements of one (tokens x vocabulary) tile of the metric scan (is_top1, a softcapped mean_logits): 64 MiB in float32.
_SCAN_ELEMENTS = 1 << 24


class UnsupportedModelError(NotImplementedError):
    """The model's head is one this integration does not reproduce (raised with ``strict=True``)."""


@dataclasses.dataclass
class _Plan:
    prior_forward: Any  # TRL's fused-head forward (an instance attribute), restored by unpatch
    temperature: float
    cast_lm_head_to_fp32: bool
    outputs: tuple[str, ...]
    rules: tuple[heads.Rule, ...] | None  # None: the model cannot be reproduced (see `refusal`)
    refusal: str | None
    options: dict
    warned: set = dataclasses.field(default_factory=set)
    disabled: bool = False  # unpatched while wrapped by another forward: passes every call to prior_forward


def _chain(fn):
    """The forward and what it wraps, outermost first: bound methods, ``functools.wraps`` wrappers, accelerate's
    mixed-precision wrapper (which the trainer puts around a model's forward when it prepares it), this module's."""
    for _ in range(16):
        if fn is None:
            return
        yield fn
        if isinstance(fn, functools.partial) and fn.func is _forward:
            fn = fn.args[1].prior_forward
        else:
            fn = getattr(fn, "__func__", None) or getattr(fn, "__wrapped__", None) or getattr(fn, "model_forward", None)


def _trl_head_settings(model: nn.Module) -> dict:
    """The settings of the fused head TRL installed on ``model`` (its temperature, outputs, fp32 cast)."""
    try:
        from trl.trainer import utils as trl_utils
    except ImportError as e:
        raise ImportError("logitless.integrations.trl needs TRL (pip install trl)") from e
    func = next((f for f in _chain(vars(model).get("forward"))
                 if getattr(getattr(f, "__code__", None), "co_name", None) == "_fused_forward"
                 and getattr(f, "__globals__", None) is vars(trl_utils)), None)
    if func is None:
        raise ValueError(
            f"this {type(model).__name__} has no TRL fused LM head (trl.trainer.utils.add_fused_lm_head): patch the "
            "trainer after constructing it, or call add_fused_lm_head on the model first"
        )
    code = func.__code__
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in func.__closure__ or ()), strict=True))
    missing = {"temperature", "cast_lm_head_to_fp32", "outputs"} - cells.keys()
    if missing:
        raise ValueError(
            f"the installed TRL's fused LM head does not keep {sorted(missing)} where this integration reads them; "
            "it was written against TRL 1.16"
        )
    unknown = set(cells["outputs"]) - set(FIELDS)
    if unknown:
        raise ValueError(f"TRL's fused LM head asks for outputs this integration does not know: {sorted(unknown)}")
    return cells


def _refusal(model: nn.Module) -> tuple[tuple[heads.Rule, ...] | None, str | None]:
    """(the transform rules, None) when the fused path reproduces the model's head, else (None, why not)."""
    try:
        heads.find_backbone(model)
        head = heads.find_output_embedding(model)
        heads.check_plain_linear(model, head)
        src = heads.forward_source(model)
        if not heads.head_applied_directly(model, head, src):
            return None, "its forward does not apply the output embedding directly to the backbone's hidden states"
        return heads.applied_rules(model, src), None
    except (TypeError, ValueError, heads.UnknownTransformError) as e:
        return None, str(e)


def _fallback(model: nn.Module, plan: _Plan, reason: str, args, kwargs):
    if plan.options["strict"]:
        raise UnsupportedModelError(f"logitless.integrations.trl: {type(model).__name__}: {reason}")
    if reason not in plan.warned:
        plan.warned.add(reason)
        warnings.warn(f"logitless.integrations.trl: {type(model).__name__}: {reason}; its log-probs come from TRL's "
                      "own fused head", stacklevel=3)
    return plan.prior_forward(*args, **kwargs)


def _forward(model: nn.Module, plan: _Plan, *args, **kwargs):
    if plan.disabled or not kwargs.get("fused_lm_head", False):
        return plan.prior_forward(*args, **kwargs)
    if plan.refusal is not None:
        return _fallback(model, plan, plan.refusal, args, kwargs)
    config = heads.text_config(model.config)
    if kwargs.get("output_router_logits", getattr(config, "output_router_logits", False)):
        return _fallback(model, plan, "the call asks for the MoE router loss, which this integration does not add",
                         args, kwargs)
    head = heads.find_output_embedding(model)
    try:  # again at every call: PEFT and FSDP wrap or shard the head after patch
        heads.check_plain_linear(model, head)
    except TypeError as e:
        return _fallback(model, plan, str(e), args, kwargs)
    return _fused(model, plan, head, *args, **kwargs)


def _fused(model: nn.Module, plan: _Plan, head: nn.Module, *args, fused_lm_head=True, labels=None,
           shift_labels=None, num_items_in_batch=None, **kwargs):
    from trl.trainer.utils import FusedCausalLMOutput

    kwargs["use_cache"] = False
    out = heads.find_backbone(model)(*args, **kwargs)
    hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
    if shift_labels is None:
        hidden, labels = hidden[:, :-1], labels[:, 1:]
    else:
        labels = shift_labels
    weight, bias = head.weight, head.bias
    hidden, labels = hidden.to(weight.device), labels.to(weight.device)
    mask = labels != -100

    x, bias, softcap, temperature = heads.transform_of(model.config, plan.rules).for_log_probs(hidden, bias)
    temperature = temperature * plan.temperature
    device_type = x.device.type
    if plan.cast_lm_head_to_fp32:
        dtype = torch.float32
    elif torch.is_autocast_enabled(device_type):  # what nn.Linear does under autocast: the autocast dtype
        dtype = torch.get_autocast_dtype(device_type)
    else:
        dtype = x.dtype
    x, weight = x.to(dtype), weight.to(dtype)
    bias = bias.to(dtype) if bias is not None else None

    compact = plan.options["compact"]
    if compact:
        # Only the scored tokens (one host synchronisation for their count, as TRL's head makes on GPUs).
        xs, ts = x[mask], labels[mask]
    else:
        xs, ts = x, labels
    want = plan.outputs
    with torch.autocast(device_type, enabled=False):
        scored = linear_log_probs(xs, weight, ts, linear_bias=bias, softcap=softcap, temperature=temperature,
                                  ignore_index=-100, return_entropy="entropy" in want,
                                  backend=plan.options["backend"], workspace_bytes=plan.options["workspace_bytes"],
                                  skip_threshold=plan.options["skip_threshold"])
        logp, ent = scored if "entropy" in want else (scored, None)
        extra = _metrics(xs, weight, bias, ts, softcap, temperature, want, plan.options["backend"])

    def place(v):
        if v is None:
            return None
        if compact:
            # masked_scatter keeps an all-ignored batch connected to the graph (a differentiable zero).
            return v.new_zeros(mask.shape).masked_scatter(mask, v)
        return v.masked_fill(~mask, 0)

    log_probs = place(logp)
    count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    loss = -log_probs.sum() / count
    return FusedCausalLMOutput(loss=loss, log_probs=log_probs, entropy=place(ent),
                               log_sum_sq_probs=place(extra.get("log_sum_sq_probs")),
                               mean_logits=place(extra.get("mean_logits")), is_top1=place(extra.get("is_top1")),
                               label_mask=mask, aux_loss=None)


@torch.no_grad()
def _metrics(x, weight, bias, target, softcap, temperature, want, backend) -> dict:
    """TRL's metric fields (no gradient) of ``softcap(x W^T + b) / temperature``, without the N x V logits."""
    out = {}
    if "log_sum_sq_probs" in want:  # log sum p^2 = lse(2 z / T) - 2 lse(z / T)
        lse = functools.partial(linear_logsumexp, x, weight, linear_bias=bias, softcap=softcap, backend=backend)
        out["log_sum_sq_probs"] = lse(temperature=temperature / 2) - 2 * lse(temperature=temperature)
    if "mean_logits" in want and softcap is None:
        # The mean over the vocabulary of a linear function is the function of the mean row.
        mean = x.float() @ weight.float().mean(0)
        if bias is not None:
            mean = mean + bias.float().mean()
        out["mean_logits"] = mean / temperature
    if "is_top1" in want or ("mean_logits" in want and softcap is not None):
        out.update(_scan(x, weight, bias, target, softcap, temperature, want))
    return out


def _scan(x, weight, bias, target, softcap, temperature, want) -> dict:
    """is_top1 (the target is the first maximum) and the mean logit, over vocabulary tiles of the logits."""
    lead, d = x.shape[:-1], x.shape[-1]
    x, t = x.reshape(-1, d), target.reshape(-1)
    n, v = x.shape[0], weight.shape[0]
    cols = min(v, max(256, _SCAN_ELEMENTS // max(n, 1)))
    best = x.new_full((n,), float("-inf"), dtype=torch.float32)
    best_before = best.clone()
    z_target = x.new_zeros((n,), dtype=torch.float32)
    z_sum = x.new_zeros((n,), dtype=torch.float32)
    for start in range(0, v, cols):
        end = min(start + cols, v)
        z = (x @ weight[start:end].t()).float()
        if bias is not None:
            z += bias[start:end].float()
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        z /= temperature
        z_sum += z.sum(-1)
        local = t - start
        before = torch.arange(end - start, device=z.device) < local[:, None]
        best_before = torch.maximum(best_before, z.masked_fill(~before, float("-inf")).amax(-1))
        best = torch.maximum(best, z.amax(-1))
        inside = (local >= 0) & (local < end - start)
        z_target = torch.where(inside, z.gather(1, local.clamp(0, end - start - 1)[:, None]).squeeze(1), z_target)
    out = {}
    if "is_top1" in want:
        out["is_top1"] = ((z_target >= best) & (z_target > best_before) & (t != -100)).reshape(lead)
    if "mean_logits" in want and softcap is not None:
        out["mean_logits"] = (z_sum / v).reshape(lead)
    return out


def _installed_plan(model: nn.Module) -> _Plan | None:
    """The plan of this module's forward on ``model``, the outermost one where forwards were wrapped again."""
    for fn in _chain(vars(model).get("forward")):
        if isinstance(fn, functools.partial) and fn.func is _forward and not fn.args[1].disabled:
            return fn.args[1]
    return None


def _models(obj) -> list[nn.Module]:
    """The models of a TRL trainer whose log-probs go through a fused head (the policy, the reference model), or
    ``[obj]`` for a model."""
    if isinstance(obj, nn.Module):
        return [obj.get_base_model() if callable(getattr(obj, "get_base_model", None)) else obj]
    model = getattr(obj, "model", None)
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a TRL trainer or a model, got {type(obj).__name__}")
    models = [model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model]
    ref = getattr(obj, "ref_model", None)
    if isinstance(ref, nn.Module) and ref is not model:
        models.append(ref)
    return models


def _patch_model(model: nn.Module, options: dict) -> None:
    if _installed_plan(model) is not None:
        _unpatch_model(model)
    settings = _trl_head_settings(model)
    rules, refusal = _refusal(model)
    if refusal is not None and options["strict"]:
        raise UnsupportedModelError(f"logitless.integrations.trl: {type(model).__name__}: {refusal}")
    plan = _Plan(prior_forward=model.forward, temperature=float(settings["temperature"]),
                 cast_lm_head_to_fp32=bool(settings["cast_lm_head_to_fp32"]), outputs=tuple(settings["outputs"]),
                 rules=rules, refusal=refusal, options=options)
    _validate.check_options(temperature=plan.temperature)
    forward = functools.partial(_forward, model, plan)
    for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
        setattr(forward, attr, getattr(type(model).forward, attr, None))
    # The trainer and generate() read the forward's signature (dataset columns, model kwargs): TRL's, unchanged.
    forward.__signature__ = inspect.signature(plan.prior_forward)
    model.forward = forward


def _unpatch_model(model: nn.Module) -> None:
    plan = _installed_plan(model)
    if plan is None:
        raise ValueError(f"logitless.integrations.trl.unpatch: this {type(model).__name__} is not patched")
    fwd = vars(model).get("forward")
    if isinstance(fwd, functools.partial) and fwd.args[1] is plan:
        model.forward = plan.prior_forward
    else:
        # Wrapped since (accelerate's mixed-precision wrapper, at train()): the wrapper stays, and this forward
        # passes every call through to TRL's.
        plan.disabled = True


def patch(trainer, *, backend: str = "auto", workspace_bytes: int | None = None, skip_threshold="auto",
          compact: bool = True, strict: bool = False):
    """Make a TRL trainer compute its per-token log-probs and entropies with ``linear_log_probs``.

    Call it after constructing the trainer (which gives its models TRL's fused LM head) and before ``train()``.
    The policy (the base model of a PEFT model) and the reference model get a new ``forward`` on their instances:
    the trainer's ``fused_lm_head=True`` calls (its loss and its no-grad log-prob passes) run the backbone, then
    ``linear_log_probs`` on the final hidden states and the output embedding, with TRL's temperature, the model's
    logit transform, and the entropy where TRL asks for it; nothing builds the N x V logits. Other calls go to TRL's
    forward. Patching again replaces the options.

    Args:
        trainer: a TRL trainer (GRPOTrainer, RLOOTrainer, DPOTrainer, KTOTrainer, SFTTrainer, ...), or one model
            that has TRL's fused head (``trl.trainer.utils.add_fused_lm_head``).
        backend: "auto", "triton" or "torch", as in ``linear_log_probs``.
        workspace_bytes: memory the Triton backward may allocate, as in ``linear_log_probs``.
        skip_threshold: as in ``linear_log_probs``: ``"auto"`` skips cold tiles of the backward where that pays,
            ``None`` runs the dense plans, which keep less memory at this head's backward
            (docs/design/skipping.md, "Where the skipping backward's memory goes").
        compact: score only the tokens with a label (one host synchronisation per call for their count, as TRL's
            head makes on GPUs); False scores every position with ignored targets instead, without synchronising.
        strict: raise :class:`UnsupportedModelError` where the head cannot be reproduced (a head that is not a plain
            ``nn.Linear``, an unknown logit transform, an MoE router loss) instead of warning once and using TRL's
            own head for those calls.

    Returns:
        ``trainer``.
    """
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    _validate.check_workspace(workspace_bytes)
    _validate.check_skip_options(skip_threshold, "none", None, None)
    _validate.check_flag("compact", compact)
    _validate.check_flag("strict", strict)
    options = dict(backend=backend, workspace_bytes=workspace_bytes, skip_threshold=skip_threshold, compact=compact,
                   strict=strict)
    for model in _models(trainer):
        _patch_model(model, options)
    return trainer


def unpatch(trainer):
    """Undo :func:`patch`: the trainer's models get TRL's fused-head forward back. Returns ``trainer``."""
    for model in _models(trainer):
        _unpatch_model(model)
    return trainer


def is_patched(model: nn.Module) -> bool:
    """Whether :func:`patch` is in effect on this model instance."""
    return _installed_plan(model) is not None
