"""MXFP4: E2M1 elements in 32-element blocks with one E8M0 (power-of-two) scale per block.

OCP Microscaling Formats (MX) Specification v1.0, §5 (MXFP4 = FP4 E2M1 elements, k = 32, E8M0
scale) and §6.3 (conversion from higher precision). This is the numpy reference (the oracle).

Dequantized value = e2m1(code) * 2**(scale - 127).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .e2m1 import ROUNDINGS, decode_e2m1, encode_e2m1, encode_e2m1_stochastic
from .e8m0 import E8M0_MAX_EXP, E8M0_MIN_EXP, E8M0_NAN, decode_e8m0, encode_e8m0_exponent
from .philox import stochastic_bits16
from .spec import FormatSpec, check_codes, check_input

BLOCK_SIZE = 32  # elements per E8M0 scale (MX v1.0 k = 32)
SPEC = FormatSpec(
    name="mxfp4",
    code=1,
    block_size=BLOCK_SIZE,
    element="e2m1",
    scale="e8m0",
    scale_dtype="float8_e8m0fnu",
    tensor_scale=False,
)
E2M1_EMAX = 2  # exponent of the largest normal E2M1 power of two (4 = 2**2); MX v1.0 Table 2

ROUNDING_MODES = ROUNDINGS

_FLOAT32_EXPONENT_BIAS = 127
_FLOAT32_MANTISSA_BITS = 23


def shared_exponent(amax_b: npt.ArrayLike) -> np.ndarray:
    """The MX shared exponent floor(log2(amax_b)) - 2 of blocks with float32 max magnitude amax_b.

    OCP MX v1.0 §6.3: X = 2**(floor(log2(max_i abs(V_i))) - emax_elem) with emax_elem = 2 for E2M1,
    clamped to the E8M0 range [-127, 127]. floor(log2) is read exactly from the float32 exponent
    field (field - 127 for normals). A zero or subnormal amax has floor(log2) <= -127 and the
    result is clamped to -127 (a float32 amax can never push it above 125, so the upper clamp
    only documents the range). ``amax_b`` must be finite and >= 0. Returns int64 exponents.
    """
    amax_b = np.asarray(amax_b)
    if amax_b.dtype != np.float32:
        raise TypeError(f"amax_b must be float32, got {amax_b.dtype}")
    if not np.all(np.isfinite(amax_b) & (amax_b >= 0)):
        raise ValueError("amax_b must be finite and >= 0")
    exponent_field = (amax_b.view(np.uint32) >> np.uint32(_FLOAT32_MANTISSA_BITS)).astype(
        np.int64
    ) & 0xFF
    # Field 0 (zero, subnormal) has floor(log2) <= -127; field - 127 - 2 = -129 is below the clamp.
    floor_log2 = exponent_field - _FLOAT32_EXPONENT_BIAS
    return np.clip(floor_log2 - E2M1_EMAX, E8M0_MIN_EXP, E8M0_MAX_EXP)


def quantize_reference(
    x: npt.ArrayLike, *, rounding: str = "nearest", seed: int = 0, step: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Quantizes float32 ``x`` (..., K), K % 32 == 0, to MXFP4 (OCP MX v1.0 §6.3).

    Returns ``(codes, scales)``: codes uint8 (..., K) unpacked E2M1 codes, scales uint8
    (..., K // 32) raw E8M0 bits. (MXFP4 has no global scale.)

    Blocks are 32 consecutive elements of the last axis. A block containing NaN or ±Inf gets
    scale 0xFF (E8M0 NaN) and codes 0, so it decodes to NaN. Otherwise
    e = ``shared_exponent(max abs(x) over the block)``, y = x * 2**-e (an exact float32 power of
    two), and code = e2m1(y), round-to-nearest-even and saturating (MX §6.3: elements above the E2M1
    max after scaling clamp to ±6), or stochastic with the random bits
    ``stochastic_bits16(seed, step, x.size)[i]`` for flat element index i (as NVFP4).
    """
    x = check_input(x, BLOCK_SIZE)
    if rounding not in ROUNDING_MODES:
        raise ValueError(f"rounding must be one of {ROUNDING_MODES}, got {rounding!r}")
    blocks = x.reshape(-1, BLOCK_SIZE)
    finite_block = np.isfinite(blocks).all(axis=1)
    # Zero the masked blocks so the arithmetic below is warning-free; their outputs are replaced.
    blocks = np.where(finite_block[:, None], blocks, np.float32(0.0))
    e = shared_exponent(np.abs(blocks).max(axis=1))
    # 2**-e for e in [-127, 125] is exact in float32 (2**-125 .. 2**127): ldexp in float64, narrow.
    inverse_scale = np.ldexp(1.0, -e).astype(np.float32)
    y = blocks * inverse_scale[:, None]
    if rounding == "nearest":
        codes = encode_e2m1(y)
    else:
        codes = encode_e2m1_stochastic(y, stochastic_bits16(seed, step, x.size).reshape(y.shape))

    codes = np.where(finite_block[:, None], codes, np.uint8(0)).astype(np.uint8)
    scale_codes = np.where(finite_block, encode_e8m0_exponent(e), np.uint8(E8M0_NAN)).astype(
        np.uint8
    )
    return codes.reshape(x.shape), scale_codes.reshape(x.shape[:-1] + (x.shape[-1] // BLOCK_SIZE,))


def dequantize_reference(codes: npt.ArrayLike, scales: npt.ArrayLike) -> np.ndarray:
    """Inverse of ``quantize_reference``: e2m1(code) * 2**(scale - 127) in float32 (MX v1.0 §6.2).

    ``codes`` uint8 (..., K) unpacked, ``scales`` uint8 (..., K // 32). A NaN scale (0xFF) makes
    its whole block NaN.
    """
    codes, scales = check_codes(codes, scales, BLOCK_SIZE)
    values = decode_e2m1(codes).reshape(-1, BLOCK_SIZE) * decode_e8m0(scales).reshape(-1, 1)
    return values.reshape(codes.shape)
