"""fp4_comm._tahquant_kernels: TAH-Quant's fused kernels give the bytes and the decoded values
of tahquant.py's torch operations (the CPU path) and of the plain-numpy oracle, bit for bit.

Three tiers: in numba's CUDA simulator (small shapes; where the process does not run the
simulator, one test runs them in a child process that does), compiled to PTX by the real NVVM
(no FMA, no float64, no flush to zero, IEEE division), and on a GPU (``gpu``: realistic shapes
against the CPU path)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings

import _tahquant_oracle as oracle
import numpy as np
import pytest
import torch
from numba import config

from fp4_comm import tahquant
from fp4_comm.tahquant import TAHQuantCodec, TAHQuantGradCodec
from fp4_kernels.testing import install_simulator_warp_intrinsics

install_simulator_warp_intrinsics()  # the entropy kernel's shuffles, in the simulator

NAN, INF = float("nan"), float("inf")
TILE = tahquant.TILE_SIZE
SIMULATOR = bool(config.ENABLE_CUDASIM)
in_simulator = pytest.mark.skipif(not SIMULATOR, reason="runs under NUMBA_ENABLE_CUDASIM=1")
# The simulator runs the kernels' arithmetic on numpy scalars, which warn where the GPU silently
# gives NaN or Inf (0 / 0 in a zero token, a NaN scale): expected.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _same_floats(a, b):
    """Equal bit for bit, NaN anywhere matching NaN (its payload aside: a GPU's arithmetic gives
    the canonical NaN, a CPU's keeps the payload)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    nan = np.isnan(a)
    assert np.array_equal(nan, np.isnan(b))
    diff = np.flatnonzero(a[~nan].view(np.uint32) != b[~nan].view(np.uint32))
    assert diff.size == 0, f"{diff.size} values differ, first at {diff[:5]}"


def _edge_activations(rng, chunks, tokens, C):
    """Gaussian tokens at scales 2^-6..2^6 plus every case the codec treats apart (as many as
    the shape holds): a zero token, a repeated token, NaN, +-Inf, a constant tile, a tile whose
    maximum occurs twice, one beyond fp16 (the zero overflows), an outlier tile (transformed),
    a transformed tile beyond fp16, subnormal values, signed zeros."""
    x = rng.standard_normal((chunks, tokens, C)) * np.exp2(rng.integers(-6, 7, (chunks, tokens, 1)))
    t = x.reshape(chunks, tokens, C // TILE, TILE)
    last = tokens - 1
    t[:, last, 0, 7] *= 100.0  # an outlier: transformed
    if tokens >= 2:
        x[:, 1] = 0.0  # a zero token (entropy 0)
    if tokens >= 3:
        t[0, 0, 0, 3] = NAN
        t[-1, 0, -1, 0] = INF
        t[0, 2, -1, 5] = -INF
        t[-1, 2, 0, :] = 0.25  # constant: scale 0
    if tokens >= 4:
        t[:, 3, 0, 10] = 40.0
        t[:, 3, 0, 20] = -40.0  # the maximum twice: no transform (top1 = top2)
        t[-1, 3, -1, :] = 70000.0  # constant beyond fp16
        t[0, 3, -1, :] = np.linspace(-60000, 60000, TILE)  # the values fit, spread / 15 too
    if tokens >= 5:
        t[:, 4, 0, :] = 0.0
        t[:, 4, 0, 9] = 3.0  # one element: transformed, low entropy
        t[0, 4, -1, 1] = 3e38  # transformed, beyond fp16
        t[-1, 4, -1, :] = rng.standard_normal(TILE) * 2.0**-140  # subnormal float32
    if tokens >= 6:
        x[:, 5] = x[:, 4]  # a tie in the ranking
        t[:, 5, -1, :] = -0.0
        t[:, 5, -1, ::3] = 0.0  # signed zeros only (transformed: top1 = 0 >= 2 * 0)
    if tokens >= 7:
        t[:, 6] = np.abs(t[:, 6]) + 1.0
        t[:, 6, :, 4::9] = -0.0
        t[:, 6, :, 7::9] = 0.0  # the minimum a zero of either sign
        t[:, 6, 0, 0] = -0.0
        t[:, 6, -1, 0] = 0.0  # first -0, first +0
    return x.reshape(chunks, tokens * C).astype(np.float32)


def _n_low(n, C):
    return tahquant.low_token_count(n // C)


def _check_activations(x, C, dtype=torch.float32):
    """The kernels' section and decode against the torch CPU path and the oracle."""
    from fp4_comm import _tahquant_kernels as K

    codec = TAHQuantCodec(C)
    xt = torch.from_numpy(x).to(dtype)
    n = x.shape[1]
    (ref,) = codec.encode(xt)
    got = K.encode(xt, C, _n_low(n, C), codec.layout(n), tahquant.low_precision_tokens)
    bad = (got != ref).nonzero()
    assert bad.numel() == 0, f"bytes differ at {bad[:8].tolist()} of layout {codec.layout(n)}"
    fields = oracle.encode_fields(xt.float().numpy(), C)
    assert np.array_equal(got.numpy(), oracle.pack(fields))
    y = K.decode(got, n, C, _n_low(n, C), codec.layout(n), tahquant._unpack_bits)
    _same_floats(y.numpy(), codec._decode_float32(ref, n).numpy())
    _same_floats(y.numpy(), oracle.decode_fields(fields, C))
    return fields


def _check_grad(x, dtype=torch.float32):
    from fp4_comm import _tahquant_kernels as K

    codec = TAHQuantGradCodec()
    xt = torch.from_numpy(x).to(dtype)
    n = x.shape[1]
    (ref,) = codec.encode(xt)
    got = K.grad_encode_section(xt, codec.section_nbytes(n)[0])
    assert torch.equal(got, ref)
    assert np.array_equal(got.numpy(), oracle.grad_encode(xt.float().numpy()))
    y = K.grad_decode_section(got, n)
    _same_floats(y.numpy(), codec._decode_float32(ref, n).numpy())
    _same_floats(y.numpy(), oracle.grad_decode(got.numpy(), n))


# ---------------------------------------------------------------------- simulator


@in_simulator
def test_activation_kernels_equal_torch_and_oracle_on_every_edge_case():
    # two chunks of 7 tokens: one 3-bit token each (7 * 20 // 100), every edge case
    fields = _check_activations(_edge_activations(np.random.default_rng(3), 2, 7, 128), 128)
    assert sum(fields[0]["low"]) == 1
    assert any(fields[0]["transform"]) and not all(fields[0]["transform"])


@in_simulator
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_activation_kernels_take_16_bit_inputs(dtype):
    x = _edge_activations(np.random.default_rng(5), 1, 5, 64)
    x = np.nan_to_num(x, nan=NAN, posinf=6e4, neginf=-6e4)  # within fp16 where it matters
    _check_activations(x, 64, dtype)


@in_simulator
def test_activation_kernels_with_no_3_bit_token_and_several_3_bit_tokens():
    _check_activations(_edge_activations(np.random.default_rng(6), 2, 3, 64), 64)  # n_low 0
    fields = _check_activations(_edge_activations(np.random.default_rng(8), 1, 11, 64), 64)
    assert sum(fields[0]["low"]) == 2  # 3-bit tokens packed back to back


@in_simulator
def test_entropy_of_tokens_beyond_the_shared_stage():
    # 8128 channels: zero-padded to 8192, 64 elements a thread whose halving stages (of strides
    # 4096 .. 128) the thread adds itself; the padding in the last threads' elements
    from fp4_comm import _tahquant_kernels as K

    C, T = 8128, 4
    x = np.random.default_rng(13).standard_normal((1, T * C)).astype(np.float32)
    assert K.entropy_geometry(1 << (C - 1).bit_length()) == (K.ENTROPY_THREADS, 64)
    got = K.entropies(torch.from_numpy(x), C)
    want = tahquant.token_entropy(torch.from_numpy(x).reshape(1, T, C))
    _same_floats(got.numpy(), want.numpy())
    for t in range(T):
        assert got[0, t].item() == oracle.entropy(x[0, t * C : (t + 1) * C])


@in_simulator
@pytest.mark.parametrize("C", [1, 5, 16, 32, 40, 64, 100, 128, 200, 768])
def test_entropy_of_every_block_geometry(C):
    # a block of 32 threads holding one element each (C <= 32: lanes beyond the padded token
    # hold zeros), of 64 (C <= 64), of 128 with 1, 2 or 8 elements a thread; zero, repeated,
    # non-finite and subnormal tokens among Gaussian ones
    from fp4_comm import _tahquant_kernels as K

    T = 6
    rng = np.random.default_rng(C)
    x = (rng.standard_normal((T, C)) * np.exp2(rng.integers(-6, 7, (T, 1)))).astype(np.float32)
    x[1] = 0.0
    x[2] = x[0]
    x[3, 0] = NAN if C % 2 else INF
    x[4] *= np.float32(2.0**-130)
    got = K.entropies(torch.from_numpy(x.reshape(1, T * C)), C)
    want = tahquant.token_entropy(torch.from_numpy(x).reshape(1, T, C))
    _same_floats(got.numpy(), want.numpy())
    for t in range(T):
        w = oracle.entropy(x[t])
        assert got[0, t].item() == w or (np.isnan(w) and np.isnan(got[0, t].item()))


@in_simulator
def test_decode_kernel_equals_torch_on_arbitrary_bytes():
    # any section decodes as the torch path decodes it: random codes, maps, pivots on tiles
    # without the transform, fp16 zeros and scales of every kind (NaN, Inf, subnormal)
    from fp4_comm import _tahquant_kernels as K

    C, T, R = 128, 6, 2
    codec = TAHQuantCodec(C)
    n = T * C
    lay = codec.layout(n)
    rng = np.random.default_rng(9)
    raw = rng.integers(0, 256, (R, lay["pivots"][1]), dtype=np.uint8)
    raw = torch.from_numpy(raw)
    got = K.decode(raw, n, C, _n_low(n, C), lay, tahquant._unpack_bits)
    _same_floats(got.numpy(), codec._decode_float32(raw, n).numpy())


@in_simulator
def test_grad_kernels_equal_torch_and_oracle():
    rng = np.random.default_rng(10)
    x = (rng.standard_normal((2, 192)) * np.exp2(rng.integers(-30, 10, (2, 192)))).astype(
        np.float32
    )
    x[0, :32] = 0.0  # a zero tile
    x[1, 32:64] = 1e-9  # below fp16's smallest scale: flushed to zero
    x[0, 64] = NAN
    x[1, 70] = 7e4  # beyond fp16: NaN
    x[0, 100] = -INF
    x[1, 96:128] = 0.0
    x[1, 100] = 65504.0  # fp16's largest: finite
    x[0, 128:160] = np.float32(0.75)  # ties of the codes: 0.75 / 0.75 * 32 = 32 -> 31
    x[0, 140] = -0.75
    x[0, 141] = 0.75 / 64  # x / s * 32 = 0.5: ties to even, 0
    _check_grad(x)
    _check_grad(np.nan_to_num(x, nan=NAN, posinf=6e4, neginf=-6e4), torch.bfloat16)


@in_simulator
def test_grad_decode_kernel_equals_torch_on_arbitrary_bytes():
    from fp4_comm import _tahquant_kernels as K

    codec = TAHQuantGradCodec()
    n = 128
    raw = torch.from_numpy(
        np.random.default_rng(12).integers(0, 256, (2, codec.section_nbytes(n)[0]), np.uint8)
    )
    _same_floats(K.grad_decode_section(raw, n).numpy(), codec._decode_float32(raw, n).numpy())


@pytest.mark.skipif(SIMULATOR, reason="this process runs the simulator tests itself")
def test_simulator_tier_in_a_child_process():
    """numba reads NUMBA_ENABLE_CUDASIM once, at import: the simulator tests of this file run
    in a child process that sets it (CI runs fp4_comm's tests without the simulator)."""
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    here = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-x",
         "-m", "not gpu and not compile_check", os.path.abspath(__file__)],
        cwd=here, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    passed = re.search(r"\b(\d+) passed\b", done.stdout)
    assert passed and int(passed.group(1)) >= 8, done.stdout[-2000:]


# ---------------------------------------------------------------------- compile check


@pytest.fixture(scope="module")
def kernels_ptx():
    from numba import types

    from fp4_comm import _tahquant_kernels as K
    from fp4_kernels.testing import compile_ptx

    u8, f32, i32 = (types.Array(t, 2, "C") for t in (types.uint8, types.float32, types.int32))
    flat = types.Array(types.float32, 1, "C")
    i64 = types.int64
    signatures = {
        K.entropy_kernel(1024): (f32, i64, i64, flat),  # tokens of 513 to 1024 channels
        K.encode_tiles: (flat, i32, i32, i64, i64, i64, i64, i64, u8, i32, i32),
        K.encode_maps: (i32, i32, i32, i64, i64, i64, i64, i64, i64, u8),
        K.decode_tiles: (u8, i32, i64, i64, i64, i64, i64, i64, i64, i64, flat),
        K.grad_encode: (flat, i64, u8),
        K.grad_decode: (u8, i64, flat),
    }
    return {k.py_func.__name__: compile_ptx(k, sig) for k, sig in signatures.items()}


@pytest.mark.compile_check
@pytest.mark.skipif(SIMULATOR, reason="compile check needs the real NVVM, not the simulator")
def test_kernels_round_every_operation_as_torch_does(kernels_ptx):
    for name, ptx in kernels_ptx.items():
        # no product contracted with an add (an FMA rounds once where torch rounds twice)
        assert not re.search(r"\bfma\.", ptx), name
        assert not re.search(r"\.ftz\b", ptx), name  # subnormals kept, as torch keeps them
        assert not re.findall(r"^\s*\S*\.f64\b.*$", ptx, re.M), name
        divisions = set(re.findall(r"\bdiv\.\S*f32", ptx))
        assert divisions <= {"div.rn.f32"}, (name, divisions)  # IEEE division only
        assert not re.search(r"\b(ex2|lg2|rcp|sqrt)\.approx", ptx), name
    # the products that precede adds go through mul.rn: entropy (ln, terms), decode, rotation
    assert kernels_ptx["token_entropy"].count("mul.rn.f32") >= 8
    assert "cvt.rni.f32.f32" in kernels_ptx["encode_tiles"]
    assert "cvt.rn.f16.f32" in kernels_ptx["encode_tiles"]
    assert "cvt.rn.f16.f32" in kernels_ptx["grad_encode"]


# ---------------------------------------------------------------------- GPU


def _realistic(rng, chunks, tokens, C):
    """Activations as in training: per-token scales, outlier channels, plus injected NaN,
    Inf, huge values, constant tiles and zero tokens."""
    x = rng.standard_normal((chunks, tokens, C)).astype(np.float32)
    x *= np.exp2(rng.integers(-4, 5, (chunks, tokens, 1)))
    outlier_channels = rng.choice(C, 8, replace=False)
    x[..., outlier_channels] *= 60.0
    flat = x.reshape(-1)
    k = flat.size
    for value, count in ((NAN, 5), (INF, 5), (-INF, 5), (3e38, 5), (7e4, 20), (-1e6, 20)):
        flat[rng.integers(0, k, count)] = value
    x[:, rng.integers(0, tokens, 16)] = 0.0  # zero tokens
    t = x.reshape(chunks, tokens, C // TILE, TILE)
    t[:, 1, 2, :] = 1.5  # constant tiles
    t[:, 2, 3, 5] = t[:, 2, 3, 6] = 1e3  # the maximum twice
    return x.reshape(chunks, tokens * C)


def _need_cuda():
    if SIMULATOR or not torch.cuda.is_available():
        pytest.skip("no CUDA device")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("chunks", "tokens"), [(1, 4096), (4, 1024), (3, 7)])
def test_cuda_kernels_equal_the_cpu_path(dtype, chunks, tokens):
    _need_cuda()
    C = 768
    x = torch.from_numpy(_realistic(np.random.default_rng(tokens + chunks), chunks, tokens, C))
    x = x.to(dtype)
    n = tokens * C
    for codec in (TAHQuantCodec(C), TAHQuantGradCodec()):
        (cpu,) = codec.encode(x)
        (gpu,) = codec.encode(x.cuda())
        assert gpu.is_cuda  # encoded where x lives (a CPU payload would compare equal)
        bad = (gpu.cpu() != cpu).nonzero()
        assert bad.numel() == 0, (codec.name, bad[:8].tolist())
        for out in (torch.float32, dtype):
            _same_floats(codec.decode([gpu], n, out).float().cpu().numpy(),
                         codec.decode([cpu], n, out).float().numpy())  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("C", [1, 5, 32, 40, 64, 100, 768, 8128, 16384])
def test_cuda_entropy_of_every_block_geometry(C):
    # every geometry of the entropy kernel on the GPU against the CPU path: 32 or 64 threads
    # a token, 128 threads with 1 to 128 elements each (16384 channels: beyond the registers)
    _need_cuda()
    from fp4_comm import _tahquant_kernels as K

    T = 37
    rng = np.random.default_rng(C)
    x = (rng.standard_normal((T, C)) * np.exp2(rng.integers(-6, 7, (T, 1)))).astype(np.float32)
    x[1] = 0.0
    x[3, 0] = NAN
    x[4, -1] = INF
    got = K.entropies(torch.from_numpy(x.reshape(1, T * C)).cuda(), C)
    assert got.is_cuda
    want = tahquant.token_entropy(torch.from_numpy(x).reshape(1, T, C))
    _same_floats(got.cpu().numpy(), want.numpy())


@pytest.mark.gpu
def test_small_payloads_launch_without_numba_occupancy_warnings():
    # a 7-token payload: grids of a few blocks, padded to MIN_BLOCKS (numba-cuda warns below)
    _need_cuda()
    from numba.core.errors import NumbaPerformanceWarning

    x = torch.from_numpy(_realistic(np.random.default_rng(5), 1, 7, 768)).cuda()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for codec in (TAHQuantCodec(768), TAHQuantGradCodec()):
            (raw,) = codec.encode(x)
            y = codec.decode([raw], x.shape[1])
            (cpu,) = codec.encode(x.cpu())
            assert torch.equal(raw.cpu(), cpu), codec.name
            _same_floats(y.cpu().numpy(), codec.decode([cpu], x.shape[1]).numpy())
        torch.cuda.synchronize()
    perf = [w for w in caught if issubclass(w.category, NumbaPerformanceWarning)]
    assert not perf, [str(w.message) for w in perf]


@pytest.mark.gpu
def test_cuda_kernels_equal_the_torch_cuda_path():
    # the torch operations on the GPU (the definition run there) give the same bytes
    _need_cuda()
    C = 768
    x = torch.from_numpy(_realistic(np.random.default_rng(1), 2, 2048, C)).cuda()
    for codec in (TAHQuantCodec(C), TAHQuantGradCodec()):
        torch_path = torch.cat(codec._encode_parts(x), dim=1)
        (kernels,) = codec.encode(x)
        assert torch.equal(torch_path, kernels), codec.name
        n = x.shape[1]
        _same_floats(codec._decode_float32(kernels, n).cpu().numpy(),
                     codec.decode([kernels], n).cpu().numpy())  # fmt: skip


@pytest.mark.gpu
def test_cuda_decode_of_arbitrary_bytes_equals_the_cpu_path():
    _need_cuda()
    rng = np.random.default_rng(2)
    for codec, n in ((TAHQuantCodec(768), 300 * 768), (TAHQuantGradCodec(), 300 * 768)):
        raw = torch.from_numpy(rng.integers(0, 256, (3, codec.section_nbytes(n)[0]), np.uint8))
        _same_floats(codec.decode([raw.cuda()], n).cpu().numpy(), codec.decode([raw], n).numpy())


@pytest.mark.gpu
def test_cuda_kernels_run_on_the_current_stream():
    _need_cuda()
    C = 768
    x = torch.from_numpy(_realistic(np.random.default_rng(4), 1, 512, C))
    (cpu,) = TAHQuantCodec(C).encode(x)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        xg = x.cuda(non_blocking=False)
        (gpu,) = TAHQuantCodec(C).encode(xg)
        back = gpu.to("cpu", non_blocking=False)
    side.synchronize()
    assert torch.equal(back, cpu)


# Ranks emulated one thread each launch their first kernels together: numba fills its device
# list on first use, which two threads at once must not do.  A fresh process, so that the list
# is still empty when the threads start.
_THREADS_SCRIPT = r"""
import threading
import numpy as np
import torch
from fp4_comm.tahquant import TAHQuantCodec, TAHQuantGradCodec

x = torch.from_numpy(np.random.default_rng(5).standard_normal((2, 64 * 768), dtype=np.float32))
xg = x.cuda()
torch.cuda.synchronize()
barrier = threading.Barrier(4)
results, errors = {}, []

def rank(i):
    try:
        codec = TAHQuantCodec(768) if i % 2 == 0 else TAHQuantGradCodec()
        barrier.wait()
        (wire,) = codec.encode(xg)
        y = codec.decode([wire], xg.shape[1])
        torch.cuda.synchronize()
        results[i] = (codec, wire.cpu(), y.cpu())
    except BaseException as e:
        errors.append(f"thread {i}: {e!r}")

threads = [threading.Thread(target=rank, args=(i,)) for i in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert not errors, errors
for i, (codec, wire, y) in sorted(results.items()):
    (cpu,) = codec.encode(x)
    assert torch.equal(wire, cpu), (i, codec.name)
    assert torch.equal(y, codec.decode([cpu], x.shape[1])), (i, codec.name)
print("threads ok", len(results))
"""


@pytest.mark.gpu
def test_cuda_kernels_first_launched_from_several_threads_at_once():
    _need_cuda()
    done = subprocess.run([sys.executable, "-c", _THREADS_SCRIPT], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0 and "threads ok 4" in done.stdout, done.stderr[-4000:]


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "all_gather"])
@pytest.mark.parametrize("codec", ["tahquant-h768", "tahquant-grad"])
def test_group_graphs_replay_tahquant_calls_with_the_eager_bits(op, codec):
    """Emulated ranks on the GPU (``graphs="auto"``): a TAH-Quant kind of call is captured into
    one CUDA graph of the group at its third call and replayed after; every call gives the bits
    of the same calls made eagerly, and no capture falls back to eager (fp4_comm's warning; numba's
    low-occupancy warnings on these small grids are not errors)."""
    import warnings

    from fp4_comm import reference

    _need_cuda()
    world, calls = 4, 6
    rng = np.random.default_rng(7)
    data = [[torch.from_numpy(_realistic(rng, 1, 64, 768)).view(64, 768).to(torch.bfloat16)
             for _ in range(world)] for _ in range(calls)]  # fmt: skip
    results = {}
    for mode in ("never", "auto"):
        ranks = reference.EmulatedRanks(world, "cuda", graphs=mode)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*could not be captured")
            results[mode] = [[y.cpu() for y in getattr(ranks, op)([x.cuda() for x in xs],
                                                                  codec=codec)]
                             for xs in data]  # fmt: skip
        replayed = [e for e in ranks._kinds.values() if e.replay is not None]
        assert (len(replayed) == 1) == (mode == "auto"), mode
    for i, (eager, graphed) in enumerate(zip(results["never"], results["auto"], strict=True)):
        for r in range(world):
            assert torch.equal(eager[r].view(torch.int16), graphed[r].view(torch.int16)), (i, r)
