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

Launch contract as the quantize kernel's: one thread per MXFP4 block, a 1-D grid-stride loop;
the encode is the quantize kernel's block codec (``e2m1.make_block_codec``) on the float32
sums.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from .._scalar import F32_ONE, KIND_F32
from ..formats.mxfp4 import SPEC as MXFP4
from . import launch
from ._primitives import OPS, device_jit, f32_as_u32, load_v4, mul_rn_f32, store_v4
from ._words import U32, U64, make_words_io
from .e2m1 import e2m1_values4, make_block_codec
from .launch_table import LAUNCHES

BLOCK = MXFP4.block_size  # 32 elements: 16 bytes of codes, 4 packed words
LAUNCH = LAUNCHES["requantized_sum"]


@functools.cache
def requantized_sum_mxfp4_kernel(aligned=True):
    """Arguments: codes_in (uint32 words, or bytes when not 16-byte aligned; rows x n_blocks
    blocks), scales_in (uint8), rows, codes_out (uint32), scales_out (uint8), global_scale
    (float32, 1 element), n_blocks."""
    _, encode8, _ = make_block_codec(KIND_F32, BLOCK)
    amax_bits = make_words_io(KIND_F32, BLOCK)[2]
    e8m0_decode = OPS.e8m0_decode
    mxfp4_block_scale = OPS.mxfp4_block_scale

    @device_jit
    def load_block(codes, i, p):
        if aligned:
            p[0], p[1], p[2], p[3] = load_v4(codes, i * U64(4))
        else:
            for g in range(4):
                b = i * U64(16) + U64(4 * g)
                p[g] = U32(
                    U32(codes[b])
                    | U32(U32(codes[b + 1]) << 8)
                    | U32(U32(codes[b + 2]) << 16)
                    | U32(U32(codes[b + 3]) << 24)
                )

    @device_jit
    def accumulate(acc, j, v, first):
        if first:
            acc[j] = v
        else:
            acc[j] = acc[j] + v

    @device_jit
    def add_row(codes, scales, r, blk, n_blocks, p, acc, first):
        i = U64(r) * U64(n_blocks) + U64(blk)
        load_block(codes, i, p)
        x = e8m0_decode(U32(scales[i]))
        for q in range(8):  # 4 codes at a time
            a, b, c, d = e2m1_values4(U32(p[q // 2] >> U32(16 * (q % 2))))
            # mul.rn: a product never fused with the add (it can overflow where an FMA not)
            accumulate(acc, 4 * q, mul_rn_f32(a, x), first)
            accumulate(acc, 4 * q + 1, mul_rn_f32(b, x), first)
            accumulate(acc, 4 * q + 2, mul_rn_f32(c, x), first)
            accumulate(acc, 4 * q + 3, mul_rn_f32(d, x), first)

    @cuda.jit
    def kernel(codes_in, scales_in, rows, codes_out, scales_out, global_scale, n_blocks):
        if cuda.blockIdx.x == 0 and cuda.threadIdx.x == 0:
            global_scale[0] = F32_ONE  # MXFP4 has no tensor scale: 1.0, as quantize writes
        p = cuda.local.array(4, np.uint32)
        w = cuda.local.array(BLOCK, np.uint32)
        acc = cuda.local.array(BLOCK, np.float32)
        for blk in range(cuda.grid(1), n_blocks, cuda.gridsize(1)):
            # row 0 alone, then + row 1, + row 2, ...: -0 stays -0 with one row
            add_row(codes_in, scales_in, 0, blk, n_blocks, p, acc, True)
            for r in range(1, rows):
                add_row(codes_in, scales_in, r, blk, n_blocks, p, acc, False)
            for j in range(BLOCK):
                w[j] = f32_as_u32(acc[j])
            bits = amax_bits(w)
            scode, _, mult = mxfp4_block_scale(bits)
            for g in range(4):
                p[g] = encode8(w, g, mult) if bits < 0x7F800000 else U32(0)
            store_v4(codes_out, U64(blk) * U64(4), p[0], p[1], p[2], p[3])
            scales_out[U64(blk)] = np.uint8(scode)

    return kernel


def run(ctx, call):
    """Queue the one-pass sum of ``call`` (a checked ``_calls.SumCall``) on the caller's
    stream; returns (codes, scales, global_scale) of the (1, n) MXFP4 result."""
    n = call.n
    codes = ctx.empty((1, n // 2), np.uint8)
    scales = ctx.empty((1, n // BLOCK), np.uint8)
    gs = ctx.empty((1,), np.float32)
    if n == 0:
        ctx.fill(gs, 1.0)
    else:
        requantized_sum_mxfp4(ctx, call.data, call.scales, call.rows, codes, scales, gs, n)
    return codes, scales, gs


def requantized_sum_mxfp4(ctx, data, scales, rows, codes_out, scales_out, gs, n):
    """Queue the one-pass sum of the ``rows`` MXFP4 rows of ``n`` elements, requantized."""
    n_blocks = n // BLOCK
    codes_in, aligned = ctx.codes_view(data, 16)
    threads = launch.threads_for(LAUNCH.threads)
    launch.launch(
        requantized_sum_mxfp4_kernel(aligned),
        launch.grid_for(n_blocks, threads),
        threads,
        ctx,
        (codes_in, ctx.view(scales), np.int64(rows), ctx.view(codes_out, np.uint32),
         ctx.view(scales_out), ctx.view(gs), np.int64(n_blocks)),
    )  # fmt: skip
