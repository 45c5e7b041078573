"""Byte movers under the collectives: gloo through torch.distributed (CPU tensors) here, NCCL
through CuPy in ``nccl.py``.

A transport moves uint8 tensors and nothing else; the codec, padding, reduction and validation
live above it (``collectives.py``), so the CPU tests over gloo run the very algorithms that run
over NCCL.
"""

from __future__ import annotations

import contextlib
import datetime
import math
from typing import Any

import torch
import torch.distributed as dist

# torch.distributed counts timeouts in whole milliseconds: a shorter one would become 0 ms, and
# every exchange would fail at once as if a peer were missing.
MIN_TIMEOUT_S = 1e-3
# The longest datetime.timedelta, which torch.distributed takes its timeouts as.
MAX_TIMEOUT_S = datetime.timedelta.max.total_seconds()


def check_timeout(timeout_s: float, name: str = "timeout_s") -> float:
    """``timeout_s``: seconds, a real number in [1 ms, datetime.timedelta.max]; TypeError /
    ValueError naming ``name`` otherwise."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise TypeError(f"{name}: expected seconds as a number, got {type(timeout_s).__name__}")
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"{name}: {timeout_s} is not a positive finite number of seconds")
    if timeout_s < MIN_TIMEOUT_S:
        raise ValueError(
            f"{name}: {timeout_s} s is below 1 ms; torch.distributed counts timeouts in whole "
            "milliseconds, so it would be 0 and every exchange would time out at once"
        )
    if timeout_s > MAX_TIMEOUT_S:
        raise ValueError(f"{name}: {timeout_s} s is beyond datetime.timedelta's range")
    return timeout_s


class CommPeerError(RuntimeError):
    """A peer of a collective is gone: it did not take part in time (``CommTimeoutError``) or
    its connection closed (``CommConnectionError``: the process died, or closed its group).

    ``op`` is the collective, ``rank`` this rank and ``peers`` the group ranks that may be the
    one gone (one rank where it is known: a send or receive, or a group of two).  The group is
    out of step afterwards: make a new one to go on.
    """

    def __init__(
        self,
        message: str,
        *,
        op: str | None = None,
        rank: int | None = None,
        peers: list[int] | None = None,
    ) -> None:
        super().__init__(message)
        self.op, self.rank, self.peers = op, rank, peers


class CommTimeoutError(CommPeerError, TimeoutError):
    """A peer did not take part in a collective within the communicator's timeout."""


class CommConnectionError(CommPeerError, ConnectionError):
    """A peer's connection closed in the middle of a collective (its process died)."""


# What gloo says when a peer never came, and when its socket closed (process killed or exited).
_TIMEOUT_WORDS = ("timed out", "timeout")
_CLOSED_WORDS = (
    "connection closed",
    "connection reset",
    "connection refused",
    "broken pipe",
    "end of file",
)


def peer_error(err: Exception, op: str, rank: int, world_size: int, peer=None, note=""):
    """The ``CommPeerError`` for gloo's ``err`` in ``op`` on ``rank`` (None where ``err`` does
    not say that a peer is gone).  ``peer``: the one peer of a send or receive; ``note`` ends
    the message."""
    text = str(err).lower()
    if any(w in text for w in _TIMEOUT_WORDS):
        cls, what = CommTimeoutError, "did not take part in time"
    elif any(w in text for w in _CLOSED_WORDS):
        cls, what = CommConnectionError, "closed its connection (its process died or left)"
    else:
        return None
    if peer is None and world_size == 2:
        peer = 1 - rank
    if peer is not None:
        peers, who = [peer], f"rank {peer}"
    else:
        peers = [r for r in range(world_size) if r != rank]
        who = "a peer (one of ranks " + ", ".join(map(str, peers)) + ")"
    message = f"{op} on rank {rank} of {world_size}: {who} {what} ({err}){note}"
    return cls(message, op=op, rank=rank, peers=peers)


def reraise_peer_error(err: Exception, op: str, rank: int, world_size: int, peer=None, note=""):
    """Raise ``peer_error(...)`` from ``err`` where it applies, else ``err`` itself."""
    mapped = peer_error(err, op, rank, world_size, peer, note)
    if mapped is None:
        raise err
    raise mapped from err


def all_gather_into(out, inp, group):
    """torch.distributed's all-gather of ``inp`` into the flat ``out`` over ``group`` (torch >=
    2.10 names it all_gather_single and deprecates all_gather_into_tensor)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, inp, group=group)


class Transport:
    """Moves uint8 tensors between the ranks of a group.

    ``pairs`` are (send, recv) tensors, one pair per codec section, moved in one go.
    all_to_all: send and recv (world, b): row p of send goes to rank p, row p of recv comes
    from rank p.  all_gather: send (1, b) or (b,), recv (world, b).
    """

    rank: int
    world_size: int
    device: torch.device
    #: Whether the ranks must agree on every call's sizes before its bytes move, whatever the
    #: communicator's ``validate`` says (see GlooTransport).
    always_validate = False
    #: Whether a CUDA graph may capture its calls (``graphs="auto"``): its transfers are device
    #: work queued on the caller's stream, which a replay repeats on the buffers of that call.
    graph_capturable = True
    #: Whether ``all_reduce_algorithm="auto"`` takes the one-shot all-reduce for small
    #: messages on few ranks (``collectives.resolve_all_reduce_algorithm``): where one
    #: exchange costs little more than its bytes (the peer-to-peer transport's kernel).
    one_shot_auto = False

    def all_to_all(self, pairs):
        raise NotImplementedError

    def all_gather(self, pairs):
        raise NotImplementedError

    def send(self, tensors, peer):
        raise NotImplementedError

    def recv(self, tensors, peer):
        raise NotImplementedError

    def synchronize(self, timeout_s=None):
        """Wait for the queued transfers (no-op where every call is already synchronous)."""

    #: Held while a CUDA graph of this transport's calls is queued (``fp4_comm.graphs``): a
    #: transport that releases its graphs from another thread (NCCL's abort) takes it too.
    replay_lock = contextlib.nullcontext()

    def keep_graph(self, graph: Any) -> None:
        """A CUDA graph holding this transport's calls now exists: ``graph`` has ``release()``
        (destroy the CUDA graph) and ``last_stream`` (the stream of its last replay, or None).
        Only a transport whose teardown waits for such graphs keeps them (NCCL)."""

    def before_replay(self) -> None:
        """Before a CUDA graph of this transport's calls replays: raise the CommPeerError that
        a call would raise now (a failed or closed transport)."""

    def after_replay(self) -> None:
        """After a replay is queued: what a call does after queuing its transfers (the NCCL
        watchdog's event)."""


class GlooTransport(Transport):
    """torch.distributed over a gloo group: CPU tensors, every call synchronous.

    gloo takes a message longer than the buffer posted for it as a fatal error of its I/O
    thread (the process aborts) and fills a longer buffer with a shorter message without a
    word, so byte counts that differ across ranks must never reach it: the communicator checks
    every call's sizes first (``always_validate``), a host exchange of a few bytes that costs
    little beside the CPU codecs.
    """

    always_validate = True

    def __init__(self, group=None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = torch.device("cpu")

    def _peer(self, group_rank):
        # torch.distributed's send/recv take global ranks even with a group.
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    @contextlib.contextmanager
    def _peer_errors(self, op, peer=None):
        """A torch.distributed failure inside: raised again as the CommPeerError it means."""
        try:
            yield
        except RuntimeError as err:
            reraise_peer_error(err, op, self.rank, self.world_size, peer)

    def all_to_all(self, pairs):
        with self._peer_errors("all_to_all"):
            for send, recv in pairs:
                dist.all_to_all_single(recv.reshape(-1), send.reshape(-1), group=self.group)

    def all_gather(self, pairs):
        with self._peer_errors("all_gather"):
            for send, recv in pairs:
                all_gather_into(recv.reshape(-1), send.reshape(-1), self.group)

    def send(self, tensors, peer):
        with self._peer_errors("send", peer):
            for t in tensors:
                dist.send(t.reshape(-1), self._peer(peer), group=self.group)

    def recv(self, tensors, peer):
        with self._peer_errors("recv", peer):
            for t in tensors:
                dist.recv(t.reshape(-1), self._peer(peer), group=self.group)
