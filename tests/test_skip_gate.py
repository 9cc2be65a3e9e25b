"""The default skip_threshold="auto": skipping where it pays for a head, the dense plans where its softmax is flat,
decided from earlier calls' plans (logitless.skip_gate) without a host sync, and under torch.compile without a
recompilation."""

from __future__ import annotations

import pytest
import torch

import logitless
from logitless import skip_gate
from logitless.kernels.linear_head import configs as lh_configs
from tests.helpers import assert_within_rule

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def plans(tune):
    """The skip plans the backward makes (one per skipping call), with the interpreter's small tiles."""
    made = []
    tune(linear_config=lh_configs.interpreter_config(), debug_plans=made, skip_probe_every=2, skip_probe_max=4)
    return made


def peaked_head(n=64, d=24, v=300, dtype=torch.bfloat16, seed=0, confident=False):
    """A trained model's kind of softmax: each row's mass on two classes of the first tile (one with `confident`),
    every other class ~e^-16 of it, so whole tiles are cold."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(v, d, generator=g) * (0.3 / d**0.5)
    w[:4] = torch.eye(4, d)
    x = torch.randn(n, d, generator=g) * 0.1
    pick = torch.randint(0, 4, (n,), generator=g)
    x[torch.arange(n), pick] += 20.0 if confident else 16.0
    if not confident:
        x[torch.arange(n), (pick + 1) % 4] += 16.0
    return x.to(DEV, dtype), w.to(DEV, dtype), pick.to(DEV)


def flat_head(n=64, d=24, v=300, dtype=torch.bfloat16, seed=1):
    """A head at initialisation: a near-uniform softmax, nothing cold."""
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(n, d, generator=g), torch.randn(v, d, generator=g) * 0.02
    return x.to(DEV, dtype), w.to(DEV, dtype), torch.randint(0, v, (n,), generator=g).to(DEV)


def step(x, w, t, **kw):
    xg, wg = x.clone().requires_grad_(), w.requires_grad_()
    loss = logitless.linear_cross_entropy(xg, wg, t, backend="triton", **kw)
    loss.backward()
    return loss, xg.grad, w.grad


def test_default_skips_a_peaked_head_and_stays_within_the_rule(plans):
    x, w, t = peaked_head()
    for _ in range(3):
        w.grad = None
        loss, dx, dw = step(x, w, t)
    assert len(plans) == 2  # the first call runs dense, the second probes, the third keeps skipping
    share = 1.0 - plans[-1].hot.float().mean().item()
    assert share > 0.5 and skip_gate.state(w) == "skip"
    assert skip_gate.last_share(w) == pytest.approx(share, rel=1e-6)  # what observe recorded: the last plan's
    # within the rule, against float64 and PyTorch's own bf16
    ref = [a.detach().double().requires_grad_() for a in (x, w)]
    pt = [a.detach().clone().requires_grad_() for a in (x, w)]
    for xs, ws, out in ((ref[0], ref[1], "f64"), (pt[0], pt[1], "torch")):
        lo = torch.nn.functional.cross_entropy((xs @ ws.T).float() if out == "torch" else xs @ ws.T, t)
        lo.backward()
    assert_within_rule("loss", loss, torch.nn.functional.cross_entropy((pt[0] @ pt[1].T).float(), t),
                       torch.nn.functional.cross_entropy(ref[0] @ ref[1].T, t))
    assert_within_rule("d_input", dx, pt[0].grad, ref[0].grad)
    assert_within_rule("d_weight", dw, pt[1].grad, ref[1].grad)


def test_deterministic_calls_do_not_follow_the_gate(plans):
    # "auto" probes the skipping plan on the second call of a head: the same call then gives other bits (within the
    # rule). deterministic=True runs the dense plans on every call, whatever the head's record says.
    x, w, t = peaked_head()
    auto = []
    for _ in range(2):
        w.grad = None
        auto.append(tuple(g.clone() for g in step(x, w, t)[1:]))
    assert len(plans) == 1 and not all(torch.equal(a, b) for a, b in zip(*auto, strict=True))
    fixed = []
    for _ in range(3):
        w.grad = None
        fixed.append(tuple(g.clone() for g in step(x, w, t, deterministic=True)[1:]))
    assert len(plans) == 1  # no skipping plan made
    assert all(torch.equal(a, b) for run in fixed[1:] for a, b in zip(fixed[0], run, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(fixed[0], auto[0], strict=True))  # the dense plans' bits
    # The module form passes it on.
    loss_fn = logitless.LinearCrossEntropyLoss(backend="triton", deterministic=True)
    xg, wg = x.clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss_fn(xg, wg, t).backward()
    assert len(plans) == 1 and torch.equal(xg.grad, fixed[0][0]) and torch.equal(wg.grad, fixed[0][1])


def test_a_near_certain_batch_keeps_its_gradient(plans):
    # Every row ~1 - 2e-6 sure of its target: the whole gradient is the cold classes' mass, and PyTorch's error in it
    # is relative to that mass, so the budget (scaled by each row's mass outside its top class) skips nothing.
    x, w, t = peaked_head(confident=True)
    for _ in range(2):
        w.grad = None
        step(x, w, t)
    assert len(plans) == 1 and bool(plans[0].hot.all())


def test_near_certain_rows_among_uncertain_ones_share_the_batch_budget(plans):
    # Half the rows ~1 - 1e-6 sure of their target, half split between two classes. Alone, the sure rows' budgets
    # would keep every tile of their blocks hot; the batch's budget (plans.row_budget) lets them skip, and the whole
    # gradient stays within the rule against float64 and PyTorch's bf16.
    x, w, t = peaked_head(n=128)
    xc, _, tc = peaked_head(n=128, confident=True, seed=3)
    x, t = torch.cat([x[:64], xc[:64]]), torch.cat([t[:64], tc[:64]])
    for _ in range(3):
        w.grad = None
        loss, dx, dw = step(x, w, t)
    plan = plans[-1]
    order = plan.rows.cpu()
    sure_blocks = [b for b in range(plan.hot.shape[0]) if (order[b * 32:(b + 1) * 32] >= 64).all()]
    assert sure_blocks and plan.hot[sure_blocks].float().mean() < 0.5
    ref = [a.detach().double().requires_grad_() for a in (x, w)]
    pt = [a.detach().clone().requires_grad_() for a in (x, w)]
    for xs, ws, f in ((ref[0], ref[1], lambda z: z), (pt[0], pt[1], lambda z: z.float())):
        torch.nn.functional.cross_entropy(f(xs @ ws.T), t).backward()
    assert_within_rule("d_input", dx, pt[0].grad, ref[0].grad)
    assert_within_rule("d_weight", dw, pt[1].grad, ref[1].grad)


def test_default_runs_dense_on_a_flat_head_and_probes_at_growing_intervals(plans):
    x, w, t = flat_head()
    skipped = []
    for _ in range(12):
        n = len(plans)
        w.grad = None
        step(x, w, t)
        skipped.append(len(plans) > n)
    # call 1 dense, call 2 probes (nothing cold); then a probe after 2 calls, then after 4 (skip_probe_max)
    assert skipped == [False, True, False, True, False, False, False, True, False, False, False, True]
    assert all(bool(p.hot.all()) for p in plans) and skip_gate.state(w) == "dense"


def test_the_dense_answer_matches_the_explicit_dense_call(plans):
    x, w, t = flat_head()
    for _ in range(3):  # dense, the probe, then the dense plans
        w.grad = None
        loss, dx, dw = step(x, w, t)
    w2 = w.detach().clone()
    loss2, dx2, dw2 = step(x, w2, t, skip_threshold=None)
    assert torch.equal(loss, loss2) and torch.equal(dx, dx2) and torch.equal(dw, dw2)


def test_a_fixed_threshold_skips_every_call_and_float32_never(plans):
    x, w, t = flat_head()
    for _ in range(3):
        w.grad = None
        step(x, w, t, skip_threshold=2.0**-12)
    assert len(plans) == 3
    x, w, t = peaked_head(dtype=torch.float32)
    for _ in range(3):
        w.grad = None
        step(x, w, t)
    assert len(plans) == 3  # float32 has no "auto" budget


def test_skip_off_and_other_losses(plans):
    x, w, t = peaked_head()
    for _ in range(3):
        w.grad = None
        step(x, w, t, skip_threshold=None)
        step(x, w, t, label_smoothing=0.1)  # its gradient error is not bounded by the skipped mass
    assert plans == []


def test_under_compile_the_backward_decides_without_recompiling(plans):
    torch._dynamo.reset()
    x, w, t = flat_head()
    fn = torch.compile(lambda a, b, c: logitless.linear_cross_entropy(a, b, c, backend="triton"),
                       backend="aot_eager", fullgraph=True)
    skipped = []
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(5):
            n = len(plans)
            w.grad = None
            xg = x.clone().requires_grad_()
            fn(xg, w.requires_grad_(), t).backward()
            skipped.append(len(plans) > n)
    assert skipped == [False, True, False, True, False]
    torch._dynamo.reset()


def test_log_probs_with_entropy_skip_within_the_rule(plans, tune):
    # RL's objective: per-token weights on the log-probs and on the entropy. The entropy's gradient p_j (z_j - mu)
    # is bounded through the mass (plans.skip_cost), so its rows skip too, and both gradients stay within the rule.
    tune(skip_min_share=0.0)
    x, w, t = peaked_head(n=96)
    g = torch.Generator().manual_seed(5)
    g_lp, g_ent = (torch.randn(96, generator=g).to(DEV) for _ in range(2))
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = logitless.linear_log_probs(xg, wg, t, return_entropy=True, backend="triton")
    (lp.float() * g_lp + ent.float() * g_ent).sum().backward()
    assert len(plans) == 1 and not bool(plans[0].hot.all())
    outs = []
    for dt in (torch.float64, None):
        xs, ws = (a.detach().clone().requires_grad_() if dt is None else a.detach().to(dt).requires_grad_()
                  for a in (x, w))
        z = (xs @ ws.T).float() if dt is None else xs @ ws.T
        logp = torch.log_softmax(z, -1)
        ((logp.gather(1, t[:, None])[:, 0] * g_lp.to(z.dtype)) - (logp.exp() * logp).sum(-1) * g_ent.to(z.dtype)
         ).sum().backward()
        outs.append((xs.grad, ws.grad))
    (rx, rw), (px, pw) = outs
    assert_within_rule("d_input", xg.grad, px, rx)
    assert_within_rule("d_weight", wg.grad, pw, rw)


def test_a_fresh_cast_of_the_weight_is_the_same_head():
    # Under autocast the head is handed a new cast of its weight at every call, wherever the allocator puts it: the
    # record follows the head (shape, dtype, device), so the second call probes as it would with one tensor.
    w = torch.randn(64, 8)
    first, second = w.bfloat16(), w.bfloat16()
    assert first.data_ptr() != second.data_ptr()
    assert skip_gate.decide(first, 0.3) is False  # the first call of a head runs dense
    assert skip_gate.decide(second, 0.3) is True  # the second probes
    assert skip_gate.state(w, torch.bfloat16) == "dense" and skip_gate.state(w) is None


def test_small_heads_need_a_larger_share_to_skip(tune):
    # The break-even share by call: the row-chunk plan's, then a small head's (one product under skip_small_flop,
    # where the skipping step's fixed costs weigh most), then the column plan's; 0 keeps "skip wherever possible".
    from logitless.triton_backend import _min_share

    def share(n, d, v, row_chunks=False):
        return _min_share(torch.empty(n, d, device="meta"), torch.empty(v, d, device="meta"), row_chunks)

    assert share(8192, 768, 50257) == 0.5 and share(16384, 768, 50257) == 0.5  # 0.63 and 1.3 TFLOP a product
    assert share(8192, 640, 262144) == 0.35 and share(16384, 1024, 151936) == 0.35  # 2.7 and 5.1 TFLOP
    assert share(8192, 640, 262144, row_chunks=True) == 0.5
    tune(skip_small_flop=1e12)
    assert share(16384, 768, 50257) == 0.35
    tune(skip_min_share=0.0)
    assert share(8, 8, 64) == 0.0


def test_hot_map_tool_counts_a_plan():
    # tools/cpu_hot_map.py's count: a dense map runs at the dense rate; one token block holding every hot tile of a
    # chunk is the launch's makespan, which dealing its dx tile out to 4 programs shortens.
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "tools" / "cpu_hot_map.py"
    spec = importlib.util.spec_from_file_location("cpu_hot_map", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    full = torch.ones(64, 128, dtype=torch.uint8)
    dense = tool.count(full, 640, 132, 12.0, 5.0, False)
    assert dense["steps"] == dense["dense_steps"] and abs(dense["rate"] - 1.0) < 1e-9
    one = torch.zeros(64, 128, dtype=torch.uint8)
    one[63] = 1
    one[:, 0] = 1
    slow = tool.count(one, 640, 132, 12.0, 5.0, False)
    dealt = tool.count(one, 640, 132, 12.0, 5.0, False, dx_split=4)
    by_makespan = tool.count(one, 640, 132, 12.0, 5.0, False, dx_split=4, deal="makespan")
    assert slow["rate"] < 0.5 and dealt["time"] < 0.5 * slow["time"] and by_makespan["time"] == dealt["time"]
    assert tool.makespan([3.0, 3.0, 2.0, 2.0, 2.0], 2) == 7.0  # longest first (the best split is 6)
