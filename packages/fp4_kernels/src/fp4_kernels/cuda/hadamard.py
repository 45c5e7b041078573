"""Walsh–Hadamard transform kernel, and the butterfly network the FP4Quant codec shares.

Element layout: a thread holds 32 elements in registers, 4 chunks of 8 consecutive elements (a
16-byte load of bf16 / fp16, two of float32): register i = 8 c + r holds tile element
``r + 8 * lane + 256 * c + 1024 * warp``.  Index bits 0-2 and 8-9 are in a thread's registers,
bits 3-7 across the lanes of a warp, bits 10 and up across the warps of a CTA.  Lanes own
consecutive chunks, so each load and store of a warp is one contiguous 512-byte segment (bf16).

The stages run in ``formats.hadamard.stage_order(g)`` (0, 1, 7, 8, 2, 3, 4, 5, 6, 9, 10, ...),
the order the numpy reference and the CPU path use, so every rounding is the same:

* register stages (bits 0-2, 8, 9): ``a + b``, ``a - b`` between two registers;
* lane stages (bits 3-7): one ``shfl.bfly`` per element, then ``fma(own, ±1, partner)``:
  ``own + partner`` in the lower lane, ``partner - own`` in the upper one (the product by ±1 is
  exact, so the FMA rounds as the add of ``fwht`` does);
* the shared-memory stage (bits 10 and up, g >= 2048: a CTA of g / 1024 warps is one group):
  every thread writes its 32 values (16-byte stores, slots XOR-swizzled against bank
  conflicts), a barrier, and each thread reads back 32 values whose warp bits have traded
  places with its chunk bits (and, at g = 8192, register bit 2): those stages then run in
  registers, and the results leave from that layout straight to global memory.

Launch contract: blockDim.x = 32 * max(1, g / 1024) for g >= 2048, any multiple of 32 below; a
1-D grid strides over CTA tiles of 32 * blockDim.x elements and every thread runs the same
passes (chunks past the end are zeros and not stored), so all lanes reach every shuffle and
barrier.  The tensor size is a multiple of g, so a tile never splits a group.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from .._scalar import KIND_F32
from ..formats.hadamard import inv_sqrt_group_size, stage_order
from . import launch
from ._primitives import (
    FULL_MASK,
    WARP_SIZE,
    device_jit,
    f32_as_u32,
    load_shared_v4,
    store_shared_v4,
    u32_as_f32,
)
from ._words import U32, U64, make_words_io, words_per

REGISTERS = 32  # elements per thread: 4 chunks of 8
CHUNK = 8
WARP_TILE = 1024  # elements a warp holds
THREADS = 256  # the launch table's row (cuda/launch.py); 32 * g / 1024 for g >= 2048


def group_warps(group_size):
    """Warps one group spans: 1 up to g = 1024, g / 1024 above (a CTA is then one group)."""
    return max(1, group_size // WARP_TILE)


def threads_per_block(group_size, default):
    """The CTA size a kernel for ``group_size`` runs with (see the launch contract)."""
    return 32 * group_warps(group_size) if group_size > WARP_TILE else default


def smem_words(group_size):
    """float32 words of shared memory the butterflies need (1: numba wants a non-empty array)."""
    return group_size if group_size > WARP_TILE else 1


def cross_warp_bits(group_size):
    """k: index bits above the warp (10 .. 9 + k) that the shared-memory stage handles."""
    return group_warps(group_size).bit_length() - 1


@device_jit
def slot(e):
    """The 16-byte shared-memory slot of element e of a group (4 elements a slot), swizzled so
    that 8 lanes at a stride of 2 slots (every access pattern here) hit 8 different banks."""
    s = e >> 2
    return s ^ ((s >> 3) & 1)


def _register_stage(stride):
    """Butterflies between registers i and i + stride (i's stride bit clear)."""

    @device_jit
    def stage(v, lane):
        for i in range(REGISTERS):
            if i & stride == 0:
                a = v[i]
                b = v[i + stride]
                v[i] = a + b
                v[i + stride] = a - b

    return stage


def _lane_stage(offset):
    """Butterflies between lanes l and l ^ offset (element bits 3-7)."""

    @device_jit
    def stage(v, lane):
        sign = np.float32(-1.0) if lane & offset else np.float32(1.0)
        for i in range(REGISTERS):
            p = cuda.shfl_xor_sync(FULL_MASK, v[i], offset)
            v[i] = v[i] * sign + p  # fma(own, ±1, partner): the product is exact

    return stage


def _chain(first, second):
    @device_jit
    def both(v, lane):
        first(v, lane)
        second(v, lane)

    return both


@device_jit
def _nothing(v, lane):
    pass


def _stage_for(bit):
    if bit <= 2:
        return _register_stage(1 << bit)
    if bit <= 7:
        return _lane_stage(1 << (bit - 3))
    return _register_stage(CHUNK << (bit - 8))  # bits 8, 9: the chunk index


# Where register i's element sits after the shared-memory exchange, for k = 1, 2, 3 cross-warp
# bits: (chunk bits taken from the warp index, register bit 2 taken from the warp index) and
# the register strides of the cross-warp stages 10, 11, 12.
_EXCHANGE_STRIDES = {1: (8,), 2: (8, 16), 3: (8, 16, 4)}


@device_jit
def exchanged_element(i, lane, warp, k):
    """Group element held in register i after the exchange of k >= 1 warp bits.

    k = 1: warp bit 0 trades with chunk bit 0; k = 2: warp bits 0-1 with chunk bits 0-1;
    k = 3: warp bits 0-2 with chunk bits 0-1 and register bit 2."""
    r = i & 7
    c = i >> 3
    if k == 1:
        return r + 8 * lane + 256 * (2 * (c >> 1) + warp) + 1024 * (c & 1)
    if k == 2:
        return r + 8 * lane + 256 * warp + 1024 * c
    w_old = c + 4 * ((i >> 2) & 1)
    return (r & 3) + 4 * (warp >> 2) + 8 * lane + 256 * (warp & 3) + 1024 * w_old


@functools.cache
def make_butterflies(group_size):
    """Device functions ``(before_exchange(v, lane), cross_warp(v, lane, warp, sm))``: the
    unnormalized transform of the 32 registers ``v`` of every group, in the reference's stage
    order.  ``cross_warp`` (g >= 2048) does the shared-memory exchange and the stages above bit
    9, leaving ``v`` in the exchanged layout (``exchanged_element``); below g = 2048 it does
    nothing.  Every thread of the CTA must call both (shuffles, barriers)."""
    order = stage_order(group_size)
    local = [b for b in order if b < 10]
    k = cross_warp_bits(group_size)
    before = functools.reduce(_chain, [_stage_for(b) for b in local], _nothing)
    if k == 0:

        @device_jit
        def cross_warp(v, lane, warp, sm):
            pass

        return before, cross_warp
    after = functools.reduce(_chain, [_register_stage(s) for s in _EXCHANGE_STRIDES[k]])

    @device_jit
    def cross_warp(v, lane, warp, sm):
        for i in range(0, REGISTERS, 4):  # the thread's own elements, 4 a slot
            s = slot(i % 8 + 8 * lane + 256 * (i // 8) + 1024 * warp) * 4
            store_shared_v4(sm, s, v[i], v[i + 1], v[i + 2], v[i + 3])
        cuda.syncthreads()  # the whole group is in shared memory
        for i in range(0, REGISTERS, 4):
            s = slot(exchanged_element(i, lane, warp, k)) * 4
            v[i], v[i + 1], v[i + 2], v[i + 3] = load_shared_v4(sm, s)
        cuda.syncthreads()  # every read is done before the next tile's writes
        after(v, lane)

    return before, cross_warp


@device_jit
def tile_element(i, lane, warp):
    """Element offset of register ``i`` of (lane, warp) inside its CTA tile (before any
    exchange)."""
    return (i & 7) + 8 * lane + 256 * (i >> 3) + WARP_TILE * warp


@functools.cache
def make_chunk_io(kind, aligned=True):
    """``(load_chunks(x, base, n, v), store_run(out, e, n, v, i0, length))`` for ``kind``:
    load the thread's 4 chunks (element ``base`` of the thread's chunk 0, ``n`` elements in
    all; zeros past the end) into ``v``; store ``length`` (8 or 4) registers from ``i0`` as the
    consecutive elements from ``e`` (nothing past the end)."""
    n_words = words_per(kind, CHUNK)
    load, element, _, _, store = make_words_io(kind, n_words, aligned)
    store4 = make_words_io(kind, words_per(kind, 4))[4]
    per_word = 1 if kind == KIND_F32 else 2

    @device_jit
    def load_chunks(x, base, n, w, v):
        for c in range(4):
            e = base + 256 * c
            if e < n:
                load(x, U64(e // per_word), w)
                for r in range(CHUNK):
                    v[8 * c + r] = element(w, r)
            else:
                for r in range(CHUNK):
                    v[8 * c + r] = np.float32(0.0)

    @device_jit
    def store_run(out, e, n, v, i0, length):
        if e < n:
            if length == CHUNK:
                store(out, U64(e // per_word), v, i0)
            else:
                store4(out, U64(e // per_word), v, i0)

    return load_chunks, store_run


@device_jit
def flip_signs(v, mask):
    """Negate register i where bit i of ``mask`` is set (an exact sign-bit flip)."""
    for i in range(REGISTERS):
        v[i] = u32_as_f32(U32(f32_as_u32(v[i]) ^ U32(U32(U32(mask >> U32(i)) & 1) << 31)))


@device_jit
def sign_mask(sign_words, lane, warp, g_mask, k, exchanged):
    """Bit i set where register i's element (in the tile layout, or the exchanged one) has a
    negative sign in the group's ±1 vector."""
    mask = U32(0)
    for i in range(REGISTERS):
        if exchanged:
            p = exchanged_element(i, lane, warp, k)
        else:
            p = tile_element(i, lane, warp) & g_mask
        bit = U32(U32(sign_words[p >> 5] >> U32(p & 31)) & 1)
        mask = U32(mask | U32(bit << U32(i)))
    return mask


@functools.cache
def hadamard_kernel(kind, group_size, inverse, signed, aligned=True):
    """The normalized transform (or its inverse) of float32 / bf16 / fp16 ``x`` into ``out``
    (uint32 words; ``x`` the element array itself when not 16-byte aligned): forward
    fwht(x * signs) * fp32(1/sqrt(g)), inverse fwht(y) * fp32(1/sqrt(g)) * signs, rounded once
    to the kind.  ``sign_words``: the signs as bits (``formats.hadamard.sign_words``), read
    only when ``signed``."""
    load_chunks, store_run = make_chunk_io(kind, aligned)
    before, cross_warp = make_butterflies(group_size)
    n_smem = smem_words(group_size)
    scale = inv_sqrt_group_size(group_size)
    g_mask = group_size - 1
    k = cross_warp_bits(group_size)
    run = 4 if k == 3 else CHUNK  # consecutive elements per register run after the stages

    @cuda.jit
    def kernel(x, out, n, sign_words):
        tid = cuda.threadIdx.x
        lane = tid % WARP_SIZE
        warp = tid // WARP_SIZE
        sm = cuda.shared.array(n_smem, np.float32)
        v = cuda.local.array(REGISTERS, np.float32)
        w = cuda.local.array(8, np.uint32)
        # A CTA tile is a whole number of groups: each register's position in its group is
        # the same in every tile, so the sign masks are computed once.
        mask_in = U32(0)
        mask_out = U32(0)
        if signed:
            mask_in = sign_mask(sign_words, lane, warp, g_mask, k, False)
            mask_out = sign_mask(sign_words, lane, warp, g_mask, k, k > 0)
        tile = REGISTERS * cuda.blockDim.x
        n_tiles = (n + tile - 1) // tile
        for t in range(cuda.blockIdx.x, n_tiles, cuda.gridDim.x):
            base = t * tile + 8 * lane + WARP_TILE * warp
            load_chunks(x, base, n, w, v)
            if signed and not inverse:
                flip_signs(v, mask_in)
            before(v, lane)
            cross_warp(v, lane, warp, sm)
            for i in range(REGISTERS):
                v[i] = v[i] * scale  # after the last add: a plain multiply, never an FMA
            if signed and inverse:
                flip_signs(v, mask_out)
            for i0 in range(0, REGISTERS, run):
                if k > 0:
                    e = t * tile + exchanged_element(i0, lane, warp, k)
                else:
                    e = base + 256 * (i0 // CHUNK)
                store_run(out, e, n, v, i0, run)

    return kernel


# ---------------------------------------------------------------------- host side


def group_grid(group_size, n, device_id):
    """(CTAs, threads) for the kernels of this module and ``cuda.fp4quant``: a CTA is one group
    for g >= 2048 (its warps exchange through shared memory), 256 threads otherwise; a
    persistent grid of up to 2048 resident threads per SM."""
    threads = threads_per_block(group_size, launch.threads_for(THREADS))
    blocks = launch.grid_for(n, threads * REGISTERS)
    return min(blocks, launch.max_blocks(max(1, 2048 // threads), device_id)), threads


def hadamard(ctx, x, out, n, sign_words, kind, group_size, inverse, signed):
    """Queue the transform of the ``n`` elements of ``x`` into ``out`` (arrays of the caller's
    kind, validated by the caller) on the caller's stream."""
    if n == 0:
        return
    xw, aligned = ctx.words_view(x, kind)
    blocks, threads = group_grid(group_size, n, ctx.device_id)
    launch.launch(
        hadamard_kernel(kind, group_size, inverse, signed, aligned),
        blocks,
        threads,
        ctx.stream,
        (xw, ctx.view(out, np.uint32), np.int64(n), sign_words),
    )
