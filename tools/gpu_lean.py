"""The lean plan (`workspace_bytes=0`) against its bound: where its time above the bound goes, kernel by kernel.

    PYTHONPATH=src python tools/gpu_lean.py [--shapes 8192,4096,128256;8192,2560,262144;gemma2-2b]
        [--data uniform] [--rounds 5] [--json FILE]
    python tools/gpu_lean.py --dry-run        (the counts alone, on a CPU, Hopper's tiles assumed)

For each shape (N, D, V), bf16, the fwd+bwd of the mean loss with `workspace_bytes=0, skip_threshold=None`:
- the counts (docs/design/backward.md, "The bound per shape"), in products of one `x @ W.T`: the bound
  (4 - s + r) / 3 of the floor with s = D/N - D/V and r = N/V, and the plan's own count with the share s it stashes
  and the share r of classes its second pass recomputes (the dW rows that held the float32 dx accumulator);
- times (CUDA events, medians over --rounds rounds that alternate the three): one cuBLAS product `x @ W.T` ("mm"),
  the floor (the three products on a stored dz) and the lean fwd+bwd;
- the third of three fwd+bwd profiled back to back (a call alone after a synchronisation runs at the boost clock),
  its kernels sorted into the forward, the dz launches that recompute logits (first and
  second pass), those that read the stash, cuBLAS's gradient products (each attributed to the chunk whose dz launch
  came before it) and the rest (casts, sums), each next to what the count prices it at (mm's time per class; the
  stash's dz and the rest at zero): their difference is the plan's time above its count, by kernel kind; then the
  timed call's time outside its kernels (the host's latency to the first launches, idle gaps) and the largest gaps.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch



def parse_shapes(text: str) -> list[tuple[str, tuple[int, int, int]]]:
    from logitless.apps.bench.cases import PRESETS
    out = []
    for item in filter(None, text.split(";")):
        if item in PRESETS:
            out.append((item, tuple(PRESETS[item])))
        else:
            n, d, v = (int(p) for p in item.split(","))
            out.append((item, (n, d, v)))
    return out


def counts(N: int, D: int, V: int, cfg=None) -> dict:
    """The bound's and the lean plan's shares and counts (x the floor) at (N, D, V), bf16, from the planners."""
    from logitless.kernels import tuning
    from logitless.kernels.linear_head import plans
    from logitless.kernels.linear_head.configs import hopper_config
    cfg = cfg or hopper_config()
    meta = dict(device="meta", dtype=torch.bfloat16)
    x, dx, w = torch.empty(N, D, **meta), torch.empty(N, D, **meta), torch.empty(V, D, **meta)
    # The products run through cuBLAS on a GPU; on meta tensors that must be said.
    with tuning(linear_config=cfg, torch_products=True):
        lay = plans.stash_layout(x, w, True, 0)
        dw_end = plans._plan(x, dx, torch.empty_like(w), N, V, D, cfg, False, plans._workspace(N, V, D, 2, 0)).dw_end
    s_max, r_min = max(0.0, D / N - D / V), N / V
    s, r = (lay.classes / V if lay else 0.0), (V - dw_end) / V
    return dict(s_max=s_max, r_min=r_min, bound=(4 - s_max + r_min) / 3, s=s, r=r, count=(4 - s + r) / 3)


def classify(kernels: list[tuple[str, float]], rec, V: int, mm_ms: float) -> dict:
    """Kernel times by kind next to the count's price for them. kernels: (name, ms) in launch order of one fwd+bwd;
    rec: that backward's BackwardRecord. A dz launch takes the next chunk of rec.first_pass + rec.second_pass; a
    product is the chunk's whose dz launch came last."""
    chunks = [("first", v0, v1, stashed, v1 <= rec.dw_end) for v0, v1, _, stashed in rec.first_pass]
    chunks += [("second", v0, v1, False, True) for v0, v1, _ in rec.second_pass]
    per_class = mm_ms / V
    kinds = {k: dict(ms=0.0, ideal=0.0, launches=0) for k in
             ("forward", "dz stash", "dz first", "dz second", "products first", "products second", "other")}
    kinds["forward"]["ideal"] = mm_ms
    at = -1
    for name, ms in kernels:
        low = name.lower()
        if "_fwd_kernel" in low or "_combine_kernel" in low:
            kind = "forward"
        elif "_dz_kernel" in low:
            at += 1
            if at >= len(chunks):
                raise RuntimeError(f"more dz launches than the record's {len(chunks)} chunks")
            which, v0, v1, stashed, writes_dw = chunks[at]
            kind = "dz stash" if stashed else f"dz {which}"
            if not stashed:
                kinds[kind]["ideal"] += (v1 - v0) * per_class
            if which == "first":
                kinds["products first"]["ideal"] += (v1 - v0) * per_class * (2 if writes_dw else 1)
            else:
                kinds["products second"]["ideal"] += (v1 - v0) * per_class
        elif at >= 0 and any(k in low for k in ("gemm", "nvjet", "xmma", "cutlass")):
            kind = f"products {chunks[at][0]}"
        else:
            kind = "other"
        kinds[kind]["ms"] += ms
        kinds[kind]["launches"] += 1
    if at + 1 != len(chunks):
        raise RuntimeError(f"{at + 1} dz launches for the record's {len(chunks)} chunks")
    return kinds


def idle_gaps(kernels: list[tuple]) -> dict:
    """The profiled step's idle time: kernels as (start_us, name, ms, end_us) sorted by start."""
    idle, gaps, end, prev = 0.0, [], kernels[0][3], kernels[0][1]
    for i, (s, name, _, e) in enumerate(kernels[1:], 1):
        if s > end:
            idle += s - end
            gaps.append(((s - end) / 1e3, i, prev, name))
        if e > end:
            end, prev = e, name
    gaps.sort(reverse=True)
    return dict(span_ms=(end - kernels[0][0]) / 1e3, idle_ms=idle / 1e3, count=len(gaps), largest=gaps[:20])


def warm_up(seconds: float = 3.0):
    """Products for `seconds`: the first shape is timed at the clocks the others see."""
    import time
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def run_shape(label: str, N: int, D: int, V: int, kind: str, rounds: int, workspace_bytes: int | None = 0) -> dict:
    import logitless
    from logitless.apps.bench import data
    from logitless.apps.bench.measure import event_ms
    from logitless.kernels import tuning
    head = data.make_head(kind, N, D, V, device="cuda")
    x0, w0, t = head.input, head.weight, head.target
    x, w = x0.detach().clone().requires_grad_(True), w0.detach().clone().requires_grad_(True)
    dz = torch.randn(N, V, device="cuda", dtype=x.dtype) * 1e-3

    def lean():
        loss = logitless.linear_cross_entropy(x, w, t, workspace_bytes=workspace_bytes,
                                             skip_threshold=None)
        return torch.autograd.grad(loss, (x, w))

    steps = {"mm": lambda: x0 @ w0.T, "floor": lambda: (x0 @ w0.T, dz @ w0, dz.T @ x0), "lean": lean}
    for fn in steps.values():
        fn(), fn()
    times = {k: [] for k in steps}
    for _ in range(rounds):
        for k, fn in steps.items():
            times[k].append(statistics.median(event_ms(fn)[0] for _ in range(3)))
    ms = {k: statistics.median(v) for k, v in times.items()}
    del dz
    # Three calls back to back, the last one classified: a call profiled alone after a synchronisation runs at
    # the boost clock, not at the clocks the timed rounds (and a training loop) see.
    records: list = []
    with tuning(debug_backwards=records):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                lean()
            torch.cuda.synchronize()
    if not records:
        raise SystemExit(f"{label}: no column backward ran with workspace_bytes={workspace_bytes} (the row-chunk plan "
                         "takes the gradients in the forward); this tool prices the column plans")
    rec = records[-1]
    kernels = sorted((e.time_range.start, e.name, e.time_range.elapsed_us() / 1e3, e.time_range.end)
                     for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    if len(kernels) % 3:
        raise RuntimeError(f"{len(kernels)} kernels in three calls")
    kernels = kernels[2 * len(kernels) // 3:]
    kinds = classify([(n, t_) for _, n, t_, _ in kernels], rec, V, ms["mm"])
    gaps = idle_gaps(kernels)
    c = counts(N, D, V)
    res = dict(shape=label, N=N, D=D, V=V, data=kind, **{f"{k}_ms": v for k, v in ms.items()}, **c,
               measured=ms["lean"] / ms["floor"], kinds=kinds, kernel_ms=sum(k["ms"] for k in kinds.values()),
               chunks_first=len(rec.first_pass), chunks_second=len(rec.second_pass), idle_ms=gaps["idle_ms"],
               span_ms=gaps["span_ms"], gaps=gaps["largest"])
    print(f"\n{label} ({kind}): mm {ms['mm']:.2f} ms, floor {ms['floor']:.2f}, lean {ms['lean']:.2f} = "
          f"{res['measured']:.3f} x floor; count {c['count']:.3f} (s {c['s']:.3f}, r {c['r']:.3f}), bound "
          f"{c['bound']:.3f} (s {c['s_max']:.3f}, r {c['r_min']:.3f}); measured / bound {res['measured'] / c['bound']:.3f}; "
          f"chunks {len(rec.first_pass)} + {len(rec.second_pass)}")
    bound_ms = c["bound"] * ms["floor"]
    print("| kind | launches | ms | priced at | above (ms) | above, % of the bound |")
    print("| --- | --- | --- | --- | --- | --- |")
    for k, v in kinds.items():
        above = v["ms"] - v["ideal"]
        print(f"| {k} | {v['launches']} | {v['ms']:.2f} | {v['ideal']:.2f} | {above:+.2f} | {100 * above / bound_ms:+.1f} |")
    print(f"| all kernels | | {res['kernel_ms']:.2f} | {sum(v['ideal'] for v in kinds.values()):.2f} | | |")
    print(f"profiled (the third of three calls): first kernel to last {gaps['span_ms']:.2f} ms, idle "
          f"{gaps['idle_ms']:.2f} ms in {gaps['count']} gaps; timed minus its kernels "
          f"{ms['lean'] - res['kernel_ms']:.2f} ms; the largest gaps:")
    for g in gaps["largest"][:8]:
        print(f"    {g[0]:.3f} ms after #{g[1]} {g[2][:40]} -> {g[3][:40]}")
    return res


def main():
    ap = argparse.ArgumentParser()
    from logitless.apps.bench.cases import GPU_DEFAULT_PRESETS
    ap.add_argument("--shapes", default="8192,4096,128256;8192,2560,262144;" + ";".join(GPU_DEFAULT_PRESETS["train"]))
    ap.add_argument("--data", default="uniform", choices=("uniform", "lm"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workspace-bytes", default="0", help="the plan timed: 0 the lean plan (default), or another "
                    "budget whose plan is a column plan (the counts stay the lean plan's)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--dry-run", action="store_true", help="the counts alone (no GPU needed)")
    a = ap.parse_args()
    shapes = parse_shapes(a.shapes)
    if a.dry_run:
        print("| shape | s, most | r, least | bound | s, the plan's | r, the plan's | the plan's count |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for label, (N, D, V) in shapes:
            c = counts(N, D, V)
            print(f"| {label} | {c['s_max']:.3f} | {c['r_min']:.3f} | {c['bound']:.3f} | {c['s']:.3f} | {c['r']:.3f} "
                  f"| {c['count']:.3f} |")
        return
    import triton
    dev = torch.cuda.get_device_properties(0)
    print(f"device {dev.name}; torch {torch.__version__}, triton {triton.__version__}", flush=True)
    warm_up()
    out = [run_shape(label, N, D, V, a.data, a.rounds,
                     None if a.workspace_bytes == "None" else int(a.workspace_bytes)) for label, (N, D, V) in shapes]
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=dev.name, torch=torch.__version__, triton=triton.__version__, results=out), f,
                      indent=1)


if __name__ == "__main__":
    main()
