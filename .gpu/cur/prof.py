import sys, torch, logitless
from collections import defaultdict
from logitless.bench import data
from logitless.kernels.linear_head import plans
from logitless.kernels import linear_head as lh
N, D, V = (int(v) for v in sys.argv[1].split(","))
head = data.make_head("lm", N, D, V, dtype=torch.bfloat16, device="cuda", seed=0)
x = head.input.detach().requires_grad_(True); w = head.weight.detach().requires_grad_(True); t = head.target
for name, ws in (("default", None), ("ws", 4 * N * D + (256 << 20))):
    lay = lh.stash_layout(x, w, True, ws)
    print(name, "stash", lay, flush=True)
    def run():
        x.grad = w.grad = None
        logitless.linear_cross_entropy(x, w, t, backend="triton", workspace_bytes=ws).backward()
    for _ in range(3): run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3): run()
        torch.cuda.synchronize()
    agg = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = e.name[:60]
            agg[k][0] += 1; agg[k][1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    tot = sum(v[1] for v in agg.values()) / 3
    print(name, f"total kernel time per call {tot/1000:.2f} ms")
    for k, (n, us) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:8]:
        print(f"   {us/3/1000:7.3f} ms  {n//3:4d}x  {k}")
