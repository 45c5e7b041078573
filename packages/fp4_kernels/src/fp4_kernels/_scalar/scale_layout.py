"""Where a block's scale sits: the linear layout or cuBLASLt's 128 x 4 tiles."""

from __future__ import annotations

import numpy as np

FUNCTIONS = ("scale_offset",)


def scale_offset(blk, kb, padded_kb, swizzled):
    """Byte offset of block ``blk``'s scale: linear (row-major rows x kb) or 128x4 tiles.

    Swizzled: the layout of cuBLASLt's VEC16_UE4M3 / VEC32_UE8M0 scale modes and
    torch._scaled_mm: 128-row x 4-column tiles of 512 bytes in row-major tile order; inside
    a tile, row r sits at (r % 32) * 16 + (r // 32) * 4 and column c at + c.  Unsigned, so
    an array index needs no negative-index wraparound.
    """
    if not swizzled:
        return np.uint64(blk)
    r = blk // kb
    col = blk - r * kb
    tile = (r >> 7) * (padded_kb >> 2) + (col >> 2)
    return np.uint64(tile * 512 + (r & 31) * 16 + ((r & 127) >> 5) * 4 + (col & 3))
