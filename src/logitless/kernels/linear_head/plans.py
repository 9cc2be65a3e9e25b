"""The linear head's plans: host arithmetic on shapes (and, for the skip plan, device ops) that decide how the
kernels walk the vocabulary and where the backward's workspaces live. Nothing here launches a Triton kernel or
synchronises with the host.

- _fwd_layout (forward_layout.py): the forward's vocabulary splits per token block;
- _workspace: how the backward spends a budget of workspace_bytes (scratch size, an own dx accumulator or not);
- _plan, _first_pass, _second_pass: where each vocabulary chunk's dL/dz and the float32 dx accumulator live, inside
  gradient buffers not written yet (the aliasing rules: see launch._Backward);
- stash_layout: where the forward may keep logits for the backward, inside the weight gradient's buffer;
- vocab_order: an order of the vocabulary that gathers frequent classes into the same tiles;
- skip_plan (skip_plans.py): which (token block, tile) pairs the backward may skip;
- row_chunk_plan (row_chunk_plan.py): the row-chunk plan, full rows of logits per chunk within a budget.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...loss_math import default_workspace_bytes
from .._common import cdiv, new_buffer
from .._tuning import current_tuning
from .configs import Config, config_for
from .forward_layout import _fwd_layout  # noqa: F401 - planned apart, read as plans._fwd_layout
from .products import _torch_products
from .row_chunk_plan import (  # noqa: F401 - planned apart, read as plans.<name>
    ROW_CHUNK_LOGITS_DIVISOR,
    RowChunkPlan,
    row_chunk_budget,
    row_chunk_plan,
)
from .skip_plans import (  # noqa: F401 - planned apart, read as plans.<name>
    _HOT_FRACTION,
    _WIDEN,
    SkipPlan,
    cold_pairs,
    row_budget,
    shared_budget,
    skip_cost,
    skip_plan,
)


def skip_supported(x: torch.Tensor) -> bool:
    """Whether this input's tiles allow skipping: the dz tiles are the forward's (token block x tile), and the
    gradient products' output tiles and reduction steps nest inside them."""
    c = config_for(x)
    return (c.dz_block_v == c.block_v and c.block_v % c.block_m == 0 and c.block_v % c.block_kg == 0
            and c.block_n % c.block_m == 0 and c.block_n % c.block_kg == 0)


def tile_grid(x: torch.Tensor, w: torch.Tensor) -> tuple[int, int]:
    """(tokens, vocabulary tiles) of the forward's tiles: the shape of forward_stats' float16 tile_lse record."""
    return x.shape[0], cdiv(w.shape[0], config_for(x).block_v)


def _segments(N: int, V: int, D: int, elt: int, cfg: Config, ws: _Workspace) -> list[int]:
    # Boundaries of the vocabulary ranges an order may permute within (the positions of a range hold the classes of
    # that range). With bf16/fp16 inputs the backward keeps its workspaces in rows of dW that are not written yet:
    # the dx accumulator in the rows after the first pass, and each second-pass chunk's dz in the rows after the
    # chunk. A chunk may therefore write back only its own rows.
    if elt == 4 or ws.own_acc or V * D < 2 * N * D + 8:
        return [0, V]
    _, dw_end = _acc_region(N, V, D, cfg, True)
    return [0, dw_end] + [v1 for _, v1, _ in _second_pass(N, V, D, elt, cfg, dw_end, True, ws.scratch)]


def vocab_order(counts: torch.Tensor, x: torch.Tensor, w: torch.Tensor, workspace_bytes: int | None = None
                ) -> torch.Tensor:
    """(V,) int32 order of the vocabulary for per-class counts (V,): the classes of each range of _segments by
    decreasing count (ties by index), so that frequent classes share tiles. Device ops only, no host sync. The
    backward that uses it must get the same workspace_bytes (the ranges depend on where its workspaces live)."""
    V = w.shape[0]
    N, D = x.shape
    by_count = torch.sort(counts.reshape(V), descending=True, stable=True).indices
    key = torch.argsort(by_count)  # rank of each class in the global order
    ws = _workspace(N, V, D, x.element_size(), workspace_bytes)
    for bound in _segments(N, V, D, x.element_size(), config_for(x), ws)[1:-1]:
        key[bound:] += V
    return torch.sort(key).indices.to(torch.int32)


class StashLayout(NamedTuple):
    """Where the forward keeps logits for the backward, inside the weight's gradient buffer (bf16/fp16, V x D)
    before the backward writes it. The logits of classes [0, classes) are stored class-major, (classes, N), as
    float16 z - o (<= 0), o being the running row max of the forward when it folded the tile (so the rounding error
    of a logit is at most 2^-11 (m - z), small exactly where p is not), and o as float32 per (tile, row). The
    backward walks these classes first, in chunks of `chunk`, computes each chunk's dL/dz from the stash in place
    (no recomputed product) and writes its dW rows below the chunk's own stash: `at` leaves room for that."""
    classes: int  # a multiple of the forward's tile width
    chunk: int
    at: int  # element offset in the buffer of the (classes, N) float16 block
    zo_at: int  # element offset (a multiple of 8) of the (classes / block_v, N) float32 maxima


def stash_layout(x: torch.Tensor, w: torch.Tensor, need_dx: bool, workspace_bytes: int | None
                 ) -> StashLayout | None:
    """The layout of the logits the forward can keep for a backward that computes dW (and dx when need_dx) with
    this workspace_bytes, or None (Tuning.stash_logits off, float32, a backward whose products are not cuBLAS's
    (they read dz column-major), tiles that differ between forward and dz kernel, too little room, or less than
    Tuning.stash_min_flop of recomputation saved). The room is the part of
    dW that the backward does not borrow for the float32 dx accumulator (_plan): (V - 2N) D elements of V D by
    default, all of them with an accumulator of its own. Shapes only: forward and backward compute the same."""
    N, D = x.shape
    V = w.shape[0]
    tune = current_tuning()
    if not (tune.stash_logits and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype and N > 0 and D > 0
            and _torch_products(x, w, False, False)):
        return None
    cfg = config_for(x)
    bv = cfg.block_v
    if cfg.dz_block_v != bv or N * bv >= 1 << 31:
        return None
    ws = _workspace(N, V, D, 2, workspace_bytes)
    end = V * D
    if need_dx and V * D >= 2 * N * D + 8 and not ws.own_acc:
        end = _acc_region(N, V, D, cfg, False)[0]  # the float32 dx accumulator's bytes start here
    rows = end // D // bv * bv  # dW rows of the first pass
    chunk = _round_chunk(cfg.wide, bv, True)
    per_class = max(N, D) + cdiv(2 * N, bv)
    classes = min(rows, max(0, end - chunk * min(N, D)) // per_class // bv * bv)
    while classes >= bv:
        c = min(chunk, classes)
        # A chunk's dW rows [v0, v1) must lie below its own stash (it is read while they are written) and every
        # later chunk's: at >= v1 D - v0 N for every chunk.
        at = max(0, max(min(v0 + c, classes) * D - v0 * N for v0 in range(0, classes, c)))
        at = cdiv(at, 8) * 8
        zo_at = cdiv(at + classes * N, 8) * 8
        if zo_at + 2 * N * (classes // bv) <= end:
            return StashLayout(classes, c, at, zo_at) if 2 * N * D * classes >= tune.stash_min_flop else None
        classes -= bv
    return None


def _stash_views(buf: torch.Tensor, lay: StashLayout, N: int, cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    # The float16 (classes, N) logits and the float32 (tiles, N) maxima inside the buffer.
    flat = buf.view(-1)
    zs = flat.view(torch.float16)[lay.at: lay.at + lay.classes * N].view(lay.classes, N)
    zo = flat[lay.zo_at: lay.zo_at + 2 * N * (lay.classes // cfg.block_v)].view(torch.float32)
    return zs, zo.view(lay.classes // cfg.block_v, N)


class _Plan(NamedTuple):
    dz_main: torch.Tensor | None  # (N, chunk) workspace of dL/dz for the first pass, or None: use the scratch
    chunk: int  # classes per chunk in the first pass (unless a wider one fits in dW, _first_pass)
    dx_acc: torch.Tensor | None  # (N, D) float32 accumulator of dx
    dw_end: int  # the first pass writes dW rows [0, dw_end); rows [dw_end, V) hold dx_acc until it is done
    cast_dx: bool  # dx_acc is not dx itself: copy it into dx at the end
    dw_free: int  # dW elements [0, dw_free) are not the dx accumulator's: a chunk's dz may borrow those after it


def _balanced_split(N: int, n_out: int, n_dx: int, dx_steps: int, sms: int, unit: int, block_k: int,
                    max_splits: int) -> int:
    """Tokens per split of the dW reduction for a gradient-products launch of n_out dW tiles (N tokens each) and
    n_dx dx tiles (dx_steps reduction steps each), one program per multiprocessor, dW tiles first. The estimated
    makespan, in reduction steps, is the longer of the dW tiles' waves and the even share of all the work; a split
    count is taken only when it shortens that by more than 3% (it costs a float32 partial per split and a sum)."""
    best_k, best = N, None
    for s in range(1, max(1, max_splits) + 1):
        k = cdiv(cdiv(N, s), unit) * unit
        n_dw = n_out * cdiv(N, k)
        steps = cdiv(k, block_k)
        span = max(cdiv(n_dw, sms) * steps, (n_dw * steps + n_dx * dx_steps) / sms + dx_steps)
        if best is None or span < 0.97 * best:
            best_k, best = k, span
    return best_k


def deal_by_makespan(pre_n: torch.Tensor, bounds: list[int], D: int, cfg: Config, sms: int) -> torch.Tensor:
    """(n_chunks,) int32 on the device (no sync): whether each skipping chunk of tiles [bounds[c], bounds[c + 1])
    deals its dx tiles' steps out (Tuning.skip_dx_deal "makespan"): where its longest dx tile (the token block with
    the most hot tiles) takes longer than the even share of the chunk's work on `sms` multiprocessors, the dW
    tiles' and dx tiles' steps. pre_n: the plan's (n_blocks, n_vtiles + 1) counts of hot tiles before each tile."""
    at = torch.tensor(bounds)
    if pre_n.is_cuda:
        # From pinned memory, asynchronously: a pageable copy would wait for the forward's kernels (a host sync).
        at = at.pin_memory().to(pre_n.device, non_blocking=True)
    hb = (pre_n[:, at[1:]] - pre_n[:, at[:-1]]).to(torch.int64)  # hot tiles of each token block in each chunk
    dx_steps = (cfg.block_v // cfg.block_kg) * cdiv(D, cfg.dx_d)  # a hot pair's dx steps, all column tiles
    dw_steps = (cfg.block_v // cfg.block_m) * (cfg.block_n // cfg.block_kg) * cdiv(D, cfg.block_d)  # and dW's
    longest = hb.amax(0) * (cfg.block_v // cfg.block_kg)
    return (longest * sms > hb.sum(0) * (dx_steps + dw_steps)).to(torch.int32)


def _round_chunk(cols: int, block: int, aligned: bool = False) -> int:
    # At most 2^16 classes per chunk keeps every in-chunk offset times a row stride within int32. Aligned (skipping,
    # or a vocabulary order): a multiple of the tile, so that chunks are made of whole tiles of the map.
    cols = min(cols, 1 << 16)
    if aligned:
        return max(block, cols // block * block)
    return cols // block * block if cols >= block else max(cols, 1)


def dz_cols(cols: int) -> int:
    """Row stride, in elements, of a chunk's dz of `cols` classes: a multiple of 8 (16-byte rows in bf16/fp16).
    cuBLAS's products leave their fast path at an unaligned row stride (products.py); the last chunk of an odd
    vocabulary has an odd width."""
    return cdiv(cols, 8) * 8


def scratch_ld(N: int, cols: int, elt: int, scratch: int) -> int:
    """dz's row stride in a scratch of `scratch` bytes: dz_cols(cols) where the padded rows fit in it, else cols (a
    chunk wider than the scratch has a buffer of its own size)."""
    ld = dz_cols(cols)
    return ld if N * ld * elt <= max(scratch, N * cols * elt) else cols


def dz_rows(flat: torch.Tensor, N: int, cols: int, ld: int | None = None) -> torch.Tensor:
    """The (N, cols) dz of a chunk at the start of the 1-D view `flat`, rows `ld` (default dz_cols(cols)) apart."""
    ld = dz_cols(cols) if ld is None else ld
    return flat[: N * ld].view(N, ld)[:, :cols]


def _scratch_cols(N: int, elt: int, block: int, aligned: bool = False, scratch: int | None = None,
                  wide: int | None = None) -> int:
    # Classes of dz in a scratch of `scratch` bytes (Tuning.scratch_bytes by default). Aligned, a chunk of one tile may
    # need more than that (N > scratch / (elt * block)). A caller's larger scratch widens the chunks up to `wide`
    # classes (cfg.wide), never below what the default scratch gives: wider ones measured slower
    # (docs/design/backward.md, "The scratch's chunk width").
    base = current_tuning().scratch_bytes
    scratch = base if scratch is None else scratch
    cols = max(1, scratch // max(1, N * elt))
    if wide is not None and scratch > base:
        cols = max(min(cols, wide), base // max(1, N * elt))
    return _round_chunk(cols, block, aligned)


class _Workspace(NamedTuple):
    scratch: int  # bytes the scratch buffer may take (allocated when first needed, as large as a chunk needs)
    own_acc: bool  # allocate the float32 dx accumulator (4 N D bytes) instead of borrowing dW rows


def acc_forced(x, need_dx: bool, need_dw: bool, N: int, V: int, D: int) -> bool:
    """Whether the float32 dx accumulator must have its own buffer whatever the budget: a half-precision dx with no
    dW rows to borrow (a frozen head, or V < 2N; _plan)."""
    return need_dx and x.dtype != torch.float32 and not (need_dw and V * D >= 2 * N * D + 8)


def default_budget(N: int, V: int, D: int, elt: int) -> int:
    """The policy's budget (loss_math.default_workspace_bytes) for this backward: with bf16 / fp16 inputs (elt < 4)
    its float32 dx accumulator counts, float32 inputs accumulate dx in their own output."""
    return default_workspace_bytes(N, V, 4 * N * D if elt != 4 else 0)


def _workspace(N: int, V: int, D: int, elt: int, workspace_bytes: int | None, acc_forced: bool = False
               ) -> _Workspace:
    """How the backward spends a budget of workspace_bytes (None: default_budget(N, V, D, elt); at most
    S = Tuning.scratch_bytes, e.g. 0: the leanest plan, S bytes of scratch). With bf16/fp16 inputs, a budget of at
    least 4 N D + S first buys the float32 dx accumulator its own buffer: the dW rows it would borrow no longer
    wait for a second pass that recomputes their logits (2N of the V classes). What is left (or all of it) enlarges
    the scratch: wider vocabulary chunks when the dW rows run out (up to cfg.wide classes, _scratch_cols) and room
    for split partials. The accumulator is allocated in any case when there is no dW to borrow (a frozen head, or
    V < 2N: acc_forced); it then counts against the budget, and the scratch gets the rest (S at least).
    Shapes only: the forward (stash_layout, vocab_order) and the backward compute the same."""
    budget = default_budget(N, V, D, elt) if workspace_bytes is None else workspace_bytes
    base = current_tuning().scratch_bytes
    if budget <= base:
        return _Workspace(base, False)
    acc = 4 * N * D
    if acc_forced:
        return _Workspace(max(base, budget - acc), True)
    own = current_tuning().own_accumulator
    if elt != 4 and budget >= acc + base and own is not False:
        return _Workspace(budget - acc, True)
    return _Workspace(budget, False)


def _acc_region(N: int, V: int, D: int, cfg: Config, aligned: bool) -> tuple[int, int]:
    # (element offset in dW of the float32 dx accumulator, 16-byte aligned; first dW row the first pass leaves out).
    start = (V * D - 2 * N * D) // 8 * 8
    end = start // D
    return start, (end // cfg.block_v * cfg.block_v if aligned else end)


def _second_pass(N: int, V: int, D: int, elt: int, cfg: Config, v0: int, aligned: bool, scratch: int | None = None
                 ) -> list:
    """(v0, v1, dz_in_dw) chunks of the second pass over dW rows [v0, V): dL/dz of a chunk goes into dW rows that are
    still unwritten (after the chunk) while they last (N c <= (V - v0 - c) D), then into the scratch (`scratch`
    bytes)."""
    scratch_cols = _scratch_cols(N, elt, cfg.block_v, aligned, scratch, cfg.wide)
    chunks = []
    while v0 < V:
        fits = _round_chunk((V - v0) * D // (N + D), cfg.block_v)
        if fits >= 8:  # an in-dW chunk's dz rows of dz_cols(fits) elements fit in the rows after it
            fits = fits // 8 * 8
        v1 = min(v0 + (fits if fits >= scratch_cols else scratch_cols), V)
        chunks.append((v0, v1, fits >= scratch_cols))
        v0 = v1
    return chunks


def _plan(x, dx, dw, N, V, D, cfg, aligned, ws: _Workspace | None = None) -> _Plan:
    """Where the backward's workspaces live. Only O(N) plus the scratch (Tuning.scratch_bytes by default) is
    allocated when both gradients are wanted in bfloat16/float16 and V >= 2N (the usual LM head) and ws does not
    ask for an own accumulator, or for float32 inputs."""
    ws = ws or _Workspace(current_tuning().scratch_bytes, False)
    scratch_cols = _scratch_cols(N, x.element_size(), cfg.block_v, aligned, ws.scratch, cfg.wide)
    if dx is None:  # weight (and/or bias) gradient only
        return _Plan(None, scratch_cols, None, V, False, V * D if dw is not None else 0)
    if x.dtype == torch.float32:  # dx is float32: accumulate in place
        return _Plan(None, scratch_cols, dx, V, False, V * D if dw is not None else 0)
    # dx (bf16/fp16) is not written until the end: it holds dL/dz of a chunk of D classes meanwhile.
    chunk = _round_chunk(D, cfg.block_v, aligned)
    dz_main = dx.view(-1)[: N * chunk].view(N, chunk) if scratch_cols <= chunk <= D else None
    if dz_main is None:
        chunk = scratch_cols
    if dw is not None and V * D >= 2 * N * D + 8 and not ws.own_acc:
        # The float32 dx accumulator takes the bytes of the last 2N rows of dW (16-byte aligned); those dW rows
        # are computed after dx is final.
        start, dw_end = _acc_region(N, V, D, cfg, aligned)
        dx_acc = dw.view(-1)[start: start + 2 * N * D].view(torch.float32).view(N, D)
        return _Plan(dz_main, chunk, dx_acc, dw_end, True, start)
    return _Plan(dz_main, chunk, new_buffer((N, D), device=x.device, dtype=torch.float32), V, True,
                 V * D if dw is not None else 0)


def _first_pass(N: int, V: int, D: int, cfg: Config, plan: _Plan, aligned: bool, wide_ok: bool,
                stash: StashLayout | None = None) -> list:
    """(v0, v1, dz_at, stashed) chunks of the first pass, in order; dz_at is the element offset in dW of the chunk's
    dz, or None (the plan's dz_main or the scratch, or, when stashed, the forward's stash in place). The stashed
    classes [0, stash.classes) go first. Each gradient-products launch re-reads and re-writes the float32 dx
    accumulator (8 N D bytes) and has few dW tiles when D is small, so wider chunks are cheaper: a chunk of up to
    cfg.wide classes puts its dz into dW rows that are not written yet and are not the accumulator's. The rows the
    first pass leaves to the second ([dw_end, V), dx only) go next, their dz at the start of dW's unwritten rows;
    then the rest of [0, dw_end) in order, each chunk's dz in the rows after it while v1 D + N c <= dw_free. A dz
    of c classes takes N dz_cols(c) elements."""
    def chunk(v0, v_end, fits):
        c = _round_chunk(min(fits, cfg.wide), cfg.block_v, aligned) if wide_ok else 0
        if 8 <= c < cfg.block_v:  # (under a tile: a multiple of 8 still, as dz's rows are dz_cols(c) apart)
            c = c // 8 * 8
        if plan.chunk < c <= fits and dz_cols(min(c, v_end - v0)) <= fits:
            return min(v0 + c, v_end), True
        return min(v0 + plan.chunk, v_end), False

    chunks = []
    s = 0
    if stash is not None:
        s = stash.classes
        chunks = [(v0, min(v0 + stash.chunk, s), None, True) for v0 in range(0, s, stash.chunk)]
    base = cdiv(s * D, 8) * 8  # dW's first unwritten element once the stashed chunks are done
    for lo, hi, left in ((plan.dw_end, V, True), (s, plan.dw_end, False)):
        v0 = lo
        while v0 < hi:
            if left:  # the rows left to the second pass: dz in dW from base
                v1, wide = chunk(v0, hi, max(0, min(plan.dw_free, plan.dw_end * D) - base) // N)
                chunks.append((v0, v1, base if wide else None, False))
            else:
                v1, wide = chunk(v0, hi, (plan.dw_free - v0 * D) // (N + D))
                chunks.append((v0, v1, v1 * D if wide else None, False))
            v0 = v1
    return chunks
