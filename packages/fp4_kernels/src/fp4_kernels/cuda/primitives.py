"""Scalar device functions for kernels written beside fp4_kernels' own (fp4_comm's TAH-Quant
kernels use them): each is one instruction or a bit cast with an exact contract, so a kernel
built from them rounds where it says and nowhere else.

- ``f32_as_u32(x)`` / ``u32_as_f32(u)``: the bits of a float32 as a uint32 and back (typed for
  float32 / uint32 only: a float64 that leaks in is a compile-time error).
- ``mul_rn_f32(a, b)``: ``a * b`` rounded to nearest even, never contracted into an FMA with a
  following add (numba-cuda contracts ``a * b + c`` otherwise).
- ``rint_f32(x)``: the nearest integer, ties to even (``cvt.rni.f32.f32``; ``torch.round``).
- ``f32_to_f16_bits(x)``: IEEE binary16 bits of ``x`` in the low 16 of a uint32, nearest even,
  overflow to infinity (``cvt.rn.f16.f32``; torch's ``to(torch.float16)``).
- ``f16_bits_to_f32(h)``: the float32 value of binary16 bits (the low 16 of a uint32), exact.

Usable in ``@cuda.jit`` kernels and device functions.  Under ``NUMBA_ENABLE_CUDASIM=1`` each
is the same operation on numpy scalars (the simulator runs kernels as Python threads).
"""

from __future__ import annotations

import numpy as np

from .launch import SIMULATOR

__all__ = [
    "f16_bits_to_f32",
    "f32_as_u32",
    "f32_to_f16_bits",
    "mul_rn_f32",
    "rint_f32",
    "u32_as_f32",
]

if SIMULATOR:
    from .._numba_abi import py_f32_as_u32 as f32_as_u32, py_u32_as_f32 as u32_as_f32

    def mul_rn_f32(a, b):
        return np.float32(np.float32(a) * np.float32(b))

    def rint_f32(x):
        return np.float32(np.rint(np.float32(x)))

    def f32_to_f16_bits(x):
        with np.errstate(over="ignore"):
            return np.uint32(np.float32(x).astype(np.float16).view(np.uint16))

    def f16_bits_to_f32(h):
        return np.float32(np.uint16(h).view(np.float16))

else:
    from ._primitives import (
        cvt_f16_to_f32 as f16_bits_to_f32,
        cvt_f32_to_f16 as f32_to_f16_bits,
        f32_as_u32,
        mul_rn_f32,
        rint_f32,
        u32_as_f32,
    )
