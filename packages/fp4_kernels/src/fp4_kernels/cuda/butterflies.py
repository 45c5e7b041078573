"""Walsh–Hadamard butterfly networks on registers, warp shuffles and shared memory.

The device functions of the transform's kernels (``cuda.hadamard``) and of FP4Quant's
(``cuda.fp4quant``), which run the same butterflies.  Two networks give the same bits (the
stages run in the reference's order either way): the shared-memory network (``make_network``,
the "smem" variants; described where it is defined below), in which every stage is a register
butterfly and the registers change layout through shared-memory transposes, and the shuffle
network described next.  The launch table's ``NETWORK_VARIANTS`` lists which network a kernel
runs at which group size (``launch.network_choice``); ``FP4_HADAMARD_VARIANT`` picks one.

Shuffle network.  Element layout: a thread holds 32 elements in registers, 4 chunks of 8
consecutive elements (a 16-byte load of bf16 / fp16, two of float32): register i = 8 c + r
holds tile element
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

Launch contract (``launch.group_grid``): blockDim.x = 32 * max(1, g / 1024) for g >= 2048, any
multiple of 32 below; a 1-D grid strides over CTA tiles of 32 * blockDim.x elements and every
thread runs the same passes (chunks past the end are zeros and not stored), so all lanes reach
every shuffle and barrier.  The tensor size is a multiple of g, so a tile never splits a group.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
from numba import cuda

from .._scalar import KIND_F32
from ..formats.hadamard import stage_order
from ._primitives import (
    FULL_MASK,
    OPS,
    WARP_SIZE,
    device_jit,
    load_shared_at,
    load_shared_v2_at,
    load_shared_v4,
    load_shared_v4_at,
    opaque_u32,
    shared_base,
    store_shared_at,
    store_shared_v2_at,
    store_shared_v4,
    store_shared_v4_at,
    warp_barrier,
)
from ._words import U32, U64, make_words_io, words_per
from .launch_table import LAUNCHES

# elements a thread holds: 4 chunks of 8 (the launch table's work a thread a pass, for every
# kernel on these networks)
REGISTERS = LAUNCHES["hadamard"].items_per_thread
CHUNK = 8
WARP_TILE = WARP_SIZE * REGISTERS  # elements a warp holds


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
    butterflies = OPS.butterflies  # the CPU path's stage too (``_scalar.hadamard``)

    @device_jit
    def stage(v, lane):
        butterflies(v, REGISTERS, stride)

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


def make_register_store(kind, k, run):
    """``store_registers(out, v, t, tile, base, lane, warp, n)``: the thread's registers after
    the butterflies to ``out`` as ``kind`` in runs of ``run`` consecutive elements, the
    registers in the exchanged layout (``exchanged_element``) when ``k`` > 0, else in the tile
    layout (element ``base`` of the thread's chunk 0 in tile ``t``); nothing past ``n``."""
    store_run = make_chunk_io(kind)[1]

    @device_jit
    def store_registers(out, v, t, tile, base, lane, warp, n):
        for i0 in range(0, REGISTERS, run):
            if k > 0:
                e = t * tile + exchanged_element(i0, lane, warp, k)
            else:
                e = base + 256 * (i0 // CHUNK)
            store_run(out, e, n, v, i0, run)

    return store_registers


# A 16-bit kind's word k holds registers 2k (low half) and 2k + 1 (high half), whose sign bits
# are the word's bits 15 and 31.
HALF_SIGN_BITS = 0x80008000


# ---------------------------------------------------------------------- the "smem" variant
#
# Shared-memory transposes instead of warp shuffles.  A layout names, for the five bits of a
# thread's register index, the five lane bits and the warp bits, the element bit (of the CTA
# tile) each one carries.  The network walks ``stage_order(g)``: a stage whose bit is a register
# bit of the current layout is a register butterfly (``a + b``, ``a - b``: the reference's
# operands in the reference's order); when the next stage's bit is not, the registers go
# through shared memory into the next layout.  Global loads and stores keep the elements of
# one 16-byte access in registers (bits 0-2 of bf16 / fp16, 0-1 of float32; 8- or 4-byte
# stores where the final layout has runs of 4 or 2) and the next bits across the first lanes,
# so each access instruction covers whole 128-byte lines (the layouts' tests check this and
# that every shared-memory access is free of bank conflicts).  The transform of 16-bit data
# from g = 2048 takes a shorter chain of layouts (``EXCHANGED_DIRECT``) than the FP4Quant
# kernels.


class Layout(NamedTuple):
    """Element bit carried by each register-index bit, lane bit and warp bit."""

    regs: tuple
    lanes: tuple
    warps: tuple = (10, 11, 12)


LOAD = Layout((0, 1, 2, 7, 8), (3, 4, 5, 6, 9))  # stages 0, 1, 7, 8, 2 in registers
STORE = Layout((0, 1, 2, 6, 9), (3, 4, 5, 7, 8))  # stage 9; 16-byte stores
# between them, the lane stages 3-5 (as few of them as g has; stage 6 runs in STORE), with two
# bits in common with LOAD and with STORE (float32 included): both transposes move 16 bytes an
# access (8 + 8 accesses each way, where a middle of bits 2-6 shares one bit with LOAD: 16 + 16
# 8-byte ones)
_MIDDLE = {
    16: Layout((0, 1, 2, 3, 7), (4, 5, 6, 8, 9)),
    32: Layout((0, 1, 2, 3, 4), (5, 6, 7, 8, 9)),
    64: Layout((1, 2, 3, 4, 5), (0, 6, 7, 8, 9)),
}
MIDDLE = Layout((0, 2, 3, 4, 5), (1, 6, 7, 8, 9))
# g >= 2048 (a CTA is one group): the warp bits 10 .. 9 + k trade places with register bits
# through the CTA's shared memory; at g = 8192 runs of 4 elements (8-byte stores, bits 2-5
# across lanes 0-15: still whole lines)
EXCHANGED = {
    1: Layout((0, 1, 2, 6, 10), (3, 4, 5, 7, 8), (9, 11, 12)),
    2: Layout((0, 1, 2, 10, 11), (3, 4, 5, 7, 8), (6, 9, 12)),
    3: Layout((0, 1, 10, 11, 12), (2, 3, 4, 5, 7), (6, 8, 9)),
}
# The transform of 16-bit data from g = 2048 (``direct_exchange``): two transposes a tile
# instead of three.  The middle layout takes stages 3-6 and the CTA exchange leads straight
# into the store layout, whose registers hold the warp bits' stages and runs of 8 (g = 2048),
# 4 (4096) or 2 (8192: 4-byte stores, 32 lanes on one whole 128-byte line) elements; each
# transpose has one bit in common with its neighbours, so it moves 8 bytes an access: 32 + 32
# accesses of 8 bytes a tile instead of 24 + 24 of 16, a third less shared-memory traffic (the
# bound of the three-transpose kernel there: its warps stalled on shared-memory results, the
# MIO queue and the barriers, not on DRAM).
MIDDLE_DIRECT = Layout((0, 3, 4, 5, 6), (1, 2, 7, 8, 9))
EXCHANGED_DIRECT = {
    1: Layout((0, 1, 2, 9, 10), (3, 4, 5, 6, 7), (8, 11, 12)),
    2: Layout((0, 1, 9, 10, 11), (2, 3, 4, 5, 6), (7, 8, 12)),
    3: Layout((0, 9, 10, 11, 12), (1, 2, 3, 4, 5), (6, 7, 8)),
}
# g <= 1024: at most this many threads a CTA (shared memory holds 1024 words for each warp);
# with the prefetch (16 more registers) 128 (more CTAs fit the register file)
# float32 (4 elements a 16-byte access): bits 0-1 in registers and 2-4 across lanes 0-7
LOAD_F32 = Layout((0, 1, 7, 8, 5), (2, 3, 4, 6, 9))  # stages 0, 1, 7, 8
STORE_F32 = Layout((0, 1, 5, 6, 9), (2, 3, 4, 7, 8))
EXCHANGED_F32 = {
    1: Layout((0, 1, 5, 6, 10), (2, 3, 4, 7, 8), (9, 11, 12)),
    2: Layout((0, 1, 5, 10, 11), (2, 3, 4, 7, 8), (6, 9, 12)),
    3: EXCHANGED[3],
}
SHARED_ALIGN_BYTES = 128  # of the network's buffers (the array's alignment on a GPU)


def bits_offset(bits, x):
    """sum over j of bit j of x moved to bit ``bits[j]`` (host side)."""
    return sum(((x >> j) & 1) << b for j, b in enumerate(bits))


def layouts(group_size, wide=False, wide_out=None, direct_exchange=False):
    """The layouts the registers pass through, load to store: ``wide`` (``wide_out``) when
    the data loaded (stored) is float32, 4 elements a 16-byte access (``wide_out`` defaults
    to ``wide``).  ``direct_exchange``: where 16-bit data goes in and out from g = 2048, the
    two-transpose chain ending in ``EXCHANGED_DIRECT`` (the transform's)."""
    wide_out = wide if wide_out is None else wide_out
    k = cross_warp_bits(group_size)
    if direct_exchange and k in EXCHANGED_DIRECT and not wide and not wide_out:
        return [LOAD, MIDDLE_DIRECT, EXCHANGED_DIRECT[k]]
    store, exchanged = (STORE_F32, EXCHANGED_F32) if wide_out else (STORE, EXCHANGED)
    chain = [LOAD_F32 if wide else LOAD, _MIDDLE.get(group_size, MIDDLE), store]
    return chain + [exchanged[k]] if k else chain


def run_length(layout):
    """Consecutive elements in consecutive registers from register 0: 8, 4 (or 2)."""
    n = 0
    while n < 5 and layout.regs[n] == n:
        n += 1
    return 1 << n


def vector_bits(src, dst):
    """Element bits that stay in one thread's registers across a transpose: the first two
    make a 16-byte shared-memory access, a single one an 8-byte access."""
    common = [b for b in src.regs if b in dst.regs]
    return tuple(sorted(common)[:2])


def address_map(src, dst, n_bits):
    """Word address (XOR of contributions, one per element bit) of each element in the
    shared-memory buffer of a transpose ``src`` -> ``dst``: linear over GF(2) and one to one.

    The vector bits are the low address bits.  The next bits (the bank group: 8 groups of 16
    bytes, or 16 of 8 bytes) take the element bits of the writer's first 3 (or 4) lanes, each
    XORed with a bit of the reader's first lanes, so that both the 8 (or 16) lanes that share a
    shared-memory wavefront hit distinct banks on the write and on the read."""
    vec = vector_bits(src, dst)
    nv = len(vec)
    nb = 5 - nv  # lanes a wavefront serves: 8 (16-byte accesses), 16 (8-byte), 32
    wq, rq = src.lanes[:nb], dst.lanes[:nb]
    amap = [0] * n_bits
    for j, b in enumerate(vec):
        amap[b] = 1 << j
    for j, b in enumerate(wq):
        amap[b] = 1 << (nv + j)
    rest = [b for b in range(n_bits) if b not in vec and b not in wq]
    for j, b in enumerate(rest):
        amap[b] = 1 << (nv + nb + j)
    free = [j for j in range(nb) if wq[j] not in rq]
    for b, j in zip([b for b in rq if b not in wq], free, strict=True):
        amap[b] |= 1 << (nv + j)
    return vec, tuple(amap)


def xor_of(amap, bits, x):
    """XOR of ``amap[bits[j]]`` over the set bits j of x (host side)."""
    a = 0
    for j, b in enumerate(bits):
        if x >> j & 1:
            a ^= amap[b]
    return a


def accesses(layout, vec, amap):
    """(address of each access of a thread's registers relative to its lane's, registers of
    each access in address order): one access per register group sharing the vector bits."""
    vregs = [layout.regs.index(b) for b in vec]
    addrs, regs = [], []
    for i in range(REGISTERS):
        if any(i >> j & 1 for j in vregs):
            continue
        addrs.append(xor_of(amap, layout.regs, i))
        for m in range(1 << len(vec)):
            regs.append(i | sum(1 << vregs[j] for j in range(len(vec)) if m >> j & 1))
    return tuple(addrs), tuple(regs)


def _make_lane_address(layout, amap, k):
    """Device function (lane, warp) -> XOR of the address contributions of the lane bits and
    of the first k warp bits (the CTA exchange; per-warp buffers add their base instead)."""
    lane_terms = tuple(amap[b] for b in layout.lanes)
    warp_terms = tuple(amap[b] for b in layout.warps[:k]) if k else (0,)

    @device_jit
    def lane_address(lane, warp):
        a = 0
        for j in range(5):
            a ^= ((lane >> j) & 1) * lane_terms[j]
        for j in range(len(warp_terms)):
            a ^= ((warp >> j) & 1) * warp_terms[j]
        return U32(a)

    return lane_address


def split_accesses(layout, vec, amap, k):
    """(lo, hi, registers) of each access: its address is ``(lane address ^ lo) + hi``, lo
    holding the bits a lane's address may have (a few low, swizzled bits: one LOP3), hi the
    others (an immediate offset of the LDS / STS)."""
    addrs, regs = accesses(layout, vec, amap)
    lane_mask = 0
    for b in layout.lanes + (layout.warps[:k] if k else ()):
        lane_mask |= amap[b]
    return (
        tuple(a & lane_mask for a in addrs),
        tuple(a & ~lane_mask for a in addrs),
        regs,
    )


@functools.cache
def _transpose(src, dst, k, region, cta_before):
    """Device function (v, lane, warp, sm): the registers of layout ``src`` into layout
    ``dst`` through shared memory.  k = 0: within each warp (1024 words at ``1024 * warp``);
    k > 0: across the CTA's 2^k warps (g words at word ``region``).  ``cta_before``: a CTA
    barrier (else a warp barrier) before the writes, where other warps may still read the
    buffer."""
    vec, amap = address_map(src, dst, 10 + k)
    amap = tuple(4 * a for a in amap)  # bytes
    w_lo, w_hi, w_regs = split_accesses(src, vec, amap, k)
    r_lo, r_hi, r_regs = split_accesses(dst, vec, amap, k)
    # the swizzled bits stay below the buffers' alignment: XOR on the full address is exact
    assert max(w_lo + r_lo) < SHARED_ALIGN_BYTES
    w_lane = _make_lane_address(src, amap, k)
    r_lane = _make_lane_address(dst, amap, k)
    width = len(vec)  # log2 of the words an access moves
    n_access = len(w_lo)

    @device_jit
    def barrier(cta):
        if cta:
            cuda.syncthreads()
        else:
            warp_barrier()

    @device_jit
    def transpose(v, lane, warp, sm):
        base = U32(shared_base(sm) + U32(4 * region if k else 4 * WARP_TILE * warp))
        # computed once a tile (opaque): the per-access addresses are then one LOP3 each
        # instead of 32 loop-invariant registers
        wa = opaque_u32(U32(base + w_lane(lane, warp)))
        ra = opaque_u32(U32(base + r_lane(lane, warp)))
        # the previous reads of this buffer are done (this tile's or the last tile's)
        barrier(cta_before)
        for q in range(n_access):
            a = U32(U32(wa ^ U32(w_lo[q])) + U32(w_hi[q]))
            if width == 2:
                store_shared_v4_at(sm, a, v[w_regs[4 * q]], v[w_regs[4 * q + 1]],
                                   v[w_regs[4 * q + 2]], v[w_regs[4 * q + 3]])  # fmt: skip
            elif width == 1:
                store_shared_v2_at(sm, a, v[w_regs[2 * q]], v[w_regs[2 * q + 1]])
            else:
                store_shared_at(sm, a, v[w_regs[q]])
        barrier(k > 0)  # every write is visible
        for q in range(n_access):
            a = U32(U32(ra ^ U32(r_lo[q])) + U32(r_hi[q]))
            if width == 2:
                x0, x1, x2, x3 = load_shared_v4_at(sm, a)
                v[r_regs[4 * q]] = x0
                v[r_regs[4 * q + 1]] = x1
                v[r_regs[4 * q + 2]] = x2
                v[r_regs[4 * q + 3]] = x3
            elif width == 1:
                x0, x1 = load_shared_v2_at(sm, a)
                v[r_regs[2 * q]] = x0
                v[r_regs[2 * q + 1]] = x1
            else:
                v[r_regs[q]] = load_shared_at(sm, a)

    return transpose


def _in_layout(stage):
    @device_jit
    def step(v, lane, warp, sm):
        stage(v, lane)

    return step


def _chain4(first, second):
    @device_jit
    def both(v, lane, warp, sm):
        first(v, lane, warp, sm)
        second(v, lane, warp, sm)

    return both


def shares_one_buffer(group_size, one_buffer=False):
    """Whether the CTA exchange reuses the per-warp buffers' words (g >= 2048): always at 8192
    (48 KB is the static limit), at 2048 and 4096 where ``one_buffer`` asks for it."""
    return group_size == 8192 or (one_buffer and group_size > WARP_TILE)


def smem_network_words(group_size, max_threads, one_buffer=False):
    """float32 words of shared memory the "smem" network uses: 1024 a warp up to g = 1024 (CTAs
    of at most ``max_threads``); g (per-warp buffers) + g (the CTA exchange) at 2048 and 4096;
    one buffer of g words for both at 8192 (and where ``one_buffer`` asks for it; the barriers
    that sharing takes: ``make_network``)."""
    if group_size <= WARP_TILE:
        return WARP_TILE * (max_threads // WARP_SIZE)
    return group_size if shares_one_buffer(group_size, one_buffer) else 2 * group_size


@functools.cache
def make_network(
    group_size, wide=False, wide_out=None, fenced=False, one_buffer=False, direct_exchange=False
):
    """(final layout, network(v, lane, warp, sm)): the unnormalized transform of the registers
    of the first of ``layouts(g, wide, wide_out, direct_exchange)`` in ``stage_order(g)``,
    leaving them in the last.

    A CTA barrier comes before each write to a buffer that other warps may still be reading:
    the CTA exchange's (g >= 2048) after the last tile's reads, and where the exchange and the
    per-warp buffers share one array (``shares_one_buffer``), before the first transpose and
    before the exchange.  ``fenced``: the caller has a CTA barrier after every tile's network (the
    FP4Quant encoder's group amax), so the barriers that only keep the last tile's reads apart
    become warp barriers: one CTA barrier a tile fewer."""
    chain = layouts(group_size, wide, wide_out, direct_exchange)
    k = cross_warp_bits(group_size)
    single = shares_one_buffer(group_size, one_buffer)
    region = 0 if single else group_size
    steps = []
    at = 0

    def advance():
        nonlocal at
        cross = k if chain[at + 1] is chain[-1] and k else 0
        if cross:  # one buffer: this tile's per-warp reads of the same words come first
            cta_before = single or not fenced
        else:  # one buffer: the last tile's exchange read the first transpose's words
            cta_before = single and at == 0 and not fenced
        steps.append(_transpose(chain[at], chain[at + 1], cross, region, cta_before))
        at += 1

    for b in stage_order(group_size):
        while b not in chain[at].regs:
            advance()
        steps.append(_in_layout(_register_stage(1 << chain[at].regs.index(b))))
    while at < len(chain) - 1:
        advance()
    return chain[-1], functools.reduce(_chain4, steps)


def bits_fn(bits):
    """Device function x -> ``bits_offset(bits, x)`` for up to 5 bits, from scalar constants
    (a tuple indexed in a loop the compiler does not unroll becomes a switch)."""
    b = tuple(bits) + (0,) * (5 - len(bits))
    n = len(bits)
    b0, b1, b2, b3, b4 = b

    @device_jit
    def offset(x):
        e = ((x & 1) << b0) + (((x >> 1) & 1) << b1) + (((x >> 2) & 1) << b2)
        if n > 3:
            e += ((x >> 3) & 1) << b3
        if n > 4:
            e += ((x >> 4) & 1) << b4
        return e

    return offset


def make_offsets(layout):
    """Device function (lane, warp) -> element offset in the CTA tile of register 0."""
    lane_offset = bits_fn(layout.lanes)
    warp_offset = bits_fn(layout.warps)

    @device_jit
    def offset(lane, warp):
        return lane_offset(lane) + warp_offset(warp)

    return offset


@functools.cache
def make_tile_loader(kind, layout, aligned=True, prefetch=False, flips=False):
    """(start, tile_values, n_raw): device functions that fill a thread's 32 registers ``v``
    with its elements of tile ``t`` in ``layout`` (the network's first; register 0 at element
    ``t * tile + e_in``, zeros past ``n``), by 16-byte loads into ``n_raw`` words ``raw``
    widened to float32 (``w``: a scratch array of 8 words).

    ``start(x, t0, tile, e_in, n, w, raw)`` before the grid-stride loop and
    ``tile_values(x, t, stride, tile, e_in, n, w, raw, v, flip)`` in it; with ``prefetch`` the
    loads of tile t + stride are issued as soon as tile t's words are widened, so they are in
    flight while the kernel computes on tile t (``raw`` stays live across the iteration).

    ``flips`` (16-bit kinds): the sign bits ``word_flip_mask`` sets in ``flip`` are flipped
    in the raw words, before widening (the same float32 bits as negating the widened values:
    bf16 widens by a shift, fp16 by an exact conversion); otherwise ``flip`` is not read."""
    wide = kind == KIND_F32
    assert not (flips and wide), "float32 words hold one element: flip the registers"
    run_in = min(run_length(layout), CHUNK)
    n_words = words_per(kind, run_in)
    load, element = make_words_io(kind, n_words, aligned)[:2]
    shift = U64(0 if wide else 1)  # element index -> word index
    n_chunks = REGISTERS // run_in
    n_raw = n_chunks * n_words
    in_regs = tuple(bits_offset(layout.regs, i) for i in range(REGISTERS))

    @device_jit
    def load_raw(x, e0, n, w, raw, full):
        if full:  # the whole tile lies before n: no checks, one address, constant offsets
            first = U64(e0) >> shift
            for c in range(n_chunks):
                load(x, first + U64(in_regs[run_in * c] >> shift), w)
                for j in range(n_words):
                    raw[n_words * c + j] = w[j]
        else:
            for c in range(n_chunks):
                e = e0 + in_regs[run_in * c]
                for j in range(n_words):
                    w[j] = U32(0)
                if e < n:
                    load(x, U64(e) >> shift, w)
                for j in range(n_words):
                    raw[n_words * c + j] = w[j]

    @device_jit
    def unpack(raw, w, v, flip):
        if flips:
            m = opaque_u32(flip)  # the 16 word masks derived in each tile, not kept live
        for c in range(n_chunks):
            for j in range(n_words):
                w[j] = raw[n_words * c + j]
                if flips:
                    k = n_words * c + j
                    w[j] = U32(w[j] ^ U32(U32(m << U32(k)) & U32(HALF_SIGN_BITS)))
            for r in range(run_in):
                v[run_in * c + r] = element(w, r)

    @device_jit
    def start(x, t0, tile, e_in, n, w, raw):
        if prefetch:
            load_raw(x, t0 * tile + e_in, n, w, raw, (t0 + 1) * tile <= n)

    @device_jit
    def tile_values(x, t, stride, tile, e_in, n, w, raw, v, flip):
        if prefetch:  # widen this tile's words, then reuse them for the next tile's
            unpack(raw, w, v, flip)
            t1 = t + stride
            load_raw(x, t1 * tile + e_in, n, w, raw, (t1 + 1) * tile <= n)
        else:
            load_raw(x, t * tile + e_in, n, w, raw, (t + 1) * tile <= n)
            unpack(raw, w, v, flip)

    return start, tile_values, n_raw
