"""e2m1 codes on the GPU, shared by the codec kernels (quantize, dequantize, requantized_sum,
FP4Quant): packing 8 codes a word (Horner on the code floats of ``_scalar.e2m1_code_f``, or
the stochastic sums' code bytes gathered by PRMT) and decoding 4 codes at a time by PRMT table
lookups.  The scalar arithmetic itself is ``_scalar.e2m1``'s, the CPU path's too.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from .._scalar import E2M1_CODE_BIAS, KIND_F32, SR_BASE_BITS
from ._primitives import OPS, device_jit, f32_as_u32, prmt, u32_as_f32
from ._words import U32, make_words_io, words_per

# Horner packing adds the float bits 2^23 + code of 8 elements as p = 16 p + bits; modulo 2^32
# the 2^23 parts add up to 0x4B000000 * 0x11111111 = 0xFB000000, which this removes.
HORNER_FIX = U32((-E2M1_CODE_BIAS * 0x11111111) & 0xFFFFFFFF)
SIGN_NIBBLES = U32(0x88888888)
# stochastic rounding: PRMT of (0x43000000, Philox word) with these selectors puts the word's
# low (even element) or high (odd element) 16 bits under the top bytes of 128.0, the float
# 128 + r 2^-16 that ``_scalar.e2m1_sr_sum`` takes.  The constant is the first operand so
# that it sits in a register once and the selector is the instruction's immediate.
SR_BASE = U32(SR_BASE_BITS)
SR_SELECT_LOW = U32(0x3254)
SR_SELECT_STEP = U32(0x22)  # + this: 0x3276, the high half
SR_BYTE2 = U32(0x62)  # PRMT: byte 2 of a, then byte 2 of b, in the low two bytes
LOW_HALVES = U32(0x5410)  # PRMT: the low two bytes of a, then the low two bytes of b
# e2m1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 as float32 bits are 0x??..0000: their top byte and
# the byte below it, as 8-entry byte tables for PRMT (entry m = byte m of hi:lo)
E2M1_TOP_BYTES = (U32(0x3F3F3F00), U32(0x40404040))
E2M1_NEXT_BYTES = (U32(0xC0800000), U32(0xC0804000))
# PRMT selectors that assemble element e's float32 from those lookups: bytes 0 and 1 are the
# sign-replicated top byte (0x00, 0x3F or 0x40: always 0), byte 2 the next byte, byte 3 the top
E2M1_ASSEMBLE = (U32(0x40CC), U32(0x51DD), U32(0x62EE), U32(0x73FF))


@functools.cache
def make_pair_gather(length):
    """Device function ``gather(b, sel) -> (even, odd)`` over the words b[0 .. length - 1]
    (8 or 4): PRMT with selector ``sel`` picks one byte from each pair (b[k], b[k + 2]); the
    bytes of the even k land in order in ``even``, those of the odd k in ``odd`` (length 4:
    in their low two bytes).  E.g. codes from byte 2 of stochastic sums, or sign bytes."""

    @device_jit
    def gather(b, sel):
        if length == 8:
            even = prmt(prmt(b[0], b[2], sel), prmt(b[4], b[6], sel), LOW_HALVES)
            odd = prmt(prmt(b[1], b[3], sel), prmt(b[5], b[7], sel), LOW_HALVES)
        else:
            even = prmt(b[0], b[2], sel)
            odd = prmt(b[1], b[3], sel)
        return even, odd

    return gather


@device_jit
def e2m1_values4(p):
    """The four e2m1 codes in the low 16 bits of ``p`` (code e in nibble e) as float32, by
    byte-permute table lookups: 3 PRMT per 4 codes, then 1 PRMT and the sign per code."""
    mags = U32(p & 0x7777)
    top = prmt(E2M1_TOP_BYTES[0], E2M1_TOP_BYTES[1], mags)
    nxt = prmt(E2M1_NEXT_BYTES[0], E2M1_NEXT_BYTES[1], mags)
    v0 = U32(prmt(nxt, top, E2M1_ASSEMBLE[0]) | U32(U32(p << U32(28)) & 0x80000000))
    v1 = U32(prmt(nxt, top, E2M1_ASSEMBLE[1]) | U32(U32(p << U32(24)) & 0x80000000))
    v2 = U32(prmt(nxt, top, E2M1_ASSEMBLE[2]) | U32(U32(p << U32(20)) & 0x80000000))
    v3 = U32(prmt(nxt, top, E2M1_ASSEMBLE[3]) | U32(U32(p << U32(16)) & 0x80000000))
    return u32_as_f32(v0), u32_as_f32(v1), u32_as_f32(v2), u32_as_f32(v3)


@device_jit
def decode8_into(v, first, p, nvfp4, s, s_dec):
    """The 8 codes of ``p`` decoded into ``v[first .. first + 7]``: NVFP4 (value * s) * s_dec
    (the first product exact, the second the one rounding), MXFP4 value * s (s = 2^e, exact)."""
    for h in range(2):
        a, b, c, d = e2m1_values4(U32(p >> U32(16 * h)))
        j = first + 4 * h
        if nvfp4:
            v[j] = (a * s) * s_dec
            v[j + 1] = (b * s) * s_dec
            v[j + 2] = (c * s) * s_dec
            v[j + 3] = (d * s) * s_dec
        else:
            v[j] = a * s
            v[j + 1] = b * s
            v[j + 2] = c * s
            v[j + 3] = d * s


@functools.cache
def make_block_codec(kind, part):
    """Device functions that encode ``part`` elements of a block held as words (``_words``):

    ``sign_nibbles(w, g)``: the sign bits of elements 8g .. 8g+7 at bit 3 of their nibbles;
    ``encode8(w, g, mult)``: the 8 nearest-even codes of those elements, packed (element 8g in
    the low nibble), signs included;
    ``encode8_sr(w, g, mult, chunk, seed_lo, seed_hi, step)``: the same with stochastic
    rounding (one Philox call, at counter ``chunk`` = the flat index of element 8g // 8);
    """
    wide = kind == KIND_F32
    n_words = words_per(kind, part)
    element = make_words_io(kind, n_words)[1]
    e2m1_code_f = OPS.e2m1_code_f
    e2m1_sr_sum = OPS.e2m1_sr_sum
    philox = OPS.philox4x32_10
    gather8 = make_pair_gather(8)

    @device_jit
    def sign_nibbles(w, g):
        if wide:
            m = U32(0)
            for e in range(8):
                m = U32(m | U32(U32(w[8 * g + e] >> 31) << U32(4 * e + 3)))
            return m
        # the sign byte of each 16-bit element, replicated (PRMT's sign mode): x holds elements
        # 0-3 of the group, y 4-7; then even elements to bit 3, odd ones to bit 7 of each byte
        x = prmt(w[4 * g], w[4 * g + 1], U32(0xFDB9))
        y = prmt(w[4 * g + 2], w[4 * g + 3], U32(0xFDB9))
        even = prmt(x, y, U32(0x6420))
        odd = prmt(x, y, U32(0x7531))
        return U32(U32(even & 0x08080808) | U32(odd & 0x80808080))

    @device_jit
    def encode8(w, g, mult):
        p = U32(0)
        for e in range(8):  # Horner from the top element down: element 8g lands in nibble 0
            a = abs(element(w, 8 * g + 7 - e)) * mult
            p = U32(U32(p << U32(4)) + f32_as_u32(e2m1_code_f(a)))
        return U32(U32(p + HORNER_FIX) | U32(sign_nibbles(w, g) & SIGN_NIBBLES))

    @device_jit
    def encode8_sr(w, g, mult, chunk, seed_lo, seed_hi, step):
        # counter = flat element index // 8 = chunk: element 8 chunk + e takes the low (even e)
        # or high (odd e) half of word e // 2, independent of the launch configuration (as the
        # CPU path and the oracle).  NaN never gets here: a non-finite block's codes are zeroed
        # by the caller.
        r = philox(U32(chunk & 0xFFFFFFFF), U32(chunk >> 32), step, U32(0), seed_lo, seed_hi)
        s = cuda.local.array(8, np.uint32)  # registers: every index is constant once unrolled
        for e in range(8):
            sel = U32(SR_SELECT_LOW + SR_SELECT_STEP * U32(e % 2))
            big_r = u32_as_f32(prmt(SR_BASE, r[e // 2], sel))
            s[e] = f32_as_u32(e2m1_sr_sum(abs(element(w, 8 * g + e)) * mult, big_r))
        # byte 2 of each sum's bits is its code (floor(V) - 128 for V in [128, 136), no add):
        # gather the even elements' codes into the bytes of one word, the odd ones' into
        # another, and interleave them as nibbles (each code < 8: no carries)
        even, odd = gather8(s, SR_BYTE2)
        p = U32(U32(odd << U32(4)) | even)
        return U32(p | U32(sign_nibbles(w, g) & SIGN_NIBBLES))

    return sign_nibbles, encode8, encode8_sr
