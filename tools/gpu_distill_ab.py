"""Interleaved A/B of a kernels.Tuning setting on the two-head losses' forward + backward.

    PYTHONPATH=src python tools/gpu_distill_ab.py --set two_heads_dz_persistent=False [--losses fkl,rkl,jsd]
        [--shape 8192,2304,256000] [--rounds 5] [--reps 3]

A is the default Tuning, B the default with --set's fields (comma-separated name=value, Python literals). Per loss
(student and teacher `lm` heads of one shape, bf16, gradients to the student's input and weight), each round times
A and B, in an order that alternates between rounds, each as the mean of --reps calls after one warm-up call;
prints the medians, every round's time and B / A, and whether B's gradients equal A's bit for bit.
"""

from __future__ import annotations

import argparse
import ast
import statistics

import torch


def main(argv=None):
    import logitless
    from logitless.apps.bench import data
    from logitless.kernels import tuning

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--set", required=True, help="Tuning fields of B, e.g. two_heads_dz_persistent=False")
    p.add_argument("--losses", default="fkl,rkl,jsd")
    p.add_argument("--shape", default="8192,2304,256000")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    changes = {k: ast.literal_eval(v) for k, v in (f.split("=", 1) for f in a.set.split(","))}
    N, D, V = (int(v) for v in a.shape.split(","))
    student = data.make_head("lm", N, D, V, dtype=torch.bfloat16, device="cuda", seed=0)
    teacher = data.make_head("lm", N, D, V, dtype=torch.bfloat16, device="cuda", seed=1)
    xs = student.input.detach().requires_grad_(True)
    ws = student.weight.detach().requires_grad_(True)
    xt, wt, t = teacher.input.detach(), teacher.weight.detach(), student.target
    del student, teacher
    losses = {"fkl": lambda: logitless.linear_kl_div(xs, ws, xt, wt, target=t),
              "rkl": lambda: logitless.linear_kl_div(xs, ws, xt, wt, target=t, direction="reverse"),
              "jsd": lambda: logitless.linear_jsd(xs, ws, xt, wt, target=t)}
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; shape {a.shape}; B: {changes}", flush=True)
    for name in a.losses.split(","):
        times, grads = {"A": [], "B": []}, {}

        def run(name=name):
            xs.grad = ws.grad = None
            losses[name]().backward()

        for r in range(a.rounds):
            for version in (("A", "B") if r % 2 == 0 else ("B", "A")):
                with tuning(**(changes if version == "B" else {})):
                    run()
                    torch.cuda.synchronize()
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    for _ in range(a.reps):
                        run()
                    e1.record()
                    torch.cuda.synchronize()
                    times[version].append(e0.elapsed_time(e1) / a.reps)
                    grads[version] = (xs.grad.clone(), ws.grad.clone())
        equal = all(torch.equal(g, h) for g, h in zip(grads["A"], grads["B"], strict=True))
        ma, mb = statistics.median(times["A"]), statistics.median(times["B"])
        print(f"{name}: A {ma:.2f} ms {[round(v, 1) for v in times['A']]}, B {mb:.2f} ms "
              f"{[round(v, 1) for v in times['B']]}, B / A {mb / ma:.3f}; gradients bitwise equal: {equal}",
              flush=True)


if __name__ == "__main__":
    main()
