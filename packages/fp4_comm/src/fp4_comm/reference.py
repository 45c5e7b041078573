"""Reference collectives: the k ranks of a group emulated in one process, running the very
algorithms of ``collectives.py``, so that their results are the multi-process results bit for
bit.

    ys = reference.all_reduce([x0, x1, x2, x3], codec="fp4quant-g64")   # every rank's result
    ys = reference.reduce_scatter(xs, codec="nvfp4", rounding="stochastic", seed=1, step=7)
    y = reference.send_recv(x, src=0, dst=1, world_size=2, codec="mxfp4")

How: each rank is a thread of its own that runs the collective's own code
(``collectives.all_reduce`` and the others, unchanged) over an ``EmulatedTransport``, which moves
the encoded bytes between the threads in memory where gloo or NCCL move them between processes.
So there is one algorithm: the same codec objects and fp4_kernels kernels, the same padding and
``shard_rows`` split, the same rank-order float32 sum (or NVFP4's / MXFP4's fused
``requantized_sum``), the same stochastic-rounding keys (``collectives.rank_seed`` of each
rank and hop), each rank's own error-feedback residuals.  Threads, not a loop over ranks,
because a rank's collective waits in the middle for the others' bytes; the threads meet at a
barrier for every exchange.  The CPU path of fp4_kernels releases the GIL (``nogil``), so CPU
ranks run in parallel; on a GPU every rank queues its kernels on the caller's current stream, in
an order the barriers fix, so a rank's kernels see the bytes the others' kernels wrote.

``EmulatedRanks`` keeps k ``Communicator`` objects over such transports for as long as a model
trains: each rank then has its own call count (the default stochastic-rounding ``step``) and its
own ``ErrorFeedback``, as in a multi-process run; ``fp4_comm.emulated`` builds the tensor-,
sequence- and pipeline-parallel layers on it.  The functions of this module take ``step``
explicitly and error-feedback state from the caller (``residuals``, one ``ErrorFeedback`` per
rank): pure functions of their arguments, apart from the residuals they update.

Where ranks would disagree (shapes, dtypes, a shard of the wrong length), ValueError names them
before any byte moves, as ``Communicator``'s argument check does between processes.  A rank that
raises stops the others at their next exchange; the error is raised in the caller.
"""

from __future__ import annotations

import inspect
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import collectives, graphs as _graphs
from ._transport import CommTimeoutError, Transport, check_timeout
from .codecs import STEP_LIMIT, CodecSpec, Rounding, check_float_tensor, check_int, get_codec
from .communicator import Communicator, check_options
from .error_feedback import ErrorFeedback
from .stats import HopStats

#: How long a rank waits for the others at an exchange before CommTimeoutError (a rank that
#: raised ends the wait at once; this bounds a collective that some rank never calls).
DEFAULT_TIMEOUT_S = 300.0
_POLL_S = 0.01  # a receiver looks this often whether a failed sender will never send
_JOIN_S = 10.0  # how long a stopping group waits for a rank's thread to finish its task
_TRANSPORTS = ("nccl", "gloo", "p2p")


class _Exchange:
    """What the transports of one emulated group share: a barrier and the posted tensors."""

    def __init__(self, world_size: int, timeout_s: float) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.barrier = threading.Barrier(world_size)
        self.failed = threading.Event()  # a rank raised: the others stop waiting
        self.posted: list[Any] = [None] * world_size
        self.mailboxes: dict[tuple[int, int], queue.SimpleQueue] = {
            (s, d): queue.SimpleQueue() for s in range(world_size) for d in range(world_size)
        }

    def wait(self, op: str, rank: int) -> None:
        try:
            self.barrier.wait(self.timeout_s)
        except threading.BrokenBarrierError:
            raise CommTimeoutError(
                f"{op} on emulated rank {rank} of {self.world_size}: another rank failed or did "
                f"not take part within {self.timeout_s} s",
                op=op, rank=rank, peers=[r for r in range(self.world_size) if r != rank],
            ) from None  # fmt: skip

    def abort(self) -> None:
        self.failed.set()
        self.barrier.abort()

    def reset(self) -> None:
        """After a failed call: a fresh barrier, nothing posted, empty mailboxes."""
        self.barrier = threading.Barrier(self.world_size)
        self.failed.clear()
        self.posted = [None] * self.world_size
        for box in self.mailboxes.values():
            while not box.empty():
                box.get_nowait()


class EmulatedTransport(Transport):
    """Moves the encoded sections between the threads of an emulated group (one transport per
    rank, all sharing one ``_Exchange``).  Same contract as ``GlooTransport``: all_to_all sends
    row p of every section to rank p; all_gather gives every rank all ranks' rows.

    Not for CUDA graphs (``graph_capturable`` False): a rank reads the others' buffers in host
    code, between barriers, so a graph of one rank's call would replay copies from the
    addresses the others posted at the capture, before their own replays write them."""

    graph_capturable = False

    def __init__(self, rank: int, exchange: _Exchange, device: torch.device) -> None:
        self.rank = rank
        self.world_size = exchange.world_size
        self.device = torch.device(device)
        self.exchange = exchange

    def _post_and_check(self, op, pairs):
        ex = self.exchange
        ex.posted[self.rank] = pairs
        ex.wait(op, self.rank)
        # Every rank compares every rank's sizes, so all reach the same verdict.
        sizes = [[tuple(s.shape) for s, _ in posted] for posted in ex.posted]
        if any(s != sizes[0] for s in sizes):
            raise ValueError(f"{op}: the emulated ranks' sections differ: {sizes}")

    def all_to_all(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        ex = self.exchange
        self._post_and_check("all_to_all", pairs)
        for i, (_, recv) in enumerate(pairs):
            rows = [ex.posted[p][i][0][self.rank : self.rank + 1] for p in range(self.world_size)]
            torch.cat(rows, out=recv)
        # Nobody returns (and frees or reuses its send buffers) before every rank has queued
        # its copies; on a GPU they are all on the one stream, before anything queued later.
        ex.wait("all_to_all", self.rank)

    def all_gather(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        ex = self.exchange
        self._post_and_check("all_gather", pairs)
        for i, (_, recv) in enumerate(pairs):
            rows = [ex.posted[p][i][0].reshape(1, -1) for p in range(self.world_size)]
            torch.cat(rows, out=recv)
        ex.wait("all_gather", self.rank)

    def send(self, tensors: Sequence[torch.Tensor], peer: int) -> None:
        # A copy: the receiver may come later than the sender frees its buffers.
        box = self.exchange.mailboxes[(self.rank, peer)]
        box.put([t.clone() for t in tensors])

    def recv(self, tensors: Sequence[torch.Tensor], peer: int) -> None:
        ex = self.exchange
        box = ex.mailboxes[(peer, self.rank)]
        deadline = time.monotonic() + ex.timeout_s
        while True:
            try:
                sent = box.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if ex.failed.is_set() or time.monotonic() > deadline:
                    raise CommTimeoutError(
                        f"recv on emulated rank {self.rank}: rank {peer} failed or sent nothing "
                        f"within {ex.timeout_s} s", op="recv", rank=self.rank, peers=[peer],
                    ) from None  # fmt: skip
        if [tuple(t.shape) for t in sent] != [tuple(t.shape) for t in tensors]:
            raise ValueError(f"recv on emulated rank {self.rank}: rank {peer} sent sections of "
                             f"{[tuple(t.shape) for t in sent]}, expected "
                             f"{[tuple(t.shape) for t in tensors]}")  # fmt: skip
        for t, s in zip(tensors, sent, strict=True):
            t.copy_(s)

    def synchronize(self, timeout_s: float | None = None) -> None:
        """Nothing to wait for: an exchange is queued on every rank when it returns."""


class _RankThreads:
    """k daemon threads, one per rank; ``run`` hands rank r its task and waits for all."""

    def __init__(self, world_size: int, device: torch.device, timeout_s: float) -> None:
        self.world_size = world_size
        self.device = torch.device(device)
        self.exchange = _Exchange(world_size, timeout_s)
        self.transports = [
            EmulatedTransport(r, self.exchange, self.device) for r in range(world_size)
        ]
        self._tasks = [queue.SimpleQueue() for _ in range(world_size)]
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # one run at a time
        self._threads = [
            threading.Thread(
                target=_serve,
                args=(self._tasks[r], self._done),
                daemon=True,
                name=f"fp4_comm-emulated-rank-{r}",
            )  # fmt: skip
            for r in range(world_size)
        ]
        for t in self._threads:
            t.start()
        weakref.finalize(self, _stop, self._tasks, self._threads)

    def run(self, tasks: Sequence[Callable[[Transport], Any] | None]) -> list[Any]:
        """``tasks[r](transport_r)`` on rank r's thread (None: rank r idles); the results."""
        stream = None
        if self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
        with self._lock:
            started = 0
            for r, task in enumerate(tasks):
                if task is not None:
                    self._tasks[r].put((r, task, self.transports[r], stream, self.exchange))
                    started += 1
            results: list[Any] = [None] * self.world_size
            errors = []
            for _ in range(started):
                r, ok, value = self._done.get()
                if ok:
                    results[r] = value
                else:
                    errors.append((r, value))
            if errors:
                self.exchange.reset()
                # The first rank's own error, not the others' "a rank failed" that it caused.
                errors.sort(key=lambda e: (isinstance(e[1], CommTimeoutError), e[0]))
                raise errors[0][1]
            return results


def _serve(tasks, done):
    while True:
        item = tasks.get()
        if item is None:
            return
        rank, task, transport, stream, exchange = item
        try:
            # Grad mode and the current stream are per thread: a rank computes what the caller
            # would (no autograd graph; its kernels on the caller's stream).
            with torch.no_grad():
                if stream is not None:
                    torch.cuda.set_device(stream.device)
                    with torch.cuda.stream(stream):
                        value = task(transport)
                else:
                    value = task(transport)
            done.put((rank, True, value))
        except BaseException as err:  # noqa: BLE001 - handed to the caller, which raises it
            exchange.abort()  # the ranks waiting for this one stop waiting
            done.put((rank, False, err))


def _stop(task_queues, threads):
    # Stopped and joined before the interpreter finalizes (weakref.finalize runs at exit): a
    # daemon thread still alive then is ended inside torch's C++ code, which aborts the process.
    for q in task_queues:
        q.put(None)
    for t in threads:
        if t is not threading.current_thread():
            t.join(timeout=_JOIN_S)


_POOLS: dict[tuple[int, str], _RankThreads] = {}
_POOLS_LOCK = threading.Lock()


def _pool(world_size: int, device: torch.device) -> _RankThreads:
    key = (world_size, str(device))
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None:
            pool = _POOLS[key] = _RankThreads(world_size, device, DEFAULT_TIMEOUT_S)
        return pool


# ---------------------------------------------------------------------------------- checks


def _check_world_size(world_size, what="world_size"):
    k = check_int(world_size, what, 2**31)
    if k < 1:
        raise ValueError(f"{what} is {k}; it must be >= 1")
    return k


def _check_peers(src, dst, world_size):
    for what, r in (("src", src), ("dst", dst)):
        if isinstance(r, bool) or not isinstance(r, int):
            raise TypeError(f"send_recv: {what}: expected a rank (an int), got {type(r).__name__}")
        if not 0 <= r < world_size:
            raise ValueError(f"send_recv: {what} = {r} is not a rank of 0..{world_size - 1}")
    if src == dst:
        raise ValueError(f"send_recv: src and dst are both {src}; a rank sends to another one")


def check_rank_tensors(op: str, xs: Sequence[torch.Tensor], same_shape: bool = True) -> None:
    """The k ranks' inputs: a list of dense torch tensors of one dtype (float32, bfloat16,
    float16) on one device, holding values (not meta), not 0-d, and (``same_shape``) of one
    shape; ValueError / TypeError naming the rank otherwise.  A lazily negated view passes: the
    functions here read the values it stands for, as a ``Communicator`` does."""
    if isinstance(xs, torch.Tensor) or not isinstance(xs, (list, tuple)) or not xs:
        kind = "a tensor" if isinstance(xs, torch.Tensor) else type(xs).__name__
        raise TypeError(f"{op}: expected a list of the ranks' tensors (one per rank), got {kind}")
    for r, x in enumerate(xs):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{op}: rank {r}'s input is {type(x).__name__}, not a torch tensor")
        check_float_tensor(f"{op}: rank {r}'s input", x)
        if x.is_meta:
            raise ValueError(f"{op}: rank {r}'s input is a meta tensor (no values); pass one "
                             "on a real device")  # fmt: skip
        if x.dim() == 0:
            raise ValueError(f"{op}: rank {r}'s input is 0-d; reshape to (1,)")
    first = xs[0]
    for r, x in enumerate(xs[1:], 1):
        if x.dtype != first.dtype or x.device != first.device:
            raise ValueError(f"{op}: the ranks disagree: rank 0 has {first.dtype} on "
                             f"{first.device}, rank {r} {x.dtype} on {x.device}")  # fmt: skip
        if same_shape and x.shape != first.shape:
            raise ValueError(f"{op}: the ranks disagree: rank 0 has shape {tuple(first.shape)}, "
                             f"rank {r} {tuple(x.shape)}")  # fmt: skip


def check_gather_shards(xs: Sequence[torch.Tensor], total_dim0: int | None) -> int | None:
    """all_gather's shards: equal shapes, or with ``total_dim0`` rank r's d_r = shard_rows
    rows and equal trailing dims."""
    check_rank_tensors("all_gather", xs, same_shape=total_dim0 is None)
    if total_dim0 is None:
        return None
    total_dim0 = check_int(total_dim0, "all_gather: total_dim0", 2**63)
    rows = collectives.shard_rows(total_dim0, len(xs))
    for r, x in enumerate(xs):
        if x.shape[0] != rows[r] or x.shape[1:] != xs[0].shape[1:]:
            raise ValueError(f"all_gather: rank {r} holds shape {tuple(x.shape)}; of "
                             f"total_dim0 = {total_dim0} rows on {len(xs)} ranks it should hold "
                             f"{rows[r]} rows (fp4_comm.shard_rows) and rank 0's trailing dims "
                             f"{tuple(xs[0].shape[1:])}")  # fmt: skip
    return total_dim0


def _options(codec, rounding, seed, step, error_feedback, residuals, world_size, stats):
    check_options(rounding, seed, step, error_feedback, stats)
    codec = get_codec(codec)
    if error_feedback is not None:
        if residuals is None or len(residuals) != world_size:
            raise ValueError(
                f"residuals: error_feedback={error_feedback!r} needs one ErrorFeedback per rank "
                f"({world_size}), got {None if residuals is None else len(residuals)}"
            )
        if not all(isinstance(e, ErrorFeedback) for e in residuals):
            raise TypeError("residuals: expected fp4_comm.ErrorFeedback objects, one per rank")
        if len({id(e) for e in residuals}) != world_size:
            # (the ranks run at once: one object's residuals would be read and written by
            # several ranks, in whatever order their threads take)
            raise ValueError("residuals: one ErrorFeedback object appears for several ranks "
                             "([ErrorFeedback()] * k?); each rank keeps its own: "
                             "[ErrorFeedback() for _ in range(k)]")  # fmt: skip
    elif residuals is not None:
        raise ValueError("residuals are given but no error_feedback buffer name")
    # (a one-element integer tensor is taken as its value; a float, negative or too large one,
    # or None, is refused here: Communicator's device steps do not apply to these functions)
    step = check_int(step, "step", STEP_LIMIT)
    return [
        collectives.Options(
            codec,
            rounding,
            int(seed),
            step,
            None if error_feedback is None else residuals[r],
            error_feedback,
            stats,
        )  # fmt: skip
        for r in range(world_size)
    ]


def _check_transport_name(transport):
    if transport not in _TRANSPORTS:
        raise ValueError(
            f"transport: {transport!r} is not one of 'nccl', 'gloo', 'p2p' (the transport "
            "whose all_reduce_algorithm='auto' choice to follow)"
        )
    return transport


def _run_ranks(collective, xs, opts, stats, *extra):
    """``collective(transport_r, xs[r], opts[r], *extra)`` on every rank's thread: the ranks'
    results (``stats``: and each rank's {hop: HopStats})."""
    pool = _pool(len(xs), xs[0].device)
    xs = [x.resolve_neg() for x in xs]  # a negative view: the values it stands for
    out = pool.run([_bind(collective, x, o, *extra) for x, o in zip(xs, opts, strict=True)])
    if not stats:
        return out
    return out, [collectives.collected_stats(o) for o in opts]


# ------------------------------------------------------------------------ pure functions


def all_reduce(
    xs: Sequence[torch.Tensor],
    codec: CodecSpec = "nvfp4",
    rounding: Rounding = "nearest",
    seed: int = 0,
    step: int = 0,
    error_feedback: str | None = None,
    residuals: Sequence[ErrorFeedback] | None = None,
    stats: bool = False,
    algorithm: str = "auto",
    transport: str = "nccl",
) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[dict[str, HopStats]]]:
    """Every rank's result of ``Communicator.all_reduce`` when rank r passes ``xs[r]`` (same
    options as there; ``step`` explicit; ``error_feedback``: a buffer name, whose residuals are
    ``residuals[r]`` on rank r).  ``stats``: also each rank's {hop: HopStats}.
    ``algorithm``: the communicator's ``all_reduce_algorithm`` ("auto", "one_shot",
    "two_shot"); "auto" chooses as a communicator over ``transport`` ("nccl", "gloo", "p2p")
    would."""
    check_rank_tensors("all_reduce", xs)
    collectives.check_all_reduce_algorithm(algorithm)
    nbytes = xs[0].numel() * xs[0].element_size()
    one_shot_auto = _check_transport_name(transport) == "p2p"
    algorithm = collectives.resolve_all_reduce_algorithm(algorithm, one_shot_auto, len(xs), nbytes)
    opts = _options(codec, rounding, seed, step, error_feedback, residuals, len(xs), stats)
    return _run_ranks(collectives.all_reduce, xs, opts, stats, algorithm)


def reduce_scatter(
    xs: Sequence[torch.Tensor],
    codec: CodecSpec = "nvfp4",
    rounding: Rounding = "nearest",
    seed: int = 0,
    step: int = 0,
    error_feedback: str | None = None,
    residuals: Sequence[ErrorFeedback] | None = None,
    stats: bool = False,
) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[dict[str, HopStats]]]:
    """Every rank's result of ``Communicator.reduce_scatter``: rank r gets its
    ``shard_rows(d0, k)[r]`` rows of the sum."""
    check_rank_tensors("reduce_scatter", xs)
    opts = _options(codec, rounding, seed, step, error_feedback, residuals, len(xs), stats)
    return _run_ranks(collectives.reduce_scatter, xs, opts, stats)


def all_gather(
    xs: Sequence[torch.Tensor],
    codec: CodecSpec = "nvfp4",
    rounding: Rounding = "nearest",
    seed: int = 0,
    step: int = 0,
    stats: bool = False,
    total_dim0: int | None = None,
) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[dict[str, HopStats]]]:
    """Every rank's result of ``Communicator.all_gather`` (``total_dim0``: rank r holds
    ``shard_rows(total_dim0, k)[r]`` rows)."""
    total_dim0 = check_gather_shards(xs, total_dim0)
    opts = _options(codec, rounding, seed, step, None, None, len(xs), stats)
    return _run_ranks(collectives.all_gather, xs, opts, stats, total_dim0)


def send_recv(
    x: torch.Tensor,
    src: int = 0,
    dst: int = 1,
    world_size: int = 2,
    codec: CodecSpec = "nvfp4",
    rounding: Rounding = "nearest",
    seed: int = 0,
    step: int = 0,
    stats: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, dict[str, HopStats]]:
    """What rank ``dst`` receives when rank ``src`` of ``world_size`` sends ``x``
    (``Communicator.send`` / ``recv``; the rounding key is the sender's).  ``stats``: also the
    sender's {hop: HopStats}."""
    world_size = _check_world_size(world_size)
    _check_peers(src, dst, world_size)
    check_rank_tensors("send", [x])
    x = x.resolve_neg()  # a negative view: the values it stands for
    (opts,) = _options(codec, rounding, seed, step, None, None, 1, stats)
    tasks: list[Any] = [None] * world_size
    tasks[src] = lambda t: collectives.send(t, x, dst, opts)
    tasks[dst] = lambda t: collectives.recv(t, tuple(x.shape), x.dtype, src, opts)
    y = _pool(world_size, x.device).run(tasks)[dst]
    return (y, collectives.collected_stats(opts)) if stats else y


def _bind(fn, *args):
    return lambda transport: fn(transport, *args)


# ----------------------------------------------------------------------- stateful group


class EmulatedRanks:
    """k ranks in this process, each with a ``Communicator`` over an ``EmulatedTransport``:
    call counts (the default stochastic-rounding ``step``), error-feedback residuals and
    send counts per rank, as k processes would have them.

    Every method takes the ranks' inputs as a list (rank order) and the options a
    ``Communicator`` call takes, the same for every rank; it returns every rank's result (with
    ``stats=True``, every rank's ``(result, {hop: HopStats})``).  ``comms[r]`` is rank r's
    communicator (``comms[r].error_feedback``, ``state_dict``).

    ``graphs`` ("auto", the default on a CUDA device; "never"): a kind of collective call that a
    ``Communicator`` would replay from a CUDA graph (``fp4_comm.graphs.eligible``: no
    statistics, fp4_comm's own codecs, each rank's input within ``GRAPH_MAX_BYTES``), made
    twice, is captured on its third call with all k ranks in one graph: their threads queue
    every rank's kernels and copies on the capturing stream in the order the exchanges fix, so a
    replay is the whole group's call (the ranks' inputs copied in, one launch, the results
    copied out) and gives the eager bits, at a few launches of host time instead of k eager
    calls and their hand-offs between threads.  Each rank's communicator counts the replayed
    call as its own (its default ``step``).  As for a ``Communicator``'s graphs: stochastic
    rounding reads each rank's step from a tensor the graph owns, written before each replay
    (the eager calls of such a kind pass their steps the same way); a call of another seed than
    captured runs eagerly; a graph whose error-feedback residuals were replaced is dropped.  A
    single rank's call cannot be captured (``EmulatedTransport``).  ``graph_cache``:
    ``(max_graphs, max_bytes)`` as ``Communicator``'s, bounding what each rank's communicator
    would keep: a group graph counts one rank's input (the largest), so the group replays the
    kinds of call its ranks' communicators would, at any k; its pool holds the k ranks' buffers,
    k times one rank's.

    ``all_reduce_algorithm`` as ``Communicator``'s; ``transport`` ("nccl", the default, "gloo"
    or "p2p"): the one whose "auto" choice the ranks follow, so that they compute what
    communicators over it compute."""

    def __init__(
        self,
        world_size: int,
        device: torch.device | str = "cpu",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        graphs: _graphs.Graphs | None = None,
        all_reduce_algorithm: str = "auto",
        transport: str = "nccl",
        graph_cache: tuple[int, int] | None = None,
    ) -> None:
        self.world_size = _check_world_size(world_size)
        check_timeout(timeout_s)  # the communicators' rule: seconds, 1 ms up to timedelta.max
        collectives.check_all_reduce_algorithm(all_reduce_algorithm)
        one_shot_auto = _check_transport_name(transport) == "p2p"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        cuda = self.device.type == "cuda"
        if graphs is None:
            graphs = "auto" if cuda else "never"
        if _graphs.check_graphs(graphs) == "auto" and not cuda:
            raise ValueError(f"graphs='auto' replays CUDA graphs; the emulated ranks are on "
                             f"{self.device}: use graphs='never' (or None)")  # fmt: skip
        self.graphs = graphs
        self._graphed = _graphs.graph_cache(graph_cache)  # kinds replayed from group graphs
        self._kinds: dict[tuple, _GroupEntry] = {}  # kind of call -> its eager count, graph
        self._threads = _RankThreads(self.world_size, self.device, timeout_s)
        for t in self._threads.transports:
            t.one_shot_auto = one_shot_auto
        # No control group: the ranks' agreement is checked here, in one process.  A rank's
        # own communicator never captures (the exchange is host code between the threads);
        # the group's calls are captured whole, above it.
        self.comms = [
            Communicator(t, None, validate="never", graphs="never",
                         all_reduce_algorithm=all_reduce_algorithm)
            for t in self._threads.transports
        ]  # fmt: skip

    def _check_device(self, op, xs):
        if xs[0].device != self.device:
            raise ValueError(f"{op}: the tensors are on {xs[0].device}, the emulated ranks on "
                             f"{self.device}")  # fmt: skip

    def _run(self, op, xs, kwargs, extra=None):
        # the ranks' inputs already checked (check_rank_tensors / check_gather_shards)
        if len(xs) != self.world_size:
            raise ValueError(f"expected one tensor per rank ({self.world_size}), got {len(xs)}")
        self._check_device(op, xs)
        extra = extra or {}
        entry = self._graph_entry(op, xs, kwargs, extra) if self.graphs == "auto" else None
        if entry is not None and entry.replay is not None:
            if self._replay_fits(entry, kwargs):
                return entry.replay.run(xs, self.comms, self._steps(kwargs))
            entry = None  # this call runs eagerly
        per_rank = self._rank_kwargs(entry, kwargs)
        if entry is not None and entry.eager > _graphs.EAGER_CALLS:
            if self._capture(entry, op, xs, per_rank, extra):
                # the capture ran every rank's call (counting it); the replay computes it
                return entry.replay.run(xs, (), None)
        return self._threads.run(
            [
                _method(c, op, x, kw, extra)
                for c, x, kw in zip(self.comms, xs, per_rank, strict=True)
            ]
        )

    def _steps(self, kwargs):
        """Each rank's step of this call: the one given, or its communicator's call count."""
        step = kwargs.get("step")
        return [c._calls % STEP_LIMIT if step is None else step for c in self.comms]

    def _rank_kwargs(self, entry, kwargs):
        """Each rank's options: with its step as a tensor (``graphs.device_step``) for a kind
        that a graph replays with stochastic rounding, as its replays will read it."""
        if entry is None or not entry.random:
            return [kwargs] * self.world_size
        return [dict(kwargs, step=_graphs.device_step(s, self.device))
                for s in self._steps(kwargs)]  # fmt: skip

    def _residuals(self, kwargs):
        """Every rank's error-feedback tensors of this call's buffer (``in_use``)."""
        name = kwargs.get("error_feedback")
        if name is None:
            return ()
        return tuple(t for c in self.comms for t in c.error_feedback.in_use(name))

    def _replay_fits(self, entry, kwargs):
        """As ``Communicator``'s: the captured seed (else eager), the captured residuals (else
        the graph is dropped)."""
        seed, residuals = kwargs.get("seed", 0), self._residuals(kwargs)
        if not self._graphed.ready(entry.kind, entry.replay, seed, residuals):
            return False
        name = kwargs.get("error_feedback")
        for c in self.comms if name is not None else ():
            c.error_feedback.resume(name)
        return True

    # -- group graphs (the class docstring says which calls)

    def _graph_entry(self, op, xs, kwargs, extra):
        """The entry of this kind of call if it may be replayed from a group graph (counting
        its eager calls), else None."""
        if torch.cuda.is_current_stream_capturing():
            return None  # the caller's own capture takes the eager calls
        codec, rounding = kwargs.get("codec", "nvfp4"), kwargs.get("rounding", "nearest")
        ef_name, stats = kwargs.get("error_feedback"), kwargs.get("stats", False)
        try:
            kind = (op, codec, rounding, ef_name, stats, extra.get("total_dim0"),
                    tuple(x.shape for x in xs), xs[0].dtype)  # fmt: skip
            entry = self._kinds.get(kind)
        except TypeError:  # a codec object that cannot be hashed: never replayed
            return None
        if entry is None:
            try:
                c = get_codec(codec)
                ok = _graphs.eligible(c, rounding, ef_name, stats, _rank_bytes(xs))
            except (TypeError, ValueError):
                ok = False  # the eager call names what is wrong
            random = ok and _graphs.draws_random_words(c, rounding)
            entry = self._kinds[kind] = _GroupEntry(kind, ok, random)
            return None  # the first call runs eagerly (and checks the arguments)
        if not entry.graphable:
            return None
        check_options(rounding, kwargs.get("seed", 0), kwargs.get("step"), ef_name, stats)
        if entry.replay is None:
            entry.eager += 1  # beyond EAGER_CALLS: this call captures
        return entry

    def _capture(self, entry, op, xs, per_rank, extra):
        """Capture the group's call of ``entry``'s kind (``per_rank``: each rank's options);
        False (the kind stays eager, with a warning) where the capture fails."""
        shapes, dtype = [tuple(x.shape) for x in xs], xs[0].dtype

        def run(statics):
            tasks = [_method(c, op, x, kw, extra)
                     for c, x, kw in zip(self.comms, statics, per_rank, strict=True)]  # fmt: skip
            return self._threads.run(tasks)

        try:
            graph, statics, outs = _graphs.capture_group(run, self.device, shapes, dtype)
        except Exception as err:  # noqa: BLE001 - any capture failure: this kind stays eager
            entry.graphable = False
            warnings.warn(f"fp4_comm: the emulated ranks' {op} could not be captured in a CUDA "
                          f"graph ({err}); calls of its kind run eagerly", RuntimeWarning,
                          stacklevel=4)  # fmt: skip
            return False
        nbytes = _rank_bytes(statics)
        steps = [kw["step"] for kw in per_rank] if entry.random else None  # the graph's own
        # The plans the ranks' calls ran in the capture (each communicator's most recent: its
        # call was the last): the graph reads and writes their buffers on every replay, and a
        # communicator drops plans beyond its cache's bound, whose buffers would go back to the
        # allocator while the graph still used them.  The replay holds them.
        plans = [next(reversed(c._plans.values()), None) for c in self.comms]
        entry.replay = _GroupReplay(graph, statics, outs, nbytes, steps, per_rank[0].get("seed", 0),
                                    self._residuals(per_rank[0]), plans)  # fmt: skip
        self._graphed.keep(entry.kind, entry)
        return entry.replay is not None  # a graph bigger than the cache's bound is dropped

    def all_reduce(self, xs: Sequence[torch.Tensor], **kwargs: Any) -> list[Any]:
        """Every rank's ``Communicator.all_reduce(xs[r], **kwargs)``."""
        check_rank_tensors("all_reduce", xs)
        return self._run("all_reduce", xs, kwargs)

    def reduce_scatter(self, xs: Sequence[torch.Tensor], **kwargs: Any) -> list[Any]:
        """Every rank's ``Communicator.reduce_scatter(xs[r], **kwargs)``."""
        check_rank_tensors("reduce_scatter", xs)
        return self._run("reduce_scatter", xs, kwargs)

    def all_gather(
        self, xs: Sequence[torch.Tensor], total_dim0: int | None = None, **kwargs: Any
    ) -> list[Any]:
        """Every rank's ``Communicator.all_gather(xs[r], total_dim0=total_dim0, **kwargs)``."""
        total_dim0 = check_gather_shards(xs, total_dim0)
        return self._run("all_gather", xs, kwargs, {"total_dim0": total_dim0})

    def send_recv(self, x: torch.Tensor, src: int, dst: int, **kwargs: Any) -> Any:
        """Rank ``src``'s ``Communicator.send(x, dst, **kwargs)`` and rank ``dst``'s ``recv``
        (of the same codec): what ``dst`` receives (with ``stats=True``: and the sender's
        {hop: HopStats}).  ``step`` None (the default): the sender's count of sends, as
        ``Communicator.send`` says."""
        check_rank_tensors("send", [x])
        self._check_device("send", [x])
        _check_peers(src, dst, self.world_size)
        # the options are bound here, not on the sender's thread: a wrong keyword raised
        # there would leave the receiver waiting for its message until the timeout
        try:
            inspect.signature(Communicator.send).bind(None, x, dst, **kwargs)
        except TypeError as err:
            raise TypeError(f"EmulatedRanks.send_recv: {err}; the options are "
                            "Communicator.send's") from None  # fmt: skip
        codec = kwargs.get("codec", "nvfp4")
        tasks: list[Any] = [None] * self.world_size
        tasks[src] = lambda _: self.comms[src].send(x, dst, **kwargs)
        tasks[dst] = lambda _: self.comms[dst].recv(tuple(x.shape), x.dtype, src, codec=codec)
        out = self._threads.run(tasks)
        if kwargs.get("stats", False):
            return out[dst], out[src][1]
        return out[dst]


class _GroupEntry:
    """A kind of group call: whether it may be replayed, its eager calls, its graph."""

    __slots__ = ("kind", "graphable", "random", "eager", "replay")

    def __init__(self, kind, graphable, random=False):
        self.kind, self.graphable, self.eager, self.replay = kind, graphable, 1, None
        self.random = random  # its encodes draw random words (``graphs.draws_random_words``)


class _GroupReplay:
    """The k ranks' call in one CUDA graph: ``run(xs, comms, steps)`` writes each rank's step
    into the graph's step tensors (stochastic rounding; ``steps`` None: already there), copies
    each rank's input in, replays on the current stream (after the last replay's stream, whose
    buffers it shares), counts the call on every rank's communicator as its eager call would,
    and returns copies of the ranks' results.  ``seed`` and ``residuals``: what the graph was
    captured with (``fits``, ``Communicator``'s graphs); ``plans``: the ranks' plan entries
    the graph ran, kept alive with it."""

    __slots__ = ("graph", "inputs", "outputs", "nbytes", "steps", "seed", "residuals",
                 "plans", "_stream")  # fmt: skip

    def __init__(self, graph, inputs, outputs, nbytes, steps=None, seed=0, residuals=(),
                 plans=()):  # fmt: skip
        self.graph, self.inputs, self.outputs, self.nbytes = graph, inputs, outputs, nbytes
        self.steps, self.seed, self.residuals = steps, seed, residuals
        self.plans = plans  # the ranks' plans the graph ran: their buffers live as long as it
        self._stream = None

    def fits(self, seed):
        return self.steps is None or seed == self.seed

    def run(self, xs, comms, steps):
        stream = torch.cuda.current_stream(self.inputs[0].device)
        if self._stream is not None and stream != self._stream:
            stream.wait_stream(self._stream)
        self._stream = stream
        if self.steps is not None and steps is not None:
            for target, step in zip(self.steps, steps, strict=True):
                _graphs.write_step(target, step)
        for static, x in zip(self.inputs, xs, strict=True):
            static.copy_(x)
        self.graph.replay()
        for comm in comms:
            comm._calls += 1
        return [y.clone() for y in self.outputs]


def _rank_bytes(xs):
    """The bytes of the largest of the ranks' inputs ``xs``: what a group call stands for in
    the graph bounds, which bound each rank's communicator."""
    return max(x.numel() for x in xs) * xs[0].element_size()


def _method(comm, op, x, kwargs, extra):
    fn = getattr(comm, op)
    return lambda _: fn(x, **kwargs, **extra)


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "EmulatedRanks",
    "EmulatedTransport",
    "all_gather",
    "all_reduce",
    "check_gather_shards",
    "check_rank_tensors",
    "reduce_scatter",
    "send_recv",
]
