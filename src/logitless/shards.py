"""A vocabulary shard: where this rank's rows sit, the exchange of its statistics, and the collectives.

The vocabulary-parallel path (docs/distributed.md; the public entry points with a known layout are
logitless.distributed's) is the one-device path on a prepared head that carries a Shard: validation resolves the
group, the local rows of DTensor arguments and the layout (layout); the head op runs its statistics on the shard
with targets shifted by its first row, and exchange() turns them into the whole vocabulary's, identical on every
rank; the loss is then written on them by the same code as on one device. Collectives per call: forward, one
all-gather of the shard sizes (none when the layout is known: ``vocab_start`` and ``vocab_size`` given, or a
DTensor weight) and one all-gather of a few floats per row; backward, one all-reduce of the input gradient (when
the input requires one). No host synchronisation is added: the exchanged sizes stay on the device (on CPU they
are read at once).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

# all_gather_single is the newer name of all_gather_into_tensor (deprecated in recent releases).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Group(NamedTuple):
    pg: dist.ProcessGroup
    rank: int
    size: int


class Layout(NamedTuple):
    """Where this rank's shard sits: global index of its first row, and the global vocabulary size. Python ints,
    or 0-d int64 device tensors when they were exchanged between GPUs (reading them would stall the host)."""

    start: int | torch.Tensor
    vocab: int | torch.Tensor


class Shard(NamedTuple):
    """The sharding of a prepared head: its group, and the global index of this rank's first row."""

    group: Group
    start: int | torch.Tensor


class Sharding(NamedTuple):
    """A ``process_group`` argument with the layout given (logitless.distributed's ``vocab_start`` and
    ``vocab_size``), as the public ops receive it from there."""

    process_group: object
    vocab_start: int | None = None
    vocab_size: int | None = None


# ---------------------------------------------------------------------------------------------------------------
# The statistics of the whole vocabulary: each rank's shard through the head op, one differentiable exchange, then
# the combination below. Autograd carries the gradients back through the combination to each shard's statistics,
# and the head op's backward turns them into the coefficients of its generic backward on the shard.


class _SumGradOverGroup(torch.autograd.Function):
    """Identity; its backward all-reduces the input's gradient over the group, in float32 (float64 for float64):
    the gradient of the replicated input is the sum of every shard's part."""

    @staticmethod
    def forward(ctx, x, group: Group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        g = grad.to(torch.float64 if grad.dtype == torch.float64 else torch.float32, copy=True)
        dist.all_reduce(g, group=ctx.group.pg)
        return g.to(grad.dtype), None


def _gather(local: torch.Tensor, group: Group) -> torch.Tensor:
    """[...] on each rank -> [P, ...] on every rank, in rank order (one all-gather)."""
    if group.size == 1:
        return local[None]
    flat = local.contiguous().reshape(-1)
    out = flat.new_empty(group.size * flat.numel())
    _all_gather_single(out, flat, group=group.pg)
    return out.view((group.size,) + tuple(local.shape))


class _Gather(torch.autograd.Function):
    """_gather, differentiable. Every rank computes the same loss from the gathered statistics (one function,
    replicated, not a sum over ranks), so the statistics of this rank's shard get the gradient of their own slot."""

    @staticmethod
    def forward(ctx, local, group: Group):
        ctx.rank = group.rank
        return _gather(local, group)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.rank], None


def sum_grad_over_group(x: torch.Tensor, group: Group) -> torch.Tensor:
    """x, whose gradient (where one is wanted) is all-reduced over the group: the input is replicated, and its
    gradient is the sum of every shard's part."""
    if x.requires_grad and torch.is_grad_enabled() and group.size > 1:
        return _SumGradOverGroup.apply(x, group)
    return x


def exchange(st, t_local, class_w, v_local: int, group: Group):
    """(the statistics of the whole vocabulary, the target's class weight, the sum of the class weights) from this
    shard's (loss_math.Stats of the head op, targets shifted to the shard, None where absent), identical on every
    rank: M = max_r m_r, logs = log sum_r exp((m_r - M) + s_r), the target logit and smoothing sums add up, the
    entropy is the mixture's. The target's class weight is None without class weights; the sum of the class weights
    (the vocabulary size without them) only with the smoothing sum sw. One all-gather of a few floats per row."""
    n = st.m.shape[0]
    rows = [r for r in st if r is not None]
    if class_w is not None and t_local is not None:  # the target's class weight: in one shard, 0 in the others
        inside = (t_local >= 0) & (t_local < v_local)
        w_tr = class_w[t_local.clamp(0, max(v_local - 1, 0))] if v_local > 0 else torch.zeros_like(st.m)
        rows.append(torch.where(inside, w_tr.to(st.m.dtype), 0.0))
    local = torch.stack(rows).reshape(-1)
    if st.sw is not None:  # the shard's sum of class weights (its row count without them) rides along
        w_r = (class_w.sum().reshape(1) if class_w is not None
               else torch.full((1,), float(v_local), device=st.m.device))
        local = torch.cat([local, w_r.to(local.dtype)])
    allg = _Gather.apply(local, group)  # [P, k * n (+ 1)]
    g = allg[:, : len(rows) * n].view(group.size, len(rows), n)
    m_all, logs_all = g[:, 0], g[:, 1]
    M = m_all.amax(dim=0)
    rel = (m_all - M) + logs_all  # lse_r - M; -inf for an empty shard
    logs = torch.logsumexp(rel, dim=0)
    i = 2
    zt = sw = ent = lse = w_t = w_sum = None
    if st.zt is not None:
        zt = g[:, i].sum(dim=0)
        i += 1
    if st.sw is not None:
        w_all = allg[:, -1]
        shift = torch.where(torch.isfinite(m_all), m_all - M, 0.0)
        sw = (g[:, i] + w_all[:, None] * shift).sum(dim=0)
        w_sum = w_all.sum()
        i += 1
    if st.ent is not None:
        # H = sum_r q_r (H_r - log q_r), q_r = exp(lse_r - lse) the share of the probability mass in shard r: a
        # mixture's entropy, every term >= 0, so nothing cancels. An empty shard (q_r = 0) adds 0, and no NaN to the
        # gradient (log q_r = -inf stays out of every product).
        log_q = rel - logs
        q = torch.exp(log_q)
        ent = (q * (g[:, i] - torch.where(q > 0, log_q, 0.0))).sum(dim=0)
        i += 1
    if st.lse is not None:
        lse = torch.logsumexp(g[:, i], dim=0)
        i += 1
    if class_w is not None and t_local is not None:
        w_t = g[:, i].sum(dim=0)
    return type(st)(M, logs, zt, sw, ent, lse), w_t, w_sum


# ---------------------------------------------------------------------------------------------------------------
# The layout: the group, DTensors, where this rank's rows sit.


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


def resolve_group(process_group) -> Group:
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
    return Group(pg, rank, dist.get_world_size(pg))


def _mesh_dim_of(mesh, group: Group) -> int | None:
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


def local_shard(t, name: str, group: Group):
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
    return local, Layout(start, V)


def replicated_input(t, name: str, group: Group):
    """input / target as DTensors on the vocabulary-parallel mesh -> the full tensor. Sharded (sequence
    parallelism) it is all-gathered; the backward keeps this rank's part of the already all-reduced gradient."""
    if t is None or not _is_dtensor(t):
        return t
    mesh = t.device_mesh
    if mesh.ndim != 1 or _mesh_dim_of(mesh, group) != 0:
        raise TypeError(f"{name} is a DTensor on a mesh other than process_group's; pass a plain tensor or a DTensor "
                        "on the vocabulary-parallel mesh")
    return t.full_tensor()


def layout(v_local: int, layouts, vocab_start, vocab_size, group: Group, device) -> Layout:
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
        given = Layout(vocab_start, vocab_size)
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
        return Layout(int(start), int(vocab))
    return Layout(start, vocab)
