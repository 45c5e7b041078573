"""The native (cuBLASLt) FP4 GEMM: its plan checked on the CPU by emulating what cuBLASLt reads,
its constants against nvmath-python's, its numerics on a GPU with FP4 tensor cores."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _oracle import bf16_result_bound, dequantize_f64, gemm_bound

import fp4_kernels
from fp4_kernels.formats.e2m1 import E2M1_VALUES
from fp4_kernels.formats.e4m3 import E4M3_VALUES
from fp4_kernels.formats.e8m0 import E8M0_VALUES
from fp4_train.gemm import NativeGemmUnavailable, _cublaslt as native, fp4_gemm

SCALE_VALUES = {"VEC16_UE4M3": E4M3_VALUES, "VEC32_UE8M0": E8M0_VALUES}
VEC = {"VEC16_UE4M3": 16, "VEC32_UE8M0": 32}


def _swizzled_offset(r, c, padded_cols):
    # cuBLAS docs, "1D Block Scaling Factors Layout": 128 x 4 tiles of 512 bytes, row-major
    # over the tiles; inside a tile row r = 32 i + j and column c at byte j * 16 + i * 4 + c
    tile = (r // 128) * (padded_cols // 4) + c // 4
    return tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


def _read_col_major_e2m1(packed, layout):
    """The (rows, cols) matrix cuBLASLt sees in ``packed`` under ``layout`` (two e2m1 codes a
    byte, the lower-indexed element in the low nibble)."""
    flat = packed.reshape(-1)
    codes = np.empty(flat.size * 2, np.uint8)
    codes[0::2], codes[1::2] = flat & 0xF, flat >> 4
    i, j = np.indices((layout.rows, layout.cols))
    return E2M1_VALUES[codes[j * layout.ld + i]].astype(np.float64)


def _op_scales(scales, mode, rows, k):
    """The scale of each element of the (rows x k) operand op(X), read from the swizzled
    buffer as cuBLASLt does: element (r, kk) uses block (r, kk // vec)."""
    vec = VEC[mode]
    padded_cols = -(-(k // vec) // 4) * 4
    r, kk = np.indices((rows, k))
    return SCALE_VALUES[mode][scales[_swizzled_offset(r, kk // vec, padded_cols)]].astype(
        np.float64
    )


def emulate(plan, a, b):
    """D = alpha op(A) op(B) as cuBLASLt would compute it from ``plan`` (float64)."""
    assert plan.trans_a == native.CUBLAS_OP_T and plan.trans_b == native.CUBLAS_OP_N
    op_a = _read_col_major_e2m1(b.data, plan.layout_a).T  # (m, k)
    op_b = _read_col_major_e2m1(a.data, plan.layout_b)  # (k, n)
    op_a = op_a * _op_scales(b.scales, plan.scale_mode, plan.m, plan.k)
    op_b = op_b * _op_scales(a.scales, plan.scale_mode, plan.n, plan.k).T
    alpha = np.float64(a.global_scale[0]) * np.float64(b.global_scale[0])
    if not plan.alpha_from_tensor_scales:
        alpha = 1.0
    d = alpha * (op_a @ op_b)  # column-major m x n
    assert plan.layout_d.rows == plan.m and plan.layout_d.ld == plan.m
    return d.T  # the row-major (M, N) the caller sees


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("m, n, k", [(1, 1, 64), (130, 7, 96), (40, 260, 512)])
def test_plan_reads_the_product_of_the_operands(fmt, m, n, k):
    rng = np.random.default_rng([m, n, k])
    x_a = rng.standard_normal((m, k)).astype(np.float32)
    x_b = rng.standard_normal((n, k)).astype(np.float32) * 3
    a = fp4_kernels.quantize(x_a, fmt=fmt, scale_layout="swizzled")
    b = fp4_kernels.quantize(x_b, fmt=fmt, scale_layout="swizzled")
    plan = native.plan_native(a, b, "float32")
    assert (plan.m, plan.n, plan.k) == (n, m, k)
    got = emulate(plan, a, b)
    a64, b64 = dequantize_f64(a), dequantize_f64(b)
    # the emulation is float64; only the float64 rounding of its sums separates it from exact
    assert np.all(np.abs(got - a64 @ b64.T) <= gemm_bound(a64, b64, k) * 2.0**-29)


def test_plan_describes_nvfp4_tn_with_alpha_from_the_tensor_scales():
    a = fp4_kernels.quantize(np.ones((300, 64), np.float32), scale_layout="swizzled")
    b = fp4_kernels.quantize(np.ones((20, 64), np.float32), scale_layout="swizzled")
    plan = native.plan_native(a, b, "bfloat16")
    assert plan.layout_a == native.MatrixLayout(native.CUDA_R_4F_E2M1, 64, 20, 64)
    assert plan.layout_b == native.MatrixLayout(native.CUDA_R_4F_E2M1, 64, 300, 64)
    assert plan.layout_d == native.MatrixLayout(native.CUDA_R_16BF, 20, 300, 20)
    assert plan.scale_mode == "VEC16_UE4M3" and plan.alpha_from_tensor_scales
    # 128 x 4 tiles: N = 20 rows pad to 128, M = 300 to 384; 4 blocks per row pad to 4
    assert (plan.scale_bytes_a, plan.scale_bytes_b) == (128 * 4, 384 * 4)


def test_plan_needs_swizzled_scales():
    q = fp4_kernels.quantize(np.ones((4, 64), np.float32))
    with pytest.raises(NativeGemmUnavailable, match="scale_layout='swizzled'"):
        native.plan_native(q, q, "float32")


def test_plan_needs_16_byte_rows():
    q = fp4_kernels.quantize(np.ones((4, 48), np.float32), scale_layout="swizzled")
    with pytest.raises(NativeGemmUnavailable, match="K a multiple of 32"):
        native.plan_native(q, q, "float32")


def test_constants_match_nvmath_bindings():
    nvmath = pytest.importorskip(
        "nvmath", reason="nvmath-python (the [native] extra) not installed"
    )
    from nvmath.bindings import cublas, cublasLt

    assert native.CUDA_R_4F_E2M1 == nvmath.CudaDataType.CUDA_R_4F_E2M1
    assert native.CUDA_R_16BF == nvmath.CudaDataType.CUDA_R_16BF
    assert native.CUDA_R_32F == nvmath.CudaDataType.CUDA_R_32F
    assert native.CUBLAS_COMPUTE_32F == cublas.ComputeType.COMPUTE_32F
    for mode in SCALE_VALUES:
        assert hasattr(cublasLt.MatmulMatrixScale, mode)
    scheme = cublasLt.ReductionScheme
    assert native.CUBLASLT_REDUCTION_SCHEME_INPLACE == scheme.INPLACE
    assert native.CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE == scheme.COMPUTE_TYPE
    assert native.CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE == scheme.OUTPUT_TYPE
    for name in native.PREFERENCES:
        assert hasattr(cublasLt.MatmulPreferenceAttribute, name)


def test_split_k_partial_sums_stay_float32():
    # a bfloat16 (or float32) result must be the float32 accumulation rounded once: split-K
    # kernels that add partial sums in the output type (INPLACE, OUTPUT_TYPE) are excluded
    mask = native.PREFERENCES["REDUCTION_SCHEME_MASK"]
    assert mask & native.CUBLASLT_REDUCTION_SCHEME_INPLACE == 0
    assert mask & native.CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE == 0
    assert mask & native.CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE
    assert native.PREFERENCES["MAX_WORKSPACE_BYTES"] == native.WORKSPACE_BYTES


@pytest.mark.parametrize(
    "a1, b1, alpha, match",
    [
        (torch.ones(4, 32), torch.ones(4, 32), torch.ones(1), "expected bfloat16"),
        (
            torch.ones(4, 32, dtype=torch.bfloat16),
            torch.ones(4, 16, dtype=torch.bfloat16),
            torch.ones(1),
            r"expected \(M, K\) and \(N, K\)",
        ),
        (
            torch.ones(4, 32, dtype=torch.bfloat16),
            torch.ones(4, 32, dtype=torch.bfloat16),
            torch.ones(2),
            "alpha: expected one float32 element",
        ),
        (
            torch.ones(4, 32, dtype=torch.bfloat16),
            torch.ones(4, 32, dtype=torch.bfloat16),
            1.0,
            "alpha: expected a torch tensor",
        ),
        (
            torch.ones(4, 32, dtype=torch.bfloat16),
            torch.ones(4, 32, dtype=torch.bfloat16),
            torch.ones(1),
            "expected one CUDA device",
        ),
    ],
    ids=["float32", "k-mismatch", "alpha-two", "alpha-float", "cpu"],
)
def test_device_alpha_gemm_checks_what_it_hands_cublaslt(a1, b1, alpha, match):
    with pytest.raises((TypeError, ValueError), match=match):
        native.bf16_gemm_device_alpha(a1, b1, alpha)


_CC = torch.cuda.get_device_capability() if torch.cuda.is_available() else None


def _cublaslt_or_skip():
    """nvmath-python's cuBLASLt bindings with their library loaded, or a skip saying why."""
    pytest.importorskip("nvmath", reason="nvmath-python (the [native] extra) not installed")
    from nvmath.bindings import cublasLt

    try:
        cublasLt.get_version()
    except Exception as e:  # the bindings import, but libcublasLt does not load
        pytest.skip(f"nvmath-python cannot load cuBLASLt here: {e}")
    return cublasLt


@pytest.mark.gpu
@pytest.mark.skipif(_CC is None, reason="needs a CUDA GPU (none visible)")
@pytest.mark.skipif(
    _CC is not None and _CC >= native.MIN_CAPABILITY,
    reason="this GPU has FP4 tensor cores: the native path runs (test_native_matches_exact)",
)
def test_native_names_the_compute_capability_it_lacks():
    x = torch.randn(128, 64, device="cuda")
    q = fp4_kernels.quantize(x, scale_layout="swizzled")
    with pytest.raises(NativeGemmUnavailable, match=rf"compute capability {_CC[0]}\.{_CC[1]}"):
        fp4_gemm(q, q, backend="native")
    assert fp4_gemm(q, q).shape == (128, 128)  # "auto" falls back to the exact path


@pytest.mark.gpu
@pytest.mark.skipif(
    _CC is None or _CC < native.MIN_CAPABILITY,
    reason=f"needs a GPU of compute capability >= 10.0 (FP4 tensor cores); have {_CC}",
)
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_native_matches_exact(fmt):
    _cublaslt_or_skip()
    x_a = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    x_b = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    a = fp4_kernels.quantize(x_a, fmt=fmt, scale_layout="swizzled")
    b = fp4_kernels.quantize(x_b, fmt=fmt, scale_layout="swizzled")
    out = fp4_gemm(a, b, backend="native")
    a64, b64 = dequantize_f64(a), dequantize_f64(b)
    err = np.abs(out.cpu().double().numpy() - a64 @ b64.T)
    assert np.all(err <= gemm_bound(a64, b64, 1024))


@pytest.mark.gpu
@pytest.mark.skipif(_CC is None, reason="needs a CUDA GPU (none visible)")
def test_bf16_gemm_with_device_alpha_is_the_exact_path():
    _cublaslt_or_skip()
    from fp4_train.gemm._exact import _without_tensor_scale

    x_a = torch.randn(384, 1024, device="cuda", dtype=torch.bfloat16)
    x_b = torch.randn(200, 1024, device="cuda", dtype=torch.bfloat16)
    a, b = fp4_kernels.quantize(x_a), fp4_kernels.quantize(x_b)
    a1 = fp4_kernels.dequantize(_without_tensor_scale(a, "torch"), dtype=torch.bfloat16)
    b1 = fp4_kernels.dequantize(_without_tensor_scale(b, "torch"), dtype=torch.bfloat16)
    alpha = a.global_scale * b.global_scale
    out = native.bf16_gemm_device_alpha(a1, b1, alpha)
    assert out.shape == (384, 200) and out.dtype == torch.float32
    a64, b64 = dequantize_f64(a), dequantize_f64(b)
    exact = a64 @ b64.T
    bound = gemm_bound(a64, b64, 1024)
    assert np.all(np.abs(out.cpu().double().numpy() - exact) <= bound)
    # a bfloat16 result: the float32 one rounded once (split-K partial sums stay float32,
    # native.PREFERENCES), so within half a bfloat16 ulp of it plus the float32 bound
    out_bf16 = native.bf16_gemm_device_alpha(a1, b1, alpha, "bfloat16").cpu().double().numpy()
    assert np.all(np.abs(out_bf16 - exact) <= bf16_result_bound(bound, exact))
