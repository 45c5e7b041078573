"""Operand checks shared by both GEMM paths: kind, device, format, shapes."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from fp4_kernels import FORMATS, QuantizedTensor


class OperandKind(NamedTuple):
    lib: str  # "torch" or "numpy"
    cuda: bool
    device: object  # torch.device, or None for numpy


def _kind(q, name):
    if not isinstance(q, QuantizedTensor):
        raise TypeError(
            f"{name}: expected an fp4_kernels.QuantizedTensor (from fp4_kernels.quantize), "
            f"got {type(q).__name__}"
        )
    if isinstance(q.data, np.ndarray):
        return OperandKind("numpy", False, None)
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        torch = None
    if torch is not None and isinstance(q.data, torch.Tensor):
        return OperandKind("torch", q.data.is_cuda, q.data.device)
    raise TypeError(
        f"{name}: fp4_gemm takes operands held by torch tensors (CPU or CUDA) or numpy arrays, "
        f"got {type(q.data).__name__} (CuPy and numba arrays: wrap them with torch.as_tensor)"
    )


def check_operands(a, b):
    """The operands' common kind; TypeError / ValueError naming the first mismatch."""
    ka, kb = _kind(a, "a"), _kind(b, "b")
    if ka != kb:
        where_a = ka.device if ka.lib == "torch" else "numpy"
        where_b = kb.device if kb.lib == "torch" else "numpy"
        raise ValueError(f"a and b live on different devices or libraries: {where_a} vs {where_b}")
    if a.fmt != b.fmt:
        raise ValueError(f"a is {a.fmt.upper()} and b is {b.fmt.upper()}; quantize both alike")
    if a.fmt not in FORMATS:
        raise ValueError(f"a.fmt: {a.fmt!r} is not one of {', '.join(map(repr, FORMATS))}")
    if len(a.shape) != 2 or len(b.shape) != 2:
        raise ValueError(
            f"a and b must be 2-D (M, K) and (N, K), got {a.shape} and {b.shape}; "
            "reshape leading dimensions into M first"
        )
    if a.shape[1] != b.shape[1]:
        raise ValueError(
            f"a @ b^T needs the same K: a is {a.shape} (K={a.shape[1]}), "
            f"b is {b.shape} (K={b.shape[1]})"
        )
    block = FORMATS[a.fmt]
    if a.shape[1] % block:
        raise ValueError(
            f"K={a.shape[1]} is not a multiple of the {a.fmt.upper()} block size {block}"
        )
    return ka
