"""Elements in 32-bit words: how the block kernels (quantize, dequantize, amax, reduce) read
and write float32, bfloat16 and float16 data.

A thread holds a block of elements as a local array of uint32 words (two 16-bit elements per
word, element 2i in the low half; one float32 per word), loaded and stored 16 bytes at a time.
Every loop over a block has a compile-time trip count, so the compiler unrolls it and keeps the
array in registers.
"""

from __future__ import annotations

import functools

import numpy as np

from .._scalar import KIND_BF16, KIND_F16, KIND_F32
from ._primitives import (
    OPS,
    cvt_bf16x2,
    cvt_f16_to_f32,
    cvt_f16x2,
    device_jit,
    f32_as_u32,
    load_v4,
    max_u16x2,
    store_v2,
    store_v4,
    u32_as_f32,
)

U32 = np.uint32
U64 = np.uint64
ELEMENT_BYTES = {KIND_F32: 4, KIND_BF16: 2, KIND_F16: 2}


def words_per(kind, elements):
    """uint32 words that hold ``elements`` elements of ``kind``."""
    return elements * ELEMENT_BYTES[kind] // 4


@functools.cache
def make_words_io(kind, n_words, aligned=True):
    """Device functions for blocks of ``n_words`` words (a multiple of 4, or 1 or 2) of ``kind``:

    ``load(x, first, w)``: words ``first ..`` of ``x`` into the local array ``w`` (16-byte loads
    through the read-only path where ``aligned``, word loads for a block of 1 or 2 words; ``x``
    is then a uint32 array; otherwise ``x`` is the data's own element array and the words are
    assembled from element loads);
    ``element(w, j)``: element ``j`` of the block as float32 (exact);
    ``amax_bits(w)``: max |element| as float32 bits (>= 0x7F800000: a NaN or Inf is present);
    ``finite_amax_bits(w)``: max |element| over the finite elements only;
    ``store(out, first, v, at)``: the elements ``v[at ..]`` (a float32 local array) rounded to
    ``kind`` (nearest even) and stored 16 bytes at a time (8 or 4 bytes at a time for a block
    of 2 or 1 words; ``out`` a uint32 array).  Any other ``n_words`` is an error (the 16-byte
    loops would move nothing: a kernel built on them would compile and store no data).
    """
    if n_words <= 0 or (n_words % 4 and n_words not in (1, 2)):
        raise ValueError(
            f"n_words: {n_words} is not a multiple of 4, or 1 or 2 (16-, 8- or 4-byte "
            "accesses); give the device functions whole 16-byte blocks, or 4 or 8 bytes"
        )
    return (
        _make_load(kind, n_words, aligned),
        *_make_reads(kind, n_words),
        _make_store(kind, n_words),
    )


def _half_to_f32():
    """IEEE binary16 bits -> float32: the conversion instruction, or the simulator's integer
    conversion."""
    return cvt_f16_to_f32 if cvt_f16_to_f32 is not None else OPS.f16_to_f32


def _make_load(kind, n_words, aligned):
    quads = n_words % 4 == 0  # 16-byte accesses
    wide = kind == KIND_F32

    @device_jit
    def load(x, first, w):
        if aligned and quads:
            for q in range(n_words // 4):
                w[4 * q], w[4 * q + 1], w[4 * q + 2], w[4 * q + 3] = load_v4(x, first + 4 * q)
        elif aligned or wide:
            for j in range(n_words):
                w[j] = U32(x[first + j])
        else:
            for j in range(n_words):
                lo = U32(x[2 * (first + j)])
                w[j] = U32(lo | U32(U32(x[2 * (first + j) + 1]) << 16))

    return load


def _make_reads(kind, n_words):
    wide = kind == KIND_F32
    to_f32 = _half_to_f32()
    # the smallest 16-bit magnitude that is Inf or NaN: bf16 0x7F80, f16 0x7C00
    nonfinite16 = 0x7F80 if kind == KIND_BF16 else 0x7C00
    carry16 = U32((0x8000 - nonfinite16) * 0x10001)  # + this sets bit 15 of a half >= it

    @device_jit
    def element(w, j):
        if wide:
            return u32_as_f32(w[j])
        word = w[j >> 1]
        if kind == KIND_BF16:
            if j & 1:
                return u32_as_f32(U32(word & 0xFFFF0000))
            return u32_as_f32(U32(word << 16))
        if j & 1:
            return to_f32(U32(word >> 16))
        return to_f32(U32(word & 0xFFFF))

    @device_jit
    def half_bits_to_f32_bits(m16):
        if kind == KIND_BF16:
            return U32(m16 << 16)
        return f32_as_u32(to_f32(m16))  # exact; Inf and NaN stay non-finite

    @device_jit
    def amax_bits(w):
        m = U32(0)
        if wide:
            for j in range(n_words):
                m = max(m, U32(w[j] & 0x7FFFFFFF))
            return m
        # |x| bits order as |x| does (NaN above Inf): max of each half, then of the two
        for j in range(n_words):
            m = max_u16x2(m, U32(w[j] & 0x7FFF7FFF))
        return half_bits_to_f32_bits(max(U32(m & 0xFFFF), U32(m >> 16)))

    @device_jit
    def finite_amax_bits(w):
        m = U32(0)
        if wide:
            for j in range(n_words):
                a = U32(w[j] & 0x7FFFFFFF)
                if a < 0x7F800000:
                    m = max(m, a)
            return m
        for j in range(n_words):
            a = U32(w[j] & 0x7FFF7FFF)
            # bit 15 of each half set exactly where that half is Inf or NaN: zero those halves
            flags = U32(U32(a + carry16) & 0x80008000)
            a = U32(a & U32(~U32(U32(flags >> 15) * 0xFFFF)))
            m = max_u16x2(m, a)
        return half_bits_to_f32_bits(max(U32(m & 0xFFFF), U32(m >> 16)))

    return element, amax_bits, finite_amax_bits


def _make_store(kind, n_words):
    quads = n_words % 4 == 0  # 16-byte accesses
    wide = kind == KIND_F32
    if cvt_bf16x2 is not None:
        pack2 = cvt_bf16x2 if kind == KIND_BF16 else cvt_f16x2
    else:  # the simulator: the integer conversions (the same rounding)
        from_f32 = OPS.f32_to_bf16 if kind == KIND_BF16 else OPS.f32_to_f16

        @device_jit
        def pack2(hi, lo):
            return U32(U32(from_f32(lo)) | U32(U32(from_f32(hi)) << 16))

    @device_jit
    def store(out, first, v, at):
        if wide and not quads:
            for j in range(n_words):
                out[first + j] = f32_as_u32(v[at + j])
        elif wide:
            for q in range(n_words // 4):
                store_v4(
                    out,
                    first + 4 * q,
                    f32_as_u32(v[at + 4 * q]),
                    f32_as_u32(v[at + 4 * q + 1]),
                    f32_as_u32(v[at + 4 * q + 2]),
                    f32_as_u32(v[at + 4 * q + 3]),
                )
        elif n_words == 1:
            out[first] = pack2(v[at + 1], v[at])
        elif n_words == 2:
            store_v2(out, first, pack2(v[at + 1], v[at]), pack2(v[at + 3], v[at + 2]))
        else:
            for q in range(n_words // 4):
                store_v4(
                    out,
                    first + 4 * q,
                    pack2(v[at + 8 * q + 1], v[at + 8 * q]),
                    pack2(v[at + 8 * q + 3], v[at + 8 * q + 2]),
                    pack2(v[at + 8 * q + 5], v[at + 8 * q + 4]),
                    pack2(v[at + 8 * q + 7], v[at + 8 * q + 6]),
                )

    return store
