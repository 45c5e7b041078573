"""asv: fp4_kernels.hadamard and the FP4Quant codec (mirrors the public API).

GPU classes report CUDA-graph device time and the time as a multiple of a device-to-device
copy of the same tensor (bytes read + written by the copy / copy bandwidth measured in the same
process), as ``track_*`` values with units, measured once per class in ``setup_cache``; they
skip (NotImplementedError in setup) where there is no GPU.  The CPU classes time the numba CPU path.
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
    measure_params,
    require_gpu,
)

GROUP_SIZES = [16, 64, 256, 1024, 4096]
# The FP4Quant codec also at g = 8192 (appended: the older commits' rows keep their order)
FP4QUANT_GROUP_SIZES = [*GROUP_SIZES, 8192]


def _inputs(group_size=0):
    """ROTATE bf16 tensors of GPU_ELEMENTS, in rows of K elements (of the group size where it
    is longer: a group lies within a row)."""
    torch = require_gpu()
    k = max(K, group_size)
    return [
        torch.randn(GPU_ELEMENTS // k, k, device="cuda", dtype=torch.bfloat16)
        for _ in range(ROTATE)
    ]


def _measure(fn, args_list):
    return {"ms": graph_time_ms(fn, args_list)[0], "bytes": GPU_ELEMENTS * 2}


def _measure_hadamard(group_size, signs):
    kw = dict(group_size=group_size, signs=1234 if signs else None)
    return _measure(lambda x: fk.hadamard(x, **kw), [(x,) for x in _inputs()])


def _measure_encode(group_size, hadamard, rounding="nearest"):
    fmt = fk.FP4Quant(group_size, hadamard)
    encode = lambda x: fk.quantize(x, fmt=fmt, rounding=rounding, seed=1234)  # noqa: E731
    return _measure(encode, [(x,) for x in _inputs(group_size)])


def _measure_stochastic_encode(group_size, hadamard):
    return _measure_encode(group_size, hadamard, "stochastic")


def _measure_decode(group_size, hadamard):
    fmt = fk.FP4Quant(group_size, hadamard)
    qs = [fk.quantize(x, fmt=fmt) for x in _inputs(group_size)]
    return _measure(lambda q: fk.dequantize(q), [(q,) for q in qs])


class _GPU(_timing.GPUBenchmark):
    """The time as a multiple of a copy's (lower is better)."""

    def track_ratio_to_copy(self, cache, *params):
        # the time a copy of the bf16 tensor takes (read + write) at the measured bandwidth
        copy_ms = 2 * self.m["bytes"] / self.m["copy_gbps"] / 1e6
        return self.m["ms"] / copy_ms

    track_ratio_to_copy.unit = "x D2D copy time"


class HadamardGPU(_GPU):
    params = (GROUP_SIZES, [False, True])
    param_names = ["group_size", "signs"]

    def setup_cache(self):
        return measure_params(self.params, _measure_hadamard)


class FP4QuantEncodeGPU(_GPU):
    params = (FP4QUANT_GROUP_SIZES, [True, False])
    param_names = ["group_size", "hadamard"]

    def setup_cache(self):
        return measure_params(self.params, _measure_encode)


class FP4QuantStochasticEncodeGPU(_GPU):
    """The encode with stochastic rounding (seed 1234, step 0)."""

    params = ([64, 256, 8192], [True, False])
    param_names = ["group_size", "hadamard"]

    def setup_cache(self):
        return measure_params(self.params, _measure_stochastic_encode)


class FP4QuantDecodeGPU(_GPU):
    params = (FP4QUANT_GROUP_SIZES, [True, False])
    param_names = ["group_size", "hadamard"]

    def setup_cache(self):
        return measure_params(self.params, _measure_decode)


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
