import faulthandler
import os
import signal
import threading

import pytest
from fp4_comm_cluster import Cluster

from fp4_kernels.testing import load_test_profile, seed_torch_generators

# hypothesis derandomized and without a database unless FP4_TEST_PROFILE=explore
# (nox -s tests_explore)
load_test_profile()

# One cluster for the session: four gloo ranks, with communicators over all four, over ranks
# 0-2 and over ranks 0-1 (even and uneven world sizes, subgroups, one cluster to start).
WORLD = 4

# Every test of this package gets at most this long (FP4_COMM_TEST_TIMEOUT_S), so that a hang
# (a collective waiting for a peer that never comes) fails the run instead of stalling CI.  At
# the limit the test fails with the traceback of where it waited; should it not return even
# then (stuck inside a C call that signals cannot interrupt), the process dumps every thread's
# stack and exits 1, HARD_GRACE_S later.  The worker processes of a cluster are killed when it
# is closed, or exit when this process does (their pipe closes).
TEST_TIMEOUT_S = int(os.environ.get("FP4_COMM_TEST_TIMEOUT_S", "600"))
HARD_GRACE_S = 120


@pytest.fixture(autouse=True)
def _time_limit(request):
    if not hasattr(signal, "SIGALRM") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        pytest.fail(
            f"{request.node.nodeid} did not finish within {TEST_TIMEOUT_S} s "
            "(FP4_COMM_TEST_TIMEOUT_S): a hang",
            pytrace=True,
        )

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(TEST_TIMEOUT_S)
    faulthandler.dump_traceback_later(TEST_TIMEOUT_S + HARD_GRACE_S, exit=True)
    try:
        yield
    finally:
        signal.alarm(0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="session")
def cluster():
    c = Cluster(WORLD, sizes=(4, 3, 2))
    yield c
    c.close()


@pytest.fixture(autouse=True)
def _torch_generators(request):
    """torch's global generators seeded by the test's id (``seed_torch_generators``)."""
    seed_torch_generators(request.node.nodeid)
