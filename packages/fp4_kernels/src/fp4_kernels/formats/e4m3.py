"""FP8 E4M3 ("E4M3FN"), the NVFP4 block-scale type (OCP 8-bit Floating Point Specification v1.0).

A code is 8 bits: bit 7 sign, bits 6-3 exponent (bias 7), bits 2-0 mantissa. Exponent field 0
is subnormal (m * 2**-9). There is no Inf; S.1111.111 (0x7F, 0xFF) is NaN, so the largest
finite magnitude is S.1111.110 = 1.75 * 2**8 = 448.

Encoding here is the saturating conversion (OFP8 §4 "saturation mode", CUDA's
``__NV_SATFINITE``), which is what ``static_cast<__nv_fp8_e4m3>(float)`` does in Transformer
Engine's NVFP4 scale computation: out-of-range and Inf clamp to ±448, only NaN gives NaN.

This module is the numpy reference (the oracle); ml_dtypes is used only as an independent check
in the tests.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

E4M3_MAX = 448.0  # S.1111.110
E4M3_NAN = 0x7F  # S.1111.111; 0xFF is NaN too
E4M3_MAX_CODE = 0x7E  # magnitude code of E4M3_MAX
E4M3_BIAS = 7
E4M3_MANTISSA_BITS = 3
E4M3_MIN_NORMAL_EXP = -6  # 2**-6, exponent field 1
E4M3_SIGN_BIT = 0x80


def _e4m3_table():
    """All 256 code values, from the OFP8 field definitions in float64 (every one is exact)."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent_field = (codes >> 3) & 0xF
    mantissa = (codes & 0x7).astype(np.float64)
    magnitude = np.where(
        exponent_field == 0,
        np.ldexp(mantissa, E4M3_MIN_NORMAL_EXP - E4M3_MANTISSA_BITS),
        np.ldexp(1.0 + mantissa / 8.0, exponent_field - E4M3_BIAS),
    )
    # S.1111.111 is NaN; the decoded NaN keeps the sign bit (as ml_dtypes does), so 0xFF is -NaN.
    magnitude[(codes & 0x7F) == 0x7F] = np.nan
    values = np.copysign(magnitude, sign)  # copysign, not *: a product does not set the sign of NaN
    return values.astype(np.float32)


E4M3_VALUES = _e4m3_table()  # index = code; NaN at 0x7F and -NaN at 0xFF


def encode_e4m3(v: npt.ArrayLike) -> np.ndarray:
    """Rounds float32 ``v`` to E4M3 codes: round-to-nearest-even, saturating to ±448 (OFP8 v1.0 §4).

    abs(v) >= 448 (including Inf) gives 0x7E with v's sign; NaN gives 0x7F; subnormals are kept;
    the sign is kept, so -0.0 gives 0x80.

    Method, exact by construction: work in float64 on the exact float32 value. Inside one binade
    [2**e, 2**(e+1)) (with e clamped to -6 so the subnormal range shares the quantum of the lowest
    normal binade) the representable values are n * 2**(e-3) for integer n, so the rounded value is
    np.round(a / 2**(e-3)), an exact power-of-two division followed by numpy's half-to-even round.
    Then code = (e + 6) * 8 + n: positive E4M3 codes are ordered like their values, n in [8, 16)
    selects the mantissa of exponent field e + 7, n < 8 (only when e = -6) is the subnormal
    mantissa, and n == 16 (rounding up out of the binade) lands on the next binade's first code.
    """
    v = np.asarray(v)
    if v.dtype != np.float32:
        raise TypeError(f"v must be float32, got {v.dtype}")
    finite_in_range = np.abs(v) < np.float32(E4M3_MAX)  # False for NaN and Inf
    # Widen only the in-range values: casting a signalling NaN would raise FE_INVALID.
    a_safe = np.abs(np.where(finite_in_range, v, np.float32(0.0))).astype(np.float64)
    # np.frexp: a = f * 2**x with f in [0.5, 1), so floor(log2(a)) = x - 1, exactly.
    binade = np.frexp(a_safe)[1] - 1
    binade = np.where(a_safe < 2.0**E4M3_MIN_NORMAL_EXP, E4M3_MIN_NORMAL_EXP, binade)
    n = np.round(np.ldexp(a_safe, E4M3_MANTISSA_BITS - binade))  # half-to-even
    magnitude_codes = (binade - E4M3_MIN_NORMAL_EXP) * 8 + n.astype(np.int64)
    magnitude_codes = np.where(finite_in_range, magnitude_codes, E4M3_MAX_CODE)
    codes = magnitude_codes | np.where(np.signbit(v), E4M3_SIGN_BIT, 0)
    return np.where(np.isnan(v), E4M3_NAN, codes).astype(np.uint8)


def decode_e4m3(codes: npt.ArrayLike) -> np.ndarray:
    """Maps uint8 E4M3 codes to float32 values (OFP8 v1.0 Table 1); 0x7F and 0xFF decode to NaN."""
    codes = np.asarray(codes)
    if codes.dtype != np.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    return E4M3_VALUES[codes]
