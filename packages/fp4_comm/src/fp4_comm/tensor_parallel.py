"""Autograd functions for tensor and sequence parallelism, whose collectives are compressed.

Megatron-LM's pairs (Shoeybi et al. 2019; Korthikanti et al. 2022), each backward doing the
collective that matches its forward:

| function | forward | backward |
| --- | --- | --- |
| ``copy_to_tensor_parallel`` (column-parallel input) | identity | all-reduce |
| ``reduce_from_tensor_parallel`` (row-parallel output) | all-reduce | identity |
| ``gather_from_sequence_parallel`` (dim 0) | all-gather | reduce-scatter |
| ``reduce_scatter_to_sequence_parallel`` (dim 0) | reduce-scatter | all-gather |

Each takes the communicator of the tensor-parallel group and the codec options of the forward
collective (``codec``, ``rounding``, ``seed``); ``grad_codec`` (default: ``codec``) is used for
the backward one.  ``error_feedback``, a buffer name unique to the call site (e.g. the layer's
name), turns on error feedback (``Communicator.all_reduce``) for the function's all-reduce or
reduce-scatter, whichever direction it runs in: forward for ``reduce_from_tensor_parallel`` and
``reduce_scatter_to_sequence_parallel``, backward (the gradient) for ``copy_to_tensor_parallel``
and ``gather_from_sequence_parallel``.  All-gathers have none: their payload is not a sum.

The sequence dimension is dim 0 (Megatron's [s, b, h] layout); its length
need not be a multiple of the world size: rank r holds ``fp4_comm.shard_rows(s, W)[r]`` rows
(ceil(s / W), the last ranks fewer or none), as ``Communicator.reduce_scatter`` splits it, and
``gather_from_sequence_parallel`` takes the full length as ``total_dim0`` when the shards differ.
"""

from __future__ import annotations

import torch

from .codecs import CodecSpec, Rounding
from .communicator import Communicator


def _opts(codec, rounding, seed, error_feedback=None):
    opts = {"codec": codec, "rounding": rounding, "seed": seed}
    if error_feedback is not None:
        opts["error_feedback"] = error_feedback
    return opts


class _CopyToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, grad_opts):
        ctx.comm, ctx.grad_opts = comm, grad_opts
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_reduce(grad.contiguous(), **ctx.grad_opts), None, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, opts):
        return comm.all_reduce(x.contiguous(), **opts)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _GatherFromSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, opts, grad_opts, total_dim0):
        ctx.comm, ctx.grad_opts = comm, grad_opts
        return comm.all_gather(x.contiguous(), total_dim0=total_dim0, **opts)

    @staticmethod
    def backward(ctx, grad):
        # reduce_scatter splits dim 0 as shard_rows does: this rank's rows, x's shape
        return ctx.comm.reduce_scatter(grad.contiguous(), **ctx.grad_opts), None, None, None, None


class _ReduceScatterToSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, opts, grad_opts):
        ctx.comm, ctx.grad_opts, ctx.dim0 = comm, grad_opts, x.shape[0]
        return comm.reduce_scatter(x.contiguous(), **opts)

    @staticmethod
    def backward(ctx, grad):
        grad = ctx.comm.all_gather(grad.contiguous(), total_dim0=ctx.dim0, **ctx.grad_opts)
        return grad, None, None, None


def copy_to_tensor_parallel(
    x: torch.Tensor,
    comm: Communicator,
    codec: CodecSpec = "nvfp4",
    rounding: Rounding = "nearest",
    seed: int = 0,
    grad_codec: CodecSpec | None = None,
    error_feedback: str | None = None,
) -> torch.Tensor:
    """Identity forward; backward all-reduces the gradient (a column-parallel layer's input)."""
    opts = _opts(grad_codec or codec, rounding, seed, error_feedback)
    return _CopyToTensorParallel.apply(x, comm, opts)


def reduce_from_tensor_parallel(
    x: torch.Tensor,
    comm: Communicator,
    codec: CodecSpec = "nvfp4",
    rounding: Rounding = "nearest",
    seed: int = 0,
    error_feedback: str | None = None,
) -> torch.Tensor:
    """All-reduce forward (a row-parallel layer's partial outputs); identity backward."""
    return _ReduceFromTensorParallel.apply(x, comm, _opts(codec, rounding, seed, error_feedback))


def gather_from_sequence_parallel(
    x: torch.Tensor,
    comm: Communicator,
    codec: CodecSpec = "nvfp4",
    rounding: Rounding = "nearest",
    seed: int = 0,
    grad_codec: CodecSpec | None = None,
    total_dim0: int | None = None,
    error_feedback: str | None = None,
) -> torch.Tensor:
    """All-gather along dim 0 forward; reduce-scatter of the gradient backward.
    ``total_dim0``: the gathered length, when the ranks' shards differ (``shard_rows``)."""
    return _GatherFromSequenceParallel.apply(
        x,
        comm,
        _opts(codec, rounding, seed),
        _opts(grad_codec or codec, rounding, seed, error_feedback),
        total_dim0,
    )


def reduce_scatter_to_sequence_parallel(
    x: torch.Tensor,
    comm: Communicator,
    codec: CodecSpec = "nvfp4",
    rounding: Rounding = "nearest",
    seed: int = 0,
    grad_codec: CodecSpec | None = None,
    error_feedback: str | None = None,
) -> torch.Tensor:
    """Reduce-scatter along dim 0 forward (any length: ``shard_rows``); all-gather of the
    gradient back to x's length backward."""
    return _ReduceScatterToSequenceParallel.apply(
        x,
        comm,
        _opts(codec, rounding, seed, error_feedback),
        _opts(grad_codec or codec, rounding, seed),
    )
