"""Vocabulary-parallel (tensor-parallel) linear cross-entropy, log-probs and log-sum-exp over torch.distributed.

Each rank of ``process_group`` holds a contiguous block of rows of the classifier (its vocabulary shard; shards
in rank order, sizes may differ), the same input rows and the same global targets. The math (docs/distributed.md):

1. Each rank runs the head op (logitless.head, either backend) on its shard, with targets shifted by its first row
   (a target outside [0, V_r) is "in another shard": it contributes no target logit here). Per row it gets the
   shard's max m_r, log-sum s_r = log sum_{j in r} exp(z_j - m_r), target logit, smoothing sum
   sum_j w_j (z_j - m_r) and entropy.
2. One all-gather of those few floats per row gives every rank the same global statistics, combined in the same
   order on every rank (so every rank returns bit-identical values): M = max_r m_r, logs = log sum_r
   exp((m_r - M) + s_r), the target logit and smoothing sums add up, and the entropy of the mixture is
   H = sum_r q_r (H_r - log q_r) with q_r = exp(lse_r - lse) the share of the probability mass in shard r. The
   losses are the single-device ones, written on these statistics with the same code (loss_math).
3. Backward: autograd takes the gradient through the combination and the all-gather (each rank keeps its own
   slot) to the statistics of the shard, whose head op runs its generic backward there: each rank keeps its weight
   (and bias) gradient, and the input gradient, a sum over shards, is all-reduced in float32.

Every option of the head op's backward works here as on one device: ``workspace_bytes``, ``skip_threshold`` /
``vocab_order`` (on the shard's own vocabulary: a tile that holds at most that fraction of the shard's mass holds
at most that fraction of the row's) and the Triton forward's stash.

Collectives per call: forward, one all-gather of the shard sizes (skipped when the layout is known: ``vocab_start``
and ``vocab_size`` given, or a DTensor weight) and one all-gather of the statistics; backward, one all-reduce of the
input gradient (when the input requires one). No host synchronisation is added: the exchanged sizes stay on the
device (on CPU they are read at once). No N x V_r tensor is built.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from . import _validate, head, loss_math
from .loss_math import Stats

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
# The statistics of the whole vocabulary: each rank's shard through the head op (either backend, every option of
# its backward), one differentiable exchange, then the combination below. Autograd carries the gradients back
# through the combination to each shard's statistics, and the head op's backward turns them into the coefficients
# of its generic backward on the shard.


class _SumGradOverGroup(torch.autograd.Function):
    """Identity; its backward all-reduces the input's gradient over the group, in float32 (float64 for float64):
    the gradient of the replicated input is the sum of every shard's part."""

    @staticmethod
    def forward(ctx, x, group: _Group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        g = grad.to(torch.float64 if grad.dtype == torch.float64 else torch.float32, copy=True)
        dist.all_reduce(g, group=ctx.group.pg)
        return g.to(grad.dtype), None


def _gather(local: torch.Tensor, group: _Group) -> torch.Tensor:
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
    def forward(ctx, local, group: _Group):
        ctx.rank = group.rank
        return _gather(local, group)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.rank], None


def _global_stats(x, w, b, t_local, class_w, softcap, inv_temp, want_smooth, want_entropy, *, group: _Group,
                  backend: str, skip: head.Skip, workspace_bytes, want_lse: bool = False
                  ) -> tuple[Stats, torch.Tensor | None, object]:
    """The head op's Stats over the whole vocabulary (sw relative to the global max), identical on every rank, with
    the target's class weight (None without class weights) and the sum of the class weights (the vocabulary size
    without them; only with want_smooth). want_lse: the lse statistic (loss_math), the log-sum-exp of the shards'
    own, so that its gradient reaches each shard's op apart from logs'. Collectives: one all-gather of a few floats
    per row; in the backward, one all-reduce of the input's gradient (when it needs one)."""
    if backend == "torch":
        # The PyTorch backend returns dx in x's dtype: upcast, the shards' parts are summed before the one rounding.
        x = x.to(loss_math.acc_dtype(x.dtype))
    if x.requires_grad and torch.is_grad_enabled() and group.size > 1:
        x = _SumGradOverGroup.apply(x, group)
    st = head.stats(x, w, b, t_local, class_w, softcap, inv_temp, want_smooth, want_entropy, backend=backend,
                    skip=skip, ignore_index=-1, workspace_bytes=workspace_bytes, want_lse=want_lse)
    v_local, n = w.shape[0], st.m.shape[0]
    rows = [r for r in st if r is not None]
    if class_w is not None and t_local is not None:  # the target's class weight: in one shard, 0 in the others
        inside = (t_local >= 0) & (t_local < v_local)
        w_tr = class_w[t_local.clamp(0, max(v_local - 1, 0))] if v_local > 0 else torch.zeros_like(st.m)
        rows.append(torch.where(inside, w_tr.to(st.m.dtype), 0.0))
    local = torch.stack(rows).reshape(-1)
    if want_smooth:  # the shard's sum of class weights (its row count without them) rides along
        w_r = class_w.sum().reshape(1) if class_w is not None else torch.full((1,), float(v_local), device=x.device)
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
    return Stats(M, logs, zt, sw, ent, lse), w_t, w_sum


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
        # Outside [0, V_r): in another shard (or ignored, -1), no target logit here.
        t_local = torch.where(valid, t - layout.start, -1)
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
                         skip_threshold="auto", vocab_order="none", workspace_bytes=None, process_group,
                         vocab_start=None, vocab_size=None) -> torch.Tensor:
    """Vocabulary-parallel :func:`logitless.linear_cross_entropy`: the same loss as on one device over the
    concatenated shards, returned identically on every rank of ``process_group``.

    Args:
        (as :func:`logitless.linear_cross_entropy`; the class ``weight`` and a ``vocab_order`` tensor of counts are
        this rank's (V_r,) shards), and
        {pg}

    Returns:
        float32 loss, a scalar or the shape of ``target`` for ``reduction="none"``. The input gradient comes back
        complete (all-reduced over the group) on every rank; each rank gets the gradient of its own shard.
    """
    ignore_index = _validate.ignore_index_arg(ignore_index)
    _validate.check_options(reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
                            ignore_index=ignore_index)
    _validate.check_workspace(workspace_bytes)
    _validate.check_skip_options(skip_threshold, vocab_order, None, None)
    group, x, w, b, cw, lead, layout, valid, t_local = _prepare(
        input, linear_weight, linear_bias, target, ignore_index, process_group, vocab_start, vocab_size, weight)
    _validate.check_skip_options(skip_threshold, vocab_order, w.shape[0], x.device)  # a tensor: the shard's counts
    chosen = head.choose_backend(backend, x, "linear_cross_entropy")
    cw = None if cw is None else cw.to(loss_math.acc_dtype(x.dtype))
    # Label smoothing adds -E w_j to every class's gradient: a skipped tile would lose that too, so no skipping.
    skip = head.Skip(skip_threshold, vocab_order, bounded=label_smoothing == 0.0)
    st, w_t, w_sum = _global_stats(x, w, b, t_local, cw, softcap, 1.0, label_smoothing > 0.0, False, group=group,
                                   backend=chosen, skip=skip, workspace_bytes=workspace_bytes,
                                   want_lse=loss_math.z_loss_apart(z_loss, x, w))
    w_t = valid.to(st.m.dtype) if w_t is None else torch.where(valid, w_t, 0.0)
    per_token = loss_math.ce_loss_from_stats(st.m, st.logs, st.zt, st.sw, st.m, valid, w_t, w_sum,
                                             label_smoothing, z_loss, layout.vocab, lse=st.lse)
    return loss_math.reduce_loss(per_token, valid, w_t, reduction, lead)


def linear_log_probs(input, linear_weight, target, *, linear_bias=None, softcap=None, temperature=1.0,
                     ignore_index=-100, return_entropy=False, backend="auto", skip_threshold="auto",
                     workspace_bytes=None, process_group, vocab_start=None, vocab_size=None):
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
    _validate.check_workspace(workspace_bytes)
    _validate.check_skip_options(skip_threshold, "none", None, None)
    group, x, w, b, _, lead, _, valid, t_local = _prepare(
        input, linear_weight, linear_bias, target, ignore_index, process_group, vocab_start, vocab_size)
    chosen = head.choose_backend(backend, x, "linear_log_probs")
    # The entropy's gradient is not bounded by the skipped probability mass alone: no skipping with it.
    skip = head.Skip(skip_threshold, "none")
    st, _, _ = _global_stats(x, w, b, t_local, None, softcap, 1.0 / float(temperature), False, bool(return_entropy),
                             group=group, backend=chosen, skip=skip, workspace_bytes=workspace_bytes)
    logp, ent = loss_math.log_probs_from_stats(st, valid)
    return (logp.reshape(lead), ent.reshape(lead)) if return_entropy else logp.reshape(lead)


def linear_logsumexp(input, linear_weight, *, linear_bias=None, softcap=None, temperature=1.0, backend="auto",
                     workspace_bytes=None, process_group, vocab_start=None, vocab_size=None) -> torch.Tensor:
    """Vocabulary-parallel :func:`logitless.linear_logsumexp`: the per-row log-partition function over the whole
    vocabulary, float32, identical on every rank.

    Args:
        (as :func:`logitless.linear_logsumexp`), and
        {pg}
    """
    _validate.check_options(softcap=softcap, temperature=temperature)
    _validate.check_workspace(workspace_bytes)
    group, x, w, b, _, lead, _, _, _ = _prepare(
        input, linear_weight, linear_bias, None, -100, process_group, vocab_start, vocab_size)
    chosen = head.choose_backend(backend, x, "linear_logsumexp")
    st, _, _ = _global_stats(x, w, b, None, None, softcap, 1.0 / float(temperature), False, False, group=group,
                             backend=chosen, skip=head.NO_SKIP, workspace_bytes=workspace_bytes)
    return (st.m + st.logs).reshape(lead)


for _f in (linear_cross_entropy, linear_log_probs, linear_logsumexp):
    if _f.__doc__:  # None under python -OO
        _f.__doc__ = _f.__doc__.replace("{pg}", _PG_DOC)
del _f
