"""cuda/quantize_dequantize.py: the one-kernel fake quantization against the numpy oracle
(quantize then dequantize, ``formats``) and against the GPU's own quantize -> dequantize, bit
for bit (NaN payloads aside).  Small cases run in the simulator (CI) and on a real GPU; full
sizes only on a real GPU."""

import functools

import numpy as np
import pytest
from _devices import NP_DTYPES, available_kinds, to_gpu, to_host
from conftest import REAL_GPU

import fp4_kernels as fk
from fp4_kernels.cuda import launch
from fp4_kernels.testing import adversarial_blocks, random_seed, reference_quantization, same_bits

KINDS = available_kinds(REAL_GPU)
SEED, STEP = 2**40 + 3, 77


def _data(rng, rows, k, dtype, block):
    x = adversarial_blocks(rng, rows, k, block)
    if dtype == "float16":
        x = np.clip(x, -6e4, 6e4)
    return x.astype(NP_DTYPES[dtype])


def _oracle(x, fmt, rounding, global_amax=None, seed=SEED, step=STEP):
    deq = reference_quantization(np.asarray(x, np.float32), fmt, rounding, seed, step, global_amax)
    return deq[3].astype(x.dtype)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "fmt,dtype,rounding,amax,rows,k",
    [
        ("nvfp4", "bfloat16", "nearest", 3.25, 3, 48),
        ("nvfp4", "bfloat16", "stochastic", None, 2, 32),
        ("nvfp4", "float32", "nearest", None, 5, 16),
        ("nvfp4", "float16", "stochastic", 100.0, 1, 80),
        ("nvfp4", "float32", "stochastic", "array", 3, 32),
        ("mxfp4", "bfloat16", "nearest", None, 3, 64),
        ("mxfp4", "bfloat16", "stochastic", None, 1, 96),
        ("mxfp4", "float32", "nearest", None, 2, 32),
        ("mxfp4", "float16", "nearest", None, 7, 32),
    ],
)
def test_fake_quantize_matches_oracle(kernels, rng, kind, fmt, dtype, rounding, amax, rows, k):
    """Every format, dtype and rounding; global_amax a number, an array or computed; shapes
    whose items do not fill a CTA's pass (a small CTA and grid: the grid-stride loop
    iterates and lanes past the end take part in the butterflies)."""
    x = _data(rng, rows, k, dtype, fk.FORMATS[fmt])
    ga = 3.25 if amax == "array" else amax
    # a device array of the input's own library: global_amax must live where x lives
    arg = to_gpu(np.array([ga], np.float32), kind) if amax == "array" else amax
    with launch.launch_policy(threads=32, max_blocks=2):
        got = fk.quantize_dequantize(
            to_gpu(x, kind), fmt=fmt, rounding=rounding, seed=SEED, step=STEP, global_amax=arg
        )
    assert same_bits(to_host(got), _oracle(x, fmt, rounding, ga))


def test_fake_quantize_of_nonfinite_blocks(kernels):
    """A block holding NaN or Inf decodes to NaN; the other blocks are unaffected; signed
    zeros keep their sign."""
    x = np.zeros((2, 64), np.float32)
    x[0, :16] = np.linspace(-2, 2, 16)
    x[0, 3] = np.nan
    x[1, 32:] = -7.0
    x[1, 40] = np.inf
    x[1, 17] = -0.0
    x[1, 18] = -1e-30  # rounds to -0 beside the 1.0
    x[1, 19] = 1.0
    for fmt in ("nvfp4", "mxfp4"):
        y = to_host(fk.quantize_dequantize(to_gpu(x, "numba"), fmt=fmt))
        assert same_bits(y, _oracle(x, fmt, "nearest"))
        block = fk.FORMATS[fmt]
        assert np.all(np.isnan(y[0, :block])) and np.all(np.isnan(y[1, 32 : 32 + block]))
        assert np.signbit(y[1, 17]) and np.signbit(y[1, 18]) and y[1, 18] == 0


def test_fake_quantize_does_not_depend_on_the_launch(kernels, rng):
    x = rng.standard_normal((4, 64)).astype(np.float32)
    configs = ((32, 1), (64, 3)) if kernels == "simulator" else ((32, 1), (256, 7), (None, None))
    for cfg in configs:
        with launch.launch_policy(*cfg):
            y = fk.quantize_dequantize(to_gpu(x, "numba"), rounding="stochastic", seed=5, step=1)
        assert same_bits(to_host(y), _oracle(x, "nvfp4", "stochastic", seed=5, step=1))


def test_fake_quantize_of_an_unaligned_view(kernels, rng):
    """An input not 16-byte aligned (a view one row in of a float16 array) loads element by
    element."""
    base = _data(rng, 9, 16, "float16", 16)
    x = to_gpu(base, "numba")[1:]
    y = to_host(fk.quantize_dequantize(x, fmt="nvfp4", global_amax=2.0))
    assert same_bits(y, _oracle(base[1:], "nvfp4", "nearest", 2.0))


_FULL_SEED = random_seed("test_full_size_fake_quantize_bit_exact")


@functools.cache
def _full_case(fmt, rounding, dtype):
    rng = np.random.default_rng([_FULL_SEED, len(fmt), len(rounding), len(dtype)])
    return _data(rng, 4096 + 7, 4096, dtype, fk.FORMATS[fmt])


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt,amax", [("nvfp4", None), ("nvfp4", 5.5), ("mxfp4", None)])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
def test_full_size_fake_quantize_bit_exact(gpu, dtype, rounding, fmt, amax, kind):
    """>= 2^24 elements of adversarial data per case: the one kernel against the GPU's
    quantize -> dequantize and against the oracle, every bit."""
    print(f"full-size data seed {_FULL_SEED}")
    x = _full_case(fmt, rounding, dtype)
    kw = dict(fmt=fmt, rounding=rounding, seed=1234, step=99, global_amax=amax)
    fused = to_host(fk.quantize_dequantize(to_gpu(x, kind), **kw))
    two_step = to_host(fk.dequantize(fk.quantize(to_gpu(x, kind), **kw)))
    assert same_bits(fused, two_step)
    assert same_bits(fused, _oracle(x, fmt, rounding, amax, seed=1234, step=99))
