"""cuda/reduce.py: the requantized row sum of NVFP4 (amax pass, encode pass) and MXFP4 (one
pass), equal bit for bit to its definition (decode the rows, add them in row order in float32,
quantize the sum: the CPU composition ``requantized_sum_reference``), which is itself checked
against the formats' plain-numpy oracles."""

import dataclasses

import numpy as np
import pytest
from _devices import available_kinds, to_host
from numba import cuda

import fp4_kernels as fk
from fp4_kernels._reduce import requantized_sum_reference
from fp4_kernels.cuda.launch import SIMULATOR, _address, launch_policy
from fp4_kernels.formats import e2m1, mxfp4, nvfp4
from fp4_kernels.testing import same_bits

E8M0_NAN = 0xFF
E4M3_NAN = 0x7F
E4M3_MAX_CODE = 0x7E  # 448
FORMATS = ["nvfp4", "mxfp4"]
BLOCK = {"nvfp4": nvfp4.BLOCK_SIZE, "mxfp4": mxfp4.SPEC.block_size}


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


# A row scale 2^116: 6 * 448 * 2^116 = 2^127.4 is finite, the sum of two such rows is not.
HUGE_ROW_SCALE = np.float32(2.0**116)


def _random_nvfp4(rng, rows, n, nan_blocks=0, huge_blocks=0):
    """A random (rows, n) NVFP4 tensor on the host and its rows' tensor decode scales 1/S
    (float32, between 2^-12 and 2^12, row 0's also the tensor's ``global_scale``): every e2m1
    code, every finite e4m3 scale code (subnormals and 0 included); ``nan_blocks`` blocks get
    the NaN scale; ``huge_blocks`` blocks hold 6 * 448 in every row, whose row scales are then
    ``HUGE_ROW_SCALE``, so that the sum of those blocks overflows (the others' sums need not)."""
    codes = rng.integers(0, 256, (rows, n // 2), dtype=np.uint8)
    scales = rng.integers(0, E4M3_MAX_CODE + 1, (rows, n // 16), dtype=np.uint8)
    row_scales = np.exp2(rng.uniform(-12, 12, rows)).astype(np.float32)
    flat = scales.reshape(-1)
    picks = rng.choice(flat.size, nan_blocks, replace=False) if nan_blocks else []
    flat[picks] = E4M3_NAN
    if huge_blocks:
        row_scales[:] = HUGE_ROW_SCALE
        for b in rng.choice(n // 16, huge_blocks, replace=False):
            scales[:, b] = E4M3_MAX_CODE
            codes[:, b * 8 : (b + 1) * 8] = 0x77
    q = fk.QuantizedTensor(data=codes, scales=scales, global_scale=row_scales[:1].copy(),
                           fmt="nvfp4", shape=(rows, n), dtype="float32",
                           scale_layout="linear")  # fmt: skip
    return q, row_scales


def _random(fmt, rng, rows, n, **kw):
    """(q, row_scales) of a random (rows, n) tensor of ``fmt`` (row_scales None for MXFP4)."""
    if fmt == "mxfp4":
        return _random_mxfp4(rng, rows, n, **kw), None
    return _random_nvfp4(rng, rows, n, **kw)


def _put(a, kind):
    if kind == "numba":
        return cuda.to_device(a)
    if kind == "torch":
        import torch

        return torch.from_numpy(a).cuda()
    import cupy

    return cupy.asarray(a)


def _on_gpu(q, kind="numba"):
    return dataclasses.replace(q, data=_put(q.data, kind), scales=_put(q.scales, kind),
                               global_scale=_put(q.global_scale, kind))  # fmt: skip


def _same(got, expect):
    assert got.shape == expect.shape == (1, expect.shape[1]) and got.fmt == expect.fmt
    np.testing.assert_array_equal(to_host(got.data), expect.data)  # uint8: exact equality
    np.testing.assert_array_equal(to_host(got.scales), expect.scales)
    assert same_bits(to_host(got.global_scale), expect.global_scale)
    if got.fmt == "mxfp4":
        assert same_bits(to_host(got.global_scale), np.ones(1, np.float32))


def _summed(q, row_scales=None, kind="numba"):
    """The kernels' requantized sum of the host tensor ``q`` (and row scales) on the GPU."""
    rs = None if row_scales is None else _put(row_scales, kind)
    return fk.requantized_sum(_on_gpu(q, kind), rs)


# ---------------------------------------------------------------------- the kernels


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_matches_the_composition(kernels, rng, fmt, rows):
    # 160 blocks a row: with the simulator's 64-thread CTAs and 2 of them the grid-stride
    # loop runs twice, the second pass partly filled; NVFP4's amax pass writes 2 partials
    q, row_scales = _random(fmt, rng, rows, 160 * BLOCK[fmt], nan_blocks=1 if rows > 1 else 0)
    _same(_summed(q, row_scales), requantized_sum_reference(q, row_scales))
    if fmt == "nvfp4":  # the tensor's one scale for every row
        _same(_summed(q), requantized_sum_reference(q))


@pytest.mark.parametrize("rows", [1, 2, 4])
def test_each_row_is_decoded_under_its_own_tensor_scale(kernels, rng, rows):
    """Rows quantized apart (amaxes 10^-3 ... 10^3 apart: tensor scales far apart), summed
    with their own 1/S: the decode-add-encode of the separately quantized rows.  With one
    tensor scale for every row (row 0's) the result differs."""
    n = 40 * 16
    xs = [rng.standard_normal((1, n)).astype(np.float32) * np.float32(10.0 ** (3 * r - 3))
          for r in range(rows)]  # fmt: skip
    parts = [fk.quantize(x) for x in xs]
    row_scales = np.concatenate([p.global_scale for p in parts])
    q = fk.QuantizedTensor(
        data=np.concatenate([p.data for p in parts]),
        scales=np.concatenate([p.scales for p in parts]), global_scale=row_scales[:1].copy(),
        fmt="nvfp4", shape=(rows, n), dtype="float32", scale_layout="linear",
    )  # fmt: skip
    decoded = [fk.dequantize(p, "float32") for p in parts]
    acc = decoded[0]
    for d in decoded[1:]:
        acc = acc + d
    expect = fk.quantize(acc)
    got = _summed(q, row_scales)
    _same(got, expect)
    shared = _summed(q)  # row 0's 1/S for every row
    differs = not np.array_equal(to_host(shared.data), expect.data) or not np.array_equal(
        to_host(shared.scales), expect.scales
    )
    assert differs == (rows > 1)


@pytest.mark.parametrize("fmt", FORMATS)
def test_zeros_overflow_and_nan(kernels, rng, fmt):
    b = BLOCK[fmt]
    half = b // 2  # code bytes a block
    q, row_scales = _random(fmt, rng, 2, 8 * b)  # 8 blocks
    if fmt == "nvfp4":  # block scales up to 2 (code 0x40): only blocks 3 and 7 overflow
        q.scales[:] = rng.integers(0, 0x41, q.scales.shape, dtype=np.uint8)
    q.data[:, 0:half] = 0x88  # block 0: -0 in both rows; -0 + -0 stays -0 (code 0x8)
    q.data[0, half : 2 * half] = 0x00  # block 1: +0 + -0 = +0 (code 0x0)
    q.data[1, half : 2 * half] = 0x88
    for blk in (3, 7):  # the largest magnitude in both rows: the sum overflows to infinity
        q.scales[:, blk] = 254 if fmt == "mxfp4" else E4M3_MAX_CODE
        q.data[:, blk * half : (blk + 1) * half] = 0x77
    if fmt == "nvfp4":
        row_scales[:] = HUGE_ROW_SCALE
        q.global_scale[:] = HUGE_ROW_SCALE
    q.scales[0, 5] = E8M0_NAN if fmt == "mxfp4" else E4M3_NAN  # block 5: NaN in one row
    nan_code = E8M0_NAN if fmt == "mxfp4" else E4M3_NAN
    expect = requantized_sum_reference(q, row_scales)
    assert np.all(expect.data[0, 0:half] == 0x88) and np.all(expect.data[0, half : 2 * half] == 0)
    assert [blk for blk in range(8) if expect.scales[0, blk] == nan_code] == [3, 5, 7]
    for blk in (3, 5, 7):
        assert np.all(expect.data[0, blk * half : (blk + 1) * half] == 0)
    _same(_summed(q, row_scales), expect)


def test_an_all_zero_sum_gets_the_tensor_scale_one(kernels, rng):
    """Rows that cancel (x and -x under one scale), and blocks whose sums are all non-finite
    only: the sum's amax is 0, so S = 1, as quantize gives for an all-zero tensor."""
    q, row_scales = _random_nvfp4(rng, 2, 12 * 16)
    q.data[1] = q.data[0] ^ 0x88  # every code's sign flipped
    q.scales[1] = q.scales[0]
    row_scales[1] = row_scales[0]
    expect = requantized_sum_reference(q, row_scales)
    zeros = fk.quantize(np.zeros((1, 12 * 16), np.float32))
    assert same_bits(expect.global_scale, zeros.global_scale)
    assert same_bits(expect.global_scale, np.ones(1, np.float32))
    _same(_summed(q, row_scales), expect)
    q.scales[0, 4] = E4M3_NAN  # one NaN block, every other sum zero: still S = 1
    expect = requantized_sum_reference(q, row_scales)
    assert same_bits(expect.global_scale, np.ones(1, np.float32)) and expect.scales[0, 4] == 0x7F
    _same(_summed(q, row_scales), expect)


@pytest.mark.parametrize("where", ["first", "last"])
def test_the_tensor_amax_is_the_max_over_every_ctas_partial(kernels, rng, where):
    """One block far larger than the rest, in the first CTA's first pass or in the last CTA's
    last pass: the encode pass reduces every partial the amax pass wrote (4 CTAs of 32
    threads, each looping twice over the 200 blocks)."""
    q, row_scales = _random_nvfp4(rng, 3, 200 * 16)
    blk = 0 if where == "first" else 199
    q.scales[:, blk] = E4M3_MAX_CODE
    q.data[:, blk * 8 : (blk + 1) * 8] = 0x77
    with launch_policy(threads=32, max_blocks=4):
        got = _summed(q, row_scales)
    expect = requantized_sum_reference(q, row_scales)
    _same(got, expect)
    one_cta = requantized_sum_reference(_slice_blocks(q, 0, 8), row_scales)  # the first 8
    if where == "last":  # a scale from the first blocks alone would be another
        assert not same_bits(one_cta.global_scale, expect.global_scale)


def _slice_blocks(q, lo, hi):
    b = BLOCK[q.fmt]
    return dataclasses.replace(
        q, data=np.ascontiguousarray(q.data[:, lo * b // 2 : hi * b // 2]),
        scales=np.ascontiguousarray(q.scales[:, lo:hi]), shape=(q.shape[0], (hi - lo) * b),
    )  # fmt: skip


@pytest.mark.parametrize("fmt,offset", [("nvfp4", 4), ("nvfp4", 8), ("mxfp4", 4), ("mxfp4", 8)])
def test_codes_offset_from_alignment(kernels, rng, fmt, offset):
    """Codes that start ``offset`` bytes into an allocation: a block's codes in one vector load
    where they are aligned to a block's codes (8 bytes NVFP4, 16 MXFP4), else byte by byte."""
    q, row_scales = _random(fmt, rng, 3, 20 * BLOCK[fmt])
    flat = np.zeros(q.data.size + 16, np.uint8)
    base = cuda.to_device(flat)
    data = base[offset : offset + q.data.size].reshape(q.data.shape)
    data.copy_to_device(q.data)
    align = BLOCK[fmt] // 2
    aligned = (offset % align == 0) and _address(base, SIMULATOR) % 16 == 0
    assert aligned == (_address(data, SIMULATOR) % align == 0)
    g = dataclasses.replace(_on_gpu(q), data=data)
    got = fk.requantized_sum(g, None if row_scales is None else cuda.to_device(row_scales))
    _same(got, requantized_sum_reference(q, row_scales))


# ---------------------------------------------------------------------- the definition


def test_sum_is_the_float32_sum_of_the_decoded_rows(rng):
    """The MXFP4 reference itself, against an independent float64 computation: the sum of the
    decoded rows is exact in float64, so quantizing it in float32 gives the same codes as long
    as the float32 sum is exact too (small exponent range: it is)."""
    q = _random_mxfp4(rng, 3, 128, scale_lo=125, scale_hi=129)
    d = fk.dequantize(q, "float32").astype(np.float64)
    # row by row, as the definition adds: numpy's d.sum(axis=0) may start from +0, which
    # turns a column of -0 into +0 (a signed-zero difference that made this test flaky)
    exact = ((d[0] + d[1]) + d[2]).astype(np.float32)
    _same(requantized_sum_reference(q), fk.quantize(exact[None], fmt="mxfp4"))


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_nvfp4_reference_is_the_oracles_composition(rng, rows):
    """The NVFP4 reference with row scales against the format's plain-numpy oracle: each row
    decoded by ``nvfp4.dequantize_reference`` under its scale, added in row order in float32,
    encoded by ``nvfp4.quantize_reference``."""
    q, row_scales = _random_nvfp4(rng, rows, 24 * 16, nan_blocks=1)
    codes = e2m1.unpack_e2m1(q.data)
    decoded = [
        nvfp4.dequantize_reference(codes[r], q.scales[r], row_scales[r]) for r in range(rows)
    ]
    acc = decoded[0]
    for d in decoded[1:]:
        acc = acc + d
    c, s, gs = nvfp4.quantize_reference(acc[None])
    got = requantized_sum_reference(q, row_scales)
    np.testing.assert_array_equal(got.data, e2m1.pack_e2m1(c))
    np.testing.assert_array_equal(got.scales, s)
    assert same_bits(got.global_scale, np.array([gs], np.float32))


def test_row_scales_of_torch_cpu_tensors_take_the_composition(rng):
    torch = pytest.importorskip("torch")
    q, row_scales = _random_nvfp4(rng, 3, 8 * 16)
    t = dataclasses.replace(q, data=torch.from_numpy(q.data), scales=torch.from_numpy(q.scales),
                            global_scale=torch.from_numpy(q.global_scale))  # fmt: skip
    got = fk.requantized_sum(t, torch.from_numpy(row_scales))
    _same(got, requantized_sum_reference(q, row_scales))


# ---------------------------------------------------------------------- bad input


def test_bad_input_is_rejected(rng):
    q = _random_mxfp4(rng, 2, 64)
    with pytest.raises(TypeError, match="q: expected a QuantizedTensor"):
        fk.requantized_sum(q.data)
    flat = dataclasses.replace(q, data=q.data.reshape(-1), scales=q.scales.reshape(-1),
                               shape=(128,))  # fmt: skip
    with pytest.raises(ValueError, match=r"q.shape: \(128,\): expected \(rows, n\)"):
        fk.requantized_sum(flat)


def test_bad_row_scales_are_rejected(rng):
    q, row_scales = _random_nvfp4(rng, 3, 32)
    m = _random_mxfp4(rng, 3, 64)
    with pytest.raises(ValueError, match="row_scales: mxfp4 has no tensor scale.*row_scales=None"):
        fk.requantized_sum(m, row_scales)
    with pytest.raises(TypeError, match=r"row_scales: dtype float64; .*float32"):
        fk.requantized_sum(q, row_scales.astype(np.float64))
    with pytest.raises(ValueError, match="row_scales: 2 elements for 3 rows; pass one"):
        fk.requantized_sum(q, row_scales[:2])
    with pytest.raises(ValueError, match="row_scales: must be C-contiguous"):
        fk.requantized_sum(q, np.repeat(row_scales, 2)[::2])
    with pytest.raises(TypeError, match="row_scales: expected a numpy array"):
        fk.requantized_sum(q, list(row_scales))
    with pytest.raises(ValueError, match="row_scales: must live where q.data lives"):
        fk.requantized_sum(q, cuda.to_device(row_scales))
    with pytest.raises(ValueError, match="row_scales: must live where q.data lives"):
        fk.requantized_sum(_on_gpu(q), row_scales)
    with pytest.raises(ValueError, match="row_scales: mxfp4"):
        requantized_sum_reference(m, row_scales)


def test_row_scales_need_the_linear_scale_layout():
    q = fk.quantize(np.ones((4, 64), np.float32), scale_layout="swizzled")
    with pytest.raises(ValueError, match="row_scales: needs the linear scale layout"):
        fk.requantized_sum(q, np.ones(4, np.float32))


# ---------------------------------------------------------------------- on a GPU, full size


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [2, 4])
@pytest.mark.parametrize("kind", available_kinds(True))
def test_full_size_bit_exact(gpu, rng, fmt, rows, kind):
    q, row_scales = _random(fmt, rng, rows, (1 << 22) + 6 * BLOCK[fmt], nan_blocks=7,
                            huge_blocks=5)  # fmt: skip
    _same(_summed(q, row_scales, kind), requantized_sum_reference(q, row_scales))
    if fmt == "nvfp4":
        q, row_scales = _random(fmt, rng, rows, (1 << 22) + 6 * BLOCK[fmt], nan_blocks=7)
        _same(_summed(q, row_scales, kind), requantized_sum_reference(q, row_scales))
        _same(_summed(q, None, kind), requantized_sum_reference(q))
