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
from ._primitives import WARP_SIZE, group_max


@functools.cache
def amax_kernel(kind):
    load_chunk, _ = make_chunk_io(kind)

    @cuda.jit
    def kernel(words, n_chunks, parts):
        tid = cuda.threadIdx.x
        m = np.float32(0.0)
        stride = cuda.gridDim.x * cuda.blockDim.x
        for c in range(cuda.blockIdx.x * cuda.blockDim.x + tid, n_chunks, stride):
            v0, v1, v2, v3 = load_chunk(words, c, n_chunks)
            for a in (finite_abs(v0), finite_abs(v1), finite_abs(v2), finite_abs(v3)):
                if a > m:
                    m = a
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
