"""The argument checks of the public API: each names the argument and says how to fix it."""

from __future__ import annotations

import math
import operator

import numpy as np

from . import _arrays as arrays


def check_choice(value, name, choices):
    """ValueError unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name}: {value!r} is not one of {', '.join(map(repr, choices))}")


def check_int(value, name, lo, hi):
    """``value`` as an int, or TypeError / ValueError unless it is an integer in [lo, hi)."""
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an integer, got {type(value).__name__}") from None
    if not lo <= v < hi:
        raise ValueError(f"{name}: {v} is outside [{lo}, {hi})")
    return v


def check_field(a, backend, name, dtype, shape, size=None):
    """TypeError / ValueError unless the array ``a`` has ``dtype``, ``shape`` (or ``size``
    elements) and is C-contiguous."""
    dt = arrays.element_dtype(a, backend)
    if dt != dtype:
        raise TypeError(f"{name}: dtype {dt}, expected {dtype}")
    got = tuple(int(d) for d in a.shape)
    if shape is not None and got != shape:
        raise ValueError(f"{name}: shape {got} != expected {shape}")
    if size is not None and math.prod(got) != size:
        raise ValueError(f"{name}: {math.prod(got)} elements, expected {size}")
    if not arrays.is_c_contiguous(a, backend):
        raise ValueError(f"{name}: must be C-contiguous (the kernels read it as a flat buffer)")


def check_input(x, block, what):
    """(backend, dtype name, shape) of an input to quantize: a supported array, >= 1-d, its
    last dimension a multiple of ``block`` (``what`` names that size), C-contiguous."""
    backend = arrays.backend_of(x, "x")
    arrays.check_has_values(x, backend, "x")
    dt = arrays.dtype_name(x, backend, "x")
    shape = tuple(int(s) for s in x.shape)
    if len(shape) == 0:
        raise ValueError("x: a 0-d array has no last dimension to quantize; reshape to (1, K)")
    k = shape[-1]
    if k % block != 0:
        raise ValueError(
            f"x: last dimension K={k} is not a multiple of the {what} {block}; "
            f"pad K to a multiple of {block}"
        )
    if not arrays.is_c_contiguous(x, backend):
        raise ValueError(
            "x: must be contiguous (the last dimension and the rows in row-major order); "
            "call .contiguous() (torch) or np.ascontiguousarray / cupy.ascontiguousarray first"
        )
    return backend, dt, shape


def is_number(value):
    """Whether ``global_amax`` was given as a number (not an array)."""
    return isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool)


# The tensor scale is computed from float32(global_amax): a float from 2^128 - 2^103 up (half
# an ulp above FLT_MAX = 2^128 - 2^104) rounds to inf there, and S would silently become 1.
AMAX_F32_OVERFLOW = 2.0**128 - 2.0**103


def checked_amax(value):
    """``global_amax`` as a float, or ValueError unless it is finite, >= 0 and within float32's
    range."""
    try:
        v, shown = float(value), repr(value)
    except OverflowError:  # an int beyond float64's range (its repr may be too long to print)
        v = AMAX_F32_OVERFLOW if value > 0 else -math.inf
        shown = f"an integer of {value.bit_length()} bits"
    if not (math.isfinite(v) and v >= 0):
        raise ValueError(f"global_amax: must be finite and >= 0, got {shown}")
    if v >= AMAX_F32_OVERFLOW:
        raise ValueError(
            f"global_amax: {shown} is beyond float32's range (largest finite value "
            f"{float(np.finfo(np.float32).max)!r}), in which the tensor scale is computed; "
            "pass at most that (the amax of a float32, bfloat16 or float16 tensor always is)"
        )
    return v


def checked_amax_array(a, backend):
    """``global_amax`` given as an array: one float32 element where ``x`` lives."""
    try:
        b = arrays.backend_of(a, "global_amax")
    except TypeError:
        if arrays.is_torch_tensor(a):
            raise  # a torch tensor of a kind the kernels cannot read: the message says which
        raise TypeError(
            "global_amax: expected a non-negative finite float or a one-element float32 array "
            f"where x lives, got {type(a).__name__}"
        ) from None
    arrays.same_place(a, backend, "global_amax", "x")
    check_field(a, b, "global_amax", "float32", None, size=1)
    return a
