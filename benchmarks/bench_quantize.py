"""asv: fp4_kernels.quantize and quantize_dequantize (mirrors the public API).

GPU classes report CUDA-graph device time, GB/s of the minimum bytes moved and the ratio to a
device-to-device copy measured in the same process, as ``track_*`` values with units; they skip
(NotImplementedError in setup) where there is no GPU.  The CPU class times the numba CPU path.
"""

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


def _min_bytes(fmt, itemsize, n, fused=False):
    if fused:
        return 2 * itemsize * n
    return itemsize * n + n // 2 + n // fk.FORMATS[fmt]


class QuantizeGPU:
    params = (["nvfp4", "mxfp4"], ["nearest", "stochastic"], ["bfloat16", "float32"])
    param_names = ["fmt", "rounding", "dtype"]
    timeout = 300

    def setup(self, fmt, rounding, dtype):
        torch = require_gpu()
        dt = getattr(torch, dtype)
        self.xs = [
            torch.randn(GPU_ELEMENTS // K, K, device="cuda", dtype=dt) for _ in range(ROTATE)
        ]
        self.kw = dict(fmt=fmt, rounding=rounding)
        self.nbytes = _min_bytes(fmt, self.xs[0].element_size(), GPU_ELEMENTS)

    def _device_ms(self):
        return graph_time_ms(lambda x: fk.quantize(x, **self.kw), [(x,) for x in self.xs])[0]

    def track_device_ms(self, *params):
        return self._device_ms()

    track_device_ms.unit = "ms"

    def track_gbps(self, *params):
        return self.nbytes / self._device_ms() / 1e6

    track_gbps.unit = "GB/s"

    def track_ratio_to_copy(self, *params):
        return self.nbytes / self._device_ms() / 1e6 / copy_gbps()

    track_ratio_to_copy.unit = "x D2D copy"

    def track_host_us(self, *params):
        small = self.xs[0][:16]  # 64K elements: host-bound, the launch path's own cost
        return host_time_us(lambda x: fk.quantize(x, **self.kw), (small,))

    track_host_us.unit = "us"


class QuantizeDequantizeGPU:
    params = (["nvfp4", "mxfp4"],)
    param_names = ["fmt"]
    timeout = 300

    def setup(self, fmt):
        torch = require_gpu()
        self.xs = [
            torch.randn(GPU_ELEMENTS // K, K, device="cuda", dtype=torch.bfloat16)
            for _ in range(ROTATE)
        ]
        self.fmt = fmt

    def _device_ms(self):
        fn = lambda x: fk.quantize_dequantize(x, fmt=self.fmt)  # noqa: E731
        return graph_time_ms(fn, [(x,) for x in self.xs])[0]

    def track_device_ms(self, fmt):
        return self._device_ms()

    track_device_ms.unit = "ms"

    def track_ratio_to_copy(self, fmt):
        nbytes = _min_bytes(fmt, 2, GPU_ELEMENTS, fused=True)
        return nbytes / self._device_ms() / 1e6 / copy_gbps()

    track_ratio_to_copy.unit = "x D2D copy"


class QuantizeCPU:
    """The CPU path (numba.njit) on numpy float32, 2^18 elements."""

    params = (["nvfp4", "mxfp4"], ["nearest", "stochastic"])
    param_names = ["fmt", "rounding"]

    def setup(self, fmt, rounding):
        rng = np.random.default_rng(0)
        self.x = rng.standard_normal((CPU_ELEMENTS // K, K)).astype(np.float32)
        fk.quantize(self.x, fmt=fmt, rounding=rounding)  # compile outside the timing

    def time_quantize(self, fmt, rounding):
        fk.quantize(self.x, fmt=fmt, rounding=rounding)

    def time_quantize_dequantize(self, fmt, rounding):
        fk.quantize_dequantize(self.x, fmt=fmt, rounding=rounding)
