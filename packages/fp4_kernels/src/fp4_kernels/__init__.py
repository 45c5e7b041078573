"""fp4_kernels: bit-exact NVFP4 and MXFP4 codecs as numba-cuda kernels, with a CPU path.

    q = fp4_kernels.quantize(x, fmt="nvfp4", rounding="nearest")
    y = fp4_kernels.dequantize(q)
    y = fp4_kernels.quantize_dequantize(x, fmt="mxfp4")

The plain-numpy references that define each format (the test oracles) live in
``fp4_kernels.formats``.
"""

from importlib.metadata import PackageNotFoundError, version

from ._api import (
    FORMATS,
    QuantizedTensor,
    dequantize,
    quantize,
    quantize_dequantize,
    swizzled_scale_shape,
)

try:
    __version__ = version("fp4-kernels")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0+unknown"

__all__ = [
    "FORMATS",
    "QuantizedTensor",
    "dequantize",
    "quantize",
    "quantize_dequantize",
    "swizzled_scale_shape",
    "__version__",
]
