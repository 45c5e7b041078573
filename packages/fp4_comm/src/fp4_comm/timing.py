"""``TimedCommunicator``: a communicator that adds up the time spent in its calls.

    timed = TimedCommunicator(comm)
    y = timed.all_reduce(x, codec="nvfp4")     # every Communicator call, timed
    ...
    comm_ms = timed.take_ms()                  # after the step (and its synchronize)

On a GPU each call is bracketed by two CUDA events on the current stream, so the figure is the
time the stream spent from the call's first kernel to its last, including waits for the peer
(a receive that waits for a slower sender counts the wait); events are read in ``take_ms``,
which must come after the device has synchronized.  On the CPU it is ``time.perf_counter``
around the call.  Calls made inside a CUDA-graph capture record "external" events that every
replay records again: ``take_ms(replayed=True)`` adds those of the latest replay.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


class TimedCommunicator:
    """Wraps a ``Communicator`` (or anything with its methods); every other attribute is the
    wrapped one's, so the tensor-parallel and pipeline functions take it in its place."""

    def __init__(self, comm: Any) -> None:
        device = getattr(comm, "device", None)
        if not isinstance(device, torch.device):
            raise TypeError(
                "comm: a Communicator (or an object with its methods and a torch.device "
                f"'device'), got {type(comm).__name__}"
            )
        self.comm = comm
        self._cuda = device.type == "cuda"
        self._events, self._cpu_s = [], 0.0
        self._graph_events = []

    def __getattr__(self, name: str) -> Any:
        # (only for names not set on the instance; ``comm`` itself read from __dict__, so a
        # copy under construction, which has none yet, raises AttributeError, not recursion)
        comm = self.__dict__.get("comm")
        if comm is None:
            raise AttributeError(name)
        return getattr(comm, name)

    def timed(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, its time counted as communication (e.g. a torch.distributed
        collective beside the compressed ones)."""
        if self._cuda:
            capturing = torch.cuda.is_current_stream_capturing()
            start, end = (torch.cuda.Event(enable_timing=True, external=capturing)
                          for _ in range(2))  # fmt: skip
            start.record()
            out = fn(*args, **kwargs)
            end.record()
            (self._graph_events if capturing else self._events).append((start, end))
            return out
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        self._cpu_s += time.perf_counter() - t0
        return out

    def all_reduce(self, *args: Any, **kwargs: Any) -> Any:
        return self.timed(self.comm.all_reduce, *args, **kwargs)

    def reduce_scatter(self, *args: Any, **kwargs: Any) -> Any:
        return self.timed(self.comm.reduce_scatter, *args, **kwargs)

    def all_gather(self, *args: Any, **kwargs: Any) -> Any:
        return self.timed(self.comm.all_gather, *args, **kwargs)

    def send(self, *args: Any, **kwargs: Any) -> Any:
        return self.timed(self.comm.send, *args, **kwargs)

    def recv(self, *args: Any, **kwargs: Any) -> Any:
        return self.timed(self.comm.recv, *args, **kwargs)

    def take_ms(self, replayed: bool = False) -> float:
        """Milliseconds spent in calls since the last take (call it after the device has
        synchronized); ``replayed``: a captured graph was replayed since, add its calls."""
        ms = 1e3 * self._cpu_s + sum(s.elapsed_time(e) for s, e in self._events)
        if replayed:
            ms += sum(s.elapsed_time(e) for s, e in self._graph_events)
        self._events, self._cpu_s = [], 0.0
        return ms


__all__ = ["TimedCommunicator"]
