"""No-grad log-probs with other tiles or grid settings, interleaved with one cuBLAS product, on a CUDA device.

    PYTHONPATH=src python tools/gpu_fwd_sweep.py [--shapes gemma2-2b,llama3-8b,16384x4096x128256] [--rounds 6]
        [--reps 3]
        --variant "" --variant "block_k=64" --variant "group=16" --variant "block_n=256,block_v=128"

Each --variant is a comma-separated list of fields of the kernels' Config (kernels/linear_head/configs.py) replaced
in the device's own tiles and set with kernels.tuning(linear_config=...); "" is the default. A variant equal to the
default (such as "block_k=64") is a null version: its distance from "" is the protocol's spread. Per shape (uniform
data, bf16), each round times the product and every variant in turn (the order reverses every other round; the GPU
runs at its power limit, so each sees the same clocks) as the median of --reps calls, and the table gives the median
over rounds and its ratio to the product. Before timing, each variant's log-probs are compared with the first
variant's.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

import logitless
from logitless.apps.bench.cases import parse_shape
from logitless.apps.bench.measure import event_ms
from logitless.kernels import linear_head as lh
from logitless.kernels import tuning


def parse_variant(text: str) -> dict:
    fields = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, _, value = item.partition("=")
        names = [f.name for f in dataclasses.fields(lh.Config)]
        if key not in names:
            raise SystemExit(f"unknown Config field {key!r}; expected one of {', '.join(names)}")
        fields[key] = value == "True" if value in ("True", "False") else int(value)
    return fields


def sweep(s, variants: list[str], base, rounds: int, reps: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(s.N, s.D, device="cuda", generator=g).bfloat16()
    w = (torch.randn(s.V, s.D, device="cuda", generator=g) * 0.02).bfloat16()
    t = torch.randint(0, s.V, (s.N,), device="cuda", generator=g)

    def run(cfg):
        with torch.no_grad(), tuning(linear_config=cfg):
            return logitless.linear_log_probs(x, w, t, backend="triton")

    fns = {"product": lambda: x @ w.T}
    first = None
    for v in variants:
        cfg = base.replace(**parse_variant(v))
        out = run(cfg)
        first = out if first is None else first
        print(f"{s.name} {v or 'default'!r}: largest difference to the first variant {(out - first).abs().max():.3g}")
        fns[v or "default"] = lambda cfg=cfg: run(cfg)
    keys = list(fns)
    times = {k: [] for k in keys}
    for r in range(rounds):
        for k in keys if r % 2 == 0 else keys[::-1]:
            times[k].append(statistics.median(event_ms(fns[k])[0] for _ in range(reps)))
    mm = statistics.median(times["product"])
    cells = [f"{k} {statistics.median(times[k]):.2f} ({statistics.median(times[k]) / mm:.3f})" for k in keys[1:]]
    print(f"{s.name}: product {mm:.2f} ms; " + "; ".join(cells), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="gemma2-2b,llama3-8b", help="preset names or NxDxV, comma-separated")
    ap.add_argument("--variant", action="append", default=None, help="Config fields to replace (repeatable)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    variants = a.variant if a.variant is not None else [""]
    base = lh.config_for(torch.empty(1, device="cuda", dtype=torch.bfloat16))
    print(f"device {torch.cuda.get_device_name()}; default tiles {base}")
    for name in a.shapes.split(","):
        sweep(parse_shape(name), variants, base, a.rounds, a.reps)

if __name__ == "__main__":
    main()
