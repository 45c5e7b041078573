"""Faults on the NCCL path, on real GPUs (``gpu``): a rank killed in the middle of a collective,
a rank that never arrives, a rank that calls another collective.  The survivors raise
``CommPeerError`` within the communicator's timeout (plus the watchdog's polling and NCCL's
abort); nothing hangs.  Each test starts a cluster of its own (``FP4_COMM_TEST_RANKS`` ranks,
default 2; more ranks than GPUs share them in NCCL's multi-rank mode), since the fault leaves
its NCCL communicator aborted."""

import os
import time

import pytest
import torch
from fp4_comm_cluster import Cluster, Died, env_ranks, skip_unless_ranks_fit

import fp4_comm

pytestmark = pytest.mark.gpu

TIMEOUT_S = 10.0
# The watchdog polls every millisecond; NCCL's abort and a process start add seconds.
SLACK_S = 30.0


@pytest.fixture
def cluster():
    world = env_ranks()
    skip_unless_ranks_fit(world)
    c = Cluster(world, timeout_s=TIMEOUT_S, gpu=True)
    yield c
    c.close(force=True)


def _waited(gpu, collective, *args, **kwargs):
    """(error class name, message, seconds) of ``collective(*args, **kwargs)`` and the
    synchronize after it; (None, None, seconds) where both return.  A peer's failure raises
    CommPeerError, a refused argument check ValueError."""
    start = time.monotonic()
    try:
        collective(*args, **kwargs)
        gpu.synchronize(timeout_s=TIMEOUT_S)
    except (ValueError, fp4_comm.CommPeerError) as err:
        return type(err).__name__, str(err), time.monotonic() - start
    return None, None, time.monotonic() - start


def _warm(comms, shape):
    gpu = comms["cuda"]
    gpu.validate = "first"  # checked once here; the faulty call below skips the check
    y = gpu.all_reduce(torch.ones(shape, device=gpu.device), codec="mxfp4")
    gpu.synchronize()
    return float(y[0, 0])


def _die_inside(comms, shape, hop, victim):
    """``victim`` exits inside the collective (before its transport moves ``hop``'s bytes: the
    argument check and the encode done, its peers already waiting); the others wait."""
    gpu = comms["cuda"]
    if gpu.rank == victim:
        transport = gpu.transport

        def die(*args, **kwargs):
            torch.cuda.synchronize()
            os._exit(17)

        setattr(transport, hop, die)
    return _waited(gpu, gpu.all_reduce, torch.ones(shape, device=gpu.device), codec="mxfp4")


@pytest.mark.parametrize("hop", ["all_to_all", "all_gather"])
def test_rank_killed_mid_collective(cluster, hop):
    shape = (64, 1024)
    assert cluster.run(_warm, shape) == [float(cluster.world)] * cluster.world
    victim = cluster.world - 1
    out = cluster.run(_die_inside, shape, hop, victim, timeout_s=TIMEOUT_S + 120, allow_death=True)
    assert isinstance(out[victim], Died) and out[victim].exitcode == 17
    for rank, (kind, message, waited) in enumerate(out[:victim]):
        # the watchdog's timeout, or NCCL's own report of a peer gone
        assert kind in ("CommTimeoutError", "CommConnectionError"), (rank, message)
        assert waited < TIMEOUT_S + SLACK_S, (rank, waited)


def _arrive_unless(comms, absent, validate):
    gpu = comms["cuda"]
    if gpu.rank == absent:
        time.sleep(TIMEOUT_S + SLACK_S)  # alive, but never takes part
        return "absent"
    gpu.validate = validate
    return _waited(gpu, gpu.all_reduce, torch.ones(8, 256, device=gpu.device), codec="nvfp4")


@pytest.mark.parametrize("validate", ["always", "never"])
def test_rank_that_never_arrives(cluster, validate):
    # "always": the argument check over gloo times out; "never": the first NCCL transfer
    # (its connection to the absent peer, then the transfer itself) is ended by the watchdog.
    absent = cluster.world - 1
    out = cluster.run(_arrive_unless, absent, validate, timeout_s=2 * (TIMEOUT_S + SLACK_S) + 60)
    assert out[absent] == "absent"
    kinds = [kind for kind, _, _ in out[:absent]]
    # With more than two ranks, the first survivor to time out leaves the gloo group, and a
    # survivor still waiting may see that before its own timeout: a peer gone, the other kind
    # of CommPeerError.  At least one survivor times out on the absent rank.
    assert "CommTimeoutError" in kinds, out
    for rank, (kind, message, waited) in enumerate(out[:absent]):
        assert kind in ("CommTimeoutError", "CommConnectionError"), (rank, message)
        assert waited < TIMEOUT_S + SLACK_S, (rank, waited)


def _different_collective(comms, validate):
    """Rank 0 calls reduce_scatter, the others all_reduce: the same first hop (an all-to-all
    of equal chunks), then the others wait for an all-gather that rank 0 never joins."""
    gpu = comms["cuda"]
    gpu.validate = validate
    x = torch.ones(16 * gpu.world_size, 64, device=gpu.device)
    op = "reduce_scatter" if gpu.rank == 0 else "all_reduce"
    return _waited(gpu, getattr(gpu, op), x, codec="mxfp4")


def test_rank_calling_another_collective_is_refused_by_the_check(cluster):
    for kind, message, _ in cluster.run(_different_collective, "always"):
        assert kind == "ValueError" and "ranks disagree" in message


def test_rank_calling_another_collective_unchecked_ends_in_a_peer_error(cluster):
    # validate="never" is the caller's promise that the calls match.  Broken, rank 0's
    # reduce-scatter ends after the first hop, and the ranks that wait for the second hop get
    # CommTimeoutError from the watchdog instead of waiting for ever.
    out = cluster.run(_different_collective, "never", timeout_s=TIMEOUT_S + SLACK_S + 60)
    kind, message, waited = out[0]
    assert kind is None and waited < TIMEOUT_S, (message, waited)
    for rank, (kind, message, waited) in enumerate(out[1:], start=1):
        assert kind == "CommTimeoutError", (rank, message)
        assert waited < TIMEOUT_S + SLACK_S, (rank, waited)
