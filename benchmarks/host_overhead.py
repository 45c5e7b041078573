"""Host cost of one eager call per op on torch CUDA tensors (256 x 256 elements).

    python benchmarks/host_overhead.py --cuda [--out DIR]   # on a GPU machine
    python benchmarks/host_overhead.py [--profile]           # anywhere: the host path alone

With ``--cuda``: for each op, the wall time of the Python call (min and median of 5 runs of
300 calls, no synchronization in the loop), with launch plans and without
(``fp4_kernels._plans.disabled()``: every call checked and laid out anew), the GPU time per
call (CUDA events around the same loop: when it is close to the host time the loop waits on
the GPU, not on Python) and the Python function calls of one warm call (cProfile).

Then the first call of a shape, as a caller whose shapes keep changing makes it (inference
over many sequence lengths): 200 calls, each on a (rows, 256) tensor of rows not seen before,
with plans (the default: such a call's plan is made from its kind's plan of every shape) and
without; the tensors are made before the timed loop.

Without ``--cuda``: every torch tensor pretends to live on ``cuda:0`` (``tests/_fake_cuda.py``):
the checks, plans, allocation (on the CPU), argument packing and the launch call run as on a
GPU machine, the launch itself is a no-op.  Times are then of this CPU and leave out the
driver's launch and the CUDA allocator.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

import torch  # noqa: E402

import fp4_kernels as fk  # noqa: E402
from fp4_kernels import _plans  # noqa: E402

REPS, CALLS = 5, 300


def ops(device):
    x = torch.randn(256, 256, device=device).to(torch.bfloat16)
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
        "torch_empty4": lambda: [
            torch.empty(65536, dtype=torch.uint8, device=device) for _ in range(4)
        ],
    }
    qn, qm, qf = fk.quantize(x), fk.quantize(x, fmt="mxfp4"), fk.quantize(x, fmt=g64)
    q4 = fk.quantize(x.reshape(4, -1), fmt="mxfp4")
    cases["dequantize_nvfp4"] = lambda: fk.dequantize(qn)
    cases["dequantize_mxfp4"] = lambda: fk.dequantize(qm)
    cases["fp4quant_g64_decode"] = lambda: fk.dequantize(qf)
    cases["requantized_sum_mxfp4_4rows"] = lambda: fk.requantized_sum(q4)
    return cases


NEW_SHAPES = 200


def _quantized(x):
    with _plans.disabled():  # (made before the timed loop: no plan of its own)
        return fk.quantize(x)


def new_shape_ops():
    """name -> a function of a tensor making one call, or (a function of a tensor making its
    argument, outside the timing; the call) (``first_call_us``)."""
    return {
        "quantize_nvfp4": fk.quantize,
        "quantize_mxfp4": lambda x: fk.quantize(x, fmt="mxfp4"),
        "quantize_dequantize_nvfp4": fk.quantize_dequantize,
        "hadamard_256": lambda x: fk.hadamard(x, group_size=256),
        "fp4quant_g64_encode": lambda x: fk.quantize(x, fmt=fk.FP4Quant(group_size=64)),
        "dequantize_nvfp4": (_quantized, fk.dequantize),
    }


def prepared(op):
    """(a function of a tensor making the call's argument, the call) of a ``new_shape_ops``
    entry."""
    return op if isinstance(op, tuple) else ((lambda x: x), op)


def first_call_us(op, device, sync):
    """Wall microseconds per call of ``op`` (as ``new_shape_ops`` gives it) on NEW_SHAPES
    tensors of shapes it has not seen ((16 + r, 256), r = 1, 2, ...), one call each."""
    prepare, f = prepared(op)
    xs = [
        prepare(torch.randn(16 + r, 256, device=device).to(torch.bfloat16))
        for r in range(1, NEW_SHAPES + 1)
    ]
    sync()
    t0 = time.perf_counter()
    for x in xs:
        f(x)
    sync()
    return (time.perf_counter() - t0) / len(xs) * 1e6


def calls_of(f, n=10, exclude="_fake_cuda.py"):
    """Python-level function calls of one call of ``f`` (average of n), the fake's excluded."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        f()
    prof.disable()
    stats = pstats.Stats(prof).stats
    total = sum(v[0] for (file, _, _), v in stats.items() if not file.endswith(exclude))
    return total / n - 1, prof  # minus the lambda itself


def profile_table(prof, n=10, most=30):
    """The ``most`` functions of a profile of ``n`` calls by their own time: calls, own and
    cumulative microseconds per call of the op (pstats prints milliseconds to three places,
    too coarse for a call of tens of microseconds)."""
    rows = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])[:most]
    out = [f"{'calls':>6s} {'own us':>8s} {'cum us':>8s}  function"]
    for (file, line, func), (_, ncalls, tottime, cumtime, _) in rows:
        where = func if file == "~" else f"{os.path.relpath(file)}:{line}({func})"
        out.append(f"{ncalls / n:6.1f} {tottime / n * 1e6:8.2f} {cumtime / n * 1e6:8.2f}  {where}")
    return "\n".join(out) + "\n"


def host_us(f, sync):
    """(min, median) wall microseconds per call over REPS runs of CALLS calls."""
    runs = []
    for _ in range(REPS):
        sync()
        t0 = time.perf_counter()
        for _ in range(CALLS):
            f()
        runs.append((time.perf_counter() - t0) / CALLS * 1e6)
    sync()
    return min(runs), statistics.median(runs)


def gpu_us(f):
    """GPU microseconds per call: CUDA events around CALLS calls."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(CALLS):
        f()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / CALLS


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cuda", action="store_true", help="on the GPU (else the fake, on the CPU)")
    ap.add_argument(
        "--out",
        default=None,
        help="also write host_overhead.txt and profiles.txt (each op's cProfile)",
    )
    ap.add_argument("--profile", action="store_true", help="print each op's cProfile")
    args = ap.parse_args()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        open(os.path.join(args.out, "profiles.txt"), "w").close()
    torch.set_num_threads(1)
    if args.cuda:
        scope, sync, device = contextlib.nullcontext(), torch.cuda.synchronize, "cuda"
    else:
        sys.path.insert(0, os.path.join(HERE, "..", "packages", "fp4_kernels", "tests"))
        from _fake_cuda import Recorder, fake_cuda

        scope, sync, device = fake_cuda(Recorder(keep=False)), lambda: None, "cpu"
    lines = []

    def emit(line):
        print(line, flush=True)
        lines.append(line)

    with scope:
        cases = ops(device)
        head = f"{'op':30s} {'calls':>5s} {'planned us min/med':>19s} {'unplanned':>15s}"
        emit(head + (f" {'gpu us':>7s}" if args.cuda else ""))
        for name, f in cases.items():
            for _ in range(50):
                f()
            with _plans.disabled():
                for _ in range(50):
                    f()
                unplanned = host_us(f, sync)
                calls_before, prof_unplanned = calls_of(f)
            planned = host_us(f, sync)
            calls, prof = calls_of(f)
            line = (
                f"{name:30s} {calls:5.0f} {planned[0]:9.1f} {planned[1]:9.1f} "
                f"{unplanned[0]:7.1f} {unplanned[1]:7.1f}"
            )
            if args.cuda:
                line += f" {gpu_us(f):7.1f}"
            emit(line + f"   (unplanned: {calls_before:.0f} calls)")
            if args.profile:
                pstats.Stats(prof).sort_stats("tottime").print_stats(25)
            if args.out:  # one file for all ops, each under a header line
                with open(os.path.join(args.out, "profiles.txt"), "a") as fh:
                    for what, p in (("planned", prof), ("plans disabled", prof_unplanned)):
                        fh.write(f"==== {name}, {what} (per call, cProfile's overhead in)\n")
                        fh.write(profile_table(p))
        emit(f"\n{'first call of a shape':30s} {'plans (default)':>15s} {'plans disabled':>15s}")
        for name, op in new_shape_ops().items():
            prepare, f = prepared(op)
            f(prepare(torch.randn(8, 256, device=device).to(torch.bfloat16)))  # kernels built
            with _plans.disabled():  # (no plan is made or used: the same shapes again below)
                unplanned = first_call_us(op, device, sync)
            planned = first_call_us(op, device, sync)
            emit(f"{name:30s} {planned:15.1f} {unplanned:15.1f}")
    if args.out:
        with open(os.path.join(args.out, "host_overhead.txt"), "w") as fh:
            fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
