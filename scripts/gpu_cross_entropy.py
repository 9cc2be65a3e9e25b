"""Cross-entropy on existing bf16 logits, forward + backward, on a CUDA device: logitless (in place and not),
Liger-Kernel, QuACK (when installed), PyTorch eager; time, bandwidth, ratio to a device-to-device copy of the same
logits measured in the same run, and peak extra memory.

    PYTHONPATH=src python scripts/gpu_cross_entropy.py [--shapes 16384x128256,8192x256000] [--variants] [--json F]

Data: the "lm" synthetic head of logitless.bench.data (D = 512), logits = hidden @ W.T in bf16, mean reduction,
no ignored tokens. Every provider is checked first (loss against a float32 chunked reference, the gradient of the
first 64 rows against float64) and is not timed if the check fails. Time: CUDA events around forward + backward,
median of the repetitions; before each repetition, outside the timed region, the logits are restored from a
pristine copy (in-place providers overwrite them). GB/s counts one read and one write of the logits. Peak extra:
torch.cuda.max_memory_allocated() during forward + backward above what was allocated before (logits, pristine copy,
targets); a gradient returned in a new buffer counts. --variants also times the in-place forward kernel alone (one
launch: statistics, and the gradient a few MiB of logits behind them) under other tile shapes (columns per tile,
warps, tiles per program) and a two-launch in-place variant (statistics, then the gradient in a second launch).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F

import logitless
from logitless.bench import data
from logitless.bench.check import rel_err as rel
from logitless.bench.measure import event_ms
from logitless.kernels import cross_entropy as kce


def median_ms(fn, restore, reps):
    """Median of CUDA-event times of fn() over reps, restore() before each outside the timed region; peak MB."""
    times, peaks = [], []
    for _ in range(reps):
        restore()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ms, out = event_ms(fn)
        times.append(ms)
        peaks.append((torch.cuda.max_memory_allocated() - base) / 2**20)
        del out
    return statistics.median(times), max(peaks)


def reference_loss(logits, target):
    """Mean cross-entropy in float32, a few rows at a time."""
    total = torch.zeros((), device=logits.device, dtype=torch.float64)
    for i in range(0, logits.shape[0], 512):
        z = logits[i:i + 512].float()
        total += (torch.logsumexp(z, -1) - z.gather(1, target[i:i + 512, None])[:, 0]).double().sum()
    return (total / logits.shape[0]).item()


def grad_truth(rows, target, n):
    z = rows.double()
    g = torch.softmax(z, -1)
    g[torch.arange(z.shape[0], device=z.device), target] -= 1.0
    return g / n




def providers():
    out = {
        "logitless inplace": lambda x, t: logitless.cross_entropy(x, t, inplace_backward=True, backend="triton"),
        "logitless": lambda x, t: logitless.cross_entropy(x, t, backend="triton"),
    }
    try:
        from liger_kernel.transformers import LigerCrossEntropyLoss

        liger = LigerCrossEntropyLoss()
        out["liger-kernel"] = lambda x, t: liger(x, t)
    except Exception as exc:  # noqa: BLE001
        print(f"liger-kernel not available: {type(exc).__name__}: {exc}")
    try:
        from quack.cross_entropy import cross_entropy as quack_ce

        out["quack"] = lambda x, t: quack_ce(x, t)
    except Exception as exc:  # noqa: BLE001
        print(f"quack not available: {type(exc).__name__}: {exc}")
    out["torch eager (bf16)"] = lambda x, t: F.cross_entropy(x, t)
    out["torch eager (fp32 upcast)"] = lambda x, t: F.cross_entropy(x.float(), t)
    return out


def run_shape(N, V, reps, variants, rows):
    dev = torch.device("cuda")
    head = data.lm_like(N, 512, V, dtype=torch.bfloat16, device=dev, seed=0)
    pristine = (head.input @ head.weight.T).contiguous()
    target = head.target.contiguous()
    del head
    nbytes = pristine.numel() * pristine.element_size()
    work = torch.empty_like(pristine).requires_grad_(True)

    def restore():
        with torch.no_grad():
            work.copy_(pristine)

    copy_ms, _ = median_ms(lambda: work.detach().copy_(pristine), lambda: None, reps)
    gbs = lambda ms: 2 * nbytes / ms / 1e6
    rows.append(dict(shape=f"{N}x{V}", provider="device-to-device copy", ms=copy_ms, gbs=gbs(copy_ms), ratio=1.0,
                     peak_mb=0.0, check="-"))
    ref = reference_loss(pristine, target)
    g64 = grad_truth(pristine[:64], target[:64], N)
    for name, fn in providers().items():
        def step(fn=fn):
            loss = fn(work, target)
            (g,) = torch.autograd.grad(loss, work)
            return loss, g

        try:
            restore()
            loss, g = step()
            e_loss = abs(loss.item() - ref) / abs(ref)
            e_grad = rel(g[:64], g64)
            ok = e_loss < 5e-3 and e_grad < 2e-2  # bf16-level errors pass
            check = f"loss {e_loss:.1e} grad {e_grad:.1e}"
            del loss, g
            if not ok:
                rows.append(dict(shape=f"{N}x{V}", provider=name, ms=float("nan"), gbs=float("nan"),
                                 ratio=float("nan"), peak_mb=float("nan"), check="FAILED " + check))
                continue
            ms, peak = median_ms(step, restore, reps)
        except torch.OutOfMemoryError as exc:
            torch.cuda.empty_cache()
            rows.append(dict(shape=f"{N}x{V}", provider=name, ms=float("nan"), gbs=float("nan"), ratio=float("nan"),
                             peak_mb=float("nan"), check=f"OOM {str(exc)[:60]}"))
            continue
        rows.append(dict(shape=f"{N}x{V}", provider=name, ms=ms, gbs=gbs(ms), ratio=ms / copy_ms, peak_mb=peak,
                         check=check))
        torch.cuda.empty_cache()

    if variants:
        scale = torch.full((), 1.0 / N, device=dev)
        opts = dict(ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None)
        x = work.detach()

        def fused(cfg):
            return lambda: kce.cross_entropy_fwd(x, target, None, None, scale, write_grad=True, config=cfg, **opts)

        def two_launch(cfg):
            def f():
                _, _, stats = kce.cross_entropy_fwd(x, target, None, None, scale, write_grad=False, config=cfg,
                                                    **opts)
                return kce.cross_entropy_bwd(None, x, target, None, None, scale, stats, x, config=cfg, **opts)
            return f

        C = kce.Config
        cands = [("one launch 8192 w8 t4", fused(C(1, 8192, 8, 4))),
                 ("one launch 8192 w8 t2", fused(C(1, 8192, 8, 2))),
                 ("one launch 8192 w8 t1", fused(C(1, 8192, 8, 1))),
                 ("one launch 4096 w4 t4", fused(C(1, 4096, 4, 4))),
                 ("one launch 4096 w4 t8", fused(C(1, 4096, 4, 8))),
                 ("one launch 16384 w16 t2", fused(C(1, 16384, 16, 2))),
                 ("two-launch 8192 w8", two_launch(C(1, 8192, 8, 1))),
                 ("forward only (default)", lambda: logitless.cross_entropy(x, target, backend="triton"))]
        g_ref = None
        for name, f in cands:
            restore()
            f()
            g = x[:64].clone()
            if name.startswith("forward"):
                check = "-"
            else:
                e = rel(g, g64)
                g_ref = g if g_ref is None else g_ref
                check = f"grad {e:.1e}" + ("" if e < 2e-2 else " FAILED")
                if e >= 2e-2:
                    rows.append(dict(shape=f"{N}x{V}", provider=name, ms=float("nan"), gbs=float("nan"),
                                     ratio=float("nan"), peak_mb=float("nan"), check=check))
                    continue
            ms, peak = median_ms(f, restore, reps)
            rows.append(dict(shape=f"{N}x{V}", provider=name, ms=ms, gbs=gbs(ms), ratio=ms / copy_ms, peak_mb=peak,
                             check=check))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="16384x128256,8192x256000")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--variants", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import triton

    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"python {sys.version.split()[0]}")
    rows = []
    for shape in args.shapes.split(","):
        N, V = (int(s) for s in shape.split("x"))
        run_shape(N, V, args.reps, args.variants, rows)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"\n{'shape':>13} {'provider':<28} {'ms':>8} {'GB/s':>7} {'x copy':>7} {'peak MB':>9}  check")
    for r in rows:
        print(f"{r['shape']:>13} {r['provider']:<28} {r['ms']:8.3f} {r['gbs']:7.0f} {r['ratio']:7.2f} "
              f"{r['peak_mb']:9.0f}  {r['check']}")


if __name__ == "__main__":
    main()
