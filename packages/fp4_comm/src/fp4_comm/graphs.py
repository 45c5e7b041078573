"""Eager calls replayed from CUDA graphs: the host cost of a repeated kind of call.

An eager compressed collective launches a dozen kernels and NCCL calls through some hundred
Python calls; NCCL's own collective is one.  Under ``Communicator(graphs="auto")`` (the default
on CUDA transports) a kind of call (operation, shape, dtype, codec, rounding, error-feedback
name, statistics off, peer, device) made ``EAGER_CALLS`` times eagerly is captured once into a
CUDA graph, and its later calls replay it: the input copied into the graph's static input
buffer, one ``cudaGraphLaunch``, and the result copied out, all queued on the caller's current
stream.

Which calls replay (``eligible``): no statistics (host-side values); one of fp4_comm's own
codecs (another codec's encode may hold host state a graph would freeze); an input (the output
of a ``recv``) of at most ``GRAPH_MAX_BYTES``; torch tensors (CuPy arrays run eagerly).  A call
made while the caller's stream is itself being captured runs the eager path (it is then part of
the caller's graph).  Replays give the eager path's bits: the same kernels on the same values
with the same arguments.

Stochastic rounding (of an FP4 codec: ``draws_random_words``): the encode kernels read the
Philox counter ``step`` from a one-element int64 tensor that the graph owns
(``fp4_kernels.quantize``'s device step), and each replay first fills it with the call's step
on the caller's stream, so the random words are the eager call's.  The eager calls of such a
kind pass their step the same way (``device_step``: a tensor of their own), so the kernels a
capture records are compiled and planned before it.  The seed is fixed at capture: a call with
another seed runs eagerly.  Error feedback: the residuals are updated in place
(``ErrorFeedback``: ``reset`` and ``load_state_dict`` too), and a graph keeps the residual
tensors it was captured with (``ErrorFeedback.in_use``); if they have been replaced (a payload
of another shape under the name after a reset, a loaded state of another shape), the kind's
graph is dropped and its calls run eagerly.

Every rank decides alike: the decision depends on the kind of call and on how many calls of it
were made (the plan cache's count, which sees the same sequence of calls on every rank), never
on timing or addresses, so ranks capture at the same call and replay the same calls.

The result is a copy of the graph's output, made on the caller's stream (a tensor the caller
owns, as the eager path's): a pool of rotating outputs would hand out memory that a later call
overwrites while the caller may still hold it.  The copies cost device time (the input's and
the output's bytes once more each), never host synchronization.

A peer that dies while a replay waits for it ends in ``CommPeerError`` as on the eager path:
the replay records the NCCL watchdog's event, and the abort that follows releases the
transport's graphs (NCCL's abort and destroy wait until every graph holding the communicator's
calls is destroyed) once the aborted replays have drained.

Memory: a graph keeps every buffer of its call (static input, encoded sections, receive
buffers, float32 sums, output) in a private pool: about 4 to 6 times the input's bytes.  A
communicator keeps at most ``GRAPH_CACHE_SIZE`` graphs, standing for at most
``GRAPH_CACHE_BYTES`` of inputs together (least recently used dropped first; a dropped kind
runs eagerly from then on); ``close()`` drops them all.  ``graph_cache=(max_graphs,
max_bytes)`` (``Communicator``, ``EmulatedRanks``) sets other bounds: every error-feedback
name is a kind of its own, so a model whose every layer's sums carry error feedback needs a
graph per call site (the kinds cycle through the cache once a step: with fewer places than
sites, they are all dropped and run eagerly).  Its GPU memory is about 4 to 6 times
``max_bytes`` where the graphs fill it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Literal

import torch

from .codecs import FP4QuantCodec, MXFP4Codec, NoneCodec, NVFP4Codec
from .tahquant import TAHQuantCodec, TAHQuantGradCodec

Graphs = Literal["auto", "never"]
GRAPHS = ("auto", "never")
#: Eager calls of a kind of call before the next one is captured: the first compiles the
#: kernels and checks the arguments across ranks, the second makes fp4_kernels' launch plans
#: (``fp4_kernels._plans.RECORD_AT``) and runs them once eagerly, so that whatever a call
#: sets up lazily is done before a capture.
EAGER_CALLS = 2
#: Graphs a communicator keeps.
GRAPH_CACHE_SIZE = 8
#: The largest input (or ``recv`` output) of a replayed call, and the most input bytes all kept
#: graphs stand for together; each graph holds about 4 to 6 times its input in its pool.
GRAPH_MAX_BYTES = 256 << 20
GRAPH_CACHE_BYTES = 512 << 20
#: Codecs whose encode and decode on a CUDA tensor are kernels and torch operations on the
#: tensors and nothing else: no host synchronization, no host state that depends on the values.
REPLAYABLE_CODECS = (NoneCodec, NVFP4Codec, MXFP4Codec, FP4QuantCodec, TAHQuantCodec,
                     TAHQuantGradCodec)  # fmt: skip


def default_graphs(transport) -> Graphs:
    """ "auto" where the transport moves CUDA tensors, needs no per-call host check and may be
    captured (NCCL, p2p), "never" otherwise (gloo: CPU tensors, every call checked; the
    emulated ranks of ``fp4_comm.reference``: an exchange in host code)."""
    if (
        transport.device.type == "cuda"
        and not transport.always_validate
        and transport.graph_capturable
    ):
        return "auto"
    return "never"


def check_graphs(graphs) -> Graphs:
    if graphs not in GRAPHS:
        raise ValueError(f"graphs: {graphs!r} is not one of {GRAPHS}")
    return graphs


def eligible(codec, rounding, ef_name, stats, nbytes) -> bool:
    """Whether a kind of call may be replayed from a graph (the module's docstring says why);
    every rounding and error feedback may."""
    return type(codec) in REPLAYABLE_CODECS and not stats and 0 < nbytes <= GRAPH_MAX_BYTES


def draws_random_words(codec, rounding) -> bool:
    """Whether a call's encode reads its seed and step: stochastic rounding of an FP4 codec
    (the "none" codec rounds by casting)."""
    return rounding == "stochastic" and type(codec) is not NoneCodec


def device_step(step, device) -> torch.Tensor:
    """``step`` (an int in [0, 2^32), or a one-element int64 tensor holding it) as a new
    one-element int64 tensor on ``device`` that the encode kernels read it from
    (``fp4_kernels.quantize``); written on the current stream."""
    if isinstance(step, torch.Tensor):
        return step.reshape(1).clone()
    return torch.full((1,), step, dtype=torch.int64, device=device)


def write_step(target, step) -> None:
    """Write ``step`` (an int, or a one-element int64 tensor) into the step tensor ``target``
    on the current stream (no host synchronization)."""
    if isinstance(step, torch.Tensor):
        target.copy_(step.reshape(1))
    else:
        target.fill_(step)


def same_tensors(a, b) -> bool:
    """Whether two tuples hold the very same tensors (``is``), in order."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def capture(run, device, shape, dtype):
    """A CUDA graph of ``run(static_input)`` -> (graph, static input, static output), captured on
    a side stream of ``device`` (``shape`` None: ``run()``, no input).  Nothing runs: the
    caller replays it.  The static input is allocated inside the capture, from the graph's
    private pool, so no eager allocation ever shares its memory (and without deterministic
    mode's NaN fill, which would be a node of the graph: ``_unfilled``).  Capture mode
    "thread_local": the caller's other threads may go on using CUDA meanwhile."""

    def call():
        static = None if shape is None else _unfilled(shape, dtype, device)
        return static, run() if shape is None else run(static)

    return _captured(call, device)


def capture_group(run, device, shapes, dtype):
    """A CUDA graph of ``run(static_inputs)`` -> (graph, static inputs, outputs), one static
    input per shape, for the emulated ranks of ``fp4_comm.reference``: ``run`` hands the call
    to the ranks' threads, which queue their kernels on the capturing stream (the caller's
    current stream, which they take as theirs).  As ``capture`` otherwise."""

    def call():
        statics = [_unfilled(shape, dtype, device) for shape in shapes]
        return statics, run(statics)

    return _captured(call, device)


def _captured(call, device):
    """(graph, inputs, out) where ``call()`` -> (inputs, out) runs inside the capture of
    ``graph`` on a side stream of ``device`` (``capture``); a failed capture is ended before
    its error goes on."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(torch.cuda.Stream(device)):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            inputs, out = call()
        except BaseException:
            try:
                graph.capture_end()
            except RuntimeError:
                pass  # the capture is invalid anyway; the original error says why
            raise
        graph.capture_end()
    return graph, inputs, out


def _unfilled(shape, dtype, device):
    """``torch.empty`` without the NaN fill of deterministic mode
    (``torch.utils.deterministic.fill_uninitialized_memory``): inside a capture that fill is a
    node of the graph, which would overwrite the input each replay copies in before it launches
    the graph.  (The flag is global: an allocation of another thread at this moment goes
    unfilled too.)"""
    det = torch.utils.deterministic
    fill, det.fill_uninitialized_memory = det.fill_uninitialized_memory, False
    try:
        return torch.empty(shape, dtype=dtype, device=device)
    finally:
        det.fill_uninitialized_memory = fill


class Replay:
    """One captured kind of call: ``replay(x)`` queues it on the current stream, and returns a
    copy of the output (None for a send).  Kept by its transport (``Transport.keep_graph``),
    which may ``release()`` it: NCCL's abort and destroy wait for its graph to go."""

    __slots__ = ("graph", "input", "output", "nbytes", "device", "step", "seed", "residuals",
                 "_raw", "_stream", "__weakref__")  # fmt: skip

    def __init__(self, graph, static_input, output, nbytes, device, step=None, seed=0,
                 residuals=()):  # fmt: skip
        self.graph, self.input, self.output = graph, static_input, output
        self.nbytes, self.device = nbytes, device
        # the step tensor the graph's encodes read (None: they draw no random words), the seed
        # captured with it, and the error-feedback tensors the graph reads and writes
        self.step, self.seed, self.residuals = step, seed, residuals
        self._raw = self._stream = None  # the stream of the last replay

    def fits(self, seed) -> bool:
        """Whether a call of seed ``seed`` may replay this graph (its seed is the captured one,
        or its encodes draw no random words)."""
        return self.step is None or seed == self.seed

    @property
    def last_stream(self):
        """The stream of the last replay (None before the first)."""
        return self._stream

    def release(self) -> None:
        """Destroy the CUDA graph (its last replay must have finished); a later ``replay``
        raises."""
        if self.graph is not None:
            self.graph.reset()
            self.graph = None

    def replay(self, transport, x=None, step=0):
        """The call of input ``x`` (None: a ``recv``) and ``step`` (the random words' counter,
        written into the graph's step tensor first)."""
        with transport.replay_lock:
            transport.before_replay()  # a failed transport raises its CommPeerError here
            if self.graph is None:
                raise RuntimeError("fp4_comm: this CUDA graph was released with its transport")
            if self.device.type == "cuda":
                raw = torch._C._cuda_getCurrentRawStream(self.device.index)
                if raw != self._raw:
                    # Replays on another stream than the last: ordered after everything queued
                    # on that one (its replay, and the copy of its output): they share buffers.
                    stream = torch.cuda.current_stream(self.device)
                    if self._stream is not None:
                        stream.wait_stream(self._stream)
                    self._raw, self._stream = raw, stream
            if self.step is not None:
                write_step(self.step, step)
            if self.input is not None:
                self.input.copy_(x)
            self.graph.replay()
            transport.after_replay()
        return None if self.output is None else self.output.clone()


def graph_cache(bounds) -> GraphCache:
    """A ``GraphCache`` of ``bounds``: None (the defaults) or ``(max_graphs, max_bytes)``, the
    ``graph_cache`` argument of ``Communicator`` and ``EmulatedRanks``."""
    if bounds is None:
        return GraphCache()
    if not isinstance(bounds, tuple | list) or len(bounds) != 2:
        raise ValueError(f"graph_cache: {bounds!r} is not (max_graphs, max_bytes): give a pair "
                         f"of positive ints, or None for ({GRAPH_CACHE_SIZE}, "
                         f"{GRAPH_CACHE_BYTES})")  # fmt: skip
    try:
        return GraphCache(*bounds)
    except ValueError as err:
        raise ValueError(f"graph_cache: {err}") from None


class GraphCache:
    """The captured kinds of call of a communicator: kind -> its plan entry, whose ``replay``
    holds the graph.  Least recently used dropped first; a dropped kind runs eagerly from then
    on (capturing it again would thrash when more kinds cycle than the cache holds)."""

    def __init__(self, max_graphs: int = GRAPH_CACHE_SIZE, max_bytes: int = GRAPH_CACHE_BYTES):
        for name, value in (("max_graphs", max_graphs), ("max_bytes", max_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: {value!r} is not a positive int: give the most "
                                 f"graphs / input bytes the cache keeps")  # fmt: skip
        self.max_graphs, self.max_bytes = max_graphs, max_bytes
        self._entries: OrderedDict = OrderedDict()
        self._bytes = 0

    def __len__(self):
        return len(self._entries)

    def kinds(self):
        return list(self._entries)

    def keep(self, kind, entry):
        """Keep ``entry`` (its ``replay`` set) and drop the oldest beyond the bounds."""
        self._entries[kind] = entry
        self._bytes += entry.replay.nbytes
        while len(self._entries) > self.max_graphs or self._bytes > self.max_bytes:
            self._forget(self._entries.popitem(last=False)[1])

    def touch(self, kind):
        self._entries.move_to_end(kind)

    def ready(self, kind, replay, seed, residuals) -> bool:
        """Whether a call of ``kind`` and ``seed`` whose error-feedback tensors are
        ``residuals`` (``ErrorFeedback.in_use``) replays ``replay`` (the kind's, a ``Replay``
        or an ``EmulatedRanks`` group replay): its seed fits (else it runs eagerly, the graph
        kept) and its residuals are the captured ones (else the kind is dropped, eager from
        then on).  A kind that replays becomes the most recently used."""
        if not replay.fits(seed):
            return False
        if not same_tensors(replay.residuals, residuals):
            self.drop(kind)
            return False
        self.touch(kind)
        return True

    def drop(self, kind):
        entry = self._entries.pop(kind, None)
        if entry is not None:
            self._forget(entry)

    def clear(self):
        for entry in self._entries.values():
            entry.replay, entry.graphable = None, False
        self._entries.clear()
        self._bytes = 0

    def _forget(self, entry):
        self._bytes -= entry.replay.nbytes
        entry.replay, entry.graphable = None, False
