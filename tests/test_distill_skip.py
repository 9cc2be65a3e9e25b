"""Skipping cold tiles in the two-head losses' backward (linear_kl_div, linear_jsd, linear_soft_cross_entropy) on
the Triton path (the interpreter on CPU): gradients under the error rule against float64 with pairs actually
skipped, the plan's bound, and a flat softmax that skips nothing. The interpreter's two-head tiles are 16 tokens x
32 classes, so N = 45, V = 200 make 3 token blocks (the last partial) and 7 tiles (the last of 8 classes)."""

from __future__ import annotations

import pytest
import torch

import logitless

from .helpers import assert_compiled_matches_eager, assert_within_rule, grads, leaves
from .test_distill import _naive, _ours

HOT_SETS = ([3, 40, 77, 101], [150, 151, 190, 12], [60, 61, 62, 199])


def peaked_pair(dtype, n=45, ds=24, dt=20, v=200, seed=0):
    """Student and teacher heads whose rows hold their mass on three of four 'hot' classes of their token block
    (HOT_SETS, one per block of 16 rows), the teacher's weights on them a little different from the student's;
    every other class holds ~e^-15 of a row's mass in both. A quarter of the rows are ignored."""
    g = torch.Generator().manual_seed(seed)
    hot = sorted({c for cs in HOT_SETS for c in cs})
    heads = []
    picks = [torch.randperm(4, generator=g)[:3].tolist() for _ in range(n)]
    for d, amp in ((ds, (20.0, 20.0, 18.0)), (dt, (21.0, 19.0, 17.5))):
        w = torch.randn(v, d, generator=g) * (0.3 / d**0.5)
        for k, c in enumerate(hot):
            w[c] = 0.0
            w[c, k % d] = 1.0 if k < d else -1.0
        x = torch.randn(n, d, generator=g) * 0.1
        for i in range(n):
            cs = HOT_SETS[(i // 16) % len(HOT_SETS)]
            for a, j in zip(amp, picks[i], strict=True):
                k = hot.index(cs[j])
                x[i, k % d] += a if k < d else -a
        heads += [x.to(dtype), w.to(dtype)]
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < 0.25] = -100
    return heads[0], heads[1], heads[2], heads[3], t


def run_check(case, xs, ws, xt, wt, t, tune, group_rows=False, bs=None, **kw):
    """Ours with skipping against float64 under the error rule (loss and the student's gradients, reduction "none"
    with a random upstream); returns the backward's skip plans and the upstream. Buffers are NaN-poisoned: a cold
    pair's dz read by a product would show up."""
    plans = []
    tune(debug_plans=plans, debug_poison=True, skip_min_share=0.0, skip_group_rows=group_rows)
    so = leaves(xs, ws, bs)
    ours = _ours(case, so[0], so[1], so[2], xt, wt, None, "triton", target=t, reduction="none", **kw)
    kw.pop("skip_threshold")
    st = leaves(xs, ws, bs)
    theirs = _naive(case, st[0], st[1], st[2], xt, wt, None, False, target=t, reduction="none", **kw)
    s64 = leaves(*(None if a is None else a.double() for a in (xs, ws, bs)))
    truth = _naive(case, s64[0], s64[1], s64[2], xt.double(), wt.double(), None, True, target=t, reduction="none",
                   pairwise_grad=True, **kw)
    assert_within_rule("loss", ours, theirs, truth)
    up = torch.randn(truth.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    names = ("d_input", "d_weight", "d_bias")[: 2 if bs is None else 3]
    for name, go, gt, g64 in zip(names, grads(ours, so, up), grads(theirs, st, up), grads(truth, s64, up),
                                 strict=True):
        assert torch.isfinite(go).all()
        assert_within_rule(name, go, gt, g64)
    return plans, up


# Each token block's cold tiles (of 7): block 0's rows are hot in tiles 0-3, block 1's in 0, 4, 5 and block 2's in
# 1 and 6 (HOT_SETS), in both heads.
COLD = 3 + 4 + 5


@pytest.mark.parametrize("case", ["fkl", "rkl", "jsd", "jsd-skew", "ce"])
def test_auto_skips_cold_pairs_within_rule(case, tune):
    # "auto" (skip_gate told that skipping always pays): every pair that is cold in both heads is left out, and the
    # gradients stay within the rule
    xs, ws, xt, wt, t = peaked_pair(torch.bfloat16)
    plans, _ = run_check(case, xs, ws, xt, wt, t, tune, skip_threshold="auto")
    (sp,) = plans
    assert sp.rows is None and sp.hot.shape == (3, 7)
    assert int((sp.hot == 0).sum()) == COLD


@pytest.mark.parametrize("case", ["rkl", "jsd"])
def test_fixed_threshold_grouped_rows_bias_softcap(case, tune):
    # a fixed budget with the rows grouped by the plan (the backward runs them in its order), a student bias, a
    # softcap and a temperature: within the rule, and every row's bound on its dL/dz's change is within its budget
    xs, ws, xt, wt, t = peaked_pair(torch.float16, seed=1)
    bs = (torch.randn(ws.shape[0], generator=torch.Generator().manual_seed(2)) * 0.1).to(ws.dtype)
    tau = 2.0**-10
    plans, up = run_check(case, xs, ws, xt, wt, t, tune, group_rows=True, bs=bs, skip_threshold=tau,
                          softcap=30.0, temperature=1.3)
    (sp,) = plans
    assert int((sp.hot == 0).sum()) > 0
    g = torch.where(t != -100, up, 0.0).abs().float()
    assert (sp.row_bound <= tau * g * (1 + 2.0**-10) + 1e-30).all()


def test_flat_softmax_skips_nothing(tune):
    # a head at initialisation: every tile holds a share of each row's mass far above any budget
    g = torch.Generator().manual_seed(3)
    xs, xt = torch.randn(45, 24, generator=g), torch.randn(45, 20, generator=g)
    ws, wt = torch.randn(200, 24, generator=g) / 24**0.5, torch.randn(200, 20, generator=g) / 20**0.5
    t = torch.randint(0, 200, (45,), generator=g)
    for case in ("fkl", "rkl"):
        plans, _ = run_check(case, *(a.bfloat16() for a in (xs, ws, xt, wt)), t, tune, skip_threshold="auto")
        assert int(plans[-1].hot.sum()) == plans[-1].hot.numel()


def test_dense_by_default_and_float32_auto(tune):
    # no plan unless asked for; "auto" has no budget for float32 inputs (as the one-head ops)
    plans = []
    tune(debug_plans=plans, skip_min_share=0.0)
    xs, ws, xt, wt, t = peaked_pair(torch.bfloat16)
    for kw in ({}, {"skip_threshold": None}, {"skip_threshold": 0.0}):
        logitless.linear_kl_div(xs.requires_grad_(), ws, xt, wt, target=t, backend="triton", **kw).backward()
    xs, ws, xt, wt, t = peaked_pair(torch.float32)
    logitless.linear_kl_div(xs.requires_grad_(), ws, xt, wt, target=t, backend="triton",
                            skip_threshold="auto").backward()
    assert plans == []
    with pytest.raises(ValueError, match="skip_threshold"):
        logitless.linear_jsd(xs, ws, xt, wt, skip_threshold=1.5)
    with pytest.raises(ValueError, match="skip_threshold"):
        logitless.linear_soft_cross_entropy(xs, ws, xt, wt, skip_threshold="always")


def test_torch_compile_fullgraph_skipping(tune):
    # the pair costs are outputs of the opaque loss op, shaped by the options alone: one graph, as eager
    xs, ws, xt, wt, t = peaked_pair(torch.bfloat16)

    plans = []
    tune(skip_min_share=0.0, debug_plans=plans)
    bs = torch.zeros(ws.shape[0], dtype=ws.dtype)

    def loss_fn(x, w, b, t):
        return logitless.linear_kl_div(x, w, xt, wt, student_bias=b, target=t, direction="reverse",
                                       backend="triton", skip_threshold=2.0**-10)

    assert_compiled_matches_eager(loss_fn, xs, ws, bs, t, compile_backend="aot_eager")
    assert len(plans) == 2 and torch.equal(plans[0].hot, plans[1].hot) and int((plans[0].hot == 0).sum()) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["fkl", "rkl", "jsd"])
def test_gpu_large_peaked(case, tune):
    # a trained-like peaked pair at an LM's sizes (V = 32000, D = 1024): "auto" within the rule and skipping most
    # pairs (time it with tools/gpu_distill.py --skip-threshold)
    n, d, v = 1024, 1024, 32000  # (the float64 reference's pairwise autograd graph runs out of memory at 4096 rows)
    g = torch.Generator().manual_seed(0)
    hot = torch.randint(0, v, (n // 128, 6), generator=g)
    heads = []
    for amp in (1.0, 1.05):
        w = torch.randn(v, d, generator=g) * (0.3 / d**0.5)
        x = torch.randn(n, d, generator=g) * 0.1
        for b in range(n // 128):
            for k in range(3):
                c = int(hot[b, k])
                direction = torch.randn(d, generator=g)
                w[c] = direction / direction.norm()
                x[b * 128: (b + 1) * 128] += (20.0 - 2 * k) * amp * w[c]
        heads += [x.bfloat16().cuda(), w.bfloat16().cuda()]
    t = torch.randint(0, v, (n,), generator=g).cuda()
    plans, _ = run_check(case, *heads, t, tune, skip_threshold="auto")
    assert float((plans[0].hot == 0).float().mean()) > 0.5
