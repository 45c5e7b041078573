"""Tests for fp4_kernels.formats.e2m1 against ml_dtypes' float4_e2m1fn and hand-worked cases."""

import ml_dtypes
import numpy as np
import pytest
from _stochastic_cases import ALL_R16, edge_magnitudes, expected_codes

from fp4_kernels.formats.e2m1 import (
    E2M1_MAX,
    E2M1_VALUES,
    decode_e2m1,
    encode_e2m1,
    encode_e2m1_stochastic,
    pack_e2m1,
    unpack_e2m1,
)

ALL_BF16_AS_FLOAT32 = (np.arange(2**16, dtype=np.uint32) << np.uint32(16)).view(np.float32)


def _ml_dtypes_e2m1_codes(y):
    return y.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)


def test_table_matches_ml_dtypes():
    expected = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(E2M1_VALUES, expected)
    np.testing.assert_array_equal(np.signbit(E2M1_VALUES), np.arange(16) >= 8)
    assert E2M1_VALUES.dtype == np.float32
    assert E2M1_MAX == E2M1_VALUES.max()


def test_decode_uses_low_nibble_only():
    codes = np.arange(256, dtype=np.uint8)
    np.testing.assert_array_equal(decode_e2m1(codes), np.tile(E2M1_VALUES, 16))


def test_encode_every_bf16_matches_ml_dtypes_except_nan():
    """E2M1 has no NaN, so a NaN input is outside both specs: ml_dtypes 0.6 gives +NaN -> 0x8 and
    -NaN -> 0x0 (an artefact of its cast); the spec here maps every NaN to 0x0. All else is equal.
    """
    x = ALL_BF16_AS_FLOAT32
    with np.errstate(invalid="ignore"):
        expected = _ml_dtypes_e2m1_codes(x)
    got = encode_e2m1(x)
    nan = np.isnan(x)
    np.testing.assert_array_equal(got[~nan], expected[~nan])
    assert np.all(got[nan] == 0)


def test_encode_random_float32_matches_ml_dtypes(rng):
    x = rng.integers(0, 2**32, size=1_000_000, dtype=np.uint32).view(np.float32)
    x = x[~np.isnan(x)]
    np.testing.assert_array_equal(encode_e2m1(x), _ml_dtypes_e2m1_codes(x))
    near_grid = rng.uniform(-7.0, 7.0, size=1_000_000).astype(np.float32)
    np.testing.assert_array_equal(encode_e2m1(near_grid), _ml_dtypes_e2m1_codes(near_grid))


@pytest.mark.parametrize(
    ("value", "code"),
    [(0.25, 0x0), (0.75, 0x2), (1.25, 0x2), (1.75, 0x4), (2.5, 0x4), (3.5, 0x6), (5.0, 0x6)],
)
def test_ties_round_to_even_code(value, code):
    y = np.array([value, -value], dtype=np.float32)
    np.testing.assert_array_equal(encode_e2m1(y), [code, code | 0x8])


def test_just_past_ties_round_away():
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)
    above = np.nextafter(ties, np.float32(np.inf))
    below = np.nextafter(ties, np.float32(0))
    np.testing.assert_array_equal(encode_e2m1(above), [1, 2, 3, 4, 5, 6, 7])
    np.testing.assert_array_equal(encode_e2m1(below), [0, 1, 2, 3, 4, 5, 6])


def test_signed_zero_and_negatives_rounding_to_zero():
    y = np.array([0.0, -0.0, -1e-30, -0.25, 1e-45, -1e-45], dtype=np.float32)
    np.testing.assert_array_equal(encode_e2m1(y), [0x0, 0x8, 0x8, 0x8, 0x0, 0x8])


def test_saturation():
    big = np.float32(np.finfo(np.float32).max)
    y = np.array([6.0, 6.5, 7.0, 100.0, big, np.inf, -6.0, -7.0, -np.inf], dtype=np.float32)
    np.testing.assert_array_equal(encode_e2m1(y), [7, 7, 7, 7, 7, 7, 0xF, 0xF, 0xF])


def test_nan_encodes_to_positive_zero():
    nan = np.float32(np.nan)
    y = np.array([nan, -nan], dtype=np.float32)
    np.testing.assert_array_equal(encode_e2m1(y), [0, 0])
    rbits = np.array([0, 0xFFFF], dtype=np.uint16)
    np.testing.assert_array_equal(encode_e2m1_stochastic(y, rbits), [0, 0])


def test_every_code_round_trips():
    codes = np.arange(16, dtype=np.uint8)
    np.testing.assert_array_equal(encode_e2m1(decode_e2m1(codes)), codes)


def test_encode_rejects_non_float32():
    with pytest.raises(TypeError, match="y"):
        encode_e2m1(np.array([1.0]))


# --- stochastic rounding -------------------------------------------------------------------


def test_stochastic_hand_cases():
    # 2.5 lies halfway between 2 (code 4) and 3 (code 5): p 2^16 = 2^15, so it rounds up
    # exactly for the upper half of the 16-bit values.
    y = np.full(4, 2.5, dtype=np.float32)
    rbits = np.array([0, 0x7FFF, 0x8000, 0xFFFF], dtype=np.uint16)
    np.testing.assert_array_equal(encode_e2m1_stochastic(y, rbits), [4, 4, 5, 5])
    np.testing.assert_array_equal(encode_e2m1_stochastic(-y, rbits), [0xC, 0xC, 0xD, 0xD])
    # -0.1 rounds to -0 (code 0x8) when it does not round up to -0.5.
    small = np.array([-0.1, -0.1], dtype=np.float32)
    np.testing.assert_array_equal(
        encode_e2m1_stochastic(small, np.array([0xFFFF, 0], dtype=np.uint16)), [0x9, 0x8]
    )
    # Ties of the 16-bit rounding: p 2^16 = 0.5 (2 + 2^-17) rounds up for r = 0xFFFF alone,
    # p 2^16 = 1.5 (2 + 3 2^-17) for the two largest r: floor(p 2^16 + 1/2) of them.
    r = np.array([0xFFFC, 0xFFFD, 0xFFFE, 0xFFFF], dtype=np.uint16)
    np.testing.assert_array_equal(
        encode_e2m1_stochastic(np.full(4, 2 + 2.0**-17, np.float32), r), [4, 4, 4, 5]
    )
    np.testing.assert_array_equal(
        encode_e2m1_stochastic(np.full(4, 2 + 3 * 2.0**-17, np.float32), r), [4, 4, 5, 5]
    )


def test_stochastic_grid_values_and_saturation_never_move():
    y = np.concatenate([E2M1_VALUES, np.array([6.5, 1e30, np.inf, -np.inf], dtype=np.float32)])
    expected = np.concatenate([np.arange(16), [7, 7, 7, 0xF]]).astype(np.uint8)
    for word in (0, 1, 0xFF, 0x100, 0x7FFF, 0x8000, 0xFFFF):
        rbits = np.full(y.shape, word, dtype=np.uint16)
        np.testing.assert_array_equal(encode_e2m1_stochastic(y, rbits), expected)


def test_stochastic_every_random_value_at_the_edges(rng):
    """Every one of the 2^16 random values for each edge magnitude and 200 random ones (both
    signs): the code is lo + 1 exactly for the floor(p 2^16 + 1/2) largest values of r16,
    counted in rational arithmetic."""
    a = np.concatenate(
        [
            edge_magnitudes(),
            rng.uniform(0, 6.5, 100).astype(np.float32),
            rng.integers(0, np.float32(6).view(np.uint32), 100, dtype=np.uint32).view(np.float32),
        ]
    )
    expected = expected_codes(a, ALL_R16)
    for i, v in enumerate(a):
        got = encode_e2m1_stochastic(np.full(ALL_R16.size, v, np.float32), ALL_R16)
        np.testing.assert_array_equal(got, expected[i], err_msg=f"a = {v!r}")
        neg = encode_e2m1_stochastic(np.full(ALL_R16.size, -v, np.float32), ALL_R16)
        sign = 0 if np.isnan(v) else 0x8
        np.testing.assert_array_equal(neg, expected[i] | sign, err_msg=f"a = -{v!r}")


def test_stochastic_is_unbiased_to_2_pow_m17(rng):
    """Averaged over all 2^16 random values, the rounded magnitude is a to within 2^-17 of
    the gap, for random a of every gap (the 16-bit rounding of p is the only bias)."""
    a = rng.uniform(0, 6, 64).astype(np.float32)
    grid = E2M1_VALUES[:8].astype(np.float64)
    for v in a:
        codes = encode_e2m1_stochastic(np.full(ALL_R16.size, v, np.float32), ALL_R16)
        mean = decode_e2m1(codes).astype(np.float64).mean()
        lo = np.searchsorted(grid, v, side="right") - 1
        assert abs(mean - float(v)) <= (grid[lo + 1] - grid[lo]) * 2.0**-17


def test_stochastic_rejects_wrong_dtypes():
    with pytest.raises(TypeError, match="rbits"):
        encode_e2m1_stochastic(np.zeros(2, np.float32), np.zeros(2, np.int64))
    with pytest.raises(TypeError, match="rbits must be uint16"):
        encode_e2m1_stochastic(np.zeros(2, np.float32), np.zeros(2, np.uint32))
    with pytest.raises(TypeError, match="y"):
        encode_e2m1_stochastic(np.zeros(2, np.float64), np.zeros(2, np.uint16))


# --- packing -------------------------------------------------------------------------------


def test_pack_nibble_order_literal():
    np.testing.assert_array_equal(
        pack_e2m1(np.array([1, 2], dtype=np.uint8)), np.array([0x21], dtype=np.uint8)
    )
    np.testing.assert_array_equal(
        pack_e2m1(np.array([[0xF, 0x0, 0x7, 0x8]], dtype=np.uint8)),
        np.array([[0x0F, 0x87]], dtype=np.uint8),
    )
    np.testing.assert_array_equal(
        unpack_e2m1(np.array([0x21, 0xF0], dtype=np.uint8)), [1, 2, 0, 0xF]
    )


def test_pack_round_trip_ragged(rng):
    for shape in [(2,), (1, 16), (3, 34), (129, 32), (2, 3, 64)]:
        codes = rng.integers(0, 16, size=shape, dtype=np.uint8)
        packed = pack_e2m1(codes)
        assert packed.shape == shape[:-1] + (shape[-1] // 2,)
        np.testing.assert_array_equal(unpack_e2m1(packed), codes)


def test_pack_rejects_odd_k_and_wide_codes():
    with pytest.raises(ValueError, match="codes"):
        pack_e2m1(np.zeros((2, 3), dtype=np.uint8))
    with pytest.raises(ValueError, match="codes"):
        pack_e2m1(np.array([16, 0], dtype=np.uint8))
    with pytest.raises(TypeError, match="codes"):
        pack_e2m1(np.array([1, 2]))
