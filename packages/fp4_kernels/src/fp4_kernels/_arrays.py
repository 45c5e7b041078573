"""Array kinds in and out: numpy / torch CPU run on the CPU; torch CUDA, CuPy and numba device
arrays run on the GPU, zero-copy, on the caller's current stream, with no host synchronization.

Everything the kernels see is a flat view of raw bits (uint64 words on the GPU, uint16/uint32
elements on the CPU), so bfloat16 needs no support from the array library beyond a bit view.
Here: the dtypes, ``Backend`` and the CPU side; an argument's checks (``backend_of``, ...) are
in ``_calls``, the GPU side (``GpuContext``) in ``cuda.launch``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from ._scalar import KIND_BF16, KIND_F16, KIND_F32

DTYPES = ("float32", "bfloat16", "float16")
KIND_OF_DTYPE = {"float32": KIND_F32, "bfloat16": KIND_BF16, "float16": KIND_F16}
BITS_DTYPE = {"float32": np.uint32, "bfloat16": np.uint16, "float16": np.uint16}


@dataclass(frozen=True)
class Backend:
    """Where an array lives and how to make more like it."""

    lib: str  # "numpy" | "torch" | "cupy" | "numba"
    gpu: bool
    device: object = None  # torch.device, cupy device id or numba device id


def _torch():
    return sys.modules.get("torch")


# ---------------------------------------------------------------------- CPU side


def to_numpy(a):
    """A numpy array of a torch tensor (copied to the host if it is on a GPU; bfloat16 as
    ml_dtypes' bfloat16, which torch's ``numpy()`` refuses) or ``a`` itself."""
    if hasattr(a, "detach"):
        t = a.detach().cpu()
        if t.dtype == _torch().bfloat16:
            return t.view(_torch().int16).numpy().view(numpy_dtype("bfloat16"))
        return t.numpy()
    return a


def cpu_bits(x, dt):
    """Flat numpy view of the raw bits of a numpy array or torch CPU tensor (no copy)."""
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        x = x.detach().reshape(-1).view(torch.int32 if dt == "float32" else torch.int16).numpy()
    return x.reshape(-1).view(BITS_DTYPE[dt])


def numpy_dtype(dt):
    if dt == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dt)


def cpu_from_bits(bits, dt, shape, backend):
    """Wrap raw bits as an array of dtype ``dt`` and ``shape`` of the given backend (no copy)."""
    if backend.lib == "torch":
        torch = _torch()
        t = torch.from_numpy(bits.view(np.int32 if dt == "float32" else np.int16))
        return t.view(getattr(torch, dt)).reshape(shape)
    if dt == "bfloat16":
        return bits.view(numpy_dtype(dt)).reshape(shape)
    return bits.view(dt).reshape(shape)


def wrap_cpu(arr, backend):
    """Hand a numpy buffer back as the caller's kind (torch CPU -> torch tensor, no copy)."""
    if backend.lib == "torch":
        return _torch().from_numpy(arr)
    return arr
