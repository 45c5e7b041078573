"""TimedCommunicator: it passes every call through unchanged, adds up the time spent in its
calls (perf_counter on the CPU), and starts again from zero after each take."""

import time

import numpy as np
import torch

from fp4_comm import TimedCommunicator, pipeline, tensor_parallel as tp


def _timed_calls(comms):
    comm = comms[2]
    if comm is None:
        return None
    timed = TimedCommunicator(comm)
    x = torch.arange(64.0).view(2, 32) * (comm.rank + 1)
    start = comm._calls
    y = tp.reduce_from_tensor_parallel(x, timed, codec="nvfp4")
    direct = comm.all_reduce(x, codec="nvfp4", step=start)
    ms_call = timed.take_ms()
    ms_empty = timed.take_ms()
    timed.timed(time.sleep, 0.05)
    ms_sleep = timed.take_ms()
    # a pipeline boundary through the wrapper (its recv counts as communication too)
    if comm.rank == 0:
        pipeline.send_forward(x, timed, 1, "none-float32")
    else:
        pipeline.recv_forward((2, 32), torch.float32, timed, 0, "none-float32")
    return (np.array_equal(y.numpy(), direct.numpy()), timed.rank, timed.world_size, ms_call,
            ms_empty, ms_sleep, timed.take_ms())  # fmt: skip


def test_calls_pass_through_and_their_time_adds_up(cluster):
    for rank, out in enumerate(cluster.run(_timed_calls)[:2]):
        same, r, world, ms_call, ms_empty, ms_sleep, ms_p2p = out
        assert same and (r, world) == (rank, 2)
        assert ms_call > 0 and ms_empty == 0 and ms_p2p > 0
        assert 50 <= ms_sleep < 30_000  # (a loaded machine may oversleep; never undersleep)


def test_timed_communicator_names_what_is_not_a_communicator_and_copies():
    """TimedCommunicator(None) raised AttributeError on 'device'; copy.copy recursed in
    __getattr__ (no 'comm' on the copy yet)."""
    import copy

    import pytest
    import torch

    from fp4_comm import TimedCommunicator

    for bad in (None, "x"):
        with pytest.raises(TypeError, match="comm: a Communicator"):
            TimedCommunicator(bad)

    class Comm:
        device = torch.device("cpu")
        rank, world_size = 0, 1

    timed = TimedCommunicator(Comm())
    twin = copy.copy(timed)
    assert twin.rank == 0 and twin.comm is timed.comm
