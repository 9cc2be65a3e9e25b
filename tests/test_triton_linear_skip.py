"""Sparsity: cold (token block x tile) pairs skipped by the backward, on the Triton path (the interpreter on CPU).
The interpreter's tiles are 32 tokens x 64 classes, so N = 70, V = 300 make 3 token blocks (the last partial)
and 5 tiles (the last of 44 classes).

Split by concern: op semantics in test_triton_linear.py, the kernels' mechanics in test_triton_linear_kernels.py,
their host plans in test_triton_linear_plans.py, skipping in test_triton_linear_skip.py, bad arguments in
test_triton_linear_validation.py; what they share in triton_linear_common.py.
"""

import functools
import math

import pytest
import torch

import logitless
from logitless import testing, triton_backend
from logitless.apps.bench import data
from logitless.kernels import linear_head as lh
from logitless.kernels.linear_head import configs as lh_configs
from logitless.linear_cross_entropy import class_counts
from tests.helpers import (
    assert_within_rule,
    check_against_truth,
    grads,
    leaves,
)
from tests.triton_linear_common import (
    DEV,
    WORKSPACES,
    poison,  # noqa: F401 - autouse: every test runs with NaN-poisoned buffers
)

TAU = 2.0**-12  # a fixed threshold that is safe for bf16/fp16


@pytest.fixture
def small_tiles(tune):
    # These tests spell out tile maps for the interpreter's 32 x 64 tiles: on a GPU they run with those tiles too.
    # Their maps are by the rows' own order: the plan's grouping of rows is tested on its own.
    tune(linear_config=lh_configs.interpreter_config(), skip_group_rows=False)


def peaked(dtype, hot_sets, n=70, d=24, v=300, seed=0):
    """A head whose rows hold their mass on three 'hot' classes each (a peaked softmax, like a trained LM's). The
    hot classes' W rows are distinct unit vectors, the other rows small and random; row i of token block b has
    x_i = 20 (e_a + e_b) + 18 e_c for three classes drawn from hot_sets[b % len(hot_sets)], and target a. Every other
    class holds ~e^-15 of the row's mass, so a tile is cold for a block where none of its rows has a hot class."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(v, d, generator=g) * (0.3 / d**0.5)
    hot = sorted({c for cs in hot_sets for c in cs})
    for k, c in enumerate(hot):
        w[c] = 0.0
        w[c, k] = 1.0
    x = torch.randn(n, d, generator=g) * 0.1
    t = torch.empty(n, dtype=torch.long)
    for i in range(n):
        cs = hot_sets[(i // 32) % len(hot_sets)]
        a, b, c = (cs[j] for j in torch.randperm(len(cs), generator=g)[:3].tolist())
        x[i, hot.index(a)] += 20.0
        x[i, hot.index(b)] += 20.0
        x[i, hot.index(c)] += 18.0
        t[i] = a
    return x.to(dtype).to(DEV), w.to(dtype).to(DEV), t.to(DEV)


def skip_check(x, w, b, t, tune, needs="xwb", **kw):
    """Loss and gradients of the Triton path (with kw: skip_threshold, vocab_order, ...) against float64 under the
    error rule; returns (the backward's skip plans, our gradients)."""
    plans = []
    tune(debug_plans=plans, skip_min_share=0.0, skip_min_share_row_chunks=0.0)  # "auto" skips from the first call
    opts = {k: kw.pop(k) for k in ("skip_threshold", "vocab_order", "workspace_bytes") if k in kw}
    ins = {}
    outs = {}
    for name in ("ours", "torch", "f64"):
        ins[name] = [None if a is None else (a.double() if name == "f64" else a).detach().clone().requires_grad_(
            k in needs) for a, k in zip((x, w, b), "xwb", strict=True)]
        xi, wi, bi = ins[name]
        if name == "ours":
            outs[name] = logitless.linear_cross_entropy(xi, wi, t, linear_bias=bi, backend="triton", **opts, **kw)
        else:
            outs[name] = testing.naive_linear_cross_entropy(xi, wi, t, linear_bias=bi, upcast=name == "f64", **kw)
    assert_within_rule("loss", outs["ours"], outs["torch"], outs["f64"])
    gs = {name: grads(outs[name], ins[name]) for name in outs}
    names = [f"d_{k}" for k, a in zip("xwb", (x, w, b), strict=True) if a is not None and k in needs]
    for name, go, gt, g64 in zip(names, gs["ours"], gs["torch"], gs["f64"], strict=True):
        assert_within_rule(name, go, gt, g64)
    return plans, gs["ours"]


def test_skip_peaked_bf16(tune, small_tiles):
    # Block 0 uses hot classes of tile 0, block 1 of tile 1, block 2 of tiles 0 and 3; two rows have targets in
    # tiles that are otherwise cold for their block (a tile holding a target is never skipped), two are ignored.
    x, w, t = peaked(torch.bfloat16, [[1, 2, 3, 4], [70, 71, 72, 73], [1, 2, 200, 201]])
    t[5], t[40], t[10], t[45] = 150, 290, -100, -100
    plans, _ = skip_check(x, w, None, t, tune, skip_threshold=TAU)
    (plan,) = plans
    expected = torch.tensor([[1, 0, 1, 0, 0], [0, 1, 0, 0, 1], [1, 0, 0, 1, 0]], dtype=torch.uint8)
    assert torch.equal(plan.hot.cpu(), expected)
    assert (plan.row_bound <= TAU).all() and (plan.row_bound > 0).any()
    assert (plan.row_bound[t == -100] == 0).all()  # ignored rows lose nothing: their coefficients are 0


def test_skip_nothing_on_uniform_data(tune, small_tiles):
    # Near-uniform softmax (initialisation): every pair holds ~BLOCK_V / V of each row's mass, far above the budget.
    head = data.make_head("uniform", 37, 24, 300, dtype=torch.bfloat16, seed=3, device=DEV)
    plans, _ = skip_check(head.input, head.weight, None, head.target, tune, skip_threshold=TAU)
    assert len(plans) == 1 and bool(plans[0].hot.all()) and (plans[0].row_bound == 0).all()


def test_skip_bound_stops_skipping(tune, small_tiles):
    # Hot classes in tile 0; tile 1 random (cold: ~1e-7 of the mass); tiles 2, 3, 4 hold exactly 0.45, 0.45 and
    # 0.31 x TAU of every row's mass (zero W rows, a bias): each is cold alone, but skipping all three would lose
    # 1.2 TAU, so the plan must stop after two of them (tile 4, then 2 or 3).
    x, w, t = peaked(torch.bfloat16, [[1, 2, 3, 4]], n=40)
    w[128:] = 0
    z = x.double() @ w.double().T
    lse = torch.logsumexp(z[:, :128], 1)
    b = torch.zeros(300, dtype=torch.float64, device=DEV)
    b[128:] = lse.min() + math.log(0.45 * TAU / 64)
    b = b.to(torch.bfloat16)
    plans, (dx, dw, db) = skip_check(x, w, b, t, tune, skip_threshold=TAU)
    (plan,) = plans
    hot = plan.hot.cpu()
    assert (hot[:, 0] == 1).all() and (hot[:, 1] == 0).all() and (hot[:, 4] == 0).all()
    assert (hot[:, 2] + hot[:, 3] == 1).all()
    # The bound holds the skipped mass (float64, from the same bf16 inputs), and it is what stopped the skipping.
    p = torch.softmax(x.double() @ w.double().T + b.double(), 1)
    cold_cols = (1 - hot).repeat_interleave(64, 1)[:, :300].repeat_interleave(32, 0)[:40].to(DEV)
    skipped = (p * cold_cols).sum(1)
    assert (skipped <= plan.row_bound.double() * (1 + 1e-4)).all() and (plan.row_bound <= TAU).all()
    assert all(plan.row_bound[i:i + 32].max() > 0.6 * TAU for i in (0, 32))  # each block's tightest row
    tiles = torch.empty(lh.tile_grid(x, w), device=DEV, dtype=torch.float16)
    m, logs, *_ = lh.forward_stats(x, w, b, t, None, softcap=None, inv_temp=1.0, want_smooth=False,
                                   want_entropy=False, tile_lse=tiles)
    a = torch.ones_like(m)
    loose = lh.skip_plan(tiles, m, logs, a, t, None, 300, 2 * TAU, 32, 64, group_rows=False)
    assert (loose.hot.cpu()[:, 1:] == 0).all()  # with twice the budget, all four go
    # Skipped pairs are not computed: tile 1 is cold for every block, so its dW rows and bias gradient are exactly 0.
    assert (dw[64:128] == 0).all() and (db[64:128] == 0).all() and (dw[:64] != 0).any()


def test_vocab_order_groups_hot_classes(tune, small_tiles):
    # Hot classes one per tile: in identity order every tile is hot for every block. Ordered by the batch's target
    # counts (within the ranges the bf16 workspace layout allows, here [0, 192) and [192, 300)), they share two
    # tiles and the other three go cold. Bias and dW rows go back to their own classes.
    hot_classes = [5, 70, 141, 210, 280]
    x, w, t = peaked(torch.bfloat16, [hot_classes], n=40)
    b = (torch.randn(300, generator=torch.Generator().manual_seed(7)) * 0.1).to(torch.bfloat16).to(DEV)
    t[3] = -100
    # (the leanest plan: with the default policy's own accumulator the order has one range, [0, 300))
    plans, _ = skip_check(x, w, b, t, tune, skip_threshold=TAU, vocab_order="batch", workspace_bytes=0)
    xo, wo = leaves(x, w)
    grads(logitless.linear_cross_entropy(xo, wo, t, skip_threshold=TAU, backend="triton", workspace_bytes=0),
          [xo, wo])
    assert bool(plans[1].hot.all())
    position = torch.argsort(lh.vocab_order(class_counts(t, 300, -100), x, w, 0))  # the order the call used
    tiles = sorted({int(position[c]) // 64 for c in hot_classes})
    assert len(tiles) == 2
    expected = torch.zeros(2, 5, dtype=torch.uint8)
    expected[:, tiles] = 1
    assert torch.equal(plans[0].hot.cpu(), expected)


def interleaved(dtype, n=64, d=24, v=300, seed=0):
    """Rows alternate between two kinds: even rows hold their mass on classes of tile 0 alone, odd rows on classes
    of tiles 1 and 3 (the interpreter's 64-class tiles). In the rows' own order every 32-row block needs tiles 0, 1
    and 3; grouped by how many tiles they need, half the blocks need tile 0 alone and the others tiles 1 and 3."""
    x0, w, t0 = peaked(torch.float32, [[1, 2, 3, 4]], n=n, d=d, v=v, seed=seed)
    x1, _, t1 = peaked(torch.float32, [[70, 71, 200, 201]], n=n, d=d, v=v, seed=seed)
    # (peaked gives both the same W: the hot classes 1-4, 70, 71, 200, 201 are unit vectors of distinct columns in
    # each call's own numbering, so rebuild W for all eight)
    hot = [1, 2, 3, 4, 70, 71, 200, 201]
    g = torch.Generator().manual_seed(seed + 1)
    w = torch.randn(v, d, generator=g) * (0.3 / d**0.5)
    x = torch.randn(n, d, generator=g) * 0.1
    t = torch.empty(n, dtype=torch.long)
    for i in range(n):
        cs = hot[:4] if i % 2 == 0 else hot[4:]
        a, b, c = (cs[j] for j in torch.randperm(4, generator=g)[:3].tolist())
        for cls, lift in ((a, 20.0), (b, 20.0), (c, 18.0)):
            x[i, hot.index(cls)] += lift
        t[i] = a
    for k, c in enumerate(hot):
        w[c] = 0.0
        w[c, k] = 1.0
    return x.to(dtype).to(DEV), w.to(dtype).to(DEV), t.to(DEV)


def test_skip_groups_rows(tune, small_tiles):
    # The plan groups rows by how many tiles they need: interleaved rows whose blocks share nothing cold in their own
    # order share most of it once grouped. The gradients come back in the input's row order (checked against float64
    # by skip_check) and every row keeps within its budget.
    x, w, t = interleaved(torch.bfloat16)
    plans, _ = skip_check(x, w, None, t, tune, skip_threshold=TAU)
    (own,) = plans
    assert own.rows is None and own.hot[:, [0, 1, 3]].all()
    tune(skip_group_rows=True)
    plans, _ = skip_check(x, w, None, t, tune, skip_threshold=TAU)
    (grouped,) = plans
    rows = grouped.rows.cpu()
    assert torch.equal(rows.sort().values, torch.arange(64))
    parity = (rows % 2).view(2, 32)  # each block holds one kind of row
    assert (parity == parity[:, :1]).all() and parity[0, 0] != parity[1, 0]
    hot = grouped.hot.cpu()
    kinds = [hot[b] for b in range(2)]
    need = {0: torch.tensor([1, 0, 0, 0, 0]), 1: torch.tensor([0, 1, 0, 1, 0])}
    for b in range(2):
        assert torch.equal(kinds[b], need[int(parity[b, 0])].to(torch.uint8))
    assert int(grouped.hot.sum()) < int(own.hot.sum())
    assert (grouped.row_bound <= TAU).all() and (grouped.row_bound > 0).any()


def test_skip_vocab_stored_by_mass(tune, small_tiles):
    # Every block's hot classes are scattered over tiles 0-3 in id order, so nothing but tile 4 is cold; with the
    # head stored by the mass of another sample (VocabOrder), they fill tile 0 and the plan skips tiles 1-4 for every
    # block. The sorted problem's loss and gradients stay within the error rule against float64.
    hot_sets = [[1, 70, 140, 210], [2, 71, 141, 211], [3, 72, 142, 212]]
    x, w, t = peaked(torch.bfloat16, hot_sets, n=96)
    plans, _ = skip_check(x, w, None, t, tune, skip_threshold=TAU)
    assert plans[0].hot[:, :4].all()
    sample = peaked(torch.bfloat16, hot_sets, n=96, seed=1)[0]
    order = logitless.VocabOrder.by_mass(sample, w)
    assert set(order.ids[:12].tolist()) == {c for cs in hot_sets for c in cs}
    plans, (dx, dw) = skip_check(x, order.sort(w), None, order.map_ids(t), tune, skip_threshold=TAU)
    assert torch.equal(plans[0].hot.cpu(), torch.tensor([[1, 0, 0, 0, 0]] * 3, dtype=torch.uint8))
    # The same gradients as the problem in id order, up to the permutation of dW's rows.
    xo, wo = leaves(x, w)
    ref = grads(logitless.linear_cross_entropy(xo, wo, t, backend="triton"), [xo, wo])
    torch.testing.assert_close(dx.float(), ref[0].float(), rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(order.unsort(dw).float(), ref[1].float(), rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("split,deal_pct,deal", [(4, 100.0, "share"), (3, 0.0, "share"), (2, 100.0, "share"),
                                                 (4, 0.0, "makespan")])
def test_skip_dx_split(tune, small_tiles, split, deal_pct, deal):
    # The skipping backward may deal each dx tile's reduction steps out to several programs (float32 partials added
    # after the last chunk); dealt out (deal_pct 100) or not (0), or chunk by chunk by their makespan, the gradients
    # hold the error rule, and equal the undealt ones to float32 rounding.
    x, w, t = peaked(torch.bfloat16, [[1, 2, 3, 4], [70, 71, 72, 73], [1, 2, 200, 201]], n=96)
    tune(skip_dx_split=1)
    _, ref = skip_check(x, w, None, t, tune, skip_threshold=TAU)
    tune(skip_dx_split=split, skip_dx_deal_pct=deal_pct, skip_dx_deal=deal)
    _, got = skip_check(x, w, None, t, tune, skip_threshold=TAU)
    torch.testing.assert_close(got[0].float(), ref[0].float(), rtol=1e-2, atol=1e-4)
    torch.testing.assert_close(got[1].float(), ref[1].float(), rtol=0, atol=0)  # dW: the same programs


def test_skip_dx_deal_names_its_choices():
    from logitless import kernels

    with pytest.raises(ValueError, match="skip_dx_deal"), kernels.tuning(skip_dx_deal="makespn"):
        pass


def test_deal_by_makespan():
    # A chunk deals its dx tiles' steps out where its longest dx tile is longer than the even share of all its
    # steps: one token block holding every hot tile among many cold ones, not hot pairs spread evenly.
    from logitless.kernels.linear_head import configs, plans

    cfg = configs.hopper_config()
    one = torch.zeros(64, 129, dtype=torch.int32)
    one[63, 1:] = torch.arange(1, 129, dtype=torch.int32)  # block 63: all 128 tiles hot, the others none
    spread = torch.arange(129, dtype=torch.int32).repeat(64, 1) // 4  # every block: a quarter of the tiles
    assert plans.deal_by_makespan(one, [0, 128], 640, cfg, 132).tolist() == [1]
    assert plans.deal_by_makespan(spread, [0, 128], 640, cfg, 132).tolist() == [0]
    # longest 4 x 128 steps against (4 + 4 per hot pair and column tile) x 3 x 128 pairs / sms: dealt from 7 on
    assert plans.deal_by_makespan(one, [0, 128], 640, cfg, 5).tolist() == [0]
    # chunk by chunk: block 63 alone in the second half, everything spread in the first
    both = spread.clone()
    both[:, 65:] = both[:, 64:65]
    both[63, 65:] += torch.arange(1, 65, dtype=torch.int32)
    assert plans.deal_by_makespan(both, [0, 64, 128], 640, cfg, 132).tolist() == [0, 1]


def tile4_head(units):
    """A peaked bfloat16 head of 300 classes whose tile 4 (classes 256-299: zero W rows and one bias) holds about
    units x 2^-12 of every row's mass; (x, w, t, bias, each row's largest logit in float64)."""
    x, w, t = peaked(torch.bfloat16, [[1, 2, 3, 4], [70, 71, 72, 73]], n=64)
    w[256:] = 0
    lse = torch.logsumexp(x.double() @ w.double().T, 1)
    b = torch.zeros(300, dtype=torch.float64, device=DEV)
    b[256:] = lse.min() + math.log(units * TAU / 44)
    b = b.to(torch.bfloat16)
    return x, w, t, b, (x.double() @ w.double().T + b.double()).amax(1)


def test_skip_auto_budget(tune, small_tiles):
    # skip_threshold="auto": each row may lose 2^-11 max(1, |m_i|) (1 - p_max,i) of its mass in bfloat16 (2^-14 in
    # float16), a quarter of the rounding error of its gradient row in the dtype; float32 inputs skip nothing. Tile 4
    # holds 3 x 2^-12 of every row's mass (zero W rows and a bias): too much for the fixed 2^-12, within the budget
    # of rows whose largest logit is ~20 and whose top class holds about half of the mass.
    x, w, t, b, m = tile4_head(3)
    fixed, _ = skip_check(x, w, b, t, tune, skip_threshold=TAU)
    auto, _ = skip_check(x, w, b, t, tune, skip_threshold="auto")
    assert fixed[0].hot[:, 4].all() and not auto[0].hot[:, 4].any()
    assert (auto[0].row_bound.double() <= 2.0**-11 * m.abs().clamp(min=1) * (1 + 1e-3)).all()
    assert (auto[0].row_bound > 2 * TAU).all()
    plans = []
    tune(debug_plans=plans, skip_min_share=0.0)
    for dtype, none in ((torch.float16, False), (torch.float32, True)):
        plans.clear()
        x, w, t = peaked(dtype, [[1, 2, 3, 4], [70, 71, 72, 73]], n=64)
        xo, wo = leaves(x, w)
        grads(logitless.linear_cross_entropy(xo, wo, t, skip_threshold="auto", backend="triton"), [xo, wo])
        assert (plans == []) == none


def test_skip_budget_scale(tune, small_tiles):
    # Tuning.skip_budget_scale multiplies "auto"'s per-row budget. As in test_skip_auto_budget, tile 4 holds a fixed
    # share of every row's mass (zero W rows and a bias), here 24 x 2^-12: over "auto"'s budget of these rows, under
    # twice it. At the default scale the tile stays hot and the call meets the precision rule; doubled, the tile goes
    # cold and every row's skipped mass stays within twice the bound. (Doubled, this head's d_weight error is 2.6 x
    # PyTorch's, over the rule: the 44 classes of that tile lose their whole gradient. That is why the scale is only
    # for A/B runs on real heads, where the bench checks the rule.)
    x, w, t, b, m = tile4_head(24)
    one, _ = skip_check(x, w, b, t, tune, skip_threshold="auto")
    assert one[0].hot[:, 4].all()
    two = []
    tune(skip_budget_scale=2.0, debug_plans=two)
    xo, wo, bo = leaves(x, w, b)
    grads(logitless.linear_cross_entropy(xo, wo, t, linear_bias=bo, skip_threshold="auto", backend="triton"),
          [xo, wo, bo])
    (plan,) = two
    assert not plan.hot[:, 4].any()
    assert (plan.row_bound.double() <= 2 * 2.0**-11 * m.abs().clamp(min=1) * (1 + 1e-3)).all()


def test_skip_bound_holds_when_cold_rows_align(tune, small_tiles):
    # Adversarial: the skipped classes' W rows all point the same way, long (norm 40) and far from every x, so their
    # mass is cold but each unit of it moves dx a long way, all in one direction. The error the skipping adds to
    # each row of dx stays within the documented bound: row_bound_i |A_i| max_j ||w_j||.
    n, d, v = 64, 24, 300
    x, w, t = peaked(torch.float32, [[1, 2, 3, 4], [70, 71, 72, 73]], n=n, d=d, v=v)
    x, w = x.cpu(), w.cpu()
    u = torch.zeros(d)
    u[-1] = 1.0
    x[:, -1] = 0.2
    cold = torch.tensor([c for c in range(v) if c not in (1, 2, 3, 4, 70, 71, 72, 73)])
    w[cold] = 40.0 * u
    # a cold class's logit is 8 = 40 x 0.2 against 20 for the top ones: ~e^-12 each, ~2e-3 of a row in all
    x, w = x.to(torch.bfloat16).to(DEV), w.to(torch.bfloat16).to(DEV)
    tau = 2.0**-8
    out = {}
    for name, thr in (("skip", tau), ("dense", 0.0)):
        plans = []
        tune(debug_plans=plans)
        xo, wo = leaves(x, w)
        out[name] = grads(logitless.linear_cross_entropy(xo, wo, t, reduction="sum", skip_threshold=thr,
                                                         backend="triton"), [xo, wo])[0].double()
        if thr:
            (plan,) = plans
    assert not plan.hot.all()
    bound = plan.row_bound.double() * w.double().norm(dim=1).max()
    diff = (out["skip"] - out["dense"]).norm(dim=1)
    rounding = 2.0**-7 * out["dense"].norm(dim=1)  # the two bf16 results' own rounding
    assert (diff <= bound + rounding + 1e-6).all()
    assert (diff > rounding).any()  # the skipped mass does move dx, along u


# Workspace arrangements (WORKSPACES above) with skipping and a vocabulary order: aligned chunks, dW rows written
# through the order (also from split-K partials), the second pass's dz in dW rows, the dx-only and V < 2N plans;
# and skipping in the vocabulary's own order with wide first-pass chunks (dz in unwritten dW rows, aligned).
# slow: the three larger arrangements; the quick run keeps their plans (test_backward_workspaces), skipping in the
# vocabulary's own order (the skip tests above) and skipping through an order in the five smaller ones here.
@pytest.mark.parametrize("name,order", [("alias_both", "batch"), ("alias_split_k", "batch"), ("dx_only", "batch"),
                                        ("dw_only", "batch"), ("small_vocab", "batch"),
                                        pytest.param("wide_chunks", "none", marks=pytest.mark.slow),
                                        pytest.param("own_acc", "counts", marks=pytest.mark.slow),
                                        pytest.param("wide_scratch", "counts", marks=pytest.mark.slow)])
def test_skip_workspaces(tune, name, order, monkeypatch, small_tiles):
    dtype, n, d, v, cols, needs, sms, *budget = WORKSPACES[name]
    orders, records = [], []
    make_order = lh.vocab_order
    monkeypatch.setattr(triton_backend, "vocab_order", lambda *a: orders.append(make_order(*a)) or orders[-1])
    tune(scratch_bytes=n * cols * torch.empty((), dtype=dtype).element_size(), debug_backwards=records)
    monkeypatch.setattr(lh_configs, "backward_sms", lambda device: sms)
    x, w, t = peaked(dtype, [[1, 2, 3, 40], [70, 71, 72, 20], [5, 6, 90, 91]], n=n, d=d, v=v)
    b = (torch.randn(v, generator=torch.Generator().manual_seed(7)) * 0.1).to(dtype).to(DEV)
    if order == "counts":  # per-class counts that reorder every range of the vocabulary
        order = torch.rand(v, generator=torch.Generator().manual_seed(3)).to(DEV)
    plans, _ = skip_check(x, w, b, t, tune, needs=needs, reduction="sum", skip_threshold=TAU,
                          vocab_order=order, workspace_bytes=budget[0] if budget else 0)
    assert len(plans) == 1 and not bool(plans[0].hot.all())
    (rec,) = records
    assert rec.skip and rec.first_pass
    assert any(dz_at is not None for _, _, dz_at, _ in rec.first_pass) == (isinstance(order, str)
                                                                          and order == "none")
    # The order was made for the backward's workspaces: each second-pass chunk (it writes back only its own rows)
    # holds its own classes.
    for perm in orders:
        for v0, v1, _ in rec.second_pass:
            assert torch.equal(perm[v0:v1].sort().values.cpu().long(), torch.arange(v0, v1)), (v0, v1)


def test_skip_log_probs(tune, small_tiles):
    # linear_log_probs skips too (its gradient is p_j A - C [j = t]; with return_entropy it never does: see
    # test_log_probs_and_entropy).
    x, w, t = peaked(torch.bfloat16, [[1, 2, 3, 4], [70, 71, 72, 73]], n=40)
    plans = []
    tune(debug_plans=plans)
    up = torch.randn(40, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(DEV)
    check_against_truth(functools.partial(logitless.linear_log_probs, skip_threshold=TAU),
                        testing.naive_linear_log_probs, x, w, None, t, upstream=up, backend="triton")
    assert len(plans) == 1 and not bool(plans[0].hot.all())


def test_module_running_vocab_order():
    # LinearCrossEntropyLoss(vocab_order="running") keeps decayed target counts across training steps (on the
    # device) and passes them as the order; evaluation does not update them.
    x, w, t = peaked(torch.bfloat16, [[1, 2, 3, 4], [70, 71, 72, 73]], n=40, v=130)
    loss_fn = logitless.LinearCrossEntropyLoss(skip_threshold=TAU, vocab_order="running", backend="triton")
    counts = None
    for _ in range(2):
        xo, wo = leaves(x, w)
        loss = loss_fn(xo, wo, t)
        counts = loss_fn.vocab_counts.clone()
        g = grads(loss, [xo, wo])
    batch = torch.bincount(t.cpu(), minlength=130).float()
    torch.testing.assert_close(counts.cpu(), batch * 0.99 + batch)
    xo, wo = leaves(x, w)
    same = logitless.linear_cross_entropy(xo, wo, t, skip_threshold=TAU, vocab_order=counts, backend="triton")
    assert torch.equal(same, loss) and all(torch.equal(a, c) for a, c in zip(grads(same, [xo, wo]), g, strict=True))
    loss_fn.eval()
    loss_fn(x, w, t)
    assert torch.equal(loss_fn.vocab_counts, counts)


@pytest.mark.parametrize("skip_wide", [None, 192])
def test_skip_wide_sets_the_first_pass_chunks(tune, small_tiles, skip_wide):
    # Tuning.skip_wide: the skipping backward's first-pass chunks (the interpreter's Config: 160 classes dense, 320
    # skipping), whole tiles of 64, within the rule either way. The default scratch holds one tile's dz, so that
    # only a larger budget widens the chunks.
    records = []
    tune(skip_wide=skip_wide, debug_backwards=records, scratch_bytes=70 * 2 * 64)
    x, w, t = peaked(torch.bfloat16, [[1, 2, 3, 40], [70, 71, 72, 20], [5, 6, 90, 91]], n=70, v=700)
    plans, _ = skip_check(x, w, None, t, tune, needs="xw", skip_threshold=TAU, workspace_bytes=1 << 24)
    assert len(plans) == 1 and not bool(plans[0].hot.all())
    (rec,) = records
    widths = [v1 - v0 for v0, v1, _, _ in rec.first_pass]
    wide = 320 if skip_wide is None else skip_wide
    assert max(widths) == wide and all(wd % 64 == 0 for wd in widths[:-1]), widths


def _peaked_record(n, t, seed):
    # A float16 tile record whose rows hold their mass in a few tiles, as a trained head's do, and the row
    # statistics that go with it.
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(n, t, generator=g) * 2 - 12
    u.scatter_(1, torch.randint(0, t, (n, 4), generator=g), torch.randn(n, 4, generator=g) + 2)
    u = u.half()
    lse = torch.logsumexp(u.float(), 1)
    m = lse - torch.rand(n, generator=g) * 0.5
    return g, u, m, lse - m


@pytest.mark.parametrize("n,t,block_n,entropy,perm,threshold,targets,group", [
    (300, 40, 32, False, False, -0.25, True, True),
    (257, 7, 32, False, False, -0.25, True, True),  # a partial block, tiles fewer than a sort's 16
    (100, 1, 32, False, False, -0.25, True, True),  # one tile
    (512, 130, 32, True, False, -0.25, True, True),  # the entropy's term; tiles past a power of two
    (64, 33, 32, False, True, -0.25, True, True),  # a vocabulary order
    (333, 90, 16, True, True, 1e-3, True, True),  # a fixed threshold
    (200, 50, 32, False, False, -0.25, False, True),  # no target term (log-probs without one)
    (200, 50, 32, False, False, -0.25, True, False),  # rows in their own order
    (31, 20, 32, False, False, -4.0, True, True),  # one block, fewer rows than it holds
])
def test_plan_kernels_build_the_torch_plan(tune, n, t, block_n, entropy, perm, threshold, targets, group):
    # The three launches of plan_kernels build the plan the PyTorch ops build, list for list: rows with and
    # without coefficients, ignored targets, a NaN in the record, and a budget wide enough that many pairs are cold.
    g, u, m, logs = _peaked_record(n, t, n + t)
    u[n // 2, t // 2] = float("nan")
    a = torch.rand(n, generator=g)
    a[::7] = 0
    b = torch.randn(n, generator=g) * 0.3 if entropy else None
    v = t * 64 - 3
    target = torch.randint(0, v, (n,), generator=g)
    target[::5] = -100
    order = torch.randperm(v, generator=g).to(torch.int32) if perm else None
    u, m, logs, a, b, target, order = (None if z is None else z.to(DEV) for z in (u, m, logs, a, b, target, order))
    args = (u, m, logs, a, target if targets else None, order, v, threshold, block_n, 64, group)
    want = lh.skip_plan(*args, B=b)
    tune(debug_plans=[])
    got = lh.skip_plan(*args, B=b, kernels=True)
    assert torch.equal(want.pairs[1:], want.hot.sum(0, dtype=torch.int32).cumsum(0, dtype=torch.int32))
    assert int(want.pairs[0]) == 0
    for name in ("hot", "list_n", "pre_n", "list_v", "pre_v", "pairs", "rows"):
        w_, g_ = getattr(want, name), getattr(got, name)
        assert (w_ is None) == (g_ is None), name
        if w_ is not None:
            assert torch.equal(w_.to(g_.dtype), g_), name
    assert got.row_bound is not None and got.row_bound.shape == (n,)
    if threshold == 1e-3 and not entropy:
        assert bool((got.row_bound <= threshold * (1 + 2.0**-10)).all())
    assert 0 < int(want.hot.sum()) < want.hot.numel() or t == 1 or n < block_n


@pytest.mark.parametrize("threshold,entropy,perm", [(-0.25, False, False), (-0.25, True, False), (1e-3, True, False),
                                                 (-0.25, False, True)])
def test_plan_kernels_row_vectors(threshold, entropy, perm):
    # The per-row vectors of the kernel plan against the PyTorch ops': lse, |A|, |B| exactly, the budget (its batch
    # sums in another order) to float32 rounding, the target tiles exactly; over several programs' partial sums,
    # with near-certain rows (logs ~ 0: expm1's small-argument side), an ignored target and A broadcast (stride 0).
    from logitless.kernels.linear_head import plan_kernels, skip_plans

    g = torch.Generator().manual_seed(3)
    n, v, bv = 333, 5000, 64
    m = (torch.randn(n, generator=g) * 8).to(DEV)
    logs = (torch.rand(n, generator=g) * 3).to(DEV)
    logs[::4] = torch.rand(len(logs[::4]), generator=g).to(DEV) * 1e-5
    logs[::9] *= 0.7
    a = torch.full((1,), 1.0 / n, device=DEV).expand(n)
    b = (torch.randn(n, generator=g) * 0.3).to(DEV) if entropy else None
    target = torch.randint(0, v, (n,), generator=g).to(DEV)
    target[::5] = -100
    order = torch.randperm(v, generator=g).to(torch.int32).to(DEV) if perm else None
    tgt = skip_plans._target_tiles(target, order, v, bv)
    lse, abs_a, abs_b, budget, got_tgt = plan_kernels.row_vectors(m, logs, a, b, target, tgt if perm else None, v,
                                                                  threshold, bv)
    assert torch.equal(lse, m + logs) and torch.equal(abs_a, a.abs())
    assert (abs_b is None) == (b is None) and (b is None or torch.equal(abs_b, b.abs()))
    torch.testing.assert_close(budget, skip_plans.row_budget(m, logs, threshold, a, b), rtol=4e-7, atol=0)
    assert torch.equal(got_tgt, tgt)
    assert int((got_tgt == -1).sum()) == len(target[::5])


@pytest.mark.gpu
@pytest.mark.parametrize("N,D,V", [(8192, 640, 262144), (4000, 1024, 151936)])
def test_gpu_plan_kernels_at_full_size(N, D, V):
    # On the GPU the kernels' exp and sums round differently from PyTorch's: the plans may differ only at pairs at
    # a budget's edge, and the kernels' plan must keep every row's skipped cost within its budget. Real-size
    # records of an lm head: thousands of tiles per row, the Hopper tiles' blocks.
    head = data.make_head("lm", N, D, V, device="cuda")
    x, w, t = head.input, head.weight, head.target.clone()
    t[::10] = -100
    cfg = lh_configs.config_for(x)
    tiles = torch.empty(lh.tile_grid(x, w), device="cuda", dtype=torch.float16)
    m, logs, *_ = lh.forward_stats(x, w, None, t, None, softcap=None, inv_temp=1.0, want_smooth=False,
                                   want_entropy=False, tile_lse=tiles)
    a = torch.where(t >= 0, 1.0 / N, 0.0)
    args = (tiles, m, logs, a, t, None, V, -0.25, cfg.block_n, cfg.block_v)
    want = lh.skip_plan(*args)
    got = lh.skip_plan(*args, kernels=True)
    assert torch.equal(want.rows, got.rows)
    differ = (want.hot != got.hot).float().mean().item()
    assert differ < 1e-3, differ
    assert 0.05 < 1 - got.hot.float().mean().item() < 0.95
    # Each row's skipped cost relative to its budget, in float64 from the same record (the plan's own formula).
    lse = (m + logs).double()
    u = tiles.double()
    r = (u + u.abs() * 2.0**-10 - lse[:, None] + lse.abs()[:, None] * 2.0**-20).exp().clamp(max=1.0)
    budget = lh.plans.row_budget(m, logs, -0.25, a).double()
    blk = torch.empty_like(got.rows).index_copy_(0, got.rows, torch.arange(N, device="cuda") // cfg.block_n)
    spent = torch.where(got.hot[blk] == 0, r * a.double()[:, None], 0.0).sum(1)
    assert bool((spent <= budget * (1 + 2.0**-12)).all())
    for name in ("list_n", "pre_n", "list_v", "pre_v"):
        if differ == 0:
            assert torch.equal(getattr(want, name), getattr(got, name)), name


@pytest.mark.gpu
@pytest.mark.parametrize("tuning", [{}, {"skip_min_share": 0.0}, {"skip_min_share": 0.0, "skip_dx_deal": "makespan"},
                                    {"skip_min_share": 0.0, "skip_plan_kernels": False}, {"row_chunks": True}])
def test_gpu_no_host_sync(tune, tuning):
    # The forward and backward never wait for the device: every call after the first few (compilation, the skip
    # gate's first probe) runs under torch's sync detector set to raise.
    tune(**tuning)
    head = data.make_head("lm", 4096, 1024, 50304, device="cuda")
    x, w = (p.detach().requires_grad_(True) for p in (head.input, head.weight))
    t = head.target.clone()
    t[::10] = -100

    def step():
        loss = logitless.linear_cross_entropy(x, w, t, backend="triton")
        gx, gw = torch.autograd.grad(loss, (x, w))
        lp, ent = logitless.linear_log_probs(x, w, t.clamp(min=0), backend="triton", return_entropy=True)
        torch.autograd.grad((lp + ent).sum(), (x, w))

    for _ in range(4):
        step()
    torch.cuda.synchronize()
    prior = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            step()
    finally:
        torch.cuda.set_sync_debug_mode(prior)
    torch.cuda.synchronize()


def test_plan_kernels_leave_wide_maps_to_torch(tune, monkeypatch):
    # Past plan_kernels.MAX_TILES tiles a row (the sort's width in one program), the PyTorch ops build the plan.
    from logitless.kernels.linear_head import plan_kernels

    g, u, m, logs = _peaked_record(96, 40, 7)
    a = torch.rand(96, generator=g)
    target = torch.randint(0, 40 * 64, (96,), generator=g)
    args = (u, m, logs, a, target, None, 40 * 64, -0.25, 32, 64, True)
    calls = []
    monkeypatch.setattr(plan_kernels, "MAX_TILES", 32)
    monkeypatch.setattr(plan_kernels, "block_plan", lambda *a, **k: calls.append(1))
    want = lh.skip_plan(*args)
    got = lh.skip_plan(*args, kernels=True)
    assert not calls and torch.equal(want.hot, got.hot) and torch.equal(want.list_v, got.list_v)


@pytest.mark.parametrize("bias", [False, True])
def test_dz_hot_list_matches_one_program_per_pair(tune, small_tiles, bias):
    # The dz launches that walk the hot pairs alone compute each hot pair as the one-program-per-pair launches do:
    # bitwise equal gradients, over several chunks (skip_wide of three tiles), a bias (the cold pairs' partials are
    # zeros without a program), ignored rows, tiles with no hot block and tiles hot for every block.
    x, w, t = peaked(torch.bfloat16, [(3, 70, 140), (200, 230, 290)], n=100, v=450)
    t[::9] = -100
    b = torch.randn(450, generator=torch.Generator().manual_seed(1)) * 0.1
    b = b.to(torch.bfloat16).to(DEV) if bias else None
    out = []
    for hot_list in (False, True):
        records = []
        tune(skip_dz_hot_list=hot_list, skip_wide=192, scratch_bytes=100 * 2 * 64, debug_backwards=records)
        _, gs = skip_check(x, w, b, t, tune, skip_threshold=TAU, workspace_bytes=1 << 24)
        launches = [d for r in records for d in r.dz]
        assert len(launches) >= 3 and all(d.skip for d in launches)
        # at most a program per multiprocessor (the interpreter's stand-in count on the CPU), walking the hot pairs
        sms = lh_configs.backward_sms(x.device)
        assert all(d.persistent and d.programs <= sms for d in launches) == hot_list
        out.append(gs)
    for a, c in zip(*out, strict=True):
        assert torch.equal(a, c)


def test_skip_products_take_narrow_tiles_where_d_half_fills_the_last():
    # Config.skip_products: the skipping gradient products' tiles narrow (skip_block_d, skip_grad_stages) only where
    # D's last block_d tile would be at most half full.
    cfg = lh_configs.hopper_config()
    for d, narrow in ((640, True), (576, True), (896, True), (960, False), (2304, False), (4096, False), (100, True),
                      (200, False)):
        got = cfg.skip_products(d)
        assert (got.block_d, got.grad_stages) == ((128, 5) if narrow else (cfg.block_d, cfg.grad_stages)), d
    assert lh_configs.small_smem_config().skip_products(640) == lh_configs.small_smem_config()


@pytest.mark.parametrize("narrow", [0, 16])
def test_skip_narrow_product_tiles(tune, small_tiles, narrow, monkeypatch):
    # D = 40 over the interpreter's 32-column product tiles: the skipping products take 16-column tiles (the Config's
    # skip_block_d) or not; both hold the error rule, over several chunks, and agree to float32 rounding.
    x, w, t = peaked(torch.bfloat16, [(3, 70, 140), (200, 230, 290)], n=100, d=40, v=450)
    t[::7] = -100
    taken = []
    orig = lh_configs.Config.skip_products

    def spy(cfg, d):
        taken.append(orig(cfg, d).block_d)
        return orig(cfg, d)

    monkeypatch.setattr(lh_configs.Config, "skip_products", spy)
    tune(linear_config=lh_configs.interpreter_config().replace(skip_block_d=narrow), skip_wide=192)
    plans, got = skip_check(x, w, None, t, tune, skip_threshold=TAU)
    assert taken == [narrow or 32]
    assert plans and 0 < plans[0].hot.float().mean().item() < 1
    tune(linear_config=lh_configs.interpreter_config().replace(skip_block_d=0), skip_wide=192)
    _, ref = skip_check(x, w, None, t, tune, skip_threshold=TAU)
    for a, c in zip(got, ref, strict=True):
        torch.testing.assert_close(a.float(), c.float(), rtol=1e-2, atol=1e-4)
