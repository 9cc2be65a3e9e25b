"""Driver for Nsight Compute: one cuBLAS product, one no-grad log-probs pass and one linear_cross_entropy
forward + backward at a shape, after warm-up calls, between cudaProfilerStart/Stop. Run under ncu, e.g.

    ncu --profile-from-start off --clock-control none \
        --kernel-name regex:'_fwd_kernel|_dz_kernel|_dgrad_kernel|gemm|nvjet' --launch-count 7 \
        --section SpeedOfLight --section WarpStateStats ... python3 tools/ncu_head.py --shape 16384,4096,128256

Without ncu it just runs (a smoke test of the driver).
"""

from __future__ import annotations

import argparse

import torch

import logitless
from logitless.apps.bench import data


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="16384,4096,128256")
    ap.add_argument("--kind", default="uniform")
    a = ap.parse_args()
    N, D, V = (int(s) for s in a.shape.split(","))
    head = data.make_head(a.kind, N, D, V, device="cuda")
    x = head.input.detach().requires_grad_(True)
    w = head.weight.detach().requires_grad_(True)
    t = head.target

    def mm():
        return head.input @ head.weight.T

    def logp():
        with torch.no_grad():
            return logitless.linear_log_probs(head.input, head.weight, t)

    def train():
        return torch.autograd.grad(logitless.linear_cross_entropy(x, w, t), (x, w))

    for fn in (mm, logp, train):
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for fn in (mm, logp, train):
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
