"""The head of a Hugging Face ``transformers`` causal LM: its backbone, its output projection, its logit transform.

A causal LM computes ``logits = T(lm_head(backbone(...).last_hidden_state))`` where ``T`` is the identity for most
model families and, for a few, a constant scale, a final softcap, or a scale of the hidden states before the head.
logitless never calls ``lm_head``: it reads the projection's weight and bias and hands them, with ``T``, to a fused
op. This module is the one place that works out those three things, for ``logitless.patch`` (the training loss)
and for ``logitless score`` / ``logitless detect`` (per-token log-probabilities):

  - :func:`find_backbone`: the submodule whose first output is the final hidden states (``model.base_model``,
    else ``model.get_decoder()``);
  - :func:`find_output_embedding`: ``model.get_output_embeddings()``, a module with a 2-D ``weight`` (and
    ``bias``); :func:`check_plain_linear` adds the checks a caller that never runs the module needs;
  - :func:`find_transform`: the :class:`LogitTransform` of the model, from the table ``RULES`` keyed by
    ``config.model_type``. Each rule names the config attribute, what the forward does with it, and a pattern of
    the forward's source that says it does so; a rule applies when the attribute is set and the class's forward
    matches the pattern. A forward that visibly transforms its logits (or its final hidden states) and matches no
    rule of its type is refused (:class:`UnknownTransformError`), so that no loss or log-prob is computed for a
    head this module does not reproduce.

The table was read off the forwards of transformers 5.x; tests/test_hf.py checks every rule against the installed
transformers, and checks that every installed causal LM whose forward transforms its logits has rules.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import re
import textwrap
import tokenize

import torch
from torch import nn

# What a forward does with a config attribute. Logit scales apply to the head's output, bias included; the hidden
# scale applies to the hidden states before the head (the bias is not scaled); the softcap comes last.
LOGITS_TIMES = "logits *"
LOGITS_OVER = "logits /"
HIDDEN_OVER = "hidden /"
SOFTCAP = "softcap"


@dataclasses.dataclass(frozen=True)
class Rule:
    """One logit transform a model family's forward applies: ``op`` with the value of ``config.<attr>``.

    ``marker``: a regular expression found in the forward's source (comments and docstrings removed) when the
    forward applies it this way; None builds the usual one from ``op`` and ``attr``."""

    attr: str
    op: str
    marker: str | None = None

    def pattern(self) -> str:
        if self.marker is not None:
            return self.marker
        ref = rf"self\.(?:\w+\.)*?{self.attr}\b"  # self.config.X, self.model.X (FalconH1), self.X (Cohere)
        if self.op == LOGITS_TIMES:
            return rf"\*\s*{ref}"
        if self.op == LOGITS_OVER:
            return rf"logits\s*/\s*{ref}"
        if self.op == HIDDEN_OVER:
            return rf"hidden_states\s*=.*/\s*{ref}"
        return rf"\b{self.attr}\b"


_GEMMA_SOFTCAP = (Rule("final_logit_softcapping", SOFTCAP),)
_COHERE = (Rule("logit_scale", LOGITS_TIMES),)
_GRANITE = (Rule("logits_scaling", LOGITS_OVER),)

# config.model_type -> the transforms its causal-LM forward applies (read off each class's forward; types not
# listed apply none). The type is that of `model.config`, which names the class; the attributes are read from its
# text config (`config.get_text_config()`), where multimodal models keep them.
RULES: dict[str, tuple[Rule, ...]] = {
    # logits * scale
    "cohere": _COHERE, "cohere2": _COHERE, "cohere2_moe": _COHERE, "cohere_compass_text": _COHERE,
    "hyperclovax": (Rule("logits_scaling", LOGITS_TIMES),),  # MuP: multiplies where Granite divides
    "falcon_h1": (Rule("lm_head_multiplier", LOGITS_TIMES),),
    # logits / scale
    "granite": _GRANITE, "granite_swa": _GRANITE, "granitemoe": _GRANITE, "granitemoe_swa": _GRANITE,
    "granitemoehybrid": _GRANITE, "granitemoeshared": _GRANITE,
    # hidden states / scale, before the head
    "minicpm3": (Rule("logits_scaling", HIDDEN_OVER),),
    "inkling_text": (Rule("logits_mup_width_multiplier", HIDDEN_OVER),),
    # softcap * tanh(logits / softcap)
    **dict.fromkeys(("gemma2", "gemma3", "gemma3_text", "gemma3n", "gemma3n_text", "gemma4", "gemma4_text",
                     "gemma4_unified", "gemma4_unified_text", "vaultgemma", "nanochat", "beam"), _GEMMA_SOFTCAP),
    "recurrent_gemma": (Rule("logits_soft_cap", SOFTCAP),),
    "inkling2_text": (Rule("final_logit_softcapping", SOFTCAP, marker=r"self\.logit_softcap\("),),
    "inkling2_loop_text": (Rule("final_logit_softcapping", SOFTCAP, marker=r"self\.logit_softcap\("),),
}

# A line of a forward that assigns the logits or the hidden states something scaled, divided or capped: the sign of
# a transform this module would have to know. `*` and `/` count only as binary operators (not `*args`).
_TRANSFORM_LINE = re.compile(
    r"^\s*(?:\w*logits|hidden_states)\s*(?:[*/]=|=(?=.*(?:[\w)\]]\s*[*/](?![*/])|tanh|softcap)))"
)


class UnknownTransformError(NotImplementedError):
    """The model's forward transforms its logits in a way this module has no rule for."""


@dataclasses.dataclass(frozen=True)
class LogitTransform:
    """``logits = softcap(logit_scale * (W (hidden_scale * h) + b))``, ``softcap(z) = c * tanh(z / c)``."""

    hidden_scale: float = 1.0
    logit_scale: float = 1.0
    softcap: float | None = None

    def for_loss(self, x: torch.Tensor, bias: torch.Tensor | None):
        """(x, bias, softcap) such that ``softcap(x W^T + bias)`` are the model's logits.

        The scales fold into the hidden states and the bias, never the (N, V) logits: no vocabulary-sized
        temporary, and the same op serves every model."""
        x_scale = self.hidden_scale * self.logit_scale
        if x_scale != 1.0:
            x = x * x_scale
        if bias is not None and self.logit_scale != 1.0:
            bias = bias * self.logit_scale
        return x, bias, self.softcap

    def for_log_probs(self, x: torch.Tensor, bias: torch.Tensor | None):
        """(x, bias, softcap, temperature) such that ``softcap(x W^T + bias) / temperature`` are the model's logits.

        Without a softcap the logit scale is a temperature (applied in float32 to the float32 logits, so bf16
        hidden states are not rounded again); with one it scales before the cap and is folded as in for_loss."""
        if self.softcap is not None and self.logit_scale != 1.0:
            return (*self.for_loss(x, bias), 1.0)
        if self.hidden_scale != 1.0:
            x = x * self.hidden_scale
        return x, bias, self.softcap, 1.0 / self.logit_scale


def text_config(config):
    """The config holding the language model's attributes (the config itself for a text-only model)."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def forward_source(model: nn.Module) -> str | None:
    """The source of the model class's forward without comments and docstrings, or None when it cannot be read."""
    try:
        src = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return None
    return _code_only(src)


def _code_only(src: str) -> str:
    """Python source with its comments and string literals (docstrings included) blanked out, layout kept."""
    src = textwrap.dedent(src)
    lines = src.splitlines(keepends=True)
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(src).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return src
    for tok in tokens:
        if tok.type not in (tokenize.COMMENT, tokenize.STRING):
            continue
        (r0, c0), (r1, c1) = tok.start, tok.end
        for r in range(r0 - 1, r1):
            line = lines[r]
            a = c0 if r == r0 - 1 else 0
            b = c1 if r == r1 - 1 else len(line.rstrip("\r\n"))
            lines[r] = line[:a] + " " * (b - a) + line[b:]
    return "".join(lines)


def transform_lines(src: str) -> list[str]:
    """The lines of a forward's source (as forward_source gives it) that look like a logit transform."""
    return [line.strip() for line in src.splitlines() if _TRANSFORM_LINE.match(line)]


def applied_rules(model: nn.Module, src: str | None = None) -> tuple[Rule, ...]:
    """The rules of the model's type whose transform its forward applies (the attribute set, the source matching).

    Raises UnknownTransformError when the forward's source transforms the logits and no rule of the type matches
    it (a type without rules, or a forward that changed from what the rules describe)."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if src is None:
        src = forward_source(model)
    rules = RULES.get(model_type, ())
    lines = transform_lines(src) if src is not None else []
    matching = tuple(r for r in rules if src is None or re.search(r.pattern(), src) is not None)
    if lines and not matching:
        raise UnknownTransformError(
            f"{type(model).__name__} (model_type {model_type!r}) transforms its logits in its forward "
            f"({'; '.join(lines)}), which logitless has no rule for; only the transforms listed in "
            "logitless.integrations.heads.RULES are reproduced"
        )
    cfg = text_config(config)
    return tuple(r for r in matching if getattr(cfg, r.attr, None) is not None)


def transform_of(config, rules: tuple[Rule, ...]) -> LogitTransform:
    """The LogitTransform the given rules make of the config's current values."""
    cfg = text_config(config)
    hidden_scale = logit_scale = 1.0
    softcap = None
    for rule in rules:
        value = float(getattr(cfg, rule.attr))
        if rule.op == LOGITS_TIMES:
            logit_scale *= value
        elif rule.op == LOGITS_OVER:
            logit_scale /= value
        elif rule.op == HIDDEN_OVER:
            hidden_scale /= value
        elif value:  # a softcap of 0 (or unset) is no softcap
            softcap = value
    return LogitTransform(hidden_scale, logit_scale, softcap)


def find_transform(model: nn.Module, src: str | None = None) -> LogitTransform:
    """The transform the model's forward applies to ``lm_head``'s output (see the module docstring)."""
    return transform_of(model.config, applied_rules(model, src))


def find_backbone(model: nn.Module) -> nn.Module:
    """The submodule whose output's first element (``last_hidden_state``) is what the head is applied to."""
    base = getattr(model, "base_model", model)
    if base is model or not isinstance(base, nn.Module):
        get_decoder = getattr(model, "get_decoder", None)
        base = get_decoder() if callable(get_decoder) else None
    if not isinstance(base, nn.Module) or base is model:
        raise ValueError(
            f"cannot find the backbone of {type(model).__name__} (neither model.base_model nor "
            "model.get_decoder() gives a submodule that returns the final hidden states)"
        )
    return base


def find_output_embedding(model: nn.Module) -> nn.Module:
    """``model.get_output_embeddings()``, checked to hold a 2-D weight (V, D) and a bias of (V,) or None."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    name = type(model).__name__
    if head is None:
        raise ValueError(f"{name}.get_output_embeddings() gives no language-model head")
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise TypeError(f"the output embedding of {name} ({type(head).__name__}) is not a linear layer with a 2-D "
                        "weight")
    bias = getattr(head, "bias", None)
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],)):
        raise TypeError(f"the output embedding of {name} has a bias that is not a ({weight.shape[0]},) tensor")
    return head


def check_plain_linear(model: nn.Module, head: nn.Module) -> None:
    """Raise TypeError unless calling ``head`` computes exactly ``hidden @ weight.T + bias``.

    Needed wherever the weight is read and the module never called: a subclass's forward, a forward hook, an
    instance forward (adapters) or a sharded weight would otherwise be silently bypassed."""
    name = type(model).__name__
    if (not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward
            or "forward" in vars(head)):
        raise TypeError(
            f"the output embedding of {name} is a {type(head).__name__} whose forward is not torch.nn.Linear's; a "
            "quantised, adapter-wrapped (LoRA on lm_head) or hook-wrapped head computes something other than "
            "hidden @ weight.T + bias, which is all logitless can fuse"
        )
    if head._forward_hooks or head._forward_pre_hooks:
        raise TypeError(
            f"the output embedding of {name} has forward hooks; logitless reads its weight without calling it, so "
            "those hooks would not run"
        )
    if type(head.weight).__name__ == "DTensor":
        raise TypeError(
            f"the output embedding of {name} holds a DTensor (tensor-parallel or unsharded-FSDP2 head); use "
            "logitless.linear_cross_entropy with process_group= for a vocabulary-parallel head"
        )


def head_applied_directly(model: nn.Module, head: nn.Module, src: str | None) -> bool:
    """Whether the forward applies ``head`` to the hidden states themselves (not to another module's output)."""
    head_name = next((n for n, m in model.named_children() if m is head), None)
    if head_name is None:
        return False
    if src is None:
        return True
    return re.search(rf"self\.{head_name}\(\s*(?!self\.\w+\()", src) is not None


@dataclasses.dataclass(frozen=True)
class Head:
    """What a causal LM's head is made of: logits = transform applied to ``backbone(...)[0] @ weight.T + bias``."""

    backbone: nn.Module
    module: nn.Module
    weight: torch.Tensor
    bias: torch.Tensor | None
    transform: LogitTransform


def find_head(model: nn.Module) -> Head:
    """Backbone, output projection and logit transform of a transformers causal LM (read-only use: scoring)."""
    if getattr(model, "config", None) is None:
        raise TypeError(f"expected a transformers causal LM, got {type(model).__name__} (no config)")
    backbone = find_backbone(model)
    module = find_output_embedding(model)
    return Head(backbone, module, module.weight, getattr(module, "bias", None), find_transform(model))
