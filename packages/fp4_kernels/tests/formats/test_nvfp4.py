"""Tests for fp4_kernels.formats.nvfp4: hand-worked blocks, an ml_dtypes twin, error bounds."""

import math

import ml_dtypes
import numpy as np
import pytest
from _random_blocks import random_blocks

from fp4_kernels.formats.e2m1 import decode_e2m1
from fp4_kernels.formats.e4m3 import decode_e4m3
from fp4_kernels.formats.nvfp4 import (
    BLOCK_SIZE,
    FP32_MAX,
    INV_E2M1_MAX,
    dequantize_reference,
    global_encode_scale,
    quantize_reference,
    tensor_amax,
)
from fp4_kernels.formats.philox import stochastic_bits16

F32 = np.float32
UNIT_GLOBAL_AMAX = 2688.0  # = 448 * 6, gives S = 1 and global_scale = 1: block arithmetic is plain


def _random_blocks(rng, shape):
    """Normal values with per-block magnitudes over 2**-30 .. 2**10, some all-zero blocks."""
    return random_blocks(rng, shape, BLOCK_SIZE, (-30, 10))


def _quantize_with_ml_dtypes(x, s_enc):
    """Transformer Engine's NVFP4 formula with every rounding done by ml_dtypes (finite x only).

    ml_dtypes' e4m3 cast does not saturate, so the scale is clipped to 448 first (clip then RNE
    equals saturating RNE); its e2m1 cast saturates already.
    """
    blocks = x.reshape(-1, BLOCK_SIZE)
    block_amax = np.abs(blocks).max(axis=1)
    scale = np.minimum(block_amax * (s_enc * (F32(1.0) / F32(6.0))), F32(448.0)).astype(
        ml_dtypes.float8_e4m3fn
    )
    with np.errstate(divide="ignore", over="ignore"):
        scale_rcp = np.minimum(F32(1.0) / (scale.astype(np.float32) * (F32(1.0) / s_enc)), FP32_MAX)
        y = blocks * scale_rcp[:, None]
    codes = y.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    return codes.reshape(x.shape), scale.view(np.uint8).reshape(x.shape[:-1] + (-1,))


# --- constants and global scale ------------------------------------------------------------


def test_constants():
    assert BLOCK_SIZE == 16
    assert INV_E2M1_MAX.dtype == np.float32 and INV_E2M1_MAX == F32(1.0) / F32(6.0)
    assert FP32_MAX == F32(3.4028234663852886e38)


def test_tensor_amax_ignores_non_finite():
    assert tensor_amax(np.array([1.0, -3.0, np.inf, np.nan, -np.inf], dtype=np.float32)) == 3.0
    assert tensor_amax(np.array([np.nan, np.inf], dtype=np.float32)) == 0.0
    assert tensor_amax(np.zeros((0, 16), dtype=np.float32)) == 0.0
    assert tensor_amax(np.array([-0.0], dtype=np.float32)) == 0.0


def test_global_encode_scale():
    assert global_encode_scale(F32(2688.0)) == 1.0
    assert global_encode_scale(F32(448.0)) == 6.0
    assert global_encode_scale(F32(0.0)) == 1.0  # no data: S = 1
    assert global_encode_scale(F32(np.inf)) == 1.0  # 2688 / Inf = 0: S = 1
    assert global_encode_scale(F32(1e-45)) == FP32_MAX  # 2688 / subnormal overflows: clamped
    s = global_encode_scale(F32(3.0))
    assert s.dtype == np.float32 and s == F32(2688.0) / F32(3.0)


# --- hand-worked blocks --------------------------------------------------------------------


def test_block_at_tensor_amax():
    """[6, 0, ...]: S = 2688 / 6 = 448, scale = e4m3(6 * (448 * (1/6))) = 448 (0x7E), y = 6 -> 7."""
    x = np.zeros((1, 16), dtype=np.float32)
    x[0, 0] = 6.0
    codes, scales, global_scale = quantize_reference(x)
    np.testing.assert_array_equal(codes, [[7] + [0] * 15])
    np.testing.assert_array_equal(scales, [[0x7E]])
    assert global_scale.dtype == np.float32 and global_scale == F32(1.0) / F32(448.0)
    out = dequantize_reference(codes, scales, global_scale)
    assert out[0, 0] == (F32(6.0) * F32(448.0)) * global_scale
    # fl(1/448) and the product are two roundings: 2688 * fl(1/448) is one float32 ulp from 6.
    assert abs(float(out[0, 0]) - 6.0) <= np.spacing(F32(6.0))
    np.testing.assert_array_equal(out[0, 1:], 0.0)


def test_hand_block_ties_and_signs_with_unit_global_scale():
    """S = 1: scale = e4m3(fl(6 * fl(1/6))) = e4m3(1.0) = 0x38, so y = x and codes are e2m1(x)."""
    x = np.array(
        [[6, 3, -1.5, 0.25, 0.75, -5, 1.25, 0, -0.0, 4, 2.5, 3.5, 1.75, 0.5, -6, 1]],
        dtype=np.float32,
    )
    codes, scales, global_scale = quantize_reference(x, global_amax=UNIT_GLOBAL_AMAX)
    np.testing.assert_array_equal(codes, [[7, 5, 0xB, 0, 2, 0xE, 2, 0, 8, 6, 4, 6, 4, 1, 0xF, 2]])
    np.testing.assert_array_equal(scales, [[0x38]])
    assert global_scale == 1.0
    expected = np.array(
        [[6, 3, -1.5, 0, 1, -4, 1, 0, -0.0, 4, 2, 4, 2, 0.5, -6, 1]], dtype=np.float32
    )
    np.testing.assert_array_equal(dequantize_reference(codes, scales, global_scale), expected)


def test_exact_subnormal_scale():
    """Block amax 6 * 2**-8 with S = 1: scale = 2**-8 = 2 * 2**-9, e4m3 subnormal code 0x02."""
    x = np.zeros((1, 16), dtype=np.float32)
    x[0, :4] = np.array([6, 3, -1, 0.5]) * 2.0**-8
    codes, scales, global_scale = quantize_reference(x, global_amax=UNIT_GLOBAL_AMAX)
    np.testing.assert_array_equal(scales, [[0x02]])
    np.testing.assert_array_equal(codes[0, :4], [7, 5, 0xA, 1])
    np.testing.assert_array_equal(dequantize_reference(codes, scales, global_scale), x)


def test_rounded_subnormal_scale():
    """Block amax 0.01, S = 1: 0.01 / 6 = 0.853 * 2**-9 rounds to 2**-9 (0x01); y = 5.12 -> 6."""
    x = np.zeros((1, 16), dtype=np.float32)
    x[0, 0] = 0.01
    codes, scales, global_scale = quantize_reference(x, global_amax=UNIT_GLOBAL_AMAX)
    np.testing.assert_array_equal(scales, [[0x01]])
    assert codes[0, 0] == 7
    assert dequantize_reference(codes, scales, global_scale)[0, 0] == 6 * 2.0**-9


def test_operation_order_of_block_scale_is_pinned():
    """TE computes amax_b * (S * (1/6)); (amax_b * S) * (1/6) would hit the tie 34 -> 32 exactly.

    S = 2688 / 538.60516 = 4.990669; amax_b * (S * fl(1/6)) = 34.000004 -> 36 (0x61), whereas
    (amax_b * S) * fl(1/6) = 34.0, a tie between 32 and 36 that rounds to even 32 (0x60).
    """
    global_amax = F32(float.fromhex("0x1.0d4d76p+9"))  # 538.60516
    block_amax = F32(float.fromhex("0x1.4702a2p+5"))  # 40.876286
    s_enc = global_encode_scale(global_amax)
    assert (block_amax * s_enc) * INV_E2M1_MAX == F32(34.0)
    x = np.zeros((1, 16), dtype=np.float32)
    x[0, 0] = block_amax
    _, scales, _ = quantize_reference(x, global_amax=global_amax)
    np.testing.assert_array_equal(scales, [[0x61]])


def test_all_zero_block_gives_exact_zeros():
    x = np.zeros((2, 32), dtype=np.float32)
    x[0, 16:] = 1.0
    x[1, :16] = -0.0
    codes, scales, global_scale = quantize_reference(x)
    np.testing.assert_array_equal(scales, [[0x00, scales[0, 1]], [0x00, 0x00]])
    np.testing.assert_array_equal(codes[0, :16], 0)
    np.testing.assert_array_equal(codes[1, :16], 0x8)  # -0.0 keeps its sign
    out = dequantize_reference(codes, scales, global_scale)
    assert not np.any(np.isnan(out))
    np.testing.assert_array_equal(out[:, :16], 0.0)
    np.testing.assert_array_equal(np.signbit(out[1, :16]), True)


def test_block_far_below_tensor_amax_has_zero_scale_and_dequantizes_to_zero():
    """Scale rounds to 0: scale_rcp = fmin(1 / 0, FP32_MAX) = FP32_MAX, y saturates, 6 * 0 = 0."""
    x = np.zeros((1, 32), dtype=np.float32)
    x[0, 0] = 2688.0
    x[0, 16:18] = [1e-4, -1e-4]
    codes, scales, global_scale = quantize_reference(x)
    assert scales[0, 1] == 0x00
    np.testing.assert_array_equal(codes[0, 16:18], [7, 0xF])
    np.testing.assert_array_equal(codes[0, 18:], 0)
    out = dequantize_reference(codes, scales, global_scale)
    np.testing.assert_array_equal(out[0, 16:], 0.0)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_block_is_nan_and_ignored_by_amax(bad):
    x = np.ones((2, 32), dtype=np.float32) * 3.0
    x[1, 20] = bad
    codes, scales, global_scale = quantize_reference(x)
    assert global_scale == F32(1.0) / (F32(2688.0) / F32(3.0))  # amax 3, the bad value ignored
    np.testing.assert_array_equal(scales, [[0x7E, 0x7E], [0x7E, 0x7F]])
    np.testing.assert_array_equal(codes[1, 16:], 0)
    np.testing.assert_array_equal(codes[:, :16], 7)
    out = dequantize_reference(codes, scales, global_scale)
    assert np.all(np.isnan(out[1, 16:]))
    assert not np.any(np.isnan(out[:, :16])) and not np.any(np.isnan(out[0]))


# --- random inputs -------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 16), (3, 48), (129, 32), (2, 3, 64), (5, 0)])
def test_matches_ml_dtypes_twin(rng, shape):
    x = _random_blocks(rng, shape)
    codes, scales, global_scale = quantize_reference(x)
    s_enc = global_encode_scale(tensor_amax(x))
    expected_codes, expected_scales = _quantize_with_ml_dtypes(x, s_enc)
    assert codes.shape == shape and codes.dtype == np.uint8
    assert scales.shape == shape[:-1] + (shape[-1] // 16,) and scales.dtype == np.uint8
    np.testing.assert_array_equal(codes, expected_codes)
    np.testing.assert_array_equal(scales, expected_scales)
    assert global_scale == F32(1.0) / s_enc


def test_round_trip_error_bound(rng):
    """Per block, |dequant - x| <= half the top e2m1 gap (2 / 2) in units of the decoded scale,
    or the saturation excess when the scale rounded down; with a normal e4m3 scale (relative
    rounding error <= 2**-4) that is <= amax_b / 6 * (1 + 2**-4). Slack 2**-20 covers the float32
    roundings of scale_rcp, y and the two dequantization products."""
    x = _random_blocks(rng, (257, 128))
    codes, scales, global_scale = quantize_reference(x)
    out = dequantize_reference(codes, scales, global_scale).astype(np.float64)
    blocks = x.astype(np.float64).reshape(-1, 16)
    err = np.abs(out.reshape(-1, 16) - blocks).max(axis=1)
    amax_b = np.abs(blocks).max(axis=1)
    s_eff = decode_e4m3(scales.reshape(-1)).astype(np.float64) * float(global_scale)
    slack = 2.0**-20
    assert np.all(err <= np.maximum(s_eff, amax_b - 6 * s_eff) * (1 + slack) + amax_b * slack)
    normal = scales.reshape(-1) >= 0x08
    assert np.all(err[normal] <= amax_b[normal] / 6 * (1 + 2.0**-4) * (1 + slack))
    assert np.all((s_eff == 0) == (scales.reshape(-1) == 0))


def test_global_amax_argument(rng):
    x = _random_blocks(rng, (4, 64))
    amax = tensor_amax(x)
    codes, scales, global_scale = quantize_reference(x, global_amax=2 * float(amax))
    s_enc = global_encode_scale(F32(2 * float(amax)))
    assert global_scale == F32(1.0) / s_enc
    expected_codes, expected_scales = _quantize_with_ml_dtypes(x, s_enc)
    np.testing.assert_array_equal(codes, expected_codes)
    np.testing.assert_array_equal(scales, expected_scales)
    # A global amax below the data saturates the top block scales at 448 and codes at 6; no NaN.
    x = np.full((1, 16), 100.0, dtype=np.float32)
    codes, scales, global_scale = quantize_reference(x, global_amax=1.0)
    np.testing.assert_array_equal(scales, [[0x7E]])
    np.testing.assert_array_equal(codes, 7)
    assert np.all(np.isfinite(dequantize_reference(codes, scales, global_scale)))


@pytest.mark.parametrize("bad", [-1.0, np.nan, np.inf])
def test_rejects_bad_global_amax(bad):
    with pytest.raises(ValueError, match="global_amax"):
        quantize_reference(np.zeros((1, 16), dtype=np.float32), global_amax=bad)


# --- stochastic rounding -------------------------------------------------------------------


def test_stochastic_mean_is_unbiased():
    """2.3 * scale (scale = 1 with S = 1) rounds to 2 or 3; the mean of N draws is within 5 sigma.

    p = P(round up) = (fl(2.3) - 2) / 1, sigma of one draw = sqrt(p (1 - p)); rounding p to 16
    bits shifts the mean by at most 2**-17.
    """
    x = np.full((256, 16), 2.3, dtype=np.float32)
    x[:, 0] = 6.0  # block amax 6 -> scale e4m3(1.0), so y = x
    draws = []
    for step in range(32):
        codes, scales, global_scale = quantize_reference(
            x, rounding="stochastic", seed=1234, step=step, global_amax=UNIT_GLOBAL_AMAX
        )
        np.testing.assert_array_equal(scales, 0x38)
        draws.append(dequantize_reference(codes, scales, global_scale)[:, 1:])
    draws = np.concatenate(draws).astype(np.float64).ravel()
    assert set(np.unique(draws)) <= {2.0, 3.0}
    target = float(F32(2.3))
    p = target - 2.0
    sigma = math.sqrt(p * (1 - p) / draws.size)
    assert abs(draws.mean() - target) <= 5 * sigma + 2.0**-17


def test_stochastic_reproducible_and_step_sensitive(rng):
    x = _random_blocks(rng, (64, 64))
    a = quantize_reference(x, rounding="stochastic", seed=7, step=3)
    b = quantize_reference(x, rounding="stochastic", seed=7, step=3)
    c = quantize_reference(x, rounding="stochastic", seed=7, step=4)
    d = quantize_reference(x, rounding="stochastic", seed=8, step=3)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], c[1])  # scales do not depend on the random bits
    assert np.any(a[0] != c[0]) and np.any(a[0] != d[0])
    # A stochastic code is at most one grid step (<= 2) from the nearest-rounded code.
    nearest = decode_e2m1(quantize_reference(x)[0])
    got = decode_e2m1(c[0])
    assert np.all(np.abs(got - nearest) <= 2.0)


def test_stochastic_uses_flat_element_index():
    """y = 2.5 (p = 1/2) rounds up exactly when the top bit of flat element i's 16 bits is 1."""
    x = np.full((3, 32), 2.5, dtype=np.float32)
    x[:, ::16] = 6.0  # one 6 per block keeps scale 1 with S = 1
    codes, _, _ = quantize_reference(
        x, rounding="stochastic", seed=2**40 + 5, step=9, global_amax=UNIT_GLOBAL_AMAX
    )
    bits = stochastic_bits16(2**40 + 5, 9, x.size).reshape(x.shape)
    expected = np.where(bits >= 0x8000, 5, 4)
    expected[:, ::16] = 7
    np.testing.assert_array_equal(codes, expected)
