"""Shared device helpers: the scalar codec compiled for CUDA, bit casts and warp reductions.

Under ``NUMBA_ENABLE_CUDASIM=1`` the same names are plain Python (the simulator runs kernels
as Python threads); its missing warp shuffles are supplied by ``fp4_kernels.testing``.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from .._numba_abi import make_bitcast_intrinsics, py_f32_as_u32, py_u32_as_f32
from .._scalar import compile_ops
from .launch import SIMULATOR
from .launch_table import WARP_SIZE  # noqa: F401 (the kernels' import of it)

FULL_MASK = 0xFFFFFFFF

if SIMULATOR:
    f32_as_u32, u32_as_f32 = py_f32_as_u32, py_u32_as_f32
    e4m3_satfinite = None  # the simulator runs the integer encoder
    cvt_bf16x2 = cvt_f16x2 = cvt_f16_to_f32 = None  # and the integer conversions

    def mul_rn_f32(a, b):
        return a * b  # numpy float32: one rounded product, nothing fuses it with an add

    # the scalar ops write these out (same results: see _scalar)
    sat_mul = sat_fma = add_rm = mul_wide_u32 = max_f32 = None

    def prmt(a, b, selector):
        """``prmt.b32`` (default mode): byte k of the result is byte (nibble k & 7) of the 8
        bytes b:a, or that byte's sign bit replicated when nibble k has bit 3 set."""
        src = (int(b) << 32) | int(a)
        out = 0
        for k in range(4):
            sel = (int(selector) >> (4 * k)) & 0xF
            byte = (src >> (8 * (sel & 7))) & 0xFF
            if sel & 8:
                byte = 0xFF if byte & 0x80 else 0
            out |= byte << (8 * k)
        return np.uint32(out)

    def max_abs_nan(m, x):
        """``max.NaN.f32`` of ``m`` and ``|x|``: NaN when either is NaN (the GPU's canonical
        NaN, 0x7FFFFFFF), else the larger."""
        m, x = np.float32(m), np.float32(abs(np.float32(x)))
        if np.isnan(m) or np.isnan(x):
            return py_u32_as_f32(np.uint32(0x7FFFFFFF))
        return m if m >= x else x

    def max_u16x2(a, b):
        """``max.u16x2``: the larger of each 16-bit half, unsigned."""
        a, b = int(a), int(b)
        lo = max(a & 0xFFFF, b & 0xFFFF)
        hi = max(a >> 16, b >> 16)
        return np.uint32(lo | (hi << 16))

    def load_v4(words, i):
        """Four consecutive uint32 words from ``words[i]`` (i a multiple of 4)."""
        return words[i], words[i + 1], words[i + 2], words[i + 3]

    def load_v2(words, i):
        """Two consecutive uint32 words from ``words[i]`` (i a multiple of 2)."""
        return words[i], words[i + 1]

    def store_v4(words, i, a, b, c, d):
        words[i] = a
        words[i + 1] = b
        words[i + 2] = c
        words[i + 3] = d

    # the simulator's shared arrays are numpy arrays too: the same element accesses
    load_shared_v4, store_shared_v4 = load_v4, store_v4

    def store_v2(words, i, a, b):
        words[i] = a
        words[i + 1] = b

    SHARED_ALIGNMENT = None  # the simulator takes none (its arrays are numpy's)

    def shared_base(sm):
        """Byte address of ``sm[0]`` in the shared window (the simulator: 0)."""
        return 0

    def opaque_u32(x):
        return x

    def load_shared_v4_at(sm, addr):
        i = addr // 4
        return sm[i], sm[i + 1], sm[i + 2], sm[i + 3]

    def store_shared_v4_at(sm, addr, a, b, c, d):
        i = addr // 4
        sm[i], sm[i + 1], sm[i + 2], sm[i + 3] = a, b, c, d

    def load_shared_v2_at(sm, addr):
        i = addr // 4
        return sm[i], sm[i + 1]

    def load_shared_at(sm, addr):
        return sm[addr // 4]

    def store_shared_at(sm, addr, a):
        sm[addr // 4] = a

    def store_shared_v2_at(sm, addr, a, b):
        i = addr // 4
        sm[i], sm[i + 1] = a, b

    def _warp_barrier():
        """``__syncwarp()``; the simulator has none, and its block-wide barrier is stronger
        (every thread of a block reaches the same barriers in these kernels)."""
        cuda.syncthreads()
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

    @intrinsic
    def cvt_f32_to_f16(typingctx, x):
        """float32 -> IEEE binary16 bits in the low 16 of a uint32: ``cvt.rn.f16.f32`` (nearest
        even, overflow to infinity: torch's ``to(float16)``)."""
        if x != types.float32:
            return None

        def codegen(context, builder, signature, args):
            i16 = ir.IntType(16)
            asm = ir.InlineAsm(ir.FunctionType(i16, [ir.FloatType()]), "cvt.rn.f16.f32 $0, $1;",
                               "=h,f")  # fmt: skip
            return builder.zext(builder.call(asm, [args[0]]), ir.IntType(32))

        return types.uint32(types.float32), codegen


if not SIMULATOR:
    from .._numba_abi import element_address

    def _asm_codegen(ptx, ll_type, constraint, n_args):
        """codegen of a one-instruction intrinsic: ``ptx $0, $1, ...;`` on ``n_args``
        operands of one LLVM type and constraint letter."""

        def codegen(context, builder, signature, llargs):
            operands = ", ".join(f"${i + 1}" for i in range(n_args))
            asm = ir.InlineAsm(
                ir.FunctionType(ll_type, [ll_type] * n_args),
                f"{ptx} $0, {operands};",
                f"={constraint}" + f",{constraint}" * n_args,
            )
            return builder.call(asm, list(llargs))

        return codegen

    _F32_ASM = (types.float32, ir.FloatType(), "f")
    _U32_ASM = (types.uint32, ir.IntType(32), "r")

    def _one_instruction(ptx, operand, n_args):
        """The intrinsic ``ptx $0, $1, ...;``: ``n_args`` operands and the result of one type
        (``operand``: ``_F32_ASM`` or ``_U32_ASM``); other argument types do not match it."""
        numba_type, ll_type, constraint = operand

        def typer(*args):
            if any(a != numba_type for a in args):
                return None
            return numba_type(*args), _asm_codegen(ptx, ll_type, constraint, n_args)

        # @intrinsic reads the typer's parameters: one fixed signature per arity
        if n_args == 1:
            return intrinsic(lambda typingctx, a: typer(a))
        if n_args == 2:
            return intrinsic(lambda typingctx, a, b: typer(a, b))
        return intrinsic(lambda typingctx, a, b, c: typer(a, b, c))

    # a * b rounded to nearest even and clamped to [0, 1], NaN -> +0 (FMUL.SAT)
    sat_mul = _one_instruction("mul.rn.sat.f32", _F32_ASM, 2)
    # fma(a, b, c) rounded to nearest even and clamped to [0, 1], NaN -> +0 (FFMA.SAT)
    sat_fma = _one_instruction("fma.rn.sat.f32", _F32_ASM, 3)
    # a + b rounded toward -inf (FADD.RM): with 2^23 - 128 added to a V in [128, 256) it is the
    # float 2^23 + floor(V) - 128, the integer in the low mantissa bits
    add_rm = _one_instruction("add.rm.f32", _F32_ASM, 2)
    # the larger of two float32 (FMNMX; of a NaN and a number, the number)
    max_f32 = _one_instruction("max.f32", _F32_ASM, 2)
    # byte permute (PRMT): byte k of the result is byte (selector nibble k & 7) of b:a, or that
    # byte's sign bit replicated when the nibble has bit 3 set
    prmt = _one_instruction("prmt.b32", _U32_ASM, 3)
    # the larger of each unsigned 16-bit half (VIMNMX.U16x2, sm_90)
    max_u16x2 = _one_instruction("max.u16x2", _U32_ASM, 2)
    # the nearest integer, ties to even (FRND: torch.round)
    rint_f32 = _one_instruction("cvt.rni.f32.f32", _F32_ASM, 1)

    @intrinsic
    def mul_wide_u32(typingctx, a, b):
        """The 64-bit product of two uint32 as (low, high) words: one IMAD.WIDE.U32."""
        if a != types.uint32 or b != types.uint32:
            return None

        def codegen(context, builder, signature, args):
            i32 = ir.IntType(32)
            asm = ir.InlineAsm(
                ir.FunctionType(ir.LiteralStructType([i32, i32]), [i32, i32]),
                "{ .reg .b64 t; mul.wide.u32 t, $2, $3; mov.b64 {$0, $1}, t; }",
                "=r,=r,r,r",
            )
            return builder.call(asm, list(args))

        return types.UniTuple(types.uint32, 2)(a, b), codegen

    @intrinsic
    def max_abs_nan(typingctx, m, x):
        """``max.NaN.f32`` of ``m`` and ``|x|`` (FMNMX.NAN with the operand's absolute-value
        modifier: one instruction): NaN (0x7FFFFFFF) when either is NaN, else the larger."""
        if m != types.float32 or x != types.float32:
            return None

        def codegen(context, builder, signature, args):
            f32 = ir.FloatType()
            asm = ir.InlineAsm(
                ir.FunctionType(f32, [f32, f32]),
                "{ .reg .f32 t; abs.f32 t, $2; max.NaN.f32 $0, $1, t; }",
                "=f,f,f",
            )
            return builder.call(asm, list(args))

        return types.float32(m, x), codegen

    def _vector_load(n):
        @intrinsic
        def load(typingctx, words, index):
            if not (isinstance(words, types.Array) and words.dtype == types.uint32):
                return None
            if not isinstance(index, types.Integer):
                return None

            def codegen(context, builder, signature, args):
                i32 = ir.IntType(32)
                addr = element_address(context, builder, signature.args[0], args[0], args[1])
                regs = ", ".join(f"${i}" for i in range(n))
                asm = ir.InlineAsm(
                    ir.FunctionType(ir.LiteralStructType([i32] * n), [ir.IntType(64)]),
                    f"ld.global.nc.v{n}.u32 {{{regs}}}, [${n}];",
                    ",".join(["=r"] * n + ["l"]),
                )
                return builder.call(asm, [addr])

            return types.UniTuple(types.uint32, n)(words, index), codegen

        return load

    def _store_codegen(n):
        def codegen(context, builder, signature, args):
            i32 = ir.IntType(32)
            addr = element_address(context, builder, signature.args[0], args[0], args[1])
            regs = ", ".join(f"${i + 1}" for i in range(n))
            asm = ir.InlineAsm(
                ir.FunctionType(ir.VoidType(), [ir.IntType(64)] + [i32] * n),
                f"st.global.v{n}.u32 [$0], {{{regs}}};",
                ",".join(["l"] + ["r"] * n + ["~{memory}"]),
                side_effect=True,
            )
            builder.call(asm, [addr, *args[2:]])
            return context.get_dummy_value()

        return codegen

    def _store_ok(words, index, values):
        return (
            isinstance(words, types.Array)
            and words.dtype == types.uint32
            and isinstance(index, types.Integer)
            and all(v == types.uint32 for v in values)
        )

    @intrinsic
    def store_v2(typingctx, words, index, a, b):
        if not _store_ok(words, index, (a, b)):
            return None
        return types.void(words, index, a, b), _store_codegen(2)

    @intrinsic
    def store_v4(typingctx, words, index, a, b, c, d):
        if not _store_ok(words, index, (a, b, c, d)):
            return None
        return types.void(words, index, a, b, c, d), _store_codegen(4)

    # n uint32 from words[index] in one 16-byte (8-byte) load through the non-coherent
    # (read-only) path, ``ld.global.nc.v4.u32`` (``.v2``): the address must be 16-byte (8-byte)
    # aligned and the data not written by the kernel.  The stores above likewise
    # (``st.global.v{2,4}.u32``).
    load_v4 = _vector_load(4)
    load_v2 = _vector_load(2)

    @intrinsic
    def load_shared_v4(typingctx, sm, index):
        """Four float32 from a shared-memory array at ``sm[index]`` (16-byte aligned) in one
        ``ld.shared.v4.f32`` (the array's generic address converted to the shared window)."""
        if not (isinstance(sm, types.Array) and sm.dtype == types.float32):
            return None
        if not isinstance(index, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            f32 = ir.FloatType()
            addr = element_address(context, builder, signature.args[0], args[0], args[1])
            asm = ir.InlineAsm(
                ir.FunctionType(ir.LiteralStructType([f32] * 4), [ir.IntType(64)]),
                "{ .reg .u64 a; cvta.to.shared.u64 a, $4; "
                "ld.shared.v4.f32 {$0, $1, $2, $3}, [a]; }",
                "=f,=f,=f,=f,l,~{memory}",
                # it reads what other threads wrote before a barrier: never moved across one
                side_effect=True,
            )
            return builder.call(asm, [addr])

        return types.UniTuple(types.float32, 4)(sm, index), codegen

    @intrinsic
    def store_shared_v4(typingctx, sm, index, a, b, c, d):
        """``sm[index : index + 4] = a, b, c, d`` in one ``st.shared.v4.f32``."""
        if not (isinstance(sm, types.Array) and sm.dtype == types.float32):
            return None
        if not isinstance(index, types.Integer):
            return None
        if any(v != types.float32 for v in (a, b, c, d)):
            return None

        def codegen(context, builder, signature, args):
            f32 = ir.FloatType()
            addr = element_address(context, builder, signature.args[0], args[0], args[1])
            asm = ir.InlineAsm(
                ir.FunctionType(ir.VoidType(), [ir.IntType(64)] + [f32] * 4),
                "{ .reg .u64 a; cvta.to.shared.u64 a, $0; "
                "st.shared.v4.f32 [a], {$1, $2, $3, $4}; }",
                "l,f,f,f,f,~{memory}",
                side_effect=True,
            )
            builder.call(asm, [addr, *args[2:]])
            return context.get_dummy_value()

        sig = types.void(sm, index, types.float32, types.float32, types.float32, types.float32)
        return sig, codegen

    SHARED_ALIGNMENT = 128  # bytes: XOR swizzles of the low address bits stay inside the array

    @intrinsic
    def shared_base(typingctx, sm):
        """Byte address of ``sm[0]`` in the shared window, as a uint32 (``cvta.to.shared``)."""
        if not (isinstance(sm, types.Array) and sm.dtype == types.float32):
            return None

        def codegen(context, builder, signature, args):
            addr = element_address(
                context, builder, signature.args[0], args[0], ir.Constant(ir.IntType(64), 0)
            )
            asm = ir.InlineAsm(
                ir.FunctionType(ir.IntType(32), [ir.IntType(64)]),
                "{ .reg .u64 a; cvta.to.shared.u64 a, $1; cvt.u32.u64 $0, a; }",
                "=r,l",
            )
            return builder.call(asm, [addr])

        return types.uint32(sm), codegen

    @intrinsic
    def opaque_u32(typingctx, x):
        """x, through a volatile ``mov``: the compiler cannot hoist what is computed from it out
        of a loop (where keeping every such value live would cost a register each)."""
        if x != types.uint32:
            return None

        def codegen(context, builder, signature, args):
            i32 = ir.IntType(32)
            asm = ir.InlineAsm(
                ir.FunctionType(i32, [i32]), "mov.b32 $0, $1;", "=r,r", side_effect=True
            )
            return builder.call(asm, list(args))

        return types.uint32(x), codegen

    def _shared_at(n, load):
        """``ld/st.shared.v{n}.f32`` at a uint32 shared-window byte address (the array operand
        only types the call); ordered like ``load_shared_v4`` (side effects, memory clobber)."""
        f32 = ir.FloatType()
        i32 = ir.IntType(32)
        regs = ", ".join(f"${i}" for i in range(n))

        def codegen(context, builder, signature, args):
            if load:
                asm = ir.InlineAsm(
                    ir.FunctionType(ir.LiteralStructType([f32] * n), [i32]),
                    f"ld.shared.v{n}.f32 {{{regs}}}, [${n}];",
                    ",".join(["=f"] * n + ["r", "~{memory}"]),
                    side_effect=True,
                )
                return builder.call(asm, [args[1]])
            vals = ", ".join(f"${i + 1}" for i in range(n))
            asm = ir.InlineAsm(
                ir.FunctionType(ir.VoidType(), [i32] + [f32] * n),
                f"st.shared.v{n}.f32 [$0], {{{vals}}};",
                ",".join(["r"] + ["f"] * n + ["~{memory}"]),
                side_effect=True,
            )
            builder.call(asm, list(args[1:]))
            return context.get_dummy_value()

        def typer(typingctx, sm, addr, *values):
            if not (isinstance(sm, types.Array) and sm.dtype == types.float32):
                return None
            if addr != types.uint32:
                return None
            if load:
                if values:
                    return None
                return types.UniTuple(types.float32, n)(sm, addr), codegen
            if len(values) != n or any(v != types.float32 for v in values):
                return None
            return types.void(sm, addr, *values), codegen

        return typer

    def _load_at(n):
        @intrinsic
        def load(typingctx, sm, addr):
            return _shared_at(n, True)(typingctx, sm, addr)

        return load

    load_shared_v4_at = _load_at(4)
    load_shared_v2_at = _load_at(2)

    @intrinsic
    def load_shared_at(typingctx, sm, addr):
        """One float32 at a shared-window byte address (``ld.shared.f32``)."""
        if not (isinstance(sm, types.Array) and sm.dtype == types.float32):
            return None
        if addr != types.uint32:
            return None

        def codegen(context, builder, signature, args):
            asm = ir.InlineAsm(
                ir.FunctionType(ir.FloatType(), [ir.IntType(32)]),
                "ld.shared.f32 $0, [$1];",
                "=f,r,~{memory}",
                side_effect=True,
            )
            return builder.call(asm, [args[1]])

        return types.float32(sm, addr), codegen

    @intrinsic
    def store_shared_at(typingctx, sm, addr, a):
        """One float32 to a shared-window byte address (``st.shared.f32``)."""
        if not (isinstance(sm, types.Array) and sm.dtype == types.float32):
            return None
        if addr != types.uint32 or a != types.float32:
            return None

        def codegen(context, builder, signature, args):
            asm = ir.InlineAsm(
                ir.FunctionType(ir.VoidType(), [ir.IntType(32), ir.FloatType()]),
                "st.shared.f32 [$0], $1;",
                "r,f,~{memory}",
                side_effect=True,
            )
            builder.call(asm, list(args[1:]))
            return context.get_dummy_value()

        return types.void(sm, addr, a), codegen

    @intrinsic
    def store_shared_v4_at(typingctx, sm, addr, a, b, c, d):
        return _shared_at(4, False)(typingctx, sm, addr, a, b, c, d)

    @intrinsic
    def store_shared_v2_at(typingctx, sm, addr, a, b):
        return _shared_at(2, False)(typingctx, sm, addr, a, b)

    def _warp_barrier():
        """``__syncwarp()`` (all lanes): orders a warp's shared-memory accesses."""
        cuda.syncwarp()


def device_jit(fn=None):
    """``cuda.jit(device=True)``; forceinline keeps the per-element helpers out of call frames."""
    if fn is None:
        return device_jit
    if SIMULATOR:
        return cuda.jit(device=True)(fn)
    return cuda.jit(device=True, forceinline=True)(fn)


warp_barrier = device_jit(_warp_barrier)

# the target's one-instruction versions of scalar functions (none in the simulator)
_HARDWARE = {
    "e4m3_encode_positive": e4m3_satfinite,
    "sat_mul": sat_mul,
    "sat_fma": sat_fma,
    "add_rm": add_rm,
    "mul_wide_u32": mul_wide_u32,
    "max_f32": max_f32,
}


def _scalar_jit(fn):
    """How the scalar modules' functions are compiled: as device functions on a GPU; left as
    Python functions in the simulator.  They take no ``cuda`` API (plain code on numpy scalars:
    the simulator's device-function wrapper would only swap a ``cuda`` module they do not
    hold), and that wrapper takes a lock and rescans the caller's globals on every call, which
    made the nested scalar calls of a simulated kernel several times slower."""
    return fn if SIMULATOR else device_jit(fn)


OPS = compile_ops(
    _scalar_jit,
    {"f32_as_u32": f32_as_u32, "u32_as_f32": u32_as_f32}
    | {name: fn for name, fn in _HARDWARE.items() if fn is not None},
)


@device_jit
def group_max(v, lanes):
    """Max of ``v`` over aligned groups of ``lanes`` (a power of two, up to 32) consecutive
    lanes.

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


def kernel_of(body, device_step=False):
    """The kernel of the Python function ``body``, whose last argument is the Philox counter's
    ``step`` (uint32): ``cuda.jit(body)`` itself, or with ``device_step`` a kernel of the same
    arguments whose last one is a one-element int64 array holding the step (its low 32 bits
    taken), read by the kernel at launch: what a CUDA graph replays with a step written into
    that array before each replay.  The step-in-memory kernel calls ``body`` as an inlined
    device function, so the scalar kernel is compiled exactly as before."""
    if not device_step:
        return cuda.jit(body)
    inner = device_jit(body)
    names = body.__code__.co_varnames[: body.__code__.co_argcount - 1]
    args = ", ".join(names)
    # a kernel of body's own parameter names (numba kernels take no *args)
    source = (
        f"def {body.__name__}_device_step({args}, step_ref):\n"
        f"    inner({args}, np.uint32(step_ref[0] & 0xFFFFFFFF))\n"
    )
    scope = {"inner": inner, "np": np}
    exec(compile(source, f"<{body.__qualname__} with the step in memory>", "exec"), scope)
    return cuda.jit(scope[f"{body.__name__}_device_step"])
