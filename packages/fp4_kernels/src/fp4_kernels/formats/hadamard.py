"""The Walsh–Hadamard transform over contiguous groups (reference implementation).

For a group size g (a power of two), the normalized transform of a row vector x of g elements
is::

    y = (x * signs) @ H_g / sqrt(g)        H_g = scipy.linalg.hadamard(g) (Sylvester order)

and, since H_g H_g = g I, its inverse is x = (y @ H_g / sqrt(g)) * signs.  ``signs`` is an
optional ±1 vector (the randomized transform of NVFP4 training recipes); without it the
transform is its own inverse.

The fast transform computes y @ H_g with log2(g) butterfly stages: the stage for index bit b
replaces each pair (u, v) = (y[i], y[i + 2^b]) with i's bit b clear by (u + v, u - v).  The
stages commute in exact arithmetic, but in float32 every stage rounds, so the result depends on
the order in which the stages run.  ``STAGE_ORDER`` is the order the CUDA kernels use (their
register, warp-shuffle and shared-memory stages; see ``fp4_kernels.cuda.butterflies``) and the
float32 reference ``fwht`` runs the same order, so that codecs built on the transform (FP4Quant)
can be checked bit for bit.  The scaling by 1/sqrt(g) is one float32 multiplication at the end
(exact when g is a power of 4).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from .philox import philox4x32_10

MIN_GROUP_SIZE = 16
MAX_GROUP_SIZE = 8192  # a CTA of 256 threads x 32 elements holds one group

# The stage order's three parts.  It is the order of the first GPU kernels' register, warp-shuffle
# and shared-memory stages (a thread held elements 4 * (lane + 32 j) + (0..3), bits 0, 1, 7, 8 in
# its registers); the kernels now keep other bits in registers (``fp4_kernels.cuda.butterflies``)
# but run the stages in the same order, which is part of the transform's definition.
REGISTER_BITS = (0, 1, 7, 8)
LANE_BITS = (2, 3, 4, 5, 6)


def check_group_size(group_size: int, name: str = "group_size") -> int:
    """``group_size`` as an int, or an error naming the allowed values."""
    try:
        g = operator.index(group_size)
    except TypeError:
        raise TypeError(f"{name}: expected an integer, got {type(group_size).__name__}") from None
    if g < MIN_GROUP_SIZE or g > MAX_GROUP_SIZE or g & (g - 1):
        raise ValueError(
            f"{name}: {g} is not a power of two in [{MIN_GROUP_SIZE}, {MAX_GROUP_SIZE}] "
            "(16, 32, ..., 8192)"
        )
    return g


def check_groups(x: npt.ArrayLike, group_size: int) -> tuple[np.ndarray, int]:
    """``(x, g)`` for a float32 array whose last dimension is a whole number of groups."""
    x = np.asarray(x)
    if x.dtype != np.float32:
        raise TypeError(f"x must be float32, got {x.dtype}")
    g = check_group_size(group_size)
    if x.ndim == 0 or x.shape[-1] % g:
        raise ValueError(f"x: last dimension of shape {x.shape} is not a multiple of {g}")
    return x, g


def stage_order(group_size: int) -> tuple[int, ...]:
    """The index bits of the butterfly stages in the order the kernels apply them.

    Bits 0, 1, 7, 8 (those below log2(g)), then bits 2-6, then bits 9 and up in increasing
    order.
    """
    bits = check_group_size(group_size).bit_length() - 1
    regs = [b for b in REGISTER_BITS if b < bits]
    lanes = [b for b in LANE_BITS if b < bits]
    return tuple(regs + lanes + list(range(9, bits)))


def fwht(x: npt.ArrayLike, group_size: int, order: Sequence[int] | None = None) -> np.ndarray:
    """Unnormalized fast Walsh–Hadamard transform ``x.reshape(-1, g) @ H_g`` in float32.

    One float32 rounding per stage per element, stages in ``order`` (default: the kernels'
    ``stage_order(g)``).  ``x`` float32 with a last dimension divisible by g; same shape out.
    """
    x, g = check_groups(x, group_size)
    y = x.reshape(-1, g).copy()
    for b in stage_order(g) if order is None else order:
        h = 1 << b
        v = y.reshape(-1, g // (2 * h), 2, h)
        lo = v[:, :, 0, :].copy()
        hi = v[:, :, 1, :]
        v[:, :, 0, :] = lo + hi
        v[:, :, 1, :] = lo - hi
    return y.reshape(x.shape)


def inv_sqrt_group_size(group_size: int) -> np.float32:
    """float32(1 / sqrt(g)): exact for g = 4^k, otherwise the correctly rounded value."""
    g = check_group_size(group_size)
    return np.float32(1.0 / math.sqrt(g))


def hadamard_reference(
    x: npt.ArrayLike,
    group_size: int,
    *,
    inverse: bool = False,
    signs: int | npt.ArrayLike | None = None,
) -> np.ndarray:
    """Normalized transform of float32 ``x`` in the kernels' operation order (float32 out).

    forward: fwht(x * signs) * float32(1/sqrt(g)); inverse: fwht(x) * float32(1/sqrt(g)) * signs.
    Multiplying by ±1 is exact, so the signs add no rounding.
    """
    x, g = check_groups(x, group_size)
    s = None if signs is None else _sign_vector(signs, g)
    y = x.reshape(-1, g)
    if s is not None and not inverse:
        y = y * s
    y = fwht(y, g) * inv_sqrt_group_size(g)
    if s is not None and inverse:
        y = y * s
    return y.reshape(x.shape)


def _sign_vector(signs, g):
    """``hadamard_reference``'s ``signs``: an int seed (``hadamard_signs``) or g values of
    +-1, as float32."""
    if isinstance(signs, (int, np.integer)) and not isinstance(signs, (bool, np.bool_)):
        return hadamard_signs(g, signs)
    try:
        s = np.asarray(signs, np.float32)
    except (TypeError, ValueError):
        raise TypeError(f"signs: expected a seed (int) or {g} values of +1 / -1, got "
                        f"{type(signs).__name__}") from None  # fmt: skip
    if s.shape != (g,) or not np.all(np.abs(s) == 1):
        raise ValueError(f"signs: expected {g} values of +1 / -1 (one per element of a group), "
                         f"got shape {s.shape}")  # fmt: skip
    return s


def hadamard_signs(group_size: int, seed: int) -> np.ndarray:
    """The ±1 float32 vector of length g that ``signs=seed`` stands for.

    Bit i of the stream decides sign i (set: -1): bit i % 32 of output word (i // 32) % 4 of
    Philox4x32-10 at counter (i // 128, 0, 0, 0x48414441 'HADA') and key = (seed mod 2**32,
    seed >> 32).  A pure function of (g, seed): every rank and backend derives the same vector,
    and the vector for g is a prefix of the vector for 2g.
    """
    g = check_group_size(group_size)
    return sign_bits_to_values(sign_words(g, seed), g)


SIGNS_DOMAIN = 0x48414441  # counter word 3: keeps these words apart from stochastic rounding's


def sign_words(group_size: int, seed: int) -> np.ndarray:
    """uint32 words whose bits are the signs (bit i % 32 of word i // 32; set = negative)."""
    g = check_group_size(group_size)
    try:
        if isinstance(seed, (bool, np.bool_)):
            raise TypeError
        seed = operator.index(seed)
    except TypeError:
        raise TypeError(f"signs: a seed is an int, got {type(seed).__name__}") from None
    if not 0 <= seed < 2**64:
        raise ValueError(f"signs: a seed must be in [0, 2**64), got {seed}")
    n_words = -(-g // 32)
    calls = np.arange(-(-n_words // 4), dtype=np.uint64)
    counter = np.zeros(calls.shape + (4,), np.uint32)
    counter[:, 0] = calls
    counter[:, 3] = SIGNS_DOMAIN
    key = np.array([seed & 0xFFFFFFFF, seed >> 32], np.uint32)
    words = philox4x32_10(counter, key).reshape(-1)[:n_words]
    if g < 32:
        words = words & np.uint32((1 << g) - 1)
    return words


def sign_bits_to_values(words: npt.ArrayLike, group_size: int) -> np.ndarray:
    """The ±1 float32 vector encoded by ``sign_words``."""
    i = np.arange(group_size)
    bits = (np.asarray(words, np.uint32)[i // 32] >> (i % 32).astype(np.uint32)) & 1
    return np.where(bits == 1, np.float32(-1.0), np.float32(1.0)).astype(np.float32)


def sign_values_to_words(signs: npt.ArrayLike) -> np.ndarray:
    """Inverse of ``sign_bits_to_values`` for a ±1 vector (checked by the caller)."""
    s = np.asarray(signs)
    neg = (s < 0).astype(np.uint64)
    n_words = -(-s.size // 32)
    padded = np.zeros(n_words * 32, np.uint64)
    padded[: s.size] = neg
    shifts = np.arange(32, dtype=np.uint64)
    return (padded.reshape(n_words, 32) << shifts).sum(axis=1).astype(np.uint32)
