"""``requantized_sum``: the rows of a quantized tensor added in float32 and quantized again.

This is the reduction step of a compressed all-reduce (each rank receives every rank's encoded
chunk, adds them, and encodes the sum for the all-gather).  Its definition is the composition
in ``requantized_sum_reference``; for NVFP4 and MXFP4 with the linear scale layout on a GPU the
kernels of ``cuda/reduce.py`` compute the same bits from the encoded rows (MXFP4 one pass,
NVFP4 an amax pass and an encode pass).  NVFP4 rows quantized apart, each under its own tensor
scale (what an all-reduce receives from different ranks), are summed with ``row_scales``.
"""

from __future__ import annotations

import math
import sys

import numpy as np

from . import _arrays as arrays, _plans
from ._api import dequantize, quantize
from ._calls import SPECS, SumCall, backend_of, element_dtype, is_c_contiguous, same_place
from ._quantized import Array, FP4Quant, QuantizedTensor, check_quantized

SUM_OP = "requantized_sum"  # a plan key's op: one tensor scale for every row (or none)
SUM_ROWS_OP = "requantized_sum_rows"  # ... and with a tensor scale a row (``row_scales``)


def _rows_and_n(q):
    backend = check_quantized(q)
    if len(q.shape) != 2 or q.shape[0] < 1:
        raise ValueError(
            f"q.shape: {tuple(q.shape)}: expected (rows, n) with rows >= 1 (the rows are "
            "summed); reshape the tensor that was quantized to two dimensions"
        )
    return backend, q.shape[0], q.shape[1]


def _check_row_scales(q, row_scales, backend, rows):
    """ValueError / TypeError naming ``row_scales`` unless it fits ``q``: NVFP4 with the linear
    scale layout, a C-contiguous float32 array of ``rows`` elements where ``q.data`` lives."""
    if q.fmt != "nvfp4":
        fmt = q.fmt if isinstance(q.fmt, str) else type(q.fmt).__name__
        raise ValueError(
            f"row_scales: {fmt} has no tensor scale for a row to carry (only NVFP4 has one); "
            "pass row_scales=None"
        )
    if q.scale_layout != "linear":
        raise ValueError(
            "row_scales: needs the linear scale layout (each row's block scales in its own "
            "row); quantize the rows with scale_layout='linear'"
        )
    b = backend_of(row_scales, "row_scales")
    same_place(row_scales, backend, "row_scales", "q.data")
    dt = element_dtype(row_scales, b)
    if dt != "float32":
        raise TypeError(
            f"row_scales: dtype {dt}; pass the rows' tensor decode scales 1/S as float32 "
            "(e.g. row_scales.float() or row_scales.astype(np.float32))"
        )
    size = math.prod(int(d) for d in row_scales.shape)
    if size != rows:
        raise ValueError(
            f"row_scales: {size} elements for {rows} rows; pass one tensor decode scale 1/S "
            "a row of q (row r's global_scale at row_scales[r])"
        )
    if not is_c_contiguous(row_scales, b):
        raise ValueError(
            "row_scales: must be C-contiguous (the kernels read it as a flat buffer); pass "
            "row_scales.contiguous() (torch) or np.ascontiguousarray(row_scales)"
        )
    if not b.gpu:  # host values are read here; a GPU array is not (no synchronization)
        v = np.asarray(arrays.to_numpy(row_scales)).reshape(-1)
        bad = ~(np.isfinite(v) & (v > 0))
        if bad.any():
            r = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"row_scales: row {r}'s decode scale is {float(v[r])!r}; a tensor decode scale "
                "1/S is positive and finite (as quantize() returns it in global_scale)"
            )


def requantized_sum_reference(q, row_scales=None):
    """The definition: row r decoded to float32 as a (1, n) tensor of its own (NVFP4: under
    ``row_scales[r]`` when given, else under ``q.global_scale``), ``acc = d[0]`` then
    ``acc + d[1]``, ``+ d[2]``, ... (IEEE float32 adds in row order; row 0 alone is not added
    to a zero, so -0 stays -0), then ``quantize(acc[None], q.fmt)`` with round-to-nearest-even
    and q's scale layout (NVFP4: the tensor scale of the sum's own amax).  numpy, torch and
    CuPy arrays."""
    backend, rows, n = _rows_and_n(q)
    if row_scales is not None:
        _check_row_scales(q, row_scales, backend, rows)
    return _composition(q, row_scales, backend, rows, n)


def _composition(q, row_scales, backend, rows, n):
    """``requantized_sum_reference`` of arguments already checked (``backend``, ``rows``,
    ``n``: ``_rows_and_n``'s)."""
    if backend.lib == "numba":
        raise TypeError(
            "q.data: numba device arrays have no elementwise add; requantized_sum runs on them "
            "for NVFP4 and MXFP4 with the linear scale layout only (use torch or CuPy for the "
            "others)"
        )
    if row_scales is None:
        d = dequantize(q, "float32")
        decoded = [d[i] for i in range(rows)]
    else:
        flat = row_scales.reshape(rows)
        decoded = [
            dequantize(
                QuantizedTensor(
                    data=q.data[r : r + 1],
                    scales=q.scales[r : r + 1],
                    global_scale=flat[r : r + 1],
                    fmt=q.fmt,
                    shape=(1, n),
                    dtype="float32",
                    scale_layout="linear",
                ),  # fmt: skip
                "float32",
            )[0]
            for r in range(rows)
        ]
    acc = decoded[0] if rows == 1 else decoded[0] + decoded[1]
    for i in range(2, rows):
        acc = acc + decoded[i]
    acc = acc.reshape(1, n)
    if isinstance(q.fmt, FP4Quant):
        return quantize(acc, fmt=q.fmt)
    return quantize(acc, fmt=q.fmt, scale_layout=q.scale_layout)


def requantized_sum(q: QuantizedTensor, row_scales: Array | None = None) -> QuantizedTensor:
    """Sum over the rows of a (rows, n) ``QuantizedTensor``, in float32, quantized again to the
    same format (round to nearest even): a (1, n) ``QuantizedTensor`` of dtype float32.

    ``row_scales`` (NVFP4 only): a float32 array of ``rows`` elements where ``q.data`` lives,
    row r's tensor decode scale 1/S (positive and finite: a host array is checked, a GPU array
    is read by the kernels unchecked), used instead of ``q.global_scale``: rows quantized apart,
    each under its own tensor scale (the chunks an all-reduce receives from its ranks), as if
    each row were a (1, n) tensor of its own.  The sum's tensor scale is that of its own amax,
    as ``quantize`` computes it.

    Bit for bit ``requantized_sum_reference(q, row_scales)`` (decode, add the rows in order,
    encode).  NVFP4 and MXFP4 with the linear scale layout on a GPU run kernels that read the
    encoded rows and write the encoded sum (no float32 intermediate; NVFP4 reads the rows
    twice: once for the sum's amax, once to encode); every other case runs the composition.
    A block whose sum is not finite (a NaN-scale row block, an overflow) gets the NaN scale.
    """
    op = SUM_OP if row_scales is None else SUM_ROWS_OP
    key = _plans.quantized_key(q, None, op, row_scales)
    plan = _plans.get(key)
    if plan is None:
        backend, rows, n = _rows_and_n(q)
        if row_scales is not None:
            _check_row_scales(q, row_scales, backend, rows)
        if not (backend.gpu and q.fmt in SPECS and q.scale_layout == "linear"):
            return _composition(q, row_scales, backend, rows, n)
        from .cuda.reduce import run as host

        spec = SPECS[q.fmt]
        gs = None
        if spec.tensor_scale:
            gs = q.global_scale if row_scales is None else row_scales
        call = SumCall(
            data=q.data, scales=q.scales, global_scale=gs, backend=backend, fmt=spec, rows=rows,
            n=n, per_row=row_scales is not None, key=key,
        )  # fmt: skip
        plan = _plans.plan_for(call, host) if n else None
        if plan is None:
            codes, scales, gs = _plans.run_unplanned(call, host)
            return QuantizedTensor(
                data=codes, scales=scales, global_scale=gs, fmt=spec.name, shape=(1, n),
                dtype="float32", scale_layout="linear",
            )  # fmt: skip
    if q.fmt != "nvfp4":
        inputs = (q.data, q.scales)
    else:
        inputs = (q.data, q.scales, q.global_scale if row_scales is None else row_scales)
    codes, scales, gs = plan(inputs)
    torch = sys.modules["torch"]
    shape = (1, q.shape[1])
    return _plans.planned_tensor(codes, scales, gs, q.fmt, shape, torch.float32, "linear")
