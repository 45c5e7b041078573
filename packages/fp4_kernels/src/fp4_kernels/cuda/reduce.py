"""Sum of the rows of an NVFP4 / MXFP4 tensor, requantized to its format: the reduction step of
an FP4 all-reduce (every rank's chunk decoded, added, encoded again for the all-gather) without
a float32 intermediate in memory.

Bit for bit the composition it replaces (``fp4_kernels._reduce.requantized_sum_reference``):
decode each row to float32, add the rows in row order in float32, ``(r0 + r1) + r2 + ...`` (row
0 alone when there is one: no ``0 + r0``, which would turn -0 into +0), and quantize the
float32 sum with round-to-nearest-even, with the quantize kernel's arithmetic
(``cuda/quantize.py``).  The decode of row r:
    NVFP4  (e2m1_value * float(s)) * gs[r * gs_step]   (the first product exact; gs_step 1: a
           tensor decode scale 1/S a row, as if each row had been quantized alone; 0: one)
    MXFP4  e2m1_value * 2^e                              (exact)
The last product of a decode goes through ``mul_rn_f32`` so that NVVM cannot contract it with
the add into an FMA: a fused ``fma(v * s, 1/S, acc)`` rounds once where the definition rounds
twice, and for MXFP4 with the scale codes 253 and 254 a product can overflow to infinity where
the FMA would stay finite.

NVFP4 takes two kernels over the encoded rows, as ``quantize`` takes two passes over its input
(the tensor scale of the sum needs the amax of the whole sum before the first block is
encoded):
  1. ``requantized_sum_amax_kernel``: sums each block and writes the max of the finite sums'
     magnitudes a CTA, ``parts[b]`` (the partials contract of ``cuda/amax.py``: a grid of at most
     ``max_partials`` CTAs, no atomics, no memset);
  2. ``requantized_sum_kernel``: reduces the partials to the tensor scale
     (``amax.make_tensor_scale``: S = 2688 / amax, 1 for an all-zero or all-non-finite sum, as
     ``quantize`` computes it; 1/S written to ``global_scale``), sums each block again and
     encodes it (e4m3 block scale, e2m1 codes).
The sum is recomputed rather than stored: the second pass reads R (n/2 + n/16) bytes where a
stored float32 sum would cost 8 n.  MXFP4 has no tensor scale and takes the second kernel alone
(``global_scale`` = 1, as ``quantize`` writes).

Launch contract: one thread per scale block (16 elements NVFP4, 32 MXFP4) of every row, a 1-D
grid-stride loop over the blocks, any CTA size that is a multiple of 32 (the amax pass's CTA
maximum); a row's block of codes in one 8-byte (NVFP4) or 16-byte (MXFP4) load where the codes
are aligned to that, else byte loads.  The encode is the quantize kernel's block codec
(``e2m1.make_block_codec``) on the float32 sums.  A block whose sum is not finite (a NaN-scale
row block, an overflow, a NaN or infinite row scale) gets the NaN scale code and zero codes.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from .._scalar import F32_ONE, KIND_F32
from ..formats.nvfp4 import SPEC as NVFP4
from . import launch
from ._primitives import (
    OPS,
    device_jit,
    f32_as_u32,
    load_v2,
    load_v4,
    mul_rn_f32,
    store_v2,
    store_v4,
    u32_as_f32,
)
from ._words import U32, U64, make_words_io
from .amax import cta_max_to, make_tensor_scale
from .e2m1 import e2m1_values4, make_block_codec
from .launch_table import LAUNCHES

LAUNCH = LAUNCHES["requantized_sum"]
AMAX_LAUNCH = LAUNCHES["requantized_sum_amax"]
NO_AMAX = np.float32(-1.0)  # make_tensor_scale's amax_value: reduce the partials instead


@functools.cache
def make_block_sum(fmt, aligned):
    """Device function ``block_sum(codes, scales, gs, gs_step, rows, blk, n_blocks, p, acc)``:
    the float32 sum over the ``rows`` rows of the scale block ``blk`` of the format ``fmt`` (a
    ``FormatSpec``) into ``acc`` (block_size elements); ``p``: the thread's code words."""
    block = fmt.block_size
    n_code_words = block // 8  # 8 codes a word: NVFP4 2, MXFP4 4
    nvfp4 = fmt.tensor_scale  # NVFP4: e4m3 block scales under a float32 tensor scale
    e4m3_decode = OPS.e4m3_decode
    e8m0_decode = OPS.e8m0_decode

    @device_jit
    def load_block(codes, i, p):
        if aligned and n_code_words == 4:
            p[0], p[1], p[2], p[3] = load_v4(codes, i * U64(4))
        elif aligned:
            p[0], p[1] = load_v2(codes, i * U64(2))
        else:
            for g in range(n_code_words):
                b = i * U64(4 * n_code_words) + U64(4 * g)
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
    def add_row(codes, scales, gs, gs_step, r, blk, n_blocks, p, acc, first):
        i = U64(r) * U64(n_blocks) + U64(blk)
        load_block(codes, i, p)
        if nvfp4:
            s = e4m3_decode(U32(scales[i]))
            x = gs[r * gs_step]
        else:
            s = F32_ONE
            x = e8m0_decode(U32(scales[i]))
        for q in range(2 * n_code_words):  # 4 codes at a time
            a, b, c, d = e2m1_values4(U32(p[q // 2] >> U32(16 * (q % 2))))
            if nvfp4:  # value * s is exact (2 by 4 significant bits)
                a, b, c, d = a * s, b * s, c * s, d * s
            # mul.rn: the decode's one rounding, never fused with the add (see the module doc)
            accumulate(acc, 4 * q, mul_rn_f32(a, x), first)
            accumulate(acc, 4 * q + 1, mul_rn_f32(b, x), first)
            accumulate(acc, 4 * q + 2, mul_rn_f32(c, x), first)
            accumulate(acc, 4 * q + 3, mul_rn_f32(d, x), first)

    @device_jit
    def block_sum(codes, scales, gs, gs_step, rows, blk, n_blocks, p, acc):
        # row 0 alone, then + row 1, + row 2, ...: -0 stays -0 with one row
        add_row(codes, scales, gs, gs_step, 0, blk, n_blocks, p, acc, True)
        for r in range(1, rows):
            add_row(codes, scales, gs, gs_step, r, blk, n_blocks, p, acc, False)

    return block_sum


@functools.cache
def requantized_sum_amax_kernel(aligned=True):
    """The NVFP4 sum's amax pass.  Arguments: codes_in (uint32 words, or bytes when not aligned
    to a block's codes; rows x n_blocks blocks), scales_in (uint8), gs_in (float32: row r's
    tensor decode scale at gs_in[r * gs_step]), gs_step, rows, n_blocks, parts (float32, one
    per CTA: the max of the finite sums' magnitudes)."""
    block = NVFP4.block_size
    n_code_words = block // 8
    block_sum = make_block_sum(NVFP4, aligned)
    finite_amax_bits = make_words_io(KIND_F32, block)[3]

    @cuda.jit
    def kernel(codes_in, scales_in, gs_in, gs_step, rows, n_blocks, parts):
        p = cuda.local.array(n_code_words, np.uint32)
        w = cuda.local.array(block, np.uint32)
        acc = cuda.local.array(block, np.float32)
        m = U32(0)
        for blk in range(cuda.grid(1), n_blocks, cuda.gridsize(1)):
            block_sum(codes_in, scales_in, gs_in, gs_step, rows, blk, n_blocks, p, acc)
            for j in range(block):
                w[j] = f32_as_u32(acc[j])
            m = max(m, finite_amax_bits(w))
        cta_max_to(u32_as_f32(m), parts)

    return kernel


@functools.cache
def requantized_sum_kernel(fmt, aligned=True):
    """The sum encoded to ``fmt`` (a ``FormatSpec``).  Arguments: codes_in, scales_in, gs_in,
    gs_step, rows, n_blocks (as the amax pass's; MXFP4 reads no gs_in), codes_out (uint32),
    scales_out (uint8), global_scale (float32, 1 element: the sum's 1/S, 1 for MXFP4; written
    by thread 0), parts (float32: the amax pass's partials, NVFP4), n_parts."""
    block = fmt.block_size
    groups = block // 8  # packed code words a thread stores
    nvfp4 = fmt.tensor_scale
    block_sum = make_block_sum(fmt, aligned)
    tensor_scale = make_tensor_scale(fmt)
    _, encode8, _ = make_block_codec(KIND_F32, block)
    amax_bits = make_words_io(KIND_F32, block)[2]
    nvfp4_block_scale = OPS.nvfp4_block_scale
    mxfp4_block_scale = OPS.mxfp4_block_scale

    @cuda.jit
    def kernel(codes_in, scales_in, gs_in, gs_step, rows, n_blocks, codes_out, scales_out,
               global_scale, parts, n_parts):  # fmt: skip
        s6, s_dec = tensor_scale(NO_AMAX, parts, n_parts, global_scale)
        p = cuda.local.array(groups, np.uint32)
        w = cuda.local.array(block, np.uint32)
        acc = cuda.local.array(block, np.float32)
        for blk in range(cuda.grid(1), n_blocks, cuda.gridsize(1)):
            block_sum(codes_in, scales_in, gs_in, gs_step, rows, blk, n_blocks, p, acc)
            for j in range(block):
                w[j] = f32_as_u32(acc[j])
            bits = amax_bits(w)
            if nvfp4:
                scode, _, mult = nvfp4_block_scale(bits, s6, s_dec)
            else:
                scode, _, mult = mxfp4_block_scale(bits)
            for g in range(groups):
                # a non-finite block: zero codes under the NaN scale
                p[g] = encode8(w, g, mult) if bits < 0x7F800000 else U32(0)
            if groups == 4:
                store_v4(codes_out, U64(blk) * U64(4), p[0], p[1], p[2], p[3])
            else:
                store_v2(codes_out, U64(blk) * U64(2), p[0], p[1])
            scales_out[U64(blk)] = np.uint8(scode)

    return kernel


def max_partials(device_id):
    """Size of the partials buffer the NVFP4 amax pass may fill."""
    return launch.max_blocks(AMAX_LAUNCH.partials_per_sm, device_id)


def run(ctx, call):
    """Queue the requantized sum of ``call`` (a checked ``_calls.SumCall`` of an NVFP4 / MXFP4
    tensor with the linear scale layout on the GPU) on the caller's stream; returns (codes,
    scales, global_scale) of the (1, n) result, arrays of the caller's kind."""
    fmt, n = call.fmt, call.n
    nvfp4 = fmt.tensor_scale
    n_blocks = n // fmt.block_size
    codes = ctx.empty((1, n // 2), np.uint8)
    scales = ctx.empty((1, n_blocks), np.uint8)
    # one allocation: [global_scale, amax partials...] (as quantize's scratch)
    scratch = ctx.empty((1 + (max_partials(ctx.device_id) if nvfp4 else 0),), np.float32)
    gs = scratch[:1]
    if n_blocks == 0:
        ctx.fill(gs, 1.0)
        return codes, scales, gs
    codes_in, aligned = ctx.codes_view(call.data, fmt.block_size // 2)  # a block's codes
    head = (
        codes_in,
        ctx.view(call.scales),
        ctx.view(call.global_scale if nvfp4 else gs),  # (MXFP4: never read)
        launch.int64(1 if call.per_row else 0),
        launch.int64(call.rows),
        launch.int64(n_blocks),
    )
    if nvfp4:
        parts = ctx.view(scratch[1:])
        threads = launch.threads_for(AMAX_LAUNCH.threads)
        blocks = min(launch.grid_for(n_blocks, threads), max_partials(ctx.device_id))
        kern = requantized_sum_amax_kernel(aligned)
        n_parts = launch.launch(kern, blocks, threads, ctx, (*head, parts))
    else:
        parts, n_parts = ctx.view(gs), 0
    threads = launch.threads_for(LAUNCH.threads)
    launch.launch(
        requantized_sum_kernel(fmt, aligned),
        launch.grid_for(n_blocks, threads),
        threads,
        ctx,
        (*head, ctx.view(codes, np.uint32), ctx.view(scales), ctx.view(gs), parts,
         launch.int64(n_parts)),
    )  # fmt: skip
    return codes, scales, gs
