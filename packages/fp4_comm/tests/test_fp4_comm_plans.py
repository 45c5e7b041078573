"""The collectives' plans (``collectives.py``) and the communicator's cache of them.

On a pretend GPU (``_fake_gpu``: one rank, an NCCL stand-in that moves nothing): what a planned
call queues (no copy of NVFP4's tensor scale, one launch for a rank's own rows), that it reuses
its receive buffers on one stream and only there (not on another stream, not under CUDA-graph
capture, never where a result is a view of them), that validate="first" checks each kind of
call once, that the cache is bounded, and that per-call values still get checked.

Over the threaded host-memory NCCL stand-in (``test_fp4_comm_nccl_transport``), which moves
the bytes: results of a call are not overwritten by the next call of its kind, and the
reduce-scatter's sum rounded once to a 16-bit dtype equals the reference for 2 and 4 ranks.
The gloo tests (``test_fp4_comm_collectives``) run the same plans against the references.
"""

import contextlib
import types

import numpy as np
import pytest
import torch
from _fake_gpu import FAKE_STREAM, Recorder, fake_gpu_communicator
from test_fp4_comm_collectives import FP4QUANT, _inputs, reference_reduce_scatter
from test_fp4_comm_nccl_transport import _on_threads, _transports
from torch.utils._python_dispatch import TorchDispatchMode

from fp4_comm import Communicator, collectives, communicator
from fp4_comm.codecs import get_codec


class _TorchOps(TorchDispatchMode):
    """The torch ops that queue device work (kernels, copies), by name; views and
    allocations left out."""

    def __init__(self):
        super().__init__()
        self.ops = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        returns = func._schema.returns
        view = returns and returns[0].alias_info is not None and not returns[0].alias_info.is_write
        if not (view or func.__name__.startswith("empty")):
            name = func.overloadpacket.__name__
            self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _recv_pointers(null):
    """The receive addresses of the NCCL calls recorded so far, then forgets them."""
    ptrs = [c[1] for c in null.calls if c[0] == "recv"]
    ptrs += [c[2] for c in null.calls if c[0] == "allGather"]
    null.calls.clear()
    return ptrs


@contextlib.contextmanager
def _current_stream(handle):
    saved = torch._C._cuda_getCurrentRawStream
    torch._C._cuda_getCurrentRawStream = lambda device: handle
    try:
        yield
    finally:
        torch._C._cuda_getCurrentRawStream = saved


def _kernel_names(recorder):
    """The fp4_kernels kernels launched so far, by the function that builds each, then
    forgets them."""
    names = [k.py_func.__qualname__.split(".")[0] for k, *_ in recorder.launches]
    recorder.launches.clear()
    return names


@pytest.mark.parametrize("world", [2, 4])
def test_planned_nvfp4_all_reduce_queues_no_copy_of_the_tensor_scale(world):
    x = torch.randn(world * 8, 64)
    with fake_gpu_communicator(world, recorder=Recorder()) as (comm, null, _, recorder):
        comm.all_reduce(x)  # plans made
        null.calls.clear()
        _kernel_names(recorder)
        with _TorchOps() as ops:
            comm.all_reduce(x)
    # each rank's own rows of the three sections: one launch; the gathered chunks' decode and
    # its 1/S product; the tensor scale goes out as the quantizer wrote it (4 bytes sent to
    # every peer), not repeated per chunk by a copy.  The middle step (nearest rounding, no
    # error feedback, no statistics) is fp4_kernels' requantized_sum with each received
    # chunk's 1/S as its row scales: its two kernels, and no torch op (no float32 decode,
    # 1/S product or add)
    assert ops.ops == {"_foreach_copy_": 1, "mul_": 1}
    assert _kernel_names(recorder) == [
        "amax_kernel", "quantize_kernel", "requantized_sum_amax_kernel",
        "requantized_sum_kernel", "dequantize_kernel",
    ]  # fmt: skip
    sends = [c for c in null.calls if c[0] == "send"]
    assert len(sends) == 3 * (world - 1)
    scale_sends = {c[1] for c in sends if c[2] == 4}
    assert len(scale_sends) == 1  # the same 4 bytes to every peer
    assert [c[0] for c in null.calls].count("groupEnd") == 2


@pytest.mark.parametrize("codec", ["nvfp4", "mxfp4", FP4QUANT])
@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "all_gather"])
def test_receive_buffers_are_kept_per_stream_and_not_under_capture(op, codec):
    x = torch.randn(16, 48)
    with fake_gpu_communicator(2) as (comm, null, _, _):
        call = getattr(comm, op)
        call(x, codec=codec)
        first = _recv_pointers(null)
        call(x, codec=codec)
        assert _recv_pointers(null) == first  # the same stream: the same buffers
        with _current_stream(FAKE_STREAM + 1):
            call(x, codec=codec)
            other = _recv_pointers(null)
            call(x, codec=codec)
            assert _recv_pointers(null) == other
        assert set(other).isdisjoint(first)  # another stream: buffers of its own
        call(x, codec=codec)
        assert _recv_pointers(null) == first  # the first stream's are still there
        torch.cuda.is_current_stream_capturing = lambda: True
        call(x, codec=codec)
        captured = _recv_pointers(null)
        assert set(captured).isdisjoint(first + other)  # a capture allocates its own


@pytest.mark.parametrize(
    ("codec", "dtype"), [("none", torch.bfloat16), ("none-float32", torch.float32)]
)
def test_buffers_that_results_view_are_not_kept(codec, dtype):
    # decode of a wire dtype equal to the result's returns a view of the receive buffer: a
    # kept buffer would be overwritten by the next call while the earlier result lives on
    x = torch.randn(16, 48).to(dtype)
    with fake_gpu_communicator(2) as (comm, null, _, _):
        y1 = comm.all_gather(x, codec=codec)
        first = _recv_pointers(null)
        y2 = comm.all_gather(x, codec=codec)
        assert set(_recv_pointers(null)).isdisjoint(first)
        del y1, y2


@pytest.mark.parametrize("codec", ["none", "none-float32", "nvfp4"])
def test_the_one_shot_all_reduce_keeps_its_buffers_also_for_none_codecs(codec):
    # its result is the rank-order sum, new memory: no result views its receive buffer
    x = torch.randn(16, 48).to(torch.float32 if codec == "none-float32" else torch.bfloat16)
    with fake_gpu_communicator(2, all_reduce_algorithm="one_shot") as (comm, null, _, _):
        y1 = comm.all_reduce(x, codec=codec)
        first = _recv_pointers(null)
        y2 = comm.all_reduce(x, codec=codec)
        assert _recv_pointers(null) == first and len(first) == len(
            get_codec(codec).section_nbytes(768)
        )
        assert y1.data_ptr() not in first and y2.data_ptr() not in first


def test_validate_first_checks_each_kind_of_call_once():
    x, x2 = torch.randn(8, 32), torch.randn(4, 32)
    with fake_gpu_communicator(2) as (comm, _, control, _):
        for expected in (1, 0, 0):
            before = control.exchanges
            comm.all_reduce(x)
            assert control.exchanges - before == expected
        comm.all_reduce(x2)  # another shape: another kind of call, checked once
        comm.all_reduce(x2)
        comm.all_reduce(x, codec="mxfp4")
        assert control.exchanges == 3
        comm.validate = "always"
        comm.all_reduce(x)
        comm.all_reduce(x)
        assert control.exchanges == 5
    with fake_gpu_communicator(2, validate="never") as (comm, _, control, _):
        comm.all_reduce(x)
        comm.all_reduce(x)
        assert control.exchanges == 0
        comm.validate = "first"  # planned under "never": not checked yet, so checked now
        comm.all_reduce(x)
        comm.all_reduce(x)
        assert control.exchanges == 1


def test_the_plan_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(communicator, "PLAN_CACHE_SIZE", 3)
    with fake_gpu_communicator(2) as (comm, _, _, _):
        for rows in (2, 4, 6, 8, 2):
            comm.all_reduce(torch.randn(rows, 16))
        assert len(comm._plans) == 3
        assert [k[7][0] for k in comm._plans] == [6, 8, 2]  # least recently used dropped


def test_with_graphs_the_plan_cache_holds_as_many_plans_as_graphs(monkeypatch):
    """A kind whose plan is dropped loses its graph: with more kinds than plans (a site of
    error feedback each) they cycled, captured and dropped again.  Where graphs replay, the
    plan cache holds as many plans as the graph cache may keep graphs."""
    monkeypatch.setattr(communicator, "PLAN_CACHE_SIZE", 3)
    for graph_cache, kept in ((None, 8), ((5, 1 << 30), 5), ((2, 1 << 30), 3)):
        with fake_gpu_communicator(2, graphs="auto", graph_cache=graph_cache) as (comm, *_):
            for rows in range(1, 11):
                comm.all_reduce(torch.randn(rows, 16))
            assert len(comm._plans) == kept, graph_cache


def test_per_call_values_of_a_planned_kind_are_still_checked():
    x = torch.randn(8, 32)
    with fake_gpu_communicator(2) as (comm, _, _, _):
        comm.all_reduce(x, seed=1, step=2)
        comm.send(x, 1)
        with pytest.raises(ValueError, match="seed"):
            comm.all_reduce(x, seed=2**64)
        with pytest.raises(ValueError, match="step"):
            comm.all_reduce(x, step=-1)
        with pytest.raises(TypeError, match="seed"):
            comm.all_reduce(x, seed=1.0)
        with pytest.raises(TypeError, match="dst"):
            comm.send(x, True)  # equal to 1 as a dict key, but no rank
        comm.all_reduce(x, seed=np.uint64(1), step=np.int32(2))  # the full way: accepted


def test_a_kept_plan_is_for_dense_strided_tensors_only():
    """A sparse or mkldnn tensor of a kept kind's shape took the plan and failed inside torch
    (copy_ between dense and sparse, ...); a negative view kept a plan under no kind."""
    x = torch.randn(4, 32)
    with fake_gpu_communicator(2) as (comm, _, _, _):
        for op in ("all_reduce", "reduce_scatter", "all_gather"):
            getattr(comm, op)(x)
            for other in (x.to_sparse(), x.to_sparse_csr(), x.to_mkldnn()):
                with pytest.raises(TypeError, match=f"{op}: a torch"):
                    getattr(comm, op)(other)
        kept = len(comm._plans)
        comm.all_reduce(torch._neg_view(torch.randn(6, 32)))
        assert len(comm._plans) == kept and None not in comm._plans


def test_setting_the_algorithm_or_graphs_checks_it_and_drops_the_kept_plans():
    """A kept all-reduce plan ran the algorithm it was made with after
    ``all_reduce_algorithm`` changed (other bits than the algorithm set: one-shot quantizes
    once, two-shot twice)."""
    xs = _inputs(2, (4, 64), seed=7)
    comms = _communicators(2)  # two-shot
    _on_threads(2, lambda r: comms[r].all_reduce(xs[r], codec="nvfp4", step=0))
    for c in comms:
        c.all_reduce_algorithm = "one_shot"
        assert not c._plans
    got = _on_threads(2, lambda r: comms[r].all_reduce(xs[r], codec="nvfp4", step=0))
    fresh = _communicators(2, "all_reduce_one_shot")
    want = _on_threads(2, lambda r: fresh[r].all_reduce(xs[r], codec="nvfp4", step=0))
    two_shot = _communicators(2)
    other = _on_threads(2, lambda r: two_shot[r].all_reduce(xs[r], codec="nvfp4", step=0))
    assert not torch.equal(want[0], other[0])  # (the check below can tell them apart)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.view(torch.int32), w.view(torch.int32))
    with pytest.raises(ValueError, match="all_reduce_algorithm"):
        comms[0].all_reduce_algorithm = "three_shot"
    with pytest.raises(ValueError, match="graphs: 'sometimes'"):
        comms[0].graphs = "sometimes"
    with fake_gpu_communicator(2) as (comm, _, _, _):
        comm.all_reduce(xs[0])
        comm.graphs = "never"
        assert not comm._plans


def test_a_kept_recv_plan_takes_int_sizes_only():
    """A shape of floats (or bools) equal to a kept recv's ints hashed as them and took its
    plan; the checks refuse it, as they do on a first call."""
    x = torch.randn(4, 64)
    comms = _communicators(2)

    def run(rank):
        if rank == 0:
            comms[0].send(x, 1, codec="nvfp4")
            return None
        comms[1].recv((4, 64), x.dtype, 0, codec="nvfp4")
        for shape in ((4.0, 64), (True, 64)):
            with pytest.raises(TypeError, match="recv: shape: .* not an int"):
                comms[1].recv(shape, x.dtype, 0, codec="nvfp4")
        return None

    _on_threads(2, run)


def test_an_empty_error_feedback_name_is_refused():
    with fake_gpu_communicator(2) as (comm, _, _, _):
        with pytest.raises(ValueError, match="error_feedback: '' names no buffer"):
            comm.all_reduce(torch.randn(4, 32), error_feedback="")
        assert not comm._plans


# ---------------------------------------------------------------------- bytes that move


def _communicators(world, op=None):
    """Communicators over the threaded stand-in (``op`` "all_reduce_one_shot": their
    all-reduce is the one-shot one)."""
    algorithm = "one_shot" if op == "all_reduce_one_shot" else "two_shot"
    return [Communicator(t, control_group=None, validate="never", all_reduce_algorithm=algorithm)
            for t in _transports(world)]  # fmt: skip


CALLS = {
    "all_reduce": lambda comm, x, codec: comm.all_reduce(x, codec=codec),
    "all_reduce_one_shot": lambda comm, x, codec: comm.all_reduce(x, codec=codec),
    "reduce_scatter": lambda comm, x, codec: comm.reduce_scatter(x, codec=codec),
    "all_gather": lambda comm, x, codec: comm.all_gather(x, codec=codec),
}


@pytest.mark.parametrize("codec", ["nvfp4", "mxfp4", FP4QUANT, "none", "none-float32"])
@pytest.mark.parametrize("op", sorted(CALLS))
def test_results_survive_the_next_call_of_their_kind(op, codec):
    world = 2
    first, second = _inputs(world, (4, 64), seed=3), _inputs(world, (4, 64), seed=4)
    comms = _communicators(world, op)
    call = CALLS[op]

    def run(rank):
        y1 = call(comms[rank], first[rank], codec)
        kept = y1.clone()
        y2 = call(comms[rank], second[rank], codec)
        return y1, kept, y2

    results = _on_threads(world, run)
    # ranks whose call is the first of its kind (its plan made anew)
    anew = _communicators(world, op)
    fresh = _on_threads(world, lambda r: call(anew[r], second[r], codec))
    for (y1, kept, y2), y2_fresh in zip(results, fresh, strict=True):
        assert torch.equal(y1.view(torch.int32), kept.view(torch.int32))
        assert torch.equal(y2.view(torch.int32), y2_fresh.view(torch.int32))


@pytest.mark.parametrize("codec", ["none-float32", "nvfp4"])
@pytest.mark.parametrize("shape", [(4, 64), (3, 5)])
def test_results_start_where_their_storage_starts(codec, shape):
    # A "none-float32" result of float32 input is a view of the receive buffer; DDP's reducer
    # views a comm hook's result with absolute storage offsets, so it must start at offset 0
    # (also where the input needs padding, and the buffer holds a padded copy of it too).
    xs = _inputs(2, shape, seed=6)
    comms = _communicators(2)

    def run(rank):
        comm = comms[rank]
        results = [comm.all_reduce(xs[rank], codec=codec)]
        results.append(comm.reduce_scatter(xs[rank], codec=codec))
        results.append(comm.all_gather(xs[rank], codec=codec))
        return [y.storage_offset() for y in results]

    for offsets in _on_threads(2, run):
        assert offsets == [0, 0, 0]


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "all_gather", "send", "recv"])
@pytest.mark.parametrize("codec", ["none", "nvfp4"])
def test_every_buffer_of_a_plan_starts_on_a_section_boundary(op, codec):
    # receive sections are viewed as float32 (NVFP4's 1/S, "none-float32" values) and keyed
    # by fp4_kernels' plans on their alignment; a bfloat16 staging copy of 3 x 5 elements
    # (30 bytes) must not push what follows it off the boundary
    transport = types.SimpleNamespace(world_size=2, rank=0, device=torch.device("cpu"))
    opts = collectives.Options(get_codec(codec))
    extra = (None,) if op == "all_gather" else ()
    plan = collectives.PLANS[op](transport, opts, (3, 5), torch.bfloat16, *extra)
    starts = []
    for part in plan._parts:
        starts += [part[1]] if part[0] == "stage" else [o for o, _ in part[1]]
    assert all(o % collectives.SECTION_ALIGN_BYTES == 0 for o in starts)


def test_messages_survive_the_next_send():
    x1, x2 = _inputs(2, (3, 40), seed=5)
    comms = _communicators(2)

    def run(rank):
        if rank == 0:
            comms[0].send(x1, 1, codec="nvfp4")
            comms[0].send(x2, 1, codec="nvfp4")
            return None
        y1 = comms[1].recv(x1.shape, x1.dtype, 0, codec="nvfp4")
        kept = y1.clone()
        y2 = comms[1].recv(x1.shape, x1.dtype, 0, codec="nvfp4")
        return y1, kept, y2

    y1, kept, y2 = _on_threads(2, run)[1]
    assert torch.equal(y1, kept)
    codec = get_codec("nvfp4")
    for x, y in ((x1, y1), (x2, y2)):
        payload = torch.nn.functional.pad(x.reshape(1, -1), (0, 8))
        sections = codec.encode(payload, seed=collectives.rank_seed(0, 0, "send"))
        assert torch.equal(y, codec.decode(sections, 128)[0, :120].reshape(3, 40))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("world", "shape"), [(2, (6, 32)), (4, (7, 33)), (4, (8, 16))])
def test_reduce_scatter_rounds_the_float32_sum_once(world, shape, dtype):
    xs = _inputs(world, shape, seed=world + shape[0], dtype=dtype)
    comms = _communicators(world)
    got = _on_threads(world, lambda r: comms[r].reduce_scatter(
        xs[r], codec="nvfp4", rounding="stochastic", seed=2, step=7))  # fmt: skip
    ref = reference_reduce_scatter(xs, "nvfp4", "stochastic", 2, 7)
    for j in range(world):
        assert got[j].dtype == dtype and got[j].shape == ref[j][0].shape
        assert torch.equal(got[j].view(torch.int16), ref[j][0].view(torch.int16))


def _p2p_calls(fn):
    """Python functions of fp4_comm/p2p.py that one ``fn()`` calls, by name."""
    import sys

    names = {}

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.endswith("fp4_comm/p2p.py"):
            names[frame.f_code.co_name] = names.get(frame.f_code.co_name, 0) + 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return names


@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot"])
@pytest.mark.parametrize("world", [2, 4])
def test_a_warm_p2p_call_launches_its_packed_plan_with_the_calls_addresses(world, algorithm):
    # the p2p kernel's parameters are packed once per kind of launch: a warm call writes its
    # sections' addresses into them and launches, three Python functions of the transport a
    # launch (the operation, _move, the plan key's comprehension)
    from fp4_comm import _p2p_kernels as K

    with fake_gpu_communicator(world, transport="p2p", all_reduce_algorithm=algorithm) as (
        comm, launcher, _, _,
    ):  # fmt: skip
        t = comm.transport
        x = torch.randn(world * 64, 32)
        comm.all_reduce(x, codec="nvfp4")
        launcher.calls.clear()
        names = _p2p_calls(lambda: comm.all_reduce(x, codec="nvfp4"))
        ops = [K.OP_ALL_GATHER] if algorithm == "one_shot" else [K.OP_ALL_TO_ALL, K.OP_ALL_GATHER]
        assert len(launcher.calls) == len(ops)
        first = K.PARAMS.index("send0")
        for (grid, params), op in zip(launcher.calls, ops, strict=True):
            values = dict(zip(K.PARAMS, params, strict=True))
            assert tuple(params[: len(t._fixed)]) == t._fixed
            assert values["op"] == op and values["only_peer"] == -1
            assert values["timeout_ns"] == t._timeout_ns and grid == world * values["lanes"]
            sections = params[first:]
            used = [sections[i : i + 3] for i in range(0, len(sections), 3) if sections[i + 2]]
            assert len(used) == 3  # NVFP4: codes, block scales, the tensor scale
            assert all(s and r for s, r, _ in used)  # this call's addresses
        transport = {"all_to_all", "all_gather"}
        assert sum(n for k, n in names.items() if k in transport) == len(ops)
        assert names.get("_move") == len(ops) and names.get("<listcomp>") == len(ops)
        assert sum(names.values()) == 3 * len(ops), names
