"""fwd+bwd of linear_cross_entropy at small heads, where the host is the bound, with and without CUDA graphs.

Variants, each timed as a training loop runs it (calls back to back, no host synchronisation between them; CUDA
events around `--reps` calls, median over `--rounds` rounds; the weight is an nn.Parameter, the hidden states an
input):
  eager        logitless.linear_cross_entropy, backend "triton"
  graph        the same call captured once into a torch.cuda.CUDAGraph, then replayed (new hidden states copied in)
  compile-ro   torch.compile(mode="reduce-overhead") of the same call: cudagraph trees, what a user would write
  torch-compile      torch.compile (default mode) of F.linear + F.cross_entropy in float32 (the bench's peer)
  torch-compile-ro   the same with mode="reduce-overhead"
  floor        the three cuBLAS products alone
Each variant's loss and gradients are compared with the eager call's on the same data first.

    PYTHONPATH=src python3 tools/gpu_graphs.py [--shapes 4096,2048,32000;8192,896,151936] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics

import torch

import logitless
from logitless import testing
from logitless.apps.bench import data


class Head(torch.nn.Module):
    def __init__(self, w, fn):
        super().__init__()
        self.weight = torch.nn.Parameter(w.clone())
        self.fn = fn

    def forward(self, x, t):
        return self.fn(x, self.weight, t)


def _ours(x, w, t):
    return logitless.linear_cross_entropy(x, w, t, backend="triton")


def _naive(x, w, t):
    return testing.naive_linear_cross_entropy(x, w, t)


def variants(x0, w0, t0):
    """name -> (step(x) -> (loss, dx, dw), needs_mark). Each step reads its own copy of the weight."""
    out = {}

    def plain(fn, name, mark=False):
        head = Head(w0, fn)

        def step(x):
            head.weight.grad = None
            xi = x.detach().requires_grad_(True)
            if mark:
                torch.compiler.cudagraph_mark_step_begin()
            loss = head(xi, t0)
            loss.backward()
            return loss.detach(), xi.grad, head.weight.grad
        out[name] = step

    plain(_ours, "eager")
    plain(torch.compile(_ours, mode="reduce-overhead", fullgraph=True), "compile-ro", mark=True)
    plain(torch.compile(_naive), "torch-compile")
    plain(torch.compile(_naive, mode="reduce-overhead"), "torch-compile-ro", mark=True)

    # By hand: one capture, then replays with the new hidden states copied into the static input.
    head = Head(w0, _ours)
    xs = x0.detach().clone().requires_grad_(True)

    def body():
        xs.grad = head.weight.grad = None
        loss = head(xs, t0)
        loss.backward()
        return loss.detach(), xs.grad, head.weight.grad
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = body()

    def replay(x, keep=head):  # the graph reads the Parameter's memory: keep it alive as long as the graph
        with torch.no_grad():
            xs.copy_(x)
        graph.replay()
        return outs
    out["graph"] = replay

    w = w0.detach()

    def floor(x):
        z = x @ w.T
        return None, z @ w, z.T @ x
    out["floor"] = floor
    return out


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1024,2048,32000;4096,2048,32000;8192,896,151936;4096,4096,128256")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{__import__('triton').__version__}; fwd+bwd ms per call (median of {args.rounds} rounds of "
          f"{args.reps} calls back to back), bf16, uniform data, every tenth target ignored")
    names = ["eager", "graph", "compile-ro", "torch-compile", "torch-compile-ro", "floor"]
    print("| N, D, V | " + " | ".join(names) + " |")
    print("| --- " * (len(names) + 1) + "|")
    for spec in args.shapes.split(";"):
        N, D, V = (int(s) for s in spec.split(","))
        head = data.make_head("uniform", N, D, V, device="cuda")
        t = head.target.clone()
        t[::10] = -100
        x = head.input.detach()
        steps = variants(x, head.weight.detach(), t)
        xs = [x, head.input.detach() * 0.5 + 0.1]
        ref = [tuple(o.clone() for o in steps["eager"](xi) if o is not None) for xi in xs]
        errs = {}
        for name in names[1:-1]:
            for i, xi in enumerate(xs * 2):  # the later calls replay
                got = steps[name](xi)
                if i >= 2:
                    e = [_rel(a, b) for a, b in zip(got, ref[i % 2], strict=True)]
                    errs[name] = [max(u, v) for u, v in zip(errs.get(name, e), e, strict=True)]
        times = {}
        for name in names:
            fn = steps[name]
            per_round = []
            for _ in range(args.rounds):
                fn(x)
                torch.cuda.synchronize()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                for _ in range(args.reps):
                    fn(x)
                e1.record()
                torch.cuda.synchronize()
                per_round.append(e0.elapsed_time(e1) / args.reps)
            times[name] = statistics.median(per_round)
        print(f"| {N}, {D}, {V} | " + " | ".join(f"{times[n]:.3g}" for n in names)
              + " |  differences from eager (loss, d_input, d_weight): "
              + ", ".join(f"{n} " + "/".join(f"{v:.1e}" for v in e) for n, e in errs.items()))
        del steps, head
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
