"""Random test inputs made of blocks whose magnitudes span many binades (the formats' tests)."""

import numpy as np


def random_blocks(rng, shape, block_size, log2_magnitudes):
    """float32 normal values whose blocks of ``block_size`` along the last axis each get a
    magnitude 2**u, u uniform over ``log2_magnitudes`` (low, high); about 5 % of the blocks are
    all zero."""
    x = rng.standard_normal(shape)
    magnitude = np.exp2(
        rng.uniform(*log2_magnitudes, size=shape[:-1] + (shape[-1] // block_size, 1))
    )
    magnitude[rng.random(magnitude.shape) < 0.05] = 0.0
    x = (x.reshape(magnitude.shape[:-1] + (block_size,)) * magnitude).reshape(shape)
    return x.astype(np.float32)
