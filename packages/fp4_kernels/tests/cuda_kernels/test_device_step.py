"""``step`` given as a one-element int64 array (``cuda.launch.seed_step_args``, the kernels'
``device_step`` variants, ``_primitives.kernel_of``): the same bits as the same step given as
an int, for every format and entry point that rounds stochastically, on the GPU (simulator
and real) and on the CPU; a bad array is refused naming ``step``."""

import numpy as np
import pytest
from _devices import available_kinds, to_gpu, to_host
from conftest import REAL_GPU
from numba import cuda

import fp4_kernels as fk
from fp4_kernels import _plans

KINDS = available_kinds(REAL_GPU)
SEED = 2**40 + 3
# a step whose high bit is set (the array holds int64, the kernels take the low 32 bits)
STEPS = (77, 2**32 - 5)
FORMATS = ["nvfp4", "mxfp4", fk.FP4Quant(64), fk.FP4Quant(32, hadamard=False)]
FMT_IDS = ["nvfp4", "mxfp4", "fp4quant64", "fp4quant32-nohadamard"]


def _step_array(step, kind):
    a = np.array([step], np.int64)
    if kind == "numba":
        return cuda.to_device(a)
    if kind == "torch":
        import torch

        return torch.from_numpy(a).cuda()
    import cupy

    return cupy.asarray(a)


def _fields(q):
    return [to_host(f) for f in (q.data, q.scales, q.global_scale) if f is not None]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS)
def test_device_step_gives_the_bits_of_the_int_step(kernels, rng, kind, fmt):
    x = rng.standard_normal((3, 128)).astype(np.float32) * 3
    d = to_gpu(x, kind)
    for step in STEPS:
        st = _step_array(step, kind)
        for _ in range(_plans.RECORD_AT + 1):  # the last call of a torch kind runs its plan
            got = fk.quantize(d, fmt, "stochastic", seed=SEED, step=st)
            want = fk.quantize(d, fmt, "stochastic", seed=SEED, step=step)
            for g, w in zip(_fields(got), _fields(want), strict=True):
                assert np.array_equal(g, w), step
            fq = fk.quantize_dequantize(d, fmt, "stochastic", seed=SEED, step=st)
            want_fq = fk.quantize_dequantize(d, fmt, "stochastic", seed=SEED, step=step)
            assert np.array_equal(to_host(fq).view(np.uint32), to_host(want_fq).view(np.uint32))
    # the array is read: another step gives other bits
    other = fk.quantize(d, fmt, "stochastic", seed=SEED, step=STEPS[0] + 1)
    assert not np.array_equal(to_host(other.data), _fields(got)[0])


@pytest.mark.parametrize("kind", KINDS)
def test_a_step_array_filled_again_is_read_again(kernels, rng, kind):
    x = rng.standard_normal((2, 64)).astype(np.float32)
    d = to_gpu(x, kind)
    st = _step_array(5, kind)
    first = to_host(fk.quantize(d, "nvfp4", "stochastic", seed=SEED, step=st).data)
    if kind == "numba":
        st.copy_to_device(np.array([6], np.int64))
    else:
        st.fill(6) if kind == "cupy" else st.fill_(6)
    second = to_host(fk.quantize(d, "nvfp4", "stochastic", seed=SEED, step=st).data)
    assert np.array_equal(first, to_host(fk.quantize(d, "nvfp4", "stochastic", SEED, 5).data))
    assert np.array_equal(second, to_host(fk.quantize(d, "nvfp4", "stochastic", SEED, 6).data))


@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS)
def test_step_array_on_the_cpu(rng, fmt):
    import torch

    x = rng.standard_normal((2, 128)).astype(np.float32)
    want = fk.quantize(x, fmt, "stochastic", seed=SEED, step=STEPS[1])
    for st in (np.array([STEPS[1]], np.int64), torch.tensor([STEPS[1]])):
        xs = x if isinstance(st, np.ndarray) else torch.from_numpy(x)
        got = fk.quantize(xs, fmt, "stochastic", seed=SEED, step=st)
        assert np.array_equal(np.asarray(got.data), want.data)
        fq = fk.quantize_dequantize(xs, fmt, "stochastic", seed=SEED, step=st)
        want_fq = fk.quantize_dequantize(x, fmt, "stochastic", seed=SEED, step=STEPS[1])
        assert np.array_equal(np.asarray(fq).view(np.uint32), want_fq.view(np.uint32))


def test_bad_step_arrays_are_refused_naming_step(kernels):
    x = np.ones((1, 32), np.float32)
    d = cuda.to_device(x)
    cases = [
        (d, cuda.to_device(np.array([1], np.int32)), "dtype int32"),
        (d, cuda.to_device(np.array([1, 2], np.int64)), r"shape \(2,\)"),
        (d, np.array([1], np.int64), "must live where x lives"),
        (x, cuda.to_device(np.array([1], np.int64)), "must live where x lives"),
        (x, np.array([2**32], np.int64), r"outside \[0, 4294967296\)"),
        (x, np.array([1.0], np.float32), "dtype float32"),
    ]
    for xi, st, msg in cases:
        with pytest.raises(ValueError, match=f"^step: .*{msg}"):
            fk.quantize(xi, "nvfp4", "stochastic", step=st)
    with pytest.raises(TypeError, match="^step: expected an integer"):
        fk.quantize(x, "nvfp4", "stochastic", step=[1])
