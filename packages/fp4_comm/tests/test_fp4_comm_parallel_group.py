"""TensorParallelGroup: ``enter`` / ``exit`` are the tensor_parallel functions with the forward
policy on the values and the backward policy on their gradients (bit for bit the direct calls
with those options), with and without sequence parallelism; error-feedback buffers per site;
the native all-reduce; statistics; what it refuses."""

import numpy as np
import pytest
import torch

from fp4_comm import TensorParallelGroup, WirePolicy, tensor_parallel as tp

FWD = WirePolicy("mxfp4", "nearest")
BWD = WirePolicy("nvfp4")  # rounding None: each collective's default


def _randn(seed, shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _block(comm, enter, exit_, sp):
    """A block's communication: h = enter(x); y = exit(h * 2); loss = sum(y * u)."""
    x = _randn(10 + comm.rank, (4 // (2 if sp else 1), 2, 64)).requires_grad_()
    h = enter(x)
    y = exit_(h * 2)
    u = _randn(20 + comm.rank, tuple(y.shape))
    (y * u).sum().backward()
    return y.detach().numpy(), x.grad.numpy()


def _group_vs_direct(comms, sp):
    comm = comms[2]
    if comm is None:
        return None
    group = TensorParallelGroup(comm, FWD, BWD, seed=9, sequence_parallel=sp)
    group.stats = {}
    start = comm._calls
    got = _block(comm, lambda x: group.enter(x, "L0"), lambda x: group.exit(x, "L0"), sp)
    comm._calls = start  # the direct calls at the same stochastic-rounding steps
    fwd = {"codec": "mxfp4", "rounding": "nearest", "seed": 9}
    if sp:
        ref = _block(
            comm,
            lambda x: tp.gather_from_sequence_parallel(x, comm, **fwd, grad_codec="nvfp4"),
            # the residual stream's gradient: stochastic by default
            lambda x: tp.reduce_scatter_to_sequence_parallel(x, comm, **fwd, grad_codec="nvfp4",
                                                             grad_rounding="stochastic"),
            sp,
        )  # fmt: skip
    else:
        ref = _block(
            comm,
            # a summed gradient: the forward's rounding by default
            lambda x: tp.copy_to_tensor_parallel(x, comm, **fwd, grad_codec="nvfp4",
                                                 grad_rounding="nearest"),
            lambda x: tp.reduce_from_tensor_parallel(x, comm, **fwd),
            sp,
        )  # fmt: skip
    seen = {k: [(s.direction, s.op) for s in v] for k, v in group.stats.items()}
    return got, ref, seen


@pytest.mark.parametrize("sp", [False, True])
def test_enter_and_exit_apply_the_forward_and_backward_policies(cluster, sp):
    for got, ref, seen in cluster.run(_group_vs_direct, sp)[:2]:
        for a, b in zip(got, ref, strict=True):
            np.testing.assert_array_equal(a, b)
        if sp:
            assert seen == {
                "enter": [("forward", "all_gather"), ("backward", "reduce_scatter")],
                "exit": [("forward", "reduce_scatter"), ("backward", "all_gather")],
            }
        else:
            assert seen == {"enter": [("backward", "all_reduce")],
                            "exit": [("forward", "all_reduce")]}  # fmt: skip


def _ef_names(comms, sp):
    comm = comms[2]
    if comm is None:
        return None
    comm.error_feedback.reset()
    policy = WirePolicy("nvfp4", error_feedback=True)
    group = TensorParallelGroup(comm, policy, policy, sequence_parallel=sp)
    x = _randn(1, (2, 2, 64))
    with torch.no_grad():
        group.exit(group.enter(x, "L1"), "L1")
    after_eval = sorted(comm.error_feedback.names())
    _block(comm, lambda x: group.enter(x, "L0"), lambda x: group.exit(x, "L0"), sp)
    return after_eval, sorted(comm.error_feedback.names())


@pytest.mark.parametrize("sp", [False, True])
def test_error_feedback_buffers_per_site_and_direction(cluster, sp):
    """A residual where the collective is a sum: the block output's forward sum (not under
    no_grad: evaluation moves no residual) and the block input's gradient sum; none for the
    all-gathers of SP."""
    after_eval, names = cluster.run(_ef_names, sp)[0]
    assert after_eval == []
    assert names == ["L0.in.grad", "L0.out"]


def _native(comms):
    comm = comms[2]
    if comm is None:
        return None
    group = TensorParallelGroup(comm, WirePolicy("native"), WirePolicy("native"))
    x = torch.full((3, 4), float(comm.rank + 1), requires_grad=True)
    y = group.exit(group.enter(x, "L0") * 1.0, "L0")
    y.backward(torch.full((3, 4), 2.0))
    return y.detach().numpy(), x.grad.numpy()


def test_native_all_reduce(cluster):
    for y, grad in cluster.run(_native)[:2]:
        np.testing.assert_array_equal(y, np.full((3, 4), 3.0))  # 1 + 2
        np.testing.assert_array_equal(grad, np.full((3, 4), 4.0))  # 2 + 2


def _native_mismatch(comms, what):
    comm = comms[2]
    if comm is None:
        return None
    group = TensorParallelGroup(comm, WirePolicy("native"), WirePolicy("native"))
    if what == "shape":
        x = torch.ones(3 + comm.rank, 4)
    else:
        x = torch.ones(3, 4, dtype=torch.float32 if comm.rank == 0 else torch.bfloat16)
    try:
        group.exit(x, "L0")
    except ValueError as err:
        ok = group.exit(torch.ones(2, 2), "L0")  # the group still serves matching calls
        return str(err), ok.tolist()
    return "no error", None


@pytest.mark.parametrize("what", ["shape", "dtype"])
def test_native_all_reduce_of_different_tensors_is_an_error_on_every_rank(cluster, what):
    """Ranks passing tensors of different shapes to gloo's all-reduce aborted the process
    (SIGABRT): the ranks compare shape and dtype first, as the communicator checks its calls."""
    for message, ok in cluster.run(_native_mismatch, what)[:2]:
        assert "native all-reduce: the ranks' tensors differ in shape or dtype" in message, message
        words = ["rank 0: float32, 2 dims", "rank 1: float32, 2 dims"]
        if what == "dtype":
            words = ["rank 0: float32", "rank 1: bfloat16"]
        assert all(w in message for w in words), message
        assert ok == [[2.0, 2.0], [2.0, 2.0]]


def _partial_grads(comms, sp):
    comm = comms[2]
    if comm is None:
        return None
    group = TensorParallelGroup(comm, WirePolicy("none"), sequence_parallel=sp)
    p = torch.nn.Parameter(torch.zeros(5))
    p.grad = torch.full((5,), float(comm.rank + 1))
    group.sum_partial_grads([p])
    shards = [group.shard(torch.arange(6.0).view(3, 2))]
    return p.grad.numpy(), shards[0].numpy()


def test_partial_gradients_are_summed_under_sequence_parallelism_only(cluster):
    for rank, (grad, shard) in enumerate(cluster.run(_partial_grads, True)[:2]):
        np.testing.assert_array_equal(grad, np.full(5, 3.0))
        np.testing.assert_array_equal(shard, np.arange(6.0).reshape(3, 2)[[0, 1]] if rank == 0
                                      else np.arange(6.0).reshape(3, 2)[[2]])  # fmt: skip
    for rank, (grad, _) in enumerate(cluster.run(_partial_grads, False)[:2]):
        np.testing.assert_array_equal(grad, np.full(5, rank + 1.0))


def _grads_held(comms, mixed):
    comm = comms[2]
    if comm is None:
        return None
    group = TensorParallelGroup(comm, WirePolicy("none"), sequence_parallel=True)
    a, b, c, d = (torch.nn.Parameter(torch.zeros(4)) for _ in range(4))
    if mixed:  # rank 0 holds a's gradient, rank 1 b's (same size): rank 0's a + rank 1's b
        (a if comm.rank == 0 else b).grad = torch.full((4,), 1.0 + comm.rank)
    c.grad = torch.full((4,), 1.0 + comm.rank)  # d: no gradient on any rank
    try:
        group.sum_partial_grads([a, b, c, d])
    except ValueError as err:
        return str(err)
    return [None if p.grad is None else p.grad.tolist() for p in (a, b, c, d)]


def test_partial_gradients_held_on_some_ranks_only_are_refused_on_every_rank(cluster):
    """A parameter with a gradient on some ranks only: the ranks compare which they hold, and
    every rank refuses (before, each rank summed its own list of gradients, so rank 0's
    gradient of one parameter was added to rank 1's of the next); one without a gradient on
    any rank keeps none."""
    for message in cluster.run(_grads_held, True)[:2]:
        assert "the ranks hold gradients of different parameters" in message
        assert "rank 0: 2 of 4 parameters; rank 1: 2 of 4" in message
    for grads in cluster.run(_grads_held, False)[:2]:
        assert grads == [None, None, [3.0] * 4, None]


def test_one_rank_runs_no_collective():
    group = TensorParallelGroup(None, WirePolicy("nvfp4"))
    x = torch.ones(2, 3)
    assert group.enter(x, "a") is x and group.exit(x, "a") is x
    assert (group.size, group.rank, group.sequence_parallel) == (1, 0, False)


@pytest.mark.parametrize(
    ("forward", "backward", "sp", "match"),
    [
        (WirePolicy("native"), WirePolicy("nvfp4"), False, "forward values and their gradients"),
        (WirePolicy("native"), WirePolicy("native"), True, "without sequence parallelism"),
        (WirePolicy("native", error_feedback=True), None, False, "or error feedback"),
    ],
)
def test_native_refuses_what_it_does_not_do(forward, backward, sp, match):
    with pytest.raises(ValueError, match=match):
        TensorParallelGroup(None, forward, backward, sequence_parallel=sp)


def test_group_arguments_are_named():
    """TensorParallelGroup('x') raised AttributeError on 'rank'; group.stats = [] raised
    AttributeError ('setdefault') at the next collective."""
    with pytest.raises(TypeError, match="comm: a Communicator"):
        TensorParallelGroup("x")
    group = TensorParallelGroup(None)
    with pytest.raises(TypeError, match="stats: None or a dict"):
        group.stats = []
    group.stats = {}
    assert group.stats == {}


def _uneven(comms):
    comm = comms[2]
    if comm is None:
        return None
    group = TensorParallelGroup(comm, WirePolicy("none-float32"), sequence_parallel=True)
    partial = torch.arange(12.0).view(3, 4) * (comm.rank + 1)  # 3 rows: shards of 2 and 1
    shard = group.exit(partial, "L0")
    try:
        group.enter(shard, "L1")
        plain = "gathered"
    except ValueError as err:
        plain = str(err)
    return tuple(shard.shape), group.enter(shard, "L1", total_dim0=3).numpy(), plain


def test_sequence_parallel_enter_gathers_the_uneven_shards_exit_made(cluster):
    """exit of a length the ranks do not divide gives shards of 2 and 1 rows, which enter
    could not gather (it had no total_dim0)."""
    full = (torch.arange(12.0).view(3, 4) * 3).numpy()  # rank 0's + rank 1's
    for rank, (shape, gathered, plain) in enumerate(cluster.run(_uneven)[:2]):
        assert shape == ((2, 4) if rank == 0 else (1, 4))
        np.testing.assert_array_equal(gathered, full)
        assert "disagree" in plain or "total_dim0" in plain
    with pytest.raises(ValueError, match="total_dim0: the gathered length"):
        TensorParallelGroup(None).enter(torch.ones(2, 4), "L0", total_dim0=2)
