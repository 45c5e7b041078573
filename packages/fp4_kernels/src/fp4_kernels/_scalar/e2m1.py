"""The e2m1 element codec: round-to-nearest-even and stochastic rounding on the float pipe
(saturating multiply-adds whose sums hold the code in their low bits), the integer encoder it
replaced (kept as a second derivation for the tests) and the branch-free decoder."""

from __future__ import annotations

import numpy as np

from .._numba_abi import py_f32_as_u32 as f32_as_u32, py_u32_as_f32 as u32_as_f32
from ..formats import e2m1
from .arith import F32_HALF, F32_TWO, U32, add_rm, max_f32, sat_fma, sat_mul

FUNCTIONS = (
    "e2m1_value", "e2m1_code_f", "e2m1_value_f", "e2m1_encode", "e2m1_encode_int",
    "e2m1_sr_sum", "e2m1_sr_code_f", "sr_random_f32", "e2m1_encode_sr", "e2m1_decode",
)  # fmt: skip

E2M1_MAX = np.float32(e2m1.E2M1_MAX)  # largest e2m1 magnitude
INV_E2M1_MAX = e2m1.INV_E2M1_MAX  # TE writes `1.0f / 6.0f`: the float32 rounding of 1/6
F32_RINT_MAGIC = np.float32(1.5 * 2**23)  # x + this - this rounds x (|x| < 2^22) to an integer
# twice the e2m1 magnitudes (0, 1, 2, 3, 4, 6, 8, 12) as nibbles, magnitude code 0 lowest
E2M1_TWICE_TABLE = np.uint32(0xC8643210)
# the encoder's constants (see e2m1_code_f): 2^23 + k holds the integer k in its low bits
F32_TWO_POW_23 = np.float32(2.0**23)
F32_FOUR = np.float32(4.0)
F32_MINUS_ONE = np.float32(-1.0)
F32_TWO_POW_24 = np.float32(2.0**24)
F32_MINUS_5_TWO_POW_24 = np.float32(-5.0 * 2.0**24)
E2M1_CODE_BIAS = 0x4B000000  # the bits of 2^23: bits(e2m1_code_f(a)) - this is the code
# e2m1_value_f's constants: 2^23 + k -> k / 2, k - 2 and 2 k - 8 by one exact add each
F32_TWO_POW_22 = np.float32(2.0**22)
F32_TWO_POW_23_PLUS_2 = np.float32(2.0**23 + 2.0)
F32_TWO_POW_24_PLUS_8 = np.float32(2.0**24 + 8.0)
# the stochastic encoder's constants (see e2m1_sr_sum)
F32_MINUS_TWO = np.float32(-2.0)
SR_BASE_BITS = 0x43000000  # the bits of 128.0: OR-ing 16 random bits r gives 128 + r 2^-16
F32_SR_TO_CODE = np.float32(2.0**23 - 128.0)  # floor(V) - 128 + 2^23 by one add toward -inf


def e2m1_value(c):
    """3-bit magnitude code -> float32 value (0, .5, 1, 1.5, 2, 3, 4, 6).

    Branch-free: twice the value is an integer 0,1,2,3,4,6,8,12, read from a nibble table
    (lanes of a warp decode different codes, so branches would diverge).
    """
    k = U32(U32(E2M1_TWICE_TABLE >> U32(U32(c & 7) << 2)) & 15)
    return np.float32(np.int32(k)) * F32_HALF


def e2m1_code_f(a):
    """Round-to-nearest-even e2m1 magnitude code of ``a`` = |y| >= 0, saturating at 6, on the
    float pipe: returns the float 2^23 + code, so bits(result) - E2M1_CODE_BIAS is the code.

    Five saturating multiply-adds and one add; every product is by a power of two (exact),
    each add rounds once to an integer (ulp 1 at 2^23):
    u = sat(a/2) and 2^23 + 4u round 2 min(a, 2) to an integer (codes 0-4, ties to even:
    0.25 -> 0, 0.75 -> 1.0, 1.75 -> 2.0); w = sat(a/2 - 1) adds 2 w = clamp(a - 2, 0, 2)
    and the sum rounds once more (2.5 -> 2, 3.5 -> 4, codes 4-6); t = sat(2^24 (a - 5)) is
    1 exactly when a > 5 (the 5 tie stays at 4), giving code 7 for (5, inf].  NaN gives 0
    (callers mask non-finite blocks first).  The test suite checks it against the integer
    RNE encoder and the numpy oracle on every non-negative float32.
    """
    u = sat_mul(a, F32_HALF)
    big = u * F32_FOUR + F32_TWO_POW_23
    w = sat_fma(a, F32_HALF, F32_MINUS_ONE)
    big = w * F32_TWO + big
    t = sat_fma(a, F32_TWO_POW_24, F32_MINUS_5_TWO_POW_24)
    return big + t


def e2m1_value_f(c):
    """The e2m1 magnitude (0, .5, 1, 1.5, 2, 3, 4, 6) of the float ``c`` = 2^23 + code that
    ``e2m1_code_f`` and ``e2m1_sr_code_f`` return, on the float pipe (the fused fake-quant
    kernel rounds an element to its e2m1 value without packing codes).

    For the code k in 0..7 the magnitude is max(k/2, k - 2, 2k - 8): k/2 up to code 4 (2.0),
    k - 2 for codes 5, 6 (3, 4), 2k - 8 for code 7 (6).  Each term is one add to a product by
    a power of two: c * 2^-1 and c * 2 are exact, so are the sums (k/2, k - 2, 2k - 8 are small
    multiples of 1/2), fused into an FMA or not.  Equal to ``e2m1_value`` for every code (the
    tests check all eight)."""
    half = c * F32_HALF - F32_TWO_POW_22
    lin = c - F32_TWO_POW_23_PLUS_2
    top = c * F32_TWO - F32_TWO_POW_24_PLUS_8
    # max_f32: one FMNMX each on the GPU (the three terms are numbers, never NaN)
    return max_f32(max_f32(half, lin), top)


def e2m1_encode(y):
    """float32 -> 4-bit e2m1 code, RNE, saturating; the sign bit follows y's (so -0 -> 0x8).

    NaN never reaches this (non-finite blocks are masked first); it would give code 0.
    """
    u = f32_as_u32(y)
    a = u32_as_f32(U32(u & 0x7FFFFFFF))
    m = U32(f32_as_u32(e2m1_code_f(a)) - E2M1_CODE_BIAS)
    return U32(U32(U32(u >> 28) & 8) | m)


def e2m1_encode_int(y):
    """float32 -> 4-bit e2m1 code, RNE, saturating, on the integer pipe (the encoder the
    float-pipe ``e2m1_encode`` replaced; kept as a second derivation for the tests).

    NaN never reaches this (non-finite blocks are masked first); it would give code 7.
    On the bits of |y| (integer order is float order for non-negative floats):
    |y| >= 1: round to 1 mantissa bit (add 0x1FFFFF plus the kept lsb, drop 22 bits: half to
    even, carries into the exponent), rebase the exponent, saturate at code 7;
    |y| < 1: twice |y| rounded to an integer (0.25 ties to 0, 0.75 to 1.0).
    """
    u = f32_as_u32(y)
    a = U32(u & 0x7FFFFFFF)
    r = U32(U32(U32(a + 0x1FFFFF) + U32(U32(a >> 22) & 1)) >> 22)
    big = U32(r - 252)
    if big > 7:
        big = U32(7)
    # |y| < 1: the code is RNE(2|y|) in {0, 1, 2}.  Adding 1.5 * 2^23 rounds to an integer
    # (ties to even) and leaves it in the low mantissa bits.  numba-cuda contracts the
    # product and sum into one FMA; 2|y| is exact, so fused and unfused round alike.
    t = u32_as_f32(a) * F32_TWO + F32_RINT_MAGIC
    small = U32(f32_as_u32(t) - 0x4B400000)
    m = big if a >= 0x3F800000 else small
    return U32(U32(U32(u >> 28) & 8) | m)


def e2m1_sr_sum(a, big_r):
    """Stochastic rounding of ``a`` = |y| >= 0 onto the e2m1 grid, saturating at 6, on the
    float pipe; ``big_r`` = 128 + r 2^-16 for the element's 16 random bits r (the float
    with bits 0x43000000 | r, exact).  Returns V in [128, 136) with floor(V) - 128 the
    code: ``e2m1_sr_code_f`` takes the floor by one addition, the quantize kernel reads it
    from the bits (they are 0x43000000 + code 2^16 + fraction < 2^16: byte 2 is the code).

    u = sat(a/2), w = sat(a/2 - 1) and t = sat(a/2 - 2) are fractional one at a time (u for
    a < 2, w on [2, 4), t on [4, 6)); below its range each is 0, above it 1 (all three are 1
    from 6 up and 0 for NaN, which never gets here).  V = ((R + 4u) + 2w) + t: every value
    lies in [128, 256), where float32's spacing is 2^-16, the inactive terms add exactly
    (0 or whole numbers) and the active one rounds once to nearest.  So floor(V) - 128 is
    floor(2a + r') on [0, 2), 4 + floor(a - 2 + r') on [2, 4), 6 + floor((a - 4)/2 + r') on
    [4, 6) and 7 from 6 up, with r' = r 2^-16 and the fraction rounded to 16 bits: the code
    below a plus one with probability p = (a - lo) / gap, rounded to 16 bits.  4u and 2w
    are exact products, so contracting u * 4 + V into an FMA (numba-cuda does; the CPU
    target does not) rounds the same: one rounding of the same exact sum.  The tests check
    it against the numpy oracle for every r at edge values of a, and on random float32
    patterns.
    """
    u = sat_mul(a, F32_HALF)
    w = sat_fma(a, F32_HALF, F32_MINUS_ONE)
    t = sat_fma(a, F32_HALF, F32_MINUS_TWO)
    v = u * F32_FOUR + big_r
    v = w * F32_TWO + v
    return v + t


def e2m1_sr_code_f(a, big_r):
    """``e2m1_sr_sum`` floored: the float 2^23 + code, as ``e2m1_code_f``, by one addition
    toward -inf of 2^23 - 128 (spacing 1 at 2^23)."""
    return add_rm(e2m1_sr_sum(a, big_r), F32_SR_TO_CODE)


def sr_random_f32(r16):
    """128 + r16 2^-16 (exact) for 16 random bits ``r16``: the float with bits
    0x43000000 | r16 (one PRMT on the GPU, which takes r16 straight from its Philox word)."""
    return u32_as_f32(U32(U32(U32(r16) & 0xFFFF) | SR_BASE_BITS))


def e2m1_encode_sr(y, r16):
    """float32 -> 4-bit e2m1 code, stochastic rounding with the 16 random bits ``r16``
    (0 for NaN, which never reaches it: non-finite blocks are masked first)."""
    u = f32_as_u32(y)
    c = e2m1_sr_code_f(u32_as_f32(U32(u & 0x7FFFFFFF)), sr_random_f32(r16))
    m = U32(U32(U32(u >> 28) & 8) | U32(f32_as_u32(c) - E2M1_CODE_BIAS))
    if U32(u & 0x7FFFFFFF) > 0x7F800000:
        m = U32(0)  # a select, not a branch: lanes never diverge here
    return m


def e2m1_decode(code):
    """4-bit e2m1 code -> float32 (sign bit 3), branch-free."""
    v = e2m1_value(code)
    return u32_as_f32(U32(f32_as_u32(v) | U32(U32(U32(code) & 8) << 28)))
