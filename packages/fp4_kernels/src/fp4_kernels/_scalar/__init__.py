"""Scalar codec arithmetic shared by the CUDA kernels and the CPU path, one module a format.

Every function here is written once, as plain Python on numpy scalars, and compiled twice by
``compile_ops``: with ``numba.cuda.jit(device=True)`` for the GPU kernels (run as Python by
numba's CUDA simulator) and with ``numba.njit`` for the CPU path.  Each compiled copy sees the
target's float32 <-> uint32 bit casts and the target's compiled versions of the functions it
calls, so the GPU and the CPU execute the same operation order and give bit-identical codes and
scales.  The modules, in the order they build on each other:

- ``arith``: saturating arithmetic, the rounding-down add, the wide multiply, powers of two;
- ``floats``: bfloat16 and float16 to and from float32 (the kernels' element kinds);
- ``e2m1``: the FP4 element codec (nearest-even and stochastic rounding, decoding);
- ``e4m3``, ``e8m0``: the NVFP4 and MXFP4 block-scale codecs;
- ``nvfp4``, ``mxfp4``, ``fp4quant``: each format's scale arithmetic;
- ``scale_layout``: the swizzled scale layout's offsets;
- ``philox``: Philox4x32-10, the random bits of stochastic rounding;
- ``hadamard``: the Walsh–Hadamard transform's butterfly stage (on an array of float32).

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

The plain-numpy oracle in ``fp4_kernels.formats`` is written independently of these modules.
"""

from __future__ import annotations

import types

from . import (
    arith,
    e2m1,
    e4m3,
    e8m0,
    floats,
    fp4quant,
    hadamard,
    mxfp4,
    nvfp4,
    philox,
    scale_layout,
)
from .arith import F32_ONE
from .e2m1 import E2M1_CODE_BIAS, INV_E2M1_MAX, SR_BASE_BITS
from .floats import KIND_BF16, KIND_F16, KIND_F32

__all__ = [
    "E2M1_CODE_BIAS", "F32_ONE", "INV_E2M1_MAX", "KIND_BF16", "KIND_F16", "KIND_F32",
    "SR_BASE_BITS", "compile_ops",
]  # fmt: skip

MODULES = (arith, floats, e2m1, e4m3, e8m0, nvfp4, mxfp4, fp4quant, scale_layout, philox, hadamard)


def compile_ops(jit, primitives):
    """Every module's ``FUNCTIONS`` compiled with ``jit`` for one target, as one namespace.

    ``jit`` is ``numba.cuda.jit(device=True)`` or ``numba.njit(error_model="numpy")``;
    ``primitives`` maps names to the target's versions: ``f32_as_u32`` / ``u32_as_f32`` (bit
    casts, no conversion) and, where the target has one instruction for them, ``sat_mul``,
    ``sat_fma``, ``add_rm``, ``mul_wide_u32`` and ``e4m3_encode_positive`` (the hardware
    float32 -> e4m3 conversion: round to nearest even, saturating, what TE's
    static_cast<fp8e4m3> compiles to; the tests check it against the written-out one on every
    input).  A primitive replaces the written-out function of its name.

    Each function is compiled from its own code with the globals of its module in which every
    name of a primitive or of a function compiled before it (this module's and the earlier
    modules') is the target's version: the module's code runs on the target unchanged."""
    compiled = dict(primitives)
    for module in MODULES:
        scope = {**vars(module), **compiled}
        for name in module.FUNCTIONS:
            if name in primitives:
                scope[name] = primitives[name]
                continue
            fn = getattr(module, name)
            copy = types.FunctionType(fn.__code__, scope, name, fn.__defaults__)
            copy.__qualname__, copy.__doc__ = fn.__qualname__, fn.__doc__
            scope[name] = compiled[name] = jit(copy)
    return types.SimpleNamespace(**compiled)
