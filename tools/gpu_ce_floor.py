"""The memory floor of the in-place cross_entropy design, measured: its traffic alone, next to the kernel and a copy.

    PYTHONPATH=src python tools/gpu_ce_floor.py

The one-launch in-place path (kernels/cross_entropy/, LAGGED) reads each logit twice, once for the row statistics
and once, `lag` work units later, for the gradient (from L2 by then), and writes it once. `_traffic_kernel` makes
exactly those accesses, with the same work units (2 tiles of 8192 columns of one row), the same lag in units, the
same L2 hints (the first read evict_last, the second evict_first, streaming stores), and none of the arithmetic or
synchronisation: program i sums unit i, then reads unit i - lag and writes half of it back. "read once" leaves out
the second read (it writes the sum of its own tiles instead). "persistent traffic" is the traffic of a persistent
design instead (4 programs of 8 warps per SM, each re-reading its own unit of 8192 columns one step later, from
its SM's L1). Times: CUDA-event medians of 15 after one warm-up,
bf16 logits ~ N(0, 4) at 16384 x 128256 and 8192 x 256000.
"""

import statistics

import torch
import triton
import triton.language as tl

from logitless.apps.bench.measure import event_ms
from logitless.kernels import cross_entropy as kce


@triton.jit
def _traffic_kernel(x_ptr, sink_ptr, n_units, lag, V, K, BLOCK: tl.constexpr, TILES: tl.constexpr,
                    SECOND_READ: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK], tl.float32)
    if pid < n_units:
        row = pid // K
        for i in tl.static_range(TILES):
            cols = (pid % K) * (TILES * BLOCK) + i * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + row * V + cols, mask=cols < V, other=0.0, eviction_policy="evict_last")
        tl.store(sink_ptr + pid, tl.sum(acc, axis=0))
    if pid >= lag:
        u = pid - lag
        row = u // K
        for i in tl.static_range(TILES):
            cols = (u % K) * (TILES * BLOCK) + i * BLOCK + tl.arange(0, BLOCK)
            mask = cols < V
            if SECOND_READ:
                z = tl.load(x_ptr + row * V + cols, mask=mask, other=0.0, eviction_policy="evict_first")
                z = z.to(tl.float32)
            else:
                z = acc
            tl.store(x_ptr + row * V + cols, (z * 0.5).to(x_ptr.dtype.element_ty), mask=mask, cache_modifier=".cs")


@triton.jit
def _persistent_traffic_kernel(x_ptr, sink_ptr, n_units, V, K, BLOCK: tl.constexpr, TILES: tl.constexpr):
    # G resident programs; program p reads units p, p + G, ... and one step later reads its own unit again (from its
    # SM's L1) and writes it: the traffic of a persistent design that re-reads from L1 instead of L2.
    p = tl.program_id(0).to(tl.int64)
    G = tl.num_programs(0).to(tl.int64)
    n_steps = tl.cdiv(n_units - p, G)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in tl.range(0, n_steps + 1, num_stages=1):
        u = p + i * G
        if i < n_steps:
            for j in tl.static_range(TILES):
                cols = (u % K) * (TILES * BLOCK) + j * BLOCK + tl.arange(0, BLOCK)
                acc += tl.load(x_ptr + (u // K) * V + cols, mask=cols < V, other=0.0, eviction_policy="evict_last")
        if i >= 1:
            u = u - G
            for j in tl.static_range(TILES):
                cols = (u % K) * (TILES * BLOCK) + j * BLOCK + tl.arange(0, BLOCK)
                z = tl.load(x_ptr + (u // K) * V + cols, mask=cols < V, other=0.0, eviction_policy="evict_first")
                tl.store(x_ptr + (u // K) * V + cols, (z.to(tl.float32) * 0.5).to(x_ptr.dtype.element_ty),
                         mask=cols < V, cache_modifier=".cs")
    tl.store(sink_ptr + p, tl.sum(acc, axis=0))


def persistent_traffic(x: torch.Tensor, programs: int, block: int = 8192, tiles: int = 1) -> None:
    N, V = x.shape
    K = triton.cdiv(V, block * tiles)
    sink = torch.empty(programs, device=x.device)
    _persistent_traffic_kernel[(programs,)](x, sink, N * K, V, K, BLOCK=block, TILES=tiles, num_warps=8,
                                            num_stages=1)


def traffic(x: torch.Tensor, lag_bytes: int, second_read: bool, block: int = 8192, tiles: int = 2) -> None:
    N, V = x.shape
    K = triton.cdiv(V, block * tiles)
    n_units = N * K
    lag = max(K, min(lag_bytes // (block * tiles * x.element_size()), n_units))
    sink = torch.empty(n_units, device=x.device)
    _traffic_kernel[(n_units + lag,)](x, sink, n_units, lag, V, K, BLOCK=block, TILES=tiles,
                                      SECOND_READ=second_read, num_warps=8)


def median_ms(fn, reps=15):
    fn()
    torch.cuda.synchronize()
    return statistics.median(event_ms(fn)[0] for _ in range(reps))


def run_shape(N: int, V: int) -> None:
    x = (torch.randn(N, V, device="cuda") * 2).to(torch.bfloat16)
    t = torch.randint(0, V, (N,), device="cuda")
    y = torch.empty_like(x)
    lag = kce.inplace_lag_bytes(x.device)
    opts = dict(ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None)
    copy = median_ms(lambda: y.copy_(x))
    rows = {
        "traffic, read twice": median_ms(lambda: traffic(y, lag, True)),
        "traffic, read once": median_ms(lambda: traffic(y, lag, False)),
        "traffic, read twice, 2 x the lag": median_ms(lambda: traffic(y, 2 * lag, True)),
        "persistent traffic, second read from L1": median_ms(
            lambda: persistent_traffic(y, 4 * torch.cuda.get_device_properties(y.device).multi_processor_count)),
    }
    y.copy_(x)  # finite logits for the kernel (it overwrites them with gradients: the same work each call)
    rows["in-place kernel"] = median_ms(lambda: kce.cross_entropy_fwd(y, t, None, None, None, write_grad=True, **opts))
    print(f"{N} x {V}: copy {copy:.3f} ms; " + "; ".join(f"{k} {v:.3f} ms ({v / copy:.2f} x copy)"
                                                     for k, v in rows.items()), flush=True)


def main():
    torch.manual_seed(0)
    for N, V in ((16384, 128256), (8192, 256000)):
        run_shape(N, V)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
