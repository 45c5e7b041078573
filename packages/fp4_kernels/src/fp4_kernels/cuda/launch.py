"""The launch executor: a kernel, its grid and its arguments, queued on the caller's stream.

No host synchronization anywhere on this path.  On a real GPU a kernel is compiled once per
signature and launched straight through ``cuda.core.launch`` with numba's argument layout
(``fp4_kernels._numba_abi``); in the simulator numba's own dispatcher runs it.

Every op module states its launch in one line of the table below; the grid is
``ceil(work items / (threads * items per thread))`` CTAs, capped at one resident wave (the
kernels are grid-stride loops, so a persistent grid does the same work without a partly filled
last wave), and for the transform's prefetching kernels at 512 threads an SM (4 CTAs of 128
below g = 2048; fewer warps with loads in flight run faster there:
``hadamard.PREFETCH_THREADS_PER_SM``); from g = 2048, where a CTA is one group, their
shared-memory carveout is also sized for 512 threads an SM (384 at g = 2048:
``hadamard.prefetch_threads_per_sm``; ``launch``'s ``threads_per_sm``), which leaves the rest
of the SM to L1.

    op (module)                          threads / CTA         work item, per thread
    quantize, dequantize (quantize.py,   256                   1 scale block (16 / 32 elem.)
      dequantize.py), requantized_sum
    amax (amax.py)                       256                   4 16-byte loads
    hadamard, fp4quant (hadamard.py,     256 (128 for the      32 elements (a CTA is one
      fp4quant.py)                       prefetching kernels,  group for g >= 2048)
                                         g 32..1024);
                                         32 * g / 1024 for
                                         g >= 2048

``launch_policy(threads=..., max_blocks=..., threads_per_sm=...)`` overrides the table for the
calls inside it (the simulator tests use small CTAs and grids so that grid-stride loops iterate
and warps cross; ``benchmarks/launch_sweep.py`` sweeps the grid and the carveout).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

from .. import _numba_abi as abi
from ._primitives import SIMULATOR

THREADS_PER_BLOCK = 256


@dataclass(frozen=True)
class LaunchPolicy:
    """Threads per CTA, a cap on the number of CTAs, the threads that share an NVFP4 / MXFP4
    block in the quantizer and the resident threads an SM every kernel's shared-memory
    carveout is sized for (0: the driver's choice); ``None`` keeps the table's choice."""

    threads: int | None = None
    max_blocks: int | None = None
    lanes_per_block: int | None = None
    threads_per_sm: int | None = None


_DEFAULT_POLICY = LaunchPolicy()
_POLICY = contextvars.ContextVar("fp4_kernels_launch_policy", default=None)


@contextlib.contextmanager
def launch_policy(threads=None, max_blocks=None, lanes_per_block=None, threads_per_sm=None):
    """Launch every kernel queued inside the block with ``threads`` per CTA (a multiple of 32),
    at most ``max_blocks`` CTAs, ``lanes_per_block`` threads sharing a quantizer block (1
    or 2 for NVFP4; 1, 2 or 4 for MXFP4) and a shared-memory carveout sized for
    ``threads_per_sm`` resident threads an SM (0: the driver's choice, which fits the most
    CTAs).  Results do not depend on it; speed does."""
    if threads is not None and (threads <= 0 or threads % 32):
        raise ValueError(f"threads: {threads} is not a positive multiple of 32")
    if lanes_per_block not in (None, 1, 2, 4):
        raise ValueError(f"lanes_per_block: {lanes_per_block} is not 1, 2 or 4")
    if threads_per_sm is not None and threads_per_sm < 0:
        raise ValueError(f"threads_per_sm: {threads_per_sm} is negative (0: the driver's choice)")
    token = _POLICY.set(LaunchPolicy(threads, max_blocks, lanes_per_block, threads_per_sm))
    try:
        yield
    finally:
        _POLICY.reset(token)


def current_policy() -> LaunchPolicy:
    return _POLICY.get() or _DEFAULT_POLICY


_sm_count = {}


def sm_count(device_id):
    n = _sm_count.get(device_id)
    if n is None:
        from numba import cuda

        n = 1 if SIMULATOR else cuda.get_current_device().MULTIPROCESSOR_COUNT
        _sm_count[device_id] = n
    return n


def threads_for(default):
    """The CTA size: the policy's if it sets one, else the op's ``default``."""
    threads = current_policy().threads
    return default if threads is None else threads


def grid_for(work_items, per_cta):
    """CTAs for ``work_items`` when one CTA takes ``per_cta`` of them per pass (>= 1)."""
    blocks = max(1, -(-work_items // per_cta))
    cap = current_policy().max_blocks
    return blocks if cap is None else min(blocks, cap)


_compiled = {}  # (kernel, device, argument dtypes) -> PackedLauncher
_resident = {}  # (that key, threads, resident threads an SM) -> CTAs resident at once
_carveout = {}  # that key -> the CTAs an SM its shared-memory carveout is sized for (None: driver)


def current_device_id():
    """The device of numba's current CUDA context: a kernel handle (``CUfunction``) belongs to
    one context, so compiled launchers and occupancy are kept per device."""
    from numba import cuda

    return cuda.current_context().device.id


def launch(kernel, blocks, threads, ctx, args, threads_per_sm=None):
    """Queue ``kernel`` on the caller's stream (``ctx.stream``, on ``ctx.device_id``, the
    device the host wrapper made current); ``args`` are DeviceBuffers (GPU) or numba arrays
    (simulator) and numpy scalars.  Returns the number of CTAs launched: on a GPU the grid is
    capped at the CTAs that can be resident at once (occupancy API).

    ``threads_per_sm``: the resident threads an SM the kernel is meant to run with; its
    shared-memory carveout is then sized for that many threads' CTAs and the rest of the SM's
    unified L1 / shared memory stays L1 (the occupancy, and so the grid, follow).  None: the
    driver's choice, which maximizes resident CTAs.  A launch policy's ``threads_per_sm``
    overrides it."""
    stream = ctx.stream
    if SIMULATOR:
        kernel[blocks, threads, stream](*args)
        return blocks
    device = ctx.device_id
    if device is None:  # numba device arrays: the current context's device
        device = current_device_id()
    key = (kernel, device, tuple(a.dtype for a in args))
    launcher = _compiled.get(key)
    if launcher is None:
        cu_kernel = abi.compile_kernel(kernel, map(abi.numba_type, args))
        launcher = _compiled[key] = abi.PackedLauncher(cu_kernel, args)
        launcher.cu_kernel = cu_kernel
    forced = current_policy().threads_per_sm
    if forced is not None:
        threads_per_sm = forced or None
    ctas_per_sm = None if threads_per_sm is None else max(1, threads_per_sm // threads)
    if _carveout.get(key) != ctas_per_sm:  # a function attribute: follows the latest launch
        abi.set_carveout(launcher.cu_kernel, device, ctas_per_sm)
        _carveout[key] = ctas_per_sm
    resident = _resident.get((key, threads, ctas_per_sm))
    if resident is None:
        per_sm = launcher.cu_kernel.occupancy.max_active_blocks_per_multiprocessor(threads, 0)
        resident = _resident[(key, threads, ctas_per_sm)] = max(1, per_sm) * sm_count(device)
    blocks = min(blocks, resident)
    record = getattr(stream, "record", None)
    if record is not None:  # a plan being recorded (``fp4_kernels._plans``): not queued
        record(launcher, blocks, threads, args)
    else:
        launcher(stream.ptr, blocks, threads, args)
    return blocks


def max_blocks(default_per_sm, device_id):
    """The largest grid an op with a partials buffer may launch (its size)."""
    cap = current_policy().max_blocks
    return cap if cap is not None else sm_count(device_id) * default_per_sm
