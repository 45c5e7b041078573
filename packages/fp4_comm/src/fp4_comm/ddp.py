"""A DistributedDataParallel communication hook: gradient buckets all-reduced in FP4.

    comm = fp4_comm.Communicator.from_process_group(group)   # the group DDP uses
    model = DDP(model, process_group=group)
    fp4_comm.ddp.register(model, comm, codec="nvfp4", error_feedback=True)

Each bucket goes through ``Communicator.all_reduce`` (bit-identical gradients on every rank)
and is divided by the world size, as DDP's default hook averages.  With error feedback, each
bucket keeps the residuals of its quantizations and adds them to its next gradients, so the
quantization error does not accumulate into a bias over the steps.
"""

# No `from __future__ import annotations`: DDP checks the hook's return annotation as an object.
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .codecs import CodecSpec, Rounding, get_codec
from .communicator import Communicator, check_options


@dataclass
class FP4HookState:
    """What the hook needs; DDP hands it back on every call."""

    comm: Communicator
    codec: CodecSpec = "nvfp4"
    rounding: Rounding = "nearest"
    error_feedback: bool = True
    seed: int = 0


def fp4_allreduce_hook(
    state: FP4HookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket's mean over ranks, through the compressed all-reduce."""
    buf = bucket.buffer()
    # DDP rebuilds its buckets after the first iteration (new sizes under the same indices):
    # the size in the name keeps a residual from being added to another bucket's gradients.
    name = f"ddp_bucket_{bucket.index()}_{buf.numel()}" if state.error_feedback else None
    out = state.comm.all_reduce(
        buf, codec=state.codec, rounding=state.rounding, seed=state.seed, error_feedback=name
    )
    out.div_(state.comm.world_size)
    # On a GPU the result is still being computed on the current stream; a Future that knows
    # the device records that stream, so DDP's copy into the gradients waits for it, without a
    # host synchronization.
    fut = torch.futures.Future(devices=[buf.device] if buf.is_cuda else None)
    fut.set_result(out)
    return fut


def register(
    model: DistributedDataParallel,
    comm: Communicator,
    codec: CodecSpec = "nvfp4",
    rounding: Rounding = "nearest",
    error_feedback: bool = True,
    seed: int = 0,
) -> FP4HookState:
    """Register ``fp4_allreduce_hook`` on a DDP ``model``; returns the hook's state.

    The options are checked here (ValueError / TypeError naming the argument), not at the
    first backward.  With error feedback, a gradient bucket that overflows (NaN or Inf, as under
    mixed precision before a GradScaler skips the step) gives NaN in the blocks that held
    them, and those blocks' residuals restart from 0: the next step is finite again
    (``comm.error_feedback.nonfinite_blocks()`` counts such blocks)."""
    if not isinstance(comm, Communicator):
        raise TypeError(f"comm: expected an fp4_comm.Communicator, got {type(comm).__name__}")
    get_codec(codec)
    check_options(rounding, seed)
    if not isinstance(error_feedback, bool):
        raise TypeError(f"error_feedback: True or False, got {error_feedback!r}")
    state = FP4HookState(comm, codec, rounding, error_feedback, seed)
    model.register_comm_hook(state, fp4_allreduce_hook)
    return state
