"""The swizzled block-scale layout read by Blackwell block-scaled GEMMs.

cuBLASLt's ``CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3`` (NVFP4) and ``VEC32_UE8M0`` (MXFP4)
scale modes, PTX ``tcgen05.mma`` block scaling and ``torch._scaled_mm`` all read the scales of an
operand as 128 x 4 tiles (128 rows, 4 scale columns = 64 or 128 elements of K), each tile
512 contiguous bytes. Tiles are laid out row-major over (rows / 128, cols / 4). Inside a tile,
row r = 32 * i + j (i in 0..3, j in 0..31) and column c sit at byte j * 16 + i * 4 + c
(cuBLAS docs, "1D Block Scaling Factors Layout"; the "32_4_4" layout). The matrix of scales is
padded with zeros to whole tiles.

This module is the numpy reference (the oracle).
"""

from __future__ import annotations

import operator

import numpy as np
import numpy.typing as npt

SCALE_TILE_ROWS = 128  # rows per tile
SCALE_TILE_COLS = 4  # scale columns per tile
SCALE_TILE_BYTES = SCALE_TILE_ROWS * SCALE_TILE_COLS  # 512
_ROW_GROUP = 32  # rows i*32 .. i*32+31 of a tile interleave with the other three groups


def swizzled_shape(rows: int, cols: int) -> tuple[int, int]:
    """The tile-padded size (padded_rows, padded_cols) = (ceil(rows/128)*128, ceil(cols/4)*4)."""
    if isinstance(rows, bool) or isinstance(cols, bool):
        raise TypeError(f"rows and cols must be ints, got {rows!r}, {cols!r}")
    rows, cols = operator.index(rows), operator.index(cols)  # TypeError for 1.5
    if rows < 0 or cols < 0:
        raise ValueError(f"rows and cols must be >= 0, got {rows}, {cols}")
    return (
        -(-rows // SCALE_TILE_ROWS) * SCALE_TILE_ROWS,
        -(-cols // SCALE_TILE_COLS) * SCALE_TILE_COLS,
    )


def swizzled_offsets(rows: int, cols: int) -> np.ndarray:
    """int64 (rows, cols): the byte offset of scale (r, c) in the swizzled buffer.

    offset = ((r // 128) * (padded_cols // 4) + c // 4) * 512
             + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
    """
    _, padded_cols = swizzled_shape(rows, cols)
    r = np.arange(rows, dtype=np.int64)[:, None]
    c = np.arange(cols, dtype=np.int64)[None, :]
    tile = (r // SCALE_TILE_ROWS) * (padded_cols // SCALE_TILE_COLS) + c // SCALE_TILE_COLS
    within_tile = (
        (r % _ROW_GROUP) * 16 + ((r % SCALE_TILE_ROWS) // _ROW_GROUP) * 4 + c % SCALE_TILE_COLS
    )
    return tile * SCALE_TILE_BYTES + within_tile


def to_swizzled(scales: npt.ArrayLike) -> np.ndarray:
    """uint8 scales (rows, cols) -> uint8 1-D swizzled buffer of padded_rows * padded_cols bytes.

    Padding bytes are 0 (an E4M3 zero scale; for E8M0 code 0 is 2**-127, and padded scales only
    ever multiply padded, i.e. absent, rows or columns).
    """
    scales = np.asarray(scales)
    if scales.dtype != np.uint8 or scales.ndim != 2:
        raise ValueError(f"scales must be a 2-D uint8 array, got {scales.dtype} {scales.shape}")
    rows, cols = scales.shape
    padded_rows, padded_cols = swizzled_shape(rows, cols)
    flat = np.zeros(padded_rows * padded_cols, dtype=np.uint8)
    flat[swizzled_offsets(rows, cols)] = scales
    return flat


def from_swizzled(flat: npt.ArrayLike, rows: int, cols: int) -> np.ndarray:
    """Inverse of ``to_swizzled``: the 1-D swizzled buffer back to uint8 (rows, cols), unpadded."""
    flat = np.asarray(flat)
    padded_rows, padded_cols = swizzled_shape(rows, cols)
    if flat.dtype != np.uint8 or flat.shape != (padded_rows * padded_cols,):
        raise ValueError(
            f"flat must be uint8 of shape ({padded_rows * padded_cols},) for ({rows}, {cols}) "
            f"scales, "
            f"got {flat.dtype} {flat.shape}"
        )
    return flat[swizzled_offsets(rows, cols)]
