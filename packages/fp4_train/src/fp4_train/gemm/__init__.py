"""``fp4_gemm``: the product ``a @ b^T`` of two FP4-quantized operands.

Two paths compute it:

- **exact** (every device, the CPU included): each operand is decoded without its tensor scale,
  which is exact in bfloat16 (an e2m1 value times an e4m3 or e8m0 scale has at most 6
  significant bits, see ``_exact``), the decoded operands are multiplied with float32
  accumulation, and the two tensor scales are applied to the float32 result as one factor
  ``alpha``.  The result equals the float64 product of the dequantized operands up to float32
  accumulation error.
- **native** (compute capability >= 10.0): cuBLASLt's block-scaled FP4 GEMM (``CUDA_R_4F_E2M1``
  operands, ``VEC16_UE4M3`` / ``VEC32_UE8M0`` scales in the swizzled layout, ``alpha`` the
  product of the tensor scales), through nvmath-python's bindings (``_cublaslt``).
"""

from __future__ import annotations

from ._cublaslt import NativeGemmUnavailable, native_supported
from ._exact import exact_gemm
from ._validate import check_operands

BACKENDS = ("auto", "exact", "native")
OUT_DTYPES = ("float32", "bfloat16")


def fp4_gemm(a, b, *, out_dtype="float32", backend="auto"):
    """``a @ b^T`` for FP4 ``QuantizedTensor`` operands ``a`` (M, K) and ``b`` (N, K).

    Args:
        a, b: ``fp4_kernels.QuantizedTensor`` of the same format (both NVFP4 or both MXFP4),
            quantized along K (their last dimension), on the same device: torch CUDA tensors,
            torch CPU tensors or numpy arrays.  K is a multiple of the block size (16 for NVFP4,
            32 for MXFP4), as quantization guarantees.
        out_dtype: "float32" (default) or "bfloat16" (torch only): the float32 result
            rounded once.
        backend: "exact" (any device), "native" (cuBLASLt FP4 tensor cores, compute capability
            >= 10.0, operands quantized with ``scale_layout="swizzled"``) or "auto" (native
            where the device has it and the scales are swizzled, else exact).

    Returns:
        (M, N) of ``out_dtype``, of the operands' kind and device.  On a GPU it is queued on
        torch's current stream; nothing synchronizes with the host.

    Raises:
        TypeError / ValueError: operands of another kind, format, shape or device.
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
    if backend == "native" or (
        backend == "auto"
        and kind.cuda
        and a.scale_layout == b.scale_layout == "swizzled"
        and native_supported(a.data.device)
    ):
        from ._cublaslt import native_gemm

        return native_gemm(a, b, out_dtype)
    return exact_gemm(a, b, out_dtype)


__all__ = ["BACKENDS", "NativeGemmUnavailable", "fp4_gemm", "native_supported"]
