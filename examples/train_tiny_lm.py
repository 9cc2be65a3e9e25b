"""Train a small Llama-architecture model from scratch twice, with the stock loss and with logitless.patch.

Both runs start from the same seed: same initial weights, same batches, same optimiser. The script trains a byte-level
BPE tokenizer (the `tokenizers` library) on a real English corpus, runs the stock model, then the patched one, each
in its own process so that their peak memories are measured apart, and writes to --out:

    loss_curves.png   the training loss of both runs, step by step
    results.md        a table of peak memory, median step time and final losses, with the setup
    results.json      every number

The corpus: --text FILE (or a folder of .txt / .rst.txt files); otherwise the reStructuredText sources of Python's
documentation from Debian's python3-doc package: taken from /usr/share/doc when it is installed, else fetched once
with `apt-get download` and cached as one text file (about 11 MB) in --cache-dir.

    python examples/train_tiny_lm.py                      # CPU: 8k vocabulary, small model, a few minutes
    python examples/train_tiny_lm.py --preset gpu         # CUDA: 32k vocabulary, 16 x 1024 tokens per step
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PRESETS = {
    # ~2.5M parameters, most of them in the embedding and the head: well under a second per step on two CPU cores.
    "cpu": dict(vocab=8192, hidden=128, layers=2, heads=4, ffn=352, seq=128, batch=8, steps=120, lr=3e-3,
                precision="fp32"),
    # ~110M parameters; the stock step keeps (16 * 1024) x 32768 logits in bf16, their float32 copy and gradient.
    "gpu": dict(vocab=32768, hidden=768, layers=8, heads=12, ffn=2048, seq=1024, batch=16, steps=300, lr=1e-3,
                precision="bf16-autocast"),
}
VARIANTS = ("stock", "logitless")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="size preset (default: gpu when CUDA is available, else cpu); the flags below override it")
    p.add_argument("--text", type=Path, help="corpus: a text file, or a folder of .txt files")
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "logitless",
                   help="where a fetched python3-doc corpus is kept")
    p.add_argument("--out", type=Path, default=Path("train-tiny-lm-out"),
                   help="folder for the results (default: ./train-tiny-lm-out, ignored by git in a checkout)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--vocab", type=int, help="BPE vocabulary size")
    p.add_argument("--hidden", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--ffn", type=int)
    p.add_argument("--seq", type=int, help="tokens per sequence")
    p.add_argument("--batch", type=int, help="sequences per step")
    p.add_argument("--steps", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--precision", choices=("fp32", "bf16-autocast", "bf16"),
                   help="fp32; bf16-autocast (float32 weights, bf16 matmuls); bf16 (bf16 weights)")
    p.add_argument("--backend", default="auto", help="logitless backend for the patched run (auto, triton, torch)")
    p.add_argument("--max-chars", type=int, default=None, help="use only the first characters of the corpus")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="CPU threads for PyTorch (default: PyTorch's choice)")
    p.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    preset = PRESETS[args.preset or ("gpu" if args.device == "cuda" else "cpu")]
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


# ---------------------------------------------------------------- corpus

def _read_folder(folder: Path) -> str:
    files = sorted(f for f in folder.rglob("*") if f.is_file() and f.suffix == ".txt")
    if not files:
        raise SystemExit(f"no .txt files under {folder}")
    return "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)


def _fetch_python_docs(cache_dir: Path) -> Path:
    """Download Debian's Python documentation package and keep its reST sources as one text file."""
    target = cache_dir / "python-docs.txt"
    if target.exists():
        return target
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise SystemExit("no corpus: pass --text FILE, or install python3-doc (Debian/Ubuntu)")
    depends = subprocess.run(["apt-cache", "depends", "python3-doc"], capture_output=True, text=True).stdout
    # python3-doc is a small package that depends on the versioned one that holds the documentation.
    versioned = re.findall(r"Depends:\s*(python3\.\d+-doc)", depends)
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        for package in versioned[:1] or ["python3-doc"]:
            subprocess.run(["apt-get", "download", package], cwd=tmp, check=True)
        for deb in Path(tmp).glob("*.deb"):
            subprocess.run(["dpkg-deb", "-x", str(deb), str(Path(tmp) / "x")], check=True)
        sources = sorted((Path(tmp) / "x").glob("usr/share/doc/python3*/html/_sources"))
        if not sources:
            raise SystemExit("the python3-doc package holds no reST sources; pass --text FILE")
        target.write_text(_read_folder(sources[-1]), encoding="utf-8")
    return target


def load_corpus(args) -> tuple[str, str]:
    """(text, a description of where it came from)."""
    if args.text is not None:
        path = args.text
        text = _read_folder(path) if path.is_dir() else path.read_text(encoding="utf-8", errors="replace")
        name = str(path)
    else:
        installed = sorted(Path("/usr/share/doc").glob("python3*/html/_sources"))
        if installed:
            text, name = _read_folder(installed[-1]), f"Python documentation sources ({installed[-1]})"
        else:
            path = _fetch_python_docs(args.cache_dir)
            text, name = path.read_text(encoding="utf-8"), "Python documentation sources (Debian python3-doc)"
    if args.max_chars:
        text = text[: args.max_chars]
    return text, name


def tokenize(text: str, vocab: int):
    """Train a byte-level BPE tokenizer on `text`; return (token ids as an int32 tensor, vocabulary size)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    tok.train_from_iterator(paragraphs, trainer=trainer)
    eos = tok.token_to_id("<|endoftext|>")
    ids = []
    for enc in tok.encode_batch(paragraphs):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32), tok.get_vocab_size()


# ---------------------------------------------------------------- one training run (in its own process)

def _peak_memory(device) -> tuple[float, str]:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30, "peak GPU memory allocated by PyTorch"
    # The whole process, Python and PyTorch included. VmHWM belongs to this process's own memory map; ru_maxrss
    # would also count the parent's resident size at the fork.
    try:
        status = Path("/proc/self/status").read_text()
        return int(re.search(r"VmHWM:\s*(\d+) kB", status).group(1)) / 2**20, "peak resident memory of the process"
    except (OSError, AttributeError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "peak resident memory (ru_maxrss)"


def train(args) -> dict:
    import torch
    import transformers

    import logitless

    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    data = torch.load(args.data)
    ids, vocab = data["ids"].long(), data["vocab"]
    n_val = max(len(ids) // 20, args.seq + 1)
    train_ids, val_ids = ids[:-n_val], ids[-n_val:]

    torch.manual_seed(args.seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.heads, max_position_embeddings=args.seq,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    model = transformers.LlamaForCausalLM(config)
    if args.precision == "bf16":
        model = model.bfloat16()
    model.to(device).train()
    backend = "-"
    if args.worker == "logitless":
        logitless.patch(model, backend=args.backend)
        from logitless._dispatch import resolve_backend

        backend = resolve_backend(args.backend, device, "linear_cross_entropy")
    n_params = sum(p.numel() for p in model.parameters())

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device.type == "cuda")
    warmup = max(1, args.steps // 20)

    def lr_at(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, args.steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    # The same windows, in the same order, for both runs.
    g = torch.Generator().manual_seed(args.seed + 1)
    starts = torch.randint(0, len(train_ids) - args.seq, (args.steps, args.batch), generator=g)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16-autocast")

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, times = [], []
    for step in range(args.steps):
        batch = torch.stack([train_ids[s: s + args.seq] for s in starts[step].tolist()]).to(device)
        sync()
        t0 = time.perf_counter()
        with autocast:
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
            print(f"[{args.worker}] step {step:5d}  loss {losses[-1]:.4f}  {times[-1] * 1e3:8.1f} ms", flush=True)
    peak, peak_kind = _peak_memory(device)

    # Validation (eval mode: the original forward, in both runs) on fixed windows of the held-out tail.
    model.eval()
    val_starts = torch.arange(0, len(val_ids) - args.seq, args.seq)[:64]
    val = []
    with torch.no_grad(), autocast:
        for chunk in val_starts.split(args.batch):
            b = torch.stack([val_ids[s: s + args.seq] for s in chunk.tolist()]).to(device)
            val.append(model(input_ids=b, labels=b).loss.float().item())
    return dict(variant=args.worker, losses=losses, step_times=times, peak_gib=peak, peak_kind=peak_kind,
                val_loss=sum(val) / len(val), params=n_params, backend=backend)


# ---------------------------------------------------------------- report

def report(args, results: dict, corpus: str, n_tokens: int, vocab: int, out: Path) -> str:
    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    skip = min(5, args.steps - 1)  # compilation and allocator warm-up
    rows = []
    for name in VARIANTS:
        r = results[name]
        tail = r["losses"][-10:]
        rows.append(f"| {name} | {r['peak_gib']:.3f} | {statistics.median(r['step_times'][skip:]) * 1e3:.1f} | "
                    f"{sum(tail) / len(tail):.4f} | {r['val_loss']:.4f} |")
    stock, ours = results["stock"], results["logitless"]
    saved = stock["peak_gib"] - ours["peak_gib"]
    diffs = [abs(a - b) for a, b in zip(stock["losses"], ours["losses"], strict=True)]
    device = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
    tokens_per_step = args.batch * args.seq
    lines = [
        f"Llama-architecture model, {stock['params'] / 1e6:.1f}M parameters ({args.layers} layers, hidden "
        f"{args.hidden}, vocabulary {vocab}), trained from scratch for {args.steps} steps of {args.batch} x {args.seq}"
        f" = {tokens_per_step} tokens, {args.precision}, seed {args.seed}, on {device} ({args.device}).",
        f"Corpus: {corpus}, {n_tokens / 1e6:.2f}M tokens (byte-level BPE trained on it); 5% held out for validation.",
        f"torch {torch.__version__}, transformers {transformers.__version__}; logitless backend={args.backend} "
        f"(ran: {ours['backend']}).",
        "",
        f"| run | {stock['peak_kind']} (GiB) | median step time (ms) | train loss, last 10 steps | validation loss |",
        "| --- | --- | --- | --- | --- |",
        *rows,
        "",
        f"Memory saved by logitless.patch: {saved:.3f} GiB ({100 * saved / stock['peak_gib']:.1f}% of the stock "
        f"peak). The logits of one step alone are {tokens_per_step} x {vocab} = "
        f"{tokens_per_step * vocab * 4 / 2**30:.3f} GiB in float32.",
        f"Largest difference between the two loss curves: {max(diffs):.2e} (first step: {diffs[0]:.2e}).",
        "",
        "Command: `python examples/train_tiny_lm.py " + " ".join(sys.argv[1:]) + "`",
    ]
    text = "\n".join(lines) + "\n"
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps(dict(args={k: str(v) for k, v in vars(args).items()},
                                                      corpus=corpus, tokens=n_tokens, vocab=vocab,
                                                      results=results), indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no loss_curves.png")
        return text
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(stock["losses"], label=f"stock transformers loss (peak {stock['peak_gib']:.2f} GiB)", lw=2.5, alpha=0.6)
    ax.plot(ours["losses"], label=f"logitless.patch (peak {ours['peak_gib']:.2f} GiB)", lw=1.0, ls="--")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats / token)")
    size = stock["params"] / 1e6
    ax.set_title(f"{size:.{1 if size < 10 else 0}f}M-parameter Llama from scratch, vocabulary {vocab}, "
                 f"{tokens_per_step} tokens/step")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss_curves.png", dpi=120)
    return text


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        result = train(args)
        args.result.write_text(json.dumps(result))
        return
    import torch

    t0 = time.perf_counter()
    text, corpus = load_corpus(args)
    ids, vocab = tokenize(text, args.vocab)
    print(f"corpus: {corpus}: {len(text) / 1e6:.1f}M characters -> {len(ids) / 1e6:.2f}M tokens, vocabulary "
          f"{vocab} ({time.perf_counter() - t0:.0f} s)", flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "tokens.pt"
        torch.save(dict(ids=ids, vocab=vocab), data)
        passed = [a for a in (argv if argv is not None else sys.argv[1:])]
        for variant in VARIANTS:
            result = Path(tmp) / f"{variant}.json"
            # Each run in a fresh process: its peak memory is its own.
            cmd = [sys.executable, os.path.abspath(__file__), *passed, "--device", args.device, "--vocab",
                   str(args.vocab), "--worker", variant, "--data", str(data), "--result", str(result)]
            subprocess.run(cmd, check=True)
            results[variant] = json.loads(result.read_text())
    print(report(args, results, corpus, len(ids), vocab, args.out))
    print(f"wrote {args.out / 'results.md'}, {args.out / 'loss_curves.png'}")


if __name__ == "__main__":
    main()
