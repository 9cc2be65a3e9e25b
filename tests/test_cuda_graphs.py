"""CUDA graphs: every op captures into a graph and replays with new data, by hand and through
torch.compile(mode="reduce-overhead"). Capture fails on a host synchronisation (`.item()`, a Python branch on a
tensor) or on memory allocated outside the graph's pool, so these tests also guard the no-sync rule.

At small heads a call is bound by host time (launches, autograd, the torch.library dispatch: notes v13); a replayed
graph removes it. `tools/gpu_graphs.py` measures how much."""

from __future__ import annotations

import pytest
import torch

import logitless

pytestmark = pytest.mark.gpu

N, D, V = 1000, 1024, 32003  # V odd: a partial last tile; V >= 2N: the backward borrows dW's rows


def _head(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(N, D, device="cuda", generator=g).bfloat16()
    w = (torch.randn(V, D, device="cuda", generator=g) * 0.05).bfloat16()
    t = torch.randint(0, V, (N,), device="cuda", generator=g)
    t[::7] = -100
    return x, w, t


def _captured(step, statics, fresh_inputs):
    """Capture step() (which reads the tensors in `statics`) into a graph after a warm-up on a side stream, then
    for each tuple of fresh inputs copy it into the statics, replay, and yield clones of the graph's outputs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # compiles the Triton kernels and fills the caches before capture
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for fresh in fresh_inputs:
        with torch.no_grad():
            for s, f in zip(statics, fresh, strict=True):
                s.copy_(f)
        graph.replay()
        yield tuple(o.clone() for o in outs)


def _lce_step(x, w, t):
    def step():
        x.grad = w.grad = None
        loss = logitless.linear_cross_entropy(x, w, t, label_smoothing=0.1, z_loss=1e-4, softcap=30.0,
                                              backend="triton")
        loss.backward()
        return loss.detach(), x.grad, w.grad
    return step


def _eager_lce(x, w, t):
    xe, we = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    return _lce_step(xe, we, t)()


def _assert_close(got, want, names):
    # The same kernels in the same order; cuBLAS may pick another algorithm under capture, so allow its float32
    # summation order (the gradients are bf16: one rounding step apart at most).
    for name, a, b in zip(names, got, want, strict=True):
        assert torch.isfinite(a).all(), name
        err = ((a.double() - b.double()).norm() / b.double().norm()).item()
        assert err < 4e-3, f"{name}: replay differs from eager by {err:.2e}"


def test_linear_cross_entropy_replays():
    x0, w0, t0 = _head(0)
    xs, ws, ts = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True), t0.clone()
    fresh = [_head(s) for s in (1, 2)]
    for (x, w, t), got in zip(fresh, _captured(_lce_step(xs, ws, ts), (xs, ws, ts), fresh), strict=True):
        _assert_close(got, _eager_lce(x, w, t), ("loss", "d_input", "d_weight"))


def test_linear_log_probs_replays():
    def step_for(x, w, t, up):
        def step():
            x.grad = w.grad = None
            logp, ent = logitless.linear_log_probs(x, w, t, return_entropy=True, temperature=0.9, backend="triton")
            (logp * up + 0.1 * ent).sum().backward()
            return logp.detach(), ent.detach(), x.grad, w.grad
        return step

    def fresh_case(seed):
        x, w, t = _head(seed)
        return x, w, t, torch.randn(N, device="cuda")

    x0, w0, t0, u0 = fresh_case(0)
    xs, ws = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
    ts, us = t0.clone(), u0.clone()
    fresh = [fresh_case(s) for s in (3, 4)]
    for (x, w, t, u), got in zip(fresh, _captured(step_for(xs, ws, ts, us), (xs, ws, ts, us), fresh), strict=True):
        want = step_for(x.clone().requires_grad_(True), w.clone().requires_grad_(True), t, u)()
        _assert_close(got, want, ("logp", "entropy", "d_input", "d_weight"))


@pytest.mark.parametrize("inplace", (False, True))
def test_cross_entropy_replays(inplace):
    def step_for(z, t):
        def step():
            z.grad = None
            loss = logitless.cross_entropy(z, t, label_smoothing=0.1, inplace_backward=inplace, backend="triton")
            loss.backward()
            return loss.detach(), z.grad
        return step

    def fresh_case(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        z = (torch.randn(N, V, device="cuda", generator=g) * 4).bfloat16()
        t = torch.randint(0, V, (N,), device="cuda", generator=g)
        t[::5] = -100
        return z, t

    z0, t0 = fresh_case(0)
    # The in-place mode overwrites the static logits with their gradient: each replay starts from the copy-in.
    zs, ts = z0.clone().requires_grad_(True), t0.clone()
    fresh = [fresh_case(s) for s in (5, 6)]
    for (z, t), got in zip(fresh, _captured(step_for(zs, ts), (zs, ts), fresh), strict=True):
        want = step_for(z.clone().requires_grad_(True), t)()
        _assert_close(got, want, ("loss", "d_logits"))


@pytest.mark.parametrize("kind", ["fkl", "rkl", "jsd", "ce"])
def test_two_heads_replay(kind):
    """The distillation losses: both heads' statistics, the merge of vocabulary splits and the student's gradients
    capture without a host synchronisation and replay with new data as eager computes it."""
    def teacher(seed):
        g = torch.Generator(device="cuda").manual_seed(seed + 100)
        xt = torch.randn(N, 512, device="cuda", generator=g).bfloat16()
        wt = (torch.randn(V, 512, device="cuda", generator=g) * 0.05).bfloat16()
        return xt, wt

    def step_for(x, w, xt, wt, t):
        def step():
            x.grad = w.grad = None
            kw = dict(target=t, temperature=2.0, reduction="mean", backend="triton")
            if kind == "jsd":
                loss = logitless.linear_jsd(x, w, xt, wt, beta=0.3, **kw)
            elif kind == "ce":
                loss = logitless.linear_soft_cross_entropy(x, w, xt, wt, **kw)
            else:
                loss = logitless.linear_kl_div(x, w, xt, wt, direction="forward" if kind == "fkl" else "reverse",
                                               **kw)
            loss.backward()
            return loss.detach(), x.grad, w.grad
        return step

    fresh = [_head(s) + teacher(s) for s in (1, 2)]
    x0, w0, t0 = _head(0)
    xt0, wt0 = teacher(0)
    xs, ws = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
    statics = (xs, ws, t0.clone(), xt0.clone(), wt0.clone())
    step = step_for(statics[0], statics[1], statics[3], statics[4], statics[2])
    for (x, w, t, xt, wt), got in zip(fresh, _captured(step, statics, [(f[0], f[1], f[2], f[3], f[4]) for f in fresh]),
                                      strict=True):
        want = step_for(x.clone().requires_grad_(True), w.clone().requires_grad_(True), xt, wt, t)()
        _assert_close(got, want, ("loss", "d_input", "d_weight"))


def test_compile_reduce_overhead():
    # What a training loop gets from torch.compile(mode="reduce-overhead"): CUDA graphs through cudagraph trees,
    # the forward and backward graphs each replayed; the results equal the eager ones.
    fn = torch.compile(lambda x, w, t: logitless.linear_cross_entropy(
        x, w, t, label_smoothing=0.1, z_loss=1e-4, softcap=30.0, backend="triton"), mode="reduce-overhead",
        fullgraph=True)
    for seed in range(4):  # the first calls record; the later ones replay
        x, w, t = _head(seed)
        xo, wo = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        torch.compiler.cudagraph_mark_step_begin()
        loss = fn(xo, wo, t)
        loss.backward()
        _assert_close((loss.detach(), xo.grad, wo.grad), _eager_lce(x, w, t), ("loss", "d_input", "d_weight"))
