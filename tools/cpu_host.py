"""The Triton path's own host time on a CPU: every Triton launch replaced by a no-op, GPU tiles and counts assumed.

A small head's step on a GPU is bound by the host (docs/design/host_time.md): Triton's entry for each launch and the
package's own Python around it. The second part can be measured without a GPU: this tool runs the Triton backend on
CPU tensors (Triton's interpreter selected, so that the backend takes them) with every kernel launch stubbed out, the
Hopper tile config, 132 multiprocessors and small buffers zeroed (what a kernel would have written into them is
read by later host code only as indices, which zeros keep in range). The times are of our Python and of PyTorch's
CPU ops on small tensors; they stand for the GPU host's by order of magnitude, not to the microsecond.

N is small (the token-block count sets little host work) while V and D are the real head's, so the backward walks
as many vocabulary chunks as on the GPU.

    PYTHONPATH=src python tools/cpu_host.py [--shape 1024,640,262144] [--skip 1e-3] [--calls 30] [--top 30]
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import cProfile  # noqa: E402
import io  # noqa: E402
import pstats  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402


def stub_launches():
    """Every Triton launch a no-op (the interpreter's JIT functions), new small buffers zeroed."""
    from triton.runtime import interpreter

    interpreter.InterpretedFunction.__getitem__ = lambda self, grid: (lambda *a, **k: None)
    from logitless.kernels import _common

    empty = torch.empty

    def new_buffer(*shape, **kw):
        t = empty(*shape, **kw)
        return t.zero_() if t.numel() <= (1 << 20) else t
    _common.new_buffer = new_buffer
    import logitless.kernels.linear_head.launch as launch
    import logitless.kernels.linear_head.plan_kernels as plan_kernels
    import logitless.kernels.linear_head.skip_plans as skip_plans
    for mod in (launch, plan_kernels, skip_plans):
        if hasattr(mod, "new_buffer"):
            mod.new_buffer = new_buffer


def gpu_like(sms: int):
    from logitless.kernels import _common
    from logitless.kernels.linear_head import configs

    _common.INTERPRETER_SMS_BACKWARD = sms
    _common.INTERPRETER_SMS_FORWARD = sms
    configs.INTERPRETER_SMS_BACKWARD = sms
    configs.dot_flags = lambda x: dict(DOT_PRECISION="tf32", UPCAST=False)
    return configs.hopper_config()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1024,640,262144")
    ap.add_argument("--skip", default="1e-3", help="skip_threshold of every call (a float, or none)")
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--sort", default="tottime")
    args = ap.parse_args()
    stub_launches()
    cfg = gpu_like(132)
    import logitless
    from logitless.kernels._tuning import tuning

    N, D, V = (int(s) for s in args.shape.split(","))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, generator=g).bfloat16().requires_grad_(True)
    w = (torch.randn(V, D, generator=g) * 0.02).bfloat16().requires_grad_(True)
    t = torch.randint(0, V, (N,), generator=g)
    t[::10] = -100
    skip = None if args.skip == "none" else float(args.skip)

    def call():
        x.grad = w.grad = None
        logitless.linear_cross_entropy(x, w, t, skip_threshold=skip, backend="triton").backward()

    with tuning(linear_config=cfg):
        for _ in range(3):
            call()
        s0 = time.perf_counter()
        for _ in range(args.calls):
            call()
        ms = (time.perf_counter() - s0) * 1e3 / args.calls
        print(f"shape {N},{D},{V} bf16, skip_threshold={skip}: {ms:.3f} ms of host time per fwd+bwd")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            call()
        prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats(args.sort).print_stats(args.top)
    print(s.getvalue())


if __name__ == "__main__":
    main()
