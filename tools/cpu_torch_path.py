"""The PyTorch path (logitless.torch_backend, the CPU default) against eager PyTorch on this CPU, interleaved.

    PYTHONPATH=src python tools/cpu_torch_path.py [--shape 512,128,32000] [--rounds 5] [--threads 2] [--generic]

To compare two versions of the package, run it once per source tree (`git archive REV src | tar -x -C old`, then
`PYTHONPATH=old/src`), one after the other, and compare the ratios to eager.

float32, lm-like data (logitless.apps.bench.data), mean loss. Per round, in an order that alternates between rounds:
fwd+bwd and no-grad forward of linear_cross_entropy(backend="torch"), of eager PyTorch (x @ W.T, then
F.cross_entropy), and with --generic of the path without its fused training path and
with the backward's block size in the forward (float32 torch_backend.py as it was before both). Prints the median
and the minimum of each, and their ratios to eager: on a shared machine the other processes' load moves every
number, so only ratios within one run mean much.
Peak memory (once, after the timing): PyTorch's profiler's CPU allocator events (logitless.apps.bench.measure, as
`logitless bench` does), above the inputs and minus the gradients returned.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import logitless
from logitless.apps.bench import data
from logitless.apps.bench.measure import _cpu_peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="512,128,32000")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--generic", action="store_true", help="also time the path without the fused training path")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    N, D, V = (int(v) for v in args.shape.split(","))
    head = data.make_head("lm", N, D, V, dtype=torch.float32, device="cpu", seed=0)
    x0, w0, t = head.input, head.weight, head.target

    fns = {"ours": lambda x, w: logitless.linear_cross_entropy(x, w, t, backend="torch"),
           "eager": lambda x, w: F.cross_entropy(x @ w.T, t)}
    if args.generic:
        fns["generic"] = lambda x, w: _generic(lambda: logitless.linear_cross_entropy(x, w, t, backend="torch"))

    def step(name, grad):
        if not grad:
            with torch.no_grad():
                return fns[name](x0, w0)
        x, w = x0.detach().requires_grad_(True), w0.detach().requires_grad_(True)
        fns[name](x, w).backward()
        return x.grad, w.grad

    cases = [(k, g) for g in (True, False) for k in fns]
    times = {c: [] for c in cases}
    for c in cases:
        step(*c)  # warm-up
    for r in range(args.rounds):
        for c in cases if r % 2 == 0 else cases[::-1]:
            t0 = time.perf_counter()
            step(*c)
            times[c].append(1e3 * (time.perf_counter() - t0))
    print(f"N={N} D={D} V={V} fp32, {torch.get_num_threads()} threads, {args.rounds} rounds")
    for g in (True, False):
        eager_med = statistics.median(times[("eager", g)])
        eager_min = min(times[("eager", g)])
        for k in fns:
            med, mn = statistics.median(times[(k, g)]), min(times[(k, g)])
            out_bytes = (x0.numel() + w0.numel()) * 4 if g else 4
            peak, _ = _cpu_peak(lambda k=k, g=g: step(k, g))
            print(f"  {'fwd+bwd' if g else 'no-grad':8s} {k:6s} median {med:8.1f} ms ({med / eager_med:.2f} x eager)"
                  f"  min {mn:8.1f} ms ({mn / eager_min:.2f} x)  peak {(peak - out_bytes) / 2**20:7.1f} MiB")


def _generic(fn):
    """fn() with the fused training path off and the forward's blocks of the backward's size."""
    from logitless.torch_backend import blocks, fused, linear_head

    saved = fused.fused_rows, linear_head.stats_block
    fused.fused_rows = lambda *a, **k: 0
    linear_head.stats_block = lambda n, V, temporaries, item: blocks.budget_block(n, V, temporaries, item=item)
    try:
        return fn()
    finally:
        fused.fused_rows, linear_head.stats_block = saved


if __name__ == "__main__":
    main()
