"""FP4 E2M1: the 4-bit element type of NVFP4 and MXFP4 (OCP Microscaling Formats (MX) v1.0, §5.3.3).

A code is 4 bits: bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa. Exponent field 0 is
subnormal (0 or 0.5); there is no Inf and no NaN. Magnitudes by code 0..7:
0, 0.5, 1, 1.5, 2, 3, 4, 6. Because the magnitude grows with the code, rounding to the nearest
code is a search on that grid, and "ties to even" means "ties to the even code" (mantissa bit 0).

This module is the numpy reference (the oracle) the kernels are tested against bit for bit.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

E2M1_MAX = 6.0  # largest finite magnitude, code 0b0111
# float32(1) / float32(6), the float32 rounding of 1/6: Transformer Engine writes `1.0f / 6.0f`,
# and every codec scales a block amax by it (a multiply, not a division)
INV_E2M1_MAX = np.float32(1.0) / np.float32(6.0)
ROUNDINGS = ("nearest", "stochastic")  # the two ways a value is rounded onto the e2m1 grid
E2M1_SIGN_BIT = 0x8  # bit 3 of a code
E2M1_MAX_CODE = 0x7  # magnitude code of E2M1_MAX

# OCP MX v1.0 Table 5 (FP4 E2M1), index = code. Code 0x8 is -0.0.
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)

# Magnitudes of codes 0..7, ascending.
_E2M1_MAGNITUDES = E2M1_VALUES[:8]
# Midpoint between magnitude code k and k+1 (exact in float32: all are multiples of 0.25).
_E2M1_MIDPOINTS = (_E2M1_MAGNITUDES[:-1] + _E2M1_MAGNITUDES[1:]) / np.float32(2)
# At a tie the even code wins; the upper neighbour k+1 is even exactly when k is odd.
_E2M1_TIE_ROUNDS_UP = np.arange(7) % 2 == 1


def _check_float32(y, name):
    y = np.asarray(y)
    if y.dtype != np.float32:
        raise TypeError(f"{name} must be float32, got {y.dtype}")
    return y


def _check_uint8(codes, name):
    codes = np.asarray(codes)
    if codes.dtype != np.uint8:
        raise TypeError(f"{name} must be uint8, got {codes.dtype}")
    return codes


def _apply_sign(y, magnitude_codes):
    """Sets bit 3 from the sign bit of y (so -0.0 and negatives rounding to 0 give 0x8); NaN -> 0x0.

    E2M1 has no NaN. The block quantizers mask non-finite blocks before encoding, so NaN never
    reaches here from them; mapping it to +0 just keeps this function total.
    """
    codes = magnitude_codes.astype(np.uint8) | np.where(np.signbit(y), E2M1_SIGN_BIT, 0).astype(
        np.uint8
    )
    return np.where(np.isnan(y), np.uint8(0), codes).astype(np.uint8)


def encode_e2m1(y: npt.ArrayLike) -> np.ndarray:
    """Rounds float32 ``y`` to E2M1 codes, round-to-nearest-even, saturating (OCP MX v1.0 §5.3.3).

    abs(y) >= 6 (including Inf) saturates to magnitude code 7, as the MX spec's conversion to FP4
    does (FP4 has no Inf). Ties go to the even code: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2,
    3.5->4, 5->4. The sign bit is copied from y, so -0.0 and negatives that round to zero give 0x8.
    NaN gives 0x0 (see ``_apply_sign``).

    Returns uint8 codes of y's shape (one code per byte, unpacked).
    """
    y = _check_float32(y, "y")
    a = np.abs(y)[..., None]
    # Code = number of midpoints passed; a value exactly on a midpoint passes it only when the
    # code above is even. NaN compares False everywhere and lands on 0 (then masked anyway).
    passed = (a > _E2M1_MIDPOINTS) | ((a == _E2M1_MIDPOINTS) & _E2M1_TIE_ROUNDS_UP)
    return _apply_sign(y, passed.sum(axis=-1))


def encode_e2m1_stochastic(y: npt.ArrayLike, rbits: npt.ArrayLike) -> np.ndarray:
    """Rounds float32 ``y`` to E2M1 codes stochastically, using 16 random bits per element.

    With a = abs(y): if a >= 6 (or Inf) the magnitude code is 7 (saturation). Otherwise lo is the
    largest grid magnitude <= a, hi the next one, and p = (a - lo) / (hi - lo) the fraction of
    the gap a has covered. Both steps are exact in float32 (a - lo by Sterbenz since
    lo <= a < 2*lo or lo == 0; the gap is a power of two), so p is the exact fraction.
    With r = ``rbits`` (uint16), a rounds up to hi when p + r * 2**-16, rounded to nearest at 16
    fractional bits (ties to even), reaches 1; else down to lo. That rounding is one float32
    addition: R = 128 + r * 2**-16 is exact in float32 (its spacing on [128, 256) is 2**-16),
    and the float32 sum R + p reaches 129 exactly then.

    Over the 2**16 values of r, a rounds up floor(p * 2**16 + 1/2) times: P(up) is p rounded
    to 16 bits (halves up), within 2**-17 of p. Sign as in ``encode_e2m1``; NaN gives 0x0.

    ``rbits`` must be uint16 and broadcastable to y's shape (``philox.stochastic_bits16``).
    """
    y = _check_float32(y, "y")
    rbits = np.asarray(rbits)
    if rbits.dtype != np.uint16:
        raise TypeError(
            f"rbits must be uint16 (16 random bits per element, see "
            f"philox.stochastic_bits16), got {rbits.dtype}"
        )
    a = np.abs(y)
    saturated = a >= np.float32(E2M1_MAX)
    # lo_code in 0..6 for a < 6; NaN and saturated entries are overwritten below.
    lo_code = np.clip(np.searchsorted(_E2M1_MAGNITUDES, a, side="right") - 1, 0, 6)
    lo = _E2M1_MAGNITUDES[lo_code]
    gap = _E2M1_MAGNITUDES[lo_code + 1] - lo
    with np.errstate(invalid="ignore"):
        p = (a - lo) / gap
        big_r = np.float32(128.0) + rbits.astype(np.float32) * np.float32(2.0**-16)  # exact
        up = big_r + p >= np.float32(129.0)  # the one float32 rounding, at 2^-16
    magnitude_codes = np.where(saturated, E2M1_MAX_CODE, lo_code + up)
    return _apply_sign(y, magnitude_codes)


def decode_e2m1(codes: npt.ArrayLike) -> np.ndarray:
    """Maps uint8 E2M1 codes to float32 values (OCP MX Table 5); only the low 4 bits are read."""
    codes = _check_uint8(codes, "codes")
    return E2M1_VALUES[codes & np.uint8(0xF)]


def pack_e2m1(codes: npt.ArrayLike) -> np.ndarray:
    """Packs uint8 codes (..., K) into bytes (..., K // 2): element 2i low nibble, 2i+1 high nibble.

    This is the byte order of PyTorch's ``float4_e2m1fn_x2`` and of the cuBLASLt/PTX FP4 operands
    (the first element of a pair sits in the least significant nibble). K must be even and every
    code must fit in 4 bits.
    """
    codes = _check_uint8(codes, "codes")
    if codes.ndim == 0 or codes.shape[-1] % 2 != 0:
        raise ValueError(f"codes must have an even last dimension, got shape {codes.shape}")
    if np.any(codes > 0xF):
        raise ValueError("codes must be 4-bit values (0..15)")
    return (codes[..., 0::2] | (codes[..., 1::2] << np.uint8(4))).astype(np.uint8)


def unpack_e2m1(packed: npt.ArrayLike) -> np.ndarray:
    """Inverse of ``pack_e2m1``: bytes (..., K // 2) to codes (..., K), low nibble first."""
    packed = _check_uint8(packed, "packed")
    if packed.ndim == 0:
        raise ValueError("packed must have at least one dimension")
    codes = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), dtype=np.uint8)
    codes[..., 0::2] = packed & np.uint8(0xF)
    codes[..., 1::2] = packed >> np.uint8(4)
    return codes
