"""Whether fwd+bwd time depends on where the caching allocator places the backward's buffers: per shape, the
default plan and `workspace_bytes=4 N D + 256 MiB` (and any other budgets asked for) timed after a padding
allocation of each of several sizes, the plans alternating. A ratio between two plans that holds at every placement
is the plans'; one that comes and goes is the placement's (or the clocks').

    PYTHONPATH=src python tools/gpu_placement.py [--shapes qwen-7b,gpt2,mistral-nemo,8192x768x50257] [--reps 5]
        [--plans default,ws,tenth] [--json FILE]

Plans: `default` (workspace_bytes=None), `ws` (4 N D + 256 MiB), `lean` (0), `tenth` (16 MiB or a tenth of the
bf16 logits, N V / 5 bytes), `fifth` (16 MiB or 2 N V / 5 bytes), `acc16` / `acc64` (4 N D + 16 / 64 MiB: the float32
dx accumulator and a scratch). Per placement: torch.cuda.empty_cache(), a padding
tensor of PAD MiB + 4 KiB, one warm-up call per plan, then the median of --reps calls (CUDA events around each).
Each plan's peak memory above inputs and gradients is measured once per shape. bf16, logitless.apps.bench.data "lm"
heads.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

PADS_MIB = (0, 1, 7, 64, 130, 333, 1000, 2049)


def main(argv=None):
    import logitless
    from logitless.apps.bench import data
    from logitless.apps.bench.cases import PRESETS

    shapes = {**PRESETS, "qwen-7b": (16384, 3584, 151655), "gpt2": (16384, 768, 50257)}
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="qwen-7b,gpt2,mistral-nemo")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--plans", default="default,ws")
    p.add_argument("--json", default=None, help="write the times and peaks here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; pads (MiB) {PADS_MIB}", flush=True)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "pads_mib": PADS_MIB, "shapes": {}}
    for name in args.shapes.split(","):
        N, D, V = shapes[name] if name in shapes else (int(n) for n in name.split("x"))
        head = data.make_head("lm", N, D, V, dtype=torch.bfloat16, device="cuda", seed=0)
        x = head.input.detach().requires_grad_(True)
        w = head.weight.detach().requires_grad_(True)
        t = head.target
        del head

        def run(ws, x=x, w=w, t=t):
            x.grad = w.grad = None
            logitless.linear_cross_entropy(x, w, t, backend="triton", workspace_bytes=ws).backward()

        budgets = {"default": None, "ws": 4 * N * D + (256 << 20), "lean": 0,
                   "tenth": max(16 << 20, N * V // 5), "fifth": max(16 << 20, 2 * N * V // 5),
                   "acc16": 4 * N * D + (16 << 20), "acc64": 4 * N * D + (64 << 20)}
        plans = {k: budgets[k] for k in args.plans.split(",")}
        peaks = {}
        for k, ws in plans.items():
            run(ws)
            torch.cuda.synchronize()
            x.grad = w.grad = None
            g_x, g_w = torch.empty_like(x), torch.empty_like(w)  # the gradients' bytes, held during the baseline
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            del g_x, g_w
            run(ws)
            torch.cuda.synchronize()
            peaks[k] = (torch.cuda.max_memory_allocated() - base) / 2**20
        res: dict[str, list[float]] = {k: [] for k in plans}
        for i, pad_mib in enumerate(PADS_MIB):
            torch.cuda.empty_cache()
            pad = torch.empty((pad_mib << 20) + 4096, dtype=torch.uint8, device="cuda")
            order = list(plans.items()) if i % 2 == 0 else list(plans.items())[::-1]
            for k, ws in order:
                run(ws)
                torch.cuda.synchronize()
                ts = []
                for _ in range(args.reps):
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    run(ws)
                    e1.record()
                    torch.cuda.synchronize()
                    ts.append(e0.elapsed_time(e1))
                res[k].append(statistics.median(ts))
            del pad
        print(f"{name} (N={N}, D={D}, V={V}) ms per placement (peak MiB above inputs and gradients):", flush=True)
        for k, vs in res.items():
            print(f"  {k:8s} " + " ".join(f"{v:6.2f}" for v in vs) + f"  ({peaks[k]:.0f} MiB)", flush=True)
        first = next(iter(res))
        for k in list(res)[1:]:
            ratios = [a / b for a, b in zip(res[first], res[k], strict=True)]
            print(f"  {first} / {k} " + " ".join(f"{r:5.3f}" for r in ratios), flush=True)
        out["shapes"][name] = {"shape": [N, D, V], "ms": res, "peak_mib": peaks}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
