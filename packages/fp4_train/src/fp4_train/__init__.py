"""fp4_train: training with FP4 (NVFP4, MXFP4) on top of fp4_kernels.

- ``ErrorFeedback``: per-tensor residuals carried into the next quantization.
- ``FP4StoredWeights``: an optimizer wrapper that keeps the weights in packed FP4 and rounds
  every update (nearest, stochastic, error feedback).
- ``FP4Linear`` / ``fp4_linear``: a linear layer whose forward and backward GEMMs run on NVFP4
  operands (straight-through estimator, full-precision master weights, stochastic rounding of
  gradients, optional random Hadamard transform on the weight-gradient path).
- ``fp4_gemm``: ``a @ b^T`` of two quantized operands (exact bf16 path; cuBLASLt FP4 on
  compute capability >= 10.0).
"""

from importlib.metadata import PackageNotFoundError, version as _version

from .error_feedback import ErrorFeedback
from .gemm import NativeGemmUnavailable, fp4_gemm
from .linear import FP4Linear, fp4_linear
from .optim import FP4StoredWeights

try:
    __version__ = _version("fp4-train")
except PackageNotFoundError:  # running from a source tree (e.g. on PYTHONPATH)
    __version__ = "0+unknown"

__all__ = [
    "ErrorFeedback",
    "FP4Linear",
    "FP4StoredWeights",
    "fp4_linear",
    "NativeGemmUnavailable",
    "fp4_gemm",
    "__version__",
]
