"""Public entry points: ``quantize``, ``dequantize``, ``quantize_dequantize``.

Validate -> allocate (through the caller's own array library) -> dispatch to the CUDA kernels
(GPU arrays) or the numba CPU path (numpy arrays, torch CPU tensors).  Both give bit-identical
codes and scales.
"""

from __future__ import annotations

import math

import numpy as np

from . import _arrays as arrays, _autograd, _plans
from ._devices import fill_one, on_device, to_numpy
from ._fp4quant import dequantize_fp4quant, quantize_fp4quant, run_encode_plan
from ._quantized import (
    SCALE_LAYOUTS,
    SPECS,
    Array,
    DType,
    Format,
    FP4Quant,
    QuantizedTensor,
    Rounding,
    ScaleLayout,
    _check_choice,
    _check_field,
    _check_fmt,
    _check_int,
    _geometry,
    check_quantized,
)
from .formats.e2m1 import ROUNDINGS


def _validate_input(x, fmt):
    backend = arrays.backend_of(x, "x")
    arrays.check_has_values(x, backend, "x")
    dt = arrays.dtype_name(x, backend, "x")
    shape = tuple(int(s) for s in x.shape)
    if len(shape) == 0:
        raise ValueError("x: a 0-d array has no last dimension to quantize; reshape to (1, K)")
    if isinstance(fmt, FP4Quant):
        block, what = fmt.group_size, "FP4Quant group size"
    else:
        block, what = SPECS[fmt].block_size, f"{fmt.upper()} block size"
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


def quantize(
    x: Array,
    fmt: Format = "nvfp4",
    rounding: Rounding = "nearest",
    seed: int = 0,
    step: int = 0,
    global_amax: float | Array | None = None,
    scale_layout: ScaleLayout = "linear",
) -> QuantizedTensor:
    """Quantize ``x`` (..., K) to NVFP4 or MXFP4 along its last dimension.

    Args:
        x: float32 / bfloat16 / float16, C-contiguous, K a multiple of the block size (16 for
            NVFP4, 32 for MXFP4).  torch CUDA tensors, CuPy arrays and numba device arrays run
            on the GPU on the caller's current stream (zero-copy, no host synchronization);
            numpy arrays and torch CPU tensors run on the CPU.  Outputs are of the input's kind.
        fmt: "nvfp4" (16-element blocks, e4m3 block scales, float32 tensor scale as in
            NVIDIA Transformer Engine), "mxfp4" (OCP MX v1.0: 32-element blocks, e8m0 scales)
            or ``FP4Quant(group_size, hadamard)`` (K a multiple of the group size; one bf16
            scale per group; ``global_amax`` and ``scale_layout`` do not apply).
        rounding: "nearest" (round to nearest even) or "stochastic": between the two
            neighbouring e2m1 values, up with probability p rounded to 16 bits for a fractional
            distance p (unbiased up to 2^-17 of a grid step).  16 random bits an element come
            from Philox4x32-10 with key = seed and counter = (element index // 8, step):
            independent of the launch configuration and identical on the GPU and the CPU.
        seed: 0 <= seed < 2**64.  step: 0 <= step < 2**32 (e.g. the training step).
        global_amax: NVFP4 only: the amax that sets the tensor scale (for a scale shared across
            ranks or steps); a non-negative float within float32's range (<= 3.4028235e38:
            the tensor scale is computed in float32), or a one-element float32 array on the
            same device (read by the kernel, no host synchronization, so a GPU array is not
            checked: a NaN, infinite or zero value there gives S = 1, a negative one a negative
            S).  Default: amax of the finite elements of ``x``.
        scale_layout: "linear" (rows x K/block) or "swizzled" (cuBLASLt's 128x4 tiles, padded
            with zeros).

    Non-finite policy: a block containing NaN or +-Inf gets the NaN scale code (e4m3 0x7F /
    e8m0 0xFF) and decodes entirely to NaN; the tensor amax ignores non-finite values; the rest
    of the tensor is unaffected.  All-zero blocks and tensors decode to exact zeros.  Signed
    zero is preserved: -0 and negative values that round to zero get the code 0x8 (-0).

    Autograd: not differentiable.  The codes are integers (as ``torch.argmax``'s indices), so
    for a torch tensor that requires grad the fields carry no graph, and neither does
    ``dequantize(q)``; ``quantize_dequantize`` is the differentiable route (straight-through
    gradient).
    """
    return _quantize(x, fmt, rounding, seed, step, global_amax, scale_layout, fused=False)


def quantize_dequantize(
    x: Array,
    fmt: Format = "nvfp4",
    rounding: Rounding = "nearest",
    seed: int = 0,
    step: int = 0,
    global_amax: float | Array | None = None,
) -> Array:
    """Fused fake-quantization: ``dequantize(quantize(x, ...))`` in one pass, same dtype as x.

    Bit-identical to the two-step version; the codes and scales never touch memory (for
    FP4Quant it is the two kernels, encode then decode, through the wire buffer).

    Autograd: for a torch tensor that requires grad (with grad mode on) the result requires
    grad too, and the gradient passes straight through: ``d(out)/dx`` is the identity, as in
    torchao's fake quantization (the values are the same bits as without grad).
    """
    if _autograd.requires_autograd(x):

        def qdq(t):
            return _quantize(t, fmt, rounding, seed, step, global_amax, "linear", fused=True)

        return _autograd.fake_quantize(x, qdq)
    return _quantize(x, fmt, rounding, seed, step, global_amax, "linear", fused=True)


def _quantize_key(x, fmt, rounding, global_amax, scale_layout, fused):
    """The plan key of a torch CUDA call (``_plans``), or None."""
    if not _plans.enabled():
        return None
    xk = _plans.tensor_key(x)
    if xk is None:
        return None
    if global_amax is None:
        ak = None
    elif type(global_amax) is float or (
        isinstance(global_amax, (int, np.floating, np.integer)) and type(global_amax) is not bool
    ):
        ak = "number"
    else:
        ak = _plans.tensor_key(global_amax)
        if ak is None:
            return None
    return ("quantize", xk, fmt, rounding, scale_layout, ak, fused, _plans.policy())


def _quantize(x, fmt, rounding, seed, step, global_amax, scale_layout, fused):
    key = _quantize_key(x, fmt, rounding, global_amax, scale_layout, fused)
    if key is not None:
        plan = _plans.get(key)
        if (
            plan is not None
            and type(seed) is int
            and 0 <= seed < 2**64
            and type(step) is int
            and 0 <= step < 2**32
        ):
            if type(fmt) is FP4Quant:
                q = run_encode_plan(plan, x, fmt, seed, step)
                return dequantize(q) if fused else q
            # a float amax the full check would refuse takes the unplanned path, which names it
            amax_value = -1.0 if key[5] != "number" else _plannable_amax(global_amax)
            if amax_value is not None:
                return _run_quantize_plan(plan, x, fmt, seed, step, global_amax, amax_value)
    _check_fmt(fmt)
    _check_choice(rounding, "rounding", ROUNDINGS)
    _check_choice(scale_layout, "scale_layout", SCALE_LAYOUTS)
    seed = _check_int(seed, "seed", 0, 2**64)
    step = _check_int(step, "step", 0, 2**32)
    backend, dt, shape = _validate_input(x, fmt)
    if isinstance(fmt, FP4Quant):
        if global_amax is not None:
            raise ValueError("global_amax: FP4Quant has no tensor scale; leave it None")
        if scale_layout != "linear":
            raise ValueError("scale_layout: FP4Quant stores its scales linearly (after the codes)")
        stochastic = rounding == "stochastic"
        q = quantize_fp4quant(x, backend, dt, shape, fmt, stochastic, seed, step, key)
        return dequantize(q) if fused else q
    spec = SPECS[fmt]
    amax_value, amax_array = -1.0, None
    if global_amax is not None:
        if not spec.tensor_scale:
            raise ValueError("global_amax: only NVFP4 has a tensor scale; MXFP4 takes none")
        if isinstance(global_amax, (int, float, np.floating, np.integer)) and not isinstance(
            global_amax, bool
        ):
            amax_value = _checked_amax(global_amax)
        else:
            amax_array = _checked_amax_array(global_amax, backend)
    geo = _geometry(shape, spec, scale_layout)
    stochastic = rounding == "stochastic"
    if backend.gpu:
        if key is not None and geo.n:
            plan = _plans.get(key)
            if plan is None:
                plan = _plans.put(key, _quantize_plan(x, amax_array, dt, spec, geo, key, fused))
            return _run_quantize_plan(plan, x, fmt, seed, step, amax_array, amax_value)
        return _quantize_gpu(
            x, backend, dt, spec, geo, stochastic, seed, step, amax_value, amax_array, fused
        )
    if amax_array is not None:  # on the CPU the array can be read and checked like a float
        amax_value = _checked_amax(np.asarray(to_numpy(amax_array), np.float32).reshape(-1)[0])
    from .cpu import codec

    bits = arrays.cpu_bits(x, dt)
    packed = np.empty(shape[:-1] + (shape[-1] // 2,), np.uint8)
    scales = (np.zeros if geo.pad else np.empty)(geo.scale_shape, np.uint8)
    out_bits = np.empty(geo.n if fused else 0, bits.dtype)
    s_dec = codec.quantize_blocks(
        bits,
        arrays.KIND_OF_DTYPE[dt],
        spec.tensor_scale,
        spec.block_size,
        stochastic,
        geo.swizzled,
        geo.kb,
        geo.padded_kb,
        np.float32(amax_value),
        np.uint32(seed & 0xFFFFFFFF),
        np.uint32(seed >> 32),
        np.uint32(step),
        packed.reshape(-1),
        scales.reshape(-1),
        fused,
        out_bits,
    )
    if fused:
        return arrays.cpu_from_bits(out_bits, dt, shape, backend)
    gs = np.array([s_dec], np.float32)
    return QuantizedTensor(
        data=arrays.wrap_cpu(packed, backend),
        scales=arrays.wrap_cpu(scales, backend),
        global_scale=arrays.wrap_cpu(gs, backend),
        fmt=fmt,
        shape=shape,
        dtype=dt,
        scale_layout=scale_layout,
    )


# The tensor scale is computed from float32(global_amax): a float from 2^128 - 2^103 up (half
# an ulp above FLT_MAX = 2^128 - 2^104) rounds to inf there, and S would silently become 1.
_AMAX_F32_OVERFLOW = 2.0**128 - 2.0**103


def _plannable_amax(value):
    """``float(value)`` when the full check (``_checked_amax``) accepts it, else None."""
    try:
        v = float(value)
    except OverflowError:  # an int beyond float64's range
        return None
    return v if 0.0 <= v < _AMAX_F32_OVERFLOW else None


def _checked_amax(value):
    """``global_amax`` as a float, or ValueError unless it is finite, >= 0 and within float32's
    range."""
    try:
        v, shown = float(value), repr(value)
    except OverflowError:  # an int beyond float64's range (its repr may be too long to print)
        v = _AMAX_F32_OVERFLOW if value > 0 else -math.inf
        shown = f"an integer of {value.bit_length()} bits"
    if not (math.isfinite(v) and v >= 0):
        raise ValueError(f"global_amax: must be finite and >= 0, got {shown}")
    if v >= _AMAX_F32_OVERFLOW:
        raise ValueError(
            f"global_amax: {shown} is beyond float32's range (largest finite value "
            f"{float(np.finfo(np.float32).max)!r}), in which the tensor scale is computed; "
            "pass at most that (the amax of a float32, bfloat16 or float16 tensor always is)"
        )
    return v


def _checked_amax_array(a, backend):
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
    _check_field(a, b, "global_amax", "float32", None, size=1)
    return a


def _quantize_gpu(x, backend, dt, spec, geo, stochastic, seed, step, amax_value, amax_array, fused):
    from .cuda import quantize as op

    ctx = arrays.GpuContext(x, backend)
    with on_device(ctx):
        data, scales, gs, out = op.quantize(
            ctx, x, arrays.KIND_OF_DTYPE[dt], spec, geo, stochastic, seed, step,
            amax_value, amax_array, fused,
        )  # fmt: skip
    if fused:
        return out
    layout = "swizzled" if geo.swizzled else "linear"
    return QuantizedTensor(
        data=data, scales=scales, global_scale=gs, fmt=spec.name, shape=geo.shape, dtype=dt,
        scale_layout=layout,
    )  # fmt: skip


def _quantize_plan(x, amax_array, dt, spec, geo, key, fused):
    """Record the launches of a checked NVFP4 / MXFP4 call (see ``_plans``)."""
    from .cuda import quantize as op

    tracer = _plans.Tracer(x.device.index)
    vx, va = tracer.input(x), tracer.input(amax_array)
    amax_value = _plans.PROBE_AMAX if key[5] == "number" else -1.0
    stochastic = key[3] == "stochastic"
    with on_device(tracer):  # the kernels compile for the input's device
        result = op.quantize(
            tracer, vx, arrays.KIND_OF_DTYPE[dt], spec, geo, stochastic,
            _plans.PROBE_SEED, _plans.PROBE_STEP, amax_value, va, fused,
        )  # fmt: skip
    plan = tracer.plan(result, (0, 1, 2, 3) if key[5] == "number" else (0, 1, 2))
    plan.shape = geo.shape
    plan.scale_layout = "swizzled" if geo.swizzled else "linear"
    plan.fused = fused
    return plan


def _run_quantize_plan(plan, x, fmt, seed, step, amax_array, amax_value):
    """One planned NVFP4 / MXFP4 call; ``amax_array`` is ``global_amax`` when it is a tensor."""
    inputs = (x, amax_array) if plan.n_inputs == 2 else (x,)
    amax32 = np.float32(amax_value) if amax_value >= 0 else 0.0  # a probe slot only if >= 0
    scalars = (seed & 0xFFFFFFFF, seed >> 32, step, amax32)
    data, scales, gs, out = plan(inputs, scalars)
    if plan.fused:
        return out
    return QuantizedTensor._from_checked(
        {"data": data, "scales": scales, "global_scale": gs, "fmt": fmt, "shape": plan.shape,
         "dtype": x.dtype, "scale_layout": plan.scale_layout, "payload": None}
    )  # fmt: skip


def _dequantize_key(q, dtype, op="dequantize"):
    """The plan key of a torch CUDA ``dequantize`` (or another ``op`` reading a quantized
    tensor) (``_plans``), or None."""
    if type(q) is not QuantizedTensor or not _plans.enabled():
        return None
    dk, sk = _plans.tensor_key(q.data), _plans.tensor_key(q.scales)
    if dk is None or sk is None:
        return None
    gk = None
    if q.global_scale is not None:
        gk = _plans.tensor_key(q.global_scale)
        if gk is None:
            return None
    # repr: a shape of bools or floats equals one of ints, and check_quantized refuses it
    shape = repr(q.shape)
    return (op, q.fmt, shape, q.dtype, q.scale_layout, dk, sk, gk, dtype, _plans.policy())


def _dequantize_inputs(q):
    if q.global_scale is None:
        return (q.data, q.scales)
    return (q.data, q.scales, q.global_scale)


def dequantize(q: QuantizedTensor, dtype: DType | None = None) -> Array:
    """Decode a ``QuantizedTensor`` to ``dtype`` (default: the dtype it was quantized from).

    NVFP4: (e2m1 * float(e4m3 scale)) * global_scale, in float32, rounded once to ``dtype``;
    MXFP4: e2m1 * 2^(e8m0 - 127).  Runs where ``q.data`` lives, output of the same kind.
    The result does not require grad (``quantize`` is not differentiable).
    """
    key = _dequantize_key(q, dtype)
    if key is not None:
        plan = _plans.get(key)
        if plan is not None:
            return plan(_dequantize_inputs(q))[0]
    backend = check_quantized(q)
    dt = arrays.normalize_dtype(q.dtype if dtype is None else dtype)
    if isinstance(q.fmt, FP4Quant):
        return dequantize_fp4quant(q, dt, backend, key)
    spec = SPECS[q.fmt]
    geo = _geometry(q.shape, spec, q.scale_layout)
    n = geo.n
    if backend.gpu and key is not None and n:
        plan = _plans.get(key)
        if plan is None:
            plan = _plans.put(key, _dequantize_plan(q, dt, spec, geo, backend))
        return plan(_dequantize_inputs(q))[0]
    if backend.gpu:
        from .cuda import dequantize as op

        ctx = arrays.GpuContext(q.data, backend)
        with on_device(ctx):
            out = ctx.empty(q.shape, None, like_dtype=ctx.float_dtype(dt))
            op.dequantize(
                ctx, q.data, q.scales, _global_scale_or_one(q, ctx), out,
                arrays.KIND_OF_DTYPE[dt], spec, geo,
            )  # fmt: skip
        return out
    from .cpu import codec

    packed = np.ascontiguousarray(to_numpy(q.data)).reshape(-1)
    scales = np.ascontiguousarray(to_numpy(q.scales)).reshape(-1)
    gs = np.float32(1.0)
    if q.global_scale is not None:
        gs = np.float32(np.asarray(to_numpy(q.global_scale), np.float32).reshape(-1)[0])
    out_bits = np.empty(n, arrays.BITS_DTYPE[dt])
    codec.dequantize_blocks(
        packed,
        scales,
        gs,
        spec.tensor_scale,
        spec.block_size,
        geo.swizzled,
        geo.kb,
        geo.padded_kb,
        out_bits,
        arrays.KIND_OF_DTYPE[dt],
    )
    return arrays.cpu_from_bits(out_bits, dt, q.shape, backend)


def _dequantize_plan(q, dt, spec, geo, backend):
    """Record the launch of a checked NVFP4 / MXFP4 ``dequantize`` (see ``_plans``)."""
    from .cuda import dequantize as op

    tracer = _plans.Tracer(q.data.device.index)
    data, scales = tracer.input(q.data), tracer.input(q.scales)
    with on_device(tracer):
        if q.global_scale is None:
            gs = _global_scale_or_one(q, arrays.GpuContext(q.data, backend))
        else:
            gs = tracer.input(q.global_scale)
        out = tracer.empty(q.shape, None, like_dtype=tracer.float_dtype(dt))
        op.dequantize(tracer, data, scales, gs, out, arrays.KIND_OF_DTYPE[dt], spec, geo)
    return tracer.plan((out,))


def _global_scale_or_one(q, ctx):
    """The tensor decode scale the dequantize kernel reads (MXFP4 has none: a cached 1.0)."""
    if q.global_scale is not None:
        return q.global_scale
    key = (ctx.backend.lib, ctx.device_id)
    one = _ONES.get(key)
    if one is None:
        one = _ONES[key] = ctx.empty((1,), np.float32)
        fill_one(one, ctx)
    return one


_ONES = {}
