"""The row-chunk plan against the column plan and the peers, fwd+bwd of the mean loss (bf16), in one process.

    PYTHONPATH=src python tools/gpu_row_chunks.py [--shapes 8192x4096x128256,...] [--data lm,uniform] [--rounds 5]
        [--reps 3] [--json FILE] [--no-compile] [--no-liger]

Versions of linear_cross_entropy (backend="triton"): "column" (Tuning.row_chunks=False: today's plan, the stash),
"default" (the policy), "rows" (Tuning.row_chunks=True: the row-chunk plan wherever the budget allows it); peers:
torch.compile of F.linear + F.cross_entropy, Liger's fused linear cross-entropy at its default and at
chunk_mem_const=8 (its documented chunk-size setting) when liger_kernel imports, and the floor: the three cuBLAS
products (logits, dz W, dz^T x) that every 3-product plan runs. First each version's loss and gradients on the
first `--check-rows` rows are compared with float64 (rel_err) next to PyTorch's own bf16 error (the precision rule),
and the versions' full-batch gradients with the column plan's. Then rounds of interleaved timing (each round times
every version in turn, the order alternating): the median over rounds of a median of --reps calls, and each
version's peak memory above its inputs and gradients.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics

import torch
import torch.nn.functional as F

import logitless
from logitless import kernels, testing
from logitless.apps.bench import data
from logitless.apps.bench.check import rel_err
from logitless.apps.bench.measure import event_ms
from logitless.kernels.linear_head import plans

SHAPES = ("8192x4096x128256", "16384x4096x128256", "8192x2560x262144", "16384x3584x151655", "16384x768x50257")


def _ours(mode):
    def fn(x, w, t):
        with kernels.tuning(row_chunks=mode):
            return logitless.linear_cross_entropy(x, w, t, backend="triton")
    return fn


def _compiled():
    import torch._dynamo as dynamo

    dynamo.config.automatic_dynamic_shapes = False
    for knob in ("cache_size_limit", "recompile_limit"):
        if hasattr(dynamo.config, knob):
            setattr(dynamo.config, knob, max(64, getattr(dynamo.config, knob)))
    compiled = torch.compile(lambda x, w, t: F.cross_entropy(F.linear(x, w).float(), t))

    def fn(x, w, t):
        dynamo.maybe_mark_dynamic(x, 0)
        dynamo.maybe_mark_dynamic(t, 0)
        return compiled(x, w, t)
    return fn


def _liger(chunk_mem_const):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return lambda x, w, t: liger_fused_linear_cross_entropy(x, w, t, chunk_mem_const=chunk_mem_const)


def _floor(x, w, t):
    # The vocabulary padded to a multiple of 8 (cuBLAS's fast path; zero rows) outside the timing: _FLOOR_W.
    wp = _FLOOR_W.get(id(w), w)
    z = x @ wp.t()
    dx = z @ wp
    dw = z.t() @ x
    return dx, dw


_FLOOR_W: dict = {}


def _step(fn, x, w, t):
    """One fwd+bwd; the gradients are left in x.grad / w.grad."""
    x.grad = w.grad = None
    if fn is _floor:
        return _floor(x, w, t)
    loss = fn(x, w, t)
    loss.backward()
    return loss


def _grads(fn, x, w, t):
    xo, wo = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = fn(xo, wo, t)
    loss.backward()
    return loss.detach(), xo.grad, wo.grad


def check(name, fn, x, w, t, rows):
    """Relative errors of loss, d_input, d_weight on the first `rows` rows, against float64, with PyTorch's bf16."""
    xs, ts = x[:rows], t[:rows]
    ours = _grads(fn, xs, w, ts)
    theirs = _grads(lambda a, b, c: testing.naive_linear_cross_entropy(a, b, c, upcast=False), xs, w, ts)
    truth = _grads(testing.naive_linear_cross_entropy, xs.double(), w.double(), ts)
    out = {}
    for k, o, p, r in zip(("loss", "d_input", "d_weight"), ours, theirs, truth, strict=True):
        e, ep = rel_err(o, r), rel_err(p, r)
        out[k] = dict(ours=e, torch=ep, ratio=e / ep if ep > 0 else float("inf"))
    print(f"  check {name:>13}: " + "  ".join(f"{k} {v['ours']:.2e}/{v['torch']:.2e} ({v['ratio']:.2f}x)"
                                              for k, v in out.items()), flush=True)
    return out


def peak_mib(fn, x, w, t):
    torch.cuda.synchronize()
    x.grad = w.grad = None
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = _step(fn, x, w, t)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    grads = out if fn is _floor else (x.grad, w.grad)
    held = sum(g.untyped_storage().nbytes() for g in grads if g is not None)
    del out, grads
    x.grad = w.grad = None
    return (peak - held) / 2**20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--data", default="lm,uniform")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--check-rows", type=int, default=2048)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-liger", action="store_true")
    a = ap.parse_args()
    dev = torch.device("cuda")
    versions = {"column": _ours(False), "default": _ours(None), "rows": _ours(True)}
    if not a.no_compile:
        versions["compile"] = _compiled()
    if not a.no_liger:
        try:
            versions["liger"] = _liger(1)
            versions["liger-c8"] = _liger(8)
        except ImportError as e:
            print("liger not available:", e)
    versions["floor"] = _floor
    env = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=__import__("triton").__version__,
               logitless=logitless.__version__)
    try:
        from importlib.metadata import version

        import liger_kernel  # noqa: F401
        env["liger_kernel"] = version("liger-kernel")
    except Exception:  # noqa: BLE001
        pass
    print(env, flush=True)
    results = []
    for kind in a.data.split(","):
        for shape in a.shapes.split(","):
            N, D, V = (int(s) for s in shape.split("x"))
            make = data.lm_like if kind == "lm" else data.uniform
            head = make(N, D, V, dtype=torch.bfloat16, device=dev, seed=0)
            x = head.input.detach().requires_grad_()
            w = head.weight.detach().requires_grad_()
            t = head.target
            _FLOOR_W.clear()
            if V % 8:
                _FLOOR_W[id(w)] = torch.nn.functional.pad(w.detach(), (0, 0, 0, 8 - V % 8))
            plan = plans.row_chunk_plan(N, V, D, torch.bfloat16, True, None)
            with kernels.tuning(row_chunks=True):
                forced = plans.row_chunk_plan(N, V, D, torch.bfloat16, True, None)
            print(f"{kind} {shape}: policy plan {plan}, forced {forced}", flush=True)
            rec = dict(data=kind, N=N, D=D, V=V, plan=None if plan is None else plan._asdict(),
                       forced=None if forced is None else forced._asdict(), check={}, vs_column={}, ms={}, mib={})
            ref = None
            for name, fn in versions.items():
                if name == "floor":
                    continue
                try:
                    rec["check"][name] = check(name, fn, x.detach(), w.detach(), t, min(N, a.check_rows))
                    _, gx, gw = _grads(fn, x.detach(), w.detach(), t)
                    if ref is None:
                        ref = (gx, gw)
                    else:
                        rec["vs_column"][name] = [rel_err(gx, ref[0].float()), rel_err(gw, ref[1].float())]
                    del gx, gw
                except Exception as e:  # noqa: BLE001 - a peer that fails is reported, not fatal
                    print(f"  {name} failed: {type(e).__name__}: {e}"[:300], flush=True)
                    rec["check"][name] = str(e)[:300]
            del ref
            torch.cuda.empty_cache()
            live = {k: v for k, v in versions.items() if not isinstance(rec["check"].get(k), str)}
            for name, fn in live.items():  # warm-up (compilation, autotuning) and memory
                for _ in range(2):
                    _step(fn, x, w, t)
                rec["mib"][name] = peak_mib(fn, x, w, t)
            times = {k: [] for k in live}
            order = list(live)
            for r in range(a.rounds):
                for name in (order if r % 2 == 0 else order[::-1]):
                    fn = live[name]
                    reps = [event_ms(functools.partial(_step, fn, x, w, t))[0] for _ in range(a.reps)]
                    times[name].append(statistics.median(reps))
                    x.grad = w.grad = None
            rec["ms"] = {k: statistics.median(v) for k, v in times.items()}
            rec["ms_rounds"] = times
            print("  " + "  ".join(f"{k} {v:.2f} ms ({rec['mib'][k]:.0f} MiB)" for k, v in rec["ms"].items()),
                  flush=True)
            results.append(rec)
            if a.json:  # after every case: a run stopped at its time limit keeps what it measured
                with open(a.json, "w") as f:
                    json.dump(dict(env=env, rounds=a.rounds, reps=a.reps, results=results), f, indent=1)
            del x, w, t, head
            torch.cuda.empty_cache()
    print("\nfwd+bwd ms (peak MiB above inputs and gradients)")
    names = list(versions)
    print(f"{'data':8} {'shape':>20} " + " ".join(f"{n:>16}" for n in names))
    for rec in results:
        cells = [f"{rec['ms'][n]:7.2f} ({rec['mib'][n]:5.0f})" if n in rec["ms"] else f"{'-':>16}" for n in names]
        print(f"{rec['data']:8} {rec['N']}x{rec['D']}x{rec['V']:>7} " + " ".join(f"{c:>16}" for c in cells))


if __name__ == "__main__":
    main()
