"""The scalar codec compiled for the CPU with ``numba.njit``.

``error_model="numpy"`` makes float division by zero give inf as IEEE (and the CUDA target)
does, instead of raising ZeroDivisionError.  Compiled functions are cached on disk in the
user's cache directory (``_numba_abi.install_cache_locator``), so only the first run compiles;
a corrupted cache entry is detected, deleted and compiled again
(``_numba_abi.CheckedFunctionCache``).
"""

from __future__ import annotations

import numba
from numba.extending import intrinsic

from .._numba_abi import enable_checked_cache, install_cache_locator, make_bitcast_intrinsics
from .._scalar import compile_ops

f32_as_u32, u32_as_f32 = make_bitcast_intrinsics(intrinsic)
install_cache_locator()


def cpu_jit(fn=None, **kwargs):
    """``numba.njit`` with the options every CPU codec function uses, cached on disk with an
    integrity check (``_numba_abi.enable_checked_cache``)."""
    opts = dict(error_model="numpy", nogil=True)
    opts.update(kwargs)

    def jit(f):
        return enable_checked_cache(numba.njit(**opts)(f))

    return jit if fn is None else jit(fn)


OPS = compile_ops(cpu_jit, {"f32_as_u32": f32_as_u32, "u32_as_f32": u32_as_f32})


def __getattr__(name):
    """The compiled scalar functions by name (``from ._primitives import e2m1_encode``)."""
    try:
        return getattr(OPS, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
