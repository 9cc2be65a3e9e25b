"""Vocabulary-parallel (tensor-parallel) linear cross-entropy, log-probs and log-sum-exp over torch.distributed.

Each rank of ``process_group`` holds a contiguous block of rows of the classifier (its vocabulary shard; shards
in rank order, sizes may differ), the same input rows and the same global targets. The math (docs/distributed.md):

1. Each rank runs the chunked single-device pass on its shard, with targets shifted by its first row (a target
   outside [0, V_r) is "in another shard": it contributes no target logit here). Per row it gets the shard's max
   m_r, log-sum s_r = log sum_{j in r} exp(z_j - m_r), target logit, smoothing sum sum_j w_j (z_j - m_r) and entropy.
2. One all-gather of those few floats per row gives every rank the same global statistics, combined in the same
   order on every rank (so every rank returns bit-identical values): M = max_r m_r, logs = log sum_r
   exp((m_r - M) + s_r), the target logit and smoothing sums add up, and the entropy of the mixture is
   H = sum_r q_r (H_r - log q_r) with q_r = exp(lse_r - lse) the share of the probability mass in shard r.
3. Backward: each rank builds dL/dz on its own shard with the global (M, logs) and per-row coefficients, keeps its
   weight (and bias) gradient, and the input gradient, a sum over shards, is all-reduced in float32.

Collectives per call: forward, one all-gather of the shard sizes (skipped when the layout is known: ``vocab_start``
and ``vocab_size`` given, or a DTensor weight) and one all-gather of the statistics; backward, one all-reduce of the
input gradient (when the input requires one). No host synchronisation is added: the exchanged sizes stay on the
device (on CPU they are read at once). No N x V_r tensor is built.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from . import _validate, reference
from ._dispatch import resolve_backend

__all__ = ["linear_cross_entropy", "linear_log_probs", "linear_logsumexp"]

# all_gather_single is the newer name of all_gather_into_tensor (deprecated in recent releases).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Group(NamedTuple):
    pg: dist.ProcessGroup
    rank: int
    size: int


class _Layout(NamedTuple):
    """Where this rank's shard sits: global index of its first row, and the global vocabulary size. Python ints,
    or 0-d int64 device tensors when they were exchanged between GPUs (reading them would stall the host)."""

    start: int | torch.Tensor
    vocab: int | torch.Tensor


# ---------------------------------------------------------------------------------------------------------------
# Local compute: one pair of functions, one implementation per backend, with the contract of the launchers of
# kernels/linear_head.py:
#   forward(x, w, b, t_local, class_w, softcap, inv_temp, want_smooth, want_entropy) -> (m, logs, zt, sw, ent) of
#       the shard, per row in the accumulation dtype; sw = sum_j w_j (z_j - m); None where not asked for.
#   backward(x, w, b, t_local, class_w, m, logs, (A, B, C, E), softcap, inv_temp, needs) -> (dx in the accumulation
#       dtype, ready for the all-reduce; dw; db).
# t_local is the target minus the shard's first row: outside [0, V_r) it is in another shard (no target logit, no
# one-hot term) -- both implementations treat it so, which the tests check with targets in every shard.


class _LocalHead(NamedTuple):
    forward: Callable
    backward: Callable


def _empty_shard_forward(x, t_local, want_smooth, want_entropy):
    # A shard of 0 rows (DTensor's Shard(0) of a small vocabulary over many ranks): no mass, lse_r = -inf.
    n, acc = x.shape[0], reference._acc(x.dtype)
    zeros = lambda want: torch.zeros(n, device=x.device, dtype=acc) if want else None
    neg_inf = torch.full((n,), float("-inf"), device=x.device, dtype=acc)
    return neg_inf, neg_inf.clone(), zeros(t_local is not None), zeros(want_smooth), zeros(want_entropy)


def _empty_shard_backward(x, w, b, needs):
    dx = torch.zeros(x.shape, device=x.device, dtype=reference._acc(x.dtype)) if needs[0] else None
    return dx, (torch.empty_like(w) if needs[1] else None), (torch.empty_like(b) if needs[2] else None)


def _torch_forward(x, w, b, t_local, class_w, softcap, inv_temp, want_smooth, want_entropy):
    n, v_local = x.shape[0], w.shape[0]
    if v_local == 0:
        return _empty_shard_forward(x, t_local, want_smooth, want_entropy)
    acc = reference._acc(x.dtype)
    chunk = lambda i0, i1, v0, v1: reference._linear_chunk(
        x[i0:i1], w[v0:v1], None if b is None else b[v0:v1], softcap, inv_temp
    )
    m, logs, zt, sw, ref, ent = reference._head_forward(chunk, n, v_local, x.device, acc, t_local, None, class_w,
                                                        want_smooth, want_entropy)
    if sw is not None:
        # The reference keeps the smoothing sum relative to its first block's max; re-base it on the row max.
        w_r = class_w.sum() if class_w is not None else float(v_local)
        sw = sw + w_r * (ref - m)
    return m, logs, zt, sw, ent


def _torch_backward(x, w, b, t_local, class_w, m, logs, coef, softcap, inv_temp, needs):
    if w.shape[0] == 0:
        return _empty_shard_backward(x, w, b, needs)
    # Handing the reference an upcast input makes it return dx in float32: the partial sums are all-reduced
    # before the one rounding to the input dtype. Its blocks are upcast anyway, so the math is unchanged.
    x_acc = x.to(reference._acc(x.dtype)) if needs[0] else x
    return reference._linear_head_backward(x_acc, w, b, t_local, class_w, m, logs, coef, softcap, inv_temp, needs)


def _triton_forward(x, w, b, t_local, class_w, softcap, inv_temp, want_smooth, want_entropy):
    if w.shape[0] == 0:
        return _empty_shard_forward(x, t_local, want_smooth, want_entropy)
    from .kernels import linear_head

    cw = None if class_w is None else class_w.float().contiguous()
    m, logs, zt, sw, ent = linear_head.forward_stats(x, w, b, t_local, cw, softcap=softcap, inv_temp=inv_temp,
                                                     want_smooth=want_smooth, want_entropy=want_entropy)
    return m, logs, zt if t_local is not None else None, sw if want_smooth else None, ent if want_entropy else None


def _triton_backward(x, w, b, t_local, class_w, m, logs, coef, softcap, inv_temp, needs):
    if w.shape[0] == 0:
        return _empty_shard_backward(x, w, b, needs)
    from .kernels import linear_head

    A, B, C, E = (None if c is None else c.float().contiguous() for c in coef)
    cw = None if class_w is None else class_w.float().contiguous()
    dx, dw, db = linear_head.backward(x, w, b, t_local, cw, m, logs, A, B, C, E, softcap=softcap,
                                      inv_temp=inv_temp, need_dx=needs[0], need_dw=needs[1], need_db=needs[2])
    # The launcher accumulates dx in float32 but returns it in the input dtype: each rank's partial is rounded
    # once before the float32 all-reduce (the PyTorch path rounds only after it).
    return (None if dx is None else dx.float()), dw, db


_TORCH_LOCAL = _LocalHead(_torch_forward, _torch_backward)
_TRITON_LOCAL = _LocalHead(_triton_forward, _triton_backward)


def _local_impl(backend: str, x: torch.Tensor, op: str) -> _LocalHead:
    """The same backend choice as the single-device functions (float64 stays on the PyTorch path under "auto")."""
    if resolve_backend(backend, x.device, op) == "triton":
        from .linear_cross_entropy import check_kernel_dtype

        if check_kernel_dtype(x, backend):
            return _TRITON_LOCAL
    return _TORCH_LOCAL


# ---------------------------------------------------------------------------------------------------------------
# Combining the shards' statistics.


def _gather(local: torch.Tensor, group: _Group) -> torch.Tensor:
    """[...] on each rank -> [P, ...] on every rank, in rank order (one all-gather)."""
    if group.size == 1:
        return local[None]
    flat = local.contiguous().reshape(-1)
    out = flat.new_empty(group.size * flat.numel())
    _all_gather_single(out, flat, group=group.pg)
    return out.view((group.size,) + tuple(local.shape))


class _Global(NamedTuple):
    m: torch.Tensor  # global row max
    logs: torch.Tensor  # log sum_j exp(z_j - m) over the whole vocabulary
    zt: torch.Tensor | None  # target logit
    sw: torch.Tensor | None  # sum_j w_j (z_j - m): the smoothing sum relative to the global max
    w_sum: torch.Tensor | None  # sum_j w_j (the vocabulary size without class weights)
    w_t: torch.Tensor | None  # class weight of the target (unmasked)
    ent: torch.Tensor | None  # entropy


def _exchange_stats(stats, *, v_local, t_local, class_w, group: _Group) -> _Global:
    """Per-shard statistics (m, logs, zt, sw, ent) -> global ones, identical on every rank."""
    m, logs, zt, sw, ent = stats
    acc = m.dtype
    rows = [m, logs]
    if zt is not None:
        rows.append(zt)
    if sw is not None:
        rows.append(sw)
    if ent is not None:
        rows.append(ent)
    if class_w is not None and t_local is not None:
        inside = (t_local >= 0) & (t_local < v_local)
        w_tr = class_w[t_local.clamp(0, max(v_local - 1, 0))] if v_local > 0 else torch.zeros_like(m)
        rows.append(torch.where(inside, w_tr, torch.zeros_like(w_tr)))
    local = torch.stack(rows).reshape(-1)
    if sw is not None:  # the shard's sum of class weights (its row count without them) rides along
        w_r = class_w.sum().reshape(1) if class_w is not None else torch.full((1,), float(v_local), device=m.device)
        local = torch.cat([local, w_r.to(acc)])
    n = m.shape[0]
    allg = _gather(local, group)  # [P, k * n (+ 1)]
    w_all = allg[:, -1] if sw is not None else None
    st = allg[:, : len(rows) * n].view(group.size, len(rows), n)
    m_all, logs_all = st[:, 0], st[:, 1]
    M = m_all.amax(dim=0)
    rel = (m_all - M) + logs_all  # lse_r - M; -inf for an empty shard
    logs_g = torch.logsumexp(rel, dim=0)
    i = 2
    zt_g = sw_g = w_sum = w_t = ent_g = None
    if zt is not None:
        zt_g = st[:, i].sum(dim=0)
        i += 1
    if sw is not None:
        shift = torch.where(torch.isfinite(m_all), m_all - M, torch.zeros_like(m_all))
        sw_g = (st[:, i] + w_all[:, None] * shift).sum(dim=0)
        w_sum = w_all.sum()
        i += 1
    if ent is not None:
        # H = sum_r q_r (H_r - log q_r): a mixture's entropy; every term is >= 0, so nothing cancels.
        log_q = rel - logs_g
        q = torch.exp(log_q)
        ent_g = torch.where(q > 0, q * (st[:, i] - log_q), torch.zeros_like(q)).sum(dim=0)
        i += 1
    if class_w is not None and t_local is not None:
        w_t = st[:, i].sum(dim=0)
    return _Global(M, logs_g, zt_g, sw_g, w_sum, w_t, ent_g)


def _finish_backward(ctx, impl, group, x, w, b, t_local, class_w, m, logs, coef, softcap, inv_temp):
    """The local backward (inputs x, w, b are the Function's first three), then the all-reduce of dx."""
    needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], b is not None and ctx.needs_input_grad[2])
    dx, dw, db = impl.backward(x, w, b, t_local, class_w, m, logs, coef, softcap, inv_temp, needs)
    if dx is not None:
        if group.size > 1:
            dist.all_reduce(dx, group=group.pg)
        dx = dx.to(x.dtype)
    return dx, dw, db


# ---------------------------------------------------------------------------------------------------------------
# autograd Functions: they take this rank's shard, the shifted targets and the layout, and save only tensors.


def _save(ctx, *tensors_or_ints):
    """save_for_backward for a mix of tensors, None and Python numbers (the layout may be either)."""
    ctx.plain = {i: v for i, v in enumerate(tensors_or_ints) if not isinstance(v, torch.Tensor)}
    ctx.save_for_backward(*(v for v in tensors_or_ints if isinstance(v, torch.Tensor)))


def _load(ctx):
    saved = iter(ctx.saved_tensors)
    n = len(ctx.plain) + len(ctx.saved_tensors)
    return [ctx.plain[i] if i in ctx.plain else next(saved) for i in range(n)]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Outputs (per-token loss, 0 at ignored rows; target class weight w_t, 0 at ignored rows)."""

    @staticmethod
    def forward(ctx, x, w, b, t_local, valid, class_w, vocab, group, impl, label_smoothing, z_loss, softcap):
        stats = impl.forward(x, w, b, t_local, class_w, softcap, 1.0, label_smoothing > 0.0, False)
        g = _exchange_stats(stats, v_local=w.shape[0], t_local=t_local, class_w=class_w, group=group)
        zero = torch.zeros_like(g.m)
        w_t = torch.where(valid, g.w_t, zero) if class_w is not None else valid.to(g.m.dtype)
        w_sum = g.w_sum if g.w_sum is not None else 0.0  # only used with label smoothing
        # ce_loss_from_stats's smoothing term is w_sum ((m - ref) + logs) - sw; with ref = m it is
        # w_sum logs - sum_j w_j (z_j - M), a sum of two non-negative terms.
        loss = reference.ce_loss_from_stats(g.m, g.logs, g.zt, g.sw, g.m, valid, w_t, w_sum, label_smoothing,
                                            z_loss, vocab)
        _save(ctx, x, w, b, t_local, valid, class_w, g.m, g.logs, w_t, w_sum, vocab)
        ctx.opts = (group, impl, label_smoothing, z_loss, softcap)
        ctx.mark_non_differentiable(w_t)
        return loss, w_t

    @staticmethod
    def backward(ctx, grad_loss, _grad_w_t):
        x, w, b, t_local, valid, class_w, m, logs, w_t, w_sum, vocab = _load(ctx)
        group, impl, label_smoothing, z_loss, softcap = ctx.opts
        coef = reference.ce_backward_coef(grad_loss, m + logs, valid, w_t, w_sum, label_smoothing, z_loss, vocab)
        dx, dw, db = _finish_backward(ctx, impl, group, x, w, b, t_local, class_w, m, logs, coef, softcap, 1.0)
        return dx, dw, db, None, None, None, None, None, None, None, None, None


class _VocabParallelLogProbs(torch.autograd.Function):
    """Outputs (log p of the target, entropy), each per row and 0 at ignored rows."""

    @staticmethod
    def forward(ctx, x, w, b, t_local, valid, group, impl, softcap, inv_temp, want_entropy):
        stats = impl.forward(x, w, b, t_local, None, softcap, inv_temp, False, want_entropy)
        g = _exchange_stats(stats, v_local=w.shape[0], t_local=t_local, class_w=None, group=group)
        zero = torch.zeros_like(g.m)
        logp = torch.where(valid, (g.zt - g.m) - g.logs, zero)
        ent = torch.where(valid, g.ent, zero) if g.ent is not None else zero.clone()
        ctx.save_for_backward(x, w, b, t_local, valid, g.m, g.logs, ent)
        ctx.opts = (group, impl, softcap, inv_temp, want_entropy)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        x, w, b, t_local, valid, m, logs, ent = ctx.saved_tensors
        group, impl, softcap, inv_temp, want_entropy = ctx.opts
        if not want_entropy:  # the zeros autograd materialised for the unused output: no B term
            grad_ent = None
        coef = reference.log_probs_backward_coef(grad_logp, grad_ent, logs, ent, valid)
        dx, dw, db = _finish_backward(ctx, impl, group, x, w, b, t_local, None, m, logs, coef, softcap, inv_temp)
        return dx, dw, db, None, None, None, None, None, None, None


class _VocabParallelLogSumExp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, group, impl, softcap, inv_temp):
        stats = impl.forward(x, w, b, None, None, softcap, inv_temp, False, False)
        g = _exchange_stats(stats, v_local=w.shape[0], t_local=None, class_w=None, group=group)
        ctx.save_for_backward(x, w, b, g.m, g.logs)
        ctx.opts = (group, impl, softcap, inv_temp)
        return g.m + g.logs

    @staticmethod
    def backward(ctx, grad_lse):
        x, w, b, m, logs = ctx.saved_tensors
        group, impl, softcap, inv_temp = ctx.opts
        coef = (grad_lse.to(m.dtype), None, None, None)
        dx, dw, db = _finish_backward(ctx, impl, group, x, w, b, None, None, m, logs, coef, softcap, inv_temp)
        return dx, dw, db, None, None, None, None


# ---------------------------------------------------------------------------------------------------------------
# Arguments: the group, DTensors, the shard layout, validation.


def _dtensor_api():
    try:
        from torch.distributed.tensor import DeviceMesh, DTensor, Partial, Replicate, Shard
    except ImportError:  # torch < 2.5
        try:
            from torch.distributed._tensor import DeviceMesh, DTensor, Partial, Replicate, Shard
        except ImportError:
            return None
    return DeviceMesh, DTensor, Partial, Replicate, Shard


def _is_dtensor(t) -> bool:
    api = _dtensor_api()
    return api is not None and isinstance(t, api[1])


def _resolve_group(process_group) -> _Group:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("process_group= needs an initialised torch.distributed (dist.init_process_group first)")
    pg = process_group
    api = _dtensor_api()
    if api is not None and isinstance(pg, api[0]):
        if pg.ndim != 1:
            raise ValueError(f"process_group is a {pg.ndim}-D DeviceMesh: pass the 1-D mesh of the "
                             "vocabulary-parallel dimension, e.g. mesh['tp']")
        pg = pg.get_group()
    if not isinstance(pg, dist.ProcessGroup):
        raise TypeError("process_group must be a torch.distributed ProcessGroup or a 1-D DeviceMesh, got "
                        f"{type(process_group).__name__}")
    rank = dist.get_rank(pg)
    if rank < 0:
        raise ValueError("this rank is not a member of process_group")
    return _Group(pg, rank, dist.get_world_size(pg))


def _mesh_dim_of(mesh, group: _Group) -> int | None:
    """The mesh dimension whose group is `group` (same ranks, same order), or None."""
    ranks = dist.get_process_group_ranks(group.pg)
    for d in range(mesh.ndim):
        if dist.get_process_group_ranks(mesh.get_group(d)) == ranks:
            return d
    return None


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, scale):
        ctx.scale = scale
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def _local_shard(t, name: str, group: _Group):
    """A weight, bias or class-weight argument -> (this rank's vocabulary shard as a plain tensor, its layout if the
    argument is a DTensor that says it, else None).

    DTensor cases: on the mesh dimension of `process_group` it must be Shard(0) (torchtitan's ColwiseParallel
    head, or FSDP2 + TP inside the forward): `to_local()` is the shard, laid out as torch.chunk lays rows out.
    Sharded over other mesh dimensions (FSDP2's sharded parameter used outside its module's forward), it is
    gathered there; the gradient goes back reduce-scattered and divided by those dimensions' size, i.e. averaged
    over the data-parallel ranks as FSDP2 averages. A DTensor on a mesh without the vocabulary dimension holds this
    rank's whole shard: the same gathering applies. Replicated over those dimensions, it is used as is (its
    data-parallel wrapper reduces the gradient).
    """
    if t is None or not _is_dtensor(t):
        return t, None
    _, _, Partial, Replicate, Shard = _dtensor_api()
    mesh = t.device_mesh
    d = _mesh_dim_of(mesh, group)
    want = [Replicate()] * mesh.ndim
    grad_pl = [Partial()] * mesh.ndim
    if d is not None:
        if t.placements[d] != Shard(0):
            raise ValueError(f"{name} is a DTensor placed {t.placements[d]} on the mesh dimension of process_group; "
                             "a vocabulary-parallel shard must be Shard(0) there")
        want[d] = grad_pl[d] = Shard(0)
    if list(t.placements) == want:
        local = t.to_local()
    else:
        others = mesh.size() // (mesh.size(d) if d is not None else 1)
        local = t.redistribute(mesh, want).to_local(grad_placements=grad_pl)
        if t.requires_grad:
            local = _ScaleGrad.apply(local, 1.0 / others)
    if d is None:
        return local, None
    V, P = t.shape[0], mesh.size(d)
    chunk = -(-V // P)
    start = min(group.rank * chunk, V)
    if local.shape[0] != min(chunk, V - start):
        raise ValueError(f"{name}: DTensor shard of {local.shape[0]} rows where torch.chunk's layout gives "
                         f"{min(chunk, V - start)}")
    return local, _Layout(start, V)


def _replicated_input(t, name: str, group: _Group):
    """input / target as DTensors on the vocabulary-parallel mesh -> the full tensor. Sharded (sequence
    parallelism) it is all-gathered; the backward keeps this rank's part of the already all-reduced gradient."""
    if t is None or not _is_dtensor(t):
        return t
    mesh = t.device_mesh
    if mesh.ndim != 1 or _mesh_dim_of(mesh, group) != 0:
        raise TypeError(f"{name} is a DTensor on a mesh other than process_group's; pass a plain tensor or a DTensor "
                        "on the vocabulary-parallel mesh")
    return t.full_tensor()


def _layout(v_local: int, layouts, vocab_start, vocab_size, group: _Group, device) -> _Layout:
    known = [lay for lay in layouts if lay is not None]
    for lay in known[1:]:
        if lay != known[0]:
            raise ValueError(f"the DTensor arguments disagree on the vocabulary layout: {known[0]} vs {lay}")
    if (vocab_start is None) != (vocab_size is None):
        raise ValueError("give both vocab_start and vocab_size, or neither")
    if vocab_start is not None:
        for nm, v in (("vocab_start", vocab_start), ("vocab_size", vocab_size)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"{nm} must be a Python int, got {type(v).__name__}")
        if not 0 <= vocab_start <= vocab_start + v_local <= vocab_size:
            raise ValueError(f"this rank's shard of {v_local} rows at vocab_start={vocab_start} does not fit in "
                             f"vocab_size={vocab_size}")
        given = _Layout(vocab_start, vocab_size)
        if known and known[0] != given:
            raise ValueError(f"vocab_start/vocab_size {tuple(given)} disagree with the DTensor layout "
                             f"{tuple(known[0])}")
        return given
    if known:
        return known[0]
    # One all-gather of the row counts. On CPU they are read at once (nothing to wait for); on a GPU they stay on
    # the device, since reading them would stall the host until everything queued before had run.
    mine = torch.full((1,), v_local, dtype=torch.int64, device=device)
    sizes = _gather(mine, group).reshape(-1)
    start, vocab = sizes[: group.rank].sum(), sizes.sum()
    if device.type == "cpu":
        return _Layout(int(start), int(vocab))
    return _Layout(start, vocab)


def _check_head(x, w, b):
    """_validate.check_linear, allowing an empty shard (0 rows)."""
    if isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[0] == 0:
        if b is not None and isinstance(b, torch.Tensor) and b.shape != (0,):
            raise ValueError(f"linear_bias must have shape (0,) like this rank's empty shard, got {tuple(b.shape)}")
        # Same checks against a one-row stand-in of the same dtype and device.
        x2d, lead = _validate.check_linear(x, w.new_empty((1, w.shape[1])), None if b is None else b.new_empty(1))
        return x2d, lead
    return _validate.check_linear(x, w, b)


def _check_target(target, lead_shape, vocab, ignore_index, device) -> torch.Tensor:
    """Targets are global ids: checked against the global vocabulary size."""
    if isinstance(vocab, int):
        if vocab == 0:
            raise ValueError("the shards of linear_weight over process_group hold no rows: the vocabulary is empty")
        return _validate.check_target(target, lead_shape, vocab, ignore_index, device)
    # The size lives on the device: same checks, the range one asynchronous (as _validate does off the CPU).
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if target.dtype not in _validate.INDEX_DTYPES:
        raise TypeError(f"target must hold class indices as int64 or int32, got {target.dtype}")
    if target.shape != lead_shape:
        raise ValueError(f"target has shape {tuple(target.shape)} but the input's leading shape is "
                         f"{tuple(lead_shape)}")
    if target.device != device:
        raise ValueError(f"target is on {target.device} but the input is on {device}")
    t = target.reshape(-1).long()
    bad = (t != ignore_index) & ((t < 0) | (t >= vocab))
    torch._assert_async(~bad.any(), "target holds class indices outside [0, V) (V: all shards' rows over "
                        f"process_group) that are not ignore_index={ignore_index}")
    return t


def _prepare(input, linear_weight, linear_bias, target, ignore_index, process_group, vocab_start, vocab_size,
             weight=None):
    group = _resolve_group(process_group)
    w, lay_w = _local_shard(linear_weight, "linear_weight", group)
    b, lay_b = _local_shard(linear_bias, "linear_bias", group)
    cw, lay_c = _local_shard(weight, "weight (class weights)", group)
    x = _replicated_input(input, "input", group)
    target = _replicated_input(target, "target", group)
    x2d, lead = _check_head(x, w, b)
    cw = _validate.check_class_weight(cw, w.shape[0], x.device)
    layout = _layout(w.shape[0], (lay_w, lay_b, lay_c), vocab_start, vocab_size, group, x.device)
    t = valid = t_local = None
    if target is not None:
        t = _check_target(target, lead, layout.vocab, ignore_index, x.device)
        valid = t != ignore_index
        t_local = t - layout.start  # outside [0, V_r): the target is in another shard
    return group, x2d, w, b, cw, lead, layout, valid, t_local


# ---------------------------------------------------------------------------------------------------------------
# Public functions (also reached through process_group= on logitless.linear_cross_entropy & co.).

_PG_DOC = """process_group: the ``torch.distributed`` group (or 1-D DeviceMesh) over which the vocabulary is
            sharded. ``linear_weight`` (and ``linear_bias``, class ``weight``) are this rank's contiguous rows, in
            rank order; sizes may differ between ranks. A DTensor placed Shard(0) on that group is used through its
            local shard (other DTensors are gathered first). ``input`` and ``target`` are the same on every rank
            (or DTensors on that group, gathered); targets are global ids in [0, V).
        vocab_start, vocab_size: this rank's first global row and the global V, when known (Megatron: rank *
            V_padded / P and V_padded); they spare the forward the all-gather of the shard sizes."""


def linear_cross_entropy(input, linear_weight, target, *, linear_bias=None, weight=None, reduction="mean",
                         ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None, backend="auto",
                         process_group, vocab_start=None, vocab_size=None) -> torch.Tensor:
    """Vocabulary-parallel :func:`logitless.linear_cross_entropy`: the same loss as on one device over the
    concatenated shards, returned identically on every rank of ``process_group``.

    Args:
        (as :func:`logitless.linear_cross_entropy`; the class ``weight`` is this rank's (V_r,) shard), and
        {pg}

    Returns:
        float32 loss, a scalar or the shape of ``target`` for ``reduction="none"``. The input gradient comes back
        complete (all-reduced over the group) on every rank; each rank gets the gradient of its own shard.
    """
    ignore_index = _validate.ignore_index_arg(ignore_index)
    _validate.check_options(reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
                            ignore_index=ignore_index)
    group, x, w, b, cw, lead, layout, valid, t_local = _prepare(
        input, linear_weight, linear_bias, target, ignore_index, process_group, vocab_start, vocab_size, weight)
    impl = _local_impl(backend, x, "linear_cross_entropy")
    cw = None if cw is None else cw.to(reference._acc(x.dtype))
    per_token, w_t = _VocabParallelCrossEntropy.apply(
        x, w, b, t_local, valid, cw, layout.vocab, group, impl, float(label_smoothing), float(z_loss),
        None if softcap is None else float(softcap),
    )
    return reference.reduce_loss(per_token, valid, w_t, reduction, lead)


def linear_log_probs(input, linear_weight, target, *, linear_bias=None, softcap=None, temperature=1.0,
                     ignore_index=-100, return_entropy=False, backend="auto", process_group, vocab_start=None,
                     vocab_size=None):
    """Vocabulary-parallel :func:`logitless.linear_log_probs`: per-token log-probs (and entropy) of the full
    vocabulary, identical on every rank.

    Args:
        (as :func:`logitless.linear_log_probs`), and
        {pg}

    Returns:
        float32 log-probs of the shape of ``target`` (0 where ignored), or ``(log_probs, entropy)`` with
        ``return_entropy=True``.
    """
    ignore_index = _validate.ignore_index_arg(ignore_index)
    _validate.check_flag("return_entropy", return_entropy)
    _validate.check_options(softcap=softcap, temperature=temperature, ignore_index=ignore_index)
    group, x, w, b, _, lead, _, valid, t_local = _prepare(
        input, linear_weight, linear_bias, target, ignore_index, process_group, vocab_start, vocab_size)
    impl = _local_impl(backend, x, "linear_log_probs")
    logp, ent = _VocabParallelLogProbs.apply(
        x, w, b, t_local, valid, group, impl, None if softcap is None else float(softcap), 1.0 / float(temperature),
        bool(return_entropy),
    )
    if return_entropy:
        return logp.reshape(lead), ent.reshape(lead)
    return logp.reshape(lead)


def linear_logsumexp(input, linear_weight, *, linear_bias=None, softcap=None, temperature=1.0, backend="auto",
                     process_group, vocab_start=None, vocab_size=None) -> torch.Tensor:
    """Vocabulary-parallel :func:`logitless.linear_logsumexp`: the per-row log-partition function over the whole
    vocabulary, float32, identical on every rank.

    Args:
        (as :func:`logitless.linear_logsumexp`), and
        {pg}
    """
    _validate.check_options(softcap=softcap, temperature=temperature)
    group, x, w, b, _, lead, _, _, _ = _prepare(
        input, linear_weight, linear_bias, None, -100, process_group, vocab_start, vocab_size)
    impl = _local_impl(backend, x, "linear_logsumexp")
    lse = _VocabParallelLogSumExp.apply(x, w, b, group, impl, None if softcap is None else float(softcap),
                                        1.0 / float(temperature))
    return lse.reshape(lead)


for _f in (linear_cross_entropy, linear_log_probs, linear_logsumexp):
    if _f.__doc__:  # None under python -OO
        _f.__doc__ = _f.__doc__.replace("{pg}", _PG_DOC)
del _f
