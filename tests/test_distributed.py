"""Vocabulary-parallel ops (process_group=) over gloo on CPU against float64 ground truth, under the error rule.

Each group of checks spawns its processes once and runs every case in them (importing torch dominates the cost);
the parametrized tests then read each case's outcome on every rank. Shards are deliberately uneven (V = 1001 as
600 + 401 and 400 + 101 + 500, one case with an empty shard) and every shard holds targets, its first and last
row included. Gradients of the weight shards are assembled into full-size ones (an exact all-reduce of zero-padded
shards) so that every rank compares the whole gradient with the single-process one.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import socket
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist

import logitless
import logitless.distributed
import logitless.head
from logitless import testing
from tests.helpers import assert_within_rule, check_against_truth, grads, leaves, make_case

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available in this build")

N, D = 37, 45
# Triton on CPU tensors runs through the interpreter, which conftest.py turns on only where there is no GPU.
INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
SPLITS = {2: (600, 401), 3: (400, 101, 500)}
F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
ALL_CE = dict(label_smoothing=0.1, z_loss=1e-3, softcap=5.0)

# name -> (op, dtype, options, data): one line each, with the reason when it is not just "an option combination".
CASES = {
    "ce_f32_mean": ("ce", F32, dict(), dict(bias=True)),
    "ce_f32_sum_all_options": ("ce", F32, dict(reduction="sum", **ALL_CE), dict(bias=True, class_w=True)),
    "ce_bf16_none_all_options": ("ce", BF16, dict(reduction="none", **ALL_CE), dict(bias=True, class_w=True)),
    "ce_f16_mean_all_options": ("ce", F16, dict(**ALL_CE), dict(bias=True, class_w=True)),
    # float64 runs in float64 on the PyTorch path: it must match the float64 truth to ~1e-12.
    "ce_f64_mean_all_options": ("ce64", F64, dict(**ALL_CE), dict(bias=True, class_w=True)),
    "ce_bf16_mean_no_ignored": ("ce", BF16, dict(), dict(ignore_frac=0.0)),
    "ce_f32_class_weights_smoothing": ("ce", F32, dict(label_smoothing=0.3), dict(class_w=True)),
    # |z| ~ 1e4: shard maxima far apart; a combine that is not max-shifted overflows or loses every p_j.
    "ce_f32_extreme_logits": ("ce", F32, dict(label_smoothing=0.1, z_loss=1e-6), dict(bias=True, scale=3000.0)),
    "ce_bf16_extreme_logits": ("ce", BF16, dict(label_smoothing=0.1), dict(bias=True, scale=3000.0)),
    # ignore_index inside the vocabulary (id 7 lives in shard 0): ignored via the global mask, not the shard test.
    "ce_f32_ignore_index_in_vocab": ("ce", F32, dict(ignore_index=7, label_smoothing=0.1), dict(targets="ignore7")),
    "ce_f32_all_ignored_sum": ("ce", F32, dict(reduction="sum", label_smoothing=0.1), dict(targets="ignored")),
    # vocab_start / vocab_size given: no exchange of shard sizes.
    "ce_f32_given_layout": ("ce", F32, dict(reduction="sum", **ALL_CE), dict(bias=True, layout="given")),
    # An empty shard (0 rows) on one rank, as DTensor's Shard(0) gives for a small vocabulary over many ranks.
    "ce_f32_empty_shard": ("ce", F32, dict(**ALL_CE), dict(bias=True, class_w=True, split={2: (0, 1001),
                                                                                            3: (600, 0, 401)})),
    "logp_f32_entropy_temp_softcap": ("logp", F32, dict(temperature=0.6, softcap=4.0), dict(bias=True)),
    "logp_bf16_entropy": ("logp", BF16, dict(temperature=1.0), dict(bias=True, scale=3.0)),
    "logp_f16_entropy_softcap": ("logp", F16, dict(softcap=4.0), dict()),
    "logp_f32_extreme_logits": ("logp_only", F32, dict(temperature=0.7), dict(scale=3000.0)),
    "logp_f32_entropy_empty_shard": ("logp", F32, dict(), dict(split={2: (1001, 0), 3: (0, 1001, 0)})),
    "logp_f32_no_entropy": ("logp_only", F32, dict(temperature=1.3), dict(bias=True)),
    "lse_f32_temp_softcap": ("lse", F32, dict(temperature=1.7, softcap=4.0), dict(bias=True, scale=3.0)),
    "lse_bf16": ("lse", BF16, dict(), dict(bias=True, scale=3.0)),
    "lse_f16_temp": ("lse", F16, dict(temperature=0.6), dict()),
    # The local pass through the Triton kernels (the interpreter on CPU, so 2 ranks only): targets of other shards
    # are shifted outside [0, V_r), below 0 on rank 1 and past V_r on rank 0, which the launchers must skip.
    "triton_ce_bf16_none_all_options": ("ce", BF16, dict(reduction="none", **ALL_CE),
                                        dict(bias=True, class_w=True, backend="triton", worlds=(2,))),
    "triton_ce_f32_mean_smoothing": ("ce", F32, dict(label_smoothing=0.2),
                                     dict(class_w=True, backend="triton", worlds=(2,))),
    "triton_logp_f32_entropy_temp_softcap": ("logp", F32, dict(temperature=0.6, softcap=4.0),
                                             dict(bias=True, backend="triton", worlds=(2,))),
    "triton_lse_f16_temp": ("lse", F16, dict(temperature=0.6), dict(backend="triton", worlds=(2,))),
    # The options of the head op's backward reach each shard's pass ("ours": given to ours only): skipping with the
    # batch order, and the leanest workspace plan, on the Triton path; on the PyTorch path they are accepted.
    "triton_ce_bf16_skip_batch_order_lean": ("ce", BF16, dict(z_loss=1e-3), dict(
        bias=True, backend="triton", worlds=(2,),
        ours=dict(skip_threshold=2.0**-12, vocab_order="batch", workspace_bytes=0))),
    "triton_logp_f32_workspace": ("logp_only", F32, dict(temperature=0.8), dict(
        backend="triton", worlds=(2,), ours=dict(skip_threshold=2.0**-30, workspace_bytes=64 << 20))),
    "ce_f32_skip_and_workspace_accepted": ("ce", F32, dict(), dict(ours=dict(skip_threshold=2.0**-12,
                                                                             workspace_bytes=0))),
}


# ---------------------------------------------------------------------------------------------------------------
# What runs inside the spawned processes.


class _ShardRows(torch.autograd.Function):
    """Forward: rows [s0, s1) of a full tensor. Backward: the full-size gradient, assembled from every rank's rows
    by an all-reduce of zero-padded shards in float32 (exact: each element has one non-zero contribution)."""

    @staticmethod
    def forward(ctx, full, s0, s1):
        ctx.meta = (full.shape, full.dtype, s0, s1)
        return full[s0:s1].clone()

    @staticmethod
    def backward(ctx, g):
        shape, dtype, s0, s1 = ctx.meta
        out = torch.zeros(shape, dtype=torch.float32 if dtype != F64 else F64)
        out[s0:s1] = g
        dist.all_reduce(out)
        return out.to(dtype), None, None


def _same_on_all_ranks(name, t):
    t = t.detach().double().reshape(-1)
    allt = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(allt, t)
    for r, other in enumerate(allt):
        assert torch.equal(torch.nan_to_num(other, nan=0.5), torch.nan_to_num(t, nan=0.5)), \
            f"{name}: rank {r} returned a different value than rank {dist.get_rank()}"


def _data(world, rank, dtype, data):
    split = data.get("split", {}).get(world, SPLITS[world])
    V = sum(split)
    x, w, b, t = make_case(dtype, n=N, d=D, v=V, bias=data.get("bias", False),
                           ignore_frac=data.get("ignore_frac", 0.25), scale=data.get("scale", 1.0), seed=world)
    # Targets in every shard, on its first and last rows.
    edges = [i for r in range(world) if split[r] for i in (sum(split[:r]), sum(split[: r + 1]) - 1)]
    t[: len(edges)] = torch.tensor(edges)
    if data.get("targets") == "ignore7":
        t = torch.where(t == -100, torch.full_like(t, 7), t)
    elif data.get("targets") == "ignored":
        t = torch.full_like(t, -100)
    cw = torch.rand(V, generator=torch.Generator().manual_seed(5)) + 0.5 if data.get("class_w") else None
    s0 = sum(split[:rank])
    return x, w, b, t, cw, (s0, s0 + split[rank]), V


def _shard(full, rows):
    if full is None:
        return None
    return _ShardRows.apply(full, *rows) if full.requires_grad else full[rows[0]:rows[1]]


def _run_case(world, rank, op, dtype, opts, data):
    x, w, b, t, cw, rows, V = _data(world, rank, dtype, data)
    group = dist.group.WORLD
    backend = data.get("backend", "auto")
    layout = dict(vocab_start=rows[0], vocab_size=V) if data.get("layout") == "given" else {}
    ours_opts = data.get("ours", {})
    if op == "ce":
        def ours(xo, wo, tt, linear_bias=None, backend="auto", weight=None, **kw):
            fn = logitless.distributed.linear_cross_entropy if layout else logitless.linear_cross_entropy
            out = fn(xo, _shard(wo, rows), tt, linear_bias=_shard(linear_bias, rows),
                     weight=None if weight is None else weight[rows[0]:rows[1]], backend=backend,
                     process_group=group, **layout, **kw, **ours_opts)
            _same_on_all_ranks("loss", out)
            return out

        check_against_truth(ours, testing.naive_linear_cross_entropy, x, w, b, t, weight=cw, backend=backend,
                            **opts)
        return
    if op == "ce64":
        xo, wo, bo = leaves(x, w, b)
        out = logitless.linear_cross_entropy(xo, _shard(wo, rows), t, linear_bias=_shard(bo, rows),
                                             weight=cw[rows[0]:rows[1]], process_group=group, **opts)
        xt, wt, bt = leaves(x, w, b)
        truth = testing.naive_linear_cross_entropy(xt, wt, t, linear_bias=bt, weight=cw, **opts)
        assert out.dtype == F64
        torch.testing.assert_close(out, truth, rtol=1e-12, atol=0)
        for go, gt in zip(grads(out, [xo, wo, bo]), grads(truth, [xt, wt, bt]), strict=True):
            torch.testing.assert_close(go, gt, rtol=1e-10, atol=1e-14)
        return
    if op == "lse":
        def run(xx, ww, bb, naive=False, upcast=True):
            if naive:
                return testing.naive_linear_logsumexp(xx, ww, linear_bias=bb, upcast=upcast, **opts)
            out = logitless.linear_logsumexp(xx, _shard(ww, rows), linear_bias=_shard(bb, rows),
                                             process_group=group, backend=backend, **opts)
            _same_on_all_ranks("logsumexp", out)
            return (out,)
        outs = {}
        for key, cast, naive, upcast in (("ours", None, False, True), ("torch", None, True, False),
                                         ("truth", F64, True, True)):
            ins = leaves(*(a if cast is None or a is None else a.to(cast) for a in (x, w, b)))
            out = run(*ins, naive=naive, upcast=upcast)
            outs[key] = ((out,) if naive else out, ins)
        names = ("logsumexp",)
    else:
        want_ent = op == "logp"

        def run(xx, ww, bb, naive=False, upcast=True):
            if naive:
                out = testing.naive_linear_log_probs(xx, ww, t, linear_bias=bb, upcast=upcast, return_entropy=True,
                                                       **opts)
                return out if want_ent else out[:1]
            out = logitless.linear_log_probs(xx, _shard(ww, rows), t, linear_bias=_shard(bb, rows),
                                             return_entropy=want_ent, process_group=group, backend=backend,
                                             **opts, **ours_opts)
            out = out if want_ent else (out,)
            for o in out:
                _same_on_all_ranks("log_probs/entropy", o)
                assert (o[t == -100] == 0).all()
            return out
        outs = {}
        for key, cast, naive, upcast in (("ours", None, False, True), ("torch", None, True, False),
                                         ("truth", F64, True, True)):
            ins = leaves(*(a if cast is None or a is None else a.to(cast) for a in (x, w, b)))
            outs[key] = (run(*ins, naive=naive, upcast=upcast), ins)
        names = ("log_probs", "entropy")[: 2 if want_ent else 1]
    for i, name in enumerate(names):
        assert outs["ours"][0][i].dtype == F32
        assert_within_rule(name, outs["ours"][0][i], outs["torch"][0][i], outs["truth"][0][i])
    gen = torch.Generator().manual_seed(3)
    ups = [torch.randn(N, generator=gen, dtype=F64) for _ in names]

    def total(out):
        return sum((o * u.to(o.dtype)).sum() for o, u in zip(out, ups, strict=False))

    gnames = [n for n, a in zip(("d_input", "d_weight", "d_bias"), (x, w, b), strict=True) if a is not None]
    gs = {k: grads(total(outs[k][0]), outs[k][1]) for k in outs}
    for i, name in enumerate(gnames):
        assert gs["ours"][i].dtype == dtype
        assert_within_rule(name, gs["ours"][i], gs["torch"][i], gs["truth"][i])


def _expect(exc, match, fn):
    try:
        fn()
    except exc as e:
        assert match in str(e), f"{exc.__name__} raised, but {match!r} is not in its message: {e}"
        return
    raise AssertionError(f"expected {exc.__name__} ({match})")


def _run_errors(world, rank):
    x, w, b, t, _, rows, V = _data(world, rank, F32, dict(bias=True))
    ws = w[rows[0]:rows[1]]
    pg = dist.group.WORLD
    lce = logitless.linear_cross_entropy
    # A target id in another shard is fine; one past the global vocabulary is not, on every rank.
    t_other = t.clone()
    t_other[0] = V - 1 if rank == 0 else 0
    lce(x, ws, t_other, process_group=pg)
    t_bad = t.clone()
    t_bad[3] = V
    _expect(ValueError, "outside [0, 1001)", lambda: lce(x, ws, t_bad, process_group=pg))
    _expect(ValueError, "must match", lambda: lce(x[:, :-1], ws, t, process_group=pg))
    _expect(ValueError, "weight (class weights) must have shape", lambda: lce(x, ws, t, weight=torch.ones(V),
                                                                            process_group=pg))
    _expect(ValueError, "both vocab_start and vocab_size", lambda: logitless.distributed.linear_cross_entropy(
        x, ws, t, process_group=pg, vocab_start=rows[0]))
    _expect(ValueError, "does not fit", lambda: logitless.distributed.linear_cross_entropy(
        x, ws, t, process_group=pg, vocab_start=V - 1, vocab_size=V))
    _expect(TypeError, "ProcessGroup", lambda: lce(x, ws, t, process_group="tp"))
    _expect(ValueError, "label_smoothing", lambda: lce(x, ws, t, process_group=pg, label_smoothing=2.0))
    # The loss still works after all the refusals (no rank was left inside a collective).
    out = lce(x, ws, t, process_group=pg)
    _same_on_all_ranks("loss", out)


def _dtensor_tp(world, rank):
    """torchtitan's layout: the head a DTensor Shard(0) over a 1-D mesh (torch.chunk rows: 334 + 334 + 333), the
    input and target sharded by rows (sequence parallel), class weights and bias sharded too; mesh as the group."""
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    x, w, b, t, cw, _, V = _data(world, rank, F32, dict(bias=True, class_w=True, split={world: (334, 334, 333)}))
    opts = dict(reduction="sum", **ALL_CE)
    xd, wd, bd = (distribute_tensor(a, mesh, [Shard(0)]).requires_grad_() for a in (x, w, b))
    td, cwd = (distribute_tensor(a, mesh, [Shard(0)]) for a in (t, cw))
    loss = logitless.linear_cross_entropy(xd, wd, td, linear_bias=bd, weight=cwd, process_group=mesh, **opts)
    loss.backward()
    x64, w64, b64 = leaves(x.double(), w.double(), b.double())
    truth = testing.naive_linear_cross_entropy(x64, w64, t, linear_bias=b64, weight=cw.double(), **opts)
    truth.backward()
    xt, wt, bt = leaves(x, w, b)
    theirs = testing.naive_linear_cross_entropy(xt, wt, t, linear_bias=bt, weight=cw, upcast=False, **opts)
    theirs.backward()
    assert wd.to_local().shape[0] == (334, 334, 333)[rank]
    assert_within_rule("loss", loss, theirs, truth)
    for name, ours, th, tr in (("d_input", xd, xt, x64), ("d_weight", wd, wt, w64), ("d_bias", bd, bt, b64)):
        assert_within_rule(name, ours.grad.full_tensor(), th.grad, tr.grad)


V_PAR, D_PAR, N_PAR = 301, 24, 29


def _parallel_models(world, rank, kind):
    """2 x 2 mesh (dp, tp): each dp replica its own batch, the head's rows split over tp. Gradients must equal the
    single-process gradient of the mean of the two replicas' losses (DDP and FSDP2 average over dp)."""
    import torch.nn as nn
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp, dp = mesh["tp"], mesh["dp"]
    dp_rank, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    torch.manual_seed(0)
    proj0 = nn.Linear(D_PAR, D_PAR)
    w0 = torch.randn(V_PAR, D_PAR) / D_PAR**0.5
    opts = dict(label_smoothing=0.1, z_loss=1e-3)

    def batch(i):
        g = torch.Generator().manual_seed(100 + i)
        x = torch.randn(N_PAR, D_PAR, generator=g) * 3
        t = torch.randint(0, V_PAR, (N_PAR,), generator=g)
        t[:5] = -100
        return x, t

    proj64 = nn.Linear(D_PAR, D_PAR).double()
    proj64.load_state_dict({k: v.double() for k, v in proj0.state_dict().items()})
    w64 = w0.double().requires_grad_()
    sum(testing.naive_linear_cross_entropy(proj64(batch(i)[0].double()), w64, batch(i)[1], **opts)
        for i in range(2)).div(2).backward()

    class Head(nn.Module):
        def __init__(self, weight):
            super().__init__()
            self.weight = nn.Parameter(weight)

    class Model(nn.Module):
        def __init__(self, head_weight, loss_in_forward):
            super().__init__()
            self.proj = nn.Linear(D_PAR, D_PAR)
            self.proj.load_state_dict(proj0.state_dict())
            self.head = Head(head_weight)
            self.loss_in_forward = loss_in_forward

        def forward(self, x, t):
            h = self.proj(x)
            if not self.loss_in_forward:
                return h
            return logitless.linear_cross_entropy(h, self.head.weight, t, process_group=tp.get_group(), **opts)

    x, t = batch(dp_rank)
    rows = (0, 151) if tp_rank == 0 else (151, V_PAR)  # DDP: a plain tensor shard (uneven on purpose)
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(Model(w0[rows[0]:rows[1]].clone(), True), process_group=dp.get_group())
        model(x, t).backward()
        gw, gp = model.module.head.weight.grad, model.module.proj.weight.grad
        w_ref = w64.grad[rows[0]:rows[1]]
    else:
        from torch.distributed.fsdp import fully_shard

        inside = kind == "fsdp2_inside_forward"
        model = Model(w0.clone(), inside)
        model.head.weight = nn.Parameter(distribute_tensor(model.head.weight.data, tp, [Shard(0)]))
        if not inside:
            # The head's own FSDP unit never runs forward: its weight stays the sharded 2-D DTensor
            # (dp-sharded, tp-sharded), which the loss gathers over dp and whose gradient is averaged back.
            fully_shard(model.head, mesh=dp)
        fully_shard(model, mesh=dp)
        out = model(x, t)
        if not inside:
            assert type(model.head.weight).__name__ == "DTensor" and model.head.weight.device_mesh.ndim == 2
            out = logitless.linear_cross_entropy(out, model.head.weight, t, process_group=tp.get_group(), **opts)
        out.backward()
        gw, gp = model.head.weight.grad.full_tensor(), model.proj.weight.grad.full_tensor()
        w_ref = w64.grad
    # float32 against float64: the rule's PyTorch side is the same computation in float32 (materialised).
    proj32 = nn.Linear(D_PAR, D_PAR)
    proj32.load_state_dict(proj0.state_dict())
    w32 = w0.clone().requires_grad_()
    sum(testing.naive_linear_cross_entropy(proj32(batch(i)[0]), w32, batch(i)[1], upcast=False, **opts)
        for i in range(2)).div(2).backward()
    assert_within_rule("d_head", gw, w32.grad[rows[0]:rows[1]] if kind == "ddp" else w32.grad, w_ref)
    assert_within_rule("d_proj", gp, proj32.weight.grad, proj64.weight.grad)


def _worker(rank, world, port, outdir, group):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=90))
    torch.set_num_threads(1)
    if group == "grid":
        jobs = {name: functools.partial(_run_case, world, rank, *spec) for name, spec in CASES.items()
                if world in spec[3].get("worlds", (world,)) and (INTERPRETER or "backend" not in spec[3])}
        jobs["errors"] = functools.partial(_run_errors, world, rank)
        if world == 3:
            jobs["dtensor_tp"] = functools.partial(_dtensor_tp, world, rank)
    else:
        jobs = {k: functools.partial(_parallel_models, world, rank, k)
                for k in ("ddp", "fsdp2_inside_forward", "fsdp2_sharded_outside_forward")}
    results = {}
    for name, job in jobs.items():
        try:
            job()
            results[name] = "ok"
        except Exception:  # recorded per case; the test of that case fails with this text
            results[name] = traceback.format_exc(limit=-3)
        dist.barrier()
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------
# The tests: spawn once per group, then read each case.


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@functools.cache
def _results(group: str, world: int):
    """Per-rank {case: "ok" or the failure}, or the text of the error that stopped the processes (kept, so that
    the other tests of the group report it instead of spawning again)."""
    import torch.multiprocessing as mp

    try:
        with tempfile.TemporaryDirectory() as outdir:
            mp.start_processes(_worker, args=(world, _free_port(), outdir, group), nprocs=world,
                               start_method="spawn")
            out = []
            for r in range(world):
                with open(os.path.join(outdir, f"rank{r}.json")) as f:
                    out.append(json.load(f))
        return out
    except Exception:
        return traceback.format_exc()


def _assert_ok(group, world, name):
    results = _results(group, world)
    assert not isinstance(results, str), f"the {world} processes failed:\n{results}"
    for rank, res in enumerate(results):
        assert res[name] == "ok", f"rank {rank} of {world}:\n{res[name]}"


_NO_INTERPRETER = pytest.mark.skip(reason="Triton on CPU tensors needs TRITON_INTERPRET=1 (conftest sets it only "
                                          "without a GPU); tools/gpu_distributed.py covers the GPU")


# slow (left out of the quick run, `-m "not slow"`; the full suite runs everything): the three-rank groups, each a
# group of processes of its own; the quick run keeps every case at two ranks.
_THREE_RANKS = pytest.mark.slow


@pytest.mark.parametrize("case,world", [
    pytest.param(c, w, marks=(() if INTERPRETER or "backend" not in spec[3] else (_NO_INTERPRETER,))
                 + ((_THREE_RANKS,) if w == 3 else ()))
    for c, spec in CASES.items() for w in spec[3].get("worlds", (2, 3))
])
def test_matches_single_process(case, world):
    _assert_ok("grid", world, case)


@pytest.mark.parametrize("world", (2, pytest.param(3, marks=_THREE_RANKS)))
def test_bad_inputs_raise_on_every_rank(world):
    _assert_ok("grid", world, "errors")


@_THREE_RANKS
def test_dtensor_tensor_parallel_head():
    _assert_ok("grid", 3, "dtensor_tp")


def _fsdp2_available():
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.slow  # a four-rank group of its own; the quick run keeps the two-rank grid
def test_ddp_with_tensor_parallel_head():
    _assert_ok("parallel", 4, "ddp")


@pytest.mark.skipif(not _fsdp2_available(), reason="this torch has no torch.distributed.fsdp.fully_shard (FSDP2)")
@pytest.mark.parametrize("kind", ("fsdp2_inside_forward", "fsdp2_sharded_outside_forward"))
@pytest.mark.slow  # the same four-rank group as the DDP test
def test_fsdp2_with_tensor_parallel_head(kind):
    _assert_ok("parallel", 4, kind)


@pytest.mark.parametrize("backend", ("torch", "triton"))
def test_local_pass_treats_targets_of_other_shards_as_absent(backend):
    # The local pass sees targets shifted by the shard's first row: below 0 or at / past V_r they belong to another
    # shard and must give neither a target logit nor a one-hot gradient term (a kernel that clamps its column
    # index would pick up the first or last column instead). Both edges, and far outside, on one process.
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if backend == "triton" and dev == "cpu" and not INTERPRETER:
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")
    x, w, b = leaves(*(a.to(dev) for a in make_case(F32, n=37, d=45, v=300, bias=True)[:3]))
    edges = [-1, 0, 299, 300, 301, -300, 599, 600, 10**6, -(10**6)]
    t = torch.tensor(edges * 3 + [5, 150, 298, 1, 2, 3, 4], device=dev)
    st = logitless.head.stats(x, w, b, t, None, None, 1.0, False, False, backend=backend)
    z = x.detach().double() @ w.detach().double().T + b.detach().double()
    inside = (t >= 0) & (t < 300)
    zt_ref = torch.where(inside, z.gather(1, t.clamp(0, 299)[:, None])[:, 0], torch.zeros_like(z[:, 0]))
    torch.testing.assert_close(st.zt.double(), zt_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close((st.m + st.logs).double(), torch.logsumexp(z, 1), rtol=1e-5, atol=1e-5)
    # Only the one-hot term: the loss -sum zt has dL/dz = -[j == t] (A = 0, C = 1 in the generic backward).
    dx, dw, db = torch.autograd.grad(-st.zt.sum(), (x, w, b))
    dz = -torch.nn.functional.one_hot(t.clamp(0, 299), 300).double() * inside[:, None]
    torch.testing.assert_close(dx.double(), dz @ w.detach().double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw.double(), dz.T @ x.detach().double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(db.double(), dz.sum(0), rtol=1e-5, atol=1e-5)


def test_options_are_checked_before_the_group():
    # The same clear errors with process_group as without: the option checks come first.
    x, w, _, t = make_case(F32)
    with pytest.raises(TypeError, match="workspace_bytes"):
        logitless.linear_cross_entropy(x, w, t, process_group=object(), workspace_bytes=1.5)
    with pytest.raises(TypeError, match="workspace_bytes"):
        logitless.linear_log_probs(x, w, t, process_group=object(), workspace_bytes=1.5)
    with pytest.raises(ValueError, match="skip_threshold"):
        logitless.linear_cross_entropy(x, w, t, process_group=object(), skip_threshold=2.0)
    with pytest.raises(ValueError, match="vocab_order"):
        logitless.linear_cross_entropy(x, w, t, process_group=object(), vocab_order="sorted")


def test_needs_initialised_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    x, w, _, t = make_case(F32)
    with pytest.raises(RuntimeError, match="init_process_group"):
        logitless.linear_cross_entropy(x, w, t, process_group=object())
