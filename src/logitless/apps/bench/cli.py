"""`logitless bench`: speed and peak memory of logitless next to every installed peer, on this device."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import sys
import warnings

import torch

from ..files import AtomicGroup, OutputError
from . import cases as C
from . import data, finetune_cli, providers, report
from .runner import run
from .selection import pick_device, resolve

DESCRIPTION = """\
Time and peak memory of logitless next to every installed peer, on this device's shapes and data.

Before any provider is timed, its value and gradients on a slice of rows are checked against a float64
reference: its relative error must be at most 2 x the error of PyTorch's own ops in the same dtype (+1e-6).
A provider that fails is reported as failing, with its errors, and is not timed.

Jobs (phases):
  train     linear_cross_entropy, mean loss: fwd+bwd (with the fwd and bwd split), and no-grad (loss only)
  logprobs  per-token log p(target) of a linear head: no-grad (scoring), and fwd+bwd (gradients)
  ce        cross_entropy on existing N x V logits: fwd+bwd (in place where the provider supports it)
  distill   linear_jsd (beta 0.5) of a student head against a teacher head of the same shape: fwd+bwd
            (gradients to the student); opt-in: runs only when named in --job
  finetune  full training steps (forward, backward, AdamW) of a real small LM on real text, per variant (stock
            transformers, logitless.patch, each eager and compiled; Liger), each in its own process, losses checked
            step by step against float64; opt-in, runs alone; --providers/--exclude pick its variants

Figures per phase: median time (CUDA events on a GPU, wall clock on a CPU); peak memory allocated above the
inputs and the outputs (CUDA caching allocator on a GPU, PyTorch's profiler on a CPU); TFLOP/s counting
2*N*D*V per matrix product (3 products for fwd+bwd, 1 for no-grad), or GB/s counting one read and one write of
the logits for ce; "x ours": time over logitless's (the backend that backend="auto" picks); "x floor": time over
the dense floor's (the matrix products alone, or a device-to-device copy of the logits for ce).
"""
EPILOG = """\
providers (each runs only when importable and able to run on the device; --list shows which):
{providers}

presets (N tokens, D hidden, V vocabulary):
{presets}

data (--data):
  lm        a trained model's head: peaked softmax (entropy ~2.5 nats), Zipf-distributed targets
  uniform   the head at initialisation: near-uniform softmax, loss ~ log V
  real      a pretrained model's head, its hidden states on real text and the real next tokens: Gemma 3 270M
            (V = 262144, D = 640) or SmolLM2-135M (V = 49152, D = 576), lifted to a larger D with the same
            logits; serves only shapes with the model's V and D >= the model's (others are skipped, saying so);
            default shapes gemma3-d640, gemma3-d2304, gemma3-d4096 on a GPU, smollm2-cpu on a CPU.
            Read from --data-file, or prepared once into --cache-dir (needs the logitless[real] extra)
  (see docs/data.md; the exact recipe is printed with each run)

defaults: on a GPU all jobs at the model presets of their targets, bf16, both data kinds, every available
provider but the opt-in variants. On a CPU a small run (about a minute on two cores): cpu-small, fp32, lm
data, with logitless-torch, torch-eager and the floor (the providers that are slow on a CPU, torch-compile,
torch-lce and the Triton peers, run there only when named in --providers).
outputs under --out: table.txt, table.md, results.json, results.csv, bench_<job>.svg
(--job finetune: finetune.txt, finetune.md, finetune.json, finetune.svg)
"""
_split = C.split_values


def _name_width() -> int:
    """Column width of the provider names in --help and --list: the longest, and two spaces."""
    return max(len(p.name) for p in providers.REGISTRY) + 2


def build_parser() -> argparse.ArgumentParser:
    width = _name_width()
    prov = "\n".join(f"  {p.name:{width}s}{p.description}" for p in providers.REGISTRY)
    pres = "\n".join(f"  {k:14s}N={n}, D={d}, V={v}" for k, (n, d, v) in C.PRESETS.items())
    ap = argparse.ArgumentParser(
        prog="logitless bench", description=DESCRIPTION, epilog=EPILOG.format(providers=prov, presets=pres),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--job", action="append", metavar="JOB",
                    help=f"job(s) to run, comma-separated or repeated: {', '.join(C.ALL_JOBS)}, finetune (default: "
                         f"{', '.join(C.JOBS)})")
    ap.add_argument("--preset", action="append", metavar="NAME",
                    help="shape preset(s), comma-separated or repeated; with --shape, replaces the default shapes "
                         "of every job")
    ap.add_argument("--shape", action="append", metavar="N,D,V",
                    help="a custom shape (repeatable): N tokens, D hidden size, V vocabulary")
    ap.add_argument("--dtype", action="append", metavar="DTYPE",
                    help=f"dtype(s) of input and weight: {', '.join(C.DTYPES)} (default: bf16 on a GPU, fp32 on a "
                         "CPU)")
    ap.add_argument("--data", action="append", metavar="KIND",
                    help=f"data kind(s): {', '.join(data.KINDS)} (default: both on a GPU, lm on a CPU)")
    ap.add_argument("--data-file", default=None, metavar="PATH",
                    help="real data prepared by `python -m logitless.apps.bench.real` (read with torch alone): the "
                         "file, a folder of its PATH.partNN parts, or PATH when only PATH.partNN exist; implies "
                         "--data real when --data is not given")
    ap.add_argument("--cache-dir", default=None, metavar="DIR",
                    help="where --data real without --data-file keeps the prepared data (default: $LOGITLESS_CACHE "
                         "or ~/.cache/logitless)")
    ap.add_argument("--providers", action="append", metavar="NAMES",
                    help="only these providers, comma-separated (default: all available; on a CPU those that run "
                         "quickly there); without --job, the jobs they run")
    ap.add_argument("--exclude", action="append", metavar="NAMES", help="skip these providers, comma-separated")
    ap.add_argument("--device", default=None,
                    help="cuda, cuda:N or cpu (default: cuda when available, else cpu)")
    ap.add_argument("--out", default="bench-out", metavar="DIR",
                    help="folder for the table, JSON, CSV and SVG files (default: %(default)s); they replace "
                         "files of the same names there only once all are written, so a run that fails or is "
                         "interrupted leaves the folder as it was")
    ap.add_argument("--no-clobber", "-n", action="store_true",
                    help="refuse to overwrite any file of the run in --out (checked before the run)")
    ap.add_argument("--no-plots", action="store_true", help="do not write the SVG plots")
    ap.add_argument("--check-rows", type=int, default=None, metavar="K",
                    help="rows of the batch on which each provider is checked against float64 "
                         "(default: 1024 on a GPU, 256 on a CPU)")
    ap.add_argument("--time-failing", action="store_true",
                    help="time providers that fail the check too (they stay marked FAIL)")
    ap.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                    help="time spent on the timed repetitions of each provider and phase, about "
                         "(default: 1.0 on a GPU, 0.5 on a CPU)")
    ap.add_argument("--min-reps", type=int, default=3, metavar="R", help="at least R timed runs (default: 3)")
    ap.add_argument("--max-reps", type=int, default=100, metavar="R", help="at most R timed runs (default: 100)")
    ap.add_argument("--warmup", type=int, default=3, metavar="R",
                    help="untimed runs before measuring, after the check; at least 1, the last one sizing the "
                         "number of timed runs (default: 3, so that no run that compiles sizes them: the default "
                         "call compiles on its first two calls, the dense plans and then its probe of skipping, "
                         "and a run sized by a compilation gets only --min-reps timed runs)")
    ap.add_argument("--max-iter-seconds", type=float, default=30.0, metavar="S",
                    help="a provider whose single run takes longer is reported 'too slow', not timed; its first "
                         "run, which may compile, may take 10 x as long (default: 30)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the synthetic data (default: 0)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--list", action="store_true", help="list providers, with why any cannot run here, and exit")
    finetune_cli.add_arguments(ap)
    return ap


def _meta(argv, device: torch.device, chosen) -> dict:
    meta = {
        "command": "logitless bench " + " ".join(shlex.quote(a) for a in argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpu_threads": torch.get_num_threads(),
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except Exception:  # noqa: BLE001 - Triton is optional
        meta["triton"] = None
    meta["providers"] = {p.name: p.version() for p in chosen}
    return meta


def _list(device: torch.device) -> int:
    print(f"device: {device}")
    width = _name_width()
    for p in providers.REGISTRY:
        reasons = {job: p.unavailable(job, device) for job in p.jobs}
        ok = [j for j, r in reasons.items() if not r]
        line = f"  {p.name:{width}s}{'jobs: ' + ', '.join(ok) if ok else 'unavailable'}"
        bad = [r for r in reasons.values() if r]
        if bad:
            line += f"   ({bad[0]})"
        print(line)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list:
        return _list(pick_device(args.device))
    if "finetune" in _split(args.job):
        return _finetune(args, parser, argv)
    for name in finetune_cli.FINETUNE_ONLY:
        if getattr(args, name) is not None:
            parser.error(f"--{name.replace('_', '-')} applies to --job finetune only")
    cases, chosen, opts = resolve(args, parser)
    _check_out(args.out, parser)
    if args.no_clobber:
        _refuse_existing(args.out, OUTPUTS + ([] if args.no_plots else sorted({f"bench_{c.job}.svg" for c in cases})),
                         parser)
    # Inductor says, for every compiled graph, that a split reduction turns its online softmax off: noise here.
    warnings.filterwarnings("ignore", message=r"[\s\S]*Online softmax is disabled")
    log = _logger(opts.progress)
    meta = _meta(argv, opts.device, chosen)
    log(f"logitless bench on {meta['device']} ({opts.device}); torch {meta['torch']}, triton {meta['triton']}")
    for line in opts.skipped:
        log(line)
    result = run(cases, chosen, opts, log=log)
    text = report.tables(result)
    legend = report.legend(result)
    print()
    print(text)
    print(legend)
    data_lines = "\n".join(f"data {d}" for d in result.data.values())
    header = f"{meta['command']}\n{meta['device']}; torch {meta['torch']}; triton {meta['triton']}\n{data_lines}\n"
    # Every file goes to a temporary one beside it; all are renamed into place together at the end.
    try:
        written = _write(args, result, meta, text, legend, header)
    except OutputError as e:  # --no-clobber: a file appeared in --out during the run
        print(f"logitless bench: error: {e}; nothing was written", file=sys.stderr)
        return 1
    print(f"wrote {', '.join(written)} to {args.out}")
    return 0


# The files of every run (the plots, bench_<job>.svg, come on top).
OUTPUTS = ["table.txt", "table.md", "results.json", "results.csv"]


def _write(args, result, meta: dict, text: str, legend: str, header: str) -> list[str]:
    with AtomicGroup(no_clobber=args.no_clobber) as files:
        with files.open(os.path.join(args.out, "table.txt"), "w") as f:
            f.write(header + "\n" + text + "\n" + legend + "\n")
        with files.open(os.path.join(args.out, "table.md"), "w") as f:
            f.write(report.tables(result, markdown=True) + "\n" + legend.replace("\n", "\n\n") + "\n")
        report.write_json(result, meta, os.path.join(args.out, "results.json"), opener=files.open)
        report.write_csv(result, os.path.join(args.out, "results.csv"), opener=files.open)
        written = list(OUTPUTS)
        if not args.no_plots:
            written += [os.path.basename(p) for p in report.write_plots(result, args.out, opener=files.open)]
    return written


def _finetune(args, parser, argv) -> int:
    """--job finetune: its own machinery (apps/bench/finetune*.py), the same device, metadata and output folder."""
    if _split(args.job) != ["finetune"]:
        parser.error("--job finetune runs alone: give it without other jobs")
    device = pick_device(args.device)
    _check_out(args.out, parser)
    if args.no_clobber:
        _refuse_existing(args.out, finetune_cli.outputs(not args.no_plots), parser)
    meta = _meta(argv, device, [])
    meta["device_name"] = str(device)
    return finetune_cli.main(args, parser, argv, meta, args.out, not args.no_plots, log=_logger(not args.no_progress),
                             no_clobber=args.no_clobber)


def _refuse_existing(out: str, names, parser) -> None:
    """--no-clobber: refuse, before the run, an --out that holds any of the run's files."""
    there = [n for n in names if os.path.lexists(os.path.join(out, n))]
    if there:
        parser.error(f"--out {out} already holds {', '.join(there)}, and --no-clobber refuses to "
                     "overwrite them: choose another --out, or leave --no-clobber out")


def _check_out(out: str, parser) -> None:
    """--out is a folder that exists or can be made, checked before the run (minutes), not after it."""
    if os.path.exists(out) and not os.path.isdir(out):
        parser.error(f"--out {out} exists and is not a folder")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        parser.error(f"--out {out}: cannot create the folder ({e.strerror or e})")
    if not os.access(out, os.W_OK | os.X_OK):
        parser.error(f"--out {out}: the folder is not writable")


def _logger(progress: bool):
    if progress:
        try:
            from tqdm.auto import tqdm

            return lambda msg: tqdm.write(msg)
        except ImportError:
            pass
    return print


if __name__ == "__main__":
    sys.exit(main())
