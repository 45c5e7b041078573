"""Saturating arithmetic, the float32 add rounding toward -inf, the 32 x 32 -> 64-bit multiply
powers of two and the larger of two floats: written out here; the CUDA target replaces
``sat_mul``, ``sat_fma``, ``add_rm``, ``mul_wide_u32`` and ``max_f32`` by one instruction each
(``mul.rn.sat.f32``, ``fma.rn.sat.f32``, ``add.rm.f32``, ``mul.wide.u32``, ``max.f32``)."""

from __future__ import annotations

import numpy as np

from .._numba_abi import py_f32_as_u32 as f32_as_u32, py_u32_as_f32 as u32_as_f32

FUNCTIONS = ("sat", "sat_mul", "sat_fma", "add_rm", "mul_wide_u32", "pow2_f32", "max_f32")

# float32 constants (see the package doc for why they are np.float32)
F32_ZERO = np.float32(0.0)
F32_ONE = np.float32(1.0)
F32_HALF = np.float32(0.5)
F32_TWO = np.float32(2.0)
FP32_MAX = np.float32(np.finfo(np.float32).max)
F32_INF = np.float32(np.inf)
F32_NAN = np.float32(np.nan)
U32 = np.uint32  # wrapping a result in U32 lets LLVM narrow numba's 64-bit integer ops to 32
U64_MASK32 = np.uint64(0xFFFFFFFF)
U64_32 = np.uint64(32)


def sat(v):
    """v clamped to [0, 1]; NaN -> 0 (the PTX ``.sat`` modifier)."""
    if v > F32_ONE:
        return F32_ONE
    if v > F32_ZERO:
        return v
    return F32_ZERO


def sat_mul(a, b):
    """a * b rounded to nearest even, clamped to [0, 1], NaN -> +0."""
    return sat(a * b)


def sat_fma(a, b, c):
    """sat(a * b + c).  Every use multiplies by a power of two, so a * b is exact and the add
    is the one rounding: fused (as numba-cuda contracts it) or not, the result is the same."""
    return sat(a * b + c)


def add_rm(a, b):
    """a + b rounded toward -inf.  The float64 sum is exact wherever it is used (operands
    within 2^29 of each other in magnitude); rounding it to float32 toward -inf is the nearest
    float32, moved one step down when that lies above the sum."""
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


def mul_wide_u32(a, b):
    """The 64-bit product of two uint32 as (low, high) words."""
    p = np.uint64(a) * np.uint64(b)  # < 2^64: both factors are below 2^32
    return U32(p & U64_MASK32), U32(p >> U64_32)


def pow2_f32(e):
    """2^e as float32 for e in [-126, 127] (normal range), built from the bits."""
    return u32_as_f32(np.uint32((e + 127) << 23))


def max_f32(a, b):
    """The larger of two float32 (FMNMX on the GPU).  The hardware's rules for a NaN and for
    +0 against -0 differ from this compare-and-select's: callers pass numbers, never zeros of
    both signs."""
    return a if a > b else b
