"""Tests for fp4_kernels.formats.mxfp4: shared exponent vs float64, hand cases, error bounds."""

import math

import ml_dtypes
import numpy as np
import pytest
from _random_blocks import random_blocks

from fp4_kernels.formats.e2m1 import decode_e2m1
from fp4_kernels.formats.mxfp4 import (
    BLOCK_SIZE,
    E2M1_EMAX,
    dequantize_reference,
    quantize_reference,
    shared_exponent,
)
from fp4_kernels.formats.philox import stochastic_bits16

F32 = np.float32


def _shared_exponent_float64(amax):
    """floor(log2(amax)) - 2 clamped to [-127, 127], via float64 log2 (exact enough: a float32 just
    below 2**k has log2 = k - 8.6e-8, far from k in float64); zero gives -inf -> -127."""
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(amax.astype(np.float64))) - 2
    return np.clip(e, -127, 127).astype(np.int64)


def _random_blocks(rng, shape):
    """Normal values with per-block magnitudes over 2**-140 .. 2**120, some all-zero blocks."""
    return random_blocks(rng, shape, BLOCK_SIZE, (-140, 120))


def _quantize_with_ml_dtypes(x):
    """MX v1.0 §6.3, exponent from float64 log2, elements rounded by ml_dtypes (finite x only)."""
    blocks = x.reshape(-1, BLOCK_SIZE)
    e = _shared_exponent_float64(np.abs(blocks).max(axis=1))
    scale = np.ldexp(1.0, e).astype(ml_dtypes.float8_e8m0fnu)
    y = (blocks.astype(np.float64) / np.ldexp(1.0, e)[:, None]).astype(
        np.float32
    )  # exact unless y underflows
    codes = y.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    return codes.reshape(x.shape), scale.view(np.uint8).reshape(x.shape[:-1] + (-1,))


def test_constants():
    assert BLOCK_SIZE == 32 and E2M1_EMAX == 2


def test_shared_exponent_matches_float64(rng):
    powers = np.ldexp(1.0, np.arange(-149, 128)).astype(np.float32)
    amax = np.concatenate(
        [
            powers,
            np.nextafter(powers, F32(0)),
            np.nextafter(powers[:-1], F32(np.inf)),
            np.exp2(rng.uniform(-149, 128, size=100_000)).astype(np.float32),
            rng.integers(0, 0x7F800000, size=100_000, dtype=np.uint32).view(
                np.float32
            ),  # every finite >= 0
            np.array(
                [0.0, np.finfo(np.float32).max, np.finfo(np.float32).smallest_subnormal],
                dtype=np.float32,
            ),
        ]
    )
    np.testing.assert_array_equal(shared_exponent(amax), _shared_exponent_float64(amax))


def test_shared_exponent_literals():
    amax = np.array(
        [6.0, 4.0, 7.99, 8.0, 1.0, 0.0, 2.0**-126, 2.0**-130, 2.0**127], dtype=np.float32
    )
    np.testing.assert_array_equal(shared_exponent(amax), [0, 0, 0, 1, -2, -127, -127, -127, 125])


def test_shared_exponent_rejects_non_finite():
    with pytest.raises(ValueError, match="amax_b"):
        shared_exponent(np.array([np.inf], dtype=np.float32))
    with pytest.raises(TypeError, match="amax_b"):
        shared_exponent(np.array([1.0]))


def test_hand_blocks():
    x = np.zeros((5, 32), dtype=np.float32)
    x[0, :3] = [6.0, -3.0, 0.25]  # amax 6: e = 0, y = x; 0.25 ties to 0
    x[1, :2] = [7.0, 5.0]  # amax 7: e = 0, 7 saturates to 6 (the MX rule), 5 ties to 4
    x[2, :2] = [8.0, 3.0]  # amax 8: e = 1, y = [4, 1.5]
    x[3, :2] = [1.0, -0.75]  # amax 1: e = -2, y = [4, -3]
    x[4, :2] = [2.0**-126, 2.0**-127]  # e clamps to -127: y = [2, 1]
    codes, scales = quantize_reference(x)
    np.testing.assert_array_equal(scales, [[127], [127], [128], [125], [0]])
    np.testing.assert_array_equal(
        codes[:, :3], [[7, 0xD, 0], [7, 6, 0], [6, 3, 0], [6, 0xD, 0], [4, 2, 0]]
    )
    np.testing.assert_array_equal(codes[:, 3:], 0)
    out = dequantize_reference(codes, scales)
    np.testing.assert_array_equal(
        out[:, :2], [[6, -3], [6, 4], [8, 3], [1, -0.75], [2.0**-126, 2.0**-127]]
    )


def test_zero_and_subnormal_blocks():
    x = np.zeros((1, 96), dtype=np.float32)
    x[0, 32:34] = [
        2.0**-140,
        -(2.0**-135),
    ]  # amax far below 2**-127: e = -127, y = x * 2**127 < 0.25 -> +-0
    x[0, 64] = -0.0
    codes, scales = quantize_reference(x)
    np.testing.assert_array_equal(scales, [[0, 0, 0]])
    np.testing.assert_array_equal(codes[0, 32:34], [0, 0x8])
    assert codes[0, 64] == 0x8
    out = dequantize_reference(codes, scales)
    np.testing.assert_array_equal(out, 0.0)
    assert not np.any(np.isnan(out))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_block_is_nan(bad):
    x = np.full((2, 64), 1.5, dtype=np.float32)
    x[1, 40] = bad
    codes, scales = quantize_reference(x)
    np.testing.assert_array_equal(scales, [[125, 125], [125, 0xFF]])
    np.testing.assert_array_equal(codes[1, 32:], 0)
    out = dequantize_reference(codes, scales)
    assert np.all(np.isnan(out[1, 32:]))
    np.testing.assert_array_equal(out[:, :32], 1.5)
    np.testing.assert_array_equal(out[0], 1.5)


@pytest.mark.parametrize("shape", [(1, 32), (3, 64), (129, 32), (2, 3, 96), (4, 0)])
def test_matches_ml_dtypes_twin(rng, shape):
    x = _random_blocks(rng, shape)
    codes, scales = quantize_reference(x)
    expected_codes, expected_scales = _quantize_with_ml_dtypes(x)
    assert codes.shape == shape and codes.dtype == np.uint8
    assert scales.shape == shape[:-1] + (shape[-1] // 32,) and scales.dtype == np.uint8
    np.testing.assert_array_equal(codes, expected_codes)
    np.testing.assert_array_equal(scales, expected_scales)


def test_round_trip_error_bound(rng):
    """Per block with scale 2**e: |dequant - x| <= max(half the top e2m1 gap = 1, saturation excess
    amax_b / 2**e - 6) * 2**e. Products by 2**+-e are exact; the slack covers only y underflow."""
    x = _random_blocks(rng, (257, 128))
    codes, scales = quantize_reference(x)
    out = dequantize_reference(codes, scales).astype(np.float64)
    blocks = x.astype(np.float64).reshape(-1, 32)
    err = np.abs(out.reshape(-1, 32) - blocks).max(axis=1)
    amax_b = np.abs(blocks).max(axis=1)
    scale = np.ldexp(1.0, scales.reshape(-1).astype(np.int64) - 127)
    assert np.all(err <= np.maximum(scale, amax_b - 6 * scale) + amax_b * 2.0**-20)
    # Unclamped (amax_b >= 2**-125), floor(log2) - 2 puts amax_b / 2**e in [4, 8): the saturation
    # excess is < 2 * 2**e <= amax_b / 2 and the rounding error <= 2**e <= amax_b / 4.
    unclamped = amax_b >= 2.0**-125
    assert np.all(err[unclamped] < amax_b[unclamped] / 2)


def test_stochastic_mean_is_unbiased():
    """2.3 at scale 1 (a 4 per block: e = 0) rounds to 2 or 3; the mean of N draws is in 5 sigma."""
    x = np.full((128, 32), 2.3, dtype=np.float32)
    x[:, 0] = 4.0
    draws = []
    for step in range(32):
        codes, scales = quantize_reference(x, rounding="stochastic", seed=99, step=step)
        np.testing.assert_array_equal(scales, 127)
        draws.append(dequantize_reference(codes, scales)[:, 1:])
    draws = np.concatenate(draws).astype(np.float64).ravel()
    assert set(np.unique(draws)) <= {2.0, 3.0}
    target = float(F32(2.3))
    p = target - 2.0
    assert abs(draws.mean() - target) <= 5 * math.sqrt(p * (1 - p) / draws.size) + 2.0**-17


def test_stochastic_reproducible_step_sensitive_and_flat_indexed(rng):
    x = _random_blocks(rng, (16, 64))
    a = quantize_reference(x, rounding="stochastic", seed=3, step=1)
    np.testing.assert_array_equal(
        a[0], quantize_reference(x, rounding="stochastic", seed=3, step=1)[0]
    )
    assert np.any(a[0] != quantize_reference(x, rounding="stochastic", seed=3, step=2)[0])
    # y = 2.5 (p = 1/2) rounds up exactly when the top bit of the flat element's 16 bits is 1.
    x = np.full((3, 64), 2.5, dtype=np.float32)
    x[:, ::32] = 4.0
    codes, _ = quantize_reference(x, rounding="stochastic", seed=11, step=5)
    expected = np.where(stochastic_bits16(11, 5, x.size).reshape(x.shape) >= 0x8000, 5, 4)
    expected[:, ::32] = 6
    np.testing.assert_array_equal(codes, expected)
    assert set(np.unique(decode_e2m1(codes))) == {2.0, 3.0, 4.0}
