"""The caller's GPU made numba's current device for a call, and moving small arrays to the
host."""

from __future__ import annotations

import threading


def to_numpy(a):
    """A numpy array of a torch tensor (copied to the host if it is on a GPU) or ``a`` itself."""
    if hasattr(a, "detach"):
        return a.detach().cpu().numpy()
    return a


def fill_one(gs, ctx):
    ctx.fill(gs, 1.0)


_GPU_COUNT = []


_THREAD = threading.local()  # .bound: the devices whose context this thread has made current


def needs_scope(device_id):
    """Whether a call on ``device_id`` must enter ``on_device`` (the first call on a thread, or
    a process with several GPUs)."""
    return not _GPU_COUNT or _GPU_COUNT[0] > 1 or device_id not in getattr(_THREAD, "bound", ())


class on_device:
    """Make the input's GPU numba's current device for the duration of the call (a no-op on a
    one-GPU process, which skips the context query on the hot path).

    The first call on a thread binds the device's primary context (the one torch, CuPy and
    numba share) to that thread: a thread that only ever used the runtime API through torch,
    such as the autograd engine's backward thread, may have none, and the kernels launch
    through the driver API."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.cm = None

    def __enter__(self):
        if self.ctx.device_id is None or self.ctx.simulator:
            return
        from numba import cuda

        bound = getattr(_THREAD, "bound", None)
        if bound is None:
            bound = _THREAD.bound = set()
        if self.ctx.device_id not in bound:
            from cuda.core import Device

            Device(self.ctx.device_id).set_current()
            bound.add(self.ctx.device_id)
        if not _GPU_COUNT:
            _GPU_COUNT.append(len(cuda.gpus))
        if _GPU_COUNT[0] > 1 and cuda.get_current_device().id != self.ctx.device_id:
            self.cm = cuda.gpus[self.ctx.device_id]
            self.cm.__enter__()

    def __exit__(self, *exc):
        if self.cm is not None:
            self.cm.__exit__(*exc)
