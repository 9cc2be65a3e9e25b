"""A/B timing of whole revisions of the package, each in a process of its own, interleaved on one device.

    mkdir old && git archive REV src | tar -x -C old
    python tools/gpu_ab_src.py --src A=old/src --src B=src [--src C=src] [--shapes 1000x2304x262144,...]
        [--cases logp,fwd,fwdbwd] [--rounds 8] [--reps 5] [--json FILE]

Why processes: the backends import their launchers by name, so one process cannot swap a kernels package under
them (tools/gpu_ab.py's method, which holds for revisions from before that); and a whole revision brings its own
plans and host code, which is what a user's call runs. Each version is a worker process started with its `src`
folder first on PYTHONPATH; the workers build the same inputs (a seeded uniform bf16 head per shape, generated on the
device, so the same bits in every worker) and wait. Each round asks every worker in turn, the order alternating
between rounds, to time one case: a warm-up call, then the median of --reps calls between CUDA events. The report
is the median over rounds per version, with its spread, and each version over A. A version given twice (a null
version, e.g. `--src C=src`) shows the noise of the method at that shape: compare differences against it.

Cases, through the public functions with backend="triton": `logp` no-grad log-probs with entropy, `logp_bwd`
log-probs with the gradients of input and weight for a random upstream per token (reduction "none", RL's shape),
`fwd` the mean loss without grad, `fwdbwd` the mean loss with the gradients of input and weight. Before timing,
every version's outputs of each case are compared with A's (largest difference relative to A's largest entry), a
sanity check of what is timed.

`--device cpu` (with TRITON_INTERPRET=1, small shapes) checks the tool itself on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CASES = ("logp", "logp_bwd", "fwd", "fwdbwd")


# ---------------------------------------------------------------------------------------------------------------
# The worker: one revision, on stdin one request per line, on stdout one JSON answer per line.


def _worker(device: str) -> None:
    import torch

    import logitless

    heads = {}

    def head(shape):
        if shape not in heads:
            heads.clear()
            if device == "cuda":
                torch.cuda.empty_cache()
            n, d, v = (int(s) for s in shape.split("x"))
            g = torch.Generator(device=device).manual_seed(0)
            x = torch.randn(n, d, device=device, generator=g).to(torch.bfloat16)
            w = (torch.randn(v, d, device=device, generator=g) * d**-0.5).to(torch.bfloat16)
            t = torch.randint(0, v, (n,), device=device, generator=g)
            up = torch.randn(n, device=device, generator=g)
            heads[shape] = (x, w, t, x.detach().requires_grad_(), w.detach().requires_grad_(), up)
        return heads[shape]

    def call(shape, case):
        x, w, t, xl, wl, up = head(shape)
        if case == "logp":
            with torch.no_grad():
                return logitless.linear_log_probs(x, w, t, backend="triton", return_entropy=True)
        if case == "logp_bwd":
            lp = logitless.linear_log_probs(xl, wl, t, backend="triton")
            return (lp.detach(), *torch.autograd.grad(lp, (xl, wl), up))
        if case == "fwd":
            with torch.no_grad():
                return (logitless.linear_cross_entropy(x, w, t, backend="triton"),)
        loss = logitless.linear_cross_entropy(xl, wl, t, backend="triton")
        return (loss, *torch.autograd.grad(loss, (xl, wl)))

    def timed(fn, reps):
        fn()  # warm-up (and, the first time, compilation)
        times = []
        for _ in range(reps):
            if device == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    print(json.dumps({"ready": logitless.__file__}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "outputs":
            outs = call(req["shape"], req["case"])
            path = req["path"]
            torch.save([o.detach().float().cpu() for o in outs], path)
            print(json.dumps({"path": path}), flush=True)
        elif req["op"] == "time":
            ms = timed(lambda r=req: call(r["shape"], r["case"]), req["reps"])
            print(json.dumps({"ms": ms}), flush=True)
        else:
            return


# ---------------------------------------------------------------------------------------------------------------
# The parent: starts the workers, checks their outputs against A's, interleaves the rounds.


class Worker:
    def __init__(self, name: str, src: str, device: str):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath(src), os.environ.get("PYTHONPATH", "")]))
        self.name = name
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", "--device", device],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.where = self.ask(None)["ready"]

    def ask(self, req):
        if req is not None:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"version {self.name}: its worker stopped (its error is above)")
        return json.loads(line)

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"op": "stop"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def _rel_diff(a, b) -> float:
    return float((a - b).abs().max() / a.abs().max().clamp_min(1e-30))


def run(workers: list[Worker], shapes, cases, rounds: int, reps: int, tmp: str) -> dict:
    import torch

    res = {}
    for shape in shapes:
        r = {}
        for case in cases:
            outs = {}
            for w in workers:
                path = os.path.join(tmp, f"ab_{w.name}.pt")
                outs[w.name] = torch.load(w.ask({"op": "outputs", "shape": shape, "case": case, "path": path})["path"])
                os.remove(path)
            ref = outs[workers[0].name]
            for w in workers[1:]:
                r[f"diff {case} {w.name}"] = [_rel_diff(a, b) for a, b in zip(ref, outs[w.name], strict=True)]
            times = {w.name: [] for w in workers}
            for k in range(rounds):
                for w in workers if k % 2 == 0 else workers[::-1]:
                    times[w.name].append(w.ask({"op": "time", "shape": shape, "case": case, "reps": reps})["ms"])
            a = statistics.median(times[workers[0].name])
            for w in workers:
                m = statistics.median(times[w.name])
                r[f"{w.name} {case}_ms"] = m
                r[f"{w.name} {case}_spread"] = (min(times[w.name]), max(times[w.name]))
                r[f"{case} {w.name}/A"] = m / a
        res[shape] = r
        print(f"{shape}: " + "; ".join(
            f"{c} " + " ".join(f"{w.name} {r[f'{w.name} {c}_ms']:.3f}" for w in workers)
            + " (" + ", ".join(f"{w.name}/A {r[f'{c} {w.name}/A']:.3f}" for w in workers[1:]) + ")"
            for c in cases), flush=True)
        for key, val in r.items():
            if key.startswith("diff"):
                print(f"  {key}: {', '.join(f'{d:.2e}' for d in val)}", flush=True)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", action="append", default=[], metavar="NAME=DIR",
                    help="a version: a name and a revision's src folder (repeatable; the first is A)")
    ap.add_argument("--shapes", default="1000x2304x262144,8192x2304x262144", help="NxDxV, comma-separated")
    ap.add_argument("--cases", default="logp,fwd,fwdbwd", help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return _worker(a.device)
    if len(a.src) < 2:
        ap.error("give at least two versions: --src A=DIR --src B=DIR")
    cases = a.cases.split(",")
    if not set(cases) <= set(CASES):
        ap.error(f"--cases: of {', '.join(CASES)}")
    specs = [s.split("=", 1) for s in a.src]
    if any(len(s) != 2 or not os.path.isdir(s[1]) for s in specs):
        ap.error("--src NAME=DIR, DIR an existing src folder")
    workers = []
    try:
        for name, src in specs:
            workers.append(Worker(name, src, a.device))
            print(f"version {name}: {workers[-1].where}", flush=True)
        res = {"versions": dict(specs), "rounds": a.rounds, "reps": a.reps}
        res.update(run(workers, a.shapes.split(","), cases, a.rounds, a.reps,
                       os.environ.get("TMPDIR", "/tmp")))
    finally:
        for w in workers:
            w.close()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
