"""Host side of the FP4Quant codec: allocate the wire buffer, dispatch to the GPU kernels
(``cuda.fp4quant``) or the CPU path (``cpu.fp4quant``).  Called by ``quantize`` / ``dequantize``
after they validated the input."""

from __future__ import annotations

import math

import numpy as np

from . import _arrays as arrays, _plans
from ._devices import on_device, to_numpy
from ._quantized import QuantizedTensor, payload_views


def quantize_fp4quant(x, backend, dt, shape, fmt, stochastic, seed, step, key=None):
    """``key``: the call's plan key (``_plans``) when it is a torch CUDA call."""
    g = fmt.group_size
    n = math.prod(shape)
    nbytes = n // 2 + 2 * (n // g)
    if backend.gpu and key is not None and n:
        plan = _plans.get(key)
        if plan is None:
            plan = _plans.put(key, _encode_plan(x, dt, shape, fmt, stochastic, nbytes))
        return run_encode_plan(plan, x, fmt, seed, step)
    if backend.gpu:
        from .cuda import fp4quant as op

        ctx = arrays.GpuContext(x, backend)
        with on_device(ctx):
            payload = ctx.empty((nbytes,), np.uint8)
            codes, scales = payload_views(payload, shape, n, g, backend.lib)
            op.encode(
                ctx, x, codes, scales, n, seed, step, arrays.KIND_OF_DTYPE[dt], g,
                fmt.hadamard, stochastic,
            )  # fmt: skip
        return _quantized(codes, scales, fmt, shape, dt, payload)
    from .cpu import fp4quant as cpu

    payload = np.empty(nbytes, np.uint8)
    codes, scales = payload_views(payload, shape, n, g, "numpy")
    cpu.encode(
        arrays.cpu_bits(x, dt),
        arrays.KIND_OF_DTYPE[dt],
        g,
        cpu.stage_strides(g),
        fmt.hadamard,
        stochastic,
        np.uint32(seed & 0xFFFFFFFF),
        np.uint32(seed >> 32),
        np.uint32(step),
        codes.reshape(-1),
        scales.reshape(-1),
    )
    if backend.lib == "torch":
        import torch

        payload = torch.from_numpy(payload)
        codes, scales = payload_views(payload, shape, n, g, "torch")
    return _quantized(codes, scales, fmt, shape, dt, payload)


def _encode_plan(x, dt, shape, fmt, stochastic, nbytes):
    """Record the launch of a checked FP4Quant encode (see ``_plans``)."""
    from .cuda import fp4quant as op

    n = math.prod(shape)
    tracer = _plans.Tracer(x.device.index)
    vx = tracer.input(x)
    with on_device(tracer):
        payload = tracer.empty((nbytes,), np.uint8)
        codes, scales = payload_views(payload, shape, n, fmt.group_size, "torch")
        op.encode(
            tracer, vx, codes, scales, n, _plans.PROBE_SEED, _plans.PROBE_STEP,
            arrays.KIND_OF_DTYPE[dt], fmt.group_size, fmt.hadamard, stochastic,
        )  # fmt: skip
    plan = tracer.plan((payload, codes, scales), (0, 1, 2))
    plan.shape = shape
    return plan


def run_encode_plan(plan, x, fmt, seed, step):
    """One planned FP4Quant encode."""
    payload, codes, scales = plan((x,), (seed & 0xFFFFFFFF, seed >> 32, step))
    return QuantizedTensor._from_checked(
        {"data": codes, "scales": scales, "global_scale": None, "fmt": fmt, "shape": plan.shape,
         "dtype": x.dtype, "scale_layout": "linear", "payload": payload}
    )  # fmt: skip


def _quantized(codes, scales, fmt, shape, dt, payload):
    return QuantizedTensor(
        data=codes, scales=scales, global_scale=None, fmt=fmt, shape=shape, dtype=dt,
        scale_layout="linear", payload=payload,
    )  # fmt: skip


def dequantize_fp4quant(q, dt, backend, key=None):
    """Decode a validated (``check_quantized``) FP4Quant tensor to dtype ``dt``; ``key``: the
    call's plan key (``_plans``) when it is a torch CUDA call."""
    g = q.fmt.group_size
    shape = tuple(q.shape)
    n = math.prod(shape)
    if backend.gpu and key is not None and n:
        plan = _plans.get(key)
        if plan is None:
            plan = _plans.put(key, _decode_plan(q, dt, shape, n))
        return plan((q.data, q.scales))[0]
    if backend.gpu:
        from .cuda import fp4quant as op

        ctx = arrays.GpuContext(q.data, backend)
        with on_device(ctx):
            out = ctx.empty(shape, None, like_dtype=ctx.float_dtype(dt))
            op.decode(ctx, q.data, q.scales, out, n, arrays.KIND_OF_DTYPE[dt], g, q.fmt.hadamard)
        return out
    from .cpu import fp4quant as cpu

    codes = np.ascontiguousarray(to_numpy(q.data)).reshape(-1).view(np.uint8)
    scales = np.ascontiguousarray(to_numpy(q.scales)).reshape(-1).view(np.uint16)
    out_bits = np.empty(n, arrays.BITS_DTYPE[dt])
    cpu.decode(
        codes,
        scales,
        g,
        cpu.stage_strides(g),
        q.fmt.hadamard,
        np.float32(2.0 ** -(g.bit_length() - 1)),
        out_bits,
        arrays.KIND_OF_DTYPE[dt],
    )
    return arrays.cpu_from_bits(out_bits, dt, shape, backend)


def _decode_plan(q, dt, shape, n):
    """Record the launch of a checked FP4Quant decode (see ``_plans``)."""
    from .cuda import fp4quant as op

    tracer = _plans.Tracer(q.data.device.index)
    codes, scales = tracer.input(q.data), tracer.input(q.scales)
    with on_device(tracer):
        out = tracer.empty(shape, None, like_dtype=tracer.float_dtype(dt))
        op.decode(
            tracer, codes, scales, out, n, arrays.KIND_OF_DTYPE[dt], q.fmt.group_size,
            q.fmt.hadamard,
        )  # fmt: skip
    return tracer.plan((out,))
