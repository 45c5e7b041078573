"""The NCCL path (CuPy), on real GPUs: marked ``gpu``, skipped with the reason elsewhere.

One GPU (world size 1, in this process): the CUDA data path against the gloo/CPU path, bit for
bit (fp4_kernels' kernels equal its CPU path bit for bit, and the reductions are plain float32
adds), CuPy arrays on a CuPy stream, CUDA-graph capture and replay.  Several ranks
(``FP4_COMM_TEST_RANKS``, default 2, worker processes, rank r on GPU r % (GPU count)): every
collective against the gloo run of the same inputs, bit for bit, identical bits on every rank,
argument mismatches, and a missing rank ending in CommTimeoutError through ``synchronize``.
More ranks than GPUs share them: NCCL >= 2.30 with ``NCCL_MULTI_RANK_GPU_ENABLE=1``
(``nox -s gpu_multirank`` sets it).
"""

import contextlib
import datetime
import time
import warnings

import numpy as np
import pytest
import torch

import fp4_comm
import fp4_kernels

pytestmark = pytest.mark.gpu


CODECS = ["nvfp4", "mxfp4", "none", "none-float32", fp4_kernels.FP4Quant(64)]


@pytest.fixture(scope="module")
def single():
    """World size 1 in this process: an NCCL communicator on GPU 0 and a gloo one."""
    import torch.distributed as dist
    from fp4_comm_cluster import skip_unless_ranks_fit

    skip_unless_ranks_fit(1)

    if not dist.is_initialized():
        dist.init_process_group(
            "gloo", store=dist.HashStore(), rank=0, world_size=1,
            timeout=datetime.timedelta(seconds=60),
        )  # fmt: skip
    torch.cuda.set_device(0)
    gpu = fp4_comm.Communicator.from_process_group(None, "cuda:0")
    cpu = fp4_comm.Communicator.from_process_group(None, "cpu")
    yield gpu, cpu
    gpu.close()


def _x(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 10.0 ** torch.randint(-3, 4, shape, generator=g)).to(
        dtype
    )


def _bits(t):
    return t.detach().cpu().contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _same_bits(a, b):
    """Bit for bit, NaN payloads aside: NaN in the same places (a GPU's arithmetic returns the
    canonical NaN 0x7FFFFFFF where the CPU keeps 0x7FC00000), every other bit equal."""
    a, b = a.detach().cpu(), b.detach().cpu()
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(_bits(a)[~nan], _bits(b)[~nan])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("codec", CODECS, ids=str)
def test_single_gpu_equals_cpu_path(single, codec, rounding, dtype):
    gpu, cpu = single
    x = _x((37, 64), dtype)
    for op in ("all_reduce", "reduce_scatter", "all_gather"):
        y_gpu = getattr(gpu, op)(x.cuda(), codec=codec, rounding=rounding, seed=3, step=5)
        y_cpu = getattr(cpu, op)(x, codec=codec, rounding=rounding, seed=3, step=5)
        assert y_gpu.is_cuda and y_gpu.dtype == dtype and y_gpu.shape == y_cpu.shape
        assert torch.equal(_bits(y_gpu), _bits(y_cpu)), op


def test_single_gpu_error_feedback_and_stats(single):
    gpu, cpu = single
    x = _x((8, 256))
    for _ in range(3):
        y_gpu, s_gpu = gpu.all_reduce(x.cuda(), error_feedback="w", stats=True)
        y_cpu, s_cpu = cpu.all_reduce(x, error_feedback="w", stats=True)
        assert torch.equal(_bits(y_gpu), _bits(y_cpu))
    for hop in s_cpu:
        assert s_gpu[hop].as_floats() == pytest.approx(s_cpu[hop].as_floats(), rel=1e-12)


def test_single_gpu_cupy_arrays_on_a_cupy_stream(single):
    cupy = pytest.importorskip("cupy")
    gpu, cpu = single
    x = _x((16, 64))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        xc = cupy.asarray(x.numpy())
        yc = gpu.all_reduce(xc, codec="nvfp4")
        assert isinstance(yc, cupy.ndarray)
    stream.synchronize()
    y_cpu = cpu.all_reduce(x, codec="nvfp4")
    assert np.array_equal(cupy.asnumpy(yc).view(np.int32), y_cpu.numpy().view(np.int32))


def test_single_gpu_cuda_graph_capture(single):
    gpu, cpu = single
    x = _x((64, 128)).cuda()
    ref = gpu.all_reduce(x, codec="nvfp4", step=0)  # warm-up: kernels compiled, tables made
    torch.cuda.synchronize()
    old = gpu.validate
    gpu.validate = "never"
    try:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            y = gpu.all_reduce(x, codec="nvfp4", step=0)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(_bits(y), _bits(ref))
        x.mul_(2)  # replays read the captured input buffer
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(_bits(y), _bits(cpu.all_reduce(x.cpu(), codec="nvfp4", step=0)))
    finally:
        gpu.validate = old


@pytest.mark.parametrize("codec", ["nvfp4", "mxfp4", fp4_kernels.FP4Quant(64)], ids=str)
def test_single_gpu_kept_buffers_on_two_streams_and_a_graph(single, codec):
    # A plan keeps its receive buffers per stream, and a captured call has its own: calls of
    # one kind queued on two streams and a graph replayed among them, never waited for in
    # between, all give what the CPU path gives.
    gpu, cpu = single
    xs = [_x((1024, 1024), seed=s) for s in range(3)]
    xg = xs[2].cuda()
    gpu.all_reduce(xg, codec=codec, step=0)  # warm-up of the kind (plan made, checked)
    torch.cuda.synchronize()
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    old = gpu.validate
    gpu.validate = "never"
    try:
        with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
            yg = gpu.all_reduce(xg, codec=codec, step=0)
    finally:
        gpu.validate = old
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    inputs = [xs[0].cuda(), xs[1].cuda()]
    outs = [[], []]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    for _ in range(4):
        for i, s in enumerate(streams):
            with torch.cuda.stream(s):
                outs[i].append(gpu.all_reduce(inputs[i], codec=codec, step=0))
        graph.replay()
    torch.cuda.synchronize()
    for i in range(2):
        ref = cpu.all_reduce(xs[i], codec=codec, step=0)
        assert all(torch.equal(_bits(y), _bits(ref)) for y in outs[i])
    assert torch.equal(_bits(yg), _bits(cpu.all_reduce(xs[2], codec=codec, step=0)))


def test_single_gpu_wrong_device_is_an_error(single):
    gpu, _ = single
    with pytest.raises(ValueError, match="on cpu"):
        gpu.all_reduce(torch.ones(4, 32))


# ---------------------------------------------------------------- two or more GPUs


@pytest.fixture(scope="module")
def multi():
    from fp4_comm_cluster import Cluster, env_ranks, skip_unless_ranks_fit

    world = env_ranks()
    skip_unless_ranks_fit(world)

    c = Cluster(world, timeout_s=30.0, gpu=True)
    yield c
    c.close()


def _run_equal_paths(comms, codec, rounding, dtype, shape):
    gpu, cpu = comms["cuda"], comms[max(k for k in comms if isinstance(k, int))]
    r = gpu.rank
    x = _x(shape, dtype, seed=r)
    out = []
    for op in ("all_reduce", "reduce_scatter", "all_gather"):
        y_gpu = getattr(gpu, op)(x.cuda(), codec=codec, rounding=rounding, seed=1, step=2)
        y_cpu = getattr(cpu, op)(x, codec=codec, rounding=rounding, seed=1, step=2)
        out.append((_bits(y_gpu).numpy(), _bits(y_cpu).numpy()))
    return out


@pytest.mark.parametrize("extra_rows", [0, 1], ids=["even", "uneven"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("codec", CODECS, ids=str)
def test_multi_gpu_equals_gloo(multi, codec, dtype, extra_rows):
    # 13 rows per rank: padding in every collective; one more row: reduce_scatter's shards
    # differ (ceil(rows / W) on the first ranks, fewer on the last)
    shape = (multi.world * 13 + extra_rows, 96)
    res = multi.run(_run_equal_paths, codec, "stochastic", dtype, shape)
    for per_rank in res:
        for y_gpu, y_cpu in per_rank:
            assert np.array_equal(y_gpu, y_cpu)
    for i in (0, 2):  # all_reduce and all_gather: the same bits on every rank
        for per_rank in res[1:]:
            assert np.array_equal(per_rank[i][0], res[0][i][0])


def _run_send_recv(comms):
    gpu = comms["cuda"]
    x = _x((5, 40), seed=7).cuda()
    if gpu.rank == 0:
        gpu.send(x, dst=1, codec="nvfp4", step=0)
        gpu.synchronize()
        return None
    if gpu.rank == 1:
        y = gpu.recv(x.shape, x.dtype, src=0, codec="nvfp4")
        gpu.synchronize()
        return _bits(y).numpy()
    return None


def test_multi_gpu_send_recv(multi):
    got = multi.run(_run_send_recv)[1]
    x = _x((5, 40), seed=7)
    ref = fp4_kernels.quantize_dequantize(
        torch.nn.functional.pad(x.reshape(1, -1), (0, 8)),
        fmt="nvfp4",
        seed=fp4_comm.collectives.rank_seed(0, 0, "send"),
    )[0, :200].reshape(5, 40)
    assert np.array_equal(got, _bits(ref).numpy())


def _run_mismatch(comms):
    gpu = comms["cuda"]
    shape = (4, 64) if gpu.rank else (4, 32)
    try:
        gpu.all_reduce(torch.ones(shape, device="cuda"))
    except ValueError as err:
        return str(err)
    return None


def test_multi_gpu_mismatch_is_an_error_not_a_hang(multi):
    for message in multi.run(_run_mismatch):
        assert message and "ranks disagree" in message


def _run_ddp(comms):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fp4_comm import ddp

    gpu = comms["cuda"]
    dev = gpu.device
    torch.manual_seed(0)
    model = torch.nn.Linear(40, 9).to(dev)  # 369 parameters: padding in the bucket
    wrapped = DDP(model, device_ids=[dev.index])  # over the gloo default group
    ddp.register(wrapped, gpu, codec="none-float32", error_feedback=False)
    g = torch.Generator().manual_seed(7 + gpu.rank)
    x = torch.randn(6, 40, generator=g).to(dev)
    wrapped(x).square().sum().backward()
    torch.manual_seed(0)
    local = torch.nn.Linear(40, 9).to(dev)
    local(x).square().sum().backward()
    flat = lambda m: torch.cat([p.grad.reshape(-1) for p in m.parameters()]).cpu().numpy()  # noqa: E731
    return flat(model), flat(local)


def test_multi_gpu_ddp_hook_averages(multi):
    out = multi.run(_run_ddp)
    mean = sum(o[1] for o in out)  # rank order, float32, as the all-reduce adds
    mean = mean / np.float32(multi.world)
    for got, _ in out:
        assert np.array_equal(got, out[0][0])
    if multi.world == 2:  # (a + b) / 2 in float32 is what both compute; beyond 2 the order
        assert np.array_equal(out[0][0], mean)  # of numpy's sum is not guaranteed


def _run_missing_rank(comms):
    gpu = comms["cuda"]
    if gpu.rank != 0:
        return "absent"
    try:  # the communicator was aborted by the watchdog in the test before
        gpu.synchronize(timeout_s=5.0)
    except fp4_comm.CommTimeoutError as err:
        return str(err)
    return None


def _run_missing_rank_watchdog(comms, timeout_s):
    gpu = comms["cuda"]
    if gpu.rank != 0:
        return "absent"
    gpu.validate = "never"
    gpu.transport.timeout_s = timeout_s
    start = time.monotonic()
    try:
        gpu.all_reduce(torch.ones(1 << 20, device=gpu.device), codec="mxfp4")
        # No synchronize(timeout_s): only the watchdog can end the wait.  Where the host itself
        # waits inside the all-reduce (a kernel module load or an allocation that waits for the
        # stuck GPU), the abort ends that wait and the all-reduce raises.
        torch.cuda.synchronize()
        gpu.all_reduce(torch.ones(8, 32, device=gpu.device), codec="mxfp4")
    except fp4_comm.CommTimeoutError as err:
        return (time.monotonic() - start, str(err))
    return (time.monotonic() - start, None)


def test_multi_gpu_watchdog_ends_a_hang_last(multi):
    # Last but one: the NCCL communicator is aborted afterwards, and the next test expects it.
    waited, message = multi.run(_run_missing_rank_watchdog, 5.0, timeout_s=120)[0]
    assert message and "aborted" in message
    assert waited < 5.0 + 30  # the watchdog's timeout plus its polling and the abort


def test_multi_gpu_missing_rank_times_out_last(multi):
    # After the watchdog aborted the communicator, synchronize says so instead of waiting.
    message = multi.run(_run_missing_rank, timeout_s=120)[0]
    assert message and "aborted" in message


def _replays_match_the_cpu_path(single, codec, name, refill=None):
    """all_reduce of a (16, 256) input with error feedback ``name``, captured on the GPU and
    replayed three times, each replay against the CPU path's call on the same input (after
    ``refill(x, k)`` where given; a non-finite input warns there): residual updates, the
    warm-up call's one (the capture itself runs nothing) and one a replay, are mirrored call
    for call, so every replay has the CPU path's bits.  The last replay's result."""
    gpu, cpu = single
    x = _x((16, 256)).cuda()
    kw = {"codec": codec, "step": 1, "error_feedback": name}
    captured = gpu.capture("all_reduce", x, **kw)
    cpu.all_reduce(x.cpu(), **kw)
    for k in range(3):
        if refill is not None:
            refill(x, k)
        y = captured.replay()
        with _no_warning() if torch.isfinite(x).all() else pytest.warns(RuntimeWarning):
            ref = cpu.all_reduce(x.cpu(), **kw)
        torch.cuda.synchronize()
        assert _same_bits(y, ref), k
    return y


def test_single_gpu_capture_with_error_feedback(single):
    _replays_match_the_cpu_path(single, "nvfp4", "cap")


@pytest.mark.parametrize("codec", CODECS, ids=str)
def test_single_gpu_error_feedback_resets_non_finite_blocks_as_the_cpu_path(single, codec):
    # The reset runs on the GPU without a host synchronization; it must give the CPU path's
    # bits, count the same blocks, and leave the later calls finite.
    gpu, cpu = single
    name = f"nonfinite-{codec}"
    for step in range(4):
        x = _x((8, 256), seed=step)
        if step == 1:
            x[3, 17] = float("inf")
            x[5, 200] = float("nan")
        y_gpu = gpu.all_reduce(x.cuda(), codec=codec, error_feedback=name)
        with pytest.warns(RuntimeWarning) if step == 1 else _no_warning():
            y_cpu = cpu.all_reduce(x, codec=codec, error_feedback=name)
        assert _same_bits(y_gpu, y_cpu), step
        assert torch.isfinite(y_gpu).all().item() == (step != 1)
    assert gpu.error_feedback.nonfinite_blocks(name) == cpu.error_feedback.nonfinite_blocks(name)
    assert gpu.error_feedback.nonfinite_blocks(name) > 0
    for hop in ("worker", "server"):
        assert torch.isfinite(gpu.error_feedback.residual(name, hop)).all()


def test_single_gpu_capture_resets_non_finite_blocks(single):
    gpu, cpu = single

    def refill(x, k):
        x.copy_(_x((16, 256), seed=k + 1))
        if k == 1:
            x[0, 0] = float("inf")

    y = _replays_match_the_cpu_path(single, "mxfp4", "cap-nan", refill)
    assert torch.isfinite(y).all()
    counts = gpu.error_feedback.nonfinite_blocks("cap-nan")
    assert counts == cpu.error_feedback.nonfinite_blocks("cap-nan") > 0


@contextlib.contextmanager
def _no_warning():
    """No RuntimeWarning (the error feedback's non-finite notice) inside."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        yield
    notices = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert not notices, notices
