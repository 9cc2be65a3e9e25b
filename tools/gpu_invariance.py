"""Batch invariance of the log-probs on a CUDA device, their precision, and their cost against another revision.

    mkdir old && git archive REV src | tar -x -C old
    PYTHONPATH=src:tools python tools/gpu_invariance.py [--old old/src] [--json FILE]

1. Invariance: on a bf16 head of V = 262144, D = 2304 and 8192 rows, the log-prob and entropy of rows taken in
   batches of 1, 3, 17, 256, 1000 and 4096 (random rows, in random order) against the same rows in the full batch:
   the largest difference (0 = bitwise the same).
2. Precision of the kernels against float64 (tools/precision_table.py) on the synthetic "lm" head calibrated on Gemma
   3 270M's (docs/data.md).
3. Cost, with --old (another revision's src folder): tools/gpu_ab_src.py's interleaved rounds, each revision in a
   process of its own and this one twice (a null version), of no-grad log-probs with entropy and of log-probs'
   forward + backward (reduction "none": a random upstream per token, gradients of input and weight), at (8192,
   2304, 262144), (16384, 4096, 128256) and small N at V = 262144.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from gpu_ab_src import main as ab_main  # tools/
from precision_table import table

import logitless
from logitless.apps.bench import data

SIZES = (1, 3, 17, 256, 1000, 4096)


def invariance():
    g = torch.Generator(device="cuda").manual_seed(0)
    N, D, V = 8192, 2304, 262144
    x = (torch.randn(N, D, device="cuda", generator=g)).to(torch.bfloat16)
    w = (torch.randn(V, D, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    t = torch.randint(0, V, (N,), device="cuda", generator=g)
    with torch.no_grad():
        lp, ent = logitless.linear_log_probs(x, w, t, return_entropy=True, backend="triton")
        res = {}
        for n in SIZES:
            idx = torch.randperm(N, device="cuda", generator=g)[:n]
            a, b = logitless.linear_log_probs(x[idx], w, t[idx], return_entropy=True, backend="triton")
            res[n] = ((a - lp[idx]).abs().max().item(), (b - ent[idx]).abs().max().item())
    print("max |diff| (logp, entropy) by batch size:", res, flush=True)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", default=None, help="another revision's src folder: time this one against it")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    res["invariance"] = invariance()
    head = data.make_head("lm", 1024, 640, 262144, dtype=torch.float32, device="cpu", seed=0)
    res["precision_lm"] = table(head.input.float(), head.weight.float(), head.target, "cuda", ("bf16",))
    print("precision (lm head, 1024 tokens):", res["precision_lm"], flush=True)
    if a.old is not None:
        torch.cuda.empty_cache()
        shapes = "8192x2304x262144,16384x4096x128256,1x2304x262144,17x2304x262144,256x2304x262144,1000x2304x262144"
        here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
        res["cost"] = ab_main(["--src", f"A={a.old}", "--src", f"B={here}", "--src", f"C={here}", "--shapes", shapes,
                               "--cases", "logp,logp_bwd", "--rounds", str(a.rounds), "--reps", str(a.reps)])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
