"""What a block-scaled FP4 format is, in one object: ``FormatSpec``.

Each format module defines its spec once (``nvfp4.SPEC``, ``mxfp4.SPEC``); the public API, the
CPU path and the CUDA kernels read the block size, the codecs and the tensor scale from it, so
that no other module repeats them.
"""

from __future__ import annotations

from dataclasses import dataclass


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
