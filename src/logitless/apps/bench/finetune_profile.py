"""Where a training step's time goes, for `tools/gpu_step_profile.py`: one variant's steps after its timed ones.

Three questions, each answered on the same trained state:

- Does the step synchronise with the device? One step under `torch.cuda.set_sync_debug_mode("warn")`: every
  synchronising call warns, and the first frames of the package or of transformers that made it are kept.
- Is it bound by the host or by the GPU? Steps timed both ways: the host's time to issue a step (no wait at its end)
  and the device's time between two events around it. A host-bound loop issues as slowly as the device runs.
- Which kernels and operators? `torch.profiler` over a few steps: per step the device's busy time (the union of the
  kernels' intervals), its idle time within the step, the largest kernels by device time and the largest operators
  by host time.
"""

from __future__ import annotations

import collections
import statistics
import time
import traceback
import warnings

import torch


def _sync_sites(step, ids) -> list[str]:
    """The package's and transformers' innermost frames of every synchronising call in one step."""
    sites = collections.Counter()

    def seen(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1]
                  if "logitless" in f.filename or "transformers" in f.filename]
        where = "; ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in frames[-3:])
        sites[f"{str(message)[:60]} at {where or f'{filename}:{lineno}'}"] += 1

    prior = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = seen
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(ids)
        finally:
            torch.cuda.set_sync_debug_mode(prior)
    torch.cuda.synchronize()
    return [f"{n} x {s}" for s, n in sites.most_common(12)]


def busy(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, -float("inf")
    for a, b in sorted(intervals):
        if a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def profile(step, batches, steps: int = 3) -> dict:
    """Run the questions of the module docstring on `step(ids)` over the next batches of `batches` (cycled)."""
    k = len(batches)
    out: dict = {}
    out["sync_sites"] = _sync_sites(step, batches[0])

    host, device = [], []
    for i in range(6):
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        t = time.perf_counter()
        step(batches[(i + 1) % k])
        host.append(1e3 * (time.perf_counter() - t))
        e1.record()
        torch.cuda.synchronize()
        device.append(e0.elapsed_time(e1))
    out["issue_ms"] = statistics.median(host)
    out["event_ms"] = statistics.median(device)

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for i in range(steps):
            step(batches[(i + 2) % k])
        torch.cuda.synchronize()
        wall = 1e3 * (time.perf_counter() - t) / steps
    kernels = collections.defaultdict(float)
    launches = collections.Counter()
    host_ops = collections.defaultdict(float)
    spans = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            if getattr(e, "is_user_annotation", False):  # a range around kernels (Optimizer.step...), not one
                continue
            kernels[e.name[:90]] += e.time_range.elapsed_us()
            launches[e.name[:90]] += 1
            spans.append((e.time_range.start, e.time_range.end))
        else:
            host_ops[e.name[:90]] += e.self_cpu_time_total
    busy_ms = busy(spans) / 1e3 / steps
    out["wall_ms"] = wall
    out["gpu_busy_ms"] = busy_ms
    out["gpu_idle_ms"] = wall - busy_ms
    # Every kernel, not only the largest: a step's difference between two variants is often many small ones.
    order = sorted(kernels.items(), key=lambda x: -x[1])
    out["kernels_ms"] = [(n, t / 1e3 / steps) for n, t in order]
    out["kernel_launches"] = [(n, launches[n] / steps) for n, _ in order]
    out["kernel_ms_total"] = sum(kernels.values()) / 1e3 / steps
    out["host_ops_ms"] = [(n, t / 1e3 / steps) for n, t in sorted(host_ops.items(), key=lambda x: -x[1])[:25]]
    return out
