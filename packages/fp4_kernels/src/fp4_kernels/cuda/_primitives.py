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
else:
    from numba.cuda.extending import intrinsic

    f32_as_u32, u32_as_f32 = make_bitcast_intrinsics(intrinsic)


def device_jit(fn=None):
    """``cuda.jit(device=True)``; forceinline keeps the per-element helpers out of call frames."""
    if fn is None:
        return device_jit
    if SIMULATOR:
        return cuda.jit(device=True)(fn)
    return cuda.jit(device=True, forceinline=True)(fn)


OPS = build_scalar_ops(device_jit, f32_as_u32, u32_as_f32)


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
