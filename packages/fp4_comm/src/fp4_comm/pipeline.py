"""Pipeline-stage boundaries: the activation goes forward and its gradient comes back, each
compressed with its own policy.

    # stage 0 (rank 0)
    h = stage0(x)
    handle = pipeline.send_forward(h, comm, dst=1, codec="nvfp4")
    ...
    pipeline.backward(handle)          # receives h's gradient from rank 1 and backpropagates it

    # stage 1 (rank 1)
    h = pipeline.recv_forward(shape, torch.bfloat16, comm, src=0, codec="nvfp4")
    stage1(h).backward()               # sends h's gradient to rank 0 on the way

Both are autograd functions over ``Communicator.send`` / ``recv``: ``send_forward``'s backward
receives the gradient, ``recv_forward``'s backward sends it, so any schedule that runs the
backward passes in the order of the forward ones (GPipe, 1F1B) pairs them up.

The forward value: ``codec`` and ``rounding``, chosen by the sender.  The gradient:
``grad_codec`` (default: ``codec``; both stages must name the same) and ``grad_rounding``,
chosen by the stage that sends it (``recv_forward``'s argument), stochastic by default: the
boundary carries the residual stream, whose gradient every weight gradient of the first stage
sums over the tokens, so the error of nearest rounding, correlated from token to token, adds
up into a bias (docs/tp_training.md measures it).  A send's payload is not a sum, so there is
no error feedback.  ``seed``: the stochastic-rounding key; the step is the sender's count of
sends (``Communicator.send``).  ``stats``: a list to which each send appends a
``tensor_parallel.WireStats`` (RMS of the payload and the send's ``HopStats``).
"""

from __future__ import annotations

import torch

from .communicator import Communicator
from .tensor_parallel import (
    BACKWARD,
    FORWARD,
    RESIDUAL_GRAD_ROUNDING,
    check_call,
    direction_options,
    run_collective,
)


class _SendForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, dst, opts, grad_codec, stats):
        ctx.comm, ctx.dst, ctx.grad_codec = comm, dst, grad_codec
        ctx.shape, ctx.dtype = x.shape, x.dtype
        run_collective(comm, "send", x.detach().contiguous(), opts, "forward", stats, dst=dst)
        # the handle whose backward brings the gradient back; it carries no data
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, _):
        grad = ctx.comm.recv(ctx.shape, ctx.dtype, ctx.dst, codec=ctx.grad_codec)
        return grad, None, None, None, None, None


class _RecvForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, comm, shape, dtype, src, codec, grad_opts, stats):
        ctx.comm, ctx.src, ctx.grad_opts, ctx.stats = comm, src, grad_opts, stats
        return comm.recv(shape, dtype, src, codec=codec)

    @staticmethod
    def backward(ctx, grad):
        run_collective(ctx.comm, "send", grad.contiguous(), ctx.grad_opts, "backward", ctx.stats,
                       dst=ctx.src)  # fmt: skip
        return None, None, None, None, None, None, None, None


def send_forward(x, comm: Communicator, dst: int, codec="nvfp4", rounding="nearest", seed=0, *,
                 grad_codec=None, stats=None):  # fmt: skip
    """Send the activation ``x`` to the next stage (rank ``dst``); returns the handle that
    ``backward`` takes once that stage has sent the gradient back."""
    opts = direction_options(codec, rounding, seed, None, FORWARD, "send")
    if grad_codec is not None:  # (checked here: it is used in the backward, on this stage only)
        direction_options(grad_codec, "nearest", seed, None, BACKWARD, "recv")
    check_call("send_forward", x, stats)
    return _SendForward.apply(x, comm, dst, opts, grad_codec or codec, stats)


def backward(handle):
    """Receive the gradient of the activation that made ``handle`` and backpropagate it
    through this stage (accumulating into its parameters' ``.grad``)."""
    if not (isinstance(handle, torch.Tensor)
            and type(handle.grad_fn) is _SendForward._backward_cls):  # fmt: skip
        raise TypeError(
            "handle: what send_forward returned (with grad enabled, of an activation that "
            f"requires grad), got {type(handle).__name__}"
            + (" that send_forward did not return" if isinstance(handle, torch.Tensor) else "")
        )
    torch.autograd.backward(handle, torch.empty_like(handle))


def recv_forward(shape, dtype, comm: Communicator, src: int, codec="nvfp4", seed=0, *,
                 grad_codec=None, grad_rounding=RESIDUAL_GRAD_ROUNDING, stats=None):  # fmt: skip
    """The activation that the previous stage (rank ``src``) sent with ``send_forward``.  With
    grad enabled it requires grad, and the backward pass sends its gradient to ``src``."""
    grad_opts = direction_options(grad_codec or codec, grad_rounding, seed, None, BACKWARD,
                                  "send")  # fmt: skip
    check_call("recv_forward", None, stats)
    device = comm.device
    anchor = torch.empty(0, device=device, requires_grad=torch.is_grad_enabled())
    return _RecvForward.apply(anchor, comm, shape, dtype, src, codec, grad_opts, stats)


__all__ = ["backward", "recv_forward", "send_forward"]
