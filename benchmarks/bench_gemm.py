"""asv: fp4_train.fp4_gemm, the exact path (mirrors the public API).

GPU: device time of ``fp4_gemm(a, b)`` on NVFP4 operands and its ratio to a torch bf16 GEMM of
the same shape in the same process (the project's aim: at most 1.15x at 8192^3), as ``track_*``
values, measured once in ``setup_cache``; skipped (NotImplementedError in setup) without a GPU
or without fp4_train.  CPU: the exact path on small operands.
"""

import numpy as np

from . import _timing
from ._timing import ROTATE, graph_time_ms, measure_params, require_gpu


def _fp4_train():
    try:
        import fp4_train
    except ImportError:
        raise NotImplementedError("needs fp4_train") from None
    return fp4_train


def _measure_gemm(n, out_dtype):
    torch = require_gpu()
    gemm = _fp4_train().fp4_gemm
    import fp4_kernels as fk

    x = [torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(ROTATE)]
    q = [fk.quantize(a, fmt="nvfp4") for a in x]
    f = lambda a, b: gemm(a, b, backend="exact", out_dtype=out_dtype)  # noqa: E731
    fp4_ms = graph_time_ms(f, list(zip(q, q[1:] + q[:1], strict=True)))[0]
    bf16_ms = graph_time_ms(lambda a, b: a @ b.t(), list(zip(x, x[1:] + x[:1], strict=True)))[0]
    return {"ms": fp4_ms, "bf16_ms": bf16_ms}


class FP4GemmGPU(_timing.GPUBenchmark):
    params = ([4096, 8192], ["float32", "bfloat16"])
    param_names = ["n", "out_dtype"]

    def setup_cache(self):
        try:
            _fp4_train()
        except NotImplementedError as e:
            return {"skip": str(e)}
        return measure_params(self.params, _measure_gemm)

    def track_ratio_to_bf16_gemm(self, cache, *params):
        return self.m["ms"] / self.m["bf16_ms"]

    track_ratio_to_bf16_gemm.unit = "x bf16 GEMM time"


class FP4GemmCPU:
    params = ([256],)
    param_names = ["n"]

    def setup(self, n):
        self.gemm = _fp4_train().fp4_gemm
        import fp4_kernels as fk

        rng = np.random.default_rng(0)
        self.a = fk.quantize(rng.standard_normal((n, n)).astype(np.float32), fmt="nvfp4")
        self.b = fk.quantize(rng.standard_normal((n, n)).astype(np.float32), fmt="nvfp4")
        self.gemm(self.a, self.b)  # compile outside the timing

    def time_fp4_gemm_exact(self, n):
        self.gemm(self.a, self.b, backend="exact")
