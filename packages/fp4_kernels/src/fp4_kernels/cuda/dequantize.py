"""NVFP4 / MXFP4 dequantize on the GPU: packed codes + block scales -> float32/bf16/fp16.

Launch contract: one thread per scale block, a 1-D grid-stride loop over the blocks; any CTA
size.  A thread reads its block's 8 (NVFP4) or 16 (MXFP4) bytes of codes in one load and its
scale byte, decodes the codes by byte-permute table lookups (``quantize.e2m1_values4``) and
stores the block 16 bytes at a time.  Decode order: NVFP4 (e2m1_value * float(s)) *
global_scale; MXFP4 e2m1_value * 2^(s - 127); a NaN scale code decodes its whole block to NaN.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from . import launch
from ._primitives import OPS, device_jit, load_v2, load_v4
from ._words import U32, U64, make_words_io, words_per
from .quantize import BLOCK_SIZES, FMT_NVFP4, decode8_into

THREADS = 256  # the launch table's row (cuda/launch.py)


@functools.cache
def dequantize_kernel(out_kind, fmt, swizzled, aligned=True):
    """Arguments: codes (uint32 words; uint8 bytes when not ``aligned`` to the load size),
    scales (uint8), global_scale (float32, 1 element), out (uint32 words), n_blocks, kb,
    padded_kb."""
    block = BLOCK_SIZES[fmt]
    groups = block // 8
    n_out_words = words_per(out_kind, block)
    store = make_words_io(out_kind, n_out_words)[4]
    nvfp4 = fmt == FMT_NVFP4
    e4m3_decode = OPS.e4m3_decode
    e8m0_decode = OPS.e8m0_decode
    scale_offset = OPS.scale_offset

    @device_jit
    def load_codes(codes, blk, p):
        if aligned and groups == 2:
            p[0], p[1] = load_v2(codes, U64(blk) * U64(2))
        elif aligned:
            p[0], p[1], p[2], p[3] = load_v4(codes, U64(blk) * U64(4))
        else:
            for g in range(groups):
                i = U64(blk) * U64(4 * groups) + U64(4 * g)
                p[g] = U32(
                    U32(codes[i])
                    | U32(U32(codes[i + 1]) << 8)
                    | U32(U32(codes[i + 2]) << 16)
                    | U32(U32(codes[i + 3]) << 24)
                )

    @cuda.jit
    def kernel(codes, scales, global_scale, out, n_blocks, kb, padded_kb):
        s_dec = global_scale[0]
        p = cuda.local.array(groups, np.uint32)
        v = cuda.local.array(block, np.float32)
        for blk in range(cuda.grid(1), n_blocks, cuda.gridsize(1)):
            load_codes(codes, blk, p)
            scode = scales[scale_offset(blk, kb, padded_kb, swizzled)]
            s = e4m3_decode(scode) if nvfp4 else e8m0_decode(scode)
            for g in range(groups):
                decode8_into(v, 8 * g, p[g], nvfp4, s, s_dec)
            store(out, U64(blk) * U64(n_out_words), v)

    return kernel


def dequantize(ctx, data, scales, global_scale, out, out_kind, fmt_code, geo):
    """Queue the decoding of ``data`` / ``scales`` (validated by the caller) into ``out`` (an
    array of the caller's kind) on the caller's stream."""
    block = BLOCK_SIZES[fmt_code]
    n_blocks = geo.n // block
    if n_blocks == 0:
        return
    codes, aligned = ctx.codes_view(data, block // 2)  # a block's codes: one 8/16-byte load
    threads = launch.threads_for(THREADS)
    launch.launch(
        dequantize_kernel(out_kind, fmt_code, geo.swizzled, aligned),
        launch.grid_for(n_blocks, threads),
        threads,
        ctx.stream,
        (
            codes,
            ctx.view(scales),
            ctx.view(global_scale),
            ctx.view(out, np.uint32),
            np.int64(n_blocks),
            np.int64(geo.kb),
            np.int64(geo.padded_kb),
        ),
    )
