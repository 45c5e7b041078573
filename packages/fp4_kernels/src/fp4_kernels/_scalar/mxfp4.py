"""MXFP4's scale arithmetic (OCP MX v1.0): the block's e8m0 scale and its exact multiplier."""

from __future__ import annotations

from .._numba_abi import py_u32_as_f32 as u32_as_f32
from .arith import F32_NAN, F32_ZERO, U32, pow2_f32
from .e8m0 import E8M0_NAN_CODE, e8m0_decode, mx_shared_exponent

FUNCTIONS = ("mxfp4_block_scale",)


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
