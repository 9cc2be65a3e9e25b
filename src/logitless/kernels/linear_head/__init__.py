"""Triton kernels of a linear head z = x @ W.T (+ b), softcapped and temperature-scaled, never stored whole.

Launchers (no autograd here). Inputs are 2-D and already validated: x (N, D) and W (V, D) of one dtype (float32,
bfloat16 or float16), b (V,) or None, class weights (V,) float32 or None. Strides are free (no copies are made).

    forward_stats(x, w, b, target, class_w, *, softcap, inv_temp, want_smooth, want_entropy, perm=None,
                  tile_lse=None, stash=None, mu_rest=None)
        -> (m, logs, zt, sw, ent), each (N,) float32:
           m = max_j z_j;  logs = log sum_j exp(z_j - m) (lse = m + logs, kept apart so that z - m stays exact);
           zt = z_target;  sw = sum_j w_j (z_j - m) (w_j the class weights, or 1);  ent = entropy of softmax(z).
           zt / sw / ent are 0 when not asked for (target None, want_smooth / want_entropy False).
           tile_lse, a float16 buffer of tile_grid(x, w) = (N, tiles), receives each row's log sum_{j in t}
           exp(z_ij) per vocabulary tile t: the statistic that bounds what the backward may skip (skip_plan).
           mu_rest, a (2, N) float32 buffer (entropy and target), receives
           mu = sum_j p_j (z_j - m) and rest = sum_{j != target} exp(z_j - m), for the entropy's backward.
    backward(x, w, b, target, class_w, m, logs, A, B, C, E, *, softcap, inv_temp, need_dx, need_dw, need_db,
             perm=None, tile_lse=None, skip_threshold=0.0, workspace_bytes=None, stash=None, At=None, on_plan=None)
        -> (dx | None, dw | None, db | None), in the dtypes of x, W and b, for the per-row float32 coefficients of
           dL/dz_j = p_j (A + B (z_j - m)) - C [j == target] - E w_j  (B, C, E may be None: that term is absent);
           with At (and C), the target's column is p_t (At + B (z_t - m)) - C - E w_t instead.
           With tile_lse and skip_threshold > 0 (and no B or E term), the (token block, tile) pairs that skip_plan
           finds cold are skipped: neither recomputed nor multiplied.

`perm` (optional, (V,) int32 from vocab_order) is an order of the vocabulary: tile t holds the classes
perm[t BLOCK_V ...], so that frequent classes share tiles. The kernels read W rows, bias and class weights through it
and write each dW row back to its own row; nothing of size V x D is copied. Forward and backward take the same perm.

`target` is (N,) int64 of class indices *local to W*: a value outside [0, V) (ignore_index, or a class held by
another vocabulary shard, the caller passing target - shard_start) contributes no target logit (zt = 0) and no
one-hot term. No function here synchronises with the host; grids and workspaces depend on shapes only.

Forward: programs own (token block x vocabulary split) and run an online log-sum-exp over their split's vocabulary
tiles (long splits first, then short ones that fill the grid's last wave: _fwd_layout); a second small kernel merges
the splits. Backward (docs/kernels.md): the vocabulary is walked in chunks; per
chunk one kernel recomputes the logits and writes dL/dz for the chunk into a workspace, then the two gradient
products run: dW rows of the chunk (reduction over all tokens in float32, written once) and the float32 dx
accumulator (read-modify-write once per chunk), through cuBLAS for bfloat16 / float16 on CUDA (torch.mm, and
torch.addmm with a float32 output, under float32-only reductions), else through _dgrad_kernel. The workspaces are carved
out of the gradient buffers before they are written, so the extra memory stays O(N) plus a bounded scratch. Nothing
uses atomics; _dgrad_kernel reduces in a fixed order, and cuBLAS is bitwise reproducible run to run on one GPU
model (NVIDIA's documented guarantee), so every gradient is.

Sparsity (docs/kernels.md): on a peaked softmax most (token block x tile) pairs hold a probability mass far below the
input dtype's resolution. skip_plan groups rows that need few tiles together, bounds each row's skipped mass by its
budget (skip_threshold, or a budget from the row's largest logit) and never skips a tile that holds a row's target; the
dz kernel returns at once on a cold pair, and both products walk only the hot
pairs (a list per token block and per tile, built on the device).

Modules, in the order a call goes through them: launch (the two launchers; the backward's buffer aliasing rules are
in launch._Backward's docstring), plans (workspaces, chunks, stash and skip plans: shapes in, numbers out),
forward_layout and row_chunk_plan (the forward's vocabulary splits and the row-chunk plan, planned apart), configs
(tiles per architecture), forward_kernels and backward_kernels (the @triton.jit kernels), tiles (device functions
both share), products (the gradient products through cuBLAS), row_chunks (the row-chunk plan's launcher), records
(what a backward decided, for Tuning.debug_backwards). The knobs that tests and tools change are fields of
kernels.Tuning, read at each launch.
"""

from .configs import Config, config_for, fp32_config, gpu_config, hopper_config, interpreter_config, small_smem_config
from .hot_products import hot_products
from .launch import backward, forward_stats
from .plans import (
    SkipPlan,
    StashLayout,
    acc_forced,
    cold_pairs,
    dz_rows,
    scratch_ld,
    shared_budget,
    skip_plan,
    skip_supported,
    stash_layout,
    tile_grid,
    vocab_order,
)

# What the two-head backward (kernels/two_heads) shares with this one: the workspace plan of a backward, where its
# dz and float32 dx accumulator live (backward_plan), the vocabulary walk of its first and second passes, the dz
# views, and the gradient products; for its skipping, the plan from per-pair costs (cold_pairs), the budgets
# shared over the batch (shared_budget) and the products over the hot pairs (hot_products).
from .plans import _first_pass as first_pass_chunks
from .plans import _plan as backward_plan
from .plans import _second_pass as second_pass_chunks
from .plans import _workspace as workspace_plan
from .products import MM_OUT_DTYPE, Fp32Reductions, products_torch
from .records import BackwardRecord, DzLaunch, ProductsCall

__all__ = [
    "MM_OUT_DTYPE", "BackwardRecord", "Config", "DzLaunch", "Fp32Reductions", "ProductsCall", "SkipPlan", "StashLayout",
    "acc_forced", "backward", "backward_plan", "cold_pairs", "config_for", "dz_rows", "first_pass_chunks",
    "forward_stats", "fp32_config", "gpu_config", "hopper_config", "hot_products", "interpreter_config",
    "products_torch", "scratch_ld", "second_pass_chunks", "shared_budget", "skip_plan", "skip_supported",
    "small_smem_config", "stash_layout", "tile_grid", "vocab_order", "workspace_plan",
]
