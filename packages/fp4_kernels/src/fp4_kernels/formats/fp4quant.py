"""FP4Quant: e2m1 codes in contiguous groups of g elements, one bfloat16 scale per group, after an
optional Walsh–Hadamard transform of each group (reference implementation).

The method (Liu et al., "FP4Quant", preprint) divides each group by its root-mean-square,
applies the normalized Walsh–Hadamard transform, divides by the transformed group's absolute
maximum over 6 and rounds to e2m1; the receiver rescales and transforms back.  Two scales (the
RMS r and the absmax m of the transformed group) describe that, but only one number per group is
needed: the transform is linear, so transforming x / r gives H x / r and its absmax is
amax(H x) / r; the codes are (H x / r) / (amax(H x) / (6 r)) = H x / (amax(H x) / 6), and the
decoded group is r * (m / 6) * H^-1(e2m1) = (amax(H x) / 6) * H^-1(e2m1).  The RMS cancels.  It
matters only to an implementation that computes the transform in bf16 (to keep it in range);
here every step is float32.  So the stored scale is that product, s = amax(H x) / 6, in
bfloat16 rounded *up* (so no element is clipped by the scale's rounding): 16 bits per group.
``docs/fp4quant_study.md`` measures the alternatives (two scales, float32 scale, bf16 rounded to
nearest).

Encode, per group of g elements (float32 throughout, in this order)::

    t   = fwht(x)                                 # unnormalized, the kernels' stage order
                                                  # (t = x when hadamard=False)
    m   = max |t|        (NaN if any t is NaN or ±Inf)
    s   = bf16_round_up(m * float32(1/6))         # stored; NaN -> 0x7FC0
    inv = fmin(1 / s, FP32_MAX)                   # s = 0 -> FP32_MAX, so zeros stay zeros
    code = e2m1(t * inv)                          # nearest-even, or stochastic with the
                                                  # bits stochastic_bits16(seed, step, n)[i]

Decode::

    y = fwht(e2m1_value(code)) * (float32(s) * 2^-log2(g))   # y = e2m1_value(code) * s without

The butterflies run on the e2m1 values themselves (multiples of 0.5 below 6; their sums over
at most 8192 elements are exact in float32), so they round nothing, in any order, and cannot
overflow; the one rounding is the final multiplication, by s * 2^-log2(g), which is exact
unless s < 2^-126 g (float32 subnormals), and is never part of an FMA (it follows the last
add).  Non-finite input makes the group's scale NaN and the whole group decodes to NaN (the
transform spreads a NaN over its group anyway); codes there are 0.  The encoder's transform
overflows float32 for ``|x|`` above about FLT_MAX / g (1e34 at g = 8192): such a group is
non-finite and decodes to NaN.  Without the transform the scale is amax / 6 rounded *up* to
bfloat16, so 6 s can exceed FLT_MAX for an amax within about 2^-8 of FLT_MAX (>= ~3.39e38): the
group's largest elements then decode to +-inf, not NaN.

Wire layout of a tensor of n elements (``QuantizedTensor.payload``): n/2 bytes of packed codes
(element 2i in the low nibble of byte i), then n/g little-endian uint16 bfloat16 scales:
4 + 16/g bits per element (5 at g = 16, 4.25 at 64, 4.0625 at 256, 4.03125 at 512).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .e2m1 import INV_E2M1_MAX, decode_e2m1, encode_e2m1, encode_e2m1_stochastic
from .hadamard import check_group_size, check_groups, fwht
from .philox import stochastic_bits16

FP32_MAX = np.finfo(np.float32).max
BF16_NAN_BITS = 0x7FC0
GROUP_SIZES_STUDIED = (64, 256, 512)  # the paper's settings


@dataclass(frozen=True)
class FP4Quant:
    """The FP4Quant group codec, usable as ``fmt=`` of quantize / dequantize.

    Contiguous groups of ``group_size`` elements of the last dimension (a power of two, 16 to
    8192), each transformed by the Walsh–Hadamard transform when ``hadamard`` is true (which
    spreads an outlier over its group), scaled by one bfloat16 scale (the transformed group's
    amax / 6, rounded up) and rounded to e2m1: 4 + 16/g bits per element.  The exact operation
    order, the wire layout and why one scale suffices: ``fp4_kernels.formats.fp4quant``, where
    this class is the format's spec (as ``nvfp4.SPEC`` and ``mxfp4.SPEC`` are those formats').
    """

    group_size: int = 64
    hadamard: bool = True

    def __post_init__(self) -> None:
        # stored as an int (np.int64(64) would reach the kernels' int-only code otherwise)
        object.__setattr__(
            self, "group_size", check_group_size(self.group_size, "FP4Quant.group_size")
        )
        if not isinstance(self.hadamard, bool):
            raise TypeError(f"FP4Quant.hadamard: expected True or False, got {self.hadamard!r}")

    @property
    def block_size(self) -> int:
        """Elements per scale: the group size."""
        return self.group_size

    @property
    def bits_per_element(self) -> float:
        """4 bits of code plus a 16-bit scale per group: 4 + 16 / group_size."""
        return 4 + 16 / self.group_size

    def __str__(self) -> str:
        return f"fp4quant(g={self.group_size}{'' if self.hadamard else ', no hadamard'})"


def bits_per_element(group_size: int) -> float:
    """4-bit codes plus one 16-bit scale per group."""
    return 4 + 16 / check_group_size(group_size)


def bf16_round_up(s: npt.ArrayLike) -> np.ndarray:
    """float32 >= 0 (finite) -> bfloat16 bits, rounded toward +inf."""
    u = np.asarray(s, np.float32).view(np.uint32).astype(np.uint64)
    return (((u + 0xFFFF) >> 16) & 0xFFFF).astype(np.uint16)


def bf16_bits_to_f32(bits: npt.ArrayLike) -> np.ndarray:
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def quantize_reference(
    x: npt.ArrayLike,
    group_size: int,
    *,
    hadamard: bool = True,
    rounding: str = "nearest",
    seed: int = 0,
    step: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """float32 ``x`` (..., K), K % g == 0 -> (codes uint8 (..., K) unpacked, scales uint16
    (..., K // g) bfloat16 bits)."""
    x, g = check_groups(x, group_size)
    groups = x.reshape(-1, g)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        t = fwht(groups, g) if hadamard else groups.copy()
        finite = np.isfinite(t).all(axis=1)
        t = np.where(finite[:, None], t, np.float32(0.0))
        m = np.abs(t).max(axis=1)
        scales = bf16_round_up(m * INV_E2M1_MAX)
        inv = np.fmin(np.float32(1.0) / bf16_bits_to_f32(scales), FP32_MAX)
        y = t * inv[:, None]
    if rounding == "nearest":
        codes = encode_e2m1(y)
    elif rounding == "stochastic":
        codes = encode_e2m1_stochastic(y, stochastic_bits16(seed, step, x.size).reshape(y.shape))
    else:
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    codes = np.where(finite[:, None], codes, np.uint8(0)).astype(np.uint8)
    scales = np.where(finite, scales, np.uint16(BF16_NAN_BITS)).astype(np.uint16)
    return codes.reshape(x.shape), scales.reshape(x.shape[:-1] + (x.shape[-1] // g,))


def dequantize_reference(
    codes: npt.ArrayLike, scales: npt.ArrayLike, group_size: int, *, hadamard: bool = True
) -> np.ndarray:
    """Inverse of ``quantize_reference`` -> float32 of the codes' shape."""
    codes = np.asarray(codes)
    g = check_group_size(group_size)
    scales = np.asarray(scales)
    if codes.ndim == 0 or codes.shape[-1] % g:
        raise ValueError(f"codes: last dimension of shape {codes.shape} is not a multiple of {g}")
    expected = codes.shape[:-1] + (codes.shape[-1] // g,)
    if scales.dtype != np.uint16 or scales.shape != expected:
        raise ValueError(f"scales: expected uint16 bf16 bits of shape {expected} (one per group "
                         f"of {g}), got {scales.dtype} {scales.shape}")  # fmt: skip
    s = bf16_bits_to_f32(scales).reshape(-1, 1)
    v = decode_e2m1(codes).reshape(-1, g)
    if hadamard:
        v = fwht(v, g)  # exact (see the module docstring)
        s = s * np.float32(2.0 ** -(g.bit_length() - 1))
    with np.errstate(invalid="ignore", over="ignore"):
        return (v * s).reshape(codes.shape)
