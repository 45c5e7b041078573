"""Stochastic rounding test cases shared by the oracle's and the scalar codec's tests: values of
a = |y| at every edge of the e2m1 grid, and the exact number of the 2^16 random values r16
that round each up, computed in rational arithmetic (independent of float32)."""

from fractions import Fraction

import numpy as np

ALL_R16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _neighbours(v):
    v = np.float32(v)
    return [np.nextafter(v, np.float32(0)), v, np.nextafter(v, np.float32(np.inf))]


def edge_magnitudes():
    """float32 a >= 0 (and NaN) covering every binade and edge the rounding has: zero, the
    subnormals, the grid points, the midpoints and their neighbours, fractions that put
    p 2^16 on a half (the ties of the 16-bit rounding), just below 2, 4 and 6, saturation."""
    tiny = np.float32(2.0**-149)
    values = [0.0, tiny, 2 * tiny, 3 * tiny, np.float32(2.0**-127), np.float32(2.0**-126)]
    values += [np.float32(np.finfo(np.float32).smallest_normal) - tiny]  # largest subnormal
    for mid in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0):
        values += _neighbours(mid)
    for g in _GRID[1:]:
        values += _neighbours(g)
    # p 2^16 = 0.5, 1.5, 2^15 + 0.5 in each gap: gap 1/2 on [0, 2), 1 on [2, 4), 2 on [4, 6)
    for lo, gap in ((0.0, 0.5), (1.5, 0.5), (2.0, 1.0), (3.0, 1.0), (4.0, 2.0)):
        for k in (0.5, 1.5, 2**15 + 0.5, 2**16 - 0.5, 2**16 - 1):
            values.append(np.float32(lo + gap * k * 2.0**-16))
    values += [2.0**-17, 2.0**-18, 3 * 2.0**-18, 6.5, 7.0, 1e30, np.finfo(np.float32).max]
    values += [np.inf, np.nan]
    return np.array(values, dtype=np.float32)


def expected_codes(a, r16):
    """The magnitude code of each a (1-D) for each r16 (1-D): (a.size, r16.size) uint8.

    Below 6, lo is the grid point at or below a and p = (a - lo) / gap exactly; a rounds up
    for the count = floor(p 2^16 + 1/2) largest values of r16 (so P(up) is p rounded to 16 bits,
    halves up); 6 and above (Inf included) is code 7, NaN code 0.
    """
    out = np.empty((a.size, r16.size), np.uint8)
    r = r16.astype(np.int64)
    for i, v in enumerate(a.tolist()):
        if v != v:
            out[i] = 0
            continue
        if v >= 6.0:
            out[i] = 7
            continue
        lo = max(k for k in range(7) if _GRID[k] <= v)
        p = (Fraction(v) - Fraction(_GRID[lo])) / (Fraction(_GRID[lo + 1]) - Fraction(_GRID[lo]))
        count = int(p * (1 << 16) + Fraction(1, 2))  # floor: the operand is >= 0
        out[i] = lo + (r >= (1 << 16) - count)
    return out
