"""The default memory policy (loss_math.default_workspace_bytes): its arithmetic, the plans it picks on both paths,
their precision, and their peak memory against the budget."""

import functools

import pytest
import torch

import logitless
from logitless import loss_math, testing, torch_backend
from logitless.apps.bench.measure import _cpu_peak
from logitless.kernels import current_tuning
from logitless.kernels import linear_head as lh
from logitless.kernels.linear_head import plans as lh_plans
from tests.helpers import assert_within_rule, check_against_truth, leaves, make_case

MiB = 1 << 20
# The shapes of BENCHMARKS.md and of the policy's measurements (N, D, V)
BENCH_SHAPES = [(16384, 768, 50257), (8192, 2304, 256000), (16384, 4096, 128256), (8192, 5120, 131072),
                (16384, 1024, 151936), (8192, 2560, 262144), (16384, 3584, 151655)]


def test_budget_arithmetic():
    # max(16 MiB + the float32 accumulator it is given, a fifth of the bf16 logits), in bytes, whatever the dtype
    assert loss_math.default_workspace_bytes(1, 1) == 16 * MiB
    assert loss_math.default_workspace_bytes(512, 32000) == 16 * MiB  # 6.6 MB of a fifth
    assert loss_math.default_workspace_bytes(16384, 50257) == 2 * 16384 * 50257 // 5  # gpt2: 314 MiB
    assert loss_math.default_workspace_bytes(8192, 131072) == 429496729  # mistral-nemo: 410 MiB
    n = 16 * MiB * 5 // 2  # the crossover: N V = 40 Mi
    assert loss_math.default_workspace_bytes(n, 1) == 16 * MiB
    assert loss_math.default_workspace_bytes(n + 10, 1) == 2 * (n + 10) // 5 > 16 * MiB
    # the accumulator's term: a llama-2-class head (V = 32000, D = 4096), where it is the larger
    acc = 4 * 8192 * 4096
    assert loss_math.default_workspace_bytes(8192, 32000, acc) == acc + 16 * MiB > 2 * 8192 * 32000 // 5
    assert lh_plans.default_budget(8192, 32000, 4096, 2) == acc + 16 * MiB
    assert lh_plans.default_budget(8192, 32000, 4096, 4) == 2 * 8192 * 32000 // 5  # float32: dx in place
    assert lh_plans.default_workspace_bytes is loss_math.default_workspace_bytes  # one policy for both paths


@pytest.mark.parametrize("n,d,v", BENCH_SHAPES + [(8192, 4096, 32000), (4096, 2048, 32000)])
def test_policy_buys_the_accumulator_at_the_benchmark_shapes(n, d, v):
    # bf16 / fp16: the float32 dx accumulator gets its own buffer (no second pass), the rest is scratch; the whole
    # budget stays under a fifth of the bf16 logits or the accumulator plus 16 MiB, far under torch.compile's logits.
    budget = lh_plans.default_budget(n, v, d, 2)
    ws = lh_plans._workspace(n, v, d, 2, None)
    assert ws.own_acc and ws.scratch == budget - 4 * n * d >= 16 * MiB
    assert budget <= max(2 * n * v / 5, 4 * n * d + 16 * MiB)
    # float32: dx accumulates in its own output; the whole budget (the logits' term alone) is scratch
    assert lh_plans._workspace(n, v, d, 4, None) == (loss_math.default_workspace_bytes(n, v), False)


def test_workspace_overrides():
    n, d, v = 16384, 4096, 128256
    scratch = current_tuning().scratch_bytes
    lean = lh_plans._workspace(n, v, d, 2, 0)
    assert lean == (scratch, False) == lh_plans._workspace(n, v, d, 2, scratch)
    assert lh_plans._workspace(n, v, d, 2, 64 * MiB) == (64 * MiB, False)  # under 4 N D + 8 MiB: a wider scratch only
    big = 4 * n * d + 256 * MiB
    assert lh_plans._workspace(n, v, d, 2, big) == (256 * MiB, True)
    # a smaller budget than the policy's, and a larger one, both taken as given
    assert lh_plans._workspace(n, v, d, 2, 300 * MiB) == (300 * MiB - 4 * n * d, True)
    # an accumulator the plan must allocate anyway (a frozen head, V < 2N) counts against the budget
    assert lh_plans._workspace(n, v, d, 2, None, acc_forced=True) == (
        lh_plans.default_budget(n, v, d, 2) - 4 * n * d, True)
    assert lh_plans._workspace(n, v, d, 2, 20 * MiB, acc_forced=True) == (scratch, True)
    assert lh_plans._workspace(n, v, d, 2, 0, acc_forced=True) == (scratch, False)


@pytest.mark.parametrize("n,v,temporaries", [(512, 32000, False), (4096, 32000, False), (4096, 32000, True),
                                             (65536, 128256, False), (3, 50257, False), (700, 5000, True)])
def test_torch_path_blocks(n, v, temporaries):
    # One float32 block takes half the budget (a third with temporaries of its size), all tokens at once while
    # that leaves >= MIN_COLS classes (else token chunks of _MIN_COLS classes), never more than the head.
    rows, cols = torch_backend.blocks.budget_block(n, v, temporaries)
    budget = loss_math.default_workspace_bytes(n, v)
    assert 1 <= rows <= n and 1 <= cols <= v
    assert rows * cols * 4 <= budget // (3 if temporaries else 2)
    assert cols >= min(v, torch_backend.blocks.MIN_COLS)
    assert rows == n or cols == min(v, torch_backend.blocks.MIN_COLS) or rows * (cols + 1) * 4 > budget // 2


# ------------------------------------------------------------------------------------------------------------------
# Triton path (the interpreter on the CPU), small shapes: Tuning.scratch_bytes and the policy's floor shrunk so that
# the lean plan (0), the policy (None) and a large budget differ as they do at the benchmark's shapes.

N, D, V = 37, 64, 300
SCRATCH = N * 32 * 2  # bf16 dz of 32 classes


@pytest.fixture
def small_policy(tune, monkeypatch):
    """Lean scratch of 32 classes; the policy's floor at 2 scratches beside its own accumulator (4 N D + 2
    scratches in all); poisoned workspaces. Returns the three budgets (lean, policy, large)."""
    tune(debug_poison=True, scratch_bytes=SCRATCH)
    monkeypatch.setattr(loss_math, "POLICY_MIN_BYTES", 2 * SCRATCH)
    return 0, None, 4 * N * D + 16 * SCRATCH


def test_small_policy_plans(small_policy):
    plans = {ws: lh_plans._workspace(N, V, D, 2, ws) for ws in small_policy}
    assert plans == {0: (SCRATCH, False), None: (2 * SCRATCH, True), small_policy[2]: (16 * SCRATCH, True)}


@pytest.mark.parametrize("budget", ["lean", "policy", "large"])
@pytest.mark.parametrize("dtype,needs,opts", [
    (torch.bfloat16, "xwb", dict(label_smoothing=0.1, reduction="sum")),  # both gradients: acc in dW or own
    (torch.float16, "x", dict(z_loss=1e-3)),  # frozen head: the accumulator is allocated in every plan
    (torch.float32, "xw", dict(softcap=5.0)),  # dx in place, dz in dW rows or the scratch
])
def test_every_plan_within_rule(small_policy, budget, dtype, needs, opts):
    ws = dict(zip(("lean", "policy", "large"), small_policy, strict=True))[budget]
    records = []
    with logitless.kernels.tuning(debug_backwards=records):
        x, w, b, t = make_case(dtype, n=N, d=D, v=V, bias=True, scale=2.0)
        b = b if "b" in needs else None
        fn = functools.partial(logitless.linear_cross_entropy, workspace_bytes=ws)
        if needs == "x":  # a frozen head: only the input requires grad
            outs = []
            for f, xx, ww in ((functools.partial(fn, backend="triton"), x, w),
                              (functools.partial(testing.naive_linear_cross_entropy, upcast=False), x, w),
                              (testing.naive_linear_cross_entropy, x.double(), w.double())):
                xo = xx.detach().clone().requires_grad_(True)
                loss = f(xo, ww, t, **opts)
                outs.append((loss, torch.autograd.grad(loss, xo)[0]))
            assert_within_rule("loss", outs[0][0], outs[1][0], outs[2][0])
            assert_within_rule("d_input", outs[0][1], outs[1][1], outs[2][1])
        else:
            check_against_truth(fn, testing.naive_linear_cross_entropy, x, w, b, t, backend="triton", **opts)
    assert records and all(rec.workspace.own_acc == (budget != "lean" and dtype != torch.float32) for rec in records)


def test_log_probs_entropy_and_stash_every_plan(tune, small_policy):
    # The entropy's gradient (B term), a temperature, and the forward's stash in dW with each plan: the forward
    # lays the stash out for the same budget as the backward (the policy's, when None).
    tune(torch_products=True, stash_min_flop=0)
    x, w, _, t = make_case(torch.bfloat16, n=N, d=D, v=V, scale=2.0)
    up = torch.randn(N, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    classes = []
    for ws in small_policy:
        lay = lh.stash_layout(x, w, True, ws)
        assert lay is not None
        classes.append(lay.classes)
        check_against_truth(functools.partial(logitless.linear_log_probs, temperature=0.8, workspace_bytes=ws),
                            functools.partial(testing.naive_linear_log_probs, temperature=0.8), x, w, None, t,
                            upstream=up, backend="triton")
    assert classes[0] < classes[1] <= classes[2]  # with its own accumulator, all of dW is room for the stash


def test_vocab_order_under_the_policy(small_policy):
    # Skipping with a vocabulary order: the order is made in the forward for the backward's workspaces (the
    # policy's plan, when None), and each second-pass chunk of the lean plan keeps its own classes.
    for ws in small_policy[:2]:
        x, w, b, t = make_case(torch.bfloat16, n=N, d=D, v=V, scale=3.0)
        check_against_truth(functools.partial(logitless.linear_cross_entropy, skip_threshold=2**-12,
                                              vocab_order="batch", workspace_bytes=ws),
                            testing.naive_linear_cross_entropy, x, w, None, t, backend="triton")


def _backward_peak(x, w, t, ws):
    """Peak bytes the backward allocates (CPU allocator events), minus the gradients it returns."""
    xo, wo = leaves(x, w)
    loss = logitless.linear_cross_entropy(xo, wo, t, backend="triton", workspace_bytes=ws, reduction="sum")
    peak, _ = _cpu_peak(loss.backward)
    return peak - xo.grad.nbytes - wo.grad.nbytes


def test_peak_memory_within_budget(small_policy):
    # The backward's peak above its gradients is the plan's workspaces plus O(N) (per-row coefficients and their
    # float32 copies): within each budget, and the policy's plan does hold its own accumulator.
    x, w, _, t = make_case(torch.bfloat16, n=N, d=D, v=V)
    slack = 16 * 4 * N + 1024  # O(N): per-row vectors (a few hundred bytes measured)
    lean, policy, large = (_backward_peak(x, w, t, ws) for ws in small_policy)
    assert lean <= SCRATCH + slack, lean
    assert policy <= lh_plans.default_budget(N, V, D, 2) + slack, policy
    assert large <= small_policy[2] + slack, large
    assert policy >= lean + 4 * N * D // 2  # the accumulator's own buffer is there


def test_torch_path_peak_and_precision_with_many_blocks(monkeypatch):
    # The PyTorch path at a budget of 256 KiB: blocks of 1024 classes x 32 tokens, several of each, within the rule
    # with every option that takes a temporary (softcap, smoothing with class weights, z-loss, bias), and its peak
    # above the gradients (and the float32 dx accumulator, O(N D)) within the budget.
    monkeypatch.setattr(loss_math, "POLICY_MIN_BYTES", 256 << 10)
    n, d, v = 96, 24, 2500
    rows, cols = torch_backend.blocks.budget_block(n, v, True)
    assert rows < n and cols < v
    x, w, b, t = make_case(torch.float32, n=n, d=d, v=v, bias=True, scale=2.0)
    cw = torch.rand(v, generator=torch.Generator().manual_seed(2)) + 0.5
    check_against_truth(logitless.linear_cross_entropy, testing.naive_linear_cross_entropy, x, w, b, t,
                        softcap=8.0, label_smoothing=0.1, weight=cw, z_loss=1e-3, reduction="none")
    up = torch.randn(n, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    check_against_truth(functools.partial(logitless.linear_log_probs, return_entropy=False, temperature=0.7),
                        functools.partial(testing.naive_linear_log_probs, temperature=0.7), x, w, b, t,
                        upstream=up)
    xo, wo, bo = leaves(x, w, b)

    def run():
        logitless.linear_cross_entropy(xo, wo, t, linear_bias=bo, softcap=8.0, label_smoothing=0.1,
                                       backend="torch").backward()

    peak, _ = _cpu_peak(run)
    extra = peak - xo.grad.nbytes - wo.grad.nbytes - bo.grad.nbytes
    assert extra <= loss_math.default_workspace_bytes(n, v) + 64 * 4 * n + (16 << 10), extra


@pytest.mark.parametrize("budget", ["lean", "policy", "large"])
def test_odd_vocabulary_dz_rows_aligned(small_policy, budget):
    # The last chunk of an odd vocabulary has an odd width. Its dz rows are plans.dz_cols apart (16-byte aligned,
    # as cuBLAS's fast products need) wherever dz lives: dW rows, the scratch, or dx; and the products take the
    # classes past a multiple of 8 apart. The gradients stay within the rule.
    ws = dict(zip(("lean", "policy", "large"), small_policy, strict=True))[budget]
    records = []
    with logitless.kernels.tuning(torch_products=True, debug_backwards=records):
        x, w, b, t = make_case(torch.bfloat16, n=N, d=D, v=V + 1, bias=True, scale=2.0)
        check_against_truth(functools.partial(logitless.linear_cross_entropy, workspace_bytes=ws),
                            testing.naive_linear_cross_entropy, x, w, b, t, backend="triton")
    # each call of torch's products: the classes of its dz and their strides
    seen = [(p.cols, p.dz_stride) for rec in records for p in rec.products]
    assert seen and all(p.torch for rec in records for p in rec.products)
    row_major = [(cols, st) for cols, st in seen if st[1] == 1]
    assert row_major and all(st[0] % 8 == 0 for _, st in row_major), seen
    assert any(cols % 8 for cols, _ in seen)  # the odd last chunk reached the products ...
    assert any(cols < 8 for cols, _ in seen)  # ... and its last classes went apart


def test_lean_tool_prices_a_plan_at_its_count(small_policy):
    # tools/gpu_lean.py prices each kernel of a lean fwd+bwd at its count: with every launch taking exactly its
    # price, the forward, the dz launches and the products sum to (4 + r) products (no stash on a CPU), r the share
    # of classes the second pass recomputes; the dz launches must match the record's chunks one to one.
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "tools" / "gpu_lean.py"
    spec = importlib.util.spec_from_file_location("gpu_lean", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    records = []
    x, w, _, t = make_case(torch.bfloat16, n=N, d=D, v=V, bias=False)
    x, w = leaves(x, w)
    with logitless.kernels.tuning(debug_backwards=records):
        loss = logitless.linear_cross_entropy(x, w, t, backend="triton", workspace_bytes=0, skip_threshold=None)
        torch.autograd.grad(loss, (x, w))
    rec = records[-1]
    assert rec.second_pass and not rec.workspace.own_acc
    mm = 3.0
    kernels = [("_fwd_kernel", mm)]
    chunks = [(v1 - v0, v1 <= rec.dw_end) for v0, v1, *_ in rec.first_pass]
    chunks += [(v1 - v0, None) for v0, v1, _ in rec.second_pass]  # one product: dW
    for cols, writes in chunks:
        kernels.append(("_dz_kernel_0d1d", cols * mm / V))
        kernels += [("nvjet_gemm", cols * mm / V)] * (2 if writes else 1)
        kernels.append(("elementwise_copy", 0.0))
    kinds = tool.classify(kernels, rec, V, mm)
    r = (V - rec.dw_end) / V
    assert r > 0
    from logitless.kernels.linear_head.configs import interpreter_config
    assert tool.counts(N, D, V, interpreter_config())["r"] == r  # the tool's count is the backward's plan
    assert abs(sum(k["ideal"] for k in kinds.values()) - (4 + r) * mm) < 1e-9
    assert all(abs(k["ms"] - k["ideal"]) < 1e-9 for k in kinds.values())
    assert kinds["dz second"]["launches"] == len(rec.second_pass) and kinds["other"]["launches"] == len(chunks)
    with pytest.raises(RuntimeError, match="dz launches"):
        tool.classify(kernels[:-3], rec, V, mm)
    c = tool.counts(8192, 4096, 128256)
    assert c["r"] == pytest.approx(2 * c["r_min"], rel=1e-3) and c["bound"] < c["count"]
