"""The dz kernel of one vocabulary chunk, both launch forms, next to cuBLAS's product of the same shape.

    PYTHONPATH=src python tools/gpu_dz.py [--shapes 16384x1024x8192,8192x2304x8192,...] [--rounds 7] [--json FILE]

Per shape N x D x c (tokens, features, classes of the chunk): bf16 x and W, the row statistics of those logits, a
cross-entropy's per-row coefficients; `_dz_kernel` (the hopper config's tiles) with one program per tile and pointer
stores, and with the persistent grid whose dz the copy engine stores (Config.dz_persistent); and `torch.mm(x, W.T)`
with a bf16 output, the same product with its result written. The two dz outputs must be bitwise equal. Each round
times every variant in a loop of 10 calls (CUDA events), the order alternating; the median over rounds is printed.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def time_shape(shape: str, cfg, sms: int, rounds: int) -> dict:
    """Times the two dz launches and the cuBLAS product at one N x D x c; returns the row."""
    import triton

    from logitless.kernels.linear_head import backward_kernels as bk
    from logitless.kernels.linear_head import configs

    dev = torch.device("cuda")
    bn, bv, bk_ = cfg.block_n, cfg.dz_block_v, cfg.block_k
    N, D, c = (int(v) for v in shape.split("x"))
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(N, D, device=dev, dtype=torch.bfloat16, generator=g)
    w = (torch.randn(c, D, device=dev, generator=g) / D**0.5).to(torch.bfloat16)
    z = x.float() @ w.float().T
    m = z.max(1).values
    logs = torch.logsumexp(z - m[:, None], 1)
    del z
    t = torch.randint(0, c, (N,), device=dev, generator=g)
    coef = torch.full((N,), 1.0 / N, device=dev)
    ld = (c + 7) // 8 * 8
    xd = configs.descriptor(x, [bn, bk_])
    wd = configs.descriptor(w, [bv, bk_])
    n_tiles = triton.cdiv(N, bn) * triton.cdiv(c, bv)
    bufs = {}

    def launch(persistent, dz):
        n_progs = min(n_tiles, sms) if persistent else n_tiles
        dz_desc = configs.descriptor(dz, [bn, bv]) if persistent else None
        bk._dz_kernel[(n_progs,)](
            xd, wd, None, t, None, None, m, logs, coef, None, coef, None, None, dz, dz_desc, None, None, None,
            None, N, D, 0, c, 0, n_progs, 0, 0, 0, 0, dz.stride(0), 1, 0, 1.0, 1.0,
            HAS_BIAS=False, HAS_SOFTCAP=False, HAS_TEMP=False, HAS_B=False, HAS_C=True, HAS_E=False,
            HAS_CLASS_WEIGHT=False, STORE_DZ=True, HAS_DB=False, HAS_PERM=False, SKIP=False, LOAD_Z=False,
            BLOCK_N=bn, BLOCK_V=bv, BLOCK_K=bk_, GROUP=cfg.group, EVEN_K=D % bk_ == 0, DOT_PRECISION="tf32",
            UPCAST=False, USE_TMA=True, HAS_AT=False, FINE_SLOPE=False, HALF_TANH=True, DZ_TMA=persistent,
            PERSISTENT=persistent, num_warps=cfg.fwd_warps, num_stages=cfg.fwd_stages)

    for name in ("per_tile", "persistent"):
        bufs[name] = torch.empty(N, ld, device=dev, dtype=torch.bfloat16)[:, :c]
    y = torch.empty(N, c, device=dev, dtype=torch.bfloat16)
    fns = {"per_tile": lambda: launch(False, bufs["per_tile"]),
           "persistent": lambda: launch(True, bufs["persistent"]),
           "cublas_mm": lambda: torch.mm(x, w.T, out=y)}
    for f in fns.values():
        f()
    torch.cuda.synchronize()
    equal = bool(torch.equal(bufs["per_tile"], bufs["persistent"]))
    times = {k: [] for k in fns}
    for r in range(rounds):
        for k in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(10):
                fns[k]()
            e1.record()
            torch.cuda.synchronize()
            times[k].append(e0.elapsed_time(e1) / 10)
    ms = {k: statistics.median(v) for k, v in times.items()}
    print(f"{shape}: per tile {ms['per_tile']:.4f} ms, persistent {ms['persistent']:.4f} "
          f"({ms['persistent'] / ms['per_tile']:.3f} x), cuBLAS product {ms['cublas_mm']:.4f}; dz bitwise "
          f"equal: {equal}", flush=True)
    return {"shape": [N, D, c], "ms": ms, "equal": equal}


def main(argv=None):
    import triton

    from logitless.kernels.linear_head import configs

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="16384x1024x8192,8192x2304x8192,16384x4096x8192,16384x768x3328")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    dev = torch.device("cuda")
    cfg = configs.hopper_config()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    out = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "triton": triton.__version__,
           "rows": []}
    print(f"{out['device']}; torch {out['torch']}, triton {out['triton']}", flush=True)
    for shape in a.shapes.split(","):
        out["rows"].append(time_shape(shape, cfg, sms, a.rounds))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
