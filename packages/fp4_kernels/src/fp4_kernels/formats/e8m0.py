"""E8M0, the MXFP4 block-scale type (OCP Microscaling Formats (MX) v1.0, §5.4.1).

An unsigned 8-bit biased exponent: code c in 0..254 means 2**(c - 127); 255 is NaN. There is no
sign, no zero and no Inf. Code 0 is 2**-127, which float32 holds exactly as a subnormal.

This module is the numpy reference (the oracle).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

E8M0_BIAS = 127
E8M0_NAN = 0xFF
E8M0_MIN_EXP = -127  # code 0
E8M0_MAX_EXP = 127  # code 254

# Index = code. Built in float64 and narrowed: every 2**k for k in [-127, 127] is exact in float32.
E8M0_VALUES = np.append(np.ldexp(1.0, np.arange(255) - E8M0_BIAS), np.nan).astype(np.float32)


def decode_e8m0(codes: npt.ArrayLike) -> np.ndarray:
    """Maps uint8 E8M0 codes to float32 2**(c - 127) (OCP MX v1.0 Table 7); 0xFF decodes to NaN."""
    codes = np.asarray(codes)
    if codes.dtype != np.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    return E8M0_VALUES[codes]


def encode_e8m0_exponent(e: npt.ArrayLike) -> np.ndarray:
    """Encodes integer exponents e (meaning 2**e) as E8M0 codes: clip(e, -127, 127) + 127.

    Clipping to the representable range is the MX rule for a shared exponent outside it
    (OCP MX v1.0 §6.3: the scale is clamped, never NaN); code 255 (NaN) is never produced.
    """
    e = np.asarray(e)
    if not np.issubdtype(e.dtype, np.integer):
        raise TypeError(f"e must be an integer array, got {e.dtype}")
    # clipped in e's own dtype first: a uint64 above 2**63 would wrap negative as int64
    e = np.clip(e, max(E8M0_MIN_EXP, np.iinfo(e.dtype).min), E8M0_MAX_EXP).astype(np.int64)
    return (e + E8M0_BIAS).astype(np.uint8)
