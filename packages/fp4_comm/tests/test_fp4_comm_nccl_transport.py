"""NcclTransport's bookkeeping without a GPU: a stand-in for ``cupy.cuda.nccl`` that executes
each group of send / recv / allGather calls on host memory, with the ranks as threads of this
process, and checks what NCCL would need (a recv for every send, equal counts, matching
collectives).  The real collective algorithms run over it and must give what the one-process
reference gives; the real NCCL runs in test_fp4_comm_nccl.py on GPUs.  The construction (the
unique id made on rank 0, broadcast over gloo, handed to ``NcclCommunicator``) runs in the gloo
cluster against a stand-in that, like cupy-cuda13x, accepts only the id's own type."""

import contextlib
import ctypes
import os
import sys
import threading
import time
import types
import weakref

import numpy as np
import pytest
import torch
from test_fp4_comm_collectives import _inputs, reference_all_reduce

from fp4_comm import collectives, nccl as nccl_module
from fp4_comm.codecs import get_codec
from fp4_comm.nccl import NcclTransport

UINT8 = 1  # cupy.cuda.nccl.NCCL_UINT8


class FakeNcclWorld:
    """The ranks' posted groups; executed when every rank has ended its group."""

    def __init__(self, world):
        self.world = world
        self.barrier = threading.Barrier(world, timeout=60)
        self.groups = [None] * world
        self.errors = []

    def end_group(self, rank, ops):
        self.groups[rank] = ops
        self.barrier.wait()
        try:
            self._run(rank)
        except AssertionError as err:
            self.errors.append(f"rank {rank}: {err}")
        self.barrier.wait()
        if self.errors:
            raise RuntimeError("; ".join(self.errors))

    def _run(self, rank):
        mine = self.groups[rank]
        recv_count = {}
        for op in mine:
            if op[0] == "recv":
                _, ptr, count, peer = op
                k = recv_count.get(peer, 0)
                recv_count[peer] = k + 1
                sends = [o for o in self.groups[peer] if o[0] == "send" and o[3] == rank]
                assert k < len(sends), f"recv #{k} from {peer} has no matching send"
                _, sptr, scount, _ = sends[k]
                assert scount == count, f"send of {scount} bytes, recv of {count}"
                ctypes.memmove(ptr, sptr, count)
        for peer in range(self.world):
            sends = [o for o in self.groups[peer] if o[0] == "send" and o[3] == rank]
            n_recv = sum(1 for o in mine if o[0] == "recv" and o[3] == peer)
            assert len(sends) == n_recv, f"{len(sends)} sends from {peer}, {n_recv} recvs"
        gathers = [o for o in mine if o[0] == "allgather"]
        for i, (_, _, rptr, count) in enumerate(gathers):
            for peer in range(self.world):
                theirs = [o for o in self.groups[peer] if o[0] == "allgather"]
                assert len(theirs) == len(gathers), "allGather calls differ across ranks"
                sptr, pcount = theirs[i][1], theirs[i][3]
                assert pcount == count, f"allGather of {pcount} vs {count} bytes"
                ctypes.memmove(rptr + peer * count, sptr, count)


class FakeNccl:
    """The module-level functions and the communicator of one rank."""

    NCCL_UINT8 = UINT8

    def __init__(self, world, rank):
        self.world, self.rank = world, rank
        self.ops = None

    def groupStart(self):  # noqa: N802 - cupy's names
        assert self.ops is None, "nested group"
        self.ops = []

    def groupEnd(self):  # noqa: N802
        ops, self.ops = self.ops, None
        self.world.end_group(self.rank, ops)

    def send(self, ptr, count, dtype, peer, stream):
        assert dtype == UINT8 and self.ops is not None and peer != self.rank
        self.ops.append(("send", ptr, count, peer))

    def recv(self, ptr, count, dtype, peer, stream):
        assert dtype == UINT8 and self.ops is not None and peer != self.rank
        self.ops.append(("recv", ptr, count, peer))

    def allGather(self, sptr, rptr, count, dtype, stream):  # noqa: N802
        assert dtype == UINT8 and self.ops is not None
        self.ops.append(("allgather", sptr, rptr, count))


def _transports(world):
    shared = FakeNcclWorld(world)
    out = []
    for rank in range(world):
        fake = FakeNccl(shared, rank)
        t = NcclTransport.__new__(NcclTransport)  # no cupy, no GPU, no process group
        t._nccl, t.comm, t._uint8 = fake, fake, UINT8
        t.rank, t.world_size, t.device, t.timeout_s = rank, world, torch.device("cpu"), 60.0
        t._stream = lambda: 0
        t._watchdog, t._failed = False, None  # CUDA events: tested on GPUs
        t._graphs, t.replay_lock, t._aborter = weakref.WeakSet(), threading.Lock(), None
        out.append(t)
    return out


def _on_threads(world, fn):
    results, errors = [None] * world, []

    def run(rank):
        try:
            results[rank] = fn(rank)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    if hung:  # (its result would read as None)
        raise TimeoutError(f"rank(s) {hung} of {world} still running after 120 s")
    return results


@pytest.mark.parametrize(("world", "codec_name"), [(2, "nvfp4"), (3, "mxfp4"), (4, "none")])
def test_all_reduce_over_the_nccl_transport(world, codec_name):
    xs = _inputs(world, (5, 20), seed=world)
    transports = _transports(world)
    opts = lambda: collectives.Options(get_codec(codec_name), "stochastic", 6, 1)  # noqa: E731
    ys = _on_threads(world, lambda r: collectives.all_reduce(transports[r], xs[r], opts()))
    ref, _ = reference_all_reduce(xs, codec_name, "stochastic", 6, 1)
    for y in ys:
        assert torch.equal(y.view(torch.int32), ref.view(torch.int32))


def test_reduce_scatter_and_all_gather_over_the_nccl_transport():
    world = 3
    xs = _inputs(world, (6, 16), seed=8)
    transports = _transports(world)
    opts = lambda: collectives.Options(get_codec("none-float32"))  # noqa: E731
    rs = _on_threads(world, lambda r: collectives.reduce_scatter(transports[r], xs[r], opts()))
    for r, y in enumerate(rs):  # float32 through float32: the exact rank-order sum
        assert torch.equal(y, (xs[0] + xs[1] + xs[2])[2 * r : 2 * r + 2])
    ag = _on_threads(world, lambda r: collectives.all_gather(transports[r], xs[r], opts()))
    for y in ag:
        assert torch.equal(y, torch.cat(xs))


def test_send_recv_over_the_nccl_transport():
    x = _inputs(1, (3, 7), seed=9)[0]
    transports = _transports(2)
    codec = get_codec("mxfp4")

    def run(rank):
        opts = collectives.Options(codec)
        if rank == 0:
            return collectives.send(transports[0], x, 1, opts)
        return collectives.recv(transports[1], x.shape, x.dtype, 0, opts)

    got = _on_threads(2, run)[1]
    sent = codec.decode(codec.encode(torch.nn.functional.pad(x.reshape(1, -1), (0, 11)),
                                     seed=collectives.rank_seed(0, 0, "send")), 32)  # fmt: skip
    assert np.array_equal(got.numpy(), sent[0, :21].reshape(3, 7).numpy())


def test_mismatched_counts_are_caught_by_the_stand_in():
    # The stand-in must be able to fail, or the tests above prove nothing about pairing.
    transports = _transports(2)
    a, b = torch.zeros(8, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)

    def run(rank):
        if rank == 0:
            transports[0].send([a], 1)
        else:
            transports[1].recv([b], 0)

    with pytest.raises(RuntimeError, match="send of 8 bytes, recv of 16"):
        _on_threads(2, run)


def _make_transport(comms, id_kind, refuse=None, gpus=1):
    """NcclTransport.__init__ on a gloo rank, with cupy, its nccl module, torch.cuda.device and
    torch.cuda.device_count (``gpus``) replaced for the duration: what reaches
    NcclCommunicator, or (error class name, message) where it raises; ``refuse``: the
    stand-in NcclCommunicator raises it (NCCL 2.28.9's answer to ranks sharing a GPU)."""
    comm = comms[2]
    if comm is None:
        return None
    # cupy-cuda13x's get_unique_id gives bytes (128), older CuPy a tuple of 128 ints; each
    # NcclCommunicator takes only its own kind back
    made = bytes(range(128)) if id_kind == "bytes" else tuple(range(-64, 64))

    class StandInNccl:
        NCCL_UINT8 = UINT8
        available = True

        @staticmethod
        def get_unique_id():
            assert comm.rank == 0, "only group rank 0 makes the id"
            return made

        @staticmethod
        def get_version():
            return 22809

        class NcclCommunicator:
            def __init__(self, ndev, comm_id, rank):
                if type(comm_id) is not type(made):
                    raise TypeError(f"unique id of type {type(comm_id).__name__}")
                if refuse is not None:
                    raise refuse
                self.args = (ndev, comm_id, rank)

    cupy = types.SimpleNamespace(
        cuda=types.SimpleNamespace(Device=lambda i: contextlib.nullcontext())
    )
    saved = nccl_module._nccl, sys.modules.get("cupy"), torch.cuda.device, torch.cuda.device_count
    env = {k: os.environ.pop(k, None) for k in ("NCCL_MULTI_RANK_GPU_ENABLE", "LOCAL_WORLD_SIZE")}
    nccl_module._nccl = lambda: StandInNccl
    sys.modules["cupy"] = cupy
    torch.cuda.device = lambda device: contextlib.nullcontext()
    torch.cuda.device_count = lambda: gpus
    try:
        t = NcclTransport(comm.control_group, torch.device("cuda", comm.rank), watchdog=False)
    except Exception as err:  # noqa: BLE001 - the test reads it
        return type(err).__name__, str(err), type(err.__cause__).__name__
    finally:
        nccl_module._nccl, torch.cuda.device, torch.cuda.device_count = saved[0], *saved[2:]
        os.environ.update({k: v for k, v in env.items() if v is not None})
        if saved[1] is None:
            del sys.modules["cupy"]
        else:
            sys.modules["cupy"] = saved[1]
    return t.comm.args, made


@pytest.mark.parametrize("id_kind", ["bytes", "tuple"])
def test_unique_id_reaches_the_communicator_as_made(cluster, id_kind):
    out = cluster.run(_make_transport, id_kind)[:2]
    for rank, ((ndev, comm_id, got_rank), made) in enumerate(out):
        assert (ndev, got_rank) == (2, rank)
        assert type(comm_id) is type(made) and comm_id == made


def test_ranks_sharing_a_gpu_with_an_old_nccl_get_the_fix_named(cluster):
    """NCCL before 2.30 refuses ranks that share a GPU with "invalid usage" only: the error
    names the version and the switch; where every rank has its own GPU, NCCL's error passes
    unchanged."""
    refused = RuntimeError("NCCL_ERROR_INVALID_USAGE: invalid usage")
    for rank, (kind, message, cause) in enumerate(
        cluster.run(_make_transport, "bytes", refused, 1)[:2]
    ):
        assert (kind, cause) == ("RuntimeError", "RuntimeError")
        assert message.startswith(f"NCCL could not make rank {rank}'s communicator on cuda:{rank}")
        assert "invalid usage" in message
        assert message.endswith(
            "2 ranks on 1 GPU share a GPU: that needs NCCL >= 2.30 (this is 22809) with "
            "NCCL_MULTI_RANK_GPU_ENABLE=1"
        ), message
    for kind, message, cause in cluster.run(_make_transport, "bytes", refused, 2)[:2]:
        assert (kind, message, cause) == ("RuntimeError", str(refused), "NoneType")


class _NeverConnects:
    """A stand-in NCCL whose groupEnd waits, as ncclGroupEnd does for a peer that never
    connects, until the communicator is aborted (then it fails, as NCCL's aborted calls do)."""

    def __init__(self):
        self.aborted = threading.Event()

    def groupStart(self):  # noqa: N802
        pass

    def groupEnd(self):  # noqa: N802
        if not self.aborted.wait(60):
            raise AssertionError("not aborted within 60 s: the watchdog did not see the wait")
        raise RuntimeError("NCCL error: remote process exited or there was a network error")

    def send(self, *args):
        pass

    def abort(self):
        self.aborted.set()


def test_watchdog_ends_a_group_that_never_starts(monkeypatch):
    # The host side of a collective, bounded: ncclGroupEnd blocked on a peer that never
    # connects ends in CommTimeoutError after timeout_s, and the communicator stays failed.
    monkeypatch.setattr(nccl_module, "_relax_capture_mode", lambda: None)
    fake = _NeverConnects()
    t = NcclTransport.__new__(NcclTransport)
    t._nccl, t.comm, t._uint8 = fake, fake, UINT8
    t.rank, t.world_size, t.device, t.timeout_s = 0, 2, torch.device("cpu"), 0.2
    t._stream = lambda: 0
    t._watchdog, t._failed, t._closing, t._thread, t._host_since = True, None, False, None, None
    t._pending = []
    t._graphs, t.replay_lock, t._aborter = weakref.WeakSet(), threading.Lock(), None
    start = time.monotonic()
    with pytest.raises(nccl_module.CommTimeoutError, match="did not start within 0.2 s"):
        t.send([torch.zeros(8, dtype=torch.uint8)], 1)
    assert fake.aborted.is_set() and time.monotonic() - start < 30
    with pytest.raises(nccl_module.CommTimeoutError, match="never connected"):
        t.send([torch.zeros(8, dtype=torch.uint8)], 1)
