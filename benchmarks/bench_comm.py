"""asv: fp4_comm's collectives (mirrors the public API: Communicator.all_reduce, all_gather,
reduce_scatter, send/recv) against NCCL bf16 on the same communicator, in the same run.

A collective needs one process per GPU, so ``setup_cache`` runs ``comm_throughput.py`` once
under torchrun on every visible GPU (at least two; otherwise NotImplementedError in setup:
asv reports the benchmarks skipped, as on a machine without a GPU) at one size, 64 MB of bf16
(where the project's aims start), and the ``track_*`` functions read its rows: device time of the
graph-replayed call (ms), its speedup over NCCL's bf16 collective, and the SQNR of the result.
The NCCL environment of the asv process (NCCL_P2P_DISABLE, NCCL_SHM_DISABLE) passes on, so the
same suite records the slow-link variants when run with them set.
"""

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SIZE_MB = 64
OPS = ["all_reduce", "all_gather", "reduce_scatter", "send_recv"]
CODECS = ["nvfp4", "mxfp4", "fp4quant64", "none"]
# asv's version of these figures (as _timing.GPU_METHOD_VERSION for the kernels' classes): the
# measurement's, changed when what a figure measures changes, so that edits of the class keep
# its history
COMM_METHOD_VERSION = "comm-throughput-1"


def _gpus():
    try:
        import torch
    except ImportError:
        raise NotImplementedError("needs torch with CUDA") from None
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        raise NotImplementedError(f"needs 2 or more CUDA GPUs, this machine has {n}")
    return n


class Collectives:
    params = (OPS, CODECS)
    param_names = ["op", "codec"]
    timeout = 900
    version = COMM_METHOD_VERSION

    def setup_cache(self):
        try:
            gpus = _gpus()
        except NotImplementedError as e:
            return {"skip": str(e)}  # setup raises it: asv reports a skip, not a failure
        env = dict(os.environ, NCCL_NVLS_ENABLE=os.environ.get("NCCL_NVLS_ENABLE", "0"))
        with tempfile.TemporaryDirectory() as out:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={gpus}", str(HERE / "comm_throughput.py"),
                   "--sizes-mb", str(SIZE_MB), "--ops", *OPS,
                   "--codecs", "nccl-bf16", *CODECS, "--out", out]  # fmt: skip
            subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
            rows = json.loads((Path(out) / "comm_throughput.json").read_text())["rows"]
        return {(r["op"], r["codec"]): r for r in rows}

    def setup(self, rows, op, codec):
        if "skip" in rows:
            raise NotImplementedError(rows["skip"])
        if (op, codec) not in rows:
            raise NotImplementedError(f"{op} {codec} was not measured")

    def track_device_ms(self, rows, op, codec):
        return rows[(op, codec)]["graph_ms"]

    track_device_ms.unit = "ms"

    def track_speedup_over_nccl_bf16(self, rows, op, codec):
        return rows[(op, codec)]["speedup_graph"]

    track_speedup_over_nccl_bf16.unit = "x NCCL bf16"

    def track_sqnr(self, rows, op, codec):
        # an exact result (bf16 moved unchanged: codec "none" in all_gather / send_recv) has
        # an infinite SQNR, which asv cannot plot (its step detection fails): NaN, shown n/a
        sqnr = rows[(op, codec)]["sqnr_db"]
        return sqnr if math.isfinite(sqnr) else math.nan

    track_sqnr.unit = "dB"
