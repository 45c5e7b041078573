"""fp4_train: training with FP4 (NVFP4, MXFP4) on top of fp4_kernels.

- ``ErrorFeedback``: per-tensor residuals carried into the next quantization.
- ``FP4StoredWeights``: an optimizer wrapper that keeps the weights in packed FP4 and rounds
  every update (nearest, stochastic, error feedback).
- ``fp4_gemm``: ``a @ b^T`` of two quantized operands (exact bf16 path; cuBLASLt FP4 on
  compute capability >= 10.0).
"""

from importlib.metadata import version as _version

from .error_feedback import ErrorFeedback
from .gemm import NativeGemmUnavailable, fp4_gemm
from .optim import FP4StoredWeights

__version__ = _version("fp4-train")

__all__ = ["ErrorFeedback", "FP4StoredWeights", "NativeGemmUnavailable", "fp4_gemm", "__version__"]
