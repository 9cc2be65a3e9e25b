"""The finetune job's variants and the training of one: each variant in a fresh process (`python -m
logitless.apps.bench.finetune_train SPEC`, started by finetune.py), the float64 reference in the parent process."""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch


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
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}


def clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [clean(x) for x in v]
    return v


def _worker(spec_path: str) -> int:
    """One variant in this process: train it, write its record as JSON beside the spec."""
    spec = json.loads(Path(spec_path).read_text())
    rec = train(spec)
    out_path = Path(spec["work"]) / f"{spec['variant']}.json"
    tmp = out_path.with_name(out_path.name + ".tmp")
    tmp.write_text(json.dumps(clean(rec)))
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

        logitless.patch(lm, **spec.get("patch_options", {}))
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
    if v is not None and v.patch == "logitless":
        from logitless import skip_gate

        # what the default's skipping gate made of the head (for the table: the share of pairs its last plan skipped)
        head = lm.get_output_embeddings()
        weight = getattr(head, "weight", None)
        if weight is not None:
            run_dtype = dtype if autocast else None  # the head runs on autocast's cast of its weight
            rec["skip_state"] = skip_gate.state(weight, run_dtype)
            rec["skipped"] = skip_gate.last_share(weight, run_dtype)
    if spec.get("profile") and cuda:
        from .finetune_profile import profile

        rec["profile"] = profile(step, ids_all)
    if v is not None and v.patch == "liger":
        rec["liger"] = getattr(sys.modules.get("liger_kernel"), "__version__", None)
    return rec


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1]))
