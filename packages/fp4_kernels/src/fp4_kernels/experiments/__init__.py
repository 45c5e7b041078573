"""The experiments behind fp4_kernels' committed study results (docs/results), importable, each
with a command line: ``error_study`` (``python -m fp4_kernels.experiments.error_study``), the
quantization error of NVFP4, MXFP4 and FP4Quant (docs/fp4quant_study.md).  They need matplotlib
(the ``report`` extra) for their plots."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name, as Linux's /proc/cpuinfo gives it (else ``platform.processor()``,
    else ``platform.machine()``): what an experiment's provenance says of the machine."""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
