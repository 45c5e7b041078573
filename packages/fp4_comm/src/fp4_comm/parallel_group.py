"""``TensorParallelGroup``: one rank's place in a Megatron tensor-parallel group, and the two
collectives a transformer sub-block needs, with a policy for the forward values and one for
their gradients.

    group = TensorParallelGroup(comm, forward=WirePolicy("mxfp4"),
                                backward=WirePolicy("mxfp4", rounding="stochastic"))
    h = group.enter(ln(x), "L0.attn")          # before the column-parallel linear
    x = x + group.exit(h @ w_o_shard.T, "L0.attn")   # the row-parallel linear's partial sum

Without sequence parallelism ``enter`` is ``copy_to_tensor_parallel`` and ``exit``
``reduce_from_tensor_parallel``; with it (the residual stream split along dim 0, the sequence)
``gather_from_sequence_parallel`` and ``reduce_scatter_to_sequence_parallel``
(``fp4_comm.tensor_parallel``).  Codec ``"native"`` (both policies) runs torch.distributed's own
all-reduce instead (tensor parallelism without SP or error feedback): the reference the
compressed collectives have to beat; gloo's over the communicator's ranks on the CPU, NCCL's on
GPUs (a group that every rank of the default group makes with the TensorParallelGroup).  Its
ranks compare each call's shape and dtype first as the communicator compares its own calls
(``Communicator.agree``: every call under ``validate="always"``, each new shape and dtype
under "first"), outside the time a ``TimedCommunicator`` measures: a mismatch is a ValueError
on every rank, not an abort in gloo or a hang in NCCL.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import tensor_parallel as tp
from .codecs import SEED_LIMIT, check_int, check_rounding, get_codec
from .communicator import Communicator


@dataclass(frozen=True)
class WirePolicy:
    """How one direction (forward values, or their gradients) crosses the ranks.

    ``codec``: as ``Communicator`` takes it, or ``"native"``.  ``rounding``: "nearest",
    "stochastic", or None for the collective's default (``fp4_comm.tensor_parallel``: the
    forward's rounding for a summed gradient, stochastic for the residual stream's gradient);
    it applies to the FP4 codecs: the "none" codecs cast to nearest and "native" sums in the
    tensors' own dtype, whatever it says (as a bf16 baseline beside FP4 runs of either
    rounding).
    ``error_feedback``: keep a residual at every site whose collective in this direction is a
    sum (buffer names ``<site>.out`` forward, ``<site>.in.grad`` backward); a forward residual
    moves in training only (not under ``torch.no_grad``).  Error feedback makes a sum over
    steps exact; TP's sums are per-batch activations and their gradients, where the residual
    is the previous batch's error: measured, it costs loss there (docs/comm.md,
    "Algorithms").
    """

    codec: object = "nvfp4"
    rounding: str | None = None
    error_feedback: bool = False

    def __post_init__(self) -> None:
        if self.codec != "native":
            get_codec(self.codec)  # ValueError naming the codec and the choices
        if self.rounding is not None:
            check_rounding(self.rounding)
        if not isinstance(self.error_feedback, bool):
            raise TypeError(f"WirePolicy: error_feedback is {type(self.error_feedback).__name__}; "
                            "expected True or False")  # fmt: skip


def check_native(forward: WirePolicy, backward: WirePolicy, sequence_parallel: bool) -> bool:
    """Whether the policies ask for torch.distributed's own all-reduce (codec "native");
    ValueError where they ask for it in a way it cannot serve."""
    native = [p.codec == "native" for p in (forward, backward)]
    if not any(native):
        return False
    if not all(native):
        raise ValueError("codec 'native' is torch.distributed's all-reduce for the "
                         "forward values and their gradients both")  # fmt: skip
    if sequence_parallel or forward.error_feedback or backward.error_feedback:
        raise ValueError("codec 'native' is tensor parallelism without sequence "
                         "parallelism or error feedback")  # fmt: skip
    return True


class _NativeAllReduce(torch.autograd.Function):
    """Megatron's copy_to (``forward=False``) / reduce_from (``forward=True``) pair through
    torch.distributed's all-reduce."""

    @staticmethod
    def forward(ctx, x, group, forward):
        ctx.group, ctx.forward = group, forward
        return group.native_all_reduce(x) if forward else x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        g = grad if ctx.forward else ctx.group.native_all_reduce(grad)
        return g, None, None


class TensorParallelGroup:
    """This rank's place in the tensor-parallel group of ``comm`` (None: one rank, no
    communication) and the collectives of a block's input (``enter``) and output (``exit``).

    ``stats``: None, or a dict that ``enter`` and ``exit`` fill with lists of
    ``tensor_parallel.WireStats`` under the keys "enter" and "exit" (set it for the steps to
    log; each statistic costs a decode)."""

    def __init__(
        self,
        comm: Communicator | Any | None,
        forward: WirePolicy = WirePolicy(),
        backward: WirePolicy | None = None,
        *,
        seed: int = 0,
        sequence_parallel: bool = False,
    ) -> None:
        if comm is not None and not all(hasattr(comm, a) for a in ("rank", "world_size",
                                                                    "all_reduce")):  # fmt: skip
            raise TypeError(
                "comm: a Communicator (or a TimedCommunicator of one), or None for one rank; "
                f"got {type(comm).__name__}"
            )
        self.comm = comm
        self.rank = 0 if comm is None else comm.rank
        self._set_policies(1 if comm is None else comm.world_size, forward, backward, seed,
                           sequence_parallel)  # fmt: skip
        self.native_group = None
        if self.native:
            self.native_group = comm.control_group  # gloo, over the communicator's ranks
            if comm.device.type == "cuda":
                # NCCL over the same ranks.  Not locally synchronized: torch names such a
                # group after the number of groups each rank has made, which differs
                # between ranks that made other subgroups; so every rank of the default
                # group makes it (with a communicator over the default group, all do).
                ranks = dist.get_process_group_ranks(comm.control_group)
                self.native_group = dist.new_group(ranks, backend="nccl")

    def _set_policies(self, size, forward, backward, seed, sequence_parallel):
        # What a group of ``size`` ranks (this one, or the emulated one of all of them) keeps
        # of its arguments; ``native``: codec "native" with more than one rank.
        for what, policy in (("forward", forward), ("backward", backward)):
            if not isinstance(policy, WirePolicy) and (what == "forward" or policy is not None):
                raise TypeError(f"{what}: expected a WirePolicy (codec, rounding, error "
                                f"feedback), got {type(policy).__name__}")  # fmt: skip
        if not isinstance(sequence_parallel, bool):
            raise TypeError(f"sequence_parallel is {type(sequence_parallel).__name__}; expected "
                            "True or False")  # fmt: skip
        self.size = size
        self.forward = forward
        self.backward = forward if backward is None else backward
        self.seed = check_int(seed, "seed", SEED_LIMIT)
        self.sequence_parallel = sequence_parallel and size > 1
        self.stats = None
        self.native = check_native(forward, self.backward, sequence_parallel) and size > 1

    @property
    def stats(self) -> dict[str, list] | None:
        """None, or the dict ``enter`` and ``exit`` fill (see the class docstring)."""
        return self._stats

    @stats.setter
    def stats(self, value: dict[str, list] | None) -> None:
        if value is not None and not isinstance(value, dict):
            raise TypeError(
                f"stats: None or a dict (kind -> list of WireStats), got {type(value).__name__}"
            )
        self._stats = value

    def native_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """torch.distributed's all-reduce of ``x`` in its dtype (timed where ``comm`` is a
        ``TimedCommunicator``)."""
        # The ranks compare shape and dtype first, as the communicator checks its own calls
        # (under validate="first": once per shape and dtype): ranks whose tensors differ
        # would abort the process in gloo, or hang or sum misaligned data in NCCL.
        shape = tuple(x.shape)
        self.comm.agree("native all-reduce", ("native_all_reduce", shape, x.dtype),
                        [_NATIVE_DTYPES.index(x.dtype) if x.dtype in _NATIVE_DTYPES else -1,
                         len(shape), zlib.crc32(repr(shape).encode())],
                        lambda rows: _native_message(rows, shape))  # fmt: skip

        def run(x):
            y = x.contiguous().clone()
            dist.all_reduce(y, group=self.native_group)
            return y

        timed = getattr(self.comm, "timed", None)
        return timed(run, x) if timed is not None else run(x)

    def _kwargs(self, site, kind):
        fwd, bwd = self.forward, self.backward
        kw = {
            "codec": fwd.codec,
            "rounding": fwd.rounding or "nearest",
            "seed": self.seed,
            "stats": None if self.stats is None else self.stats.setdefault(kind, []),
        }
        if kind == "enter":  # the gradient is summed
            kw.update(
                grad_codec=bwd.codec,
                grad_rounding=bwd.rounding,
                grad_error_feedback=f"{site}.in.grad" if bwd.error_feedback else None,
            )
        elif torch.is_grad_enabled() and fwd.error_feedback:
            # a validation pass must not move the residuals
            kw["error_feedback"] = f"{site}.out"
        if kind == "exit" and self.sequence_parallel:  # the gradient is all-gathered
            kw["grad_codec"] = bwd.codec
            if bwd.rounding is not None:
                kw["grad_rounding"] = bwd.rounding
        return kw  # fmt: skip

    def enter(self, x: torch.Tensor, site: str, total_dim0: int | None = None) -> torch.Tensor:
        """A block's input, replicated (or, with SP, gathered) before its column-parallel
        linear.  ``site``: a name unique to the call site (error-feedback buffers).
        ``total_dim0`` (SP only): the gathered length where the ranks' shards differ, as
        ``exit`` splits a length the ranks do not divide (``shard_rows``)."""
        if total_dim0 is not None and not self.sequence_parallel:
            raise ValueError(
                "total_dim0: the gathered length of sequence parallelism's shards; this group "
                "gathers nothing (sequence_parallel=False, or one rank)"
            )
        return self._edge(x, site, "enter", total_dim0)

    def exit(self, x: torch.Tensor, site: str) -> torch.Tensor:
        """A row-parallel linear's partial output, summed over the ranks (with SP: and
        scattered along the sequence)."""
        return self._edge(x, site, "exit")

    # the collective at each edge of a tensor-parallel region: (without SP, with SP)
    _EDGE_FUNCTIONS = {
        "enter": ("copy_to_tensor_parallel", "gather_from_sequence_parallel"),
        "exit": ("reduce_from_tensor_parallel", "reduce_scatter_to_sequence_parallel"),
    }

    def _edge(self, x, site, kind, total_dim0=None):
        if self.size == 1:
            return x
        if self.native:
            return self._native(x, kind == "exit")
        function = self._EDGE_FUNCTIONS[kind][bool(self.sequence_parallel)]
        kw = self._kwargs(site, kind)
        if total_dim0 is not None:
            kw["total_dim0"] = total_dim0
        return self._collective(function, x, kw)

    def _collective(self, function, x, kw):
        # ``function`` of ``fp4_comm.tensor_parallel`` over this rank's communicator (the
        # emulated group: of ``fp4_comm.emulated``, over every rank)
        return getattr(tp, function)(x, self.comm, **kw)

    def _native(self, x, forward):
        # Megatron's reduce_from (``forward``) or copy_to through torch.distributed's all-reduce
        return _NativeAllReduce.apply(x, self, forward)

    def shard(self, w: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This rank's slice of a full tensor along ``dim`` (a weight, or with SP the
        sequence): ``torch.chunk``'s piece, as ``shard_rows`` splits dim 0."""
        pieces = w.chunk(self.size, dim)
        if self.rank >= len(pieces):
            return w.narrow(dim, 0, 0).clone()
        return pieces[self.rank].clone()

    # The model's side.  A model written against these methods is one definition for one
    # rank's share (this class: a method is the plain operation) and for all k ranks of an
    # emulated group in one process (``fp4_comm.emulated.EmulatedTensorParallelGroup``, where
    # a per-rank value holds every rank's tensor and ``each`` runs once per rank).

    def each(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``: this rank's computation on its values (shards, replicated tensors)."""
        return fn(*args)

    def sharded_parameter(self, value: torch.Tensor) -> torch.nn.Parameter:
        """The parameter of this rank's shard (``value``: from ``shard``)."""
        return torch.nn.Parameter(value)

    def replicated_parameter(self, value: torch.Tensor) -> torch.nn.Parameter:
        """A parameter every rank holds whole (norms, embedding, head)."""
        return torch.nn.Parameter(value)

    def backpropagate(self, loss: torch.Tensor, scale: float = 1.0) -> None:
        """Backpropagate ``loss * scale`` (with SP: this rank's loss over its part of the
        sequence, ``scale`` = 1 / size, whose backward collectives sum over the ranks)."""
        (loss * scale).backward()

    def sum_partial_grads(self, params: Iterable[torch.nn.Parameter]) -> None:
        """With SP, the gradients of the parameters every rank holds whole (LayerNorms,
        embedding, head) are partial over the sequence shards: sum them over the ranks, in
        float32 (exact up to the adds).  A no-op without SP.

        Every rank passes the same parameters in the same order; a parameter without a
        gradient on every rank keeps none.  The ranks compare which of them have one, as the
        communicator checks its calls (over its control group, on the host; every call under
        ``validate="always"``, each new pattern under "first", never under "never" or while
        a CUDA graph is captured): a parameter with a gradient on some ranks only is refused on
        every rank (ValueError), as ``EmulatedTensorParallelGroup`` does, instead of one
        rank's gradient of a parameter being added to another's of the next."""
        if not self.sequence_parallel:
            return
        params = list(params)
        held = tuple(p.grad is not None for p in params)
        self.comm.agree(
            "sum_partial_grads (gradient check)",
            ("sum_partial_grads", held),
            [len(held), sum(held), zlib.crc32(bytes(held))],
            _grads_held_message,
        )
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads]).float()
        flat = self.comm.all_reduce(flat, codec="none-float32")
        off = 0
        for g in grads:
            g.copy_(flat[off : off + g.numel()].view_as(g))
            off += g.numel()


_NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _native_message(rows, shape):
    def dtype(i):
        return str(_NATIVE_DTYPES[i]).removeprefix("torch.") if i >= 0 else "another dtype"

    described = "; ".join(f"rank {r}: {dtype(d)}, {n} dims" for r, (d, n, _) in enumerate(rows))
    return (
        f"native all-reduce: the ranks' tensors differ in shape or dtype (this rank's: {shape}; "
        f"{described}); every rank of the group passes a tensor of the same shape and dtype"
    )


def _grads_held_message(rows):
    described = "; ".join(
        f"rank {r}: {n_held} of {n} parameters" for r, (n, n_held, _) in enumerate(rows)
    )
    return (
        "sum_partial_grads: the ranks hold gradients of different parameters "
        f"({described}); every rank passes the same parameters, and a replica that got "
        "no gradient on one rank but did on others holds zeros there "
        "(p.grad = torch.zeros_like(p))"
    )


__all__ = ["TensorParallelGroup", "WirePolicy", "check_native"]
