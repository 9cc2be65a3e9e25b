"""Triton kernels of two linear heads over one vocabulary (distillation losses, soft cross-entropy), never stored.

Launchers (no autograd here). Inputs are validated: the student's xs (N, Ds), ws (V, Ds), bs (V,) or None and the
teacher's xt (N, Dt), wt (V, Dt), bt or None, all of one dtype (float32, bfloat16 or float16). Logits of both
heads are z = softcap(x W^T + b) * inv_temp; `kind` is one of loss_math.KINDS.

    forward_stats(xs, ws, bs, xt, wt, bt, *, kind, beta, softcap, inv_temp)
        -> (m_s, logs_s, m_t, logs_t, ea, da, kt, ks, zr, dl, dref), each (N,) float32 or None (loss_math.RowStats):
           pass 1,
           one kernel, folds both heads' tiles into online log-sum-exps and the weighting head a's sums
           sum_j e_a (z_a - m_a) and sum_j e_a ((z_a - m_a) - (z_b - zr)), zr = z_b at a's argmax (moved as m_a
           grows); for the JSD, pass 2 (the same
           kernel, MODE 2) sums p_t (log p_t - log M) and p_s (log p_s - log M) with the final log-sum-exps.
    backward(xs, ws, bs, xt, wt, bt, m_s, logs_s, m_t, logs_t, R, g, *, kind, beta, softcap, inv_temp, need_dx,
             need_dw, need_db, workspace_bytes=None)
        -> (dx_s | None, dW_s | None, db_s | None) for the per-row upstream gradient g (float32, 0 at ignored rows);
           m_t and R as loss_math.row_loss gives them (for the reverse KL, the teacher's reference and da).

Forward: programs own (token block x vocabulary split); each computes both heads' logit tiles with the linear-head
kernels' logits_tile (tensor descriptors where possible) and the splits' partials are merged with a few PyTorch
ops on (splits, N) floats. Backward: the linear-head backward's machinery with another dz kernel: the vocabulary is
walked in chunks, _two_dz_kernel recomputes both heads' tiles and writes the student's dL/dz of the chunk, and the
two gradient products (dW_s rows = dz^T x_s, dx_s += dz W_s[chunk]) run through linear_head's products_torch
(cuBLAS for bfloat16 / float16 on CUDA, float32 reductions). The workspaces follow linear_head's plans
(workspace_plan, backward_plan, first_pass_chunks, second_pass_chunks): dz and the float32 dx accumulator live in
rows of dW_s not written yet, so the extra memory is the same O(N) plus scratch as the single-head backward's.
Nothing here synchronises with the host.

Skipping (docs/math.md, "Skipping cold tiles of two heads"): with `tiles`, the forward records per (row, tile) both
heads' tile log-sum-exps and the teacher's smallest logit; pair_costs turns them into bounds on what leaving a pair
out costs each kind's dL/dz, skip_plan picks the cold (token block, tile) pairs within each row's budget (on
linear_head's cold_pairs), and backward(sp=...) neither recomputes nor multiplies them (linear_head's
hot_products).

Modules, as linear_head's: launch (the two launchers), configs (tiles per architecture), kernels (the
@triton.jit kernels), plans (the skip plan).
"""

from ..linear_head.configs import fp32_config
from .configs import arch_config, config, gpu_config, interpreter_config
from .launch import backward, forward_stats
from .plans import pair_costs, skip_plan, skip_supported, tile_count

__all__ = ["arch_config", "backward", "config", "forward_stats", "fp32_config", "gpu_config", "interpreter_config",
           "pair_costs", "skip_plan", "skip_supported", "tile_count"]
