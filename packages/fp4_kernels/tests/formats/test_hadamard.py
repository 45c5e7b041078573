"""formats/hadamard.py: the reference transform against float64 scipy.linalg.hadamard, its stage
order, and the seeded sign vectors."""

import numpy as np
import pytest
import scipy.linalg

from fp4_kernels.formats import hadamard as h

GROUP_SIZES = [16 << i for i in range(10)]  # 16 ... 8192
U_F32 = 2.0**-24  # float32 unit roundoff


def _float64(x, g, signs=None):
    s = np.ones(g) if signs is None else np.asarray(signs, np.float64)
    return (x.reshape(-1, g).astype(np.float64) * s) @ scipy.linalg.hadamard(g) / np.sqrt(g)


@pytest.mark.parametrize("g", GROUP_SIZES)
def test_reference_matches_scipy_within_float32_butterfly_error(rng, g):
    x = rng.standard_normal((3, 2 * g)).astype(np.float32)
    signs = h.hadamard_signs(g, 11)
    y = h.hadamard_reference(x, g, signs=signs).reshape(-1, g)
    exact = _float64(x, g, signs)
    # each of the log2(g) stages rounds every partial sum once (relative error <= u), and the
    # final scaling once more; the partial sums are bounded by the l2 norm times sqrt(g) / sqrt(g)
    # ... which gives |err| <= (log2 g + 1) * u * ||x_group||_2 per element
    bound = (np.log2(g) + 1) * U_F32 * np.linalg.norm(x.reshape(-1, g), axis=1, keepdims=True)
    assert np.all(np.abs(y - exact) <= bound)
    # and not looser than the same-dtype naive product (float32 matmul) by more than 4x
    naive = (x.reshape(-1, g) * signs) @ scipy.linalg.hadamard(g).astype(np.float32)
    naive = naive * np.float32(1 / np.sqrt(g))
    assert np.abs(y - exact).max() <= 4 * np.abs(naive - exact).max() + U_F32


@pytest.mark.parametrize("g", [16, 256, 2048])
def test_inverse_undoes_forward(rng, g):
    x = rng.standard_normal((2, g)).astype(np.float32)
    signs = h.hadamard_signs(g, 3)
    back = h.hadamard_reference(
        h.hadamard_reference(x, g, signs=signs), g, signs=signs, inverse=True
    )
    np.testing.assert_allclose(back, x, rtol=0, atol=4 * np.log2(g) * U_F32 * np.abs(x).max() * 4)
    # and without signs the transform is its own inverse
    back = h.hadamard_reference(h.hadamard_reference(x, g), g)
    np.testing.assert_allclose(back, x, rtol=0, atol=4 * np.log2(g) * U_F32 * np.abs(x).max() * 4)


def test_power_of_four_scaling_is_exact():
    assert h.inv_sqrt_group_size(16) == np.float32(0.25)
    assert h.inv_sqrt_group_size(4096) == np.float32(1 / 64)
    assert h.inv_sqrt_group_size(32) == np.float32(1 / np.sqrt(32))


def test_stage_order_covers_every_bit_once_in_kernel_order():
    assert h.stage_order(16) == (0, 1, 2, 3)
    assert h.stage_order(256) == (0, 1, 7, 2, 3, 4, 5, 6)
    assert h.stage_order(4096) == (0, 1, 7, 8, 2, 3, 4, 5, 6, 9, 10, 11)
    for g in GROUP_SIZES:
        assert sorted(h.stage_order(g)) == list(range(g.bit_length() - 1))


def test_stage_order_matters_in_float32_so_it_is_pinned():
    """Different orders round differently: the reference is only bit-exact in the kernels'."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 256)).astype(np.float32)
    a = h.fwht(x, 256)
    b = h.fwht(x, 256, order=range(8))
    assert not np.array_equal(a, b)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)


def test_signs_are_deterministic_prefixes_and_balanced():
    a = h.hadamard_signs(4096, 123)
    assert np.array_equal(a, h.hadamard_signs(4096, 123))
    assert np.array_equal(h.hadamard_signs(64, 123), a[:64])
    assert not np.array_equal(a, h.hadamard_signs(4096, 124))
    assert set(np.unique(a)) == {-1.0, 1.0}
    assert abs((a < 0).mean() - 0.5) < 0.05  # 4096 fair coin flips: 6 sigma is 0.047
    words = h.sign_words(4096, 123)
    assert np.array_equal(h.sign_values_to_words(a), words)
    assert np.array_equal(h.sign_bits_to_values(words, 4096), a)


def test_signs_of_the_seed_known_answer():
    """Pins the derivation (Philox4x32-10, counter (i // 128, 0, 0, 'HADA'), key = seed): a
    change here changes every randomized transform, so it must be deliberate."""
    from fp4_kernels.formats.philox import philox4x32_10

    w = philox4x32_10(np.array([0, 0, 0, 0x48414441], np.uint32), np.array([7, 0], np.uint32))
    s = h.hadamard_signs(128, 7)
    for i in (0, 5, 31, 32, 100, 127):
        assert s[i] == (-1.0 if (int(w[i // 32]) >> (i % 32)) & 1 else 1.0)


@pytest.mark.parametrize("bad", [8, 24, 16384, 0, -16])
def test_group_size_must_be_a_power_of_two_in_range(bad):
    with pytest.raises(ValueError, match="power of two"):
        h.check_group_size(bad)
    with pytest.raises(TypeError, match="integer"):
        h.check_group_size(16.0)
