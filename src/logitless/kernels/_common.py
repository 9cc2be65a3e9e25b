"""Constants and host helpers shared by the kernel modules."""

import triton.language as tl

# log2(e): exponentials are computed as exp2(x * LOG2E) (one multiply and the hardware's EX2).
LOG2E = tl.constexpr(1.4426950408889634)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host-side grid and plan arithmetic. triton.cdiv is a JIT-aware wrapper in recent Triton
    releases (~2 us a call on the host): the backward's planner makes a few hundred such calls per step."""
    return -(-a // b)
