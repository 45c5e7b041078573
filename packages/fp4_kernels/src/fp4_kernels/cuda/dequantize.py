"""NVFP4 / MXFP4 dequantization kernel: packed codes + block scales -> float32/bf16/fp16.

Launch contract: 1-D grid-stride over tiles of ``blockDim.x * UNROLL`` chunks of 4 elements
(one uint16 of codes in; one 8-byte word of 16-bit output, or two of float32, out).  Each thread
issues the loads of all its UNROLL chunks before decoding any: a chunk reads only 2-3 bytes, so
one chunk at a time would leave far too few bytes in flight to cover DRAM latency.  The lanes of
one block read the same scale byte (a broadcast in L1).
Decode order: NVFP4 (e2m1_value * float(s)) * global_scale; MXFP4 e2m1_value * 2^(s - 127);
a NaN scale code decodes its whole block to NaN.
"""

from __future__ import annotations

import functools

from numba import cuda

from ._chunk import U64, make_chunk_io, scale_offset
from ._primitives import OPS, device_jit
from .quantize import BLOCK_SIZES, FMT_NVFP4

UNROLL = 4


@functools.cache
def dequantize_kernel(out_kind, fmt, swizzled):
    lanes = BLOCK_SIZES[fmt] // 4
    lanes_log2 = lanes.bit_length() - 1
    store_chunk = make_chunk_io(out_kind)[1]
    nvfp4 = fmt == FMT_NVFP4
    e2m1_decode = OPS.e2m1_decode
    e4m3_decode = OPS.e4m3_decode
    e8m0_decode = OPS.e8m0_decode

    @device_jit
    def load(codes, scales, c, n_chunks, kb, padded_kb):
        if c >= n_chunks:
            return 0, 0
        return codes[U64(c)], scales[scale_offset(c >> lanes_log2, kb, padded_kb, swizzled)]

    @device_jit
    def decode_store(out, c, n_chunks, p, scode, s_dec):
        if c >= n_chunks:
            return
        v0 = e2m1_decode(p & 15)
        v1 = e2m1_decode((p >> 4) & 15)
        v2 = e2m1_decode((p >> 8) & 15)
        v3 = e2m1_decode((p >> 12) & 15)
        if nvfp4:
            s = e4m3_decode(scode)
            # (e2m1 value * s) is exact; the product with the global scale rounds once.
            store_chunk(
                out, c, (v0 * s) * s_dec, (v1 * s) * s_dec, (v2 * s) * s_dec, (v3 * s) * s_dec
            )
        else:
            x = e8m0_decode(scode)
            store_chunk(out, c, v0 * x, v1 * x, v2 * x, v3 * x)

    @cuda.jit
    def kernel(codes, scales, global_scale, out, n_chunks, kb, padded_kb):
        s_dec = global_scale[0]
        nthreads = cuda.blockDim.x
        tile = nthreads * UNROLL
        n_tiles = (n_chunks + tile - 1) // tile
        for t in range(cuda.blockIdx.x, n_tiles, cuda.gridDim.x):
            c0 = t * tile + cuda.threadIdx.x
            c1 = c0 + nthreads
            c2 = c1 + nthreads
            c3 = c2 + nthreads
            p0, s0 = load(codes, scales, c0, n_chunks, kb, padded_kb)
            p1, s1 = load(codes, scales, c1, n_chunks, kb, padded_kb)
            p2, s2 = load(codes, scales, c2, n_chunks, kb, padded_kb)
            p3, s3 = load(codes, scales, c3, n_chunks, kb, padded_kb)
            decode_store(out, c0, n_chunks, p0, s0, s_dec)
            decode_store(out, c1, n_chunks, p1, s1, s_dec)
            decode_store(out, c2, n_chunks, p2, s2, s_dec)
            decode_store(out, c3, n_chunks, p3, s3, s_dec)

    return kernel
