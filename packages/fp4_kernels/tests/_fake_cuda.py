"""The host side of a torch CUDA call, driven on a machine without a GPU.

``fake_cuda()`` makes every torch tensor but a meta tensor (which has no memory) report itself
as living on ``cuda:0`` (its memory stays in host RAM), turns CUDA allocations into CPU ones,
compiles no kernel and records each ``cuLaunchKernel`` instead of queuing it: what
``quantize(x)`` does on the host for a torch CUDA tensor (checks, plans, allocation, argument
packing) runs as on a GPU machine, and the launches it would queue can be compared.  Nothing
reads or writes the outputs' memory.

Used by the host-path tests and ``benchmarks/host_overhead.py``.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools

import numba
import numpy as np
import torch

from fp4_kernels import _numba_abi as abi, _plans

# (_primitives imported here: its device helpers built for the tier in force, before the fake
# turns the simulator's flag off)
from fp4_kernels.cuda import _primitives, launch  # noqa: F401

CUDA0 = torch.device("cuda", 0)
META = torch.device("meta")
SM_COUNT = 132


class FakeKernel:
    """What ``compile_kernel`` returns: a handle and the parameter table of the signature."""

    _handles = itertools.count(0x1000)

    def __init__(self, kernel, argtypes):
        self.kernel = kernel
        self.handle = next(self._handles)
        dummies = []
        # the parameter slots that hold an array's data pointer (numba's ABI: ARRAY_FIELDS)
        self.pointer_slots = set()
        slot = 0
        for t in argtypes:
            if hasattr(t, "ndim"):  # an array type: a DeviceBuffer of its dtype
                dummies.append(launch.DeviceBuffer(0, 0, np.dtype(str(t.dtype))))
                self.pointer_slots.add(slot + abi.ARRAY_FIELDS.index("data"))
                slot += len(abi.ARRAY_FIELDS)
            else:
                dummies.append(np.dtype(str(t)).type(0))
                slot += 1
        self.layout = launch.parameter_layout(dummies)
        self.arguments_info = self.layout[1]
        self.occupancy = self

    def max_active_blocks_per_multiprocessor(self, threads, smem):
        return max(1, 2048 // threads)


class Pointer(int):
    """A launch value that is an array's data pointer (what the kernel's signature says, not
    its magnitude: host allocations can sit below 4 GiB)."""


class Recorder:
    """The launches queued while it is installed: (kernel, blocks, threads, stream, values);
    with ``keep=False`` they are dropped (the cost of a no-op launch only)."""

    def __init__(self, keep=True):
        self.keep = keep
        self.launches = []
        self.kernels = {}
        self.carveouts = {}  # kernel -> CTAs an SM its carveout is sized for (None: driver)
        self.device_id = 0  # the device of "numba's current context" (launch.current_device_id)

    def stream(self, device):
        """torch's current stream on ``device``: a fake handle naming the device."""
        return 0x5713EA00 + device

    def compile(self, kernel, argtypes):
        k = FakeKernel(kernel, list(argtypes))
        self.kernels[k.handle] = k
        return k

    def set_carveout(self, cu_kernel, device_id, ctas_per_sm):
        """The shared-memory carveout a kernel asks for: recorded as the CTAs it is sized for."""
        self.carveouts[cu_kernel.kernel] = ctas_per_sm
        return ctas_per_sm

    def cu_launch(self, function, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        if not self.keep:
            return 0
        k = self.kernels[function]
        fmt, layout = k.layout
        values = []
        for i, (_, size) in enumerate(layout):
            code = {8: ctypes.c_uint64, 4: ctypes.c_uint32}[size]
            raw = code.from_address(params[i]).value
            values.append(Pointer(raw) if i in k.pointer_slots else raw)
        self.launches.append((k.kernel, gx, bx, stream, tuple(values)))
        return 0


@contextlib.contextmanager
def fake_cuda(recorder=None):
    """Torch tensors on a pretend ``cuda:0``; launches recorded by ``recorder`` (or dropped)."""
    recorder = recorder or Recorder()
    saved = []

    def patch(obj, name, value):
        saved.append((obj, name, vars(obj).get(name, _MISSING)))
        setattr(obj, name, value)

    real_empty, real_zeros, real_full = torch.empty, torch.zeros, torch.full
    real_to = torch.Tensor.to

    def empty(*shape, device=None, **kw):
        return real_empty(*shape, **kw)

    def zeros(*shape, device=None, **kw):
        return real_zeros(*shape, **kw)

    def full(*args, device=None, **kw):
        return real_full(*args, **kw)

    def to(self, *a, **kw):
        if a and isinstance(a[0], torch.device) and a[0].type == "cuda":
            return self
        return real_to(self, *a, **kw)

    patch(torch.Tensor, "is_cuda", property(lambda self: not self.is_meta))
    patch(
        torch.Tensor,
        "device",
        property(lambda self: META if self.is_meta else getattr(self, "fake_device", CUDA0)),
    )
    patch(torch.Tensor, "to", to)
    patch(torch, "empty", empty)
    patch(torch, "zeros", zeros)
    patch(torch, "full", full)
    patch(torch._C, "_cuda_getCurrentRawStream", recorder.stream)
    patch(abi, "compile_kernel", recorder.compile)
    patch(abi, "set_carveout", recorder.set_carveout)
    patch(launch, "current_device_id", lambda: recorder.device_id)
    # the simulator tier too: the launcher, not numba's simulated dispatcher, takes the launches
    patch(launch, "SIMULATOR", False)
    patch(numba.config, "ENABLE_CUDASIM", 0)
    patch(launch, "_libcuda", recorder.cu_launch)
    # the caches of device state and device arrays: the fake's own while it runs (on a GPU
    # machine the real ones hold real launchers and device pointers, restored afterwards)
    caches = [
        (launch, "_sm_count"), (launch, "_compiled"), (launch, "_resident"), (launch, "_carveout"),
        (launch, "CONSTANTS"), (_plans, "_PLANS"), (_plans, "_SEEN"), (_plans, "_KINDS"),
    ]  # fmt: skip
    saved_caches = [(obj, name, getattr(obj, name)) for obj, name in caches]
    for obj, name, value in saved_caches:
        setattr(obj, name, type(value)())
    launch._sm_count.update({None: SM_COUNT, 0: SM_COUNT, 1: SM_COUNT})
    saved_gpu_count = list(_plans._GPU_COUNT)
    saved_bound = getattr(_plans._THREAD, "bound", None)
    _plans._GPU_COUNT[:] = [1]
    _plans._THREAD.bound = {0, 1}
    launch.init_torch_tables()
    try:
        yield recorder
    finally:
        for obj, name, value in reversed(saved):
            if value is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, value)
        for obj, name, value in saved_caches:
            setattr(obj, name, value)
        _plans._GPU_COUNT[:] = saved_gpu_count
        if saved_bound is None:
            del _plans._THREAD.bound
        else:
            _plans._THREAD.bound = saved_bound


_MISSING = object()


def call_path(f):
    """(Python function calls, the package's source files) of one call of ``f`` (a function of
    no arguments that makes the call): what runs on the host between the public function and
    ``cuLaunchKernel``, counted by cProfile, builtins and C methods and the fake's own functions
    left out.  The garbage collector is off meanwhile: a collection that happened to fall in
    the call would count the finalizers and weakref callbacks of other tests' objects."""
    import cProfile
    import gc
    import os
    import pstats

    import fp4_kernels

    root = os.path.dirname(os.path.abspath(fp4_kernels.__file__)) + os.sep
    prof = cProfile.Profile()
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        prof.enable()
        f()
        prof.disable()
    finally:
        if enabled:
            gc.enable()
    calls, files = 0, set()
    for (file, _, _), (_, ncalls, *_) in pstats.Stats(prof).stats.items():
        if file == "~" or file == __file__:
            continue
        calls += ncalls
        if os.path.abspath(file).startswith(root):
            files.add(os.path.relpath(file, root).replace(os.sep, "/"))
    return calls - 1, sorted(files)  # f itself aside
