"""Could the forward compute the cold tail of a sorted vocabulary with FP8 products, within a proof?

    PYTHONPATH=src python tools/cpu_fp8_tail.py --data-file FILE [--rows 512] [--held 1024]

On a real head's data file (`python -m logitless.apps.bench.real`, docs/data.md): the vocabulary sorted by softmax
mass over `--held` held-out tokens (the order the self-sorting head keeps), then for `--rows` other tokens, in
float64: the logits of e4m3 operands (per-row scales to 448, as a Hopper FP8 product would take them) against the
exact ones; the rigorous bound of that error per logit, sum_k |x_k| |w_jk| (2 * 2^-4 + 2^-8) (each operand's
relative rounding, whatever the signs); PyTorch's own bf16 log-sum-exp error; and, with the first `head` share of
the sorted classes exact and the rest in FP8, the log-sum-exp's actual error and the bound the kernel could prove.
"""

from __future__ import annotations

import argparse

import torch

from logitless.apps.bench import real_files


def e4m3(a: torch.Tensor) -> torch.Tensor:
    s = a.abs().amax(1, keepdim=True).clamp(min=1e-30) / 448
    return (a / s).to(torch.float8_e4m3fn).double() * s


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-file", required=True)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--held", type=int, default=1024)
    args = ap.parse_args()
    d = real_files.load(args.data_file)
    w = d["weight"].double()
    x = d["input"].double()
    held, rows = x[-args.held:], x[:args.rows]
    mass = torch.zeros(w.shape[0], dtype=torch.float64)
    for lo in range(0, held.shape[0], 256):
        mass += torch.softmax(held[lo:lo + 256] @ w.T, -1).sum(0)
    w = w[torch.argsort(mass, descending=True)]
    z = rows @ w.T
    lse = torch.logsumexp(z, -1)
    lse_bf16 = torch.logsumexp((rows.bfloat16() @ w.bfloat16().T).double(), -1)
    zq = e4m3(rows.float()) @ e4m3(w.float()).T
    bound = (rows.abs() @ w.abs().T) * (2 * 2.0**-4 + 2.0**-8)
    err = (zq - z).abs()
    print(f"{d['model']}: {args.rows} tokens, order from {args.held} held-out tokens, V = {w.shape[0]}, "
          f"D = {w.shape[1]}")
    print(f"FP8 logit error: median {err.median():.3g}, max {err.max():.3g}; its rigorous bound: median "
          f"{bound.median():.3g}")
    pt = (lse_bf16 - lse).abs()
    print(f"PyTorch's bf16 log-sum-exp error: median {pt.median():.3g}, max {pt.max():.3g}")
    print("| exact head | tail mass (median / max) | FP8 tail's lse error (median / max) | provable bound "
          "(median / max) |")
    print("| --- | --- | --- | --- |")
    p = torch.softmax(z, -1)
    for frac in (0.05, 0.1, 0.25, 0.5):
        h = int(w.shape[0] * frac)
        mixed = torch.logsumexp(torch.cat([z[:, :h], zq[:, h:]], 1), -1)
        upper = torch.logsumexp(torch.cat([z[:, :h], zq[:, h:] + bound[:, h:]], 1), -1)
        tail = p[:, h:].sum(1)
        got, proof = (mixed - lse).abs(), upper - mixed
        print(f"| {frac:.0%} | {tail.median():.2e} / {tail.max():.2e} | {got.median():.2e} / {got.max():.2e} | "
              f"{proof.median():.2e} / {proof.max():.2e} |")


if __name__ == "__main__":
    main()
