"""Tile configurations of the cross_entropy forward kernel (statistics only) and of the in-place path.

    PYTHONPATH=src python tools/gpu_ce_tiles.py         # statistics alone, and in place, per tiling
    PYTHONPATH=src python tools/gpu_ce_tiles.py --lag   # in place: the lag in work units, and a second launch

bf16 logits ~ N(0, 4) at 16384 x 128256 and 8192 x 256000 on a CUDA device; CUDA-event medians of 15 after one
warm-up, next to a device-to-device copy of the logits timed the same way. Config(block_n, block_v, num_warps,
tiles): a forward program reads `tiles` tiles of block_n x block_v along its rows; the second launch (the gradient
pass) uses the same tiles. "loss diff" is the largest difference from the first configuration's per-row loss.
"""

import argparse
import statistics

import torch

from logitless import kernels
from logitless.apps.bench.measure import event_ms
from logitless.kernels import cross_entropy as kce


def C(block_n, block_v, num_warps, tiles):  # noqa: N802 - short for the tables below
    return kce.Config(block_n=block_n, block_v=block_v, num_warps=num_warps, tiles=tiles)


CONFIGS = [C(1, 8192, 8, 4), C(1, 8192, 8, 8), C(1, 8192, 8, 16), C(1, 16384, 16, 2), C(1, 16384, 16, 4),
           C(1, 16384, 16, 8), C(1, 32768, 16, 1), C(1, 32768, 32, 1), C(1, 4096, 4, 4), C(1, 4096, 4, 8),
           C(1, 4096, 8, 8), C(1, 2048, 4, 8), C(1, 8192, 16, 4), C(1, 8192, 4, 4)]
OPTS = dict(ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None)


def median_ms(fn, reps=15):
    fn()
    torch.cuda.synchronize()
    return statistics.median(event_ms(fn)[0] for _ in range(reps))


def run_shape(N, V):
    x = (torch.randn(N, V, device="cuda") * 2).to(torch.bfloat16)
    t = torch.randint(0, V, (N,), device="cuda")
    y = torch.empty_like(x)
    copy = median_ms(lambda: y.copy_(x))
    print(f"{N}x{V}: copy {copy:.3f} ms, default {kce.default_config(N, V, x.device)}", flush=True)
    ref = None
    for cfg in CONFIGS:
        try:
            def fwd(cfg=cfg):
                return kce.cross_entropy_fwd(x, t, None, None, None, write_grad=False, config=cfg, **OPTS)

            def in_place(cfg=cfg):  # y holds gradients after the first call: same work, finite values
                return kce.cross_entropy_fwd(y, t, None, None, None, write_grad=True, config=cfg, **OPTS)

            loss = fwd()[0]
            ref = loss if ref is None else ref
            diff = (loss - ref).abs().max().item()
            f_ms = median_ms(fwd)
            y.copy_(x)
            b_ms = median_ms(in_place)
            print(f"  {cfg}: fwd {f_ms:.3f} ms ({f_ms / copy:.2f} x copy), in place fwd+grad {b_ms:.3f} ms "
                  f"({b_ms / copy:.2f} x copy), loss diff {diff:.1e}", flush=True)
        except Exception as e:  # a configuration the compiler rejects is reported, not fatal
            print(f"  {cfg}: {repr(e)[:150]}", flush=True)


LAG_CONFIGS = [C(1, 8192, 8, 2), C(1, 8192, 8, 4), C(1, 8192, 16, 2), C(1, 4096, 8, 4), C(1, 4096, 4, 4),
               C(1, 16384, 16, 1)]
LAGS = [None, 0, 64, 128, 192, 256, 320, 384]  # work units; None: a second launch; 0 is raised to K


def run_lags(N, V):
    """In-place forward + gradient per tiling and lag; "diff" is the largest difference from the second launch's
    gradient of the same logits (the lagged pass rounds its exponent with one fused multiply-add: ~1 bf16 ulp)."""
    x = (torch.randn(N, V, device="cuda") * 2).to(torch.bfloat16)
    t = torch.randint(0, V, (N,), device="cuda")
    y = torch.empty_like(x)
    copy = median_ms(lambda: y.copy_(x))
    tune = kernels.current_tuning()
    print(f"{N}x{V}: copy {copy:.3f} ms, in-place default "
          f"{kce.default_config(N, V, x.device, tune.ce_inplace_tiles_per_program)}, "
          f"lag {kce.inplace_lag_bytes(x.device)} bytes", flush=True)
    for cfg in LAG_CONFIGS:
        ref = None
        row = []
        for lag in LAGS:
            # (None: a second launch)
            lag_bytes = None if lag is None else tune.ce_inplace_lag_bytes
            try:
                def in_place(cfg=cfg, lag=lag, lag_bytes=lag_bytes):
                    with kernels.tuning(ce_inplace_lag_bytes=lag_bytes):
                        return kce.cross_entropy_fwd(y, t, None, None, None, write_grad=True, config=cfg, lag=lag,
                                                     **OPTS)

                y.copy_(x)
                in_place()
                diff = 0.0 if ref is None else (y.float() - ref.float()).abs().max().item()
                ref = y.clone() if ref is None else ref
                ms = median_ms(in_place)
                row.append(f"{lag}: {ms:.3f}{'' if diff == 0 else f' (diff {diff:.1e})'}")
            except Exception as e:  # a configuration the compiler rejects is reported, not fatal
                row.append(f"{lag}: {repr(e)[:100]}")
        print(f"  {cfg}: " + " | ".join(row), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lag", action="store_true", help="sweep the in-place lag per tiling")
    args = ap.parse_args()
    torch.manual_seed(0)
    for N, V in ((16384, 128256), (8192, 256000)):
        run_lags(N, V) if args.lag else run_shape(N, V)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
