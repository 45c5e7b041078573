"""Host side of the CUDA kernels: flat device buffers in, grid chosen, kernel queued on the
caller's stream.  No host synchronization anywhere on this path.

Host time matters: numba's dispatcher costs 25-55 us per launch (it types every argument and
builds a device-array object for each), which makes tensors below tens of megabytes host-bound.
On a real GPU the kernels are therefore compiled once per signature and launched straight
through ``cuda.core.launch`` with the argument layout numba's ABI expects (a 1-D C-contiguous
array is meminfo, parent, nitems, itemsize, data, shape[0], strides[0]).  In the simulator the
ordinary dispatcher runs them.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import numpy as np
from numba import cuda

from ._primitives import SIMULATOR
from .amax import UNROLL as AMAX_UNROLL, amax_kernel
from .dequantize import UNROLL as DEQUANTIZE_UNROLL, dequantize_kernel
from .quantize import BLOCK_SIZES, UNROLL, quantize_kernel

THREADS_PER_BLOCK = 256
CTAS_PER_SM = 8  # persistent grid: enough resident warps to cover DRAM latency

# Tests shrink launches so the simulator (one Python thread per CUDA thread) stays fast and
# grid-stride loops still take several iterations: (threads_per_block, max_blocks) or None.
launch_override = None


class DeviceBuffer(NamedTuple):
    """A flat, C-contiguous device buffer seen as ``n`` elements of ``dtype``."""

    ptr: int
    n: int
    dtype: np.dtype


class StreamRef:
    """A raw CUstream handle in the ``__cuda_stream__`` protocol cuda.core accepts."""

    __slots__ = ("ptr",)

    def __init__(self, ptr):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


_sm_count = {}


def sm_count(device_id):
    n = _sm_count.get(device_id)
    if n is None:
        n = 1 if SIMULATOR else cuda.get_current_device().MULTIPROCESSOR_COUNT
        _sm_count[device_id] = n
    return n


def _grid(chunks_per_cta, n_chunks, device_id):
    """(blocks, threads) when one CTA handles ``chunks_per_cta(threads)`` chunks per pass."""
    if launch_override is not None:
        threads, max_blocks = launch_override
    else:
        threads = THREADS_PER_BLOCK
        max_blocks = sm_count(device_id) * CTAS_PER_SM
    per = chunks_per_cta(threads)
    return max(1, min(max_blocks, (n_chunks + per - 1) // per)), threads


def max_partials(device_id):
    """Size of the partials buffer ``amax_partials`` may fill."""
    if launch_override is not None:
        return launch_override[1]
    return sm_count(device_id) * CTAS_PER_SM


# ---------------------------------------------------------------------- direct launch

_SCALAR_CTYPES = {
    np.dtype(np.int64): ctypes.c_int64,
    np.dtype(np.uint32): ctypes.c_uint32,
    np.dtype(np.float32): ctypes.c_float,
}
_compiled = {}


def _numba_type(a):
    from numba import types
    from numba.np import numpy_support

    if isinstance(a, DeviceBuffer):
        return types.Array(numpy_support.from_dtype(a.dtype), 1, "C")
    return numpy_support.from_dtype(np.asarray(a).dtype)


def _launch(kernel, blocks, threads, stream, args):
    """Queue ``kernel`` on ``stream``; ``args`` are DeviceBuffers (GPU) or numba arrays (sim)
    and numpy scalars.  Returns the number of blocks launched.

    On a GPU the grid is capped at the blocks that can be resident at once (occupancy API):
    the kernels are grid-stride loops, so a persistent grid of exactly one wave does the same
    work without a partly filled second wave at the end.
    """
    if SIMULATOR:
        kernel[blocks, threads, stream](*args)
        return blocks
    from cuda.core import LaunchConfig, launch

    key = (
        kernel,
        tuple(a.dtype.str for a in args),
        tuple(isinstance(a, DeviceBuffer) for a in args),
    )
    cu_kernel = _compiled.get(key)
    if cu_kernel is None:
        compiled = kernel.compile(tuple(_numba_type(a) for a in args))
        compiled.bind()
        cu_kernel = _compiled[key] = compiled._codelibrary.get_cufunc().kernel
    resident = _resident.get((key, threads))
    if resident is None:
        per_sm = cu_kernel.occupancy.max_active_blocks_per_multiprocessor(threads, 0)
        resident = _resident[(key, threads)] = max(1, per_sm) * sm_count(None)
    blocks = min(blocks, resident)
    params = []
    for a in args:
        if isinstance(a, DeviceBuffer):
            size = a.dtype.itemsize
            params += (0, 0, a.n, size, a.ptr, a.n, size)
        else:
            params.append(_SCALAR_CTYPES[a.dtype](a))
    launch(stream, LaunchConfig(grid=blocks, block=threads), cu_kernel, *params)
    return blocks


_resident = {}


# ---------------------------------------------------------------------- the ops


def amax_partials(words, n_chunks, kind, stream, parts, device_id):
    """Queue the amax kernel writing ``parts[:blocks]``; returns how many partials it wrote."""
    blocks, threads = _grid(lambda t: t * AMAX_UNROLL, n_chunks, device_id)
    blocks = min(blocks, parts.n if isinstance(parts, DeviceBuffer) else parts.shape[0])
    return _launch(amax_kernel(kind), blocks, threads, stream, (words, np.int64(n_chunks), parts))


# Which quantize layout runs (see ``quantize.quantize_kernel``): a thread per block or lanes
# sharing a block.  benchmarks/gpu_throughput.py times both; the faster is the default.
QUANTIZE_PER_THREAD = False


def quantize(
    words,
    codes16,
    codes64,
    scales,
    out_words,
    n_chunks,
    kb,
    padded_kb,
    amax_parts,
    n_parts,
    amax_value,
    global_scale,
    seed,
    step,
    *,
    kind,
    fmt,
    stochastic,
    swizzled,
    fused,
    stream,
    device_id,
    per_thread=None,
):
    per_thread = QUANTIZE_PER_THREAD if per_thread is None else per_thread
    kern = quantize_kernel(kind, fmt, stochastic, swizzled, fused, per_thread)
    if per_thread:
        lanes = BLOCK_SIZES[fmt] // 4
        blocks, threads = _grid(lambda t: t * lanes, n_chunks, device_id)
        codes = codes64
    else:
        blocks, threads = _grid(lambda t: t * UNROLL, n_chunks, device_id)
        codes = codes16
    _launch(
        kern,
        blocks,
        threads,
        stream,
        (
            words,
            codes,
            scales,
            out_words,
            np.int64(n_chunks),
            np.int64(kb),
            np.int64(padded_kb),
            amax_parts,
            np.int64(n_parts),
            np.float32(amax_value),
            global_scale,
            np.uint32(seed & 0xFFFFFFFF),
            np.uint32(seed >> 32),
            np.uint32(step),
        ),
    )


def dequantize(
    codes16,
    scales,
    global_scale,
    out_words,
    n_chunks,
    kb,
    padded_kb,
    *,
    out_kind,
    fmt,
    swizzled,
    stream,
    device_id,
):
    kern = dequantize_kernel(out_kind, fmt, swizzled)
    blocks, threads = _grid(lambda t: t * DEQUANTIZE_UNROLL, n_chunks, device_id)
    _launch(
        kern,
        blocks,
        threads,
        stream,
        (
            codes16,
            scales,
            global_scale,
            out_words,
            np.int64(n_chunks),
            np.int64(kb),
            np.int64(padded_kb),
        ),
    )


def requantized_sum_mxfp4(
    codes16, scales, rows, codes_out16, scales_out, global_scale, n_chunks, *, stream, device_id
):
    """Queue the one-pass sum of ``rows`` MXFP4 rows of ``n_chunks`` chunks, requantized."""
    from .reduce import requantized_sum_mxfp4_kernel

    blocks, threads = _grid(lambda t: t, n_chunks, device_id)
    _launch(
        requantized_sum_mxfp4_kernel(),
        blocks,
        threads,
        stream,
        (codes16, scales, np.int64(rows), codes_out16, scales_out, global_scale,
         np.int64(n_chunks)),
    )  # fmt: skip


# ---------------------------------------------------------------------- Hadamard, FP4Quant


def _group_grid(group_size, n_chunks, device_id):
    """(blocks, threads) for the kernels of ``cuda.hadamard`` / ``cuda.fp4quant``: a CTA is one
    group for g >= 1024 (its warps exchange through shared memory), 256 threads otherwise; a
    persistent grid of up to 2048 resident threads per SM."""
    from .hadamard import REGISTERS, threads_per_block

    if launch_override is not None:
        default, max_blocks = launch_override
        threads = threads_per_block(group_size, default)
    else:
        threads = threads_per_block(group_size, THREADS_PER_BLOCK)
        max_blocks = sm_count(device_id) * max(1, 2048 // threads)
    per = threads * REGISTERS // 4
    return max(1, min(max_blocks, (n_chunks + per - 1) // per)), threads


def hadamard(words, out_words, n_chunks, sign_words, *, kind, group_size, inverse, signed,
             stream, device_id):  # fmt: skip
    from .hadamard import hadamard_kernel

    kern = hadamard_kernel(kind, group_size, inverse, signed)
    blocks, threads = _group_grid(group_size, n_chunks, device_id)
    _launch(kern, blocks, threads, stream, (words, out_words, np.int64(n_chunks), sign_words))


def fp4quant_encode(words, codes16, scales16, n_chunks, seed, step, *, kind, group_size,
                    hadamard, stochastic, stream, device_id):  # fmt: skip
    from .fp4quant import fp4quant_encode_kernel

    kern = fp4quant_encode_kernel(kind, group_size, hadamard, stochastic)
    blocks, threads = _group_grid(group_size, n_chunks, device_id)
    args = (
        words,
        codes16,
        scales16,
        np.int64(n_chunks),
        np.uint32(seed & 0xFFFFFFFF),
        np.uint32(seed >> 32),
        np.uint32(step),
    )
    _launch(kern, blocks, threads, stream, args)


def fp4quant_decode(codes16, scales16, out_words, n_chunks, *, out_kind, group_size, hadamard,
                    stream, device_id):  # fmt: skip
    from .fp4quant import fp4quant_decode_kernel

    kern = fp4quant_decode_kernel(out_kind, group_size, hadamard)
    blocks, threads = _group_grid(group_size, n_chunks, device_id)
    _launch(kern, blocks, threads, stream, (codes16, scales16, out_words, np.int64(n_chunks)))
