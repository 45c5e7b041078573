"""fp4_comm collectives against NCCL bf16 on the same communicator, in the same run.

    torchrun --nproc-per-node 2 benchmarks/comm_throughput.py [--sizes-mb 1 4 16 64 256 1024]
        [--ops all_reduce all_gather reduce_scatter send_recv] [--graphs auto|never]
        [--transport nccl|p2p] [--all-reduce-algorithm auto|one_shot|two_shot] [--out DIR]

For each size (bytes of the bf16 tensor: the all-reduce tensor, the all-gather output, the
reduce-scatter input, the tensor sent), operation and codec ("nccl-bf16": NCCL's own collective
on bf16, the baseline; "none": bf16 through fp4_comm's path; "nvfp4", "mxfp4", "fp4quant64"):

- device time (ms): median over repeats, between CUDA events, of the call captured in a CUDA
  graph and replayed (host overhead cannot leave the GPU idle inside the interval), and of
  the eager call (what an un-captured caller gets, host overhead included when it dominates);
- host time (us) of one eager call (queued, not waited for), and of one made with the GPU
  idle and every rank ready (``host_idle_us``: each call after a synchronize and a barrier):
  where the queued figure is the larger, calls wait on the GPU (a full launch queue, an
  allocation that synchronizes, NCCL waiting for work ahead of it), the difference being that
  wait; the idle figure is the host's own work (Python, launches, NCCL's host side).
  ``--host-profile`` also writes, per row, rank 0's cProfile of queued calls (where the host
  time goes: Python functions, and C calls such as kernel launches and NCCL's groupEnd);
- algorithm bandwidth (size / graph time), bus bandwidth (NCCL-tests' factors: all-reduce
  2(W-1)/W, all-gather and reduce-scatter (W-1)/W, send/recv 1);
- speedup over nccl-bf16 (graph and eager);
- error: SQNR (dB) of the result against the float32 collective of the same inputs.

fp4_comm's calls go through the communicator's default path (``graphs="never"``: every call
eager) unless ``--graphs auto`` (repeated calls replayed from CUDA graphs) says otherwise; the
rows record which.  ``--transport p2p``: fp4_comm's calls over the peer-to-peer transport
(``nccl-bf16`` stays NCCL's, on a second communicator); ``--all-reduce-algorithm``: the
communicator's (default "auto": one-shot over p2p for at most 4 ranks and 512 KiB).

Inputs are N(0, 1) bf16, rotated among 3 buffers per rank.  Run with NCCL_P2P_DISABLE=1 (and
NCCL_SHM_DISABLE=1) to model slower links.  Rank 0 writes comm_throughput.json and .md (device,
commit, date, NCCL environment) to --out (default $OUT or .).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import (  # noqa: E402
    commit_id,
    cuda_time_ms,
    graph_time_ms,
    machine_label,
    write_json,
    write_markdown,
)

ROTATE = 3
BUS_FACTOR = {
    "all_reduce": lambda w: 2 * (w - 1) / w,
    "all_gather": lambda w: (w - 1) / w,
    "reduce_scatter": lambda w: (w - 1) / w,
    "send_recv": lambda w: 1.0,
}
HOST_REPS = 50
HOST_IDLE_REPS = 20
HOST_PROFILE_CALLS = 20
NCCL_ENV = ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_NVLS_ENABLE", "NCCL_ALGO", "NCCL_PROTO")


def _codec(name):
    import fp4_kernels

    return fp4_kernels.FP4Quant(64) if name == "fp4quant64" else name


def host_time_us(fn, args_list, reps=HOST_REPS):
    """Median wall time of one eager call, queued and not waited for; every rank makes the
    same calls (they are collectives), synchronizing every 10 to keep the queue short."""
    import torch

    ts = []
    for i in range(reps):
        t0 = time.perf_counter()
        fn(*args_list[i % len(args_list)])
        ts.append((time.perf_counter() - t0) * 1e6)
        if i % 10 == 9:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return statistics.median(ts)


def host_idle_us(comm, fn, args_list, reps=HOST_IDLE_REPS):
    """Median wall time of one eager call made with the GPU idle: every rank synchronizes and
    meets the others at a barrier before each call, so nothing is queued ahead of it."""
    import torch
    import torch.distributed as dist

    ts = []
    for i in range(reps):
        torch.cuda.synchronize()
        dist.barrier(group=comm.control_group)
        t0 = time.perf_counter()
        fn(*args_list[i % len(args_list)])
        ts.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(ts)


def host_profile(fn, args_list, path, calls=HOST_PROFILE_CALLS):
    """cProfile of ``calls`` queued eager calls (every rank makes them; rank 0 writes ``path``),
    sorted by own time: Python functions and the C calls they make."""
    import cProfile
    import pstats

    import torch

    prof = cProfile.Profile() if path else None
    for i in range(calls):
        if prof is not None:
            prof.enable()
        fn(*args_list[i % len(args_list)])
        if prof is not None:
            prof.disable()
        if i % 10 == 9:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    if prof is not None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)  # before the first table
        with open(path, "w") as fh:
            fh.write(f"{calls} queued calls\n")
            pstats.Stats(prof, stream=fh).sort_stats("tottime").print_stats(40)


def sqnr_db(ref, y):
    ref = ref.double()
    noise = float(((ref - y.double()) ** 2).sum())
    return math.inf if noise == 0 else 10 * math.log10(float((ref**2).sum()) / noise)


class NcclBaseline:
    """NCCL's own collectives on bf16, through the communicator's CuPy NCCL handle."""

    def __init__(self, comm):
        from cupy.cuda import nccl

        self.nccl = nccl
        self.c = comm.transport.comm
        self.rank, self.world = comm.rank, comm.world_size
        # ncclBfloat16 is 9 in NCCL >= 2.10; older CuPy has no constant for it.
        self.bf16 = getattr(nccl, "NCCL_BFLOAT16", 9)
        self.f32 = nccl.NCCL_FLOAT32

    def _s(self):
        import torch

        return torch.cuda.current_stream().cuda_stream

    def dtype(self, t):
        import torch

        return self.f32 if t.dtype == torch.float32 else self.bf16

    def all_reduce(self, x, out):
        self.c.allReduce(x.data_ptr(), out.data_ptr(), x.numel(), self.dtype(x),
                         self.nccl.NCCL_SUM, self._s())  # fmt: skip

    def all_gather(self, x, out):
        self.c.allGather(x.data_ptr(), out.data_ptr(), x.numel(), self.dtype(x), self._s())

    def reduce_scatter(self, x, out):
        self.c.reduceScatter(x.data_ptr(), out.data_ptr(), out.numel(), self.dtype(x),
                             self.nccl.NCCL_SUM, self._s())  # fmt: skip

    def send_recv(self, x, out):
        self.nccl.groupStart()
        if self.rank == 0:
            self.c.send(x.data_ptr(), x.numel(), self.dtype(x), 1, self._s())
        elif self.rank == 1:
            self.c.recv(out.data_ptr(), out.numel(), self.dtype(x), 0, self._s())
        self.nccl.groupEnd()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    ap.add_argument("--ops", nargs="+", default=list(BUS_FACTOR))
    ap.add_argument("--codecs", nargs="+",
                    default=["nccl-bf16", "none", "nvfp4", "mxfp4", "fp4quant64"])  # fmt: skip
    ap.add_argument("--reps", type=int, default=15, help="timed repeats (events, graphs)")
    ap.add_argument("--host-reps", type=int, default=HOST_REPS, help="calls timed on the host")
    ap.add_argument("--host-profile", action="store_true",
                    help="write rank 0's cProfile of queued calls per row to --out")  # fmt: skip
    ap.add_argument("--graphs", choices=["auto", "never"], default=None,
                    help="the communicator's graphs option (default: its default)")  # fmt: skip
    ap.add_argument("--transport", choices=["nccl", "p2p"], default="nccl",
                    help="fp4_comm's transport (the nccl-bf16 baseline is NCCL's)")  # fmt: skip
    ap.add_argument("--all-reduce-algorithm", choices=["auto", "one_shot", "two_shot"],
                    default="auto", help="the communicator's all_reduce_algorithm")  # fmt: skip
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()

    import torch

    import fp4_comm

    # LOCAL_RANK modulo the GPUs: ranks share a GPU where there are more ranks than GPUs (NCCL's
    # multi-rank mode, NCCL_MULTI_RANK_GPU_ENABLE=1)
    device = fp4_comm.local_device()
    torch.cuda.set_device(device)
    comm = fp4_comm.Communicator.from_env(
        device=device, validate="first", graphs=args.graphs, transport=args.transport,
        all_reduce_algorithm=args.all_reduce_algorithm,
    )  # fmt: skip
    world, rank = comm.world_size, comm.rank
    dev = comm.device
    nccl = comm
    if args.transport != "nccl":
        nccl = fp4_comm.Communicator.from_env(device=device, validate="first", transport="nccl")
    base = NcclBaseline(nccl)
    rows = []
    gen = torch.Generator(device=dev).manual_seed(1234 + rank)

    for size_mb in args.sizes_mb:
        n = int(size_mb * 2**20) // 2 // (world * 64) * (world * 64)  # bf16 elements
        for op in args.ops:
            if op == "send_recv" and world < 2:
                continue
            profile_dir = args.out if args.host_profile else None
            rows += _measure_op(comm, base, op, n, args.codecs, args.reps, args.host_reps, gen,
                                profile_dir)  # fmt: skip
            torch.cuda.empty_cache()
            if rank == 0:  # after every operation: a run cut short keeps what it measured
                _write(args.out, rows, world)
    comm.synchronize()
    torch.distributed.barrier(comm.control_group)


def _slowest(comm, value):
    """The largest of the ranks' values (the slowest rank bounds a collective)."""
    import torch.distributed as dist

    every = [None] * comm.world_size
    dist.all_gather_object(every, value, group=comm.control_group)
    return every


def _measure_op(comm, base, op, n, codecs, reps, host_reps, gen, profile_dir=None):
    import torch

    world, rank, dev = comm.world_size, comm.rank, comm.device
    per_rank = n // world if op == "all_gather" else n
    xs = [torch.randn(per_rank, device=dev, dtype=torch.bfloat16, generator=gen)
          for _ in range(ROTATE)]  # fmt: skip
    out_n = {"all_gather": n, "reduce_scatter": n // world}.get(op, n)
    out = torch.empty(out_n, device=dev, dtype=torch.bfloat16)
    ref_out = torch.empty(out_n, device=dev, dtype=torch.float32)
    getattr(base, op)(xs[0].float(), ref_out)  # the float32 reference of the same inputs
    rows, baseline = [], None
    for codec in codecs:
        if codec == "nccl-bf16":

            def fn(x):
                getattr(base, op)(x, out)
                return out

        else:
            fn = _ours(comm, op, _codec(codec))
        torch.distributed.barrier(comm.control_group)
        y = fn(xs[0])
        err = sqnr_db(ref_out, y) if (op != "send_recv" or rank == 1) else float("nan")
        arg_list = [(x,) for x in xs]
        eager_ms = cuda_time_ms(fn, arg_list, reps=reps)[0]
        try:
            graph_ms = graph_time_ms(fn, arg_list, reps=reps, chain=1)[0]
        except RuntimeError as capture_err:  # a transport that cannot be captured: say so
            print(f"rank {rank}: {op} {codec}: graph capture failed: {capture_err}", flush=True)
            graph_ms = math.nan
        host_us = host_time_us(fn, arg_list, host_reps)
        idle_us = host_idle_us(comm, fn, arg_list)
        if profile_dir is not None:
            name = f"host_profile_{op}_{codec}_{2 * n >> 20}mb_w{world}.txt"
            host_profile(fn, arg_list, os.path.join(profile_dir, name) if rank == 0 else None)
        every = _slowest(comm, (graph_ms, eager_ms, host_us, idle_us, err))
        graph_ms, eager_ms, host_us, idle_us = (max(e[i] for e in every) for i in range(4))
        err = every[1][4] if op == "send_recv" else every[0][4]  # the receiver's for send/recv
        size_b = 2 * n
        row = {
            "op": op, "codec": codec, "size_bytes": size_b, "world": world,
            "graph_ms": graph_ms, "eager_ms": eager_ms, "host_us": host_us,
            "host_idle_us": idle_us,
            "algbw_gbps": size_b / graph_ms / 1e6,
            "busbw_gbps": size_b / graph_ms / 1e6 * BUS_FACTOR[op](world),
            "sqnr_db": err, "graphs": comm.graphs,
            "transport": type(comm.transport).__name__,
            "all_reduce_algorithm": comm.all_reduce_algorithm,
        }  # fmt: skip
        if codec == "nccl-bf16":
            baseline = row
        if baseline is not None:
            row["speedup_graph"] = baseline["graph_ms"] / graph_ms
            row["speedup_eager"] = baseline["eager_ms"] / eager_ms
        rows.append(row)
        if rank == 0:
            print(
                f"{op:15s} {size_b / 2**20:7.0f} MB {codec:11s} graph {graph_ms:8.3f} ms "
                f"eager {eager_ms:8.3f} ms host {host_us:7.0f} us (idle {idle_us:5.0f}) "
                f"busbw {row['busbw_gbps']:6.1f} GB/s "
                f"x{row.get('speedup_graph', float('nan')):5.2f} SQNR {err:6.2f} dB",
                flush=True,
            )
    return rows


def _ours(comm, op, codec):
    """The fp4_comm call of ``op`` as fn(x) -> result."""
    if op == "send_recv":

        def fn(x):
            if comm.rank == 0:
                comm.send(x, dst=1, codec=codec)
                return x
            if comm.rank == 1:
                return comm.recv(x.shape, x.dtype, src=0, codec=codec)
            return x

        return fn
    return lambda x: getattr(comm, op)(x, codec=codec)


def _write(out_dir, rows, world):
    import torch

    # ranks on one host share its GPUs where there are fewer (rank r on GPU r % count)
    gpus = min(world, torch.cuda.device_count())
    meta = {
        "device": torch.cuda.get_device_name(),
        "ranks": world,
        "gpus": gpus,
        "commit": commit_id(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "nccl_env": {k: os.environ[k] for k in NCCL_ENV if k in os.environ},
        "torch": torch.__version__,
    }
    write_json(out_dir, "comm_throughput", {"meta": meta, "rows": rows})
    lines = [
        f"# fp4_comm collectives vs NCCL bf16: {machine_label(meta)}",
        "",
        f"commit {meta['commit']}, {meta['date']}, NCCL env {meta['nccl_env'] or 'default'}",
        "",
        "| op | size | codec | graph ms | eager ms | host us | host us, GPU idle | busbw GB/s "
        "| speedup (graph) | speedup (eager) | SQNR dB |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['op']} | {r['size_bytes'] / 2**20:.0f} MB | {r['codec']} | {r['graph_ms']:.3f} "
            f"| {r['eager_ms']:.3f} | {r['host_us']:.0f} | {r['host_idle_us']:.0f} "
            f"| {r['busbw_gbps']:.1f} "
            f"| {r.get('speedup_graph', float('nan')):.2f} "
            f"| {r.get('speedup_eager', float('nan')):.2f} | {r['sqnr_db']:.2f} |"
        )
    write_markdown(out_dir, "comm_throughput", lines)


if __name__ == "__main__":
    main()
