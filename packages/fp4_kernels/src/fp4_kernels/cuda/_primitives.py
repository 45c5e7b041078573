"""Shared device helpers: the scalar codec compiled for CUDA, bit casts and warp reductions.

Under ``NUMBA_ENABLE_CUDASIM=1`` the same names are plain Python (the simulator runs kernels
as Python threads); its missing warp shuffles are supplied by ``fp4_kernels.testing``.
"""

from __future__ import annotations

from numba import config, cuda

from .._bitcast import make_bitcast_intrinsics, py_f32_as_u32, py_u32_as_f32
from .._scalar import build_scalar_ops

SIMULATOR = bool(config.ENABLE_CUDASIM)
WARP_SIZE = 32
FULL_MASK = 0xFFFFFFFF

if SIMULATOR:
    f32_as_u32, u32_as_f32 = py_f32_as_u32, py_u32_as_f32
    e4m3_satfinite = None  # the simulator runs the integer encoder
    cvt_bf16x2 = cvt_f16x2 = cvt_f16_to_f32 = None  # and the integer conversions

    def mul_rn_f32(a, b):
        return a * b  # numpy float32: one rounded product, nothing fuses it with an add
else:
    from llvmlite import ir
    from numba.core import types
    from numba.cuda.extending import intrinsic

    f32_as_u32, u32_as_f32 = make_bitcast_intrinsics(intrinsic)

    @intrinsic
    def e4m3_satfinite(typingctx, v):
        """float32 -> e4m3 bits in one instruction: ``cvt.rn.satfinite.e4m3x2.f32`` (sm_89+).

        The x2 form converts two floats; the second source lands in the low byte.
        """
        if v != types.float32:
            return None

        def codegen(context, builder, signature, args):
            f32 = ir.FloatType()
            asm = ir.InlineAsm(
                ir.FunctionType(ir.IntType(16), [f32, f32]),
                "cvt.rn.satfinite.e4m3x2.f32 $0, $1, $2;",
                "=h,f,f",
            )
            pair = builder.call(asm, [ir.Constant(f32, 0.0), args[0]])
            return builder.zext(
                builder.and_(pair, ir.Constant(ir.IntType(16), 0xFF)), ir.IntType(32)
            )

        return types.uint32(types.float32), codegen

    def _cvt_x2(ptx_type):
        """Two float32 -> one packed 32-bit word of two 16-bit floats, round to nearest even
        (``cvt.rn.<type>x2.f32``, sm_80+): ``hi`` lands in the upper half."""

        @intrinsic
        def cvt(typingctx, hi, lo):
            if hi != types.float32 or lo != types.float32:
                return None

            def codegen(context, builder, signature, args):
                f32 = ir.FloatType()
                asm = ir.InlineAsm(
                    ir.FunctionType(ir.IntType(32), [f32, f32]),
                    f"cvt.rn.{ptx_type}x2.f32 $0, $1, $2;",
                    "=r,f,f",
                )
                return builder.call(asm, list(args))

            return types.uint32(types.float32, types.float32), codegen

        return cvt

    cvt_bf16x2 = _cvt_x2("bf16")
    cvt_f16x2 = _cvt_x2("f16")

    @intrinsic
    def mul_rn_f32(typingctx, a, b):
        """a * b rounded to nearest even, as a product that is never contracted into an FMA
        with a following add: ``mul.rn.f32`` in inline PTX is opaque to NVVM's contraction,
        and ptxas leaves instructions with an explicit rounding modifier unfused."""
        if a != types.float32 or b != types.float32:
            return None

        def codegen(context, builder, signature, args):
            f32 = ir.FloatType()
            asm = ir.InlineAsm(ir.FunctionType(f32, [f32, f32]), "mul.rn.f32 $0, $1, $2;", "=f,f,f")
            return builder.call(asm, list(args))

        return types.float32(types.float32, types.float32), codegen

    @intrinsic
    def cvt_f16_to_f32(typingctx, h):
        """IEEE binary16 bits (low 16 bits of a uint32) -> float32, exact: ``cvt.f32.f16``."""
        if h != types.uint32:
            return None

        def codegen(context, builder, signature, args):
            i16 = ir.IntType(16)
            asm = ir.InlineAsm(
                ir.FunctionType(ir.FloatType(), [i16]), "cvt.f32.f16 $0, $1;", "=f,h"
            )
            return builder.call(asm, [builder.trunc(args[0], i16)])

        return types.float32(types.uint32), codegen


def device_jit(fn=None):
    """``cuda.jit(device=True)``; forceinline keeps the per-element helpers out of call frames."""
    if fn is None:
        return device_jit
    if SIMULATOR:
        return cuda.jit(device=True)(fn)
    return cuda.jit(device=True, forceinline=True)(fn)


OPS = build_scalar_ops(device_jit, f32_as_u32, u32_as_f32, e4m3_satfinite)


@device_jit
def group_max(v, lanes):
    """Max of ``v`` over aligned groups of ``lanes`` (1, 2, 4 or 8) consecutive lanes.

    Butterfly (xor) shuffles leave the result in every lane of the group.  Every lane of the warp
    must call this (full mask): callers keep out-of-range lanes running on dummy data.
    """
    off = 1
    while off < lanes:
        w = cuda.shfl_xor_sync(FULL_MASK, v, off)
        if w > v:
            v = w
        off *= 2
    return v
