"""float32 <-> uint32 bit reinterpretation for numba targets (CPU and CUDA) and the simulator.

numba has no scalar ``view``; an ``@intrinsic`` that emits an LLVM ``bitcast`` costs nothing on
either target (a register move).  The typing functions accept *only* float32 / uint32: a float64
that leaks into codec arithmetic (numba types Python float literals as float64) is then a
compile-time error instead of a silent change of rounding.
"""

from __future__ import annotations

import numpy as np
from numba.core import types
from numba.core.errors import TypingError


def make_bitcast_intrinsics(intrinsic):
    """Return ``(f32_as_u32, u32_as_f32)`` built with the target's ``intrinsic`` decorator."""

    @intrinsic
    def f32_as_u32(typingctx, x):
        if x != types.float32:
            raise TypingError(f"f32_as_u32 needs a float32 argument, got {x} (float64 leak?)")

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], context.get_value_type(types.uint32))

        return types.uint32(types.float32), codegen

    @intrinsic
    def u32_as_f32(typingctx, x):
        if x != types.uint32:
            raise TypingError(f"u32_as_f32 needs a uint32 argument, got {x}")

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], context.get_value_type(types.float32))

        return types.float32(types.uint32), codegen

    return f32_as_u32, u32_as_f32


def py_f32_as_u32(x):
    """Python version for numba's CUDA simulator."""
    return np.float32(x).view(np.uint32)


def py_u32_as_f32(x):
    """Python version for numba's CUDA simulator."""
    return np.uint32(x).view(np.float32)
