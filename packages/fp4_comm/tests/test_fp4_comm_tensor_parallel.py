"""Each autograd function runs its collective forward and the matching one backward: compared,
bit for bit, with the Communicator calls themselves (same step, same codec), and exactly with
the sums where the codec is exact (float32 values, integer-valued tensors)."""

import numpy as np
import pytest
import torch

from fp4_comm import tensor_parallel as tp


def _ints(seed, shape):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-20, 21, shape, generator=g).float()


def _run(comms, fn_name, codec, shape):
    comm = comms[2]
    if comm is None:
        return None
    r = comm.rank
    x = _ints(10 + r, shape).requires_grad_()
    fn = getattr(tp, fn_name)
    start = comm._calls
    y = fn(x, comm, codec=codec)
    upstream = _ints(20 + r, tuple(y.shape))
    (y * upstream).sum().backward()
    # the same collectives, by hand, with the steps the autograd functions used
    if fn_name == "copy_to_tensor_parallel":
        y_ref, g_ref = x.detach(), comm.all_reduce(upstream, codec=codec, step=start)
    elif fn_name == "reduce_from_tensor_parallel":
        y_ref, g_ref = comm.all_reduce(x.detach(), codec=codec, step=start), upstream
    elif fn_name == "gather_from_sequence_parallel":
        y_ref = comm.all_gather(x.detach(), codec=codec, step=start)
        g_ref = comm.reduce_scatter(upstream, codec=codec, step=start + 1)
    else:
        y_ref = comm.reduce_scatter(x.detach(), codec=codec, step=start)
        g_ref = comm.all_gather(upstream, codec=codec, step=start + 1)
    return (y.detach().numpy(), x.grad.numpy(), y_ref.numpy(), g_ref.numpy(), upstream.numpy())


FUNCTIONS = [
    ("copy_to_tensor_parallel", (4, 32)),
    ("reduce_from_tensor_parallel", (4, 32)),
    ("gather_from_sequence_parallel", (3, 32)),
    ("reduce_scatter_to_sequence_parallel", (4, 32)),
]


@pytest.mark.parametrize("codec", ["nvfp4", "none-float32"])
@pytest.mark.parametrize(("fn_name", "shape"), FUNCTIONS)
def test_forward_and_backward_collectives(cluster, fn_name, shape, codec):
    out = cluster.run(_run, fn_name, codec, shape)[:2]
    for y, grad, y_ref, g_ref, _ in out:
        assert np.array_equal(y, y_ref) and np.array_equal(grad, g_ref)
    if codec != "none-float32":
        return
    # Exact codec: the sums themselves.
    xs = [_ints(10 + r, shape).numpy() for r in range(2)]
    ups = [o[4] for o in out]
    for r, (y, grad, *_rest) in enumerate(out):
        if fn_name == "copy_to_tensor_parallel":
            assert np.array_equal(y, xs[r]) and np.array_equal(grad, ups[0] + ups[1])
        elif fn_name == "reduce_from_tensor_parallel":
            assert np.array_equal(y, xs[0] + xs[1]) and np.array_equal(grad, ups[r])
        elif fn_name == "gather_from_sequence_parallel":
            assert np.array_equal(y, np.concatenate(xs))
            m = shape[0]
            assert np.array_equal(grad, ups[0][r * m : (r + 1) * m] + ups[1][r * m : (r + 1) * m])
        else:
            m = shape[0] // 2
            assert np.array_equal(y, xs[0][r * m : (r + 1) * m] + xs[1][r * m : (r + 1) * m])
            assert np.array_equal(grad, np.concatenate(ups))
