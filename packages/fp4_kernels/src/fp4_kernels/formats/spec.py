"""What a block-scaled FP4 format is, in one object: ``FormatSpec``; and the argument checks
the formats' oracles share.

Each format module defines its spec once (``nvfp4.SPEC``, ``mxfp4.SPEC``); the public API, the
CPU path and the CUDA kernels read the block size, the codecs and the tensor scale from it, so
that no other module repeats them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True)
class FormatSpec:
    """A block-scaled FP4 format.

    Attributes:
        name: the ``fmt=`` string of quantize ("nvfp4", "mxfp4").
        code: a small integer that names the format where a number is needed (kernels are
            specialized on the spec itself; the code is its stable identity).
        block_size: elements that share one block scale.
        element: the element type ("e2m1": ``formats.e2m1``).
        scale: the block scale type ("e4m3", "e8m0": ``formats.e4m3`` / ``formats.e8m0``).
        scale_dtype: the scale type's dtype name in torch and ml_dtypes.
        tensor_scale: whether a float32 tensor scale multiplies every block scale.
    """

    name: str
    code: int
    block_size: int
    element: str
    scale: str
    scale_dtype: str
    tensor_scale: bool

    def __str__(self) -> str:
        return self.name


def check_input(x: npt.ArrayLike, block_size: int) -> np.ndarray:
    """``x`` as a float32 array whose last dimension is a multiple of ``block_size``, or
    TypeError / ValueError (the oracles' input check)."""
    x = np.asarray(x)
    if x.dtype != np.float32:
        raise TypeError(f"x must be float32, got {x.dtype}")
    if x.ndim == 0 or x.shape[-1] % block_size != 0:
        raise ValueError(
            f"x must have a last dimension divisible by {block_size}, got shape {x.shape}"
        )
    return x


def check_codes(
    codes: npt.ArrayLike, scales: npt.ArrayLike, block_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """(codes, scales) as arrays: unpacked codes (..., K) with K a multiple of ``block_size``
    and one scale a block (..., K // block_size), or ValueError (the oracles' decode check)."""
    codes = np.asarray(codes)
    scales = np.asarray(scales)
    if codes.ndim == 0 or codes.shape[-1] % block_size != 0:
        raise ValueError(
            f"codes must have a last dimension divisible by {block_size}, got shape {codes.shape}"
        )
    scales_shape = codes.shape[:-1] + (codes.shape[-1] // block_size,)
    if scales.shape != scales_shape:
        raise ValueError(
            f"scales must have shape {scales_shape} for codes of shape {codes.shape}, "
            f"got {scales.shape}"
        )
    return codes, scales
