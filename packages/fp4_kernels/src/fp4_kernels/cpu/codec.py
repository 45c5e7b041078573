"""The CPU path: NVFP4 / MXFP4 quantize, dequantize and fused fake-quant with ``numba.njit``.

``quantize(call)`` and ``dequantize(call)`` take the call descriptors (``_calls``) and return
numpy arrays; the compiled functions below them take flat arrays of raw bits.  Same scalar
arithmetic as the GPU kernels (``fp4_kernels._scalar``), so codes and scales are
bit-identical; stochastic rounding draws the same random bits (one Philox call per 8 elements,
at counter = flat index // 8, 16 bits an element).
Inputs arrive as flat arrays of raw bits: uint32 for float32, uint16 for bfloat16 / float16.
"""

from __future__ import annotations

import numpy as np

from .. import _arrays as arrays
from .._scalar import INV_E2M1_MAX, KIND_BF16, KIND_F32
from .._scalar.arith import F32_INF, F32_ONE, F32_ZERO
from ._primitives import (  # the compiled scalar functions
    bf16_to_f32,
    cpu_jit,
    e2m1_decode,
    e2m1_encode,
    e2m1_encode_sr,
    e4m3_decode,
    e8m0_decode,
    f16_to_f32,
    f32_as_u32,
    f32_to_bf16,
    f32_to_f16,
    mxfp4_block_scale,
    nvfp4_block_scale,
    nvfp4_encode_scale,
    philox4x32_10,
    scale_offset,
    u32_as_f32,
)


@cpu_jit
def load(bits, i, kind):
    if kind == KIND_F32:
        return u32_as_f32(np.uint32(bits[i]))
    if kind == KIND_BF16:
        return bf16_to_f32(np.uint32(bits[i]))
    return f16_to_f32(np.uint32(bits[i]))


@cpu_jit
def store(bits, i, kind, v):
    if kind == KIND_F32:
        bits[i] = f32_as_u32(v)
    elif kind == KIND_BF16:
        bits[i] = f32_to_bf16(v)
    else:
        bits[i] = f32_to_f16(v)


@cpu_jit
def tensor_amax(bits, kind):
    """max |x| over finite elements (0 when there are none)."""
    m = F32_ZERO
    for i in range(bits.size):
        u = f32_as_u32(load(bits, i, kind)) & 0x7FFFFFFF
        if u < 0x7F800000:
            a = u32_as_f32(np.uint32(u))
            if a > m:
                m = a
    return m


@cpu_jit
def load_block(bits, base, kind, vals):
    """The block of ``vals.size`` elements at ``base`` into ``vals`` (float32); returns its
    amax, inf when the block holds a NaN or an Inf."""
    bmax = F32_ZERO
    for j in range(vals.size):
        v = load(bits, base + j, kind)
        vals[j] = v
        u = f32_as_u32(v) & 0x7FFFFFFF
        a = F32_INF if u >= 0x7F800000 else u32_as_f32(np.uint32(u))
        if a > bmax:
            bmax = a
    return bmax


@cpu_jit
def quantize_blocks(
    bits,
    kind,
    tensor_scale,
    block,
    stochastic,
    swizzled,
    kb,
    padded_kb,
    amax,
    seed_lo,
    seed_hi,
    step,
    packed,
    scales,
    fused,
    out_bits,
):
    """Quantize flat ``bits`` into ``packed`` (n/2 bytes) and ``scales`` in blocks of ``block``
    elements, under a tensor scale (NVFP4) or not (MXFP4); returns 1/S.

    ``amax`` < 0 means: compute the tensor amax here.  With ``fused`` the reconstruction is also
    written to ``out_bits`` in the input's kind.  Operation order: see ``cuda.quantize``.
    """
    n = bits.size
    s6 = F32_ZERO
    s_dec = F32_ONE
    if tensor_scale:
        if amax < F32_ZERO:
            amax = tensor_amax(bits, kind)
        big_s = nvfp4_encode_scale(amax)
        s_dec = F32_ONE / big_s
        s6 = big_s * INV_E2M1_MAX
    vals = np.empty(block, dtype=np.float32)
    codes = np.empty(block, dtype=np.int64)
    for b in range(n // block):
        base = b * block
        bmax = load_block(bits, base, kind, vals)
        finite = bmax < F32_INF
        # the block arithmetic the GPU kernels share (_scalar): scale code, decoded scale,
        # element multiplier; a non-finite block gets the NaN code and multiplier 0
        if tensor_scale:
            scode, s, mult = nvfp4_block_scale(f32_as_u32(bmax), s6, s_dec)
        else:
            scode, s, mult = mxfp4_block_scale(f32_as_u32(bmax))
        scales[scale_offset(b, kb, padded_kb, swizzled)] = scode
        if not finite:
            codes[:] = 0
        elif stochastic:
            for j in range(0, block, 8):
                c = (base + j) >> 3  # flat element index // 8: the reference's counter
                r = philox4x32_10(
                    np.uint32(c & 0xFFFFFFFF),
                    np.uint32(c >> 32),
                    step,
                    np.uint32(0),
                    seed_lo,
                    seed_hi,
                )
                for q in range(8):  # element q: the low (even q) or high half of word q // 2
                    r16 = (r[q >> 1] >> np.uint32(16 * (q & 1))) & np.uint32(0xFFFF)
                    codes[j + q] = e2m1_encode_sr(vals[j + q] * mult, r16)
        else:
            for j in range(block):
                codes[j] = e2m1_encode(vals[j] * mult)
        for j in range(0, block, 2):
            packed[(base + j) >> 1] = codes[j] | (codes[j + 1] << 4)
        if fused:
            if tensor_scale:
                for j in range(block):
                    store(out_bits, base + j, kind, (e2m1_decode(codes[j]) * s) * s_dec)
            else:  # s = 2^e: exact
                for j in range(block):
                    store(out_bits, base + j, kind, e2m1_decode(codes[j]) * s)
    return s_dec


@cpu_jit
def dequantize_blocks(packed, scales, s_dec, tensor_scale, block, swizzled, kb, padded_kb,
                      out_bits, kind):  # fmt: skip
    """Decode ``packed`` codes with their block scales into ``out_bits`` (raw bits of ``kind``)."""
    n = packed.size * 2
    for b in range(n // block):
        base = b * block
        scode = scales[scale_offset(b, kb, padded_kb, swizzled)]
        if tensor_scale:
            s = e4m3_decode(scode)
            for j in range(0, block, 2):
                p = packed[(base + j) >> 1]
                store(out_bits, base + j, kind, (e2m1_decode(p & 15) * s) * s_dec)
                store(out_bits, base + j + 1, kind, (e2m1_decode(p >> 4) * s) * s_dec)
        else:
            x = e8m0_decode(scode)
            for j in range(0, block, 2):
                p = packed[(base + j) >> 1]
                store(out_bits, base + j, kind, e2m1_decode(p & 15) * x)
                store(out_bits, base + j + 1, kind, e2m1_decode(p >> 4) * x)


def quantize(call):
    """(codes, scales, 1/S, out_bits) of the checked ``_calls.QuantizeCall`` on the CPU: numpy
    arrays (codes (..., K/2), scales in the call's layout, out_bits the reconstruction's raw bits,
    empty unless ``call.fused``) and the tensor decode scale as a float32."""
    geo, fmt = call.geometry, call.fmt
    bits = arrays.cpu_bits(call.x, call.dtype)
    packed = np.empty(geo.shape[:-1] + (geo.shape[-1] // 2,), np.uint8)
    scales = (np.zeros if geo.pad else np.empty)(geo.scale_shape, np.uint8)
    out_bits = np.empty(geo.n if call.fused else 0, bits.dtype)
    s_dec = quantize_blocks(
        bits, call.kind, fmt.tensor_scale, fmt.block_size, call.stochastic, geo.swizzled, geo.kb,
        geo.padded_kb, np.float32(call.amax_value), np.uint32(call.seed & 0xFFFFFFFF),
        np.uint32(call.seed >> 32), np.uint32(call.step), packed.reshape(-1), scales.reshape(-1),
        call.fused, out_bits,
    )  # fmt: skip
    return packed, scales, np.float32(s_dec), out_bits


def dequantize(call):
    """The raw bits (flat, numpy) of the checked ``_calls.DequantizeCall`` decoded on the CPU."""
    geo, fmt = call.geometry, call.fmt
    packed = np.ascontiguousarray(arrays.to_numpy(call.data)).reshape(-1)
    scales = np.ascontiguousarray(arrays.to_numpy(call.scales)).reshape(-1)
    gs = np.float32(1.0)
    if call.global_scale is not None:
        gs = np.float32(np.asarray(arrays.to_numpy(call.global_scale), np.float32).reshape(-1)[0])
    out_bits = np.empty(geo.n, arrays.BITS_DTYPE[call.dtype])
    dequantize_blocks(packed, scales, gs, fmt.tensor_scale, fmt.block_size, geo.swizzled, geo.kb,
                      geo.padded_kb, out_bits, call.kind)  # fmt: skip
    return out_bits
