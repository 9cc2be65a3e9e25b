"""Triton kernels and their launchers. No autograd and no reductions live here.

- linear_head: a linear head z = x W^T (+ b) never stored whole: per-row statistics forward, one generic
  coefficient backward (linear_cross_entropy, linear_log_probs, linear_logsumexp);
- two_heads: two heads over one vocabulary (the distillation losses);
- cross_entropy: cross-entropy on logits that already exist, with an in-place gradient.

The tuning knobs those launchers read (tiles, workspaces, the stash, debug switches) are one object, Tuning; tests
and tools change them for a block with `kernels.tuning(**overrides)`; `narrow` is the rule, read from it, by which a
half-precision backward of a few features keeps dL/dz in float32; `new_buffer` allocates a launcher's output.
Importing this package loads no kernel and does not import Triton (its subpackages do).
"""

from ._common import narrow, new_buffer
from ._tuning import Tuning, current_tuning, tuning

__all__ = ["Tuning", "current_tuning", "narrow", "new_buffer", "tuning"]
