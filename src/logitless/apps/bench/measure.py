"""Time and peak memory of one phase of one provider.

Time: on a GPU, CUDA events recorded around the forward and the backward of every repetition, with no host
synchronisation between repetitions (the queue stays full; a provider's own host syncs count against it); the
median of each is reported. On a CPU, the wall clock (time.perf_counter) around the same calls. Before each
repetition, outside the timed region, the gradients of the previous one are dropped and (ce) the logits restored.

Peak memory above inputs and outputs: the inputs are allocated before the measurement starts; the outputs (the
returned value and the gradients, unless they overwrite an input in place) are alive at its end and subtracted.
  GPU: torch.cuda.max_memory_allocated() after torch.cuda.reset_peak_memory_stats(), minus the allocation at the
       start. This counts every tensor of the caching allocator (workspaces that stay cached across calls are
       allocated during the warm-up and so belong to the baseline).
  CPU: PyTorch's profiler with profile_memory=True records every allocation and free of the CPU allocator in
       order; the running sum of those events gives the live bytes, and its maximum the peak. Memory that does not
       go through PyTorch's allocator (library scratch buffers, Python objects) is not seen.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from .providers import Step


@dataclass
class Timing:
    total_ms: float
    fwd_ms: float
    bwd_ms: float  # NaN for a phase without backward
    reps: int


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# The first runs of a provider may compile (Triton kernels for new shapes, torch.compile graphs): each of the first
# COMPILING_RUNS may take up to FIRST_RUN_ALLOWANCE times --max-iter-seconds, and one that takes longer than the limit
# is followed by another. Two, because the default call compiles twice: its first call runs the dense plans, and
# its second probes whether skipping pays for the head (skip_gate), which compiles the skipping kernels; hence the
# default of three warm-up runs (--warmup), the third sizing the timed runs.
FIRST_RUN_ALLOWANCE = 10.0
COMPILING_RUNS = 2


def warm_up(step: Step, prepare, device: torch.device, runs: int, max_iter_s: float) -> float:
    """Untimed runs (at least one) before anything is measured; returns the wall time of the last one, in
    seconds. Raises TooSlow as soon as a run after the first COMPILING_RUNS exceeds max_iter_s, or one of them
    exceeds FIRST_RUN_ALLOWANCE x max_iter_s; one of them over the limit is always followed by another."""
    est = math.nan
    n, i = max(1, runs), 0
    while i < n:
        prepare()
        _sync(device)
        t0 = time.perf_counter()
        _run(step)
        _sync(device)
        est = time.perf_counter() - t0
        compiling = i < COMPILING_RUNS
        limit = max_iter_s * (FIRST_RUN_ALLOWANCE if compiling else 1.0)
        if est > limit:
            what = f"run {i + 1} (compilation included)" if compiling else "one run"
            raise TooSlow(f"{what} took {est:.1f} s (limit {limit:g} s, --max-iter-seconds {max_iter_s:g})")
        if compiling and est > max_iter_s:
            n = max(n, i + 2)
        i += 1
    return est


def time_step(step: Step, prepare, device: torch.device, *, est_s: float, budget_s: float, min_reps: int,
              max_reps: int) -> Timing:
    """Median times of `step` over about budget_s seconds of repetitions (est_s: the time of one run)."""
    reps = int(min(max_reps, max(min_reps, math.ceil(budget_s / max(est_s, 1e-6)))))
    fwd, bwd = [], []
    if device.type == "cuda":
        events = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(reps)]
        for e0, e1, e2 in events:
            prepare()
            e0.record()
            out = step.fwd()
            e1.record()
            if step.bwd is not None:
                step.bwd(out)
            e2.record()
            del out
        torch.cuda.synchronize(device)
        for e0, e1, e2 in events:
            fwd.append(e0.elapsed_time(e1))
            bwd.append(e1.elapsed_time(e2))
    else:
        for _ in range(reps):
            prepare()
            t0 = time.perf_counter()
            out = step.fwd()
            t1 = time.perf_counter()
            if step.bwd is not None:
                step.bwd(out)
            t2 = time.perf_counter()
            del out
            fwd.append(1e3 * (t1 - t0))
            bwd.append(1e3 * (t2 - t1))
    total = [f + b for f, b in zip(fwd, bwd, strict=True)]
    has_bwd = step.bwd is not None
    return Timing(statistics.median(total), statistics.median(fwd),
                  statistics.median(bwd) if has_bwd else math.nan, reps)


class TooSlow(Exception):
    pass


# Building blocks for ad-hoc GPU scripts (tools/gpu_*.py), which time single calls rather than Steps.


def event_ms(fn):
    """(milliseconds between CUDA events recorded around fn(), fn's result), after a device synchronisation."""
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    out = fn()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1), out


def peak_extra_mib(fn, inputs=()) -> float:
    """Peak CUDA allocation during fn() above the allocation before it, minus what fn returns (a tensor or a tuple /
    list of them; storage shared with `inputs` is not an output), in MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    outs = out if isinstance(out, (tuple, list)) else (out,)
    result = (peak - output_bytes(outs, inputs)) / 2**20
    del out, outs
    return result


def _run(step: Step):
    out = step.fwd()
    extra = step.bwd(out) if step.bwd is not None else []
    return out, extra


def _storage_key(t: torch.Tensor):
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 - tensors without storage (compiled wrappers, sparse) are skipped
        return None


def output_bytes(outputs, inputs) -> int:
    """Bytes held by `outputs` that are not storage of `inputs` (gradients written in place are no output)."""
    seen = {_storage_key(t) for t in inputs}
    total = 0
    for t in outputs:
        if not isinstance(t, torch.Tensor):
            continue
        key = _storage_key(t)
        if key is None or key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def peak_extra_bytes(step: Step, prepare, device: torch.device, inputs, leaves) -> int:
    """Peak bytes allocated during one run of `step`, above what existed before it and what it returns."""
    prepare()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        out, extra = _run(step)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        peak, (out, extra) = _cpu_peak(lambda: _run(step))
    outs = [out, *extra, *(leaf.grad for leaf in leaves if leaf.grad is not None)]
    result = peak - output_bytes(outs, inputs)
    del out, extra, outs
    return max(result, 0)


@contextlib.contextmanager
def _quiet_profiler_log():
    """The profiler's C++ side prints start/stop lines on file descriptor 2; keep every other line."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [ln for ln in tmp.read().decode(errors="replace").splitlines(keepends=True)
                    if not ln.startswith("USDT:")]
            if kept:
                sys.stderr.write("".join(kept))


def _cpu_peak(fn):
    from torch.profiler import ProfilerActivity, profile

    with _quiet_profiler_log(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and str(e.device_type()).endswith("CPU")]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak, result
