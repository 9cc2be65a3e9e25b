"""Vocabulary-parallel ops over NCCL, one process per GPU: correctness against one GPU and float64, and timing.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src \\
        torchrun --nproc-per-node 2 tools/gpu_distributed.py [--reps 10] [--check-rows 2048] [--kinds lm,uniform]
        [--shape llama3-8b] [--json FILE]

(`python3 -m torch.distributed.run` in place of `torchrun` where the launcher is not on PATH.)

The script sets those three variables itself too, before NCCL starts: NVLink multicast stays off.

Every rank holds the same input and targets and an uneven contiguous block of the classifier's rows (V % P rows
go to the first ranks). In bfloat16:
1. options check (N=2048, D=1024, V=50257, "lm" data, 10% ignored tokens), for backend "triton" and "torch":
   linear_cross_entropy with bias, class weights, label smoothing, z-loss and softcap; linear_log_probs with the
   entropy (temperature 0.9, softcap, random upstream gradients); linear_logsumexp. Loss / outputs and d_input,
   d_weight (this rank's rows), d_bias against float64 under the precision rule (ours <= 2 x PyTorch-in-bf16 error
   + 1e-6), and every rank's outputs bitwise equal;
2. full shape (--shape, default llama3-8b = 16384 x 4096 x 128256): on the first --check-rows tokens (full D, V)
   the loss, d_input and d_weight against float64 under the rule; on all tokens the loss and gradients against the
   single-GPU Triton result (relative difference);
3. timing (CUDA events, median of --reps after 2 warm-ups, the slowest rank's): forward (loss, no grad) and
   forward + backward (autograd.grad of the mean loss w.r.t. input and weight) split over the P GPUs, next to the
   same call on one GPU with the whole weight; the collectives alone (the statistics all-gather and the float32
   all-reduce of d_input); peak extra memory per GPU.
Prints a short table at the end (rank 0); --json writes the numbers. --smoke runs the same code on CPU processes
over gloo at tiny shapes (the Triton kernels through the interpreter), to check the script itself:
    PYTHONPATH=src torchrun --nproc-per-node 2 tools/gpu_distributed.py --smoke
"""

from __future__ import annotations

import os
import sys

SMOKE = "--smoke" in sys.argv
if SMOKE:  # before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Before anything can start NCCL: NVLink multicast (NVLS, symmetric-memory multicast) stays off.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import logitless  # noqa: E402
import logitless.distributed  # noqa: E402
import logitless.shards  # noqa: E402
from logitless import testing  # noqa: E402
from logitless.apps.bench import data  # noqa: E402
from logitless.apps.bench.check import rel_err as rel  # noqa: E402
from logitless.apps.bench.check import rule_line as rule  # noqa: E402
from logitless.apps.bench.measure import event_ms, peak_extra_mib  # noqa: E402

SHAPES = {
    "llama3-8b": (16384, 4096, 128256),
    "gemma2-2b": (8192, 2304, 256000),
    "qwen3-small": (16384, 1024, 151936),
    "smoke": (96, 48, 1001),
}
DEVICE = "cpu" if SMOKE else "cuda"


def empty_cache():
    if not SMOKE:
        torch.cuda.empty_cache()


def log0(*a):
    if dist.get_rank() == 0:
        print(*a, flush=True)


def rows_of(V, P, r):
    base, extra = divmod(V, P)
    start = r * base + min(r, extra)
    return start, start + base + (1 if r < extra else 0)






def leaf(t):
    return None if t is None else t.detach().clone().requires_grad_(True)


def same_on_all_ranks(t):
    t = t.detach().reshape(-1).contiguous()
    allt = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(allt, t)
    return all(torch.equal(torch.nan_to_num(a), torch.nan_to_num(t)) for a in allt)


def broadcast_head(head):
    for t in (head.input, head.weight, head.target):
        dist.broadcast(t, src=0)
    return head


def grads_of(out, ins, upstream=None):
    ins = [t for t in ins if t is not None]
    return torch.autograd.grad(out, ins, grad_outputs=upstream)


# ---------------------------------------------------------------------------------------------------------------
# 1. Every option at a small shape.


def check_options(backend):
    P, r = dist.get_world_size(), dist.get_rank()
    N, D, V = (64, 32, 1001) if SMOKE else (2048, 1024, 50257)
    head = broadcast_head(data.lm_like(N, D, V, device=DEVICE, seed=1))
    g = torch.Generator(device=DEVICE).manual_seed(2)
    x, w, t = head.input, head.weight, head.target.clone()
    t[torch.rand(N, device=DEVICE, generator=g) < 0.1] = -100
    b = (torch.randn(V, device=DEVICE, generator=g) * 0.5).to(torch.bfloat16)
    cw = torch.rand(V, device=DEVICE, generator=g) + 0.5
    for tt in (x, w, t, b, cw):
        dist.broadcast(tt, src=0)
    s0, s1 = rows_of(V, P, r)
    pg = dist.group.WORLD
    failures, parts = [], []
    ce_opts = dict(label_smoothing=0.1, z_loss=1e-4, softcap=30.0)

    res = {}
    for name in ("ours", "bf16", "f64"):
        dt = torch.float64 if name == "f64" else None
        xl, wl, bl = (leaf(a.to(dt) if dt else a) for a in (x, w, b))
        if name == "ours":
            loss = logitless.linear_cross_entropy(xl, wl[s0:s1], t, linear_bias=bl[s0:s1], weight=cw[s0:s1],
                                                  backend=backend, process_group=pg, **ce_opts)
            if not same_on_all_ranks(loss):
                failures.append("ce loss differs between ranks")
        else:
            loss = testing.naive_linear_cross_entropy(xl, wl, t, linear_bias=bl, weight=cw.to(dt or torch.float32),
                                                        upcast=name == "f64", **ce_opts)
        gx, gw, gb = grads_of(loss, (xl, wl, bl))
        res[name] = (loss.detach(), gx, gw[s0:s1], gb[s0:s1])
        del xl, wl, bl, loss, gx, gw, gb
    for i, q in enumerate(("ce_loss", "ce_d_input", "ce_d_weight", "ce_d_bias")):
        parts.append(rule(q, res["ours"][i], res["bf16"][i], res["f64"][i], failures))

    up1 = torch.randn(N, device=DEVICE, generator=g, dtype=torch.float64)
    up2 = torch.randn(N, device=DEVICE, generator=g, dtype=torch.float64)
    dist.broadcast(up1, src=0)
    dist.broadcast(up2, src=0)
    lp_opts = dict(temperature=0.9, softcap=30.0)
    res = {}
    for name in ("ours", "bf16", "f64"):
        dt = torch.float64 if name == "f64" else None
        xl, wl = (leaf(a.to(dt) if dt else a) for a in (x, w))
        if name == "ours":
            lp, en = logitless.linear_log_probs(xl, wl[s0:s1], t, return_entropy=True, backend=backend,
                                                process_group=pg, **lp_opts)
            if not (same_on_all_ranks(lp) and same_on_all_ranks(en)):
                failures.append("log-probs differ between ranks")
        else:
            lp, en = testing.naive_linear_log_probs(xl, wl, t, return_entropy=True, upcast=name == "f64",
                                                      **lp_opts)
        obj = (lp * up1.to(lp.dtype)).sum() + (en * up2.to(en.dtype)).sum()
        gx, gw = grads_of(obj, (xl, wl))
        res[name] = (lp.detach(), en.detach(), gx, gw[s0:s1])
        del xl, wl, lp, en, obj, gx, gw
    for i, q in enumerate(("logp", "entropy", "lp_d_input", "lp_d_weight")):
        parts.append(rule(q, res["ours"][i], res["bf16"][i], res["f64"][i], failures))

    res = {}
    for name in ("ours", "bf16", "f64"):
        dt = torch.float64 if name == "f64" else None
        xl, wl, bl = (leaf(a.to(dt) if dt else a) for a in (x, w, b))
        if name == "ours":
            lse = logitless.linear_logsumexp(xl, wl[s0:s1], linear_bias=bl[s0:s1], temperature=0.7,
                                             backend=backend, process_group=pg)
        else:
            lse = testing.naive_linear_logsumexp(xl, wl, linear_bias=bl, temperature=0.7, upcast=name == "f64")
        gx, gw, gb = grads_of(lse, (xl, wl, bl), up1.to(lse.dtype))
        res[name] = (lse.detach(), gx, gw[s0:s1], gb[s0:s1])
        del xl, wl, bl, lse, gx, gw, gb
    for i, q in enumerate(("lse", "lse_d_input", "lse_d_weight", "lse_d_bias")):
        parts.append(rule(q, res["ours"][i], res["bf16"][i], res["f64"][i], failures))
    return parts, failures


# ---------------------------------------------------------------------------------------------------------------
# 2. The full shape: the rule on a slice of tokens, the whole batch against one GPU.


def check_full(head, check_rows):
    P, r = dist.get_world_size(), dist.get_rank()
    x, w, t = head.input, head.weight, head.target.clone()
    t[::10] = -100
    V = w.shape[0]
    s0, s1 = rows_of(V, P, r)
    pg = dist.group.WORLD
    failures, parts = [], []
    xs, ts = x[:check_rows], t[:check_rows]
    res = {}
    for name in ("ours", "bf16", "f64"):
        dt = torch.float64 if name == "f64" else None
        xl, wl = leaf(xs.to(dt) if dt else xs), leaf(w.to(dt) if dt else w)
        if name == "ours":
            loss = logitless.linear_cross_entropy(xl, wl[s0:s1], ts, process_group=pg)
        else:
            loss = testing.naive_linear_cross_entropy(xl, wl, ts, upcast=name == "f64")
        gx, gw = grads_of(loss, (xl, wl))
        res[name] = (loss.detach(), gx, gw[s0:s1].clone())
        del xl, wl, loss, gx, gw
        empty_cache()
    for i, q in enumerate(("loss", "d_input", "d_weight")):
        parts.append(rule(q, res["ours"][i], res["bf16"][i], res["f64"][i], failures))
    del res
    # All tokens: the split result against the one-GPU result (Triton on both sides).
    xl, wl = leaf(x), leaf(w[s0:s1])
    loss = logitless.linear_cross_entropy(xl, wl, t, process_group=pg)
    gx, gw = torch.autograd.grad(loss, (xl, wl))
    xr, wr = leaf(x), leaf(w)
    ref = logitless.linear_cross_entropy(xr, wr, t)
    rx, rw = torch.autograd.grad(ref, (xr, wr))
    diffs = {"loss": rel(loss, ref), "d_input": rel(gx, rx), "d_weight": rel(gw, rw[s0:s1])}
    if not same_on_all_ranks(loss):
        failures.append("loss differs between ranks")
    return parts, diffs, failures


# ---------------------------------------------------------------------------------------------------------------
# 3. Timing.


def median_ms(fn, reps, warmup=2):
    for _ in range(warmup):
        out = fn()
        del out
    times = []
    for _ in range(reps):
        dist.barrier()
        if SMOKE:
            t0 = time.perf_counter()
            out = fn()
            times.append((time.perf_counter() - t0) * 1e3)
            del out
            continue
        torch.cuda.synchronize()
        ms, out = event_ms(fn)
        times.append(ms)
        del out
    mine = torch.tensor([statistics.median(times)], device=DEVICE)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # the step waits for the slowest rank
    return mine.item()


def peak_extra_mb(fn):
    if SMOKE:
        return float("nan")
    mine = torch.tensor([peak_extra_mib(fn)], device=DEVICE)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return mine.item()


def time_case(head, reps):
    P, r = dist.get_world_size(), dist.get_rank()
    x, w, t = head.input, head.weight, head.target
    N, D = x.shape
    V = w.shape[0]
    s0, s1 = rows_of(V, P, r)
    ws = w[s0:s1].contiguous()
    pg = dist.group.WORLD
    xl, wl, wsl = leaf(x), leaf(w), leaf(ws)

    def one_fwd():
        with torch.no_grad():
            return logitless.linear_cross_entropy(x, w, t)

    def one_fwdbwd():
        return torch.autograd.grad(logitless.linear_cross_entropy(xl, wl, t), (xl, wl))

    def tp_fwd():
        with torch.no_grad():
            return logitless.linear_cross_entropy(x, ws, t, process_group=pg)

    def tp_fwdbwd():
        return torch.autograd.grad(logitless.linear_cross_entropy(xl, wsl, t, process_group=pg), (xl, wsl))

    def tp_fwdbwd_given_layout():
        return torch.autograd.grad(logitless.distributed.linear_cross_entropy(
            xl, wsl, t, process_group=pg, vocab_start=s0, vocab_size=V), (xl, wsl))

    dx32 = torch.zeros(N, D, device=DEVICE, dtype=torch.float32)
    stats = torch.zeros(3 * N, device=DEVICE, dtype=torch.float32)
    stats_all = torch.empty(P * 3 * N, device=DEVICE, dtype=torch.float32)

    def allreduce_dx():
        dist.all_reduce(dx32, group=pg)

    def allgather_stats():
        logitless.shards._all_gather_single(stats_all, stats, group=pg)

    out = {}
    for name, fn in (("one_fwd", one_fwd), ("one_fwdbwd", one_fwdbwd), ("tp_fwd", tp_fwd),
                     ("tp_fwdbwd", tp_fwdbwd), ("tp_fwdbwd_given_layout", tp_fwdbwd_given_layout),
                     ("allreduce_dx_f32", allreduce_dx), ("allgather_stats", allgather_stats)):
        out[name + "_ms"] = median_ms(fn, reps)
    for name, fn in (("one_fwdbwd", one_fwdbwd), ("tp_fwdbwd", tp_fwdbwd)):
        out[name + "_peak_mb"] = peak_extra_mb(fn)
    out["speedup"] = out["one_fwdbwd_ms"] / out["tp_fwdbwd_ms"]
    out["efficiency"] = out["speedup"] / P
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--kinds", default="lm,uniform")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--check-rows", type=int, default=2048)
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU processes over gloo, tiny shapes")
    args = ap.parse_args()
    if SMOKE:
        args.shape, args.check_rows, args.reps = "smoke", 16, 2
        dist.init_process_group("gloo")
        device_name = "CPU (smoke run)"
    else:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        device_name = f"{torch.cuda.get_device_name()}, NCCL {torch.cuda.nccl.version()}"
    P = dist.get_world_size()
    log0(f"{P} x {device_name}, torch {torch.__version__}, NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']}, "
         f"TORCH_SYMM_MEM_DISABLE_MULTICAST={os.environ['TORCH_SYMM_MEM_DISABLE_MULTICAST']}")
    results, all_failures = {"world": P, "device": device_name}, []

    for backend in ("triton", "torch"):
        try:
            parts, failures = check_options(backend)
            log0(f"options check, backend={backend}: " + "; ".join(parts))
            results[f"options_{backend}"] = parts
            all_failures += [f"options/{backend}: {f}" for f in failures]
        except Exception:
            all_failures.append(f"options/{backend}: crashed")
            log0(traceback.format_exc())
        empty_cache()

    N, D, V = SHAPES[args.shape]
    for kind in args.kinds.split(","):
        head = broadcast_head(data.make_head(kind, N, D, V, device=DEVICE, seed=0))
        tag = f"{args.shape}/{kind}"
        try:
            parts, diffs, failures = check_full(head, args.check_rows)
            log0(f"check {tag} rows={args.check_rows}: " + "; ".join(parts))
            log0(f"  all {N} tokens vs one GPU: " + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
            results[f"check_{kind}"] = {"rule": parts, "vs_one_gpu": diffs}
            all_failures += [f"{tag}: {f}" for f in failures]
        except Exception:
            all_failures.append(f"{tag}: check crashed")
            log0(traceback.format_exc())
        empty_cache()
        try:
            results[f"time_{kind}"] = time_case(head, args.reps)
        except Exception:
            all_failures.append(f"{tag}: timing crashed")
            log0(traceback.format_exc())
        del head
        empty_cache()

    log0(f"\n{args.shape} (N, D, V) = {(N, D, V)}, bf16, fwd+bwd = autograd.grad of the mean loss w.r.t. input "
         f"and weight; times are the slowest rank's median")
    log0(f"{'data':8} {'1 GPU fwd':>10} {'1 GPU f+b':>10} {f'{P} GPU fwd':>10} {f'{P} GPU f+b':>10} "
         f"{'given lay.':>10} {'speedup':>8} {'eff.':>6} {'AR dx f32':>10} {'AG stats':>9} "
         f"{'peak 1':>8} {f'peak {P}':>8}")
    for kind in args.kinds.split(","):
        r = results.get(f"time_{kind}")
        if r:
            log0(f"{kind:8} {r['one_fwd_ms']:9.2f}ms {r['one_fwdbwd_ms']:9.2f}ms {r['tp_fwd_ms']:9.2f}ms "
                 f"{r['tp_fwdbwd_ms']:9.2f}ms {r['tp_fwdbwd_given_layout_ms']:9.2f}ms {r['speedup']:7.2f}x "
                 f"{r['efficiency']:5.0%} {r['allreduce_dx_f32_ms']:9.2f}ms {r['allgather_stats_ms']:8.2f}ms "
                 f"{r['one_fwdbwd_peak_mb']:6.0f}MB {r['tp_fwdbwd_peak_mb']:6.0f}MB")
    log0("FAILURES: " + ("; ".join(all_failures) if all_failures else "none"))
    results["failures"] = all_failures
    if args.json and dist.get_rank() == 0:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
