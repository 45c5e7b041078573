"""Tests for fp4_kernels.formats.e8m0 against exact powers of two and ml_dtypes' float8_e8m0fnu."""

import ml_dtypes
import numpy as np
import pytest

from fp4_kernels.formats.e8m0 import E8M0_BIAS, E8M0_NAN, decode_e8m0, encode_e8m0_exponent


def test_decode_every_code():
    codes = np.arange(256, dtype=np.uint8)
    got = decode_e8m0(codes)
    assert got.dtype == np.float32
    for c in range(255):
        assert float(got[c]) == 2.0 ** (c - 127), c  # python float: exact
    assert np.isnan(got[E8M0_NAN])
    np.testing.assert_array_equal(got, codes.view(ml_dtypes.float8_e8m0fnu).astype(np.float32))


def test_code_zero_is_float32_subnormal():
    v = decode_e8m0(np.array([0], dtype=np.uint8))[0]
    assert v == np.float32(2.0**-127)
    assert 0 < v < np.finfo(np.float32).smallest_normal


def test_encode_exponent_clamps_and_never_gives_nan():
    e = np.array([-1000, -128, -127, -1, 0, 1, 127, 128, 1000])
    np.testing.assert_array_equal(encode_e8m0_exponent(e), [0, 0, 0, 126, 127, 128, 254, 254, 254])
    assert E8M0_BIAS == 127


def test_encode_decode_round_trip(rng):
    e = rng.integers(-127, 128, size=10_000)
    np.testing.assert_array_equal(
        decode_e8m0(encode_e8m0_exponent(e)), np.ldexp(1.0, e).astype(np.float32)
    )


def test_rejects_wrong_dtypes():
    with pytest.raises(TypeError, match="e"):
        encode_e8m0_exponent(np.array([1.0]))
    with pytest.raises(TypeError, match="codes"):
        decode_e8m0(np.array([1]))
