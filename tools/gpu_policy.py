"""The backward's memory policy on a CUDA device: fwd+bwd time and peak extra memory of linear_cross_entropy per
workspace setting, next to torch.compile and cuBLAS's products, every provider interleaved in one process.

    PYTHONPATH=src python tools/gpu_policy.py [--shapes gpt2,gemma2-2b,...|N,D,V] [--rounds 4] [--reps 3]
        [--kind lm] [--no-compile] [--json FILE]
    PYTHONPATH=src python tools/gpu_policy.py --smoke      # tiny shapes on the CPU (Triton interpreter): it runs

Per shape (bf16, logitless.apps.bench.data, "lm" by default), on the same tensors:
  lean     workspace_bytes=0: the leanest plan (8 MiB scratch, the dx accumulator in dW's last rows, second pass)
  default  workspace_bytes=None: the default policy, max(2 N V / 5, 4 N D + 16 MiB) bytes (plans.default_budget)
  borrow   (where the default buys the float32 dx accumulator its own buffer) the same budget with the accumulator
           in dW's last rows instead (Tuning.own_accumulator=False): all of the budget is scratch, with a second pass
  ws       workspace_bytes=4 N D + 256 MiB
  compile  torch.compile of the eager composition (F.linear, then F.cross_entropy in float32), as `logitless bench`
  floor3   three cuBLAS products on a stored N x V bf16 gradient: x @ W.T, dz @ W, dz.T @ x (the dense floor)
  floor4   the same plus a second x @ W.T: the products of a method that recomputes the logits instead of storing them
  floor3p  floor3 with V padded to a multiple of 64: at a V that is not a multiple of 8 (50257, 151655) cuBLAS's
           products fall off their fast path, so floor3 is no floor there; floor3p is
Each round times every provider `--reps` times, in an order that alternates between rounds (the GPU runs at its
power limit: a provider timed right after another sees other clocks); the table gives the median over all calls
(CUDA events around one call each). Peak extra memory: torch.cuda.max_memory_allocated() during one call above the
allocation before it, minus the gradients it returns (logitless.apps.bench.measure.peak_extra_mib). Before timing, the
loss of each logitless setting is compared with the lean plan's, and its gradients too (largest difference relative
to the largest entry; the settings sum in different orders, so a few ulp of bf16 are expected, not zero).
The policy's choice per shape (budget, own accumulator, scratch, stashed classes) is printed first.
Estimated at 4-5 minutes on an H100 for the seven default shapes (torch.compile compiles once per shape; not yet
run on a GPU: --smoke checks it on the CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def _shapes():
    # The bench's presets where they agree; gpt2 at the 16384 tokens, and the two shapes the bench lacks.
    from logitless.apps.bench.cases import PRESETS

    names = ("gemma2-2b", "llama3-8b", "mistral-nemo", "qwen3-small")
    return {"gpt2": (16384, 768, 50257), **{n: PRESETS[n] for n in names},
            "gemma3": (8192, 2560, 262144), "qwen-7b": (16384, 3584, 151655)}


SHAPES = _shapes()
SMOKE_SHAPES = {"tiny": (64, 40, 301)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help="names, or N,D,V; several separated by ';'")
    p.add_argument("--kind", default="lm", choices=("lm", "uniform"))
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU through the Triton interpreter")
    return p.parse_args(argv)


def shape_list(text: str, table: dict) -> list[tuple[str, tuple[int, int, int]]]:
    # "gpt2,llama3-8b" (names), "16384,3584,151655" (one N,D,V), several of either separated by ';'
    out = []
    for token in (s.strip() for s in text.split(";") if s.strip()):
        parts = [p.strip() for p in token.split(",")]
        if all(p in table for p in parts):
            out += [(p, table[p]) for p in parts]
        elif len(parts) == 3 and all(p.isdigit() for p in parts):
            out.append((token, tuple(int(p) for p in parts)))
        else:
            raise SystemExit(f"unknown shape {token!r}: names of {', '.join(table)}, or N,D,V")
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    import logitless
    from logitless import kernels, loss_math
    from logitless.apps.bench import data
    from logitless.apps.bench.measure import peak_extra_mib
    from logitless.kernels import linear_head as lh
    from logitless.kernels.linear_head import plans

    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        raise SystemExit("no CUDA device: use --smoke for the CPU check")
    dev = "cuda" if cuda else "cpu"
    shapes = shape_list(args.shapes, SHAPES) if not args.smoke else list(SMOKE_SHAPES.items())
    if args.smoke:
        args.rounds, args.reps = 1, 1
        # Tiny shapes reach every plan: a lean scratch of 32 classes, a policy of 64 KiB (the accumulator's own
        # buffer and a wider scratch).
        smoke_scratch = 64 * 32 * 2
        loss_math.POLICY_MIN_BYTES = 64 << 10

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def timed_ms(fn) -> float:
        if cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            torch.cuda.synchronize()
            return e0.elapsed_time(e1)
        t0 = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t0)

    def peak_mib(fn, inputs) -> float:
        if cuda:
            return peak_extra_mib(fn, inputs)
        from logitless.apps.bench.measure import _cpu_peak, output_bytes

        peak, out = _cpu_peak(fn)
        return (peak - output_bytes(out, inputs)) / 2**20

    compiled = None
    if not args.no_compile:
        from logitless.apps.bench.providers import by_name

        compiled = by_name()["torch-compile"].fn("train")
    print(f"device: {torch.cuda.get_device_name() if cuda else 'CPU (Triton interpreter)'}; torch {torch.__version__}"
          f"; data {args.kind}, bf16; {args.rounds} rounds x {args.reps} calls per provider", flush=True)
    rows = []
    t_start = time.perf_counter()
    def run_shape(name, N, D, V):
        head = data.make_head(args.kind, N, D, V, dtype=torch.bfloat16, device=dev, seed=0)
        x0, w0, t = head.input, head.weight, head.target
        del head
        x = x0.detach().requires_grad_(True)
        w = w0.detach().requires_grad_(True)
        ws_big = 4 * N * D + (256 << 20)
        budget = plans.default_budget(N, V, D, 2)
        plan = plans._workspace(N, V, D, 2, None)
        lay = lh.stash_layout(x, w, True, None) if cuda else None
        lay0 = lh.stash_layout(x, w, True, 0) if cuda else None
        print(f"{name} (N={N}, D={D}, V={V}): policy budget {budget / 2**20:.0f} MiB (4ND = {4 * N * D / 2**20:.0f}"
              f" MiB): own accumulator {plan.own_acc}, scratch up to {plan.scratch / 2**20:.0f} MiB; stashed classes"
              f" lean {lay0.classes if lay0 else 0}, default {lay.classes if lay else 0}", flush=True)

        def lce(ws, **knobs):
            def run():
                x.grad = w.grad = None
                with kernels.tuning(**knobs):
                    logitless.linear_cross_entropy(x, w, t, backend="triton", workspace_bytes=ws).backward()
                return x.grad, w.grad
            return run

        def run_compile():
            x.grad = w.grad = None
            compiled(x, w, t).backward()
            return x.grad, w.grad

        Vp = -(-V // 64) * 64
        xd, wd = x0.detach(), w0.detach()
        dz = torch.randn(N, V, device=dev, dtype=torch.bfloat16) * 1e-3
        wp = torch.nn.functional.pad(wd, (0, 0, 0, Vp - V)) if Vp != V else None
        dzp = torch.nn.functional.pad(dz, (0, Vp - V)) if Vp != V else None

        def floor(k, ww, zz):
            def run():
                for _ in range(k - 2):
                    xd @ ww.T
                zz @ ww
                zz.T @ xd
            return run

        provs = {"lean": lce(0), "default": lce(None), "ws": lce(ws_big)}
        if plan.own_acc:  # the default budget with the accumulator in dW's last rows instead, all of it scratch
            provs["borrow"] = lce(None, own_accumulator=False)
        if compiled is not None:
            provs["compile"] = run_compile
        provs["floor3"] = floor(3, wd, dz)
        provs["floor4"] = floor(4, wd, dz)
        if wp is not None:
            provs["floor3p"] = floor(3, wp, dzp)
        # Checks (and the first call of each: compilation) before anything is timed.
        grads = {}
        checked = [k for k in ("lean", "default", "ws", "borrow") if k in provs]
        for k in checked:
            gx, gw = provs[k]()
            grads[k] = (gx.detach().clone(), gw.detach().clone())
        diffs = {}
        for k in checked[1:]:
            diffs[k] = max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
                           for a, b in zip(grads[k], grads["lean"], strict=True))
        # (in grad mode, as timed: torch.compile would compile a no-grad graph of its own)
        losses = {k: logitless.linear_cross_entropy(x, w, t, backend="triton", workspace_bytes=ws).item()
                  for k, ws in (("lean", 0), ("default", None), ("ws", ws_big))}
        if compiled is not None:
            losses["compile"] = compiled(x, w, t).item()
        del grads
        x.grad = w.grad = None
        mem = {}
        for k, fn in provs.items():
            fn()  # warm-up (compiles)
            sync()
            if not k.startswith("floor"):
                x.grad = w.grad = None
                mem[k] = peak_mib(fn, (x, w, t))
                x.grad = w.grad = None
        times = {k: [] for k in provs}
        order = list(provs)
        for r in range(args.rounds):
            for k in order if r % 2 == 0 else order[::-1]:
                for _ in range(args.reps):
                    times[k].append(timed_ms(provs[k]))
                x.grad = w.grad = None
        med = {k: statistics.median(v) for k, v in times.items()}
        row = dict(shape=name, N=N, D=D, V=V, budget_mib=budget / 2**20, own_acc=plan.own_acc, ms=med, peak_mib=mem,
                   grad_diff_vs_lean=diffs, loss=losses, stash_classes={"lean": lay0.classes if lay0 else 0,
                                                                       "default": lay.classes if lay else 0})
        rows.append(row)
        fl = min(med["floor3"], med.get("floor3p", float("inf")))
        print("  " + "  ".join(f"{k} {v:.3g} ms" + (f" ({mem[k]:.3g} MiB)" if k in mem else "")
                               for k, v in med.items()), flush=True)
        print(f"  default / lean {med['default'] / med['lean']:.3f}, default / ws {med['default'] / med['ws']:.3f}"
              + (f", default / compile {med['default'] / med['compile']:.3f}" if "compile" in med else "")
              + f", default / floor {med['default'] / fl:.3f}; grads vs lean: "
              + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items())
              + "; losses " + " ".join(f"{k} {v:.5f}" for k, v in losses.items()), flush=True)
    with kernels.tuning(scratch_bytes=smoke_scratch if args.smoke else kernels.current_tuning().scratch_bytes):
        for name, (N, D, V) in shapes:
            run_shape(name, N, D, V)
            if cuda:
                torch.cuda.empty_cache()
    cols = ["lean", "default", "borrow", "ws", "compile", "floor3", "floor4", "floor3p"]
    print("\n| shape (N, D, V) | " + " | ".join(cols) + " | default / lean | default / ws | default / compile |"
          " default / floor |")
    print("| --- " * (len(cols) + 5) + "|")
    for r in rows:
        med, mem = r["ms"], r["peak_mib"]
        cells = [(f"{med[c]:.3g}" + (f" ({mem[c]:.3g})" if c in mem else "")) if c in med else "-" for c in cols]
        fl = min(med["floor3"], med.get("floor3p", float("inf")))
        ratios = [med["default"] / med["lean"], med["default"] / med["ws"],
                  med["default"] / med["compile"] if "compile" in med else float("nan"), med["default"] / fl]
        print(f"| {r['shape']} ({r['N']}, {r['D']}, {r['V']}) | " + " | ".join(cells) + " | "
              + " | ".join(f"{q:.2f}" for q in ratios) + " |")
    print(f"\nms (peak MiB above inputs and gradients); floor = min(floor3, floor3p); "
          f"total {time.perf_counter() - t_start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
