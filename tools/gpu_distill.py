"""Two-head losses on a GPU: correctness on a slice, then interleaved fwd+bwd time and peak memory next to the
single-head linear_cross_entropy of the student alone (the yardstick of docs/distill.md; also without its
forward's stash of logits, the 4 products the count assumes) and Liger's
LigerFusedLinearJSD where it is installed.

    python tools/gpu_distill.py                                   # gemma2-2b shape, bf16, lm-like heads
    python tools/gpu_distill.py --shape 8192,2304,256000 --rounds 5 --reps 3
    python tools/gpu_distill.py --tiles 128,64,64,8,3             # two-head tiles: block_n, block_v, block_k,
                                                                    # warps, stages (forward and dz kernels)
    python tools/gpu_distill.py --skip-threshold auto             # the KLs and the JSD also skipping cold pairs
                                                                    # (every call, skip_gate's break-even at 0)

Peak memory is what a call allocates above its inputs and the gradients it returns (torch.cuda's peak counter).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics

import torch

import logitless
from logitless import skip_gate, testing
from logitless.apps.bench import cases, data
from logitless.apps.bench.check import rule_line
from logitless.kernels import tuning, two_heads

_TUNED = contextlib.ExitStack()


class _Tuned:
    """A loss whose forward and backward both run under logitless.kernels.tuning(**kw) (the forward's layouts, such
    as the stash, and the backward's must agree)."""

    def __init__(self, fn, **kw):
        self.fn, self.kw = fn, kw

    def __call__(self, *args):
        with tuning(**self.kw):
            self.out = self.fn(*args)
        return self

    def backward(self):
        with tuning(**self.kw):
            self.out.backward()


def _losses(liger, skip=None):
    out = {
        "ce (student alone)": lambda x, w, xt, wt, t: logitless.linear_cross_entropy(x, w, t),
        # the yardstick of the product count (4 products): the same head without the forward's stash of logits
        "ce (no stash)": _Tuned(lambda x, w, xt, wt, t: logitless.linear_cross_entropy(x, w, t), stash_logits=False),
        "kl forward": lambda x, w, xt, wt, t: logitless.linear_kl_div(x, w, xt, wt, target=t),
        "kl reverse": lambda x, w, xt, wt, t: logitless.linear_kl_div(x, w, xt, wt, target=t, direction="reverse"),
        "jsd 0.5": lambda x, w, xt, wt, t: logitless.linear_jsd(x, w, xt, wt, target=t),
        "soft ce": lambda x, w, xt, wt, t: logitless.linear_soft_cross_entropy(x, w, xt, wt, target=t,
                                                                               reduction="mean"),
    }
    if skip is not None:
        out["kl forward skip"] = _Tuned(lambda x, w, xt, wt, t: logitless.linear_kl_div(
            x, w, xt, wt, target=t, skip_threshold=skip), skip_min_share=0.0)
        out["kl reverse skip"] = _Tuned(lambda x, w, xt, wt, t: logitless.linear_kl_div(
            x, w, xt, wt, target=t, direction="reverse", skip_threshold=skip), skip_min_share=0.0)
        out["jsd 0.5 skip"] = _Tuned(lambda x, w, xt, wt, t: logitless.linear_jsd(
            x, w, xt, wt, target=t, skip_threshold=skip), skip_min_share=0.0)
    if liger is not None:
        out["liger jsd 0.5"] = lambda x, w, xt, wt, t: liger(x, w, xt, wt, t)
    return out


_KIND = {"kl forward": ("fkl", 0.5), "kl reverse": ("rkl", 0.5), "jsd 0.5": ("jsd", 0.5), "soft ce": ("ce", 0.5),
         "liger jsd 0.5": ("jsd", 0.5), "kl forward skip": ("fkl", 0.5), "kl reverse skip": ("rkl", 0.5),
         "jsd 0.5 skip": ("jsd", 0.5)}


def _check(name, fn, x, w, xt, wt, t, rows):
    if name not in _KIND:
        return "(not checked here: tests/test_linear_cross_entropy.py)"
    kind, beta = _KIND[name]
    sl = slice(0, rows)
    failures = []

    def run(f, cast, upcast=None):
        xs = x[sl].detach().to(cast).requires_grad_()
        ws = w.detach().to(cast).requires_grad_()
        args = (xs, ws, xt[sl].to(cast), wt.to(cast), t[sl])
        out = f(*args) if upcast is None else testing.naive_two_heads(*args[:4], kind=kind, beta=beta,
                                                                       target=t[sl], upcast=upcast,
                                                                       reduction="mean")
        out.backward()
        value = out.out if isinstance(out, _Tuned) else out
        return value.detach(), xs.grad, ws.grad

    ours = run(fn, x.dtype)
    theirs = run(None, x.dtype, upcast=False)
    truth = run(None, torch.float64, upcast=True)
    parts = [rule_line(n, o, th, tr, failures) for n, o, th, tr in zip(("loss", "d_input", "d_weight"), ours,
                                                                         theirs, truth, strict=True)]
    return " ".join(parts) + (" FAILED" if failures else "")


def _time(fn, args, reps):
    x, w = args[0], args[1]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        x.grad = w.grad = None
        start.record()
        fn(*args).backward()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def _peak(fn, args):
    x, w = args[0], args[1]
    x.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn(*args).backward()
    torch.cuda.synchronize()
    grads = sum(g.numel() * g.element_size() for g in (x.grad, w.grad) if g is not None)
    x.grad = w.grad = None
    return (torch.cuda.max_memory_allocated() - base - grads) / 2**20


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="8192,2304,256000", help="N,D,V (student and teacher of one width)")
    ap.add_argument("--data", default="lm", choices=data.KINDS)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--check-rows", type=int, default=256)
    ap.add_argument("--tiles", default=None, help="block_n,block_v,block_k,warps,stages of the two-head kernels")
    ap.add_argument("--skip-threshold", default=None,
                    help='"auto" or a float: also time the KLs and the JSD with this skip_threshold')
    args = ap.parse_args()
    skip = args.skip_threshold
    if skip is not None and skip != "auto":
        skip = float(skip)
    n, d, v = (int(a) for a in args.shape.split(","))
    if args.tiles:
        bn, bv, bk, warps, stages = (int(a) for a in args.tiles.split(","))
        base = two_heads.config(torch.empty(1, device="cuda", dtype=torch.bfloat16))
        tiles = dataclasses.replace(base, block_n=bn, block_v=bv, block_k=bk, fwd_warps=warps, fwd_stages=stages,
                                    dz_block_v=bv)
        _TUNED.enter_context(tuning(two_heads_config=tiles))  # for the rest of the run
    head = data.make_head(args.data, n, d, v, dtype=torch.bfloat16, device="cuda", seed=0)
    xt, wt = cases.teacher_for(head)
    x, w, t = head.input.clone().requires_grad_(), head.weight.clone().requires_grad_(), head.target
    liger = None
    try:
        from liger_kernel.transformers import LigerFusedLinearJSD

        liger = LigerFusedLinearJSD(jsd_beta=0.5, ignore_index=-100, temperature=1.0)
    except ImportError:
        pass
    losses = _losses(liger, skip)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  shape N={n} D={d} V={v} bf16 data={args.data}"
          f"  two-head tiles {two_heads.config(x)}")
    for name, fn in losses.items():
        print(f"check {name:20s} {_check(name, fn, x, w, xt, wt, t, args.check_rows)}")
    times = {name: [] for name in losses}
    full = (x, w, xt, wt, t)
    for fn in losses.values():  # warm-up and compile
        _time(fn, full, 1)
    for _ in range(args.rounds):  # interleaved: every loss once per round
        for name, fn in losses.items():
            times[name] += _time(fn, full, args.reps)
    ref = statistics.median(times["ce (student alone)"])
    ref4 = statistics.median(times["ce (no stash)"])
    print(f"{'loss':22s} {'median ms':>10s} {'x ce':>6s} {'x ce no stash':>14s} {'peak MiB':>9s}")
    for name, fn in losses.items():
        med = statistics.median(times[name])
        print(f"{name:22s} {med:10.2f} {med / ref:6.2f} {med / ref4:14.2f} {_peak(fn, full):9.1f}")
    if skip == "auto":
        torch.cuda.synchronize()
        print(f"skipped share of the last plan: {skip_gate.last_share(w)}")


if __name__ == "__main__":
    main()
