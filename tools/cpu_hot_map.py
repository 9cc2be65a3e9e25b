"""Where a skipping backward's gradient products spend their time, counted on a CPU from a real head's skip plan.

The skipping backward (docs/design/skipping.md) runs its two gradient products over the skip plan's hot (token
block, tile) pairs, chunk by chunk (`Config.skip_wide` classes), in one launch per chunk: a dx program per (token
block, column tile of D) walks the block's hot tiles of the chunk, a dW program per (128 classes, column tile, split
of the tokens) walks the tile's hot token blocks. This tool builds the plan the kernels would build (`plans.skip_plan`
on the forward's float16 tile log-sum-exps, the mean loss's coefficients, the "auto" budget of bf16) from the
prepared real head (docs/data.md), in float32 on the CPU, and counts per launch: the reduction steps (one MMA of the
Hopper tiles, 128 x 256 x 64), each program's fixed cost in steps (its accumulator's round trip, its output's store,
the pipeline's fill), and the makespan of one program per multiprocessor taken longest first. The ratio of the
dense chunk's predicted time per step to the sparse one's is the predicted rate of the sparse products, to set
against the measured one (BENCHMARKS.md).

It also counts what other shapes of the work would do: dx tiles dealt out to several programs (always, or per chunk
by its makespan), one launch over the whole vocabulary, targets as a sparse correction instead of keeping their
tile hot for the whole block (`--targets correction`: the plan with no forced target tiles), and dense loops over
each program's span of hot steps (first to last hot tile or block) instead of a list walk.

    PYTHONPATH=src python tools/cpu_hot_map.py --data-file FILE [--n 8192] [--d 640,2304] [--order mass,id]
        [--sms 132] [--unit 1] [--targets kept,correction] [--variant chunk=262144,dx_split=4 ...]
        [--per-chunk 32768]
"""

from __future__ import annotations

import argparse
import heapq
import math

import torch

from logitless.apps.bench import data
from logitless.kernels.linear_head import plans
from logitless.triton_backend import AUTO_SKIP_UNIT

BLOCK_N, BLOCK_V = 128, 256  # the plan's map (Hopper): token blocks x vocabulary tiles
BLOCK_M, BLOCK_D, BLOCK_K = 128, 256, 64  # the gradient products' tiles (Hopper)
CHUNK = 32768  # Config.skip_wide on Hopper (--chunk)


def stats(x: torch.Tensor, w: torch.Tensor, rows: int = 256):
    """(m, logs, tile_lse float16) of the logits x w^T in float32, a block of rows at a time."""
    N, V = x.shape[0], w.shape[0]
    m = torch.empty(N)
    logs = torch.empty(N)
    tiles = torch.empty(N, math.ceil(V / BLOCK_V), dtype=torch.float16)
    wt = w.float().t().contiguous()
    for i in range(0, N, rows):
        z = x[i:i + rows].float() @ wt
        mi = z.max(1).values
        m[i:i + rows] = mi
        logs[i:i + rows] = (z - mi[:, None]).exp().sum(1).log()
        pad = tiles.shape[1] * BLOCK_V - V
        zt = torch.nn.functional.pad(z, (0, pad), value=float("-inf")).view(z.shape[0], -1, BLOCK_V)
        tiles[i:i + rows] = torch.logsumexp(zt, 2).half()
    return m, logs, tiles


def makespan(costs: list[float], sms: int) -> float:
    """Programs taken longest first onto the least loaded of `sms` multiprocessors (one program each at a time)."""
    load = [0.0] * sms
    heapq.heapify(load)
    for c in sorted(costs, reverse=True):
        heapq.heappush(load, heapq.heappop(load) + c)
    return max(load)


def count(hot: torch.Tensor, D: int, sms: int, fixed_dx: float, fixed_dw: float, span: bool, chunk: int = CHUNK,
          dx_split: int = 1, deal: str = "always") -> dict:
    """Steps and predicted time (in steps of one multiprocessor) of the gradient products over `hot`
    (n_blocks x n_vtiles), chunk by chunk. span: each program loops densely from its first to its last hot step.
    dx_split: each dx tile's steps dealt out to that many programs (each with the fixed cost); deal: "always", or
    "makespan": in a chunk only where its longest dx tile is longer than the even share of all its work."""
    n_blocks, n_vtiles = hot.shape
    per_chunk = chunk // BLOCK_V
    d_tiles = math.ceil(D / BLOCK_D)
    d_use = D / (d_tiles * BLOCK_D)  # the last column tile's unused share
    steps = time = dense_steps = dense_time = 0.0
    for c0 in range(0, n_vtiles, per_chunk):
        h = hot[:, c0:c0 + per_chunk].bool()
        t = h.shape[1]
        if span:  # dx: first to last hot tile of each block; dW: first to last hot block of each tile
            idx = torch.arange(t)
            anyb = h.any(1)
            first = torch.where(h, idx, t).min(1).values
            last = torch.where(h, idx, -1).max(1).values
            dx_tiles = torch.where(anyb, last - first + 1, 0)
            idb = torch.arange(n_blocks)[:, None]
            anyt = h.any(0)
            firstb = torch.where(h, idb, n_blocks).min(0).values
            lastb = torch.where(h, idb, -1).max(0).values
            dw_blocks = torch.where(anyt, lastb - firstb + 1, 0)
        else:
            dx_tiles = h.sum(1)
            dw_blocks = h.sum(0)
        dx = [float(k) * (BLOCK_V // BLOCK_K) for k in dx_tiles.tolist()] * d_tiles
        dw = [float(k) * (BLOCK_N // BLOCK_K) for k in dw_blocks.tolist() for _ in range(BLOCK_V // BLOCK_M)] * d_tiles
        split = dx_split
        if deal == "makespan":
            # Dealt out only where the chunk's longest dx tile is longer than the even share of all its work.
            split = dx_split if max(dx) > (sum(dx) + sum(dw)) / sms else 1
        costs = [math.ceil(s / split) + fixed_dx for s in dx for _ in range(split if s else 0)]
        costs += [s + fixed_dw for s in dw if s > 0]
        steps += sum(dx) + sum(dw)
        time += makespan(costs, sms)
        full_dx = [t * (BLOCK_V // BLOCK_K) + fixed_dx] * (n_blocks * d_tiles)
        full_dw = [n_blocks * (BLOCK_N // BLOCK_K) + fixed_dw] * (t * (BLOCK_V // BLOCK_M) * d_tiles)
        dense_steps += (t * (BLOCK_V // BLOCK_K)) * n_blocks * d_tiles * 2
        dense_time += makespan(full_dx + full_dw, sms)
    return {"steps": steps * d_use, "time": time, "dense_steps": dense_steps * d_use, "dense_time": dense_time,
            # the sparse launches' useful steps per unit of time, against the dense ones'
            "rate": (steps / time) / (dense_steps / dense_time) if time else float("nan")}


def _variant(spec: str) -> dict:
    out = {"chunk": CHUNK, "dx_split": 1, "fixed_dx": 12.0, "fixed_dw": 5.0, "deal": "always"}
    for item in filter(None, spec.split(",")):
        k, v = item.split("=")
        out[k] = (v if k == "deal" else type(out[k])(float(v))) if k in out else None
        if out[k] is None:
            raise SystemExit(f"unknown variant field {k!r}; known: {sorted(out)}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-file", required=True)
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--d", default="640,2304", help="widths of D to count (the hot map does not depend on D)")
    ap.add_argument("--order", default="mass,id")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--unit", type=float, default=1.0,
                    help="the budget's unit as a multiple of the bf16 \"auto\" one (smaller: fewer pairs skipped)")
    ap.add_argument("--targets", default="kept", help="kept: target tiles stay hot; correction: not (both: kept,"
                    "correction)")
    ap.add_argument("--variant", action="append", default=None,
                    help="FIELD=V[,FIELD=V]: chunk (classes per launch), dx_split (programs each dx tile's steps "
                    "are dealt out to), fixed_dx, fixed_dw (a program's fixed cost in steps: its float32 "
                    "accumulator read and written or its output stored, the pipeline's fill), deal (always, or "
                    "makespan: per chunk, where its longest dx tile is longer than the even share of its work); "
                    "default: the kernels' (chunk=32768,dx_split=1,fixed_dx=12,fixed_dw=5)")
    ap.add_argument("--per-chunk", type=int, default=0, metavar="CLASSES",
                    help="also list, per range of CLASSES classes, the hot pairs and the share of token blocks with "
                         "no hot tile there (whose dx tiles a chunk's products neither read nor write)")
    args = ap.parse_args()
    variants = [(v, _variant(v)) for v in (args.variant or [""])]
    src = data.real_source(262144, args.data_file)
    V = src["V"]
    print(f"{src['model']}: V {V}, D {src['D']}, {src['input'].shape[0]} prepared tokens, N {args.n}; "
          f"{args.sms} multiprocessors")
    print("| order | targets | hot pairs | variant | D | steps / dense | predicted rate, list walk | predicted time / "
          "dense | spans: steps / dense | predicted rate, spans |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for order in args.order.split(","):
        head = data.real_head(args.n, src["D"], V, dtype=torch.bfloat16, data_file=args.data_file,
                              sorted_vocab=order == "mass")
        m, logs, tiles = stats(head.input, head.weight)
        A = torch.full((args.n,), 1.0 / args.n)
        for forced in (t == "kept" for t in args.targets.split(",")):
            sp = plans.skip_plan(tiles, m, logs, A, head.target if forced else None, None, V,
                                 -AUTO_SKIP_UNIT[torch.bfloat16] * args.unit, BLOCK_N, BLOCK_V, True)
            share = sp.hot.float().mean().item()
            if args.per_chunk:
                per = args.per_chunk // BLOCK_V
                for c in range(0, sp.hot.shape[1], per):
                    hb = sp.hot[:, c:c + per].bool()
                    print(f"  {order}, classes {c * BLOCK_V}-{(c + hb.shape[1]) * BLOCK_V}: {int(hb.sum())} hot pairs, "
                          f"{(hb.sum(1) == 0).float().mean().item():.0%} of the token blocks with none")
            for name, v in variants:
                for D in (int(d) for d in args.d.split(",")):
                    # the reference: the dense products in the kernels' chunks, with the kernels' fixed costs
                    ref = count(torch.ones_like(sp.hot[:, :CHUNK // BLOCK_V]), D, args.sms, 12.0, 5.0, False)
                    ref_time = ref["dense_time"] * (sp.hot.shape[1] * BLOCK_V // CHUNK)
                    kw = dict(chunk=v["chunk"], dx_split=v["dx_split"], deal=v["deal"])
                    lw = count(sp.hot, D, args.sms, v["fixed_dx"], v["fixed_dw"], False, **kw)
                    sn = count(sp.hot, D, args.sms, v["fixed_dx"], v["fixed_dw"], True, **kw)
                    print(f"| {order} | {'kept hot' if forced else 'a correction'} | {share:.1%} | {name or 'kernels'}"
                          f" | {D} | {lw['steps'] / lw['dense_steps']:.3f} | {lw['rate']:.2f} | "
                          f"{lw['time'] / ref_time:.3f} | "
                          f"{sn['steps'] / sn['dense_steps']:.3f} | {sn['rate']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
