"""NCCL transport through ``cupy.cuda.nccl``, rendezvous through torch.distributed.

The NCCL unique id is made on group rank 0 and broadcast over a gloo group of torch.distributed
(whose TCPStore rendezvous torchrun already did), not with ``cupyx.distributed``, which sets
up a rendezvous of its own.  Every NCCL call is queued on the caller's current torch
stream (a CuPy caller's stream is made torch's current one in ``communicator.py``); nothing here
waits for the GPU, except ``synchronize``.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
import warnings
import weakref

import torch
import torch.distributed as dist

from ._transport import (
    CommConnectionError,
    CommTimeoutError,
    Transport,
    check_timeout,
    reraise_peer_error,
)
from .devices import local_world_size, sharing_problem

# How often synchronize() polls the stream's event and NCCL's async error state.
_POLL_INTERVAL_S = 1e-4
# How often the watchdog looks at the oldest unfinished transfer.
_WATCHDOG_INTERVAL_S = 1e-3
# How long an abort or close without a timeout waits for CUDA graphs' replays to drain.
_GRAPH_DRAIN_S = 60.0
# Stream objects kept for the watchdog's event records (all dropped when there are more).
_STREAM_OBJECTS = 16


def _relax_capture_mode():
    """Let this thread's CUDA calls (the watchdog's event queries) run while another thread
    captures a CUDA graph.  In the default (global) capture mode, a query of any event from any
    thread during a capture invalidates that capture (cudaErrorStreamCaptureInvalidated: seen on
    the H200 with torch.cuda.graph around an fp4_comm collective while the watchdog polled).
    The events it queries were recorded outside any capture, so the relaxed mode is safe."""
    try:
        from cuda.bindings import driver
    except ImportError:  # cuda-python < 12.6 names the module cuda.cuda
        from cuda import cuda as driver
    mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    err, _ = driver.cuThreadExchangeStreamCaptureMode(mode)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuThreadExchangeStreamCaptureMode: {err}")


def _nccl():
    try:
        from cupy.cuda import nccl
    except ImportError as err:  # pragma: no cover - depends on the install
        raise ImportError(
            "the NCCL transport needs CuPy with NCCL: pip install 'fp4-comm[nccl]'"
        ) from err
    if not getattr(nccl, "available", False) or not hasattr(nccl, "NcclCommunicator"):
        raise ImportError(
            "cupy.cuda.nccl is not usable (libnccl.so.2 not found): pip install "
            "'nvidia-nccl-cu13>=2.27.7,<3' or 'fp4-comm[nccl]'"
        )
    return nccl


def nccl_version() -> int:
    """The version of the NCCL that CuPy loaded, as ``ncclGetVersion`` numbers it (23007 for
    2.30.7); ImportError naming the install where there is none."""
    return _nccl().get_version()


class NcclTransport(Transport):
    """One NCCL communicator over the ranks of ``control_group``, on ``device``.

    Collective: every rank of the group must construct it, each with its own device.
    """

    #: all_to_all takes a send section of one row as meant for every peer (sent from where it
    #: is, no repeated copy made)
    broadcast_rows = True

    def __init__(self, control_group, device, timeout_s=300.0, watchdog=True):
        if timeout_s is not None:  # None: no watchdog (synchronize() then needs a timeout)
            check_timeout(timeout_s)
        nccl = _nccl()
        self._nccl = nccl
        self.device = torch.device(device)
        if self.device.type != "cuda" or self.device.index is None:
            raise ValueError(f"device: expected a CUDA device with an index, got {device!r}")
        self.rank = dist.get_rank(control_group)
        self.world_size = dist.get_world_size(control_group)
        self.timeout_s = timeout_s
        root = 0 if control_group is None else dist.get_global_rank(control_group, 0)
        box = [nccl.get_unique_id() if self.rank == 0 else None]
        try:
            # The broadcast doubles as a barrier with the gloo timeout: NCCL's init below waits
            # for every rank forever, so a rank that never comes is caught here instead.
            dist.broadcast_object_list(box, src=root, group=control_group)
        except RuntimeError as err:
            reraise_peer_error(err, "NCCL unique id broadcast", self.rank, self.world_size)
        import cupy

        with torch.cuda.device(self.device), cupy.cuda.Device(self.device.index):
            # ncclCommInitRank binds the communicator to the current CUDA device (made current
            # through both libraries, which may load CUDA runtimes of their own).
            # get_unique_id's type differs across CuPy versions (a tuple of ints, or bytes);
            # hand the constructor back exactly what this CuPy produced
            try:
                self.comm = nccl.NcclCommunicator(self.world_size, box[0], self.rank)
            except Exception as err:  # NCCL's own error (CuPy's NcclError), said plainly
                self._init_failed(err)
        self._uint8 = nccl.NCCL_UINT8
        # Watchdog: an event after every group of transfers; a daemon thread aborts the
        # communicator when the oldest one has not completed timeout_s after it became the
        # oldest (so a queue of long legitimate transfers does not trip it), which ends the
        # NCCL kernels that wait for a peer that never comes: no hang, even for a caller who
        # never calls synchronize().  Not under CUDA-graph capture (nothing runs then).
        # The watchdog also bounds the host side: ncclGroupEnd connects to the peers on their
        # first transfer and waits there (on the host, before anything is queued) for a peer
        # that never comes; ``_host_since`` is when the call now inside a group began.
        self._watchdog = watchdog and timeout_s is not None
        self._pending = collections.deque()
        # Events the watchdog saw complete, recorded again by later calls (an event is only
        # re-recorded once its previous record has completed and left the queue).
        self._spare_events = collections.deque()
        self._stream_objects = {}  # raw stream handle -> torch.cuda.Stream (_stream_object)
        self._failed = None  # why the communicator was aborted
        self._failure = CommTimeoutError  # the error later calls raise then
        self._closing = False
        self._thread = None
        self._host_since = None
        # CUDA graphs holding this communicator's calls (fp4_comm.graphs' replays, and
        # Communicator.capture's): NCCL's abort and destroy wait until they are all destroyed.
        self._graphs = weakref.WeakSet()
        self.replay_lock = threading.Lock()
        self._aborter = None  # the thread of an abort that waits for graphs to drain

    def _init_failed(self, err):
        """Raise ``err`` again, or RuntimeError naming the fix where the node's ranks
        (``LOCAL_WORLD_SIZE``, else the group's size) outnumber its GPUs and this NCCL cannot
        share one (older NCCL says only "invalid usage")."""
        ranks = local_world_size()
        if ranks is None:
            ranks = self.world_size
        problem = sharing_problem(ranks, nccl_version=self._nccl.get_version())
        if problem is None:
            raise err
        raise RuntimeError(
            f"NCCL could not make rank {self.rank}'s communicator on {self.device} ({err}): "
            f"{problem}"
        ) from err

    def _stream(self):
        if self._failed is not None:
            raise self._failure(self._failed)
        # torch's current stream on this device as a raw handle (no Stream object made)
        return torch._C._cuda_getCurrentRawStream(self.device.index)

    def _stream_object(self):
        """torch's current stream on this device as a ``torch.cuda.Stream``, made once per
        stream (``torch.cuda.current_stream`` builds a new object, in Python, every call)."""
        streams = self._stream_objects
        raw = torch._C._cuda_getCurrentRawStream(self.device.index)
        stream = streams.get(raw)
        if stream is None:
            if len(streams) >= _STREAM_OBJECTS:
                streams.clear()
            stream = streams[raw] = torch.cuda.current_stream(self.device)
        return stream

    def _start_watchdog(self):
        if self._watchdog and self._thread is None:
            self._thread = threading.Thread(target=self._watch_loop, daemon=True)
            self._thread.start()

    @contextlib.contextmanager
    def _group(self):
        """One NCCL group of transfers, bounded on the host by the watchdog (a peer that never
        connects), then watched on the stream (a transfer that never ends)."""
        self._start_watchdog()
        self._host_since = time.monotonic()
        self._nccl.groupStart()
        try:
            yield
        finally:
            try:
                self._nccl.groupEnd()
            except Exception as err:
                if self._failed is not None:  # aborted by the watchdog while it waited
                    raise CommTimeoutError(self._failed) from err
                raise
            finally:
                self._host_since = None
        self._watch()

    def _watch(self):
        if not self._watchdog or torch.cuda.is_current_stream_capturing():
            return
        try:
            event = self._spare_events.popleft()
        except IndexError:
            event = torch.cuda.Event()
        event.record(self._stream_object())
        self._pending.append(event)

    def _watch_loop(self):
        try:
            _relax_capture_mode()
        except Exception as err:  # noqa: BLE001 - keep watching; only captures are at risk
            warnings.warn(f"fp4_comm watchdog: {err}; a CUDA-graph capture in another thread "
                          "may be invalidated by its event queries", stacklevel=1)  # fmt: skip
        head, since = None, 0.0
        while not self._closing:
            host = self._host_since
            if host is not None and time.monotonic() - host > self.timeout_s:
                self._abort(
                    f"NCCL: a group of transfers did not start within {self.timeout_s} s (a peer "
                    "that never connected); the communicator was aborted"
                )
                return
            if not self._pending:
                time.sleep(_WATCHDOG_INTERVAL_S)
                continue
            event = self._pending[0]
            if event is not head:
                head, since = event, time.monotonic()
            if event.query():
                self._spare_events.append(self._pending.popleft())
                continue
            if time.monotonic() - since > self.timeout_s:
                self._abort(
                    f"NCCL: a transfer did not finish within {self.timeout_s} s (a peer "
                    "missing from a collective, or called with other sizes); the communicator "
                    "was aborted"
                )
                return
            time.sleep(_WATCHDOG_INTERVAL_S)

    def _abort(self, why):
        """Fail the communicator (later calls raise its failure with ``why``) and abort it."""
        self._failed = why
        self._abort_nccl()

    def _abort_nccl(self):
        """ncclCommAbort, also where CUDA graphs hold this communicator's calls.

        NCCL counts the graphs that captured a communicator's calls, and its abort (as its
        destroy) returns only once every one is destroyed; a graph whose replay waits for a
        dead peer ends only when the abort raises NCCL's abort flag, which the waiting kernels
        poll.  So with graphs alive the abort runs in a thread of its own (it raises the flag
        first), the replays drain, the graphs are released, and the abort returns.  Within the
        timeout; past it the graphs are kept (their memory may still be written) and the
        failure says that NCCL's abort has not returned."""
        with self.replay_lock:  # no replay is queued meanwhile; later ones raise (_failed)
            graphs = list(self._graphs)
            if not graphs:
                self.comm.abort()
                return
            name = f"fp4_comm NCCL abort rank {self.rank}"
            aborter = self._aborter = threading.Thread(
                target=self.comm.abort, daemon=True, name=name
            )
            aborter.start()
            deadline = self._graph_deadline()
            _release_when_drained(graphs, deadline)
        aborter.join(max(0.0, deadline - time.monotonic()))
        if aborter.is_alive():
            self._failed = (
                f"{self._failed} (NCCL's abort had not returned {self.timeout_s} s later: CUDA "
                "graphs of this communicator's calls did not finish)"
            )

    def keep_graph(self, graph):
        self._graphs.add(graph)

    def _graph_deadline(self):
        """When an abort or close stops waiting for the graphs' replays to drain."""
        return time.monotonic() + (self.timeout_s or _GRAPH_DRAIN_S)

    def all_to_all(self, pairs):
        stream, comm, u8, rank = self._stream(), self.comm, self._uint8, self.rank
        # Row p of a send section starts p row strides in (a one-row section: the same row for
        # every peer, ``broadcast_rows``); receive sections are contiguous.
        rows, own_send, own_recv = [], [], []
        for send, recv in pairs:
            b = recv.shape[1]
            if b == 0:
                continue
            step = send.stride(0) if send.shape[0] > 1 else 0
            rows.append((send.data_ptr(), step, recv.data_ptr(), b))
            own_send.append(send[rank if step else 0])
            own_recv.append(recv[rank])
        # A rank's own rows: device copies on the same stream (not NCCL self-sends), all
        # sections in one launch.
        if own_recv:
            torch._foreach_copy_(own_recv, own_send)
        with self._group():
            for send_ptr, step, recv_ptr, b in rows:
                for p in range(self.world_size):
                    if p != rank:
                        comm.send(send_ptr + p * step, b, u8, p, stream)
                        comm.recv(recv_ptr + p * b, b, u8, p, stream)

    def all_gather(self, pairs):
        stream, comm, u8 = self._stream(), self.comm, self._uint8
        with self._group():
            for send, recv in pairs:
                b = send.numel()
                if b:
                    comm.allGather(send.data_ptr(), recv.data_ptr(), b, u8, stream)

    def send(self, tensors, peer):
        self._point_to_point("send", tensors, peer)

    def recv(self, tensors, peer):
        self._point_to_point("recv", tensors, peer)

    def _point_to_point(self, op, tensors, peer):
        """ncclSend / ncclRecv (``op``) of each non-empty tensor with ``peer``, in one group."""
        stream, comm, u8 = self._stream(), self.comm, self._uint8
        with self._group():
            for t in tensors:
                if t.numel():
                    getattr(comm, op)(t.data_ptr(), t.numel(), u8, peer, stream)

    def before_replay(self):
        if self._failed is not None:
            raise self._failure(self._failed)
        if self.comm is None:
            raise RuntimeError("NCCL transport: the communicator was closed")

    def after_replay(self):
        # The watchdog's event after the replayed transfers, as after a call's group: a peer
        # that never comes ends in an aborted communicator and CommPeerError, not a hang.
        self._watch()

    def synchronize(self, timeout_s=None):
        """Wait for the current stream; on timeout abort the communicator (so no later call can
        hang on it either) and raise CommTimeoutError."""
        timeout_s = self.timeout_s if timeout_s is None else check_timeout(timeout_s)
        if self._failed is not None:
            raise self._failure(self._failed)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        deadline = time.monotonic() + timeout_s
        while not event.query():
            if self._failed is not None:  # the watchdog aborted meanwhile
                raise CommTimeoutError(self._failed)
            try:
                self.comm.check_async_error()
            except Exception as err:  # noqa: BLE001 - NCCL's asynchronous error, whatever type
                self._failed = (
                    f"NCCL reported an asynchronous error ({err}): a peer failed or left; the "
                    "communicator was aborted"
                )
                self._failure = CommConnectionError
                self._closing = True
                self._abort_nccl()
                raise CommConnectionError(self._failed) from err
            if time.monotonic() > deadline:
                self._failed = (
                    f"NCCL: the stream did not finish within {timeout_s} s (a peer missing from "
                    "a collective, or called with other sizes); the communicator was aborted"
                )
                self._closing = True  # the watchdog has nothing left to watch
                self._abort_nccl()
                raise CommTimeoutError(self._failed)
            time.sleep(_POLL_INTERVAL_S)

    def close(self):
        self._closing = True
        if self._thread is not None:
            self._thread.join()
        if getattr(self, "comm", None) is not None:
            aborter = self._aborter
            if aborter is not None and aborter.is_alive():
                self.comm = None  # NCCL's abort has not returned: no destroy beside it
                return
            # ncclCommDestroy waits for the graphs holding the communicator's calls to go
            with self.replay_lock:
                drained = _release_when_drained(list(self._graphs), self._graph_deadline())
            if not drained:
                self._abort(
                    f"NCCL transport: close() found CUDA graphs of this communicator's calls "
                    f"still running after {self.timeout_s} s; the communicator was aborted"
                )
                self.comm = None
                raise CommTimeoutError(self._failed)
            self.comm.destroy()
            self.comm = None


def _release_when_drained(graphs, deadline):
    """Destroy ``graphs`` once the last replay of each has finished; False, and nothing
    destroyed (their memory may still be written), if one has not by ``deadline``
    (monotonic s)."""
    events = []
    for graph in graphs:
        stream = graph.last_stream
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
            events.append(event)
    while not all(e.query() for e in events):
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL_INTERVAL_S)
    for graph in graphs:
        graph.release()
    return True
