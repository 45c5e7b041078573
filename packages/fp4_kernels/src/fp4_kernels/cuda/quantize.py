"""NVFP4 / MXFP4 quantize on the GPU (optionally fused with dequantize: fake quantization):
the kernel and its host wrapper.

Launch contract: one thread per scale block (16 elements NVFP4, 32 MXFP4), a 1-D grid-stride
loop over the blocks; any CTA size.  A thread loads its block with 16-byte loads, finds the
block amax on the raw words (no shuffles), computes the scale once, encodes its elements on the
float pipe (``_scalar.e2m1_code_f``, or ``e2m1_sr_sum`` with one Philox call per 8 elements
for stochastic rounding) and stores 8 (NVFP4) or 16 (MXFP4) bytes of codes and one
scale byte.  The NVFP4 tensor amax is a value given by the caller or the max over the per-CTA
partials that ``cuda.amax`` wrote earlier on the same stream.

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

from .._scalar import E2M1_CODE_BIAS, INV_E2M1_MAX, KIND_F32, SR_BASE_BITS
from . import launch
from ._primitives import (
    OPS,
    WARP_SIZE,
    device_jit,
    f32_as_u32,
    group_max,
    prmt,
    store_v2,
    u32_as_f32,
)
from ._words import U32, U64, make_words_io, store_v4, words_per
from .launch_table import LAUNCHES

LAUNCH = LAUNCHES["quantize"]

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
def quantize_kernel(kind, fmt, stochastic, swizzled, fused, aligned=True, lanes=1):
    """Build (once per configuration) the quantize kernel of the format ``fmt`` (a
    ``FormatSpec``); ``fused`` also writes x_hat.

    ``lanes`` consecutive threads share a block, each loading,
    encoding and storing block / lanes consecutive elements, so that every load and store of a
    warp is contiguous; the block amax is a butterfly over those lanes and each computes the
    scale.  Arguments: x (uint32 words; the element array itself when not ``aligned`` to 16
    bytes), codes (uint32), scales (uint8), out (uint32; written only when fused), n_items (a
    lane's parts of blocks: n / (block / lanes)), kb, padded_kb, amax_parts (float32),
    n_parts, amax_value (float32; < 0: reduce the partials), global_scale (float32, 1 element,
    written by thread 0), seed_lo, seed_hi, step (uint32).
    """
    part = fmt.block_size // lanes  # elements a thread takes
    n_words = words_per(kind, part)
    groups = part // 8  # packed code words a thread stores
    load, _, amax_bits, _, store = make_words_io(kind, n_words, aligned)
    _, encode8, encode8_sr = make_block_codec(kind, part)
    nvfp4 = fmt.tensor_scale  # NVFP4: e4m3 block scales under a float32 tensor scale
    nvfp4_block_scale = OPS.nvfp4_block_scale
    mxfp4_block_scale = OPS.mxfp4_block_scale
    nvfp4_encode_scale = OPS.nvfp4_encode_scale
    scale_offset = OPS.scale_offset
    one = np.float32(1.0)

    @device_jit
    def tensor_scale(amax_value, amax_parts, n_parts, global_scale):
        """(S * 1/6, 1/S) for NVFP4 (1/S written to global_scale by thread 0), (0, 1) MXFP4."""
        s6 = np.float32(0.0)
        s_dec = one
        if nvfp4:
            if amax_value >= np.float32(0.0):
                amax = amax_value
            else:
                amax = tensor_amax_from_partials(amax_parts, n_parts)
            big_s = nvfp4_encode_scale(amax)
            s_dec = one / big_s
            s6 = big_s * INV_E2M1_MAX
        if cuda.blockIdx.x == 0 and cuda.threadIdx.x == 0:
            global_scale[0] = s_dec
        return s6, s_dec

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

    @cuda.jit
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

    return kernel


# ---------------------------------------------------------------------- host side


def run(ctx, call):
    """Queue the quantization of ``call`` (a checked ``_calls.QuantizeCall`` of an NVFP4 /
    MXFP4 format on the GPU) on the caller's stream; returns (data, scales, global_scale, out)
    arrays of the caller's kind (out is None unless ``call.fused``).  ``ctx`` is the caller's
    ``_arrays.GpuContext``."""
    from . import amax as amax_op

    geo, fmt, kind = call.geometry, call.fmt, call.kind
    data = ctx.empty(geo.shape[:-1] + (geo.shape[-1] // 2,), np.uint8)
    scales = ctx.empty(geo.scale_shape, np.uint8, zero=geo.pad)
    compute_amax = fmt.tensor_scale and call.amax_value < 0 and call.amax_array is None
    # one float32 buffer: [global_scale, amax partials...] (one allocation, not two)
    n_partials = amax_op.max_partials(ctx.device_id) if compute_amax else 0
    scratch = ctx.empty((1 + n_partials,), np.float32)
    gs = scratch[:1]
    out = None
    if call.fused:
        out = ctx.empty(geo.shape, None, like_dtype=ctx.float_dtype_of_kind(kind))
    n_blocks = geo.n // fmt.block_size
    if n_blocks == 0:
        ctx.fill(gs, 1.0)
        return data, scales, gs, out
    xw, aligned = ctx.words_view(call.x, kind)
    if call.amax_array is not None:
        parts, n_parts = ctx.view(call.amax_array, np.float32), 1
    elif compute_amax:
        parts = ctx.view(scratch[1:])
        n_parts = amax_op.amax_partials(ctx, xw, aligned, kind, geo.n, parts)
    else:
        parts, n_parts = ctx.view(gs), 0
    lanes = launch.current_policy().lanes_per_block or lanes_per_block(fmt, call.fused)
    if fmt.block_size % (8 * lanes):
        raise ValueError(
            f"lanes_per_block: {lanes} threads cannot share a {fmt.block_size}-element block"
        )
    kern = quantize_kernel(kind, fmt, call.stochastic, geo.swizzled, call.fused, aligned, lanes)
    threads = launch.threads_for(LAUNCH.threads)
    codes = ctx.view(data, np.uint32)
    n_items = n_blocks * lanes
    seed = call.seed
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
            np.int64(n_items),
            np.int64(geo.kb),
            np.int64(geo.padded_kb),
            parts,
            np.int64(n_parts),
            np.float32(call.amax_value),
            ctx.view(gs),
            np.uint32(seed & 0xFFFFFFFF),
            np.uint32(seed >> 32),
            np.uint32(call.step),
        ),
    )
    return data, scales, gs, out
