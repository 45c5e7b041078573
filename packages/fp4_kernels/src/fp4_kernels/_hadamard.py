"""Public ``hadamard``: checked into a ``_calls.HadamardCall``, then the GPU kernels
(``cuda.hadamard``, through the plan cache ``_plans``) or the CPU path (``cpu.fp4quant``)."""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence

import numpy as np

from . import _arrays as arrays, _autograd, _plans
from ._calls import (
    HadamardCall,
    HadamardKey,
    backend_of,
    check_has_values,
    dtype_name,
    hadamard_kind,
    is_c_contiguous,
    is_torch_tensor,
)
from ._quantized import Array
from .formats import hadamard as spec


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
    # (requires_grad read here first: a tensor without it takes no call into _autograd)
    if getattr(signs, "requires_grad", False) and _autograd.requires_autograd(signs):
        raise ValueError(
            "signs: a ±1 vector that requires grad; the transform is not differentiated with "
            "respect to its signs (they are constants of the transform): pass signs.detach()"
        )
    if getattr(x, "requires_grad", False) and _autograd.requires_autograd(x):
        # x @ (D H / sqrt(g)) has the adjoint (H D / sqrt(g)), the inverse with the same signs
        # (H is symmetric), and the inverse's adjoint is the forward transform
        return _autograd.linear_transform(
            x,
            lambda t: hadamard(t, group_size=group_size, inverse=inverse, signs=signs),
            lambda g: hadamard(g, group_size=group_size, inverse=not inverse, signs=signs),
        )
    key = _hadamard_key(x, group_size, inverse, signs)
    plan = _plans.get(key)
    if plan is None and key is not None:  # a new shape of a kind of call planned before?
        plan = _plans.shape_plan(key, hadamard_kind(key), (x,))
    if plan is None:
        call = _hadamard_call(x, group_size, inverse, signs, key)
        if not call.backend.gpu:
            from .cpu import fp4quant

            out_bits = fp4quant.run_hadamard(call)
            return arrays.cpu_from_bits(out_bits, call.dtype, tuple(x.shape), call.backend)
        from .cuda.hadamard import run as host

        plan = _plans.plan_for(call, host) if call.n else None
        if plan is None:
            return _plans.run_unplanned(call, host)[0]
    return plan((x,))[0]


def _hadamard_key(x, group_size, inverse, signs):
    """The plan key of a torch CUDA call (``_plans``), or None (signs given as a vector)."""
    if type(group_size) is not int or type(inverse) is not bool:
        return None
    if signs is not None and type(signs) is not int:
        return None
    policy = _plans.plan_policy()
    xk = _plans.tensor_key(x)
    if xk is None or policy is _plans.NO_PLAN:
        return None
    return HadamardKey(xk, group_size, inverse, signs, policy)


def _hadamard_call(x, group_size, inverse, signs, key):
    """The descriptor of a transform, every argument checked."""
    g = spec.check_group_size(group_size)
    if not isinstance(inverse, bool):
        raise TypeError(f"inverse: expected True or False, got {inverse!r}")
    backend = backend_of(x, "x")
    check_has_values(x, backend, "x")
    dt = dtype_name(x, backend, "x")
    shape = tuple(int(s) for s in x.shape)
    if not shape or shape[-1] % g:
        raise ValueError(
            f"x: last dimension of shape {shape} is not a multiple of group_size={g}; "
            f"pad it to a multiple of {g} or choose a group size that divides it"
        )
    if not is_c_contiguous(x, backend):
        raise ValueError("x: must be C-contiguous; call .contiguous() / np.ascontiguousarray")
    return HadamardCall(
        x=x, backend=backend, dtype=dt, group_size=g, inverse=inverse,
        sign_words=_sign_words(signs, g), key=key,
    )  # fmt: skip


@functools.lru_cache(maxsize=256)
def _seed_sign_words(g, seed):
    """``formats.hadamard.sign_words(g, seed)`` once per (g, seed): its numpy Philox took more
    host time than the rest of a first call.  Read-only, as every call of the pair shares it."""
    words = spec.sign_words(g, seed)
    words.flags.writeable = False
    return words


def _sign_words(signs, g):
    """None, a seed or a ±1 vector -> the uint32 sign words (or None)."""
    if signs is None:
        return None
    if isinstance(signs, (int, np.integer)) and not isinstance(signs, bool):
        seed = operator.index(signs)
        if not 0 <= seed < 2**64:
            raise ValueError(f"signs: a seed must be in [0, 2**64), got {seed}")
        return _seed_sign_words(g, seed)
    backend = None
    try:
        backend = backend_of(signs, "signs")
    except TypeError:
        if is_torch_tensor(signs):
            raise  # a torch tensor of a kind that cannot be read: the message says which
    if backend is not None and backend.gpu:
        raise TypeError("signs: pass a seed or a host (numpy / list / torch CPU) ±1 vector")
    if backend is not None:
        check_has_values(signs, backend, "signs")
    try:
        s = np.asarray(arrays.to_numpy(signs) if backend is not None else signs, np.float64)
    except (TypeError, ValueError) as err:  # a dict, a string, a float8 tensor, ...
        raise TypeError(
            f"signs: expected a seed (int) or {g} values of +1 / -1 (a list, a numpy array or "
            f"a torch CPU tensor of a float or int dtype), got {type(signs).__name__} ({err})"
        ) from None
    if s.shape != (g,):
        raise ValueError(f"signs: expected {g} values (one per group position), got {s.shape}")
    if not np.all(np.abs(s) == 1):
        raise ValueError("signs: every entry must be +1 or -1")
    return spec.sign_values_to_words(s)
