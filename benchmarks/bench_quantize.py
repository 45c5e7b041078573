"""asv: fp4_kernels.quantize and quantize_dequantize (mirrors the public API).

GPU classes report CUDA-graph device time, GB/s of the minimum bytes moved and the ratio to a
device-to-device copy measured in the same process, as ``track_*`` values with units, all
measured once per class in ``setup_cache`` (``_timing.measure_params``); they skip
(NotImplementedError in setup) where there is no GPU.  The CPU class times the numba CPU path.
"""

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


def _min_bytes(fmt, itemsize, n, fused=False):
    if fused:
        return 2 * itemsize * n
    return itemsize * n + n // 2 + n // fk.FORMATS[fmt]


def _inputs(torch, dtype):
    return [torch.randn(GPU_ELEMENTS // K, K, device="cuda", dtype=dtype) for _ in range(ROTATE)]


def _measure_quantize(fmt, rounding, dtype, global_amax=None):
    torch = require_gpu()
    xs = _inputs(torch, getattr(torch, dtype))
    fn = lambda x: fk.quantize(x, fmt=fmt, rounding=rounding, global_amax=global_amax)  # noqa: E731
    return {
        "ms": graph_time_ms(fn, [(x,) for x in xs])[0],
        "bytes": _min_bytes(fmt, xs[0].element_size(), GPU_ELEMENTS),
        # 64K elements: host-bound, the launch path's own cost
        "host_us": host_time_us(fn, (xs[0][:16],)),
    }


class QuantizeGPU(_timing.BandwidthGPU):
    params = (["nvfp4", "mxfp4"], ["nearest", "stochastic"], ["bfloat16", "float32"])
    param_names = ["fmt", "rounding", "dtype"]

    def setup_cache(self):
        return measure_params(self.params, _measure_quantize)

    def track_gbps(self, cache, *params):
        return self.m["bytes"] / self.m["ms"] / 1e6

    track_gbps.unit = "GB/s"

    def track_host_us(self, cache, *params):
        return self.m["host_us"]

    track_host_us.unit = "us"


def _measure_quantize_amax_given(dtype):
    return _measure_quantize("nvfp4", "nearest", dtype, global_amax=4.5)


class QuantizeAmaxGivenGPU(_timing.BandwidthGPU):
    """NVFP4 quantize with a ``global_amax`` (a tensor scale shared across ranks or steps): one
    kernel, no amax pass; nearest rounding, from bf16 and from float32."""

    params = (["bfloat16", "float32"],)
    param_names = ["dtype"]
    timeout = 600

    def setup_cache(self):
        return measure_params(self.params, _measure_quantize_amax_given)


def _measure_quantize_dequantize(fmt, rounding, amax):
    if amax == "given" and fmt != "nvfp4":
        return {"skip": "only NVFP4 takes a global_amax"}
    torch = require_gpu()
    xs = _inputs(torch, torch.bfloat16)
    ga = 4.5 if amax == "given" else None
    fn = lambda x: fk.quantize_dequantize(x, fmt=fmt, rounding=rounding, global_amax=ga)  # noqa: E731
    return {
        "ms": graph_time_ms(fn, [(x,) for x in xs])[0],
        "bytes": _min_bytes(fmt, 2, GPU_ELEMENTS, fused=True),
    }


class QuantizeDequantizeGPU(_timing.BandwidthGPU):
    """Fake quantization (bf16): ``amax`` "given" is NVFP4 with a ``global_amax`` (one
    kernel, the training case), "computed" its amax pass first (MXFP4 has none)."""

    params = (["nvfp4", "mxfp4"], ["nearest", "stochastic"], ["computed", "given"])
    param_names = ["fmt", "rounding", "amax"]

    def setup_cache(self):
        return measure_params(self.params, _measure_quantize_dequantize)


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
