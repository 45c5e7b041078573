"""asv: fp4_train.fp4_gemm, the exact path (mirrors the public API).

GPU: device time of ``fp4_gemm(a, b)`` on NVFP4 operands and its ratio to a torch bf16 GEMM of
the same shape in the same process (the issue-5 aim: at most 1.15x at 8192^3), as ``track_*``
values; skipped (NotImplementedError in setup) without a GPU or without fp4_train.  CPU: the
exact path on small operands.
"""

import numpy as np

from ._timing import ROTATE, graph_time_ms, require_gpu


def _fp4_train():
    try:
        import fp4_train
    except ImportError:
        raise NotImplementedError("needs fp4_train") from None
    return fp4_train


class FP4GemmGPU:
    params = ([4096, 8192], ["float32", "bfloat16"])
    param_names = ["n", "out_dtype"]
    timeout = 600

    def setup(self, n, out_dtype):
        torch = require_gpu()
        self.gemm = _fp4_train().fp4_gemm
        import fp4_kernels as fk

        self.x = [torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(ROTATE)]
        self.q = [fk.quantize(x, fmt="nvfp4") for x in self.x]
        self.out_dtype = out_dtype

    def _fp4_ms(self):
        pairs = list(zip(self.q, self.q[1:] + self.q[:1], strict=True))
        f = lambda a, b: self.gemm(a, b, backend="exact", out_dtype=self.out_dtype)  # noqa: E731
        return graph_time_ms(f, pairs)[0]

    def _bf16_ms(self):
        pairs = list(zip(self.x, self.x[1:] + self.x[:1], strict=True))
        return graph_time_ms(lambda a, b: a @ b.t(), pairs)[0]

    def track_device_ms(self, *params):
        return self._fp4_ms()

    track_device_ms.unit = "ms"

    def track_ratio_to_bf16_gemm(self, *params):
        return self._fp4_ms() / self._bf16_ms()

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
