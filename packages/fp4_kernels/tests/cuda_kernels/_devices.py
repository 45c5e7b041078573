"""GPU array kinds the kernel tests feed: numba device arrays everywhere (the simulator has only
those); torch CUDA tensors and CuPy arrays on a real GPU when installed."""

import ml_dtypes
import numpy as np
from numba import cuda

NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def available_kinds(real_gpu):
    kinds = ["numba"]
    if real_gpu:
        try:
            import torch

            if torch.cuda.is_available():
                kinds.append("torch")
        except ImportError:
            pass
        try:
            import cupy  # noqa: F401

            kinds.append("cupy")
        except ImportError:
            pass
    return kinds


def to_gpu(x, kind):
    """numpy (float32 / ml_dtypes.bfloat16 / float16) -> a GPU array of ``kind``.

    Skips the test for bfloat16 where the array library has none: CuPy, and numba device
    arrays on a real GPU (numba cannot export ml_dtypes' bfloat16 to a buffer); the simulator's
    numba arrays wrap numpy and take it.
    """
    import pytest
    from numba import config

    if np.dtype(x.dtype).name == "bfloat16" and (
        kind == "cupy" or (kind == "numba" and not config.ENABLE_CUDASIM)
    ):
        pytest.skip(f"{kind} arrays have no bfloat16 on a real GPU (torch covers bfloat16)")
    if kind == "numba":
        return cuda.to_device(x)
    if kind == "torch":
        import torch

        raw = torch.from_numpy(x.view(np.int32 if x.itemsize == 4 else np.int16).copy())
        dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        return raw.cuda().view(dt[np.dtype(x.dtype).name])
    import cupy

    return cupy.asarray(x)


def to_host(a):
    """Any GPU array (or numpy) -> numpy with the same bits."""
    if isinstance(a, np.ndarray):
        return a
    if hasattr(a, "copy_to_host"):
        return a.copy_to_host()
    if hasattr(a, "cpu"):  # torch
        import torch

        name = str(a.dtype).replace("torch.", "")
        if name in NP_DTYPES:
            raw = a.view(torch.int32 if a.element_size() == 4 else torch.int16)
            return raw.cpu().numpy().view(NP_DTYPES[name])
        return a.cpu().numpy()
    return a.get()  # cupy


def use_network_variant(monkeypatch, variant):
    """Run the butterfly network ``variant`` (``FP4_HADAMARD_VARIANT``) from here on: the
    variable is read when a kind of torch call is planned, so the plans made before are
    forgotten too (else a later variant's torch calls would run the earlier one's kernels)."""
    from fp4_kernels import _plans

    monkeypatch.setenv("FP4_HADAMARD_VARIANT", variant)
    _plans.clear()
