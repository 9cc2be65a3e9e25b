"""RL's head step: per-token log-probs and entropies, forward and backward with per-token weights, against
torch.compile and eager PyTorch on the same data, with the errors of the whole batch against float64.

    PYTHONPATH=src python tools/gpu_rl_head.py --data-file FILE [--data real,real-sorted] \
        [--shapes 8192x640,8192x2304] [--reps 10] [--json FILE]

The objective is sum_i (a_i log p_i(t_i) + b_i H_i), a_i and b_i fixed random per token (GRPO's advantages and an
entropy bonus), over a head of V classes (the data file's). Providers: logitless's default call
(``linear_log_probs(..., return_entropy=True)``, skipping where it pays), the same with ``skip_threshold=None``,
and PyTorch's ``log_softmax`` of the bf16 logits in float32, eager and under torch.compile. Each provider runs a few
warm-up calls (the default's gate decides from them), then ``--reps`` timed calls (CUDA events), and its peak
memory above inputs and gradients. Errors: relative Frobenius error of d_input and d_weight over the whole batch
against a float64 reference built in row chunks, next to PyTorch's own bf16 error (the eager provider).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import logitless
from logitless import skip_gate
from logitless.apps.bench import data
from logitless.apps.bench.measure import event_ms


def naive(x, w, t, a, b):
    logp = torch.log_softmax((x @ w.T).float(), -1)
    lp = logp.gather(1, t[:, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)
    return (lp * a + ent * b).sum()


def ours(x, w, t, a, b, **kw):
    lp, ent = logitless.linear_log_probs(x, w, t, return_entropy=True, **kw)
    return (lp.float() * a + ent.float() * b).sum()


def bind(fn, t, a, b, **kw):
    return lambda xs, ws: fn(xs, ws, t, a, b, **kw)


def reference(x, w, t, a, b, rows=1024):
    """float64 d_input and d_weight of the objective, row chunk by row chunk (no N x V float64 logits)."""
    w64 = w.double()
    dx = torch.empty(x.shape, dtype=torch.float64, device=x.device)
    dw = torch.zeros(w.shape, dtype=torch.float64, device=x.device)
    for lo in range(0, x.shape[0], rows):
        x64 = x[lo:lo + rows].double()
        logp = torch.log_softmax(x64 @ w64.T, -1)
        p = logp.exp()
        h = -(p * logp).sum(-1, keepdim=True)
        # d(a log p_t)/dz = a (onehot - p); dH/dz = -p (log p + H)
        dz = -p * (a[lo:lo + rows, None].double() + b[lo:lo + rows, None].double() * (logp + h))
        dz.scatter_add_(1, t[lo:lo + rows, None], a[lo:lo + rows, None].double())
        dx[lo:lo + rows] = dz @ w64
        dw.addmm_(dz.T, x64)
        del logp, p, dz
    return dx, dw


def rel(a, ref):
    return ((a.double() - ref).norm() / ref.norm()).item()


def step(fn, x, w):
    xg, wg = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()

    def run():
        xg.grad = wg.grad = None
        fn(xg, wg).backward()
    return run, xg, wg


def measure(fn, x, w, reps, warmup=4):
    run, xg, wg = step(fn, x, w)
    for _ in range(warmup):
        run()
    if x.device.type == "cpu":  # a dry run of the tool: wall clock, no peak
        t0 = time.perf_counter()
        run()
        return (time.perf_counter() - t0) * 1e3, 0.0, xg.grad, wg.grad
    torch.cuda.synchronize()
    times = [event_ms(run)[0] for _ in range(reps)]
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return statistics.median(times), peak, xg.grad, wg.grad


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-file", default=None)
    ap.add_argument("--data", default="real,real-sorted")
    ap.add_argument("--shapes", default="8192x640,8192x2304")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    records = []
    for kind in args.data.split(","):
        for shape in args.shapes.split(","):
            N, D = (int(v) for v in shape.split("x"))
            V = data.real_source(0, args.data_file)["V"] if kind in data.REAL_KINDS else 262144
            head = data.make_head(kind, N, D, V, data_file=args.data_file, device=args.device)
            x, w, t = head.input, head.weight, head.target
            g = torch.Generator(device=args.device).manual_seed(0)
            a = torch.randn(N, device=args.device, generator=g)
            b = torch.randn(N, device=args.device, generator=g) * 0.01
            rx, rw = reference(x, w, t, a, b)
            provs = {
                "logitless": bind(ours, t, a, b),
                "logitless-dense": bind(ours, t, a, b, skip_threshold=None),
                "torch-compile": bind(torch.compile(naive), t, a, b),
                "torch-eager": bind(naive, t, a, b),
            }
            rec = {"data": kind, "N": N, "D": D, "V": V, "desc": head.description}
            for name, fn in provs.items():
                skip_gate.forget()
                ms, peak, dx, dw = measure(fn, x, w, args.reps)
                share = skip_gate.last_share(w) if name == "logitless" else None
                rec[name] = {"ms": ms, "peak_mib": peak, "err_dx": rel(dx, rx), "err_dw": rel(dw, rw),
                             "skipped": share}
                del dx, dw
                if args.device != "cpu":
                    torch.cuda.empty_cache()
            records.append(rec)
            e = rec["torch-eager"]
            line = [f"{kind} ({N}, {D}, {V})"]
            for name in provs:
                r = rec[name]
                line.append(f"{name} {r['ms']:.2f} ms ({r['peak_mib']:.0f} MiB) dx {r['err_dx'] / e['err_dx']:.2f}x "
                            f"dw {r['err_dw'] / e['err_dw']:.2f}x" + (f" skipped {r['skipped']:.0%}"
                                                                       if r["skipped"] is not None else ""))
            line.append(f"default / compile {rec['logitless']['ms'] / rec['torch-compile']['ms']:.3f}")
            print("\n  ".join(line), flush=True)
            del x, w, t, head, rx, rw
    meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if args.device != "cpu" else "cpu",
            "triton": __import__("triton").__version__, "command": "tools/gpu_rl_head.py " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
