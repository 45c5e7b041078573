"""NVFP4 / MXFP4 fake quantization on the GPU, ``dequantize(quantize(x))`` in one kernel that
writes no codes and no scales: the kernel and its host wrapper.

Launch contract: a thread per 8 consecutive elements (an item: 16 bytes of bf16 / fp16, 32 of
float32), ``UNROLL`` items a pass (both loads in flight before any arithmetic), a 1-D
grid-stride loop; consecutive lanes take consecutive items, so every load and every store of
a warp is contiguous.  The block / 8 lanes of a block (2 NVFP4, 4 MXFP4) reduce its amax by a
butterfly and each computes the block scale.  An element is rounded to its e2m1 value on the
float pipe (``_scalar.e2m1_code_f`` or ``e2m1_sr_code_f``, then ``e2m1_value_f``), given the
element's sign, and scaled back; the NVFP4 tensor amax is a value given by the caller or the
max over the per-CTA partials that ``cuda.amax`` wrote earlier on the same stream.

Bit-identical to ``cuda.quantize`` then ``cuda.dequantize``: the same block scale
(``_scalar.nvfp4_block_scale`` / ``mxfp4_block_scale``), the same element multiplier and
rounding, the same Philox counter (element index // 8, one call an item) and the same decode
order, NVFP4 (e2m1_value * s) * (1/S) and MXFP4 e2m1_value * 2^e; a block holding NaN or Inf
decodes to NaN (its scale s is NaN).
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from . import launch
from ._primitives import OPS, device_jit, f32_as_u32, group_max, kernel_of, prmt, u32_as_f32
from ._words import U32, U64, make_words_io, words_per
from .amax import make_tensor_scale
from .e2m1 import SR_BASE, SR_SELECT_LOW, SR_SELECT_STEP
from .launch_table import LAUNCHES

LAUNCH = LAUNCHES["quantize_dequantize"]
UNROLL = LAUNCH.items_per_thread  # items a thread a pass: both loads in flight before any math
ITEM = 8  # elements an item: one Philox call's 16-bit words for stochastic rounding
SIGN = U32(0x80000000)


@functools.cache
def make_fake_quantize_item(kind, fmt, stochastic, aligned):
    """Device functions of an item (``ITEM`` elements held as words, ``_words``):
    ``load(x, item, valid, w)``: the item's words (zeros where not ``valid``: a lane past the
    end still takes part in its block's butterfly);
    ``block_bits(w)``: the block amax bits, reduced over the block's lanes;
    ``fake_quantize(out, item, w, bits, s6, s_dec, seed_lo, seed_hi, step, v)``: the item
    rounded and stored (``v``: float32 scratch of ``ITEM``)."""
    n_words = words_per(kind, ITEM)
    lanes = fmt.block_size // ITEM
    load_words, element, amax_bits, _, store = make_words_io(kind, n_words, aligned)
    nvfp4 = fmt.tensor_scale
    nvfp4_block_scale = OPS.nvfp4_block_scale
    mxfp4_block_scale = OPS.mxfp4_block_scale
    e2m1_code_f = OPS.e2m1_code_f
    e2m1_sr_code_f = OPS.e2m1_sr_code_f
    e2m1_value_f = OPS.e2m1_value_f
    philox = OPS.philox4x32_10

    @device_jit
    def load(x, item, valid, w):
        if valid:
            load_words(x, U64(item) * U64(n_words), w)
        else:
            for j in range(n_words):
                w[j] = U32(0)

    @device_jit
    def block_bits(w):
        bits = amax_bits(w)
        return U32(group_max(np.int32(bits), lanes))  # |x| bits <= 0x7FFFFFFF: int32 safe

    @device_jit
    def fake_quantize(out, item, w, bits, s6, s_dec, seed_lo, seed_hi, step, v):
        if nvfp4:
            _, s, mult = nvfp4_block_scale(bits, s6, s_dec)
        else:
            _, s, mult = mxfp4_block_scale(bits)
        # the element's sign, as its code's sign bit; a non-finite block's codes are zero
        # (+0 under the NaN scale: NaN either way)
        sign = SIGN if bits < 0x7F800000 else U32(0)
        r = (U32(0), U32(0), U32(0), U32(0))
        if stochastic:  # counter = flat element index // 8 = the item, as cuda.quantize's
            r = philox(U32(U64(item) & 0xFFFFFFFF), U32(U64(item) >> 32), step, U32(0),
                       seed_lo, seed_hi)  # fmt: skip
        for e in range(ITEM):
            f = element(w, e)
            a = abs(f) * mult
            if stochastic:
                sel = U32(SR_SELECT_LOW + SR_SELECT_STEP * U32(e % 2))
                c = e2m1_sr_code_f(a, u32_as_f32(prmt(SR_BASE, r[e // 2], sel)))
            else:
                c = e2m1_code_f(a)
            val = u32_as_f32(U32(f32_as_u32(e2m1_value_f(c)) | U32(f32_as_u32(f) & sign)))
            if nvfp4:  # (e2m1 value * s) is exact; the product with 1/S rounds, as dequantize
                v[e] = (val * s) * s_dec
            else:  # s = 2^e: exact
                v[e] = val * s
        store(out, U64(item) * U64(n_words), v, 0)

    return load, block_bits, fake_quantize


@functools.cache
def fake_quantize_kernel(kind, fmt, stochastic, aligned=True, device_step=False):
    """Build (once per configuration) the fake-quantization kernel of ``fmt`` (a
    ``FormatSpec``).  Arguments: x (uint32 words; the element array itself when not
    ``aligned`` to 16 bytes), out (uint32 words), n_items (n / 8), amax_parts (float32),
    n_parts, amax_value (float32; < 0: reduce the partials), global_scale (float32, 1 element,
    written by thread 0), seed_lo, seed_hi, step (uint32; with ``device_step``, a
    one-element int64 array holding it: ``_primitives.kernel_of``)."""
    if UNROLL != 2:
        raise ValueError(f"quantize_dequantize: the kernel takes 2 items a pass, not {UNROLL}")
    n_words = words_per(kind, ITEM)
    tensor_scale = make_tensor_scale(fmt)
    load, block_bits, fake_quantize = make_fake_quantize_item(kind, fmt, stochastic, aligned)

    def kernel(x, out, n_items, amax_parts, n_parts, amax_value, global_scale, seed_lo,
               seed_hi, step):  # fmt: skip
        s6, s_dec = tensor_scale(amax_value, amax_parts, n_parts, global_scale)
        w0 = cuda.local.array(n_words, np.uint32)
        w1 = cuda.local.array(n_words, np.uint32)
        v = cuda.local.array(ITEM, np.float32)
        span = cuda.blockDim.x
        tile = span * UNROLL
        # every thread runs the same number of passes (whole CTAs), so all lanes of a block
        # reach its butterfly; the items past the end only take part in it
        padded = (n_items + tile - 1) // tile * tile
        for t0 in range(cuda.blockIdx.x * tile, padded, cuda.gridDim.x * tile):
            i0 = t0 + cuda.threadIdx.x
            i1 = i0 + span
            load(x, i0, i0 < n_items, w0)
            load(x, i1, i1 < n_items, w1)
            b0 = block_bits(w0)
            b1 = block_bits(w1)
            if i0 < n_items:
                fake_quantize(out, i0, w0, b0, s6, s_dec, seed_lo, seed_hi, step, v)
            if i1 < n_items:
                fake_quantize(out, i1, w1, b1, s6, s_dec, seed_lo, seed_hi, step, v)

    return kernel_of(kernel, device_step)


# ---------------------------------------------------------------------- host side


def run(ctx, call):
    """Queue the fake quantization of ``call`` (a checked ``_calls.QuantizeCall`` with
    ``fused`` set, of an NVFP4 / MXFP4 format on the GPU) on the caller's stream: the amax
    pass first when NVFP4 computes its tensor amax, then the kernel.  Returns (out,), an array
    of the caller's kind."""
    from . import amax as amax_op

    geo, fmt, kind = call.geometry, call.fmt, call.kind
    out = ctx.empty(geo.shape, None, like_dtype=ctx.float_dtype_of_kind(kind))
    n_items = geo.n // ITEM
    if n_items == 0:
        return (out,)
    # [global_scale (written, unused), amax partials...]
    scratch = ctx.empty((amax_op.scratch_size(call, ctx.device_id),), np.float32)
    xw, aligned = ctx.words_view(call.x, kind)
    tensor_scale = amax_op.tensor_scale_args(ctx, call, xw, aligned, scratch)
    threads = launch.threads_for(LAUNCH.threads)
    launch.launch(
        fake_quantize_kernel(kind, fmt, call.stochastic, aligned, call.step_array is not None),
        launch.grid_for(n_items, threads * UNROLL),
        threads,
        ctx,
        (
            xw,
            ctx.view(out, np.uint32),
            launch.int64(n_items),
            *tensor_scale,
            *launch.seed_step_args(ctx, call.seed, call.step, call.step_array),
        ),
    )
    return (out,)
