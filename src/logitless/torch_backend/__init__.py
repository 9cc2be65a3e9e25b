"""The chunked PyTorch backend: the pure-PyTorch twin of every op, never N x V.

The backend wherever Triton cannot run: CPU tensors, float64, backend="torch". Tokens are processed in chunks of
rows and the vocabulary in chunks of columns (a block sized by the memory policy, loss_math.default_workspace_bytes),
with an online log-sum-exp in the forward and a backward that recomputes each block's logits and turns them into
dL/dz in place. All math is float32 whatever the input dtype (float64 for float64 inputs). The contracts (the
statistics, the coefficients, the two heads' row statistics) are loss_math's.

Modules, by job:
- blocks: block sizes, chunking, a block's logits and their transform (softcap, temperature) and its chain rule;
- linear_head: the head op's statistics (stats, head_forward) and its generic backward (head_backward);
- fused: linear_cross_entropy's training step with a reduced loss (fused_rows, fused_plan, fused_cross_entropy):
  chunks of rows over the full vocabulary whose gradients are computed in the forward, three products instead of
  four (within logitless.later_grad's context, part of the weight's gradient made by a later node);
- cross_entropy: cross_entropy on given logits (the same statistics, its own backward);
- one_class: the closed forms of a one-class head (its logits, and the public ops' outputs on them);
- two_heads: the two-head losses' row statistics and the student's backward (logitless.distill).

The names other layers call are exported here: the head op calls this backend as it calls the Triton backend
(triton_backend.py), through stats, fused_plan and fused_cross_entropy.
"""

from .fused import fused_cross_entropy, fused_plan, fused_rows
from .linear_head import stats
from .one_class import one_class_cross_entropy, one_class_log_probs, one_class_logits, one_class_logsumexp

__all__ = ["fused_cross_entropy", "fused_plan", "fused_rows", "one_class_cross_entropy", "one_class_log_probs",
           "one_class_logits", "one_class_logsumexp", "stats"]
