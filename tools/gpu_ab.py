"""A/B timing of versions of the kernels on a CUDA device, interleaved so that all see the same clocks.

    mkdir old && git archive REV src/logitless/kernels | tar -x -C old    # another revision's kernels package
    PYTHONPATH=src python tools/gpu_ab.py --old old/src/logitless/kernels [--shapes gemma2-2b,...] [--rounds 6]
        [--reps 5] [--json FILE] [--set stash_logits=False ...] [--also OTHER_KERNELS_DIR ...] [--cases fwdbwd]
        [--softcap 30]
    PYTHONPATH=src python tools/gpu_ab.py --kernels cross_entropy --old old/src/logitless/kernels [--rounds 6]

A version is a kernels package (the folder src/logitless/kernels of some revision) with a kernels.Tuning. The
package is swapped under the public functions, which holds for revisions whose backends looked their launchers up
through the package at each call; today's backends import them by name, so to time against a revision from since,
compare whole revisions in processes of their own with tools/gpu_ab_src.py. "A" is the
package given by --old, "B" the package's own; each --set adds a version C, D, ... of the package's own kernels with
Tuning fields changed (comma-separated name=value, e.g. "stash_logits=False,scratch_bytes=0"), and each --also
another package, named on after them (linear_head only). Without --old (linear_head), A is the package's own and the
--set versions are B, C, ... (Revisions whose kernels registered themselves with the dispatcher on import load too.)
The GPU runs at its power limit under these kernels, so a version timed in its own loop right after another sees
different clocks; here each round times A, B, ... in order or in reverse (the order alternates), at one shape on the
same tensors. Even so, two-version runs have read 2-3% against the second version for changes that were null kernel
by kernel: for differences that small, add a null version (a --set of a field to its default value) and compare
against its spread. Per shape (uniform data, bf16): one cuBLAS product x @ W.T, no-grad log-probs, the forward
(loss, no grad) and forward + backward (gradients of the mean loss w.r.t. input and weight; --cases picks). Each
entry is the median over rounds of a median of --reps calls. Before timing, each version's loss, log-probs and
gradients are compared with A's (largest difference relative to A's largest entry; the two may sum in different
orders).

--kernels cross_entropy: bf16 logits ~ N(0, 4) at 16384 x 128256 and 8192 x 256000; the launchers are called
directly: the forward alone (statistics and loss) and the in-place path (forward, then the gradient written over
the logits), next to a device-to-device copy of the logits; B's loss and gradient are compared with A's first.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import importlib.util
import json
import os
import statistics
import sys

import torch
import triton
from gpu_linear import SHAPES, head_steps  # tools/, next to this file

import logitless._dispatch
import logitless.kernels
from logitless import kernels
from logitless.apps.bench import data
from logitless.apps.bench.measure import event_ms

MODULE = "logitless.kernels.linear_head"
CE_SHAPES = ((16384, 128256), (8192, 256000))
CE_OPTS = dict(ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None)


def load_old(path: str, kernels_name: str = "linear_head"):
    """logitless.kernels.<kernels_name> of another kernels package (a folder), loaded as a sibling package of the
    package's own kernels (logitless.kernels_ab<n>), so that its relative imports resolve."""
    if not hasattr(logitless._dispatch, "register_triton_op"):  # revisions whose kernels registered on import
        logitless._dispatch.register_triton_op = lambda op: None
    name = f"logitless.kernels_ab{sum(m.startswith('logitless.kernels_ab') for m in sys.modules)}"
    spec = importlib.util.spec_from_file_location(name, os.path.join(path, "__init__.py"),
                                                  submodule_search_locations=[path])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules[name] = pkg
    spec.loader.exec_module(pkg)
    return importlib.import_module(f"{name}.{kernels_name}")


def use(version) -> None:
    # The public functions import the launchers through the package on every call (linear_cross_entropy._kernels).
    mod, _ = version
    sys.modules[MODULE] = mod
    logitless.kernels.linear_head = mod


def tuned(version):
    """The version's Tuning, current for a block."""
    return kernels.tuning(version[1])


def median_ms(fn, reps: int) -> float:
    fn()  # warm-up (and, the first time, compilation)
    return statistics.median(event_ms(fn)[0] for _ in range(reps))


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / a.float().abs().max().clamp_min(1e-30)).item()


def run_shape(shape: str, versions: dict, rounds: int, reps: int, cases=("logp", "fwd", "fwdbwd"),
              softcap=None) -> dict:
    N, D, V = SHAPES[shape] if shape in SHAPES else (int(n) for n in shape.split("x"))
    head = data.uniform(N, D, V, device="cuda")
    fwd, logp, fwdbwd = head_steps(head.input, head.weight, head.target, softcap=softcap)

    out = {}
    names = list(versions)
    first = None
    for name, version in versions.items():
        use(version)
        with tuned(version):
            # (the gradients only where they are timed: a revision's backward may not take today's arguments)
            got = (logp(), *(fwdbwd() if {"fwd", "fwdbwd"} & set(cases) else ()))
        if first is None:
            first = got
        else:  # each version against A
            names = ("logp", "loss", "dx", "dw")
            out[f"diff {name}"] = {k: rel_diff(u, v) for k, u, v in zip(names, first, got, strict=False)}
        del got
    del first
    steps = [c for c in (("logp", logp), ("fwd", fwd), ("fwdbwd", fwdbwd)) if c[0] in cases]
    times = {(name, case): [] for name in versions for case, _ in steps}
    mm = []
    for r in range(rounds):
        mm.append(median_ms(lambda: head.input @ head.weight.T, reps))
        for name in names if r % 2 == 0 else names[::-1]:
            use(versions[name])
            with tuned(versions[name]):
                for case, fn in steps:
                    times[name, case].append(median_ms(fn, reps))
    out["mm_ms"] = statistics.median(mm)
    for (name, case), v in times.items():
        out[f"{name} {case}_ms"] = statistics.median(v)
        out[f"{name} {case}_spread"] = (min(v), max(v))
    for case, _ in steps:
        for name in names[1:]:
            out[f"{case} {name}/A"] = out[f"{name} {case}_ms"] / out[f"A {case}_ms"]
        for name in names:
            out[f"{name} {case}/mm"] = out[f"{name} {case}_ms"] / out["mm_ms"]
    return out


def run_ce_shape(N: int, V: int, versions: dict, rounds: int, reps: int) -> dict:
    x = (torch.randn(N, V, device="cuda") * 2).to(torch.bfloat16)
    t = torch.randint(0, V, (N,), device="cuda")
    y = torch.empty_like(x)
    out, outputs = {}, {}
    for name, (mod, tune) in versions.items():
        y.copy_(x)
        with kernels.tuning(tune):
            loss = mod.cross_entropy_fwd(y, t, None, None, None, write_grad=True, **CE_OPTS)[0]
        outputs[name] = (loss, y.clone())
    (la, ga), (lb, gb) = outputs.values()
    out["diff"] = {"loss": rel_diff(la, lb), "grad": rel_diff(ga, gb)}
    del outputs, la, ga, lb, gb
    names = list(versions)
    times = {(name, case): [] for name in names for case in ("stats", "inplace")}
    copy = []
    for r in range(rounds):
        copy.append(median_ms(lambda: y.copy_(x), reps))
        for name in names if r % 2 == 0 else names[::-1]:
            mod, tune = versions[name]
            with kernels.tuning(tune):
                times[name, "stats"].append(median_ms(
                    lambda mod=mod: mod.cross_entropy_fwd(x, t, None, None, None, write_grad=False, **CE_OPTS), reps))
                # y holds gradients after the first call: the same work on finite values
                times[name, "inplace"].append(median_ms(
                    lambda mod=mod: mod.cross_entropy_fwd(y, t, None, None, None, write_grad=True, **CE_OPTS), reps))
    out["copy_ms"] = statistics.median(copy)
    for (name, case), v in times.items():
        out[f"{name} {case}_ms"] = statistics.median(v)
        out[f"{name} {case}_spread"] = (min(v), max(v))
    for case in ("stats", "inplace"):
        out[f"{case} B/A"] = out[f"B {case}_ms"] / out[f"A {case}_ms"]
        for name in names:
            out[f"{name} {case}/copy"] = out[f"{name} {case}_ms"] / out["copy_ms"]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", default="linear_head", choices=("linear_head", "cross_entropy"))
    ap.add_argument("--old", default=None,
                    help="another kernels package, the folder src/logitless/kernels of some revision (linear_head: "
                         "without it, A is the package's own and only the --set / --also versions are compared)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="preset names or NxDxV, comma-separated")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--also", action="append", default=[],
                    help="another kernels package folder (repeatable; named after the --set versions)")
    ap.add_argument("--set", action="append", default=[],
                    help="another version: the package's own kernels with kernels.Tuning fields set, e.g. "
                         "stash_logits=False (repeatable; named C, D, ...)")
    ap.add_argument("--cases", default="logp,fwd,fwdbwd", help="what to time (linear_head): logp, fwd, fwdbwd")
    ap.add_argument("--softcap", type=float, default=None, help="the calls' softcap (linear_head)")
    a = ap.parse_args()
    dev = torch.cuda.get_device_properties(0)
    print(f"device {dev.name}; torch {torch.__version__}, triton {triton.__version__}", flush=True)
    res = {"device": dev.name, "torch": torch.__version__, "triton": triton.__version__}
    if a.kernels == "cross_entropy":
        if a.old is None:
            ap.error("--kernels cross_entropy needs --old")
        if a.set or a.also:
            ap.error("--set and --also are for --kernels linear_head only")
        import logitless.kernels.cross_entropy as new_ce

        versions = {"A": (load_old(a.old, a.kernels), kernels.Tuning()), "B": (new_ce, kernels.Tuning())}
        for N, V in CE_SHAPES:
            r = run_ce_shape(N, V, versions, a.rounds, a.reps)
            res[f"{N}x{V}"] = r
            print(f"{N}x{V}: copy {r['copy_ms']:.3f} ms; " + "; ".join(
                f"{c} A {r[f'A {c}_ms']:.3f} B {r[f'B {c}_ms']:.3f} (B/A {r[f'{c} B/A']:.3f}, B/copy "
                f"{r[f'B {c}/copy']:.2f})" for c in ("stats", "inplace")) + f"; diff {r['diff']}", flush=True)
            torch.cuda.empty_cache()
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)
        return
    import logitless.kernels.linear_head as new

    default = kernels.Tuning()
    versions = {"A": (new, default)}
    if a.old is not None:
        versions = {"A": (load_old(a.old), default), "B": (new, default)}
    for spec in a.set:
        # C, D, ... (B, C, ... without --old): the package's own kernels with Tuning fields set
        name = chr(ord("A") + len(versions))
        fields = {}
        for item in spec.split(","):
            key, value = item.split("=")
            fields[key] = ast.literal_eval(value)
        versions[name] = (new, dataclasses.replace(default, **fields))
        res[f"version {name}"] = spec
    for path in a.also:
        name = chr(ord("A") + len(versions))
        versions[name] = (load_old(path), default)
        res[f"version {name}"] = path
    cases = a.cases.split(",")
    try:
        for shape in a.shapes.split(","):
            r = run_shape(shape, versions, a.rounds, a.reps, cases, a.softcap)
            res[shape] = r
            print(f"{shape}: mm {r['mm_ms']:.2f} ms; " + "; ".join(
                f"{c} " + " ".join(f"{n} {r[f'{n} {c}_ms']:.2f}" for n in versions)
                + " (" + ", ".join(f"{n}/A {r[f'{c} {n}/A']:.3f}" for n in list(versions)[1:]) + ")"
                for c in cases)
                + "; " + "; ".join(f"diff {n} {r[f'diff {n}']}" for n in list(versions)[1:]), flush=True)
            torch.cuda.empty_cache()
    finally:
        use((new, default))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
