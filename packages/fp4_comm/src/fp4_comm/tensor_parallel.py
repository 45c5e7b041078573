"""Autograd functions for tensor and sequence parallelism, whose collectives are compressed.

Megatron-LM's pairs (Shoeybi et al. 2019; Korthikanti et al. 2022), each backward doing the
collective that matches its forward:

| function | forward | backward |
| --- | --- | --- |
| ``copy_to_tensor_parallel`` (column-parallel input) | identity | all-reduce |
| ``reduce_from_tensor_parallel`` (row-parallel output) | all-reduce | identity |
| ``gather_from_sequence_parallel`` (dim 0) | all-gather | reduce-scatter |
| ``reduce_scatter_to_sequence_parallel`` (dim 0) | reduce-scatter | all-gather |

The forward value and its gradient each have their own policy:

- ``codec``, ``rounding``, ``error_feedback``: the forward collective's;
- ``grad_codec`` (default: ``codec``), ``grad_rounding``, ``grad_error_feedback``: the backward
  one's.  ``grad_rounding`` defaults to ``rounding`` for a gradient that is summed (all-reduce,
  reduce-scatter) and to ``"stochastic"`` for the gradient that
  ``reduce_scatter_to_sequence_parallel`` all-gathers: that one is the residual stream's
  gradient, which every weight gradient of the layer sums over the tokens, so the error of
  nearest rounding, correlated from token to token, adds up into a bias (docs/tp_training.md
  measures it); stochastic rounding's error is zero in the mean.

``codec``: as ``Communicator`` takes it ("nvfp4", "mxfp4", "none", "none-float32", a ``Codec``
or an ``fp4_kernels.FP4Quant``).  ``error_feedback`` / ``grad_error_feedback``: a buffer name
unique to the call site (``Communicator.all_reduce``); only a sum (all-reduce, reduce-scatter)
has error feedback, so naming one for an all-gather or an identity raises ValueError.
``seed``: the stochastic-rounding key of both directions.  ``stats``: a list; every collective
the function runs, forward and backward, appends a ``WireStats`` to it (the payload's RMS and
the codec's per-hop ``HopStats``; 0-d tensors, no host synchronization).

The sequence dimension is dim 0 (Megatron's [s, b, h] layout); its length
need not be a multiple of the world size: rank r holds ``fp4_comm.shard_rows(s, W)[r]`` rows
(ceil(s / W), the last ranks fewer or none), as ``Communicator.reduce_scatter`` splits it, and
``gather_from_sequence_parallel`` takes the full length as ``total_dim0`` when the shards differ.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .codecs import ROUNDINGS, SEED_LIMIT, CodecSpec, Rounding, check_int, get_codec
from .communicator import Communicator
from .stats import HopStats

#: the default rounding of the residual stream's gradient (SP all-gather, pipeline boundary)
RESIDUAL_GRAD_ROUNDING = "stochastic"


class WireStats(NamedTuple):
    """What one compressed collective or send did to its payload (this rank's view)."""

    #: "forward" (the value) or "backward" (its gradient)
    direction: str
    #: the collective: "all_reduce", "reduce_scatter", "all_gather" or "send"
    op: str
    #: root mean square of this rank's payload, a 0-d float32 tensor
    rms: torch.Tensor
    #: hop name ("reduce_scatter", "all_gather", "send") -> HopStats of this rank's encodes
    hops: dict[str, HopStats]


FORWARD = ("rounding", "error_feedback")  # the argument names of each direction
BACKWARD = ("grad_rounding", "grad_error_feedback")
_SUMS = ("all-reduce", "reduce-scatter")


def direction_options(
    codec: CodecSpec,
    rounding: Rounding,
    seed: int,
    error_feedback: str | None,
    names: tuple[str, str],
    runs: str,
) -> dict[str, Any]:
    """The keyword arguments of one direction's collective, checked: ``names`` are that
    direction's argument names (``FORWARD`` / ``BACKWARD``), for the errors; ``runs`` the
    collective it runs ("all-reduce", "reduce-scatter", "all-gather", "send", or "no
    collective")."""
    if not isinstance(rounding, str) or rounding not in ROUNDINGS:
        raise ValueError(f"{names[0]}: {rounding!r} is not one of {ROUNDINGS}")
    # the codec and the seed too, at the call: a direction that runs in the backward would
    # otherwise raise there, on one rank, while its peer waits for the collective
    what = "grad_codec" if names == BACKWARD else "codec"
    try:
        spec = get_codec(codec)
    except ValueError as err:
        raise ValueError(f"{what}: {str(err).removeprefix('codec: ')}") from None
    check_int(seed, "seed", SEED_LIMIT)
    if rounding != "nearest" and getattr(spec, "nearest_only", False):
        raise ValueError(
            f"{names[0]}: {rounding!r}, but {what} {spec.name} rounds to nearest only; pass "
            f"{names[0]}='nearest'"
        )
    if error_feedback is not None and runs not in _SUMS:
        raise ValueError(
            f"{names[1]}={error_feedback!r}: error feedback corrects a sum (all-reduce or "
            f"reduce-scatter), and this direction runs {runs}"
        )
    opts = {"codec": codec, "rounding": rounding, "seed": seed}
    if error_feedback is not None:
        opts["error_feedback"] = error_feedback
    return opts


#: The collective each function runs forward and backward (``direction_options``' ``runs``).
RUNS = {
    "copy_to_tensor_parallel": ("no collective", "all-reduce"),
    "reduce_from_tensor_parallel": ("all-reduce", None),
    "gather_from_sequence_parallel": ("all-gather", "reduce-scatter"),
    "reduce_scatter_to_sequence_parallel": ("reduce-scatter", "all-gather"),
}


def function_options(
    function: str,
    codec: CodecSpec,
    rounding: Rounding,
    seed: int,
    error_feedback: str | None = None,
    grad_codec: CodecSpec | None = None,
    grad_rounding: Rounding | None = None,
    grad_error_feedback: str | None = None,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The checked keyword arguments of the forward and the backward collective of
    ``function`` (a key of ``RUNS``; this module's functions and ``fp4_comm.emulated``'s take
    the same options): ``direction_options`` of each direction, the gradient's codec
    defaulting to ``codec``; None for a backward without a collective.  ``grad_rounding``
    arrives with the function's own default applied (the forward's rounding for a summed
    gradient, ``RESIDUAL_GRAD_ROUNDING`` for the residual stream's)."""
    runs, grad_runs = RUNS[function]
    opts = direction_options(codec, rounding, seed, error_feedback, FORWARD, runs)
    if grad_runs is None:
        return opts, None
    grad_opts = direction_options(grad_codec or codec, grad_rounding, seed, grad_error_feedback,
                                  BACKWARD, grad_runs)  # fmt: skip
    return opts, grad_opts


def check_call(function: str, x: Any, stats: Any) -> None:
    """TypeError naming ``function``'s argument, before any collective moves: ``x`` not a
    torch tensor (None: not checked), ``stats`` neither a list nor None."""
    if x is not None and not isinstance(x, torch.Tensor):
        raise TypeError(f"{function}: x: expected a torch tensor, got {type(x).__name__} "
                        "(torch.as_tensor(...) makes one of an array)")  # fmt: skip
    if stats is not None and not isinstance(stats, list):
        raise TypeError(f"{function}: stats: expected a list (the WireStats are appended) or "
                        f"None, got {type(stats).__name__}")  # fmt: skip


def run_collective(
    comm: Communicator,
    op: str,
    x: torch.Tensor,
    opts: dict[str, Any],
    direction: str,
    stats: list[WireStats] | None,
    **extra: Any,
) -> torch.Tensor | None:
    """``comm.<op>(x, **opts)``; with ``stats`` a list, also append its ``WireStats``."""
    fn = getattr(comm, op)
    if stats is None:
        return fn(x, **opts, **extra)
    rms = x.detach().float().pow(2).mean().sqrt()
    out, hops = fn(x, **opts, **extra, stats=True)  # a send returns (None, hops)
    stats.append(WireStats(direction, op, rms, hops))
    return out


class _CopyToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, grad_opts, stats):
        ctx.comm, ctx.grad_opts, ctx.stats = comm, grad_opts, stats
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        g = run_collective(ctx.comm, "all_reduce", grad.contiguous(), ctx.grad_opts, "backward",
                           ctx.stats)  # fmt: skip
        return g, None, None, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, opts, stats):
        return run_collective(comm, "all_reduce", x.contiguous(), opts, "forward", stats)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


class _GatherFromSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, opts, grad_opts, total_dim0, stats):
        ctx.comm, ctx.grad_opts, ctx.stats = comm, grad_opts, stats
        return run_collective(comm, "all_gather", x.contiguous(), opts, "forward", stats,
                              total_dim0=total_dim0)  # fmt: skip

    @staticmethod
    def backward(ctx, grad):
        # reduce_scatter splits dim 0 as shard_rows does: this rank's rows, x's shape
        g = run_collective(ctx.comm, "reduce_scatter", grad.contiguous(), ctx.grad_opts,
                           "backward", ctx.stats)  # fmt: skip
        return g, None, None, None, None, None


class _ReduceScatterToSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, opts, grad_opts, stats):
        ctx.comm, ctx.grad_opts, ctx.stats, ctx.dim0 = comm, grad_opts, stats, x.shape[0]
        return run_collective(comm, "reduce_scatter", x.contiguous(), opts, "forward", stats)

    @staticmethod
    def backward(ctx, grad):
        g = run_collective(ctx.comm, "all_gather", grad.contiguous(), ctx.grad_opts, "backward",
                           ctx.stats, total_dim0=ctx.dim0)  # fmt: skip
        return g, None, None, None, None


def copy_to_tensor_parallel(
    x: torch.Tensor,
    comm: Communicator,
    codec: CodecSpec = "nvfp4",
    rounding: Rounding = "nearest",
    seed: int = 0,
    *,
    grad_codec: CodecSpec | None = None,
    grad_rounding: Rounding | None = None,
    error_feedback: str | None = None,
    grad_error_feedback: str | None = None,
    stats: list[WireStats] | None = None,
) -> torch.Tensor:
    """Identity forward; backward all-reduces the gradient (a column-parallel layer's input).

    The forward runs no collective: ``codec`` and ``rounding`` only give the gradient's
    defaults, and ``error_feedback`` must be None (the gradient's sum takes
    ``grad_error_feedback``)."""
    check_call("copy_to_tensor_parallel", x, stats)
    _, grad_opts = function_options("copy_to_tensor_parallel", codec, rounding, seed,
                                    error_feedback, grad_codec, grad_rounding or rounding,
                                    grad_error_feedback)  # fmt: skip
    return _CopyToTensorParallel.apply(x, comm, grad_opts, stats)


def reduce_from_tensor_parallel(
    x: torch.Tensor,
    comm: Communicator,
    codec: CodecSpec = "nvfp4",
    rounding: Rounding = "nearest",
    seed: int = 0,
    *,
    error_feedback: str | None = None,
    stats: list[WireStats] | None = None,
) -> torch.Tensor:
    """All-reduce forward (a row-parallel layer's partial outputs); identity backward."""
    check_call("reduce_from_tensor_parallel", x, stats)
    opts, _ = function_options("reduce_from_tensor_parallel", codec, rounding, seed,
                               error_feedback)  # fmt: skip
    return _ReduceFromTensorParallel.apply(x, comm, opts, stats)


def gather_from_sequence_parallel(
    x: torch.Tensor,
    comm: Communicator,
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
) -> torch.Tensor:
    """All-gather along dim 0 forward; reduce-scatter of the gradient backward.
    ``total_dim0``: the gathered length, when the ranks' shards differ (``shard_rows``)."""
    check_call("gather_from_sequence_parallel", x, stats)
    opts, grad_opts = function_options("gather_from_sequence_parallel", codec, rounding, seed,
                                       error_feedback, grad_codec, grad_rounding or rounding,
                                       grad_error_feedback)  # fmt: skip
    return _GatherFromSequenceParallel.apply(x, comm, opts, grad_opts, total_dim0, stats)


def reduce_scatter_to_sequence_parallel(
    x: torch.Tensor,
    comm: Communicator,
    codec: CodecSpec = "nvfp4",
    rounding: Rounding = "nearest",
    seed: int = 0,
    *,
    grad_codec: CodecSpec | None = None,
    grad_rounding: Rounding = RESIDUAL_GRAD_ROUNDING,
    error_feedback: str | None = None,
    grad_error_feedback: str | None = None,
    stats: list[WireStats] | None = None,
) -> torch.Tensor:
    """Reduce-scatter along dim 0 forward (any length: ``shard_rows``); all-gather of the
    gradient back to x's length backward, stochastically rounded unless ``grad_rounding``
    says otherwise (the residual stream's gradient: see the module docstring)."""
    check_call("reduce_scatter_to_sequence_parallel", x, stats)
    opts, grad_opts = function_options("reduce_scatter_to_sequence_parallel", codec, rounding,
                                       seed, error_feedback, grad_codec, grad_rounding,
                                       grad_error_feedback)  # fmt: skip
    return _ReduceScatterToSequenceParallel.apply(x, comm, opts, grad_opts, stats)
