"""fp4_gemm's dispatch and its errors for bad operands."""

from __future__ import annotations

import dataclasses
import sys
import warnings

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


# -- backend="auto" on a GPU with FP4 tensor cores, emulated on the CPU ----------------------


@pytest.fixture
def fp4_gpu(monkeypatch):
    """Dispatch CPU operands as if they lived on a GPU of compute capability 10.0 (the exact
    path itself still runs on the CPU); the bindings' availability is looked up afresh."""
    from fp4_train import gemm
    from fp4_train.gemm import _cublaslt

    real_check = gemm.check_operands
    monkeypatch.setattr(gemm, "check_operands", lambda a, b: real_check(a, b)._replace(cuda=True))
    monkeypatch.setattr(_cublaslt, "device_capability", lambda device: (10, 0))
    _cublaslt._bindings.cache_clear()
    yield
    _cublaslt._bindings.cache_clear()


@pytest.fixture
def without_nvmath(monkeypatch):
    """nvmath-python not installed: importing it raises ImportError."""
    for name in ("nvmath", "nvmath.bindings", "nvmath.bindings.cublasLt"):
        monkeypatch.setitem(sys.modules, name, None)


def test_auto_without_nvmath_falls_back_to_exact_with_a_warning(fp4_gpu, without_nvmath):
    a, b = _q(8, 64, layout="swizzled"), _q(5, 64, layout="swizzled")
    with pytest.warns(RuntimeWarning, match=r"FP4 tensor cores.*pip install 'fp4-train\[native\]'"):
        out = fp4_gemm(a, b)
    assert torch.equal(out, fp4_gemm(a, b, backend="exact"))


def test_native_without_nvmath_names_the_extra(fp4_gpu, without_nvmath):
    from fp4_train.gemm import _cublaslt

    with pytest.raises(NativeGemmUnavailable, match=r"\[native\] extra"):
        _cublaslt._cublaslt()


@pytest.mark.parametrize(
    "capability, k, layout",
    [((9, 0), 64, "swizzled"), ((10, 0), 48, "swizzled"), ((10, 0), 64, "linear")],
    ids=["no-fp4-tensor-cores", "k-not-a-multiple-of-32", "linear-scales"],
)
def test_auto_takes_the_exact_path_silently_where_native_does_not_apply(
    fp4_gpu, without_nvmath, monkeypatch, capability, k, layout
):
    from fp4_train.gemm import _cublaslt

    monkeypatch.setattr(_cublaslt, "device_capability", lambda device: capability)
    a, b = _q(8, k, layout=layout), _q(5, k, layout=layout)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = fp4_gemm(a, b)
    assert torch.equal(out, fp4_gemm(a, b, backend="exact"))
