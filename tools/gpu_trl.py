"""TRL's fused LM head against logitless.integrations.trl on one model: peak memory and time of the log-prob pass.

Each provider runs in its own process (so that peak memory is its own): the model gets TRL's fused head
(``add_fused_lm_head`` with GRPO's outputs, log-probs and entropy), and for ``logitless`` also
``logitless.integrations.trl.patch``. Measured, on one batch of GRPO-shaped sequences (a prompt whose labels are
ignored, then a completion):
  - ``train``: the training call, ``model(..., fused_lm_head=True)`` and the backward of an advantage-weighted
    loss with an entropy bonus (forward + backward, backbone included, as the trainer runs it);
  - ``no_grad``: the reference / old-policy pass under ``torch.no_grad()``;
  - peak memory above the model, its gradients and the batch (CUDA: ``max_memory_allocated``; CPU: peak RSS);
  - the log-probs' largest difference from the other provider's (a sanity check, not the precision test).

    python tools/gpu_trl.py --model /path/to/Qwen3-0.6B --dtype bf16 --batch 8 --prompt 512 --completion 1024
    python tools/gpu_trl.py --tiny                                  # CPU check: a 2-layer model built here

Prints one JSON line per provider and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

PROVIDERS = ("trl", "logitless")


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_rss_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024
    return 0


def _model(args, device, dtype):
    import transformers

    if args.tiny:
        config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=args.prompt + args.completion)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).to(dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    return model.to(device).train()


def run_one(args) -> dict:
    from trl.trainer.utils import add_fused_lm_head

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    model = _model(args, device, dtype)
    add_fused_lm_head(model, temperature=args.temperature, outputs=("log_probs", "entropy"))
    if args.provider == "logitless":
        import logitless.integrations.trl as ltrl

        ltrl.patch(model)
    v = model.get_output_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    t = args.prompt + args.completion
    ids = torch.randint(0, v, (args.batch, t), generator=g).to(device)
    mask = torch.ones_like(ids)
    labels = ids.clone()
    labels[:, : args.prompt] = -100
    adv = torch.randn(args.batch, t - 1, generator=g).to(device)
    batch = dict(input_ids=ids, attention_mask=mask, labels=labels)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def train_step():
        out = model(**batch, fused_lm_head=True)
        ((out.log_probs * adv).sum() + 0.01 * out.entropy.sum()).backward()
        return out.log_probs.detach()

    def no_grad_pass():
        with torch.no_grad():
            return model(**batch, fused_lm_head=True).log_probs

    lp = train_step()  # warm-up (allocates the gradients), also the reference values
    no_grad_pass()
    sync()
    times = {"train": [], "no_grad": []}
    peaks = {}
    for name, fn in (("train", train_step), ("no_grad", no_grad_pass)):
        for i in range(args.repeats + 1):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            else:
                _reset_rss_peak()
                base = _rss_bytes()
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if i:  # the first repeat warms this path's caches
                times[name].append(time.perf_counter() - t0)
            peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else _peak_rss_bytes()
            peaks[name] = max(peaks.get(name, 0), peak - base)
    torch.save(lp.float().cpu(), args.save)
    return dict(provider=args.provider, device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                dtype=args.dtype, vocab=v, batch=args.batch, prompt=args.prompt, completion=args.completion,
                train_s=sorted(times["train"])[len(times["train"]) // 2],
                no_grad_s=sorted(times["no_grad"])[len(times["no_grad"]) // 2],
                train_peak_mib=peaks["train"] / 2**20, no_grad_peak_mib=peaks["no_grad"] / 2**20,
                torch=torch.__version__)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a local Hugging Face causal LM directory")
    p.add_argument("--tiny", action="store_true", help="a 2-layer Llama built here (a CPU check of this script)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary of the --tiny model")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--completion", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=0.9)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--provider", choices=PROVIDERS, help=argparse.SUPPRESS)
    p.add_argument("--save", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.provider:
        print(json.dumps(run_one(args)))
        return
    if not args.tiny and not args.model:
        p.error("give --model PATH or --tiny")
    rows, logps = [], {}
    out_dir = Path(os.environ.get("TMPDIR", "/tmp"))
    for provider in PROVIDERS:
        save = out_dir / f"gpu_trl_{os.getpid()}_{provider}.pt"
        cmd = [sys.executable, __file__, *sys.argv[1:], "--provider", provider, "--save", str(save)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            sys.exit(f"{provider} failed:\n{res.stderr[-4000:]}")
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
        logps[provider] = torch.load(save)
        save.unlink()
        print(json.dumps(rows[-1]))
    diff = float((logps["trl"] - logps["logitless"]).abs().max())
    print(f"\nlog-probs: largest |trl - logitless| = {diff:.3g}")
    print("| provider | train fwd+bwd (s) | no-grad pass (s) | train peak (MiB) | no-grad peak (MiB) |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['provider']} | {r['train_s']:.4f} | {r['no_grad_s']:.4f} | {r['train_peak_mib']:.1f} | "
              f"{r['no_grad_peak_mib']:.1f} |")


if __name__ == "__main__":
    main()
