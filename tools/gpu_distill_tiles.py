"""Where the two-head losses' time goes on a GPU, and a sweep of their kernels' tiles.

    python tools/gpu_distill_tiles.py --shape 8192,2304,256000
    python tools/gpu_distill_tiles.py --fwd 128,128,64,8,3 128,256,64,16,3 --dz 128,128,64,8,3

Prints, for bf16 lm-like heads (the student's and a related teacher's): one cuBLAS product of the shape (the rate a
tile kernel can hope for), the single-head forward and backward kernels, a per-kernel profile of one fwd+bwd of the
single-head cross-entropy and of the forward KL, then the two-head forward (pass 1 of the KL, both passes of the
JSD) and backward (dz kernel + cuBLAS gradient products) for each tile config given (block_n, block_v, block_k,
warps, stages; then ",f": both heads' products in one loop; ",gG": programs grouped by G token blocks). Times
are medians of CUDA-event timings; products are counted as 2 N V D FLOP each.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import logitless
from logitless import loss_math
from logitless.apps.bench import cases, data
from logitless.kernels import linear_head as lh
from logitless.kernels import tuning, two_heads

_FWD = ["128,128,64,8,4", "128,128,64,8,5", "64,256,64,8,4", "64,256,64,8,5"]
_DZ = ["128,128,64,8,4", "128,128,64,8,5", "64,256,64,8,4", "128,128,64,8,3,f"]


def _spec(spec):
    """'block_n,block_v,block_k,warps,stages[,f][,gG]' -> the five numbers, whether the heads share one loop, and
    the program group (None: the default's)."""
    parts = spec.split(",")
    group = next((int(p[1:]) for p in parts[5:] if p.startswith("g")), None)
    return tuple(int(a) for a in parts[:5]), "f" in parts[5:], group


def _ms(fn, reps):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _profile(name, fn, top=8):
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0.0)
        if t > 0:
            rows.append((t / 1000.0, e.count, e.key))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    print(f"profile {name}: {total:.2f} ms of kernels")
    for t, c, k in rows[:top]:
        print(f"    {t:8.2f} ms  x{c:<4d} {k[:90]}")


def _resources(kernel):
    # (registers, spills, shared bytes) of each compiled variant of a Triton kernel (Triton 3.x caches)
    out = []
    for cache in getattr(kernel, "device_caches", {}).values():
        for ck in cache[0].values():
            out.append((getattr(ck, "n_regs", None), getattr(ck, "n_spills", None),
                        getattr(ck.metadata, "shared", None)))
    return out


def _kinds(xs, ws, xt, wt, g, reps, rate):
    for kind in ("fkl", "rkl", "ce", "jsd"):
        def fwd(kind=kind):
            return two_heads.forward_stats(xs, ws, None, xt, wt, None, kind=kind, beta=0.5, softcap=None,
                                           inv_temp=1.0)
        st = fwd()
        _, R, t_ref, t_aux = loss_math.row_loss(kind, 0.5, loss_math.RowStats(*st))
        line = f"{kind:4s} forward {rate(_ms(fwd, reps), 4 if kind == 'jsd' else 2)}"
        for tma in (True, False):
            def bwd(kind=kind, st=st, R=R, t_ref=t_ref, t_aux=t_aux):
                return two_heads.backward(xs, ws, None, xt, wt, None, st[0], st[1], t_ref, t_aux, R, g, kind=kind,
                                          beta=0.5, softcap=None, inv_temp=1.0, need_dx=True, need_dw=True,
                                          need_db=False)
            with tuning(two_heads_dz_store_tma=tma):
                line += f" | backward dz-tma={int(tma)} {_ms(bwd, reps):8.2f} ms"
        print(line)
    print("fwd kernel (regs, spills, smem):", _resources(two_heads.kernels._two_fwd_kernel))
    print("dz kernel (regs, spills, smem):", _resources(two_heads.kernels._two_dz_kernel))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="8192,2304,256000", help="N,D,V")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--fwd", nargs="*", default=_FWD)
    ap.add_argument("--dz", nargs="*", default=_DZ)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--kinds", action="store_true", help="per kind: forward and backward at the default tiles, "
                    "with the dz kernel's descriptor store on and off, and the kernels' registers and spills")
    args = ap.parse_args()
    n, d, v = (int(a) for a in args.shape.split(","))
    head = data.make_head("lm", n, d, v, dtype=torch.bfloat16, device="cuda", seed=0)
    xt, wt = cases.teacher_for(head)
    xs, ws, t = head.input, head.weight, head.target
    prod = 2.0 * n * v * d
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {__import__('triton').__version__}  "
          f"N={n} D={d} V={v} bf16 lm; one product = {prod / 1e12:.2f} TFLOP")

    def rate(ms, products):
        return f"{ms:8.2f} ms  {products * prod / ms / 1e9:6.0f} TFLOP/s over {products} products"

    print("cuBLAS x @ W.T          ", rate(_ms(lambda: torch.mm(xs, ws.t()), args.reps), 1))
    f1 = dict(softcap=None, inv_temp=1.0, want_smooth=False, want_entropy=False)
    print("single-head forward     ", rate(_ms(lambda: lh.forward_stats(xs, ws, None, t, None, **f1), args.reps), 1))
    m, logs, zt, _, _ = lh.forward_stats(xs, ws, None, t, None, **f1)
    A = torch.ones(n, device="cuda")
    C = -torch.ones(n, device="cuda")

    def bwd1():
        return lh.backward(xs, ws, None, t, None, m, logs, A, None, C, None, softcap=None, inv_temp=1.0,
                           need_dx=True, need_dw=True, need_db=False)

    print("single-head backward    ", rate(_ms(bwd1, args.reps), 3))
    if not args.no_profile:
        x1, w1 = xs.clone().requires_grad_(), ws.clone().requires_grad_()
        _profile("ce fwd+bwd", lambda: logitless.linear_cross_entropy(x1, w1, t).backward())
        _profile("kl forward fwd+bwd", lambda: logitless.linear_kl_div(x1, w1, xt, wt, target=t).backward())
        _profile("jsd fwd+bwd", lambda: logitless.linear_jsd(x1, w1, xt, wt, target=t).backward())
        del x1, w1
    g = torch.ones(n, device="cuda")
    if args.kinds:
        _kinds(xs, ws, xt, wt, g, args.reps, rate)
    base = two_heads.config(xs)
    st = ref_st = None
    for spec in args.fwd:
        (bn, bv, bk, warps, stages), fused, group = _spec(spec)
        cfg = base.replace(block_n=bn, block_v=bv, block_k=bk, fwd_warps=warps, fwd_stages=stages, dz_block_v=bv,
                           group=group or base.group)
        with tuning(two_heads_config=cfg, two_heads_dz=(128, 128, bk, 8, 3), two_heads_fused_k=fused):
            try:
                kl = _ms(lambda: two_heads.forward_stats(xs, ws, None, xt, wt, None, kind="fkl", beta=0.5,
                                                         softcap=None, inv_temp=1.0), args.reps)
                jsd = _ms(lambda: two_heads.forward_stats(xs, ws, None, xt, wt, None, kind="jsd", beta=0.5,
                                                          softcap=None, inv_temp=1.0), args.reps)
                got = two_heads.forward_stats(xs, ws, None, xt, wt, None, kind="fkl", beta=0.5, softcap=None,
                                              inv_temp=1.0)
                if ref_st is None:
                    ref_st = got
                diff = max((a - b).abs().max().item() for a, b in zip(got[:6], ref_st[:6], strict=True))
                print(f"two-head forward {spec:16s} kl {rate(kl, 2)}   jsd {rate(jsd, 4)}   "
                      f"max |stats - first config's| {diff:.2e}")
            except Exception as e:  # noqa: BLE001 (a config that does not compile or fit is a result too)
                print(f"two-head forward {spec:16s} failed: {type(e).__name__}: {str(e)[:120]}")
            if st is None:
                with tuning(two_heads_fused_k=False):
                    st = two_heads.forward_stats(xs, ws, None, xt, wt, None, kind="fkl", beta=0.5, softcap=None,
                                                 inv_temp=1.0)
    if st is None:
        st = two_heads.forward_stats(xs, ws, None, xt, wt, None, kind="fkl", beta=0.5, softcap=None, inv_temp=1.0)
    m_s, logs_s, m_t, logs_t = st[:4]
    ref_dx = None
    for spec in args.dz:
        dz_tiles, fused, group = _spec(spec)

        def bwd2():
            return two_heads.backward(xs, ws, None, xt, wt, None, m_s, logs_s, m_t, logs_t, st[9], g, kind="fkl",
                                      beta=0.5, softcap=None, inv_temp=1.0, need_dx=True, need_dw=True,
                                      need_db=False)

        with tuning(two_heads_config=base.replace(group=group or base.group), two_heads_dz=dz_tiles,
                    two_heads_fused_k=fused):
            try:
                t2 = _ms(bwd2, args.reps)
                dx2 = bwd2()[0].float()
                if ref_dx is None:
                    ref_dx = dx2
                diff = ((dx2 - ref_dx).norm() / ref_dx.norm()).item()
                print(f"two-head backward {spec:15s}", rate(t2, 4), f"  dx vs first config's {diff:.2e}")
            except Exception as e:  # noqa: BLE001
                print(f"two-head backward {spec:15s} failed: {type(e).__name__}: {str(e)[:120]}")


if __name__ == "__main__":
    main()
