"""Fused CUDA kernels for TAH-Quant's two codecs (``tahquant.py``): the same bytes and the same
decoded values as its torch operations, which stay the definition and the CPU path.

Every float32 operation below is the IEEE operation of ``tahquant.py`` in the same order: the
sums of the entropy add halves (zero-padded to a power of two, ``a[i] + a[i + h]`` for h = P/2,
..., 1), ``ln`` is the same frexp and Horner polynomial, the Hadamard transform the same
butterflies (stride 1, 2, ..., 32; ``(a + b, a - b)``), divisions are ``div.rn.f32`` (numba's
default without fastmath, no flush to zero), rounding to an integer is ``cvt.rni`` (nearest
even, as ``torch.round``), and fp16 conversions are ``cvt.rn`` (nearest even, overflow to
infinity, as torch's).  NVVM would contract a product followed by an add into an FMA (one
rounding instead of two): every product goes through ``mul_rn_f32``, an inline ``mul.rn.f32``
that is never fused (these scalar operations: ``fp4_kernels.cuda.primitives``).

Launch geometry and layout (one launch each, on torch's current stream):

- ``token_entropy``: one block of ``ENTROPY_THREADS`` per token (32 or 64 for tokens below 128
  channels), each thread holding ``fold`` elements of the token (one kernel per geometry,
  ``entropy_kernel``), ``ENTROPY_THREADS`` floats of shared memory for the cross-warp stages
  of its sums; writes each token's entropy (float32, ``-inf`` where the magnitude sum is not
  finite).
- ``encode_tiles``: one thread per 64-channel tile, ``TILE_THREADS`` a block, grid-wide over
  chunks x tiles.  The block loads its tiles with coalesced reads into shared memory, a row of
  65 floats a tile (conflict-free: a warp's threads read element i of 32 rows from 32 banks),
  and each thread works on its row (swap, Hadamard, min/max, codes).  It writes the tile's
  codes at its token's destination (``slot``: the token's rank among the 3-bit tokens, or among
  the 4-bit ones, in token order), its fp16 zero and scale, and its transform flag and pivot
  into two int32 side arrays.
- ``encode_maps``: one thread per byte of the token map, the transform map and the pivots.
- ``decode_tiles``: one thread per tile, reading every field of the section directly, the
  values built in the thread's shared row and stored by the block with coalesced writes.
- ``grad_encode`` / ``grad_decode``: one thread per 32-element tile, staged the same way (rows
  of 33 floats, ``GRAD_THREADS`` a block).

The ranking of the tokens (``tahquant.low_precision_tokens``, an argsort) and each token's
slot (a cumulative sum) stay torch operations.  Under ``NUMBA_ENABLE_CUDASIM=1`` the kernels
run in numba's simulator on CPU tensors (the tests' way of checking them without a GPU).
"""

from __future__ import annotations

import math
import threading

import numpy as np
import torch
from numba import config, cuda, float32, int32, uint32

from fp4_kernels.cuda.primitives import (
    f16_bits_to_f32,
    f32_as_u32,
    f32_to_f16_bits,
    mul_rn_f32,
    rint_f32,
    u32_as_f32,
)

SIMULATOR = bool(config.ENABLE_CUDASIM)

TILE_SIZE = 64
GRAD_TILE_SIZE = 32
HADAMARD_STAGES = 6  # log2(TILE_SIZE)
# threads (= tiles) a block of the per-tile kernels; a block stages its tiles in shared memory,
# one row of TILE_SIZE + 1 floats a tile (the + 1: a warp's threads read their tiles' element i
# from 32 different banks)
TILE_THREADS = 64
TILE_STAGE = TILE_THREADS * (TILE_SIZE + 1)  # 16.6 KB
GRAD_THREADS = 128
GRAD_STAGE = GRAD_THREADS * (GRAD_TILE_SIZE + 1)  # 16.9 KB
ENTROPY_THREADS = 128  # threads a block of the entropy kernel (one block a token)
ENTROPY_WARPS = ENTROPY_THREADS // 32
# elements a thread of the entropy kernel holds at most (tokens up to 131072 channels; beyond
# 16 or so the compiler keeps them in local memory rather than registers)
ENTROPY_MAX_FOLD = 1024
WARP = 32
FULL_MASK = 0xFFFFFFFF
MAP_THREADS = 256
MIN_BLOCKS = 128  # numba-cuda's low-occupancy warning threshold (its dispatcher)
LOW_BYTES_A_TILE = TILE_SIZE * 3 // 8  # 24: 8 codes to 3 bytes
HIGH_BYTES_A_TILE = TILE_SIZE // 2  # 32: 2 codes a byte
GRAD_BYTES_A_TILE = GRAD_TILE_SIZE * 6 // 8  # 24: 4 codes to 3 bytes
FP16_NAN_BITS = 0x7E00

# float32 constants: numba types a Python float as float64, so each is a float32 here
ZERO = np.float32(0.0)
ONE = np.float32(1.0)
TWO = np.float32(2.0)
EIGHTH = np.float32(0.125)  # 1 / sqrt(64): the orthonormal Hadamard's scaling, exact
TWO_24 = np.float32(2.0**24)  # lifts a subnormal into the normal range (exact)
NEG_INF = np.float32(-np.inf)
LOW_LEVELS = np.float32(7.0)  # 2^3 - 1
HIGH_LEVELS = np.float32(15.0)  # 2^4 - 1
GRAD_STEPS = np.float32(32.0)
INV_GRAD_STEPS = np.float32(1.0 / 32.0)
# tahquant's _ln constants, the same float32 values
SQRT_HALF = np.float32(0.70710677)
LN2 = np.float32(0.6931472)
LN_C9, LN_C7, LN_C5, LN_C3, LN_C1 = (np.float32(1.0 / k) for k in (9, 7, 5, 3, 1))

_device = cuda.jit(device=True)


@_device
def _ln(p):
    """``tahquant._ln`` for a positive finite float32: frexp from the bits (exact, subnormals
    included), then the same operations in the same order."""
    b = f32_as_u32(p)
    ex = int32((b >> 23) & 0xFF)
    if ex == 0:  # subnormal: scaled into the normal range, exactly
        b = f32_as_u32(mul_rn_f32(p, TWO_24))
        ex = int32((b >> 23) & 0xFF) - 24
    m = u32_as_f32(uint32((b & 0x807FFFFF) | 0x3F000000))  # [0.5, 1)
    e = ex - 126
    if m < SQRT_HALF:
        m = mul_rn_f32(m, TWO)
        e -= 1
    s = (m - ONE) / (m + ONE)
    z = mul_rn_f32(s, s)
    # Horner, 1/9 first; each product rounded before its add (no FMA)
    r = LN_C9
    r = mul_rn_f32(r, z) + LN_C7
    r = mul_rn_f32(r, z) + LN_C5
    r = mul_rn_f32(r, z) + LN_C3
    r = mul_rn_f32(r, z) + LN_C1
    t = mul_rn_f32(s, r)
    return mul_rn_f32(float32(e), LN2) + (t + t)


@_device
def _p_ln_p(a, total):
    """``p ln p`` of p = a / total (``tahquant.token_entropy``'s term); p = 0 and NaN (a zero
    token: 0 / 0) give a zero term."""
    p = a / total
    if p > ZERO:
        return mul_rn_f32(p, _ln(p))  # rounded before the sums add it
    return ZERO


@_device
def _fold_stages(c, n):
    """Halving stages within a thread's ``n`` values, c[m] + c[m + h] for h = n / 2, ..., 1;
    returns their sum c[0]."""
    h = n // 2
    while h >= 1:
        for m in range(h):
            c[m] = c[m] + c[m + h]
        h //= 2
    return c[0]


@_device
def _block_sum(v, tid, p2, sm, nthreads):
    """The halving sum's last log2(nthreads) stages (nthreads: the block's size, a compile-time
    constant of each kernel, so these loops unroll): thread t holds element t of the level of
    nthreads values (``a[i] + a[i + h]`` for h = nthreads / 2, ..., 1).  The stages of stride
    32 and above add in warp 0 from shared memory (one barrier), those below by shuffles.  The
    sum is thread 0's; every thread calls it (it holds a barrier and shuffles)."""
    if nthreads > WARP:
        sm[tid] = v
        cuda.syncthreads()
        if tid < WARP:
            w = cuda.local.array(ENTROPY_WARPS, float32)
            n = nthreads // WARP
            for j in range(n):
                w[j] = sm[tid + WARP * j]
            v = _fold_stages(w, n)  # the strides 32 * h
    # every warp shuffles (the other warps' sums are not used): the block's threads run the same
    # shuffles, which the simulator's warp shuffles require
    h = min(WARP, p2) // 2
    while h >= 1:
        v = v + cuda.shfl_down_sync(FULL_MASK, v, h)
        h //= 2
    return v


def _make_token_entropy(fold, nthreads):
    """The entropy kernel of blocks of ``nthreads`` for tokens zero-padded to p2 channels,
    fold * nthreads (or less than 32, with 32 threads): thread t holds elements t + m * nthreads
    (m < fold), whose halving stages of stride nthreads and above it adds in registers;
    ``_block_sum`` adds the rest.  The |x| stay with the thread for
    the second pass (the terms): the token is read once."""

    @cuda.jit
    def token_entropy(x, token_size, p2, out):
        """One block a token: x (tokens, token_size) float32 -> out (tokens,) float32,
        ``tahquant.token_entropy``.  p2: token_size rounded up to a power of two."""
        sm = cuda.shared.array(ENTROPY_THREADS, float32)
        total_sm = cuda.shared.array(1, float32)
        tok = cuda.blockIdx.x
        if tok >= x.shape[0]:
            return  # a block of the grid's padding to MIN_BLOCKS (the whole block, no barrier)
        tid = cuda.threadIdx.x
        a = cuda.local.array(fold, float32)
        c = cuda.local.array(fold, float32)
        for m in range(fold):
            i = tid + m * nthreads
            a[m] = abs(x[tok, i]) if i < token_size else ZERO
            c[m] = a[m]
        s = _block_sum(_fold_stages(c, fold), tid, p2, sm, nthreads)
        if tid == 0:
            total_sm[0] = s
        cuda.syncthreads()  # the total to every thread; warp 0 has read sm
        total = total_sm[0]
        for m in range(fold):
            c[m] = _p_ln_p(a[m], total)
        s = _block_sum(_fold_stages(c, fold), tid, p2, sm, nthreads)
        if tid == 0:
            h = ZERO - s
            out[tok] = h if math.isfinite(total) else NEG_INF

    return token_entropy


_ENTROPY_KERNELS: dict = {}


def entropy_geometry(p2):
    """(threads, fold) of the entropy kernel for tokens zero-padded to ``p2`` channels: a block
    of 32 to ``ENTROPY_THREADS`` threads a token, ``fold`` elements a thread."""
    threads = min(ENTROPY_THREADS, max(WARP, p2))
    return threads, max(1, p2 // threads)


def entropy_kernel(p2):
    """The entropy kernel for tokens zero-padded to ``p2`` channels (one for each geometry,
    compiled at its first use)."""
    geometry = entropy_geometry(p2)
    kernel = _ENTROPY_KERNELS.get(geometry)
    if kernel is None:  # two threads may both build it: the same kernel, either one kept
        kernel = _ENTROPY_KERNELS[geometry] = _make_token_entropy(geometry[1], geometry[0])
    return kernel


@_device
def _hadamard_orthonormal(sm, row):
    """The tile ``sm[row:row + 64]`` -> its Walsh-Hadamard transform / 8, in place: stages of
    stride 1, 2, ..., 32, pairs (i, i + h) -> (a + b, a - b), then the exact scaling
    (``tahquant._hadamard``).  The row is the thread's own (no barrier)."""
    for stage in range(HADAMARD_STAGES):
        h = 1 << stage
        for pair in range(TILE_SIZE // 2):
            i = row + (((pair >> stage) << (stage + 1)) | (pair & (h - 1)))  # i & h == 0
            a = sm[i]
            b = sm[i + h]
            sm[i] = a + b
            sm[i + h] = a - b
    for i in range(TILE_SIZE):
        # never fused with the subtraction of the zero that follows
        sm[row + i] = mul_rn_f32(sm[row + i], EIGHTH)


@_device
def _code(e, zero, scale, levels, live):
    """``clamp(rne((e - zero) / scale), 0, levels)``, 0 where the tile is not ``live``."""
    if not live:
        return 0
    u = rint_f32((e - zero) / scale)
    if u > levels:
        u = levels
    if u > ZERO:  # -0 and negatives give code 0
        return int32(u)
    return 0


@_device
def _stage_in(src, sm, width, chunks, tiles):
    """The block's tiles of the flat ``src`` (``chunks`` x ``tiles`` tiles of ``width``
    consecutive elements, the block's first at blockIdx * blockDim) into rows of ``sm`` of
    width + 1: coalesced loads.  Returns the thread's tile ``g`` (out of range past the last),
    its row's offset in ``sm``, its chunk ``r`` and its tile ``k`` in the chunk."""
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    base = cuda.blockIdx.x * nthreads * width
    limit = chunks * tiles * width
    e = tid
    while e < nthreads * width:
        if base + e < limit:
            t = e // width
            sm[t * (width + 1) + e - t * width] = src[base + e]
        e += nthreads
    cuda.syncthreads()  # the rows are read by other threads than wrote them
    g = cuda.grid(1)
    r = g // tiles
    return g, tid * (width + 1), r, g - r * tiles


@_device
def _stage_out(sm, dst, width, tiles_total):
    """The inverse of ``_stage_in``: rows of ``sm`` to the block's tiles of ``dst``."""
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    base = cuda.blockIdx.x * nthreads * width
    limit = tiles_total * width
    cuda.syncthreads()  # every row is written before the block stores them
    e = tid
    while e < nthreads * width:
        if base + e < limit:
            t = e // width
            dst[base + e] = sm[t * (width + 1) + e - t * width]
        e += nthreads


@_device
def _rotate_outlier(sm, row):
    """Step 3 on the thread's tile ``sm[row:row + 64]``: whether it is finite, and where its
    largest magnitude is at least twice the second, the pivot swapped to the front and the
    tile transformed in place -> (finite, transform, pivot); pivot 0 where not transformed."""
    finite = True
    pivot = 0
    top1 = ZERO
    for i in range(TILE_SIZE):
        e = sm[row + i]
        if not math.isfinite(e):
            finite = False
        a = abs(e)
        if i == 0 or a > top1:  # the first occurrence of the maximum (torch.argmax)
            top1 = a
            pivot = i
    # the largest magnitude but the pivot's: the second of the two largest
    top2 = ZERO
    for i in range(TILE_SIZE):
        a = abs(sm[row + i])
        if i != pivot and a > top2:
            top2 = a
    transform = finite and top1 >= top2 * TWO
    if transform:
        first = sm[row]
        sm[row] = sm[row + pivot]
        sm[row + pivot] = first
        _hadamard_orthonormal(sm, row)
    else:
        pivot = 0
    return finite, transform, pivot


@_device
def _store24(out, r, at, word):
    """A 24-bit word into ``out[r, at:at + 3]``, little-endian."""
    out[r, at] = word & 255
    out[r, at + 1] = (word >> 8) & 255
    out[r, at + 2] = (word >> 16) & 255


@_device
def _load24(raw, r, at):
    """The little-endian 24-bit word at ``raw[r, at:at + 3]`` (int32)."""
    return int32(raw[r, at]) | (int32(raw[r, at + 1]) << 8) | (int32(raw[r, at + 2]) << 16)


@_device
def _store_fp16(out, r, at, bits):
    """fp16 ``bits`` into ``out[r, at:at + 2]``, little-endian."""
    out[r, at] = bits & 255
    out[r, at + 1] = bits >> 8


@_device
def _fp16_at(raw, r, at):
    """The little-endian fp16 at byte ``at`` of row ``r``, as a float32 (exact)."""
    return f16_bits_to_f32(uint32(int32(raw[r, at]) | (int32(raw[r, at + 1]) << 8)))


@_device
def _store_codes(out, r, at, sm, row, zero, scale, levels, live, is_low):
    """The tile's codes into ``out[r, at:]``: 3 bits (8 codes a little-endian 24-bit word,
    code k at bit 3k) where ``is_low``, else 4 bits (element 2w in the low nibble)."""
    if is_low:
        for w in range(TILE_SIZE // 8):
            word = 0
            for kk in range(8):
                word |= _code(sm[row + 8 * w + kk], zero, scale, levels, live) << (3 * kk)
            _store24(out, r, at + 3 * w, word)
    else:
        for w in range(TILE_SIZE // 2):
            even = _code(sm[row + 2 * w], zero, scale, levels, live)
            odd = _code(sm[row + 2 * w + 1], zero, scale, levels, live)
            out[r, at + w] = even | (odd << 4)


@cuda.jit
def encode_tiles(x, low, slot, tokens, token_size, high_off, zeros_off, scales_off, out,
                 transform_out, pivot_out):  # fmt: skip
    """One thread per tile, ``TILE_THREADS`` a block: the codes, zero, scale, transform flag
    and pivot of the tile (``TAHQuantCodec._encode_parts``, steps 3 and 4).  x (chunks * n,)
    float32, flat; low, slot (chunks, tokens) int32; out (chunks, section bytes) uint8;
    transform_out, pivot_out (chunks, tiles) int32."""
    tiles_a_token = token_size // TILE_SIZE
    tiles = tokens * tiles_a_token
    sm = cuda.shared.array(TILE_STAGE, float32)
    g, row, r, k = _stage_in(x, sm, TILE_SIZE, out.shape[0], tiles)
    if g >= out.shape[0] * tiles:
        return  # after the block's last barrier
    t = k // tiles_a_token
    j = k - t * tiles_a_token
    finite, transform, pivot = _rotate_outlier(sm, row)
    ok = finite
    lo = sm[row]
    hi = sm[row]
    for i in range(TILE_SIZE):
        e = sm[row + i]
        if not math.isfinite(e):
            ok = False
        if e < lo:
            lo = e
        if e > hi:
            hi = e
    # -0 becomes +0 (as tahquant's lo and hi): equal values differ in the sign of a zero only
    lo = lo + ZERO
    hi = hi + ZERO
    is_low = low[r, t] != 0
    levels = LOW_LEVELS if is_low else HIGH_LEVELS
    zero_bits = uint32(FP16_NAN_BITS)
    scale_bits = uint32(FP16_NAN_BITS)
    zero = ZERO
    scale = ZERO
    if ok:
        zero_bits = f32_to_f16_bits(lo)
        zero = f16_bits_to_f32(zero_bits)
        spread = hi - zero
        if spread < ZERO:  # torch.clamp(min=0)
            spread = ZERO
        scale_bits = f32_to_f16_bits(spread / levels)
        scale = f16_bits_to_f32(scale_bits)
        if not (math.isfinite(zero) and math.isfinite(scale)):
            ok = False
            zero_bits = uint32(FP16_NAN_BITS)
            scale_bits = uint32(FP16_NAN_BITS)
    live = ok and scale > ZERO
    s = slot[r, t]
    if is_low:
        at = s * (token_size * 3 // 8) + j * LOW_BYTES_A_TILE
    else:
        at = high_off + s * (token_size // 2) + j * HIGH_BYTES_A_TILE
    _store_codes(out, r, at, sm, row, zero, scale, levels, live, is_low)
    _store_fp16(out, r, zeros_off + 2 * k, zero_bits)
    _store_fp16(out, r, scales_off + 2 * k, scale_bits)
    flag = ok and transform
    transform_out[r, k] = 1 if flag else 0
    pivot_out[r, k] = pivot if flag else 0


@cuda.jit
def encode_maps(low, transform, pivot, tokens, tiles, token_map_off, transform_map_off,
                pivots_off, end, out):  # fmt: skip
    """One thread per byte of the token map, the transform map and the pivots (6 bits a tile,
    an LSB-first bit stream: 4 pivots to a little-endian 24-bit word), the last byte of each
    zero-filled."""
    per_row = end - token_map_off
    g = cuda.grid(1)
    if g >= low.shape[0] * per_row:
        return
    r = g // per_row
    at = token_map_off + (g - r * per_row)
    byte = 0
    if at < transform_map_off:
        b = at - token_map_off
        for bit in range(8):
            i = 8 * b + bit
            if i < tokens and low[r, i] != 0:
                byte |= 1 << bit
    elif at < pivots_off:
        b = at - transform_map_off
        for bit in range(8):
            i = 8 * b + bit
            if i < tiles and transform[r, i] != 0:
                byte |= 1 << bit
    else:
        b = at - pivots_off
        for bit in range(8):
            i = 8 * b + bit
            k = i // 6
            if k < tiles:
                byte |= ((pivot[r, k] >> (i - 6 * k)) & 1) << bit
    out[r, at] = byte


@cuda.jit
def decode_tiles(raw, place, tokens, token_size, n_low, high_off, zeros_off, scales_off,
                 transform_map_off, pivots_off, out):  # fmt: skip
    """One thread per tile: ``TAHQuantCodec._decode_float32``.  raw (chunks, section bytes)
    uint8; place (chunks, tokens) int32: the token's place in the codes (the 3-bit tokens in
    token order, then the 4-bit ones; the first ``n_low`` places are 3-bit codes, whatever the
    token map says); out (chunks * n,) float32, flat."""
    tiles_a_token = token_size // TILE_SIZE
    tiles = tokens * tiles_a_token
    sm = cuda.shared.array(TILE_STAGE, float32)
    g = cuda.grid(1)
    if g < raw.shape[0] * tiles:  # every thread reaches _stage_out's barrier
        _decode_tile(raw, place, g, tiles, tiles_a_token, token_size, n_low, high_off,
                     zeros_off, scales_off, transform_map_off, pivots_off, sm,
                     cuda.threadIdx.x * (TILE_SIZE + 1))  # fmt: skip
    _stage_out(sm, out, TILE_SIZE, raw.shape[0] * tiles)


@_device
def _decode_tile(raw, place, g, tiles, tiles_a_token, token_size, n_low, high_off, zeros_off,
                 scales_off, transform_map_off, pivots_off, sm, row):  # fmt: skip
    """Tile ``g`` of the section into ``sm[row:row + TILE_SIZE]``."""
    r = g // tiles
    k = g - r * tiles
    t = k // tiles_a_token
    j = k - t * tiles_a_token
    zero = _fp16_at(raw, r, zeros_off + 2 * k)
    scale = _fp16_at(raw, r, scales_off + 2 * k)
    s = place[r, t]
    if s < n_low:
        at = s * (token_size * 3 // 8) + j * LOW_BYTES_A_TILE
        for w in range(TILE_SIZE // 8):
            word = _load24(raw, r, at + 3 * w)
            for kk in range(8):
                sm[row + 8 * w + kk] = float32((word >> (3 * kk)) & 7)
    else:
        at = high_off + (s - n_low) * (token_size // 2) + j * HIGH_BYTES_A_TILE
        for w in range(TILE_SIZE // 2):
            byte = int32(raw[r, at + w])
            sm[row + 2 * w] = float32(byte & 15)
            sm[row + 2 * w + 1] = float32(byte >> 4)
    for i in range(TILE_SIZE):
        # q * scale, rounded, then + zero (no FMA)
        sm[row + i] = mul_rn_f32(sm[row + i], scale) + zero
    if (raw[r, transform_map_off + k // 8] >> (k % 8)) & 1:
        _hadamard_orthonormal(sm, row)
        bit = 6 * k
        at = pivots_off + bit // 8
        shift = bit % 8
        word = int32(raw[r, at])
        if shift > 2:  # the pivot runs into the next byte
            word |= int32(raw[r, at + 1]) << 8
        pivot = (word >> shift) & 63
        first = sm[row]
        sm[row] = sm[row + pivot]
        sm[row + pivot] = first


@cuda.jit
def grad_encode(x, scales_off, out):
    """One thread per 32-element tile, ``GRAD_THREADS`` a block:
    ``TAHQuantGradCodec._encode_parts``.  x (chunks * n,) float32, flat; out (chunks, section
    bytes) uint8."""
    tiles = x.shape[0] // out.shape[0] // GRAD_TILE_SIZE
    sm = cuda.shared.array(GRAD_STAGE, float32)
    g, row, r, k = _stage_in(x, sm, GRAD_TILE_SIZE, out.shape[0], tiles)
    if g >= out.shape[0] * tiles:
        return  # after the block's last barrier
    finite = True
    amax = ZERO
    for i in range(GRAD_TILE_SIZE):
        e = sm[row + i]
        if not math.isfinite(e):
            finite = False
        a = abs(e)
        if a > amax:
            amax = a
    scale_bits = f32_to_f16_bits(amax)
    scale = f16_bits_to_f32(scale_bits)
    ok = finite and math.isfinite(scale)
    if not ok:
        scale_bits = uint32(FP16_NAN_BITS)
    live = ok and scale > ZERO
    at = k * GRAD_BYTES_A_TILE
    for w in range(GRAD_TILE_SIZE // 4):  # 4 codes: a little-endian 24-bit word, code k at 6k
        word = 0
        for kk in range(4):
            c = 32
            if live:
                u = rint_f32(mul_rn_f32(sm[row + 4 * w + kk] / scale, GRAD_STEPS))
                if u < -GRAD_STEPS:
                    u = -GRAD_STEPS
                if u > GRAD_STEPS - ONE:
                    u = GRAD_STEPS - ONE
                c = int32(u) + 32
            word |= c << (6 * kk)
        _store24(out, r, at + 3 * w, word)
    _store_fp16(out, r, scales_off + 2 * k, scale_bits)


@cuda.jit
def grad_decode(raw, scales_off, out):
    """One thread per 32-element tile, ``GRAD_THREADS`` a block:
    ``TAHQuantGradCodec._decode_float32``.  raw (chunks, section bytes) uint8; out
    (chunks * n,) float32, flat."""
    tiles = out.shape[0] // raw.shape[0] // GRAD_TILE_SIZE
    sm = cuda.shared.array(GRAD_STAGE, float32)
    g = cuda.grid(1)
    if g < raw.shape[0] * tiles:  # every thread reaches _stage_out's barrier
        _grad_decode_tile(raw, scales_off, g, tiles, sm, cuda.threadIdx.x * (GRAD_TILE_SIZE + 1))
    _stage_out(sm, out, GRAD_TILE_SIZE, raw.shape[0] * tiles)


@_device
def _grad_decode_tile(raw, scales_off, g, tiles, sm, row):
    """Tile ``g`` of the section into ``sm[row:row + GRAD_TILE_SIZE]``."""
    r = g // tiles
    k = g - r * tiles
    scale = _fp16_at(raw, r, scales_off + 2 * k)
    at = k * GRAD_BYTES_A_TILE
    for w in range(GRAD_TILE_SIZE // 4):
        word = _load24(raw, r, at + 3 * w)
        for kk in range(4):
            q = float32(((word >> (6 * kk)) & 63) - 32)
            # (q / 32) is exact; one rounding in the product with the scale
            sm[row + 4 * w + kk] = mul_rn_f32(mul_rn_f32(q, INV_GRAD_STEPS), scale)


# ------------------------------------------------------------------------ host side


# numba fills its device list on first use, and two threads doing that at once fail ("key
# already in dictionary"): ranks emulated one thread each (``fp4_comm.emulated``) launch their
# first kernels together, so the first use takes a lock
_DEVICE_LIST_LOCK = threading.Lock()
_DEVICE_LIST = []


def _numba_device(index):
    """numba's context manager of CUDA device ``index`` (its primary context, torch's)."""
    if not _DEVICE_LIST:
        with _DEVICE_LIST_LOCK:
            if not _DEVICE_LIST:
                _DEVICE_LIST.append(len(cuda.gpus))
    return cuda.gpus[index]


def _launch(kernel, blocks, threads, shared_bytes, *args):
    """``kernel[blocks, threads]`` on ``args`` (torch tensors and ints) on torch's current
    stream of the tensors' device, with at least ``MIN_BLOCKS`` blocks.  Under the simulator
    the tensors are CPU tensors, copied in and back, and the grid is ``blocks``."""
    if SIMULATOR:
        tensors = [(a, cuda.to_device(a.numpy())) for a in args if isinstance(a, torch.Tensor)]
        dev = iter(d for _, d in tensors)
        kargs = [next(dev) if isinstance(a, torch.Tensor) else a for a in args]
        kernel[max(1, blocks), threads, 0, shared_bytes](*kargs)
        for a, d in tensors:
            d.copy_to_host(a.numpy())
        return
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    with _numba_device(device.index):
        stream = cuda.external_stream(torch.cuda.current_stream(device).cuda_stream)
        # sync=False: the arrays are torch's, used on the stream that produced them
        kargs = [cuda.as_cuda_array(a, sync=False) if isinstance(a, torch.Tensor) else a
                 for a in args]  # fmt: skip
        # at least MIN_BLOCKS blocks (numba warns of low occupancy below that at every launch
        # of a small payload); the kernels' surplus blocks find no work and return
        kernel[max(MIN_BLOCKS, blocks), threads, stream, shared_bytes](*kargs)


def entropies(xf, token_size):
    """(chunks, n) float32 contiguous -> (chunks, n / token_size) float32 entropies."""
    R, n = xf.shape
    T = n // token_size
    p2 = 1 << max(0, (token_size - 1).bit_length())
    threads, fold = entropy_geometry(p2)
    if fold > ENTROPY_MAX_FOLD:
        raise ValueError(f"TAH-Quant kernels: token_size {token_size} is beyond the entropy "
                         f"kernel's {ENTROPY_THREADS * ENTROPY_MAX_FOLD} channels")  # fmt: skip
    h = torch.empty(R * T, dtype=torch.float32, device=xf.device)
    _launch(entropy_kernel(p2), R * T, threads, 0, xf.view(R * T, token_size), token_size, p2,
            h)  # fmt: skip
    return h.view(R, T)


def token_slots(low, low32):
    """(chunks, tokens) bool and the same as int32 -> int32: each token's rank among the 3-bit
    tokens, or among the 4-bit ones, in token order (its place in its codes part)."""
    ranks = torch.cumsum(low32, 1, dtype=torch.int32)
    idx = torch.arange(low.shape[1], device=low.device, dtype=torch.int32)
    return torch.where(low, ranks - 1, idx - ranks)


def token_places(low):
    """(chunks, tokens) bool -> int32: each token's place in the order of the codes, the
    3-bit tokens in token order, then the 4-bit ones (``argsort`` of the decoder's key)."""
    ranks = torch.cumsum(low.to(torch.int32), 1, dtype=torch.int32)
    idx = torch.arange(low.shape[1], device=low.device, dtype=torch.int32)
    return torch.where(low, ranks - 1, ranks[:, -1:] + idx - ranks)


def encode(x, token_size, n_low, layout, low_precision_tokens):
    """``TAHQuantCodec`` encode of a checked (chunks, n) tensor -> its section (chunks, bytes).
    ``n_low``: 3-bit tokens a chunk; ``layout``: the codec's byte ranges of the parts;
    ``low_precision_tokens``: tahquant's ranking, (entropies, n_low) -> (chunks, tokens)
    bool."""
    R, n = x.shape
    T = n // token_size
    tiles = n // TILE_SIZE
    xf = x.float().contiguous()
    low = low_precision_tokens(entropies(xf, token_size), n_low)
    low32 = low.to(torch.int32)
    slot = token_slots(low, low32)
    out = torch.empty(R, layout["pivots"][1], dtype=torch.uint8, device=x.device)
    transform = torch.empty(R, tiles, dtype=torch.int32, device=x.device)
    pivot = torch.empty(R, tiles, dtype=torch.int32, device=x.device)
    _launch(encode_tiles, -(-R * tiles // TILE_THREADS), TILE_THREADS, 0, xf.view(-1), low32,
            slot, T, token_size, layout["high_codes"][0], layout["zeros"][0],
            layout["scales"][0], out, transform, pivot)  # fmt: skip
    start, end = layout["token_map"][0], layout["pivots"][1]
    _launch(encode_maps, -(-R * (end - start) // MAP_THREADS), MAP_THREADS, 0, low32, transform,
            pivot, T, tiles, start, layout["transform_map"][0], layout["pivots"][0], end,
            out)  # fmt: skip
    return out


def decode(raw, n, token_size, n_low, layout, unpack_bits):
    """``TAHQuantCodec`` decode of a checked section -> (chunks, n) float32.  ``unpack_bits``:
    tahquant's (packed, k) -> bool."""
    R = raw.shape[0]
    T = n // token_size
    raw = raw.contiguous()
    a, b = layout["token_map"]
    place = token_places(unpack_bits(raw[:, a:b], T))
    out = torch.empty(R, n, dtype=torch.float32, device=raw.device)
    _launch(decode_tiles, -(-R * (n // TILE_SIZE) // TILE_THREADS), TILE_THREADS, 0, raw, place,
            T, token_size, n_low, layout["high_codes"][0], layout["zeros"][0],
            layout["scales"][0], layout["transform_map"][0], layout["pivots"][0],
            out.view(-1))  # fmt: skip
    return out


def grad_encode_section(x, nbytes):
    """``TAHQuantGradCodec`` encode of a checked (chunks, n) tensor -> (chunks, nbytes)."""
    R, n = x.shape
    xf = x.float().contiguous()
    out = torch.empty(R, nbytes, dtype=torch.uint8, device=x.device)
    tiles = n // GRAD_TILE_SIZE
    _launch(grad_encode, -(-R * tiles // GRAD_THREADS), GRAD_THREADS, 0, xf.view(-1), n * 6 // 8,
            out)  # fmt: skip
    return out


def grad_decode_section(raw, n):
    """``TAHQuantGradCodec`` decode of a checked section -> (chunks, n) float32."""
    R = raw.shape[0]
    out = torch.empty(R, n, dtype=torch.float32, device=raw.device)
    tiles = n // GRAD_TILE_SIZE
    _launch(grad_decode, -(-R * tiles // GRAD_THREADS), GRAD_THREADS, 0, raw.contiguous(),
            n * 6 // 8, out.view(-1))  # fmt: skip
    return out
