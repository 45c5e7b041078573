"""``requantized_sum``: the rows of a quantized tensor added in float32 and quantized again.

This is the reduction step of a compressed all-reduce (each rank receives every rank's encoded
chunk, adds them, and encodes the sum for the all-gather).  Its definition is the composition
in ``requantized_sum_reference``; for MXFP4 on a GPU one kernel (``cuda/reduce.py``) computes
the same bits in one pass over the encoded rows.
"""

from __future__ import annotations

import sys

from . import _plans
from ._api import dequantize, planned_tensor, quantize, quantized_key
from ._calls import SumCall, backend_of
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
    if backend_of(q.data, "q.data").lib == "numba":
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
    key = quantized_key(q, None, "requantized_sum")
    plan = _plans.get(key)
    if plan is None:
        rows, n = _rows_and_n(q)
        backend = backend_of(q.data, "q.data")
        if not (backend.gpu and q.fmt == "mxfp4" and q.scale_layout == "linear"):
            return requantized_sum_reference(q)
        from .cuda.reduce import run as host

        call = SumCall(data=q.data, scales=q.scales, backend=backend, rows=rows, n=n, key=key)
        if key is None or n == 0:
            codes, scales, gs = _plans.run_unplanned(call, host)
            return QuantizedTensor(
                data=codes, scales=scales, global_scale=gs, fmt="mxfp4", shape=(1, n),
                dtype="float32", scale_layout="linear",
            )  # fmt: skip
        plan = _plans.plan_for(call, host)
    codes, scales, gs = plan((q.data, q.scales))
    torch = sys.modules["torch"]
    shape = (1, q.shape[1])
    return planned_tensor(codes, scales, gs, "mxfp4", shape, torch.float32, "linear")
