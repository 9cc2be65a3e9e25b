"""Constants shared by the kernel modules."""

import triton.language as tl

# log2(e): exponentials are computed as exp2(x * LOG2E) (one multiply and the hardware's EX2).
LOG2E = tl.constexpr(1.4426950408889634)
