"""The exact GEMM path against the float64 product of the dequantized operands."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from _oracle import U_BF16, bf16_result_bound, dequantize_f64, gemm_bound

import fp4_kernels
from fp4_train.gemm import fp4_gemm
from fp4_train.gemm._exact import _without_tensor_scale

SHAPES = [(1, 1, 32), (3, 5, 64), (17, 130, 96), (64, 48, 512)]  # (M, N, K), ragged M and N


def _operand(rng, rows, k, fmt, lib, layout="linear", spread=True):
    x = rng.standard_normal((rows, k)).astype(np.float32)
    if spread:  # blocks whose amax spans 2^-12 .. 2^12: every e4m3 / e8m0 binade is used
        x *= np.exp2(rng.integers(-12, 13, size=(rows, k // 16))).repeat(16, axis=1)
    if lib == "torch":
        x = torch.from_numpy(x)
    return fp4_kernels.quantize(x, fmt=fmt, scale_layout=layout)


@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("m, n, k", SHAPES)
def test_exact_gemm_within_float32_accumulation_bound(lib, fmt, m, n, k):
    rng = np.random.default_rng([m, n, k])
    a = _operand(rng, m, k, fmt, lib)
    b = _operand(rng, n, k, fmt, lib)
    out = fp4_gemm(a, b)
    out = out.numpy() if lib == "torch" else out
    assert out.shape == (m, n) and out.dtype == np.float32
    a64, b64 = dequantize_f64(a), dequantize_f64(b)
    err = np.abs(out.astype(np.float64) - a64 @ b64.T)
    assert np.all(err <= gemm_bound(a64, b64, k))


def test_swizzled_scales_give_the_same_product():
    rng = np.random.default_rng(7)
    x_a = torch.from_numpy(rng.standard_normal((130, 64)).astype(np.float32))
    x_b = torch.from_numpy(rng.standard_normal((33, 64)).astype(np.float32))
    linear = fp4_gemm(fp4_kernels.quantize(x_a), fp4_kernels.quantize(x_b))
    swizzled = fp4_gemm(
        fp4_kernels.quantize(x_a, scale_layout="swizzled"),
        fp4_kernels.quantize(x_b, scale_layout="swizzled"),
    )
    assert torch.equal(linear, swizzled)


def test_bfloat16_output_is_the_float32_result_rounded_once():
    rng = np.random.default_rng(3)
    a = _operand(rng, 8, 64, "nvfp4", "torch")
    b = _operand(rng, 24, 64, "nvfp4", "torch")
    assert torch.equal(fp4_gemm(a, b, out_dtype="bfloat16"), fp4_gemm(a, b).to(torch.bfloat16))


def test_bfloat16_output_within_the_rounded_once_bound():
    # the bound the GPU tests put on a bfloat16 result (test_cublaslt's device-alpha GEMM
    # among them), checked on the CPU at the same shape: the float32 bound plus half a
    # bfloat16 ulp, U_BF16 = 2^-8 relative
    torch.manual_seed(0)
    a = fp4_kernels.quantize(torch.randn(384, 1024, dtype=torch.bfloat16))
    b = fp4_kernels.quantize(torch.randn(200, 1024, dtype=torch.bfloat16))
    out = fp4_gemm(a, b, out_dtype="bfloat16").double().numpy()
    a64, b64 = dequantize_f64(a), dequantize_f64(b)
    exact = a64 @ b64.T
    bound = gemm_bound(a64, b64, 1024)
    err = np.abs(out - exact)
    assert np.all(err <= bf16_result_bound(bound, exact))
    # half of that relative term (2^-9) is too little for a correctly rounded result
    assert np.any(err > bound * (1 + U_BF16) + U_BF16 / 2 * np.abs(exact))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_operands_without_tensor_scale_are_exact_in_bfloat16(fmt):
    # the premise of the path: e2m1 x block scale needs no rounding in bfloat16
    rng = np.random.default_rng(11)
    q = _operand(rng, 64, 256, fmt, "torch")
    q1 = _without_tensor_scale(q, "torch")
    as_bf16 = fp4_kernels.dequantize(q1, dtype=torch.bfloat16).float()
    as_f32 = fp4_kernels.dequantize(q1, dtype=torch.float32)
    assert torch.equal(as_bf16, as_f32)


def test_tensor_scale_is_applied_once_to_the_result():
    # a tensor scale that is not a power of two: folding it into bf16 operands would round them
    x = torch.linspace(-1.0, 1.0, 32).reshape(1, 32) * 0.3
    a = fp4_kernels.quantize(x)
    assert a.global_scale.item() not in (0.0, 1.0)
    assert float(np.log2(a.global_scale.item())) % 1 != 0
    b = dataclasses.replace(a, global_scale=torch.ones(1))
    expected = dequantize_f64(a) @ dequantize_f64(b).T
    got = fp4_gemm(a, b).double().numpy()
    assert np.all(np.abs(got - expected) <= gemm_bound(dequantize_f64(a), dequantize_f64(b), 32))


def _far_from_one(rng, magnitude):
    """Operands whose tensor amaxes multiply to a number float32 cannot hold (above FLT_MAX,
    or in its subnormal range), while every element of a @ b^T is a normal float32."""
    if magnitude > 1:  # amax 1e23 each: gs_a * gs_b ~ 1.4e39 > FLT_MAX
        # the amax blocks of a and b never meet, an all-zero row, and rows of 1e18 whose
        # products (1e36 * K) float32 holds
        a = np.zeros((5, 64), np.float32)
        b = np.zeros((3, 64), np.float32)
        a[0, :16] = rng.standard_normal(16) * magnitude
        a[0, 0] = magnitude
        a[2:, 32:] = rng.standard_normal((3, 32)) * 1e18
        a[4, 32:] = -np.abs(a[4, 32:])  # a row of one sign: a result near -1.8e37
        b[0, 16:32] = rng.standard_normal(16) * magnitude
        b[0, 16] = magnitude
        b[1:, 32:] = np.abs(rng.standard_normal((2, 32))) * 1e18
        return a, b
    # amax 3e-19 each: gs_a * gs_b ~ 1e-44, a float32 subnormal of a few significant bits,
    # while every product of two elements (~1e-37) and their sum is normal
    a = (rng.standard_normal((5, 64)) * magnitude).astype(np.float32)
    b = (rng.standard_normal((3, 64)) * magnitude).astype(np.float32)
    return a, b


@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("magnitude", [1e23, 3e-19], ids=["product-overflows", "subnormal"])
def test_tensor_scales_whose_product_float32_cannot_hold(lib, magnitude):
    # multiplying the two float32 tensor scales first gave inf (an all-zero row NaN, the
    # others +-inf) or a subnormal alpha (errors of ~1 %); each is applied in float64 instead
    x, y = _far_from_one(np.random.default_rng(13), magnitude)
    wrap = torch.from_numpy if lib == "torch" else np.asarray
    a, b = fp4_kernels.quantize(wrap(x)), fp4_kernels.quantize(wrap(y))
    alpha = float(a.global_scale[0]) * float(b.global_scale[0])  # float64: exact
    f32 = np.finfo(np.float32)
    assert not float(f32.tiny) <= alpha <= float(f32.max)  # the premise
    a64, b64 = dequantize_f64(a), dequantize_f64(b)
    exact = a64 @ b64.T
    nonzero = exact[exact != 0]
    assert nonzero.size >= 6 and np.all(np.abs(nonzero) > np.finfo(np.float32).tiny)
    assert np.all(np.abs(exact) < np.finfo(np.float32).max)
    out = fp4_gemm(a, b)
    out = out.numpy() if lib == "torch" else out
    assert np.all(np.isfinite(out))
    assert np.all(np.abs(out.astype(np.float64) - exact) <= gemm_bound(a64, b64, 64))
    if lib == "torch":
        bf16 = fp4_gemm(a, b, out_dtype="bfloat16")
        assert torch.equal(bf16, torch.from_numpy(out).to(torch.bfloat16))


def _cuda_capability():
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("m, n, k", [(130, 70, 96), (512, 384, 4096)])
def test_cuda_exact_gemm_within_float32_accumulation_bound(fmt, m, n, k):
    rng = np.random.default_rng([m, n, k, 1])
    a = _operand(rng, m, k, fmt, "numpy")
    b = _operand(rng, n, k, fmt, "numpy")
    to_cuda = lambda q: dataclasses.replace(  # noqa: E731
        q,
        data=torch.from_numpy(q.data).cuda(),
        scales=torch.from_numpy(q.scales).cuda(),
        global_scale=torch.from_numpy(q.global_scale).cuda(),
    )
    out = fp4_gemm(to_cuda(a), to_cuda(b))
    assert out.is_cuda and out.dtype == torch.float32
    a64, b64 = dequantize_f64(a), dequantize_f64(b)
    err = np.abs(out.cpu().double().numpy() - a64 @ b64.T)
    assert np.all(err <= gemm_bound(a64, b64, k))
    out_bf16 = fp4_gemm(to_cuda(a), to_cuda(b), out_dtype="bfloat16")
    assert torch.equal(out_bf16, out.to(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")
@pytest.mark.parametrize("magnitude", [1e23, 3e-19], ids=["product-overflows", "subnormal"])
def test_cuda_tensor_scales_whose_product_float32_cannot_hold(magnitude):
    x, y = _far_from_one(np.random.default_rng(13), magnitude)
    a = fp4_kernels.quantize(torch.from_numpy(x).cuda())
    b = fp4_kernels.quantize(torch.from_numpy(y).cuda())
    out = fp4_gemm(a, b, backend="exact")
    a64, b64 = dequantize_f64(a), dequantize_f64(b)
    err = np.abs(out.cpu().double().numpy() - a64 @ b64.T)
    assert np.all(err <= gemm_bound(a64, b64, 64))
    bf16 = fp4_gemm(a, b, out_dtype="bfloat16", backend="exact")
    assert torch.equal(bf16, out.to(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")
def test_cuda_exact_gemm_quantizes_and_multiplies_on_the_device():
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(128, 512, device="cuda", dtype=torch.bfloat16)
    qa, qb = fp4_kernels.quantize(x), fp4_kernels.quantize(y)
    out = fp4_gemm(qa, qb)
    a64, b64 = dequantize_f64(qa), dequantize_f64(qb)
    err = np.abs(out.cpu().double().numpy() - a64 @ b64.T)
    assert np.all(err <= gemm_bound(a64, b64, 512))
