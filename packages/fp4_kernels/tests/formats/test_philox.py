"""Tests for fp4_kernels.formats.philox: Random123 known answers and a scalar pure-Python Philox."""

import numpy as np
import pytest

from fp4_kernels.formats.philox import philox4x32_10, stochastic_bits16

# Random123 kat_vectors, "philox4x32 10": counter, key, expected output.
RANDOM123_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (
        (0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF),
        (0xFFFFFFFF, 0xFFFFFFFF),
        (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD),
    ),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


def _philox_scalar(counter, key):
    """Philox4x32-10 on Python ints from the Random123 round definition (independent of numpy)."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(10):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (
            (p1 >> 32) ^ c1 ^ k0,
            p1 & 0xFFFFFFFF,
            (p0 >> 32) ^ c3 ^ k1,
            p0 & 0xFFFFFFFF,
        )
    return c0, c1, c2, c3


@pytest.mark.parametrize(("counter", "key", "expected"), RANDOM123_KAT)
def test_random123_known_answers(counter, key, expected):
    got = philox4x32_10(np.array(counter, dtype=np.uint32), np.array(key, dtype=np.uint32))
    np.testing.assert_array_equal(got, np.array(expected, dtype=np.uint32))
    assert _philox_scalar(counter, key) == expected


def test_batched_matches_scalar(rng):
    counters = rng.integers(0, 2**32, size=(200, 4), dtype=np.uint32)
    keys = rng.integers(0, 2**32, size=(200, 2), dtype=np.uint32)
    got = philox4x32_10(counters, keys)
    expected = [
        _philox_scalar(tuple(map(int, c)), tuple(map(int, k)))
        for c, k in zip(counters, keys, strict=True)
    ]
    np.testing.assert_array_equal(got, np.array(expected, dtype=np.uint32))
    # One key broadcast over many counters.
    np.testing.assert_array_equal(
        philox4x32_10(counters, keys[0]), philox4x32_10(counters, np.tile(keys[0], (200, 1)))
    )


def test_stochastic_bits16_counter_and_key_layout(rng):
    seed = int(rng.integers(0, 2**64, dtype=np.uint64))
    step = int(rng.integers(0, 2**32, dtype=np.uint64))
    n = 8 * 25 + 5  # a ragged tail: the last Philox call is only partly used
    got = stochastic_bits16(seed, step, n)
    assert got.dtype == np.uint16 and got.shape == (n,)
    key = (seed & 0xFFFFFFFF, seed >> 32)
    for i in range(n):
        c = i // 8
        word = _philox_scalar((c & 0xFFFFFFFF, c >> 32, step, 0), key)[(i % 8) // 2]
        half = word & 0xFFFF if i % 2 == 0 else word >> 16  # the low half first
        assert got[i] == half, i


def test_stochastic_bits16_prefix_and_sensitivity():
    base = stochastic_bits16(5, 7, 1000)
    np.testing.assert_array_equal(stochastic_bits16(5, 7, 37), base[:37])
    np.testing.assert_array_equal(stochastic_bits16(5, 7, 1000), base)
    assert stochastic_bits16(5, 7, 0).shape == (0,)
    for other in (
        stochastic_bits16(5, 8, 1000),
        stochastic_bits16(6, 7, 1000),
        stochastic_bits16(5 + 2**32, 7, 1000),
    ):
        assert np.mean(other == base) < 0.01
    # Eight consecutive elements come from one call, each from its own 16 bits.
    assert len(set(base[:8].tolist())) == 8


def test_stochastic_bits16_extreme_arguments():
    stochastic_bits16(2**64 - 1, 2**32 - 1, 8)
    stochastic_bits16(0, 0, 8)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"seed": -1, "step": 0, "n": 4}, "seed"),
        ({"seed": 2**64, "step": 0, "n": 4}, "seed"),
        ({"seed": 0, "step": -1, "n": 4}, "step"),
        ({"seed": 0, "step": 2**32, "n": 4}, "step"),
        ({"seed": 0, "step": 0, "n": -1}, "n"),
    ],
)
def test_stochastic_bits16_rejects_out_of_range(kwargs, name):
    with pytest.raises(ValueError, match=name):
        stochastic_bits16(**kwargs)


def test_philox_rejects_bad_shapes():
    with pytest.raises(ValueError, match="counter"):
        philox4x32_10(np.zeros(3, dtype=np.uint32), np.zeros(2, dtype=np.uint32))
    with pytest.raises(ValueError, match="key"):
        philox4x32_10(np.zeros(4, dtype=np.uint32), np.zeros(2, dtype=np.int64))
