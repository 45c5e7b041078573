"""asv: fp4_kernels.requantized_sum (mirrors the public API): the middle step of fp4_comm's
all-reduce, the rows of a quantized tensor added in float32 and quantized again.

GPU: device time of ``requantized_sum`` on ``rows`` encoded rows of 2^26 / rows elements each
(bf16 quantized first), its GB/s of the minimum bytes (every row's codes and scales read once,
the sum's written once) over the D2D copy's, and its time over that of the composition it
replaces (dequantize to float32, add the rows in order, quantize: ``_composition``), both
CUDA-graph replays measured once per class in ``setup_cache``.  MXFP4 runs one fused kernel;
NVFP4 two (an amax pass over the encoded rows, then the encode pass, which sums them again:
its tensor scale needs the sum's amax first), so it reads the rows twice and its ratio to the
copy is at most about half MXFP4's.  The rows share one tensor scale here; with ``row_scales``
(fp4_comm's all-reduce, a scale a received chunk) the kernels are the same and read 4 bytes a
row more.  Skipped (NotImplementedError in setup) without a GPU.
"""

import fp4_kernels as fk

from . import _timing
from ._timing import GPU_ELEMENTS, ROTATE, graph_time_ms, measure_params, require_gpu


def _composition(q):
    """What requantized_sum replaces, through the public API (its definition)."""
    import torch

    d = fk.dequantize(q, dtype=torch.float32)
    acc = d[0] + d[1]
    for i in range(2, d.shape[0]):
        acc = acc + d[i]
    return fk.quantize(acc.reshape(1, -1), fmt=q.fmt)


def _measure_reduce(fmt, rows):
    torch = require_gpu()
    n = GPU_ELEMENTS // rows
    qs = [
        fk.quantize(torch.randn(rows, n, device="cuda", dtype=torch.bfloat16), fmt=fmt)
        for _ in range(ROTATE)
    ]
    per_row = n // 2 + n // fk.FORMATS[fmt]  # codes + block scales
    return {
        "ms": graph_time_ms(fk.requantized_sum, [(q,) for q in qs])[0],
        "composition_ms": graph_time_ms(_composition, [(q,) for q in qs])[0],
        "bytes": (rows + 1) * per_row,
    }


class RequantizedSumGPU(_timing.BandwidthGPU):
    params = (["mxfp4", "nvfp4"], [2, 8])
    param_names = ["fmt", "rows"]
    timeout = 600

    def setup_cache(self):
        return measure_params(self.params, _measure_reduce)

    def track_ratio_to_composition(self, cache, *params):
        return self.m["ms"] / self.m["composition_ms"]

    track_ratio_to_composition.unit = "x decode+sum+encode time"
