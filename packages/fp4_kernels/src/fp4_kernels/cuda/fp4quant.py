"""FP4Quant group codec kernels: one pass each way (``formats.fp4quant`` is the spec).

encode: read x once -> (optional) butterflies -> group amax -> bf16 scale -> e2m1 codes; write
        the packed codes (4 per uint16, element 4c + r in nibble r) and one uint16 scale per group.
decode: read codes and scales once -> (optional) butterflies on the e2m1 values (exact) ->
        * (scale * 2^-log2(g)); write the tensor.

Element layout, launch contract and butterfly order are those of ``cuda.hadamard``.  The group
amax is reduced like the transform: over a chunk's 4 registers, over the thread's chunks that
share a group (g >= 256), over the lanes of the group (butterfly shuffles; every lane ends with
it) and, for g >= 1024, over the CTA's warps through shared memory.  The thread that holds a
group's first chunk stores its scale.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from . import launch
from ._chunk import U32, U64, make_chunk_io, max4_abs_bits
from ._primitives import FULL_MASK, OPS, WARP_SIZE, device_jit, u32_as_f32
from .hadamard import (
    CHUNKS,
    REGISTERS,
    TILE_CHUNKS,
    group_grid,
    group_warps,
    make_butterflies,
    make_tile_io,
    smem_words,
)

_NONFINITE = 0x7F800000  # |t| bits at or above this: Inf or NaN


@functools.cache
def fp4quant_encode_kernel(kind, group_size, hadamard, stochastic):
    load_tile_raw, unpack_tile = make_tile_io(kind)
    butterflies = make_butterflies(group_size) if hadamard else None
    n_smem = smem_words(group_size)
    warps_per_group = group_warps(group_size)
    group_chunks = group_size // 4
    # lanes a group spans, as a shuffle butterfly: offsets 1 .. lanes/2
    group_lanes = min(WARP_SIZE, group_chunks)
    chunks_shared = 1 if group_size <= 128 else (2 if group_size == 256 else 4)
    e2m1_encode = OPS.e2m1_encode
    e2m1_encode_sr = OPS.e2m1_encode_sr
    fp4quant_scale = OPS.fp4quant_scale
    philox = OPS.philox4x32_10

    @device_jit
    def encode_chunk(v, j, mult, finite, c, seed_lo, seed_hi, step):
        """The 4 codes of chunk j of ``v`` packed into a uint16 (0 for a non-finite group)."""
        packed = U32(0)
        if finite:
            if stochastic:
                # counter = flat element index // 4 = chunk index, word r for element 4c + r:
                # the same words as NVFP4 / MXFP4 stochastic rounding and the reference.
                r0, r1, r2, r3 = philox(
                    np.uint32(c & 0xFFFFFFFF), np.uint32(c >> 32), step, np.uint32(0),
                    seed_lo, seed_hi,
                )  # fmt: skip
                packed = U32(
                    e2m1_encode_sr(v[4 * j] * mult, r0)
                    | (e2m1_encode_sr(v[4 * j + 1] * mult, r1) << 4)
                    | (e2m1_encode_sr(v[4 * j + 2] * mult, r2) << 8)
                    | (e2m1_encode_sr(v[4 * j + 3] * mult, r3) << 12)
                )
            else:
                packed = U32(
                    e2m1_encode(v[4 * j] * mult)
                    | (e2m1_encode(v[4 * j + 1] * mult) << 4)
                    | (e2m1_encode(v[4 * j + 2] * mult) << 8)
                    | (e2m1_encode(v[4 * j + 3] * mult) << 12)
                )
        return np.uint16(packed)

    @device_jit
    def lanes_max(m):
        off = 1
        while off < group_lanes:
            o = cuda.shfl_xor_sync(FULL_MASK, m, off)
            if o > m:
                m = o
            off *= 2
        return m

    @cuda.jit
    def kernel(words, codes16, scales16, n_chunks, seed_lo, seed_hi, step):
        tid = cuda.threadIdx.x
        lane = tid % WARP_SIZE
        warp = tid // WARP_SIZE
        sm = cuda.shared.array(n_smem, np.float32)
        warp_amax = cuda.shared.array(16, np.int32)
        v = cuda.local.array(REGISTERS, np.float32)
        tile_chunks = TILE_CHUNKS * (cuda.blockDim.x // WARP_SIZE)
        n_tiles = (n_chunks + tile_chunks - 1) // tile_chunks
        t = cuda.blockIdx.x
        base = t * tile_chunks + warp * TILE_CHUNKS + lane
        stride = cuda.gridDim.x * tile_chunks
        w0, w1, w2, w3, w4, w5, w6, w7 = load_tile_raw(words, base, n_chunks)
        while t < n_tiles:
            unpack_tile(v, w0, w1, w2, w3, w4, w5, w6, w7)
            w0, w1, w2, w3, w4, w5, w6, w7 = load_tile_raw(words, base + stride, n_chunks)
            if hadamard:
                butterflies(v, lane, sm)
            # |t| bits (int32: shuffles move signed words); NaN bits exceed Inf's
            m0 = max4_abs_bits(v[0], v[1], v[2], v[3])
            m1 = max4_abs_bits(v[4], v[5], v[6], v[7])
            m2 = max4_abs_bits(v[8], v[9], v[10], v[11])
            m3 = max4_abs_bits(v[12], v[13], v[14], v[15])
            if chunks_shared >= 2:  # chunks 0,1 (and 2,3) hold one group: element bit 7
                m0 = max(m0, m1)
                m2 = max(m2, m3)
            if chunks_shared == 4:  # all four: bit 8 too
                m0 = max(m0, m2)
            m0 = lanes_max(m0)
            if chunks_shared < 4:
                m2 = lanes_max(m2)
            if chunks_shared == 1:
                m1 = lanes_max(m1)
                m3 = lanes_max(m3)
            if warps_per_group > 1:
                if lane == 0:
                    warp_amax[warp] = m0
                cuda.syncthreads()  # every warp's amax is visible
                m0 = warp_amax[0]
                for w in range(1, warps_per_group):
                    m0 = max(m0, warp_amax[w])
                if not hadamard:
                    # with the transform, the next tile's barriers order these reads before
                    # the next writes; without it, this one does
                    cuda.syncthreads()
            if chunks_shared >= 2:
                m1 = m0
                m3 = m2
            if chunks_shared == 4:
                m2 = m0
                m3 = m0
            s0, k0 = fp4quant_scale(U32(m0))
            s1, k1 = s0, k0
            s2, k2 = s0, k0
            s3, k3 = s0, k0
            if chunks_shared < 4:
                s2, k2 = fp4quant_scale(U32(m2))
                s3, k3 = s2, k2
            if chunks_shared == 1:
                s1, k1 = fp4quant_scale(U32(m1))
                s3, k3 = fp4quant_scale(U32(m3))
            for j in range(CHUNKS):
                c = base + 32 * j
                if j == 0:
                    s, k, mj = s0, k0, m0
                elif j == 1:
                    s, k, mj = s1, k1, m1
                elif j == 2:
                    s, k, mj = s2, k2, m2
                else:
                    s, k, mj = s3, k3, m3
                packed = encode_chunk(v, j, k, mj < _NONFINITE, c, seed_lo, seed_hi, step)
                if c < n_chunks:
                    codes16[U64(c)] = packed
                    if c % group_chunks == 0:  # the group's first chunk stores its scale
                        scales16[U64(c // group_chunks)] = np.uint16(s)
            t += cuda.gridDim.x
            base += stride

    return kernel


@functools.cache
def fp4quant_decode_kernel(out_kind, group_size, hadamard):
    store_chunk = make_chunk_io(out_kind)[1]
    butterflies = make_butterflies(group_size) if hadamard else None
    n_smem = smem_words(group_size)
    group_chunks = group_size // 4
    inv_g = np.float32(2.0 ** -(group_size.bit_length() - 1))
    e2m1_decode = OPS.e2m1_decode

    @device_jit
    def load_one(codes16, scales16, c, n_chunks):
        """Chunk c's packed codes and its group's scale bits (zeros past the end), loaded
        a tile ahead of their use."""
        if c >= n_chunks:
            return U32(0), U32(0)
        return U32(codes16[U64(c)]), U32(scales16[U64(c // group_chunks)])

    @device_jit
    def load_codes(codes16, scales16, base, n_chunks):
        c0, s0 = load_one(codes16, scales16, base, n_chunks)
        c1, s1 = load_one(codes16, scales16, base + 32, n_chunks)
        c2, s2 = load_one(codes16, scales16, base + 64, n_chunks)
        c3, s3 = load_one(codes16, scales16, base + 96, n_chunks)
        return c0, s0, c1, s1, c2, s2, c3, s3

    @device_jit
    def decode_chunk(v, j, code):
        for r in range(4):
            v[4 * j + r] = e2m1_decode(U32(U32(code >> U32(4 * r)) & 15))

    @device_jit
    def group_scale(sbits):
        """The factor the group's e2m1 values (or their transform) are multiplied by."""
        s = u32_as_f32(U32(sbits << 16))
        if hadamard:
            return s * inv_g  # exact unless s < 2^-126 * g (a float32 subnormal)
        return s

    @device_jit
    def scale_chunk(v, j, sbits):
        s = group_scale(sbits)
        for r in range(4):
            v[4 * j + r] = v[4 * j + r] * s

    @cuda.jit
    def kernel(codes16, scales16, out_words, n_chunks):
        tid = cuda.threadIdx.x
        lane = tid % WARP_SIZE
        warp = tid // WARP_SIZE
        sm = cuda.shared.array(n_smem, np.float32)
        v = cuda.local.array(REGISTERS, np.float32)
        tile_chunks = TILE_CHUNKS * (cuda.blockDim.x // WARP_SIZE)
        n_tiles = (n_chunks + tile_chunks - 1) // tile_chunks
        t = cuda.blockIdx.x
        base = t * tile_chunks + warp * TILE_CHUNKS + lane
        stride = cuda.gridDim.x * tile_chunks
        c0, s0, c1, s1, c2, s2, c3, s3 = load_codes(codes16, scales16, base, n_chunks)
        while t < n_tiles:
            decode_chunk(v, 0, c0)
            decode_chunk(v, 1, c1)
            decode_chunk(v, 2, c2)
            decode_chunk(v, 3, c3)
            if hadamard:
                # on the e2m1 values themselves: sums of at most 8192 multiples of 0.5 below
                # 6 are exact in float32, so the butterflies round nothing and cannot overflow
                butterflies(v, lane, sm)
            # one rounding: a plain multiply after the last add, never part of an FMA
            scale_chunk(v, 0, s0)
            scale_chunk(v, 1, s1)
            scale_chunk(v, 2, s2)
            scale_chunk(v, 3, s3)
            c0, s0, c1, s1, c2, s2, c3, s3 = load_codes(codes16, scales16, base + stride, n_chunks)
            for j in range(CHUNKS):
                c = base + 32 * j
                if c < n_chunks:
                    store_chunk(out_words, c, v[4 * j], v[4 * j + 1], v[4 * j + 2], v[4 * j + 3])
            t += cuda.gridDim.x
            base += stride

    return kernel


# ---------------------------------------------------------------------- host side


def encode(ctx, x, codes, scales, n, seed, step, kind, group_size, hadamard, stochastic):
    """Queue the encoding of the ``n`` elements of ``x`` into the wire buffer's ``codes`` and
    ``scales`` views (validated and allocated by the caller) on the caller's stream."""
    if n == 0:
        return
    blocks, threads = group_grid(group_size, n // 4, ctx.device_id)
    launch.launch(
        fp4quant_encode_kernel(kind, group_size, hadamard, stochastic),
        blocks,
        threads,
        ctx.stream,
        (ctx.view(x, np.uint64), ctx.view(codes, np.uint16), ctx.view(scales, np.uint16),
         np.int64(n // 4), np.uint32(seed & 0xFFFFFFFF), np.uint32(seed >> 32), np.uint32(step)),
    )  # fmt: skip


def decode(ctx, codes, scales, out, n, out_kind, group_size, hadamard):
    """Queue the decoding of the ``n`` elements of ``codes`` / ``scales`` into ``out``."""
    if n == 0:
        return
    blocks, threads = group_grid(group_size, n // 4, ctx.device_id)
    launch.launch(
        fp4quant_decode_kernel(out_kind, group_size, hadamard),
        blocks,
        threads,
        ctx.stream,
        (ctx.view(codes, np.uint16), ctx.view(scales, np.uint16), ctx.view(out, np.uint64),
         np.int64(n // 4)),
    )  # fmt: skip
