"""Tests for fp4_kernels.formats.e4m3 against ml_dtypes' float8_e4m3fn and hand-worked cases."""

import ml_dtypes
import numpy as np
import pytest

from fp4_kernels.formats.e4m3 import E4M3_MAX, E4M3_NAN, E4M3_VALUES, decode_e4m3, encode_e4m3

ALL_BF16_AS_FLOAT32 = (np.arange(2**16, dtype=np.uint32) << np.uint32(16)).view(np.float32)
ALL_FP16_AS_FLOAT32 = (
    np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
)

# ml_dtypes' float8_e4m3fn cast is round-to-nearest-even WITHOUT saturation: a value rounds as if
# the exponent range continued, and a result past 448 is NaN. 464 is the midpoint between 448
# (mantissa 110, even) and the would-be 480 (mantissa 111), so |x| <= 464 still gives 448.
ML_DTYPES_LAST_TO_448 = 464.0


def _assert_matches_ml_dtypes(x):
    """encode_e4m3(x) equals ml_dtypes' cast except exactly where the documented semantics differ.

    - NaN: ours is always 0x7F; ml_dtypes keeps the sign (0x7F / 0xFF).
    - |x| > 464 (incl. Inf): ours saturates to 0x7E | sign; ml_dtypes gives NaN.
    """
    with np.errstate(invalid="ignore", over="ignore"):
        expected = x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        out_of_range = np.abs(x) > np.float32(ML_DTYPES_LAST_TO_448)
    got = encode_e4m3(x)
    nan = np.isnan(x)
    sign = np.where(np.signbit(x), 0x80, 0)
    np.testing.assert_array_equal(got[nan], E4M3_NAN)
    np.testing.assert_array_equal(expected[nan], (E4M3_NAN | sign)[nan])
    np.testing.assert_array_equal(got[out_of_range], (0x7E | sign)[out_of_range])
    np.testing.assert_array_equal(expected[out_of_range], (E4M3_NAN | sign)[out_of_range])
    same = ~nan & ~out_of_range
    np.testing.assert_array_equal(got[same], expected[same])


def test_table_matches_ml_dtypes():
    expected = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(E4M3_VALUES, expected)  # NaN positions must coincide
    np.testing.assert_array_equal(np.signbit(E4M3_VALUES), np.arange(256) >= 0x80)
    assert np.flatnonzero(np.isnan(E4M3_VALUES)).tolist() == [0x7F, 0xFF]
    np.testing.assert_array_equal(decode_e4m3(np.arange(256, dtype=np.uint8)), expected)


def test_table_literals():
    assert E4M3_VALUES[0x7E] == E4M3_MAX == 448.0
    assert E4M3_VALUES[0x38] == 1.0  # exponent field 7 = bias
    assert E4M3_VALUES[0x08] == 2.0**-6  # smallest normal
    assert E4M3_VALUES[0x01] == 2.0**-9  # smallest subnormal
    assert E4M3_VALUES[0x07] == 7 * 2.0**-9  # largest subnormal
    assert E4M3_VALUES[0x80] == 0.0 and np.signbit(E4M3_VALUES[0x80])


def test_encode_every_bf16_matches_ml_dtypes():
    _assert_matches_ml_dtypes(ALL_BF16_AS_FLOAT32)


def test_encode_every_fp16_matches_ml_dtypes():
    _assert_matches_ml_dtypes(ALL_FP16_AS_FLOAT32)


def test_encode_random_float32_matches_ml_dtypes(rng):
    bits = rng.integers(0, 2**32, size=1_000_000, dtype=np.uint32).view(np.float32)
    _assert_matches_ml_dtypes(bits)
    # Concentrate on the representable range, where most of the rounding happens.
    in_range = (
        rng.choice([-1, 1], size=1_000_000) * np.exp2(rng.uniform(-12, 9.5, size=1_000_000))
    ).astype(np.float32)
    _assert_matches_ml_dtypes(in_range)


def test_every_code_round_trips():
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], dtype=np.uint8)
    np.testing.assert_array_equal(encode_e4m3(decode_e4m3(codes)), codes)


@pytest.mark.parametrize(
    ("value", "code"),
    [
        (2.0**-10, 0x00),  # half the smallest subnormal: tie to 0
        (3 * 2.0**-10, 0x02),  # 1.5 subnormal ulps: tie between m=1 and m=2 -> 2
        (5 * 2.0**-10, 0x02),  # 2.5 subnormal ulps: tie -> 2
        (15 * 2.0**-10, 0x08),  # between 7 * 2**-9 (0x07) and 2**-6 (0x08): tie -> 0x08
        (1.0 + 1 / 16, 0x38),  # between 1.0 (0x38) and 1.125 (0x39) -> 0x38
        (1.0 + 3 / 16, 0x3A),  # between 1.125 (0x39) and 1.25 (0x3A) -> 0x3A
        (1.9375, 0x40),  # between 1.875 (0x3F) and 2.0 (0x40): rounds into the next binade
        (432.0, 0x7E),  # between 416 (0x7D) and 448 (0x7E) -> 0x7E
    ],
)
def test_ties_round_to_even(value, code):
    v = np.array([value, -value], dtype=np.float32)
    np.testing.assert_array_equal(encode_e4m3(v), [code, code | 0x80])


def test_saturation_zero_and_nan():
    big = np.finfo(np.float32).max
    v = np.array([448.0, 449.0, 464.0, 480.0, 1e30, big, np.inf, -500.0, -np.inf], dtype=np.float32)
    np.testing.assert_array_equal(encode_e4m3(v), [0x7E] * 7 + [0xFE, 0xFE])
    v = np.array([0.0, -0.0, 1e-30, -1e-30, np.nan, -np.nan], dtype=np.float32)
    np.testing.assert_array_equal(encode_e4m3(v), [0x00, 0x80, 0x00, 0x80, 0x7F, 0x7F])


def test_subnormal_scales_kept():
    v = (np.arange(1, 8) * 2.0**-9).astype(np.float32)
    np.testing.assert_array_equal(encode_e4m3(v), np.arange(1, 8))
    np.testing.assert_array_equal(decode_e4m3(np.arange(1, 8, dtype=np.uint8)), v)


def test_rejects_wrong_dtypes():
    with pytest.raises(TypeError, match="v"):
        encode_e4m3(np.array([1.0]))
    with pytest.raises(TypeError, match="codes"):
        decode_e4m3(np.array([1]))
