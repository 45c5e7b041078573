"""``fp4_gemm``: the product ``a @ b^T`` of two FP4-quantized operands.

Two paths compute it:

- **exact** (every device, the CPU included): each operand is decoded without its tensor scale,
  which is exact in bfloat16 (an e2m1 value times an e4m3 or e8m0 scale has at most 6
  significant bits, see ``_exact``), the decoded operands are multiplied with float32
  accumulation, and the two tensor scales are applied to the float32 result as one factor
  ``alpha``, formed and applied in float64 (so it neither overflows nor underflows where the
  result is a normal float32).  The result equals the float64 product of the dequantized
  operands up to float32 accumulation error.
- **native** (compute capability >= 10.0): cuBLASLt's block-scaled FP4 GEMM (``CUDA_R_4F_E2M1``
  operands, ``VEC16_UE4M3`` / ``VEC32_UE8M0`` scales in the swizzled layout, ``alpha`` the
  product of the tensor scales, a float32 as cuBLASLt takes it: tensor amaxes whose product
  is above about 2.5e45 or below about 8e-32 put it out of float32's range, where
  ``backend="exact"`` is right), through nvmath-python's bindings (``_cublaslt``).
"""

from __future__ import annotations

import warnings
from typing import Literal

import numpy as np
import torch

from fp4_kernels import QuantizedTensor

from . import _cublaslt
from ._cublaslt import K_ALIGNMENT, NativeGemmUnavailable, native_supported
from ._exact import exact_gemm
from ._validate import OperandKind, check_operands

BACKENDS = ("auto", "exact", "native")
OUT_DTYPES = ("float32", "bfloat16")


def fp4_gemm(
    a: QuantizedTensor,
    b: QuantizedTensor,
    *,
    out_dtype: Literal["float32", "bfloat16"] = "float32",
    backend: Literal["auto", "exact", "native"] = "auto",
) -> torch.Tensor | np.ndarray:
    """``a @ b^T`` for FP4 ``QuantizedTensor`` operands ``a`` (M, K) and ``b`` (N, K).

    Args:
        a, b: ``fp4_kernels.QuantizedTensor`` of the same format (both NVFP4 or both MXFP4;
            FP4Quant has no GEMM), quantized along K (their last dimension), on the same
            device: torch CUDA tensors, torch CPU tensors or numpy arrays.  K is a multiple of
            the block size (16 for NVFP4, 32 for MXFP4), as quantization guarantees.
        out_dtype: "float32" (default) or "bfloat16" (torch only): the float32 result
            rounded once.
        backend: "exact" (any device), "native" (cuBLASLt FP4 tensor cores, compute capability
            >= 10.0, operands quantized with ``scale_layout="swizzled"``, K a multiple of 32,
            nvmath-python installed: the ``[native]`` extra) or "auto": native where all of
            that holds, else exact.  Where the GPU has FP4 tensor cores but nvmath-python's
            cuBLASLt bindings are missing (or cuBLASLt has no kernel for the shape), "auto"
            warns (RuntimeWarning) and takes the exact path.

    Returns:
        (M, N) of ``out_dtype``, of the operands' kind and device.  On a GPU it is queued on
        torch's current stream; nothing synchronizes with the host.  NaN and infinite operand
        values propagate into the products they take part in, as in any GEMM.

    Raises:
        TypeError / ValueError: operands of another kind, format, shape or device, or a
            ``QuantizedTensor`` field (data, scales, global_scale) of the wrong dtype, shape or
            device; the message names the operand and the field.
        NativeGemmUnavailable: backend="native" where the GPU lacks FP4 tensor cores (the
            message names its compute capability), on CPU operands, or without nvmath-python.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: {backend!r} is not one of {', '.join(map(repr, BACKENDS))}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(
            f"out_dtype: {out_dtype!r} is not one of {', '.join(map(repr, OUT_DTYPES))}"
        )
    kind = check_operands(a, b)
    if out_dtype == "bfloat16" and kind.lib != "torch":
        raise TypeError("out_dtype='bfloat16' needs torch operands (numpy has no bfloat16)")
    if backend == "native":
        return _cublaslt.native_gemm(a, b, out_dtype)
    if backend == "auto" and _auto_takes_native(kind, a, b):
        try:
            return _cublaslt.native_gemm(a, b, out_dtype)
        except NativeGemmUnavailable as e:  # raised before anything is launched
            _warn_fallback(str(e), stacklevel=3)
    return exact_gemm(a, b, out_dtype)


def _auto_takes_native(kind: OperandKind, a: QuantizedTensor, b: QuantizedTensor) -> bool:
    """Whether backend="auto" runs the native GEMM; warns where only nvmath-python is missing."""
    if not kind.cuda or not a.scale_layout == b.scale_layout == "swizzled":
        return False
    if a.shape[1] % K_ALIGNMENT or not _cublaslt.has_fp4_tensor_cores(kind.device):
        return False
    reason = _cublaslt.bindings_unavailable()
    if reason is not None:
        _warn_fallback(reason, stacklevel=4)
        return False
    return True


def _warn_fallback(reason: str, stacklevel: int) -> None:
    # stacklevel: the frame of fp4_gemm's caller
    warnings.warn(
        "fp4_gemm(backend='auto'): this GPU has FP4 tensor cores, but the native FP4 GEMM "
        f"cannot run: {reason}. Using the exact path (the same product within float32 "
        "accumulation error, slower).",
        RuntimeWarning,
        stacklevel=stacklevel,
    )


__all__ = ["BACKENDS", "NativeGemmUnavailable", "fp4_gemm", "native_supported"]
