"""The kernels' tuning knobs in one explicit object, read by the launchers at each launch.

    from logitless import kernels
    with kernels.tuning(scratch_bytes=0, stash_logits=False):
        loss = logitless.linear_cross_entropy(x, w, t)
        loss.backward()

`Tuning` holds the defaults; `tuning(**overrides)` makes a copy with some fields changed the current one until the
block ends (blocks nest); `current_tuning()` is what the launchers read. Tests, tools and A/B runs use it; a user
has no need to.

The current value is process-wide, not per thread or per context variable: autograd runs the backward of CUDA
tensors on a thread of its own, which would not see a context variable set around `loss.backward()`, and the
forward and backward must agree on the layouts that depend on these knobs (the stash, the vocabulary order).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any


@dataclasses.dataclass(frozen=True)
class Tuning:
    # Launches of a specialization seen before go straight to the compiled kernel, past Triton's argument binding
    # (kernels/_launch.py); off, every launch goes through Triton's JIT.
    fast_launch: bool = True
    # --- the linear-head kernels (kernels/linear_head)
    # Tiles for every launch instead of the device's own (a linear_head Config); None: the device's.
    linear_config: Any = None
    # Bytes of the backward's one scratch buffer in the leanest plan (workspace_bytes <= scratch_bytes, e.g. 0):
    # dL/dz of a vocabulary chunk when it cannot borrow a gradient buffer, and split-K partials. Tests shrink it to
    # force many chunks. A larger workspace budget buys a larger scratch and, past 4 N D bytes more, a float32 dx
    # accumulator of its own.
    scratch_bytes: int = 8 << 20
    # Whether a budget past 4 N D bytes buys the bf16/fp16 backward's float32 dx accumulator a buffer of its own
    # (True) or leaves it in the weight gradient's last rows and gives the whole budget to the scratch (False);
    # None: the policy's choice (plans._workspace). A/B runs of the policy use it.
    own_accumulator: bool | None = None
    # The backward's two gradient products of a chunk (dW rows = dz^T x, dx_acc += dz W[chunk]) through cuBLAS
    # (torch.mm / torch.addmm with a float32 output for dx) instead of _dgrad_kernel. None: for bfloat16 / float16
    # on CUDA, without skipping or a vocabulary order, where torch has matmuls with a float32 output (>= 2.8). True
    # runs the same calls on the CPU (there in float32). Faster at every benchmark shape
    # (docs/design/gradient_products.md).
    torch_products: bool | None = None
    # The forward keeps the logits of the first classes for the backward where the weight's gradient buffer has
    # room for them before it is written (stash_layout): their recomputation is skipped.
    stash_logits: bool = True
    # ... when it saves at least this many FLOP of recomputation (2 N D per stashed class): below, the stash's fixed
    # costs (host time, the forward's stashing loop) outweigh it (docs/design/stash.md).
    stash_min_flop: float = 5e11
    # The forward writes the stash through a tensor descriptor (the copy engine) where its operands use them and
    # the stash's rows are 16-byte aligned (N % 8 == 0); else with pointer stores.
    stash_tma: bool = True
    # Whether the forward's kernels may contract a float32 multiply and add into one fused multiply-add. Off, every
    # operation rounds as written, so a row's values depend on the source alone and not on which optional outputs a
    # launch computes: with contraction on, summing the entropy backward's target mass (only when a gradient is
    # wanted) moved the entropy by an ulp on a GPU, and a pass without gradients (an RL reference or old-policy
    # pass) must give bit for bit the values of the training pass. Off costs nothing measurable
    # (docs/design/forward.md, "Grad-mode invariance").
    fwd_fp_fusion: bool = False
    # Below this many features, a half-precision backward runs on float32 copies of x and W: there the products
    # cost next to nothing beside the dz pass, and dL/dz rounded to bf16 / fp16 before them is the whole error,
    # which a sum over a few nearly cancelling terms amplifies (D = 1 and 3: 2-4 x PyTorch's own error, found by
    # fuzzing). The copies take (N + 2 V) D float32 numbers.
    narrow_d: int = 8
    # The row-chunk plan of a reduced linear_cross_entropy with a gradient wanted (plans.row_chunk_plan: the
    # gradients in the forward, over chunks of rows that hold their full row of bf16 logits, three products):
    # None: where the policy predicts it faster (bf16, D >= row_chunk_min_d, within the budget); True: wherever the
    # budget and the precision caps allow it (tests, A/B runs); False: never (the column plan, with its stash).
    row_chunks: bool | None = None
    # ... the policy's width from which it pays: it saves the recomputing product (2 N V D FLOP, less the stash's
    # share) and costs memory passes over the bf16 logits (about 5 x 2 N V bytes), so it wins from a width on
    # (docs/design/row_chunks.md).
    row_chunk_min_d: int = 1024
    # ... rows per chunk at least (all of them when fewer): smaller products leave cuBLAS's fast path.
    row_chunk_min_rows: int = 1024
    # ... chunks at most when the weight's gradient is accumulated in bf16 (one rounding per chunk; the bound:
    # docs/design/row_chunks.md); more need a float32 accumulator or fall back to the column plan.
    row_chunk_max_bf16: int = 4
    # ... whether dW may be accumulated in float32 (None: where the budget allows it, row_chunk_plan; False: bf16
    # always, within row_chunk_max_bf16 chunks: the tests of that bound).
    row_chunk_f32_dw: bool | None = None
    # Every output and workspace starts as NaN, so an element that is never written shows up (tests).
    debug_poison: bool = False
    # A list: each backward appends the SkipPlan it uses (tests and tools read them).
    debug_plans: list | None = None
    # A list: each backward of a linear head or of the two-head losses appends a linear_head.BackwardRecord of what
    # it decided (workspace, plan, chunks, dz launches, gradient products); None: none is built (tests, tools).
    debug_backwards: list | None = None
    # Skipping, the backward groups rows by how many tiles they need (plans.skip_plan) so that a token block's rows
    # share their cold tiles: on Gemma 3 270M's head it triples the pairs a budget of 2^-12 can skip (docs/kernels.md).
    # False keeps the rows' own order (tests that place hot tiles by row).
    skip_group_rows: bool = True
    # The skip plan built by three Triton launches (plan_kernels) instead of about a hundred PyTorch ops over (N, T)
    # arrays: the same plan in less kernel and host time (docs/design/skipping.md, "The plan in three launches").
    skip_plan_kernels: bool = True
    # ... and its dz launches as one program per multiprocessor walking the chunk's hot pairs alone (the plan's
    # per-tile lists) instead of one program per pair, most of which return at once (docs/design/skipping.md).
    skip_dz_hot_list: bool = True
    # Classes per first-pass chunk of a skipping backward, at least the dense plans' (Config.wide); None: the
    # configuration's Config.skip_wide. Wider chunks launch less often and take a larger dz scratch (N x chunk in
    # the input dtype): docs/design/skipping.md, "Where the skipping backward's memory goes".
    skip_wide: int | None = None
    # Skipping, the gradient products' launch runs its dx tiles first, those of the last token blocks (the rows that
    # need the most tiles) before all others (backward_kernels._dgrad_kernel).
    skip_dx_first: bool = True
    # ... and deals each dx tile's reduction out to up to this many programs (float32 partials of dx, N x D each,
    # within the memory budget, added in a fixed order): the rows grouped last need every tile, and their few dx
    # tiles, each a reduction over the whole chunk, are the launch's critical path.
    skip_dx_split: int = 4
    # ... where at most this percentage of the plan's pairs is hot (decided on the device, no host sync).
    skip_dx_deal_pct: float = 15.0
    # ... or, with "makespan", per chunk where its longest dx tile takes longer than the even share of the chunk's
    # steps (plans.deal_by_makespan): a count of the real head's plans predicts it at least as fast as either fixed
    # choice; on a GPU the products gained a few percent and the step nothing (docs/design/skipping.md).
    skip_dx_deal: str = "share"
    # skip_threshold="auto"'s per-row budget times this (1: a quarter of each gradient row's rounding error in the
    # dtype). A/B runs weigh a larger budget's errors against its time (the bench's logitless-triton-skip2).
    skip_budget_scale: float = 1.0
    # skip_threshold="auto" (the default) skips for a head while its plans skip at least this share of the
    # (token block, tile) pairs, and runs the dense plans otherwise (skip_gate). The break-even share is lower where
    # the dense alternative is the column plan than where it is the row-chunk plan (three cuBLAS products, bf16 at
    # D >= row_chunk_min_d): skip_min_share_row_chunks (docs/design/skipping.md). 0 skips wherever a plan is
    # possible, from a head's first call (tests, A/B runs).
    skip_min_share: float = 0.35
    skip_min_share_row_chunks: float = 0.5
    # ... and for a head whose one product (2 N D V FLOP) is under skip_small_flop: there the skipping step's fixed
    # costs (its plan, the record, its launches) weigh a third of the dense backward or more, and skipping lost at
    # every share measured (docs/design/skipping.md, "Small heads").
    skip_min_share_small: float = 0.5
    skip_small_flop: float = 2e12
    # ... a head found dense probes again after this many calls, the interval doubling after each dense finding up
    # to skip_probe_max.
    skip_probe_every: int = 8
    skip_probe_max: int = 1024

    # --- the two-head kernels (kernels/two_heads)
    # Tiles for every launch instead of the device's own (a linear_head Config); None: the device's.
    two_heads_config: Any = None
    # The dz kernel's tiles (block_n, block_v, block_k, warps, stages) on CUDA when they differ from the forward's;
    # None: the forward's, with dz_block_v classes.
    two_heads_dz: tuple[int, int, int, int, int] | None = None
    # The dz kernel writes its tiles through a tensor descriptor (the copy engine) where the operands use them.
    two_heads_dz_store_tma: bool = True
    # Those dz launches as a persistent grid with one flattened loop (as the single head's Config.dz_persistent)
    two_heads_dz_persistent: bool = True
    # Both heads' products in one reduction loop where they have one width and use descriptors.
    two_heads_fused_k: bool = False

    # --- cross_entropy on stored logits (kernels/cross_entropy)
    # Columns per tile and tiles per program of the two-launch path (pass 1 reads tiles * tile columns of a row), and
    # the narrowest tile (kernels/cross_entropy/configs.py, default_config).
    ce_tile_elems: int = 8192
    ce_tiles_per_program: int = 4
    ce_min_block_v: int = 1024
    # In place, rows longer than one tile: program i reads work unit i (tiles of a row block) for the statistics and
    # writes the gradient of the unit this many bytes of logits earlier (at least a whole row block), by then
    # published and still in L2: a longer lag lets the second read miss, a second launch reads twice from DRAM
    # (docs/cross_entropy.md, "The Triton kernels"). None: a second launch (two reads from DRAM).
    ce_inplace_lag_bytes: int | None = 8 << 20
    # ... and at most this many seconds of the device's peak DRAM bandwidth: the lag is best at about the same time
    # of traffic on each GPU, not the same bytes: a GPU with less bandwidth than the one it was tuned on gets a
    # shorter lag (docs/cross_entropy.md, "Measured").
    ce_inplace_lag_seconds: float = 1.8e-6
    ce_inplace_tiles_per_program: int = 2  # 4 was slower in place (docs/cross_entropy.md)
    # The statistics alone (no gradient in the launch): tiles of ce_stats_tile_elems, ce_stats_tiles per program, in
    # a loop software-pipelined ce_stats_stages deep (docs/cross_entropy.md).
    ce_stats_tile_elems: int = 4096
    ce_stats_tiles: int = 8
    ce_stats_stages: int = 3

    def __post_init__(self):
        if self.skip_dx_deal not in ("share", "makespan"):
            raise ValueError(f"Tuning.skip_dx_deal must be 'share' or 'makespan', not {self.skip_dx_deal!r}")


DEFAULT = Tuning()
_current = DEFAULT
_lock = threading.Lock()


def current_tuning() -> Tuning:
    """The Tuning the launchers use now."""
    return _current


@contextlib.contextmanager
def tuning(base: Tuning | None = None, /, **overrides):
    """Within the block, the current Tuning is `base` (default: the current one) with `overrides` replaced; the
    previous one is back afterwards. Unknown names raise TypeError."""
    global _current
    new = dataclasses.replace(_current if base is None else base, **overrides)
    with _lock:
        previous, _current = _current, new
    try:
        yield new
    finally:
        with _lock:
            _current = previous
