"""Public ``hadamard``: validate -> allocate -> GPU kernel (``cuda.hadamard``) or CPU path."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import numpy as np

from . import _arrays as arrays, _autograd, _plans
from ._devices import on_device, to_numpy
from ._quantized import Array
from .formats import hadamard as spec

_SIGN_CACHE = {}  # (array kind, device, g, sign words) -> the words on that device


def hadamard(
    x: Array,
    *,
    group_size: int,
    inverse: bool = False,
    signs: int | Sequence[int] | Array | None = None,
) -> Array:
    """Normalized Walsh–Hadamard transform over contiguous groups of the last dimension.

    Equivalent to ``x.reshape(-1, g) @ (diag(signs) @ scipy.linalg.hadamard(g)) / sqrt(g)``
    (Sylvester order; without ``signs`` the transform is its own inverse), reshaped back;
    ``inverse=True`` applies ``y.reshape(-1, g) @ (scipy.linalg.hadamard(g) @ diag(signs))
    / sqrt(g)``, which undoes it.  Computed in float32 with log2(g) butterfly stages in the
    order ``fp4_kernels.formats.hadamard.stage_order(g)`` (register, warp-shuffle, then
    shared-memory stages on the GPU; the CPU path gives the same bits), scaled once by
    float32(1/sqrt(g)) and rounded once to the input dtype.  Range: the butterflies add in
    float32 before the scaling, so a group whose partial sums exceed FLT_MAX (possible once
    ``|x| > FLT_MAX / g``) gives ±inf where they do (and NaN for inf - inf), as float32 arithmetic
    does; below FLT_MAX / g nothing overflows.

    Autograd: for a torch tensor that requires grad (with grad mode on) the result requires
    grad too, and the gradient is the adjoint transform of the incoming gradient: the matrix
    transposed, which for this orthogonal matrix is the other direction with the same signs
    (``hadamard(grad, group_size=g, inverse=not inverse, signs=signs)``, in grad's dtype; the
    forward values are the bits of the no-grad call).  Signs that require grad are refused:
    the transform is not differentiated with respect to them.

    Args:
        x: float32 / bfloat16 / float16, C-contiguous, last dimension a multiple of g.  GPU
            arrays (torch CUDA, CuPy, numba) run on the caller's current stream; numpy and
            torch CPU on the CPU.  Returns a new array of x's kind, dtype and shape.
        group_size: g, a power of two from 16 to 8192.
        inverse: apply the inverse transform.
        signs: None, an int seed (0 <= seed < 2**64: the random ±1 vector
            ``fp4_kernels.formats.hadamard.hadamard_signs(g, seed)``, the same on every rank
            and backend), or a ±1 vector of length g (numpy, list or torch CPU).
    """
    if signs is not None and _autograd.requires_autograd(signs):
        raise ValueError(
            "signs: a ±1 vector that requires grad; the transform is not differentiated with "
            "respect to its signs (they are constants of the transform): pass signs.detach()"
        )
    if _autograd.requires_autograd(x):
        # x @ (D H / sqrt(g)) has the adjoint (H D / sqrt(g)), the inverse with the same signs
        # (H is symmetric), and the inverse's adjoint is the forward transform
        return _autograd.linear_transform(
            x,
            lambda t: hadamard(t, group_size=group_size, inverse=inverse, signs=signs),
            lambda g: hadamard(g, group_size=group_size, inverse=not inverse, signs=signs),
        )
    key = _hadamard_key(x, group_size, inverse, signs)
    if key is not None:
        plan = _plans.get(key)
        if plan is not None:
            return plan((x,))[0]
    g = spec.check_group_size(group_size)
    if not isinstance(inverse, bool):
        raise TypeError(f"inverse: expected True or False, got {inverse!r}")
    backend = arrays.backend_of(x, "x")
    arrays.check_has_values(x, backend, "x")
    dt = arrays.dtype_name(x, backend, "x")
    shape = tuple(int(s) for s in x.shape)
    if not shape or shape[-1] % g:
        raise ValueError(
            f"x: last dimension of shape {shape} is not a multiple of group_size={g}; "
            f"pad it to a multiple of {g} or choose a group size that divides it"
        )
    if not arrays.is_c_contiguous(x, backend):
        raise ValueError("x: must be C-contiguous; call .contiguous() / np.ascontiguousarray")
    words = _sign_words(signs, g)
    n = math.prod(shape)
    kind = arrays.KIND_OF_DTYPE[dt]
    if backend.gpu and key is not None and n:
        plan = _plans.get(key)
        if plan is None:
            plan = _plans.put(key, _hadamard_plan(x, backend, dt, shape, g, inverse, words))
        return plan((x,))[0]
    if backend.gpu:
        from .cuda import hadamard as op

        ctx = arrays.GpuContext(x, backend)
        with on_device(ctx):
            out = ctx.empty(shape, None, like_dtype=ctx.float_dtype(dt))
            if n:
                dev_words = _device_words(ctx, words if words is not None else np.zeros(1, "u4"))
                op.hadamard(ctx, x, out, n, dev_words, kind, g, inverse, words is not None)
        return out
    from .cpu import fp4quant as cpu

    mask = np.zeros(0, np.uint8)
    if words is not None:
        mask = (spec.sign_bits_to_values(words, g) < 0).astype(np.uint8)
    out_bits = np.empty(n, arrays.BITS_DTYPE[dt])
    cpu.hadamard(
        arrays.cpu_bits(x, dt),
        kind,
        g,
        cpu.stage_strides(g),
        spec.inv_sqrt_group_size(g),
        inverse,
        mask,
        out_bits,
    )
    return arrays.cpu_from_bits(out_bits, dt, shape, backend)


def _hadamard_key(x, group_size, inverse, signs):
    """The plan key of a torch CUDA call (``_plans``), or None (signs given as a vector)."""
    if not _plans.enabled() or type(group_size) is not int or type(inverse) is not bool:
        return None
    if signs is not None and type(signs) is not int:
        return None
    xk = _plans.tensor_key(x)
    if xk is None:
        return None
    return ("hadamard", xk, group_size, inverse, signs, _plans.policy())


def _hadamard_plan(x, backend, dt, shape, g, inverse, words):
    """Record the launch of a checked torch CUDA transform (see ``_plans``)."""
    from .cuda import hadamard as op

    tracer = _plans.Tracer(x.device.index)
    vx = tracer.input(x)
    with on_device(tracer):
        out = tracer.empty(shape, None, like_dtype=tracer.float_dtype(dt))
        ctx = arrays.GpuContext(x, backend)
        dev_words = _device_words(ctx, words if words is not None else np.zeros(1, "u4"))
        op.hadamard(
            tracer, vx, out, math.prod(shape), dev_words, arrays.KIND_OF_DTYPE[dt], g, inverse,
            words is not None,
        )  # fmt: skip
    return tracer.plan((out,))


def _sign_words(signs, g):
    """None, a seed or a ±1 vector -> the uint32 sign words (or None)."""
    if signs is None:
        return None
    if isinstance(signs, (int, np.integer)) and not isinstance(signs, bool):
        seed = operator.index(signs)
        if not 0 <= seed < 2**64:
            raise ValueError(f"signs: a seed must be in [0, 2**64), got {seed}")
        return spec.sign_words(g, seed)
    backend = None
    try:
        backend = arrays.backend_of(signs, "signs")
    except TypeError:
        if arrays.is_torch_tensor(signs):
            raise  # a torch tensor of a kind that cannot be read: the message says which
    if backend is not None and backend.gpu:
        raise TypeError("signs: pass a seed or a host (numpy / list / torch CPU) ±1 vector")
    if backend is not None:
        arrays.check_has_values(signs, backend, "signs")
    s = np.asarray(to_numpy(signs) if backend is not None else signs, dtype=np.float64)
    if s.shape != (g,):
        raise ValueError(f"signs: expected {g} values (one per group position), got {s.shape}")
    if not np.all(np.abs(s) == 1):
        raise ValueError("signs: every entry must be +1 or -1")
    return spec.sign_values_to_words(s)


def _device_words(ctx, words):
    """The sign words on the caller's device, copied once per (device, words) and cached."""
    key = (ctx.backend.lib, ctx.device_id, words.tobytes())
    dev = _SIGN_CACHE.get(key)
    if dev is None:
        lib = ctx.backend.lib
        if lib == "torch" and not ctx.simulator:
            import torch

            dev = torch.from_numpy(words.view(np.int32).copy()).to(
                torch.device("cuda", ctx.device_id)
            )
        elif lib == "cupy" and not ctx.simulator:
            import cupy

            dev = cupy.asarray(words)
        else:
            from numba import cuda

            dev = cuda.to_device(words)
        _SIGN_CACHE[key] = dev
    return ctx.view(dev, np.uint32)
