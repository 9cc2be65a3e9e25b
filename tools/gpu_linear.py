"""Linear head kernels on a CUDA device: correctness against float64 and timing next to cuBLAS.

    PYTHONPATH=src python tools/gpu_linear.py [--shapes gemma2-2b,llama3-8b,mistral-nemo,qwen3-small]
        [--kinds lm,uniform] [--reps 10] [--check-rows 1024] [--variants] [--extra] [--json FILE]

For each shape (N, D, V) and data kind (logitless.apps.bench.data: "lm" = peaked softmax, Zipf targets, ~2.5 nats;
"uniform" = the head at initialisation), in bfloat16:
- check: on the first --check-rows tokens (full D and V), the loss and d_input / d_weight of
  linear_cross_entropy (mean, 10% ignored tokens) and log-probs + entropy (temperature 0.9, random upstream) of
  linear_log_probs against float64, under the precision rule (ours <= 2 x PyTorch-in-bf16 error + 1e-6); on the full
  shape, the loss (and for "lm" the gradients) against the chunked float32 PyTorch path;
- time (CUDA events, median of --reps after 2 warm-ups): the forward (loss, no grad), forward + backward
  (autograd.grad of the mean loss w.r.t. input and weight), no-grad log-probs; the dense floor = the three cuBLAS
  products x @ W.T, dz @ W, dz.T @ x (dz a pre-made N x V bf16 tensor) and one product x @ W.T;
- peak extra memory: torch.cuda.max_memory_allocated() during the call above what was allocated before (inputs),
  minus the returned outputs (the gradients for forward + backward).
--variants times other tile configurations at the shapes (uniform data; --variants-only: nothing else);
--extra runs the int64-offset shapes
(N*D > 2^31, V*D > 2^31) and the run-to-run bitwise determinism check.

Skipping cold tiles in the backward has its own tool: tools/gpu_skip.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback

import torch
import triton

import logitless
from logitless import testing
from logitless.apps.bench import data
from logitless.apps.bench.cases import GPU_DEFAULT_PRESETS, PRESETS
from logitless.apps.bench.check import rel_err as rel
from logitless.apps.bench.check import rule_line as rule
from logitless.apps.bench.measure import event_ms, peak_extra_mib
from logitless.kernels import current_tuning, tuning
from logitless.kernels import linear_head as lh

SHAPES = {name: PRESETS[name] for name in GPU_DEFAULT_PRESETS["train"]}  # the four heads


def median_ms(fn, reps, warmup=2):
    for _ in range(warmup):
        out = fn()
        del out
    if not torch.cuda.is_available():  # --dry-run on the CPU interpreter: host clock
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) * 1e3 / reps
    return statistics.median(event_ms(fn)[0] for _ in range(reps))


def peak_extra_mb(fn):
    """Peak allocation above the current one during fn(), minus what fn returns (tensors or tuples of them)."""
    return peak_extra_mib(fn) if torch.cuda.is_available() else float("nan")


def leaf(t):
    return t.detach().clone().requires_grad_(True)


def check_slice(head, rows, tag):
    """precision rule on the first `rows` tokens: loss, d_input, d_weight; log-probs, entropy and their grads."""
    failures = []
    x, w, t = head.input[:rows], head.weight, head.target[:rows].clone()
    t[::10] = -100
    parts = []
    res = {}
    for name in ("ours", "bf16", "f64"):
        xl, wl = leaf(x if name != "f64" else x.double()), leaf(w if name != "f64" else w.double())
        if name == "ours":
            loss = logitless.linear_cross_entropy(xl, wl, t, backend="triton")
        else:
            loss = testing.naive_linear_cross_entropy(xl, wl, t, upcast=name == "f64")
        res[name] = (loss.detach(),) + tuple(torch.autograd.grad(loss, (xl, wl)))
        del xl, wl, loss
    for i, q in enumerate(("loss", "d_input", "d_weight")):
        parts.append(rule(q, res["ours"][i], res["bf16"][i], res["f64"][i], failures))
    del res
    g = torch.Generator(device=x.device).manual_seed(1)
    up1 = torch.randn(rows, device=x.device, generator=g, dtype=torch.float64)
    up2 = torch.randn(rows, device=x.device, generator=g, dtype=torch.float64)
    res = {}
    for name in ("ours", "bf16", "f64"):
        xl, wl = leaf(x if name != "f64" else x.double()), leaf(w if name != "f64" else w.double())
        if name == "ours":
            lp, en = logitless.linear_log_probs(xl, wl, t, temperature=0.9, return_entropy=True, backend="triton")
        else:
            lp, en = testing.naive_linear_log_probs(xl, wl, t, temperature=0.9, return_entropy=True,
                                                      upcast=name == "f64")
        obj = (lp * up1.to(lp.dtype)).sum() + (en * up2.to(en.dtype)).sum()
        res[name] = (lp.detach(), en.detach()) + tuple(torch.autograd.grad(obj, (xl, wl)))
        del xl, wl, lp, en, obj
    for i, q in enumerate(("logp", "entropy", "lp_d_input", "lp_d_weight")):
        parts.append(rule(q, res["ours"][i], res["bf16"][i], res["f64"][i], failures))
    print(f"  check {tag} rows={rows}: " + "; ".join(parts), flush=True)
    return failures


def check_full(head, with_grads):
    xl, wl = leaf(head.input), leaf(head.weight)
    ours = logitless.linear_cross_entropy(xl, wl, head.target, backend="triton")
    ref = logitless.linear_cross_entropy(head.input, head.weight, head.target, backend="torch")
    out = {"loss_rel_vs_fp32_path": rel(ours, ref)}
    if with_grads:
        go = torch.autograd.grad(ours, (xl, wl))
        xr, wr = leaf(head.input), leaf(head.weight)
        gr = torch.autograd.grad(logitless.linear_cross_entropy(xr, wr, head.target, backend="torch"), (xr, wr))
        out["d_input_rel"] = rel(go[0], gr[0])
        out["d_weight_rel"] = rel(go[1], gr[1])
    return out


def head_steps(x, w, t, **opts):
    """The timed calls on one head (x, W, targets): the loss without grad, no-grad log-probs, and forward + backward
    of the mean loss (returns loss, d_input, d_weight); opts (e.g. softcap) go to every call."""
    xl, wl = leaf(x), leaf(w)

    def fwd():
        with torch.no_grad():
            return logitless.linear_cross_entropy(x, w, t, backend="triton", **opts)

    def logp():
        with torch.no_grad():
            return logitless.linear_log_probs(x, w, t, backend="triton", **opts)

    def fwdbwd():
        loss = logitless.linear_cross_entropy(xl, wl, t, backend="triton", **opts)
        return (loss, *torch.autograd.grad(loss, (xl, wl)))

    return fwd, logp, fwdbwd


def time_case(head, reps):
    x, w, t = head.input, head.weight, head.target
    N, V = x.shape[0], w.shape[0]
    fwd, logp, fwdbwd = head_steps(x, w, t)
    buf = {"dz": torch.randn(N, V, device="cuda", dtype=x.dtype) * 1e-3}  # the floor's dL/dz, made once

    def floor():
        dz = buf["dz"]
        return (x @ w.T, dz @ w, dz.T @ x)

    def mm():
        return x @ w.T

    r = {}
    for name, fn in (("fwd", fwd), ("logp", logp), ("fwdbwd", fwdbwd), ("floor", floor), ("mm", mm)):
        r[name + "_ms"] = median_ms(fn, reps)
    buf.clear()
    for name, fn in (("fwd", fwd), ("logp", logp), ("fwdbwd", fwdbwd)):
        r[name + "_peak_mb"] = peak_extra_mb(fn)
    return r


def run_variants(reps, shapes=("llama3-8b",)):
    """Other tile configurations at each shape (uniform data): the forward alone, and forward + backward."""
    base = lh.hopper_config()
    fwd_variants = {"default": base}
    # name -> (configuration, scratch bytes): a larger scratch widens the first pass's chunks (dz goes there
    # instead of the dx buffer, at the price of the scratch's memory)
    scratch = current_tuning().scratch_bytes
    grad_variants = {
        "default": (base, scratch),
        "gradient products through pointers": (base.replace(grad_tma=False), scratch),
        "gradient products 3 stages": (base.replace(grad_stages=3), scratch),
        "no wide chunks": (base.replace(wide=0), scratch),
        "default again": (base, scratch),
    }
    out = {}
    for shape in shapes:
        N, D, V = SHAPES[shape]
        head = data.uniform(N, D, V, device="cuda")
        x, w, t = head.input, head.weight, head.target
        xl, wl = leaf(x), leaf(w)
        for name, cfg in fwd_variants.items():
            key = f"{shape} fwd {name}"
            try:
                with torch.no_grad(), tuning(linear_config=cfg):
                    out[key] = median_ms(
                        lambda x=x, w=w, t=t: logitless.linear_cross_entropy(x, w, t, backend="triton"), reps)
            except Exception as e:  # a configuration the compiler rejects (shared memory) is reported, not fatal
                out[key] = repr(e)[:120]
            print(f"  variant {key}: {out[key]}", flush=True)
        ref = None
        for name, (cfg, nbytes) in grad_variants.items():
            key = f"{shape} fwdbwd {name}"

            def step(xl=xl, wl=wl, t=t, cfg=cfg, nbytes=nbytes):
                with tuning(linear_config=cfg, scratch_bytes=nbytes):
                    return torch.autograd.grad(logitless.linear_cross_entropy(xl, wl, t, backend="triton"),
                                               (xl, wl))

            try:
                grads = step()
                if ref is None:
                    ref = grads
                # gradients against the default's, relative to its largest entry (summation order differs)
                diff = max(((g.float() - r.float()).abs().max() / r.float().abs().max()).item()
                           for g, r in zip(grads, ref, strict=True))
                del grads
                out[key] = (median_ms(step, reps), diff)
            except Exception as e:
                out[key] = repr(e)[:120]
            print(f"  variant {key}: {out[key]}", flush=True)
        del ref
        del head, x, w, t, xl, wl
        torch.cuda.empty_cache()
    return out


FWD_VARIANTS = {
    "tma (default)": {},
    "pointers": dict(tma=False),
    "tma s4": dict(tma=True, fwd_stages=4),
    "tma k128 s2": dict(tma=True, block_k=128, fwd_stages=2),
    "tma waves4": dict(tma=True, waves=4),
    "tma waves16": dict(tma=True, waves=16),
    "tma 256x128": dict(tma=True, block_n=256, block_v=128),
    "tma 256x128 s4": dict(tma=True, block_n=256, block_v=128, fwd_stages=4),
    "tma 128x128 w4": dict(tma=True, block_n=128, block_v=128, fwd_warps=4),
}


def run_fwd_variants(shapes, reps, names=None):
    """No-grad log-probs (one fused pass) under each forward configuration, next to one cuBLAS product, at each
    shape (uniform data); every variant's log-probs are compared with the default's. Then fwd+bwd with the default
    (tensor descriptors in the forward and dz kernels) and with pointer loads."""
    out = {}
    base = lh.hopper_config()
    for shape in shapes:
        N, D, V = SHAPES[shape]
        head = data.uniform(N, D, V, device="cuda")
        x, w, t = head.input, head.weight, head.target
        mm = median_ms(lambda x=x, w=w: x @ w.T, reps)
        out[f"{shape} mm"] = mm
        print(f"  {shape}: mm {mm:.3f} ms", flush=True)
        ref = None
        for name, change in FWD_VARIANTS.items():
            if names and name not in names:
                continue
            try:
                with torch.no_grad(), tuning(linear_config=base.replace(**change)):
                    lp = logitless.linear_log_probs(x, w, t, backend="triton")
                    if ref is None:
                        ref = lp
                    diff = (lp - ref).abs().max().item()
                    ms = median_ms(lambda x=x, w=w, t=t: logitless.linear_log_probs(x, w, t, backend="triton"), reps)
                out[f"{shape} logp {name}"] = (ms, diff)
                print(f"  {shape} logp {name}: {ms:.3f} ms = {ms / mm:.3f} x mm (max |diff| {diff:.2e})",
                      flush=True)
            except Exception as e:  # a configuration the compiler rejects is reported, not fatal
                out[f"{shape} logp {name}"] = repr(e)[:200]
                print(f"  {shape} logp {name}: {repr(e)[:200]}", flush=True)
        xl, wl = leaf(x), leaf(w)
        for name, change in (("default", {}), ("pointers fwd+dz", dict(tma=False))):
            try:
                with tuning(linear_config=base.replace(**change)):
                    ms = median_ms(lambda xl=xl, wl=wl, t=t: torch.autograd.grad(
                        logitless.linear_cross_entropy(xl, wl, t, backend="triton"), (xl, wl)), max(3, reps // 3))
                    with torch.no_grad():
                        fms = median_ms(
                            lambda x=x, w=w, t=t: logitless.linear_cross_entropy(x, w, t, backend="triton"), reps)
                out[f"{shape} fwdbwd {name}"] = (ms, fms)
                print(f"  {shape} {name}: fwd+bwd {ms:.2f} ms, fwd {fms:.3f} ms = {fms / mm:.3f} x mm", flush=True)
            except Exception as e:
                out[f"{shape} fwdbwd {name}"] = repr(e)[:200]
                print(f"  {shape} fwdbwd {name}: {repr(e)[:200]}", flush=True)
        del head, x, w, t, xl, wl, ref
        torch.cuda.empty_cache()
    return out


def run_interleaved(shapes, reps):
    """One cuBLAS product and the no-grad log-probs pass timed alternately (A B A B ...), so that both see the same
    clocks under the power limit; medians and their ratio per shape (uniform data)."""
    out = {}
    for shape in shapes:
        N, D, V = SHAPES[shape]
        head = data.uniform(N, D, V, device="cuda")
        x, w, t = head.input, head.weight, head.target
        steps = {"mm": lambda x=x, w=w: x @ w.T,
                 "logp": lambda x=x, w=w, t=t: logitless.linear_log_probs(x, w, t, backend="triton"),
                 "lce fwd": lambda x=x, w=w, t=t: logitless.linear_cross_entropy(x, w, t, backend="triton")}
        times = {k: [] for k in steps}
        with torch.no_grad():
            for fn in steps.values():  # warm-up
                fn()
            for _ in range(reps):
                for k, fn in steps.items():
                    times[k].append(event_ms(fn)[0])
        med = {k: statistics.median(v) for k, v in times.items()}
        out[shape] = med
        print(f"  interleaved {shape}: mm {med['mm']:.3f} ms, log-probs {med['logp']:.3f} ms "
              f"({med['logp'] / med['mm']:.3f} x), lce forward {med['lce fwd']:.3f} ms "
              f"({med['lce fwd'] / med['mm']:.3f} x)", flush=True)
        del head, x, w, t, steps
        torch.cuda.empty_cache()
    return out


def run_logp_profile(shape):
    """Kernel times of one no-grad log-probs call (what else than the fused kernel runs)."""
    N, D, V = SHAPES[shape]
    head = data.uniform(N, D, V, device="cuda")
    with torch.no_grad():
        logitless.linear_log_probs(head.input, head.weight, head.target, backend="triton")
        torch.cuda.synchronize()
        # Five calls back to back, each also timed with events: kernel time against event time shows host gaps or
        # clocks that fall under sustained load.
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            ev = []
            for _ in range(5):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                logitless.linear_log_probs(head.input, head.weight, head.target, backend="triton")
                e1.record()
                ev.append((e0, e1))
            torch.cuda.synchronize()
    print("  event ms per call: " + " ".join(f"{a.elapsed_time(b):.2f}" for a, b in ev))
    print(f"  profile {shape} uniform, 5 no-grad log-probs calls:")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=40))


def run_extra():
    out = {}
    # N * D > 2^31 (input and the dz workspace), then V * D > 2^31 (weight and its gradient).
    for tag, (N, D, V) in (("N*D>2^31", (524411, 4100, 1000)), ("V*D>2^31", (300, 4100, 524411))):
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(N, D, device="cuda", generator=g, dtype=torch.bfloat16)
        w = (torch.randn(V, D, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        t = torch.randint(0, V, (N,), device="cuda", generator=g)
        xl, wl = leaf(x), leaf(w)
        ours = logitless.linear_cross_entropy(xl, wl, t, backend="triton", reduction="sum")
        go = torch.autograd.grad(ours, (xl, wl))
        del xl, wl
        xr, wr = leaf(x), leaf(w)
        ref = logitless.linear_cross_entropy(xr, wr, t, backend="torch", reduction="sum")
        gr = torch.autograd.grad(ref, (xr, wr))
        # The far end of each big tensor is where a 32-bit offset would wrap.
        out[tag] = dict(loss=rel(ours, ref), d_input=rel(go[0], gr[0]), d_weight=rel(go[1], gr[1]),
                        d_input_last_rows=rel(go[0][-64:], gr[0][-64:]),
                        d_weight_last_rows=rel(go[1][-64:], gr[1][-64:]))
        print(f"  int64 {tag}: {out[tag]}", flush=True)
        del x, w, t, go, gr, xr, wr
        torch.cuda.empty_cache()
    N, D, V = SHAPES["qwen3-small"]
    head = data.uniform(N, D, V, device="cuda", seed=3)
    runs = []
    for _ in range(2):
        xl, wl = leaf(head.input), leaf(head.weight)
        runs.append(torch.autograd.grad(logitless.linear_cross_entropy(xl, wl, head.target, backend="triton",
                                                                       deterministic=True), (xl, wl)))
    out["bitwise_identical"] = all(torch.equal(a, b) for a, b in zip(runs[0], runs[1], strict=True))
    print(f"  determinism (qwen3-small uniform, 2 runs): bitwise identical = {out['bitwise_identical']}", flush=True)
    return out


def kernel_resources():
    """Registers, spills and shared memory of every compiled linear-head kernel (Triton's cache; best effort)."""
    from logitless.kernels.linear_head import backward_kernels, forward_kernels

    for name, fn in (("_fwd_kernel", forward_kernels._fwd_kernel), ("_dz_kernel", backward_kernels._dz_kernel),
                     ("_dgrad_kernel", backward_kernels._dgrad_kernel)):
        try:
            for cache in fn.device_caches.values():
                for k in cache[0].values():
                    print(f"  {name}: regs {k.n_regs}, spills {k.n_spills}, shared {k.metadata.shared} B, "
                          f"warps {k.metadata.num_warps}, stages {k.metadata.num_stages}", flush=True)
        except Exception as e:
            print(f"  {name}: resources unavailable ({e!r})")


def run_profile(shape):
    N, D, V = SHAPES[shape]
    head = data.uniform(N, D, V, device="cuda")
    xl, wl = leaf(head.input), leaf(head.weight)

    def step():
        return torch.autograd.grad(logitless.linear_cross_entropy(xl, wl, head.target, backend="triton"), (xl, wl))

    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    if os.environ.get("TRACE_DIR"):
        prof.export_chrome_trace(os.path.join(os.environ["TRACE_DIR"], f"trace-{shape}.json"))
    print(f"  profile {shape} uniform, forward + backward:")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10, max_name_column_width=40))
    timeline(prof, step)


def timeline(prof, step):
    """The profiled step's GPU timeline: first kernel start to last kernel end, the time some kernel ran, and the
    largest idle gaps between kernels (launch gaps, host work), next to the same step timed by CUDA events."""
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    if not kernels:
        return
    busy, gaps, end, prev = 0.0, [], kernels[0][0], kernels[0][2]
    for s, e, name in kernels:
        if s > end:
            gaps.append((s - end, prev, name))
        busy += max(0.0, e - max(s, end))
        if e > end:
            end, prev = e, name
    span = end - kernels[0][0]
    events = statistics.median(event_ms(step)[0] for _ in range(3))
    print(f"  timeline: {len(kernels)} kernels, span {span / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms, idle "
          f"{(span - busy) / 1e3:.2f} ms in {len(gaps)} gaps; the step by CUDA events {events:.2f} ms")
    for g, a, b in sorted(gaps, reverse=True)[:5]:
        print(f"    gap {g:.0f} us: {a[:40]} -> {b[:40]}")


def write_json(res, path):
    if path:
        with open(path, "w") as f:
            json.dump(res, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--kinds", default="lm,uniform")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--check-rows", type=int, default=1024)
    ap.add_argument("--variants", action="store_true")
    ap.add_argument("--extra", action="store_true")
    ap.add_argument("--variants-only", action="store_true", help="only the tile variants at --shapes, then exit")
    ap.add_argument("--interleaved", action="store_true",
                    help="one product and the no-grad passes timed alternately at --shapes, then exit")
    ap.add_argument("--fwd-variants", default="", help="forward variants (comma-separated names, or 'all') at "
                    "--shapes, then exit")
    ap.add_argument("--profile", default="", help="comma-separated shapes to profile (kernel times)")
    ap.add_argument("--profile-only", action="store_true",
                    help="only the --profile shapes, then exit (TRACE_DIR=folder also writes Chrome traces)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--dry-run", action="store_true", help="checks only, at a tiny shape on the CPU interpreter")
    a = ap.parse_args()

    if a.dry_run:
        for kind in ("lm", "uniform"):
            head = data.make_head(kind, 70, 48, 700, device="cpu")
            print(check_slice(head, 50, kind), check_full(head, True))
        return

    dev = torch.cuda.get_device_properties(0)
    print(f"device {dev.name}, {dev.multi_processor_count} SMs; torch {torch.__version__}, triton {triton.__version__}",
          flush=True)
    if a.profile_only:
        for shape in filter(None, a.profile.split(",")):
            run_profile(shape)
        return
    if a.interleaved:
        return write_json(run_interleaved(a.shapes.split(","), a.reps), a.json)
    if a.variants_only:
        for shape in filter(None, a.profile.split(",")):
            run_profile(shape)
        res = run_variants(a.reps, a.shapes.split(","))
        kernel_resources()
        return write_json(res, a.json)
    if a.fwd_variants:
        for shape in filter(None, a.profile.split(",")):
            run_logp_profile(shape)
        names = None if a.fwd_variants == "all" else a.fwd_variants.split(",")
        res = run_fwd_variants(a.shapes.split(","), a.reps, names)
        kernel_resources()
        return write_json(res, a.json)
    results = {"device": dev.name, "torch": torch.__version__, "triton": triton.__version__, "cases": {}}
    failures = []
    for shape in a.shapes.split(","):
        N, D, V = SHAPES[shape]
        for kind in a.kinds.split(","):
            tag = f"{shape} {kind}"
            t0 = time.time()
            try:
                head = data.make_head(kind, N, D, V, device="cuda")
                res = {"data": head.description}
                failures += [f"{tag} {f}" for f in check_slice(head, a.check_rows, tag)]
                res.update(check_full(head, with_grads=kind == "lm"))
                res.update(time_case(head, a.reps))
                res["fwdbwd_over_floor"] = res["fwdbwd_ms"] / res["floor_ms"]
                res["fwd_over_mm"] = res["fwd_ms"] / res["mm_ms"]
                res["logp_over_mm"] = res["logp_ms"] / res["mm_ms"]
                results["cases"][tag] = res
                short = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items() if k != "data"}
                print(f"  {tag}: {json.dumps(short)} ({time.time() - t0:.0f} s)", flush=True)
                del head
            except Exception:
                traceback.print_exc()
                failures.append(f"{tag} crashed")
            torch.cuda.empty_cache()
    kernel_resources()
    for shape in filter(None, a.profile.split(",")):
        try:
            run_profile(shape)
        except Exception:
            traceback.print_exc()
    if a.variants:
        try:
            results["variants"] = run_variants(a.reps, a.shapes.split(","))
        except Exception:
            traceback.print_exc()
    if a.extra:
        try:
            results["extra"] = run_extra()
        except Exception:
            traceback.print_exc()
            failures.append("extra crashed")
    results["failures"] = failures
    write_json(results, a.json)
    print("\n| shape | data | fwd ms (x mm) | logp ms (x mm) | fwd+bwd ms (x floor) | floor ms | mm ms "
          "| peak MB fwd / logp / fwd+bwd |")
    print("|---|---|---|---|---|---|---|---|")
    for tag, r in results["cases"].items():
        shape, kind = tag.split()
        print(f"| {shape} | {kind} | {r['fwd_ms']:.2f} ({r['fwd_over_mm']:.2f}) | {r['logp_ms']:.2f} "
              f"({r['logp_over_mm']:.2f}) | {r['fwdbwd_ms']:.2f} ({r['fwdbwd_over_floor']:.2f}) "
              f"| {r['floor_ms']:.2f} | {r['mm_ms']:.2f} "
              f"| {r['fwd_peak_mb']:.1f} / {r['logp_peak_mb']:.1f} / {r['fwdbwd_peak_mb']:.1f} |")
    print("failures:", failures or "none")


if __name__ == "__main__":
    main()
