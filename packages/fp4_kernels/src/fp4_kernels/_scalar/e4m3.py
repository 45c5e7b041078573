"""The e4m3 block-scale codec of NVFP4: the integer RNE encoder (the CUDA target replaces it by
the hardware conversion, ``cvt.rn.satfinite.e4m3x2.f32``) and the branch-free decoder."""

from __future__ import annotations

import numpy as np

from .._numba_abi import py_f32_as_u32 as f32_as_u32, py_u32_as_f32 as u32_as_f32
from ..formats import e4m3
from .arith import F32_NAN, U32

FUNCTIONS = ("e4m3_encode_positive", "e4m3_decode")

E4M3_MAX = np.float32(e4m3.E4M3_MAX)  # largest finite e4m3 (OCP "fn") magnitude
E4M3_NAN_CODE = 0x7F
TWO_POW_M9 = np.float32(2.0**-9)  # e4m3 subnormal quantum


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
