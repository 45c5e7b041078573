"""cuda/_primitives.py: the scalar codec as compiled for the GPU (on a real GPU the block-scale
encoder is the hardware cvt.rn.satfinite.e4m3x2.f32) against the numpy oracle: every
non-negative bf16 and fp16 pattern on a real GPU, a sample of them in the simulator; likewise
the stochastic rounding core.  cuda/primitives.py (the public scalar operations) against the
numpy operations they name."""

import functools

import numpy as np
import pytest
from _stochastic_cases import ALL_R16, edge_magnitudes, expected_codes
from numba import config, cuda

from fp4_kernels._scalar import E2M1_CODE_BIAS, KIND_BF16, KIND_F16, KIND_F32
from fp4_kernels.cuda._primitives import OPS, f32_as_u32, prmt, u32_as_f32
from fp4_kernels.cuda._words import U32, make_words_io
from fp4_kernels.cuda.e2m1 import SR_BASE, SR_SELECT_LOW, SR_SELECT_STEP
from fp4_kernels.cuda.primitives import (
    f16_bits_to_f32,
    f32_to_f16_bits,
    mul_rn_f32,
    rint_f32,
)
from fp4_kernels.formats import e2m1, e4m3

_e4m3 = OPS.e4m3_encode_positive
_e2m1 = OPS.e2m1_encode
_e4m3_dec = OPS.e4m3_decode


@cuda.jit
def _map(v, scale_codes, elem_codes, decoded):
    for i in range(cuda.grid(1), v.size, cuda.gridsize(1)):
        scale_codes[i] = _e4m3(v[i])
        elem_codes[i] = _e2m1(v[i])
        decoded[i] = _e4m3_dec(np.uint8(i & 0x7F))


def _patterns(rng):
    bf16 = (np.arange(1 << 15, dtype=np.uint32) << 16).view(np.float32)
    f16 = np.arange(0x7C01, dtype=np.uint16).view(np.float16).astype(np.float32)
    v = np.concatenate([bf16, f16])
    v = v[~np.isnan(v)]
    if config.ENABLE_CUDASIM:  # one Python thread per CUDA thread: a sample
        v = np.concatenate([v[rng.integers(0, v.size, 192)], [0.0, 448.0, 464.0, np.inf]])
    return np.ascontiguousarray(v, np.float32)


def test_device_codecs_match_oracle(kernels, rng):
    v = _patterns(rng)
    sc = cuda.device_array(v.size, np.uint8)
    ec = cuda.device_array(v.size, np.uint8)
    dec = cuda.device_array(v.size, np.float32)
    blocks = 2 if config.ENABLE_CUDASIM else 256
    _map[blocks, 64](cuda.to_device(v), sc, ec, dec)
    np.testing.assert_array_equal(sc.copy_to_host(), e4m3.encode_e4m3(v))
    np.testing.assert_array_equal(ec.copy_to_host(), e2m1.encode_e2m1(v))
    idx = (np.arange(v.size) & 0x7F).astype(np.uint8)
    np.testing.assert_array_equal(dec.copy_to_host(), e4m3.decode_e4m3(idx))


_sr_code_f = OPS.e2m1_sr_code_f


@cuda.jit
def _map_sr(a, words, codes):
    """Element i takes the low (even i) or high half of ``words[i // 2]`` as the quantize
    kernels do (PRMT under the top bytes of 128.0) and the float-pipe stochastic core."""
    for i in range(cuda.grid(1), a.size, cuda.gridsize(1)):
        sel = U32(SR_SELECT_LOW + SR_SELECT_STEP * U32(i & 1))
        big_r = u32_as_f32(prmt(SR_BASE, words[i >> 1], sel))
        codes[i] = U32(f32_as_u32(_sr_code_f(a[i], big_r)) - U32(E2M1_CODE_BIAS))


def test_device_stochastic_core_matches_oracle(kernels, rng):
    """The stochastic e2m1 core as the GPU runs it (fma.rn.sat, add.rm, PRMT; their twins in
    the simulator): on a real GPU all 2^16 random values at every edge magnitude and 2^22
    random float32 patterns, equal to the oracle and to the exact round-up counts; a sample
    of both in the simulator."""
    edges = edge_magnitudes()
    patterns = np.abs(
        rng.integers(0, 1 << 32, 1 << 22, dtype=np.uint64).astype(np.uint32).view(np.float32)
    )
    r_patterns = rng.integers(0, 1 << 16, patterns.size).astype(np.uint16)
    if config.ENABLE_CUDASIM:  # one Python thread per CUDA thread: a sample
        pick = rng.integers(0, 1 << 16, 64).astype(np.uint16)
        a_edge, r_edge = np.repeat(edges, pick.size), np.tile(pick, edges.size)
        keep = rng.integers(0, patterns.size, 256)
        patterns, r_patterns = patterns[keep], r_patterns[keep]
        expected_edge = expected_codes(edges, pick).ravel()
    else:
        a_edge, r_edge = np.repeat(edges, ALL_R16.size), np.tile(ALL_R16, edges.size)
        expected_edge = expected_codes(edges, ALL_R16).ravel()
    a = np.concatenate([a_edge, patterns]).astype(np.float32)
    r16 = np.concatenate([r_edge, r_patterns]).astype(np.uint16)
    codes = cuda.device_array(a.size, np.uint32)
    blocks = 2 if config.ENABLE_CUDASIM else 1024
    _map_sr[blocks, 64](cuda.to_device(a), cuda.to_device(r16.view(np.uint32)), codes)
    got = codes.copy_to_host()
    np.testing.assert_array_equal(got, e2m1.encode_e2m1_stochastic(a, r16))
    np.testing.assert_array_equal(got[: a_edge.size], expected_edge)


def test_word_blocks_of_other_sizes_are_refused():
    """``make_words_io`` moves 16-byte blocks (and 4 or 8 bytes): for any other block its
    loops would move nothing, so building it is an error, not a kernel that stores no data."""
    for n_words in (0, 3, 6):
        with pytest.raises(ValueError, match="n_words"):
            make_words_io(KIND_BF16, n_words)


@functools.cache
def _words_copy(kind, n_words):
    """A kernel that moves each block of ``n_words`` words through ``load``, ``element`` and
    ``store`` (the elements widened to float32 and rounded back: the same bits)."""
    load, element, _, _, store = make_words_io(kind, n_words)
    per_block = n_words * (2 if kind != KIND_F32 else 1)

    @cuda.jit
    def kernel(x, out):
        w = cuda.local.array(4, np.uint32)
        v = cuda.local.array(8, np.float32)
        b = cuda.grid(1)
        if b * n_words < x.size:
            load(x, b * n_words, w)
            for j in range(per_block):
                v[j] = element(w, j)
            store(out, b * n_words, v, 0)

    return kernel


@pytest.mark.parametrize("kind", [KIND_BF16, KIND_F16, KIND_F32])
@pytest.mark.parametrize("n_words", [1, 2, 4])
def test_word_blocks_round_trip(kind, n_words):
    """Every block size ``make_words_io`` accepts loads and stores every word (a block of 1
    or 2 words included: no loop that moves nothing)."""
    rng = np.random.default_rng(n_words)
    finite = {KIND_BF16: 0x7F7F, KIND_F16: 0x7BFF}
    if kind == KIND_F32:
        x = rng.standard_normal(64 * n_words).astype(np.float32).view(np.uint32)
    else:  # finite 16-bit patterns of both signs (NaN payloads need not survive a widening)
        h = rng.integers(0, finite[kind], 128 * n_words, dtype=np.uint16)
        h |= rng.integers(0, 2, h.size, dtype=np.uint16) << 15
        x = h.view(np.uint32)
    out = cuda.to_device(np.full(x.size, 0xDEADBEEF, np.uint32))
    _words_copy(kind, n_words)[x.size // n_words, 1](cuda.to_device(x), out)
    np.testing.assert_array_equal(out.copy_to_host(), x)


@cuda.jit
def _public_ops(x, a, b, c, prod_add, rounded, half_bits, half_value, flipped):
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        # the product rounded on its own, then the add: an FMA here would round once
        prod_add[i] = mul_rn_f32(a[i], b[i]) + c[i]
        rounded[i] = rint_f32(x[i])
        half_bits[i] = f32_to_f16_bits(x[i])
        half_value[i] = f16_bits_to_f32(U32(i & 0xFFFF))
        flipped[i] = f32_as_u32(u32_as_f32(U32(f32_as_u32(x[i]) ^ U32(0x80000000))))


def _public_inputs(rng, n):
    """Finite float32 of every exponent and both signs with integer-rounding ties and binary16
    rounding ties and overflow edges in front; and products a * b with c = -(a * b) rounded,
    so that a * b + c is 0 unfused and the product's rounding error when fused."""
    x = rng.integers(0, 0x7F800000, n, dtype=np.uint32).view(np.float32).copy()
    x[rng.random(n) < 0.5] *= -1
    edges = [0.5, 1.5, 2.5, -0.5, -2.5, 8388607.5, 65504.0, 65519.996, 65520.0, 2.0**-24,
             2.0**-25, 3 * 2.0**-26, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11]  # fmt: skip
    x[: len(edges)] = edges
    a, b = (rng.standard_normal(n) * np.exp2(rng.integers(-60, 60, n)) for _ in range(2))
    a, b = a.astype(np.float32), b.astype(np.float32)
    return x, a, b, -(a * b)


def test_public_primitives_match_numpy(kernels, rng):
    """``fp4_kernels.cuda.primitives`` as a kernel written outside the package uses them: each
    equal bit for bit to the numpy operation it names (all 2^16 binary16 patterns widened on
    a GPU), and a ``mul_rn_f32`` product never fused with the add after it."""
    n = 256 if config.ENABLE_CUDASIM else 1 << 16
    inputs = _public_inputs(rng, n)
    x, a, b, c = inputs
    kinds = (np.float32, np.float32, np.uint32, np.float32, np.uint32)
    outs = [cuda.device_array(n, t) for t in kinds]
    blocks = 2 if config.ENABLE_CUDASIM else 256
    _public_ops[blocks, 128](*(cuda.to_device(v) for v in inputs), *outs)
    prod_add, rounded, half_bits, half_value, flipped = (o.copy_to_host() for o in outs)
    np.testing.assert_array_equal(prod_add, a * b + c)
    assert not prod_add.any()  # a fused product would leave its rounding error here
    np.testing.assert_array_equal(rounded, np.rint(x))
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(half_bits, x.astype(np.float16).view(np.uint16))
    h = (np.arange(n) & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float32)
    nan = np.isnan(h)
    np.testing.assert_array_equal(half_value[~nan], h[~nan])
    assert np.isnan(half_value[nan]).all()
    np.testing.assert_array_equal(flipped, x.view(np.uint32) ^ np.uint32(0x80000000))
