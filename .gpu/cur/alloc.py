import statistics, torch, logitless
from logitless.bench import data
for (N, D, V) in ((8192, 768, 50257), (16384, 768, 50257)):
    head = data.make_head("lm", N, D, V, dtype=torch.bfloat16, device="cuda", seed=0)
    x = head.input.detach().requires_grad_(True); w = head.weight.detach().requires_grad_(True); t = head.target
    def run(ws):
        x.grad = w.grad = None
        logitless.linear_cross_entropy(x, w, t, backend="triton", workspace_bytes=ws).backward()
    for ws in (None, 4 * N * D + (256 << 20)):
        run(ws)
    for pad_mib in (0, 1, 7, 64):
        torch.cuda.empty_cache()
        pad = torch.empty((pad_mib << 20) + 4096, dtype=torch.uint8, device="cuda")
        for name, ws in (("default", None), ("ws", 4 * N * D + (256 << 20))):
            run(ws); torch.cuda.synchronize()
            s0 = torch.cuda.memory_stats()
            ts = []
            for _ in range(5):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record(); run(ws); e1.record(); torch.cuda.synchronize(); ts.append(e0.elapsed_time(e1))
            s1 = torch.cuda.memory_stats()
            d = {k: s1.get(k, 0) - s0.get(k, 0) for k in ("num_device_alloc", "num_device_free", "segment.all.allocated", "num_alloc_retries", "num_sync_all_streams")}
            print(N, pad_mib, name, f"{statistics.median(ts):.2f} ms", d, "reserved MiB", s1["reserved_bytes.all.current"] >> 20, flush=True)
        del pad
    # the same with expandable segments is a process-wide setting: not here
