"""NVFP4: E2M1 elements in 16-element blocks, an E4M3 scale per block and one float32 global scale.

This is the numpy reference (the oracle) and it reproduces NVIDIA Transformer Engine's NVFP4 cast
(``transformer_engine/common/cast/nvfp4/core_nvfp4.cuh``:
``compute_global_encode_scaling_factor_FP4``, ``quantization_SF::compute_decoding_scaling_factor``,
``compute_scaling_coefficient<float>``)
bit for bit. Every step is a float32 operation in TE's order; the order matters because float32
multiplication is not associative, so it is kept exactly and each step is an explicit
``np.float32`` operation so numpy never computes in float64.

Dequantized value = e2m1(code) * e4m3(block scale) * global_scale.
"""

from __future__ import annotations

from typing import SupportsFloat

import numpy as np
import numpy.typing as npt

from .e2m1 import (
    E2M1_MAX,
    INV_E2M1_MAX,
    ROUNDINGS,
    decode_e2m1,
    encode_e2m1,
    encode_e2m1_stochastic,
)
from .e4m3 import E4M3_MAX, E4M3_NAN, decode_e4m3, encode_e4m3
from .philox import stochastic_bits16
from .spec import FormatSpec, check_codes, check_input

BLOCK_SIZE = 16  # elements per E4M3 scale
SPEC = FormatSpec(
    name="nvfp4",
    code=0,
    block_size=BLOCK_SIZE,
    element="e2m1",
    scale="e4m3",
    scale_dtype="float8_e4m3fn",
    tensor_scale=True,
)
FP32_MAX = np.finfo(np.float32).max  # TE's TypeExtrema<float>::max
NVFP4_GLOBAL_AMAX_TARGET = np.float32(E4M3_MAX * E2M1_MAX)  # 448 * 6 = 2688, exact in float32

ROUNDING_MODES = ROUNDINGS


def tensor_amax(x: npt.ArrayLike) -> np.float32:
    """Max abs(x) over the finite elements of float32 ``x`` (NaN, ±Inf ignored); 0 if none.

    Non-finite elements are left out so that one Inf does not make every other block quantize to
    zero; the blocks holding them are masked to NaN by ``quantize_reference`` instead.
    """
    x = np.asarray(x)
    if x.dtype != np.float32:
        raise TypeError(f"x must be float32, got {x.dtype}")
    finite = np.abs(x[np.isfinite(x)])
    return np.float32(finite.max()) if finite.size else np.float32(0.0)


def global_encode_scale(amax: SupportsFloat) -> np.float32:
    """The global encode scale S = 2688 / amax in float32.

    Transformer Engine's ``compute_global_encode_scaling_factor_FP4``.

    S maps the tensor amax to E4M3_MAX * E2M1_MAX. It is clamped to FP32_MAX with fminf semantics
    (np.fmin: a NaN S yields FP32_MAX), and S = 1 when amax == 0 or S == 0 (amax = Inf).
    The decode scale stored with the tensor (``global_scale``) is float32(1) / S.
    """
    amax = np.float32(amax)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        s = NVFP4_GLOBAL_AMAX_TARGET / amax
    s = np.fmin(s, FP32_MAX)
    if amax == np.float32(0.0) or s == np.float32(0.0):
        s = np.float32(1.0)
    return np.float32(s)


def quantize_reference(
    x: npt.ArrayLike,
    *,
    rounding: str = "nearest",
    seed: int = 0,
    step: int = 0,
    global_amax: SupportsFloat | None = None,
) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """Quantizes float32 ``x`` (..., K), K % 16 == 0, to NVFP4 exactly as Transformer Engine does.

    Returns ``(codes, scales, global_scale)``: codes uint8 (..., K) unpacked E2M1 codes, scales
    uint8 (..., K // 16) raw E4M3 bits, global_scale a float32 scalar (the decode scale 1 / S).

    Blocks are 16 consecutive elements of the last axis (flat order; K % 16 == 0 so a block never
    crosses a row). With S = ``global_encode_scale(amax)``, amax = ``tensor_amax(x)`` or
    float32(``global_amax``) when given (e.g. an amax reduced across ranks), and S_dec = 1 / S:

    - a block containing NaN or ±Inf gets scale 0x7F (E4M3 NaN) and codes 0, so it decodes to NaN;
    - otherwise, with amax_b = max abs(x) over the block:
      s_code = e4m3(amax_b * (S * (1/6)))  (TE: block_amax * (S_enc * fp4_max_inv), saturating)
      scale_rcp = fmin(1 / (e4m3_value(s_code) * S_dec), FP32_MAX)  (when the scale is 0 this is
      FP32_MAX, so an all-zero block gives zero codes, never NaN)
      code = e2m1(x * scale_rcp), round-to-nearest-even, or stochastic with the random bits
      ``stochastic_bits16(seed, step, x.size)[i]`` for flat element index i.
    """
    x = check_input(x, BLOCK_SIZE)
    if rounding not in ROUNDING_MODES:
        raise ValueError(f"rounding must be one of {ROUNDING_MODES}, got {rounding!r}")
    if global_amax is None:
        amax = tensor_amax(x)
    else:
        amax = np.float32(global_amax)
        if not (np.isfinite(amax) and amax >= 0):
            raise ValueError(f"global_amax must be finite and >= 0, got {global_amax}")
    s_enc = global_encode_scale(amax)
    s_dec = np.float32(1.0) / s_enc

    blocks = x.reshape(-1, BLOCK_SIZE)
    finite_block = np.isfinite(blocks).all(axis=1)
    # Zero the masked blocks so the arithmetic below is warning-free; their outputs are replaced.
    blocks = np.where(finite_block[:, None], blocks, np.float32(0.0))
    block_amax = np.abs(blocks).max(axis=1)

    with np.errstate(over="ignore", divide="ignore"):
        # TE order: (S_enc * fp4_max_inv) first, then times block_amax.
        scale_codes = encode_e4m3(block_amax * (s_enc * INV_E2M1_MAX))
        # TE order: s * S_dec, then the reciprocal, then the clamp (fminf).
        scale_rcp = np.fmin(np.float32(1.0) / (decode_e4m3(scale_codes) * s_dec), FP32_MAX)
        y = blocks * scale_rcp[:, None]
    if rounding == "nearest":
        codes = encode_e2m1(y)
    else:
        codes = encode_e2m1_stochastic(y, stochastic_bits16(seed, step, x.size).reshape(y.shape))

    codes = np.where(finite_block[:, None], codes, np.uint8(0)).astype(np.uint8)
    scale_codes = np.where(finite_block, scale_codes, np.uint8(E4M3_NAN)).astype(np.uint8)
    return (
        codes.reshape(x.shape),
        scale_codes.reshape(x.shape[:-1] + (x.shape[-1] // BLOCK_SIZE,)),
        s_dec,
    )


def dequantize_reference(
    codes: npt.ArrayLike, scales: npt.ArrayLike, global_scale: SupportsFloat
) -> np.ndarray:
    """Inverse of ``quantize_reference``: (e2m1(code) * e4m3(scale)) * global_scale in float32.

    ``codes`` uint8 (..., K) unpacked, ``scales`` uint8 (..., K // 16). A NaN scale (0x7F/0xFF)
    makes its whole block NaN.
    """
    codes, scales = check_codes(codes, scales, BLOCK_SIZE)
    values = decode_e2m1(codes).reshape(-1, BLOCK_SIZE) * decode_e4m3(scales).reshape(-1, 1)
    return (values * np.float32(global_scale)).reshape(codes.shape)
