"""Philox4x32-10 (Salmon et al., SC'11; Random123's philox4x32_10): the random bits of
stochastic rounding."""

from __future__ import annotations

import numpy as np

from .arith import U32, mul_wide_u32

FUNCTIONS = ("philox4x32_10",)

PHILOX_M0_32 = np.uint32(0xD2511F53)
PHILOX_M1_32 = np.uint32(0xCD9E8D57)
PHILOX_W0_32 = np.uint32(0x9E3779B9)  # the key increments as uint32 (wrapping adds)
PHILOX_W1_32 = np.uint32(0xBB67AE85)


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32 with 10 rounds; all words uint32 values, returns a 4-tuple of uint32.

    Every word is a uint32 and each product one 32 x 32 -> 64-bit multiply (one
    IMAD.WIDE.U32 on the GPU)."""
    x0 = U32(c0)
    x1 = U32(c1)
    x2 = U32(c2)
    x3 = U32(c3)
    key0 = U32(k0)
    key1 = U32(k1)
    for _ in range(10):
        lo0, hi0 = mul_wide_u32(PHILOX_M0_32, x0)
        lo1, hi1 = mul_wide_u32(PHILOX_M1_32, x2)
        x0 = U32(U32(hi1 ^ x1) ^ key0)
        x2 = U32(U32(hi0 ^ x3) ^ key1)
        x1 = lo1
        x3 = lo0
        key0 = U32(U32(key0) + PHILOX_W0_32)
        key1 = U32(U32(key1) + PHILOX_W1_32)
    return x0, x1, x2, x3
