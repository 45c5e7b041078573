"""Tensor amax (max |x| over finite elements) as per-CTA partial maxima: kernel and host side,
the CTA's last step that any amax pass shares (``cta_max_to``; the requantized sum's amax pass,
``cuda/reduce.py``, writes the same partials), the consumer's reduction of the partials
(``tensor_amax_from_partials``) and the NVFP4 tensor scale made from it (``make_tensor_scale``,
read by the quantize, fake-quantize and requantized-sum kernels).

Launch contract: 1-D grid of at most ``max_partials`` CTAs, any multiple of 32 threads; CTA b
writes ``parts[b]``.  A thread reads ``UNROLL`` 16-byte words a pass (independent loads in
flight before the first use) and takes the max of the finite magnitudes on the raw bits.  No
atomics and no zero-initialised buffer: the consumer (the quantize kernel) reduces the partials
itself, so the NVFP4 quantizer costs two launches and no memset.  NaN and +-Inf are ignored
(they contribute 0), so a stray non-finite value poisons only its own block, not the tensor
scale.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from .._scalar import INV_E2M1_MAX
from . import launch
from ._primitives import OPS, WARP_SIZE, device_jit, group_max, u32_as_f32
from ._words import ELEMENT_BYTES, U32, U64, make_words_io
from .launch_table import LAUNCHES

LAUNCH = LAUNCHES["amax"]
UNROLL = LAUNCH.items_per_thread  # 16-byte words in flight per thread per pass


@functools.cache
def amax_kernel(kind, aligned=True):
    """Arguments: x (uint32 words, or the element array when not aligned), n_vec (16-byte
    words), parts (float32, one per CTA)."""
    n_words = 4 * UNROLL
    load, _, _, finite_amax_bits, _ = make_words_io(kind, n_words, aligned)
    load4 = make_words_io(kind, 4, aligned)[0]
    finite_amax4 = make_words_io(kind, 4, aligned)[3]

    @cuda.jit
    def kernel(x, n_vec, parts):
        w = cuda.local.array(n_words, np.uint32)
        m = U32(0)
        nthreads = cuda.blockDim.x
        start = cuda.blockIdx.x * nthreads + cuda.threadIdx.x
        step = cuda.gridDim.x * nthreads
        full = n_vec // UNROLL  # passes of UNROLL consecutive 16-byte words per thread
        for i in range(start, full, step):
            load(x, U64(i) * U64(n_words), w)
            m = max(m, finite_amax_bits(w))
        for i in range(full * UNROLL + start, n_vec, step):  # the last < UNROLL words
            load4(x, U64(i) * U64(4), w)
            m = max(m, finite_amax4(w))
        cta_max_to(u32_as_f32(m), parts)

    return kernel


@device_jit
def cta_max_to(a, parts):
    """The max of ``a`` (>= 0) over the CTA written to ``parts[blockIdx.x]`` by thread 0: a
    warp butterfly, then the warps' maxima through shared memory.  Every thread of the CTA
    calls it (the barrier), after its last read of the data: what an amax pass's CTA does last
    (this kernel's, and the requantized sum's, ``cuda/reduce.py``)."""
    tid = cuda.threadIdx.x
    a = group_max(a, WARP_SIZE)
    warp_max = cuda.shared.array(32, dtype=np.float32)
    if tid % WARP_SIZE == 0:
        warp_max[tid // WARP_SIZE] = a
    cuda.syncthreads()  # all warp maxima written before thread 0 combines them
    if tid == 0:
        for k in range(1, cuda.blockDim.x // WARP_SIZE):
            v = warp_max[k]
            if v > a:
                a = v
        parts[cuda.blockIdx.x] = a


def max_partials(device_id):
    """Size of the partials buffer ``amax_partials`` may fill."""
    return launch.max_blocks(LAUNCH.partials_per_sm, device_id)


def computes_amax(call):
    """Whether the quantize ``call`` (a ``_calls.QuantizeCall``) computes its tensor amax: NVFP4
    without a ``global_amax``."""
    return call.fmt.tensor_scale and call.amax_value < 0 and call.amax_array is None


def scratch_size(call, device_id):
    """float32 elements of the quantize kernels' scratch buffer: [global_scale, amax
    partials...] (one allocation, not two)."""
    return 1 + (max_partials(device_id) if computes_amax(call) else 0)


def tensor_scale_args(ctx, call, xw, aligned, scratch):
    """The quantize kernels' tensor-scale arguments for ``call`` (parts, n_parts, amax_value,
    global_scale): the amax from the caller's one-element ``global_amax`` array, from the
    partials queued here into ``scratch[1:]`` over the words view ``xw`` of ``call.x``, or from
    none (``n_parts`` 0: a ``global_amax`` given as a number, or MXFP4); the tensor scale
    written to ``scratch[0]``."""
    gs = ctx.view(scratch[:1])
    if call.amax_array is not None:
        parts, n_parts = ctx.view(call.amax_array, np.float32), 1
    elif computes_amax(call):
        parts = ctx.view(scratch[1:])
        n_parts = amax_partials(ctx, xw, aligned, call.kind, call.geometry.n, parts)
    else:
        parts, n_parts = gs, 0
    return parts, launch.int64(n_parts), np.float32(call.amax_value), gs


def amax_partials(ctx, xw, aligned, kind, n, parts):
    """Queue the amax kernel over the ``n`` elements behind the words view ``xw``, writing
    ``parts[:blocks]``; returns how many partials it wrote."""
    n_vec = n * ELEMENT_BYTES[kind] // 16  # n is a multiple of 16 elements
    threads = launch.threads_for(LAUNCH.threads)
    blocks = launch.grid_for(-(-n_vec // UNROLL), threads)
    blocks = min(blocks, max_partials(ctx.device_id))
    return launch.launch(
        amax_kernel(kind, aligned), blocks, threads, ctx, (xw, launch.int64(n_vec), parts)
    )


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
def make_tensor_scale(fmt):
    """Device function ``tensor_scale(amax_value, amax_parts, n_parts, global_scale)``: (S *
    1/6, 1/S) for NVFP4 (1/S written to global_scale by thread 0), (0, 1) for MXFP4."""
    nvfp4 = fmt.tensor_scale  # NVFP4: e4m3 block scales under a float32 tensor scale
    nvfp4_encode_scale = OPS.nvfp4_encode_scale
    one = np.float32(1.0)

    @device_jit
    def tensor_scale(amax_value, amax_parts, n_parts, global_scale):
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

    return tensor_scale
