"""Host side of the CUDA kernels: validated flat views in, grid chosen, kernel queued on the
caller's stream.  No host synchronization anywhere on this path.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from ._primitives import SIMULATOR
from .amax import amax_kernel
from .dequantize import dequantize_kernel
from .quantize import UNROLL, quantize_kernel

THREADS_PER_BLOCK = 256
CTAS_PER_SM = 8  # persistent grid: enough resident warps to cover DRAM latency

# Tests shrink launches so the simulator (one Python thread per CUDA thread) stays fast and
# grid-stride loops still take several iterations: (threads_per_block, max_blocks) or None.
launch_override = None

_sm_count = {}


def _grid(n_units_per_block, n_units):
    """(blocks, threads) for ``n_units`` items when one CTA handles ``n_units_per_block``."""
    if launch_override is not None:
        threads, max_blocks = launch_override
    else:
        threads = THREADS_PER_BLOCK
        dev = cuda.get_current_device()
        key = getattr(dev, "id", 0)
        if key not in _sm_count:
            _sm_count[key] = getattr(dev, "MULTIPROCESSOR_COUNT", 1) if not SIMULATOR else 1
        max_blocks = _sm_count[key] * CTAS_PER_SM
    per = n_units_per_block(threads)
    blocks = max(1, min(max_blocks, (n_units + per - 1) // per))
    return blocks, threads


def amax_partials(words, n_chunks, kind, stream, parts):
    """Queue the amax kernel writing ``parts[:blocks]``; returns how many partials it wrote."""
    blocks, threads = _grid(lambda t: t, n_chunks)
    blocks = min(blocks, parts.shape[0])
    amax_kernel(kind)[blocks, threads, stream](words, n_chunks, parts)
    return blocks


def max_partials():
    """Size of the partials buffer the caller allocates for ``amax_partials``."""
    if launch_override is not None:
        return launch_override[1]
    dev = cuda.get_current_device()
    return (getattr(dev, "MULTIPROCESSOR_COUNT", 1) if not SIMULATOR else 1) * CTAS_PER_SM


def quantize(words, codes16, scales, out_words, n_chunks, kb, padded_kb, amax_parts, n_parts,
             amax_value, global_scale, seed, step, *, kind, fmt, stochastic, swizzled, fused,
             stream):
    kern = quantize_kernel(kind, fmt, stochastic, swizzled, fused)
    blocks, threads = _grid(lambda t: t * UNROLL, n_chunks)
    kern[blocks, threads, stream](
        words, codes16, scales, out_words, n_chunks, kb, padded_kb, amax_parts, n_parts,
        np.float32(amax_value), global_scale, np.uint32(seed & 0xFFFFFFFF),
        np.uint32(seed >> 32), np.uint32(step),
    )


def dequantize(codes16, scales, global_scale, out_words, n_chunks, kb, padded_kb, *, out_kind,
               fmt, swizzled, stream):
    kern = dequantize_kernel(out_kind, fmt, swizzled)
    blocks, threads = _grid(lambda t: t, n_chunks)
    kern[blocks, threads, stream](codes16, scales, global_scale, out_words, n_chunks, kb,
                                  padded_kb)
