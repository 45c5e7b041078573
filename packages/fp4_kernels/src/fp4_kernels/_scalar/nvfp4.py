"""NVFP4's scale arithmetic, in Transformer Engine's order: the tensor encode scale and the
block scale (e4m3 code, decoded scale, element multiplier)."""

from __future__ import annotations

from .._numba_abi import py_u32_as_f32 as u32_as_f32
from ..formats import nvfp4
from .arith import F32_NAN, F32_ONE, F32_ZERO, FP32_MAX, U32
from .e4m3 import E4M3_NAN_CODE, e4m3_decode, e4m3_encode_positive

FUNCTIONS = ("nvfp4_encode_scale", "nvfp4_block_scale")

NVFP4_AMAX_TO_SCALE = nvfp4.NVFP4_GLOBAL_AMAX_TARGET  # 2688: e4m3 max times e2m1 max


def nvfp4_encode_scale(amax):
    """Tensor encode scale S = min(2688 / amax, FLT_MAX); 1 when amax or S is 0 (as TE)."""
    if amax == F32_ZERO:
        return F32_ONE
    s = NVFP4_AMAX_TO_SCALE / amax
    if s > FP32_MAX:
        s = FP32_MAX
    if s == F32_ZERO:
        return F32_ONE
    return s


def nvfp4_block_scale(bmax_bits, s6, s_dec):
    """Block amax (bits of max |x|; >= 0x7F800000: the block holds NaN or Inf) ->
    (e4m3 scale code, decoded scale s, element multiplier), in Transformer Engine's order:
    code = e4m3(amax_b * (S * fp32(1/6))) with s6 = S * fp32(1/6) given; the multiplier
    is 1 / (s * (1/S)), the product first, clamped to FLT_MAX (s == 0 gives FLT_MAX).
    A non-finite block gets the NaN code, s = NaN (it decodes to NaN) and multiplier 0."""
    if bmax_bits >= 0x7F800000:
        return U32(E4M3_NAN_CODE), F32_NAN, F32_ZERO
    scode = U32(e4m3_encode_positive(u32_as_f32(U32(bmax_bits)) * s6))
    s = e4m3_decode(scode)
    mult = F32_ONE / (s * s_dec)
    if mult > FP32_MAX:
        mult = FP32_MAX
    return scode, s, mult
