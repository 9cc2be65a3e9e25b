"""What a backward decided, for those who watch it (Tuning.debug_backwards: tests and tools): its workspace, its
plan, the chunks of its two passes, and each dz launch and gradient-products call it made. The launchers build a
record only when that field is a list; otherwise nothing here runs. A record holds numbers and addresses, never a
tensor: a reference to a gradient held here would make autograd copy it instead of handing it over."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple


class DzLaunch(NamedTuple):
    """One launch of a dz kernel: dL/dz of classes [v0, v1)."""

    v0: int
    v1: int
    programs: int  # the grid's size
    block_v: int  # classes per tile
    stashed: bool  # from the forward's stash of logits (no recomputed product)
    persistent: bool  # a persistent grid: a program walks several tiles
    store_tma: bool  # dz stored through a tensor descriptor
    skip: bool  # cold pairs of a skip plan left out


class ProductsCall(NamedTuple):
    """One call of a chunk's gradient products (dW rows = dz^T x, the float32 dx accumulator += dz W[chunk]): a
    launch of the products kernel, or one call of torch's matmuls (a chunk of a class count past a multiple of 8
    makes two: the aligned classes, then the rest)."""

    v0: int  # the chunk's classes [v0, v1)
    v1: int
    dw: bool  # dW rows computed
    dx: bool  # dx accumulated
    torch: bool  # through torch's matmuls (cuBLAS on CUDA), else the Triton products kernel
    fp32_reductions: bool  # cuBLAS's float32-only reductions on (products.Fp32Reductions) during the call
    cols: int  # classes of the dz multiplied
    dz_stride: tuple[int, int]  # its strides
    k_per_split: int  # tokens per split of dW's reduction (N: not split)
    splits: int  # float32 partials of dW summed after the launch (1: none)
    partials: int | None  # address of the storage that holds those partials (the scratch's, or dW's), or None


@dataclasses.dataclass
class BackwardRecord:
    """One backward's decisions, in the order it made them. head: "linear_head" or "two_heads". Addresses are
    those of tensors' storages (untyped_storage().data_ptr()), to compare with the gradients returned. A
    half-precision linear head narrower than Tuning.narrow_d runs on float32 copies: the record is that backward's."""

    head: str
    workspace: tuple[int, bool]  # (scratch bytes, own dx accumulator): plans._workspace
    skip: bool  # a skip plan's cold pairs are left out
    stash: tuple | None  # the StashLayout of the forward's logits that the backward used up, or None
    chunk: int  # classes per first-pass chunk (unless a wider one fits in dW)
    dw_end: int  # the first pass writes dW rows [0, dw_end), the second pass the rest
    dz_main: bool  # the first pass's dz lives in dx's bytes
    dx_acc: int | None  # address of the float32 dx accumulator's storage (None: no dx)
    first_pass: list = dataclasses.field(default_factory=list)  # (v0, v1, dz_at, stashed) per chunk
    second_pass: list = dataclasses.field(default_factory=list)  # (v0, v1, dz_in_dw) per chunk
    dz: list[DzLaunch] = dataclasses.field(default_factory=list)
    products: list[ProductsCall] = dataclasses.field(default_factory=list)


def storage_address(t) -> int | None:
    """The address of t's storage, or None for None."""
    return None if t is None else t.untyped_storage().data_ptr()
