"""The linear head's host plans: tiles per GPU tier, when tensor descriptors are used, the stash's layout, the
forward's vocabulary splits, the backward's chunks and split reductions, the vocabulary order's ranges: shapes
in, numbers out.

Split by concern: op semantics in test_triton_linear.py, the kernels' mechanics in test_triton_linear_kernels.py,
their host plans in test_triton_linear_plans.py, skipping in test_triton_linear_skip.py, bad arguments in
test_triton_linear_validation.py; what they share in triton_linear_common.py.
"""

import heapq
import itertools

import pytest
import torch

from logitless.kernels import linear_head as lh
from logitless.kernels._common import INTERPRETER_SMS_FORWARD
from logitless.kernels.linear_head import configs as lh_configs
from logitless.kernels.linear_head import plans as lh_plans
from tests.helpers import check_log_probs_entropy
from tests.triton_linear_common import (
    DEV,
    case,
    lce_check,
    poison,  # noqa: F401 - autouse: every test runs with NaN-poisoned buffers
)


def test_tensor_descriptor_conditions():
    # Descriptors only where the copy engine can read the operands; pointer loads everywhere else.
    cfg = lh_configs.config_for(torch.empty(1, device=DEV)).replace(tma=True)
    x = torch.randn(9, 48, dtype=torch.bfloat16, device=DEV)
    w = torch.randn(70, 48, dtype=torch.bfloat16, device=DEV)
    assert lh_configs.use_tma(cfg, x, w, None) or lh_configs.TensorDescriptor is None
    assert not lh_configs.use_tma(cfg.replace(tma=False), x, w, None)
    assert not lh_configs.use_tma(cfg, x, w, torch.arange(70, dtype=torch.int32, device=DEV))  # a vocabulary order
    # 96-byte row strides
    assert lh_configs.use_tma(cfg, x[:, :45], w[:, :45], None) or lh_configs.TensorDescriptor is None
    assert not lh_configs.use_tma(cfg, x[:, :45].contiguous(), w[:, :45].contiguous(), None)  # 90-byte row strides
    assert not lh_configs.use_tma(cfg, x, w.T.contiguous().T, None)  # no unit last stride
    assert not lh_configs.use_tma(cfg, x.view(-1)[1:].as_strided((8, 48), (48, 1)), w, None)  # base 2 bytes off


# The tiles each kind of CUDA device gets (linear_head.gpu_config: Hopper-class shared memory, A100's, and the 99 KB of
# sm_86 / sm_89 / sm_120 cards), run at a shape with partial blocks and tiles in every direction; on the CPU through
# the interpreter (descriptors emulated where the tier uses them). tools/compile_check.py compiles the same tiers
# for each architecture and checks their shared memory.
GPU_TIERS = [(9, 232448), (8, 166912), (8, 101376), (12, 101376)]


@pytest.mark.parametrize("major,smem", GPU_TIERS)
def test_gpu_tiers(tune, major, smem):
    cfg = lh.gpu_config(torch.bfloat16, major, smem)
    assert cfg.tma == cfg.grad_tma == (major >= 9)
    assert (cfg.block_v, cfg.block_k) == ((256, 64) if smem >= 200 * 1024 else (128, 32))
    assert lh.gpu_config(torch.float32, major, smem) == lh_configs.fp32_config()
    tune(linear_config=cfg)
    x, w, b, t = case(torch.bfloat16, n=200, d=48, v=700, bias=True, ignore_frac=0.25, scale=3.0)
    lce_check(x, w, b, t, label_smoothing=0.1)
    check_log_probs_entropy(x, w, b, t, backend="triton")


# Planning only (meta tensors, GPU tiles): the issue shapes and smaller ones, N < D and N > D, with and without the
# input's gradient and with an accumulator of its own. Replays the first pass's memory: a stashed chunk's logits and
# maxima are intact until it reads them, every dz region and dW row range written stays off data still needed.
@pytest.mark.parametrize("n,d,v,need_dx,budget", [
    (8192, 2304, 256000, True, 0), (16384, 4096, 128256, True, 0), (8192, 5120, 131072, True, 0),
    (16384, 1024, 151936, True, 0), (4096, 4096, 128256, True, 0), (1024, 2048, 32000, True, 0),
    (4096, 2048, 32000, False, 0), (16384, 4096, 128256, True, 4 * 16384 * 4096 + (256 << 20)),
    (512, 4096, 32000, True, 0), (8192, 2304, 256000, True, None), (16384, 4096, 128256, True, None),
    (8192, 5120, 131072, True, None), (16384, 768, 50257, True, None)])
def test_stash_layout_timeline(tune, n, d, v, need_dx, budget):
    tune(linear_config=lh_configs.hopper_config(), torch_products=True)
    cfg = lh_configs.hopper_config()
    meta = dict(device="meta", dtype=torch.bfloat16)
    x, w = torch.empty(n, d, **meta), torch.empty(v, d, **meta)
    lay = lh.stash_layout(x, w, need_dx, budget)
    ws = lh_plans._workspace(n, v, d, 2, budget)
    plan = lh_plans._plan(x, torch.empty(n, d, **meta) if need_dx else None, w, n, v, d, cfg, False, ws)
    end = plan.dw_free if need_dx else v * d  # the dx accumulator's first element, where it lives in dW
    assert lay is not None and lay.classes % cfg.block_v == 0 and lay.classes <= plan.dw_end
    # the room is used: fewer than one chunk's worth of classes (plus its tile maxima) would still fit
    per_class = max(n, d) + 2 * n / cfg.block_v
    assert (end - lay.zo_at - 2 * n * lay.classes // cfg.block_v) < (lay.chunk + cfg.block_v) * per_class
    zo = (lay.zo_at, lay.zo_at + 2 * n * lay.classes // cfg.block_v)
    assert lay.at + n * lay.classes <= zo[0] and zo[1] <= end
    chunks = lh_plans._first_pass(n, v, d, cfg, plan, False, True, lay)
    stashed = [c for c in chunks if c[3]]
    assert [c[:2] for c in stashed] == [(v0, min(v0 + lay.chunk, lay.classes)) for v0 in
                                        range(0, lay.classes, lay.chunk)]
    assert chunks[:len(stashed)] == stashed  # they go first

    def overlaps(a, b):
        return a[0] < b[1] and b[0] < a[1]

    written = []  # element ranges of dW written so far
    for v0, v1, dz_at, is_stashed in chunks:
        rows = (v0 * d, min(v1, plan.dw_end) * d) if v0 < plan.dw_end else None
        if is_stashed:
            dz = (lay.at + v0 * n, lay.at + v1 * n)  # read (logits) and written (dz) in place
            later = (lay.at + v1 * n, lay.at + lay.classes * n)  # the logits of the chunks to come
            for r in written + [rows]:
                assert not overlaps(r, dz) and not overlaps(r, later) and not overlaps(r, zo)
        elif dz_at is not None:
            dz = (dz_at, dz_at + n * (v1 - v0))
            assert dz[1] <= end and not any(overlaps(r, dz) for r in written + [rows] if r)
        if rows:
            written.append(rows)
    if lay.classes >= 2 * lay.chunk:
        assert lay.classes / v > {8192: 0.25, 16384: 0.04, 4096: 0.3, 1024: 0.75, 512: 0.75}[n]


def test_balanced_split():
    # One program per SM, dW tiles first: few long dW tiles next to many short dx tiles are split; many dW tiles
    # (large D) are not. (qwen3-small's and llama3-8b's first-pass launches on 132 SMs.)
    assert lh_plans._balanced_split(16384, 32, 512, 16, 132, 64, 64, 2) == 8192
    assert lh_plans._balanced_split(16384, 512, 2048, 64, 132, 64, 64, 1) == 16384
    assert lh_plans._balanced_split(16384, 512, 2048, 64, 132, 64, 64, 4) == 16384
    assert lh_plans._balanced_split(16384, 32, 512, 16, 132, 64, 64, 1) == 16384  # no room for partials


def _makespan(n_blocks, layout, sms, group):
    """Finish time, in tiles, of the forward's programs dispatched in launch order to the first free one of `sms`
    multiprocessors (one program each at a time; a program costs its tiles plus 0.1)."""
    n_big, a, n_small, b = layout
    free = [0.0] * sms

    def phase(sizes):
        for first in range(0, n_blocks, group):  # _grouped: a group's blocks, split by split
            for size in sizes:
                for _ in range(min(group, n_blocks - first)):
                    heapq.heappush(free, heapq.heappop(free) + size + 0.1)

    phase([a] * n_big)
    phase([b] * n_small)
    return max(free)


@pytest.mark.parametrize("n_blocks,n_vtiles", [(64, 1000), (128, 501), (64, 512), (128, 594), (32, 125),
                                               (64, 594), (256, 501), (16, 197), (1, 501), (3, 196), (512, 125),
                                               (8, 1024), (151, 640), (339, 971)])
def test_forward_layout_covers_and_balances(n_blocks, n_vtiles):
    # Every tile of a row in exactly one split; on 132 SMs (an H100 / H200), the two phases end within 2% of the
    # even share at the issue shapes (the first four; equal splits: 3.4-4.3% above), and never later than equal
    # splits do (the first layout the planner considers).
    sms, group, waves = 132, 8, 8
    n_big, a, n_small, b = layout = lh_plans._fwd_layout(n_blocks, n_vtiles, sms, group, waves)
    rest = n_vtiles - n_big * a
    assert n_big >= 1 and a >= 1 and rest >= 0
    assert (n_small == 0) == (rest == 0)
    if n_small:
        assert (n_small - 1) * b < rest <= n_small * b
    end = _makespan(n_blocks, layout, sms, group)
    share = n_blocks * n_vtiles / sms
    tps = -(-n_vtiles // max(1, min(n_vtiles, round(waves * sms / n_blocks))))
    equal = (n_vtiles // tps, tps, int(n_vtiles % tps > 0), n_vtiles % tps)
    assert end <= _makespan(n_blocks, equal, sms, group) + 1e-9
    if (n_blocks, n_vtiles) in [(64, 1000), (128, 501), (64, 512), (128, 594)]:
        assert end <= 1.02 * share, (layout, end / share)
        assert _makespan(n_blocks, equal, sms, group) >= 1.03 * share


def test_forward_layout_under_the_interpreter_uses_both_phases():
    # The layout is in chunks of chunk_tiles tiles (the partials' unit). At the batch-invariance test's N = 100, V =
    # 600 on 32 x 64 tiles, programs of several chunks in both phases (a restart of the running statistics inside a
    # program, and a merge of partials from both phases).
    cfg = lh_configs.interpreter_config()
    n_tiles = -(-600 // cfg.block_v)
    n_chunks = -(-n_tiles // cfg.chunk_tiles)
    layout = lh_plans._fwd_layout(-(-100 // cfg.block_n), n_chunks, INTERPRETER_SMS_FORWARD, cfg.group, cfg.waves)
    assert layout[0] >= 1 and layout[1] >= 2 and layout[2] >= 1, layout


@pytest.mark.parametrize("budget_mib", [0, 64, 300, None])
def test_vocab_order_follows_workspace(tune, budget_mib):
    # At llama3-8b's shape with the GPU tiles (planning only, meta tensors): the lean plan (0), a larger scratch that
    # moves the second pass's chunk boundaries (64 MiB), or no second pass (300 MiB, and the default policy's 400
    # MiB: the accumulator's own buffer). The order made for that budget keeps each of the backward's second-pass
    # chunks on its own classes.
    tune(linear_config=lh_configs.hopper_config())
    n, d, v = 16384, 4096, 128256
    budget = None if budget_mib is None else budget_mib << 20
    meta = dict(device="meta", dtype=torch.bfloat16)
    x, w = torch.empty(n, d, **meta), torch.empty(v, d, **meta)
    perm = lh.vocab_order(torch.rand(v, generator=torch.Generator().manual_seed(0)), x, w, budget)
    ws = lh_plans._workspace(n, v, d, 2, budget)
    plan = lh_plans._plan(x, torch.empty(n, d, **meta), w, n, v, d, lh_configs.hopper_config(), True, ws)
    chunks = lh_plans._second_pass(n, v, d, 2, lh_configs.hopper_config(), plan.dw_end, True, ws.scratch)
    own = budget_mib in (300, None)
    assert (plan.dw_end == v) == own and bool(chunks) == (not own)
    for v0, v1, _ in chunks + [(0, plan.dw_end, None)]:
        assert torch.equal(perm[v0:v1].sort().values.long(), torch.arange(v0, v1)), (v0, v1)
    assert not torch.equal(perm.long(), torch.arange(v))


@pytest.mark.parametrize("n,d,v,wide,expect", [
    (100, 40, 1500, 160, (True, True)), (16384, 1024, 151936, 4096, (True, True)),
    (8192, 2304, 256000, 4096, (True, True)), (16384, 4096, 128256, 4096, (False, False)),
    (37, 130, 300, 160, (False, False)), (300, 40, 500, 160, (True, False)), (100, 40, 1500, 0, (False, False))])
@pytest.mark.parametrize("aligned", [False, True])
def test_first_pass_chunks(n, d, v, wide, expect, aligned):
    # Every class once; a chunk's dz borrowed from dW lies in rows not written yet and not the accumulator's.
    cfg = (lh_configs.hopper_config() if n > 1000 else lh_configs.interpreter_config()).replace(wide=wide)
    start, dw_end = lh_plans._acc_region(n, v, d, cfg, aligned) if v * d >= 2 * n * d + 8 else (v * d, v)
    chunk = lh_plans._round_chunk(d, cfg.block_v, aligned)
    plan = lh_plans._Plan(None, chunk, None, dw_end, True, start)
    chunks = lh_plans._first_pass(n, v, d, cfg, plan, aligned, True)
    written = []  # dW row ranges written so far (the first pass writes its chunks' rows below dw_end)
    seen = []
    for v0, v1, dz_at, stashed in chunks:
        assert not stashed
        assert v0 < v1 and (v1 <= dw_end or v0 >= dw_end)
        if aligned:
            assert v0 % cfg.block_v == 0
        mine = (v0, min(v1, dw_end))
        if dz_at is not None:
            assert v1 - v0 > chunk or v1 in (dw_end, v)  # wider than the plan's chunk, unless cut at an end
            lo, hi = dz_at, dz_at + n * lh_plans.dz_cols(v1 - v0)  # dz's rows are 16-byte aligned
            assert 0 <= lo and hi <= start
            assert not any(a * d < hi and b * d > lo for a, b in written + [mine] if a < b)
        written.append(mine)
        seen.append((v0, v1))
    seen.sort()
    assert seen[0][0] == 0 and seen[-1][1] == v
    assert all(a[1] == b[0] for a, b in itertools.pairwise(seen))
    assert any(dz_at is not None for _, _, dz_at, _ in chunks) == expect[aligned]


def test_workspace_chunks_capped_at_wide(tune):
    # Planning only (meta tensors, GPU tiles): a caller's scratch widens the first pass's chunks up to cfg.wide
    # classes and no further (32768-class chunks measured slower), never below the default scratch's width.
    tune(linear_config=lh_configs.hopper_config())
    cfg = lh_configs.hopper_config()
    meta = dict(device="meta", dtype=torch.bfloat16)
    for n, d, v in ((4096, 4096, 128256), (8192, 2304, 256000), (512, 64, 32000)):
        x = torch.empty(n, d, **meta)
        widths = {}
        for name, budget in (("lean", 0), ("default", None), ("ws", 4 * n * d + (256 << 20))):
            ws = lh_plans._workspace(n, v, d, 2, budget)
            plan = lh_plans._plan(x, torch.empty(n, d, **meta), torch.empty(v, d, **meta), n, v, d, cfg, False, ws)
            chunks = lh_plans._first_pass(n, v, d, cfg, plan, False, True)
            widths[name] = max(v1 - v0 for v0, v1, *_ in chunks)
            assert chunks[0][0] == plan.dw_end % v and chunks[-1][1] in (v, plan.dw_end)
        default_cols = lh_plans._scratch_cols(n, 2, cfg.block_v)
        assert max(widths["ws"], widths["default"]) <= max(cfg.wide, default_cols), (n, widths)
        assert lh_plans._scratch_cols(n, 2, cfg.block_v, False, 256 << 20, cfg.wide) == max(
            min(cfg.wide, (256 << 20) // (2 * n)) // cfg.block_v * cfg.block_v, default_cols)
