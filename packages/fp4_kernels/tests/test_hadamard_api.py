"""fp4_kernels.hadamard on the CPU path: bit-exact against the reference, against float64 scipy
within the dtype's error, input validation.  (GPU kernels: cuda_kernels/test_hadamard_kernel.)"""

import ml_dtypes
import numpy as np
import pytest
import scipy.linalg
import torch

import fp4_kernels as fk
from fp4_kernels.formats import hadamard as h
from fp4_kernels.testing import same_bits

NP = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
EPS = {"float32": 2.0**-24, "bfloat16": 2.0**-9, "float16": 2.0**-11}  # unit roundoff


def _reference(x, g, inverse=False, seed=None):
    signs = None if seed is None else h.hadamard_signs(g, seed)
    y = h.hadamard_reference(np.asarray(x, np.float32), g, inverse=inverse, signs=signs)
    return y.astype(x.dtype)


@pytest.mark.parametrize("dtype", list(NP))
@pytest.mark.parametrize("g,rows", [(16, 1), (32, 3), (64, 5), (512, 2), (1024, 3), (8192, 1)])
def test_cpu_matches_reference_bit_for_bit(rng, dtype, g, rows):
    x = (rng.standard_normal((rows, 2 * g)) * 3).astype(NP[dtype])
    for inverse, seed in ((False, None), (True, None), (False, 9), (True, 9)):
        y = fk.hadamard(x, group_size=g, inverse=inverse, signs=seed)
        assert y.dtype == x.dtype and y.shape == x.shape
        assert same_bits(y, _reference(x, g, inverse, seed))


@pytest.mark.parametrize("dtype", list(NP))
@pytest.mark.parametrize("g", [16, 128, 4096])
def test_against_scipy_float64_within_the_dtype_error(rng, dtype, g):
    """Tolerance = the same-dtype naive product's own error (float32 matmul, rounded to the
    dtype) doubled, plus one unit roundoff of the output: never a magic epsilon."""
    x = rng.standard_normal((4, g)).astype(NP[dtype])
    signs = h.hadamard_signs(g, 5)
    y = fk.hadamard(x, group_size=g, signs=5).astype(np.float64)
    m = np.diag(signs.astype(np.float64)) @ scipy.linalg.hadamard(g) / np.sqrt(g)
    exact = x.astype(np.float64) @ m
    naive = (x.astype(np.float32) @ m.astype(np.float32)).astype(NP[dtype]).astype(np.float64)
    tol = 2 * np.abs(naive - exact).max() + EPS[dtype] * np.abs(exact).max()
    assert np.abs(y - exact).max() <= tol


@pytest.mark.parametrize("g", [16, 256, 2048])
def test_inverse_undoes_the_randomized_transform(rng, g):
    x = rng.standard_normal((3, 2 * g)).astype(np.float32)
    y = fk.hadamard(fk.hadamard(x, group_size=g, signs=77), group_size=g, signs=77, inverse=True)
    np.testing.assert_allclose(y, x, rtol=0, atol=8 * np.log2(g) * 2**-24 * np.abs(x).max())


def test_sign_vector_seed_and_torch_agree(rng):
    g = 64
    x = rng.standard_normal((2, g)).astype(np.float32)
    s = h.hadamard_signs(g, 4)
    by_seed = fk.hadamard(x, group_size=g, signs=4)
    assert same_bits(fk.hadamard(x, group_size=g, signs=s), by_seed)
    assert same_bits(fk.hadamard(x, group_size=g, signs=list(s)), by_seed)
    t = fk.hadamard(torch.from_numpy(x), group_size=g, signs=torch.from_numpy(s))
    assert isinstance(t, torch.Tensor) and same_bits(t.numpy(), by_seed)
    tb = fk.hadamard(torch.from_numpy(x).bfloat16(), group_size=g)
    assert tb.dtype == torch.bfloat16
    ref = _reference(x.astype(ml_dtypes.bfloat16), g)
    assert same_bits(tb.view(torch.int16).numpy().view(ml_dtypes.bfloat16), ref)


def test_empty_and_ragged_row_counts(rng):
    assert fk.hadamard(np.zeros((0, 32), np.float32), group_size=32).shape == (0, 32)
    x = rng.standard_normal((7, 3, 32)).astype(np.float16)
    assert same_bits(fk.hadamard(x, group_size=16), _reference(x, 16))


def test_bad_input_names_the_argument():
    x = np.zeros((2, 64), np.float32)
    with pytest.raises(ValueError, match="group_size: 48 is not a power of two"):
        fk.hadamard(x, group_size=48)
    with pytest.raises(ValueError, match="group_size: 8 is not a power of two"):
        fk.hadamard(x, group_size=8)
    with pytest.raises(ValueError, match="x: last dimension .* not a multiple of group_size=128"):
        fk.hadamard(x, group_size=128)
    with pytest.raises(ValueError, match="C-contiguous"):
        fk.hadamard(np.zeros((64, 64), np.float32).T, group_size=16)
    with pytest.raises(TypeError, match="dtype float64 is not supported"):
        fk.hadamard(np.zeros((2, 64)), group_size=16)
    with pytest.raises(ValueError, match="signs: expected 64 values"):
        fk.hadamard(x, group_size=64, signs=np.ones(32))
    with pytest.raises(ValueError, match=r"signs: every entry must be \+1 or -1"):
        fk.hadamard(x, group_size=64, signs=np.full(64, 0.5))
    with pytest.raises(ValueError, match="signs: a seed"):
        fk.hadamard(x, group_size=64, signs=-1)
    with pytest.raises(TypeError, match="inverse"):
        fk.hadamard(x, group_size=64, inverse=1)
    with pytest.raises(TypeError, match="group_size: expected an integer"):
        fk.hadamard(x, group_size=64.0)
