"""Per-token precision of log-probs and entropy against float64: logitless, PyTorch on bf16 logits, PyTorch with a
float32 head (bf16 weights and hidden states upcast to float32), on a real head (docs/rl.md).

    python -m logitless.apps.bench.real --model gemma3-270m --tokens 2048 --out gemma.pt     # once (docs/data.md)
    PYTHONPATH=src python tools/precision_table.py --data-file gemma.pt [--tokens 1024] [--device cpu|cuda]
        [--json FILE]

The head is the model's own (Gemma 3 270M: V = 262144, D = 640), its hidden states on real text and the real next
tokens. Inputs are rounded to bf16 (the usual training dtype) and, on the CPU, also taken in float32; the truth is
float64 on those same rounded inputs. logitless runs its PyTorch path on the CPU and its Triton kernels on a GPU.
Prints a Markdown table: max and mean |error| per token, of the log-prob of the target and of the entropy.
"""

from __future__ import annotations

import argparse
import json

import torch

import logitless
from logitless.apps.bench import real

ROWS = 128  # rows per float64 / PyTorch block (their V-wide logits)


def _truth(x, w, t):
    """float64 log-prob of the target and entropy, per row."""
    lp, ent = [], []
    w64 = w.double()
    for i in range(0, x.shape[0], ROWS):
        z = x[i:i + ROWS].double() @ w64.T
        ls = torch.log_softmax(z, -1)
        lp.append(ls.gather(1, t[i:i + ROWS, None])[:, 0])
        ent.append(-(ls.exp() * ls).sum(-1))
    return torch.cat(lp), torch.cat(ent)


def _torch_on(x, w, t, dtype):
    """PyTorch's own log_softmax on logits of `dtype` (x @ W.T in that dtype), as an RL trainer computes them."""
    lp, ent = [], []
    w_d = w.to(dtype)
    for i in range(0, x.shape[0], ROWS):
        z = x[i:i + ROWS].to(dtype) @ w_d.T
        ls = torch.log_softmax(z, -1)
        lp.append(ls.gather(1, t[i:i + ROWS, None])[:, 0].double())
        ent.append((-(ls.exp() * ls).sum(-1)).double())
    return torch.cat(lp), torch.cat(ent)


def _err(got, ref):
    e = (got.double() - ref).abs()
    return e.max().item(), e.mean().item()


def table(x32, w32, t, device, dtypes):
    rows = []
    for name in dtypes:
        dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[name]
        x, w = x32.to(dt).to(device), w32.to(dt).to(device)
        tt = t.to(device)
        ref_lp, ref_ent = _truth(x, w, tt)
        backend = "triton" if device == "cuda" else "torch"
        with torch.no_grad():
            lp, ent = logitless.linear_log_probs(x, w, tt, return_entropy=True, backend=backend)
        cases = [(f"logitless ({backend})", lp, ent)]
        if dt != torch.float32:
            cases.append(("PyTorch, bf16 logits", *_torch_on(x, w, tt, dt)))
        cases.append(("PyTorch, float32 head" if dt != torch.float32 else "PyTorch, float32", *_torch_on(x, w, tt,
                                                                                                       torch.float32)))
        for label, a, b in cases:
            rows.append({"inputs": name, "device": device, "method": label, "logp": _err(a, ref_lp),
                         "entropy": _err(b, ref_ent)})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-file", required=True, help="a prepared real head (python -m logitless.apps.bench.real)")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    obj = real.load(a.data_file)
    w = obj["weight"]
    x, t = obj["input"][: a.tokens].float(), obj["target"][: a.tokens]
    dtypes = ("bf16", "fp32") if a.device == "cpu" else ("bf16",)
    rows = table(x, w.float(), t, a.device, dtypes)
    print(f"{obj.get('model', '?')}: V = {w.shape[0]}, D = {w.shape[1]}, {x.shape[0]} tokens, {a.device}")
    print("| inputs | method | log-prob max | log-prob mean | entropy max | entropy mean |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['inputs']} | {r['method']} | {r['logp'][0]:.2e} | {r['logp'][1]:.2e} | {r['entropy'][0]:.2e} "
              f"| {r['entropy'][1]:.2e} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": obj.get("model"), "tokens": x.shape[0], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
