"""The launch executor: a kernel, its grid and its arguments, queued on the caller's stream.

No host synchronization anywhere on this path.  On a real GPU a kernel is compiled once per
signature and launched straight through ``cuda.core.launch`` with numba's argument layout
(``fp4_kernels._numba_abi``); in the simulator numba's own dispatcher runs it.

Each op's host function reads its launch from the launch table (``launch_table.LAUNCHES``: the
threads a CTA, what a thread takes a pass, the caps) and the launch policy in force
(``launch_policy``), which overrides the table for the calls inside it.
"""

from __future__ import annotations

from .. import _numba_abi as abi
from ._primitives import SIMULATOR
from .launch_table import DEFAULT_POLICY, POLICY, LaunchPolicy, launch_policy

__all__ = ["LaunchPolicy", "current_policy", "launch", "launch_policy"]


def current_policy() -> LaunchPolicy:
    """The launch policy in force (``launch_policy``), or the table's choice."""
    return POLICY.get() or DEFAULT_POLICY


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
    """Queue ``kernel`` on the caller's stream (``ctx.submit``, on ``ctx.device_id``, the
    device the host wrapper made current); ``args`` are DeviceBuffers (GPU) or numba arrays
    (simulator) and numpy scalars.  Returns the number of CTAs launched: on a GPU the grid is
    capped at the CTAs that can be resident at once (occupancy API).

    ``threads_per_sm``: the resident threads an SM the kernel is meant to run with; its
    shared-memory carveout is then sized for that many threads' CTAs and the rest of the SM's
    unified L1 / shared memory stays L1 (the occupancy, and so the grid, follow).  None: the
    driver's choice, which maximizes resident CTAs.  A launch policy's ``threads_per_sm``
    overrides it."""
    if SIMULATOR:
        kernel[blocks, threads, ctx.stream](*args)
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
    ctx.submit(launcher, blocks, threads, args)  # queued, or recorded into a plan (``_plans``)
    return blocks


def max_blocks(default_per_sm, device_id):
    """The largest grid an op with a partials buffer may launch (its size)."""
    cap = current_policy().max_blocks
    return cap if cap is not None else sm_count(device_id) * default_per_sm
