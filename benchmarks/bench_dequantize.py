"""asv: fp4_kernels.dequantize (mirrors the public API); GPU rows skip without a GPU."""

import numpy as np

import fp4_kernels as fk

from ._timing import (
    CPU_ELEMENTS,
    GPU_ELEMENTS,
    ROTATE,
    K,
    copy_gbps,
    graph_time_ms,
    host_time_us,
    require_gpu,
)


class DequantizeGPU:
    params = (["nvfp4", "mxfp4"], ["bfloat16", "float32"], ["linear", "swizzled"])
    param_names = ["fmt", "out_dtype", "scale_layout"]
    timeout = 300

    def setup(self, fmt, out_dtype, scale_layout):
        torch = require_gpu()
        xs = [
            torch.randn(GPU_ELEMENTS // K, K, device="cuda", dtype=torch.bfloat16)
            for _ in range(ROTATE)
        ]
        self.qs = [fk.quantize(x, fmt=fmt, scale_layout=scale_layout) for x in xs]
        self.dtype = getattr(torch, out_dtype)
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        self.nbytes = GPU_ELEMENTS // 2 + GPU_ELEMENTS // fk.FORMATS[fmt] + itemsize * GPU_ELEMENTS

    def _device_ms(self):
        fn = lambda q: fk.dequantize(q, dtype=self.dtype)  # noqa: E731
        return graph_time_ms(fn, [(q,) for q in self.qs])[0]

    def track_device_ms(self, *params):
        return self._device_ms()

    track_device_ms.unit = "ms"

    def track_ratio_to_copy(self, *params):
        return self.nbytes / self._device_ms() / 1e6 / copy_gbps()

    track_ratio_to_copy.unit = "x D2D copy"

    def track_host_us(self, *params):
        return host_time_us(lambda q: fk.dequantize(q, dtype=self.dtype), (self.qs[0],))

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
