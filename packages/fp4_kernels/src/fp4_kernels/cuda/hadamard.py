"""The Walsh–Hadamard transform (``hadamard``): its kernels and host wrapper.

Each kernel runs one of the butterfly networks of ``cuda.butterflies`` (the shuffle network,
``hadamard_kernel``, or the shared-memory one, ``smem_hadamard_kernel``; the launch table's
``NETWORK_VARIANTS`` says which, ``transform_kernel`` picks it) on 32 registers a thread:
forward, the signs applied to the loaded elements, the butterflies, one multiplication by
fp32(1 / sqrt(g)); inverse, the butterflies, that multiplication, then the signs.  One rounding
to the output kind at the store, as ``formats.hadamard.fwht`` does.  Element layout, stage
order and launch contract are those of ``cuda.butterflies``; the grid is
``launch.group_grid``'s, on the launch table's "hadamard" row (and "hadamard_prefetch" for the
prefetching kernels, whose shared-memory carveout is sized per group size:
``prefetch_threads_per_sm``).
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from .._scalar import KIND_F32
from ..formats.hadamard import inv_sqrt_group_size
from . import launch
from ._primitives import (
    SHARED_ALIGNMENT,
    WARP_SIZE,
    device_jit,
    f32_as_u32,
    opaque_u32,
    u32_as_f32,
)
from ._words import U32, U64, make_words_io, words_per
from .butterflies import (
    CHUNK,
    REGISTERS,
    WARP_TILE,
    bits_fn,
    bits_offset,
    cross_warp_bits,
    exchanged_element,
    layouts,
    make_butterflies,
    make_chunk_io,
    make_network,
    make_offsets,
    make_register_store,
    make_tile_loader,
    run_length,
    smem_network_words,
    smem_words,
    tile_element,
)
from .launch_table import LAUNCHES

LAUNCH = LAUNCHES["hadamard"]  # a CTA of 32 * g / 1024 threads from g = 2048
PREFETCH_LAUNCH = LAUNCHES["hadamard_prefetch"]


@device_jit
def scale_registers(v, scale):
    """``v[i] * scale`` in place: the transform's one rounding, after its last add (a plain
    multiply that nothing follows, so never part of an FMA)."""
    for i in range(REGISTERS):
        v[i] = v[i] * scale


@device_jit
def flip_signs(v, mask):
    """Negate register i where bit i of ``mask`` is set (an exact sign-bit flip)."""
    for i in range(REGISTERS):
        v[i] = u32_as_f32(U32(f32_as_u32(v[i]) ^ U32(U32(U32(mask >> U32(i)) & 1) << 31)))


@device_jit
def flip_signs_per_tile(v, mask):
    """``flip_signs`` with the 32 sign words derived from ``mask`` in every tile (two integer
    instructions a register) instead of kept in 32 registers across the loop."""
    m = opaque_u32(mask)
    for i in range(REGISTERS):
        v[i] = u32_as_f32(U32(f32_as_u32(v[i]) ^ U32(U32(m << U32(31 - i)) & U32(0x80000000))))


@device_jit
def word_flip_mask(mask):
    """``mask`` (bit i: negate register i) rearranged for 16-bit words: bit 15 - k holds bit 2k
    and bit 31 - k bit 2k + 1, so that ``(m << k) & HALF_SIGN_BITS`` flips word k's two
    elements (one shift and one LOP3 a word, where ``flip_signs_per_tile`` spends two
    instructions a register)."""
    m = U32(0)
    for k in range(REGISTERS // 2):
        m = U32(m | U32(U32(U32(mask >> U32(2 * k)) & 1) << U32(15 - k)))
        m = U32(m | U32(U32(U32(mask >> U32(2 * k + 1)) & 1) << U32(31 - k)))
    return m


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
    load_chunks = make_chunk_io(kind, aligned)[0]
    before, cross_warp = make_butterflies(group_size)
    n_smem = smem_words(group_size)
    scale = inv_sqrt_group_size(group_size)
    g_mask = group_size - 1
    k = cross_warp_bits(group_size)
    run = 4 if k == 3 else CHUNK  # consecutive elements per register run after the stages
    store_registers = make_register_store(kind, k, run)

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
            scale_registers(v, scale)
            if signed and inverse:
                flip_signs(v, mask_out)
            store_registers(out, v, t, tile, base, lane, warp, n)

    return kernel


def _make_sign_mask(layout, group_size):
    """Device function ``mask_of(sign_words, e0)``: bit i set where register i's element in
    ``layout`` (register 0 at ``e0``) has a negative sign."""
    offset = bits_fn(layout.regs)
    g_mask = group_size - 1

    @device_jit
    def mask_of(sign_words, e0):
        mask = U32(0)
        for i in range(REGISTERS):
            p = (e0 + offset(i)) & g_mask
            bit = U32(U32(sign_words[p >> 5] >> U32(p & 31)) & 1)
            mask = U32(mask | U32(bit << U32(i)))
        return mask

    return mask_of


@functools.cache
def smem_hadamard_kernel(kind, group_size, inverse, signed, aligned=True, prefetch=False):
    """``hadamard_kernel`` with the "smem" network: same arguments, same bits.  Launch: as
    ``hadamard_kernel``, at most ``max_threads(prefetch)`` threads a CTA below g = 2048.
    ``prefetch`` (16-bit kinds only: ``network_choice``): the next tile's loads are issued
    before this tile's butterflies, so they are in flight while it computes (16 more
    registers)."""
    wide = kind == KIND_F32
    assert not (prefetch and wide), "float32 input does not prefetch (network_choice)"
    first = layouts(group_size, wide, direct_exchange=True)[0]
    final, network = make_network(group_size, wide, direct_exchange=True)
    n_smem = smem_network_words(group_size, launch.network_max_threads(prefetch))
    # the forward transform of a 16-bit kind flips its input signs in the raw words
    word_flips = signed and not inverse and not wide
    start, tile_values, n_raw = make_tile_loader(kind, first, aligned, prefetch, word_flips)
    # runs of consecutive elements in consecutive registers: one store each (16 bytes; 8 or 4
    # where the final layout's runs are 4 or 2 elements)
    run = min(run_length(final), CHUNK)
    store = make_words_io(kind, words_per(kind, run))[4]
    shift = U64(0 if wide else 1)  # element index -> word index
    scale = inv_sqrt_group_size(group_size)
    in_offset = make_offsets(first)
    out_offset = make_offsets(final)
    out_regs = tuple(bits_offset(final.regs, i) for i in range(REGISTERS))
    mask_in_of = _make_sign_mask(first, group_size)
    mask_out_of = _make_sign_mask(final, group_size)

    @cuda.jit
    def kernel(x, out, n, sign_words):
        tid = cuda.threadIdx.x
        lane = tid % WARP_SIZE
        warp = tid // WARP_SIZE
        sm = cuda.shared.array(n_smem, np.float32, alignment=SHARED_ALIGNMENT)
        v = cuda.local.array(REGISTERS, np.float32)
        w = cuda.local.array(8, np.uint32)
        raw = cuda.local.array(n_raw, np.uint32)
        e_in = in_offset(lane, warp)
        e_out = out_offset(lane, warp)
        mask_in = U32(0)
        mask_out = U32(0)
        if signed:  # a CTA tile is a whole number of groups: the same masks in every tile
            mask_in = mask_in_of(sign_words, e_in)
            mask_out = mask_out_of(sign_words, e_out)
            if word_flips:
                mask_in = word_flip_mask(mask_in)
        tile = REGISTERS * cuda.blockDim.x
        n_tiles = (n + tile - 1) // tile
        stride = cuda.gridDim.x
        start(x, cuda.blockIdx.x, tile, e_in, n, w, raw)
        for t in range(cuda.blockIdx.x, n_tiles, stride):
            tile_values(x, t, stride, tile, e_in, n, w, raw, v, mask_in)
            if signed and not inverse and not word_flips:
                flip_signs_per_tile(v, mask_in)
            network(v, lane, warp, sm)
            scale_registers(v, scale)
            if signed and inverse:
                flip_signs_per_tile(v, mask_out)
            if (t + 1) * tile <= n:  # the whole tile: one address, constant offsets
                first = U64(t * tile + e_out) >> shift
                for i0 in range(0, REGISTERS, run):
                    store(out, first + U64(out_regs[i0] >> shift), v, i0)
            else:
                for i0 in range(0, REGISTERS, run):
                    e = t * tile + e_out + out_regs[i0]
                    if e < n:
                        store(out, U64(e) >> shift, v, i0)

    return kernel


def transform_kernel(kind, group_size, inverse, signed, aligned=True):
    """(kernel, most threads a CTA or None, prefetch) of the current variant."""
    smem, prefetch = launch.network_choice(group_size, kind)
    if not smem:
        return hadamard_kernel(kind, group_size, inverse, signed, aligned), None, False
    kernel = smem_hadamard_kernel(kind, group_size, inverse, signed, aligned, prefetch)
    return kernel, launch.network_max_threads(prefetch), prefetch


# ---------------------------------------------------------------------- host side


def prefetch_threads_per_sm(group_size):
    """The resident threads an SM the prefetching transform's carveout is sized for at
    ``group_size`` >= 2048 (a CTA is one group)."""
    carveouts = dict(PREFETCH_LAUNCH.carveout_threads_per_sm)
    return carveouts.get(group_size, PREFETCH_LAUNCH.threads_per_sm)


NO_SIGNS = np.zeros(1, np.uint32)  # the sign-words argument of a transform without signs


def run(ctx, call):
    """Queue the transform of ``call`` (a checked ``_calls.HadamardCall``) on the caller's
    stream; returns (out,), an array of the caller's kind."""
    out = ctx.empty(call.x.shape, None, like_dtype=ctx.float_dtype_of_kind(call.kind))
    signed = call.sign_words is not None
    words = ctx.view(ctx.constant(call.sign_words if signed else NO_SIGNS), np.uint32)
    hadamard(ctx, call.x, out, call.n, words, call.kind, call.group_size, call.inverse, signed)
    return (out,)


def hadamard(ctx, x, out, n, sign_words, kind, group_size, inverse, signed):
    """Queue the transform of the ``n`` elements of ``x`` into ``out`` (arrays of the caller's
    kind, validated by the caller) on the caller's stream."""
    if n == 0:
        return
    xw, aligned = ctx.words_view(x, kind)
    kernel, max_threads, prefetch = transform_kernel(kind, group_size, inverse, signed, aligned)
    # prefetching: 512 threads an SM by the grid, and from g = 2048 by the carveout too (384
    # at 2048)
    whole_groups = group_size > WARP_TILE  # a CTA is one group
    row = PREFETCH_LAUNCH if prefetch else LAUNCH
    blocks, threads = launch.group_grid(row, group_size, n, ctx.device_id, max_threads)
    launch.launch(
        kernel,
        blocks,
        threads,
        ctx,
        (xw, ctx.view(out, np.uint32), launch.int64(n), sign_words),
        threads_per_sm=prefetch_threads_per_sm(group_size) if prefetch and whole_groups else None,
    )
