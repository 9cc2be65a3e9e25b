"""The row-chunk plan of a reduced loss with a gradient wanted: how many rows of full bf16 logits a chunk holds
within the budget, and whether the weight gradient gets a float32 accumulator (row_chunks.py launches it). Shapes and
dtypes in, numbers out: no host sync."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._common import cdiv
from .._tuning import current_tuning

# The row-chunk plan's default budget: half of what the N x V logits take in bf16 (2 N V bytes, about
# torch.compile's peak for this loss), less room for the plan's other buffers (per-row statistics, the loss rows,
# cuBLAS's workspace: about 1 MiB measured), so that the whole peak stays at most half of torch.compile's. Without
# that room, chunks of exactly N / 2 rows peaked 1 MiB above the half (docs/design/row_chunks.md).
ROW_CHUNK_LOGITS_DIVISOR = 2
ROW_CHUNK_RESERVE = 4 << 20


class RowChunkPlan(NamedTuple):
    """The row-chunk plan of a reduced loss with a gradient wanted (row_chunks.forward_with_grads): chunks of `rows`
    rows (the last one shorter) hold their full row of bf16 logits, `ld` elements apart (V rounded up to 8: 16-byte
    rows for cuBLAS), become dL/dz in place and go into dx_c = dz W and dW += dz^T x_c; `f32_dw`: dW is accumulated
    in a float32 buffer of its own (one rounding), else in its bf16 output (one rounding per chunk)."""
    rows: int
    chunks: int
    ld: int
    f32_dw: bool


def row_chunk_budget(N: int, V: int) -> int:
    """The row-chunk plan's default budget in bytes: half of the bf16 N x V logits, less ROW_CHUNK_RESERVE."""
    return max(0, 2 * N * V // ROW_CHUNK_LOGITS_DIVISOR - ROW_CHUNK_RESERVE)


def row_chunk_plan(N: int, V: int, D: int, dtype: torch.dtype, need_dw: bool, workspace_bytes: int | None
                   ) -> RowChunkPlan | None:
    """The row-chunk plan for these shapes, or None where the column plan (forward statistics, backward by vocabulary
    chunks, the stash) is taken: Tuning.row_chunks False; not bfloat16; under Tuning.row_chunk_min_d features
    (policy; Tuning.row_chunks=True skips that test only); a budget (workspace_bytes, default row_chunk_budget) that
    holds no chunk of min(N, Tuning.row_chunk_min_rows) rows, or only more than Tuning.row_chunk_max_bf16 of them with
    a bf16 weight-gradient accumulator. A float32 accumulator (4 V D bytes of the budget) is taken where it leaves at
    most one chunk more than without it. Shapes and dtypes only: no host sync."""
    tune = current_tuning()
    if tune.row_chunks is False or dtype != torch.bfloat16 or N <= 0 or D <= 0 or V < 2:
        return None
    if tune.row_chunks is None and D < tune.row_chunk_min_d:
        return None
    budget = row_chunk_budget(N, V) if workspace_bytes is None else workspace_bytes
    if budget <= tune.scratch_bytes:  # the leanest plan
        return None
    ld = cdiv(V, 8) * 8
    min_rows = min(N, tune.row_chunk_min_rows)

    # Bytes per row of a chunk: its bf16 logits, and with an unaligned vocabulary its float32 dx rows
    # (row_chunks._split).
    per_row = 2 * ld + (4 * D if V % 8 else 0)

    def chunking(room):
        most = room // per_row
        if most < min_rows:
            return None
        k = cdiv(N, most)
        rows = cdiv(N, k)
        if cdiv(rows, 8) * 8 <= most:
            rows = cdiv(rows, 8) * 8
        return rows, cdiv(N, rows)

    bf16 = chunking(budget)
    f32 = chunking(budget - 4 * V * D) if need_dw and tune.row_chunk_f32_dw is not False else None
    if f32 is not None and (bf16 is None or f32[1] <= bf16[1] + 1):
        return RowChunkPlan(f32[0], f32[1], ld, True)
    if bf16 is None or (need_dw and bf16[1] > tune.row_chunk_max_bf16):
        return None
    return RowChunkPlan(bf16[0], bf16[1], ld, False)
