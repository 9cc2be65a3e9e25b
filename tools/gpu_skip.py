"""Where a skipping backward's time goes, on one CUDA device.

    PYTHONPATH=src python tools/gpu_skip.py [--shape 8192,2304,262144] [--data lm] [--data-file PATH]
        [--thresholds 0,auto,0.000244] [--reps 5] [--tune skip_nested=0 --tune skip_nested=1 ...]

For each data kind and skip_threshold (0: no skipping, "auto", or a float), in bfloat16 with the mean loss of
linear_cross_entropy: fwd+bwd time (CUDA events, median of --reps after a warm-up), the fraction of (token block x
tile) pairs the backward skipped, the peak memory above the inputs and the gradients, and the largest per-row bound
on the skipped mass (from the plan, read from a call of its own), and one profiled fwd+bwd whose CUDA kernel time is
summed by kernel name (the forward, the dz kernel, the gradient products, sorts and scans, the rest, whose largest
kernels are listed by name and count). Each --tune (comma-separated
field=value pairs of kernels.Tuning, integers or floats) is a variant run at every threshold; none: the defaults. A
field `cfg.NAME` changes that field of the device's linear-head Config (e.g. `cfg.grad_stages=3`). Errors against
float64 are the benchmark's job (`logitless bench`, whose provider logitless-triton-skip is skip_threshold="auto").
"""

from __future__ import annotations

import argparse
import collections
import statistics

import torch

import logitless
from logitless import kernels
from logitless.apps.bench import data


def _time(fn, reps):
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def _num(text: str):
    """A --tune value: an int, a float, or else the text itself (a named choice, e.g. skip_dx_deal=makespan)."""
    if text.lstrip("-").isdigit():
        return int(text)
    try:
        return float(text)
    except ValueError:
        return text


def tune_variants(specs: list[str] | None) -> list[dict]:
    """The Tuning overrides of each --tune value ("k=v,k=v"; none given: one variant of the defaults)."""
    return [dict((kv.split("=")[0], _num(kv.split("=")[1])) for kv in v.split(",") if kv) for v in specs or [""]]


def _group(name: str) -> str:
    for key in ("_fwd_kernel", "_combine_kernel", "_dz_kernel", "_dgrad_kernel", "_sum_splits", "gemm", "Gemm",
                "sort", "Sort", "cumsum", "scan", "Scan", "index"):
        if key in name:
            return key.lower()
    return "other"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="8192,2304,262144")
    ap.add_argument("--data", action="append", default=None)
    ap.add_argument("--data-file", default=None)
    ap.add_argument("--thresholds", default="0,auto")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tune", action="append", default=None)
    ap.add_argument("--per-launch", type=int, default=0, metavar="CLASSES",
                    help="also list each dz and gradient-product launch's time in order, and the plan's hot pairs "
                         "per range of CLASSES classes (the skipping chunks' width)")
    args = ap.parse_args(argv)
    variants = tune_variants(args.tune)
    N, D, V = (int(v) for v in args.shape.split(","))
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(dev)}; torch {torch.__version__}; shape N={N} D={D} V={V}, bf16, mean loss")
    for kind in args.data or ["lm"]:
        head = data.make_head(kind, N, D, V, dtype=torch.bfloat16, device=dev, data_file=args.data_file)
        x = head.input.detach().requires_grad_(True)
        w = head.weight.detach().requires_grad_(True)
        t = head.target
        for thr_text, variant in ((a, v) for a in args.thresholds.split(",") for v in variants):
            thr = thr_text if thr_text == "auto" else float(thr_text)
            plans = []

            def step(x=x, w=w, t=t, thr=thr):
                loss = logitless.linear_cross_entropy(x, w, t, backend="triton", skip_threshold=thr)
                torch.autograd.grad(loss, [x, w])

            tune = dict(variant)
            cfg_fields = {k[4:]: v for k, v in tune.items() if k.startswith("cfg.")}
            tune = {k: v for k, v in tune.items() if not k.startswith("cfg.")}
            if cfg_fields:
                from logitless.kernels import linear_head as lh

                tune["linear_config"] = lh.config_for(x).replace(**cfg_fields)
            # The plan is read from one call of its own: with Tuning.debug_plans set, the plan also computes each
            # row's bound (PyTorch ops over the (N, T) record) that the timed and profiled calls do not.
            with kernels.tuning(**tune):
                ms = _time(step, args.reps)
                with kernels.tuning(debug_plans=plans):
                    step()
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                step()
                torch.cuda.synchronize()
                # above the inputs and the two gradients (outputs, as the bench counts them)
                peak = (torch.cuda.max_memory_allocated() - base - 2 * (N + V) * D) / 2**20
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    step()
                    torch.cuda.synchronize()
            totals = collections.Counter()
            others = collections.Counter()
            for ev in prof.key_averages():
                totals[_group(ev.key)] += ev.device_time_total / 1000.0
                if _group(ev.key) == "other":
                    others[f"{ev.key[:60]} x{ev.count}"] += ev.device_time_total / 1000.0
            skipped = bound = 0.0
            if plans:
                skipped = 1.0 - plans[0].hot.float().mean().item()
                bound = plans[0].row_bound.max().item()
            if args.per_launch:
                launches = [(ev.name, ev.device_time_total / 1000.0) for ev in prof.events()
                            if ev.device_type == torch.autograd.DeviceType.CUDA
                            and _group(ev.name) in ("_dz_kernel", "_dgrad_kernel", "_sum_splits")]
                print("    launches (ms): " + ", ".join(f"{_group(n)[1:4]} {t:.3f}" for n, t in launches))
                if plans:
                    hot = plans[0].hot
                    per = max(1, args.per_launch * hot.shape[1] // V)
                    counts = [int(hot[:, i:i + per].sum().item()) for i in range(0, hot.shape[1], per)]
                    print(f"    hot pairs per {args.per_launch} classes (of {hot.shape[0] * per}): {counts}")
            parts = ", ".join(f"{k} {v:.2f}" for k, v in totals.most_common() if v >= 0.05)
            print(f"{kind:8s} {variant} skip_threshold={thr_text:8s} fwd+bwd {ms:7.2f} ms  "
                  f"peak {peak:6.0f} MiB  skipped {100 * skipped:5.1f}% (max row bound {bound:.2e})\n"
                  f"    kernel ms: {parts}\n"
                  f"    other: {', '.join(f'{k} {v:.3f}' for k, v in others.most_common(8))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
