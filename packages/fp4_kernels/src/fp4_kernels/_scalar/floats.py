"""bfloat16 and IEEE float16 bits to and from float32: the element kinds the kernels read and
write besides float32."""

from __future__ import annotations

import numpy as np

from .._numba_abi import py_f32_as_u32 as f32_as_u32, py_u32_as_f32 as u32_as_f32
from .arith import U32

FUNCTIONS = ("bf16_to_f32", "f32_to_bf16", "f16_to_f32", "f32_to_f16")

# element kinds of the arrays the codecs read and write (the kernels' `kind` argument)
KIND_F32 = 0
KIND_BF16 = 1
KIND_F16 = 2
TWO_POW_M24_F16 = np.float32(2.0**-24)  # fp16 subnormal quantum


def bf16_to_f32(h):
    """bfloat16 bits (low 16 bits of ``h``) -> float32, exact."""
    h = np.int64(h)  # see WIDEN
    return u32_as_f32(np.uint32((h & 0xFFFF) << 16))


def f32_to_bf16(f):
    """float32 -> bfloat16 bits, round to nearest even (NaN stays a quiet NaN)."""
    u = f32_as_u32(f)
    if U32(u & 0x7FFFFFFF) > 0x7F800000:
        return U32(U32(U32(u >> 16) | 0x40) & 0xFFFF)
    # Adding 0x7FFF plus the kept lsb rounds half to even; the carry may ripple into the
    # exponent (and to inf), which is the correct rounding.  No NaN here, so no overflow.
    return U32(U32(u + U32(0x7FFF + U32(U32(u >> 16) & 1))) >> 16)


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
