"""The implementations the benchmark compares, each one wrapped to the same calling convention.

Per job a provider supplies a function:
  train     fn(input, linear_weight, target) -> mean loss (scalar)
  logprobs  fn(input, linear_weight, target) -> log p(target) per token, (N,)
  ce        fn(logits, target) -> mean loss (scalar)
  distill   fn(input, linear_weight, teacher_input, teacher_weight, target) -> mean JSD (beta 0.5; scalar)
The runner makes the inputs leaves that require grad for the "fwd+bwd" phase and calls ``backward`` itself. The
dense floor is the exception: it is no loss, only the matrix products (or the copy) that a dense implementation
of the job must at least pay for, and it is neither checked nor differentiated.

Peers are optional: a provider whose package does not import, or that cannot run on the device, is listed as
unavailable with the reason and skipped. ``REGISTRY`` is the list the command draws from (tests add to it).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .cases import JOB_OP, Inputs
from .peers import EAGER, cce, compile_eager, liger, liger_jsd, torch_lce, torch_lce_unavailable


@dataclass
class Step:
    """One run of a phase: fwd() returns the output; bwd(out) runs the backward and returns extra outputs."""

    fwd: Callable[[], object]
    bwd: Callable[[object], list] | None


@dataclass
class Provider:
    name: str
    description: str
    jobs: dict[str, Callable[[], Callable]]  # job -> builder of the job's function (called once per run)
    unavailable: Callable[[str, torch.device], str | None] = lambda job, device: None  # reason, or None
    kind: str = "loss"  # "loss", or "floor" (not checked, not a loss)
    cpu_default: bool = True  # part of the default provider set on a CPU
    gpu_default: bool = True  # part of the default provider set on a GPU (variants are opt-in)
    version: Callable[[], str] = lambda: ""
    # Whether this job's gradients are computed in its forward at these inputs (grad mode on, leaves requiring
    # grad), so that the fwd+bwd phase's "bwd" is only their hand-over: the report marks such a split.
    grads_in_forward: Callable[[str, Inputs], bool] = lambda job, inp: False
    _built: dict = field(default_factory=dict, repr=False)

    def fn(self, job: str) -> Callable:
        if job not in self._built:
            self._built[job] = self.jobs[job]()
        return self._built[job]

    def step(self, job: str, inp: Inputs, grad: bool) -> Step:
        """A Step over the case's inputs, which the runner has already made leaves (requires_grad == grad)."""
        if self.kind == "floor":
            return _floor_step(job, inp, grad)
        fn = self.fn(job)
        args = (inp.logits, inp.t) if job == "ce" else (inp.x, inp.w, *(inp.teacher or ()), inp.t)
        upstream = inp.upstream if job == "logprobs" else None
        if not grad:
            return Step(lambda: fn(*args), None)

        def bwd(out):
            out.backward(upstream)
            return []

        return Step(lambda: fn(*args), bwd)


def _floor_step(job: str, inp: Inputs, grad: bool) -> Step:
    if job == "ce":
        # Read the logits once and write as many bytes once: what a fused in-place forward+backward must do.
        return Step(lambda: inp.logits.detach().clone(), None)
    x, w = inp.x.detach(), inp.w.detach()
    fwd = lambda: x @ w.T  # the logits: [N, V]
    if job == "distill":  # both heads' logits; the gradient products of the student's
        xt, wt = inp.teacher
        fwd = lambda: (x @ w.T, xt @ wt.T)[0]
    if not grad:
        return Step(fwd, None)
    return Step(fwd, lambda z: [z @ w, z.T @ x])  # d_input [N, D] and d_weight [V, D] from a [N, V] gradient


def _dist_version(name: str) -> Callable[[], str]:
    def get():
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return ""
    return get


def _needs_module(module: str, install: str) -> Callable[[str, torch.device], str | None]:
    def reason(job, device):
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - any import failure means "not available", with the reason
            return f"{install} is not importable ({type(e).__name__}: {e})"[:200]
        return None
    return reason


def _triton_device(reason_if_import: Callable) -> Callable[[str, torch.device], str | None]:
    """Triton-only peers: CUDA, or a CPU with the Triton interpreter enabled (slow; for testing)."""
    def reason(job, device):
        r = reason_if_import(job, device)
        if r:
            return r
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            return "Triton kernels need a CUDA device (or TRITON_INTERPRET=1 on a CPU)"
        return None
    return reason


# ---------------------------------------------------------------------------------------------------------------
# logitless


def _logitless(backend: str) -> Provider:
    import logitless

    def unavailable(job, device):
        from ..._dispatch import resolve_backend

        try:
            got = resolve_backend(backend, device, JOB_OP[job])
        except Exception as e:  # noqa: BLE001 - the dispatcher's message says why the backend cannot run
            return str(e)
        return None if got == backend else f"backend {backend!r} resolves to {got!r} here"

    def ce():
        kw = {"backend": backend}
        if "inplace_backward" in inspect.signature(logitless.cross_entropy).parameters:
            kw["inplace_backward"] = True  # the gradient overwrites the logits, as Liger's does
        return lambda logits, t: logitless.cross_entropy(logits, t, **kw)

    return Provider(
        name=f"logitless-{backend}",
        description=f"logitless, backend={backend!r}" + (" (chunked PyTorch path)" if backend == "torch" else ""),
        jobs={
            "train": lambda: lambda x, w, t: logitless.linear_cross_entropy(x, w, t, backend=backend),
            "logprobs": lambda: lambda x, w, t: logitless.linear_log_probs(x, w, t, backend=backend),
            "ce": ce,
            "distill": lambda: lambda x, w, xt, wt, t: logitless.linear_jsd(x, w, xt, wt, target=t, backend=backend),
        },
        unavailable=unavailable,
        cpu_default=backend == "torch",
        version=lambda: logitless.__version__,
        grads_in_forward=_fused if backend == "torch" else (lambda job, inp: False),
    )


def _fused(job: str, inp: Inputs) -> bool:
    """linear_cross_entropy's PyTorch path takes its fused training path here (torch_backend.fused_rows): the
    gradients are computed in the forward, chunk by chunk, and the backward only scales them."""
    from ... import torch_backend

    return job == "train" and torch_backend.fused_rows(inp.x, inp.w, None, None, "mean") > 0


# The backward's memory-for-speed setting: the float32 dx accumulator in a buffer of its own (4 N D bytes) and a
# 256 MiB scratch (workspace_bytes; docs/design/backward.md).
WORKSPACE_EXTRA = 256 << 20


def _logitless_workspace() -> Provider:
    import logitless

    base = _logitless("triton")

    def train():
        def fn(x, w, t):
            budget = 4 * x.shape[0] * x.shape[1] + WORKSPACE_EXTRA
            return logitless.linear_cross_entropy(x, w, t, backend="triton", workspace_bytes=budget)
        return fn

    return Provider(
        name="logitless-triton-ws",
        description="logitless, backend='triton', workspace_bytes=4 N D + 256 MiB (fwd+bwd only)",
        jobs={"train": train}, unavailable=base.unavailable, cpu_default=False, version=base.version,
    )


def _logitless_dense() -> Provider:
    import logitless

    base = _logitless("triton")

    def train():
        return lambda x, w, t: logitless.linear_cross_entropy(x, w, t, backend="triton", skip_threshold=None)

    def logprobs():
        return lambda x, w, t: logitless.linear_log_probs(x, w, t, backend="triton", skip_threshold=None)

    return Provider(
        name="logitless-triton-dense",
        description="logitless, backend='triton', skip_threshold=None (no skipping: the dense plans only)",
        jobs={"train": train, "logprobs": logprobs}, unavailable=base.unavailable, cpu_default=False,
        version=base.version,
    )


def _logitless_lean() -> Provider:
    import logitless

    base = _logitless("triton")

    def train():
        return lambda x, w, t: logitless.linear_cross_entropy(x, w, t, backend="triton", skip_threshold=None,
                                                             workspace_bytes=0)

    return Provider(
        name="logitless-triton-lean",
        description="logitless, backend='triton', workspace_bytes=0, skip_threshold=None (the lean plan: its "
                    "bound is in docs/design/backward.md)",
        jobs={"train": train}, unavailable=base.unavailable, cpu_default=False, gpu_default=False,
        version=base.version,
    )


def _logitless_always_skip() -> Provider:
    import logitless
    from logitless import kernels

    base = _logitless("triton")

    def always(fn):
        def call(x, w, t):
            with kernels.tuning(skip_min_share=0.0):  # the forward decides: the backward follows it
                return fn(x, w, t, backend="triton")
        return call

    return Provider(
        name="logitless-triton-skip",
        description="logitless, backend='triton', skipping on every call (the default's budget with "
                    "Tuning.skip_min_share=0: the skipping plan however little it skips)",
        jobs={"train": lambda: always(logitless.linear_cross_entropy),
              "logprobs": lambda: always(logitless.linear_log_probs)},
        unavailable=base.unavailable, cpu_default=False, gpu_default=False, version=base.version,
    )


def _logitless_wide_budget() -> Provider:
    import logitless
    from logitless import kernels

    base = _logitless("triton")

    def twice(fn):
        def call(x, w, t):
            with kernels.tuning(skip_budget_scale=2.0, skip_min_share=0.0):
                return fn(x, w, t, backend="triton")
        return call

    return Provider(
        name="logitless-triton-skip2",
        description="logitless, backend='triton', skipping on every call with twice the default's per-row budget "
                    "(Tuning.skip_budget_scale=2: half of each gradient row's rounding error instead of a quarter), "
                    "to weigh a larger budget's errors against its time",
        jobs={"train": lambda: twice(logitless.linear_cross_entropy)},
        unavailable=base.unavailable, cpu_default=False, gpu_default=False, version=base.version,
    )


# ---------------------------------------------------------------------------------------------------------------


def _registry() -> list[Provider]:
    liger_import = _needs_module("liger_kernel.transformers", "liger-kernel")
    cce_import = _needs_module("cut_cross_entropy", "cut-cross-entropy")
    return [
        _logitless("triton"),
        _logitless_workspace(),
        _logitless_dense(),
        _logitless_always_skip(),
        _logitless_wide_budget(),
        _logitless_lean(),
        _logitless("torch"),
        Provider("torch-eager", "PyTorch eager: F.linear, then F.cross_entropy / log_softmax in float32",
                 {job: functools.partial(lambda j: EAGER[j], job) for job in EAGER},
                 version=lambda: torch.__version__),
        Provider("torch-compile", "torch.compile of the eager composition (token count dynamic, D and V static)",
                 {job: functools.partial(compile_eager, job) for job in EAGER},
                 cpu_default=False, version=lambda: torch.__version__),
        Provider("torch-lce", "torch.nn.functional.linear_cross_entropy, chunked (LinearCrossEntropyOptions())",
                 {job: functools.partial(torch_lce, job) for job in ("train", "logprobs")},
                 unavailable=torch_lce_unavailable, cpu_default=False, version=lambda: torch.__version__),
        Provider("liger", "Liger-Kernel: LigerFusedLinearCrossEntropyLoss (train), LigerCrossEntropyLoss (ce)",
                 {job: functools.partial(liger, job) for job in ("train", "ce")},
                 unavailable=_triton_device(liger_import), cpu_default=False,
                 version=_dist_version("liger-kernel")),
        Provider("liger-c8", "Liger-Kernel's fused linear cross-entropy with chunk_mem_const=8 (its documented "
                 "chunk-size setting: 8 x larger row chunks than its default)",
                 {"train": functools.partial(liger, "train", chunk_mem_const=8)},
                 unavailable=_triton_device(liger_import), cpu_default=False, gpu_default=False,
                 version=_dist_version("liger-kernel")),
        Provider("liger-jsd", "Liger-Kernel: LigerFusedLinearJSD(jsd_beta=0.5) (distill)",
                 {"distill": functools.partial(liger_jsd, "distill")},
                 unavailable=_triton_device(liger_import), cpu_default=False,
                 version=_dist_version("liger-kernel")),
        Provider("liger-fp32", "Liger-Kernel's fused linear cross-entropy with accum_dtype=float32 (opt-in)",
                 {"train": functools.partial(liger, "train", torch.float32)},
                 unavailable=_triton_device(liger_import), cpu_default=False, gpu_default=False,
                 version=_dist_version("liger-kernel")),
        Provider("cce", "Cut Cross-Entropy, impl='cce' (default gradient filtering)",
                 {job: functools.partial(cce, "cce", job) for job in ("train", "logprobs")},
                 unavailable=_triton_device(cce_import), cpu_default=False,
                 version=_dist_version("cut-cross-entropy")),
        Provider("cce-nofilter", "Cut Cross-Entropy, impl='cce', filter_eps=None: no gradient filtering (opt-in)",
                 {job: functools.partial(cce, "cce", job, filter_eps=None) for job in ("train", "logprobs")},
                 unavailable=_triton_device(cce_import), cpu_default=False, gpu_default=False,
                 version=_dist_version("cut-cross-entropy")),
        Provider("cce-compile", "Cut Cross-Entropy, impl='torch_compile'",
                 {job: functools.partial(cce, "torch_compile", job) for job in ("train", "logprobs")},
                 unavailable=cce_import, cpu_default=False,
                 version=_dist_version("cut-cross-entropy")),
        Provider("floor", "dense floor: the matrix products alone (x W^T; then dz W, dz^T x); ce: a copy of the "
                 "logits",
                 {job: (lambda: None) for job in ("train", "logprobs", "ce", "distill")}, kind="floor",
                 version=lambda: torch.__version__),
    ]


REGISTRY: list[Provider] = _registry()


def by_name() -> dict[str, Provider]:
    return {p.name: p for p in REGISTRY}
