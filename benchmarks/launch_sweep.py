"""One op's time over grid sizes and CTA sizes, each point against a copy timed right before it.

    python benchmarks/launch_sweep.py [--log2n 28] [--ops hadamard:1024,encode:4096,...]
        [--ctas-per-sm 0,1,2,4,8] [--threads 0,64,128] [--threads-per-sm table,0,512,640]
        [--repeat 2] [--out DIR]
    python benchmarks/launch_sweep.py --profile [--ops ...]    # each op once, for ncu

Ops: ``hadamard:G``, ``hadamard-signs:G``, ``hadamard-f32:G`` (float32 input, the copy still
bf16: compare it with ``hadamard:G`` of the same run), ``encode:G`` (FP4Quant with the transform),
``decode:G``, ``nvfp4`` (quantize with ``global_amax`` given), ``dequantize-nvfp4``.  A point is
``launch_policy(max_blocks=ctas_per_sm * SMs, threads=threads, threads_per_sm=...)`` (0 CTAs
or threads: the launch table's choice; the launcher still caps the grid at the CTAs that can
be resident at once).  ``--threads-per-sm``: the resident threads an SM each kernel's
shared-memory carveout is sized for, the rest of the SM being L1 (``table``: the op's choice;
0: the driver's, which fits the most CTAs).  On the H200 the transform at g = 4096 (CTAs of
128 threads, 33 KB of shared memory each) gets 228 KB of shared memory for 768 or 0, 196 KB
for 640 and 164 KB for 512 (the driver rounds up to the sizes it supports).

Timing: ``_timing.graph_time_ms`` with ``--chain`` CUDA-graph replays back to back between two
events (the GPU busy for ~10 ms a sample), median of 15 samples; the copy of the same tensor
just before, eager calls chained the same way (a copy captured in a graph may run on a copy
engine, slower), so every ratio has its own baseline.  The SM clock and the clock-event
reasons (``nvidia-smi``) are read while the op runs again: a kernel that issues near its limit
slows with the SM clock, a copy does not.  Writes ``launch_sweep.json`` / ``.md`` to
``--out``.

Profile mode runs each op once on the same tensor size (no timing, no copy), so that
``ncu --clock-control none --kernel-name regex:'hadamard|fp4quant|quantize' ...`` sees one
launch of each kernel.
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys

import fp4_kernels as fk
from fp4_kernels.cuda import launch

try:  # imported as part of the benchmarks package
    from . import _timing
except ImportError:  # run as a script
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _timing

K = 8192
DEFAULT_OPS = (
    "hadamard:64,hadamard:1024,hadamard-signs:1024,hadamard:8192,encode:1024,encode:4096,"
    "decode:4096"
)


def make_op(spec, xs):
    """(name, fn(i)) for an op spec; fn runs the op on input i of the rotation."""
    name, _, g = spec.partition(":")
    g = int(g) if g else 0
    if name == "hadamard":
        return spec, lambda i: fk.hadamard(xs[i], group_size=g)
    if name == "hadamard-f32":
        xs32 = [x.float() for x in xs]
        return spec, lambda i: fk.hadamard(xs32[i], group_size=g)
    if name == "hadamard-signs":
        return spec, lambda i: fk.hadamard(xs[i], group_size=g, signs=1234)
    if name == "encode":
        fmt = fk.FP4Quant(g)
        return spec, lambda i: fk.quantize(xs[i], fmt=fmt)
    if name == "decode":
        fmt = fk.FP4Quant(g)
        qs = [fk.quantize(x, fmt=fmt) for x in xs]
        return spec, lambda i: fk.dequantize(qs[i])
    if name == "nvfp4":
        return spec, lambda i: fk.quantize(xs[i], fmt="nvfp4", global_amax=4.5)
    if name == "dequantize-nvfp4":
        qs = [fk.quantize(x, fmt="nvfp4") for x in xs]
        return spec, lambda i: fk.dequantize(qs[i])
    raise SystemExit(f"--ops: unknown op {spec!r} (see the module docstring)")


def smi():
    """(SM MHz, memory MHz, watts, active clock-event reasons) from nvidia-smi, or Nones."""
    q = "clocks.sm,clocks.mem,power.draw,clocks_event_reasons.active"
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.split(",")  # fmt: skip
        return int(out[0]), int(out[1]), float(out[2]), out[3].strip()
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None, None, None, None


def busy_reading(torch, fn, calls):
    """The nvidia-smi reading taken while ``calls`` more calls of ``fn`` run."""
    for j in range(calls):
        fn(j % _timing.ROTATE)
    reading = smi()
    torch.cuda.synchronize()
    return reading


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log2n", type=int, default=28)
    ap.add_argument("--ops", default=DEFAULT_OPS)
    ap.add_argument("--ctas-per-sm", default="0,1,2,3,4,6,8")
    ap.add_argument("--threads", default="0")
    ap.add_argument(
        "--threads-per-sm",
        default="table",
        help="resident threads an SM the carveout is sized for: 'table' (the op's), 0 (the "
        "driver's), N; a comma list sweeps them",
    )
    ap.add_argument("--repeat", type=int, default=1, help="sweeps in a row")
    ap.add_argument("--chain", type=int, default=40, help="calls per timed sample")
    ap.add_argument("--profile", action="store_true", help="run each op once (for ncu)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    import torch

    n = 1 << args.log2n
    torch.manual_seed(0)
    xs = [
        torch.randn(n // K, K, device="cuda", dtype=torch.bfloat16) for _ in range(_timing.ROTATE)
    ]
    ops = [make_op(s, xs) for s in args.ops.split(",") if s]
    if args.profile:
        for name, fn in ops:
            fn(0)
            torch.cuda.synchronize()
            print(f"ran {name}", flush=True)
        return
    dst = torch.empty_like(xs[0])

    def copy(i):
        dst.copy_(xs[i])

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    points = list(
        itertools.product(
            [int(t) for t in args.threads.split(",")],
            [int(c) for c in args.ctas_per_sm.split(",")],
            [None if c == "table" else int(c) for c in args.threads_per_sm.split(",")],
        )
    )
    for rep in range(args.repeat):
        for (name, fn), (threads, per_sm, carve) in itertools.product(ops, points):
            rotation = [(i,) for i in range(_timing.ROTATE)]
            copy_ms = _timing.cuda_time_ms(copy, rotation, chain=args.chain)[0]
            copy_smi = busy_reading(torch, copy, 8 * args.chain)
            policy = dict(
                max_blocks=per_sm * sms if per_sm else None,
                threads=threads or None,
                threads_per_sm=carve,
            )
            with launch.launch_policy(**policy):
                try:
                    ms = _timing.graph_time_ms(fn, rotation, chain=args.chain)[0]
                    op_smi = busy_reading(torch, fn, 8 * args.chain)
                except ValueError as e:  # a CTA size this op does not take
                    print(f"{name} threads={threads} ctas/SM={per_sm}: {e}")
                    continue
            row = {
                "repeat": rep,
                "op": name,
                "threads": threads or "table",
                "ctas_per_sm": per_sm or "table",
                "threads_per_sm": "table" if carve is None else carve,
                "ms": ms,
                "copy_ms": copy_ms,
                "ratio_to_copy": ms / copy_ms,
                "sm_mhz": op_smi[0],
                "copy_sm_mhz": copy_smi[0],
                "mem_mhz": op_smi[1],
                "watts": op_smi[2],
                "clock_reasons": op_smi[3],
            }
            rows.append(row)
            print(
                f"{rep} {name:20s} threads={row['threads']!s:5s} "
                f"ctas/SM={row['ctas_per_sm']!s:5s} carveout for {row['threads_per_sm']!s:5s} "
                f"{ms:7.4f} ms  copy {copy_ms:7.4f}  {ms / copy_ms:5.3f} x copy time  "
                f"SM {op_smi[0]} MHz (copy {copy_smi[0]}) {op_smi[2]} W {op_smi[3]}",
                flush=True,
            )
    meta = _timing.run_meta(
        elements=n,
        chain=args.chain,
        sms=sms,
        resident_ctas=[  # the launcher's occupancy answers, one per kernel and CTA size
            {
                "kernel": getattr(getattr(key[0], "py_func", None), "__qualname__", "?"),
                "arg_types": [str(t) for t in key[2]],
                "threads": threads,
                "carveout_for_ctas": carveout[0] if carveout else None,
                "ctas": ctas,
            }
            for (key, threads, *carveout), ctas in launch._resident.items()
        ],
    )
    _timing.write_json(args.out, "launch_sweep", {"meta": meta, "results": rows})
    lines = [
        f"# launch sweep: {meta['device']}, commit {meta['commit']}, {meta['date']}",
        "",
        f"2^{args.log2n} bf16 elements, {args.chain} calls per timed sample.",
        "",
        "| rep | op | threads | CTAs / SM | carveout for (threads / SM) | ms | copy ms "
        "| x copy time | SM MHz | W |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['repeat']} | {r['op']} | {r['threads']} | {r['ctas_per_sm']} | "
            f"{r['threads_per_sm']} | "
            f"{r['ms']:.4f} | {r['copy_ms']:.4f} | {r['ratio_to_copy']:.3f} | {r['sm_mhz']} | "
            f"{r['watts']} |"
        )
    _timing.write_markdown(args.out, "launch_sweep", lines)


if __name__ == "__main__":
    main()
