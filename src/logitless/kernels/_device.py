"""Triton device helpers shared by every kernel family: exponentials, the softcap's tanh, float32 -> output casts and
the tile product.

The softcap's tanh has two numerics, and each kernel family keeps its own (their results are bitwise those the
tests pin):
- tanh_slope, for the linear-head and two-head kernels: one exponential serves tanh and its slope 1 - tanh^2, with
  no libdevice call, so the GPU and the interpreter run the same arithmetic;
- tanh_libdevice with sech2, for cross_entropy on stored logits: libdevice's tanh on the GPU (the interpreter has no
  libdevice: a continued fraction there), and the slope from exp(-2|y|) only where tanh saturates.
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice

# log2(e): exponentials are computed as exp2(x * LOG2E) (one multiply and the hardware's EX2).
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def exp(x):
    # e^x as 2^(x log2 e): Triton's exp adds a range test and two multiplies per element to return subnormal
    # results (below 2^-126); exp2 flushes those to zero, which no float32 sum or gradient here can resolve anyway.
    return tl.exp2(x * LOG2E)


@triton.jit
def tanh_slope(y, FINE: tl.constexpr = False, HALF: tl.constexpr = False):
    """(tanh(y), 1 - tanh(y)^2). An odd Taylor series near 0 (truncation < 1e-9 relative for |y| < 0.3),
    (1 - t) / (1 + t) with t = e^-2|y| elsewhere (no cancellation there). The slope is 4 t / (1 + t)^2, from the
    exponential tanh already takes: no cancellation where tanh saturates (1 - th^2 there was 20-60x PyTorch's
    float32 error), a few ulp everywhere, and no second exponential.
    HALF (bf16 / fp16 heads, whose logits PyTorch rounds to 2^-9 or 2^-12): y - y^3 / 3 below 1/16 and
    (1 - t) / (1 + t) from there, both within 2e-6 relative, in a third fewer instructions per element, which the
    backward's recomputing dz tiles gain from (docs/math.md, "Temperature and softcap")."""
    a = tl.abs(y)
    t = tl.exp(-2.0 * a)
    big = (1.0 - t) / (1.0 + t)
    y2 = y * y
    if HALF:
        th = tl.where(a < 0.0625, y * (1.0 - 0.3333333333333333 * y2), tl.where(y < 0, -big, big))
    else:
        p = y * (1.0 + y2 * (-0.3333333333333333 + y2 * (0.13333333333333333 + y2 * (
            -0.05396825396825397 + y2 * (0.021869488536155203 + y2 * -0.008863235529902197)))))
        th = tl.where(a < 0.3, p, tl.where(y < 0, -big, big))
    slope = 4.0 * t / ((1.0 + t) * (1.0 + t))
    if FINE:
        # Near 0, 1 - th^2 (no cancellation while th^2 < 0.09): 0.25 ulp on average where 4 t / (1 + t)^2 is 0.7,
        # which a d_input that cancels 34-fold (V = 2, two nearly equal head rows) made 3 x PyTorch's error. For
        # float32 dz only: a bf16 / fp16 dz rounds far coarser, and in the 128 x 256 dz tiles this form made the
        # kernel much slower (docs/math.md, "Temperature and softcap").
        slope = tl.where(a < 0.3, 1.0 - th * th, slope)
    return th, slope


@triton.jit
def tanh_libdevice(y, INTERPRET: tl.constexpr):
    """tanh(y): libdevice's on the GPU. The interpreter has no libdevice: Lambert's continued fraction below 0.6 (no
    cancellation near 0), the exponential form above; within 3 ulp of float64."""
    if not INTERPRET:
        return libdevice.tanh(y)
    else:
        a = tl.abs(y)
        y2 = y * y
        cf = 13.0 + y2 / 15.0
        cf = 11.0 + y2 / cf
        cf = 9.0 + y2 / cf
        cf = 7.0 + y2 / cf
        cf = 5.0 + y2 / cf
        cf = 3.0 + y2 / cf
        small = y / (1.0 + y2 / cf)
        e = tl.exp(-2.0 * a)
        big = (1.0 - e) / (1.0 + e)
        big = tl.where(y < 0, -big, big)
        return tl.where(a < 0.6, small, big)


@triton.jit
def sech2(y, th):
    """1 - tanh(y)^2 given th = tanh(y), to a few ulp: from exp(-2|y|) where tanh saturates, where 1 - th^2 cancels
    (a saturated softcap's gradient was 60x PyTorch's float32 error)."""
    a = tl.abs(y)
    e = tl.exp2(a * (-2.0 * LOG2E))
    big = 4.0 * e / ((1.0 + e) * (1.0 + e))
    return tl.where(a < 0.6, (1.0 - th) * (1.0 + th), big)


@triton.jit
def cast(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """float32 -> dtype, rounding to nearest even. The interpreter truncates float32 -> bfloat16, so there the
    rounding is done on the bits; a NaN keeps the plain conversion (adding the rounding bias to a NaN's bits can
    carry into the sign and give -0)."""
    if INTERPRET and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return tl.where(x == x, bits.to(tl.uint16).to(tl.bfloat16, bitcast=True), x.to(tl.bfloat16))
    else:
        return x.to(dtype)


@triton.jit
def mma(a, b, acc, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b in float32. UPCAST (the interpreter, bfloat16): its bfloat16 dot is wrong in some Triton versions;
    bf16 products are exact in float32."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)
