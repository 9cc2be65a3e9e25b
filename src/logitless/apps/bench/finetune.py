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

Here: the parent's preparation, runs and judgement; finetune_train.py: the variants and one training run (the
worker process); finetune_report.py: the tables and the plot; finetune_cli.py: the options and the entry point.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .finetune_report import SHOW_STEPS, mib, show
from .finetune_train import SCALE, Variant, train

FORMAT = "logitless-finetune/1"
RULE_FACTOR, RULE_FLOOR = 2.0, 1e-6
DEFAULTS = {  # batch, seq, steps, warmup
    "cuda": dict(batch=8, seq=1024, steps=40, warmup=5),
    "cpu": dict(batch=2, seq=64, steps=6, warmup=2),
}
MODEL_PREFERENCE = {"cuda": ("gemma3-270m", "smollm2-135m"), "cpu": ("smollm2-135m", "gemma3-270m")}


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
    pkg_root = str(Path(__file__).resolve().parents[3])  # the folder holding the logitless package
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
    proc = subprocess.run([sys.executable, "-m", "logitless.apps.bench.finetune_train", str(spec_path)],
                          env=_worker_env(),
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
                line += (f": median step {show(rec['median_ms'])} ms, {show(rec['tokens_per_s'])} tokens/s, peak "
                         f"{show(mib(rec['peak_step_bytes']))} MiB above the step's start; losses "
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
