"""Public entry points: ``quantize``, ``dequantize``, ``quantize_dequantize``.

A call is checked once and described by a frozen descriptor (``_calls``), then runs where its
arrays live: on the CPU (``cpu.codec``, ``cpu.fp4quant``) or on the GPU through the plan cache
(``_plans``), which runs the op's host function (``cuda.<op>.run``) against the caller's
context or records it into a plan.  Both give bit-identical codes and scales.  A torch CUDA call
of a kind seen before takes none of that: its plan key (the static part of its descriptor, as
the caller gave it) finds the plan, the per-call scalars are checked, the plan launches.
"""

from __future__ import annotations

import numpy as np

from . import _arrays as arrays, _autograd, _plans
from ._calls import (
    AMAX_F32_OVERFLOW,
    AMAX_NUMBER,
    FP4QUANT_KEY,
    STEP_LIMIT,
    DequantizeCall,
    Geometry,
    QuantizeCall,
    QuantizeKey,
    check_choice,
    check_input,
    check_int,
    checked_amax,
    checked_amax_array,
    checked_step_array,
    dequantize_kind,
    format_spec,
    is_number,
    is_torch_tensor,
    normalize_dtype,
    payload_views,
    quantize_kind,
)
from ._quantized import (
    SCALE_LAYOUTS,
    Array,
    DType,
    Format,
    FP4Quant,
    QuantizedTensor,
    Rounding,
    ScaleLayout,
    check_quantized,
    leading_dims_agree,
)
from .formats.e2m1 import ROUNDINGS


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
        seed: 0 <= seed < 2**64.  step: 0 <= step < 2**32 (e.g. the training step), or a
            one-element int64 array where ``x`` lives holding it: on the GPU the kernels read
            it when they run (its low 32 bits; not checked, no host synchronization), so a
            CUDA graph that captured the call replays it with the step written there since;
            on the CPU its value is read and checked.  The same bits as the int step.
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
    return _quantize(x, fmt, rounding, seed, step, global_amax, scale_layout, False)


def quantize_dequantize(
    x: Array,
    fmt: Format = "nvfp4",
    rounding: Rounding = "nearest",
    seed: int = 0,
    step: int = 0,
    global_amax: float | Array | None = None,
) -> Array:
    """Fused fake-quantization: ``dequantize(quantize(x, ...))`` in one pass, same dtype as x.

    Bit-identical to the two-step version; on the GPU one kernel reads x and writes the result,
    the codes and scales never touch memory (NVFP4 without ``global_amax`` reads x once more
    before, for its tensor amax; FP4Quant runs two kernels, encode then decode, through the
    wire buffer).

    Autograd: for a torch tensor that requires grad (with grad mode on) the result requires
    grad too, and the gradient passes straight through: ``d(out)/dx`` is the identity, as in
    torchao's fake quantization (the values are the same bits as without grad).
    """
    # (requires_grad read here first: a tensor without it takes no call into _autograd)
    if getattr(x, "requires_grad", False) and _autograd.requires_autograd(x):

        def qdq(t):
            return _quantize(t, fmt, rounding, seed, step, global_amax, "linear", True)

        return _autograd.fake_quantize(x, qdq)
    return _quantize(x, fmt, rounding, seed, step, global_amax, "linear", True)


def _quantize(x, fmt, rounding, seed, step, global_amax, scale_layout, fused):
    key = _quantize_key(x, fmt, rounding, step, global_amax, scale_layout, fused)
    plan = _plans.get(key)
    if plan is None and key is not None:  # a new shape of a kind of call planned before?
        plan = _plans.shape_plan(key, quantize_kind(key), _plan_inputs(key, x, step, global_amax))
    # (a value the full checks would refuse, a float amax beyond float32's range among them,
    # takes the checked path below, which names it)
    if (
        plan is not None
        and type(seed) is int
        and 0 <= seed < 2**64
        and ((type(step) is int and 0 <= step < STEP_LIMIT) or key.step is not None)
        and (
            key.amax != AMAX_NUMBER
            or (type(global_amax) is float and 0 <= global_amax < AMAX_F32_OVERFLOW)
        )
    ):
        return _run_quantize_plan(plan, key, fmt, x, seed, step, global_amax)
    call = _quantize_call(x, fmt, rounding, seed, step, global_amax, scale_layout, fused, key)
    if not call.backend.gpu:
        return _quantize_result(call, _quantize_cpu(call))
    if isinstance(call.fmt, FP4Quant):
        from .cuda import fp4quant

        host = fp4quant.run_quantize_dequantize if fused else fp4quant.run_encode
    elif fused:
        from .cuda.quantize_dequantize import run as host
    else:
        from .cuda.quantize import run as host
    plan = _plans.plan_for(call, host) if call.geometry.n else None
    if plan is None:
        outputs = _plans.run_unplanned(call, host)
        return outputs[0] if fused else _quantize_result(call, outputs)
    amax = call.amax_value if call.key.amax == AMAX_NUMBER else call.amax_array
    step = call.step if call.step_array is None else call.step_array
    return _run_quantize_plan(plan, key, fmt, x, call.seed, step, amax)


def _quantize_key(x, fmt, rounding, step, global_amax, scale_layout, fused):
    """The plan key of a torch CUDA call (``_plans``), or None."""
    policy = _plans.plan_policy()
    xk = _plans.tensor_key(x)
    if xk is None or policy is _plans.NO_PLAN:
        return None
    sk = None if type(step) is int else _plans.tensor_key(step)  # (an int: no call)
    if global_amax is None:
        ak = None
    elif type(global_amax) is float or is_number(global_amax):  # (a float: no call)
        ak = AMAX_NUMBER
    else:
        ak = _plans.tensor_key(global_amax)
        if ak is None:
            return None
    if type(fmt) is FP4Quant:
        fmt = (FP4QUANT_KEY, fmt.group_size, fmt.hadamard)
    return QuantizeKey(xk, fmt, rounding, scale_layout, ak, fused, policy, sk)


def _quantize_call(x, fmt, rounding, seed, step, global_amax, scale_layout, fused, key):
    """The descriptor of a quantize call, every argument checked."""
    spec = format_spec(fmt)
    check_choice(rounding, "rounding", ROUNDINGS)
    check_choice(scale_layout, "scale_layout", SCALE_LAYOUTS)
    seed = check_int(seed, "seed", 0, 2**64)
    # (a torch tensor first: hasattr on a nested tensor's shape raises torch's internal error)
    step_is_array = is_torch_tensor(step) or (
        hasattr(step, "shape") and not isinstance(step, np.generic)
    )
    if not step_is_array:
        step = check_int(step, "step", 0, STEP_LIMIT)
    if isinstance(spec, FP4Quant):
        block, what = spec.group_size, "FP4Quant group size"
    else:
        block, what = spec.block_size, f"{spec.name.upper()} block size"
    backend, dt, shape = check_input(x, block, what)
    step, step_array = _checked_step(step, backend) if step_is_array else (step, None)
    amax_value, amax_array = -1.0, None
    if isinstance(spec, FP4Quant):
        if global_amax is not None:
            raise ValueError("global_amax: FP4Quant has no tensor scale; leave it None")
        if scale_layout != "linear":
            raise ValueError("scale_layout: FP4Quant stores its scales linearly (after the codes)")
    elif global_amax is not None:
        if not spec.tensor_scale:
            raise ValueError("global_amax: only NVFP4 has a tensor scale; MXFP4 takes none")
        if is_number(global_amax):
            amax_value = checked_amax(global_amax)
        elif backend.gpu:
            amax_array = checked_amax_array(global_amax, backend)
        else:  # on the CPU the array can be read and checked like a float
            checked_amax_array(global_amax, backend)
            host = np.asarray(arrays.to_numpy(global_amax), np.float32).reshape(-1)[0]
            amax_value = checked_amax(host)
    return QuantizeCall(
        x=x, backend=backend, dtype=dt, fmt=spec, geometry=Geometry.of(shape, block, scale_layout),
        stochastic=rounding == "stochastic", seed=seed, step=step, amax_value=amax_value,
        amax_array=amax_array, fused=fused, key=key, step_array=step_array,
    )  # fmt: skip


def _checked_step(step, backend):
    """(step, step_array) of a ``step`` given as an array: on the GPU the array, which the
    kernels read (step 0); on the CPU its value, checked as an int step."""
    checked_step_array(step, backend)
    if backend.gpu:
        return 0, step
    value = int(np.asarray(arrays.to_numpy(step)).reshape(-1)[0])
    return check_int(value, "step", 0, STEP_LIMIT), None


def _plan_inputs(key, x, step, global_amax):
    """The arrays of a planned quantize, in the order its plan takes them."""
    inputs = (x,) if key.amax is None or key.amax == AMAX_NUMBER else (x, global_amax)
    return inputs if key.step is None else (*inputs, step)


def _run_quantize_plan(plan, key, fmt, x, seed, step, global_amax):
    """One planned quantize of ``fmt`` as the caller gave it; ``global_amax`` and ``step`` as
    its key says (None, a float or an array; an int or an array)."""
    number = key.amax == AMAX_NUMBER
    inputs = (x,) if key.amax is None or number else (x, global_amax)  # (``_plan_inputs``,
    if key.step is not None:  # written out: a warm call makes no call it can do without)
        inputs, step = (*inputs, step), 0
    outputs = plan(
        inputs, (seed & 0xFFFFFFFF, seed >> 32, step, np.float32(global_amax) if number else 0.0)
    )
    if key.fused:  # (the host functions of a fused call return (out,), FP4Quant's too)
        return outputs[0]
    shape = tuple(x.shape)
    if isinstance(fmt, FP4Quant):  # (a subclass too: its key holds it as given)
        payload, codes, scales = outputs
        return _plans.planned_tensor(codes, scales, None, fmt, shape, x.dtype, "linear", payload)
    data, scales, gs, _ = outputs
    return _plans.planned_tensor(data, scales, gs, fmt, shape, x.dtype, key.scale_layout)


def _quantize_cpu(call):
    """The outputs of a CPU quantize as arrays of the caller's kind: (payload, codes, scales)
    for FP4Quant, (out,) for quantize_dequantize, else (data, scales, global_scale, None)."""
    from .cpu import codec, fp4quant

    backend, geo = call.backend, call.geometry
    if isinstance(call.fmt, FP4Quant):
        payload, codes, scales = fp4quant.run_encode(call)
        if backend.lib == "torch":
            payload = arrays.wrap_cpu(payload, backend)
            codes, scales = payload_views(payload, geo.shape, geo.n, call.fmt.group_size, "torch")
        return payload, codes, scales
    packed, scales, s_dec, out_bits = codec.quantize(call)
    if call.fused:
        return (arrays.cpu_from_bits(out_bits, call.dtype, geo.shape, backend),)
    gs = np.array([s_dec], np.float32)
    return tuple(arrays.wrap_cpu(a, backend) for a in (packed, scales, gs)) + (None,)


def _quantize_result(call, outputs):
    """What quantize / quantize_dequantize return for ``call``'s outputs (``_quantize_cpu``'s or
    an unfused host function's, of the caller's kind)."""
    geo = call.geometry
    # torch results: the constructor's work (the dtype as torch's) done here, x's dtype
    # (``_plans.planned_tensor``, as a planned call's; the fields are this call's own outputs)
    make = _plans.planned_tensor if call.backend.lib == "torch" else _checked_tensor
    dtype = call.x.dtype if call.backend.lib == "torch" else call.dtype
    if isinstance(call.fmt, FP4Quant):
        payload, codes, scales = outputs
        q = make(codes, scales, None, call.fmt, geo.shape, dtype, "linear", payload)
        return dequantize(q) if call.fused else q
    if call.fused:
        return outputs[0]
    data, scales, gs, _ = outputs
    layout = "swizzled" if geo.swizzled else "linear"
    return make(data, scales, gs, call.fmt.name, geo.shape, dtype, layout)


def _checked_tensor(data, scales, global_scale, fmt, shape, dtype, scale_layout, payload=None):
    """``_plans.planned_tensor``'s arguments through the constructor (numpy, CuPy, numba)."""
    return QuantizedTensor(
        data=data, scales=scales, global_scale=global_scale, fmt=fmt, shape=shape, dtype=dtype,
        scale_layout=scale_layout, payload=payload,
    )  # fmt: skip


def dequantize(q: QuantizedTensor, dtype: DType | None = None) -> Array:
    """Decode a ``QuantizedTensor`` to ``dtype`` (default: the dtype it was quantized from).

    NVFP4: (e2m1 * float(e4m3 scale)) * global_scale, in float32, rounded once to ``dtype``;
    MXFP4: e2m1 * 2^(e8m0 - 127).  Runs where ``q.data`` lives, output of the same kind.
    The result does not require grad (``quantize`` is not differentiable).
    """
    key = _plans.quantized_key(q, dtype, "dequantize")
    plan = _plans.get(key)
    if plan is None and key is not None and key.scale_layout == "linear" and leading_dims_agree(q):
        # a new shape of a kind planned before: the plan from its kind's, if it has one
        gs = () if q.global_scale is None else (q.global_scale,)
        plan = _plans.shape_plan(key, dequantize_kind(key, q.shape), (q.data, q.scales, *gs))
    if plan is None:
        call = _dequantize_call(q, dtype, key)
        if not call.backend.gpu:
            from .cpu import codec, fp4quant

            cpu = fp4quant.run_decode if isinstance(call.fmt, FP4Quant) else codec.dequantize
            return arrays.cpu_from_bits(cpu(call), call.dtype, q.shape, call.backend)
        if isinstance(call.fmt, FP4Quant):
            from .cuda.fp4quant import run_decode as host
        else:
            from .cuda.dequantize import run as host
        plan = _plans.plan_for(call, host) if call.geometry.n else None
        if plan is None:
            return _plans.run_unplanned(call, host)[0]
    if q.global_scale is None:
        return plan((q.data, q.scales))[0]
    return plan((q.data, q.scales, q.global_scale))[0]


def _dequantize_call(q, dtype, key):
    """The descriptor of a dequantize call, ``q`` checked in full."""
    backend = check_quantized(q)
    dt = normalize_dtype(q.dtype if dtype is None else dtype)
    fmt = format_spec(q.fmt)
    block = fmt.group_size if isinstance(fmt, FP4Quant) else fmt.block_size
    return DequantizeCall(
        data=q.data, scales=q.scales, global_scale=q.global_scale, backend=backend, dtype=dt,
        fmt=fmt, geometry=Geometry.of(q.shape, block, q.scale_layout), key=key,
    )  # fmt: skip
