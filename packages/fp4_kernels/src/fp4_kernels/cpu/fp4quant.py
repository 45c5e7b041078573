"""The CPU path of the Walsh–Hadamard transform and the FP4Quant codec, with ``numba.njit``.

The butterflies run in ``formats.hadamard.stage_order(g)``, the GPU kernels' order, each stage
the GPU register stages' own function (``_scalar.hadamard.butterflies``: ``lo + hi``,
``lo - hi`` in float32), and the codec uses the same scalar functions (``_scalar``), so codes
and scales are bit-identical to the GPU's and the transform's output too.  Inputs and outputs
are flat arrays of raw bits (see ``cpu.codec``).
"""

from __future__ import annotations

import functools

import numpy as np

from .. import _arrays as arrays
from .._calls import payload_views
from ..formats import hadamard as spec
from ..formats.hadamard import stage_order
from ._primitives import (  # the compiled scalar functions
    butterflies,
    cpu_jit,
    e2m1_decode,
    e2m1_encode,
    e2m1_encode_sr,
    f32_as_u32,
    fp4quant_scale,
    philox4x32_10,
    u32_as_f32,
)
from .codec import load, store


@functools.cache
def stage_strides(group_size):
    """The butterfly strides (1 << bit) in ``stage_order(g)``: what ``fwht_group`` takes."""
    strides = np.array([1 << b for b in stage_order(group_size)], np.int64)
    strides.flags.writeable = False  # shared by every call
    return strides


@cpu_jit
def fwht_group(buf, strides):
    """Unnormalized butterflies over one group in ``buf`` (float32), stage strides in order."""
    g = buf.shape[0]
    for h in strides:
        butterflies(buf, g, h)


@cpu_jit
def hadamard(bits, kind, g, strides, scale, inverse, sign_mask, out_bits):
    """Normalized transform of every group; ``sign_mask`` uint8 (g,) with 1 = negate, or empty."""
    buf = np.empty(g, np.float32)
    signed = sign_mask.shape[0] > 0
    for q in range(bits.shape[0] // g):
        for i in range(g):
            buf[i] = load(bits, q * g + i, kind)
        if signed and not inverse:
            for i in range(g):
                if sign_mask[i]:
                    buf[i] = -buf[i]
        fwht_group(buf, strides)
        for i in range(g):
            v = buf[i] * scale
            if signed and inverse and sign_mask[i]:
                v = -v
            store(out_bits, q * g + i, kind, v)


@cpu_jit
def encode(bits, kind, g, strides, hadamard, stochastic, seed_lo, seed_hi, step, codes, scales):
    """FP4Quant encode: ``codes`` uint8 (n/2,) packed, ``scales`` uint16 (n/g,) bf16 bits."""
    buf = np.empty(g, np.float32)
    nib = np.empty(g, np.uint8)
    for q in range(bits.shape[0] // g):
        for i in range(g):
            buf[i] = load(bits, q * g + i, kind)
        if hadamard:
            fwht_group(buf, strides)
        m = np.uint32(0)
        for i in range(g):
            a = np.uint32(f32_as_u32(buf[i]) & 0x7FFFFFFF)
            if a > m:
                m = a
        sb, mult = fp4quant_scale(m)
        scales[q] = sb
        if m >= 0x7F800000:
            for i in range(g):
                nib[i] = 0
        elif stochastic:
            for c8 in range(g // 8):
                c = (q * g) // 8 + c8  # flat element index // 8: the reference's counter
                r = philox4x32_10(
                    np.uint32(c & 0xFFFFFFFF), np.uint32(c >> 32), step, np.uint32(0),
                    seed_lo, seed_hi,
                )  # fmt: skip
                for k in range(8):  # element k: the low (even k) or high half of word k // 2
                    r16 = (r[k >> 1] >> np.uint32(16 * (k & 1))) & np.uint32(0xFFFF)
                    nib[8 * c8 + k] = e2m1_encode_sr(buf[8 * c8 + k] * mult, r16)
        else:
            for i in range(g):
                nib[i] = e2m1_encode(buf[i] * mult)
        for i in range(g // 2):
            codes[(q * g) // 2 + i] = nib[2 * i] | (nib[2 * i + 1] << 4)


@cpu_jit
def decode(codes, scales, g, strides, hadamard, inv_g, out_bits, kind):
    buf = np.empty(g, np.float32)
    for q in range(out_bits.shape[0] // g):
        for i in range(g // 2):
            byte = np.uint32(codes[(q * g) // 2 + i])
            buf[2 * i] = e2m1_decode(byte & 15)
            buf[2 * i + 1] = e2m1_decode(byte >> 4)
        s = u32_as_f32(np.uint32(np.uint32(scales[q]) << 16))
        if hadamard:
            fwht_group(buf, strides)  # exact: sums of halves below 6 * 8192
            s = s * inv_g
        for i in range(g):
            store(out_bits, q * g + i, kind, buf[i] * s)


def run_hadamard(call):
    """The raw bits (flat, numpy) of the checked ``_calls.HadamardCall``'s transform."""
    g = call.group_size
    mask = np.zeros(0, np.uint8)
    if call.sign_words is not None:
        mask = (spec.sign_bits_to_values(call.sign_words, g) < 0).astype(np.uint8)
    out_bits = np.empty(call.n, arrays.BITS_DTYPE[call.dtype])
    hadamard(arrays.cpu_bits(call.x, call.dtype), call.kind, g, stage_strides(g),
             spec.inv_sqrt_group_size(g), call.inverse, mask, out_bits)  # fmt: skip
    return out_bits


def run_encode(call):
    """(payload, codes, scales) numpy arrays of the checked ``_calls.QuantizeCall`` of an
    ``FP4Quant``: the wire buffer and its views."""
    fmt, geo = call.fmt, call.geometry
    g, n = fmt.group_size, geo.n
    payload = np.empty(n // 2 + 2 * (n // g), np.uint8)
    codes, scales = payload_views(payload, geo.shape, n, g, "numpy")
    encode(arrays.cpu_bits(call.x, call.dtype), call.kind, g, stage_strides(g), fmt.hadamard,
           call.stochastic, np.uint32(call.seed & 0xFFFFFFFF), np.uint32(call.seed >> 32),
           np.uint32(call.step), codes.reshape(-1), scales.reshape(-1))  # fmt: skip
    return payload, codes, scales


def run_decode(call):
    """The raw bits (flat, numpy) of the checked ``_calls.DequantizeCall`` of an FP4Quant
    tensor."""
    g = call.fmt.group_size
    codes = np.ascontiguousarray(arrays.to_numpy(call.data)).reshape(-1).view(np.uint8)
    scales = np.ascontiguousarray(arrays.to_numpy(call.scales)).reshape(-1).view(np.uint16)
    out_bits = np.empty(call.geometry.n, arrays.BITS_DTYPE[call.dtype])
    decode(codes, scales, g, stage_strides(g), call.fmt.hadamard,
           np.float32(2.0 ** -(g.bit_length() - 1)), out_bits, call.kind)  # fmt: skip
    return out_bits
