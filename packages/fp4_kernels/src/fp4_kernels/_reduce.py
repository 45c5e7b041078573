"""``requantized_sum``: the rows of a quantized tensor added in float32 and quantized again.

This is the reduction step of a compressed all-reduce (each rank receives every rank's encoded
chunk, adds them, and encodes the sum for the all-gather).  Its definition is the composition
in ``requantized_sum_reference``; for MXFP4 on a GPU one kernel (``cuda/reduce.py``) computes
the same bits in one pass over the encoded rows.
"""

from __future__ import annotations

import sys

import numpy as np

from . import _arrays as arrays, _plans
from ._api import _dequantize_key, dequantize, quantize
from ._devices import fill_one, on_device
from ._quantized import FP4Quant, QuantizedTensor, check_quantized


def _rows_and_n(q):
    check_quantized(q)
    if len(q.shape) != 2 or q.shape[0] < 1:
        raise ValueError(
            f"q.shape: {tuple(q.shape)}: expected (rows, n) with rows >= 1 (the rows are "
            "summed); reshape the tensor that was quantized to two dimensions"
        )
    return q.shape[0], q.shape[1]


def requantized_sum_reference(q):
    """The definition: ``d = dequantize(q, "float32")``, ``acc = d[0]`` then ``acc + d[1]``,
    ``+ d[2]``, ... (IEEE float32 adds in row order; row 0 alone is not added to a zero, so -0
    stays -0), then ``quantize(acc[None], q.fmt)`` with round-to-nearest-even and q's scale
    layout.  numpy, torch and CuPy arrays."""
    rows, n = _rows_and_n(q)
    if arrays.backend_of(q.data, "q.data").lib == "numba":
        raise TypeError(
            "q.data: numba device arrays have no elementwise add; requantized_sum runs on them "
            "for MXFP4 with the linear scale layout only (use torch or CuPy for the others)"
        )
    d = dequantize(q, "float32")
    acc = d[0] if rows == 1 else d[0] + d[1]
    for i in range(2, rows):
        acc = acc + d[i]
    acc = acc.reshape(1, n)
    if isinstance(q.fmt, FP4Quant):
        return quantize(acc, fmt=q.fmt)
    return quantize(acc, fmt=q.fmt, scale_layout=q.scale_layout)


def requantized_sum(q: QuantizedTensor) -> QuantizedTensor:
    """Sum over the rows of a (rows, n) ``QuantizedTensor``, in float32, quantized again to the
    same format (round to nearest even): a (1, n) ``QuantizedTensor`` of dtype float32.

    Bit for bit ``requantized_sum_reference(q)`` (decode, add the rows in order, encode).  MXFP4
    with the linear scale layout on a GPU runs one kernel that reads the encoded rows once and
    writes the encoded sum (no float32 intermediate); every other case runs the composition.
    A block whose sum is not finite (a NaN-scale row block, or an overflow) gets the NaN scale.
    """
    key = _dequantize_key(q, None, op="requantized_sum")
    if key is not None:
        plan = _plans.get(key)
        if plan is not None:
            return _run_sum_plan(plan, q)
    rows, n = _rows_and_n(q)
    backend = arrays.backend_of(q.data, "q.data")
    if not (backend.gpu and q.fmt == "mxfp4" and q.scale_layout == "linear"):
        return requantized_sum_reference(q)
    if key is not None and n:
        plan = _plans.get(key)
        if plan is None:
            plan = _plans.put(key, _sum_plan(q, rows, n))
        return _run_sum_plan(plan, q)
    ctx = arrays.GpuContext(q.data, backend)
    with on_device(ctx):
        codes = ctx.empty((1, n // 2), np.uint8)
        scales = ctx.empty((1, n // 32), np.uint8)
        gs = ctx.empty((1,), np.float32)
        if n == 0:
            fill_one(gs, ctx)
        else:
            from .cuda import reduce as op

            op.requantized_sum_mxfp4(ctx, q.data, q.scales, rows, codes, scales, gs, n)
    return QuantizedTensor(
        data=codes, scales=scales, global_scale=gs, fmt="mxfp4", shape=(1, n), dtype="float32",
        scale_layout="linear",
    )  # fmt: skip


def _sum_plan(q, rows, n):
    """Record the launch of a checked one-kernel MXFP4 sum (see ``_plans``)."""
    from .cuda import reduce as op

    tracer = _plans.Tracer(q.data.device.index)
    data, scales = tracer.input(q.data), tracer.input(q.scales)
    with on_device(tracer):
        codes = tracer.empty((1, n // 2), np.uint8)
        scales_out = tracer.empty((1, n // 32), np.uint8)
        gs = tracer.empty((1,), np.float32)
        op.requantized_sum_mxfp4(tracer, data, scales, rows, codes, scales_out, gs, n)
    plan = tracer.plan((codes, scales_out, gs))
    plan.shape = (1, n)
    return plan


def _run_sum_plan(plan, q):
    codes, scales, gs = plan((q.data, q.scales))
    torch = sys.modules["torch"]
    return QuantizedTensor._from_checked(
        {"data": codes, "scales": scales, "global_scale": gs, "fmt": "mxfp4", "shape": plan.shape,
         "dtype": torch.float32, "scale_layout": "linear", "payload": None}
    )  # fmt: skip
