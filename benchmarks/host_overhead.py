"""Host cost of one eager call on torch CUDA tensors, measured without a GPU.

    python benchmarks/host_overhead.py [--calls 2000] [--profile]

Every torch tensor pretends to live on ``cuda:0`` (``tests/_fake_cuda.py``): the checks,
planning, allocation (on the CPU here), argument packing and the launch call run as on a GPU
machine, but the kernel launch itself is a no-op.  Reports, per op on 256 x 256 elements, the
Python function calls of one warm call (cProfile, the fake's own functions excluded) and the
microseconds per call on this CPU; the time of a launch (a few microseconds through the driver)
and of a CUDA allocation are not in it.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "packages", "fp4_kernels", "tests"))

import torch  # noqa: E402
from _fake_cuda import Recorder, fake_cuda  # noqa: E402

import fp4_kernels as fk  # noqa: E402


def ops():
    x = torch.randn(256, 256).to(torch.bfloat16)
    x32 = x.float()
    amax = x32.abs().amax().reshape(1)
    g64 = fk.FP4Quant(group_size=64)
    cases = {
        "quantize_nvfp4": lambda: fk.quantize(x),
        "quantize_nvfp4_amax_tensor": lambda: fk.quantize(x, global_amax=amax),
        "quantize_nvfp4_amax_float": lambda: fk.quantize(x, global_amax=3.5),
        "quantize_nvfp4_sr": lambda: fk.quantize(x, rounding="stochastic", seed=1, step=2),
        "quantize_nvfp4_swizzled": lambda: fk.quantize(x, scale_layout="swizzled"),
        "quantize_mxfp4": lambda: fk.quantize(x, fmt="mxfp4"),
        "quantize_nvfp4_fp32": lambda: fk.quantize(x32),
        "quantize_dequantize_nvfp4": lambda: fk.quantize_dequantize(x),
        "hadamard_256": lambda: fk.hadamard(x, group_size=256),
        "hadamard_256_signs": lambda: fk.hadamard(x, group_size=256, signs=7),
        "fp4quant_g64_encode": lambda: fk.quantize(x, fmt=g64),
        "torch_mul": lambda: x.mul(2),
        "torch_empty4": lambda: [torch.empty(65536, dtype=torch.uint8) for _ in range(4)],
    }
    qn, qm, qf = fk.quantize(x), fk.quantize(x, fmt="mxfp4"), fk.quantize(x, fmt=g64)
    q4 = fk.quantize(x.reshape(4, -1), fmt="mxfp4")
    cases["dequantize_nvfp4"] = lambda: fk.dequantize(qn)
    cases["dequantize_mxfp4"] = lambda: fk.dequantize(qm)
    cases["fp4quant_g64_decode"] = lambda: fk.dequantize(qf)
    cases["requantized_sum_mxfp4_4rows"] = lambda: fk.requantized_sum(q4)
    return cases


def calls_of(f, n=10):
    """Python-level function calls of one call of ``f`` (average of n), the fake's excluded."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        f()
    prof.disable()
    stats = pstats.Stats(prof).stats
    total = sum(v[0] for (file, _, _), v in stats.items() if not file.endswith("_fake_cuda.py"))
    return total / n - 1, prof  # minus the lambda itself


def time_of(f, calls):
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--profile", action="store_true", help="print each op's cProfile")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with fake_cuda(Recorder(keep=False)):
        cases = ops()
        print(f"{'op':30s} {'calls':>6s} {'us/call':>8s}")
        for name, f in cases.items():
            for _ in range(20):
                f()
            n_calls, prof = calls_of(f)
            print(f"{name:30s} {n_calls:6.0f} {time_of(f, args.calls):8.1f}", flush=True)
            if args.profile:
                pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
