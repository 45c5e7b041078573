"""Tests for fp4_kernels.formats.scale_layout: literal offsets and torchao's reshape form."""

import numpy as np
import pytest

from fp4_kernels.formats.scale_layout import (
    from_swizzled,
    swizzled_offsets,
    swizzled_shape,
    to_swizzled,
)

RAGGED_SHAPES = [(1, 1), (3, 5), (128, 4), (129, 7), (256, 8), (300, 13), (1, 64)]


def _to_blocked_reshape_form(scales):
    """The layout as torchao's ``to_blocked`` writes it, independent of the offset formula: pad to
    whole 128x4 tiles, view (R/128, 128, C/4, 4), put tiles first, then split each tile's 128 rows
    as (4 groups of 32) and interleave: (4, 32, 4) -> (32, 4, 4) = (32, 16) rows of 16 bytes.
    """
    rows, cols = scales.shape
    padded_rows, padded_cols = swizzled_shape(rows, cols)
    padded = np.zeros((padded_rows, padded_cols), dtype=np.uint8)
    padded[:rows, :cols] = scales
    tiles = padded.reshape(padded_rows // 128, 128, padded_cols // 4, 4).transpose(0, 2, 1, 3)
    return tiles.reshape(-1, 4, 32, 4).transpose(0, 2, 1, 3).reshape(-1, 32, 16).reshape(-1)


def test_swizzled_shape():
    assert swizzled_shape(1, 1) == (128, 4)
    assert swizzled_shape(128, 4) == (128, 4)
    assert swizzled_shape(129, 5) == (256, 8)
    assert swizzled_shape(0, 0) == (0, 0)


def test_literal_offsets():
    offsets = swizzled_offsets(256, 8)
    assert offsets[0, 0] == 0
    assert offsets[0, 1] == 1  # the 4 columns of a row are contiguous
    assert offsets[1, 0] == 16  # row r % 32 strides by 16 bytes
    assert offsets[32, 0] == 4  # row group (r % 128) // 32 strides by 4 bytes
    assert offsets[33, 2] == 16 + 4 + 2
    assert offsets[0, 4] == 512  # next tile along the columns
    assert offsets[128, 0] == 2 * 512  # next tile row: after the 2 tiles of the first tile row
    assert offsets[255, 7] == 4 * 512 - 1


def test_literal_bytes():
    scales = np.arange(1, 9, dtype=np.uint8).reshape(2, 4)  # rows 0 and 1 of a single tile
    flat = to_swizzled(scales)
    assert flat.shape == (512,)
    np.testing.assert_array_equal(flat[:4], [1, 2, 3, 4])
    np.testing.assert_array_equal(flat[16:20], [5, 6, 7, 8])
    assert np.count_nonzero(flat) == 8


@pytest.mark.parametrize("shape", RAGGED_SHAPES)
def test_matches_torchao_reshape_form(rng, shape):
    scales = rng.integers(1, 256, size=shape, dtype=np.uint8)  # nonzero, so padding is visible
    flat = to_swizzled(scales)
    np.testing.assert_array_equal(flat, _to_blocked_reshape_form(scales))
    assert flat.dtype == np.uint8 and flat.size == np.prod(swizzled_shape(*shape))
    assert np.count_nonzero(flat) == scales.size  # the padding bytes are all 0


@pytest.mark.parametrize("shape", RAGGED_SHAPES)
def test_round_trip_and_offsets_are_a_permutation(rng, shape):
    scales = rng.integers(0, 256, size=shape, dtype=np.uint8)
    np.testing.assert_array_equal(from_swizzled(to_swizzled(scales), *shape), scales)
    offsets = swizzled_offsets(*shape)
    assert len(np.unique(offsets)) == offsets.size
    assert offsets.min() >= 0 and offsets.max() < np.prod(swizzled_shape(*shape))


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="scales"):
        to_swizzled(np.zeros((4, 4), dtype=np.int32))
    with pytest.raises(ValueError, match="scales"):
        to_swizzled(np.zeros(4, dtype=np.uint8))
    with pytest.raises(ValueError, match="flat"):
        from_swizzled(np.zeros(100, dtype=np.uint8), 3, 5)
    with pytest.raises(ValueError, match="rows"):
        swizzled_shape(-1, 4)
