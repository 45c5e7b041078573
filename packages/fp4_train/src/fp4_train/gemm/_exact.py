"""The exact FP4 GEMM path: decode without the tensor scales, multiply, scale once.

Why exact: an e2m1 value (0, 0.5, 1, 1.5, 2, 3, 4 or 6: at most 2 significant bits) times an
e4m3 scale (at most 4 significant bits, 2^-9 .. 448) has at most 6 significant bits and lies in
[2^-10, 2688], so it is exact in bfloat16 (8 significant bits, normal down to 2^-126).  MXFP4's
e2m1 x 2^e, e in [-127, 127], is exact too (bfloat16 subnormals reach 2^-133), except where it
overflows (6 x 2^127): such a block overflows the float32 dequantization as well.  The NVFP4
tensor scale (an arbitrary float32) is what would make the decoded values inexact, so it is
left out of the operands and applied once to the float32 result: ``alpha = gs_a * gs_b``.

alpha is formed in float64, where the product of two float32 numbers is exact (48 significant
bits) and cannot overflow or underflow: in float32 it would be inf for amax_a * amax_b above
about 2.5e45, and a subnormal (a few significant bits) below about 8e-32, while ``alpha * acc``
may lie well inside float32's range.  ``alpha * acc`` is computed in float64 too and rounded
once to float32.  Every product of two decoded elements (at most 12 significant bits) is exact
in float32, so the only roundings are the float32 accumulation over K and that last one.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import fp4_kernels


def _without_tensor_scale(q, lib):
    """``q`` with its tensor scale replaced by 1 (a one-element array where q's lives).

    MXFP4 has no tensor scale (``dequantize`` ignores the field, which may be None)."""
    if q.fmt != "nvfp4" or q.global_scale is None:
        return q
    if lib == "torch":
        import torch

        ones = torch.ones_like(q.global_scale)
    else:
        ones = np.ones_like(q.global_scale)
    return dataclasses.replace(q, global_scale=ones)


def exact_gemm(a, b, out_dtype):
    """``a @ b^T`` by the exact path; operands already checked by ``check_operands``."""
    if isinstance(a.data, np.ndarray):
        return _exact_numpy(a, b)
    import torch

    if not a.data.is_cuda:
        return _exact_torch_cpu(a, b, out_dtype)
    a1 = fp4_kernels.dequantize(_without_tensor_scale(a, "torch"), dtype=torch.bfloat16)
    b1 = fp4_kernels.dequantize(_without_tensor_scale(b, "torch"), dtype=torch.bfloat16)
    # bf16 operands, float32 accumulation and a float32 result (no bfloat16 rounding of the
    # partial sums or of the result before alpha is applied).
    try:
        acc = torch.mm(a1, b1.t(), out_dtype=torch.float32)
    except TypeError:  # a torch without mm's out_dtype (before 2.8): a float32 GEMM of the
        # same decoded values, exact in float32 and in TF32 (11 significant bits >= 6) alike
        acc = torch.mm(a1.float(), b1.float().t())
    if a.fmt == "nvfp4":
        _scale(acc, a, b)
    return acc if out_dtype == "float32" else acc.to(torch.bfloat16)


def _alpha64(a, b):
    """gs_a * gs_b in float64 (exact; see the module docstring), where the scales live: a
    one-element tensor on the device (no host synchronization) or a numpy float64."""
    if isinstance(a.global_scale, np.ndarray):
        return np.float64(a.global_scale[0]) * np.float64(b.global_scale[0])
    return a.global_scale.double().mul_(b.global_scale)


def _scale(acc, a, b):
    """acc *= gs_a * gs_b in place, computed in float64 and rounded once to float32."""
    alpha = _alpha64(a, b)
    if isinstance(acc, np.ndarray):
        np.multiply(acc, alpha, out=acc, casting="same_kind")  # float64 loop, float32 out
    else:
        # a float32 (M, N) tensor times a float64 one-element (not 0-d) tensor: torch's type
        # promotion computes in float64 and casts the result to acc's float32
        acc.mul_(alpha)


def _exact_torch_cpu(a, b, out_dtype):
    import torch

    # The decoded values are exact in float32 too, and a float32 matmul accumulates in float32:
    # the same arithmetic as the GPU's bf16 x bf16 -> float32 GEMM up to summation order.
    a1 = fp4_kernels.dequantize(_without_tensor_scale(a, "torch"), dtype=torch.float32)
    b1 = fp4_kernels.dequantize(_without_tensor_scale(b, "torch"), dtype=torch.float32)
    out = a1 @ b1.t()
    if a.fmt == "nvfp4":
        _scale(out, a, b)
    return out if out_dtype == "float32" else out.to(torch.bfloat16)


def _exact_numpy(a, b):
    a1 = fp4_kernels.dequantize(_without_tensor_scale(a, "numpy"), dtype=np.float32)
    b1 = fp4_kernels.dequantize(_without_tensor_scale(b, "numpy"), dtype=np.float32)
    out = a1 @ b1.T
    if a.fmt == "nvfp4":
        _scale(out, a, b)
    return out
