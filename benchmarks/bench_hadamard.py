"""asv: fp4_kernels.hadamard and the FP4Quant codec (mirrors the public API).

GPU classes report CUDA-graph device time and the time as a multiple of a device-to-device
copy of the same tensor (bytes read + written by the copy / copy bandwidth measured in the same
process), as ``track_*`` values with units; they skip (NotImplementedError in setup) where
there is no GPU.  The CPU classes time the numba CPU path.
"""

import numpy as np

import fp4_kernels as fk

from ._timing import CPU_ELEMENTS, GPU_ELEMENTS, ROTATE, K, copy_gbps, graph_time_ms, require_gpu

GROUP_SIZES = [16, 64, 256, 1024, 4096]


def _copy_ms(nbytes):
    """Time a copy of a tensor of ``nbytes`` takes (read + write) at the measured bandwidth."""
    return 2 * nbytes / copy_gbps() / 1e6


class _GPU:
    timeout = 300

    def _inputs(self):
        torch = require_gpu()
        self.xs = [
            torch.randn(GPU_ELEMENTS // K, K, device="cuda", dtype=torch.bfloat16)
            for _ in range(ROTATE)
        ]
        self.nbytes = GPU_ELEMENTS * 2

    def track_device_ms(self, *params):
        return self._device_ms()

    track_device_ms.unit = "ms"

    def track_ratio_to_copy(self, *params):
        return self._device_ms() / _copy_ms(self.nbytes)

    track_ratio_to_copy.unit = "x D2D copy time"


class HadamardGPU(_GPU):
    params = (GROUP_SIZES, [False, True])
    param_names = ["group_size", "signs"]

    def setup(self, group_size, signs):
        self._inputs()
        self.kw = dict(group_size=group_size, signs=1234 if signs else None)

    def _device_ms(self):
        return graph_time_ms(lambda x: fk.hadamard(x, **self.kw), [(x,) for x in self.xs])[0]


class FP4QuantEncodeGPU(_GPU):
    params = (GROUP_SIZES, [True, False])
    param_names = ["group_size", "hadamard"]

    def setup(self, group_size, hadamard):
        self._inputs()
        self.fmt = fk.FP4Quant(group_size, hadamard)

    def _device_ms(self):
        return graph_time_ms(lambda x: fk.quantize(x, fmt=self.fmt), [(x,) for x in self.xs])[0]


class FP4QuantDecodeGPU(_GPU):
    params = (GROUP_SIZES, [True, False])
    param_names = ["group_size", "hadamard"]

    def setup(self, group_size, hadamard):
        self._inputs()
        fmt = fk.FP4Quant(group_size, hadamard)
        self.qs = [fk.quantize(x, fmt=fmt) for x in self.xs]

    def _device_ms(self):
        return graph_time_ms(lambda q: fk.dequantize(q), [(q,) for q in self.qs])[0]


class HadamardCPU:
    params = ([16, 256, 4096],)
    param_names = ["group_size"]

    def setup(self, group_size):
        self.x = np.random.default_rng(0).standard_normal(CPU_ELEMENTS).astype(np.float32)
        self.x = self.x.reshape(-1, 4096)
        fk.hadamard(self.x, group_size=group_size)  # compile outside the timing

    def time_hadamard(self, group_size):
        fk.hadamard(self.x, group_size=group_size)


class FP4QuantCPU:
    params = ([64, 256], [True, False])
    param_names = ["group_size", "hadamard"]

    def setup(self, group_size, hadamard):
        self.x = np.random.default_rng(0).standard_normal(CPU_ELEMENTS).astype(np.float32)
        self.x = self.x.reshape(-1, 4096)
        self.fmt = fk.FP4Quant(group_size, hadamard)
        self.q = fk.quantize(self.x, fmt=self.fmt)

    def time_quantize(self, group_size, hadamard):
        fk.quantize(self.x, fmt=self.fmt)

    def time_dequantize(self, group_size, hadamard):
        fk.dequantize(self.q)
