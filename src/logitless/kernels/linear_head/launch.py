"""The linear head's two launchers, forward_stats and backward (the contract is in the package docstring)."""

from __future__ import annotations

import contextlib

import torch

from .._common import INTERPRETER_SMS_FORWARD, cdiv, gradient_buffers, new_buffer, num_sms
from .._launch import launch
from .._tuning import current_tuning
from . import backward_kernels as bk
from . import configs, plans, products
from .configs import config_for, dot_flags, operands, tma_ok, use_tma
from .forward_kernels import _combine_kernel, _fwd_kernel
from .records import BackwardRecord, DzLaunch, ProductsCall, storage_address


def forward_stats(x, w, b, target, class_w, *, softcap, inv_temp, want_smooth, want_entropy, perm=None,
                  tile_lse=None, stash=None, mu_rest=None):
    """Per-row (m, logs, zt, sw, ent) float32 of the head (and tile_lse filled when given); see the package
    docstring. mu_rest: None, or a (2, N) float32 buffer (with a target and no perm) filled with the backward's
    mu = sum_j p_j (z_j - m) (with want_entropy; else left as it is) and rest = sum_{j != t} exp(z_j - m)
    (loss_math.head_coefficients).
    stash: None, or (buffer, layout), a (V, D) tensor of W's dtype that will be the weight's gradient
    and its stash_layout: the logits of the layout's classes are kept there for backward(stash=buffer)."""
    N, D = x.shape
    V = w.shape[0]
    f32 = dict(device=x.device, dtype=torch.float32)
    outs = [new_buffer(N, **f32) for _ in range(5)]
    if N == 0:
        return tuple(outs)
    cfg = config_for(x)
    n_blocks = cdiv(N, cfg.block_n)
    n_vtiles = cdiv(V, cfg.block_v)
    if tile_lse is not None:
        assert tile_lse.shape == (N, n_vtiles) and tile_lse.dtype == torch.float16
        assert tile_lse.is_contiguous()
    sms = num_sms(x.device, INTERPRETER_SMS_FORWARD)
    # The splits are whole chunks of cfg.chunk_tiles tiles, the partials per chunk (their number depends on V
    # alone): a row's statistics do not depend on N (batch invariance, docs/rl.md).
    n_chunks = cdiv(n_vtiles, cfg.chunk_tiles)
    n_big, chunks_big, n_small, chunks_small = plans._fwd_layout(n_blocks, n_chunks, sms, cfg.group, cfg.waves)
    n_splits = n_big + n_small
    has_target = target is not None
    has_rest = mu_rest is not None
    assert not has_rest or (has_target and perm is None and mu_rest.shape == (2, N))
    # Absent operands are None: Triton makes such an argument a constexpr, and the kernel's flag for it keeps the
    # code that would read it out.
    # Partial statistics per chunk: m and s always, the others only where asked for.
    kept = [True, True, has_target, bool(want_smooth), bool(want_entropy), has_rest]
    part = new_buffer((sum(kept), n_chunks, N), **f32)
    part = [part[sum(kept[:i])] if k else None for i, k in enumerate(kept)]
    wsum = new_buffer(n_chunks, **f32)
    tma = use_tma(cfg, x, w, perm)
    xo, wo = operands(x, w, tma, cfg.block_n, cfg.block_v, cfg.block_k)
    zs = zo = None
    n_stash = 0
    stash_tma = False
    if stash is not None:
        buf, lay = stash
        assert perm is None and buf.shape == (V, D) and buf.is_contiguous() and lay.classes % cfg.block_v == 0
        zs, zo = plans._stash_views(buf, lay, N, cfg)
        n_stash = lay.classes
        stash_tma = current_tuning().stash_tma and tma and tma_ok(zs)
        if stash_tma:
            zs = configs.descriptor(zs, [cfg.block_v, cfg.block_n])
    fusion = current_tuning().fwd_fp_fusion  # off: values independent of the optional outputs (Tuning)
    launch(_fwd_kernel, (n_blocks * n_splits,),
        xo, wo, b, target, class_w, perm,
        part[0], part[1], part[2], part[3], part[4], wsum, tile_lse, zs, zo, part[5],
        N, V, D, n_big, chunks_big, n_small, chunks_small, n_vtiles, n_stash,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1),
        float(softcap or 1.0), float(inv_temp),
        HAS_BIAS=b is not None, HAS_SOFTCAP=softcap is not None, HAS_TEMP=inv_temp != 1.0, HAS_TARGET=has_target,
        HAS_SMOOTH=bool(want_smooth), HAS_CLASS_WEIGHT=class_w is not None, HAS_ENTROPY=bool(want_entropy),
        HAS_PERM=perm is not None, RECORD_TILES=tile_lse is not None, STASH=stash is not None,
        STASH_TMA=stash_tma, BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_K=cfg.block_k, GROUP=cfg.group,
        EVEN_K=D % cfg.block_k == 0, **dot_flags(x), USE_TMA=tma, EVEN_V=V % cfg.block_v == 0, HAS_REST=has_rest,
        HALF_TANH=x.dtype != torch.float32, CHUNK=cfg.chunk_tiles, num_warps=cfg.fwd_warps,
        num_stages=cfg.fwd_stages, enable_fp_fusion=fusion,
    )
    block = 256 if x.device.type == "cuda" else 32
    launch(_combine_kernel, (cdiv(N, block),),
        part[0], part[1], part[2], part[3], part[4], wsum, part[5],
        outs[0], outs[1], outs[2], outs[3], outs[4], mu_rest[0] if has_rest and want_entropy else None,
        mu_rest[1] if has_rest else None,
        N, n_chunks,
        HAS_TARGET=has_target, HAS_SMOOTH=bool(want_smooth), HAS_ENTROPY=bool(want_entropy), HAS_REST=has_rest,
        BLOCK=block,
        num_warps=4, enable_fp_fusion=fusion,
    )
    return tuple(outs)


def backward(x, w, b, target, class_w, m, logs, A, B, C, E, *, softcap, inv_temp, need_dx, need_dw, need_db,
             perm=None, tile_lse=None, skip_threshold=0.0, workspace_bytes=None, stash=None, At=None, on_plan=None):
    """Gradients (dx, dw, db) of the head for the per-row coefficients (A, B, C, E); see the package docstring.
    At (with C): the target's column is p_t (At + B (z_t - m)) - C - E w_t (loss_math.head_coefficients).
    perm and tile_lse are the forward's (same x and w; perm made with the same workspace_bytes); pairs are skipped
    only with skip_threshold != 0 and without an E term (its error is not bounded by the probability mass;
    plans.skip_plan bounds the A and B terms'). workspace_bytes: what the workspaces may take beyond O(N)
    (plans._workspace; None: the default policy, plans.default_budget).
    stash: the buffer the forward kept logits in (forward_stats(stash=...), its layout from stash_layout with this
    need_dx and workspace_bytes); it becomes dw (need_dw must be set), and its contents are used up.
    on_plan: called with the SkipPlan where the backward makes one (the skipping gate's record)."""
    N, D = x.shape
    V = w.shape[0]
    need_db = bool(need_db and b is not None)
    if x.dtype != torch.float32 and 0 < D < current_tuning().narrow_d:
        return _narrow_backward(x, w, b, target, class_w, m, logs, A, B, C, E, softcap, inv_temp, need_dx, need_dw,
                                need_db, perm, workspace_bytes, stash, At)
    lay = None
    if stash is not None:
        lay = plans.stash_layout(x, w, need_dx, workspace_bytes)
        assert need_dw and lay is not None and stash.shape == (V, D) and stash.dtype == w.dtype
    # (db in vocabulary positions until the end)
    dx, dw, db, empty = gradient_buffers(x, w, need_dx, need_dw, need_db, dw=stash)
    if empty:
        return dx, dw, None if db is None else db.to(b.dtype)
    sp = None
    if tile_lse is not None and skip_threshold != 0 and E is None and plans.skip_supported(x) and N > 0:
        cfg = config_for(x)
        sp = plans.skip_plan(tile_lse, m, logs, A, target if C is not None else None, perm, V, skip_threshold,
                             cfg.block_n, cfg.block_v, current_tuning().skip_group_rows, B=B,
                             kernels=current_tuning().skip_plan_kernels)
        sink = current_tuning().debug_plans
        if sink is not None:
            sink.append(sp)
        if on_plan is not None:
            on_plan(sp)
    rows = None if sp is None else sp.rows
    dx_split = 1
    if sp is not None and perm is None:
        # What skipping holds during the backward counts against the budget: the forward's tile log-sum-exps and,
        # with grouped rows, the reordered copy of x; then float32 partials of dx for split dx tiles
        # (Tuning.skip_dx_split), as many as leave the accumulator and the scratch their room. (With a vocabulary
        # order the budget stays the forward's: the order was made for the workspaces that budget gives.)
        held = tile_lse.numel() * tile_lse.element_size() + (x.numel() * x.element_size() if rows is not None else 0)
        budget = (plans.default_budget(N, V, D, x.element_size()) if workspace_bytes is None
                  else workspace_bytes)
        left = max(0, budget - held)
        acc = 4 * N * D
        if need_dx and need_dw and acc > 0:
            spare = (left - acc - current_tuning().scratch_bytes) // acc
            dx_split = 1 + max(0, min(current_tuning().skip_dx_split - 1, spare))
        workspace_bytes = left - (dx_split - 1) * acc
    if rows is not None:
        # The plan's blocks are blocks of its row order: the backward runs on the rows in that order (copies of x
        # and of the per-row vectors, O(N D)) and dx comes back to the input's order at the end.
        def take(t):
            return None if t is None else t.index_select(0, rows)
        x, target, m, logs, A, B, C, At = (take(t) for t in (x, target, m, logs, A, B, C, At))
    bw = _Backward(x, w, b, target, class_w, m, logs, (A, B, C, E, At), softcap, inv_temp, perm, sp, workspace_bytes,
                   dx, dw, db, lay, dx_split)
    records = current_tuning().debug_backwards
    if records is not None:
        plan = bw.plan
        bw.rec = BackwardRecord("linear_head", bw.ws, bw.skip, lay, plan.chunk, plan.dw_end, plan.dz_main is not None,
                                storage_address(plan.dx_acc))
        records.append(bw.rec)
    # cuBLAS's settings saved and restored once per backward, not around each chunk's products (host time a chunk,
    # which small heads wait on: docs/design/host_time.md; products._Fp32Reductions is reentrant, the inner ones
    # cost nothing)
    with products._Fp32Reductions() if bw.torch_products and (need_dx or need_dw) else contextlib.nullcontext():
        bw.run(need_dx, need_dw, need_db)
    if rows is not None and dx is not None:
        dx = torch.empty_like(dx).index_copy_(0, rows, dx)
    if db is not None and perm is not None:
        db = db[torch.argsort(perm)]  # position order -> class order
    return dx, dw, None if db is None else db.to(b.dtype)


def _narrow_backward(x, w, b, target, class_w, m, logs, A, B, C, E, softcap, inv_temp, need_dx, need_dw, need_db,
                     perm, workspace_bytes, stash, At=None):
    """backward at D < Tuning.narrow_d for half-precision inputs: on float32 copies (dL/dz kept in float32 for the
    products), gradients cast back to the inputs' dtypes. No skipping (tile_lse follows the half-precision tiles,
    and there is no product worth skipping); a stash is used up by writing dW into it."""
    b32 = None if b is None else b.float()
    dx, dw, db = backward(x.float(), w.float(), b32, target, class_w, m, logs, A, B, C, E, softcap=softcap,
                          inv_temp=inv_temp, need_dx=need_dx, need_dw=need_dw, need_db=need_db, perm=perm,
                          workspace_bytes=workspace_bytes, At=At)
    if dw is not None:
        dw = stash.copy_(dw) if stash is not None else dw.to(w.dtype)
    return (None if dx is None else dx.to(x.dtype), dw, None if db is None else db.to(b.dtype))


class _Backward:
    """One backward call: its inputs, tiles, plans and buffers, and the two launches per vocabulary chunk (dz_pass:
    dL/dz of the chunk; grad_pass: its gradient products).

    The vocabulary is walked in chunks, twice at most. Where each chunk's dL/dz and the float32 dx accumulator live
    (bfloat16 / float16 inputs; float32 inputs accumulate into dx itself) is decided by the plans, and every buffer
    used is one of the gradients before it is written, or the scratch:
    - dx (N, D) is written only at the end: until then it holds the dz of a first-pass chunk of up to D classes
      (plan.dz_main).
    - dW (V, D) is written chunk by chunk; rows not written yet hold, in the bytes of its last 2N rows, the float32
      dx accumulator (plan.dx_acc, unless the workspace budget buys it a buffer of its own), whose rows
      [plan.dw_end, V) the second pass computes once dx is final; a wide first-pass chunk's dz in the rows after the
      chunk (below plan.dw_free), or for the chunks of the rows left to the second pass, from dW's first unwritten
      element (_first_pass); a second-pass chunk's dz in the rows after it while they last (_second_pass), else
      those rows take its float32 split partials while dz is in the scratch.
    - With a stash, the first classes' logits are in dW already (float16, class-major, with their row maxima;
      stash_layout): each stashed chunk's dz is written over its own logits, and its dW rows lie below every later
      chunk's stash.
    - The scratch is one lazily allocated buffer of at most ws.scratch bytes (more only if one row of N tokens
      needs more), for dz when nothing above has room and for split partials: no view of it outlives the next
      request, so a larger request replaces it.
    Nothing here synchronises with the host.
    """

    def __init__(self, x, w, b, target, class_w, m, logs, coefs, softcap, inv_temp, perm, sp, workspace_bytes, dx, dw,
                 db, lay, dx_split=1):
        N, D = x.shape
        V = w.shape[0]
        self.x, self.w, self.b, self.target, self.class_w, self.m, self.logs = x, w, b, target, class_w, m, logs
        self.A, self.B, self.C, self.E, self.At = coefs
        self.softcap, self.inv_temp, self.perm = softcap, inv_temp, perm
        self.dx, self.dw, self.db, self.lay = dx, dw, db, lay
        self.N, self.V, self.D = N, V, D
        self.cfg = cfg = config_for(x)
        skip_wide = current_tuning().skip_wide or cfg.skip_wide
        if sp is not None:
            self.cfg = cfg = cfg.skip_products(D)
            if skip_wide > cfg.wide:
                self.cfg = cfg = cfg.replace(wide=skip_wide)
        self.has_perm = perm is not None
        # Chunks of whole tiles with skipping or a vocabulary order (chunk boundaries on the tiles of the map).
        self.aligned = self.has_perm or sp is not None
        self.skip = sp is not None
        self.ws = plans._workspace(N, V, D, x.element_size(), workspace_bytes,
                                   plans.acc_forced(x, dx is not None, dw is not None, N, V, D))
        self.plan = plans._plan(x, dx, dw, N, V, D, cfg, self.aligned, self.ws)
        self.f32 = dict(device=x.device, dtype=torch.float32)
        self.dot = dot_flags(x)
        self.n_blocks = cdiv(N, cfg.block_n)
        self.n_vtiles = cdiv(V, cfg.block_v)
        self.sms = configs.backward_sms(x.device)
        self.sp = sp
        self.lists = ((self.sp.list_n, self.sp.pre_n, self.sp.list_v, self.sp.pre_v) if self.skip
                      else (None,) * 4)
        # Skipping, the dz launches walk the hot pairs alone (Tuning.skip_dz_hot_list), found through the plan's
        # count of the hot pairs before each tile.
        self.pairs = sp.pairs if self.skip and current_tuning().skip_dz_hot_list else None
        self.torch_products = products._torch_products(x, w, self.skip, self.has_perm)
        self.dz_tma = use_tma(cfg, x, w, perm)
        self.dz_x, self.dz_w = operands(x, w, self.dz_tma, cfg.block_n, cfg.dz_block_v, cfg.block_k)
        # With a softcap, the recomputing dz launches take their own tiles (Config.cap_dz_block_v; the stash's and
        # skipping's tiles are the forward's)
        self.cap_tiles = softcap is not None and sp is None and cfg.cap_dz_block_v not in (0, cfg.dz_block_v)
        if self.cap_tiles:
            self.cap_x, self.cap_w = operands(x, w, self.dz_tma, cfg.block_n, cfg.cap_dz_block_v, cfg.block_k)
        self.scratch = None
        self.x_desc = None  # the gradient products' descriptor of x, made once
        self.dx_split = dx_split  # programs per dx tile in skipping launches of both products (the budget's choice)
        self.dx_deal = None  # (1,) int32 on the device: whether those launches deal the steps out
        self.deal_by_chunk = None  # with Tuning.skip_dx_deal "makespan": that flag per first-pass chunk (by v0)
        self.dx_part = None  # their float32 partials, (dx_split - 1, N, D), made at the first such launch and added
        # to the dx accumulator after the first pass
        self.rec = None  # a BackwardRecord to fill (Tuning.debug_backwards), or None
        if lay is not None:
            self.stash_zs, self.stash_zo = plans._stash_views(dw, lay, N, cfg)
            self.stash_dz = dw.view(-1)[lay.at: lay.at + lay.classes * N].view(lay.classes, N)

    def scratch_view(self, shape, dtype):
        n = shape[0] * shape[1]
        nbytes = n * dtype.itemsize
        if self.scratch is None or self.scratch.numel() * 4 < nbytes:
            self.scratch = None  # freed first: the peak holds one buffer
            self.scratch = new_buffer(cdiv(nbytes, 4), **self.f32)
        return self.scratch.view(dtype)[:n].view(shape)

    def dz_in_dw(self, start, cols):
        # The (N, cols) dz of a chunk in dW rows not written yet, from element `start` (the planners leave room for
        # its padded rows)
        return plans.dz_rows(self.dw.view(-1)[start:], self.N, cols)

    def dz_in_scratch(self, cols):
        ld = plans.scratch_ld(self.N, cols, self.x.element_size(), self.ws.scratch)
        return self.scratch_view((self.N, ld), self.x.dtype)[:, :cols]

    def run(self, need_dx, need_dw, need_db):
        N, V, D, cfg, plan = self.N, self.V, self.D, self.cfg, self.plan
        need_dz = need_dx or need_dw
        # First pass: every class once; dW rows below plan.dw_end, dx accumulated over all chunks. (A vocabulary
        # order gets no wide chunks: its dW rows are scattered over the first pass's range.)
        first = True
        chunks = plans._first_pass(N, V, D, cfg, plan, self.aligned, need_dz and not self.has_perm, self.lay)
        if self.rec is not None:
            self.rec.first_pass = list(chunks)
        if self.skip and self.dx_split > 1 and current_tuning().skip_dx_deal == "makespan":
            # Every chunk's choice at once (one small computation, not one per chunk), read by grad_pass.
            bounds = [v0 // cfg.block_v for v0, *_ in chunks] + [cdiv(chunks[-1][1], cfg.block_v)]
            flags = plans.deal_by_makespan(self.sp.pre_n, bounds, D, cfg, self.sms)
            self.deal_by_chunk = {v0: flags[i:i + 1] for i, (v0, *_) in enumerate(chunks)}
        for v0, v1, dz_at, stashed in chunks:
            dz = None
            if stashed:  # dz replaces the chunk's stashed logits: (N, v1 - v0), column-major
                dz = self.stash_dz[v0: v1].t()
                self.dz_pass(v0, v1, dz, need_db, stashed=True)
                self.grad_pass(v0, v1, dz, True, plan.dx_acc, not first, True)
                first = False
                continue
            if dz_at is not None:
                dz = self.dz_in_dw(dz_at, v1 - v0)
            elif need_dz:
                dz = plan.dz_main[:, : v1 - v0] if plan.dz_main is not None else self.dz_in_scratch(v1 - v0)
            self.dz_pass(v0, v1, dz, need_db)
            if need_dz:
                self.grad_pass(v0, v1, dz, need_dw and v1 <= plan.dw_end, plan.dx_acc, not first,
                               dz_at is not None or plan.dz_main is not None)
                first = False
        if self.dx_part is not None:  # the split dx tiles' partials, in split order (deterministic)
            for part in self.dx_part:
                plan.dx_acc.add_(part)
            self.dx_part = None
        if need_dx and plan.cast_dx:
            self.dx.copy_(plan.dx_acc)
        # Second pass: the dW rows that held the dx accumulator.
        if need_dw and plan.dw_end < V:
            chunks = plans._second_pass(N, V, D, self.x.element_size(), cfg, plan.dw_end, self.aligned,
                                        self.ws.scratch)
            if self.rec is not None:
                self.rec.second_pass = list(chunks)
            for v0, v1, in_dw in chunks:
                room = None
                if in_dw:
                    dz = self.dz_in_dw(v1 * D, v1 - v0)
                else:
                    dz = self.dz_in_scratch(v1 - v0)
                    # The dW rows after the chunk are not written yet (its classes' rows are its own, also with an
                    # order): room for the split partials of its few long dW tiles, 16-byte aligned.
                    lo, hi = cdiv(v1 * D, 8) * 8, V * D // 8 * 8
                    room = self.dw.view(-1)[lo:hi] if hi > lo else None
                self.dz_pass(v0, v1, dz, False)
                self.grad_pass(v0, v1, dz, True, None, False, in_dw, room)

    def dz_pass(self, v0, v1, dz, with_db, stashed=False):
        """dL/dz of classes [v0, v1) into dz (N, v1 - v0) (None: not stored, the bias gradient alone), and the bias
        gradient of the chunk. stashed: dz (column-major) is where the forward kept these logits."""
        cfg, N = self.cfg, self.N
        assert not self.skip or v0 % cfg.block_v == 0
        store = dz is not None
        dbp = new_buffer((self.n_blocks, v1 - v0), **self.f32) if with_db else None
        zs = zo = None
        if stashed:
            zs = self.stash_zs[v0: v1]
            zo = self.stash_zo[v0 // cfg.block_v:]
        b, target, class_w, B, C, E = self.b, self.target, self.class_w, self.B, self.C, self.E
        x, w = self.x, self.w
        bv, stages, ox, ow = cfg.dz_block_v, cfg.fwd_stages, self.dz_x, self.dz_w
        if self.cap_tiles and not stashed:
            bv, stages, ox, ow = cfg.cap_dz_block_v, cfg.cap_dz_stages or cfg.fwd_stages, self.cap_x, self.cap_w
        n_tiles = self.n_blocks * cdiv(v1 - v0, bv)
        hot_list = self.pairs is not None
        # Recomputing chunks whose dz the copy engine can store: a persistent grid (see _dz_kernel). Not with the
        # entropy's term or a softcap, whose longer epilogues it made slower (docs/design/backward.md, "The dz
        # kernel, persistent").
        persistent = (cfg.dz_persistent and self.dz_tma and store and not stashed and not self.skip
                      and B is None and self.softcap is None and tma_ok(dz))
        dz_desc = configs.descriptor(dz, [cfg.block_n, bv]) if persistent else None
        n_progs = min(n_tiles, self.sms) if persistent or hot_list else n_tiles
        if hot_list and with_db:
            dbp.zero_()  # the cold pairs' bias partials: no program visits them
        if self.rec is not None:
            self.rec.dz.append(DzLaunch(v0, v1, n_progs, bv, stashed, bool(persistent or hot_list), bool(persistent),
                                        self.skip))
        launch(bk._dz_kernel, (n_progs,),
            ox, ow, b, target, class_w, self.perm, self.m, self.logs, self.A, B, C, E,
            self.sp.hot if self.skip else None, dz, dz_desc, dbp, zs, zo, self.At,
            self.sp.list_v if hot_list else None, self.pairs, N, self.D, v0, v1, self.n_vtiles, n_progs,
            self.n_blocks,
            x.stride(0), x.stride(1), w.stride(0), w.stride(1), dz.stride(0) if store else 0,
            dz.stride(1) if store else 1, dbp.stride(0) if with_db else 0,
            float(self.softcap or 1.0), float(self.inv_temp),
            HAS_BIAS=b is not None, HAS_SOFTCAP=self.softcap is not None, HAS_TEMP=self.inv_temp != 1.0,
            HAS_B=B is not None, HAS_C=C is not None and target is not None, HAS_E=E is not None,
            HAS_CLASS_WEIGHT=class_w is not None, STORE_DZ=store, HAS_DB=with_db, HAS_PERM=self.has_perm,
            SKIP=self.skip, LOAD_Z=stashed,
            BLOCK_N=cfg.block_n, BLOCK_V=bv, BLOCK_K=cfg.block_k, GROUP=cfg.group,
            EVEN_K=self.D % cfg.block_k == 0, **self.dot,
            USE_TMA=self.dz_tma, HAS_AT=self.At is not None and C is not None and target is not None,
            FINE_SLOPE=x.dtype == torch.float32, HALF_TANH=x.dtype != torch.float32, DZ_TMA=persistent,
            PERSISTENT=persistent, HOT_LIST=hot_list, SEARCH_STEPS=max(1, (cdiv(v1 - v0, bv)).bit_length()),
            num_warps=cfg.fwd_warps, num_stages=stages,
        )
        if with_db:
            torch.sum(dbp, dim=0, out=self.db[v0:v1])

    def grad_pass(self, v0, v1, dz, do_dw, dx_acc, accumulate, scratch_free, room=None):
        """dW rows [v0, v1) = dz^T x (do_dw) and dx_acc = or += dz W[v0:v1] (dx_acc not None). scratch_free: dz is
        not in the scratch (split partials may go there); room: else where they may go (free dW rows, or None)."""
        cfg, N, D, x, w, dw = self.cfg, self.N, self.D, self.x, self.w, self.dw
        has_perm, perm, skip = self.has_perm, self.perm, self.skip
        rows = v1 - v0
        do_dx = dx_acc is not None
        if not (do_dw or do_dx):
            return
        if self.torch_products:
            on_call = None
            if self.rec is not None:
                def on_call(d, rec=self.rec.products):
                    rec.append(ProductsCall(v0, v1, do_dw, do_dx, True, products.Fp32Reductions.active(), d.shape[1],
                                            d.stride(), N, 1, None))
            products._products_torch(dz, x, w[v0:v1], dw[v0:v1] if do_dw else None, dx_acc, accumulate,
                                     on_call=on_call)
            return
        n_out = cdiv(rows, cfg.block_m) * cdiv(D, cfg.block_d)
        n_dx_tiles = cdiv(N, cfg.block_m) * cdiv(D, cfg.dx_d) if do_dx else 0
        splits, k_per_split, part = 1, N, None
        room_bytes = self.ws.scratch if scratch_free else (0 if room is None else room.numel() * room.element_size())
        if do_dw and do_dx and scratch_free and cfg.balance:
            # A few dW tiles, each reducing over all N tokens, next to many short dx tiles (small D): the dW tiles
            # would set the kernel's time while most multiprocessors idle. Split their reduction (float32 partials
            # in the scratch, summed in a fixed order) as far as it shortens the estimated makespan.
            unit = cfg.block_n if skip else cfg.block_kg
            k_per_split = plans._balanced_split(N, n_out, n_dx_tiles, cdiv(rows, cfg.block_kg), self.sms, unit,
                                                cfg.block_kg, room_bytes // (4 * rows * D))
            splits = cdiv(N, k_per_split)
        elif do_dw and not do_dx and n_out < self.sms and room_bytes:
            # Too few dW tiles to fill the GPU: split the token reduction into float32 partials in the scratch (or,
            # when dz is there, in the room given), summed in a fixed order by a second kernel. Skipping, the
            # splits are made of whole token blocks.
            splits = max(1, min(self.sms // n_out, cdiv(N, 4 * cfg.block_kg), room_bytes // (4 * rows * D)))
            unit = cfg.block_n if skip else cfg.block_kg
            k_per_split = cdiv(cdiv(N, splits), unit) * unit
            splits = cdiv(N, k_per_split)
        if splits > 1:  # float32 partials [splits, rows, D], in the scratch or the room
            n = splits * rows * D
            part = (self.scratch_view((1, n), torch.float32) if scratch_free else room.view(torch.float32)[:n])
            part = part.view(splits, rows, D)
        scatter = do_dw and has_perm and part is None  # dW rows written straight to their classes' rows
        if not do_dw:
            dw_out = None
        elif part is not None:
            dw_out = part
        else:
            dw_out = dw if scatter else dw[v0:v1]
        n_dw_tiles = n_out * splits if do_dw else 0
        wv = w if has_perm else w[v0:v1]
        descs = (None,) * 4
        grad_tma = cfg.grad_tma and not has_perm and tma_ok(dz, x, wv)
        if grad_tma:
            kg, bm, bd = cfg.block_kg, cfg.block_m, cfg.block_d
            if self.x_desc is None:  # the same for every chunk (host time: a launch costs tens of microseconds)
                self.x_desc = configs.descriptor(x, [kg, bd])
            descs = (configs.descriptor(dz, [kg, bm]), configs.descriptor(dz, [bm, kg]), self.x_desc,
                     configs.descriptor(wv, [kg, cfg.dx_d]))
        dx_first = bool(skip and current_tuning().skip_dx_first)
        split = self.dx_split if (dx_first and do_dw and do_dx and dx_acc.is_contiguous()) else 1
        if split > 1 and self.dx_part is None:
            self.dx_part = torch.zeros((split - 1, N, D), **self.f32)
            if self.deal_by_chunk is None:
                # Dealt out only where the plan skips most pairs: there the few rows that need every tile set the
                # launch's time; with more of the pairs hot, the partials' traffic costs more than it saves
                # (docs/design/skipping.md, "What was measured").
                n_hot = self.sp.pairs[-1:].to(torch.int64)
                self.dx_deal = (n_hot * 100 <= self.sp.hot.numel() * current_tuning().skip_dx_deal_pct
                                ).to(torch.int32)
        if split > 1 and self.deal_by_chunk is not None:
            self.dx_deal = self.deal_by_chunk[v0]
        if self.rec is not None:
            self.rec.products.append(ProductsCall(v0, v1, do_dw, do_dx, False, products.Fp32Reductions.active(), rows,
                                                  dz.stride(), k_per_split, splits, storage_address(part)))
        launch(bk._dgrad_kernel, (n_dw_tiles + n_dx_tiles * split,),
            dz, x, wv, dw_out, dx_acc,
            None if perm is None else perm[v0:], *self.lists, self.dx_part if split > 1 else None,
            self.dx_deal if split > 1 else None, *descs,
            N, D, rows, n_dw_tiles, k_per_split, n_out, self.n_blocks, self.n_vtiles, v0 // cfg.block_v,
            cdiv(v1, cfg.block_v),
            dz.stride(0), x.stride(0), x.stride(1), w.stride(0), w.stride(1),
            dw_out.stride(-2) if do_dw else 0, dw_out.stride(-1) if do_dw else 0,
            part.stride(0) if part is not None else 0,
            dx_acc.stride(0) if do_dx else 0, dx_acc.stride(1) if do_dx else 0,
            DO_DW=do_dw, DO_DX=do_dx, DX_ACCUMULATE=accumulate,
            DW_EVEN_K=N % cfg.block_kg == 0 and k_per_split % cfg.block_kg == 0,
            DX_EVEN_K=rows % cfg.block_kg == 0, HAS_PERM=has_perm, DW_SCATTER=scatter, SKIP=skip,
            MAP_N=cfg.block_n, MAP_V=cfg.block_v,
            BLOCK_M=cfg.block_m, BLOCK_D=cfg.block_d, DX_BLOCK_D=cfg.dx_d, BLOCK_K=cfg.block_kg, GROUP=cfg.group,
            **self.dot,
            USE_TMA=grad_tma, DX_FIRST=dx_first, DX_SPLIT=split,
            num_warps=cfg.grad_warps, num_stages=cfg.grad_stages,
        )

        if part is not None:
            n = rows * D
            launch(bk._sum_splits_kernel, (cdiv(n, 1024),), part, dw if has_perm else dw[v0:v1],
                   None if perm is None else perm[v0:], n, splits, D, SCATTER=has_perm, BLOCK=1024,
                   UPCAST=self.dot["UPCAST"])
