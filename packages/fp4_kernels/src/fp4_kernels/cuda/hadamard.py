"""Walsh–Hadamard transform kernel, and the butterfly network the FP4Quant codec shares.

Element layout (``formats.hadamard``): a thread holds 16 elements in registers, 4 chunks of 4
consecutive elements, chunk j of lane l of warp w covering tile elements
4 * (l + 32 j) + 512 w + (0..3).  Lanes own consecutive chunks, so every load and store of a
warp is one contiguous 256-byte (16-bit data) or 512-byte (float32) segment.  Index bits then
fall into three kinds of stage, applied cheapest first:

* register stages, bits 0, 1 (inside a chunk) and 7, 8 (across a thread's chunks): two adds per
  pair, no communication;
* warp-shuffle stages, bits 2-6 (across lanes): one ``shfl.bfly`` per element and stage, no
  barrier; a lane keeps ``own + partner`` if it holds the lower element, ``partner - own`` if the
  upper one (the same operands, in the same order, as ``fwht``'s ``lo + hi`` and ``lo - hi``);
* shared-memory stages, bits 9 and up (groups of g >= 1024 span g / 512 warps: the CTA is one
  group): every thread writes its 16 values, a barrier, each thread reads the 16 values that
  differ only in those bits (16 / (g/512) register slots times g/512 warps), butterflies them in
  registers, writes them back, a barrier, and reads its own 16 values again.  One round trip
  covers all the bits above 8 (up to 4 of them, g = 8192), and every shared-memory access of a
  warp is 32 consecutive words (no bank conflicts).

Launch contract: blockDim.x = 32 * (g / 512) for g >= 1024, any multiple of 32 otherwise; a
1-D grid strides over CTA tiles of 16 * blockDim.x elements, every thread runs the same
iterations (out-of-range chunks are zeros and not stored), so all lanes reach every shuffle and
barrier.  The tensor size is a multiple of g, so a tile never splits a group.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from ..formats.hadamard import WARP_TILE, inv_sqrt_group_size
from . import launch
from ._chunk import U32, make_chunk_io
from ._primitives import FULL_MASK, WARP_SIZE, device_jit, f32_as_u32, u32_as_f32

REGISTERS = 16  # elements per thread: 4 chunks of 4
CHUNKS = 4
TILE_CHUNKS = WARP_TILE // 4  # chunks per warp tile (128)


def group_warps(group_size):
    """Warps one group spans: 1 up to g = 512 (registers and shuffles suffice), g / 512 above."""
    return max(1, group_size // WARP_TILE)


def threads_per_block(group_size, default):
    """The CTA size a kernel for ``group_size`` runs with (see the launch contract)."""
    return 32 * group_warps(group_size) if group_size > WARP_TILE else default


def smem_words(group_size):
    """float32 words of shared memory the butterflies need (1: numba wants a non-empty array)."""
    return group_size if group_size > WARP_TILE else 1


def _register_stage(stride):
    """Butterflies between registers i and i + stride (stride 1, 2: bits 0, 1; 4, 8: bits 7, 8)."""

    @device_jit
    def stage(v, lane, sm):
        for i in range(REGISTERS):
            if i & stride == 0:
                a = v[i]
                b = v[i + stride]
                v[i] = a + b
                v[i + stride] = a - b

    return stage


def _lane_stage(offset):
    """Butterflies between lanes l and l ^ offset (element bits 2-6)."""

    @device_jit
    def stage(v, lane, sm):
        upper = (lane & offset) != 0
        for i in range(REGISTERS):
            p = cuda.shfl_xor_sync(FULL_MASK, v[i], offset)
            if upper:
                v[i] = p - v[i]
            else:
                v[i] = v[i] + p

    return stage


def _slot_stage(stride, warps, per_warp):
    """Butterflies between gathered values h and h + stride of each slot (bits 9 and up)."""

    @device_jit
    def stage(c):
        for k in range(per_warp):
            for h in range(warps):
                if h & stride == 0:
                    a = c[k * warps + h]
                    b = c[k * warps + h + stride]
                    c[k * warps + h] = a + b
                    c[k * warps + h + stride] = a - b

    return stage


def _chain(first, second):
    @device_jit
    def both(v, lane, sm):
        first(v, lane, sm)
        second(v, lane, sm)

    return both


def _chain_slots(first, second):
    @device_jit
    def both(c):
        first(c)
        second(c)

    return both


def _smem_stage(group_size):
    warps = group_warps(group_size)  # == the CTA's warps
    per_warp = REGISTERS // warps  # register slots each thread gathers
    slot_stages = functools.reduce(
        _chain_slots,
        [_slot_stage(1 << b, warps, per_warp) for b in range(warps.bit_length() - 1)],
    )

    @device_jit
    def stage(v, lane, sm):
        w = cuda.threadIdx.x // WARP_SIZE
        # word lane + 32 * (slot + 16 * warp): a warp's accesses are 32 consecutive words
        for i in range(REGISTERS):
            sm[lane + 32 * (i + REGISTERS * w)] = v[i]
        cuda.syncthreads()  # all of the group is in shared memory
        # v's own values are in shared memory now, so v holds the gathered slots (no second
        # register array: the CTA keeps more threads resident)
        for k in range(per_warp):
            for h in range(warps):
                v[k * warps + h] = sm[lane + 32 * (w * per_warp + k + REGISTERS * h)]
        slot_stages(v)
        for k in range(per_warp):
            for h in range(warps):
                sm[lane + 32 * (w * per_warp + k + REGISTERS * h)] = v[k * warps + h]
        cuda.syncthreads()  # every slot is transformed before threads read their own back
        # A thread only ever writes its own words before the next tile's first barrier, so no
        # barrier is needed between this read and the next tile's writes.
        for i in range(REGISTERS):
            v[i] = sm[lane + 32 * (i + REGISTERS * w)]

    return stage


@functools.cache
def make_butterflies(group_size):
    """Device function ``butterflies(v, lane, sm)``: the unnormalized transform, in place, of the
    16 registers ``v`` (float32 local array) of every group, in ``formats.hadamard``'s stage
    order.  ``sm`` is a float32 shared array of ``smem_words(g)`` words.  Every thread of the
    CTA must call it (shuffles, barriers)."""
    bits = group_size.bit_length() - 1
    stages = [_register_stage(s) for b, s in ((0, 1), (1, 2), (7, 4), (8, 8)) if b < bits]
    stages += [_lane_stage(1 << (b - 2)) for b in range(2, min(7, bits))]
    if group_size > WARP_TILE:
        stages.append(_smem_stage(group_size))
    return functools.reduce(_chain, stages)


@device_jit
def flip_signs(v, mask):
    """Negate register i where bit i of ``mask`` is set (an exact sign-bit flip)."""
    for i in range(REGISTERS):
        v[i] = u32_as_f32(U32(f32_as_u32(v[i]) ^ U32(U32(U32(mask >> i) & 1) << 31)))


@device_jit
def tile_position(i, lane, warp):
    """Element offset of register ``i`` of (lane, warp) inside its CTA tile."""
    return (i & 3) + 4 * (lane + 32 * (i >> 2)) + WARP_TILE * warp


@functools.cache
def make_tile_io(kind):
    """``(load_tile_raw, unpack_tile)``: a thread's 4 chunks as 8 raw words (zeros past the end;
    the second word of each pair is unused for 16-bit data), and their conversion into the 16
    float32 registers.  Loading the next tile's raw words before transforming the current one
    keeps twice the bytes in flight (the kernels are otherwise latency-bound between tiles)."""
    _, _, load_raw, unpack = make_chunk_io(kind)

    @device_jit
    def load_tile_raw(words, base, n_chunks):
        a0, a1 = load_raw(words, base, n_chunks)
        b0, b1 = load_raw(words, base + 32, n_chunks)
        c0, c1 = load_raw(words, base + 64, n_chunks)
        d0, d1 = load_raw(words, base + 96, n_chunks)
        return a0, a1, b0, b1, c0, c1, d0, d1

    @device_jit
    def unpack_tile(v, a0, a1, b0, b1, c0, c1, d0, d1):
        v[0], v[1], v[2], v[3] = unpack(a0, a1)
        v[4], v[5], v[6], v[7] = unpack(b0, b1)
        v[8], v[9], v[10], v[11] = unpack(c0, c1)
        v[12], v[13], v[14], v[15] = unpack(d0, d1)

    return load_tile_raw, unpack_tile


@functools.cache
def hadamard_kernel(kind, group_size, inverse, signed):
    """The normalized transform (or its inverse) of float32 / bf16 / fp16 ``words`` into
    ``out_words`` (same kind; may alias): forward fwht(x * signs) * fp32(1/sqrt(g)), inverse
    fwht(y) * fp32(1/sqrt(g)) * signs, rounded once to the kind.  ``sign_words``: the signs as
    bits (``formats.hadamard.sign_words``), read only when ``signed``."""
    store_chunk = make_chunk_io(kind)[1]
    load_tile_raw, unpack_tile = make_tile_io(kind)
    butterflies = make_butterflies(group_size)
    n_smem = smem_words(group_size)
    scale = inv_sqrt_group_size(group_size)
    g_mask = group_size - 1

    @cuda.jit
    def kernel(words, out_words, n_chunks, sign_words):
        tid = cuda.threadIdx.x
        lane = tid % WARP_SIZE
        warp = tid // WARP_SIZE
        sm = cuda.shared.array(n_smem, np.float32)
        v = cuda.local.array(REGISTERS, np.float32)
        # A CTA tile is a whole number of groups, so each register's position in its group is
        # the same in every tile: the sign mask is computed once.
        mask = U32(0)
        if signed:
            for i in range(REGISTERS):
                p = tile_position(i, lane, warp) & g_mask
                mask |= U32(U32(U32(sign_words[p >> 5] >> U32(p & 31)) & 1) << i)
        tile_chunks = TILE_CHUNKS * (cuda.blockDim.x // WARP_SIZE)
        n_tiles = (n_chunks + tile_chunks - 1) // tile_chunks
        t = cuda.blockIdx.x
        base = t * tile_chunks + warp * TILE_CHUNKS + lane
        stride = cuda.gridDim.x * tile_chunks
        w0, w1, w2, w3, w4, w5, w6, w7 = load_tile_raw(words, base, n_chunks)
        while t < n_tiles:
            unpack_tile(v, w0, w1, w2, w3, w4, w5, w6, w7)
            w0, w1, w2, w3, w4, w5, w6, w7 = load_tile_raw(words, base + stride, n_chunks)
            if signed and not inverse:
                flip_signs(v, mask)
            butterflies(v, lane, sm)
            for i in range(REGISTERS):
                v[i] = v[i] * scale  # after the last add: a plain multiply, never an FMA
            if signed and inverse:
                flip_signs(v, mask)
            for j in range(CHUNKS):
                c = base + 32 * j
                if c < n_chunks:
                    store_chunk(out_words, c, v[4 * j], v[4 * j + 1], v[4 * j + 2], v[4 * j + 3])
            t += cuda.gridDim.x
            base += stride

    return kernel


# ---------------------------------------------------------------------- host side

THREADS = 256  # the launch table's row (cuda/launch.py); 32 * g / 512 for g >= 1024


def group_grid(group_size, n_chunks, device_id):
    """(CTAs, threads) for the kernels of this module and ``cuda.fp4quant``: a CTA is one group
    for g >= 1024 (its warps exchange through shared memory), 256 threads otherwise; a
    persistent grid of up to 2048 resident threads per SM."""
    threads = threads_per_block(group_size, launch.threads_for(THREADS))
    per = threads * REGISTERS // 4  # chunks of 4 elements a CTA takes per pass
    blocks = launch.grid_for(n_chunks, per)
    return min(blocks, launch.max_blocks(max(1, 2048 // threads), device_id)), threads


def hadamard(ctx, x, out, n, sign_words, kind, group_size, inverse, signed):
    """Queue the transform of the ``n`` elements of ``x`` into ``out`` (arrays of the caller's
    kind, validated by the caller) on the caller's stream."""
    if n == 0:
        return
    blocks, threads = group_grid(group_size, n // 4, ctx.device_id)
    launch.launch(
        hadamard_kernel(kind, group_size, inverse, signed),
        blocks,
        threads,
        ctx.stream,
        (ctx.view(x, np.uint64), ctx.view(out, np.uint64), np.int64(n // 4), sign_words),
    )
