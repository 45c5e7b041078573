"""Philox4x32-10, the counter-based generator behind stochastic rounding (reference implementation).

Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as 1, 2, 3", SC'11, and the
Random123 library (``philox4x32_R`` with R = 10). It is the generator cuRAND's
``curand_Philox4x32_10`` and Transformer Engine's stochastic NVFP4 rounding use. Being
counter-based, the random bits of element i are a pure function of (seed, step, i), so any
kernel layout can reproduce this reference exactly.
"""

from __future__ import annotations

import operator

import numpy as np
import numpy.typing as npt

PHILOX_M0 = 0xD2511F53  # multiplies counter word 0
PHILOX_M1 = 0xCD9E8D57  # multiplies counter word 2
PHILOX_W0 = 0x9E3779B9  # key word 0 bump (golden ratio)
PHILOX_W1 = 0xBB67AE85  # key word 1 bump (sqrt(3) - 1)
PHILOX_ROUNDS = 10

_MASK32 = np.uint64(0xFFFFFFFF)
_SHIFT32 = np.uint64(32)


def _mulhilo(multiplier, word):
    """Returns the (hi, lo) 32-bit halves of the product, exact in uint64 (both factors < 2**32)."""
    product = np.uint64(multiplier) * word
    return product >> _SHIFT32, product & _MASK32


def philox4x32_10(counter: npt.ArrayLike, key: npt.ArrayLike) -> np.ndarray:
    """Philox4x32 with 10 rounds (Random123 ``philox4x32_R(10, ctr, key)``).

    ``counter`` is uint32 (..., 4) and ``key`` uint32 (..., 2); they broadcast. One round:
    (hi0, lo0) = mulhilo(M0, c0); (hi1, lo1) = mulhilo(M1, c2);
    c = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0). Between rounds (9 times) the key is bumped:
    k0 += W0, k1 += W1 (mod 2**32). Arithmetic is carried in uint64 and masked to 32 bits.
    Returns uint32 (..., 4).
    """
    counter = np.asarray(counter)
    key = np.asarray(key)
    if counter.dtype != np.uint32 or counter.shape[-1:] != (4,):
        raise ValueError(
            f"counter must be uint32 with last dimension 4, got {counter.dtype} {counter.shape}"
        )
    if key.dtype != np.uint32 or key.shape[-1:] != (2,):
        raise ValueError(f"key must be uint32 with last dimension 2, got {key.dtype} {key.shape}")
    c0, c1, c2, c3 = (counter[..., j].astype(np.uint64) for j in range(4))
    k0, k1 = (key[..., j].astype(np.uint64) for j in range(2))
    for round_index in range(PHILOX_ROUNDS):
        if round_index > 0:
            k0 = (k0 + np.uint64(PHILOX_W0)) & _MASK32
            k1 = (k1 + np.uint64(PHILOX_W1)) & _MASK32
        hi0, lo0 = _mulhilo(PHILOX_M0, c0)
        hi1, lo1 = _mulhilo(PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return np.stack(np.broadcast_arrays(c0, c1, c2, c3), axis=-1).astype(np.uint32)


def stochastic_bits16(seed: int, step: int, n: int) -> np.ndarray:
    """The 16 random bits of each flat element index i in [0, n) of one quantization call (uint16).

    Element i uses output word (i % 8) // 2 of Philox4x32-10 at
    counter = (c mod 2**32, c >> 32, step, 0) with c = i // 8, and
    key = (seed mod 2**32, seed >> 32): the low 16 bits of that word for even i, the high 16 bits
    for odd i. So eight consecutive elements share one Philox call, ``step`` (e.g. the training
    step) changes every value, and no two elements of one call share bits. ``seed`` must be in
    [0, 2**64), ``step`` in [0, 2**32), ``n`` >= 0.
    """
    seed, step, n = operator.index(seed), operator.index(step), operator.index(n)
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    if not 0 <= step < 2**32:
        raise ValueError(f"step must be in [0, 2**32), got {step}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    calls = np.arange(-(-n // 8), dtype=np.uint64)
    counter = np.zeros(calls.shape + (4,), dtype=np.uint32)
    counter[:, 0] = calls & _MASK32
    counter[:, 1] = calls >> _SHIFT32
    counter[:, 2] = step
    key = np.array([seed & 0xFFFFFFFF, seed >> 32], dtype=np.uint32)
    words = philox4x32_10(counter, key)  # (calls, 4)
    halves = np.stack([words & np.uint32(0xFFFF), words >> np.uint32(16)], axis=-1)  # low first
    return halves.reshape(-1)[:n].astype(np.uint16)
