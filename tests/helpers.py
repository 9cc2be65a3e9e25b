"""Error rule shared by every test: ours must be no worse than 2x PyTorch's own same-dtype error against float64."""

from __future__ import annotations

import torch

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64; NaN anywhere in x (where ref is finite) counts as infinite error."""
    x64, r64 = x.detach().double().cpu(), ref.detach().double().cpu()
    if x64.shape != r64.shape:
        raise AssertionError(f"shape {tuple(x64.shape)} != reference shape {tuple(r64.shape)}")
    if torch.isnan(x64).any() and not torch.isnan(r64).any():
        return float("inf")
    both_nan = torch.isnan(x64) & torch.isnan(r64)
    diff = torch.where(both_nan, torch.zeros_like(x64), x64 - r64)
    denom = torch.where(torch.isnan(r64), torch.zeros_like(r64), r64).norm().item()
    return diff.norm().item() / max(denom, 1e-30)


def assert_within_rule(name: str, ours: torch.Tensor, torch_same_dtype: torch.Tensor, truth: torch.Tensor,
                       factor: float = 2.0, tiny: float = 1e-6) -> None:
    """err(ours) <= factor * err(PyTorch in the same dtype) + tiny, all against the float64 truth."""
    e_ours = rel_err(ours, truth)
    e_torch = rel_err(torch_same_dtype, truth)
    assert e_ours <= factor * e_torch + tiny, (
        f"{name}: our relative error {e_ours:.3e} exceeds {factor} x PyTorch's {e_torch:.3e} + {tiny:g}"
    )


def grads(out: torch.Tensor, inputs, upstream: torch.Tensor | None = None):
    """Gradients of sum(out * upstream) (or of out when it is a scalar) w.r.t. the tensors that require grad."""
    inputs = [t for t in inputs if t is not None and t.requires_grad]
    if upstream is None:
        upstream = torch.ones_like(out)
    return torch.autograd.grad(out, inputs, grad_outputs=upstream.to(out.dtype), allow_unused=False)
