"""The scalar codec (fp4_kernels._scalar, as compiled for the CPU) against the numpy oracle
and numpy's own conversions, exhaustively where the input space allows."""

import ml_dtypes
import numba
import numpy as np
import pytest
from _stochastic_cases import ALL_R16, edge_magnitudes, expected_codes

from fp4_kernels.cpu._primitives import (  # the compiled scalar functions
    OPS,
    add_rm as _add_rm,
    bf16_to_f32 as _bf16_to_f32,
    e2m1_encode as _enc,
    e2m1_encode_int as _enc_int,
    e2m1_encode_sr as _enc_sr,
    e2m1_sr_code_f as _sr_code_f,
    e2m1_sr_sum as _sr_sum,
    e4m3_decode as _e4m3_dec,
    e4m3_encode_positive as _e4m3,
    f16_to_f32 as _f16_to_f32,
    f32_as_u32,
    f32_to_bf16 as _f32_to_bf16,
    f32_to_f16 as _f32_to_f16,
    mx_shared_exponent as _mx_exp,
    sr_random_f32 as _sr_random,
)
from fp4_kernels.formats import e2m1, e4m3, philox

ALL_BF16_AS_F32 = (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)
ALL_F16 = np.arange(1 << 16, dtype=np.uint16)


@numba.njit
def _map(f, v, out):
    """out[i] = f(v[i]): a compiled scalar function over an array."""
    for i in range(v.size):
        out[i] = f(v[i])


@numba.njit
def _map_e2m1_sr(y, r, out):
    for i in range(y.size):
        out[i] = _enc_sr(y[i], r[i])


def test_e2m1_encode_every_bf16_pattern_matches_oracle():
    # NaN never reaches the element encoder (non-finite blocks are masked before it)
    y = ALL_BF16_AS_F32[~np.isnan(ALL_BF16_AS_F32)]
    got = np.empty(y.size, np.uint8)
    _map(_enc, y, got)
    np.testing.assert_array_equal(got, e2m1.encode_e2m1(y))


@numba.njit(nogil=True)
def _e2m1_float_vs_integer_mismatches(lo, hi):
    """Count patterns in [lo, hi) where the float-pipe and integer encoders disagree."""
    bad = 0
    for b in range(lo, hi):
        y = np.uint32(b).view(np.float32)
        if _enc(y) != _enc_int(y):
            bad += 1
    return bad


def test_e2m1_float_pipe_encoder_equals_integer_encoder_on_every_float32():
    """Every non-negative float32 up to +inf (2^31 - 2^23 + 1 patterns), and their negatives'
    sign bit: the float-pipe round-to-nearest-even chain is exactly the integer encoder."""
    bad = _e2m1_float_vs_integer_mismatches(0, 0x7F800001)
    assert bad == 0
    neg = _e2m1_float_vs_integer_mismatches(0x80000000, 0x80000000 + (1 << 20))
    assert neg == 0


def test_e2m1_value_f_is_the_magnitude_of_every_code():
    """2^23 + code -> magnitude on the float pipe: every code, and every code the nearest and
    the stochastic encoders give for every bf16 magnitude (that is the fused kernel's chain)."""
    for k in range(8):
        c = np.float32(2.0**23 + k)
        assert np.float32(OPS.e2m1_value_f(c)) == np.float32(OPS.e2m1_value(np.uint32(k)))
    a = np.abs(ALL_BF16_AS_F32[np.isfinite(ALL_BF16_AS_F32)])
    expect = np.abs(e2m1.decode_e2m1(e2m1.encode_e2m1(a)))
    got = np.array([OPS.e2m1_value_f(OPS.e2m1_code_f(v)) for v in a[::7]], np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), expect[::7].view(np.uint32))
    r = np.float32(128.0 + 0.5)  # 128 + r 2^-16 for r = 2^15
    got = [OPS.e2m1_value_f(OPS.e2m1_sr_code_f(v, r)) for v in a[::97]]
    codes = [int(OPS.e2m1_sr_code_f(v, r)) - 2**23 for v in a[::97]]
    np.testing.assert_array_equal(
        np.array(got, np.float32), e2m1.decode_e2m1(np.array(codes, np.uint8))
    )


def test_e2m1_encode_strided_float32_patterns_match_oracle():
    """The numpy oracle over every 61st non-negative float32 pattern (~35M values, both signs),
    ties and the saturation bound included."""
    bits = np.arange(0, 0x7F800001, 61, dtype=np.uint32)
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, np.inf], np.float32)
    for chunk in np.array_split(bits, 16):
        y = np.concatenate([chunk.view(np.float32), ties])
        y = np.concatenate([y, -y])
        out = np.empty(y.size, np.uint32)
        _map(_enc, y, out)
        np.testing.assert_array_equal(out, e2m1.encode_e2m1(y))


def test_e2m1_encode_sr_matches_oracle(rng):
    """Every bf16 pattern (NaN, Inf, subnormals included) and random values in (-7, 7), each
    with random 16 random bits, and the extreme random values."""
    y = np.concatenate([ALL_BF16_AS_F32, rng.uniform(-7, 7, 1 << 16).astype(np.float32)])
    for r in (
        rng.integers(0, 1 << 16, y.size).astype(np.uint16),
        np.zeros(y.size, np.uint16),
        np.full(y.size, 0xFFFF, np.uint16),
    ):
        got = np.empty(y.size, np.uint8)
        _map_e2m1_sr(y, r, got)
        np.testing.assert_array_equal(got, e2m1.encode_e2m1_stochastic(y, r))


@numba.njit(nogil=True)
def _sr_codes_for_every_r16(a, out, byte2):
    """out[i, r] = the magnitude code of a[i] with random bits r, from the float-pipe core;
    byte2[i, r] = byte 2 of the bits of its unfloored sum (what the quantize kernel reads)."""
    for i in range(a.size):
        for r in range(1 << 16):
            c = _sr_code_f(a[i], _sr_random(np.uint32(r)))
            out[i, r] = np.uint32(f32_as_u32(c) - np.uint32(0x4B000000))
            byte2[i, r] = (f32_as_u32(_sr_sum(a[i], _sr_random(np.uint32(r)))) >> 16) & 0xFF


def test_e2m1_sr_core_every_random_value_at_the_edges(rng):
    """The float-pipe core (the kernels' function) for all 2^16 random values at every edge
    magnitude and 300 random ones: equal to the oracle, and rounding up exactly
    floor(p 2^16 + 1/2) times (counted in rational arithmetic); byte 2 of the unfloored sum's
    bits is the same code."""
    a = np.concatenate(
        [
            edge_magnitudes(),
            rng.uniform(0, 6.5, 150).astype(np.float32),
            rng.integers(0, np.float32(6).view(np.uint32), 150, dtype=np.uint32).view(np.float32),
        ]
    )
    got = np.empty((a.size, 1 << 16), np.uint8)
    byte2 = np.empty((a.size, 1 << 16), np.uint8)
    _sr_codes_for_every_r16(a, got, byte2)
    np.testing.assert_array_equal(got, expected_codes(a, ALL_R16))
    np.testing.assert_array_equal(byte2, got)  # the code, with nothing above it in the byte
    for i in range(a.size):
        oracle = e2m1.encode_e2m1_stochastic(np.full(ALL_R16.size, a[i], np.float32), ALL_R16)
        np.testing.assert_array_equal(got[i], oracle, err_msg=f"a = {a[i]!r}")


@numba.njit(nogil=True)
def _map_sr_core(a, r16, out):
    for i in range(a.size):
        c = _sr_code_f(a[i], _sr_random(np.uint32(r16[i])))
        out[i] = np.uint32(f32_as_u32(c) - np.uint32(0x4B000000))


def test_e2m1_sr_core_random_float32_patterns(rng):
    """4M random float32 bit patterns (every binade, NaN and Inf included) as a = |y|, with
    random 16-bit values: the core's codes are the oracle's magnitude codes."""
    y = rng.integers(0, 1 << 32, 1 << 22, dtype=np.uint64).astype(np.uint32).view(np.float32)
    a = np.abs(y)
    r16 = rng.integers(0, 1 << 16, a.size).astype(np.uint16)
    got = np.empty(a.size, np.uint8)
    _map_sr_core(a, r16, got)
    np.testing.assert_array_equal(got, e2m1.encode_e2m1_stochastic(a, r16))


@numba.njit
def _map_add_rm(a, b, out):
    for i in range(a.size):
        out[i] = _add_rm(a[i], b[i])


def test_add_rm_rounds_toward_minus_infinity(rng):
    """The written-out add.rm.f32 (the CPU's and the simulator's): the float32 at or below the
    exact sum, for sums of both signs whose float64 value is exact."""
    a = rng.uniform(-300, 300, 100_000).astype(np.float32)
    b = rng.uniform(-300, 300, 100_000).astype(np.float32) * np.float32(2.0**-10)
    a = np.concatenate([a, np.float32([128.5, 2.0**23 - 128, 1.0, -1.0, 0.0])])
    b = np.concatenate([b, np.float32([2.0**23 - 128, 135.99998, -(2.0**-30), 2.0**-30, -0.0])])
    got = np.empty(a.size, np.float32)
    _map_add_rm(a, b, got)
    exact = a.astype(np.float64) + b.astype(np.float64)  # exact: exponents within 29 bits
    nearest = exact.astype(np.float32)
    below = np.where(
        nearest.astype(np.float64) > exact, np.nextafter(nearest, np.float32(-np.inf)), nearest
    )
    np.testing.assert_array_equal(got, below)
    # the floors the stochastic encoder takes, 1 -+ 2^-30, and the sign of an exact zero sum
    assert got[-5] == np.float32(2.0**23) and got[-4] == np.float32(2.0**23 + 7)
    assert got[-3] == np.nextafter(np.float32(1), np.float32(0)) and got[-2] == np.float32(-1)
    assert got[-1] == 0 and np.signbit(got[-1])  # +0 + -0 is -0 rounding toward -inf


def test_e4m3_encode_every_nonnegative_bf16_and_f16_pattern():
    # the kernels only encode block scales, which are >= 0 (inf included; NaN is masked first)
    f16 = ALL_F16.view(np.float16).astype(np.float32)
    v = np.concatenate([ALL_BF16_AS_F32, f16])
    v = v[~np.signbit(v) & ~np.isnan(v)]
    got = np.empty(v.size, np.uint8)
    _map(_e4m3, v, got)
    np.testing.assert_array_equal(got, e4m3.encode_e4m3(v))
    # independent check: ml_dtypes' cast agrees wherever it does not overflow (it does not
    # saturate: above 464 it gives NaN where the e4m3 "satfinite" cast gives 448)
    fin = v < 464
    np.testing.assert_array_equal(got[fin], v[fin].astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    assert np.all(got[~fin] == 0x7E)


def test_e4m3_decode_every_code():
    codes = np.arange(256, dtype=np.uint8)
    got = np.array([_e4m3_dec(c) for c in codes[:128]], np.float32)
    ref = codes[:128].view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(got, ref)  # NaN at 0x7F compares equal via assert_array_equal


def test_f16_conversions_exhaustive(rng):
    got = np.empty(1 << 16, np.float32)
    _map(_f16_to_f32, ALL_F16.astype(np.uint32), got)
    np.testing.assert_array_equal(got, ALL_F16.view(np.float16).astype(np.float32))
    v = np.concatenate(
        [
            ALL_BF16_AS_F32,
            rng.integers(0, 2**32, 1 << 18, dtype=np.uint64).astype(np.uint32).view(np.float32),
            # every fp16 rounding midpoint (ties), and one ulp either side
            _f16_midpoints(),
        ]
    )
    h = np.empty(v.size, np.uint16)
    _map(_f32_to_f16, v, h)
    ref = v.astype(np.float16)
    nan = np.isnan(ref)
    np.testing.assert_array_equal(h[~nan], ref[~nan].view(np.uint16))
    assert np.all(np.isnan(h[nan].view(np.float16)))


def _f16_midpoints():
    a = ALL_F16[:0x7C00].view(np.float16).astype(np.float64)
    mids = ((a[:-1] + a[1:]) / 2).astype(np.float32)  # exact: fp16 midpoints fit in float32
    m = mids.view(np.uint32)
    both = np.concatenate([m, m - 1, m + 1]).view(np.float32)
    return np.concatenate([both, -both])


def test_bf16_conversions(rng):
    v = np.concatenate(
        [
            rng.integers(0, 2**32, 1 << 18, dtype=np.uint64).astype(np.uint32).view(np.float32),
            ((np.arange(1 << 16, dtype=np.uint32) << 16) | 0x8000).view(np.float32),  # exact ties
        ]
    )
    h = np.empty(v.size, np.uint16)
    _map(_f32_to_bf16, v, h)
    ref = v.astype(ml_dtypes.bfloat16)
    nan = np.isnan(v)
    np.testing.assert_array_equal(h[~nan], ref[~nan].view(np.uint16))
    assert np.all(np.isnan(h[nan].view(ml_dtypes.bfloat16).astype(np.float32)))
    back = np.array([_bf16_to_f32(np.uint32(b)) for b in h[:4096]], np.float32)
    np.testing.assert_array_equal(back, ref[:4096].astype(np.float32))


def test_mx_shared_exponent_exact(rng):
    v = np.abs(ALL_BF16_AS_F32[np.isfinite(ALL_BF16_AS_F32)])
    v = np.concatenate([v, np.exp2(np.arange(-149, 128)).astype(np.float32)])
    got = np.empty(v.size, np.int64)
    _map(_mx_exp, v, got)
    with np.errstate(divide="ignore"):
        ref = np.floor(np.log2(v.astype(np.float64))) - 2  # exact in float64 for these inputs
    ref = np.clip(np.where(v == 0, -1000, ref), -127, 127).astype(np.int64)
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize(
    "ctr,key,expect",
    [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ],
)
def test_philox_known_answers(ctr, key, expect):
    """Random123's philox4x32_10 known-answer vectors."""
    got = OPS.philox4x32_10(*[np.uint32(c) for c in ctr], np.uint32(key[0]), np.uint32(key[1]))
    assert tuple(int(g) for g in got) == expect
    ref = philox.philox4x32_10(np.array(ctr, np.uint32), np.array(key, np.uint32))
    assert tuple(int(g) for g in ref) == expect


def test_every_module_is_compiled_for_the_cpu():
    """``compile_ops`` compiles each module's functions; the CPU target has no one-instruction
    primitives, so every function is the module's own code, compiled."""
    from fp4_kernels._scalar import MODULES

    names = [name for module in MODULES for name in module.FUNCTIONS]
    assert len(names) == len(set(names))  # one function a name across the modules
    assert set(names) | {"f32_as_u32", "u32_as_f32"} == set(vars(OPS))
    assert all(hasattr(getattr(OPS, name), "py_func") for name in names)
