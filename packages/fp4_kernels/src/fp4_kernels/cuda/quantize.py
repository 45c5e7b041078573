"""NVFP4 / MXFP4 quantize on the GPU (optionally fused with dequantize: fake quantization):
the kernel and its host wrapper.

Launch contract: one thread per scale block (16 elements NVFP4, 32 MXFP4), a 1-D grid-stride
loop over the blocks; any CTA size.  A thread loads its block with 16-byte loads, finds the
block amax on the raw words (no shuffles), computes the scale once, encodes its elements on the
float pipe (``e2m1.make_block_codec``: ``_scalar.e2m1_code_f``, or ``e2m1_sr_sum`` with one
Philox call per 8 elements for stochastic rounding) and stores 8 (NVFP4) or 16 (MXFP4) bytes
of codes and one scale byte.  The NVFP4 tensor amax is a value given by the caller or the max
over the per-CTA partials that ``cuda.amax`` wrote earlier on the same stream.

Operation order (float32, as NVIDIA Transformer Engine computes NVFP4; ``_scalar`` has the
block arithmetic, shared with the CPU path):
    S     = min(2688 / amax, FLT_MAX), 1 if amax == 0 or S == 0       (tensor encode scale)
    s     = e4m3_rne_sat(amax_b * (S * fp32(1/6)))                    (block decode scale code)
    rcp   = min(1 / (float(s) * (1 / S)), FLT_MAX)                     (block encode scale)
    code  = e2m1(x * rcp)                                              (RNE or stochastic)
    x_hat = (e2m1_value * float(s)) * (1 / S)
MXFP4 (OCP MX v1.0): e = clamp(floor(log2 amax_b) - 2, -127, 127) from the bits;
    code = e2m1(x * 2^-e) (exact scaling), x_hat = e2m1_value * 2^e.
A block holding NaN or +-Inf gets the NaN scale code (0x7F / 0xFF) and zero codes: it decodes to
NaN; the rest of the tensor is unaffected.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from . import launch
from ._primitives import (
    OPS,
    device_jit,
    group_max,
    kernel_of,
    store_v2,
)
from ._words import U32, U64, make_words_io, store_v4, words_per
from .amax import make_tensor_scale
from .e2m1 import decode8_into, make_block_codec
from .launch_table import LAUNCHES

LAUNCH = LAUNCHES["quantize"]

# Threads that share a block, chosen by measurement (benchmarks/NOTES.md; a launch policy may
# override it): a thread per block when only codes are written (its strided 16-byte loads are
# served by L1; sharing a block repeats the scale arithmetic in every lane of it, which costs
# issue slots: 0.98x vs 0.65x copy for NVFP4); for fake quantization 8 elements per thread, so
# that the 16-byte stores of the reconstruction are contiguous across a warp.
FUSED_ELEMENTS_PER_THREAD = 8


def lanes_per_block(spec, fused):
    """The threads that share one of ``spec``'s blocks by default."""
    return spec.block_size // FUSED_ELEMENTS_PER_THREAD if fused else 1


@functools.cache
def make_quantize_item(kind, fmt, stochastic, swizzled, fused, aligned, lanes):
    """Device function ``quantize_item(x, codes, scales, out, item, valid, kb, padded_kb, s6,
    s_dec, seed_lo, seed_hi, step, w, p, v)``: a lane's part of one block (``item``) loaded,
    its block amax reduced over the block's lanes, the scale computed and its codes (and, when
    ``fused``, its reconstruction) stored; an item past the end (``valid`` false) only takes
    part in the reduction.  ``w``, ``p``, ``v``: the thread's words, code words and values."""
    part = fmt.block_size // lanes  # elements a thread takes
    n_words = words_per(kind, part)
    groups = part // 8  # packed code words a thread stores
    load, _, amax_bits, _, store = make_words_io(kind, n_words, aligned)
    _, encode8, encode8_sr = make_block_codec(kind, part)
    nvfp4 = fmt.tensor_scale
    nvfp4_block_scale = OPS.nvfp4_block_scale
    mxfp4_block_scale = OPS.mxfp4_block_scale
    scale_offset = OPS.scale_offset

    @device_jit
    def quantize_item(x, codes, scales, out, item, valid, kb, padded_kb, s6, s_dec, seed_lo,
                      seed_hi, step, w, p, v):  # fmt: skip
        if valid:
            load(x, U64(item) * U64(n_words), w)
        else:
            for j in range(n_words):
                w[j] = U32(0)  # a lane past the end still takes part in the block's butterfly
        bits = amax_bits(w)
        if lanes > 1:
            bits = U32(group_max(np.int32(bits), lanes))  # |x| bits <= 0x7FFFFFFF: int32 safe
        if nvfp4:
            scode, s, mult = nvfp4_block_scale(bits, s6, s_dec)
        else:
            scode, s, mult = mxfp4_block_scale(bits)
        if not valid:
            return
        if stochastic:
            # written out per group: the Philox calls keep the compiler from unrolling a loop,
            # and a rolled loop would index the register arrays at run time
            chunk = U64(item) * U64(groups)  # one Philox call per 8 elements
            p[0] = encode8_sr(w, 0, mult, chunk, seed_lo, seed_hi, step)
            if groups >= 2:
                p[1] = encode8_sr(w, 1, mult, chunk + U64(1), seed_lo, seed_hi, step)
            if groups == 4:
                p[2] = encode8_sr(w, 2, mult, chunk + U64(2), seed_lo, seed_hi, step)
                p[3] = encode8_sr(w, 3, mult, chunk + U64(3), seed_lo, seed_hi, step)
        else:
            for g in range(groups):
                p[g] = encode8(w, g, mult)
        for g in range(groups):
            if bits >= 0x7F800000:
                p[g] = U32(0)  # a non-finite block: zero codes under the NaN scale
        if groups == 1:
            codes[U64(item)] = p[0]
        elif groups == 2:
            store_v2(codes, U64(item) * U64(2), p[0], p[1])
        else:
            store_v4(codes, U64(item) * U64(4), p[0], p[1], p[2], p[3])
        if item % lanes == 0:
            scales[scale_offset(item // lanes, kb, padded_kb, swizzled)] = np.uint8(scode)
        if fused:
            for g in range(groups):
                decode8_into(v, 8 * g, p[g], nvfp4, s, s_dec)
            store(out, U64(item) * U64(n_words), v, 0)

    return quantize_item


@functools.cache
def quantize_kernel(
    kind, fmt, stochastic, swizzled, fused, aligned=True, lanes=1, device_step=False
):
    """Build (once per configuration) the quantize kernel of the format ``fmt`` (a
    ``FormatSpec``); ``fused`` also writes x_hat.

    ``lanes`` consecutive threads share a block, each loading, encoding and storing block /
    lanes consecutive elements, so that every load and store of a warp is contiguous; the block
    amax is a butterfly over those lanes and each computes the scale.  Arguments: x (uint32
    words; the element array itself when not ``aligned`` to 16 bytes), codes (uint32), scales
    (uint8), out (uint32; written only when fused), n_items (a lane's parts of blocks:
    n / (block / lanes)), kb, padded_kb, amax_parts (float32), n_parts, amax_value (float32;
    < 0: reduce the partials), global_scale (float32, 1 element, written by thread 0), seed_lo,
    seed_hi, step (uint32; with ``device_step``, a one-element int64 array holding it:
    ``_primitives.kernel_of``).
    """
    part = fmt.block_size // lanes  # elements a thread takes
    n_words = words_per(kind, part)
    groups = part // 8  # packed code words a thread stores
    tensor_scale = make_tensor_scale(fmt)
    quantize_item = make_quantize_item(kind, fmt, stochastic, swizzled, fused, aligned, lanes)

    def kernel(
        x, codes, scales, out, n_items, kb, padded_kb, amax_parts, n_parts, amax_value,
        global_scale, seed_lo, seed_hi, step,
    ):  # fmt: skip
        s6, s_dec = tensor_scale(amax_value, amax_parts, n_parts, global_scale)
        w = cuda.local.array(n_words, np.uint32)
        p = cuda.local.array(groups, np.uint32)
        v = cuda.local.array(part, np.float32)
        if lanes == 1:
            for item in range(cuda.grid(1), n_items, cuda.gridsize(1)):
                quantize_item(x, codes, scales, out, item, True, kb, padded_kb, s6, s_dec,
                              seed_lo, seed_hi, step, w, p, v)  # fmt: skip
        else:
            # every thread runs the same number of passes (whole CTAs), so all lanes of a block
            # reach its butterfly; the items past the end only take part in it
            span = cuda.blockDim.x
            padded = (n_items + span - 1) // span * span
            for i0 in range(cuda.blockIdx.x * span, padded, cuda.gridDim.x * span):
                item = i0 + cuda.threadIdx.x
                quantize_item(x, codes, scales, out, item, item < n_items, kb, padded_kb, s6,
                              s_dec, seed_lo, seed_hi, step, w, p, v)  # fmt: skip

    return kernel_of(kernel, device_step)


# ---------------------------------------------------------------------- host side


def run(ctx, call):
    """Queue the quantization of ``call`` (a checked ``_calls.QuantizeCall`` of an NVFP4 /
    MXFP4 format on the GPU) on the caller's stream; returns (data, scales, global_scale, out)
    arrays of the caller's kind (out is None unless ``call.fused``).  ``ctx`` is the caller's
    ``cuda.launch.GpuContext``."""
    from . import amax as amax_op

    geo, fmt, kind = call.geometry, call.fmt, call.kind
    data = ctx.empty(geo.shape[:-1] + (geo.shape[-1] // 2,), np.uint8)
    scales = ctx.empty(geo.scale_shape, np.uint8, zero=geo.pad)
    scratch = ctx.empty((amax_op.scratch_size(call, ctx.device_id),), np.float32)
    gs = scratch[:1]
    out = None
    if call.fused:
        out = ctx.empty(geo.shape, None, like_dtype=ctx.float_dtype_of_kind(kind))
    n_blocks = geo.n // fmt.block_size
    if n_blocks == 0:
        ctx.fill(gs, 1.0)
        return data, scales, gs, out
    xw, aligned = ctx.words_view(call.x, kind)
    tensor_scale = amax_op.tensor_scale_args(ctx, call, xw, aligned, scratch)
    lanes = launch.current_policy().lanes_per_block or lanes_per_block(fmt, call.fused)
    if fmt.block_size % (8 * lanes):
        raise ValueError(
            f"lanes_per_block: {lanes} threads cannot share a {fmt.block_size}-element block"
        )
    device_step = call.step_array is not None
    kern = quantize_kernel(
        kind, fmt, call.stochastic, geo.swizzled, call.fused, aligned, lanes, device_step
    )
    threads = launch.threads_for(LAUNCH.threads)
    codes = ctx.view(data, np.uint32)
    n_items = n_blocks * lanes
    launch.launch(
        kern,
        launch.grid_for(n_items, threads),
        threads,
        ctx,
        (
            xw,
            codes,
            ctx.view(scales),
            ctx.view(out, np.uint32) if call.fused else codes,  # never written when not fused
            launch.int64(n_items),
            launch.int64(geo.kb),
            launch.int64(geo.padded_kb),
            *tensor_scale,
            *launch.seed_step_args(ctx, call.seed, call.step, call.step_array),
        ),
    )
    return data, scales, gs, out
