"""asv: fp4_kernels.dequantize (mirrors the public API); GPU rows skip without a GPU."""

import numpy as np

import fp4_kernels as fk

from . import _timing
from ._timing import (
    CPU_ELEMENTS,
    GPU_ELEMENTS,
    ROTATE,
    K,
    graph_time_ms,
    host_time_us,
    measure_params,
    require_gpu,
)


def _measure_dequantize(fmt, out_dtype, scale_layout):
    torch = require_gpu()
    xs = [
        torch.randn(GPU_ELEMENTS // K, K, device="cuda", dtype=torch.bfloat16)
        for _ in range(ROTATE)
    ]
    qs = [fk.quantize(x, fmt=fmt, scale_layout=scale_layout) for x in xs]
    del xs
    dtype = getattr(torch, out_dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    fn = lambda q: fk.dequantize(q, dtype=dtype)  # noqa: E731
    return {
        "ms": graph_time_ms(fn, [(q,) for q in qs])[0],
        "bytes": GPU_ELEMENTS // 2 + GPU_ELEMENTS // fk.FORMATS[fmt] + itemsize * GPU_ELEMENTS,
        "host_us": host_time_us(fn, (qs[0],)),
    }


class DequantizeGPU(_timing.BandwidthGPU):
    params = (["nvfp4", "mxfp4"], ["bfloat16", "float32"], ["linear", "swizzled"])
    param_names = ["fmt", "out_dtype", "scale_layout"]

    def setup_cache(self):
        return measure_params(self.params, _measure_dequantize)

    def track_host_us(self, cache, *params):
        return self.m["host_us"]

    track_host_us.unit = "us"


class DequantizeCPU:
    params = (["nvfp4", "mxfp4"],)
    param_names = ["fmt"]

    def setup(self, fmt):
        x = np.random.default_rng(0).standard_normal((CPU_ELEMENTS // K, K)).astype(np.float32)
        self.q = fk.quantize(x, fmt=fmt)
        fk.dequantize(self.q)  # compile outside the timing

    def time_dequantize(self, fmt):
        fk.dequantize(self.q)
