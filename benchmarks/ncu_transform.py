"""The transform at g = 1024 / 4096 / 8192, with signs at 4096, and the FP4Quant encoder at
4096 (2^28 bf16), each called twice with the second call inside an NVTX range of its name, for
Nsight Compute:

    ncu --clock-control none --nvtx --nvtx-include "h1024/" --nvtx-include "h4096/" \\
        --nvtx-include "h8192/" --nvtx-include "hs4096/" --nvtx-include "e4096/" \\
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \\
        --section MemoryWorkloadAnalysis --page raw python benchmarks/ncu_transform.py

The raw page holds, per kernel, the stall reasons an issued instruction
(``smsp__average_warps_issue_stalled_*_per_issue_active.ratio``), the issue rate and the DRAM
throughput (``dram__bytes.sum.per_second``).
"""

import os
import sys

import torch

import fp4_kernels as fk

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402


def main():
    x = torch.randn(1 << 28, device="cuda").to(torch.bfloat16).reshape(-1, 8192)
    y = torch.empty_like(x)
    ops = [
        ("copy", lambda: y.copy_(x)),
        ("h1024", lambda: fk.hadamard(x, group_size=1024)),
        ("h4096", lambda: fk.hadamard(x, group_size=4096)),
        ("h8192", lambda: fk.hadamard(x, group_size=8192)),
        ("hs4096", lambda: fk.hadamard(x, group_size=4096, signs=7)),
        ("e4096", lambda: fk.quantize(x, fmt=fk.FP4Quant(group_size=4096))),
    ]
    _timing.in_nvtx_ranges(dict(ops))


if __name__ == "__main__":
    main()
