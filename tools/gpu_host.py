"""Host-side cost of the public calls at small shapes, where the host, not the GPU, can be the bound.

For each shape and call (linear_cross_entropy fwd+bwd, linear_log_probs without grad):
  gpu    CUDA-event time per call with the host far ahead (a long sleep kernel queued first): the GPU's own time;
  free   CUDA-event time per call back to back with nothing queued: what a user sees when the host is the bound;
  host   wall-clock time to enqueue one call while the GPU is busy (one long sleep kernel queued first, and few
         enough calls that the driver's launch queue never fills): the host's own time;
  launches  kernels per call (torch profiler).
Then, on request, cProfile of the host side of a few calls (top functions by own time), and a breakdown of the host
time of one call without the profiler's overhead (--breakdown): Triton's JIT entry (argument binding, cache lookup)
and its launcher (tensor-descriptor packing and the driver call) timed per kernel by wrapping them, the host-made
tensor descriptors, and the package's functions (WRAPPED), each with its own time.

    PYTHONPATH=src python3 tools/gpu_host.py [--shapes 4096,2048,32000;8192,896,151936] [--reps 20] [--cprofile]
        [--breakdown] [--data uniform|lm] [--skips auto,none] [--entropy] [--tune fast_launch=0 --tune '' --rounds 3]
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import pstats
import statistics
import time

import torch

import logitless
from logitless.apps.bench import data


def _busy(ms: float):
    """Queue about `ms` of GPU work in one kernel, so the host runs ahead of the device without filling the
    launch queue (many short kernels would block the host once the queue is full)."""
    torch.cuda._sleep(int(ms * 1e-3 * _clock_hz()))


@functools.cache
def _clock_hz() -> float:
    """Cycles per second of torch.cuda._sleep, measured once."""
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(10_000_000)
    e0.record()
    torch.cuda._sleep(100_000_000)
    e1.record()
    torch.cuda.synchronize()
    return 100_000_000 / (e0.elapsed_time(e1) * 1e-3)


def calls(N, D, V, kind="uniform", skips=("auto",), entropy=False, data_file=None):
    head = data.make_head(kind, N, D, V, device="cuda", data_file=data_file)  # bf16
    x = head.input.detach().requires_grad_(True)
    w = head.weight.detach().requires_grad_(True)
    t = head.target.clone()
    t[::10] = -100  # every tenth token ignored

    def lce(skip):
        def call():
            x.grad = w.grad = None
            logitless.linear_cross_entropy(x, w, t, skip_threshold=skip).backward()
        return call

    def logp():
        with torch.no_grad():
            logitless.linear_log_probs(x, w, t, return_entropy=entropy)

    out = {f"lce fwd+bwd, skip {s}": lce(None if s == "none" else s) for s in skips}
    out["log-probs no-grad" + (", entropy" if entropy else "")] = logp
    return out


def measure(fn, reps):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    launches = sum(1 for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    # free: back to back, nothing queued
    e0.record()
    for _ in range(reps):
        fn()
    e1.record()
    torch.cuda.synchronize()
    free = e0.elapsed_time(e1) / reps
    # host: enqueue time with the GPU busy far ahead; gpu: event time of the same calls. At most ~400 launches are
    # queued behind the sleep: beyond the driver's queue depth (about a thousand) the host would wait for the GPU.
    n = max(1, min(reps, 400 // max(1, launches)))
    _busy(20.0 + 2.0 * n * free)
    s0 = time.perf_counter()
    e0.record()
    for _ in range(n):
        fn()
    e1.record()
    host = (time.perf_counter() - s0) * 1e3 / n
    torch.cuda.synchronize()
    gpu = e0.elapsed_time(e1) / n
    return gpu, free, host, launches


# Functions of the package timed one by one by --breakdown (own time: less the time of the timed calls inside),
# as MODULE:NAME or MODULE:CLASS.METHOD under logitless.
WRAPPED = (
    "head:linear_cross_entropy", "_validate:linear_head", "_validate:check_target", "skip_gate:observe",
    "triton_backend:stats", "triton_backend:fused_plan", "loss_math:ce_row_terms", "loss_math:ce_loss_from_stats",
    "loss_math:reduce_loss", "loss_math:head_coefficients",
    "kernels.linear_head.skip_plans:skip_plan", "kernels.linear_head.skip_plans:row_budget",
    "kernels.linear_head.skip_plans:_target_tiles", "kernels.linear_head.plan_kernels:hot_counts",
    "kernels.linear_head.plan_kernels:block_plan", "kernels.linear_head.launch:_Backward.__init__",
    "kernels.linear_head.launch:_Backward.run", "kernels.linear_head.launch:_Backward.dz_pass",
    "kernels.linear_head.launch:_Backward.grad_pass", "kernels.linear_head.plans:_plan",
    "kernels.linear_head.plans:_first_pass", "kernels.linear_head.plans:_workspace",
    "kernels.linear_head.configs:descriptor", "kernels._launch:launch",
)


def breakdown(fn, calls=2, wrapped=WRAPPED):
    """Host time of one call of fn split by where it is spent (wall clock, GPU kept busy far ahead): total and own
    time (less the timed calls inside) of Triton's JIT entry and launcher, the host-made descriptors, the two
    launchers and the package's functions in `wrapped`."""
    import importlib
    import sys

    from triton.backends.nvidia.driver import CudaLauncher
    from triton.runtime.jit import JITFunction
    from triton.tools.tensor_descriptor import TensorDescriptor

    spent: dict[str, float] = {}
    own: dict[str, float] = {}
    counts: dict[str, int] = {}
    inner = [0.0]  # time of timed calls inside the current one

    def timed(key_of, orig):
        def wrapper(*args, **kwargs):
            key = key_of(args)
            outer, inner[0] = inner[0], 0.0
            t0 = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                spent[key] = spent.get(key, 0.0) + dt
                own[key] = own.get(key, 0.0) + dt - inner[0]
                counts[key] = counts.get(key, 0) + 1
                inner[0] = outer + dt
        return wrapper

    import logitless.kernels.linear_head as lh

    targets = {lh.backward: "linear_head.backward", lh.forward_stats: "linear_head.forward_stats"}
    methods = []
    for spec in wrapped:
        mod_name, name = spec.split(":")
        obj = importlib.import_module("logitless." + mod_name)
        if "." in name:
            cls_name, meth = name.split(".")
            cls = getattr(obj, cls_name)
            methods.append((cls, meth, cls.__dict__[meth], spec))
        else:
            targets[getattr(obj, name)] = spec
    swapped = [(mod, name, val) for mod in list(sys.modules.values())
               if getattr(mod, "__name__", "").startswith("logitless")
               for name, val in list(vars(mod).items()) if callable(val) and val in targets]
    for mod, name, val in swapped:
        setattr(mod, name, timed(lambda a, k=targets[val]: k, val))
    for cls, meth, val, spec in methods:
        setattr(cls, meth, timed(lambda a, k=spec: k, val))
    saved = (JITFunction.run, CudaLauncher.__call__, TensorDescriptor.__dict__["from_tensor"])
    JITFunction.run = timed(lambda a: f"jit {a[0].fn.__name__}", saved[0])
    CudaLauncher.__call__ = timed(lambda a: "launcher (inside jit)", saved[1])
    TensorDescriptor.from_tensor = staticmethod(timed(lambda a: "TensorDescriptor.from_tensor", saved[2].__func__))
    try:
        fn()
        torch.cuda.synchronize()
        spent.clear()
        own.clear()
        counts.clear()
        _busy(100.0)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        total = time.perf_counter() - t0
        torch.cuda.synchronize()
    finally:
        JITFunction.run, CudaLauncher.__call__ = saved[0], saved[1]
        for mod, name, val in swapped:
            setattr(mod, name, val)
        for cls, meth, val, _ in methods:
            setattr(cls, meth, val)
        TensorDescriptor.from_tensor = saved[2]
    timed_own = sum(own.values())
    rows = sorted(((k, spent[k], own[k], counts[k]) for k in spent), key=lambda r: -r[2])
    rows.append(("not inside any timed call (the caller's ops, autograd, the custom ops' dispatch)",
                 total - timed_own, total - timed_own, calls))
    print(f"total {total * 1e3 / calls:.3f} ms per call")
    print("| where | ms per call | own ms per call | calls per call | own us per call of it |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for k, v, o, c in rows:
        print(f"| {k} | {v * 1e3 / calls:.3f} | {o * 1e3 / calls:.3f} | {c / calls:.0f} | {o * 1e6 / c:.1f} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4096,2048,32000;8192,896,151936;4096,4096,128256;16384,4096,128256")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--breakdown", action="store_true")
    ap.add_argument("--data", default="uniform", help="bench data kind of the head (uniform, lm, real, real-sorted)")
    ap.add_argument("--skips", default="auto", help="skip_threshold values of the fwd+bwd, comma-separated "
                    "(auto, none, or a float)")
    ap.add_argument("--entropy", action="store_true", help="the no-grad log-probs also return the entropy")
    ap.add_argument("--data-file", default=None, help="a prepared real head (--data real, real-sorted)")
    ap.add_argument("--tune", action="append", default=None,
                    help="Tuning fields (k=v,k=v) of one variant; repeat for an A/B, measured in --rounds rounds")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    from gpu_skip import tune_variants  # tools/, next to this file

    from logitless import kernels

    tunes = tune_variants(args.tune)
    skips = tuple(s if s in ("auto", "none") else float(s) for s in args.skips.split(","))
    variants = functools.partial(calls, kind=args.data, skips=skips, entropy=args.entropy,
                                 data_file=args.data_file)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| shape | call | tuning | gpu ms | free ms | host ms | launches |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    for spec in args.shapes.split(";"):
        N, D, V = (int(s) for s in spec.split(","))
        for name, fn in variants(N, D, V).items():
            seen = {}
            for _ in range(args.rounds):
                for tune in tunes:
                    with kernels.tuning(**tune):
                        gpu, free, host, launches = measure(fn, args.reps)
                    seen.setdefault(str(tune or "default"), []).append((gpu, free, host))
                    print(f"| {N}, {D}, {V} | {name} | {tune or 'default'} | {gpu:.3f} | {free:.3f} | {host:.3f} | "
                          f"{launches} |", flush=True)
            if args.rounds > 1:
                for tune, runs in seen.items():
                    med = [statistics.median(r[i] for r in runs) for i in range(3)]
                    print(f"| {N}, {D}, {V} | {name} | {tune}, median of {len(runs)} | {med[0]:.3f} | {med[1]:.3f} | "
                          f"{med[2]:.3f} | |", flush=True)
        if args.breakdown:
            for name, fn in variants(N, D, V).items():
                print(f"\n## host time by place, {N}, {D}, {V}, {name}\n")
                breakdown(fn)
        if args.cprofile:
            for name, fn in variants(N, D, V).items():
                fn()
                torch.cuda.synchronize()
                _busy(200.0)
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(5):
                    fn()
                pr.disable()
                torch.cuda.synchronize()
                for order, top in (("tottime", 30), ("cumulative", 60)):
                    s = io.StringIO()
                    pstats.Stats(pr, stream=s).sort_stats(order).print_stats(top)
                    print(f"\n## cProfile by {order}, {N}, {D}, {V}, {name}, 5 calls\n" + s.getvalue())


if __name__ == "__main__":
    main()
