"""FP4-compressed NCCL collectives. A skeleton: nothing works yet.

The collectives come with issue 4; until then the package only reports its version.
"""

from importlib.metadata import version as _version

__version__ = _version("fp4-comm")
