"""Operand checks shared by both GEMM paths: kind, device, format, shapes, and every field the
GEMM reads.

The native path hands ``data`` and ``scales`` to cuBLASLt as raw pointers, so a hand-built or
modified ``QuantizedTensor`` is checked field by field (dtype, shape, contiguity, device) before
anything reads it: a wrong size would make cuBLASLt read memory the operand does not own.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from fp4_kernels import FORMATS, QuantizedTensor, swizzled_scale_shape

SCALE_LAYOUTS = ("linear", "swizzled")


class OperandKind(NamedTuple):
    lib: str  # "torch" or "numpy"
    cuda: bool
    device: object  # torch.device, or None for numpy

    def where(self) -> str:
        return str(self.device) if self.lib == "torch" else "numpy"


def _torch():
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return None
    return torch


def _kind_of_array(x, name):
    if isinstance(x, np.ndarray):
        return OperandKind("numpy", False, None)
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        if x.is_nested or x.layout != torch.strided or x.device.type == "meta":
            what = "a nested" if x.is_nested else f"a {x.device.type} {x.layout}"
            raise TypeError(
                f"{name}: {what} tensor; fp4_gemm reads the operands' fields as dense arrays "
                "in memory (as quantize() returns them)"
            )
        return OperandKind("torch", x.is_cuda, x.device)
    raise TypeError(
        f"{name}: fp4_gemm takes operands held by torch tensors (CPU or CUDA) or numpy arrays, "
        f"got {type(x).__name__} (CuPy and numba arrays: wrap them with torch.as_tensor)"
    )


def _check_fmt(q, name):
    fmt = q.fmt
    if isinstance(fmt, str) and fmt in FORMATS:
        return
    what = fmt if isinstance(fmt, str) else type(fmt).__name__
    if type(fmt).__name__ == "FP4Quant":
        detail = (
            f"{name} is FP4Quant ({fmt}), a communication codec with one bfloat16 scale per "
            "group and no GEMM kernel"
        )
    else:
        detail = f"{name}.fmt is {what!r}"
    raise ValueError(
        f"{name}: fp4_gemm multiplies NVFP4 or MXFP4 operands; {detail}. Quantize it with "
        "fp4_kernels.quantize(x, fmt='nvfp4') or fmt='mxfp4'"
    )


def _check_field(x, kind, name, dtype, shape):
    """``x``: an array of ``kind`` (library, device), of ``dtype`` and ``shape``, C-contiguous."""
    got_kind = _kind_of_array(x, name)
    if got_kind != kind:
        raise ValueError(
            f"{name}: lives on {got_kind.where()} but the operand's data on {kind.where()}; "
            "keep data, scales and global_scale together (as quantize() returns them)"
        )
    if kind.lib == "numpy":
        ok_dtype = x.dtype == np.dtype(dtype)
    else:
        ok_dtype = x.dtype == getattr(_torch(), dtype)
    if not ok_dtype:
        raise TypeError(f"{name}: dtype {x.dtype}, expected {dtype}")
    got = tuple(int(d) for d in x.shape)
    if got != shape:
        raise ValueError(f"{name}: shape {got}, expected {shape}")
    contiguous = x.flags.c_contiguous if kind.lib == "numpy" else x.is_contiguous()
    if not contiguous:
        raise ValueError(f"{name}: must be C-contiguous (the GEMM reads it as a flat buffer)")


def _check_operand(q, name):
    """The checks of one operand on its own; returns its kind."""
    if not isinstance(q, QuantizedTensor):
        raise TypeError(
            f"{name}: expected an fp4_kernels.QuantizedTensor (from fp4_kernels.quantize), "
            f"got {type(q).__name__}"
        )
    _check_fmt(q, name)
    shape = q.shape
    if not isinstance(shape, tuple) or not all(
        isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise TypeError(f"{name}.shape: expected a tuple of non-negative ints, got {shape!r}")
    if len(shape) != 2:
        raise ValueError(
            f"{name}: fp4_gemm takes 2-D operands, a (M, K) and b (N, K); {name} has shape "
            f"{shape}: reshape leading dimensions into the rows before quantizing"
        )
    rows, k = shape
    block = FORMATS[q.fmt]
    if k % block:
        raise ValueError(
            f"{name}: K={k} is not a multiple of the {q.fmt.upper()} block size {block}"
        )
    if q.scale_layout not in SCALE_LAYOUTS:
        raise ValueError(
            f"{name}.scale_layout: {q.scale_layout!r} is not one of "
            f"{', '.join(map(repr, SCALE_LAYOUTS))}"
        )
    kind = _kind_of_array(q.data, f"{name}.data")
    _check_field(q.data, kind, f"{name}.data", "uint8", (rows, k // 2))
    if q.scale_layout == "swizzled":
        scale_shape = (math.prod(swizzled_scale_shape(rows, k // block)),)
    else:
        scale_shape = (rows, k // block)
    _check_field(q.scales, kind, f"{name}.scales", "uint8", scale_shape)
    if q.global_scale is None:
        if q.fmt == "nvfp4":
            raise ValueError(
                f"{name}.global_scale: NVFP4 needs its tensor decode scale (a one-element "
                "float32 array, as quantize() returns it); got None"
            )
    else:
        _check_field(q.global_scale, kind, f"{name}.global_scale", "float32", (1,))
        if q.fmt == "nvfp4" and not kind.cuda:  # (a GPU value is not read: no sync)
            value = float(np.asarray(q.global_scale.detach().cpu() if kind.lib == "torch"
                                     else q.global_scale).reshape(-1)[0])  # fmt: skip
            if not (math.isfinite(value) and value > 0):
                raise ValueError(
                    f"{name}.global_scale: [{value!r}]; NVFP4's tensor decode scale 1/S is "
                    "positive and finite, as quantize() returns it"
                )
    return kind


def check_operands(a, b) -> OperandKind:
    """The operands' common kind; TypeError / ValueError naming the first bad field."""
    ka, kb = _check_operand(a, "a"), _check_operand(b, "b")
    if ka != kb:
        raise ValueError(
            f"a and b live on different devices or libraries: {ka.where()} vs {kb.where()}"
        )
    if a.fmt != b.fmt:
        raise ValueError(f"a is {a.fmt.upper()} and b is {b.fmt.upper()}; quantize both alike")
    if a.shape[1] != b.shape[1]:
        raise ValueError(
            f"a @ b^T needs the same K: a is {a.shape} (K={a.shape[1]}), "
            f"b is {b.shape} (K={b.shape[1]})"
        )
    return ka
