"""fp4_comm.p2p without a GPU: the buffer layout and launch plans as pure functions, the failure
messages, and the CPU model (``_p2p_model.ModelWorld``): the exchange kernel's own code run by
Python threads on host memory behind the real ``P2PTransport`` host code, for 1-4 ranks, with
a check on every store into a receive slot (never into one whose message is unconsumed).  The
collectives over the model equal the gloo path bit for bit.  The GPU tests are in
test_fp4_comm_p2p_gpu.py; the kernel's PTX in test_fp4_comm_p2p_kernels.py."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from fp4_comm_cluster import construction_outcomes

import fp4_comm
import fp4_kernels
from fp4_comm import _p2p_kernels as K, p2p
from fp4_comm._p2p_model import ModelWorld
from fp4_comm.collectives import resolve_all_reduce_algorithm
from fp4_comm.p2p import (
    LANE_MIN_BYTES,
    PIECE_ALIGN,
    BufferLayout,
    P2PTransport,
    describe_failure,
    packed_bytes,
    plan_launch,
    reach_row,
    unreachable_pairs,
)

# ---------------------------------------------------------------- layout and plans


@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("lanes", [1, 3, 8])
def test_layout_regions_are_disjoint_and_aligned(world, lanes):
    layout = BufferLayout.for_buffer(world, lanes, 1 << 20)
    assert layout.piece_bytes % PIECE_ALIGN == 0
    assert max(1, world - 1) * lanes * 2 * layout.piece_bytes <= 1 << 20
    regions = [
        (layout.ready_off, 8 * world * lanes * 2),
        (layout.ack_off, 8 * world * lanes),
        (layout.counters_off, 16 * world * lanes),
        (layout.failed_off, 8),
        (layout.table_off, 8 * world),
        (layout.data_off, (world - 1) * lanes * 2 * layout.piece_bytes),
    ]
    for (a, n), (b, _) in zip(regions, regions[1:], strict=False):
        assert a + n <= b, (a, n, b)
    assert layout.data_off % 4096 == 0 and layout.total_bytes == sum(regions[-1])
    slots = set()
    for owner in range(world):
        for src in range(world):
            if src == owner:
                continue
            for lane in range(lanes):
                for parity in (0, 1):
                    off = layout.slot_off(owner, src, lane, parity)
                    assert layout.data_off <= off <= layout.total_bytes - layout.piece_bytes
                    assert off % 16 == 0
                    slots.add((owner, off))
    assert len(slots) == world * (world - 1) * lanes * 2  # no two senders share a slot


def test_layout_too_small_names_the_argument():
    with pytest.raises(ValueError, match="buffer_bytes: 100 bytes hold no slot"):
        BufferLayout.for_buffer(2, 8, 100)


def test_packed_bytes_pads_each_section_to_16():
    assert packed_bytes([]) == 0
    assert packed_bytes([1]) == 16
    assert packed_bytes([16, 1, 0, 17]) == 16 + 16 + 0 + 32


def test_plan_launch_lanes_follow_the_message_size():
    layout = BufferLayout(world=4, lanes=8, piece_bytes=1 << 16)
    assert plan_launch(layout, [0, 0]) is None
    small = plan_launch(layout, [100])
    assert small == (1, 4, 112)  # one lane a peer, a block row per rank
    assert plan_launch(layout, [100], only_peer=2) == (1, 1, 112)
    mid = plan_launch(layout, [3 * LANE_MIN_BYTES])
    assert mid.lanes == 3
    big = plan_launch(layout, [1 << 30])
    assert big.lanes == 8 and big.grid == 32
    # never more lanes than pieces
    few = plan_launch(BufferLayout(world=2, lanes=8, piece_bytes=1 << 20), [2 << 20])
    assert few.lanes == 2
    with pytest.raises(ValueError, match="at most 4 sections"):
        plan_launch(layout, [1] * 5)


def test_slot_and_flag_predicates_double_buffer():
    # message k goes in slot k % 2: it may be written once message k - 2 (the slot's previous
    # tenant) is consumed, i.e. the receiver has acknowledged k - 1 messages; not before
    for k in range(0, 12):
        assert K.slot_free(max(0, k - 1), k)
        if k >= 2:
            assert not K.slot_free(k - 2, k)
        # message k has come when its slot's flag holds k + 1; k - 1 (the slot's tenant two
        # messages back holds k - 1) is not it
        assert K.data_ready(k + 1, k)
        assert not K.data_ready(k - 1, k)


def _report(status, peer, wait, op, expected=3, seen=1, lane=2, waited=2_500_000_000):
    words = [0] * 8
    words[K.REPORT_STATUS], words[K.REPORT_PEER], words[K.REPORT_WAIT] = status, peer, wait
    words[K.REPORT_LANE], words[K.REPORT_OP] = lane, op
    words[K.REPORT_EXPECTED], words[K.REPORT_SEEN], words[K.REPORT_WAITED_NS] = (
        expected,
        seen,
        waited,
    )
    return words


def test_failure_messages_name_the_peer_and_what_was_awaited():
    text, peers = describe_failure(_report(K.STATUS_TIMEOUT, 3, K.WAIT_DATA, K.OP_ALL_TO_ALL),
                                   1, 4, 2.0)  # fmt: skip
    assert peers == [3]
    assert text.startswith("p2p all_to_all on rank 1 of 4: rank 3 did not take part in time")
    assert "message 2 of lane 2 from rank 3" in text and "unusable" in text
    text, _ = describe_failure(_report(K.STATUS_TIMEOUT, 0, K.WAIT_SLOT, K.OP_SEND), 1, 2, 2.0)
    assert "rank 0 to take message 2 of lane 2 out of its receive slot" in text
    assert "one must receive first" in text
    text, _ = describe_failure(_report(K.STATUS_ABORTED, 0, K.WAIT_DATA, K.OP_ALL_GATHER), 1, 2,
                               2.0)  # fmt: skip
    assert "stopped by this rank's host" in text and "aborted" in text


def test_reach_rows_refuse_other_nodes_and_gpus_without_peer_access():
    def info(node, gpu, local, access):
        return {"node": node, "gpu": gpu, "local": local, "index": 0, "peer_access": access}

    a = info("h/1", "GPU-a", ["GPU-a", "GPU-b"], {"GPU-a": True, "GPU-b": False})
    same = info("h/1", "GPU-a", ["GPU-a"], {"GPU-a": True})
    b = info("h/1", "GPU-b", ["GPU-a", "GPU-b"], {"GPU-a": True, "GPU-b": True})
    far = info("k/2", "GPU-c", ["GPU-c"], {"GPU-c": True})
    hidden = info("h/1", "GPU-z", ["GPU-z"], {"GPU-z": True})
    row = reach_row(a, [a, same, b, far, hidden])
    assert row[0] is None and row[1] is None  # itself; another rank on the same GPU
    assert "no peer access" in row[2]
    assert "another node (k)" in row[3]
    assert "not visible" in row[4]
    lines = unreachable_pairs([row, [None] * 5])
    assert lines[0].startswith("rank 0 cannot reach rank 2: no peer access")
    assert len(lines) == 3


def test_p2p_transport_refuses_a_cpu_device():
    with pytest.raises(ValueError, match="not a CUDA device"):
        P2PTransport(None, "cpu")


def test_ipc_handle_bytes_round_trip():
    pytest.importorskip("cuda.bindings")
    from fp4_comm.p2p import ipc_handle_bytes, ipc_handle_from_bytes

    data = bytes(range(64))
    assert ipc_handle_bytes(ipc_handle_from_bytes(data)) == data
    with pytest.raises(ValueError, match="64 bytes"):
        ipc_handle_from_bytes(b"x")


# ---------------------------------------------------------------- the CPU model

SIZES = [0, 1, 5, 16, 17, 255, 256, 700, 2000, 3001]


def _payload(rank, call, section, n, rows):
    g = torch.Generator().manual_seed(rank * 100_003 + call * 101 + section)
    return torch.randint(0, 256, (rows, n), generator=g, dtype=torch.uint8)


def _calls(world, count, seed):
    rng = np.random.default_rng(seed)
    kinds = ["all_to_all", "all_gather"] + (["ring"] if world > 1 else [])
    return [
        (
            kinds[rng.integers(len(kinds))],
            [int(rng.choice(SIZES)) for _ in range(rng.integers(1, 7))],
        )
        for _ in range(count)
    ]


def _run_calls(t, calls):
    """Every call's bytes against the peers' payloads; sections beyond four take more launches."""
    W, r = t.world_size, t.rank
    for c, (kind, sizes) in enumerate(calls):
        if kind == "all_to_all":
            send = [_payload(r, c, i, n, W) for i, n in enumerate(sizes)]
            recv = [torch.zeros_like(s) for s in send]
            t.all_to_all(list(zip(send, recv, strict=True)))
            want = [
                torch.stack([_payload(p, c, i, n, W)[r] for p in range(W)])
                for i, n in enumerate(sizes)
            ]
        elif kind == "all_gather":
            send = [_payload(r, c, i, n, 1)[0] for i, n in enumerate(sizes)]
            recv = [torch.zeros(W, n, dtype=torch.uint8) for n in sizes]
            t.all_gather(list(zip(send, recv, strict=True)))
            want = [
                torch.stack([_payload(p, c, i, n, 1)[0] for p in range(W)])
                for i, n in enumerate(sizes)
            ]
        else:  # a ring of send / recv; even ranks send first (a send may wait for its receiver)
            dst, src = (r + 1) % W, (r - 1) % W
            send = [_payload(r, c, i, n, 1) for i, n in enumerate(sizes)]
            recv = [torch.zeros(1, n, dtype=torch.uint8) for n in sizes]
            if r % 2 == 0:
                t.send(send, dst)
                t.recv(recv, src)
            else:
                t.recv(recv, src)
                t.send(send, dst)
            want = [_payload(src, c, i, n, 1) for i, n in enumerate(sizes)]
        for i, (got, expected) in enumerate(zip(recv, want, strict=True)):
            assert torch.equal(got, expected), (c, kind, i, sizes)
    t.synchronize()
    return len(calls)


@pytest.mark.parametrize(("world", "lanes"), [(1, 2), (2, 1), (2, 3), (3, 2), (4, 2)])
def test_model_moves_every_byte_in_order(world, lanes):
    # 256-byte slots: messages of up to 6 sections x 3001 bytes go in dozens of pieces, every
    # lane wraps its two slots many times, and the calls change sizes and kinds back to back
    model = ModelWorld(world, timeout_s=30.0, lanes=lanes)
    calls = _calls(world, 40 if world < 4 else 20, seed=world * 10 + lanes)
    assert model.run(_run_calls, calls, timeout_s=300) == [len(calls)] * world
    assert model.violations == []


def _run_twice_and_count_plans(t, calls):
    _run_calls(t, calls + calls)  # every kind of launch again, after it was dropped
    return len(t._plans)


def test_model_keeps_a_bounded_number_of_launch_kinds(monkeypatch):
    # calls of changing section shapes pack a launch each; past MAX_PLANS the oldest goes, and
    # a dropped kind that comes back is packed again and moves the same bytes
    monkeypatch.setattr(p2p, "MAX_PLANS", 3)
    calls = _calls(2, 12, seed=5)
    assert len({(kind, tuple(sizes)) for kind, sizes in calls}) > 3
    model = ModelWorld(2, timeout_s=30.0, lanes=2)
    assert model.run(_run_twice_and_count_plans, calls, timeout_s=300) == [3, 3]
    assert model.violations == []


def _gather_as(t, dtypes, n=300):
    """all_gathers of one section, its dtype per call; what each call gathered (or the
    ValueError's message)."""
    out = []
    for c, dtype in enumerate(dtypes):
        # the same shapes whatever the dtype: one kind of call for the transport's plans
        send = (torch.arange(n) + 7 * t.rank + c).to(dtype)
        recv = torch.zeros(t.world_size, n, dtype=dtype)
        try:
            t.all_gather([(send, recv)])
        except ValueError as err:
            out.append(str(err))
            continue
        out.append(recv.view(torch.uint8).clone())
    return out


def test_a_planned_kind_takes_one_byte_sections_of_any_dtype_and_no_wider_ones():
    # int8 sections move as bytes, on the call that plans the kind and on the planned calls
    # after it; a float32 section of the planned shape is refused there too (its bytes are
    # not the planned ones), not moved as if it were bytes
    model = ModelWorld(2, lanes=1)
    dtypes = [torch.int8, torch.uint8, torch.int8, torch.uint8, torch.float32]
    got = model.run(_gather_as, dtypes)
    want = [torch.stack([(torch.arange(300) + 7 * p + c).to(dtypes[c]).view(torch.uint8)
                         for p in range(2)]) for c in range(4)]  # fmt: skip
    for r in range(2):
        for c in range(4):
            assert torch.equal(got[r][c], want[c]), (r, c, got[r][c])
        assert "one-byte" in got[r][4] and "float32" in got[r][4]
    assert model.violations == []


def test_model_slot_check_sees_a_store_into_an_unconsumed_slot():
    # the check the model runs on every store: a slot whose flag says message 4 is there,
    # with 4 messages (0..3) consumed, must not be written (4 unconsumed); with 5, it may
    model = ModelWorld(2, lanes=1)
    layout = model.layout
    ready = layout.ready_at(0, 0, 0)
    model.memories[1].array[ready : ready + 8].view(np.int64)[0] = 5  # message 4 published
    ack = layout.ack_at(1, 0)
    model.memories[0].array[ack : ack + 8].view(np.int64)[0] = 4
    slot = model.bases[1] + layout.slot_off(1, 0, 0, 0)
    model._on_store(slot + 32, 16)
    assert len(model.violations) == 1 and "holding message 4" in model.violations[0]
    model.memories[0].array[ack : ack + 8].view(np.int64)[0] = 5
    model._on_store(slot, 16)
    assert len(model.violations) == 1


def _exchange_once(t, n=3000):
    send = [torch.full((t.world_size, n), t.rank, dtype=torch.uint8)]
    recv = [torch.zeros_like(send[0])]
    start = time.monotonic()
    t.all_to_all(list(zip(send, recv, strict=True)))
    took = time.monotonic() - start
    try:
        t.synchronize()
    except fp4_comm.CommTimeoutError as err:
        return took, err
    return took, None


def test_model_dead_peer_times_out_on_every_survivor_naming_it():
    model = ModelWorld(3, timeout_s=0.5, lanes=2)
    model.dead.add(2)
    out = model.run(_exchange_once)
    for r in (0, 1):
        took, err = out[r]
        assert 0.5 <= took < 0.5 + 5, took  # the deadline, then the launch ends
        assert isinstance(err, fp4_comm.CommTimeoutError) and err.peers == [2]
        assert f"rank {r} of 3: rank 2 did not take part in time" in str(err)
    # the communicator says it is unusable at every later call, at once
    start = time.monotonic()
    for r in (0, 1):
        with pytest.raises(fp4_comm.CommTimeoutError, match="unusable"):
            _exchange_once(model.transports[r])
    assert time.monotonic() - start < 1.0


def test_model_abort_ends_a_wait_long_before_its_deadline():
    model = ModelWorld(2, timeout_s=60.0, lanes=1)
    model.dead.add(1)
    t = model.transports[0]

    def abort_while_waiting():
        # once the launch waits (an abort before the call would make the call itself raise,
        # on a machine that stalls this thread for the timer's 0.3 s)
        while model.launches == 0:
            time.sleep(0.01)
        time.sleep(0.3)
        t.abort("stopped by the test")

    timer = threading.Thread(target=abort_while_waiting, daemon=True)
    timer.start()
    took, err = _exchange_once(t)
    timer.join()
    assert took < 10, took
    assert isinstance(err, fp4_comm.CommTimeoutError) and "stopped by the test" in str(err)
    words = t._report_words()
    assert words[K.REPORT_STATUS] == K.STATUS_ABORTED and words[K.REPORT_PEER] == 1


def test_model_failed_rank_skips_queued_launches_at_once():
    # a rank whose failure word is set runs no block of a later launch (no deadline to wait:
    # well under the 2 s a wait would take, with room for a loaded machine)
    model = ModelWorld(2, timeout_s=2.0, lanes=1)
    model.dead.add(1)
    t = model.transports[0]
    _exchange_once(t)
    t._failed = None  # look past the host's verdict: launch again into the failed rank
    t._status.value = 0
    start = time.monotonic()
    _exchange_once(t)
    assert time.monotonic() - start < 1.0


# ---------------------------------------------------------------- collectives over the model

CODECS = ["nvfp4", "mxfp4", "none", "none-float32", fp4_kernels.FP4Quant(64)]


def _inputs(world, rank, shape, dtype):
    g = torch.Generator().manual_seed(1000 * world + rank)
    return (torch.randn(shape, generator=g) * 10.0 ** torch.randint(-2, 3, shape, generator=g)).to(
        dtype
    )


def _collectives(comm, world, codec, dtype, shape):
    x = _inputs(world, comm.rank, shape, dtype)
    out = []
    for op in ("all_reduce", "reduce_scatter", "all_gather"):
        y = getattr(comm, op)(x, codec=codec, rounding="stochastic", seed=1, step=2)
        out.append(y.contiguous().view(torch.int16 if y.element_size() == 2 else torch.int32))
    return [o.numpy() for o in out]


def _gloo_collectives(comms, world, codec, dtype, shape, algorithm):
    comm = comms[world]
    if comm is None:
        return None
    comm = fp4_comm.Communicator(comm.transport, comm.control_group,
                                 all_reduce_algorithm=algorithm)  # fmt: skip
    return _collectives(comm, world, codec, dtype, shape)


def _model_comms(world, algorithm="auto"):
    model = ModelWorld(
        world, timeout_s=60.0, lanes=2, buffer_bytes=max(1, world - 1) * 2 * 2 * 1024
    )
    comms = [fp4_comm.Communicator(t, None, validate="never", all_reduce_algorithm=algorithm)
             for t in model.transports]  # fmt: skip
    return model, comms


@pytest.mark.parametrize(
    ("world", "codec", "dtype", "algorithm"),
    [(3, c, torch.bfloat16, "auto") for c in CODECS]
    + [(2, "nvfp4", torch.float32, "two_shot"), (4, "mxfp4", torch.float16, "two_shot")]
    + [(2, "mxfp4", torch.bfloat16, "one_shot"), (4, "nvfp4", torch.float32, "one_shot")],
    ids=str,
)
def test_model_collectives_equal_the_gloo_path(cluster, world, codec, dtype, algorithm):
    shape = (world * 13 + 1, 96)  # padding everywhere; uneven reduce_scatter shards
    # "auto" over p2p: one-shot for this small message (gloo's "auto" would be two-shot)
    nbytes = shape[0] * shape[1] * dtype.itemsize
    resolved = resolve_all_reduce_algorithm(algorithm, True, world, nbytes)
    assert resolved == ("two_shot" if algorithm == "two_shot" else "one_shot")
    gloo = cluster.run(_gloo_collectives, world, codec, dtype, shape, resolved)[:world]
    model, comms = _model_comms(world, algorithm)
    got = model.run(
        lambda t: _collectives(comms[t.rank], world, codec, dtype, shape), timeout_s=300
    )
    for r in range(world):
        for y_model, y_gloo in zip(got[r], gloo[r], strict=True):
            assert np.array_equal(y_model, y_gloo)
    assert model.violations == []


#: transport arguments that do not name a transport for the device
MISMATCHED_TRANSPORTS = [
    {"device": "cpu", "transport": "p2p"},
    {"device": "cpu", "transport": "nccl"},
    {"device": "cpu", "transport": "bogus"},
    {"device": "cuda:0", "transport": "gloo"},
]


def test_communicator_transport_argument_is_checked(cluster):
    expected = [
        "transport='p2p' moves CUDA tensors",
        "transport='nccl' moves CUDA tensors",
        "transport: 'bogus' is not one of",
        "transport='gloo' moves CPU tensors",
    ]
    for out in cluster.run(construction_outcomes, MISMATCHED_TRANSPORTS)[:2]:
        for (kind, message), word in zip(out, expected, strict=True):
            assert kind == "ValueError" and word in message, (kind, message)


def test_shared_gpu_lanes_fit_every_rank_on_the_gpu():
    from fp4_comm.p2p import shared_gpu_lanes

    assert shared_gpu_lanes(8, 2, 132) == 8
    assert shared_gpu_lanes(8, 4, 132) == 8  # 4 x 4 x 8 = 128 blocks <= 132 SMs
    assert shared_gpu_lanes(8, 8, 132) == 2  # 8 x 8 x 2 = 128
    assert shared_gpu_lanes(8, 16, 132) == 1  # never fewer than one lane
