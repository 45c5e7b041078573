"""Communicator behaviour that needs its own processes: a rank that never calls makes the others
fail with CommTimeoutError within the timeout (never a hang), and torchrun-style construction
from the environment."""

import time

import pytest
import torch
from fp4_comm_cluster import Cluster

import fp4_comm

TIMEOUT_S = 3.0


def _run_missing_rank(comms):
    comm = comms[2]
    if comm.rank == 1:
        return "absent"
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(64), codec="none-float32")
    except fp4_comm.CommTimeoutError as err:
        return ("timeout", time.monotonic() - start, str(err))
    return ("returned", time.monotonic() - start, "")


@pytest.fixture
def small_cluster():
    c = Cluster(2, timeout_s=TIMEOUT_S)
    yield c
    c.close(force=True)  # its group is out of step after the timeout: not reused


def test_missing_rank_times_out(small_cluster):
    outcome = small_cluster.run(_run_missing_rank, timeout_s=60)
    status, elapsed, message = outcome[0]
    assert status == "timeout", outcome
    assert "argument check" in message
    # gloo's timeout, plus scheduling slack on a loaded 2-core machine
    assert TIMEOUT_S * 0.9 <= elapsed < TIMEOUT_S + 30
