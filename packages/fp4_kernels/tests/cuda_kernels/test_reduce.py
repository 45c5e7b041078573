"""cuda/reduce.py: the one-pass MXFP4 requantized row sum, equal bit for bit to its definition
(decode the rows, add them in row order in float32, quantize the sum: the CPU composition)."""

import dataclasses

import numpy as np
import pytest
from _devices import available_kinds, to_host
from numba import cuda

import fp4_kernels as fk
from fp4_kernels._reduce import requantized_sum_reference
from fp4_kernels.testing import same_bits

E8M0_NAN = 0xFF


def _random_mxfp4(rng, rows, n, scale_lo=110, scale_hi=140, nan_blocks=0, huge_blocks=0):
    """A random (rows, n) MXFP4 tensor on the host: every e2m1 code (both zeros included) and
    scales 2^(scale - 127); ``nan_blocks`` blocks get the NaN scale, ``huge_blocks`` blocks the
    largest scale (2^127) in every row, so that their sum overflows to infinity."""
    codes = rng.integers(0, 256, (rows, n // 2), dtype=np.uint8)
    scales = rng.integers(scale_lo, scale_hi, (rows, n // 32), dtype=np.uint8)
    flat = scales.reshape(-1)
    picks = rng.choice(flat.size, nan_blocks, replace=False) if nan_blocks else []
    flat[picks] = E8M0_NAN
    for b in rng.choice(n // 32, huge_blocks, replace=False) if huge_blocks else []:
        scales[:, b] = 254
        codes[:, b * 16 : (b + 1) * 16] = 0x77  # 6.0 in both nibbles: 6 * 2^127 per row
    return fk.QuantizedTensor(data=codes, scales=scales, global_scale=np.ones(1, np.float32),
                              fmt="mxfp4", shape=(rows, n), dtype="float32",
                              scale_layout="linear")  # fmt: skip


def _on_gpu(q, kind):
    def put(a):
        if kind == "numba":
            return cuda.to_device(a)
        if kind == "torch":
            import torch

            return torch.from_numpy(a).cuda()
        import cupy

        return cupy.asarray(a)

    return dataclasses.replace(q, data=put(q.data), scales=put(q.scales),
                               global_scale=put(q.global_scale))  # fmt: skip


def _same(got, expect):
    assert got.shape == expect.shape == (1, expect.shape[1]) and got.fmt == "mxfp4"
    np.testing.assert_array_equal(to_host(got.data), expect.data)  # uint8: exact equality
    np.testing.assert_array_equal(to_host(got.scales), expect.scales)
    assert same_bits(to_host(got.global_scale), np.ones(1, np.float32))


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_matches_the_composition(kernels, rng, rows):
    # 3 MXFP4 blocks per row: with the simulator's 64-thread blocks and 2 CTAs the grid-stride
    # loop runs partly filled tiles
    q = _random_mxfp4(rng, rows, 96 * 3, nan_blocks=1 if rows > 1 else 0)
    _same(fk.requantized_sum(_on_gpu(q, "numba")), requantized_sum_reference(q))


def test_zeros_overflow_and_nan(kernels, rng):
    q = _random_mxfp4(rng, 2, 256)  # 8 blocks of 32
    q.data[:, 0:16] = 0x88  # block 0: -0 in both rows; -0 + -0 stays -0 (code 0x8)
    q.data[0, 16:32] = 0x00  # block 1: +0 + -0 = +0 (code 0x0)
    q.data[1, 16:32] = 0x88
    for b in (3, 7):  # 6 * 2^127 in both rows: the sum overflows to infinity
        q.scales[:, b] = 254
        q.data[:, b * 16 : (b + 1) * 16] = 0x77
    q.scales[0, 5] = E8M0_NAN  # block 5: NaN in one row
    expect = requantized_sum_reference(q)
    assert np.all(expect.data[0, 0:16] == 0x88) and np.all(expect.data[0, 16:32] == 0x00)
    assert [b for b in range(8) if expect.scales[0, b] == E8M0_NAN] == [3, 5, 7]
    assert np.all(expect.data[0, 48:64] == 0) and np.all(expect.data[0, 80:96] == 0)
    _same(fk.requantized_sum(_on_gpu(q, "numba")), expect)


def test_sum_is_the_float32_sum_of_the_decoded_rows(rng):
    """The reference itself, against an independent float64 computation: the sum of the
    decoded rows is exact in float64, so quantizing it in float32 gives the same codes as long
    as the float32 sum is exact too (small exponent range: it is)."""
    q = _random_mxfp4(rng, 3, 128, scale_lo=125, scale_hi=129)
    d = fk.dequantize(q, "float32").astype(np.float64)
    # row by row, as the definition adds: numpy's d.sum(axis=0) may start from +0, which
    # turns a column of -0 into +0 (a signed-zero difference that made this test flaky)
    exact = ((d[0] + d[1]) + d[2]).astype(np.float32)
    _same(requantized_sum_reference(q), fk.quantize(exact[None], fmt="mxfp4"))


def test_bad_input_is_rejected(rng):
    q = _random_mxfp4(rng, 2, 64)
    with pytest.raises(TypeError, match="q: expected a QuantizedTensor"):
        fk.requantized_sum(q.data)
    flat = dataclasses.replace(q, data=q.data.reshape(-1), scales=q.scales.reshape(-1),
                               shape=(128,))  # fmt: skip
    with pytest.raises(ValueError, match=r"q.shape: \(128,\): expected \(rows, n\)"):
        fk.requantized_sum(flat)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [2, 4])
@pytest.mark.parametrize("kind", available_kinds(True))
def test_full_size_bit_exact(gpu, rng, rows, kind):
    q = _random_mxfp4(rng, rows, (1 << 22) + 96, nan_blocks=7, huge_blocks=5)
    _same(fk.requantized_sum(_on_gpu(q, kind)), requantized_sum_reference(q))
