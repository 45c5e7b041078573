"""The scalar codec compiled for the CPU with ``numba.njit``.

``error_model="numpy"`` makes float division by zero give inf as IEEE (and the CUDA target)
does, instead of raising ZeroDivisionError.  Compiled functions are cached on disk in the
user's cache directory (``_numba_abi.install_cache_locator``), so only the first run compiles.
"""

from __future__ import annotations

import numba
from numba.extending import intrinsic

from .._numba_abi import install_cache_locator, make_bitcast_intrinsics
from .._scalar import build_scalar_ops

f32_as_u32, u32_as_f32 = make_bitcast_intrinsics(intrinsic)
install_cache_locator()


def cpu_jit(fn=None, **kwargs):
    """``numba.njit`` with the options every CPU codec function uses."""
    opts = dict(error_model="numpy", cache=True, nogil=True)
    opts.update(kwargs)
    if fn is None:
        return lambda f: numba.njit(**opts)(f)
    return numba.njit(**opts)(fn)


OPS = build_scalar_ops(cpu_jit, f32_as_u32, u32_as_f32)
