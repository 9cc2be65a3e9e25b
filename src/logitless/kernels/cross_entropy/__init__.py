"""Triton kernels for cross-entropy on logits that already exist, and their launchers.

The logits are cut into tiles of BLOCK_N rows x BLOCK_V columns. In the forward pass each program reads TILES tiles
along its rows with an online reduction (row max m, sum of exp(z - m), and for label smoothing sum w (z - m) and
sum w); a row longer than TILES * BLOCK_V is spread over K programs, so small batches still fill the GPU. The last of
a row block's K programs to finish (an atomic counter; no statistics program waits for another) merges the partial
statistics into the loss and the log-sum-exp, so there is no second launch.

With ``inplace_backward`` the gradient d(loss)/d(logits) is written over the logits. A row that fits one tile keeps
its exponentials in registers and is written back by the same program (WRITE_GRAD): one read and one write. A longer
row needs its final log-sum-exp before any of its gradient, so it is read twice: in the same launch (LAGGED), each
program also writes the gradient of the work unit `lag` units behind its own, whose row block is published by then
(it spins on the row block's counter otherwise) and whose logits are still in L2, so DRAM sees about one read and
one write; or by a second launch (_ce_bwd_kernel with out = logits), two reads from DRAM and one write.

Notation per row (docs/cross_entropy.md): lse = M + log S, p_j = exp(z_j - lse), and
  dL/dz_j = p_j A - C [j == t] - E w_j,   C = g (1 - eps) w_t,  A = C + g (eps / V) W + 2 g z_loss lse,  E = g eps / V
with g the upstream gradient (0 on ignored rows), w the class weights (1 without), W their sum; softcap multiplies
by 1 - tanh^2. The target's column is computed as p_t X + (p_t - 1) (C + E w_t), X = A - C - E w_t (_row_coef).
The loss is computed as (M - z_t) + log S, not lse - z_t, so huge logits lose no precision.

Modules: launch (the launchers), configs (tiles and the in-place lag), kernels (the @triton.jit kernels).
"""

from .configs import Config, default_config, inplace_lag_bytes, num_sms
from .launch import cross_entropy_bwd, cross_entropy_fwd, scale_rows_

__all__ = ["Config", "cross_entropy_bwd", "cross_entropy_fwd", "default_config", "inplace_lag_bytes", "num_sms",
           "scale_rows_"]
