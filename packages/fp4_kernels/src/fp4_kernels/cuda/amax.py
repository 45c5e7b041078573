"""Tensor amax (max |x| over finite elements) as per-CTA partial maxima.

Launch contract: 1-D grid of ``n_parts`` CTAs, ``blockDim.x`` a multiple of 32; CTA b writes
``parts[b]``.  No atomics and no zero-initialised buffer: the consumer (the quantize kernel)
reduces the partials itself, so the NVFP4 quantizer costs two launches and no memset.
NaN and +-Inf are ignored (they contribute 0), so a stray non-finite value poisons only its own
block, not the tensor scale.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from ._chunk import finite_abs, make_chunk_io
from ._primitives import WARP_SIZE, device_jit, group_max

UNROLL = 4


@functools.cache
def amax_kernel(kind):
    load_chunk = make_chunk_io(kind)[0]

    @device_jit
    def chunk_amax(words, c, n_chunks):
        v0, v1, v2, v3 = load_chunk(words, c, n_chunks)
        a = max(finite_abs(v0), finite_abs(v1))
        b = max(finite_abs(v2), finite_abs(v3))
        return max(a, b)

    @cuda.jit
    def kernel(words, n_chunks, parts):
        tid = cuda.threadIdx.x
        m = np.float32(0.0)
        nthreads = cuda.blockDim.x
        tile = nthreads * UNROLL
        n_tiles = (n_chunks + tile - 1) // tile
        for t in range(cuda.blockIdx.x, n_tiles, cuda.gridDim.x):
            # UNROLL independent loads in flight per thread (one at a time is latency-bound)
            c0 = t * tile + tid
            a0 = chunk_amax(words, c0, n_chunks)
            a1 = chunk_amax(words, c0 + nthreads, n_chunks)
            a2 = chunk_amax(words, c0 + 2 * nthreads, n_chunks)
            a3 = chunk_amax(words, c0 + 3 * nthreads, n_chunks)
            m = max(m, max(max(a0, a1), max(a2, a3)))
        m = group_max(m, WARP_SIZE)
        warp_max = cuda.shared.array(32, dtype=np.float32)
        if tid % WARP_SIZE == 0:
            warp_max[tid // WARP_SIZE] = m
        cuda.syncthreads()  # all warp maxima written before thread 0 combines them
        if tid == 0:
            for w in range(1, cuda.blockDim.x // WARP_SIZE):
                v = warp_max[w]
                if v > m:
                    m = v
            parts[cuda.blockIdx.x] = m

    return kernel
