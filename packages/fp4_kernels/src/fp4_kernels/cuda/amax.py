"""Tensor amax (max |x| over finite elements) as per-CTA partial maxima: kernel and host side,
and the consumer's reduction of the partials (``tensor_amax_from_partials``).

Launch contract: 1-D grid of at most ``max_partials`` CTAs, any multiple of 32 threads; CTA b
writes ``parts[b]``.  A thread reads ``UNROLL`` 16-byte words a pass (independent loads in
flight before the first use) and takes the max of the finite magnitudes on the raw bits.  No
atomics and no zero-initialised buffer: the consumer (the quantize kernel) reduces the partials
itself, so the NVFP4 quantizer costs two launches and no memset.  NaN and +-Inf are ignored
(they contribute 0), so a stray non-finite value poisons only its own block, not the tensor
scale.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from . import launch
from ._primitives import WARP_SIZE, device_jit, group_max, u32_as_f32
from ._words import ELEMENT_BYTES, U32, U64, make_words_io
from .launch_table import LAUNCHES

LAUNCH = LAUNCHES["amax"]
UNROLL = LAUNCH.items_per_thread  # 16-byte words in flight per thread per pass


@functools.cache
def amax_kernel(kind, aligned=True):
    """Arguments: x (uint32 words, or the element array when not aligned), n_vec (16-byte
    words), parts (float32, one per CTA)."""
    n_words = 4 * UNROLL
    load, _, _, finite_amax_bits, _ = make_words_io(kind, n_words, aligned)
    load4 = make_words_io(kind, 4, aligned)[0]
    finite_amax4 = make_words_io(kind, 4, aligned)[3]

    @cuda.jit
    def kernel(x, n_vec, parts):
        tid = cuda.threadIdx.x
        w = cuda.local.array(n_words, np.uint32)
        m = U32(0)
        nthreads = cuda.blockDim.x
        start = cuda.blockIdx.x * nthreads + tid
        step = cuda.gridDim.x * nthreads
        full = n_vec // UNROLL  # passes of UNROLL consecutive 16-byte words per thread
        for i in range(start, full, step):
            load(x, U64(i) * U64(n_words), w)
            m = max(m, finite_amax_bits(w))
        for i in range(full * UNROLL + start, n_vec, step):  # the last < UNROLL words
            load4(x, U64(i) * U64(4), w)
            m = max(m, finite_amax4(w))
        a = u32_as_f32(m)
        a = group_max(a, WARP_SIZE)
        warp_max = cuda.shared.array(32, dtype=np.float32)
        if tid % WARP_SIZE == 0:
            warp_max[tid // WARP_SIZE] = a
        cuda.syncthreads()  # all warp maxima written before thread 0 combines them
        if tid == 0:
            for k in range(1, nthreads // WARP_SIZE):
                v = warp_max[k]
                if v > a:
                    a = v
            parts[cuda.blockIdx.x] = a

    return kernel


def max_partials(device_id):
    """Size of the partials buffer ``amax_partials`` may fill."""
    return launch.max_blocks(LAUNCH.partials_per_sm, device_id)


def computes_amax(call):
    """Whether the quantize ``call`` (a ``_calls.QuantizeCall``) computes its tensor amax: NVFP4
    without a ``global_amax``."""
    return call.fmt.tensor_scale and call.amax_value < 0 and call.amax_array is None


def scratch_size(call, device_id):
    """float32 elements of the quantize kernels' scratch buffer: [global_scale, amax
    partials...] (one allocation, not two)."""
    return 1 + (max_partials(device_id) if computes_amax(call) else 0)


def tensor_scale_args(ctx, call, xw, aligned, scratch):
    """The quantize kernels' tensor-scale arguments for ``call`` (parts, n_parts, amax_value,
    global_scale): the amax from the caller's one-element ``global_amax`` array, from the
    partials queued here into ``scratch[1:]`` over the words view ``xw`` of ``call.x``, or from
    none (``n_parts`` 0: a ``global_amax`` given as a number, or MXFP4); the tensor scale
    written to ``scratch[0]``."""
    gs = ctx.view(scratch[:1])
    if call.amax_array is not None:
        parts, n_parts = ctx.view(call.amax_array, np.float32), 1
    elif computes_amax(call):
        parts = ctx.view(scratch[1:])
        n_parts = amax_partials(ctx, xw, aligned, call.kind, call.geometry.n, parts)
    else:
        parts, n_parts = gs, 0
    return parts, np.int64(n_parts), np.float32(call.amax_value), gs


def amax_partials(ctx, xw, aligned, kind, n, parts):
    """Queue the amax kernel over the ``n`` elements behind the words view ``xw``, writing
    ``parts[:blocks]``; returns how many partials it wrote."""
    n_vec = n * ELEMENT_BYTES[kind] // 16  # n is a multiple of 16 elements
    threads = launch.threads_for(LAUNCH.threads)
    blocks = launch.grid_for(-(-n_vec // UNROLL), threads)
    blocks = min(blocks, max_partials(ctx.device_id))
    return launch.launch(
        amax_kernel(kind, aligned), blocks, threads, ctx, (xw, np.int64(n_vec), parts)
    )


@device_jit
def tensor_amax_from_partials(parts, n_parts):
    """Max over ``parts`` by the whole CTA (strided read, warp butterfly, shared memory)."""
    tid = cuda.threadIdx.x
    m = np.float32(0.0)
    for i in range(tid, n_parts, cuda.blockDim.x):
        v = parts[i]
        if v > m:
            m = v
    m = group_max(m, WARP_SIZE)
    warp_max = cuda.shared.array(32, dtype=np.float32)
    if tid % WARP_SIZE == 0:
        warp_max[tid // WARP_SIZE] = m
    cuda.syncthreads()  # every warp's partial is visible before anyone reads them
    m = warp_max[0]
    for w in range(1, cuda.blockDim.x // WARP_SIZE):
        v = warp_max[w]
        if v > m:
            m = v
    return m
