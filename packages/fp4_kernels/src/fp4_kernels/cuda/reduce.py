"""Sum of the rows of an MXFP4 tensor, requantized to MXFP4: the reduction step of an FP4
all-reduce (every rank's chunk decoded, added, encoded again for the all-gather) in one pass.

Bit for bit the composition it replaces (``fp4_kernels._reduce.requantized_sum_reference``):
decode each row to float32 (e2m1 value * 2^e: exact), add the rows in row order in float32,
``(r0 + r1) + r2 + ...`` (row 0 alone when there is one: no ``0 + r0``, which would turn -0
into +0), and quantize the float32 sum to MXFP4 with round-to-nearest-even, with the quantize
kernel's arithmetic (``cuda/quantize.py``).  The decode products go through ``mul_rn_f32`` so
that NVVM cannot contract them with the adds into FMAs: the products are exact for scale codes
up to 252 (all that ``quantize`` produces from finite input), but with the codes 253 and 254 a
product can overflow to infinity where a fused ``fma(v, 2^e, s)`` would stay finite.

It reads R (n/2 + n/32) bytes and writes n/2 + n/32, where the composition writes and reads
back 4 R n + 8 n bytes of float32.

Launch contract as the quantize kernel's: a 1-D grid-stride loop over tiles of ``blockDim.x``
chunks (4 elements each; ``blockDim.x`` a multiple of 32), every thread running the same number
of iterations so that all 8 lanes of an MXFP4 block reach the shuffle of its amax; chunks past
the end take part as zeros and store nothing.
"""

from __future__ import annotations

import functools

from numba import cuda

from .._scalar import E8M0_NAN_CODE, F32_ONE, F32_ZERO
from ._chunk import U32, U64, max4_abs_bits
from ._primitives import OPS, device_jit, group_max, mul_rn_f32, u32_as_f32

MX_LANES = 8  # chunks of 4 elements per MXFP4 block of 32
MX_LANES_LOG2 = 3


@functools.cache
def requantized_sum_mxfp4_kernel():
    e2m1_encode = OPS.e2m1_encode
    e2m1_decode = OPS.e2m1_decode
    e8m0_decode = OPS.e8m0_decode
    mx_shared_exponent = OPS.mx_shared_exponent
    pow2_f32 = OPS.pow2_f32

    @device_jit
    def row_chunk(codes_in, scales_in, r, c, n_chunks):
        """Chunk ``c`` of row ``r`` decoded to four float32 values."""
        p = U32(codes_in[U64(r) * U64(n_chunks) + U64(c)])
        n_blocks = n_chunks >> MX_LANES_LOG2
        x = e8m0_decode(U32(scales_in[U64(r) * U64(n_blocks) + U64(c >> MX_LANES_LOG2)]))
        return (
            mul_rn_f32(e2m1_decode(p & 15), x),
            mul_rn_f32(e2m1_decode((p >> 4) & 15), x),
            mul_rn_f32(e2m1_decode((p >> 8) & 15), x),
            mul_rn_f32(e2m1_decode(p >> 12), x),
        )

    @device_jit
    def summed_chunk(codes_in, scales_in, rows, c, n_chunks):
        """The four sums over the rows, in row order; zeros past the end."""
        if c >= n_chunks:
            return F32_ZERO, F32_ZERO, F32_ZERO, F32_ZERO
        s0, s1, s2, s3 = row_chunk(codes_in, scales_in, 0, c, n_chunks)
        for r in range(1, rows):
            v0, v1, v2, v3 = row_chunk(codes_in, scales_in, r, c, n_chunks)
            s0 = s0 + v0
            s1 = s1 + v1
            s2 = s2 + v2
            s3 = s3 + v3
        return s0, s1, s2, s3

    @cuda.jit
    def kernel(codes_in, scales_in, rows, codes_out, scales_out, global_scale, n_chunks):
        if cuda.blockIdx.x == 0 and cuda.threadIdx.x == 0:
            global_scale[0] = F32_ONE  # MXFP4 has no tensor scale: 1.0, as quantize writes
        nthreads = cuda.blockDim.x
        n_tiles = (n_chunks + nthreads - 1) // nthreads
        for t in range(cuda.blockIdx.x, n_tiles, cuda.gridDim.x):
            c = t * nthreads + cuda.threadIdx.x
            v0, v1, v2, v3 = summed_chunk(codes_in, scales_in, rows, c, n_chunks)
            # the quantize kernel's MXFP4 block scale and encode (cuda/quantize.py)
            bmax_bits = group_max(max4_abs_bits(v0, v1, v2, v3), MX_LANES)
            packed = U32(0)
            if bmax_bits < 0x7F800000:
                e = mx_shared_exponent(u32_as_f32(U32(bmax_bits)))
                scode = U32(e + 127)
                mult = pow2_f32(-e)  # -e in [-125, 127]: a normal float32, exact scaling
                k0 = e2m1_encode(v0 * mult)
                k1 = e2m1_encode(v1 * mult)
                k2 = e2m1_encode(v2 * mult)
                k3 = e2m1_encode(v3 * mult)
                packed = U32(U32(k0 | U32(k1 << 4)) | U32(U32(k2 << 8) | U32(k3 << 12)))
            else:
                scode = U32(E8M0_NAN_CODE)  # a non-finite sum: NaN scale, zero codes
            if c < n_chunks:
                codes_out[U64(c)] = packed
                if (c & (MX_LANES - 1)) == 0:
                    scales_out[U64(c >> MX_LANES_LOG2)] = scode

    return kernel
