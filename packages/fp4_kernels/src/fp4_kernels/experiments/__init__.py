"""The experiments behind fp4_kernels' committed study results (docs/results), importable, each
with a command line: ``error_study`` (``python -m fp4_kernels.experiments.error_study``), the
quantization error of NVFP4, MXFP4 and FP4Quant (docs/fp4quant_study.md).  They need matplotlib
(the ``report`` extra) for their plots."""
