"""fp4_gemm's dispatch and its errors for bad operands."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import fp4_kernels
from fp4_train.gemm import NativeGemmUnavailable, fp4_gemm


def _q(rows, k, fmt="nvfp4", lib="torch", layout="linear"):
    x = np.random.default_rng(rows * k).standard_normal((rows, k)).astype(np.float32)
    return fp4_kernels.quantize(
        torch.from_numpy(x) if lib == "torch" else x, fmt=fmt, scale_layout=layout
    )


def test_mismatched_k_is_rejected():
    with pytest.raises(ValueError, match="same K"):
        fp4_gemm(_q(4, 32), _q(4, 64))


def test_mixed_formats_are_rejected():
    with pytest.raises(ValueError, match="NVFP4 and b is MXFP4"):
        fp4_gemm(_q(4, 64), _q(4, 64, fmt="mxfp4"))


def test_mixed_libraries_are_rejected():
    with pytest.raises(ValueError, match="different devices"):
        fp4_gemm(_q(4, 64), _q(4, 64, lib="numpy"))


def test_non_quantized_operand_is_rejected():
    with pytest.raises(TypeError, match="QuantizedTensor"):
        fp4_gemm(torch.ones(4, 64), _q(4, 64))


def test_three_dimensional_operand_is_rejected():
    x = torch.ones(2, 3, 64)
    with pytest.raises(ValueError, match="2-D"):
        fp4_gemm(fp4_kernels.quantize(x), _q(4, 64))


def test_k_not_a_multiple_of_the_block_is_rejected():
    # quantize() cannot produce one; a hand-made QuantizedTensor can
    q = _q(4, 32)
    bad = dataclasses.replace(q, shape=(4, 24), data=q.data[:, :12])
    with pytest.raises(ValueError, match="multiple of the NVFP4 block size 16"):
        fp4_gemm(bad, bad)


def test_bfloat16_output_needs_torch():
    with pytest.raises(TypeError, match="numpy has no bfloat16"):
        fp4_gemm(_q(4, 64, lib="numpy"), _q(4, 64, lib="numpy"), out_dtype="bfloat16")


@pytest.mark.parametrize("kw", [{"backend": "cutlass"}, {"out_dtype": "float16"}])
def test_unknown_options_are_rejected(kw):
    with pytest.raises(ValueError, match="is not one of"):
        fp4_gemm(_q(4, 64), _q(4, 64), **kw)


def test_native_on_cpu_operands_is_a_clear_error():
    with pytest.raises(NativeGemmUnavailable, match="CUDA tensors only"):
        fp4_gemm(_q(4, 64, layout="swizzled"), _q(4, 64, layout="swizzled"), backend="native")


def test_auto_on_cpu_runs_the_exact_path():
    a, b = _q(4, 64), _q(8, 64)
    assert torch.equal(fp4_gemm(a, b), fp4_gemm(a, b, backend="exact"))
