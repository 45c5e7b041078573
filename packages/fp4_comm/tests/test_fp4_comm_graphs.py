"""Eager calls replayed from CUDA graphs (``fp4_comm.graphs``, ``Communicator(graphs=...)``).

On the CPU: a pretend GPU (``_fake_gpu``) and a stand-in capture whose "graph" runs the captured
call again: which calls are captured (the third of an eligible kind, on every rank alike), that
ineligible ones never are, the bounds, ``close()``, a failed transport, a caller's own capture.
Over the threaded host-memory NCCL stand-in, which moves the bytes: replayed results equal the
eager ones bit for bit, every rank captures at the same call (a rank that captured alone would
pair its capture's transfers with another call's), and a result is never overwritten by a later
call; stochastic rounding and error feedback replay with the eager bits (the step written into
the graph's step tensor, residuals reset in place), a call of another seed runs eagerly, and a
replaced residual drops its graph.  On GPUs (``gpu``): real CUDA graphs against
``graphs="never"``, bit for bit, for every codec and operation, stochastic rounding and error
feedback included, and a peer killed before a replay ending in ``CommPeerError``.
"""

import contextlib
import os
import threading
import time

import _fake_gpu
import pytest
import torch
from _fake_gpu import fake_gpu_communicator, fake_graphs
from test_fp4_comm_nccl_transport import _on_threads, _transports

import fp4_comm
import fp4_kernels
from fp4_comm import Communicator, graphs, reference
from fp4_comm._transport import CommTimeoutError, GlooTransport
from fp4_comm.codecs import NVFP4Codec

OPS = ("all_reduce", "reduce_scatter", "all_gather")


class _OwnNVFP4(NVFP4Codec):
    """A user's codec (whose encode might keep host state a graph would freeze)."""


def _call(comm, op, x, **kw):
    if op == "send":
        return comm.send(x, 1, **kw)
    if op == "recv":
        return comm.recv(x.shape, x.dtype, 1, **kw)
    return getattr(comm, op)(x, **kw)


@pytest.mark.parametrize("op", [*OPS, "send", "recv"])
@pytest.mark.parametrize(
    "kw",
    [{}, {"rounding": "stochastic"}, {"error_feedback": "grad"}],
    ids=["nearest", "stochastic", "error_feedback"],
)
def test_third_call_of_a_kind_is_captured_and_later_ones_replay(op, kw):
    if kw.get("error_feedback") and op not in ("all_reduce", "reduce_scatter"):
        pytest.skip("error feedback is an option of the reductions")
    if op == "recv":
        kw = {}  # the receiver draws nothing
    x = torch.randn(8, 64)
    with fake_graphs() as cap, fake_gpu_communicator(2, graphs="auto") as (comm, null, _, _):
        if op == "recv":
            comm.send(x, 1)  # what the receiver's check compares with (the fake's answer)
        for i in range(graphs.EAGER_CALLS):
            _call(comm, op, x, **kw)
            assert cap.graphs == [], i
        eager_nccl = len(null.calls)
        for _ in range(3):
            _call(comm, op, x, **kw)
        assert len(cap.graphs) == 1 and cap.graphs[0].replays == 3
        # the replays ran the captured call (the stand-in graph reruns it) and nothing else
        assert len(null.calls) > eager_nccl
    assert len(comm._graphed) == 1


@pytest.mark.parametrize(
    "kw",
    [{"stats": True}, {"codec": _OwnNVFP4()}],
    ids=["stats", "other-codec"],
)
def test_ineligible_calls_never_replay(kw):
    x = torch.randn(8, 64)
    with fake_graphs() as cap, fake_gpu_communicator(2, graphs="auto") as (comm, _, _, _):
        for _ in range(6):
            comm.all_reduce(x, **kw)
    assert cap.graphs == []


def test_stochastic_rounding_of_the_none_codec_replays():
    # "none" draws no random words: rounding is no part of its bits
    with fake_graphs() as cap, fake_gpu_communicator(2, graphs="auto") as (comm, _, _, _):
        for _ in range(4):
            comm.all_reduce(torch.randn(8, 64), codec="none", rounding="stochastic")
    assert len(cap.graphs) == 1


def test_graphs_never_and_cupy_like_calls_run_eagerly(monkeypatch):
    x = torch.randn(8, 64)
    with fake_graphs() as cap, fake_gpu_communicator(2, graphs="never") as (comm, _, _, _):
        for _ in range(6):
            comm.all_reduce(x)
    assert cap.graphs == []
    monkeypatch.setattr(graphs, "GRAPH_MAX_BYTES", x.numel() * 4 - 1)
    with fake_graphs() as cap, fake_gpu_communicator(2, graphs="auto") as (comm, _, _, _):
        for _ in range(6):
            comm.all_reduce(x)
    assert cap.graphs == []  # larger than GRAPH_MAX_BYTES


def test_no_capture_or_replay_inside_the_callers_capture(monkeypatch):
    x = torch.randn(8, 64)
    with fake_graphs() as cap, fake_gpu_communicator(2, graphs="auto") as (comm, _, _, _):
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        for _ in range(5):
            comm.all_reduce(x)
        assert cap.graphs == []
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        comm.all_reduce(x)  # the calls inside the caller's capture did not count: eager
        assert cap.graphs == []
        comm.all_reduce(x)
        assert len(cap.graphs) == 1
        comm.all_reduce(x)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        comm.all_reduce(x)
    assert cap.graphs[0].replays == 2


def test_graph_cache_is_bounded_and_dropped_kinds_stay_eager():
    shapes = [(8, 64), (16, 64), (24, 64)]
    bounds = (2, graphs.GRAPH_CACHE_BYTES)
    with (
        fake_graphs() as cap,
        fake_gpu_communicator(2, graphs="auto", graph_cache=bounds) as (comm, _, _, _),
    ):
        for shape in shapes:
            for _ in range(3):
                comm.all_reduce(torch.randn(shape))
        assert len(cap.graphs) == 3
        assert [k[7] for k in comm._graphed.kinds()] == [torch.Size(s) for s in shapes[1:]]
        for _ in range(3):  # the dropped kind is not captured again
            comm.all_reduce(torch.randn(shapes[0]))
        assert len(cap.graphs) == 3 and cap.graphs[0].replays == 1
        # the bytes bound: one more kind whose input pushes the total past it drops the oldest
        comm._graphed.max_bytes = 40 * 64 * 4
        for _ in range(3):
            comm.all_reduce(torch.randn(32, 64))
        assert [k[7] for k in comm._graphed.kinds()] == [torch.Size((32, 64))]
        comm.transport.close = lambda: None  # the fake's watchdog thread is a placeholder
        comm.close()
        assert len(comm._graphed) == 0 and comm._plans == {}


def test_replay_of_a_failed_transport_raises_its_peer_error():
    x = torch.randn(8, 64)
    with fake_graphs() as cap, fake_gpu_communicator(2, graphs="auto") as (comm, _, _, _):
        for _ in range(3):
            comm.all_reduce(x)
        comm.transport._failure = CommTimeoutError  # as the watchdog leaves it
        comm.transport._failed = "NCCL: a transfer did not finish (test)"
        with pytest.raises(CommTimeoutError, match="all_reduce: NCCL: a transfer did not"):
            comm.all_reduce(x)
    assert cap.graphs[0].replays == 1


def test_replay_records_the_watchdog_event_and_orders_streams(monkeypatch):
    import _fake_gpu

    x = torch.randn(8, 64)
    with fake_graphs(), fake_gpu_communicator(2, graphs="auto") as (comm, _, _, _):
        comm.all_reduce(x)
        events = []
        monkeypatch.setattr(comm.transport, "_pending", events)
        comm.all_reduce(x)  # eager
        eager = len(events)
        comm.all_reduce(x)  # captured
        del events[:]
        waits = _fake_gpu._FakeStream.waits
        comm.all_reduce(x)  # replayed
        # the stand-in graph's rerun records the eager call's events; the replay one more, as
        # an eager call after each of its groups
        assert eager > 0 and len(events) == eager + 1
        assert _fake_gpu._FakeStream.waits == waits  # same stream: nothing to wait for
        monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0x1234)
        comm.all_reduce(x)
        assert _fake_gpu._FakeStream.waits == waits + 1  # ordered after the other stream


def test_graphs_option_is_checked():
    with fake_gpu_communicator(2) as (comm, _, _, _):
        with pytest.raises(ValueError, match="graphs: 'sometimes'"):
            Communicator(comm.transport, graphs="sometimes")
        assert Communicator(comm.transport).graphs == "auto"  # a CUDA transport
    gloo = GlooTransport.__new__(GlooTransport)
    gloo.device = torch.device("cpu")
    with pytest.raises(ValueError, match="graphs='auto'.*gloo"):
        Communicator(gloo, control_group=object(), graphs="auto")
    assert Communicator(gloo, control_group=object()).graphs == "never"
    # the emulated ranks exchange in host code, which a graph cannot replay
    emulated = reference.EmulatedTransport(0, reference._Exchange(2, 1.0), "cuda:0")
    assert graphs.default_graphs(emulated) == "never"
    assert Communicator(emulated).graphs == "never"
    with pytest.raises(ValueError, match="graphs='auto'.*EmulatedTransport cannot be captured"):
        Communicator(emulated, graphs="auto")
    ranks = reference.EmulatedRanks(2, "cuda:0")
    assert [c.graphs for c in ranks.comms] == ["never", "never"]


def test_static_input_is_allocated_without_the_deterministic_fill(monkeypatch):
    """Deterministic mode fills new tensors with NaN; inside a capture the fill of the static
    input would be a graph node that overwrites the input each replay copies in first."""
    det = torch.utils.deterministic
    seen, empty = [], torch.empty

    def recording(*args, **kwargs):
        seen.append(det.fill_uninitialized_memory)
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", recording)
    before = torch.are_deterministic_algorithms_enabled(), det.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        det.fill_uninitialized_memory = True
        x = graphs._unfilled((3, 5), torch.bfloat16, "cpu")
        assert det.fill_uninitialized_memory is True  # restored
        torch.empty(1)
    finally:
        torch.use_deterministic_algorithms(before[0])
        det.fill_uninitialized_memory = before[1]
    assert seen == [False, True] and x.shape == (3, 5) and x.dtype == torch.bfloat16


# ---------------------------------------------------------------- bytes moved: threads


def _threaded(world, graphs_mode, calls, monkeypatch, graph_cache=None):
    """Every rank's results of ``calls`` (op, codec, shape, seed) on communicators over the
    threaded NCCL stand-in, and each rank's captured kinds."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    transports = _transports(world)

    def run(rank):
        comm = Communicator(transports[rank], validate="never", graphs=graphs_mode,
                            graph_cache=graph_cache)  # fmt: skip
        out, shots = [], []
        for op, codec, shape, seed in calls:
            g = torch.Generator().manual_seed(seed * 31 + rank)
            x = torch.randn(shape, generator=g).to(torch.bfloat16)
            y = getattr(comm, op)(x, codec=codec)
            out.append(y)
            shots.append(y.clone())
        return out, shots, comm._graphed.kinds()

    with fake_graphs() as cap:
        results = _on_threads(world, run)
    return results, cap


_CALLS = [
    (op, codec, shape, i)
    for i in range(5)
    for op in OPS
    for codec, shape in (
        ("nvfp4", (6, 64)),
        ("mxfp4", (4, 96)),
        ("none", (5, 32)),
        (fp4_kernels.FP4Quant(64), (4, 128)),
        ("tahquant-h64", (4, 192)),
        ("tahquant-grad", (5, 64)),
    )  # fmt: skip
]


@pytest.mark.parametrize("world", [2, 3])
def test_replays_equal_eager_calls_bit_for_bit_and_are_never_overwritten(world, monkeypatch):
    eager, cap = _threaded(world, "never", _CALLS, monkeypatch)
    assert cap.graphs == []
    bounds = (24, graphs.GRAPH_CACHE_BYTES)  # the 18 kinds below, all kept
    replayed, cap = _threaded(world, "auto", _CALLS, monkeypatch, graph_cache=bounds)
    assert len(cap.graphs) == world * 18  # 3 ops x 6 codecs, on every rank
    assert sum(g.replays for g in cap.graphs) == world * 18 * 3
    kinds = [k for _, _, k in replayed]
    assert all([k[:7] for k in ks] == [k[:7] for k in kinds[0]] for ks in kinds)
    for r in range(world):
        (ys, shots, _), (e, _, _) = replayed[r], eager[r]
        for i, (y, shot, ref) in enumerate(zip(ys, shots, e, strict=True)):
            assert torch.equal(y.view(torch.int16), ref.view(torch.int16)), (r, _CALLS[i])
            # still what the call returned: no later call wrote into it
            assert torch.equal(y.view(torch.int16), shot.view(torch.int16)), (r, _CALLS[i])


def _capture_keeping_residuals(fake):
    """``fake`` (a ``FakeCapture``, whose capture runs the call once, as a real capture does
    not) with the error-feedback state of the capturing rank's communicator put back after
    that run (``load_state_dict``: in place), so that the replay that follows is the call's
    only update of the residuals, as on a GPU."""
    owners = {}  # thread -> its communicator

    def capture(run, device, shape, dtype):
        ef = owners[threading.get_ident()].error_feedback
        saved = ef.state_dict()
        try:
            return fake(run, device, shape, dtype)
        finally:
            ef.load_state_dict(saved)

    return capture, owners


def _threaded_steps(world, graphs_mode, calls, monkeypatch, graph_cache=None):
    """Every rank's results of ``calls`` over the threaded NCCL stand-in: (op, shape, seed of
    the data, keyword arguments) or ("reset", name); and the captures' stand-in graphs."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    transports = _transports(world)
    fake = _fake_gpu.FakeCapture()
    capture, owners = _capture_keeping_residuals(fake)
    monkeypatch.setattr(graphs, "capture", capture)

    def run(rank):
        comm = owners[threading.get_ident()] = Communicator(
            transports[rank], validate="never", graphs=graphs_mode, graph_cache=graph_cache
        )
        out = []
        for call in calls:
            if call[0] == "reset":
                comm.error_feedback.reset(call[1])
                continue
            op, shape, seed, kw = call
            g = torch.Generator().manual_seed(seed * 31 + rank)
            x = torch.randn(shape, generator=g).to(torch.bfloat16)
            out.append(getattr(comm, op)(x, **kw))
        return out, {n: comm.error_feedback.residual(n) for n in comm.error_feedback.names()}

    return _on_threads(world, run), fake


_SR, _EF = {"rounding": "stochastic", "seed": 9}, {"error_feedback": "g"}
_STEP_CALLS = (
    [(op, (6, 64), i, dict(_SR, codec="nvfp4")) for i in range(6) for op in OPS]
    + [("all_reduce", (4, 96), i, dict(_EF, codec="mxfp4")) for i in range(5)]
    + [("reset", "g")]  # in place: the graph goes on replaying, from residual 0
    + [("all_reduce", (4, 96), i, dict(_EF, codec="mxfp4")) for i in range(5, 8)]
    + [("reduce_scatter", (4, 128), i, dict(_SR, error_feedback="h",
                                             codec=fp4_kernels.FP4Quant(64))) for i in range(6)]
    + [("all_reduce", (6, 64), 40, dict(_SR, codec="nvfp4", step=12345))]
    + [("all_reduce", (6, 64), 41, dict(_SR, codec="nvfp4", seed=10))]  # another seed: eager
)  # fmt: skip


@pytest.mark.parametrize("world", [2, 3])
def test_stochastic_and_error_feedback_replays_equal_eager_calls(world, monkeypatch):
    eager, cap = _threaded_steps(world, "never", _STEP_CALLS, monkeypatch)
    assert cap.graphs == []
    replayed, cap = _threaded_steps(world, "auto", _STEP_CALLS, monkeypatch)
    # 3 SR kinds, the EF kind, the SR + EF kind: captured on every rank, replayed from the
    # third call on, but for the call of another seed
    assert len(cap.graphs) == world * 5
    assert sum(g.replays for g in cap.graphs) == world * (3 * 4 + 6 + 4 + 1)
    for r in range(world):
        (ys, res), (want, want_res) = replayed[r], eager[r]
        for i, (y, ref) in enumerate(zip(ys, want, strict=True)):
            assert torch.equal(y.view(torch.int16), ref.view(torch.int16)), (r, i)
        assert res.keys() == want_res.keys() == {"g", "h"}
        for name in res:
            assert _same_bytes(res[name], want_res[name]), (r, name)


# a model's error-feedback sums: a kind per name (call site), called in turn once a step
_SITES = 10
_SITE_CALLS = [("all_reduce", (4, 96), 100 * i + j, {"codec": "mxfp4", "error_feedback": f"s{j}"})
               for i in range(5) for j in range(_SITES)]  # fmt: skip


@pytest.mark.parametrize("bounds", [None, (_SITES, graphs.GRAPH_CACHE_BYTES)])
def test_error_feedback_sites_replay_when_the_graph_cache_holds_them(bounds, monkeypatch):
    """More error-feedback sites than the default cache holds: each is captured on its third
    call, the oldest dropped as the later ones are kept, and the dropped ones run eagerly from
    then on; a cache with a place for every site replays them all.  Both give the eager bits."""
    eager, _ = _threaded_steps(2, "never", _SITE_CALLS, monkeypatch)
    results, cap = _threaded_steps(2, "auto", _SITE_CALLS, monkeypatch, bounds)
    for (ys, res), (refs, ref_res) in zip(results, eager, strict=True):
        assert all(torch.equal(y.view(torch.int16), r.view(torch.int16))
                   for y, r in zip(ys, refs, strict=True))  # fmt: skip
        assert all(torch.equal(res[n], ref_res[n]) for n in ref_res)
    kept = _SITES if bounds else graphs.GRAPH_CACHE_SIZE
    assert len(cap.graphs) == 2 * _SITES  # every site captured once, on every rank
    # the kept kinds replay at calls 3, 4 and 5; a dropped one at its capture only
    dropped = 2 * (_SITES - kept)
    assert sorted(g.replays for g in cap.graphs) == [1] * dropped + [3] * (2 * kept)


def test_graph_cache_bounds_are_checked(monkeypatch):
    for bad, match in [((0, 1), "max_graphs: 0"), ((1, -5), "max_bytes: -5"),
                       ((True, 1), "max_graphs: True"), ((2.0, 1), "max_graphs: 2.0")]:  # fmt: skip
        with pytest.raises(ValueError, match=f"^{match} is not a positive int"):
            graphs.GraphCache(*bad)
        with pytest.raises(ValueError, match=f"^graph_cache: {match} is not a positive int"):
            graphs.graph_cache(bad)
    for bad in [8, (8,), (8, 1, 1), "big"]:
        with pytest.raises(ValueError, match=r"graph_cache: .* is not \(max_graphs, max_bytes\)"):
            graphs.graph_cache(bad)
    cache = graphs.graph_cache(None)
    defaults = (graphs.GRAPH_CACHE_SIZE, graphs.GRAPH_CACHE_BYTES)
    assert (cache.max_graphs, cache.max_bytes) == defaults
    with fake_gpu_communicator(2) as (comm, _, _, _):
        with pytest.raises(ValueError, match="graph_cache: max_graphs: 0"):
            Communicator(comm.transport, graph_cache=(0, 1 << 20))
        assert Communicator(comm.transport, graph_cache=[64, 1 << 30])._graphed.max_graphs == 64
    with pytest.raises(ValueError, match="graph_cache: max_bytes: 0"):
        reference.EmulatedRanks(2, graph_cache=(4, 0))
    # from_process_group checks before it makes its group; from_env passes the bounds on
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    with pytest.raises(ValueError, match="graph_cache: max_graphs: -1"):
        Communicator.from_process_group(device="cpu", graph_cache=(-1, 1))
    monkeypatch.setattr(Communicator, "from_process_group", classmethod(lambda cls, *a: a[-1]))
    assert Communicator.from_env(device="cpu", graph_cache=(64, 1 << 30)) == (64, 1 << 30)


def test_a_step_tensor_gives_the_bits_of_its_int_step(monkeypatch):
    calls = [("all_reduce", (6, 64), 3, dict(_SR, codec="nvfp4", step=step))
             for step in (7, torch.tensor([7]), 2**32 - 1, torch.tensor([2**32 - 1]))]  # fmt: skip
    (outs, _), *_ = _threaded_steps(2, "never", calls, monkeypatch)[0]
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    assert torch.equal(outs[2].view(torch.int16), outs[3].view(torch.int16))
    assert not torch.equal(outs[0].view(torch.int16), outs[2].view(torch.int16))


@pytest.mark.parametrize(
    "step", [torch.tensor([7], dtype=torch.int32), torch.tensor([7, 8]), torch.tensor([7.0])]
)
def test_a_bad_step_tensor_is_refused_naming_step(step):
    with fake_gpu_communicator(2) as (comm, _, _, _):
        with pytest.raises(ValueError, match="^step: a tensor step must be a one-element int64"):
            comm.all_reduce(torch.randn(8, 64), rounding="stochastic", step=step)


def test_a_replaced_residual_drops_the_graph(monkeypatch):
    kind_a = ("all_reduce", (4, 64), 0, dict(_EF, codec="nvfp4"))
    calls = [kind_a] * 4 + [("reset", "g"), ("all_reduce", (2, 64), 1, dict(_EF, codec="nvfp4")),
                            ("reset", "g")] + [kind_a] * 3  # fmt: skip
    eager, _ = _threaded_steps(2, "never", calls, monkeypatch)
    replayed, cap = _threaded_steps(2, "auto", calls, monkeypatch)
    # kind A's residual has new storage after the call of another shape under its name: its
    # graph (2 replays before) is dropped, and its later calls run eagerly
    assert [g.replays for g in cap.graphs] == [2, 2]
    for r in range(2):
        for y, ref in zip(replayed[r][0], eager[r][0], strict=True):
            assert torch.equal(y.view(torch.int16), ref.view(torch.int16))


# ---------------------------------------------------------------- GPUs


def _same_bytes(a, b):
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _setup_eager(comms, rank, world, timeout_s):
    device = fp4_comm.local_device(rank)
    comms["auto"] = Communicator.from_process_group(None, device, timeout_s, graphs="auto")
    comms["eager"] = Communicator.from_process_group(None, device, timeout_s, graphs="never")


@contextlib.contextmanager
def _deterministic_mode():
    """torch.use_deterministic_algorithms, which fills every new tensor with NaN."""
    det = torch.utils.deterministic
    before = torch.are_deterministic_algorithms_enabled(), det.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    det.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0])
        det.fill_uninitialized_memory = before[1]


def _gpu_compare(comms, op, codec, shape, dtype, deterministic=False):
    """Five calls of ``op`` on the graphs="auto" and "never" communicators: their bits equal,
    every result still what it was when returned, and the kind captured (``deterministic``:
    all of it in torch's deterministic mode)."""
    if deterministic:
        with _deterministic_mode():
            bad, moved, _ = _gpu_compare(comms, op, codec, shape, dtype)
        # this shape's kind of call (a recv's kind holds its shape as a tuple) has a graph
        shapes = [k[1] if k[0] == "recv" else k[7] for k in comms["auto"]._graphed.kinds()]
        return bad, moved, sum(tuple(s) == tuple(shape) for s in shapes)
    gpu, eager = comms["auto"], comms["eager"]
    assert gpu.graphs == "auto" and eager.graphs == "never"
    rank, ys, shots = gpu.rank, [], []
    for i in range(5):
        g = torch.Generator().manual_seed(i * 97 + rank)
        x = (torch.randn(shape, generator=g) * 10.0 ** (i - 2)).to(dtype).to(gpu.device)
        if op == "send_recv":
            if rank == 0:
                gpu.send(x, 1, codec=codec)
                eager.send(x, 1, codec=codec)
                continue
            if rank != 1:
                continue
            y = gpu.recv(x.shape, x.dtype, 0, codec=codec)
            ref = eager.recv(x.shape, x.dtype, 0, codec=codec)
        else:
            y = getattr(gpu, op)(x, codec=codec)
            ref = getattr(eager, op)(x, codec=codec)
        ys.append((y, ref))
        shots.append(y.clone())
    torch.cuda.synchronize()
    bad = [i for i, (y, ref) in enumerate(ys) if not _same_bytes(y, ref)]
    moved = [i for i, ((y, _), s) in enumerate(zip(ys, shots, strict=True))
             if not _same_bytes(y, s)]  # fmt: skip
    return bad, moved, len(gpu._graphed)


@pytest.fixture(scope="module")
def gpu_cluster():
    from fp4_comm_cluster import Cluster, env_ranks, skip_unless_ranks_fit

    world = env_ranks()
    skip_unless_ranks_fit(world)
    c = Cluster(world, timeout_s=60.0, gpu=True, setup=_setup_eager)
    yield c
    c.close()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("op", [*OPS, "send_recv"])
@pytest.mark.parametrize("codec", ["nvfp4", "mxfp4", "none", fp4_kernels.FP4Quant(64)], ids=str)
def test_gpu_replays_equal_eager_calls_bit_for_bit(gpu_cluster, codec, op, dtype):
    out = gpu_cluster.run(_gpu_compare, op, codec, (gpu_cluster.world * 24, 256), dtype)
    for rank, (bad, moved, captured) in enumerate(out):
        assert bad == [] and moved == [], (rank, bad, moved)
        if op != "send_recv" or rank < 2:
            assert captured >= 1, rank


def _gpu_compare_steps(comms, op, codec, shape, kw):
    """Seven calls of ``op`` with ``kw`` (stochastic rounding and / or error feedback) on the
    graphs="auto" and "never" communicators, a reset of the residuals after the fourth and a
    call of another seed as the sixth: (calls whose bits differ, residuals that differ, the
    kind's graph replays)."""
    gpu, eager = comms["auto"], comms["eager"]
    bad, name = [], kw.get("error_feedback")
    for i in range(7):
        g = torch.Generator().manual_seed(i * 89 + gpu.rank)
        x = torch.randn(shape, generator=g).to(torch.bfloat16).to(gpu.device)
        call_kw = dict(kw, seed=kw.get("seed", 0) + (i == 5))
        y = getattr(gpu, op)(x, codec=codec, **call_kw)
        ref = getattr(eager, op)(x, codec=codec, **call_kw)
        if not _same_bytes(y, ref):
            bad.append(i)
        if i == 3 and name is not None:
            gpu.error_feedback.reset(name)
            eager.error_feedback.reset(name)
    torch.cuda.synchronize()
    residuals = []
    if name is not None:
        for hop in ("worker", "server"):
            a, b = gpu.error_feedback.residual(name, hop), eager.error_feedback.residual(name, hop)
            if (a is None) != (b is None) or (a is not None and not _same_bytes(a, b)):
                residuals.append(hop)
    mine = (op, codec, kw.get("rounding", "nearest"), name)
    kinds = [k for k in gpu._graphed.kinds() if k[:4] == mine and tuple(k[7]) == shape]
    return bad, residuals, len(kinds)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "all_gather"])
@pytest.mark.parametrize("codec", ["nvfp4", "mxfp4", fp4_kernels.FP4Quant(64)], ids=str)
@pytest.mark.parametrize("what", ["sr", "ef", "sr+ef"])
def test_gpu_stochastic_and_error_feedback_replays_equal_eager(gpu_cluster, what, codec, op):
    if "ef" in what and op == "all_gather":
        pytest.skip("error feedback is an option of the reductions")
    kw = {"seed": 11}
    if "sr" in what:
        kw["rounding"] = "stochastic"
    if "ef" in what:
        kw["error_feedback"] = f"{what}-{codec}-{op}"
    shape = (gpu_cluster.world * 16, 320)
    out = gpu_cluster.run(_gpu_compare_steps, op, codec, shape, kw)
    for rank, (bad, residuals, captured) in enumerate(out):
        assert bad == [] and residuals == [] and captured == 1, (rank, bad, residuals)


@pytest.mark.gpu
@pytest.mark.parametrize("op", [*OPS, "send_recv"])
def test_gpu_replays_equal_eager_calls_in_deterministic_mode(gpu_cluster, op):
    """Under torch.use_deterministic_algorithms (new tensors filled with NaN): a kind of call
    first captured there replays the eager bits (a shape no other test uses: a new capture)."""
    shape = (gpu_cluster.world * 24, 320)
    out = gpu_cluster.run(_gpu_compare, op, "nvfp4", shape, torch.bfloat16, True)
    for rank, (bad, moved, captured) in enumerate(out):
        assert bad == [] and moved == [], (rank, bad, moved)
        if op != "send_recv" or rank < 2:
            assert captured >= 1, rank


TIMEOUT_S = 10.0


def _setup_auto(comms, rank, world, timeout_s):
    device = fp4_comm.local_device(rank)
    comms["auto"] = Communicator.from_process_group(None, device, timeout_s, graphs="auto")


def _replay_after_death(comms, victim):
    gpu = comms["auto"]
    gpu.validate = "never"  # the replay itself must notice the dead peer, not a host check
    x = torch.ones(gpu.world_size * 16, 256, device=gpu.device)
    for _ in range(graphs.EAGER_CALLS + 1):
        gpu.all_reduce(x, codec="nvfp4")
    gpu.synchronize()
    assert len(gpu._graphed) == 1
    if gpu.rank == victim:
        os._exit(17)
    time.sleep(1.0)  # the victim is gone
    start = time.monotonic()
    try:
        gpu.all_reduce(x, codec="nvfp4")  # replayed
        gpu.synchronize(timeout_s=TIMEOUT_S)
    except fp4_comm.CommPeerError as err:
        return type(err).__name__, str(err), time.monotonic() - start
    return None, None, time.monotonic() - start


@pytest.mark.gpu
def test_gpu_replay_with_a_dead_peer_ends_in_a_peer_error():
    from fp4_comm_cluster import Cluster, Died, env_ranks, skip_unless_ranks_fit

    world = env_ranks()
    skip_unless_ranks_fit(world)
    c = Cluster(world, timeout_s=TIMEOUT_S, gpu=True, setup=_setup_auto)
    try:
        victim = world - 1
        out = c.run(_replay_after_death, victim, timeout_s=TIMEOUT_S + 120, allow_death=True)
    finally:
        c.close(force=True)
    assert isinstance(out[victim], Died) and out[victim].exitcode == 17
    for rank, (kind, message, waited) in enumerate(out[:victim]):
        assert kind in ("CommTimeoutError", "CommConnectionError"), (rank, message)
        assert waited < TIMEOUT_S + 30.0, (rank, waited)


class _WaitsForGraphs:
    """NCCL's abort and destroy as they behave with graphs: they return only once every CUDA
    graph holding the communicator's calls is destroyed (here: within 10 s, else they give up
    and say so by leaving ``returned`` unset)."""

    def __init__(self):
        self.replays = []
        self.returned = []

    def _wait(self, what):
        deadline = time.monotonic() + 10.0
        while any(r.graph is not None for r in self.replays):
            if time.monotonic() > deadline:
                return
            time.sleep(1e-3)
        self.returned.append(what)

    def abort(self):
        self._wait("abort")

    def destroy(self):
        self._wait("destroy")


@pytest.mark.parametrize("how", ["abort", "close"])
def test_abort_and_close_release_the_graphs_nccl_waits_for(how):
    """A replayed graph keeps NCCL's abort (and destroy) from returning until it is destroyed:
    the transport releases its graphs (once their replays have drained), the abort returns, and
    a later call raises the communicator's error instead of replaying a destroyed graph."""
    x = torch.randn(8, 64)
    with fake_graphs(), fake_gpu_communicator(2, graphs="auto") as (comm, _, _, _):
        for _ in range(graphs.EAGER_CALLS + 1):
            comm.all_reduce(x)
        (replay,) = comm.transport._graphs
        fake = comm.transport.comm = _WaitsForGraphs()
        fake.replays.append(replay)
        start = time.monotonic()
        if how == "abort":
            comm.transport._abort("NCCL: a transfer did not finish (test)")
        else:
            comm.transport._thread = None
            comm.transport.close()
        assert fake.returned == ["abort" if how == "abort" else "destroy"]
        assert time.monotonic() - start < 5.0 and replay.graph is None
        if how == "abort":
            with pytest.raises(CommTimeoutError, match="did not finish"):
                comm.all_reduce(x)
            with pytest.raises(CommTimeoutError, match="did not finish"):
                replay.replay(comm.transport, x)
