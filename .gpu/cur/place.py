"""Does fwd+bwd time depend on where the allocator places buffers? Per shape, per padding allocation, median of
default and ws, alternating."""
import statistics, sys, torch
import logitless
from logitless.bench import data
from logitless.bench.cases import PRESETS
shapes = {"qwen-7b": (16384, 3584, 151655), "gpt2": (16384, 768, 50257), "mistral-nemo": PRESETS["mistral-nemo"]}
sel = sys.argv[1].split(",") if len(sys.argv) > 1 else list(shapes)
pads = [0, 1, 7, 64, 130, 333, 1000, 2049]  # MiB + 4 KiB
for name in sel:
    N, D, V = shapes[name]
    head = data.make_head("lm", N, D, V, dtype=torch.bfloat16, device="cuda", seed=0)
    x = head.input.detach().requires_grad_(True); w = head.weight.detach().requires_grad_(True); t = head.target
    def run(ws):
        x.grad = w.grad = None
        logitless.linear_cross_entropy(x, w, t, backend="triton", workspace_bytes=ws).backward()
    wsb = 4 * N * D + (256 << 20)
    run(None); run(wsb); torch.cuda.synchronize()
    res = {}
    for p in pads:
        torch.cuda.empty_cache()
        pad = torch.empty((p << 20) + 4096, dtype=torch.uint8, device="cuda")
        for k, ws in (("default", None), ("ws", wsb)) if p % 2 == 0 else (("ws", wsb), ("default", None)):
            run(ws); torch.cuda.synchronize()
            ts = []
            for _ in range(5):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record(); run(ws); e1.record(); torch.cuda.synchronize()
                ts.append(e0.elapsed_time(e1))
            res.setdefault(k, []).append(statistics.median(ts))
        del pad
    print(name, {k: " ".join(f"{v:.1f}" for v in vs) for k, vs in res.items()}, flush=True)
