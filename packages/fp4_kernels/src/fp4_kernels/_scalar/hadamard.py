"""The Walsh–Hadamard transform's butterfly stage, ``lo + hi`` and ``lo - hi`` in float32: the
transform's one arithmetic, run over a group by the CPU path and over a thread's registers by
the GPU kernels' register stages (their lane and shared-memory stages move the operands, then
add and subtract in the same order)."""

from __future__ import annotations

FUNCTIONS = ("butterflies",)


def butterflies(v, n, h):
    """One stage over ``v[:n]``: each pair (i, i + h) with bit ``h`` of i clear becomes
    (v[i] + v[i + h], v[i] - v[i + h]); ``h`` a power of two below ``n``."""
    for i in range(n):
        if i & h == 0:
            a = v[i]
            b = v[i + h]
            v[i] = a + b
            v[i + h] = a - b
