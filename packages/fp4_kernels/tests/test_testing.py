"""fp4_kernels.testing: the simulator's warp shuffles behave as the hardware's."""

import numpy as np
import pytest
from numba import cuda

from fp4_kernels.testing import adversarial_blocks, same_bits


def test_warp_shuffles(kernels):
    @cuda.jit
    def shuffles(out):
        t = cuda.threadIdx.x
        out[0, t] = cuda.shfl_xor_sync(0xFFFFFFFF, t, 5)
        out[1, t] = cuda.shfl_down_sync(0xFFFFFFFF, t, 3)
        out[2, t] = cuda.shfl_up_sync(0xFFFFFFFF, t, 2)
        out[3, t] = cuda.shfl_sync(0xFFFFFFFF, t, 7)

    out = cuda.to_device(np.zeros((4, 64), np.int64))
    shuffles[1, 64](out)
    got = out.copy_to_host()
    t = np.arange(64)
    lane = t % 32
    base = t - lane
    np.testing.assert_array_equal(got[0], base + (lane ^ 5))
    np.testing.assert_array_equal(got[1], np.where(lane + 3 < 32, t + 3, t))
    np.testing.assert_array_equal(got[2], np.where(lane >= 2, t - 2, t))
    np.testing.assert_array_equal(got[3], base + 7)


def test_adversarial_blocks_cover_the_cases(rng):
    x = adversarial_blocks(rng, 64, 64)
    assert np.isnan(x).any() and np.isinf(x).any() and (x == 0).any()
    assert (np.signbit(x) & (x == 0)).any()
    tiny = np.abs(x[np.isfinite(x) & (x != 0)]).min()
    assert tiny < np.finfo(np.float32).tiny  # float32 subnormals present


def test_same_bits():
    a = np.array([1.0, np.nan, -0.0], np.float32)
    assert same_bits(a, a.copy())
    assert not same_bits(a, np.array([1.0, np.nan, 0.0], np.float32))
    with pytest.raises(AssertionError):
        assert same_bits(a, a.astype(np.float16))
