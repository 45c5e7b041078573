"""Device helpers for the chunked access pattern every codec kernel uses.

A *chunk* is 4 consecutive elements: 8 bytes of a 16-bit input (one 8-byte load, the widest
numba-cuda issues) or 16 bytes of float32 (two).  Consecutive lanes own consecutive chunks, so
each warp-wide load or store is contiguous.  An NVFP4 block (16 elements) spans 4 lanes and an
MXFP4 block (32) spans 8; the block amax is a butterfly shuffle over those lanes.  The 4 codes of
a chunk are packed into one uint16 in registers (element 4c+j in nibble j: element 2i in the low
nibble of byte i, as cuBLASLt reads it) and written with one 2-byte store.
"""

from __future__ import annotations

import numpy as np

from .._scalar import KIND_BF16, KIND_F16, KIND_F32
from ._primitives import (
    OPS,
    cvt_bf16x2,
    cvt_f16_to_f32,
    cvt_f16x2,
    device_jit,
    f32_as_u32,
    u32_as_f32,
)

_U32 = np.uint64(32)
U32 = np.uint32
U64 = np.uint64


def make_chunk_io(kind):
    """Return ``(load_chunk, store_chunk, load_raw, unpack)`` device functions for a kind.

    ``load_chunk(words, c, n_chunks)`` returns chunk ``c`` as four float32 values (zeros past
    the end, so out-of-range lanes still take part in the shuffles); ``store_chunk`` writes four
    float32 values rounded to the kind (round to nearest even).  ``load_raw`` returns the
    chunk's raw 8-byte word(s) and ``unpack`` converts them: loading raw words ahead keeps 2
    registers per chunk of 16-bit input live instead of 4 floats.
    """
    if kind == KIND_F32:

        @device_jit
        def load_raw(words, c, n_chunks):
            if c >= n_chunks:
                return U64(0), U64(0)
            return words[U64(2 * c)], words[U64(2 * c + 1)]

        @device_jit
        def unpack(w0, w1):
            return (
                u32_as_f32(np.uint32(w0)),
                u32_as_f32(np.uint32(w0 >> _U32)),
                u32_as_f32(np.uint32(w1)),
                u32_as_f32(np.uint32(w1 >> _U32)),
            )

        @device_jit
        def load_chunk(words, c, n_chunks):
            if c >= n_chunks:
                z = np.float32(0.0)
                return z, z, z, z
            w0 = words[U64(2 * c)]  # unsigned index: no negative-index wraparound code
            w1 = words[U64(2 * c + 1)]
            return (
                u32_as_f32(np.uint32(w0)),
                u32_as_f32(np.uint32(w0 >> _U32)),
                u32_as_f32(np.uint32(w1)),
                u32_as_f32(np.uint32(w1 >> _U32)),
            )

        @device_jit
        def store_chunk(words, c, v0, v1, v2, v3):
            words[U64(2 * c)] = U64(f32_as_u32(v0)) | (U64(f32_as_u32(v1)) << _U32)
            words[U64(2 * c + 1)] = U64(f32_as_u32(v2)) | (U64(f32_as_u32(v3)) << _U32)

        return load_chunk, store_chunk, load_raw, unpack

    to_f32 = OPS.bf16_to_f32 if kind == KIND_BF16 else OPS.f16_to_f32
    from_f32 = OPS.f32_to_bf16 if kind == KIND_BF16 else OPS.f32_to_f16
    if kind == KIND_F16 and cvt_f16_to_f32 is not None:
        to_f32 = cvt_f16_to_f32  # one instruction instead of the integer conversion
    pack2 = None  # (hi, lo) -> two 16-bit floats in one uint32, rounded to nearest even
    if cvt_bf16x2 is not None:
        pack2 = cvt_bf16x2 if kind == KIND_BF16 else cvt_f16x2

    @device_jit
    def load_raw16(words, c, n_chunks):
        if c >= n_chunks:
            return U64(0), U64(0)
        return words[U64(c)], U64(0)

    @device_jit
    def unpack16(w, unused):
        lo = np.uint32(w)
        hi = np.uint32(w >> _U32)
        return (
            to_f32(U32(lo & 0xFFFF)),
            to_f32(U32(lo >> 16)),
            to_f32(U32(hi & 0xFFFF)),
            to_f32(U32(hi >> 16)),
        )

    @device_jit
    def load_chunk16(words, c, n_chunks):
        if c >= n_chunks:
            z = np.float32(0.0)
            return z, z, z, z
        w = words[U64(c)]
        lo = np.uint32(w)
        hi = np.uint32(w >> _U32)
        return (
            to_f32(U32(lo & 0xFFFF)),
            to_f32(U32(lo >> 16)),
            to_f32(U32(hi & 0xFFFF)),
            to_f32(U32(hi >> 16)),
        )

    if pack2 is not None:
        # the hardware conversions round exactly as the integer ones (NaN payloads aside;
        # NaN only ever comes from a NaN block scale), one instruction per pair.
        @device_jit
        def store_chunk16(words, c, v0, v1, v2, v3):
            words[U64(c)] = U64(pack2(v1, v0)) | (U64(pack2(v3, v2)) << _U32)

    else:

        @device_jit
        def store_chunk16(words, c, v0, v1, v2, v3):
            # two 32-bit halves first: 32-bit ors, one 64-bit combine
            lo = U32(U32(from_f32(v0)) | U32(U32(from_f32(v1)) << 16))
            hi = U32(U32(from_f32(v2)) | U32(U32(from_f32(v3)) << 16))
            words[U64(c)] = U64(lo) | (U64(hi) << _U32)

    return load_chunk16, store_chunk16, load_raw16, unpack16


@device_jit
def max4_abs_bits(v0, v1, v2, v3):
    """max of |v| over four floats, on the bits (integer order is float order for |v|).

    NaN bits exceed +inf's, so the result is >= 0x7F800000 exactly when the chunk holds a
    non-finite value; that flags the block.
    """
    a = U32(f32_as_u32(v0) & 0x7FFFFFFF)
    b = U32(f32_as_u32(v1) & 0x7FFFFFFF)
    c = U32(f32_as_u32(v2) & 0x7FFFFFFF)
    d = U32(f32_as_u32(v3) & 0x7FFFFFFF)
    # int32: warp shuffles take signed 32-bit words; every value here is <= 0x7FFFFFFF
    return np.int32(max(max(a, b), max(c, d)))


@device_jit
def finite_abs(v):
    """|v| for finite v, 0 otherwise: the tensor amax ignores non-finite values."""
    u = f32_as_u32(v) & 0x7FFFFFFF
    if u >= 0x7F800000:
        return np.float32(0.0)
    return u32_as_f32(np.uint32(u))


scale_offset = OPS.scale_offset
