"""The p2p transport on real GPUs: marked ``gpu``, skipped with the reason elsewhere.

Several ranks share one GPU (CUDA IPC between processes of one device works, and so does
peer access between GPUs); rank r uses GPU r % device_count.  Environment:

- ``FP4_COMM_TEST_RANKS``: processes (default 2; 4 and 8 run the same tests);
- ``FP4_COMM_P2P_LOOP``: calls of the back-to-back test (default 300; the hang test of the
  QuickReduce kind is 50000);
- ``FP4_COMM_P2P_MAX_MB``: largest tensor of the size sweeps (default 256);
- ``FP4_COMM_P2P_VS_NCCL=1``: also make an NCCL communicator in every worker and compare the
  two paths bit for bit (several ranks on one GPU need NCCL_MULTI_RANK_GPU_ENABLE=1).

In this process: ``P2PTransport.loopback`` (ranks of one process, one stream each) for the
kernel alone at every size.  Worker processes: every byte of every size, every collective and
codec against the gloo path (and NCCL), the all-reduce algorithms (one-shot, two-shot, "auto")
against ``fp4_comm.reference``, back-to-back calls of changing shapes, CUDA-graph
capture and replay, two communicators at once, send / recv, and the faults: a rank that skips a
call and a rank that is killed end in CommTimeoutError naming it, within the timeout.
"""

from __future__ import annotations

import os
import signal
import time
import warnings

import numpy as np
import pytest
import torch

import fp4_comm
import fp4_kernels
from fp4_comm.collectives import resolve_all_reduce_algorithm

pytestmark = pytest.mark.gpu

RANKS = int(os.environ.get("FP4_COMM_TEST_RANKS", "2"))
LOOP = int(os.environ.get("FP4_COMM_P2P_LOOP", "300"))
MAX_MB = float(os.environ.get("FP4_COMM_P2P_MAX_MB", "256"))
VS_NCCL = os.environ.get("FP4_COMM_P2P_VS_NCCL") == "1"
TIMEOUT_S = 60.0  # the kernels' deadline in the healthy tests: ranks time-slice one GPU
FAULT_TIMEOUT_S = 5.0
CODECS = ["nvfp4", "mxfp4", "none", "none-float32", fp4_kernels.FP4Quant(64)]
# bytes of the tensor moved: 1 KB ... 256 MB, odd sizes among them
SIZES = [1 << 10, 3 * 1000 + 7, (1 << 20) + 3, (16 << 20) + 5, (64 << 20) + 7, 256 << 20]


def _missing():
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    try:
        import cuda.core  # noqa: F401
        from cuda.bindings import driver  # noqa: F401
    except ImportError as err:
        return f"the p2p transport needs cuda-python (cuda.bindings, cuda.core): {err}"
    return None


def _bits(t):
    t = t.detach().contiguous()
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32).cpu().numpy()


def _x(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 10.0 ** torch.randint(-3, 4, shape, generator=g)).to(
        dtype
    )


# ---------------------------------------------------------------- one process: loopback


def _payloads(world, rank, call, nbytes, dev):
    g = torch.Generator(device=dev).manual_seed(rank * 7919 + call * 104_729 + nbytes)
    return torch.randint(0, 256, (world, nbytes), generator=g, device=dev, dtype=torch.uint8)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_loopback_moves_every_byte(world):
    reason = _missing()
    if reason:
        pytest.skip(reason)
    from fp4_comm.p2p import P2PTransport

    dev = fp4_comm.local_device(0)
    ts = P2PTransport.loopback(world, dev, timeout_s=30.0, buffer_bytes=16 << 20)
    streams = [torch.cuda.Stream(dev) for _ in range(world)]
    call = 0
    try:
        for size in [s for s in SIZES if s <= MAX_MB * 2**20]:
            rows = [max(1, size // world), 7, 1]  # three sections, odd sizes
            for op in ("all_to_all", "all_gather"):
                call += 1
                sends = [[_payloads(world, r, call, n, dev) for n in rows] for r in range(world)]
                if op == "all_gather":
                    sends = [[s[0] for s in per] for per in sends]
                recvs = [
                    [torch.zeros(world, n, dtype=torch.uint8, device=dev) for n in rows]
                    for _ in range(world)
                ]
                torch.cuda.synchronize(dev)
                for r in range(world):  # all queued before any is waited for
                    with torch.cuda.stream(streams[r]):
                        getattr(ts[r], op)(list(zip(sends[r], recvs[r], strict=True)))
                for r in range(world):
                    with torch.cuda.stream(streams[r]):
                        ts[r].synchronize()
                for r in range(world):
                    for i in range(len(rows)):
                        for p in range(world):
                            want = sends[p][i][r] if op == "all_to_all" else sends[p][i]
                            assert torch.equal(recvs[r][i][p], want), (size, op, r, i, p)
    finally:
        for t in ts:
            t.close()


# ---------------------------------------------------------------- worker processes


def _setup(comms, rank, world, timeout_s):
    dev = fp4_comm.local_device(rank)
    torch.cuda.set_device(dev)
    comms["p2p"] = fp4_comm.Communicator.from_process_group(
        None, dev, TIMEOUT_S, validate="first", transport="p2p"
    )
    if VS_NCCL:
        comms["nccl"] = fp4_comm.Communicator.from_process_group(
            None, dev, TIMEOUT_S, validate="first", transport="nccl"
        )


def _close(comms):
    for key in ("p2p", "nccl"):
        if key in comms:
            comms[key].close()


@pytest.fixture(scope="module")
def cluster():
    reason = _missing()
    if reason:
        pytest.skip(reason)
    from fp4_comm_cluster import Cluster

    c = Cluster(RANKS, timeout_s=120.0, setup=_setup, start_timeout_s=900.0)
    yield c
    try:
        c.run(_close, timeout_s=300)
    finally:
        c.close()


def _smoke(comms):
    comm = comms["p2p"]
    r, W = comm.rank, comm.world_size
    x = torch.full((W * 4, 32), float(r + 1), device=comm.device)
    y = comm.all_reduce(x, codec="none-float32")
    comm.synchronize()
    return float(y[0, 0]), float(y[-1, -1])


def test_p2p_smoke_all_reduce(cluster):
    # small integers: the sum is exact in every codec path; first a wrong answer or a hang
    # here says the transport itself is broken
    want = float(sum(range(1, RANKS + 1)))
    for got in cluster.run(_smoke, timeout_s=300):
        assert got == (want, want)


def _transport_bytes(comms, sizes):
    comm = comms["p2p"]
    t, W, r, dev = comm.transport, comm.world_size, comm.rank, comm.device
    bad = []
    for call, size in enumerate(sizes):
        rows = [max(1, size // W), 13, 1]
        sends = [_payloads(W, r, call, n, dev) for n in rows]
        recvs = [torch.zeros(W, n, dtype=torch.uint8, device=dev) for n in rows]
        t.all_to_all(list(zip(sends, recvs, strict=True)))
        gath = [torch.zeros(W, n, dtype=torch.uint8, device=dev) for n in rows]
        t.all_gather(list(zip([s[0] for s in sends], gath, strict=True)))
        t.synchronize()
        for p in range(W):
            theirs = [_payloads(W, p, call, n, dev) for n in rows]
            for i in range(len(rows)):
                if not torch.equal(recvs[i][p], theirs[i][r]):
                    bad.append(("all_to_all", size, i, p))
                if not torch.equal(gath[i][p], theirs[i][0]):
                    bad.append(("all_gather", size, i, p))
        del sends, recvs, gath
        torch.cuda.empty_cache()
    return bad


def test_p2p_moves_every_byte_1kb_to_256mb(cluster):
    sizes = [s for s in SIZES if s <= MAX_MB * 2**20]
    for bad in cluster.run(_transport_bytes, sizes, timeout_s=600):
        assert bad == []


def _collectives(comms, key, codec, rounding, dtype, shape):
    comm = comms[key]
    x = _x(shape, dtype, seed=comm.rank).to(comm.device)
    out = []
    for op in ("all_reduce", "reduce_scatter", "all_gather"):
        y = getattr(comm, op)(x, codec=codec, rounding=rounding, seed=1, step=2)
        out.append(_bits(y))
    return out


def _equal_paths(comms, codec, rounding, dtype, shape):
    p2p = _collectives(comms, "p2p", codec, rounding, dtype, shape)
    gloo = [_bits(y) for y in _gloo(comms, codec, rounding, dtype, shape)]
    return p2p, gloo


def _gloo(comms, codec, rounding, dtype, shape):
    comm = comms[max(k for k in comms if isinstance(k, int))]
    x = _x(shape, dtype, seed=comm.rank)
    # the all-reduce algorithm that "auto" chooses over p2p for this size, on gloo's transport
    nbytes = x.numel() * x.element_size()
    algorithm = resolve_all_reduce_algorithm("auto", True, comm.world_size, nbytes)
    comm = fp4_comm.Communicator(comm.transport, comm.control_group,
                                 all_reduce_algorithm=algorithm)  # fmt: skip
    return [
        getattr(comm, op)(x, codec=codec, rounding=rounding, seed=1, step=2)
        for op in ("all_reduce", "reduce_scatter", "all_gather")
    ]


def _algorithms(comms, cases):
    """Each case's all-reduce on this rank by a p2p communicator of each algorithm (over the
    same transport), and by the default one ("auto")."""
    base = comms["p2p"]
    by_algorithm = {
        a: fp4_comm.Communicator(base.transport, base.control_group, validate="first",
                                 all_reduce_algorithm=a)
        for a in ("one_shot", "two_shot")
    }  # fmt: skip
    by_algorithm["auto"] = base
    out = []
    for algorithm, codec, rounding, dtype, shape in cases:
        x = _x(shape, dtype, seed=base.rank).to(base.device)
        y = by_algorithm[algorithm].all_reduce(x, codec=codec, rounding=rounding, seed=1, step=2)
        out.append(_bits(y))
    base.synchronize()
    return out


#: (algorithm, codec, rounding, dtype, shape): both algorithms with every codec, and "auto"
#: on both sides of its threshold (512 KiB of input: one-shot, 2 bytes more: two-shot).
ALGORITHM_CASES = [
    (a, c, r, d, (RANKS * 13 + 1, 96))
    for a in ("one_shot", "two_shot")
    for c in CODECS
    for r, d in (("nearest", torch.float32), ("stochastic", torch.bfloat16))
] + [
    ("auto", "nvfp4", "nearest", torch.bfloat16, (256 << 10,)),
    ("auto", "nvfp4", "nearest", torch.bfloat16, ((256 << 10) + 1,)),
]  # fmt: skip


def test_p2p_all_reduce_algorithms_equal_the_reference(cluster):
    """one_shot and two_shot at FP4_COMM_TEST_RANKS ranks (run with 2 and with 4): every rank
    holds the same bits, equal to fp4_comm.reference's all-reduce of that algorithm (on this
    process's GPU); "auto" equals the reference's choice for the p2p transport."""
    from fp4_comm import reference

    res = cluster.run(_algorithms, ALGORITHM_CASES, timeout_s=600)
    for i, (algorithm, codec, rounding, dtype, shape) in enumerate(ALGORITHM_CASES):
        xs = [_x(shape, dtype, seed=r).cuda() for r in range(RANKS)]
        want = reference.all_reduce(xs, codec=codec, rounding=rounding, seed=1, step=2,
                                    algorithm=algorithm, transport="p2p")  # fmt: skip
        for r in range(RANKS):
            assert np.array_equal(res[r][i], _bits(want[r])), (r, algorithm, codec, rounding)
            assert np.array_equal(res[r][i], res[0][i]), (r, algorithm, codec)


@pytest.mark.parametrize("extra_rows", [0, 1], ids=["even", "uneven"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("codec", CODECS, ids=str)
def test_p2p_collectives_equal_the_gloo_path(cluster, codec, dtype, extra_rows):
    shape = (RANKS * 13 + extra_rows, 96)
    res = cluster.run(_equal_paths, codec, "stochastic", dtype, shape, timeout_s=300)
    for p2p, gloo in res:
        for a, b in zip(p2p, gloo, strict=True):
            assert np.array_equal(a, b)
    for i in (0, 2):  # all_reduce and all_gather: the same bits on every rank
        for p2p, _ in res[1:]:
            assert np.array_equal(p2p[i], res[0][0][i])


def _vs_nccl(comms, codec, n):
    shape = (n // 96, 96)
    return (
        _collectives(comms, "p2p", codec, "nearest", torch.bfloat16, shape),
        _collectives(comms, "nccl", codec, "nearest", torch.bfloat16, shape),
    )


@pytest.mark.parametrize("mb", [1, 64, 256])
@pytest.mark.parametrize("codec", ["nvfp4", "mxfp4", "none"], ids=str)
def test_p2p_equals_nccl_at_large_sizes(cluster, codec, mb):
    if not VS_NCCL:
        pytest.skip("FP4_COMM_P2P_VS_NCCL=1 makes the NCCL communicators to compare with")
    if mb > MAX_MB:
        pytest.skip(f"FP4_COMM_P2P_MAX_MB={MAX_MB}")
    n = mb * 2**20 // 2 // (96 * RANKS) * (96 * RANKS)  # bf16 elements
    for p2p, nccl in cluster.run(_vs_nccl, codec, n, timeout_s=600):
        for a, b in zip(p2p, nccl, strict=True):
            assert np.array_equal(a, b)


def _loop(comms, calls):
    """Back-to-back calls of changing ops, shapes and codecs without a host synchronization;
    the exact ones (integers in float32, "none-float32") checked every call."""
    comm = comms["p2p"]
    W, r, dev = comm.world_size, comm.rank, comm.device
    rng = np.random.default_rng(7)  # the same sequence on every rank
    wrong = torch.zeros((), dtype=torch.int64, device=dev)  # counted on the GPU: no sync
    fp4 = []
    for i in range(calls):
        rows = int(rng.integers(1, 64)) * W + int(rng.integers(0, W))
        cols = int(rng.choice([1, 7, 32, 96, 250, 1024]))
        op = ["all_reduce", "reduce_scatter", "all_gather"][i % 3]
        x = torch.full((rows, cols), float(r + 1 + i % 5), device=dev)
        y = getattr(comm, op)(x, codec="none-float32")
        if op == "all_gather":
            want = torch.arange(W, device=dev).repeat_interleave(rows).float() + 1 + i % 5
            wrong += (y != want[:, None]).sum()
        else:  # the sum over the ranks, in every row of the result
            wrong += (y != sum(float(q + 1 + i % 5) for q in range(W))).sum()
        if i % 50 == 0:
            x = _x((rows, cols), torch.bfloat16, i + 1000 * r).to(dev)
            fp4.append(comm.all_reduce(x, codec="nvfp4"))
    comm.synchronize()
    return int(wrong), [_bits(z).tobytes() for z in fp4]


def test_p2p_back_to_back_changing_shapes(cluster):
    # 3 collectives a call, no synchronization between calls: ranks run ahead of each other
    # by many messages; FP4_COMM_P2P_LOOP=50000 is the long hang test
    res = cluster.run(_loop, LOOP, timeout_s=max(600, LOOP * 0.5))
    for wrong, fp4 in res:
        assert wrong == 0
        assert fp4 == res[0][1]


def _graph(comms):
    comm = comms["p2p"]
    W, r, dev = comm.world_size, comm.rank, comm.device
    x = _x((W * 16, 256), torch.float32, r).to(dev)
    captured = comm.capture("all_reduce", x, codec="nvfp4", step=3)
    out = []
    for k in range(4):
        x.copy_(_x((W * 16, 256), torch.float32, 100 * k + r).to(dev))
        y = captured.replay()
        eager = comm.all_reduce(x, codec="nvfp4", step=3)  # between replays: epochs go on
        torch.cuda.synchronize(dev)
        out.append((_bits(y), _bits(eager)))
    comm.synchronize()
    return out


def test_p2p_cuda_graph_capture_and_replay(cluster):
    res = cluster.run(_graph, timeout_s=300)
    for per_rank in res:
        for k, (replayed, eager) in enumerate(per_rank):
            assert np.array_equal(replayed, eager), k
            assert np.array_equal(replayed, res[0][k][0]), k


def _two_communicators(comms):
    comm = comms["p2p"]
    dev = comm.device
    other = fp4_comm.Communicator.from_process_group(
        None, dev, TIMEOUT_S, validate="first", transport="p2p"
    )
    try:
        W, r = comm.world_size, comm.rank
        out = []
        for i in range(20):  # interleaved, the same order on every rank
            a = comm.all_reduce(torch.full((W * 8, 40), float(r), device=dev), codec="none-float32")
            b = other.all_gather(torch.full((3, 17), float(r + i), device=dev), codec="none")
            out.append((float(a[0, 0]), b[:, 0].tolist()))
        other.synchronize()
        comm.synchronize()
    finally:
        other.close()
    return out


def test_p2p_two_communicators_at_once(cluster):
    s = float(sum(range(RANKS)))
    for out in cluster.run(_two_communicators, timeout_s=300):
        for i, (a, b) in enumerate(out):
            assert a == s
            assert b == [float(p + i) for p in range(RANKS) for _ in range(3)]


def _ring(comms):
    comm = comms["p2p"]
    W, r, dev = comm.world_size, comm.rank, comm.device
    x = _x((5, 40), torch.float32, 7 + r).to(dev)
    dst, src = (r + 1) % W, (r - 1) % W
    if r % 2 == 0:  # a send waits for its receiver once the slots are full: one side first
        comm.send(x, dst=dst, codec="nvfp4", step=0)
        y = comm.recv(x.shape, x.dtype, src=src, codec="nvfp4")
    else:
        y = comm.recv(x.shape, x.dtype, src=src, codec="nvfp4")
        comm.send(x, dst=dst, codec="nvfp4", step=0)
    comm.synchronize()
    return _bits(y)


def test_p2p_send_recv_ring(cluster):
    for r, got in enumerate(cluster.run(_ring, timeout_s=300)):
        src = (r - 1) % RANKS
        x = _x((5, 40), torch.float32, 7 + src)
        ref = fp4_kernels.quantize_dequantize(
            torch.nn.functional.pad(x.reshape(1, -1), (0, 8)),
            fmt="nvfp4",
            seed=fp4_comm.collectives.rank_seed(0, src, "send"),
        )[0, :200].reshape(5, 40)
        assert np.array_equal(got, _bits(ref))


def _mismatch(comms):
    comm = comms["p2p"]
    comm.validate = "always"
    try:
        shape = (4, 64) if comm.rank else (4, 32)
        comm.all_reduce(torch.ones(shape, device=comm.device))
    except ValueError as err:
        return str(err)
    finally:
        comm.validate = "first"
    return None


def test_p2p_mismatch_is_an_error_not_a_hang(cluster):
    for message in cluster.run(_mismatch, timeout_s=300):
        assert message and "ranks disagree" in message


def _skipped_call(comms):
    """A fresh communicator with a short deadline; the last rank skips one all_reduce."""
    comm = fp4_comm.Communicator.from_process_group(
        None, torch.cuda.current_device(), FAULT_TIMEOUT_S, validate="never", transport="p2p"
    )
    W, r = comm.world_size, comm.rank
    x = torch.ones(W * 64, 64, device=comm.device)
    try:
        # one healthy call first: it compiles the codec's kernels, which (seconds with 8
        # processes compiling at once) would otherwise eat the deadline inside the call
        comm.all_reduce(x, codec="mxfp4")
        comm.synchronize()
        if r == W - 1:
            return None
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            start = time.monotonic()
            try:
                # the error may come from the call itself (a later hop finds the first one
                # failed) or from synchronize; either way it names the rank that skipped
                comm.all_reduce(x, codec="mxfp4")
                time.sleep(FAULT_TIMEOUT_S + 2)  # no synchronize: the watchdog notices
                comm.synchronize()
                return ("no error", 0.0, None, [], "")
            except fp4_comm.CommTimeoutError as err:
                took = time.monotonic() - start
                try:
                    comm.all_reduce(torch.ones(8, 32, device=comm.device))
                    again = "no error"
                except fp4_comm.CommTimeoutError as err2:
                    again = str(err2)
                warned = [str(w.message) for w in seen if "watchdog" in str(w.message)]
                return (str(err), took, err.peers, warned, again)
    finally:
        comm.close()


def test_p2p_a_rank_that_skips_a_call_ends_in_timeout_naming_it(cluster):
    res = cluster.run(_skipped_call, timeout_s=300)
    last = RANKS - 1
    for out in res[:-1]:
        message, took, peers, warned, again = out
        assert f"rank {last} did not take part in time" in message, message
        assert peers == [last]
        assert took < FAULT_TIMEOUT_S + 2 + 30
        assert warned, "the watchdog did not warn"
        assert "unusable" in again, again


def _killed(comms, victim):
    dev = fp4_comm.local_device(torch.distributed.get_rank())
    torch.cuda.set_device(dev)
    comm = fp4_comm.Communicator.from_process_group(
        None, dev, FAULT_TIMEOUT_S, validate="never", transport="p2p"
    )
    W, r = comm.world_size, comm.rank
    comm.all_reduce(torch.ones(W * 64, 64, device=comm.device), codec="nvfp4")
    comm.synchronize()  # one healthy call first: the victim dies between calls
    if r == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(W * 1024, 256, device=comm.device), codec="nvfp4")
        comm.synchronize()
    except fp4_comm.CommTimeoutError as err:
        return (str(err), time.monotonic() - start, err.peers)
    return ("no error", time.monotonic() - start, None)


def test_p2p_killed_peer_ends_in_timeout_naming_it():
    # a cluster of its own: one of its ranks dies
    reason = _missing()
    if reason:
        pytest.skip(reason)
    from fp4_comm_cluster import Cluster, Died

    c = Cluster(RANKS, timeout_s=60.0, start_timeout_s=900.0)
    victim = RANKS - 1
    try:
        res = c.run(_killed, victim, timeout_s=300, allow_death=True)
    finally:
        c.close(force=True)
    assert isinstance(res[victim], Died)
    for r, result in enumerate(res):
        if r == victim:
            continue
        message, took, peers = result
        assert f"rank {victim} did not take part in time" in message, message
        assert peers == [victim]
        assert took < FAULT_TIMEOUT_S + 30, took
