"""What a z-loss costs a bf16 training step: linear_cross_entropy fwd+bwd with z_loss=0 and z_loss=1e-4, interleaved
(6 rounds of 3 calls each, CUDA events, medians), default budget, `lm` heads. To compare two versions of the
package, run it once per version's source tree, one after the other on the same warm GPU:

    git archive REV src | tar -x -C /tmp/old
    for p in /tmp/old/src src; do PYTHONPATH=$p python tools/gpu_zloss_ab.py; done
"""

from __future__ import annotations

import argparse
import statistics

import torch

import logitless
from logitless.apps.bench import data


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="8192x2304x256000,16384x1024x151936", help="NxDxV, comma-separated")
    ap.add_argument("--z-loss", type=float, default=1e-4)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; logitless from {logitless.__file__}")
    for shape in args.shapes.split(","):
        N, D, V = (int(a) for a in shape.split("x"))
        h = data.make_head("lm", N, D, V, dtype=torch.bfloat16, device="cuda", seed=0)
        x, w, t = h.input.detach().requires_grad_(), h.weight.detach().requires_grad_(), h.target
        del h

        def run(zl, x=x, w=w, t=t):
            x.grad = w.grad = None
            logitless.linear_cross_entropy(x, w, t, z_loss=zl).backward()

        res = {0.0: [], args.z_loss: []}
        for zl in res:
            run(zl)
            run(zl)
        torch.cuda.synchronize()
        for r in range(6):
            for zl in (list(res) if r % 2 == 0 else list(res)[::-1]):
                for _ in range(3):
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    run(zl)
                    e.record()
                    torch.cuda.synchronize()
                    res[zl].append(s.elapsed_time(e))
        med = {k: statistics.median(v) for k, v in res.items()}
        print(f"({N}, {D}, {V}) fwd+bwd ms: z_loss 0 {med[0.0]:.2f}, z_loss {args.z_loss:g} {med[args.z_loss]:.2f} "
              f"({med[args.z_loss] / med[0.0]:.3f} x)", flush=True)
        del x, w


if __name__ == "__main__":
    main()
