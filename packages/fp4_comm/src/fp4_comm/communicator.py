"""``Communicator``: compressed collectives on torch tensors and CuPy arrays.

One communicator per process group: NCCL (through CuPy) for CUDA tensors, gloo for CPU tensors.
Both run the same algorithms (``collectives.py``).  Before the data moves, the ranks compare
what each was asked to do (operation, shape, dtype, codec, rounding, and how many collectives
each has made) over a gloo group with a timeout, so a mismatch raises ValueError on every rank
and a missing rank raises CommTimeoutError, instead of NCCL hanging or reading garbage.  That
check is a small host-side exchange between the processes (no GPU synchronization); on NCCL,
``validate="first"`` does it once per distinct call and ``"never"`` not at all (needed under
CUDA-graph capture); over gloo every call is checked (``GlooTransport`` says why).
"""

from __future__ import annotations

import datetime
import operator
import sys
import warnings
import zlib
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from contextlib import nullcontext
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist

from . import collectives, graphs as _graphs
from ._transport import (
    CommPeerError,
    CommTimeoutError,
    GlooTransport,
    Transport,
    all_gather_into,
    check_timeout as _check_timeout,
    reraise_peer_error,
)
from .codecs import (
    SEED_LIMIT,
    STEP_LIMIT,
    CodecSpec,
    Rounding,
    check_float_tensor,
    check_int,
    check_rounding,
    get_codec,
)
from .devices import local_device
from .error_feedback import ErrorFeedback
from .graphs import Graphs
from .stats import HopStats

#: A torch tensor, or a CuPy array (the result is then a CuPy array, queued on CuPy's current
#: stream).
TensorLike = Any
#: A torch.device, a device string ("cuda:1", "cpu") or a CUDA device index.
DeviceLike = torch.device | str | int
Validate = Literal["always", "first", "never"]
TransportName = Literal["nccl", "gloo", "p2p"]
AllReduceAlgorithm = Literal["auto", "one_shot", "two_shot"]

VALIDATE = ("always", "first", "never")
_OPS = {
    "all_reduce": 1,
    "reduce_scatter": 2,
    "all_gather": 3,
    "send": 4,
    "recv": 4,
    "all_reduce_one_shot": 5,
}
_DTYPES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
# Kinds of call whose plans a communicator keeps (least recently used dropped first).
PLAN_CACHE_SIZE = 64
STRIDED = torch.strided  # the one layout a kept plan takes (sparse, mkldnn: the full checks)
# Signature: op, dtype, codec, rounding, call, ndim, numel, then the shape (up to _MAX_DIMS
# dims; beyond, the first _MAX_DIMS - 1 and -1), then a CRC of the whole shape, so that shapes
# of more dims that differ only after the first ones differ too.  "call" is the number of
# collectives the communicator was asked for before this one (-1 for send / recv): ranks that
# disagree on it are out of step (one of them failed or skipped a call that the others made).
_MAX_DIMS = 8
_SIG_LEN = 8 + _MAX_DIMS
_CALL = 4


def _crc(s: str) -> int:
    return zlib.crc32(s.encode())


def check_options(
    rounding: Rounding,
    seed: int,
    step: int | None = None,
    error_feedback: str | None = None,
    stats: bool = False,
) -> None:
    """The collectives' options that need no tensor: ValueError / TypeError naming the argument
    (before anything moves, so a bad option on every rank leaves the group in step)."""
    check_rounding(rounding)
    check_int(seed, "seed", SEED_LIMIT)
    if step is not None and not isinstance(step, torch.Tensor):  # a tensor: Communicator's
        check_int(step, "step", STEP_LIMIT)
    if error_feedback is not None and not isinstance(error_feedback, str):
        raise TypeError(
            f"error_feedback: a buffer name (str) or None, got {type(error_feedback).__name__}"
        )
    if error_feedback == "":
        raise ValueError("error_feedback: '' names no buffer; give a name, or None for none")
    if not isinstance(stats, bool):
        raise TypeError(f"stats: True or False (True: also return the {{hop: HopStats}}), got "
                        f"{type(stats).__name__} (a list of WireStats is what "
                        "fp4_comm.tensor_parallel's and emulated's functions take)")  # fmt: skip


class Communicator:
    """FP4-compressed collectives among the ranks of a torch.distributed group.

    Make one with ``Communicator.from_process_group`` (or ``from_env`` under torchrun); every
    rank of the group must do so (it is collective).  Calls are collective too: every rank calls
    the same collectives in the same order.

    Arguments every collective takes:

    - ``codec``: "nvfp4", "mxfp4", "none" (bfloat16 values: the baseline through the same
      path), "none-float32", "none-float16", or a ``Codec`` instance (``fp4_comm.codecs``).
    - ``rounding``: "nearest" or "stochastic" (FP4 codecs; each rank and hop draws its own
      random words, keyed by ``seed``, rank and hop, at counter ``step``).  The "none" codecs
      cast, rounding to nearest even, whatever ``rounding`` says: it is checked, not used.
    - ``seed``: an int, 0 <= seed < 2^64.  ``step``: the stochastic-rounding counter, an int,
      0 <= step < 2^32; default: the number of collectives this communicator has run, modulo
      2^32 (the same on every rank).  Out of range or not an int: ValueError / TypeError, as
      ``fp4_kernels.quantize`` says.  Or a one-element int64 tensor on the communicator's
      device holding it, which the encode kernels read when they run (its value is not
      checked: the kernels take its low 32 bits): a step that a CUDA graph's replays change.
    - ``error_feedback``: a buffer name (reduce_scatter, all_reduce): the residual of each
      quantization of that buffer is added before its next one (``comm.error_feedback``; a
      block that held NaN or Inf starts again from residual 0).
    - ``stats``: True: also return {hop: HopStats} (SQNR, clipped and zeroed fractions) of this
      rank.  True or False: anything else is a TypeError.

    Non-finite input: a NaN or Inf makes its codec block NaN in the result, on every rank (FP4
    codecs; the other blocks are unaffected), or goes through as IEEE arithmetic says
    ("none" codecs).  A peer that is gone raises ``CommPeerError``: ``CommTimeoutError`` when
    it did not come in time, ``CommConnectionError`` when its connection closed.

    ``graphs``: "auto" replays a kind of call made twice from a CUDA graph captured on its third
    call (the same bits, a few microseconds of host time: ``fp4_comm.graphs`` says which calls
    qualify, and the memory the graphs keep), "never" runs every call eagerly.  Default: "auto"
    on CUDA transports (NCCL, p2p), "never" over gloo and between the emulated ranks of
    ``fp4_comm.reference`` (which no graph can capture).  ``graph_cache``: ``(max_graphs,
    max_bytes)``, the most graphs kept and the input bytes they stand for together (default:
    ``(fp4_comm.graphs.GRAPH_CACHE_SIZE, GRAPH_CACHE_BYTES)``, 8 graphs, 512 MiB; least recently
    used dropped first, its kind eager from then on); each error-feedback name is a kind of its
    own, so a model with error feedback at every layer needs a place for each call site.

    ``all_reduce_algorithm``: "two_shot" (reduce-scatter, requantize the sum, all-gather),
    "one_shot" (every rank gathers every rank's encoded input and adds them: one quantization,
    so other bits than two-shot's; W times the bytes received), or "auto" (default): one-shot
    on the p2p transport for at most 4 ranks and inputs of at most 512 KiB, two-shot otherwise
    (``fp4_comm.collectives``).  Both run over every transport; every rank must choose the
    same (the ranks' check compares the algorithm an all-reduce resolves to).
    """

    def __init__(
        self,
        transport: Transport,
        control_group: dist.ProcessGroup | None = None,
        validate: Validate = "always",
        graphs: Graphs | None = None,
        all_reduce_algorithm: AllReduceAlgorithm = "auto",
        graph_cache: tuple[int, int] | None = None,
    ) -> None:
        if validate not in VALIDATE:
            raise ValueError(f"validate: {validate!r} is not one of {VALIDATE}")
        self.transport = transport
        self._graphed = _graphs.graph_cache(graph_cache)  # kinds of call replayed from graphs
        self._plans: OrderedDict[tuple, _PlanEntry] = OrderedDict()  # kind of call -> plan
        self.all_reduce_algorithm = all_reduce_algorithm  # (checked by the setters)
        self.graphs = graphs
        if control_group is None and isinstance(transport, GlooTransport):
            # gloo needs every call checked (GlooTransport): over its own group where no
            # other is given.
            control_group = dist.group.WORLD if transport.group is None else transport.group
        self.control_group = control_group
        self.validate = validate
        self.error_feedback = ErrorFeedback()
        self._validated: set[tuple] = set()
        self._calls = 0  # collectives made: the default stochastic-rounding step
        self._sends = 0

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_process_group(
        cls,
        group: dist.ProcessGroup | None = None,
        device: DeviceLike | None = None,
        timeout_s: float = 60.0,
        validate: Validate = "always",
        transport: TransportName | None = None,
        graphs: Graphs | None = None,
        all_reduce_algorithm: AllReduceAlgorithm = "auto",
        graph_cache: tuple[int, int] | None = None,
    ) -> Communicator:
        """A communicator over the ranks of ``group`` (default: the default group).

        ``device``: a CUDA device (this rank's GPU) for an NCCL communicator through CuPy, or
        "cpu" (default when CUDA is unavailable) for gloo.  ``timeout_s`` bounds every check
        and every gloo transfer (at least 1 ms: torch.distributed counts whole milliseconds);
        NCCL transfers are bounded by ``synchronize`` and by a watchdog thread that aborts the
        NCCL communicator when a transfer is not done in time.
        ``transport``: "nccl" (default for a CUDA device), "gloo" (for "cpu"), or "p2p": CUDA
        tensors moved by fp4_comm's own kernel through CUDA IPC buffers, for ranks on one node
        whose GPUs can map each other's memory (``fp4_comm.p2p``; ValueError on every rank
        where they cannot).  ``graphs``, ``all_reduce_algorithm`` and ``graph_cache``: as in the
        constructor.
        """
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialized: call dist.init_process_group first, or "
                "use Communicator.from_env() under torchrun"
            )
        if validate not in VALIDATE:
            raise ValueError(f"validate: {validate!r} is not one of {VALIDATE}")
        if graphs is not None:
            _graphs.check_graphs(graphs)
        collectives.check_all_reduce_algorithm(all_reduce_algorithm)
        _graphs.graph_cache(graph_cache)  # checked before the group is made
        _check_timeout(timeout_s)
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if torch.cuda.is_available() and transport != "gloo"
                else torch.device("cpu")
            )
        device = torch.device(device)
        _check_transport(transport, device)
        timeout = datetime.timedelta(seconds=timeout_s)
        ranks = None if group is None else dist.get_process_group_ranks(group)
        # Our own gloo group: its timeout is ours, and the checks never queue behind (or
        # deadlock with) the caller's traffic on an NCCL default group.
        # Local synchronization: only the group's members take part in making it, so a
        # communicator over a subgroup needs nothing from the other ranks.
        control = dist.new_group(
            ranks=ranks, backend="gloo", timeout=timeout, use_local_synchronization=True
        )
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if transport == "p2p":
            from .p2p import P2PTransport

            mover: Transport = P2PTransport(control, device, timeout_s)
        elif device.type == "cuda":
            from .nccl import NcclTransport

            mover = NcclTransport(control, device, timeout_s)
        elif device.type == "cpu":
            mover = GlooTransport(control)
        else:
            raise ValueError(f"device: {device} is neither a CUDA device nor the CPU")
        return cls(mover, control, validate, graphs, all_reduce_algorithm, graph_cache)

    @classmethod
    def from_env(
        cls,
        device: DeviceLike | None = None,
        timeout_s: float = 60.0,
        validate: Validate = "always",
        transport: TransportName | None = None,
        graphs: Graphs | None = None,
        all_reduce_algorithm: AllReduceAlgorithm = "auto",
        graph_cache: tuple[int, int] | None = None,
    ) -> Communicator:
        """Under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT): initialize
        torch.distributed with gloo if nobody did (env:// rendezvous through the TCPStore), and
        make a communicator on GPU ``LOCAL_RANK % torch.cuda.device_count()`` (``local_device``:
        ranks share GPUs where there are more than GPUs), or on the CPU where there is no CUDA.
        ``transport``, ``graphs``, ``all_reduce_algorithm`` and ``graph_cache`` as in
        ``from_process_group``."""
        _check_timeout(timeout_s)
        if not dist.is_initialized():
            dist.init_process_group(
                backend="gloo", init_method="env://", timeout=datetime.timedelta(seconds=timeout_s)
            )
        if device is None and torch.cuda.is_available():
            device = local_device()
            torch.cuda.set_device(device)
        collectives.check_all_reduce_algorithm(all_reduce_algorithm)
        return cls.from_process_group(
            None, device, timeout_s, validate, transport, graphs, all_reduce_algorithm, graph_cache
        )

    # ------------------------------------------------------------------ properties

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return self.transport.rank

    @property
    def world_size(self) -> int:
        """The number of ranks in the group."""
        return self.transport.world_size

    @property
    def device(self) -> torch.device:
        """Where the tensors of this communicator live (this rank's GPU, or the CPU)."""
        return self.transport.device

    def synchronize(self, timeout_s: float | None = None) -> None:
        """Wait until this rank's queued transfers are done; CommTimeoutError (and, for NCCL,
        an aborted communicator) if they are not within the timeout."""
        if timeout_s is not None:
            _check_timeout(timeout_s)
        self.transport.synchronize(timeout_s)

    @property
    def graphs(self) -> Graphs:
        """ "auto" or "never" (the class doc); set it to change how the calls after run: the
        value is checked, and the kept plans, which were made under the old one, go."""
        return self._graphs_setting

    @graphs.setter
    def graphs(self, graphs: Graphs | None) -> None:
        transport = self.transport
        if graphs is None:
            graphs = _graphs.default_graphs(transport)
        _graphs.check_graphs(graphs)
        if graphs == "auto" and transport.always_validate:
            raise ValueError(
                "graphs='auto' replays CUDA graphs; this transport (gloo) moves CPU tensors and "
                "checks every call: use graphs='never' (or None, the default)"
            )
        if graphs == "auto" and not transport.graph_capturable:
            raise ValueError(
                f"graphs='auto' replays CUDA graphs; {type(transport).__name__} cannot be "
                "captured in one: use graphs='never' (or None, the default)"
            )
        self._graphs_setting = graphs
        self._drop_plans()

    @property
    def all_reduce_algorithm(self) -> AllReduceAlgorithm:
        """ "auto", "one_shot" or "two_shot" (the class doc); set it (on every rank alike) to
        change the all-reduces after: the value is checked, and the kept plans, whose
        all-reduces were planned with the old one, go."""
        return self._all_reduce_algorithm

    @all_reduce_algorithm.setter
    def all_reduce_algorithm(self, algorithm: AllReduceAlgorithm) -> None:
        collectives.check_all_reduce_algorithm(algorithm)
        self._all_reduce_algorithm = algorithm
        self._drop_plans()

    def _drop_plans(self):
        """Forget the kept plans (and their graphs, which go first: they hold the plans'
        buffers)."""
        self._graphed.clear()
        self._plans.clear()

    def close(self) -> None:
        """Stop the NCCL watchdog and destroy the NCCL communicator (nothing to release over
        gloo), and drop the plans and the buffers they keep; no collective may follow on an
        NCCL communicator.  A p2p communicator's close is collective: every rank waits for its
        kernels, the ranks meet, and the buffers go.  The CUDA graphs go first (they hold
        the transport's resources)."""
        self._drop_plans()  # and with them the buffers they keep
        close = getattr(self.transport, "close", None)
        if close is not None:
            close()

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """What a resumed run needs to continue with the same bits: the error-feedback
        residuals (``ErrorFeedback.state_dict``) and the call counters that give the default
        stochastic-rounding ``step`` and that the ranks compare, with the rank and world size
        that saved it.  Each rank saves its own (the residuals differ across ranks)."""
        return {
            "calls": self._calls,
            "sends": self._sends,
            "error_feedback": self.error_feedback.state_dict(),
            "rank": self.rank,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state_dict()`` of this rank (every rank of the group loads its own:
        another rank's state, or one of a group of another size, is refused).  A state saved
        without its rank and world size (an older release) is taken as this rank's."""
        keys = {"calls", "sends", "error_feedback"}
        if not isinstance(state, dict) or set(state) not in (keys, keys | {"rank", "world_size"}):
            got = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                "Communicator.load_state_dict: expected the keys 'calls', 'sends', "
                f"'error_feedback', 'rank' and 'world_size' (Communicator.state_dict()), got {got}"
            )
        if "rank" in state:
            rank = check_int(state["rank"], "rank", 2**31)
            world = check_int(state["world_size"], "world_size", 2**31)
            if (rank, world) != (self.rank, self.world_size):
                raise ValueError(
                    f"Communicator.load_state_dict: the state of rank {rank} of {world}, on "
                    f"rank {self.rank} of {self.world_size}; each rank loads the state it saved "
                    "(its residuals are its own)"
                )
        calls = check_int(state["calls"], "calls", 2**63)
        sends = check_int(state["sends"], "sends", 2**63)
        self.error_feedback.load_state_dict(state["error_feedback"])
        self._calls, self._sends = calls, sends

    # ------------------------------------------------------------------ collectives

    def all_reduce(
        self,
        x: TensorLike,
        codec: CodecSpec = "nvfp4",
        rounding: Rounding = "nearest",
        seed: int = 0,
        step: int | None = None,
        error_feedback: str | None = None,
        stats: bool = False,
    ) -> TensorLike | tuple[TensorLike, dict[str, HopStats]]:
        """Sum of ``x`` over the ranks: same shape and dtype as ``x``, the same bits on every
        rank.  Any size (zeros pad it to whole blocks).  One-shot or two-shot as the
        communicator's ``all_reduce_algorithm`` says (their bits differ where the codec loses
        information: ``fp4_comm.collectives``)."""
        return self._run("all_reduce", x, codec, rounding, seed, step, error_feedback, stats)

    def reduce_scatter(
        self,
        x: TensorLike,
        codec: CodecSpec = "nvfp4",
        rounding: Rounding = "nearest",
        seed: int = 0,
        step: int | None = None,
        error_feedback: str | None = None,
        stats: bool = False,
    ) -> TensorLike | tuple[TensorLike, dict[str, HopStats]]:
        """``x`` (d0, ...) -> (d_r, ...): rank r gets the sum over ranks of rows
        [r m, r m + d_r), m = ceil(d0 / W), d_r = ``shard_rows(d0, W)[r]`` (m, or fewer or none
        on the last ranks), decoded once and added in float32 (no requantization).  That is
        ``torch.distributed.reduce_scatter_tensor`` of x zero-padded to W m rows, with the
        padding rows dropped; for d0 a multiple of W, exactly its split (d0 / W rows each)."""
        return self._run("reduce_scatter", x, codec, rounding, seed, step, error_feedback, stats)

    def all_gather(
        self,
        x: TensorLike,
        codec: CodecSpec = "nvfp4",
        rounding: Rounding = "nearest",
        seed: int = 0,
        step: int | None = None,
        stats: bool = False,
        total_dim0: int | None = None,
    ) -> TensorLike | tuple[TensorLike, dict[str, HopStats]]:
        """``x`` (d0, ...) -> (W * d0, ...): the ranks' tensors along dim 0, decoded.

        ``total_dim0``: the inverse of ``reduce_scatter``'s split of a (total_dim0, ...)
        tensor: rank r passes its d_r = ``shard_rows(total_dim0, W)[r]`` rows (trailing dims
        equal on every rank) and every rank gets the (total_dim0, ...) tensor."""
        return self._run("all_gather", x, codec, rounding, seed, step, None, stats,
                         total_dim0=total_dim0)  # fmt: skip

    def send(
        self,
        x: TensorLike,
        dst: int,
        codec: CodecSpec = "nvfp4",
        rounding: Rounding = "nearest",
        seed: int = 0,
        step: int | None = None,
        stats: bool = False,
    ) -> tuple[None, dict[str, HopStats]] | None:
        """Send ``x`` encoded to rank ``dst``, which calls ``recv`` with its shape and dtype.
        ``step`` defaults to the number of sends this rank has made (only the sender draws
        random words; the receiver needs no step)."""
        return self._run("send", x, codec, rounding, seed, step, None, stats, peer=dst)

    def recv(
        self,
        shape: Sequence[int],
        dtype: torch.dtype | str | np.dtype,
        src: int,
        codec: CodecSpec = "nvfp4",
        like: TensorLike | None = None,
    ) -> TensorLike:
        """Receive a tensor of ``shape`` and ``dtype`` that rank ``src`` sent with ``send``.
        ``like``: a tensor or CuPy array whose kind and stream the result follows (default: a
        torch tensor on this communicator's device)."""
        kind = ("recv", shape, dtype, src, codec)
        entry = self._planned(kind) if like is None and type(src) is int else None
        if entry is not None and not all(type(d) is int for d in shape):
            entry = None  # a float or bool equal to an int hashes as it: the checks name it
        if entry is not None:
            plan = entry.plan
            if self._needs_check(entry):
                self._validate_p2p("recv", plan.shape, plan.dtype, plan.codec, "nearest", src)
                entry.validated = entry.validated or self._validated_for_good()
            opts = collectives.Options(plan.codec)
            try:
                if entry.graphable and self._graph_ready(entry, kind, "recv", None, opts, src):
                    return entry.replay.replay(self.transport)
                return plan.run(self.transport, opts, src)
            except CommPeerError as err:
                _reraise_with_op(err, "recv")
        shape = _shape(shape, "recv: shape")
        dtype = _torch_dtype(dtype, "recv")
        opts = collectives.Options(get_codec(codec))
        src = self._check_peer(src, "recv: src")
        with _stream_of(like) as back:
            self._validate_p2p("recv", shape, dtype, opts.codec, "nearest", src)
            plan = collectives.RecvPlan(self.transport, opts, shape, dtype)
            if like is None:
                nbytes = _numel(shape) * dtype.itemsize
                self._keep_plan(kind, plan, (opts.codec, "nearest", None, False, nbytes))
            try:
                y = plan.run(self.transport, opts, src)
            except CommPeerError as err:
                _reraise_with_op(err, "recv")
            return back(y)

    def capture(
        self,
        op: Literal["all_reduce", "reduce_scatter", "all_gather"],
        x: torch.Tensor,
        **kwargs: Any,
    ) -> CapturedCollective:
        """Capture the collective ``op`` ("all_reduce", "reduce_scatter", "all_gather") of the
        CUDA tensor ``x`` in a CUDA graph: ``replay()`` then reruns it on whatever ``x`` holds,
        for a few microseconds of host time, and returns the same ``output`` tensor.

        Collective: every rank captures the same ops in the same order, and replays them in
        the same order.  A warm-up call first (it compiles the kernels and checks the
        arguments across ranks); the capture itself skips the check.  ``step`` is fixed at
        capture (stochastic rounding draws the same words on every replay) unless it is a
        one-element int64 tensor, which every replay reads (write the next step into it
        before a replay); error-feedback residuals are updated in place by replays.
        """
        return CapturedCollective(self, op, x, kwargs)

    # ------------------------------------------------------------------ plumbing

    def _run(self, op, x, codec, rounding, seed, step, ef_name, stats, peer=None,
             total_dim0=None):  # fmt: skip
        # Every call counts, also one that fails its argument checks below: a rank that fails
        # alone is then a call behind, and its next call meets the others' current one with
        # another call number (ValueError on every rank) instead of pairing with it.
        # Collectives only: every rank makes them, so the default step stays the same on every
        # rank (a send/recv involves two ranks and would put the others behind).
        if peer is None:
            call = self._calls
            self._calls += 1
        else:
            call = -1
            default_step = self._sends
            self._sends += 1
        kind = None
        if type(x) is torch.Tensor and x.layout is STRIDED and not (x.is_nested or x.is_neg()):
            # A torch tensor in a kind of call made before: its plan, if the per-call values
            # are plain ints in range (anything else goes the full way, which checks it).
            kind = (op, codec, rounding, ef_name, stats, peer, total_dim0, x.shape, x.dtype,
                    x.device)  # fmt: skip
            entry = self._planned(kind)
            if (
                entry is not None
                and type(seed) is int
                and 0 <= seed < SEED_LIMIT
                and (
                    step is None
                    or (type(step) is int and 0 <= step < STEP_LIMIT)
                    or self._is_step_tensor(step)
                )
                and (peer is None or type(peer) is int)
                and (total_dim0 is None or type(total_dim0) is int)
                and type(stats) is bool
            ):
                if step is None:
                    step = (call if peer is None else default_step) % STEP_LIMIT
                return self._run_planned(entry, kind, op, x, rounding, seed, step, ef_name,
                                         stats, peer, total_dim0, call)  # fmt: skip
        codec = get_codec(codec)
        check_options(rounding, seed, step, ef_name, stats)
        seed = operator.index(seed)
        if step is None:
            step = (call if peer is None else default_step) % STEP_LIMIT
        elif isinstance(step, torch.Tensor):
            self._check_step_tensor(step)
        else:
            step = operator.index(step)
        if peer is not None:
            peer = self._check_peer(peer, f"{op}: dst")
        if total_dim0 is not None:
            total_dim0 = check_int(total_dim0, "all_gather: total_dim0", 2**63)
        with _stream_of(x) as back:
            t = back.tensor
            self._check_input(op, t)
            t = t.resolve_neg()  # a negative view: the values it stands for
            plan_class = self._plan_class(op, t)
            self._validate_call(plan_class.check_op or op, t, codec, rounding, peer, total_dim0,
                                call)  # fmt: skip
            opts = collectives.Options(
                codec, rounding, seed, step, self.error_feedback if ef_name else None,
                ef_name, stats,
            )  # fmt: skip
            extra = (total_dim0,) if op == "all_gather" else ()
            plan = plan_class(self.transport, opts, t.shape, t.dtype, *extra)
            if kind is not None:  # (CuPy arrays, negative views and the like: not kept)
                nbytes = t.numel() * t.element_size()
                self._keep_plan(kind, plan, (codec, rounding, ef_name, stats, nbytes))
            try:
                if op == "send":
                    plan.run(self.transport, t, opts, peer)
                    out = None
                else:
                    out = back(plan.run(self.transport, t, opts))
            except CommPeerError as err:
                _reraise_with_op(err, op)
            if stats:
                return out, collectives.collected_stats(opts)
            return out

    def _check_step_tensor(self, step):
        if not self._is_step_tensor(step):
            raise ValueError(
                f"step: a tensor step must be a one-element int64 tensor on {self.device}, "
                f"got {step.dtype} of shape {tuple(step.shape)} on {step.device}"
            )

    def _is_step_tensor(self, step):
        return (
            type(step) is torch.Tensor
            and step.dtype == torch.int64
            and step.numel() == 1
            and step.device == self.device
        )

    # -- plans: the host work of a kind of call done once (collectives.py)

    def _plan_class(self, op, t):
        """The plan of ``op`` on ``t``: all_reduce's as ``all_reduce_algorithm`` says."""
        if op != "all_reduce":
            return collectives.PLANS[op]
        nbytes = t.numel() * t.element_size()
        return collectives.all_reduce_plan(self.all_reduce_algorithm, self.transport, nbytes)

    def _planned(self, kind):
        """The kept plan of this kind of call, or None (also for arguments that cannot be
        hashed: the checks of the full path name them)."""
        try:
            entry = self._plans.get(kind)
        except TypeError:
            return None
        if entry is not None:
            self._plans.move_to_end(kind)
        return entry

    def _keep_plan(self, kind, plan, call):
        """Keep ``plan`` for ``kind``; ``call``: (codec, rounding, error feedback name, stats,
        input bytes), which say whether the kind may be replayed from a graph."""
        graphable = self.graphs == "auto" and _graphs.eligible(*call)
        try:
            self._graphed.drop(kind)  # a graph of a plan made again goes with the old plan
            self._plans[kind] = _PlanEntry(plan, self._validated_for_good(), graphable)
        except TypeError:
            return
        # where graphs replay, room for a plan per graph the cache may keep: a kind whose plan
        # goes loses its graph, and with more kinds than plans they would cycle (captured,
        # dropped, captured again: each site of error feedback is a kind)
        bound = PLAN_CACHE_SIZE
        if self.graphs == "auto":
            bound = max(bound, self._graphed.max_graphs)
        while len(self._plans) > bound:
            self._graphed.drop(self._plans.popitem(last=False)[0])

    # -- graphs: repeated kinds of call replayed (fp4_comm.graphs)

    def _graph_ready(self, entry, kind, op, x, opts, peer):
        """Whether this call replays ``entry.replay``: it has one, or this is the call that
        captures it (the kind's ``EAGER_CALLS + 1``-th: the same call on every rank).  Never
        while the caller's stream is being captured: the call then runs eagerly, into the
        caller's graph."""
        if torch.cuda.is_current_stream_capturing():
            return False
        if entry.replay is not None:
            return self._replay_fits(entry, kind, opts)
        plan, transport = entry.plan, self.transport
        if _graphs.draws_random_words(plan.codec, opts.rounding):
            # the eager calls before the capture and the capture itself read the step from
            # memory, as the replays will (the kernels compiled and planned before a capture)
            opts.step = _graphs.device_step(opts.step, self.device)
        if entry.eager < _graphs.EAGER_CALLS:
            entry.eager += 1
            return False
        if op == "recv":
            run, shape = (lambda: plan.run(transport, opts, peer)), None
        elif op == "send":
            run, shape = (lambda s: plan.run(transport, s, opts, peer)), plan.shape
        else:
            run, shape = (lambda s: plan.run(transport, s, opts)), plan.shape
        try:
            graph, static, out = _graphs.capture(run, self.device, shape, plan.dtype)
        except CommPeerError:
            raise
        except Exception as err:  # noqa: BLE001 - any capture failure: this kind stays eager
            entry.graphable = False
            why = f"fp4_comm: {op} could not be captured in a CUDA graph ({err}); "
            warnings.warn(why + "calls of its kind run eagerly", RuntimeWarning, stacklevel=4)
            return False
        nbytes = (out if static is None else static).numel() * plan.dtype.itemsize
        step = opts.step if isinstance(opts.step, torch.Tensor) else None  # the graph's own
        entry.replay = _graphs.Replay(graph, static, out, nbytes, self.device, step, opts.seed,
                                      self._residuals_in_use(opts))  # fmt: skip
        transport.keep_graph(entry.replay)
        self._graphed.keep(kind, entry)
        return entry.replay is not None  # a graph bigger than the cache's bound is dropped

    def _residuals_in_use(self, opts):
        name = opts.error_feedback_name
        return () if name is None else self.error_feedback.in_use(name)

    def _replay_fits(self, entry, kind, opts):
        """Whether this call replays the kind's graph: its seed is the captured one (else it
        runs eagerly), and its error-feedback tensors are those captured (else the graph is
        dropped and the kind runs eagerly from then on)."""
        residuals = self._residuals_in_use(opts)
        if not self._graphed.ready(kind, entry.replay, opts.seed, residuals):
            return False
        if opts.error_feedback_name is not None:
            self.error_feedback.resume(opts.error_feedback_name)
        return True

    def _validated_for_good(self):
        """Whether the check just made leaves this kind of call in ``_validated`` (it is then
        never checked again under validate="first")."""
        return (
            self.control_group is not None
            and self.validate != "never"
            and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
        )

    def _needs_check(self, entry):
        """Whether a call of a planned kind must go through ``_validate_call`` (what
        ``_should_validate`` would say, without computing the signature)."""
        if self.control_group is None:
            return False
        if self.transport.always_validate or self.validate == "always":
            return True
        return self.validate == "first" and not entry.validated

    def _run_planned(self, entry, kind, op, x, rounding, seed, step, ef_name, stats, peer,
                     total_dim0, call):  # fmt: skip
        """A call of a kind made before: its arguments were checked then, and everything the
        checks read is in the plan's key; seed and step, which are not, were checked by the
        caller.  The ranks' comparison runs as ``validate`` says; then a graph of this kind
        replays, or is captured (``fp4_comm.graphs``), or the plan runs eagerly."""
        plan = entry.plan
        if self._needs_check(entry):
            self._validate_call(plan.check_op or op, x, plan.codec, rounding, peer, total_dim0,
                                call)  # fmt: skip
            entry.validated = entry.validated or self._validated_for_good()
        opts = collectives.Options(
            plan.codec, rounding, seed, step, self.error_feedback if ef_name else None, ef_name,
            stats,
        )  # fmt: skip
        if entry.graphable and self._graph_ready(entry, kind, op, x, opts, peer):
            try:
                return entry.replay.replay(self.transport, x, step)
            except CommPeerError as err:
                _reraise_with_op(err, op)
        try:
            if peer is not None:
                plan.run(self.transport, x, opts, peer)
                out = None
            else:
                out = plan.run(self.transport, x, opts)
        except CommPeerError as err:
            _reraise_with_op(err, op)
        if stats:
            return out, collectives.collected_stats(opts)
        return out

    def _validate_call(self, op, t, codec, rounding, peer, total_dim0, call):
        if peer is not None:
            self._validate_p2p(op, tuple(t.shape), t.dtype, codec, rounding, peer)
        elif op == "all_gather":
            self._validate_all_gather(t, codec, rounding, total_dim0, call)
        else:
            self._validate_collective(op, tuple(t.shape), t.dtype, codec, rounding, call)

    def _check_input(self, op, t):
        check_float_tensor(op, t)
        if t.device != self.device:
            raise ValueError(
                f"{op}: the tensor is on {t.device}, this communicator on {self.device} "
                "(one communicator per device: gloo for CPU tensors, NCCL for this rank's GPU)"
            )
        if t.dim() == 0:
            raise ValueError(f"{op}: a 0-d tensor; reshape to (1,)")

    def _check_peer(self, peer, what):
        try:
            if isinstance(peer, bool):
                raise TypeError
            peer = operator.index(peer)
        except TypeError:
            kind = type(peer).__name__
            raise TypeError(f"{what}: expected a rank (an int), got {kind}") from None
        if not (0 <= peer < self.world_size) or peer == self.rank:
            raise ValueError(f"{what}: {peer} is not another rank of 0..{self.world_size - 1}")
        return peer

    def _signature(self, op, shape, dtype, codec, rounding, call=-1):
        numel = 1
        for s in shape:
            numel *= s
        ndim, whole = len(shape), _crc(",".join(str(int(d)) for d in shape))
        if ndim > _MAX_DIMS:  # the leading dims here; the rest compare through the CRC
            shape = (*shape[: _MAX_DIMS - 1], -1)
        sig = [_OPS[op], _DTYPES[dtype], _crc(codec.key), _crc(rounding), call, ndim, numel]
        return sig + list(shape) + [0] * (_MAX_DIMS - len(shape)) + [whole]

    def _should_validate(self, key):
        if self.control_group is None:
            return False
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return False  # host-side exchanges cannot be captured; the graph replays data only
        if self.transport.always_validate:
            return True
        if self.validate == "never":
            return False
        return self.validate == "always" or key not in self._validated

    def _check_failed(self, err, what, peer=None):
        """A RuntimeError of the argument check's exchange, as the CommPeerError it means."""
        note = ""
        if self.validate == "first" and not self.transport.always_validate:
            note = (
                "; under validate='first' this is also what ranks whose calls differ look "
                "like: this rank checks a call that is new to it while a peer makes one it has "
                "checked before"
            )
        reraise_peer_error(err, what, self.rank, self.world_size, peer, note)

    def _validate_all_gather(self, t, codec, rounding, total_dim0, call):
        """The ranks compare the gathered shape; a rank whose shard does not have the rows
        ``shard_rows`` gives it sends a shape no other rank has, so every rank raises."""
        rest = tuple(t.shape[1:])
        if total_dim0 is None:
            total_dim0, wrong = self.world_size * t.shape[0], None
        else:
            rows = collectives.shard_rows(total_dim0, self.world_size)[self.rank]
            wrong = None
            if t.shape[0] != rows:
                wrong = (
                    f"all_gather: rank {self.rank} holds {t.shape[0]} rows; of total_dim0 = "
                    f"{total_dim0} rows on {self.world_size} ranks it should hold {rows} "
                    "(fp4_comm.shard_rows)"
                )
        if wrong is None:
            self._validate_collective("all_gather", (total_dim0, *rest), t.dtype, codec,
                                      rounding, call)  # fmt: skip
            return
        try:
            self._validate_collective("all_gather", (-1, *rest), t.dtype, codec, rounding, call)
        except ValueError as err:
            raise ValueError(f"{wrong}\n{err}") from None
        raise ValueError(wrong)

    def agree(
        self, what: str, key: Hashable, values: Sequence[int], message: Callable[[list], str]
    ) -> None:
        """The ranks' check, as ``validate`` says (every call; the first of each ``key``;
        never; not while a CUDA graph captures), that each passes the same ``values`` (ints,
        as many on every rank) for a call of kind ``key``: ValueError on every rank with
        ``message(rows)`` (``rows[r]``: rank r's values) where they differ, CommPeerError where
        a rank is gone.  For checks of calls beside this communicator's own collectives (a
        native all-reduce, a gradient layout), made with its policy and control group."""
        if not self._should_validate(key):
            return
        values = [int(v) for v in values]
        mine = torch.tensor(values, dtype=torch.int64)
        every = torch.empty(self.world_size * len(values), dtype=torch.int64)
        try:
            all_gather_into(every, mine, self.control_group)
        except RuntimeError as err:
            self._check_failed(err, f"{what} (argument check)")
        rows = every.view(self.world_size, len(values)).tolist()
        if any(r != values for r in rows):
            raise ValueError(message(rows))
        self._validated.add(key)

    def _validate_collective(self, op, shape, dtype, codec, rounding, call):
        sig = self._signature(op, shape, dtype, codec, rounding, call)
        key = tuple(sig[:_CALL] + sig[_CALL + 1 :])
        op = op.removesuffix("_one_shot")  # the user's name of the call in the messages

        def message(rows):
            return f"{op}: the ranks disagree:\n" + _describe(rows) + _hint(rows)

        self.agree(op, key, sig, message)

    def _validate_p2p(self, op, shape, dtype, codec, rounding, peer):
        # Sender and receiver compare (shape, dtype, codec); rounding is the sender's business.
        sig = self._signature("send", shape, dtype, codec, "nearest")
        key = (*sig, op, peer)
        if not self._should_validate(key):
            return
        peer_global = peer if self.control_group is None else dist.get_global_rank(
            self.control_group, peer
        )  # fmt: skip
        mine = torch.tensor(sig, dtype=torch.int64)
        theirs = torch.empty(_SIG_LEN, dtype=torch.int64)
        try:
            # Sender first sends then receives, receiver the opposite: no deadlock either way.
            if op == "send":
                dist.send(mine, peer_global, group=self.control_group)
                dist.recv(theirs, peer_global, group=self.control_group)
            else:
                dist.recv(theirs, peer_global, group=self.control_group)
                dist.send(mine, peer_global, group=self.control_group)
        except RuntimeError as err:
            self._check_failed(err, f"{op} with rank {peer} (argument check)", peer)
        if theirs.tolist() != sig:
            rows = [sig, theirs.tolist()] if op == "send" else [theirs.tolist(), sig]
            raise ValueError(f"send/recv between ranks {self.rank} and {peer} disagree "
                             "(row 0: sender, row 1: receiver):\n" + _describe(rows))  # fmt: skip
        self._validated.add(key)


class _PlanEntry:
    """A kept plan, whether its kind of call is in ``Communicator._validated``, whether it may
    be replayed from a graph, how many calls of it ran eagerly, and its graph."""

    __slots__ = ("plan", "validated", "graphable", "eager", "replay")

    def __init__(self, plan, validated, graphable=False):
        self.plan, self.validated = plan, validated
        self.graphable, self.eager, self.replay = graphable, 1, None


class CapturedCollective:
    """A collective captured in a CUDA graph (``Communicator.capture``)."""

    def __init__(
        self, comm: Communicator, op: str, x: torch.Tensor, kwargs: dict[str, Any]
    ) -> None:
        if op not in ("all_reduce", "reduce_scatter", "all_gather"):
            raise ValueError(f"capture: {op!r} is not all_reduce, reduce_scatter or all_gather")
        if not (isinstance(x, torch.Tensor) and x.is_cuda):
            raise ValueError("capture: needs a torch CUDA tensor (the graph's static input)")
        fn = getattr(comm, op)
        side = torch.cuda.Stream(x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):
            fn(x, **kwargs)  # warm-up: compiles kernels, checks arguments across ranks
        torch.cuda.current_stream(x.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        self.input = x
        self.last_stream = None  # the stream of the last replay
        self._transport = comm.transport
        validate, comm.validate = comm.validate, "never"
        try:
            with torch.cuda.graph(self.graph):
                self.output = fn(x, **kwargs)
        finally:
            comm.validate = validate
        # the transport releases the graph if it is aborted or closed first (NCCL waits for it)
        self._transport.keep_graph(self)

    def replay(self) -> torch.Tensor:
        """Run the captured collective on the current contents of ``input``; the
        communicator's error if it has failed or is closed."""
        transport = self._transport
        with transport.replay_lock:
            transport.before_replay()
            if self.graph is None:
                raise RuntimeError("capture: the graph was released with its communicator")
            self.last_stream = torch.cuda.current_stream(self.input.device)
            self.graph.replay()
            transport.after_replay()
        return self.output

    def release(self) -> None:
        """Destroy the CUDA graph (the communicator does, when it is aborted or closed)."""
        if self.graph is not None:
            self.graph.reset()
            self.graph = None


def _check_transport(transport, device):
    """``transport`` is a known name that fits ``device`` (None: the device's default)."""
    if transport is None:
        return
    if transport not in ("nccl", "gloo", "p2p"):
        raise ValueError(f"transport: {transport!r} is not one of 'nccl', 'gloo', 'p2p'")
    if transport == "gloo" and device.type != "cpu":
        raise ValueError(f"transport='gloo' moves CPU tensors; device {device} is not the CPU")
    if transport in ("nccl", "p2p") and device.type != "cuda":
        raise ValueError(
            f"transport={transport!r} moves CUDA tensors; device {device} is not a CUDA device "
            "(CPU tensors go over gloo: transport='gloo' or None)"
        )


def _describe(rows):
    names = {v: k for k, v in _DTYPES.items()}
    lines = []
    for r, sig in enumerate(rows):
        ndim = sig[_CALL + 1]
        shape = tuple(sig[_CALL + 3 : _CALL + 3 + min(ndim, _MAX_DIMS)])
        if ndim > _MAX_DIMS:
            dims = ", ".join(map(str, shape[:-1]))
            shape = f"({dims}, ...) of {ndim} dims (CRC of the whole shape {sig[-1]:#x})"
        call = f", call #{sig[_CALL]}" if sig[_CALL] >= 0 else ""
        lines.append(
            f"  rank {r}: shape {shape}, dtype {names.get(sig[1])}, codec id {sig[2]:#x}, "
            f"rounding id {sig[3]:#x}, op id {sig[0]}{call}"
        )
    return "\n".join(lines)


def _hint(rows):
    ops = {r[0] for r in rows}
    if ops == {_OPS["all_reduce"], _OPS["all_reduce_one_shot"]}:
        return (
            "\nop id 1 is the two-shot all-reduce, 5 the one-shot one: the ranks' "
            "all_reduce_algorithm differs (give every rank's Communicator the same)"
        )
    calls = {r[_CALL] for r in rows}
    rest = {tuple(r[:_CALL] + r[_CALL + 1 :]) for r in rows}
    if len(calls) > 1 and len(rest) == 1:
        return (
            "\nthe same call, but the ranks have made different numbers of collectives on this "
            "communicator before it: one skipped (or added) a collective, or failed one alone"
        )
    return ""


def _reraise_with_op(err: CommPeerError, op: str):
    """The transport's CommPeerError, with the collective that was running in its message."""
    raise type(err)(f"{op}: {err}", op=op, rank=err.rank, peers=err.peers) from err


def _shape(shape, what):
    try:
        dims = tuple(shape)
    except TypeError:
        kind = type(shape).__name__
        raise TypeError(f"{what}: expected a sequence of ints, got {kind}") from None
    out = []
    for d in dims:
        # (a bool is an int to operator.index; True for 1 is a slip)
        if isinstance(d, bool) or not hasattr(type(d), "__index__"):
            raise TypeError(f"{what}: {dims!r} holds a {type(d).__name__}, not an int")
        d = operator.index(d)
        if d < 0:
            raise ValueError(f"{what}: {dims!r} has a negative size")
        out.append(d)
    if not out:
        raise ValueError(f"{what}: a 0-d shape; send and receive (1,) instead")
    return tuple(out)


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def _torch_dtype(dtype, what):
    """torch.float32 / bfloat16 / float16 from a torch dtype, a name, or a numpy dtype."""
    t = dtype if isinstance(dtype, torch.dtype) else None
    if t is None:
        name = dtype if isinstance(dtype, str) else getattr(dtype, "name", None)
        if not isinstance(name, str):
            try:
                name = np.dtype(dtype).name
            except TypeError:
                name = None
        if isinstance(name, str):
            t = getattr(torch, name.removeprefix("torch."), None)
    if t not in _DTYPES:
        raise TypeError(f"{what}: dtype {dtype!r} is not supported; use float32, bfloat16, "
                        "float16")  # fmt: skip
    return t


class _stream_of:
    """Context: the input as a torch tensor, on the stream its library says is current, and
    ``back(y)`` that hands a result back in the input's kind (torch, or CuPy zero-copy)."""

    def __init__(self, x):
        self.x = x
        self.cupy = None
        self.ctx = nullcontext()
        self.tensor = x
        cupy = sys.modules.get("cupy")
        if cupy is not None and isinstance(x, cupy.ndarray):
            self.cupy = cupy
            ptr = cupy.cuda.get_current_stream().ptr
            dev = torch.device("cuda", x.device.id)
            # CuPy's current stream becomes torch's current one: every kernel and NCCL call of
            # the collective is queued on it, and DLPack needs no cross-stream wait.
            stream = (
                torch.cuda.ExternalStream(ptr, device=dev)
                if ptr
                else torch.cuda.default_stream(dev)
            )
            self.ctx = torch.cuda.stream(stream)
        elif x is not None and not isinstance(x, torch.Tensor):
            raise TypeError(f"expected a torch tensor or a CuPy array, got {type(x).__name__}")

    def __enter__(self):
        self.ctx.__enter__()
        if self.cupy is not None:
            self.tensor = torch.from_dlpack(self.x)
        return self

    def __call__(self, y):
        if self.cupy is not None and y is not None:
            return self.cupy.from_dlpack(y)
        return y

    def __exit__(self, *exc):
        return self.ctx.__exit__(*exc)


__all__ = ["CapturedCollective", "CommTimeoutError", "Communicator"]
