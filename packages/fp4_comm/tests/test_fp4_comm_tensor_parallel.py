"""Each autograd function runs its collective forward and the matching one backward: compared,
bit for bit, with the Communicator calls themselves (same step, same codec, same rounding), and
exactly with the sums where the codec is exact (float32 values, integer-valued tensors).  The
sequence parallel pairs also with a sequence length that is no multiple of the world size.
The forward and backward policies (codec, rounding, error feedback) reach their own collective:
checked against the direct calls with those options, and by the default stochastic rounding of
the residual stream's gradient differing from nearest rounding of the same inputs."""

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
        # the residual stream's gradient: stochastic rounding by default
        g_ref = comm.all_gather(upstream, codec=codec, rounding="stochastic", step=start + 1,
                                total_dim0=shape[0])  # fmt: skip
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
        y = fn(x, comm, codec="nvfp4", **{("grad_error_feedback" if backward else
                                           "error_feedback"): ef})  # fmt: skip
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


# The forward collective and the gradient's, by function: (op, kwargs) of the direct calls.
_OPS = {
    "copy_to_tensor_parallel": (None, "all_reduce"),
    "reduce_from_tensor_parallel": ("all_reduce", None),
    "gather_from_sequence_parallel": ("all_gather", "reduce_scatter"),
    "reduce_scatter_to_sequence_parallel": ("reduce_scatter", "all_gather"),
}


def _policy_run(comms, fn_name, fwd, bwd):
    """The function with forward policy ``fwd`` and gradient policy ``bwd`` ((codec, rounding)
    each), and the direct calls with those options.
    Also returns what the stats list collected: (direction, op, rms) per collective."""
    comm = comms[2]
    if comm is None:
        return None
    r = comm.rank
    x = _randn(30 + r, (4, 64)).requires_grad_()
    fn = getattr(tp, fn_name)
    fwd_op, bwd_op = _OPS[fn_name]
    kw = {"codec": fwd[0], "rounding": fwd[1], "seed": 7}
    if bwd_op is not None:
        kw.update(grad_codec=bwd[0], grad_rounding=bwd[1])
    stats = []
    start = comm._calls
    y = fn(x, comm, **kw, stats=stats)
    upstream = _randn(40 + r, tuple(y.shape))
    (y * upstream).sum().backward()
    refs, step = [], start
    for op, arg, policy in ((fwd_op, x.detach(), fwd), (bwd_op, upstream, bwd)):
        if op is None:
            refs.append(None)
            continue
        codec, rounding = policy
        extra = {"total_dim0": 4} if (fn_name, op) == (
            "reduce_scatter_to_sequence_parallel", "all_gather") else {}  # fmt: skip
        refs.append(getattr(comm, op)(arg, codec=codec, rounding=rounding, seed=7, step=step,
                                      **extra).numpy())  # fmt: skip
        step += 1
    got = [y.detach().numpy(), x.grad.numpy()]
    seen = [(s.direction, s.op, float(s.rms), sorted(s.hops)) for s in stats]
    payload_rms = [float(x.detach().pow(2).mean().sqrt()), float(upstream.pow(2).mean().sqrt())]
    return got, refs, seen, payload_rms


@pytest.mark.parametrize("fn_name", list(_OPS))
@pytest.mark.parametrize(
    ("fwd", "bwd"),
    [
        (("mxfp4", "nearest"), ("nvfp4", "stochastic")),
        (("nvfp4", "stochastic"), ("mxfp4", "nearest")),
        (("none", "nearest"), ("nvfp4", "stochastic")),  # a forward-only / backward-only split
    ],
)
def test_forward_and_gradient_policies_reach_their_collectives(cluster, fn_name, fwd, bwd):
    out = cluster.run(_policy_run, fn_name, fwd, bwd)[:2]
    fwd_op, bwd_op = _OPS[fn_name]
    for got, refs, seen, payload_rms in out:
        if fwd_op is not None:
            np.testing.assert_array_equal(got[0], refs[0])
        if bwd_op is not None:
            np.testing.assert_array_equal(got[1], refs[1])
        expected = [(d, op) for d, op in (("forward", fwd_op), ("backward", bwd_op)) if op]
        assert [(d, op) for d, op, _, _ in seen] == expected
        for direction, _, rms, hops in seen:
            want = payload_rms[direction == "backward"]
            assert rms == pytest.approx(want, rel=1e-6) and hops


def _grad_rounding_run(comms, grad_rounding):
    """The gradient all-gather of reduce_scatter_to_sequence_parallel, on the same inputs, with
    grad_rounding given or (None) left to its default."""
    comm = comms[2]
    if comm is None:
        return None
    x = _randn(50 + comm.rank, (4, 64)).requires_grad_()
    kw = {} if grad_rounding is None else {"grad_rounding": grad_rounding}
    comm._calls = 0  # the same stochastic-rounding step in every run
    y = tp.reduce_scatter_to_sequence_parallel(x, comm, codec=_fp4quant(),
                                               rounding="nearest", seed=3, **kw)  # fmt: skip
    upstream = _randn(60 + comm.rank, tuple(y.shape))
    (y * upstream).sum().backward()
    direct = comm.all_gather(upstream, codec=_fp4quant(), rounding=grad_rounding or "stochastic",
                             seed=3, step=1, total_dim0=4)  # fmt: skip
    return x.grad.numpy(), direct.numpy()


def _fp4quant():
    import fp4_kernels

    return fp4_kernels.FP4Quant(64)


def test_residual_gradient_all_gather_is_stochastic_by_default(cluster):
    default = cluster.run(_grad_rounding_run, None)[:2]
    stochastic = cluster.run(_grad_rounding_run, "stochastic")[:2]
    nearest = cluster.run(_grad_rounding_run, "nearest")[:2]
    for run in (default, stochastic, nearest):
        for grad, direct in run:
            np.testing.assert_array_equal(grad, direct)  # the collective with those options
    for r in range(2):
        np.testing.assert_array_equal(default[r][0], stochastic[r][0])
        assert not np.array_equal(stochastic[r][0], nearest[r][0])


def _bad_call(comms, fn_name, kwargs):
    comm = comms[2]
    if comm is None:
        return None
    x = torch.zeros(4, 64, requires_grad=True)
    try:
        getattr(tp, fn_name)(x, comm, codec="nvfp4", **kwargs)
    except (ValueError, TypeError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


@pytest.mark.parametrize(
    ("fn_name", "kwargs", "match"),
    [
        ("copy_to_tensor_parallel", {"error_feedback": "a"}, "error_feedback='a'.*runs no coll"),
        ("gather_from_sequence_parallel", {"error_feedback": "a"}, "runs all-gather"),
        ("reduce_scatter_to_sequence_parallel", {"grad_error_feedback": "a"},
         "grad_error_feedback='a'.*runs all-gather"),
        ("reduce_from_tensor_parallel", {"rounding": "up"}, "rounding: 'up' is not one of"),
        ("copy_to_tensor_parallel", {"grad_rounding": "up"}, "grad_rounding: 'up'"),
        ("reduce_from_tensor_parallel", {"grad_error_feedback": "a"}, "TypeError"),
    ],
)  # fmt: skip
def test_a_policy_that_cannot_apply_is_refused_by_name(cluster, fn_name, kwargs, match):
    """Error feedback corrects a sum: naming it for an all-gather or an identity is refused
    (before any collective runs, so no rank waits for the others), as is an unknown rounding."""
    import re

    for message in cluster.run(_bad_call, fn_name, kwargs)[:2]:
        assert re.search(match, message), message


_FUNCTIONS = ["copy_to_tensor_parallel", "reduce_from_tensor_parallel",
              "gather_from_sequence_parallel", "reduce_scatter_to_sequence_parallel"]  # fmt: skip


@pytest.mark.parametrize("fn_name", _FUNCTIONS)
def test_an_array_or_a_dict_of_stats_is_named_before_any_collective(fn_name):
    """A numpy array for x raised AttributeError ('contiguous') inside the autograd function;
    stats={} raised AttributeError ('append') after the collective had moved the data.  Both
    are refused before the communicator is touched (here: none at all)."""
    from fp4_comm import pipeline

    fn = getattr(tp, fn_name)
    with pytest.raises(TypeError, match=f"{fn_name}: x: expected a torch tensor, got ndarray"):
        fn(np.ones((4, 16), np.float32), None)
    with pytest.raises(TypeError, match=f"{fn_name}: stats: expected a list .* got dict"):
        fn(torch.ones(4, 16), None, stats={})
    with pytest.raises(TypeError, match="send_forward: x: expected a torch tensor, got list"):
        pipeline.send_forward([1.0], None, 1)
    with pytest.raises(TypeError, match="recv_forward: stats: expected a list .* got dict"):
        pipeline.recv_forward((4, 16), torch.float32, None, 0, stats={})
