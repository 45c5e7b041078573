"""GPU time of the kernels one small eager call launches (256 x 256 bf16, torch CUDA tensors).

    python benchmarks/small_call_kernels.py

``host_overhead.py --cuda``'s "gpu us" column is CUDA events around a loop of unsynchronized
calls: when the host is the bottleneck it is the loop's wall time, not kernel time.  This
script reads the kernels' own durations from torch's profiler (CUPTI): 50 calls of each case
after 20 warm-up calls, the average duration of each kernel it launched.
"""

import torch
from torch.profiler import ProfilerActivity, profile

import fp4_kernels as fk


def main():
    x = torch.randn(256, 256, device="cuda").to(torch.bfloat16)
    amax = x.float().abs().amax().reshape(1)
    cases = {
        "nvfp4": lambda: fk.quantize(x),
        "nvfp4_amax_float": lambda: fk.quantize(x, global_amax=3.5),
        "nvfp4_amax_tensor": lambda: fk.quantize(x, global_amax=amax),
        "nvfp4_sr": lambda: fk.quantize(x, rounding="stochastic", seed=1, step=2),
        "nvfp4_sr_amax": lambda: fk.quantize(
            x, rounding="stochastic", seed=1, step=2, global_amax=3.5
        ),
        "mxfp4": lambda: fk.quantize(x, fmt="mxfp4"),
        "mxfp4_sr": lambda: fk.quantize(x, fmt="mxfp4", rounding="stochastic", seed=1, step=2),
    }
    for name, f in cases.items():
        for _ in range(20):
            f()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(50):
                f()
            torch.cuda.synchronize()
        print("==", name)
        for e in prof.key_averages():
            if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0):
                avg = e.device_time_total / max(e.count, 1)
                print(f"  {e.key[:90]:90s} n={e.count:4d} avg {avg:8.2f} us")


if __name__ == "__main__":
    main()
