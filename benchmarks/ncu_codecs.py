"""The codec kernels whose bound ``docs/benchmarks.md`` names from a Nsight Compute profile:
fake quantization (NVFP4 with ``global_amax`` given, MXFP4), FP4Quant's encode and decode at
g = 8192 and its stochastic encode at g = 64 (2^28 bf16 elements; rows of 4096, 8192 for
g = 8192).  Each op runs twice, the second time inside an NVTX range of its name, so that
Nsight Compute profiles that call only:

    ncu --clock-control none --nvtx $(python benchmarks/ncu_codecs.py --ranges) \\
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \\
        --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy \\
        --page raw --csv python benchmarks/ncu_codecs.py > ncu.csv
    python benchmarks/ncu_codecs.py --summarize ncu.csv

The summary gives per kernel its time, DRAM throughput, instructions per element (a thread's:
warp instructions x 32 / elements), the share of the elapsed cycles that its instructions need
at one warp instruction per scheduler and cycle (the issue-slot floor: 1.0 is issue-bound),
the issue rate achieved, the warps resident per scheduler, registers per thread, and the stall
reasons that cost most cycles per issued instruction
(``smsp__average_warps_issue_stalled_*_per_issue_active.ratio``).  Its time against a copy's
is ``gpu_throughput.py``'s to give (a D2D copy is a memcpy, not a kernel Nsight Compute sees).
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402

LOG2N = 28
#: the NVTX ranges, in the order the workload runs them (``_workload`` says what each runs)
OPS = ("qdq_nvfp4", "qdq_mxfp4", "enc8192", "dec8192", "encsr64")
TIME_UNITS = {"ns": 1e-9, "nsecond": 1e-9, "us": 1e-6, "usecond": 1e-6, "ms": 1e-3, "msecond": 1e-3}
RATE_UNITS = {
    "Tbyte/second": 1.0,
    "Gbyte/second": 1e-3,
    "byte/s": 1e-12,
    "byte/second": 1e-12,
}  # -> TB/s
#: the unit table of each column with a unit, by its name here
UNIT_TABLES = {"time": ("TIME_UNITS", TIME_UNITS), "dram": ("RATE_UNITS", RATE_UNITS)}
STALLS = "smsp__average_warps_issue_stalled_"
SCHEDULERS_PER_SM = 4  # Volta to Hopper
COLUMNS = {
    "time": "gpu__time_duration.sum",
    "dram": "dram__bytes.sum.per_second",
    "inst": "inst_executed",  # warp instructions
    "cycles": "gpc__cycles_elapsed.max",
    "sms": "device__attribute_multiprocessor_count",
    "issued": "smsp__issue_active.avg.per_cycle_active",
    "warps": "smsp__warps_active.avg.per_cycle_active",
    "regs": "launch__registers_per_thread",
}


def _workload():
    import torch

    import fp4_kernels as fk

    n = 1 << LOG2N
    x = torch.randn(n, device="cuda").to(torch.bfloat16).reshape(-1, 4096)
    x8192 = x.reshape(-1, 8192)
    g8192, g64 = fk.FP4Quant(group_size=8192), fk.FP4Quant(group_size=64)
    q8192 = fk.quantize(x8192, fmt=g8192)
    run = {
        "qdq_nvfp4": lambda: fk.quantize_dequantize(x, fmt="nvfp4", global_amax=4.5),
        "qdq_mxfp4": lambda: fk.quantize_dequantize(x, fmt="mxfp4"),
        "enc8192": lambda: fk.quantize(x8192, fmt=g8192),
        "dec8192": lambda: fk.dequantize(q8192, "bfloat16"),
        "encsr64": lambda: fk.quantize(x, fmt=g64, rounding="stochastic", seed=1234, step=0),
    }
    assert tuple(run) == OPS  # (the names ncu is told to profile)
    _timing.in_nvtx_ranges(run)


def _number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def _factor(unit, what):
    """The factor of ncu's ``unit`` of column ``what`` (to seconds, to TB/s: ``UNIT_TABLES``);
    a unit its table does not list stops the summary rather than print figures off by its
    factor."""
    name, table = UNIT_TABLES[what]
    if unit not in table:
        sys.exit(f"--summarize: ncu gave the {what} column ({COLUMNS[what]}) in {unit!r}, which "
                 f"this script does not know: add it to {name} ({', '.join(table)})")  # fmt: skip
    return table[unit]


def _summarize(path):
    """One line per profiled kernel of ncu's ``--page raw --csv`` output."""
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]  # ncu's own log lines are not
    rows = list(csv.reader(lines))
    header, units, data = rows[0], rows[1], rows[2:]
    col = {name: i for i, name in enumerate(header)}
    print(
        "| range | kernel | us | DRAM TB/s | instructions / element | issue-slot floor "
        "| issued / cycle | warps / scheduler | registers | top stalls (cycles / issued) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for n, row in enumerate(data):
        get = {k: _number(row[col[m]]) if m in col else None for k, m in COLUMNS.items()}
        time_s = get["time"] * _factor(units[col[COLUMNS["time"]]], "time")
        rate = get["dram"] * _factor(units[col[COLUMNS["dram"]]], "dram")
        # the range: from ncu's NVTX column where it has one, else by order (one kernel an op)
        nvtx = " ".join(row[i] for name, i in col.items() if "nvtx" in name.lower())
        rng = next((r for r in OPS if f"{r}/" in nvtx), None)
        rng = rng or (OPS[n] if n < len(OPS) else "?")
        stalls = sorted(
            (
                (name[len(STALLS) :].replace("_per_issue_active.ratio", ""), _number(row[i]) or 0.0)
                for name, i in col.items()
                if name.startswith(STALLS) and name.endswith("_per_issue_active.ratio")
            ),
            key=lambda s: -s[1],
        )
        top = ", ".join(f"{name} {value:.2f}" for name, value in stalls[:4])
        per_element = 32 * get["inst"] / (1 << LOG2N)
        floor = get["inst"] / (get["sms"] * SCHEDULERS_PER_SM) / get["cycles"]
        kernel = row[col["Kernel Name"]].split("[")[0] if "Kernel Name" in col else ""
        print(
            f"| {rng} | {kernel} | {time_s * 1e6:.0f} | {rate:.2f} | {per_element:.1f} | "
            f"{floor:.2f} | {get['issued']:.2f} | {get['warps']:.2f} | {get['regs']:.0f} | {top} |"
        )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranges", action="store_true", help="print ncu's --nvtx-include options")
    ap.add_argument("--summarize", metavar="CSV", help="summarize ncu's raw CSV page")
    args = ap.parse_args()
    if args.ranges:
        print(" ".join(f"--nvtx-include {name}/" for name in OPS))
    elif args.summarize:
        _summarize(args.summarize)
    else:
        _workload()


if __name__ == "__main__":
    main()
