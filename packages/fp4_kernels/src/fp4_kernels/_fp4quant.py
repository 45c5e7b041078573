"""Host side of the FP4Quant codec: allocate the wire buffer, dispatch to the GPU kernels
(``cuda.fp4quant``) or the CPU path (``cpu.fp4quant``).  Called by ``quantize`` / ``dequantize``
after they validated the input."""

from __future__ import annotations

import math

import numpy as np

from . import _arrays as arrays
from ._devices import on_device, to_numpy
from ._quantized import QuantizedTensor, payload_views


def quantize_fp4quant(x, backend, dt, shape, fmt, stochastic, seed, step):
    g = fmt.group_size
    n = math.prod(shape)
    nbytes = n // 2 + 2 * (n // g)
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


def _quantized(codes, scales, fmt, shape, dt, payload):
    return QuantizedTensor(
        data=codes, scales=scales, global_scale=None, fmt=fmt, shape=shape, dtype=dt,
        scale_layout="linear", payload=payload,
    )  # fmt: skip


def dequantize_fp4quant(q, dt, backend):
    """Decode a validated (``check_quantized``) FP4Quant tensor to dtype ``dt``."""
    g = q.fmt.group_size
    shape = tuple(q.shape)
    n = math.prod(shape)
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
