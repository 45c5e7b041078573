"""Each autograd function runs its collective forward and the matching one backward: compared,
bit for bit, with the Communicator calls themselves (same step, same codec), and exactly with
the sums where the codec is exact (float32 values, integer-valued tensors).  The sequence
parallel pairs also with a sequence length that is no multiple of the world size."""

import numpy as np
import pytest
import torch

from fp4_comm import shard_rows, tensor_parallel as tp


def _ints(seed, shape):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-20, 21, shape, generator=g).float()


def _shape(fn_name, shape, total, rank):
    """The input of ``rank``: a shard of ``total`` rows where the function gathers them."""
    if fn_name == "gather_from_sequence_parallel" and total is not None:
        return (shard_rows(total, 2)[rank], *shape[1:])
    return shape


def _run(comms, fn_name, codec, shape, total):
    comm = comms[2]
    if comm is None:
        return None
    r = comm.rank
    x = _ints(10 + r, _shape(fn_name, shape, total, r)).requires_grad_()
    fn = getattr(tp, fn_name)
    start = comm._calls
    kw = {"total_dim0": total} if total is not None else {}
    y = fn(x, comm, codec=codec, **kw)
    upstream = _ints(20 + r, tuple(y.shape))
    (y * upstream).sum().backward()
    # the same collectives, by hand, with the steps the autograd functions used
    if fn_name == "copy_to_tensor_parallel":
        y_ref, g_ref = x.detach(), comm.all_reduce(upstream, codec=codec, step=start)
    elif fn_name == "reduce_from_tensor_parallel":
        y_ref, g_ref = comm.all_reduce(x.detach(), codec=codec, step=start), upstream
    elif fn_name == "gather_from_sequence_parallel":
        y_ref = comm.all_gather(x.detach(), codec=codec, step=start, total_dim0=total)
        g_ref = comm.reduce_scatter(upstream, codec=codec, step=start + 1)
    else:
        y_ref = comm.reduce_scatter(x.detach(), codec=codec, step=start)
        g_ref = comm.all_gather(upstream, codec=codec, step=start + 1, total_dim0=shape[0])
    return (y.detach().numpy(), x.grad.numpy(), y_ref.numpy(), g_ref.numpy(), upstream.numpy())


FUNCTIONS = [
    # name, shape (gather: of each rank's shard), total_dim0 (gather: the gathered length)
    ("copy_to_tensor_parallel", (4, 32), None),
    ("reduce_from_tensor_parallel", (4, 32), None),
    ("gather_from_sequence_parallel", (3, 32), None),
    ("gather_from_sequence_parallel", (0, 32), 5),  # shards of 3 and 2 rows
    ("reduce_scatter_to_sequence_parallel", (4, 32), None),
    ("reduce_scatter_to_sequence_parallel", (5, 32), None),  # 3 and 2 rows
]


@pytest.mark.parametrize("codec", ["nvfp4", "none-float32"])
@pytest.mark.parametrize(("fn_name", "shape", "total"), FUNCTIONS)
def test_forward_and_backward_collectives(cluster, fn_name, shape, total, codec):
    out = cluster.run(_run, fn_name, codec, shape, total)[:2]
    for r, (y, grad, y_ref, g_ref, _) in enumerate(out):
        assert np.array_equal(y, y_ref) and np.array_equal(grad, g_ref)
        assert grad.shape == _shape(fn_name, shape, total, r)  # x's shape
    if codec != "none-float32":
        return
    # Exact codec: the sums themselves.
    xs = [_ints(10 + r, _shape(fn_name, shape, total, r)).numpy() for r in range(2)]
    ups = [o[4] for o in out]
    for r, (y, grad, *_rest) in enumerate(out):
        if fn_name == "copy_to_tensor_parallel":
            assert np.array_equal(y, xs[r]) and np.array_equal(grad, ups[0] + ups[1])
        elif fn_name == "reduce_from_tensor_parallel":
            assert np.array_equal(y, xs[0] + xs[1]) and np.array_equal(grad, ups[r])
        elif fn_name == "gather_from_sequence_parallel":
            assert np.array_equal(y, np.concatenate(xs))
            m = xs[0].shape[0]  # rank 0 holds the largest shard
            rows = slice(r * m, r * m + xs[r].shape[0])
            assert np.array_equal(grad, ups[0][rows] + ups[1][rows])
        else:
            m = -(-shape[0] // 2)
            rows = slice(r * m, r * m + shard_rows(shape[0], 2)[r])
            assert np.array_equal(y, xs[0][rows] + xs[1][rows])
            assert np.array_equal(grad, np.concatenate(ups))


def _randn(seed, shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _ef_run(comms, fn_name, use_ef, steps):
    """The same inputs ``steps`` times: returns the mean of what the compressed collective
    delivered (the output, or the gradient where the collective runs backward) and the exact
    sum it approximates."""
    comm = comms[2]
    if comm is None:
        return None
    r = comm.rank
    fn = getattr(tp, fn_name)
    backward = fn_name in ("copy_to_tensor_parallel", "gather_from_sequence_parallel")
    xs = [_randn(10 + k, (4, 64)) for k in range(2)]
    out_rows = (
        8 if fn_name == "gather_from_sequence_parallel" else (2 if "scatter" in fn_name else 4)
    )
    ups = [_randn(20 + k, (out_rows, 64)) for k in range(2)]
    delivered = []
    for _ in range(steps):
        x = xs[r].clone().requires_grad_()
        ef = f"{fn_name}.ef" if use_ef else None
        y = fn(x, comm, codec="nvfp4", error_feedback=ef)
        (y * ups[r]).sum().backward()
        delivered.append(x.grad if backward else y.detach())
    mean = torch.stack(delivered).mean(0)
    if fn_name == "copy_to_tensor_parallel":
        exact = ups[0] + ups[1]
    elif fn_name == "reduce_from_tensor_parallel":
        exact = xs[0] + xs[1]
    elif fn_name == "gather_from_sequence_parallel":
        exact = (ups[0] + ups[1])[4 * r : 4 * r + 4]
    else:
        exact = (xs[0] + xs[1])[2 * r : 2 * r + 2]
    return float((mean - exact).pow(2).mean() / exact.pow(2).mean()), comm.error_feedback.names()


@pytest.mark.parametrize(
    "fn_name",
    [
        "copy_to_tensor_parallel",
        "reduce_from_tensor_parallel",
        "gather_from_sequence_parallel",
        "reduce_scatter_to_sequence_parallel",
    ],
)
def test_error_feedback_makes_repeated_sums_converge(cluster, fn_name):
    """Nearest rounding of the same input repeats the same error every step, so without error
    feedback the mean over steps is as wrong as one step; with it the residual is carried, and
    the mean's error shrinks like 1/steps (here 8: its energy by far more than 4x)."""
    without = cluster.run(_ef_run, fn_name, False, 8)[:2]
    with_ef = cluster.run(_ef_run, fn_name, True, 8)[:2]
    for (err0, names0), (err1, names1) in zip(without, with_ef, strict=True):
        assert f"{fn_name}.ef" not in names0 and f"{fn_name}.ef" in names1
        assert err1 < err0 / 4, (err0, err1)
