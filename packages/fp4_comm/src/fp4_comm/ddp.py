"""A DistributedDataParallel communication hook: gradient buckets all-reduced in FP4.

    comm = fp4_comm.Communicator.from_process_group(group)   # the group DDP uses
    model = DDP(model, process_group=group)
    fp4_comm.ddp.register(model, comm, codec="nvfp4", error_feedback=True)

Each bucket goes through ``Communicator.all_reduce`` (bit-identical gradients on every rank)
and is divided by the world size, as DDP's default hook averages.  With error feedback, each
bucket keeps the residuals of its quantizations and adds them to its next gradients, so the
quantization error does not accumulate into a bias over the steps.  A bucket's residual is
named by the registration (the first, second ... hook registered on the communicator: two
models on one communicator keep theirs apart) and by the bucket's layout (which parameters,
in which order: the same on every rank).  DDP rebuilds its buckets after the first step, in
the order the gradients became ready; a bucket whose layout changed starts from residual 0
(its old residual, laid out for other parameters, is reset) rather than adding one
parameter's quantization error to another's gradient.
"""

# No `from __future__ import annotations`: DDP checks the hook's return annotation as an object.
import weakref
import zlib
from dataclasses import dataclass, field

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
    #: the hook's place among those registered on ``comm`` (0, 1, ...): its residuals' prefix
    registration: int = 0
    #: id(parameter) -> its position in the model's parameters (the same on every rank)
    positions: dict = field(default_factory=dict, repr=False)
    #: (bucket index, its parameters' ids) -> residual name; bucket index -> the name in use
    names: dict = field(default_factory=dict, repr=False)
    current: dict = field(default_factory=dict, repr=False)


# Communicator -> how many hooks were registered on it (their residuals' prefixes)
_REGISTRATIONS = weakref.WeakKeyDictionary()


def _residual_name(state: FP4HookState, bucket: dist.GradBucket) -> str:
    """The residual name of ``bucket``'s current layout; a bucket index whose layout changed
    (DDP's rebuild) has its previous residual reset."""
    index, params = bucket.index(), bucket.parameters()
    key = (index, tuple(map(id, params)))
    name = state.names.get(key)
    if name is None:
        layout = [(state.positions.get(id(p), -1), p.numel()) for p in params]
        crc = zlib.crc32(repr(layout).encode())
        name = state.names[key] = f"ddp{state.registration}_bucket_{index}_{crc:08x}"
    previous = state.current.get(index)
    if previous != name:
        if previous is not None:
            state.comm.error_feedback.reset(previous)
        state.current[index] = name
    return name


def fp4_allreduce_hook(
    state: FP4HookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket's mean over ranks, through the compressed all-reduce."""
    buf = bucket.buffer()
    name = _residual_name(state, bucket) if state.error_feedback else None
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
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(
            f"model: expected a torch DistributedDataParallel model, got {type(model).__name__}"
        )
    _check_same_ranks(model, comm)
    registration = _REGISTRATIONS.get(comm, 0)
    positions = {id(p): i for i, p in enumerate(model.parameters())}
    state = FP4HookState(comm, codec, rounding, error_feedback, seed, registration, positions)
    model.register_comm_hook(state, fp4_allreduce_hook)
    _REGISTRATIONS[comm] = registration + 1
    return state


def _check_same_ranks(model, comm):
    """ValueError unless ``comm`` spans the ranks of DDP's process group (a communicator of
    another group averages over other ranks: the replicas diverge)."""
    group, control = getattr(model, "process_group", None), comm.control_group
    if group is None or control is None:
        return
    ddp_ranks = dist.get_process_group_ranks(group)
    comm_ranks = dist.get_process_group_ranks(control)
    if ddp_ranks != comm_ranks:
        raise ValueError(
            f"comm: its ranks {comm_ranks} are not DDP's process group's {ddp_ranks}; make "
            "the communicator over the group DDP uses (Communicator.from_process_group(group))"
        )
