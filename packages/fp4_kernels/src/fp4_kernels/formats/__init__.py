"""FP4 format specifications and their plain-numpy reference implementations.

Each module here is the spec of one format (constants, code tables) plus a vectorized numpy
oracle that the CPU and CUDA kernels are tested against bit for bit:

- ``e2m1``: the 4-bit element type (OCP MX v1.0 FP4 E2M1), encode/decode and nibble packing.
- ``e4m3``: the OCP FP8 E4M3 ("fn") type used for NVFP4 block scales.
- ``e8m0``: the OCP MX v1.0 E8M0 power-of-two type used for MXFP4 block scales.
- ``philox``: the Philox4x32-10 counter-based generator that feeds stochastic rounding.
- ``nvfp4``: NVFP4 (16-element blocks, e4m3 scales, fp32 global scale) as Transformer Engine
  computes it.
- ``mxfp4``: MXFP4 (32-element blocks, e8m0 scales) per OCP MX v1.0.
- ``scale_layout``: the 128x4-tile swizzled block-scale layout read by cuBLASLt.
- ``spec``: ``FormatSpec``, what a block-scaled format is (``nvfp4.SPEC``, ``mxfp4.SPEC``).

Nothing is imported here so that importing the package stays cheap; import the submodules.
"""
