"""Compile every Triton kernel specialisation that logitless launches, for a given GPU architecture, without a GPU,
and check its shared memory against that architecture's limit.

    python tools/compile_check.py --arch 80,86,89,90 [--shapes "300,64,1100;70,48,300"] [--dtypes bf16,fp16,fp32]

A kernel whose tiles need more shared memory than the GPU has fails at its first launch with Triton's
OutOfResources; this finds that before a user does. Step 1 runs, in a subprocess with TRITON_INTERPRET=1, the public
functions on CPU tensors with the configuration a GPU of that architecture gets (`linear_head.gpu_config`,
`two_heads.arch_config`), and records every launch (kernel, argument types, constants, warps, stages):
linear_cross_entropy forward and backward (plain and with every option), linear_log_probs with entropy,
linear_logsumexp, cross_entropy in place and not, and the two-head losses (both KL directions, the JSD).
Step 2 compiles each distinct specialisation with `triton.compile` for sm_<arch> and prints its shared memory,
registers and spills (from the bundled cuobjdump). Exit status 1 if any kernel fails to compile or needs more
shared memory than the architecture allows. Compiling takes ~5-30 s per specialisation.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile

# Shared memory a block may use (opt-in maximum, bytes), by compute capability.
SMEM_LIMIT = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448, 120: 101376}


# ---------------------------------------------------------------------------------------------------------------
# Step 1: record the launches (runs under the interpreter)


def _arg_type(v):
    """Triton signature type of a launch argument, its divisibility-by-16 hint, or ("constexpr", value)."""
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor

    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64",
             torch.int64: "i64", torch.int32: "i32", torch.uint8: "u8", torch.int8: "i8", torch.bool: "i1"}
    if isinstance(v, TensorDescriptor):
        return f"tensordesc<{names[v.base.dtype]}[{', '.join(str(b) for b in v.block_shape)}]>", False
    if isinstance(v, torch.Tensor):
        return "*" + names[v.dtype], v.data_ptr() % 16 == 0
    if isinstance(v, bool):
        return "i1", False
    if isinstance(v, int):
        if v == 1:  # Triton specialises an integer argument equal to 1 as a constant (unit strides)
            return ("constexpr", 1), False
        return ("i32" if -(2**31) <= v < 2**31 else "i64"), v % 16 == 0
    if isinstance(v, float):
        return "fp32", False
    return ("constexpr", v), False


def record(shapes, dtypes, configs, two_configs) -> list:
    import torch
    import triton.runtime.interpreter as interp

    import logitless
    from logitless import kernels
    from logitless.apps.bench.cases import DTYPES
    from logitless.kernels import linear_head as lh

    seen, out = set(), []
    original = interp.InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        fn = self.fn  # the undecorated Python function
        params = inspect.signature(fn).parameters
        values = dict(zip(params, args, strict=False))  # (defaults fill the rest)
        values.update({k: v for k, v in kwargs.items() if k in params})
        sig, const, div = {}, {}, []
        for name, p in params.items():
            v = values.get(name, p.default)
            if "constexpr" in str(p.annotation):
                sig[name] = "constexpr"
                const[name] = v
                continue
            t, d = _arg_type(v)
            if isinstance(t, tuple):
                sig[name] = "constexpr"
                const[name] = t[1]
            else:
                sig[name] = t
                if d:
                    div.append(name)
        # The interpreter's stand-ins (bf16 products and rounding, tanh) are not what a GPU compiles.
        for flag in ("UPCAST", "INTERPRET"):
            if flag in const:
                const[flag] = False
        entry = dict(module=fn.__module__, name=fn.__name__, sig=sig, const=const, div=div,
                     num_warps=kwargs.get("num_warps", 4), num_stages=kwargs.get("num_stages", 3))
        key = json.dumps(entry, sort_keys=True, default=str)
        if key not in seen:
            seen.add(key)
            out.append(entry)
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    interp.InterpretedFunction.run = run
    gen = torch.Generator().manual_seed(0)
    for dt_name in dtypes:
        dt = DTYPES[dt_name]
        with kernels.tuning(linear_config=lh.Config(**configs[dt_name]),
                            two_heads_config=lh.Config(**two_configs[dt_name])):
            record_calls(logitless, shapes, dt, gen)
    interp.InterpretedFunction.run = original
    return out


def record_calls(logitless, shapes, dt, gen) -> None:
    """Every public call whose launches record() collects, at each shape, in dtype dt."""
    import torch

    for N, D, V in shapes:
        x = (torch.randn(N, D, generator=gen) * 0.5).to(dt).requires_grad_()
        w = (torch.randn(V, D, generator=gen) * 0.5).to(dt).requires_grad_()
        b = torch.randn(V, generator=gen).to(dt).requires_grad_()
        t = torch.randint(0, V, (N,), generator=gen)
        t[::7] = -100
        cw = torch.rand(V, generator=gen) + 0.5
        kw = dict(backend="triton")
        logitless.linear_cross_entropy(x, w, t, **kw).backward()
        # a frozen head (dx only) and a frozen input (dW only): other gradient-product specialisations
        logitless.linear_cross_entropy(x, w.detach(), t, **kw).backward()
        logitless.linear_cross_entropy(x.detach(), w, t, **kw).backward()
        logitless.linear_cross_entropy(x, w, t, linear_bias=b, weight=cw, label_smoothing=0.1, z_loss=1e-4,
                                       softcap=20.0, reduction="sum", **kw).backward()
        lp, ent = logitless.linear_log_probs(x, w, t, temperature=0.7, return_entropy=True, **kw)
        (lp.sum() + ent.sum()).backward()
        with torch.no_grad():
            logitless.linear_logsumexp(x, w, **kw)
        logits = (torch.randn(N, V, generator=gen) * 3).to(dt)
        logitless.cross_entropy(logits.clone().requires_grad_(), t, **kw).backward()
        y = logits.clone().requires_grad_()
        logitless.cross_entropy(y * 1, t, inplace_backward=True, label_smoothing=0.1, z_loss=1e-4, **kw)
        # the two-head losses (a teacher of another width): both KL directions, the JSD, with and without options
        xt = (torch.randn(N, D + 8, generator=gen) * 0.5).to(dt)
        wt = (torch.randn(V, D + 8, generator=gen) * 0.5).to(dt)
        logitless.linear_kl_div(x, w, xt, wt, target=t, **kw).backward()
        logitless.linear_kl_div(x, w, xt, wt, target=t, direction="reverse", student_bias=b, softcap=20.0,
                                temperature=0.7, **kw).backward()
        logitless.linear_jsd(x, w, xt, wt, target=t, **kw).backward()


# ---------------------------------------------------------------------------------------------------------------
# Step 2: compile for the architecture


def _resources(kernel) -> tuple:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+)\s+STACK:(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else (None, None)


def compile_all(entries: list, arch: int) -> bool:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ok = True
    limit = SMEM_LIMIT.get(arch)
    for e in entries:
        fn = getattr(importlib.import_module(e["module"]), e["name"])
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in e["div"]}
        flags = ",".join(f"{k}={v}" for k, v in e["const"].items() if isinstance(v, bool) and v)
        label = f"{e['name']} warps={e['num_warps']} stages={e['num_stages']} {flags}"
        sizes = [f"{k}={v}" for k, v in e["const"].items() if k.startswith("BLOCK") or k == "TILES"]
        label += " " + " ".join(sizes)
        try:
            k = triton.compile(ASTSource(fn, e["sig"], e["const"], attrs), target=GPUTarget("cuda", arch, 32),
                               options=dict(num_warps=e["num_warps"], num_stages=e["num_stages"]))
        except Exception as err:  # noqa: BLE001 - report and go on
            print(f"  FAIL compile: {label}: {str(err).splitlines()[-1][:300]}", flush=True)
            ok = False
            continue
        smem = k.metadata.shared
        regs, stack = _resources(k)
        over = limit is not None and smem > limit
        ok &= not over
        print(f"  {'OVER' if over else 'ok  '} smem {smem / 1024:6.1f} KiB (limit {limit / 1024 if limit else '?'})"
              f" regs {regs} stack {stack}: {label}", flush=True)
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="80,86,90", help="compute capabilities, e.g. 80,86,89,90")
    ap.add_argument("--shapes", default="300,64,1100;70,48,300", help="N,D,V;... (small: run by the interpreter)")
    ap.add_argument("--dtypes", default="bf16,fp16,fp32")
    ap.add_argument("--replace", default="{}", help='JSON of Config fields to try instead, e.g. {"block_v": 128}')
    ap.add_argument("--record-python", default=sys.executable,
                    help="the Python that records the launches (another Triton's interpreter, if this one's fails)")
    ap.add_argument("--record", default=None, help=argparse.SUPPRESS)  # internal: step 1 in the subprocess
    a = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    if a.record is not None:
        args = json.loads(a.record)
        print(json.dumps(record(args["shapes"], args["dtypes"], args["configs"], args["two_configs"])))
        return
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        # The kernels must import as compilable functions here: run again without the interpreter.
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        sys.exit(subprocess.run([sys.executable, *sys.argv], env=env).returncode)
    from logitless.apps.bench.cases import DTYPES
    from logitless.kernels import linear_head as lh
    from logitless.kernels import two_heads

    shapes = [tuple(int(v) for v in s.split(",")) for s in a.shapes.split(";")]
    dtypes = a.dtypes.split(",")
    all_ok = True
    for arch in (int(v) for v in a.arch.split(",")):
        config = {d: dataclasses.asdict(lh.gpu_config(DTYPES[d], arch // 10, SMEM_LIMIT[arch])
                                        .replace(**(json.loads(a.replace) if d != "fp32" else {}))) for d in dtypes}
        print(f"sm_{arch}: configs {config}", flush=True)
        env = dict(os.environ, TRITON_INTERPRET="1")
        two = {d: dataclasses.asdict(two_heads.arch_config(DTYPES[d], arch // 10, SMEM_LIMIT[arch])) for d in dtypes}
        arg = json.dumps(dict(shapes=shapes, dtypes=dtypes, configs=config, two_configs=two))
        r = subprocess.run([a.record_python, os.path.abspath(__file__), "--record", arg], capture_output=True,
                           text=True, env=env)
        if r.returncode != 0:
            print(r.stderr[-3000:])
            sys.exit(2)
        entries = json.loads(r.stdout.strip().splitlines()[-1])
        print(f"sm_{arch}: {len(entries)} specialisations", flush=True)
        all_ok &= compile_all(entries, arch)
    print("all fit" if all_ok else "SOME KERNELS DO NOT FIT OR DO NOT COMPILE")
    sys.exit(0 if all_ok else 1)


if __name__ == "__main__":
    main()
