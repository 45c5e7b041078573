"""FP4Quant group codec kernels: one pass each way (``formats.fp4quant`` is the spec).

encode: read x once -> (optional) butterflies -> group amax -> bf16 scale -> e2m1 codes; write
        the packed codes (8 per uint32; 4 per uint16 at g = 8192 with the transform, whose
        exchanged layout holds runs of 4 consecutive elements) and one uint16 scale per group.
decode: read codes and scales once -> (optional) butterflies on the e2m1 values (exact) ->
        * (scale * 2^-log2(g)); write the tensor.

Element layout, launch contract and butterfly order are those of ``cuda.butterflies``: its
shuffle network, or its shared-memory network where the launch table's variant runs that one
(``_smem_encode_kernel``, ``_smem_decode_kernel``).  The group amax is reduced like the
transform: over a run's 8 registers, over the thread's runs that share a group, over the lanes
of the group (butterfly shuffles; every lane ends with it) and, for g >= 2048, over the CTA's
warps through shared memory.  The thread that holds a group's first element stores its scale.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from .._calls import payload_views
from .._scalar import E2M1_CODE_BIAS, KIND_F32
from . import butterflies as bf, launch
from ._primitives import (
    FULL_MASK,
    OPS,
    SHARED_ALIGNMENT,
    WARP_SIZE,
    device_jit,
    f32_as_u32,
    group_max,
    kernel_of,
    max_abs_nan,
    prmt,
    u32_as_f32,
)
from ._words import U32, U64, make_words_io, words_per
from .butterflies import (
    CHUNK,
    REGISTERS,
    WARP_TILE,
    cross_warp_bits,
    exchanged_element,
    make_butterflies,
    make_chunk_io,
    make_register_store,
    smem_words,
)
from .e2m1 import (
    HORNER_FIX,
    SR_BASE,
    SR_BYTE2,
    SR_SELECT_LOW,
    SR_SELECT_STEP,
    e2m1_values4,
    make_pair_gather,
)
from .launch_table import LAUNCHES

LAUNCH = LAUNCHES["fp4quant"]
_NONFINITE = 0x7F800000  # |t| bits at or above this: Inf or NaN


@functools.cache
def _group_layout(group_size, hadamard):
    """(k, run): the cross-warp bits whose exchange leaves the registers in the exchanged
    layout (0: the tile layout), and the consecutive elements per register run then."""
    k = cross_warp_bits(group_size) if hadamard else 0
    return k, (4 if k == 3 else CHUNK)


def _make_lanes_max(group_size):
    """Max of ``m`` over the lanes one group spans in the tile layout (index bits 3 .. 7)."""
    lanes = min(WARP_SIZE, max(1, group_size // CHUNK))

    @device_jit
    def lanes_max(m):
        return group_max(m, lanes)

    return lanes_max


@device_jit
def run_amax_bits(v, i0, length):
    """max |v[i0 .. i0 + length - 1]| (``length`` even) as int32 bits: one FMNMX.NAN an element
    in two independent chains; any NaN gives 0x7FFFFFFF, above Inf (0x7F800000), so the bits
    order every non-finite group above the finite ones."""
    a = abs(v[i0])
    b = abs(v[i0 + 1])
    for j in range(2, length, 2):
        a = max_abs_nan(a, v[i0 + j])
        b = max_abs_nan(b, v[i0 + j + 1])
    return np.int32(f32_as_u32(max_abs_nan(a, b)))


@functools.cache
def make_cta_amax(warps_per_group):
    """Device function ``cta_amax(v, lane, warp, warp_amax, half)``: the amax bits of the
    thread's 32 registers over the whole CTA (a CTA is one group), in every thread: the
    thread, the warp (butterfly shuffles), then the warps through ``warp_amax`` (32 int32 of
    shared memory; the tile uses 16 of them from ``half``, 0 or 16, alternating by tile).

    One CTA barrier a tile: a warp writes its half again two tiles later, after the barrier
    of the tile in between, which every warp reaches only once it has read this tile's."""

    @device_jit
    def cta_amax(v, lane, warp, warp_amax, half):
        a = run_amax_bits(v, 0, REGISTERS)
        off = 1
        while off < WARP_SIZE:
            a = max(a, cuda.shfl_xor_sync(FULL_MASK, a, off))
            off *= 2
        if lane == 0:
            warp_amax[half + warp] = a
        cuda.syncthreads()  # every warp's amax is visible
        a = warp_amax[half]
        for q in range(1, warps_per_group):
            a = max(a, warp_amax[half + q])
        return a

    return cta_amax


# PRMT selectors: bytes 0 and 1 (and again 2 and 3) the sign byte of float a, of float b,
# replicated (PRMT's sign mode: 0xFF or 0x00)
SIGN_PAIR = U32(0xFBFB)


@functools.cache
def make_run_encoder(run, stochastic):
    """Device function ``encode_run(v, i0, mult, e, seed_lo, seed_hi, step)``: the ``run``
    (8 or 4) e2m1 codes of the float32 registers v[i0 ..] (flat elements e ..), element e in
    nibble 0, scaled by ``mult``; nearest-even or stochastic rounding.

    Codes: nearest by Horner on the code floats' bits (2^23 + code, the bias removed once at
    the end), stochastic from byte 2 of ``e2m1_sr_sum`` gathered by PRMT (as the NVFP4 / MXFP4
    encoder).  Signs: the sign bytes of the floats, replicated by PRMT, even elements to bit 3
    and odd ones to bit 7 of each byte (-0 included: the sign bit, as the reference).
    """
    philox = OPS.philox4x32_10
    e2m1_code_f = OPS.e2m1_code_f
    e2m1_sr_sum = OPS.e2m1_sr_sum
    horner_fix = U32(HORNER_FIX) if run == CHUNK else U32((-E2M1_CODE_BIAS * 0x1111) & 0xFFFF)
    gather = make_pair_gather(run)

    @device_jit
    def sign_nibbles(v, i0):
        b = cuda.local.array(CHUNK, np.uint32)  # registers: constant indices once unrolled
        for k in range(run):
            b[k] = f32_as_u32(v[i0 + k])
        even, odd = gather(b, SIGN_PAIR)
        return U32(U32(even & 0x08080808) | U32(odd & 0x80808080))

    @device_jit
    def encode_run(v, i0, mult, e, seed_lo, seed_hi, step):
        if stochastic:
            # one Philox call at counter = flat element index // 8 (as the reference); element
            # e + k takes the low (even) or high (odd) half of word ((e + k) % 8) // 2.  A run
            # of 4 (e % 4 == 0) uses half of the call's words, the second half when e % 8 == 4.
            c = U64(e // 8)
            r0, r1, r2, r3 = philox(
                U32(c & 0xFFFFFFFF), U32(c >> 32), step, U32(0), seed_lo, seed_hi
            )
            if run == 4 and e % 8 != 0:
                r0 = r2
                r1 = r3
            words = (r0, r1, r2, r3)
            s = cuda.local.array(CHUNK, np.uint32)
            for k in range(run):
                sel = U32(SR_SELECT_LOW + SR_SELECT_STEP * U32(k % 2))
                big_r = u32_as_f32(prmt(SR_BASE, words[k // 2], sel))
                s[k] = f32_as_u32(e2m1_sr_sum(abs(v[i0 + k]) * mult, big_r))
            # byte 2 of each sum's bits is its code (< 8): even elements' codes into the bytes
            # of one word, odd ones' into another, interleaved as nibbles (no carries)
            even, odd = gather(s, SR_BYTE2)
            p = U32(U32(odd << U32(4)) | even)
            return U32(p | sign_nibbles(v, i0))
        p = U32(0)
        for t in range(run):  # Horner from the top element down: element e lands in nibble 0
            y = v[i0 + run - 1 - t]
            p = U32(U32(p << U32(4)) + f32_as_u32(e2m1_code_f(abs(y) * mult)))
        return U32(U32(p + horner_fix) | sign_nibbles(v, i0))

    return encode_run


@functools.cache
def make_code_store(run, group_size):
    """Device function ``store_codes(codes, scales16, n, e, e_rel, p, amax_bits, sb, word,
    full)``: a run's packed codes ``p`` (zeros for a non-finite group, whose scale is NaN) at
    flat element ``e``, which is code word ``word`` (one uint32 for 8 codes, one uint16 for 4),
    and the group's scale bits ``sb`` from the thread whose run starts the group; nothing past
    ``n``, which ``full`` (the tile ends before n) says without a comparison.  ``e_rel``: e's
    offset in its tile (a tile is a whole number of groups, so the group's start is a property
    of the position in the tile: no 64-bit modulo)."""
    g_mask = group_size - 1
    log_g = group_size.bit_length() - 1

    @device_jit
    def store_codes(codes, scales16, n, e, e_rel, p, amax_bits, sb, word, full):
        if amax_bits >= _NONFINITE:
            p = U32(0)  # a non-finite group: zero codes under the NaN scale
        if full or e < n:
            if run == CHUNK:
                codes[word] = p
            else:
                codes[word] = np.uint16(p)
            if e_rel & g_mask == 0:
                scales16[U64(e) >> U64(log_g)] = np.uint16(sb)

    return store_codes


@functools.cache
def make_encode_runs(group_size, hadamard, stochastic):
    """Device function ``encode_runs(v, m, codes, scales16, n, tile0, base, lane, warp,
    seed_lo, seed_hi, step)``: every register run of the thread encoded (``m``: the group amax
    of each run set) and stored, in the tile layout or, with the transform's exchange, the
    exchanged layout."""
    k, run = _group_layout(group_size, hadamard)
    fp4quant_scale = OPS.fp4quant_scale
    encode_run = make_run_encoder(run, stochastic)
    store_codes = make_code_store(run, group_size)
    run_bits = run.bit_length() - 1

    def run_step(i0):
        """Encode and store register run i0 (a device function per run: with Philox calls
        inside, a loop over the runs would not be unrolled, and a rolled loop would index the
        register arrays at run time)."""

        @device_jit
        def step_fn(v, m, codes, scales16, n, tile0, base, lane, warp, seed_lo, seed_hi, step):
            if k > 0:
                e_rel = exchanged_element(i0, lane, warp, k)
            else:
                e_rel = base + 256 * (i0 // CHUNK)
            e = tile0 + e_rel
            mc = m[i0 // CHUNK]
            sb, mult = fp4quant_scale(U32(mc))
            p = encode_run(v, i0, mult, e, seed_lo, seed_hi, step)
            store_codes(codes, scales16, n, e, e_rel, p, mc, sb, U64(e) >> U64(run_bits), False)

        return step_fn

    def chain(first, second):
        @device_jit
        def both(v, m, codes, scales16, n, tile0, base, lane, warp, seed_lo, seed_hi, step):
            first(v, m, codes, scales16, n, tile0, base, lane, warp, seed_lo, seed_hi, step)
            second(v, m, codes, scales16, n, tile0, base, lane, warp, seed_lo, seed_hi, step)

        return both

    return functools.reduce(chain, [run_step(i0) for i0 in range(0, REGISTERS, run)])


@functools.cache
def fp4quant_encode_kernel(kind, group_size, hadamard, stochastic, aligned=True, smem=False,
                           prefetch=False, device_step=False):  # fmt: skip
    """Arguments: x (uint32 words; the element array itself when not 16-byte aligned), codes
    (uint32, or uint16 at g = 8192 with the transform), scales (uint16), n (elements), seed_lo,
    seed_hi, step (uint32; with ``device_step``, a one-element int64 array holding it:
    ``_primitives.kernel_of``).  ``smem``: the transform's shared-memory network; ``prefetch``
    (with it, 16-bit kinds only: ``launch.network_choice``): the next tile's loads
    issued before this tile's work."""
    if hadamard and smem:
        return _smem_encode_kernel(kind, group_size, stochastic, aligned, prefetch, device_step)
    load_chunks, _ = make_chunk_io(kind, aligned)
    before, cross_warp = make_butterflies(group_size)
    n_smem = smem_words(group_size)
    warps_per_group = max(1, group_size // WARP_TILE)
    lanes_max = _make_lanes_max(group_size)
    cta_amax = make_cta_amax(warps_per_group)
    encode_runs = make_encode_runs(group_size, hadamard, stochastic)

    def kernel(x, codes, scales16, n, seed_lo, seed_hi, step):
        tid = cuda.threadIdx.x
        lane = tid % WARP_SIZE
        warp = tid // WARP_SIZE
        sm = cuda.shared.array(n_smem, np.float32)
        warp_amax = cuda.shared.array(32, np.int32)
        half = 0  # the half of warp_amax this tile uses
        v = cuda.local.array(REGISTERS, np.float32)
        w = cuda.local.array(8, np.uint32)
        m = cuda.local.array(4, np.int32)  # the group amax of each run set (see below)
        tile = REGISTERS * cuda.blockDim.x
        n_tiles = (n + tile - 1) // tile
        for t in range(cuda.blockIdx.x, n_tiles, cuda.gridDim.x):
            base = 8 * lane + WARP_TILE * warp  # in the tile
            load_chunks(x, t * tile + base, n, w, v)
            if hadamard:
                before(v, lane)
                cross_warp(v, lane, warp, sm)
            if warps_per_group > 1:
                a = cta_amax(v, lane, warp, warp_amax, half)
                half ^= 16
                for c in range(4):
                    m[c] = a
            else:
                # the tile layout: chunk c's 8 registers, then the chunks sharing a group
                # (bit 8: chunks 0-1, 2-3; bit 9: all four), then the group's lanes
                for c in range(4):
                    m[c] = run_amax_bits(v, 8 * c, CHUNK)
                if group_size >= 512:
                    m[0] = max(m[0], m[1])
                    m[2] = max(m[2], m[3])
                if group_size >= 1024:
                    m[0] = max(m[0], m[2])
                m[0] = lanes_max(m[0])
                if group_size < 1024:
                    m[2] = lanes_max(m[2])
                if group_size < 512:
                    m[1] = lanes_max(m[1])
                    m[3] = lanes_max(m[3])
                else:
                    m[1] = m[0]
                    m[3] = m[2]
                if group_size >= 1024:
                    m[2] = m[0]
                    m[3] = m[0]
            encode_runs(v, m, codes, scales16, n, t * tile, base, lane, warp, seed_lo,
                        seed_hi, step)  # fmt: skip

    return kernel_of(kernel, device_step)


@functools.cache
def fp4quant_decode_kernel(out_kind, group_size, hadamard, smem=False, prefetch=False):
    """Arguments: codes (uint32: 8 codes each), scales (uint16), out (uint32 words), n.
    ``smem``: the transform's shared-memory network (``cuda.butterflies.make_network``);
    ``prefetch`` (with it): the next tile's codes and scales loaded before this tile's
    butterflies."""
    if hadamard and smem:
        return _smem_decode_kernel(out_kind, group_size, prefetch)
    before, cross_warp = make_butterflies(group_size)
    n_smem = smem_words(group_size)
    k, run = _group_layout(group_size, hadamard)
    store_registers = make_register_store(out_kind, k, run)
    inv_g = np.float32(2.0 ** -(group_size.bit_length() - 1))

    @device_jit
    def group_scale(sbits):
        """The factor the group's e2m1 values (or their transform) are multiplied by."""
        s = u32_as_f32(U32(sbits << 16))
        if hadamard:
            return s * inv_g  # exact unless s < 2^-126 * g (a float32 subnormal)
        return s

    @cuda.jit
    def kernel(codes, scales16, out, n):
        tid = cuda.threadIdx.x
        lane = tid % WARP_SIZE
        warp = tid // WARP_SIZE
        sm = cuda.shared.array(n_smem, np.float32)
        v = cuda.local.array(REGISTERS, np.float32)
        sc = cuda.local.array(4, np.float32)
        tile = REGISTERS * cuda.blockDim.x
        n_tiles = (n + tile - 1) // tile
        for t in range(cuda.blockIdx.x, n_tiles, cuda.gridDim.x):
            base = t * tile + 8 * lane + WARP_TILE * warp
            for c in range(4):
                e = base + 256 * c
                p = U32(0)
                sbits = U32(0)
                if e < n:
                    p = U32(codes[U64(e // CHUNK)])
                    sbits = U32(scales16[U64(e // group_size)])
                sc[c] = group_scale(sbits)
                for h in range(2):
                    a, b, cc, d = e2m1_values4(U32(p >> U32(16 * h)))
                    v[8 * c + 4 * h] = a
                    v[8 * c + 4 * h + 1] = b
                    v[8 * c + 4 * h + 2] = cc
                    v[8 * c + 4 * h + 3] = d
            if hadamard:
                # on the e2m1 values themselves: sums of at most 8192 multiples of 0.5 below
                # 6 are exact in float32, so the butterflies round nothing and cannot overflow
                before(v, lane)
                cross_warp(v, lane, warp, sm)
            # one rounding: a plain multiply after the last add, never part of an FMA; in the
            # exchanged layout (a CTA is one group) every register has the group's scale
            for i in range(REGISTERS):
                v[i] = v[i] * sc[0 if k > 0 else i // CHUNK]
            store_registers(out, v, t, tile, base, lane, warp, n)

    return kernel


def _make_group_scales(group_size, final, run, warps_per_group):
    """Device function ``group_scales(v, lane, warp, warp_amax, half, m, sbs, mults)`` of the
    encode with the "smem" network, in its final layout ``final`` (runs of ``run``)."""
    n_runs = REGISTERS // run
    log_g = group_size.bit_length() - 1
    run_bits = run.bit_length() - 1
    # run-index bits and lanes whose element bits lie inside a group (g <= 1024): the runs
    # q with q & outside == r (r & inside == 0) hold one group
    inside = sum(1 << (j - run_bits) for j in range(run_bits, 5) if final.regs[j] < log_g)
    outside = (n_runs - 1) & ~inside
    lane_offsets = tuple(1 << j for j in range(5) if final.lanes[j] < log_g)
    fp4quant_scale = OPS.fp4quant_scale
    cta_amax = make_cta_amax(warps_per_group)

    @device_jit
    def lanes_max(a):
        for j in range(len(lane_offsets)):
            a = max(a, cuda.shfl_xor_sync(FULL_MASK, a, lane_offsets[j]))
        return a

    @device_jit
    def group_scales(v, lane, warp, warp_amax, half, m, sbs, mults):
        """Each run's group: amax bits ``m``, bf16 scale bits ``sbs`` and multiplier
        ``mults`` (one ``fp4quant_scale`` per group the thread holds)."""
        if warps_per_group > 1:
            a = cta_amax(v, lane, warp, warp_amax, half)
            sb, mult = fp4quant_scale(U32(a))
            for r in range(n_runs):
                m[r] = a
                sbs[r] = sb
                mults[r] = mult
        else:
            for r in range(n_runs):
                m[r] = run_amax_bits(v, run * r, run)
            for r in range(n_runs):
                if r & inside == 0:
                    a = m[r]
                    for q in range(n_runs):
                        if q & outside == r:
                            a = max(a, m[q])
                    a = lanes_max(a)
                    sb, mult = fp4quant_scale(U32(a))
                    for q in range(n_runs):
                        if q & outside == r:
                            m[q] = a
                            sbs[q] = sb
                            mults[q] = mult

    return group_scales


def _make_smem_encode_runs(group_size, final, run, stochastic):
    """Device function ``encode_runs(v, m, sbs, mults, codes, scales16, n, tile0, e_out,
    word0, full, seed_lo, seed_hi, step)``: the encode's runs, in the final layout, encoded
    and stored."""
    n_runs = REGISTERS // run
    out_regs = tuple(bf.bits_offset(final.regs, i) for i in range(REGISTERS))
    run_bits = run.bit_length() - 1
    encode_run = make_run_encoder(run, stochastic)
    store_codes = make_code_store(run, group_size)

    def run_step(r):
        i0 = run * r
        offset = out_regs[i0]

        @device_jit
        def step_fn(v, m, sbs, mults, codes, scales16, n, tile0, e_out, word0, full, seed_lo,
                    seed_hi, step):  # fmt: skip
            e_rel = e_out + offset
            e = tile0 + e_rel
            p = encode_run(v, i0, mults[r], e, seed_lo, seed_hi, step)
            # word0 + a constant: one address a tile, an immediate offset a run
            word = word0 + U64(offset >> run_bits)
            store_codes(codes, scales16, n, e, e_rel, p, m[r], sbs[r], word, full)

        return step_fn

    def chain(first_fn, second_fn):
        @device_jit
        def both(v, m, sbs, mults, codes, scales16, n, tile0, e_out, word0, full, seed_lo,
                 seed_hi, step):  # fmt: skip
            first_fn(v, m, sbs, mults, codes, scales16, n, tile0, e_out, word0, full, seed_lo,
                     seed_hi, step)  # fmt: skip
            second_fn(v, m, sbs, mults, codes, scales16, n, tile0, e_out, word0, full, seed_lo,
                      seed_hi, step)  # fmt: skip

        return both

    return functools.reduce(chain, [run_step(r) for r in range(n_runs)])


def _smem_encode_kernel(kind, group_size, stochastic, aligned, prefetch, device_step):
    """The encode with the transform's "smem" network (``fp4quant_encode_kernel``'s
    arguments): the group amax and the codes taken in the network's final layout (runs of 8
    consecutive elements; of 4 at g = 8192).  Each group's scale is computed once per thread,
    however many of its runs the thread holds."""
    wide = kind == KIND_F32
    first = bf.layouts(group_size, wide, False)[0]
    warps_per_group = max(1, group_size // WARP_TILE)
    # g >= 2048: the group amax's CTA barrier follows every tile's network (fenced), and the
    # exchange reuses the per-warp buffers (one buffer: half the shared memory at 2048 / 4096;
    # on an H200 encode 2048 1.29 -> 1.26-1.27x copy time, 4096 unchanged)
    final, network = bf.make_network(
        group_size, wide, False, fenced=warps_per_group > 1, one_buffer=True
    )
    assert not (prefetch and wide), "float32 input does not prefetch (network_choice)"
    start, tile_values, n_raw = bf.make_tile_loader(kind, first, aligned, prefetch)
    run = min(bf.run_length(final), CHUNK)
    n_runs = REGISTERS // run
    most = launch.network_max_threads(prefetch)
    n_smem = bf.smem_network_words(group_size, most, one_buffer=True)
    in_offset = bf.make_offsets(first)
    out_offset = bf.make_offsets(final)
    run_bits = run.bit_length() - 1
    # a run starts at a multiple of its length: e_out >> run_bits loses nothing
    assert min(final.lanes + final.warps) >= run_bits and final.regs[:run_bits] == tuple(
        range(run_bits)
    )
    group_scales = _make_group_scales(group_size, final, run, warps_per_group)
    encode_runs = _make_smem_encode_runs(group_size, final, run, stochastic)

    def kernel(x, codes, scales16, n, seed_lo, seed_hi, step):
        tid = cuda.threadIdx.x
        lane = tid % WARP_SIZE
        warp = tid // WARP_SIZE
        sm = cuda.shared.array(n_smem, np.float32, alignment=SHARED_ALIGNMENT)
        warp_amax = cuda.shared.array(32, np.int32)
        half = 0  # the half of warp_amax this tile uses
        v = cuda.local.array(REGISTERS, np.float32)
        w = cuda.local.array(8, np.uint32)
        raw = cuda.local.array(n_raw, np.uint32)
        m = cuda.local.array(n_runs, np.int32)  # each run's group: amax bits,
        sbs = cuda.local.array(n_runs, np.uint32)  # scale bits
        mults = cuda.local.array(n_runs, np.float32)  # and encode multiplier
        e_in = in_offset(lane, warp)
        e_out = out_offset(lane, warp)
        tile = REGISTERS * cuda.blockDim.x
        n_tiles = (n + tile - 1) // tile
        stride = cuda.gridDim.x
        start(x, cuda.blockIdx.x, tile, e_in, n, w, raw)
        for t in range(cuda.blockIdx.x, n_tiles, stride):
            tile_values(x, t, stride, tile, e_in, n, w, raw, v, U32(0))
            network(v, lane, warp, sm)
            group_scales(v, lane, warp, warp_amax, half, m, sbs, mults)
            half ^= 16
            tile0 = t * tile
            encode_runs(v, m, sbs, mults, codes, scales16, n, tile0, e_out,
                        U64(tile0 + e_out) >> U64(run_bits), tile0 + tile <= n, seed_lo,
                        seed_hi, step)  # fmt: skip

    return kernel_of(kernel, device_step)


def _make_code_tile_loader(group_size, first, final, run):
    """Device function ``load_tile(codes, scales16, n, e_in0, e_out0, words, sbits, full)`` of
    the decode with the "smem" network: codes in its load layout ``first``, scales of the runs
    (of ``run``) it stores from its final layout ``final``."""
    n_runs = REGISTERS // run
    n_chunks = REGISTERS // CHUNK
    in_regs = tuple(bf.bits_offset(first.regs, i) for i in range(REGISTERS))
    out_regs = tuple(bf.bits_offset(final.regs, i) for i in range(REGISTERS))
    n_per_tile = 1 if group_size > WARP_TILE else n_runs  # distinct factors a thread needs

    @device_jit
    def load_tile(codes, scales16, n, e_in0, e_out0, words, sbits, full):
        """The code words of the thread's chunks (register 0 at element ``e_in0``) and the
        scale bits of the runs it stores (register 0 at ``e_out0``); zeros past ``n``.
        ``full``: the tile ends before n (no checks; the code words from one index plus
        constants)."""
        if full:
            first = U64(e_in0) >> U64(3)
            for c in range(n_chunks):
                words[c] = U32(codes[first + U64(in_regs[CHUNK * c] >> 3)])
        else:
            for c in range(n_chunks):
                e = e_in0 + in_regs[CHUNK * c]
                words[c] = U32(0)
                if e < n:
                    words[c] = U32(codes[U64(e) >> U64(3)])
        for r in range(n_per_tile):
            e = e_out0 + out_regs[run * r]
            sbits[r] = U32(0)
            if full or e < n:
                sbits[r] = U32(scales16[U64(e) // U64(group_size)])

    return load_tile


def _smem_decode_kernel(out_kind, group_size, prefetch):
    """The decode with the transform's "smem" network: codes read in its load layout (8
    consecutive codes a thread and chunk), the output stored from its final layout, each run
    times its group's factor (butterflies on e2m1 values are exact: their order does not
    matter).  ``prefetch``: the next tile's code words and scales load into the same
    registers once this tile's are unpacked, in flight while the kernel computes on it."""
    wide = out_kind == KIND_F32
    first = bf.layouts(group_size, False, wide)[0]
    final, network = bf.make_network(group_size, False, wide)
    run = min(bf.run_length(final), CHUNK)
    store = make_words_io(out_kind, words_per(out_kind, run))[4]
    shift = U64(0 if wide else 1)
    n_runs = REGISTERS // run
    n_chunks = REGISTERS // CHUNK
    n_smem = bf.smem_network_words(group_size, launch.network_max_threads(prefetch))
    in_offset = bf.make_offsets(first)
    out_offset = bf.make_offsets(final)
    out_regs = tuple(bf.bits_offset(final.regs, i) for i in range(REGISTERS))
    inv_g = np.float32(2.0 ** -(group_size.bit_length() - 1))
    n_per_tile = 1 if group_size > WARP_TILE else n_runs  # distinct factors a thread needs
    # chunks of 8 consecutive codes, a thread's first at a multiple of 8: one code word each
    assert first.regs[:3] == (0, 1, 2) and min(first.lanes + first.warps) >= 3
    load_tile = _make_code_tile_loader(group_size, first, final, run)

    @cuda.jit
    def kernel(codes, scales16, out, n):
        tid = cuda.threadIdx.x
        lane = tid % WARP_SIZE
        warp = tid // WARP_SIZE
        sm = cuda.shared.array(n_smem, np.float32, alignment=SHARED_ALIGNMENT)
        v = cuda.local.array(REGISTERS, np.float32)
        sc = cuda.local.array(n_runs, np.float32)
        words = cuda.local.array(n_chunks, np.uint32)
        sbits = cuda.local.array(n_runs, np.uint32)
        e_in = in_offset(lane, warp)
        e_out = out_offset(lane, warp)
        tile = REGISTERS * cuda.blockDim.x
        n_tiles = (n + tile - 1) // tile
        stride = cuda.gridDim.x
        t0 = cuda.blockIdx.x
        if prefetch:
            load_tile(codes, scales16, n, t0 * tile + e_in, t0 * tile + e_out, words, sbits,
                      (t0 + 1) * tile <= n)  # fmt: skip
        for t in range(t0, n_tiles, stride):
            full = (t + 1) * tile <= n
            if not prefetch:
                load_tile(codes, scales16, n, t * tile + e_in, t * tile + e_out, words, sbits,
                          full)  # fmt: skip
            for c in range(n_chunks):
                for h in range(2):
                    a, b, cc, d = e2m1_values4(U32(words[c] >> U32(16 * h)))
                    v[8 * c + 4 * h] = a
                    v[8 * c + 4 * h + 1] = b
                    v[8 * c + 4 * h + 2] = cc
                    v[8 * c + 4 * h + 3] = d
            for r in range(n_per_tile):  # the factors of the runs the thread stores
                # exact unless the scale is below 2^-126 * g (a float32 subnormal)
                sc[r] = u32_as_f32(U32(sbits[r] << 16)) * inv_g
            for r in range(n_per_tile, n_runs):  # a CTA is one group: one factor
                sc[r] = sc[0]
            if prefetch:  # this tile's words and scale bits are consumed: reuse them
                t1 = t + stride  # the next tile's
                load_tile(codes, scales16, n, t1 * tile + e_in, t1 * tile + e_out, words, sbits,
                          (t1 + 1) * tile <= n)  # fmt: skip
            # on the e2m1 values themselves: sums of at most 8192 multiples of 0.5 below 6
            # are exact in float32, so the butterflies round nothing and cannot overflow
            network(v, lane, warp, sm)
            for i in range(REGISTERS):
                v[i] = v[i] * sc[i // run]  # one rounding, a plain multiply
            if full:  # one address, constant offsets
                first = U64(t * tile + e_out) >> shift
                for r in range(n_runs):
                    store(out, first + U64(out_regs[run * r] >> shift), v, run * r)
            else:
                for r in range(n_runs):
                    e = t * tile + e_out + out_regs[run * r]
                    if e < n:
                        store(out, U64(e) >> shift, v, run * r)

    return kernel


# ---------------------------------------------------------------------- host side


def _network_grid(group_size, kind, hadamard, n, device_id):
    """(smem, prefetch, CTAs, threads) of an FP4Quant kernel that loads elements of ``kind``
    (None: packed codes): the transform's network choice where there is a transform."""
    smem, prefetch = launch.network_choice(group_size, kind) if hadamard else (False, False)
    most = launch.network_max_threads(prefetch) if smem else None
    return (smem, prefetch, *launch.group_grid(LAUNCH, group_size, n, device_id, most))


def run_encode(ctx, call):
    """Queue the encoding of ``call`` (a checked ``_calls.QuantizeCall`` of an ``FP4Quant``)
    on the caller's stream; returns (payload, codes, scales): the wire buffer and its views."""
    fmt, geo = call.fmt, call.geometry
    g, n = fmt.group_size, geo.n
    payload = ctx.empty((n // 2 + 2 * (n // g),), np.uint8)
    codes, scales = payload_views(payload, geo.shape, n, g, ctx.backend.lib)
    step = call.step if call.step_array is None else call.step_array
    encode(ctx, call.x, codes, scales, n, call.seed, step, call.kind, g, fmt.hadamard,
           call.stochastic)  # fmt: skip
    return payload, codes, scales


def run_decode(ctx, call):
    """Queue the decoding of ``call`` (a checked ``_calls.DequantizeCall`` of an FP4Quant
    tensor) on the caller's stream; returns (out,)."""
    geo = call.geometry
    out = ctx.empty(geo.shape, None, like_dtype=ctx.float_dtype_of_kind(call.kind))
    decode(ctx, call.data, call.scales, out, geo.n, call.kind, call.fmt.group_size,
           call.fmt.hadamard)  # fmt: skip
    return (out,)


def run_quantize_dequantize(ctx, call):
    """Queue ``quantize_dequantize`` of ``call`` (a checked ``_calls.QuantizeCall`` of an
    FP4Quant, ``fused`` set): the encoding into a wire buffer of its own, then its decoding,
    the launches of ``run_encode`` and ``run_decode`` one after the other, in one host
    function so that a plan holds both.  Returns (out,), of the input's dtype."""
    fmt, geo = call.fmt, call.geometry
    _, codes, scales = run_encode(ctx, call)
    out = ctx.empty(geo.shape, None, like_dtype=ctx.float_dtype_of_kind(call.kind))
    decode(ctx, codes, scales, out, geo.n, call.kind, fmt.group_size, fmt.hadamard)
    return (out,)


def encode(ctx, x, codes, scales, n, seed, step, kind, group_size, hadamard, stochastic):
    """Queue the encoding of the ``n`` elements of ``x`` into the wire buffer's ``codes`` and
    ``scales`` views (validated and allocated by the caller) on the caller's stream; ``step``
    an int or a one-element int64 array holding it (read by the kernel)."""
    if n == 0:
        return
    device_step = not isinstance(step, int)
    if device_step:
        seed_step = launch.seed_step_args(ctx, seed, 0, step)
    else:
        seed_step = launch.seed_step_args(ctx, seed, step)
    xw, aligned = ctx.words_view(x, kind)
    _, run = _group_layout(group_size, hadamard)
    smem, prefetch, blocks, threads = _network_grid(group_size, kind, hadamard, n, ctx.device_id)
    launch.launch(
        fp4quant_encode_kernel(
            kind, group_size, hadamard, stochastic, aligned, smem, prefetch, device_step
        ),
        blocks,
        threads,
        ctx,
        (xw, ctx.view(codes, np.uint32 if run == CHUNK else np.uint16),
         ctx.view(scales, np.uint16), launch.int64(n), *seed_step),
    )  # fmt: skip


def decode(ctx, codes, scales, out, n, out_kind, group_size, hadamard):
    """Queue the decoding of the ``n`` elements of ``codes`` / ``scales`` into ``out``."""
    if n == 0:
        return
    # the input is codes: prefetched whatever the output kind
    smem, prefetch, blocks, threads = _network_grid(group_size, None, hadamard, n, ctx.device_id)
    codes_w, aligned = ctx.codes_view(codes, 4)
    if not aligned:
        raise ValueError("q.data: FP4Quant codes must be 4-byte aligned (a view of the payload)")
    launch.launch(
        fp4quant_decode_kernel(out_kind, group_size, hadamard, smem, prefetch),
        blocks,
        threads,
        ctx,
        (codes_w, ctx.view(scales, np.uint16), ctx.view(out, np.uint32), launch.int64(n)),
    )  # fmt: skip
