"""Instance-level patch of Hugging Face ``transformers`` causal LMs: the training loss without the logits.

``patch(model)`` puts a new ``forward`` on this one model object (never on its class, never on a global). When the
model is in training mode and ``labels`` are given, the new forward runs the backbone, then
``logitless.linear_cross_entropy`` on the final hidden states and the output embedding, and returns the model's usual
output with ``logits=None``. In every other case (no labels, ``model.eval()``) it calls the original forward.

The loss follows transformers' causal-LM contract (``ForCausalLMLoss``) exactly:
  - ``labels`` are padded on the right with ``ignore_index`` and shifted by one, unless ``shift_labels`` is given;
  - ``num_items_in_batch`` (int or tensor) switches to ``sum / num_items_in_batch``, else the mean over non-ignored
    tokens; a tensor stays on the device (no host synchronisation);
  - ``logits_to_keep`` (``num_logits_to_keep`` before transformers 4.50) slices the hidden states as the model does;
  - the logit transform the model's forward applies (a final softcap, a logit scale that multiplies or divides, a
    scale of the hidden states before the head) is applied too, as ``heads`` finds it per model type;
  - tied embeddings work unchanged (the head's weight is the embedding's parameter); on a CPU the embedding's
    rows are added into the head's gradient in place (``tied``), never beside a second dense one, and half of the
    head's gradient is made after the backbone's backward, never beside its activations.
While patched, the head's rows are stored in a softmax-mass order learned from the training forwards (``vocab_order``,
``logitless.SortedHead``), for the skipping backward; inputs, labels, logits and state dicts stay in class order.
The backbone, the head and the logit transform come from ``heads`` (shared with ``logitless score``), and models
whose forward does something this cannot reproduce are refused at ``patch`` time with an error that says why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import _validate
from .._dispatch import BACKENDS
from ..linear_cross_entropy import check_workspace, linear_cross_entropy
from ..sorted_head import SortedHead
from ..vocab import VocabOrder
from . import heads, tied


def _refusals(config, src: str | None):
    """(reason, applies) for the loss or logit features this integration does not reproduce."""

    def mentioned(name):
        return src is None or name in src

    z = getattr(config, "z_loss_coefficient", None)
    yield ("its forward adds a z-loss averaged over all positions (config.z_loss_coefficient > 0); set it to 0 and "
           "pass z_loss= to logitless.patch instead", mentioned("z_loss") and isinstance(z, (int, float)) and z > 0)
    unpadded = getattr(config, "unpadded_vocab_size", None)
    yield ("its forward drops the padded vocabulary rows (config.unpadded_vocab_size)",
           mentioned("unpadded_vocab_size") and unpadded is not None)
    yield ("its forward adds the router load-balancing loss (config.output_router_logits=True); set it to False or "
           "add that loss yourself", mentioned("output_router_logits") and bool(getattr(config, "output_router_logits",
                                                                                       False)))
    yield ("it is an encoder-decoder model", bool(getattr(config, "is_encoder_decoder", False)))


@dataclasses.dataclass
class _Plan:
    """What the patched forward needs, worked out once at patch time."""

    # An instance attribute `forward` the model had before patch (restored by unpatch), else None: the class's.
    prior_forward: Any
    signature: inspect.Signature
    varkw: str | None
    keep_name: str | None  # "logits_to_keep" or "num_logits_to_keep"
    backbone_return_dict: bool
    # The logit transforms the forward applies; their values are read from the config at each call.
    transform_rules: tuple[heads.Rule, ...]
    checks_router_logits: bool
    output_cls: type
    output_fields: tuple[str, ...]  # output_cls's fields the backbone's output passes on (all but loss, logits)
    options: dict
    # The head stored in a vocabulary order (learned or fixed), None in class order; restored by unpatch.
    sorter: SortedHead | None = None

    @property
    def vocab_order(self) -> VocabOrder | None:
        """The order the head is stored in now (its tables change in place when a learned order is applied)."""
        return None if self.sorter is None else self.sorter.order


def _find_backbone(model: nn.Module) -> nn.Module:
    try:
        return heads.find_backbone(model)
    except ValueError as e:
        raise ValueError(f"logitless.patch: {e}") from None


def _find_head(model: nn.Module) -> nn.Linear:
    try:
        head = heads.find_output_embedding(model)
        heads.check_plain_linear(model, head)
    except (TypeError, ValueError) as e:
        raise type(e)(f"logitless.patch: {e}") from None
    return head


def _output_class(fn):
    """The ModelOutput class the original forward is annotated to return, or CausalLMOutputWithPast."""
    from transformers.modeling_outputs import CausalLMOutputWithPast
    from transformers.utils import ModelOutput

    ann = inspect.signature(fn).return_annotation
    if isinstance(ann, str):
        ann = getattr(sys.modules.get(getattr(fn, "__module__", ""), None), ann.strip("'\""), None)
    if isinstance(ann, type) and issubclass(ann, ModelOutput):
        names = {f.name for f in dataclasses.fields(ann)}
        if {"loss", "logits"} <= names:
            return ann
    return CausalLMOutputWithPast


def _make_plan(model: nn.Module, options: dict) -> _Plan:
    cls = type(model).__name__
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(
            f"logitless.patch expects a transformers *ForCausalLM model, got {cls} (for a PEFT model, patch "
            "model.get_base_model())"
        )
    backbone = _find_backbone(model)
    head = _find_head(model)
    src = heads.forward_source(model)
    if not heads.head_applied_directly(model, head, src):
        raise ValueError(
            f"logitless.patch: {cls}'s forward does not apply its output embedding directly to the backbone's "
            "hidden states, so the fused loss would not be the model's loss"
        )
    if src is not None and "loss_function" not in src and "shift_labels" not in src:
        raise ValueError(
            f"logitless.patch: {cls} computes its loss its own way, not with transformers' shifted causal-LM loss"
        )
    if getattr(model, "_loss_function", None) is not None:
        raise ValueError(f"logitless.patch: {cls} has a custom loss_function, which the fused loss would bypass")
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING
    except ImportError:  # transformers < 4.46: the loss was written inline (checked through the source above)
        LOSS_MAPPING = {}
    loss_type = getattr(model, "loss_type", None)
    if loss_type in LOSS_MAPPING and loss_type != "ForCausalLM":
        raise ValueError(f"logitless.patch: {cls} uses loss_type={loss_type!r}; only 'ForCausalLM' is supported")
    for reason, applies in _refusals(config, src):
        if applies:
            raise NotImplementedError(f"logitless.patch cannot reproduce {cls}'s loss: {reason}")
    try:
        transform_rules = heads.applied_rules(model, src)
    except heads.UnknownTransformError as e:
        raise NotImplementedError(f"logitless.patch cannot reproduce {cls}'s loss: {e}") from None

    signature = inspect.signature(model.forward)
    params = signature.parameters
    if "labels" not in params:
        raise ValueError(f"logitless.patch: {cls}.forward takes no `labels`, so it has no loss to fuse")
    varkw = next((p.name for p in params.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    keep_name = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
    bparams = inspect.signature(backbone.forward).parameters
    backbone_return_dict = "return_dict" in bparams or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in bparams.values()
    )
    return _Plan(
        prior_forward=vars(model).get("forward"),
        signature=signature,
        varkw=varkw,
        keep_name=keep_name,
        backbone_return_dict=backbone_return_dict,
        transform_rules=transform_rules,
        checks_router_logits=src is None or "output_router_logits" in src,
        output_cls=(cls := _output_class(model.forward)),
        output_fields=tuple(f.name for f in dataclasses.fields(cls) if f.name not in ("loss", "logits")),
        options=options,
    )


def _keep_positions(hidden: torch.Tensor, keep) -> torch.Tensor:
    """transformers' `logits_to_keep` slicing of (B, T, D) hidden states: int (last k; 0 keeps all), 1-D positions,
    2-D (B, K) positions, or a 2-D boolean (B, T) mask (flattened to (num_true, D))."""
    if isinstance(keep, torch.Tensor) and keep.dim() == 2:
        if keep.dtype == torch.bool:
            return hidden[keep]
        return torch.take_along_dim(hidden, keep[..., None], dim=1)
    if isinstance(keep, int):
        return hidden if keep == 0 else hidden[:, -keep:, :]
    return hidden[:, keep, :]


def _fused_forward(model: nn.Module, plan: _Plan, call: dict):
    if plan.varkw is not None:
        call.update(call.pop(plan.varkw, {}))
    labels = call.pop("labels")
    keep = call.pop(plan.keep_name, 0) if plan.keep_name else 0
    return_dict = call.pop("return_dict", None)
    # The loss's keywords; transformers also hands them to the backbone, which ignores them.
    num_items = call.pop("num_items_in_batch", None)
    shift_labels = call.pop("shift_labels", None)
    ignore_index = call.pop("ignore_index", plan.options["ignore_index"])
    config = model.config
    if plan.checks_router_logits and call.get("output_router_logits", getattr(config, "output_router_logits", False)):
        raise NotImplementedError(
            f"logitless: {type(model).__name__} was asked for output_router_logits=True, whose load-balancing loss "
            "the fused forward does not add; call it without, or unpatch the model"
        )

    sorter = plan.sorter
    backbone = _find_backbone(model)
    if plan.backbone_return_dict:
        call["return_dict"] = True
    head = _find_head(model)
    weight = head.weight
    emb = tied.tied_embedding(model, weight)  # None under torch.compile, which traces the plain call below
    head_grad = contextlib.nullcontext()
    if emb is None:
        out = backbone(**call)
    else:  # a head tied to the input embedding, on a CPU: the two gradients summed in place, part of the head's last
        with tied.tied_rows(emb, weight) as weight:
            out = backbone(**call)
        head_grad = tied.head_grad_later(weight)
    hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
    hidden = _keep_positions(hidden, keep)

    if shift_labels is None:
        # Position i predicts token i + 1; the last position predicts nothing.
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    target = shift_labels.to(hidden.device).reshape(-1)
    x = hidden.reshape(-1, hidden.shape[-1])
    if x.shape[0] != target.shape[0]:
        raise ValueError(
            f"logitless: the model keeps {x.shape[0]} positions (logits_to_keep={keep!r}) but the labels give "
            f"{target.shape[0]} targets; pass shift_labels with one target per kept position"
        )

    x, bias, softcap = heads.transform_of(config, plan.transform_rules).for_loss(x, head.bias)
    if sorter is not None:
        target = sorter.targets(x, target, ignore_index=ignore_index)

    lce = functools.partial(
        linear_cross_entropy, reduction="mean" if num_items is None else "sum", ignore_index=ignore_index,
        softcap=softcap, label_smoothing=plan.options["label_smoothing"], z_loss=plan.options["z_loss"],
        backend=plan.options["backend"], workspace_bytes=plan.options["workspace_bytes"],
        skip_threshold=plan.options["skip_threshold"],
    )
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        # What nn.Linear does under autocast: run the head in the autocast dtype. The loss math stays float32.
        dtype = torch.get_autocast_dtype(device_type)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
        with torch.autocast(device_type, enabled=False):
            loss = lce(x, weight, target, linear_bias=bias)
    else:
        with head_grad:
            loss = lce(x, weight, target, linear_bias=bias)
    if num_items is not None:
        if isinstance(num_items, torch.Tensor):
            num_items = num_items.to(loss.device)
        loss = loss / num_items

    # Field names worked out at patch time: dataclasses.fields() here would break a compiled graph.
    passed = {} if isinstance(out, tuple) else {name: getattr(out, name, None) for name in plan.output_fields}
    result = plan.output_cls(loss=loss, logits=None, **passed)
    if return_dict is None:
        return_dict = getattr(config, "return_dict", True)
    return result if return_dict else result.to_tuple()


def _patched_forward(model: nn.Module, plan: _Plan, *args, **kwargs):
    if model.training:
        call = dict(plan.signature.bind_partial(*args, **kwargs).arguments)
        if call.get("labels") is not None:
            return _fused_forward(model, plan, call)
    original = plan.prior_forward or functools.partial(type(model).forward, model)
    if plan.vocab_order is None:
        return original(*args, **kwargs)
    return _forward_in_order(original, plan, args, kwargs)


def _forward_in_order(original, plan: _Plan, args, kwargs):
    """The model's own forward with its head stored in plan.vocab_order: labels (and shift_labels) go in as
    positions, so its loss is the loss on class ids; logits come back in class order."""
    call = dict(plan.signature.bind_partial(*args, **kwargs).arguments)
    if plan.varkw is not None:
        call.update(call.pop(plan.varkw, {}))
    order = plan.vocab_order
    for name in ("labels", "shift_labels"):
        if isinstance(call.get(name), torch.Tensor):
            call[name] = order.map_ids(call[name])
    out = original(**call)
    if isinstance(out, tuple):
        i = 1 if call.get("labels") is not None else 0  # (loss, logits, ...) or (logits, ...)
        return out[:i] + (order.unsort(out[i], dim=-1),) + out[i + 1:]
    if getattr(out, "logits", None) is not None:
        out.logits = order.unsort(out.logits, dim=-1)
    return out


def _installed_plan(model: nn.Module) -> _Plan | None:
    fwd = vars(model).get("forward")
    if isinstance(fwd, functools.partial) and fwd.func is _patched_forward:
        return fwd.args[1]
    return None


def patch(
    model: nn.Module,
    *,
    z_loss: float = 0.0,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    backend: str = "auto",
    workspace_bytes: int | None = None,
    skip_threshold: float | str | None = "auto",
    vocab_order: VocabOrder | str | None = "learn",
) -> nn.Module:
    """Make this causal-LM instance compute its training loss with ``linear_cross_entropy``, never building logits.

    Only ``model`` changes: its ``forward`` attribute is replaced; its class, other instances and PyTorch's
    functions stay as they are. In training mode (``model.train()``) with ``labels``, the forward returns the
    model's usual output class with the loss of transformers' ``ForCausalLMLoss`` (label shift, ``shift_labels``,
    ``num_items_in_batch``, ``logits_to_keep``, the config's logit softcap or scale) and ``logits=None``; otherwise
    it calls the original forward. Patching a patched model replaces its options.

    Args:
        model: a transformers ``*ForCausalLM`` (or ``*LMHeadModel``) whose head is a plain ``nn.Linear``.
        z_loss: coefficient of ``logsumexp(z)**2`` added to each non-ignored token's loss (0 keeps the stock loss).
        label_smoothing: in [0, 1] (0 keeps the stock loss); use it instead of the Trainer's
            ``label_smoothing_factor``, which takes the labels away from the model.
        ignore_index: label value that is ignored, also used to pad the shifted labels; a forward call's own
            ``ignore_index=`` keyword wins, as in transformers.
        backend: "auto", "triton" or "torch", as in ``linear_cross_entropy``.
        workspace_bytes: memory the Triton backward may allocate, as in ``linear_cross_entropy`` (None: the
            memory policy's budget).
        skip_threshold: as in ``linear_cross_entropy`` (default "auto": skipping cold tiles of the backward where
            it pays; None: no skipping).
        vocab_order: the order the head's rows are stored in while patched, for the skipping backward
            (``skip_threshold``), which finds whole tiles cold when they are stored by softmax mass. "learn" (the
            default): the order is learned from the training forwards' hidden states and applied on a schedule
            (the first after the first training forward, then after forwards 16, 32, 64, ..., 1024 and every
            1024th); a :class:`logitless.VocabOrder`: that order, fixed; None or "none": class order, as the
            stock model. In either stored order the model stays the same function of class ids: input ids (tied
            embedding) and labels are mapped to positions inside, logits come back in class order, and
            ``state_dict()``/``load_state_dict()`` and every optimizer's ``state_dict()`` see class order; the
            optimizer's state is permuted with the rows whether it was built before or after ``patch``. Only
            ``model.lm_head.weight`` (and its ``.grad``) read directly show the stored order. ``logitless.SortedHead``
            does it, see there.

    Returns:
        ``model`` itself.

    Raises:
        TypeError / ValueError / NotImplementedError naming what about the model or an option is not supported.
    """
    _validate.check_options(label_smoothing=label_smoothing, z_loss=z_loss, ignore_index=ignore_index)
    check_workspace(workspace_bytes)
    _validate.check_skip_options(skip_threshold, "none", None, None)
    if isinstance(vocab_order, str):
        if vocab_order not in ("learn", "none"):
            raise ValueError(f"vocab_order must be 'learn', 'none', None or a logitless.VocabOrder, got "
                             f"{vocab_order!r}")
    elif vocab_order is not None and not isinstance(vocab_order, VocabOrder):
        raise TypeError(f"vocab_order must be 'learn', 'none', None or a logitless.VocabOrder, got "
                        f"{type(vocab_order).__name__}")
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"logitless.patch expects a torch.nn.Module, got {type(model).__name__}")
    if _installed_plan(model) is not None:
        unpatch(model)
    options = dict(z_loss=float(z_loss), label_smoothing=float(label_smoothing), ignore_index=ignore_index,
                   backend=backend, workspace_bytes=workspace_bytes, skip_threshold=skip_threshold)
    plan = _make_plan(model, options)
    if vocab_order is not None and vocab_order != "none":
        _store_in_order(model, plan, None if vocab_order == "learn" else vocab_order)
    # A partial rather than a closure or a bound method: copy.deepcopy (TRL's reference model, EMA copies) then gives
    # the copy a forward bound to the copy and its own plan.
    forward = functools.partial(_patched_forward, model, plan)
    # Same name, doc and signature as the original: the Trainer reads the signature (loss kwargs, dataset columns).
    for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
        setattr(forward, attr, getattr(type(model).forward, attr, None))
    forward.__signature__ = plan.signature
    model.forward = forward
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Undo :func:`patch` on this instance: its ``forward`` is the one it had before. Returns ``model``."""
    plan = _installed_plan(model)
    if plan is None:
        raise ValueError(
            f"logitless.unpatch: this {type(model).__name__} is not patched (or its forward was wrapped again after "
            "logitless.patch; undo that wrapper first)"
        )
    if plan.prior_forward is not None:
        model.forward = plan.prior_forward
    else:
        del model.forward
    if plan.sorter is not None:
        plan.sorter.restore()
    return model


def _store_in_order(model: nn.Module, plan: _Plan, order: VocabOrder | None) -> None:
    """Store the head in `order` (None: learned while training), with the hooks that keep the model the same
    function of class ids and its state_dict in class order."""
    head = _find_head(model)
    if order is not None and len(order) != head.weight.shape[0]:
        raise ValueError(f"logitless.patch: vocab_order has {len(order)} classes, the head {head.weight.shape[0]}")
    # The sample the sorter keeps is the loss's input: hidden states already scaled; the bias and the cap as the
    # loss applies them.
    transform = heads.transform_of(model.config, plan.transform_rules)
    plan.sorter = SortedHead(head.weight, head.bias, module=model, order=order, softcap=transform.softcap,
                             bias_scale=transform.logit_scale)
