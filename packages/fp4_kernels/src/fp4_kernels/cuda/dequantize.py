"""NVFP4 / MXFP4 dequantize on the GPU: packed codes + block scales -> float32/bf16/fp16.

Launch contract: one thread per 16 bytes of output (8 elements of bf16 / fp16, 4 of float32), a
1-D grid-stride loop over tiles of ``UNROLL`` such items per thread: consecutive lanes take
consecutive items, so every load of codes and every 16-byte store of a warp is contiguous, and
a thread issues the loads of all its items before decoding any.  The lanes of one block read the
same scale byte.  The codes are decoded by byte-permute table lookups
(``e2m1.e2m1_values4``).  Decode order: NVFP4 (e2m1_value * float(s)) * global_scale;
MXFP4 e2m1_value * 2^(s - 127); a NaN scale code decodes its whole block to NaN.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from .._scalar import KIND_F32
from . import launch
from ._primitives import OPS, device_jit
from ._words import U32, U64, make_words_io
from .e2m1 import e2m1_values4
from .launch_table import LAUNCHES

LAUNCH = LAUNCHES["dequantize"]
UNROLL = LAUNCH.items_per_thread  # items a thread a pass: all loads in flight before a decode


@functools.cache
def dequantize_kernel(out_kind, fmt, swizzled, aligned=True):
    """The decoder of the format ``fmt`` (a ``FormatSpec``).  Arguments: codes (uint32 words
    for 16-bit outputs, uint16 for float32 ones; uint8 bytes when not aligned to that size),
    scales (uint8), global_scale (float32, 1 element), out
    (uint32 words), n_items (16-byte output items), kb, padded_kb."""
    if UNROLL != 4:
        raise ValueError(f"dequantize: the kernel loads 4 items a pass, the table says {UNROLL}")
    block = fmt.block_size
    per_item = 4 if out_kind == KIND_F32 else 8  # elements in 16 bytes of output
    store = make_words_io(out_kind, 4)[4]
    nvfp4 = fmt.tensor_scale  # NVFP4: (value * e4m3 scale) * tensor scale
    e4m3_decode = OPS.e4m3_decode
    e8m0_decode = OPS.e8m0_decode
    scale_offset = OPS.scale_offset

    @device_jit
    def load_item(codes, scales, item, n_items, kb, padded_kb):
        """The item's packed codes (per_item nibbles) and its block's scale code."""
        if item >= n_items:
            return U32(0), U32(0)
        s = U32(scales[scale_offset(item * per_item // block, kb, padded_kb, swizzled)])
        if aligned:
            return U32(codes[U64(item)]), s
        b = U64(item) * U64(per_item // 2)
        p = U32(U32(codes[b]) | U32(U32(codes[b + 1]) << 8))
        if per_item == 8:
            p = U32(p | U32(U32(codes[b + 2]) << 16) | U32(U32(codes[b + 3]) << 24))
        return p, s

    @device_jit
    def decode_store(out, item, n_items, p, scode, s_dec, v):
        if item >= n_items:
            return
        s = e4m3_decode(scode) if nvfp4 else e8m0_decode(scode)
        for h in range(per_item // 4):
            a, b, c, d = e2m1_values4(U32(p >> U32(16 * h)))
            if nvfp4:  # (e2m1 value * s) is exact; the product with the tensor scale rounds
                v[4 * h] = (a * s) * s_dec
                v[4 * h + 1] = (b * s) * s_dec
                v[4 * h + 2] = (c * s) * s_dec
                v[4 * h + 3] = (d * s) * s_dec
            else:  # s = 2^e: exact
                v[4 * h] = a * s
                v[4 * h + 1] = b * s
                v[4 * h + 2] = c * s
                v[4 * h + 3] = d * s
        store(out, U64(item) * U64(4), v, 0)

    @cuda.jit
    def kernel(codes, scales, global_scale, out, n_items, kb, padded_kb):
        s_dec = global_scale[0]
        v = cuda.local.array(8, np.float32)
        span = cuda.blockDim.x
        tile = span * UNROLL
        for t0 in range(cuda.blockIdx.x * tile, n_items, cuda.gridDim.x * tile):
            i0 = t0 + cuda.threadIdx.x
            p0, s0 = load_item(codes, scales, i0, n_items, kb, padded_kb)
            p1, s1 = load_item(codes, scales, i0 + span, n_items, kb, padded_kb)
            p2, s2 = load_item(codes, scales, i0 + 2 * span, n_items, kb, padded_kb)
            p3, s3 = load_item(codes, scales, i0 + 3 * span, n_items, kb, padded_kb)
            decode_store(out, i0, n_items, p0, s0, s_dec, v)
            decode_store(out, i0 + span, n_items, p1, s1, s_dec, v)
            decode_store(out, i0 + 2 * span, n_items, p2, s2, s_dec, v)
            decode_store(out, i0 + 3 * span, n_items, p3, s3, s_dec, v)

    return kernel


ONE = np.ones(1, np.float32)  # MXFP4's tensor scale, where the kernel reads one


def run(ctx, call):
    """Queue the decoding of ``call`` (a checked ``_calls.DequantizeCall`` of an NVFP4 / MXFP4
    tensor on the GPU) on the caller's stream; returns (out,), an array of the caller's kind."""
    geo, kind = call.geometry, call.kind
    out = ctx.empty(geo.shape, None, like_dtype=ctx.float_dtype_of_kind(kind))
    per_item = 4 if kind == KIND_F32 else 8
    n_items = geo.n // per_item
    if n_items == 0:
        return (out,)
    codes, aligned = ctx.codes_view(call.data, per_item // 2)
    if aligned and per_item == 4:
        codes = ctx.view(call.data, np.uint16)  # 4 codes an item
    threads = launch.threads_for(LAUNCH.threads)
    launch.launch(
        dequantize_kernel(kind, call.fmt, geo.swizzled, aligned),
        launch.grid_for(n_items, threads * UNROLL),
        threads,
        ctx,
        (
            codes,
            ctx.view(call.scales),
            ctx.view(ctx.constant(ONE) if call.global_scale is None else call.global_scale),
            ctx.view(out, np.uint32),
            launch.int64(n_items),
            launch.int64(geo.kb),
            launch.int64(geo.padded_kb),
        ),
    )
    return (out,)
