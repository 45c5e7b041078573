"""Host cost of one eager fp4_comm collective, measured anywhere (no GPU, no peers).

    python benchmarks/comm_host_overhead.py [--world 2 4] [--ops all_reduce reduce_scatter
        all_gather send recv] [--codecs nvfp4 mxfp4 fp4quant64 none] [--elements 8192]
        [--kernels] [--profile] [--ops-detail] [--graphs never auto] [--transport nccl p2p]
        [--algorithm auto one_shot two_shot] [--out DIR]

Rank 0 of ``--world`` ranks on a pretend GPU (``packages/fp4_comm/tests/_fake_gpu.py``): every
torch tensor says it lives on ``cuda:0``, so the communicator's checks, the collective's plan,
fp4_kernels' checks and launch plans, the allocations (on the CPU) and the argument packing run
as on a GPU machine; kernel launches are recorded, not run; the transport is the real
``NcclTransport`` over a stand-in for ``cupy.cuda.nccl`` that records each call and moves
nothing (nothing waits for a peer), or with ``--transport p2p`` the real ``P2PTransport`` over
host memory whose ``cuLaunchKernel`` is a stand-in that records each launch ("nccl" column:
the NCCL calls, or the p2p kernel's launches).  ``--algorithm``: the communicator's
``all_reduce_algorithm`` per row.  Arguments are checked across ranks as ``validate="first"``
says: once, in the warm-up.  ``--graphs``: the communicator's ``graphs`` per row ("never":
every call eager; "auto", the default on a GPU: the warm calls replay a CUDA graph, whose launch
the stand-in graph counts as one call and does not run).

Per op and codec, one warm call: the function calls it makes, Python and C alike, as cProfile
counts them ("python"; "(fk)": those made inside fp4_kernels' quantize / dequantize /
requantized_sum), the torch ops that queue device work ("torch": kernels and copies), torch
allocations and views, fp4_kernels' kernel launches ("fp4"), the NCCL calls, and the time per
call: this thread's CPU time (min of 5 runs of 200 calls: what the host spends, robust on a busy
machine) and the wall time (min, median).  ``--kernels`` adds the fp4_kernels calls the
collectives make, each alone.  Times are of this CPU and leave out the driver's launch and the
CUDA allocator (a few microseconds each on a GPU machine), and the torch ops compute on the CPU
(tiny tensors: ``--elements`` per rank).  The real figure is ``comm_throughput.py``'s host
column, on a GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import os
import pstats
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPS, CALLS = 5, 200
OPS = ("all_reduce", "reduce_scatter", "all_gather", "send", "recv")
CODECS = ("nvfp4", "mxfp4", "fp4quant64", "none")
# what the counts leave out: the fakes themselves and this file
_FAKE_FILES = ("_fake_cuda.py", "comm_host_overhead.py")
# stand-ins counted as the one call each replaces (a CuPy NCCL call, an event record)
_STAND_INS = ("_fake_gpu.py",)


def _codec(name):
    import fp4_kernels

    return fp4_kernels.FP4Quant(64) if name == "fp4quant64" else name


def _fakes():
    sys.path.insert(0, os.path.join(HERE, "..", "packages", "fp4_comm", "tests"))
    import _fake_gpu

    return _fake_gpu


def make_call(comm, op, codec, elements):
    """fn() making one eager call of ``op`` on rank 0 (send: to rank 1; recv: from rank 1)."""
    import torch

    w = comm.world_size
    rows = max(w, elements // 256 // w * w)
    x = torch.randn(rows, 256).to(torch.bfloat16)
    if op == "send":
        return lambda: comm.send(x, 1, codec=codec)
    if op == "recv":
        comm.send(x, 1, codec=codec)  # what the receiver's argument check compares with
        return lambda: comm.recv(x.shape, x.dtype, 1, codec=codec)
    f = getattr(comm, op)
    return lambda: f(x, codec=codec)


def count_torch_ops(fn):
    """(kernels, allocations, views) of the torch ops one call of ``fn`` runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts = {"kernels": 0, "allocations": 0, "views": 0}
    names = {}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kind = _op_kind(func)
            counts[kind] += 1
            names[str(func)] = names.get(str(func), 0) + 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return counts, names


def _op_kind(func):
    name = func.__name__
    if name.startswith(("empty", "new_empty")):
        return "allocations"
    ret = func._schema.returns
    if ret and ret[0].alias_info is not None and not ret[0].alias_info.is_write:
        return "views"
    return "kernels"


def python_calls(fn, n=5):
    """Function calls of one call of ``fn`` (average of n), Python and C alike, as cProfile
    counts them: (all, those made inside fp4_kernels).  Calls of the fakes are left out (what
    they call stands for what the GPU path calls), and each stand-in for a CuPy or CUDA call
    counts as the one call it replaces."""
    in_kernels = f"{os.sep}fp4_kernels{os.sep}src{os.sep}"
    counts = [0, 0]
    stack = [(False, False)]  # per frame: (inside fp4_kernels, muted)

    def profile(frame, event, arg):
        inside, muted = stack[-1]
        if event == "call":
            file = frame.f_code.co_filename
            stand_in = file.endswith(_STAND_INS)
            if not muted and not file.endswith(_FAKE_FILES):
                inside = inside or in_kernels in file
                counts[0] += 1
                counts[1] += inside
            stack.append((inside, muted or stand_in))
        elif event == "return":
            if len(stack) > 1:
                stack.pop()
        elif event == "c_call" and not muted:
            counts[0] += 1
            counts[1] += inside

    sys.setprofile(profile)
    try:
        for _ in range(n):
            fn()
    finally:
        sys.setprofile(None)
    return counts[0] / n, counts[1] / n


def profile_of(fn, n=20):
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    return prof


def host_us(fn):
    """(min wall, median wall, min CPU) microseconds per call over REPS runs of CALLS calls.
    The CPU time (this thread's) leaves out the time the thread waited for a core, which on
    a busy machine inflates even the minimum wall time."""
    walls, cpus = [], []
    for _ in range(REPS):
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(CALLS):
            fn()
        cpus.append((time.thread_time() - c0) / CALLS * 1e6)
        walls.append((time.perf_counter() - t0) / CALLS * 1e6)
    return min(walls), statistics.median(walls), min(cpus)


def measure(world, op, codec, elements, profile=False, graphs="never", transport="nccl",
            algorithm="auto"):  # fmt: skip
    """One row: the counts and times of a warm call of ``op`` with ``codec`` on ``world``."""
    import contextlib

    fakes = _fakes()
    with contextlib.ExitStack() as stack:
        stack.enter_context(fakes.fake_graphs(rerun=False))
        comm, null, _, recorder = stack.enter_context(
            fakes.fake_gpu_communicator(
                world, graphs=graphs, transport=transport, all_reduce_algorithm=algorithm
            )  # fmt: skip
        )
        fn = make_call(comm, op, _codec(codec), elements)
        for _ in range(20):
            fn()
        recorder.keep = True
        before, nccl_before = len(recorder.launches), len(null.calls)
        fn()
        launches, nccl = len(recorder.launches) - before, len(null.calls) - nccl_before
        recorder.keep = False
        torch_ops, names = count_torch_ops(fn)
        calls, kernel_calls = python_calls(fn)
        prof = profile_of(fn) if profile else None
        t_min, t_med, cpu = host_us(fn)
    row = {
        "world": world, "op": op, "codec": codec, "graphs": graphs, "transport": transport,
        "algorithm": algorithm, "python_calls": calls,
        "fp4_kernels_calls": kernel_calls, "cpu_us": cpu,
        "torch_kernels": torch_ops["kernels"], "torch_allocations": torch_ops["allocations"],
        "torch_views": torch_ops["views"], "fp4_launches": launches, "nccl_calls": nccl,
        "host_us_min": t_min, "host_us_median": t_med, "torch_op_names": names,
    }  # fmt: skip
    return row, prof


def kernel_calls(world, elements):
    """{name: fn()} of the fp4_kernels calls the collectives make, each alone, on tensors laid
    out as in an all-reduce of ``elements`` bf16 elements per rank over ``world`` ranks: the
    encode of the W chunks, the encode of the float32 sum, the decode of the W received chunks
    (to float32 for the sum, to bfloat16 for the result) and MXFP4's requantized sum."""
    import torch

    import fp4_kernels as fk
    from fp4_comm.codecs import get_codec, padded_chunk

    cases = {}
    for name in CODECS[:3]:
        codec = get_codec(_codec(name))
        c = padded_chunk(elements, world, codec.granularity)
        x = torch.randn(world, c).to(torch.bfloat16)
        s = torch.randn(1, c)
        fmt = codec.fmt
        cases[f"quantize {name} ({world}, {c}) bf16"] = lambda x=x, fmt=fmt: fk.quantize(
            x, fmt=fmt, rounding="nearest", seed=7, step=3
        )
        cases[f"quantize {name} (1, {c}) f32"] = lambda s=s, fmt=fmt: fk.quantize(
            s, fmt=fmt, rounding="nearest", seed=7, step=3
        )
        sections = codec.encode(x)
        flat = torch.empty(sum(t.numel() for t in sections) + 64, dtype=torch.uint8)
        views, at = [], 0
        for t in sections:  # receive sections at aligned offsets of one buffer, as collectives
            views.append(flat[at : at + t.numel()].view(t.shape).copy_(t))
            at += -(-t.numel() // 16) * 16
        for dtype in (torch.float32, torch.bfloat16):
            decode = codec.decoder(views, c, dtype)
            cases[f"dequantize {name} ({world}, {c}) -> {str(dtype)[6:]}"] = decode
        if name == "mxfp4":
            cases[f"requantized_sum mxfp4 ({world}, {c})"] = codec.requantizer(views, c)
    return cases


def measure_kernel_calls(world, elements, emit):
    with _fakes().fake_gpu_communicator(world) as (_, _, _, recorder):
        cases = kernel_calls(world, elements)
        emit(f"{'fp4_kernels call (as the collectives make it)':48s} {'python':>6s} "
             f"{'launch':>6s} {'alloc':>5s} {'cpu us':>7s}")  # fmt: skip
        for name, fn in cases.items():
            for _ in range(20):
                fn()
            recorder.keep = True
            before = len(recorder.launches)
            fn()
            launches = len(recorder.launches) - before
            recorder.keep = False
            torch_ops, _ = count_torch_ops(fn)
            calls, _ = python_calls(fn)
            cpu = host_us(fn)[2]
            emit(f"{name:48s} {calls:6.0f} {launches:6d} {torch_ops['allocations']:5d} "
                 f"{cpu:7.1f}")  # fmt: skip


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    ap.add_argument("--codecs", nargs="+", default=list(CODECS), choices=CODECS)
    ap.add_argument("--elements", type=int, default=8192, help="elements per rank (bf16)")
    ap.add_argument("--profile", action="store_true", help="print each call's cProfile")
    ap.add_argument("--ops-detail", action="store_true", help="print each call's torch ops")
    ap.add_argument("--kernels", action="store_true",
                    help="also the fp4_kernels calls the collectives make, each alone")  # fmt: skip
    ap.add_argument("--graphs", nargs="+", default=["never", "auto"], choices=["never", "auto"],
                    help="the communicator's graphs option, a row each")  # fmt: skip
    ap.add_argument("--transport", nargs="+", default=["nccl"], choices=["nccl", "p2p"],
                    help="the transport, a row each")  # fmt: skip
    ap.add_argument("--algorithm", nargs="+", default=["auto"],
                    choices=["auto", "one_shot", "two_shot"],
                    help="the communicator's all_reduce_algorithm, a row each")  # fmt: skip
    ap.add_argument("--out", default=None, help="also write comm_host_overhead.txt")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    lines = []

    def emit(line):
        print(line, flush=True)
        lines.append(line)

    emit(f"{'W':>2s} {'op':15s} {'codec':11s} {'graphs':6s} {'via':4s} {'all_reduce':10s} "
         f"{'python':>6s} {'(fk)':>5s} "
         f"{'torch':>5s} {'alloc':>5s} {'views':>5s} {'fp4':>3s} {'nccl':>4s} {'cpu us':>7s} "
         f"{'us min':>7s} "
         f"{'us med':>7s}")  # fmt: skip
    for world in args.world:
        for op in args.ops:
            rows = itertools.product(args.codecs, args.graphs, args.transport, args.algorithm)
            for codec, graphs, via, algorithm in rows:
                row, prof = measure(world, op, codec, args.elements, args.profile, graphs, via,
                                    algorithm)  # fmt: skip
                emit(
                    f"{world:2d} {op:15s} {codec:11s} {graphs:6s} {via:4s} {algorithm:10s} "
                    f"{row['python_calls']:6.0f} "
                    f"{row['fp4_kernels_calls']:5.0f} {row['torch_kernels']:5d} "
                    f"{row['torch_allocations']:5d} {row['torch_views']:5d} "
                    f"{row['fp4_launches']:3d} {row['nccl_calls']:4d} {row['cpu_us']:7.1f} "
                    f"{row['host_us_min']:7.1f} {row['host_us_median']:7.1f}"
                )
                if args.ops_detail:
                    print("    ", row["torch_op_names"])
                if args.profile:
                    pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    if args.kernels:
        for world in args.world:
            measure_kernel_calls(world, args.elements, emit)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "comm_host_overhead.txt"), "w") as fh:
            fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
