"""Where a real model's training step spends its time, per variant of `logitless bench --job finetune`.

    PYTHONPATH=src python tools/gpu_step_profile.py --model-file GGUF [--variants hf-compile,logitless-compile]
        [--variants "logitless-compile:skip_threshold=None,vocab_order=None"] [--steps 20] [--json PATH]

The finetune job's preparation (the model's weights and the token batches of real text) and its worker (one fresh
process per variant, bf16 autocast over float32 parameters, AdamW), with `--steps` steps timed as there, then
(logitless.apps.bench.finetune_profile) one step under CUDA's sync debug mode (where the step synchronises), steps
timed on the host and on the device (is the loop host-bound), and a profiler's view of a few steps: the device's
busy and idle time per step, the largest kernels and the largest host operators. A variant may carry options for
`logitless.patch` after a colon (`name=value`, values None, "auto", numbers or strings).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from logitless.apps.bench import finetune


def _value(text: str):
    if text == "None":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _variant(text: str) -> tuple[str, dict]:
    name, _, opts = text.partition(":")
    options = {}
    for item in filter(None, opts.split(",")):
        k, _, v = item.partition("=")
        options[k] = _value(v)
    return name, options


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-file", required=True)
    ap.add_argument("--variants", action="append", default=None)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    variants = []
    for group in args.variants or ["hf-compile,logitless-compile"]:
        if ":" in group:
            variants.append(_variant(group))
        else:
            variants += [(n, {}) for n in group.split(",") if n]
    cfg = finetune.Config(device=args.device, dtype="bf16", batch=args.batch, seq=args.seq, steps=args.steps,
                          warmup=args.warmup, check_steps=0, lr=1e-4, seed=0, variants=[v for v, _ in variants],
                          model_file=args.model_file)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        meta = finetune.prepare(cfg, work)
        for i, (name, options) in enumerate(variants):
            spec = finetune._spec(work, name, cfg, cfg.steps)
            spec.update(profile=True, patch_options=options)
            spec_path = work / f"v{i}.spec.json"
            spec_path.write_text(json.dumps(spec))
            proc = subprocess.run([sys.executable, "-m", "logitless.apps.bench.finetune_train", str(spec_path)],
                                  env=finetune._worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True)
            out = work / f"{name}.json"
            if not out.exists():
                print(f"{name} {options}: failed\n{proc.stdout[-3000:]}")
                continue
            rec = json.loads(out.read_text())
            out.unlink()
            rec["patch_options"] = options
            results.append(rec)
            p = rec.get("profile", {})
            print(f"\n== {name} {options}: median step {rec['median_ms']:.1f} ms, skipped "
                  f"{rec.get('skipped')}, gate {rec.get('skip_state')}")
            if p:
                print(f"issue {p['issue_ms']:.1f} ms, events {p['event_ms']:.1f} ms; profiled wall {p['wall_ms']:.1f} "
                      f"ms, GPU busy {p['gpu_busy_ms']:.1f}, idle {p['gpu_idle_ms']:.1f}")
                print("sync sites:", *(p["sync_sites"] or ["none"]), sep="\n  ")
                print(f"kernels (ms/step; {p['kernel_ms_total']:.2f} in all, the JSON lists every one):",
                      *(f"{t:7.2f} {n}" for n, t in p["kernels_ms"][:15]), sep="\n  ")
                print("host ops (ms/step):", *(f"{t:7.2f} {n}" for n, t in p["host_ops_ms"][:15]), sep="\n  ")
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
