"""The p2p transport's exchange kernel on one GPU, against a device-to-device copy of the same
bytes in the same run, and the host time of an eager call.

    python benchmarks/p2p_kernel.py [--ranks 2 4 8] [--sizes-mb 1 4 16 64 256] [--out DIR]

W ranks live in this process (``P2PTransport.loopback``), each with its own buffer, counters
and stream; one sample queues every rank's call and times, between two events, until all are
done.  All W kernels share one GPU: the bytes never cross a link, so the time is a floor for
the kernel's own cost (its loads, stores, flags and barriers), not an NVLink figure.  The
baseline is one ``copy_`` of the bytes the ranks receive, W x (the tensor each rank sends).
The exchange moves each byte twice (into the peer's slot, then out of it into the result), so
about 2x the copy time is the kernel at memory speed.

Host time (us): one eager call queued and not waited for (median): the transport's call alone
(``all_to_all`` / ``all_gather`` of one section), and whole collectives through a
``Communicator`` over the loopback transports (``validate="never"``: no host check; ``graphs``
at its default, "auto", so the timed calls, each of a kind made before, replay its CUDA graph).

Writes p2p_kernel.json and .md (device, commit, date) to --out (default $OUT or .).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import commit_id, write_json, write_markdown  # noqa: E402

HOST_REPS = 200


def _device_ms(torch, dev, launch_all, reps):
    base = torch.cuda.current_stream(dev)
    for _ in range(3):
        launch_all()
    torch.cuda.synchronize(dev)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(base)
        launch_all()
        end.record(base)
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _exchange(torch, dev, ts, streams, op, per_rank_bytes):
    W = len(ts)
    b = max(1, per_rank_bytes // W)
    if op == "all_to_all":
        sends = [torch.randint(0, 256, (W, b), dtype=torch.uint8, device=dev) for _ in ts]
    else:
        sends = [torch.randint(0, 256, (b,), dtype=torch.uint8, device=dev) for _ in ts]
    recvs = [torch.empty(W, b, dtype=torch.uint8, device=dev) for _ in ts]
    base = torch.cuda.current_stream(dev)

    def launch_all():
        ready = torch.cuda.Event()
        ready.record(base)
        for r, t in enumerate(ts):
            streams[r].wait_event(ready)
            with torch.cuda.stream(streams[r]):
                getattr(t, op)([(sends[r], recvs[r])])
        for s in streams:
            base.wait_stream(s)

    def host_once():
        ready = torch.cuda.Event()
        ready.record(base)
        for r, t in enumerate(ts):
            streams[r].wait_event(ready)
            with torch.cuda.stream(streams[r]):
                if r == 0:
                    start = time.perf_counter()
                    getattr(t, op)([(sends[r], recvs[r])])
                    took = time.perf_counter() - start
                else:
                    getattr(t, op)([(sends[r], recvs[r])])
        for s in streams:
            base.wait_stream(s)
        return took

    return launch_all, host_once, W * W * b


def _host_us(torch, dev, once, reps):
    ts = []
    for i in range(reps):
        ts.append(once())
        if i % 10 == 9:
            torch.cuda.synchronize(dev)
    torch.cuda.synchronize(dev)
    return 1e6 * statistics.median(ts)


def _collective_host_us(torch, dev, ts, streams, op, codec, numel, reps):
    import fp4_comm

    comms = [fp4_comm.Communicator(t, None, validate="never") for t in ts]
    W = len(ts)
    xs = [torch.randn(numel // W if op == "all_gather" else numel, device=dev,
                      dtype=torch.bfloat16) for _ in ts]  # fmt: skip
    base = torch.cuda.current_stream(dev)

    def once():
        ready = torch.cuda.Event()
        ready.record(base)
        took = 0.0
        for r in range(W):
            streams[r].wait_event(ready)
            with torch.cuda.stream(streams[r]):
                start = time.perf_counter()
                getattr(comms[r], op)(xs[r], codec=codec)
                if r == 0:
                    took = time.perf_counter() - start
        for s in streams:
            base.wait_stream(s)
        return took

    def warm():
        # The first call of a codec compiles and loads its kernels; loading a module can wait
        # for the device, where rank 0's exchange kernel already waits for rank 1's, which this
        # thread has not queued yet.  So the first calls run one thread a rank.
        ready = torch.cuda.Event()
        ready.record(base)
        errors = []

        def rank(r):
            try:
                streams[r].wait_event(ready)
                with torch.cuda.stream(streams[r]):
                    getattr(comms[r], op)(xs[r], codec=codec)
            except Exception as err:  # reported below, in the main thread
                errors.append(err)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(W)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        for s in streams:
            base.wait_stream(s)
        torch.cuda.synchronize(dev)

    for _ in range(2):
        warm()
    for _ in range(3):
        once()
    return _host_us(torch, dev, once, reps)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--ops", nargs="+", default=["all_to_all", "all_gather"])
    ap.add_argument("--codecs", nargs="+", default=["none", "nvfp4", "mxfp4", "fp4quant64"])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--host-reps", type=int, default=HOST_REPS)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()

    import torch

    import fp4_comm
    import fp4_kernels
    from fp4_comm.p2p import P2PTransport

    dev = fp4_comm.local_device()
    torch.cuda.set_device(dev)
    rows, host_rows = [], []
    for world in args.ranks:
        # lanes capped so that every rank's blocks fit on the GPU at once (shared_gpu_lanes)
        ts = P2PTransport.loopback(world, dev, timeout_s=60.0)
        lanes = ts[0].layout.lanes
        streams = [torch.cuda.Stream(dev) for _ in range(world)]
        for size_mb in args.sizes_mb:
            size = int(size_mb * 2**20)
            for op in args.ops:
                launch_all, host_once, delivered = _exchange(torch, dev, ts, streams, op, size)
                ms = _device_ms(torch, dev, launch_all, args.reps)
                src = torch.empty(delivered, dtype=torch.uint8, device=dev)
                dst = torch.empty_like(src)
                copy_ms = _device_ms(torch, dev, lambda s=src, d=dst: d.copy_(s), args.reps)
                host = _host_us(torch, dev, host_once, args.host_reps)
                row = {"ranks": world, "lanes": lanes, "op": op, "size_bytes": size,
                       "delivered_bytes": delivered, "kernel_ms": ms, "copy_ms": copy_ms,
                       "x_copy": ms / copy_ms, "host_us": host}  # fmt: skip
                rows.append(row)
                print(f"W={world} {op:10s} {size_mb:7.1f} MB  kernels {ms:8.3f} ms  copy "
                      f"{copy_ms:8.3f} ms  x{ms / copy_ms:5.2f}  host {host:6.1f} us",
                      flush=True)  # fmt: skip
                del src, dst
                torch.cuda.empty_cache()
        numel = 2**20 // 2  # 1 MB of bf16
        for op in ("all_reduce", "all_gather", "reduce_scatter"):
            for name in args.codecs:
                codec = fp4_kernels.FP4Quant(64) if name == "fp4quant64" else name
                us = _collective_host_us(torch, dev, ts, streams, op, codec, numel,
                                         args.host_reps)  # fmt: skip
                host_rows.append({"ranks": world, "op": op, "codec": name, "size_bytes": 2**20,
                                  "host_us": us})  # fmt: skip
                print(f"W={world} {op:15s} {name:11s} 1 MB host (replayed) {us:7.1f} us",
                      flush=True)  # fmt: skip
        for t in ts:
            t.close()
        _write(args.out, rows, host_rows)


def _write(out_dir, rows, host_rows):
    import torch

    meta = {
        "device": torch.cuda.get_device_name(),
        "commit": commit_id(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "note": "loopback: every rank in one process on one GPU; a floor for the kernel's "
        "cost, not an NVLink figure",
    }
    write_json(out_dir, "p2p_kernel", {"meta": meta, "rows": rows, "host_rows": host_rows})
    lines = [
        f"# p2p exchange kernel, loopback on one {meta['device']}",
        "",
        f"commit {meta['commit']}, {meta['date']}. {meta['note']}.",
        "",
        "| ranks | op | size / rank | delivered | kernels ms | copy ms | x copy | host us |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['ranks']} | {r['op']} | {r['size_bytes'] / 2**20:g} MB "
            f"| {r['delivered_bytes'] / 2**20:.1f} MB | {r['kernel_ms']:.3f} | {r['copy_ms']:.3f} "
            f"| {r['x_copy']:.2f} | {r['host_us']:.1f} |"
        )
    lines += [
        "",
        "| ranks | collective | codec | size | host us (replayed) |",
        "| ---: | --- | --- | ---: | ---: |",
    ]
    for r in host_rows:
        lines.append(f"| {r['ranks']} | {r['op']} | {r['codec']} | 1 MB | {r['host_us']:.1f} |")
    write_markdown(out_dir, "p2p_kernel", lines)


if __name__ == "__main__":
    main()
