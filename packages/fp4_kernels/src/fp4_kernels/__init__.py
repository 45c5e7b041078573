"""fp4_kernels: bit-exact NVFP4, MXFP4 and FP4Quant codecs and the Walsh–Hadamard transform as
numba-cuda kernels, with a CPU path.

    q = fp4_kernels.quantize(x, fmt="nvfp4", rounding="nearest")
    y = fp4_kernels.dequantize(q)
    y = fp4_kernels.quantize_dequantize(x, fmt="mxfp4")
    q = fp4_kernels.quantize(x, fmt=fp4_kernels.FP4Quant(group_size=64))
    h = fp4_kernels.hadamard(x, group_size=256, signs=1234)
    s = fp4_kernels.requantized_sum(q)  # rows added in float32, quantized again

The plain-numpy references that define each format (the test oracles) live in
``fp4_kernels.formats``.
"""

from importlib.metadata import PackageNotFoundError, version

from ._api import dequantize, quantize, quantize_dequantize
from ._hadamard import hadamard
from ._notices import KernelCacheWarning, KernelCompileWarning
from ._quantized import FORMATS, FP4Quant, QuantizedTensor, swizzled_scale_shape
from ._reduce import requantized_sum

try:
    __version__ = version("fp4-kernels")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0+unknown"

__all__ = [
    "FORMATS",
    "FP4Quant",
    "hadamard",
    "KernelCacheWarning",
    "KernelCompileWarning",
    "QuantizedTensor",
    "dequantize",
    "quantize",
    "quantize_dequantize",
    "requantized_sum",
    "swizzled_scale_shape",
    "__version__",
]
