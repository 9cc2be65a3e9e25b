"""What a `logitless bench` run measures: its device, cases (job, shape, dtype, data) and providers, from the
arguments; errors go through the parser (exit 2)."""

from __future__ import annotations

import torch

from . import cases as C
from . import data, providers
from .runner import Options

_split = C.split_values


def pick_device(arg: str | None) -> torch.device:
    if arg is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(arg)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("logitless bench: --device cuda was asked for but CUDA is not available")
    if dev.type not in ("cuda", "cpu"):
        raise SystemExit(f"logitless bench: unsupported device {arg!r}; use cuda or cpu")
    return dev


def resolve(args, parser) -> tuple[list[C.Case], list[providers.Provider], Options]:
    """Arguments -> the cases to run, the providers, and the options. Errors go through parser.error (exit 2)."""
    device = pick_device(args.device)
    gpu = device.type == "cuda"
    jobs = _split(args.job) or list(C.JOBS)
    for j in jobs:
        if j not in C.ALL_JOBS:
            parser.error(f"unknown job {j!r}; expected one of {', '.join(C.ALL_JOBS)}")
    known = providers.by_name()
    if args.providers:
        names = _split(args.providers)
        for n in names:
            if n not in known:
                parser.error(f"unknown provider {n!r}; expected some of {', '.join(known)}")
        chosen = [known[n] for n in names]
    else:
        chosen = [p for p in providers.REGISTRY if (p.gpu_default if gpu else p.cpu_default)]
    if args.providers and not args.job:  # --providers alone: the jobs those providers run
        jobs = [j for j in jobs if any(j in p.jobs for p in chosen)]
    dtypes = _split(args.dtype) or (["bf16"] if gpu else ["fp32"])
    for d in dtypes:
        if d not in C.DTYPES:
            parser.error(f"unknown dtype {d!r}; expected one of {', '.join(C.DTYPES)}")
    kinds = _split(args.data) or (["real"] if args.data_file else ["lm", "uniform"] if gpu else ["lm"])
    for k in kinds:
        if k not in data.KINDS:
            parser.error(f"unknown data kind {k!r}; expected one of {', '.join(data.KINDS)}")
    if args.data_file and not any(k in data.REAL_KINDS for k in kinds):
        parser.error("--data-file is read by --data real (or real-sorted) only")
    shapes = []
    for text in _split(args.preset):
        if text not in C.PRESETS:
            parser.error(f"unknown preset {text!r}; expected one of {', '.join(C.PRESETS)}")
        shapes.append(C.parse_shape(text))
    for text in args.shape or []:
        try:
            shapes.append(C.parse_shape(text))
        except ValueError as e:
            parser.error(str(e))
    defaults = C.GPU_DEFAULT_PRESETS if gpu else C.CPU_DEFAULT_PRESETS
    cases, skipped = [], []
    for job in jobs:
        for k in kinds:
            if k in data.REAL_KINDS:
                job_shapes = shapes or [C.parse_shape(n) for n in (C.REAL_GPU_PRESETS if gpu else C.REAL_CPU_PRESETS)]
            else:
                job_shapes = shapes or [C.parse_shape(n) for n in defaults[job]]
            for s in job_shapes:
                try:
                    why = _real_refuses(s, args.data_file) if k in data.REAL_KINDS else None
                except (OSError, ValueError) as e:
                    parser.error(f"--data-file: {e}")
                if why:
                    skipped.append(f"skipped {job} {s.name} data=real: {why}")
                    continue
                cases += [C.Case(job, s, d, k) for d in dtypes]
    if not cases:
        parser.error("no case left to run: " + "; ".join(skipped))
    excluded = set(_split(args.exclude))
    for n in excluded:
        if n not in known:
            parser.error(f"unknown provider {n!r} in --exclude; expected some of {', '.join(known)}")
    left = [p for p in chosen if p.name not in excluded]
    # A job that no chosen provider runs would print an empty table: refuse it up front, naming the flag.
    emptied = [j for j in jobs if any(j in p.jobs for p in chosen) and not any(j in p.jobs for p in left)]
    if emptied:
        parser.error(f"--exclude leaves no provider for job(s) {', '.join(emptied)}")
    unserved = [j for j in jobs if not any(j in p.jobs for p in chosen)]
    if unserved:
        able = {j: ", ".join(p.name for p in providers.REGISTRY if j in p.jobs) for j in unserved}
        parser.error("--providers names no provider for job(s) "
                     + "; ".join(f"{j} (run by {able[j]})" for j in unserved))
    chosen = left
    if args.check_rows is not None and args.check_rows < 1:
        parser.error("--check-rows must be at least 1")
    if args.min_reps < 1 or args.max_reps < args.min_reps:
        parser.error("--min-reps must be at least 1 and --max-reps at least --min-reps")
    budget = args.budget if args.budget is not None else (1.0 if gpu else 0.5)
    if budget <= 0:
        parser.error("--budget must be positive")
    opts = Options(
        device=device, budget_s=budget, min_reps=args.min_reps, max_reps=args.max_reps,
        warmup=max(1, args.warmup), max_iter_s=args.max_iter_seconds,
        check_rows=args.check_rows or (1024 if gpu else 256), time_failing=args.time_failing, seed=args.seed,
        progress=not args.no_progress, data_file=args.data_file, cache_dir=args.cache_dir, skipped=skipped,
    )
    return cases, chosen, opts


def _real_refuses(s: C.Shape, data_file) -> str | None:
    """Why real data cannot serve shape s: the file's V, D and tokens, or the models' (None when it serves)."""
    from . import real

    if data_file is not None:
        src = data.real_source(s.V, data_file)
        return real.serves(src["V"], src["D"], src["input"].shape[0], s.N, s.D, s.V)
    try:
        m = real.MODELS[real.model_for(s.V)]
    except ValueError as e:
        return str(e)
    return real.serves(m.V, m.D, s.N, s.N, s.D, s.V)
