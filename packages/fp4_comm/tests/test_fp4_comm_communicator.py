"""Communicator behaviour under faults, in gloo processes of its own: a rank that never calls,
calls late, or is killed makes the others raise CommPeerError (CommTimeoutError,
CommConnectionError) naming the collective and the rank, within the timeout (never a hang, never
a raw gloo error); ranks whose calls differ get ValueError on every rank whatever ``validate``
says (never data read from another call, never a process aborted by gloo); and the per-test
time limit that turns a hang into a failure."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from fp4_comm_cluster import Cluster, Died

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


def _run_killed_rank(comms, phase):
    comm = comms[2]
    if phase == "before":
        comm.all_reduce(torch.ones(64), codec="mxfp4")  # the group works
        return "ok"
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1.0)  # rank 1 is gone by now
    outcomes = {}
    calls = {
        "all_reduce": lambda: comm.all_reduce(torch.ones(64), codec="mxfp4"),
        "reduce_scatter": lambda: comm.reduce_scatter(torch.ones(4, 32), codec="nvfp4"),
        "all_gather": lambda: comm.all_gather(torch.ones(2, 32), codec="none"),
        "send": lambda: comm.send(torch.ones(64), dst=1),
        "recv": lambda: comm.recv((64,), torch.float32, src=1),
        # the data phase itself, after a check that passed
        "all_to_all": lambda: comm.transport.all_to_all(
            [(torch.zeros(2, 8, dtype=torch.uint8), torch.empty(2, 8, dtype=torch.uint8))]
        ),
    }
    for name, call in calls.items():
        try:
            call()
            outcomes[name] = ("returned", "")
        except fp4_comm.CommPeerError as err:
            outcomes[name] = (type(err).__name__, str(err), err.op, err.rank, err.peers)
        except Exception as err:  # noqa: BLE001 - the test reports what it was
            outcomes[name] = (type(err).__name__, str(err))
    return outcomes


def test_killed_rank_is_a_peer_error_naming_the_collective_and_the_rank():
    c = Cluster(2, timeout_s=TIMEOUT_S)
    try:
        assert c.run(_run_killed_rank, "before") == ["ok", "ok"]
        start = time.monotonic()
        outcomes, dead = c.run(_run_killed_rank, "after", timeout_s=120, allow_death=True)
        elapsed = time.monotonic() - start
    finally:
        c.close(force=True)
    assert dead == Died(-signal.SIGKILL)
    for name, outcome in outcomes.items():
        assert outcome[0] in ("CommConnectionError", "CommTimeoutError"), (name, outcome)
        kind, message, op, rank, peers = outcome
        assert name in message and "rank 1" in message, message
        assert rank == 0 and peers == [1]
        assert op is not None and name in op
    assert outcomes["all_reduce"][0] == "CommConnectionError"
    assert elapsed < 6 * (TIMEOUT_S + 10)  # at worst each call waits out the timeout


def _fail_at_start(comms, rank, world, timeout_s):
    # a worker's start-up: rank 1 fails (raises, or its process ends), rank 0 then waits for
    # it, as NCCL's init waits for a peer that never comes
    how = os.environ["FP4_TEST_START_FAILURE"]
    if rank == 1:
        if how == "exit":
            os._exit(3)
        raise RuntimeError("rank 1 cannot start")
    time.sleep(120)


@pytest.mark.parametrize("how", ["raise", "exit"])
def test_a_worker_that_fails_at_start_fails_the_cluster_at_once(monkeypatch, how):
    """The test harness itself: a worker that raises or dies while the cluster starts fails
    the start within the grace period (its error named, the rank still waiting named), not
    after the start timeout."""
    import fp4_comm_cluster

    monkeypatch.setenv("FP4_TEST_START_FAILURE", how)  # the spawned workers inherit it
    monkeypatch.setattr(fp4_comm_cluster, "START_GRACE_S", 2.0)
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        Cluster(2, setup=_fail_at_start, start_timeout_s=300)
    message = str(info.value)
    assert "worker(s) [0] gave no answer" in message, message
    words = "rank 1 cannot start" if how == "raise" else "the process died (Died(exitcode=3))"
    assert words in message, message
    assert time.monotonic() - start < 120  # the workers' import and gloo start, then 2 s


def _run_late_rank(comms, delay_s):
    comm = comms[2]
    if comm.rank == 1:
        time.sleep(delay_s)
    start = time.monotonic()
    try:
        y = comm.all_reduce(torch.full((64,), float(comm.rank + 1)), codec="none-float32")
        return ("ok", time.monotonic() - start, float(y[0]))
    except fp4_comm.CommPeerError as err:
        return (type(err).__name__, time.monotonic() - start, str(err))


def test_late_rank_within_the_timeout_takes_part_and_beyond_it_is_a_peer_error():
    c = Cluster(2, timeout_s=TIMEOUT_S)
    try:
        # late, but in time: the call completes on both ranks
        for status, _, value in c.run(_run_late_rank, TIMEOUT_S / 3):
            assert status == "ok" and value == 3.0
        # later than the timeout: rank 0 gives up; rank 1, arriving after that, too
        first, late = c.run(_run_late_rank, TIMEOUT_S * 2, timeout_s=120)
    finally:
        c.close(force=True)
    assert first[0] == "CommTimeoutError", first
    assert "all_reduce (argument check) on rank 0 of 2: rank 1 did not take part" in first[2]
    assert TIMEOUT_S * 0.9 <= first[1] < TIMEOUT_S + 30
    assert late[0] in ("CommTimeoutError", "CommConnectionError"), late
    assert "all_reduce" in late[2] and "rank 0" in late[2]
    assert late[1] < TIMEOUT_S + 30


def _run_diverging(comms, validate, case):
    """Two ranks whose calls agree at first and differ later; what each call gave."""
    comm = comms[2]
    if comm is None:
        return None
    # "algorithm": the ranks' communicators take different all-reduce algorithms
    algorithm = ("one_shot", "two_shot")[comm.rank] if case == "algorithm" else "auto"
    comm = fp4_comm.Communicator.from_process_group(comm.transport.group, "cpu", 30.0,
                                                    validate=validate,
                                                    all_reduce_algorithm=algorithm)  # fmt: skip
    r = comm.rank
    rows = torch.arange(100.0, 164.0).reshape(2, 32) + 1000 * r
    out = []

    def call(fn):
        try:
            out.append(("ok", fn().tolist()))
        except ValueError as err:
            out.append(("ValueError", str(err)))

    if case == "shape":  # the case at stake: rank 1's second all_gather is new to it
        call(lambda: comm.all_gather(rows, codec="none-float32"))
        call(lambda: comm.all_gather(rows if r == 0 else rows[:1], codec="none-float32"))
    elif case == "both_seen":  # each rank's second call was checked before, but they differ
        call(lambda: comm.all_gather(rows, codec="none-float32"))
        call(lambda: comm.all_gather(rows[:1], codec="none-float32"))
        call(lambda: comm.all_gather(rows if r == 0 else rows[:1], codec="none-float32"))
    elif case == "same_bytes":  # float32 vs bfloat16 under nvfp4: the same bytes on the wire
        call(lambda: comm.all_reduce(rows, codec="nvfp4"))
        call(lambda: comm.all_reduce(rows if r == 0 else rows.bfloat16(), codec="nvfp4"))
    elif case == "sizes":  # byte counts differ: gloo would abort the receiving process
        call(lambda: comm.all_reduce(torch.ones(64 if r == 0 else 4096), codec="mxfp4"))
    elif case == "algorithm":  # one-shot gathers, two-shot exchanges: other bytes
        call(lambda: comm.all_reduce(rows, codec="nvfp4"))
    # afterwards the group still works, and gives the right data
    call(lambda: comm.all_gather(rows, codec="none-float32"))
    return out


@pytest.mark.parametrize("validate", ["always", "first", "never"])
@pytest.mark.parametrize("case", ["shape", "both_seen", "same_bytes", "sizes", "algorithm"])
def test_ranks_whose_calls_differ_get_value_error_whatever_validate_says(cluster, validate, case):
    out = cluster.run(_run_diverging, validate, case)[:2]  # a dead worker fails the run
    rows = torch.arange(100.0, 164.0).reshape(2, 32)
    gathered = torch.cat([rows, rows + 1000]).tolist()
    agreeing = {"shape": 1, "both_seen": 2, "same_bytes": 1, "sizes": 0, "algorithm": 0}[case]
    for calls in out:
        assert [c[0] for c in calls] == ["ok"] * agreeing + ["ValueError", "ok"], calls
        assert "the ranks disagree" in calls[agreeing][1]
        if case == "algorithm":
            assert calls[0][1].startswith("all_reduce: ")
            assert "all_reduce_algorithm differs" in calls[0][1]
        assert calls[-1][1] == gathered  # and nothing of the failed call leaked into it


def _run_hand_made(comms):
    from fp4_comm._transport import GlooTransport

    comm = comms[2]
    if comm is None:
        return None
    # no control group given: gloo still checks every call, over the transport's group
    hand_made = fp4_comm.Communicator(GlooTransport(comm.transport.group), validate="never")
    try:
        hand_made.all_reduce(torch.ones(64 if comm.rank == 0 else 4096), codec="mxfp4")
    except ValueError as err:
        return str(err)
    return None


def test_a_communicator_made_from_a_gloo_transport_checks_sizes_too(cluster):
    for message in cluster.run(_run_hand_made)[:2]:  # a dead worker fails the run
        assert message is not None and "the ranks disagree" in message


def _run_one_rank_fails_alone(comms):
    comm = comms[2]
    if comm is None:
        return None
    # a communicator of its own: the second call of rank 1 finds no partner and times out,
    # which leaves this group out of step
    comm = fp4_comm.Communicator.from_process_group(comm.transport.group, "cpu", TIMEOUT_S)
    out = []
    for dtype in (torch.float64 if comm.rank == 0 else torch.float32, torch.float32):
        try:  # rank 0's first call fails its own checks (float64), rank 1's is fine
            y = comm.all_reduce(torch.full((64,), comm.rank + 1.0, dtype=dtype), codec="none")
            out.append(("ok", float(y[0])))
        except (TypeError, ValueError, fp4_comm.CommPeerError) as err:
            out.append((type(err).__name__, str(err)))
    return out


def test_a_rank_that_failed_a_call_alone_is_not_paired_with_the_others_next_call(cluster):
    # Rank 0's second call and rank 1's first have the same signature but for the call
    # number: without it they would pair, and every later call would meet the other rank's
    # previous one.
    rank0, rank1 = cluster.run(_run_one_rank_fails_alone)[:2]
    assert rank0[0][0] == "TypeError" and "float64" in rank0[0][1]
    for status, message in (rank0[1], rank1[0]):
        assert status == "ValueError" and "different numbers of collectives" in message
        assert "call #0" in message and "call #1" in message
    assert rank1[1][0] == "CommTimeoutError"  # rank 0 made no third call


HANGING_TEST = """
import time


def test_hangs():
    time.sleep(600)
"""


def test_a_hanging_test_fails_within_the_time_limit(tmp_path):
    tests = Path(__file__).resolve().parent
    (tmp_path / "conftest.py").write_text(textwrap.dedent(f"""
        import importlib.util
        import sys

        sys.path.insert(0, {str(tests)!r})
        spec = importlib.util.spec_from_file_location("fp4_comm_conftest",
                                                      {str(tests / "conftest.py")!r})
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _time_limit = module._time_limit
    """))  # fmt: skip
    (tmp_path / "test_hang.py").write_text(HANGING_TEST)
    env = {**os.environ, "FP4_COMM_TEST_TIMEOUT_S": "2"}
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", str(tmp_path)],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert "did not finish within 2 s" in result.stdout and "1 failed" in result.stdout
    assert time.monotonic() - start < 60
