"""A communicator on a pretend GPU, for the host path of the collectives without a GPU.

``fake_gpu_communicator(world)`` is rank 0 of ``world`` ranks: every torch tensor pretends to
live on ``cuda:0`` (fp4_kernels' ``tests/_fake_cuda.py``: checks, launch plans, allocation on
the CPU and argument packing run as on a GPU, kernel launches are recorded or dropped), the
transport is the real ``NcclTransport`` over ``NullNccl``, a stand-in for ``cupy.cuda.nccl``
that records each call and moves no byte (or, ``transport="p2p"``, the real ``P2PTransport``
over host memory, whose ``cuLaunchKernel`` is ``NullLauncher``: launches recorded, none run),
and the argument checks' exchanges over the control group answer as if every rank agreed.
Nothing waits for a peer, so it measures and checks the host work of one rank's calls: what
they queue, what they allocate, what they check.

Used by ``test_fp4_comm_plans.py`` and ``benchmarks/comm_host_overhead.py``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from threading import Lock
from unittest import mock
from weakref import WeakSet

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "fp4_kernels", "tests"))  # fmt: skip
from _fake_cuda import Recorder, fake_cuda  # noqa: E402

from fp4_comm import Communicator, codecs, graphs  # noqa: E402
from fp4_comm._transport import CommTimeoutError  # noqa: E402
from fp4_comm.nccl import NcclTransport  # noqa: E402
from fp4_comm.p2p import BufferLayout, P2PTransport  # noqa: E402

#: the fake's raw handle of torch's current stream on cuda:0 (``_fake_cuda.Recorder.stream``)
FAKE_STREAM = Recorder().stream(0)


class NullNccl:
    """``cupy.cuda.nccl`` and one communicator of it: each call recorded as (name, args...) in
    ``calls`` (pointers, byte counts, peers), none moves a byte."""

    NCCL_UINT8 = 1

    def __init__(self):
        self.calls = []

    def groupStart(self):  # noqa: N802 - cupy's names
        self.calls.append(("groupStart",))

    def groupEnd(self):  # noqa: N802
        self.calls.append(("groupEnd",))

    def send(self, ptr, count, dtype, peer, stream):
        self.calls.append(("send", ptr, count, peer, stream))

    def recv(self, ptr, count, dtype, peer, stream):
        self.calls.append(("recv", ptr, count, peer, stream))

    def allGather(self, send_ptr, recv_ptr, count, dtype, stream):  # noqa: N802
        self.calls.append(("allGather", send_ptr, recv_ptr, count, stream))


class NullLauncher:
    """The p2p transport's kernel and ``cuLaunchKernel``: each launch recorded in ``calls`` as
    (grid, the kernel's parameters), none run."""

    handle = 0

    def __init__(self):
        self.calls = []

    def launch(self, handle, grid, gy, gz, threads, by, bz, shared_bytes, stream, ptrs, extra):
        import ctypes

        self.calls.append((grid, [ctypes.c_int64.from_address(p).value for p in ptrs]))
        return 0


class _P2PMemory:
    """A p2p rank's buffer and host page, in host memory (no kernel ever reads them here)."""

    def __init__(self, nbytes):
        import numpy as np

        self._array = np.zeros(nbytes, np.uint8)
        self._page = np.zeros(512, np.int64)
        self.base = self._array.ctypes.data
        self.host_ctl = self.host_ctl_device = self._page.ctypes.data

    def write(self, offset, data):
        self._array[offset : offset + len(data)] = bytearray(data)

    def free(self):
        pass


class _P2PStream:
    """The p2p transport's stream on cuda:0, as ``p2p._CudaStream`` asks torch for it."""

    def __init__(self):
        self.current = functools.partial(torch._C._cuda_getCurrentRawStream, 0)


def _null_p2p(world, rank):
    """(P2PTransport on a pretend cuda:0, its NullLauncher)."""
    launcher = NullLauncher()
    layout = BufferLayout.for_buffer(world, 8, 1 << 20)
    memory = _P2PMemory(layout.total_bytes)
    transport = P2PTransport.__new__(P2PTransport)
    transport._assemble(rank, world, torch.device("cuda", 0), layout, memory,
                        [memory.base] * world, 60.0, launcher, _P2PStream(),
                        watchdog=False)  # fmt: skip
    transport._control = None
    return transport, launcher


class ControlGroup:
    """The gloo control group's exchanges, answered as if every rank agreed; ``exchanges``
    counts them (one per argument check)."""

    def __init__(self, world):
        self.world = world
        self.exchanges = 0
        self._sent = None

    def all_gather(self, out, mine, group=None):
        self.exchanges += 1
        out.view(self.world, -1).copy_(mine)

    def send(self, t, dst, group=None):
        self.exchanges += 1
        self._sent = t.clone()

    def recv(self, t, src, group=None):
        # a receiver checked before any send of the same kind has nothing to compare with
        # here; the fake hands it back its own signature only once one was sent
        if self._sent is None:
            raise RuntimeError("fake control group: recv before any send")
        t.copy_(self._sent)


class _FakeEvent:
    """``torch.cuda.Event``: recorded, and done when queried (nothing runs on a pretend GPU)."""

    def record(self, stream=None):
        pass

    def query(self):
        return True


class _FakeStream:
    """``torch.cuda.current_stream(device)``; ``waits`` counts its ``wait_stream`` calls."""

    waits = 0

    def __init__(self, device=None):
        self.cuda_stream = torch._C._cuda_getCurrentRawStream(0)

    def wait_stream(self, other):
        _FakeStream.waits += 1


class _NoQueue(list):
    """The watchdog's queues, which no thread drains here (events are dropped)."""

    def append(self, item):
        pass

    def popleft(self):
        raise IndexError


class FakeGraph:
    """A "CUDA graph" of ``run``: a replay runs it again (eagerly, on the host) into the static
    output, or (``rerun`` False: what a replay costs the host) does nothing.  ``replays``
    counts them."""

    def __init__(self, run, static, output, rerun=True):
        self.run, self.static, self.output, self.rerun = run, static, output, rerun
        self.replays = 0

    def reset(self):
        self.run = None  # destroyed: a replay would fail

    def replay(self):
        self.replays += 1
        if not self.rerun:
            return
        out = self.run() if self.static is None else self.run(self.static)
        if self.output is not None:
            self.output.copy_(out)


class FakeCapture:
    """Stands in for ``fp4_comm.graphs.capture``: ``graphs`` lists what it captured.  The
    template of the static output comes from one run of ``run`` at capture (a real capture
    runs nothing; the collective then runs once more on every rank that captures)."""

    def __init__(self, rerun=True):
        self.graphs, self.rerun = [], rerun

    def __call__(self, run, device, shape, dtype):
        static = None if shape is None else torch.zeros(shape, dtype=dtype)
        out = run() if static is None else run(static)
        out = None if out is None else out.clone()
        graph = FakeGraph(run, static, out, self.rerun)
        self.graphs.append(graph)
        return graph, static, out


@contextlib.contextmanager
def fake_graphs(rerun=True):
    """``fp4_comm.graphs.capture`` replaced by a ``FakeCapture`` (yielded)."""
    fake = FakeCapture(rerun)
    with mock.patch.object(graphs, "capture", fake):
        yield fake


@contextlib.contextmanager
def fake_gpu_communicator(world, rank=0, validate="first", recorder=None, graphs="never",
                          transport="nccl", **options):  # fmt: skip
    """(Communicator, NullNccl, ControlGroup, Recorder) of rank ``rank`` of ``world`` ranks on a
    pretend ``cuda:0``; ``recorder``: fp4_kernels' launch recorder (default: launches dropped);
    ``graphs``: the communicator's (captures need ``fake_graphs`` here).  ``transport="p2p"``:
    over ``P2PTransport``, with its ``NullLauncher`` in the place of ``NullNccl``.
    ``options``: the Communicator's other arguments (``all_reduce_algorithm``)."""
    mover = transport
    null = NullNccl()
    transport = NcclTransport.__new__(NcclTransport)  # no CuPy, no process group
    transport._nccl = transport.comm = null
    transport._uint8 = null.NCCL_UINT8
    transport.rank, transport.world_size, transport.timeout_s = rank, world, 60.0
    transport.device = torch.device("cuda", 0)
    # The watchdog records its event per transfer; its thread, which would query them, is not
    # started (a placeholder stands in for it).
    transport._watchdog, transport._failed, transport._thread = True, None, object()
    transport._failure = CommTimeoutError  # as the constructor leaves it
    transport._pending, transport._spare_events = _NoQueue(), _NoQueue()
    transport._stream_objects = {}
    transport._closing = False
    transport._graphs, transport.replay_lock, transport._aborter = WeakSet(), Lock(), None
    control = ControlGroup(world)
    recorder = recorder or Recorder(keep=False)
    pretend = [
        (torch.cuda, "is_available", lambda: True),
        (torch.cuda, "is_current_stream_capturing", lambda: False),
        (torch.cuda, "Event", _FakeEvent),
        (torch.cuda, "current_stream", _FakeStream),
        (dist, "all_gather_single", control.all_gather),  # created where torch lacks it
        (dist, "send", control.send),
        (dist, "recv", control.recv),
        (dist, "get_global_rank", lambda group, rank: rank),
        (codecs, "_ONES", {}),  # its 1.0 made on the pretend device, dropped afterwards
        (torch, "ones", _host_ones(torch.ones)),
    ]
    with fake_cuda(recorder), contextlib.ExitStack() as patches:
        for obj, name, value in pretend:
            patches.enter_context(mock.patch.object(obj, name, value, create=True))
        if mover == "p2p":
            transport, null = _null_p2p(world, rank)
        comm = Communicator(transport, control_group=control, validate=validate, graphs=graphs,
                            **options)  # fmt: skip
        yield comm, null, control, recorder


def _host_ones(real):
    def ones(*shape, device=None, **kw):
        return real(*shape, **kw)

    return ones
