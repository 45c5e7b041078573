"""NVFP4 / MXFP4 dequantization kernel: packed codes + block scales -> float32/bf16/fp16.

Launch contract: 1-D grid-stride over chunks of 4 elements (one uint16 of codes in, one 8-byte
word of 16-bit output or two of float32 out); no shuffles, so any block size works.  The lanes
of one block read the same scale byte (a broadcast in L1).
Decode order: NVFP4 (e2m1_value * float(s)) * global_scale; MXFP4 e2m1_value * 2^(s - 127);
a NaN scale code decodes its whole block to NaN.
"""

from __future__ import annotations

import functools

from numba import cuda

from ._chunk import U64, make_chunk_io, scale_offset
from ._primitives import OPS
from .quantize import BLOCK_SIZES, FMT_NVFP4


@functools.cache
def dequantize_kernel(out_kind, fmt, swizzled):
    lanes = BLOCK_SIZES[fmt] // 4
    lanes_log2 = lanes.bit_length() - 1
    _, store_chunk = make_chunk_io(out_kind)
    nvfp4 = fmt == FMT_NVFP4
    e2m1_decode = OPS.e2m1_decode
    e4m3_decode = OPS.e4m3_decode
    e8m0_decode = OPS.e8m0_decode

    @cuda.jit
    def kernel(codes, scales, global_scale, out, n_chunks, kb, padded_kb):
        s_dec = global_scale[0]
        stride = cuda.gridDim.x * cuda.blockDim.x
        for c in range(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, n_chunks, stride):
            p = codes[U64(c)]
            scode = scales[scale_offset(c >> lanes_log2, kb, padded_kb, swizzled)]
            v0 = e2m1_decode(p & 15)
            v1 = e2m1_decode((p >> 4) & 15)
            v2 = e2m1_decode((p >> 8) & 15)
            v3 = e2m1_decode((p >> 12) & 15)
            if nvfp4:
                s = e4m3_decode(scode)
                # (e2m1 value * s) is exact; the product with the global scale rounds once.
                store_chunk(out, c, (v0 * s) * s_dec, (v1 * s) * s_dec, (v2 * s) * s_dec,
                            (v3 * s) * s_dec)
            else:
                x = e8m0_decode(scode)
                store_chunk(out, c, v0 * x, v1 * x, v2 * x, v3 * x)

    return kernel
