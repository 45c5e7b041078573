"""A few gloo worker processes that stay up for a whole test session and run the functions a
test sends them, each with this rank's communicators.

Starting a process costs seconds here (importing torch, compiling fp4_kernels' CPU path with
numba), so the tests share one cluster instead of spawning per test.  Each worker holds one
communicator per group size: ``comms[4]`` over all four ranks, ``comms[3]`` over ranks 0-2 and
``comms[2]`` over ranks 0 and 1 (subgroups; None on the ranks outside them); with
``gpu=True`` also ``comms["cuda"]``, NCCL over all ranks, rank r on GPU r % (GPU count):
more ranks than GPUs share them (NCCL >= 2.30 with ``NCCL_MULTI_RANK_GPU_ENABLE=1``);
``setup(comms, rank, world, timeout_s)``, a module-level function, adds a test module's own
communicators.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import time
import traceback
from dataclasses import dataclass
from multiprocessing import connection

#: At start, how long the other workers may still take once one has failed (NCCL's init waits
#: for a peer that failed before it, forever).
START_GRACE_S = 30.0


def env_ranks() -> int:
    """The world size of the multi-rank GPU tests: ``FP4_COMM_TEST_RANKS`` (default 2)."""
    return int(os.environ.get("FP4_COMM_TEST_RANKS", "2"))


def skip_unless_ranks_fit(ranks: int) -> None:
    """Skip the calling test, with the reason, where ``ranks`` NCCL ranks cannot run here: no
    GPU or no usable NCCL, or more ranks than GPUs without NCCL's multi-rank mode (NCCL >= 2.30
    with ``NCCL_MULTI_RANK_GPU_ENABLE=1``)."""
    import pytest
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from fp4_comm.devices import sharing_problem
    from fp4_comm.nccl import nccl_version

    try:
        version = nccl_version()
    except ImportError as err:
        pytest.skip(str(err))
    problem = sharing_problem(ranks, nccl_version=version)
    if problem is not None:
        pytest.skip(f"{problem} (nox -s gpu_multirank)")


def construction_outcomes(comms, cases):
    """A worker function: on the ranks of ``comms[2]``, ("returned", "") or (error class
    name, message) of ``Communicator.from_process_group(its group, **kwargs)`` for each
    ``kwargs`` of ``cases``; None on the other ranks."""
    import fp4_comm

    comm = comms[2]
    if comm is None:
        return None
    out = []
    for kwargs in cases:
        try:
            fp4_comm.Communicator.from_process_group(comm.transport.group, **kwargs)
            out.append(("returned", ""))
        except (TypeError, ValueError) as err:
            out.append((type(err).__name__, str(err)))
    return out


def rendezvous_store():
    """A TCPStore server on a port the system picks, hosted by the calling process: the workers
    connect to ``store.port`` as clients.  The port is bound from the start, so test processes
    running side by side (pytest-xdist) cannot pick the same one, as they could with a port
    found free and bound later by a worker."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


@dataclass
class Died:
    """What ``Cluster.run`` gives for a worker that died: its exit code (-N: signal N)."""

    exitcode: int | None


def _communicators(rank, world, port, timeout_s, sizes, gpu):
    import torch
    import torch.distributed as dist

    import fp4_comm

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    comms = {}
    for size in sizes:
        if size == world:
            comms[size] = fp4_comm.Communicator.from_process_group(None, "cpu", timeout_s)
            continue
        members = list(range(size))
        group = dist.new_group(members)  # every rank of the world takes part in new_group
        comms[size] = (
            fp4_comm.Communicator.from_process_group(group, "cpu", timeout_s)
            if rank in members
            else None
        )
    if gpu:
        # GPU rank % count (ranks share GPUs where there are fewer), NCCL through CuPy, beside
        # the gloo communicators.
        device = fp4_comm.local_device(rank)
        torch.cuda.set_device(device)
        comms["cuda"] = fp4_comm.Communicator.from_process_group(None, device, timeout_s)
    return comms


def _worker(rank, world, port, conn, timeout_s, sizes, gpu, setup=None):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # 2 cores for several processes: no oversubscription
    try:  # a failure here (NCCL refusing the ranks, a test module's setup) fails the cluster
        comms = _communicators(rank, world, port, timeout_s, sizes, gpu)
        if setup is not None:  # a test module's own communicators, made in every worker
            setup(comms, rank, world, timeout_s)
    except BaseException:  # noqa: BLE001 - the cluster fails with the traceback
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        fn, args = msg
        try:
            conn.send(("ok", fn(comms, *args)))
        except BaseException:  # noqa: BLE001 - handed to the test, which fails with it
            conn.send(("error", traceback.format_exc()))
    dist.destroy_process_group()


class Cluster:
    def __init__(
        self, world, timeout_s=30.0, sizes=None, start_timeout_s=300.0, gpu=False, setup=None
    ):
        ctx = mp.get_context("spawn")
        self._store = rendezvous_store()  # lives as long as the cluster
        port = self._store.port
        self.world = world
        self.conns, self.procs = [], []
        sizes = tuple(sizes or (world,))
        for rank in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_worker,
                args=(rank, world, port, child, timeout_s, sizes, gpu, setup),
                daemon=True,
            )
            p.start()
            child.close()  # the worker's end only: a worker that dies is seen at once (EOF)
            self.conns.append(parent)
            self.procs.append(p)
        self._collect(start_timeout_s, grace_s=START_GRACE_S)

    def _collect(self, timeout_s, allow_death=False, grace_s=None):
        """Every worker's answer, by rank.  TimeoutError naming the silent ranks (with the
        errors of the others) where one gives none within ``timeout_s``, or within
        ``grace_s`` of another's error where that is given (at start: a rank whose peer
        failed may wait for it forever, in NCCL's init)."""
        deadline = time.monotonic() + timeout_s
        results, errors = [None] * len(self.conns), []
        pending = dict(enumerate(self.conns))
        while pending:
            ready = connection.wait(list(pending.values()), max(0.0, deadline - time.monotonic()))
            if not ready:
                self.close(force=True)
                raise TimeoutError(
                    f"worker(s) {sorted(pending)} gave no answer within {timeout_s} s"
                    + "".join(f"\n{e}" for e in errors)
                )
            for rank in [r for r, c in pending.items() if c in ready]:
                conn = pending.pop(rank)
                try:
                    status, value = conn.recv()
                except (EOFError, ConnectionResetError):
                    # The worker died (killed on purpose, or an abort inside a library).
                    self.procs[rank].join(timeout=10)
                    status, value = "died", Died(self.procs[rank].exitcode)
                    if not allow_death:
                        errors.append(f"--- rank {rank}: the process died ({value})")
                if status == "error":
                    errors.append(f"--- rank {rank}:\n{value}")
                if errors and grace_s is not None:
                    deadline = min(deadline, time.monotonic() + grace_s)
                results[rank] = value
        if errors:
            raise AssertionError("worker failed:\n" + "\n".join(errors))
        return results

    def run(self, fn, *args, timeout_s=240.0, allow_death=False):
        """fn(comms, *args) on every rank; the list of their results, by rank.  A worker that
        dies fails the call, unless ``allow_death``: then its result is a ``Died``."""
        for conn in self.conns:
            try:
                conn.send((fn, args))
            except (BrokenPipeError, OSError):
                pass  # a dead worker: _collect reports it
        return self._collect(timeout_s, allow_death)

    def close(self, force=False):
        for conn in self.conns:
            if not force:
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        for p in self.procs:
            p.join(timeout=0 if force else 10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():  # stuck where SIGTERM does not reach: no process outlives the test
                p.kill()
                p.join(timeout=5)
