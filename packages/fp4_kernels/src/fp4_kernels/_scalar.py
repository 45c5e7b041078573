"""Scalar codec arithmetic shared by the CUDA kernels and the CPU path.

Every function here is written once and compiled twice: by ``numba.cuda.jit(device=True)`` for
the GPU kernels (and run as Python by numba's CUDA simulator) and by ``numba.njit`` for the CPU
path.  ``build_scalar_ops`` takes the target's ``jit`` decorator and its float32 <-> uint32
bit-cast helpers and returns the compiled set, so the GPU and the CPU execute the same operation
order and give bit-identical codes and scales.

Rules that keep the targets bit-identical (numba types a Python float literal as float64 and a
Python int literal as int64):

* every floating constant is a module-level ``np.float32`` so arithmetic stays in float32;
* 64-bit unsigned arithmetic (Philox) uses ``np.uint64`` constants only, never mixed with int64
  (numba would promote uint64 op int64 to float64);
* WIDEN: integer arguments that may come straight from a uint8/uint16 array are widened to
  int64 first.  numba does that implicitly (small ints promote to intp), but the simulator runs
  this code on numpy scalars, where ``np.uint8(0x7E) << 23`` wraps in uint8;
* no expression has the shape ``a * b + c`` on floats where the rounding matters: numba-cuda
  contracts that into an FMA, numpy does not.  Where a product feeds a sum the code is split,
  or the sum or the product is exact (a product by a power of two: fused or not, the sum then
  rounds once, the same), and a comment says which.

The plain-numpy oracle in ``fp4_kernels.formats`` is written independently of this module.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from .formats import e2m1, e4m3, nvfp4

# float32 constants (see the module docstring for why they are np.float32).
F32_ZERO = np.float32(0.0)
F32_ONE = np.float32(1.0)
F32_HALF = np.float32(0.5)
F32_RINT_MAGIC = np.float32(1.5 * 2**23)  # x + this - this rounds x (|x| < 2^22) to an integer
F32_TWO = np.float32(2.0)
FP32_MAX = np.float32(np.finfo(np.float32).max)
F32_INF = np.float32(np.inf)
F32_NAN = np.float32(np.nan)
# the formats' constants, from their specification modules (defined there once)
E2M1_MAX = np.float32(e2m1.E2M1_MAX)  # largest e2m1 magnitude
E4M3_MAX = np.float32(e4m3.E4M3_MAX)  # largest finite e4m3 (OCP "fn") magnitude
NVFP4_AMAX_TO_SCALE = nvfp4.NVFP4_GLOBAL_AMAX_TARGET  # 2688: e4m3 max times e2m1 max
INV_E2M1_MAX = e2m1.INV_E2M1_MAX  # TE writes `1.0f / 6.0f`: the float32 rounding of 1/6
TWO_POW_M9 = np.float32(2.0**-9)  # e4m3 subnormal quantum
TWO_POW_M24_F16 = np.float32(2.0**-24)  # fp16 subnormal quantum
# the e2m1 encoder's constants (see e2m1_code_f): 2^23 + k holds the integer k in its low bits
F32_TWO_POW_23 = np.float32(2.0**23)
F32_FOUR = np.float32(4.0)
F32_MINUS_ONE = np.float32(-1.0)
F32_TWO_POW_24 = np.float32(2.0**24)
F32_MINUS_5_TWO_POW_24 = np.float32(-5.0 * 2.0**24)
E2M1_CODE_BIAS = 0x4B000000  # the bits of 2^23: bits(e2m1_code_f(a)) - this is the code
# the stochastic encoder's constants (see e2m1_sr_sum)
F32_MINUS_TWO = np.float32(-2.0)
SR_BASE_BITS = 0x43000000  # the bits of 128.0: OR-ing 16 random bits r gives 128 + r 2^-16
F32_SR_TO_CODE = np.float32(2.0**23 - 128.0)  # floor(V) - 128 + 2^23 by one add toward -inf

# Philox4x32-10 (Salmon et al., SC'11; Random123's philox4x32_10).
PHILOX_M0 = np.uint64(0xD2511F53)
PHILOX_M1 = np.uint64(0xCD9E8D57)
PHILOX_W0 = np.uint64(0x9E3779B9)
PHILOX_W1 = np.uint64(0xBB67AE85)
_U64_MASK32 = np.uint64(0xFFFFFFFF)
PHILOX_M0_32 = np.uint32(0xD2511F53)
PHILOX_M1_32 = np.uint32(0xCD9E8D57)
PHILOX_W0_32 = np.uint32(0x9E3779B9)  # the key increments as uint32 (wrapping adds)
PHILOX_W1_32 = np.uint32(0xBB67AE85)
_U64_32 = np.uint64(32)

# element kinds of the arrays the codecs read and write (the kernels' `kind` argument)
KIND_F32 = 0
KIND_BF16 = 1
KIND_F16 = 2

E4M3_NAN_CODE = 0x7F
# twice the e2m1 magnitudes (0, 1, 2, 3, 4, 6, 8, 12) as nibbles, magnitude code 0 lowest
E2M1_TWICE_TABLE = np.uint32(0xC8643210)
U32 = np.uint32  # wrapping a result in U32 lets LLVM narrow numba's 64-bit integer ops to 32
E8M0_NAN_CODE = 0xFF
BF16_NAN_BITS = 0x7FC0  # the quiet NaN FP4Quant stores as the scale of a non-finite group


def build_scalar_ops(
    jit,
    f32_as_u32,
    u32_as_f32,
    e4m3_satfinite=None,
    sat_mul=None,
    sat_fma=None,
    add_rm=None,
    mul_wide_u32=None,
):
    """Compile the scalar codec functions for one target.

    ``jit`` is ``numba.cuda.jit(device=True)`` or ``numba.njit(error_model="numpy")``;
    ``f32_as_u32`` / ``u32_as_f32`` reinterpret bits (no conversion) on that target.
    ``e4m3_satfinite``, where given, is the target's hardware float32 -> e4m3 conversion
    (round to nearest even, saturating: what TE's static_cast<fp8e4m3> compiles to) and replaces
    the integer encoder for block scales; the tests check the two agree on every input.
    ``sat_mul`` / ``sat_fma``, where given, are the target's saturating float32 multiply and
    fused multiply-add (``mul.rn.sat.f32`` / ``fma.rn.sat.f32``: one instruction each, result
    clamped to [0, 1], NaN to 0); elsewhere the same function is written out.  ``add_rm`` is
    the float32 addition rounding toward -inf (``add.rm.f32``); ``mul_wide_u32(a, b)`` the
    64-bit product of two uint32 as (low, high) words (one ``mul.wide.u32``).
    """

    # ---------------------------------------------------------------- saturating arithmetic

    @jit
    def sat(v):
        """v clamped to [0, 1]; NaN -> 0 (the PTX ``.sat`` modifier)."""
        if v > F32_ONE:
            return F32_ONE
        if v > F32_ZERO:
            return v
        return F32_ZERO

    if sat_mul is None:

        @jit
        def sat_mul(a, b):
            return sat(a * b)

    if add_rm is None:

        @jit
        def add_rm(a, b):
            # the float64 sum is exact wherever it is used (operands within 2^29 of each other
            # in magnitude); rounding it to float32 toward -inf is the nearest float32, moved
            # one step down when that lies above the sum
            s = np.float64(a) + np.float64(b)
            r = np.float32(s)
            if s == 0.0 and U32(f32_as_u32(a) | f32_as_u32(b)) != 0:
                r = u32_as_f32(U32(0x80000000))  # an exact zero sum is -0 unless both are +0
            elif np.float64(r) > s:
                u = f32_as_u32(r)
                if r > F32_ZERO:
                    r = u32_as_f32(U32(u - U32(1)))
                elif r < F32_ZERO:
                    r = u32_as_f32(U32(u + U32(1)))
                else:
                    r = u32_as_f32(U32(0x80000001))  # below +-0: the negative subnormal
            return r

    if mul_wide_u32 is None:

        @jit
        def mul_wide_u32(a, b):
            p = np.uint64(a) * np.uint64(b)  # < 2^64: both factors are below 2^32
            return U32(p & _U64_MASK32), U32(p >> _U64_32)

    if sat_fma is None:

        @jit
        def sat_fma(a, b, c):
            # every use multiplies by a power of two, so a * b is exact and the add is the one
            # rounding: fused (as numba-cuda contracts it) or not, the result is the same
            return sat(a * b + c)

    # ---------------------------------------------------------------- float formats in and out

    @jit
    def bf16_to_f32(h):
        """bfloat16 bits (low 16 bits of ``h``) -> float32, exact."""
        h = np.int64(h)  # see WIDEN
        return u32_as_f32(np.uint32((h & 0xFFFF) << 16))

    @jit
    def f32_to_bf16(f):
        """float32 -> bfloat16 bits, round to nearest even (NaN stays a quiet NaN)."""
        u = f32_as_u32(f)
        if U32(u & 0x7FFFFFFF) > 0x7F800000:
            return U32(U32(U32(u >> 16) | 0x40) & 0xFFFF)
        # Adding 0x7FFF plus the kept lsb rounds half to even; the carry may ripple into the
        # exponent (and to inf), which is the correct rounding.  No NaN here, so no overflow.
        return U32(U32(u + U32(0x7FFF + U32(U32(u >> 16) & 1))) >> 16)

    @jit
    def f16_to_f32(h):
        """IEEE binary16 bits -> float32, exact (subnormals, inf and NaN included)."""
        h = np.int64(h)  # see WIDEN
        sign = (h & 0x8000) << 16
        e = (h >> 10) & 0x1F
        m = h & 0x3FF
        if e == 0x1F:
            return u32_as_f32(np.uint32(sign | 0x7F800000 | (m << 13)))
        if e == 0:
            # subnormal (or zero): m * 2^-24 is exact in float32
            mag = np.float32(m) * TWO_POW_M24_F16
            if sign != 0:
                return -mag
            return mag
        return u32_as_f32(np.uint32(sign | ((e + 112) << 23) | (m << 13)))

    @jit
    def f32_to_f16(f):
        """float32 -> IEEE binary16 bits, round to nearest even, overflow to inf."""
        u = f32_as_u32(f)
        sign = (u >> 16) & 0x8000
        a = u & 0x7FFFFFFF
        if a > 0x7F800000:
            return sign | 0x7E00
        if a >= 0x477FF000:  # 65520 and above round to inf (65504 has an odd mantissa)
            return sign | 0x7C00
        if a >= 0x38800000:  # normal binary16 (>= 2^-14)
            h = (((a >> 23) - 112) << 10) | ((a >> 13) & 0x3FF)
            rem = a & 0x1FFF
            if rem > 0x1000 or (rem == 0x1000 and (h & 1) == 1):
                h += 1  # a carry into the exponent is the correct rounding
            return sign | h
        if a <= 0x33000000:  # <= 2^-25: rounds to zero (exactly 2^-25 ties to even zero)
            return sign
        # subnormal binary16: quantum 2^-24
        e = a >> 23
        m = (a & 0x7FFFFF) | 0x800000
        s = 126 - e
        q = m >> s
        rem = m & ((1 << s) - 1)
        half = 1 << (s - 1)
        if rem > half or (rem == half and (q & 1) == 1):
            q += 1
        return sign | q

    # ---------------------------------------------------------------- e2m1

    @jit
    def e2m1_value(c):
        """3-bit magnitude code -> float32 value (0, .5, 1, 1.5, 2, 3, 4, 6).

        Branch-free: twice the value is an integer 0,1,2,3,4,6,8,12, read from a nibble table
        (lanes of a warp decode different codes, so branches would diverge).
        """
        k = U32(U32(E2M1_TWICE_TABLE >> U32(U32(c & 7) << 2)) & 15)
        return np.float32(np.int32(k)) * F32_HALF

    @jit
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

    @jit
    def e2m1_encode(y):
        """float32 -> 4-bit e2m1 code, RNE, saturating; the sign bit follows y's (so -0 -> 0x8).

        NaN never reaches this (non-finite blocks are masked first); it would give code 0.
        """
        u = f32_as_u32(y)
        a = u32_as_f32(U32(u & 0x7FFFFFFF))
        m = U32(f32_as_u32(e2m1_code_f(a)) - E2M1_CODE_BIAS)
        return U32(U32(U32(u >> 28) & 8) | m)

    @jit
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

    @jit
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

    @jit
    def e2m1_sr_code_f(a, big_r):
        """``e2m1_sr_sum`` floored: the float 2^23 + code, as ``e2m1_code_f``, by one addition
        toward -inf of 2^23 - 128 (spacing 1 at 2^23)."""
        return add_rm(e2m1_sr_sum(a, big_r), F32_SR_TO_CODE)

    @jit
    def sr_random_f32(r16):
        """128 + r16 2^-16 (exact) for 16 random bits ``r16``: the float with bits
        0x43000000 | r16 (one PRMT on the GPU, which takes r16 straight from its Philox word)."""
        return u32_as_f32(U32(U32(U32(r16) & 0xFFFF) | SR_BASE_BITS))

    @jit
    def e2m1_encode_sr(y, r16):
        """float32 -> 4-bit e2m1 code, stochastic rounding with the 16 random bits ``r16``
        (0 for NaN, which never reaches it: non-finite blocks are masked first)."""
        u = f32_as_u32(y)
        c = e2m1_sr_code_f(u32_as_f32(U32(u & 0x7FFFFFFF)), sr_random_f32(r16))
        m = U32(U32(U32(u >> 28) & 8) | U32(f32_as_u32(c) - E2M1_CODE_BIAS))
        if U32(u & 0x7FFFFFFF) > 0x7F800000:
            m = U32(0)  # a select, not a branch: lanes never diverge here
        return m

    @jit
    def e2m1_decode(code):
        """4-bit e2m1 code -> float32 (sign bit 3), branch-free."""
        v = e2m1_value(code)
        return u32_as_f32(U32(f32_as_u32(v) | U32(U32(U32(code) & 8) << 28)))

    # ---------------------------------------------------------------- e4m3 (block scales)

    @jit
    def e4m3_encode_positive(v):
        """float32 v >= 0 (inf allowed) -> e4m3 code: RNE, saturating at 448, subnormals kept.

        All integer arithmetic on the float32 bits, so no float rounding can differ by target.
        """
        if v >= E4M3_MAX:
            return 0x7E
        u = f32_as_u32(v)
        e = np.int32(u >> 23) - 127
        if e < -10:  # v < 2^-10: below half of the smallest subnormal 2^-9, rounds to 0
            return 0
        m = (u & 0x7FFFFF) | 0x800000  # 24-bit significand, value m * 2^(e-23)
        if e >= -6:
            s = 20  # normal e4m3 keeps 3 mantissa bits: drop 20 of 23
        else:
            s = 14 - e  # subnormal e4m3: quantum 2^-9, drop down to it (21..24 bits)
        q = m >> s
        rem = m & ((1 << s) - 1)
        half = 1 << (s - 1)
        if rem > half or (rem == half and (q & 1) == 1):
            q += 1
        if e >= -6:
            # q in [8, 16]; q == 16 carries into the exponent, which the addition does for us
            return ((e + 7) << 3) + (q - 8)
        return q  # q in [0, 8]; 8 is the smallest normal, again by plain addition

    if e4m3_satfinite is not None:
        e4m3_encode_positive = e4m3_satfinite  # noqa: F811 (the hardware cast, same results)

    @jit
    def e4m3_decode(code):
        """e4m3 code (sign ignored: scales are non-negative) -> float32; 0x7F -> NaN.

        Branch-free on the float32 bits: a normal code is exponent + 120 and mantissa << 20;
        a subnormal m * 2^-9 is built exactly as a float product.
        """
        c = U32(U32(code) & 0x7F)
        e = U32(c >> 3)
        m = U32(c & 7)
        normal = u32_as_f32(U32(U32(U32(e + 120) << 23) | U32(m << 20)))
        sub = np.float32(np.int32(m)) * TWO_POW_M9
        v = normal if e != 0 else sub
        return v if c != 0x7F else F32_NAN

    # ---------------------------------------------------------------- e8m0 (MX block scales)

    @jit
    def mx_shared_exponent(amax):
        """OCP MX v1.0: floor(log2(amax)) - emax(e2m1)=2, exact from the bits, clamped to e8m0.

        Any float32 subnormal or zero amax lies below 2^-126, so its exponent clamps to -127.
        """
        u = f32_as_u32(amax)
        f = np.int32((u >> 23) & 0xFF)
        if f == 0:
            return -127
        e = f - 127 - 2
        if e < -127:
            return -127
        return e  # finite amax < 2^128 gives e <= 125, inside e8m0's range

    @jit
    def pow2_f32(e):
        """2^e as float32 for e in [-126, 127] (normal range), built from the bits."""
        return u32_as_f32(np.uint32((e + 127) << 23))

    @jit
    def e8m0_decode(code):
        """e8m0 code -> 2^(code-127) as float32 (code 0 is the subnormal 2^-127); 0xFF -> NaN."""
        code = np.int64(code)  # see WIDEN
        if code == 0xFF:
            return u32_as_f32(np.uint32(0x7FC00000))
        if code == 0:
            return u32_as_f32(np.uint32(0x00400000))
        return u32_as_f32(np.uint32(code << 23))

    # ---------------------------------------------------------------- NVFP4 tensor scale

    @jit
    def nvfp4_encode_scale(amax):
        """Tensor encode scale S = min(2688 / amax, FLT_MAX); 1 when amax or S is 0 (as TE)."""
        if amax == F32_ZERO:
            return F32_ONE
        s = NVFP4_AMAX_TO_SCALE / amax
        if s > FP32_MAX:
            s = FP32_MAX
        if s == F32_ZERO:
            return F32_ONE
        return s

    # ---------------------------------------------------------------- block scales

    @jit
    def nvfp4_block_scale(bmax_bits, s6, s_dec):
        """Block amax (bits of max |x|; >= 0x7F800000: the block holds NaN or Inf) ->
        (e4m3 scale code, decoded scale s, element multiplier), in Transformer Engine's order:
        code = e4m3(amax_b * (S * fp32(1/6))) with s6 = S * fp32(1/6) given; the multiplier
        is 1 / (s * (1/S)), the product first, clamped to FLT_MAX (s == 0 gives FLT_MAX).
        A non-finite block gets the NaN code, s = NaN (it decodes to NaN) and multiplier 0."""
        if bmax_bits >= 0x7F800000:
            return U32(E4M3_NAN_CODE), F32_NAN, F32_ZERO
        scode = U32(e4m3_encode_positive(u32_as_f32(U32(bmax_bits)) * s6))
        s = e4m3_decode(scode)
        mult = F32_ONE / (s * s_dec)
        if mult > FP32_MAX:
            mult = FP32_MAX
        return scode, s, mult

    @jit
    def mxfp4_block_scale(bmax_bits):
        """Block amax bits -> (e8m0 scale code, decoded scale 2^e, element multiplier 2^-e) per
        OCP MX v1.0 (e = floor(log2 amax) - 2, clamped; exact scaling); a non-finite block gets
        the NaN code 0xFF, scale NaN and multiplier 0."""
        if bmax_bits >= 0x7F800000:
            return U32(E8M0_NAN_CODE), F32_NAN, F32_ZERO
        e = mx_shared_exponent(u32_as_f32(U32(bmax_bits)))
        scode = U32(e + 127)
        # -e in [-125, 127]: a normal float32, so the multiplier scales exactly
        return scode, e8m0_decode(scode), pow2_f32(-e)

    # ---------------------------------------------------------------- FP4Quant group scale

    @jit
    def fp4quant_scale(amax_bits):
        """Group amax (bits of max |t|; >= 0x7F800000 means non-finite) -> (bf16 scale bits,
        float32 encode multiplier).  s = amax * fp32(1/6) rounded *up* to bfloat16, so that
        amax * (1/s) does not exceed 6 by more than the multiplier's own rounding; the
        multiplier is fmin(1 / s, FLT_MAX) (s == 0 gives FLT_MAX: zeros stay zeros)."""
        if amax_bits >= 0x7F800000:
            return U32(BF16_NAN_BITS), F32_ZERO
        s32 = u32_as_f32(U32(amax_bits)) * INV_E2M1_MAX
        # adding 0xFFFF carries into the kept bits unless the dropped ones are all zero:
        # rounding toward +inf of a non-negative finite float (no overflow below 2^128 / 6)
        sb = U32(U32(f32_as_u32(s32) + 0xFFFF) >> 16)
        if sb == 0:  # an all-zero group: 1/0 would be inf, clamped to FLT_MAX
            return sb, FP32_MAX
        mult = F32_ONE / u32_as_f32(U32(sb << 16))
        if mult > FP32_MAX:
            mult = FP32_MAX
        return sb, mult

    # ---------------------------------------------------------------- scale layouts

    @jit
    def scale_offset(blk, kb, padded_kb, swizzled):
        """Byte offset of block ``blk``'s scale: linear (row-major rows x kb) or 128x4 tiles.

        Swizzled: the layout of cuBLASLt's VEC16_UE4M3 / VEC32_UE8M0 scale modes and
        torch._scaled_mm: 128-row x 4-column tiles of 512 bytes in row-major tile order; inside
        a tile, row r sits at (r % 32) * 16 + (r // 32) * 4 and column c at + c.  Unsigned, so
        an array index needs no negative-index wraparound.
        """
        if not swizzled:
            return np.uint64(blk)
        r = blk // kb
        col = blk - r * kb
        tile = (r >> 7) * (padded_kb >> 2) + (col >> 2)
        return np.uint64(tile * 512 + (r & 31) * 16 + ((r & 127) >> 5) * 4 + (col & 3))

    # ---------------------------------------------------------------- Philox4x32-10

    @jit
    def philox4x32_10(c0, c1, c2, c3, k0, k1):
        """Philox4x32 with 10 rounds; all words uint32 values, returns a 4-tuple of uint32.

        Every word is a uint32 and each product one 32 x 32 -> 64-bit multiply (one
        IMAD.WIDE.U32 on the GPU)."""
        x0 = U32(c0)
        x1 = U32(c1)
        x2 = U32(c2)
        x3 = U32(c3)
        key0 = U32(k0)
        key1 = U32(k1)
        for _ in range(10):
            lo0, hi0 = mul_wide_u32(PHILOX_M0_32, x0)
            lo1, hi1 = mul_wide_u32(PHILOX_M1_32, x2)
            x0 = U32(U32(hi1 ^ x1) ^ key0)
            x2 = U32(U32(hi0 ^ x3) ^ key1)
            x1 = lo1
            x3 = lo0
            key0 = U32(U32(key0) + PHILOX_W0_32)
            key1 = U32(U32(key1) + PHILOX_W1_32)
        return x0, x1, x2, x3

    return SimpleNamespace(
        bf16_to_f32=bf16_to_f32,
        f32_to_bf16=f32_to_bf16,
        f16_to_f32=f16_to_f32,
        f32_to_f16=f32_to_f16,
        e2m1_value=e2m1_value,
        e2m1_encode=e2m1_encode,
        e2m1_encode_int=e2m1_encode_int,
        e2m1_code_f=e2m1_code_f,
        sat=sat,
        sat_mul=sat_mul,
        sat_fma=sat_fma,
        add_rm=add_rm,
        e2m1_encode_sr=e2m1_encode_sr,
        e2m1_sr_code_f=e2m1_sr_code_f,
        e2m1_sr_sum=e2m1_sr_sum,
        sr_random_f32=sr_random_f32,
        e2m1_decode=e2m1_decode,
        e4m3_encode_positive=e4m3_encode_positive,
        e4m3_decode=e4m3_decode,
        mx_shared_exponent=mx_shared_exponent,
        pow2_f32=pow2_f32,
        e8m0_decode=e8m0_decode,
        nvfp4_encode_scale=nvfp4_encode_scale,
        philox4x32_10=philox4x32_10,
        fp4quant_scale=fp4quant_scale,
        nvfp4_block_scale=nvfp4_block_scale,
        mxfp4_block_scale=mxfp4_block_scale,
        scale_offset=scale_offset,
    )
