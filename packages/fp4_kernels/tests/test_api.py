"""The public API on the CPU path (numpy arrays and torch CPU tensors) against the oracle,
and its input validation."""

import ml_dtypes
import numpy as np
import pytest

import fp4_kernels as fk
from fp4_kernels.testing import adversarial_blocks, reference_quantization, same_bits

NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def _input(rng, rows, k, dtype, block):
    x = adversarial_blocks(rng, rows, k, block)
    if dtype == "float16":
        x = np.clip(x, -6e4, 6e4)  # keep finite after the cast
    return x.astype(NP_DTYPES[dtype])


def _check(q, x, fmt, rounding, layout, seed=0, step=0, global_amax=None):
    xf = np.asarray(x).astype(np.float32)
    data, scales, gs, deq = reference_quantization(
        xf, fmt, rounding, seed, step, global_amax, layout
    )
    np.testing.assert_array_equal(np.asarray(q.data), data)
    np.testing.assert_array_equal(np.asarray(q.scales), scales)
    assert np.asarray(q.global_scale).reshape(-1)[0].view(np.uint32) == gs.view(np.uint32)
    y = fk.dequantize(q)
    assert same_bits(np.asarray(y), deq.astype(np.asarray(x).dtype))
    return y


@pytest.mark.parametrize("layout", ["linear", "swizzled"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("rows", [1, 3, 129])
def test_numpy_matches_oracle(rng, fmt, dtype, rounding, layout, rows):
    block = fk.FORMATS[fmt]
    x = _input(rng, rows, 4 * block, dtype, block)
    q = fk.quantize(x, fmt=fmt, rounding=rounding, seed=11, step=5, scale_layout=layout)
    assert q.data.dtype == np.uint8 and q.data.shape == (rows, 2 * block)
    y = _check(q, x, fmt, rounding, layout, seed=11, step=5)
    fused = fk.quantize_dequantize(x, fmt=fmt, rounding=rounding, seed=11, step=5)
    assert same_bits(fused, y)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_torch_cpu_tensors_in_and_out(rng, fmt):
    torch = pytest.importorskip("torch")
    block = fk.FORMATS[fmt]
    x = _input(rng, 5, 2 * block, "bfloat16", block)
    t = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).reshape(5, 2 * block)
    q = fk.quantize(t, fmt=fmt)
    assert isinstance(q.data, torch.Tensor) and q.data.dtype == torch.uint8
    qn = fk.quantize(x, fmt=fmt)
    np.testing.assert_array_equal(q.data.numpy(), qn.data)
    np.testing.assert_array_equal(q.scales.numpy(), qn.scales)
    y = fk.dequantize(q)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16
    np.testing.assert_array_equal(y.view(torch.int16).numpy(), fk.dequantize(qn).view(np.int16))
    y32 = fk.dequantize(q, dtype=torch.float32)
    assert y32.dtype == torch.float32
    assert same_bits(y32.numpy(), fk.dequantize(qn, dtype="float32"))


def test_leading_dimensions_are_rows(rng):
    x = rng.standard_normal((2, 3, 4, 32)).astype(np.float32)
    q = fk.quantize(x)
    assert q.data.shape == (2, 3, 4, 16) and q.scales.shape == (2, 3, 4, 2)
    q2 = fk.quantize(x.reshape(24, 32))
    np.testing.assert_array_equal(q.data.reshape(24, 16), q2.data)
    assert fk.dequantize(q).shape == x.shape


def test_global_amax_sets_the_tensor_scale(rng):
    x = rng.standard_normal((4, 64)).astype(np.float32)
    q = fk.quantize(x, global_amax=10.0)
    _check(q, x, "nvfp4", "nearest", "linear", global_amax=10.0)
    q_arr = fk.quantize(x, global_amax=np.array([10.0], np.float32))
    np.testing.assert_array_equal(q.data, q_arr.data)
    assert q.global_scale[0] == np.float32(1) / (np.float32(2688) / np.float32(10))


def test_policies_nan_inf_zero_and_signed_zero():
    x = np.zeros((1, 64), np.float32)
    x[0, 16:32] = 1.0
    x[0, 20] = np.nan
    x[0, 32:48] = -0.0
    x[0, 48:64] = np.linspace(-3, 3, 16)
    x[0, 50] = np.inf
    q = fk.quantize(x)
    y = fk.dequantize(q)
    assert np.all(y[0, :16] == 0) and not np.any(np.signbit(y[0, :16]))  # all-zero block
    assert np.all(np.isnan(y[0, 16:32])) and np.all(np.isnan(y[0, 48:64]))  # non-finite blocks
    assert np.all(y[0, 32:48] == 0) and np.all(np.signbit(y[0, 32:48]))  # -0 preserved
    assert q.scales[0, 1] == 0x7F and q.scales[0, 3] == 0x7F
    # the tensor amax ignored NaN and Inf: it is 3, the largest finite magnitude
    assert q.global_scale[0] == np.float32(1) / (np.float32(2688) / np.float32(3))
    inf_only = fk.quantize(np.array([[np.inf] + [0.0] * 15], np.float32))
    assert inf_only.global_scale[0] == 1.0  # no finite non-zero value: S = 1
    z = fk.quantize(np.zeros((3, 32), np.float32), fmt="mxfp4")
    assert np.all(fk.dequantize(z) == 0)


def test_packing_order_pinned_with_literal_bytes():
    # amax 6 -> S = 448, block scale e4m3(448) = 0x7E, and each value encodes as itself
    x = np.array([[0.5, 1.0, -1.5, 2.0, 3.0, -4.0, 6.0, 0.0] + [0.0] * 8], np.float32)
    q = fk.quantize(x)
    assert q.data[0].tolist() == [0x21, 0x4B, 0xE5, 0x07, 0, 0, 0, 0]
    assert q.scales[0, 0] == 0x7E


def test_stochastic_rounding_is_unbiased_and_reproducible():
    x = np.full((1, 16 * 64), 2.3, np.float32)
    x[0, ::16] = 6.0  # pins every block scale so 2.3 sits between the grid points 2 and 3
    mask = np.ones(x.shape, bool)
    mask[0, ::16] = False
    draws = np.stack(
        [fk.quantize_dequantize(x, rounding="stochastic", step=s)[mask] for s in range(200)]
    )
    n = draws.size
    p = 0.3  # P(round up to 3)
    sigma = np.sqrt(p * (1 - p)) / np.sqrt(n)  # std of the mean, grid gap 1
    assert abs(draws.mean() - 2.3) < 5 * sigma + 1e-6
    lo, hi = np.unique(draws)  # the decoded grid points 2 and 3 (times S * 1/S, not exactly 1)
    assert abs(lo - 2) < 1e-6 and abs(hi - 3) < 1e-6
    a = fk.quantize(x, rounding="stochastic", seed=3, step=9)
    b = fk.quantize(x, rounding="stochastic", seed=3, step=9)
    c = fk.quantize(x, rounding="stochastic", seed=3, step=10)
    np.testing.assert_array_equal(a.data, b.data)
    assert not np.array_equal(a.data, c.data)


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda: fk.quantize(np.zeros((2, 24), np.float32)), ValueError, "x: last dimension K=24"),
        (
            lambda: fk.quantize(np.zeros((2, 48), np.float32), fmt="mxfp4"),
            ValueError,
            "multiple of the MXFP4 block size 32",
        ),
        (lambda: fk.quantize(np.zeros((2, 32), np.int32)), TypeError, "x: dtype int32"),
        (lambda: fk.quantize(np.zeros((32, 4), np.float32).T), ValueError, "x: must be contig"),
        (lambda: fk.quantize(np.float32(1.0)), TypeError, "x: expected"),
        (lambda: fk.quantize(np.zeros((1, 16), np.float32), fmt="fp4"), ValueError, "fmt: 'fp4'"),
        (lambda: fk.quantize(np.zeros((1, 16), np.float32), rounding="up"), ValueError, "rounding"),
        (lambda: fk.quantize(np.zeros((1, 16), np.float32), seed=-1), ValueError, "seed: -1"),
        (lambda: fk.quantize(np.zeros((1, 16), np.float32), step=2**32), ValueError, "step"),
        (
            lambda: fk.quantize(np.zeros((1, 16), np.float32), global_amax=float("nan")),
            ValueError,
            "global_amax",
        ),
        (
            lambda: fk.quantize(np.zeros((1, 32), np.float32), fmt="mxfp4", global_amax=1.0),
            ValueError,
            "global_amax: only NVFP4",
        ),
        (
            lambda: fk.quantize(np.zeros((1, 16), np.float32), scale_layout="tiled"),
            ValueError,
            "scale_layout",
        ),
        (lambda: fk.quantize(np.zeros((), np.float32)), ValueError, "x: a 0-d array"),
        (lambda: fk.dequantize(np.zeros(3)), TypeError, "q: expected a QuantizedTensor"),
        (
            lambda: fk.dequantize(fk.quantize(np.zeros((1, 16), np.float32)), dtype=np.int8),
            TypeError,
            "dtype",
        ),
    ],
)
def test_bad_input_raises_clear_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_empty_rows():
    q = fk.quantize(np.zeros((0, 32), np.float32))
    assert q.data.shape == (0, 16) and q.global_scale[0] == 1.0
    assert fk.dequantize(q).shape == (0, 32)
