"""Skipping cold tiles in the two-head losses' backward (linear_kl_div, linear_jsd, linear_soft_cross_entropy) on
the Triton path (the interpreter on CPU): gradients under the error rule against float64 with pairs actually
skipped, the plan's bound, and a flat softmax that skips nothing. The interpreter's two-head tiles are 16 tokens x
32 classes, so N = 45, V = 200 make 3 token blocks (the last partial) and 7 tiles (the last of 8 classes)."""

from __future__ import annotations

import pytest
import torch

import logitless
from logitless.kernels import two_heads

from .helpers import assert_within_rule, grads, leaves
from .test_distill import CASES, _naive, _ours

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


def run_check(case, xs, ws, xt, wt, t, tune, group_rows=False, **kw):
    """Ours with skipping against float64 under the error rule (loss and both gradients, reduction "none" with a
    random upstream); returns the backward's skip plans."""
    plans = []
    tune(debug_plans=plans, skip_min_share=0.0, skip_group_rows=group_rows)
    so = leaves(xs, ws)
    ours = _ours(case, so[0], so[1], None, xt, wt, None, "triton", target=t, reduction="none", **kw)
    kw.pop("skip_threshold")
    st = leaves(xs, ws)
    theirs = _naive(case, st[0], st[1], None, xt, wt, None, False, target=t, reduction="none", **kw)
    s64 = leaves(xs.double(), ws.double())
    truth = _naive(case, s64[0], s64[1], None, xt.double(), wt.double(), None, True, target=t, reduction="none",
                   pairwise_grad=True, **kw)
    assert_within_rule("loss", ours, theirs, truth)
    up = torch.randn(truth.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for name, go, gt, g64 in zip(("d_input", "d_weight"), grads(ours, so, up), grads(theirs, st, up),
                                 grads(truth, s64, up), strict=True):
        assert_within_rule(name, go, gt, g64)
    return plans
