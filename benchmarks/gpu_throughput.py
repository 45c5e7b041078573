"""fp4_kernels GPU throughput against a device-to-device copy measured in the same run.

    python benchmarks/gpu_throughput.py [--log2n 28] [--out DIR]

For each op: median of CUDA-event timings after warm-up, GB/s of the *minimum* bytes the op
must move (input read once + packed codes + scales written; for dequantize the reverse; for the
fused fake-quant input read + output written), and that bandwidth as a ratio to a large
torch device-to-device copy (bytes read + written) timed in the same process.  Inputs rotate
among several buffers so repeated runs do not measure the L2.  Host time per call is the wall
time of the Python call alone (no synchronization), the cost that bounds small tensors.
Writes ``gpu_throughput.json`` and ``gpu_throughput.md`` (device, commit, date) to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys

import fp4_kernels as fk

try:  # imported by asv as part of the benchmarks package
    from . import _timing
except ImportError:  # run as a script
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _timing


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log2n", type=int, default=28, help="elements per input (default 2^28)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--profile", action="store_true", help="cProfile host time to host_profile.txt")
    args = ap.parse_args()
    import torch

    n = 1 << args.log2n
    k = 4096
    rows = n // k
    dev = torch.device("cuda")
    torch.manual_seed(0)
    xs = [torch.randn(rows, k, device=dev, dtype=torch.bfloat16) for _ in range(_timing.ROTATE)]
    xs32 = [torch.randn(rows, k, device=dev, dtype=torch.float32) for _ in range(_timing.ROTATE)]

    copy_gbps = _timing.copy_gbps()  # baseline: 1 GiB device-to-device, read + written

    results = []

    def record(name, fn, args_list, nbytes, small_args=None):
        eager_ms, _, _ = _timing.cuda_time_ms(fn, args_list)
        med, lo, hi = _timing.graph_time_ms(fn, args_list)
        gbps = nbytes / med / 1e6
        row = {
            "op": name,
            "elements": n,
            "median_ms": med,
            "min_ms": lo,
            "max_ms": hi,
            "eager_ms": eager_ms,
            "min_bytes": nbytes,
            "gbps": gbps,
            "ratio_to_copy": gbps / copy_gbps,
        }
        if small_args is not None:
            row["host_us_per_call"] = _timing.host_time_us(fn, small_args)
        results.append(row)
        print(
            f"{name:48s} {med:8.3f} ms (eager {eager_ms:6.3f}) {gbps:7.1f} GB/s "
            f"{gbps / copy_gbps:5.2f} x copy"
            + (f"  host {row['host_us_per_call']:.0f} us" if "host_us_per_call" in row else ""),
            flush=True,
        )

    small = torch.randn(64, 1024, device=dev, dtype=torch.bfloat16)  # 64K elements
    from fp4_kernels.cuda.launch import launch_policy

    def thread_per_block(fn):
        """The same call with a thread per quantizer block (the alternative layout)."""

        def run(*a):
            with launch_policy(lanes_per_block=1):
                return fn(*a)

        return run

    # the write-heavy ops' other ceiling: a write-only fill of the same bf16 tensors
    fills = [torch.empty(rows, k, device=dev, dtype=torch.bfloat16) for _ in range(_timing.ROTATE)]
    record(
        "baseline: fill bf16 (torch, write only)",
        lambda y: y.fill_(1.0),
        [(y,) for y in fills],
        2 * n,
    )
    del fills
    for fmt in ("nvfp4", "mxfp4"):
        q_bytes = n // 2 + n // fk.FORMATS[fmt]
        kwa = dict(fmt=fmt, global_amax=4.5) if fmt == "nvfp4" else dict(fmt=fmt)
        record(
            f"quantize {fmt} nearest bf16 one pass (a thread per block)",
            thread_per_block(lambda x, kw=kwa: fk.quantize(x, **kw)),
            [(x,) for x in xs],
            2 * n + q_bytes,
        )
    for fmt in ("nvfp4", "mxfp4"):
        block = fk.FORMATS[fmt]
        q_bytes = n // 2 + n // block
        for rounding in ("nearest", "stochastic"):
            kw = dict(fmt=fmt, rounding=rounding)
            record(
                f"quantize {fmt} {rounding} bf16",
                lambda x, kw=kw: fk.quantize(x, **kw),
                [(x,) for x in xs],
                2 * n + q_bytes,
                small_args=(small,),
            )
            if fmt == "nvfp4":
                kwa = dict(kw, global_amax=4.5)
                record(
                    f"quantize {fmt} {rounding} bf16 one pass (global_amax given)",
                    lambda x, kw=kwa: fk.quantize(x, **kw),
                    [(x,) for x in xs],
                    2 * n + q_bytes,
                    small_args=(small,),
                )
        record(
            f"quantize {fmt} nearest fp32",
            lambda x, f=fmt: fk.quantize(x, fmt=f),
            [(x,) for x in xs32],
            4 * n + q_bytes,
        )
        if fmt == "nvfp4":  # the amax pass left out: what the float32 path itself reaches
            record(
                f"quantize {fmt} nearest fp32 one pass (global_amax given)",
                lambda x, f=fmt: fk.quantize(x, fmt=f, global_amax=4.5),
                [(x,) for x in xs32],
                4 * n + q_bytes,
            )
        qs = [fk.quantize(x, fmt=fmt) for x in xs]
        record(
            f"dequantize {fmt} -> bf16",
            lambda q: fk.dequantize(q),
            [(q,) for q in qs],
            q_bytes + 2 * n,
            small_args=(fk.quantize(small, fmt=fmt),),
        )
        # fake quantization (one kernel: input read, output written; NVFP4 without
        # global_amax reads the input once more for its amax first)
        for rounding in ("nearest", "stochastic"):
            amaxes = (None, 4.5) if fmt == "nvfp4" else (None,)
            for ga in amaxes:
                kw = dict(fmt=fmt, rounding=rounding, global_amax=ga)
                record(
                    f"quantize_dequantize {fmt} {rounding} bf16"
                    + (" one pass (global_amax given)" if ga is not None else ""),
                    lambda x, kw=kw: fk.quantize_dequantize(x, **kw),
                    [(x,) for x in xs],
                    4 * n,
                    small_args=(small,) if rounding == "nearest" else None,
                )
        del qs

    if args.profile:
        import cProfile
        import pstats

        q_small = fk.quantize(small)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            fk.quantize(small)
            fk.dequantize(q_small)
        prof.disable()
        torch.cuda.synchronize()
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "host_profile.txt"), "w") as f:
            pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(25)

    meta = _timing.run_meta(copy_gbps=copy_gbps, fp4_kernels=fk.__version__)
    _timing.write_json(args.out, "gpu_throughput", {"meta": meta, "results": results})
    lines = [
        f"Device {meta['device']}, commit {meta['commit']}, {meta['date']}; "
        f"D2D copy {copy_gbps:.0f} GB/s (read + write); {n} elements (2^{args.log2n}), "
        f"rows of {k}.",
        "",
        f"Device time: median of 15 samples, each {_timing.CHAIN} CUDA-graph replays (one call per "
        "graph) back to back between two events; eager: one call timed with events around the "
        "Python call (includes any idle GPU time while the host launches).",
        "",
        "| op | device ms | eager ms | GB/s (min bytes) | x copy | host us/call (64K elems) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        host = f"{r['host_us_per_call']:.0f}" if "host_us_per_call" in r else ""
        lines.append(
            f"| {r['op']} | {r['median_ms']:.3f} | {r['eager_ms']:.3f} | {r['gbps']:.0f} | "
            f"{r['ratio_to_copy']:.2f} | {host} |"
        )
    _timing.write_markdown(args.out, "gpu_throughput", lines, echo=True)


if __name__ == "__main__":
    main()
