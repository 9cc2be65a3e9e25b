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
tensor descriptors, and the rest (our planner, PyTorch ops, autograd).

    PYTHONPATH=src python3 tools/gpu_host.py [--shapes 4096,2048,32000;8192,896,151936] [--reps 20] [--cprofile]
        [--breakdown] [--data uniform|lm] [--skips auto,none] [--entropy]
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import pstats
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


def breakdown(fn, calls=2):
    """Host time of one call of fn split by where it is spent (wall clock, GPU kept busy far ahead)."""
    from triton.backends.nvidia.driver import CudaLauncher
    from triton.runtime.jit import JITFunction
    from triton.tools.tensor_descriptor import TensorDescriptor

    spent: dict[str, float] = {}
    counts: dict[str, int] = {}
    depth = [0]

    def timed(key_of, orig):
        def wrapper(*args, **kwargs):
            key = key_of(args)
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                depth[0] -= 1
                spent[key] = spent.get(key, 0.0) + dt
                counts[key] = counts.get(key, 0) + 1
        return wrapper

    import sys

    import logitless.kernels.linear_head as lh

    # Wrapped wherever a module of the package holds them (the backends import them by name).
    entries = {lh.backward: timed(lambda a: "linear_head.backward (all of it)", lh.backward),
               lh.forward_stats: timed(lambda a: "linear_head.forward_stats (all of it)", lh.forward_stats)}
    swapped = [(mod, name, val) for mod in list(sys.modules.values())
               if getattr(mod, "__name__", "").startswith("logitless")
               for name, val in list(vars(mod).items()) if callable(val) and val in entries]
    for mod, name, val in swapped:
        setattr(mod, name, entries[val])
    saved = (JITFunction.run, CudaLauncher.__call__, TensorDescriptor.__dict__["from_tensor"])
    JITFunction.run = timed(lambda a: f"jit {a[0].fn.__name__}", saved[0])
    CudaLauncher.__call__ = timed(lambda a: "launcher (inside jit)", saved[1])
    TensorDescriptor.from_tensor = staticmethod(timed(lambda a: "TensorDescriptor.from_tensor", saved[2].__func__))
    try:
        fn()
        torch.cuda.synchronize()
        spent.clear()
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
        TensorDescriptor.from_tensor = saved[2]
    jit = sum(v for k, v in spent.items() if k.startswith("jit "))
    inner = sum(v for k, v in spent.items() if k.startswith("linear_head."))
    rows = [("total", total, calls)] + sorted(((k, v, counts[k]) for k, v in spent.items()), key=lambda r: -r[1])
    desc = spent.get("TensorDescriptor.from_tensor", 0.0)
    rows.append(("launchers' own Python (planner, views, torch ops; inside linear_head, less jit and descriptors)",
                 inner - jit - desc, calls))
    rows.append(("outside linear_head (validation, torch.library op, autograd, loss ops)", total - inner, calls))
    print("| where | ms per call | calls per call | us per call of it |")
    print("| --- | ---: | ---: | ---: |")
    for k, v, c in rows:
        print(f"| {k} | {v * 1e3 / calls:.3f} | {c / calls:.0f} | {v * 1e6 / c:.1f} |")


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
    args = ap.parse_args()
    skips = tuple(s if s in ("auto", "none") else float(s) for s in args.skips.split(","))
    variants = functools.partial(calls, kind=args.data, skips=skips, entropy=args.entropy,
                                 data_file=args.data_file)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| shape | call | gpu ms | free ms | host ms | launches |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for spec in args.shapes.split(";"):
        N, D, V = (int(s) for s in spec.split(","))
        for name, fn in variants(N, D, V).items():
            gpu, free, host, launches = measure(fn, args.reps)
            print(f"| {N}, {D}, {V} | {name} | {gpu:.3f} | {free:.3f} | {host:.3f} | {launches} |", flush=True)
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
                s = io.StringIO()
                pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
                print(f"\n## cProfile, {N}, {D}, {V}, {name}, 5 calls\n" + s.getvalue())


if __name__ == "__main__":
    main()
