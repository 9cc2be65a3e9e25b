"""Correctness gate run before any provider is timed: the project's error rule on a slice of rows.

For the value and every gradient, with the float64 result of PyTorch's own ops as the truth:

    err(provider) <= 2 * err(PyTorch in the benchmark dtype) + 1e-6,   err(a) = ||a - truth|| / ||truth||

"PyTorch in the benchmark dtype" is the same composition of PyTorch ops (testing.naive_*) run on the inputs in
the benchmark dtype without upcasting. This is the rule of the test suite, restated here because the benchmark
must not import the tests. A provider that breaks it is reported as failing, with its errors, and is not timed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import testing
from .cases import Inputs

FACTOR = 2.0
TINY = 1e-6


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64; NaN anywhere in x (where ref is finite) counts as infinite error.

    Computed on the reference's device: a weight gradient at a real vocabulary is gigabytes in float64, and
    copying it to the host would cost seconds per comparison."""
    r64 = ref.detach().double()
    x64 = x.detach().to(device=r64.device, dtype=torch.float64)
    if x64.shape != r64.shape:
        raise ValueError(f"shape {tuple(x64.shape)} != reference shape {tuple(r64.shape)}")
    if torch.isnan(x64).any() and not torch.isnan(r64).any():
        return float("inf")
    both_nan = torch.isnan(x64) & torch.isnan(r64)
    diff = torch.where(both_nan, torch.zeros_like(x64), x64 - r64)
    denom = torch.where(torch.isnan(r64), torch.zeros_like(r64), r64).norm().item()
    return diff.norm().item() / max(denom, 1e-30)


@dataclass
class Comparison:
    name: str  # "loss", "logp", "d_input", ... with " (no grad)" for the no-grad call
    err: float  # the provider's relative error against float64
    err_torch: float  # PyTorch's own error in the benchmark dtype

    @property
    def ok(self) -> bool:
        return self.err <= FACTOR * self.err_torch + TINY

    def as_dict(self) -> dict:
        return {"name": self.name, "err": self.err, "err_torch": self.err_torch, "ok": self.ok}

    def __str__(self) -> str:
        return f"{self.name}: error {self.err:.3e} vs PyTorch's {self.err_torch:.3e}"


def rule_line(name: str, ours, theirs, truth, failures: list) -> str:
    """One "name err/err_torch" entry of the rule for the GPU scripts; a failing name is appended to `failures`."""
    c = Comparison(name, err=rel_err(ours, truth), err_torch=rel_err(theirs, truth))
    if not c.ok:
        failures.append(name)
    return f"{name} {c.err:.2e}/{c.err_torch:.2e}{'' if c.ok else ' FAIL'}"


def _naive(job: str, upcast: bool):
    if job == "train":
        return lambda x, w, t: testing.naive_linear_cross_entropy(x, w, t, upcast=upcast)
    if job == "logprobs":
        return lambda x, w, t: testing.naive_linear_log_probs(x, w, t, upcast=upcast)
    if job == "distill":
        from ...testing import naive_two_heads

        return lambda x, w, xt, wt, t: naive_two_heads(x, w, xt, wt, kind="jsd", beta=0.5, target=t, upcast=upcast)
    return lambda logits, t: testing.naive_cross_entropy(logits, t, upcast=upcast)


def evaluate(job: str, fn, inp: Inputs, *, grad: bool, cast=None):
    """Run `fn` on fresh leaves of `inp` (cast to `cast` if given). Returns (value, gradients, gradient names);
    the value is detached, the gradients are those of sum(value * upstream) (of the value when it is a scalar)."""
    srcs = (("logits", inp.logits),) if job == "ce" else (("input", inp.x), ("weight", inp.w))
    leaves = []
    for _, a in srcs:
        a = a.detach().to(cast) if cast is not None else a.detach().clone()
        leaves.append(a.requires_grad_(grad))
    teacher = tuple(a.detach().to(cast) if cast is not None else a for a in (inp.teacher or ()))
    with torch.set_grad_enabled(grad):
        out = fn(*leaves, *teacher, inp.t)
        if not grad:
            return out.detach(), [], []
        upstream = inp.upstream if out.dim() > 0 else None
        if upstream is not None:
            upstream = upstream.to(out.dtype)
        value = out.detach().clone()  # before backward: some providers reuse their buffers
        out.backward(upstream)
    names = [f"d_{n}" for n, _ in srcs]
    return value, [a.grad for a in leaves], names


class Reference:
    """Float64 truth on the check slice of one case, and PyTorch's same-dtype errors against it, computed once
    and shared by every provider."""

    def __init__(self, job: str, inp: Inputs, phases):
        self.job, self.inp = job, inp
        self.truth = {}  # phase -> (value, gradients, gradient names), float64
        self.err_torch = {}  # phase -> [error of the value, error of each gradient]
        for phase in phases:
            grad = phase == "fwd+bwd"
            tv, tg, names = evaluate(job, _naive(job, True), inp, grad=grad, cast=torch.float64)
            sv, sg, _ = evaluate(job, _naive(job, False), inp, grad=grad)
            self.truth[phase] = (tv, tg, names)
            self.err_torch[phase] = [rel_err(sv, tv)] + [rel_err(s, t) for s, t in zip(sg, tg, strict=True)]
            del sv, sg

    def truth_value(self, phase: str) -> float:
        """The mean float64 value (loss in nats, or mean log p) on the slice, for the data description."""
        return float(self.truth[phase][0].double().mean())

    def compare(self, fn) -> list[Comparison]:
        out = []
        value_name = "logp" if self.job == "logprobs" else "loss"
        for phase, (tv, tg, names) in self.truth.items():
            grad = phase == "fwd+bwd"
            value, grads, _ = evaluate(self.job, fn, self.inp, grad=grad)
            e_value, *e_grads = self.err_torch[phase]
            suffix = "" if grad else " (no grad)"
            out.append(Comparison(value_name + suffix, rel_err(value, tv), e_value))
            del value
            for name, g, t, e in zip(names, grads, tg, e_grads, strict=True):
                out.append(Comparison(name, float("inf") if g is None else rel_err(g, t), e))
            del grads
        return out
