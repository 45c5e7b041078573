"""FP4 training: trainers, the FP4 linear layer, the FP4 GEMM. A skeleton: nothing works yet.

They come with issue 5; until then the package only reports its version.
"""

from importlib.metadata import version as _version

__version__ = _version("fp4-train")
