"""Backend selection: one function picks "triton" or "torch" from the request, the device and the environment.

- ``backend="torch"`` always runs the chunked PyTorch path (torch_backend.py).
- ``backend="triton"`` runs the Triton kernels: on CUDA tensors, or on CPU tensors through the Triton interpreter
  when ``TRITON_INTERPRET=1`` is set (that is how the kernels are tested without a GPU).
- ``backend="auto"`` (the default) is replaced by ``$LOGITLESS_BACKEND`` when that is set, else picks Triton for
  CUDA tensors when Triton imports and the op has kernels, and PyTorch otherwise.

Beside it, what every layer may ask about where a call runs: the dtypes the kernels take (KERNEL_DTYPES,
check_kernel_dtype) and whether torch.compile is tracing (is_compiling).
"""

from __future__ import annotations

import functools
import os

import torch

BACKENDS = ("auto", "triton", "torch")
# The dtypes of the Triton kernels; float64 runs on the PyTorch path only (in float64 math).
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Ops that have Triton kernels: kernels/linear_head (the first three), kernels/two_heads (the two-head losses) and
# kernels/cross_entropy.
TRITON_OPS = frozenset({
    "linear_cross_entropy", "linear_log_probs", "linear_logsumexp",
    "linear_kl_div", "linear_jsd", "linear_soft_cross_entropy",
    "cross_entropy",
})


@functools.cache
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_backend(backend: str, device, op: str) -> str:
    """Return "triton" or "torch" for running `op` on tensors of `device`, or raise a clear error."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        env = os.environ.get("LOGITLESS_BACKEND", "").strip().lower()
        if env:
            if env not in BACKENDS:
                raise ValueError(f"LOGITLESS_BACKEND must be one of {BACKENDS}, got {env!r}")
            backend = env
    if backend == "torch":
        return "torch"
    on_cuda = getattr(device, "type", str(device)) == "cuda"
    if backend == "auto":
        if not on_cuda or not triton_importable():
            return "torch"
        return "triton" if op in TRITON_OPS else "torch"
    # backend == "triton"
    if not triton_importable():
        raise RuntimeError(f"{op}: backend='triton' was requested but Triton is not installed or does not import")
    if not on_cuda and not interpreter_enabled():
        raise RuntimeError(
            f"{op}: backend='triton' needs CUDA tensors (got {device}); on CPU set TRITON_INTERPRET=1 before "
            "importing triton to run the kernels through the Triton interpreter, or use backend='torch'"
        )
    if op not in TRITON_OPS:
        raise NotImplementedError(f"{op}: there is no Triton implementation of this op yet; use backend='torch'")
    return "triton"


def is_compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling())


def check_kernel_dtype(x: torch.Tensor, backend: str) -> bool:
    """True when the Triton kernels take this dtype; float64 raises for an explicit backend="triton" and falls back
    to the PyTorch path under "auto"."""
    if x.dtype in KERNEL_DTYPES:
        return True
    if backend == "triton":
        raise TypeError(f"backend='triton' takes float32, bfloat16 or float16 inputs, got {x.dtype}; "
                        "use backend='torch' for float64")
    return False
