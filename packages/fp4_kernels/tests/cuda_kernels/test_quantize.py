"""cuda/quantize.py (+ cuda/amax.py, and the fused fake-quant): GPU kernels against the numpy
oracle, bit for bit.  Small cases run in the simulator (CI) and on a real GPU; full sizes
(>= 2^24 elements) only on a real GPU."""

import functools

import numpy as np
import pytest
from _devices import NP_DTYPES, available_kinds, to_gpu, to_host
from conftest import REAL_GPU

import fp4_kernels as fk
from fp4_kernels.cuda import launch
from fp4_kernels.testing import adversarial_blocks, random_seed, reference_quantization, same_bits

KINDS = available_kinds(REAL_GPU)


def _data(rng, rows, k, dtype, block):
    x = adversarial_blocks(rng, rows, k, block)
    if dtype == "float16":
        x = np.clip(x, -6e4, 6e4)
    return x.astype(NP_DTYPES[dtype])


def _assert_matches_oracle(q, x, fmt, rounding, layout, seed, step, global_amax=None):
    data, scales, gs, deq = reference_quantization(
        np.asarray(x, np.float32), fmt, rounding, seed, step, global_amax, layout
    )
    np.testing.assert_array_equal(to_host(q.data), data)
    np.testing.assert_array_equal(to_host(q.scales), scales)
    assert to_host(q.global_scale).view(np.uint32)[0] == gs.view(np.uint32)
    return deq


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "fmt,dtype,rounding,layout,rows",
    [
        ("nvfp4", "float32", "nearest", "linear", 3),
        ("nvfp4", "bfloat16", "stochastic", "swizzled", 5),
        ("nvfp4", "float16", "nearest", "swizzled", 1),
        ("nvfp4", "bfloat16", "nearest", "linear", 129),
        ("mxfp4", "bfloat16", "nearest", "linear", 3),
        ("mxfp4", "float32", "stochastic", "swizzled", 2),
        ("mxfp4", "float16", "stochastic", "linear", 1),
    ],
)
def test_quantize_matches_oracle(kernels, rng, kind, fmt, dtype, rounding, layout, rows):
    block = fk.FORMATS[fmt]
    k = 16 if rows > 100 else 4 * block  # the 129-row case keeps the simulator quick
    if fmt == "mxfp4" and k < 32:
        k = 32
    x = _data(rng, rows, k, dtype, block)
    q = fk.quantize(
        to_gpu(x, kind), fmt=fmt, rounding=rounding, seed=2**40 + 3, step=77, scale_layout=layout
    )
    deq = _assert_matches_oracle(q, x, fmt, rounding, layout, 2**40 + 3, 77)
    y = to_host(fk.dequantize(q))
    assert same_bits(y, deq.astype(x.dtype))
    fused = to_host(
        fk.quantize_dequantize(to_gpu(x, kind), fmt=fmt, rounding=rounding, seed=2**40 + 3, step=77)
    )
    assert same_bits(fused, y)


def test_global_amax_scalar_and_device_array(kernels, rng):
    x = rng.standard_normal((2, 64)).astype(np.float32)
    q = fk.quantize(to_gpu(x, "numba"), global_amax=3.5)
    _assert_matches_oracle(q, x, "nvfp4", "nearest", "linear", 0, 0, global_amax=3.5)
    q_dev = fk.quantize(
        to_gpu(x, "numba"), global_amax=to_gpu(np.array([3.5], np.float32), "numba")
    )
    np.testing.assert_array_equal(to_host(q_dev.data), to_host(q.data))
    np.testing.assert_array_equal(to_host(q_dev.global_scale), to_host(q.global_scale))


def test_stochastic_rounding_does_not_depend_on_the_launch(kernels, rng):
    x = rng.standard_normal((4, 64)).astype(np.float32)
    outs = []
    for cfg in ((32, 1), (64, 3)) if kernels == "simulator" else ((32, 1), (256, 7), (None, None)):
        with launch.launch_policy(*cfg):
            q = fk.quantize(to_gpu(x, "numba"), rounding="stochastic", seed=5, step=1)
        outs.append(to_host(q.data))
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])
    np.testing.assert_array_equal(
        outs[0], fk.quantize(x, rounding="stochastic", seed=5, step=1).data
    )


def test_nonfinite_blocks_and_amax(kernels):
    x = np.zeros((2, 32), np.float32)
    x[0, :16] = np.linspace(-2, 2, 16)
    x[0, 3] = np.nan
    x[1, 16:] = 7.0
    x[1, 20] = -np.inf
    q = fk.quantize(to_gpu(x, "numba"))
    _assert_matches_oracle(q, x, "nvfp4", "nearest", "linear", 0, 0)
    y = to_host(fk.dequantize(q))
    assert np.all(np.isnan(y[0, :16])) and np.all(np.isnan(y[1, 16:]))
    assert np.all(y[0, 16:] == 0) and np.all(y[1, :16] == 0)


_FULL_SEED = random_seed("test_full_size_bit_exact")


@functools.cache
def _full_case(fmt, rounding, dtype):
    """2^24 + 7*4096 elements of adversarial data and the oracle's answer, shared by kinds."""
    rng = np.random.default_rng([_FULL_SEED, len(fmt), len(rounding), len(dtype)])
    x = _data(rng, 4096 + 7, 4096, dtype, fk.FORMATS[fmt])
    layout = "swizzled" if rounding == "nearest" else "linear"
    ref = reference_quantization(np.asarray(x, np.float32), fmt, rounding, 1234, 99, None, layout)
    return x, layout, ref


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
def test_full_size_bit_exact(gpu, dtype, rounding, fmt, kind):
    """>= 2^24 elements of adversarial data per case, every output bit against the oracle."""
    print(f"full-size data seed {_FULL_SEED}")
    x, layout, (data, scales, gs, deq) = _full_case(fmt, rounding, dtype)
    q = fk.quantize(
        to_gpu(x, kind), fmt=fmt, rounding=rounding, seed=1234, step=99, scale_layout=layout
    )
    np.testing.assert_array_equal(to_host(q.data), data)
    np.testing.assert_array_equal(to_host(q.scales), scales)
    assert to_host(q.global_scale).view(np.uint32)[0] == gs.view(np.uint32)
    expect = deq.astype(x.dtype)
    assert same_bits(to_host(fk.dequantize(q)), expect)
    fused = fk.quantize_dequantize(to_gpu(x, kind), fmt=fmt, rounding=rounding, seed=1234, step=99)
    assert same_bits(to_host(fused), expect)
