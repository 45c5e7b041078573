"""fp4_comm.pipeline: the activation crosses the stage boundary forward and its gradient comes
back, each with its own codec and rounding, bit for bit what ``Communicator.send`` / ``recv``
deliver with those options; the gradient is stochastically rounded by default; a stage's
parameters get the gradient of the loss computed on the other rank."""

import numpy as np
import pytest
import torch

from fp4_comm import pipeline

SHAPE = (4, 3, 64)  # [sequence, batch, hidden]


def _randn(seed, shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _exchange(comms, fwd, grad_codec, grad_rounding, microbatches=2):
    """Stage 0 (rank 0): h = x * w, sent; stage 1 (rank 1): loss = sum(h * u).  GPipe order:
    every forward, then every backward.  Then the same payloads through direct sends with the
    options the boundary should have used.  Returns what each rank saw."""
    comm = comms[2]
    if comm is None:
        return None
    codec, rounding = fwd
    kw = {"grad_codec": grad_codec, "seed": 5}
    stats = []
    sends0 = comm._sends
    if comm.rank == 0:
        w = torch.ones(SHAPE[-1], requires_grad=True)
        xs = [_randn(70 + i, SHAPE) for i in range(microbatches)]
        handles = [pipeline.send_forward(x * w, comm, 1, codec, rounding, stats=stats, **kw)
                   for x in xs]  # fmt: skip
        for handle in handles:
            pipeline.backward(handle)
        # what rank 1 sent back, received directly, and what w's gradient should be from it
        grads = [comm.recv(SHAPE, torch.float32, 1, codec=grad_codec) for _ in xs]
        w_grad = sum((g * x).sum((0, 1)) for g, x in zip(grads, xs, strict=True))
        for i, x in enumerate(xs):  # the forward payloads again, directly, at the same steps
            comm.send(x, 1, codec=codec, rounding=rounding, seed=5, step=sends0 + i)
        return w.grad.numpy(), w_grad.numpy(), [s.direction for s in stats]
    if grad_rounding is not None:
        kw["grad_rounding"] = grad_rounding
    hs = [pipeline.recv_forward(SHAPE, torch.float32, comm, 0, codec, stats=stats, **kw)
          for _ in range(microbatches)]  # fmt: skip
    assert all(h.requires_grad for h in hs)
    us = [_randn(80 + i, SHAPE) for i in range(microbatches)]
    for h, u in zip(hs, us, strict=True):
        (h * u).sum().backward()
    for i, u in enumerate(us):  # the gradients again, directly, with the policy's options
        comm.send(u, 0, codec=grad_codec, rounding=grad_rounding or "stochastic", seed=5,
                  step=sends0 + i)  # fmt: skip
    direct = [comm.recv(SHAPE, torch.float32, 0, codec=codec) for _ in hs]
    got = [h.detach().numpy() for h in hs]
    return got, [d.numpy() for d in direct], [s.direction for s in stats]


@pytest.mark.parametrize(
    ("fwd", "grad_codec", "grad_rounding"),
    [
        (("nvfp4", "nearest"), "mxfp4", None),  # the default: stochastic gradients
        (("mxfp4", "stochastic"), "nvfp4", "nearest"),
        (("none", "nearest"), "nvfp4", "stochastic"),  # backward only
        (("nvfp4", "nearest"), "none", None),  # forward only
    ],
)
def test_boundary_policies_match_direct_sends(cluster, fwd, grad_codec, grad_rounding):
    stage0, stage1 = cluster.run(_exchange, fwd, grad_codec, grad_rounding)[:2]
    w_grad, w_grad_ref, seen0 = stage0
    h, h_ref, seen1 = stage1
    for a, b in zip(h, h_ref, strict=True):
        np.testing.assert_array_equal(a, b)
    # the gradient that reached stage 0's weight is the one the direct send delivers again
    # (the same step: sends0 + i on rank 1 both times, as the counter is the sender's)
    np.testing.assert_allclose(w_grad, w_grad_ref, rtol=1e-6)
    assert seen0 == ["forward", "forward"] and seen1 == ["backward", "backward"]


def _rounding_of_gradient(comms, grad_rounding):
    comm = comms[2]
    if comm is None:
        return None
    comm._sends = 0
    kw = {} if grad_rounding is None else {"grad_rounding": grad_rounding}
    if comm.rank == 0:
        x = _randn(90, SHAPE).requires_grad_()
        pipeline.backward(pipeline.send_forward(x, comm, 1, "none-float32", grad_codec="nvfp4"))
        return x.grad.numpy()
    h = pipeline.recv_forward(SHAPE, torch.float32, comm, 0, "none-float32", grad_codec="nvfp4",
                              **kw)  # fmt: skip
    (h * _randn(91, SHAPE)).sum().backward()
    return None


def test_gradient_is_stochastically_rounded_by_default(cluster):
    default = cluster.run(_rounding_of_gradient, None)[0]
    stochastic = cluster.run(_rounding_of_gradient, "stochastic")[0]
    nearest = cluster.run(_rounding_of_gradient, "nearest")[0]
    np.testing.assert_array_equal(default, stochastic)
    assert not np.array_equal(stochastic, nearest)


def _no_grad_recv(comms):
    comm = comms[2]
    if comm is None:
        return None
    with torch.no_grad():
        if comm.rank == 0:
            pipeline.send_forward(_randn(1, SHAPE), comm, 1, "none-float32")
            return None
        h = pipeline.recv_forward(SHAPE, torch.float32, comm, 0, "none-float32")
    return h.requires_grad, h.numpy()


def test_evaluation_under_no_grad_sends_no_gradient(cluster):
    """Under torch.no_grad the received activation needs no gradient (an evaluation pass)."""
    requires_grad, h = cluster.run(_no_grad_recv)[1]
    assert not requires_grad
    np.testing.assert_array_equal(h, _randn(1, SHAPE).numpy())


def test_a_send_has_no_error_feedback():
    with pytest.raises(TypeError, match="error_feedback"):
        pipeline.send_forward(torch.zeros(2), None, 1, error_feedback="boundary")
    with pytest.raises(ValueError, match="grad_rounding: 'up'"):
        pipeline.recv_forward((2,), torch.float32, None, 0, grad_rounding="up")


def test_options_used_in_the_backward_are_checked_at_the_call():
    """A gradient codec, seed or rounding that only the backward uses was checked there, on one
    stage, while the other waited for the communicator's timeout; the message named codec or
    rounding instead of grad_codec / grad_rounding."""
    import pytest

    x = torch.randn(4, 64, requires_grad=True)
    for call, message in (
        (lambda: pipeline.recv_forward((4, 64), torch.float32, None, 0, seed=-1), "seed"),
        (lambda: pipeline.recv_forward((4, 64), torch.float32, None, 0, grad_codec="bogus"),
         "grad_codec: 'bogus' is not"),
        (lambda: pipeline.recv_forward((4, 64), torch.float32, None, 0, codec="tahquant-h64"),
         "grad_rounding: 'stochastic', but grad_codec tahquant-h64 rounds to nearest only"),
        (lambda: pipeline.send_forward(x, None, 1, grad_codec="bogus"),
         "grad_codec: 'bogus' is not"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            call()


def test_backward_refuses_what_send_forward_did_not_return():
    """The activation passed instead of the handle backpropagated uninitialized memory."""
    import pytest

    h = torch.randn(4, 64, requires_grad=True) * 2
    for handle in (h, torch.empty(0), "handle"):
        with pytest.raises(TypeError, match="handle: what send_forward returned"):
            pipeline.backward(handle)
