"""Tensor, sequence and pipeline parallelism of k ranks emulated in one process, equal bit for
bit to the k-process run.

    ranks = fp4_comm.reference.EmulatedRanks(4, "cuda")
    group = EmulatedTensorParallelGroup(ranks, forward=WirePolicy(fp4_kernels.FP4Quant(64)))
    model = Model(..., par=group)        # the model a rank builds with a TensorParallelGroup
    loss = loss_fn(model(x), y)          # every rank's shard computed, the collectives emulated
    group.backpropagate(loss)

A model written against the parallel-group interface (``TensorParallelGroup.each``,
``shard``, ``sharded_parameter``, ``replicated_parameter``, ``enter``, ``exit``,
``sum_partial_grads``, ``backpropagate``) runs either as one rank of a real group or, with an
``EmulatedTensorParallelGroup``, as all k ranks at once: a sharded parameter is then an
``nn.ParameterList`` of the k ranks' shards, and a per-rank activation a ``PerRank`` tuple of the
k ranks' tensors.  ``each(fn, ...)`` calls ``fn`` once per rank on rank r's values, so each
shard's partial product is the very matrix product its rank computes (same shapes, dtype and
autocast); where every argument is replicated (plain TP: the norms, residual adds, embedding and
head, identical on every rank) it runs once, and that one result is every rank's.  Under
sequence parallelism the replicated parameters are k replicas (each rank's gradient is partial
over its part of the sequence, summed by ``sum_partial_grads`` as the ranks do).

The collectives are autograd functions over all k ranks (k inputs and/or k outputs): forward
they run the reference collective of ``fp4_comm.reference`` on the ranks' tensors, backward the
matching one on the ranks' gradients, which autograd hands over together once every rank's is
there.  They mirror ``fp4_comm.tensor_parallel`` and ``fp4_comm.pipeline`` one for one: the
same option handling (``tensor_parallel.function_options``: forward and gradient codec,
rounding, error feedback, the residual stream's gradient stochastic by default), the same
collective in each direction, each rank's step from its communicator's call count
(``EmulatedRanks``) and each rank's own error-feedback residuals.  One process, one autograd
graph, in which a collective is one node: the order of the collectives is the order of their
data dependencies, the order in which every rank runs them.

Codec "native" (torch.distributed's own all-reduce, whose summation order the library picks)
is emulated as a float32 sum in rank order rounded to the input's dtype (the "none-float32"
codec): the same result up to that rounding, not the same bits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from .codecs import CodecSpec, Rounding
from .parallel_group import TensorParallelGroup, WirePolicy
from .reference import EmulatedRanks, check_rank_tensors
from .tensor_parallel import (
    BACKWARD,
    FORWARD,
    RESIDUAL_GRAD_ROUNDING,
    WireStats,
    check_call,
    direction_options,
    function_options,
)

_DEFAULT_POLICY = WirePolicy()
#: What "native" becomes in an emulated group: a float32 sum in rank order.
NATIVE_EMULATION = "none-float32"


class PerRank(tuple):
    """One value per rank of an emulated group, in rank order."""

    def __repr__(self) -> str:
        return f"PerRank{tuple.__repr__(self)}"


def is_per_rank(value: Any) -> bool:
    """Whether ``value`` holds one value per rank (a ``PerRank`` or the ``nn.ParameterList``
    of a sharded or replicated parameter of an emulated group)."""
    return isinstance(value, (PerRank, nn.ParameterList))


def _run(ranks, op, xs, opts, direction, stats, **extra):
    """``ranks.<op>(xs, **opts)``: every rank's result; with ``stats`` a list, each rank's
    ``WireStats`` appended in rank order (as each rank's own list would get it)."""
    fn = getattr(ranks, op)
    if stats is None:
        return fn(xs, **opts, **extra)
    rms = [x.detach().float().pow(2).mean().sqrt() for x in xs]
    out = fn(xs, **opts, **extra, stats=True)
    for r, (_, hops) in enumerate(out):
        stats.append(WireStats(direction, op, rms[r], hops))
    return [y for y, _ in out]


# ------------------------------------------------------------------ autograd functions


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward (one replicated input, or each rank's own); all-reduce backward."""

    @staticmethod
    def forward(ctx, ranks, grad_opts, stats, shared, *xs):
        ctx.ranks, ctx.grad_opts, ctx.stats, ctx.shared = ranks, grad_opts, stats, shared
        if shared:
            return tuple(xs[0].view_as(xs[0]) for _ in range(ranks.world_size))
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        gs = _run(ctx.ranks, "all_reduce", [g.contiguous() for g in grads], ctx.grad_opts,
                  "backward", ctx.stats)  # fmt: skip
        # The all-reduce leaves the same bits on every rank: rank 0's is the replicated
        # input's gradient.
        return (None, None, None, None, *(gs[:1] if ctx.shared else gs))


class _ReduceFromTensorParallel(torch.autograd.Function):
    """All-reduce forward (the ranks' partial outputs -> the replicated sum); identity
    backward (each rank's partial output gets the sum's gradient)."""

    @staticmethod
    def forward(ctx, ranks, opts, stats, *xs):
        ctx.k = len(xs)
        ys = _run(ranks, "all_reduce", [x.contiguous() for x in xs], opts, "forward", stats)
        return ys[0]  # the same bits on every rank

    @staticmethod
    def backward(ctx, grad):
        return (None, None, None, *([grad] * ctx.k))


class _GatherFromSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ranks, opts, grad_opts, total_dim0, stats, *xs):
        ctx.ranks, ctx.grad_opts, ctx.stats = ranks, grad_opts, stats
        ys = _run(ranks, "all_gather", [x.contiguous() for x in xs], opts, "forward", stats,
                  total_dim0=total_dim0)  # fmt: skip
        return tuple(ys)

    @staticmethod
    def backward(ctx, *grads):
        gs = _run(ctx.ranks, "reduce_scatter", [g.contiguous() for g in grads], ctx.grad_opts,
                  "backward", ctx.stats)  # fmt: skip
        return (None, None, None, None, None, *gs)


class _ReduceScatterToSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ranks, opts, grad_opts, stats, *xs):
        ctx.ranks, ctx.grad_opts, ctx.stats, ctx.dim0 = ranks, grad_opts, stats, xs[0].shape[0]
        ys = _run(ranks, "reduce_scatter", [x.contiguous() for x in xs], opts, "forward", stats)
        return tuple(ys)

    @staticmethod
    def backward(ctx, *grads):
        gs = _run(ctx.ranks, "all_gather", [g.contiguous() for g in grads], ctx.grad_opts,
                  "backward", ctx.stats, total_dim0=ctx.dim0)  # fmt: skip
        return (None, None, None, None, *gs)


class _PipelineBoundary(torch.autograd.Function):
    """Rank ``src`` sends the activation, rank ``dst`` receives it; backward ``dst`` sends its
    gradient back and ``src`` receives it (``pipeline.send_forward`` / ``recv_forward``)."""

    @staticmethod
    def forward(ctx, x, ranks, src, dst, opts, grad_opts, stats):
        ctx.ranks, ctx.src, ctx.dst, ctx.grad_opts, ctx.stats = ranks, src, dst, grad_opts, stats
        return _send(ranks, x.detach().contiguous(), src, dst, opts, "forward", stats)

    @staticmethod
    def backward(ctx, grad):
        g = _send(ctx.ranks, grad.contiguous(), ctx.dst, ctx.src, ctx.grad_opts, "backward",
                  ctx.stats)  # fmt: skip
        return g, None, None, None, None, None, None


def _send(ranks, x, src, dst, opts, direction, stats):
    if stats is None:
        return ranks.send_recv(x, src, dst, **opts)
    rms = x.detach().float().pow(2).mean().sqrt()
    y, hops = ranks.send_recv(x, src, dst, **opts, stats=True)
    stats.append(WireStats(direction, "send", rms, hops))
    return y


# ------------------------------------------------------------------ the four TP functions


def _inputs(x, ranks, what, stats):
    """The per-rank values of ``x`` (None where ``x`` is one tensor, every rank's), each a
    torch tensor a collective takes (``reference.check_rank_tensors``); the group and the
    statistics list checked too, before any collective moves."""
    if not isinstance(ranks, EmulatedRanks):
        raise TypeError(f"{what}: ranks: expected fp4_comm.reference.EmulatedRanks, got "
                        f"{type(ranks).__name__}")  # fmt: skip
    check_call(what, None, stats)
    if is_per_rank(x):
        if len(x) != ranks.world_size:
            raise ValueError(f"{what}: {len(x)} per-rank values for {ranks.world_size} ranks")
        check_rank_tensors(what, list(x), same_shape=False)
        return list(x)
    check_rank_tensors(what, [x])
    return None


def copy_to_tensor_parallel(
    x: torch.Tensor | Sequence[torch.Tensor],
    ranks: EmulatedRanks,
    codec: CodecSpec = "nvfp4",
    rounding: Rounding = "nearest",
    seed: int = 0,
    *,
    grad_codec: CodecSpec | None = None,
    grad_rounding: Rounding | None = None,
    error_feedback: str | None = None,
    grad_error_feedback: str | None = None,
    stats: list[WireStats] | None = None,
) -> PerRank:
    """``tensor_parallel.copy_to_tensor_parallel`` of every rank: ``x`` replicated (one
    tensor, every rank's) or per rank; returns every rank's view; backward all-reduces."""
    _, grad_opts = function_options("copy_to_tensor_parallel", codec, rounding, seed,
                                    error_feedback, grad_codec, grad_rounding or rounding,
                                    grad_error_feedback)  # fmt: skip
    xs = _inputs(x, ranks, "copy_to_tensor_parallel", stats)
    shared = xs is None
    return PerRank(_CopyToTensorParallel.apply(ranks, grad_opts, stats, shared,
                                               *([x] if shared else xs)))  # fmt: skip


def reduce_from_tensor_parallel(
    xs: Sequence[torch.Tensor],
    ranks: EmulatedRanks,
    codec: CodecSpec = "nvfp4",
    rounding: Rounding = "nearest",
    seed: int = 0,
    *,
    error_feedback: str | None = None,
    stats: list[WireStats] | None = None,
) -> torch.Tensor:
    """``tensor_parallel.reduce_from_tensor_parallel`` of every rank: the ranks' partial
    outputs -> their all-reduced sum (the same on every rank: one tensor)."""
    opts, _ = function_options("reduce_from_tensor_parallel", codec, rounding, seed,
                               error_feedback)  # fmt: skip
    xs = _need_per_rank(xs, ranks, "reduce_from_tensor_parallel", stats)
    return _ReduceFromTensorParallel.apply(ranks, opts, stats, *xs)


def gather_from_sequence_parallel(
    xs: Sequence[torch.Tensor],
    ranks: EmulatedRanks,
    codec: CodecSpec = "nvfp4",
    rounding: Rounding = "nearest",
    seed: int = 0,
    *,
    grad_codec: CodecSpec | None = None,
    grad_rounding: Rounding | None = None,
    error_feedback: str | None = None,
    grad_error_feedback: str | None = None,
    total_dim0: int | None = None,
    stats: list[WireStats] | None = None,
) -> PerRank:
    """``tensor_parallel.gather_from_sequence_parallel`` of every rank: the ranks' shards ->
    every rank's gathered tensor; backward reduce-scatters the gradients."""
    opts, grad_opts = function_options("gather_from_sequence_parallel", codec, rounding, seed,
                                       error_feedback, grad_codec, grad_rounding or rounding,
                                       grad_error_feedback)  # fmt: skip
    xs = _need_per_rank(xs, ranks, "gather_from_sequence_parallel", stats)
    return PerRank(_GatherFromSequenceParallel.apply(ranks, opts, grad_opts, total_dim0, stats,
                                                     *xs))  # fmt: skip


def reduce_scatter_to_sequence_parallel(
    xs: Sequence[torch.Tensor],
    ranks: EmulatedRanks,
    codec: CodecSpec = "nvfp4",
    rounding: Rounding = "nearest",
    seed: int = 0,
    *,
    grad_codec: CodecSpec | None = None,
    grad_rounding: Rounding = RESIDUAL_GRAD_ROUNDING,
    error_feedback: str | None = None,
    grad_error_feedback: str | None = None,
    stats: list[WireStats] | None = None,
) -> PerRank:
    """``tensor_parallel.reduce_scatter_to_sequence_parallel`` of every rank: the ranks'
    partial outputs -> each rank's rows of the sum; backward all-gathers the gradients."""
    opts, grad_opts = function_options("reduce_scatter_to_sequence_parallel", codec, rounding,
                                       seed, error_feedback, grad_codec, grad_rounding,
                                       grad_error_feedback)  # fmt: skip
    xs = _need_per_rank(xs, ranks, "reduce_scatter_to_sequence_parallel", stats)
    return PerRank(_ReduceScatterToSequenceParallel.apply(ranks, opts, grad_opts, stats, *xs))


def _need_per_rank(xs, ranks, what, stats):
    if not is_per_rank(xs):
        raise TypeError(f"{what}: expected one tensor per rank (a PerRank), got "
                        f"{type(xs).__name__}")  # fmt: skip
    return _inputs(xs, ranks, what, stats)


def pipeline_boundary(
    x: torch.Tensor,
    ranks: EmulatedRanks,
    src: int = 0,
    dst: int = 1,
    codec: CodecSpec = "nvfp4",
    rounding: Rounding = "nearest",
    seed: int = 0,
    *,
    grad_codec: CodecSpec | None = None,
    grad_rounding: Rounding = RESIDUAL_GRAD_ROUNDING,
    stats: list[WireStats] | None = None,
) -> torch.Tensor:
    """``pipeline.send_forward`` on rank ``src`` and ``recv_forward`` on rank ``dst``, in one:
    the activation as ``dst`` receives it; backward, its gradient as ``src`` receives it.
    Each direction's step is its sender's count of sends (``EmulatedRanks``)."""
    if is_per_rank(x):
        raise TypeError("pipeline_boundary: x: expected rank src's activation (one tensor), got "
                        f"{type(x).__name__}")  # fmt: skip
    _inputs(x, ranks, "pipeline_boundary", stats)
    opts = direction_options(codec, rounding, seed, None, FORWARD, "send")
    grad_opts = direction_options(grad_codec or codec, grad_rounding, seed, None, BACKWARD,
                                  "send")  # fmt: skip
    return _PipelineBoundary.apply(x, ranks, src, dst, opts, grad_opts, stats)


# ------------------------------------------------------------------ the group


class EmulatedTensorParallelGroup(TensorParallelGroup):
    """All ranks of a tensor-parallel group in this process: ``TensorParallelGroup``'s
    interface, whose per-rank values hold every rank's (see the module docstring).

    ``ranks``: the ``EmulatedRanks`` whose communicators run the collectives (their call
    counts and error-feedback residuals are the ranks' own).  ``forward``, ``backward``,
    ``seed``, ``sequence_parallel`` and ``stats``: as ``TensorParallelGroup``'s."""

    def __init__(
        self,
        ranks: EmulatedRanks,
        forward: WirePolicy = _DEFAULT_POLICY,
        backward: WirePolicy | None = None,
        *,
        seed: int = 0,
        sequence_parallel: bool = False,
    ) -> None:
        if not isinstance(ranks, EmulatedRanks):
            raise TypeError(f"ranks: expected fp4_comm.reference.EmulatedRanks, got "
                            f"{type(ranks).__name__}")  # fmt: skip
        self.ranks = ranks
        self.comm = None
        self.rank = None  # every rank
        self._set_policies(ranks.world_size, forward, backward, seed, sequence_parallel)
        self.native_group = None

    # --- the model's side

    def each(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn`` on rank r's values for every rank r (a ``PerRank``), or once where every
        argument is replicated (that result is every rank's)."""
        if not any(is_per_rank(a) for a in args):
            return fn(*args)
        for a in args:
            if is_per_rank(a):
                self._check_count("each", a)
        return PerRank(fn(*(a[r] if is_per_rank(a) else a for a in args)) for r in range(self.size))

    def shard(self, w: Any, dim: int = 0) -> PerRank:
        """Every rank's ``TensorParallelGroup.shard`` of ``w`` (of rank r's own ``w[r]`` where
        ``w`` is per rank)."""
        if is_per_rank(w):
            self._check_count("shard", w)
        return PerRank(
            _piece(w[r] if is_per_rank(w) else w, dim, r, self.size) for r in range(self.size)
        )

    def _check_count(self, what, value):
        if len(value) != self.size:
            raise ValueError(f"{what}: a per-rank value of {len(value)} for {self.size} ranks")

    def sharded_parameter(self, value: Sequence[torch.Tensor]) -> nn.ParameterList:
        """The ranks' shards (``shard``'s result), one parameter each."""
        if not is_per_rank(value):
            raise TypeError("sharded_parameter: expected every rank's shard (from shard or "
                            f"each), got {type(value).__name__}")  # fmt: skip
        self._check_count("sharded_parameter", value)
        return nn.ParameterList([nn.Parameter(v) for v in value])

    def replicated_parameter(self, value: torch.Tensor) -> nn.Parameter | nn.ParameterList:
        """One parameter, every rank's; under sequence parallelism one replica per rank, each
        with its own (partial) gradient."""
        if self.sequence_parallel:
            return nn.ParameterList([nn.Parameter(value.clone()) for _ in range(self.size)])
        return nn.Parameter(value)

    def backpropagate(self, loss: Any, scale: float = 1.0) -> None:
        """Every rank's ``(loss * scale).backward()``, in one backward pass (a collective's
        node needs every rank's gradient)."""
        if is_per_rank(loss):
            torch.autograd.backward([v * scale for v in loss])
        else:
            (loss * scale).backward()

    def sum_partial_grads(self, params: Iterable[Any]) -> None:
        """Every rank's ``TensorParallelGroup.sum_partial_grads``: under SP each replica's
        gradient becomes the float32 sum over the ranks (the "none-float32" all-reduce of the
        ranks' concatenated gradients)."""
        params = list(params)
        if not self.sequence_parallel:
            return
        for p in params:
            if not (isinstance(p, nn.ParameterList) and len(p) == self.size):
                raise TypeError(
                    "sum_partial_grads: under sequence parallelism every replicated parameter "
                    "has one replica per rank (replicated_parameter)"
                )
        for i, p in enumerate(params):
            missing = [r for r in range(self.size) if p[r].grad is None]
            if missing and len(missing) < self.size:
                raise ValueError(
                    f"sum_partial_grads: parameter {i} has no gradient on rank(s) {missing} but "
                    "has one on the others; every rank's replica takes part in the sum (a rank "
                    "whose replica got no gradient holds zeros: p.grad = torch.zeros_like(p))"
                )
        grads = [[p[r].grad for p in params if p[r].grad is not None] for r in range(self.size)]
        if not grads[0]:
            return
        flats = [torch.cat([g.reshape(-1) for g in gs]).float() for gs in grads]
        flats = self.ranks.all_reduce(flats, codec="none-float32")
        for gs, flat in zip(grads, flats, strict=True):
            off = 0
            for g in gs:
                g.copy_(flat[off : off + g.numel()].view_as(g))
                off += g.numel()

    # --- the collectives

    # ``enter`` and ``exit`` are TensorParallelGroup's: their collectives are this module's
    # functions over every rank

    def _collective(self, function, x, kw):
        return _FUNCTIONS[function](x, self.ranks, **kw)

    def _native(self, x, forward):
        kw = {"codec": NATIVE_EMULATION, "rounding": "nearest", "seed": self.seed}
        if forward:
            return reduce_from_tensor_parallel(x, self.ranks, **kw)
        return copy_to_tensor_parallel(x, self.ranks, **kw)

    def native_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(
            "an emulated group has no torch.distributed group; it runs 'native' as a float32 "
            "sum in rank order (enter / exit)"
        )


_FUNCTIONS = {
    f.__name__: f
    for f in (
        copy_to_tensor_parallel,
        reduce_from_tensor_parallel,
        gather_from_sequence_parallel,
        reduce_scatter_to_sequence_parallel,
    )
}


def _piece(w, dim, rank, size):
    pieces = w.chunk(size, dim)
    if rank >= len(pieces):
        return w.narrow(dim, 0, 0).clone()
    return pieces[rank].clone()


__all__ = [
    "NATIVE_EMULATION",
    "EmulatedTensorParallelGroup",
    "PerRank",
    "copy_to_tensor_parallel",
    "gather_from_sequence_parallel",
    "is_per_rank",
    "pipeline_boundary",
    "reduce_from_tensor_parallel",
    "reduce_scatter_to_sequence_parallel",
]
