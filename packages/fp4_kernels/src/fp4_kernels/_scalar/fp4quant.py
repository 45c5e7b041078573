"""FP4Quant's group scale: the bfloat16 scale, rounded up, and the element multiplier."""

from __future__ import annotations

from .._numba_abi import py_f32_as_u32 as f32_as_u32, py_u32_as_f32 as u32_as_f32
from .arith import F32_ONE, F32_ZERO, FP32_MAX, U32
from .e2m1 import INV_E2M1_MAX

FUNCTIONS = ("fp4quant_scale",)

BF16_NAN_BITS = 0x7FC0  # the quiet NaN FP4Quant stores as the scale of a non-finite group


def fp4quant_scale(amax_bits):
    """Group amax (bits of max |t|; >= 0x7F800000 means non-finite) -> (bf16 scale bits,
    float32 encode multiplier).  s = amax * fp32(1/6) rounded *up* to bfloat16, so that
    amax * (1/s) does not exceed 6 by more than the multiplier's own rounding; the
    multiplier is fmin(1 / s, FLT_MAX) (s == 0 gives FLT_MAX: zeros stay zeros)."""
    if amax_bits >= 0x7F800000:
        return U32(BF16_NAN_BITS), F32_ZERO
    s32 = u32_as_f32(U32(amax_bits)) * INV_E2M1_MAX
    # adding 0xFFFF carries into the kept bits unless the dropped ones are all zero:
    # rounding toward +inf of a non-negative finite float (no overflow below 2^128 / 6)
    sb = U32(U32(f32_as_u32(s32) + 0xFFFF) >> 16)
    if sb == 0:  # an all-zero group: 1/0 would be inf, clamped to FLT_MAX
        return sb, FP32_MAX
    mult = F32_ONE / u32_as_f32(U32(sb << 16))
    if mult > FP32_MAX:
        mult = FP32_MAX
    return sb, mult
