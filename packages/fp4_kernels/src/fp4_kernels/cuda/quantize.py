"""NVFP4 / MXFP4 quantization kernel (optionally fused with dequantization: fake-quant).

Launch contract: 1-D grid-stride over *tiles* of ``blockDim.x * UNROLL`` chunks (4 elements
each); every thread of a block runs the same number of iterations, so all lanes reach every warp
shuffle (out-of-range chunks are processed as zeros and not stored).  ``blockDim.x`` must be a
multiple of 32.  One pass: the input is read once, codes and scales written once (and, fused,
the reconstructed tensor).  The NVFP4 tensor amax is either a value given by the caller or the
max over per-CTA partial maxima written earlier by ``cuda.amax`` on the same stream.

Operation order (float32, as NVIDIA Transformer Engine computes NVFP4):
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

from .._scalar import (
    E4M3_NAN_CODE,
    E8M0_NAN_CODE,
    F32_NAN,
    F32_ONE,
    F32_ZERO,
    FP32_MAX,
    INV_E2M1_MAX,
)
from ._chunk import U32, U64, make_chunk_io, max4_abs_bits, scale_offset
from ._primitives import OPS, WARP_SIZE, device_jit, group_max, u32_as_f32

UNROLL = 4  # chunks per thread per tile: four independent loads in flight before first use

FMT_NVFP4 = 0
FMT_MXFP4 = 1
BLOCK_SIZES = {FMT_NVFP4: 16, FMT_MXFP4: 32}


@device_jit
def tensor_amax_from_partials(parts, n_parts):
    """Max over ``parts`` by the whole CTA (strided read, warp butterfly, shared memory)."""
    tid = cuda.threadIdx.x
    m = np.float32(0.0)
    for i in range(tid, n_parts, cuda.blockDim.x):
        v = parts[i]
        if v > m:
            m = v
    m = group_max(m, WARP_SIZE)
    warp_max = cuda.shared.array(32, dtype=np.float32)
    if tid % WARP_SIZE == 0:
        warp_max[tid // WARP_SIZE] = m
    cuda.syncthreads()  # every warp's partial is visible before anyone reads them
    m = warp_max[0]
    for w in range(1, cuda.blockDim.x // WARP_SIZE):
        v = warp_max[w]
        if v > m:
            m = v
    return m


@functools.cache
def quantize_kernel(kind, fmt, stochastic, swizzled, fused, per_thread=False):
    """Build (once per configuration) the quantize kernel; ``fused`` also writes x_hat.

    Two layouts of the same arithmetic (bit-identical results): ``per_thread=False``, four
    lanes (NVFP4; eight for MXFP4) share a block, each owning a chunk, the block amax found by
    warp shuffles and each lane storing its 4 codes as a uint16 (fully coalesced loads);
    ``per_thread=True``, a thread owns a whole block (strided loads, no shuffles, no repeated
    scale arithmetic).  ``benchmarks/gpu_throughput.py`` measures both.
    """
    lanes = BLOCK_SIZES[fmt] // 4  # lanes sharing one block
    lanes_log2 = lanes.bit_length() - 1
    _, store_chunk, load_raw, unpack = make_chunk_io(kind)
    nvfp4 = fmt == FMT_NVFP4

    e2m1_encode = OPS.e2m1_encode
    e2m1_encode_sr = OPS.e2m1_encode_sr
    e2m1_decode = OPS.e2m1_decode
    e4m3_encode_positive = OPS.e4m3_encode_positive
    e4m3_decode = OPS.e4m3_decode
    e8m0_decode = OPS.e8m0_decode
    mx_shared_exponent = OPS.mx_shared_exponent
    pow2_f32 = OPS.pow2_f32
    philox = OPS.philox4x32_10
    nvfp4_encode_scale = OPS.nvfp4_encode_scale

    @device_jit
    def encode4(v0, v1, v2, v3, mult, c, seed_lo, seed_hi, step):
        """Scale the chunk by ``mult`` and round to e2m1; returns the four codes."""
        y0 = v0 * mult
        y1 = v1 * mult
        y2 = v2 * mult
        y3 = v3 * mult
        if stochastic:
            # counter = flat element index // 4 = chunk index: one Philox call per chunk, word j
            # for element 4c + j, independent of the launch configuration.
            r0, r1, r2, r3 = philox(
                np.uint32(c & 0xFFFFFFFF), np.uint32(c >> 32), step, np.uint32(0), seed_lo, seed_hi
            )
            return (
                e2m1_encode_sr(y0, r0),
                e2m1_encode_sr(y1, r1),
                e2m1_encode_sr(y2, r2),
                e2m1_encode_sr(y3, r3),
            )
        return e2m1_encode(y0), e2m1_encode(y1), e2m1_encode(y2), e2m1_encode(y3)

    @device_jit
    def block_scale(bmax_bits, s6, s_dec):
        """Block amax bits -> (finite, scale code, decoded scale s, element multiplier)."""
        finite = bmax_bits < 0x7F800000
        bmax = u32_as_f32(U32(bmax_bits))
        s = F32_ZERO
        if nvfp4:
            if finite:
                # TE order: S * fp32(1/6) first, then times the block amax (s6 = S * 1/6).
                scode = e4m3_encode_positive(bmax * s6)
                s = e4m3_decode(scode)
                # the product s * (1/S) first, then its reciprocal, clamped (s == 0 -> FLT_MAX).
                mult = F32_ONE / (s * s_dec)
                if mult > FP32_MAX:
                    mult = FP32_MAX
            else:
                scode = U32(E4M3_NAN_CODE)
                s = F32_NAN
                mult = F32_ZERO
        else:
            if finite:
                e = mx_shared_exponent(bmax)
                scode = U32(e + 127)
                mult = pow2_f32(-e)  # -e in [-125, 127]: a normal float32, exact scaling
            else:
                scode = U32(E8M0_NAN_CODE)
                mult = F32_ZERO
        return finite, scode, s, mult

    @device_jit
    def encode_chunk(finite, v0, v1, v2, v3, mult, c, seed_lo, seed_hi, step):
        """The chunk's four codes packed in a uint16 (element 4c + j in nibble j)."""
        if not finite:
            return U32(0)  # a non-finite block: zero codes under the NaN scale
        k0, k1, k2, k3 = encode4(v0, v1, v2, v3, mult, c, seed_lo, seed_hi, step)
        return U32(U32(k0 | U32(k1 << 4)) | U32(U32(k2 << 8) | U32(k3 << 12)))

    @device_jit
    def store_decoded(out, c, packed, s, s_dec, scode):
        """Fused fake-quant: write the chunk's reconstruction in the input's dtype."""
        k0 = U32(packed & 15)
        k1 = U32(U32(packed >> 4) & 15)
        k2 = U32(U32(packed >> 8) & 15)
        k3 = U32(packed >> 12)
        if nvfp4:
            # (e2m1 value * s) is exact; the product with 1/S is the one rounding.
            store_chunk(
                out,
                c,
                (e2m1_decode(k0) * s) * s_dec,
                (e2m1_decode(k1) * s) * s_dec,
                (e2m1_decode(k2) * s) * s_dec,
                (e2m1_decode(k3) * s) * s_dec,
            )
        else:
            x = e8m0_decode(scode)
            store_chunk(
                out,
                c,
                e2m1_decode(k0) * x,
                e2m1_decode(k1) * x,
                e2m1_decode(k2) * x,
                e2m1_decode(k3) * x,
            )

    @device_jit
    def process_chunk(
        w0, w1, c, n_chunks, codes, scales, out, kb, padded_kb, s6, s_dec, seed_lo, seed_hi, step
    ):
        v0, v1, v2, v3 = unpack(w0, w1)
        bmax_bits = group_max(max4_abs_bits(v0, v1, v2, v3), lanes)
        finite, scode, s, mult = block_scale(bmax_bits, s6, s_dec)
        packed = encode_chunk(finite, v0, v1, v2, v3, mult, c, seed_lo, seed_hi, step)
        if c < n_chunks:
            codes[U64(c)] = packed
            if (c & (lanes - 1)) == 0:
                scales[scale_offset(c >> lanes_log2, kb, padded_kb, swizzled)] = scode
            if fused:
                store_decoded(out, c, packed, s, s_dec, scode)

    @device_jit
    def tensor_scale(amax_value, amax_parts, n_parts, global_scale):
        """(S * 1/6, 1/S) for NVFP4 (written to global_scale by thread 0), (0, 1) for MXFP4."""
        s6 = np.float32(0.0)
        s_dec = np.float32(1.0)
        if nvfp4:
            if amax_value >= np.float32(0.0):
                amax = amax_value
            else:
                amax = tensor_amax_from_partials(amax_parts, n_parts)
            big_s = nvfp4_encode_scale(amax)
            s_dec = F32_ONE / big_s
            s6 = big_s * INV_E2M1_MAX
        if cuda.blockIdx.x == 0 and cuda.threadIdx.x == 0:
            global_scale[0] = s_dec  # 1/S for NVFP4, 1.0 for MXFP4
        return s6, s_dec

    if per_thread:

        @cuda.jit
        def kernel_per_thread(
            words,
            codes64,
            scales,
            out,
            n_chunks,
            kb,
            padded_kb,
            amax_parts,
            n_parts,
            amax_value,
            global_scale,
            seed_lo,
            seed_hi,
            step,
        ):
            """One thread per block: no shuffles, the scale computed once per block; the block's
            codes (8 bytes NVFP4, 16 MXFP4) leave in 8-byte stores, contiguous across lanes.
            Pass 1 loads the block and takes its amax; pass 2 reloads it (from L1) to encode."""
            s6, s_dec = tensor_scale(amax_value, amax_parts, n_parts, global_scale)
            n_blocks = n_chunks >> lanes_log2
            for blk in range(cuda.grid(1), n_blocks, cuda.gridsize(1)):
                c0 = blk << lanes_log2
                m = np.int32(0)
                for j in range(lanes):
                    w0, w1 = load_raw(words, c0 + j, n_chunks)
                    v0, v1, v2, v3 = unpack(w0, w1)
                    m = max(m, max4_abs_bits(v0, v1, v2, v3))
                finite, scode, s, mult = block_scale(m, s6, s_dec)
                lo = U64(0)
                hi = U64(0)
                for j in range(lanes):
                    c = c0 + j
                    w0, w1 = load_raw(words, c, n_chunks)
                    v0, v1, v2, v3 = unpack(w0, w1)
                    packed = encode_chunk(finite, v0, v1, v2, v3, mult, c, seed_lo, seed_hi, step)
                    if j < 4:
                        lo |= U64(packed) << U64(16 * j)
                    else:
                        hi |= U64(packed) << U64(16 * (j - 4))
                    if fused:
                        store_decoded(out, c, packed, s, s_dec, scode)
                if lanes == 4:
                    codes64[U64(blk)] = lo
                else:
                    codes64[U64(2 * blk)] = lo
                    codes64[U64(2 * blk + 1)] = hi
                scales[scale_offset(blk, kb, padded_kb, swizzled)] = scode

        return kernel_per_thread

    @cuda.jit
    def kernel(
        words,
        codes,
        scales,
        out,
        n_chunks,
        kb,
        padded_kb,
        amax_parts,
        n_parts,
        amax_value,
        global_scale,
        seed_lo,
        seed_hi,
        step,
    ):
        s6, s_dec = tensor_scale(amax_value, amax_parts, n_parts, global_scale)
        nthreads = cuda.blockDim.x
        tile = nthreads * UNROLL
        n_tiles = (n_chunks + tile - 1) // tile
        for t in range(cuda.blockIdx.x, n_tiles, cuda.gridDim.x):
            c0 = t * tile + cuda.threadIdx.x
            c1 = c0 + nthreads
            c2 = c1 + nthreads
            c3 = c2 + nthreads
            # all loads first: UNROLL independent memory requests in flight per thread, kept as
            # raw words (fewer live registers than unpacked floats)
            a0, a1 = load_raw(words, c0, n_chunks)
            b0, b1 = load_raw(words, c1, n_chunks)
            d0, d1 = load_raw(words, c2, n_chunks)
            e0, e1 = load_raw(words, c3, n_chunks)
            process_chunk(
                a0,
                a1,
                c0,
                n_chunks,
                codes,
                scales,
                out,
                kb,
                padded_kb,
                s6,
                s_dec,
                seed_lo,
                seed_hi,
                step,
            )
            process_chunk(
                b0,
                b1,
                c1,
                n_chunks,
                codes,
                scales,
                out,
                kb,
                padded_kb,
                s6,
                s_dec,
                seed_lo,
                seed_hi,
                step,
            )
            process_chunk(
                d0,
                d1,
                c2,
                n_chunks,
                codes,
                scales,
                out,
                kb,
                padded_kb,
                s6,
                s_dec,
                seed_lo,
                seed_hi,
                step,
            )
            process_chunk(
                e0,
                e1,
                c3,
                n_chunks,
                codes,
                scales,
                out,
                kb,
                padded_kb,
                s6,
                s_dec,
                seed_lo,
                seed_hi,
                step,
            )

    return kernel
