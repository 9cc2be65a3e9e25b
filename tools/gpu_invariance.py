"""Batch invariance and its cost on a CUDA device: kernels of another revision (A) against this one (B).

    mkdir old && git archive REV src/logitless/kernels | tar -x -C old
    PYTHONPATH=src:tools python tools/gpu_invariance.py --old old/src/logitless/kernels [--json FILE]

1. Invariance: on a bf16 head of V = 262144, D = 2304 and 8192 rows, each version's log-prob and entropy of rows taken
   in batches of 1, 3, 17, 256, 1000 and 4096 (random rows, in random order) against the same rows in the full batch:
   the largest difference (0 = bitwise the same).
2. Cost: interleaved rounds (tools/gpu_ab.py's method) of no-grad log-probs with entropy, and forward + backward of
   log-probs (reduction "none": a random upstream per token, gradients of input and weight), at (8192, 2304, 262144),
   (16384, 4096, 128256) and small N at V = 262144.
3. Precision of the kernels against float64 (tools/precision_table.py) on the synthetic "lm" head calibrated on Gemma
   3 270M's (docs/data.md).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from gpu_ab import load_old, median_ms, tuned, use  # tools/
from precision_table import table

import logitless
from logitless import kernels
from logitless.apps.bench import data

SIZES = (1, 3, 17, 256, 1000, 4096)


def invariance(versions):
    g = torch.Generator(device="cuda").manual_seed(0)
    N, D, V = 8192, 2304, 262144
    x = (torch.randn(N, D, device="cuda", generator=g)).to(torch.bfloat16)
    w = (torch.randn(V, D, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    t = torch.randint(0, V, (N,), device="cuda", generator=g)
    out = {}
    for name, ver in versions.items():
        use(ver)
        with tuned(ver), torch.no_grad():
            lp, ent = logitless.linear_log_probs(x, w, t, return_entropy=True, backend="triton")
            res = {}
            for n in SIZES:
                idx = torch.randperm(N, device="cuda", generator=g)[:n]
                a, b = logitless.linear_log_probs(x[idx], w, t[idx], return_entropy=True, backend="triton")
                res[n] = ((a - lp[idx]).abs().max().item(), (b - ent[idx]).abs().max().item())
        out[name] = res
        print(name, "max |diff| (logp, entropy) by batch size:", res, flush=True)
    return out


def steps(N, D, V):
    head = data.uniform(N, D, V, device="cuda")
    x, w, t = head.input, head.weight, head.target
    up = torch.randn(N, device="cuda")
    xl, wl = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)

    def logp():
        with torch.no_grad():
            return logitless.linear_log_probs(x, w, t, return_entropy=True, backend="triton")

    def fwdbwd():
        lp = logitless.linear_log_probs(xl, wl, t, backend="triton")
        return torch.autograd.grad(lp, (xl, wl), up)

    return {"logp": logp, "fwdbwd_none": fwdbwd}


def cost(versions, shapes, rounds, reps):
    out = {}
    for N, D, V in shapes:
        fns = steps(N, D, V)
        cases = ("logp",) if N < 256 else ("logp", "fwdbwd_none")
        times = {(v, c): [] for v in versions for c in cases}
        names = list(versions)
        for r in range(rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                use(versions[name])
                with tuned(versions[name]):
                    for c in cases:
                        times[name, c].append(median_ms(fns[c], reps))
        res = {f"{v} {c}": statistics.median(ts) for (v, c), ts in times.items()}
        for c in cases:
            res[f"{c} B/A"] = res[f"B {c}"] / res[f"A {c}"]
        out[f"{N}x{D}x{V}"] = res
        print(f"{N}x{D}x{V}", {k: round(v, 4) for k, v in res.items()}, flush=True)
        del fns
        torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import logitless.kernels.linear_head as new
    versions = {"A": (load_old(a.old), kernels.Tuning()), "B": (new, kernels.Tuning())}
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    res["invariance"] = invariance(versions)
    use(versions["B"])
    head = data.make_head("lm", 1024, 640, 262144, dtype=torch.float32, device="cpu", seed=0)
    res["precision_lm"] = table(head.input.float(), head.weight.float(), head.target, "cuda", ("bf16",))
    print("precision (lm head, 1024 tokens):", res["precision_lm"], flush=True)
    shapes = [(8192, 2304, 262144), (16384, 4096, 128256), (1, 2304, 262144), (17, 2304, 262144),
              (256, 2304, 262144)]
    res["cost"] = cost(versions, shapes, a.rounds, a.reps)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
