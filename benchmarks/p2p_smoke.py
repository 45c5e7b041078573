"""The p2p transport, stage by stage, loud on failure: the first thing to run on a GPU machine,
and the workload for compute-sanitizer.

    python benchmarks/p2p_smoke.py --loopback          # one process: compile, load, W = 1, 2, 4
    torchrun --standalone --nproc-per-node 2 benchmarks/p2p_smoke.py   # ranks over CUDA IPC

Stages (each prints one line; the first failure prints the transport's failure report and
exits 1): compile and load the exchange kernel; loopback ranks in this process (self copy,
then 2 and 4 ranks on streams of their own, sizes from 1 KB); then, under torchrun, the
communicator over CUDA IPC (rank r on GPU r % device_count), the transport's all_to_all and
all_gather with odd sizes, every collective with every codec against the exact or the
cross-rank answer, a CUDA-graph replay, and close.  ``--timeout`` (default 20 s) is every
kernel wait's deadline; a Python traceback of every thread is dumped if a stage is stuck
past ``--stuck`` seconds (default 300).
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import time
import traceback


def _say(rank, text):
    print(f"[p2p smoke rank {rank}] {text}", flush=True)


def _fail(rank, stage, transports=()):
    _say(rank, f"FAILED at stage: {stage}")
    traceback.print_exc()
    for t in transports:
        try:
            _say(rank, f"report words {t._report_words()}; failed: {t.failed()}")
        except Exception as err:  # noqa: BLE001 - diagnostics only
            _say(rank, f"(no report: {err})")
    sys.stdout.flush()
    os._exit(1)


def _payload(torch, world, rank, call, n, dev):
    g = torch.Generator(device=dev).manual_seed(rank * 7919 + call * 104_729 + n)
    return torch.randint(0, 256, (world, n), generator=g, device=dev, dtype=torch.uint8)


def loopback(timeout_s):
    import torch

    import fp4_comm
    from fp4_comm import _p2p_kernels as K
    from fp4_comm.p2p import P2PTransport, _launcher

    dev = fp4_comm.local_device()
    stage = "compile and load the exchange kernel"
    try:
        start = time.monotonic()
        launcher = _launcher(dev)
        _say(0, f"{stage}: {time.monotonic() - start:.1f} s, {len(K.PARAMS)} parameters, "
                f"{K.THREADS} threads a block")  # fmt: skip
    except Exception:
        _fail(0, stage)
    del launcher
    call = 0
    for world in (1, 2, 4):
        stage = f"loopback with {world} ranks"
        ts = []
        try:
            ts = P2PTransport.loopback(world, dev, timeout_s, buffer_bytes=4 << 20, lanes=4)
            streams = [torch.cuda.Stream(dev) for _ in range(world)]
            for n in (1 << 10, 4097, 3 << 20):
                rows = [n, 5, 1]
                call += 1
                sends = [
                    [_payload(torch, world, r, call, k, dev) for k in rows] for r in range(world)
                ]
                recvs = [[torch.zeros_like(s) for s in per] for per in sends]
                torch.cuda.synchronize(dev)
                for r in range(world):
                    with torch.cuda.stream(streams[r]):
                        ts[r].all_to_all(list(zip(sends[r], recvs[r], strict=True)))
                for r in range(world):
                    with torch.cuda.stream(streams[r]):
                        ts[r].synchronize()
                for r in range(world):
                    for i in range(len(rows)):
                        for p in range(world):
                            if not torch.equal(recvs[r][i][p], sends[p][i][r]):
                                raise AssertionError(f"rank {r} section {i} from {p}: wrong bytes")
                _say(0, f"{stage}: all_to_all of {n} bytes a row: exact")
        except Exception:
            _fail(0, stage, ts)
        for t in ts:
            t.close()
    _say(0, "loopback: all stages passed")


def distributed(timeout_s):
    import torch
    import torch.distributed as dist

    import fp4_comm
    import fp4_kernels

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # LOCAL_RANK's GPU; without a launcher's LOCAL_RANK, the rank's
    dev = fp4_comm.local_device(fp4_comm.devices.local_rank(default=rank))
    torch.cuda.set_device(dev)
    transports = []
    stage = "make the p2p communicator (CUDA IPC handles, kernel compile)"
    try:
        start = time.monotonic()
        comm = fp4_comm.Communicator.from_process_group(None, dev, timeout_s, transport="p2p")
        transports.append(comm.transport)
        _say(rank, f"{stage}: {time.monotonic() - start:.1f} s on {dev}")
        stage = "transport all_to_all and all_gather, odd sizes"
        t = comm.transport
        for call, n in enumerate((1 << 10, 1000003, 7)):
            rows = [n, 13, 1]
            sends = [_payload(torch, world, rank, call, k, dev) for k in rows]
            recvs = [torch.zeros_like(s) for s in sends]
            t.all_to_all(list(zip(sends, recvs, strict=True)))
            gath = [torch.zeros_like(s) for s in sends]
            t.all_gather(list(zip([s[0] for s in sends], gath, strict=True)))
            t.synchronize()
            for p in range(world):
                for i, k in enumerate(rows):
                    theirs = _payload(torch, world, p, call, k, dev)
                    if not torch.equal(recvs[i][p], theirs[rank]):
                        raise AssertionError(f"all_to_all: section {i} from rank {p} wrong")
                    if not torch.equal(gath[i][p], theirs[0]):
                        raise AssertionError(f"all_gather: section {i} from rank {p} wrong")
            _say(rank, f"{stage}: {n} bytes a row: exact")
        stage = "collectives, every codec"
        x = torch.full((world * 13 + 1, 96), float(rank + 1), device=dev)
        exact = float(sum(range(1, world + 1)))
        for codec in ("none-float32", "none", "nvfp4", "mxfp4", fp4_kernels.FP4Quant(64)):
            y = comm.all_reduce(x, codec=codec)
            g = comm.all_gather(x, codec=codec)
            s = comm.reduce_scatter(x, codec=codec)
            comm.synchronize()
            if codec in ("none-float32", "none") and not bool((y == exact).all()):
                raise AssertionError(f"all_reduce {codec}: not {exact}")
            every = [None] * world
            dist.all_gather_object(every, (y.cpu(), g.cpu()))
            if any(not torch.equal(e[0], every[0][0]) or not torch.equal(e[1], every[0][1])
                   for e in every):  # fmt: skip
                raise AssertionError(f"{codec}: ranks hold different bits")
            _say(rank, f"{stage}: {codec}: all_reduce, all_gather, reduce_scatter {tuple(s.shape)}")
        stage = "all-reduce algorithms"
        auto = comm.all_reduce(x, codec="nvfp4")  # a small input: "auto" is one-shot here
        for algorithm in ("one_shot", "two_shot"):
            c = fp4_comm.Communicator(comm.transport, comm.control_group, "first",
                                      all_reduce_algorithm=algorithm)  # fmt: skip
            y = c.all_reduce(x, codec="nvfp4")
            comm.synchronize()
            every = [None] * world
            dist.all_gather_object(every, y.cpu())
            if any(not torch.equal(e, every[0]) for e in every):
                raise AssertionError(f"{algorithm}: ranks hold different bits")
            if algorithm == "one_shot" and not torch.equal(y, auto):
                raise AssertionError("auto at this size is not the one-shot all-reduce")
            _say(rank, f"{stage}: {algorithm}: the same bits on every rank")
        stage = "CUDA graph capture and replay"
        captured = comm.capture("all_reduce", x, codec="nvfp4")
        for _ in range(3):
            y = captured.replay()
        torch.cuda.synchronize(dev)
        ref = comm.all_reduce(x, codec="nvfp4")
        comm.synchronize()
        if not torch.equal(y, ref):
            raise AssertionError("the replay's result differs from the eager call's")
        _say(rank, f"{stage}: 3 replays equal the eager call")
        stage = "close"
        comm.close()
        _say(rank, "all stages passed")
    except Exception:
        _fail(rank, stage, transports)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loopback", action="store_true", help="one process, no torchrun")
    ap.add_argument("--timeout", type=float, default=20.0, help="every kernel wait's deadline")
    ap.add_argument("--stuck", type=float, default=300.0, help="dump stacks after this long")
    args = ap.parse_args()
    faulthandler.dump_traceback_later(args.stuck, exit=True)
    if args.loopback:
        loopback(args.timeout)
    else:
        distributed(args.timeout)


if __name__ == "__main__":
    main()
