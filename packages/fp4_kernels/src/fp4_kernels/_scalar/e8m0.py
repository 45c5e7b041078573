"""The e8m0 block-scale codec of MXFP4: the OCP MX shared exponent and the decoder."""

from __future__ import annotations

import numpy as np

from .._numba_abi import py_f32_as_u32 as f32_as_u32, py_u32_as_f32 as u32_as_f32

FUNCTIONS = ("mx_shared_exponent", "e8m0_decode")

E8M0_NAN_CODE = 0xFF


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


def e8m0_decode(code):
    """e8m0 code -> 2^(code-127) as float32 (code 0 is the subnormal 2^-127); 0xFF -> NaN."""
    code = np.int64(code)  # see WIDEN
    if code == 0xFF:
        return u32_as_f32(np.uint32(0x7FC00000))
    if code == 0:
        return u32_as_f32(np.uint32(0x00400000))
    return u32_as_f32(np.uint32(code << 23))
