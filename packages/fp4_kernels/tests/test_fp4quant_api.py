"""quantize / dequantize with fmt=FP4Quant(...) on the CPU path: bit-exact against the numpy
reference, the wire layout, validation.  (GPU kernels: cuda_kernels/test_fp4quant_kernel.)"""

import ml_dtypes
import numpy as np
import pytest
import torch

import fp4_kernels as fk
from fp4_kernels.formats import e2m1, fp4quant as fq
from fp4_kernels.testing import adversarial_blocks, same_bits

NP = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def _data(rng, rows, k, dtype, g):
    x = adversarial_blocks(rng, rows, k, g)
    if dtype != "float32":  # keep finite in 16-bit; the transform can grow values by sqrt(g)
        x = np.clip(np.nan_to_num(x, nan=np.nan), -1e3, 1e3)
    return x.astype(NP[dtype])


def _check(q, x, fmt, rounding, seed, step, dtype=None):
    codes, scales = fq.quantize_reference(
        np.asarray(x, np.float32), fmt.group_size, hadamard=fmt.hadamard, rounding=rounding,
        seed=seed, step=step,
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(q.data), e2m1.pack_e2m1(codes))
    np.testing.assert_array_equal(np.asarray(q.scales), scales)
    ref = fq.dequantize_reference(codes, scales, fmt.group_size, hadamard=fmt.hadamard)
    out_dtype = NP[dtype or q.dtype_name]
    assert same_bits(fk.dequantize(q, dtype), ref.astype(out_dtype))


@pytest.mark.parametrize("dtype", list(NP))
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("g,hadamard", [(16, True), (64, True), (64, False), (1024, True)])
def test_cpu_matches_reference(rng, dtype, rounding, g, hadamard):
    fmt = fk.FP4Quant(g, hadamard)
    x = _data(rng, 3, 2 * g, dtype, g)
    q = fk.quantize(x, fmt=fmt, rounding=rounding, seed=2**40 + 3, step=7)
    assert q.fmt == fmt and q.shape == x.shape and q.dtype == x.dtype and q.global_scale is None
    _check(q, x, fmt, rounding, 2**40 + 3, 7)
    _check(q, x, fmt, rounding, 2**40 + 3, 7, "float32")


def test_wire_layout_is_codes_then_bf16_scales(rng):
    x = rng.standard_normal((3, 128)).astype(np.float32)
    q = fk.quantize(x, fmt=fk.FP4Quant(32))
    n = x.size
    assert q.payload.dtype == np.uint8 and q.payload.shape == (n // 2 + 2 * n // 32,)
    assert q.nbytes == q.payload.nbytes == n * fk.FP4Quant(32).bits_per_element / 8
    assert np.array_equal(q.payload[: n // 2], q.data.reshape(-1))
    assert np.array_equal(q.payload[n // 2 :].view("<u2"), q.scales.reshape(-1))
    assert np.shares_memory(q.payload, q.data) and np.shares_memory(q.payload, q.scales)


def test_quantize_dequantize_is_the_round_trip(rng):
    x = rng.standard_normal((4, 256)).astype(ml_dtypes.bfloat16)
    fmt = fk.FP4Quant(256)
    assert same_bits(fk.quantize_dequantize(x, fmt=fmt), fk.dequantize(fk.quantize(x, fmt=fmt)))


def test_torch_cpu_in_torch_out(rng):
    x = torch.from_numpy(rng.standard_normal((2, 64)).astype(np.float32)).bfloat16()
    q = fk.quantize(x, fmt=fk.FP4Quant(64))
    assert isinstance(q.payload, torch.Tensor) and q.scales.dtype == torch.uint16
    y = fk.dequantize(q)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    ref = fk.quantize_dequantize(x.view(torch.int16).numpy().view(ml_dtypes.bfloat16),
                                 fmt=fk.FP4Quant(64))  # fmt: skip
    assert same_bits(y.view(torch.int16).numpy().view(ml_dtypes.bfloat16), ref)


def test_stochastic_rounding_is_unbiased_and_reproducible():
    # each group: a 6.0 that sets the scale to exactly 1, and 1.3 between grid points 1 and 1.5
    x = np.full((1, 4096), 1.3, np.float32)
    x[:, ::64] = 6.0
    rest = np.ones(x.shape, bool)
    rest[:, ::64] = False
    fmt = fk.FP4Quant(64, hadamard=False)
    a = fk.quantize_dequantize(x, fmt=fmt, rounding="stochastic", seed=1, step=0)
    b = fk.quantize_dequantize(x, fmt=fmt, rounding="stochastic", seed=1, step=0)
    assert same_bits(a, b)
    draws = np.concatenate([
        fk.quantize_dequantize(x, fmt=fmt, rounding="stochastic", seed=1, step=s)[rest]
        for s in range(8)
    ])  # fmt: skip
    assert set(np.unique(draws)) == {np.float32(1.0), np.float32(1.5)}
    # up with probability 0.6: the mean of 32256 draws has a standard error of 0.0014
    assert abs(draws.mean() - 1.3) < 0.007
    assert fk.quantize_dequantize(x, fmt=fmt)[rest].mean() == 1.5  # nearest: biased by 0.2


def test_validation():
    x = np.zeros((2, 64), np.float32)
    with pytest.raises(ValueError, match="FP4Quant.group_size: 24 is not a power of two"):
        fk.FP4Quant(24)
    with pytest.raises(TypeError, match="FP4Quant.hadamard"):
        fk.FP4Quant(64, hadamard="yes")
    with pytest.raises(ValueError, match="K=64 is not a multiple of the FP4Quant group size 128"):
        fk.quantize(x, fmt=fk.FP4Quant(128))
    with pytest.raises(ValueError, match="global_amax: FP4Quant has no tensor scale"):
        fk.quantize(x, fmt=fk.FP4Quant(64), global_amax=1.0)
    with pytest.raises(ValueError, match="scale_layout: FP4Quant"):
        fk.quantize(x, fmt=fk.FP4Quant(64), scale_layout="swizzled")
    with pytest.raises(TypeError, match="fmt: expected 'nvfp4', 'mxfp4' or an FP4Quant"):
        fk.quantize(x, fmt=64)
    q = fk.quantize(x, fmt=fk.FP4Quant(64))
    import dataclasses

    with pytest.raises(ValueError, match="q.scales: shape"):
        fk.dequantize(dataclasses.replace(q, scales=q.scales[:, :0]))
