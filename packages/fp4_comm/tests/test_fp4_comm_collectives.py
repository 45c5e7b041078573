"""The collective algorithms over gloo (four CPU processes; three and two through subgroups),
against a one-process reference of the same algorithm built on fp4_kernels.quantize_dequantize
(equal bit for bit), against the exact float64 sum (within the error bound the codec's format
implies), and across ranks (identical bits)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fp4_kernels
from fp4_comm import codecs
from fp4_comm.codecs import get_codec, padded_chunk
from fp4_comm.collectives import rank_seed, shard_rows

FLOAT32_REL_HALF_ULP = 2.0**-24


def _inputs(world, shape, seed, dtype=torch.float32):
    """One tensor per rank: Gaussian blocks at scales 2^-8..2^8, a few zeros, one outlier."""
    rng = np.random.default_rng(seed)
    xs = []
    for _ in range(world):
        x = rng.standard_normal(shape) * np.exp2(rng.integers(-8, 9, size=shape))
        x.reshape(-1)[rng.integers(0, x.size, size=max(1, x.size // 10))] = 0.0
        x.reshape(-1)[rng.integers(0, x.size)] *= 64.0
        xs.append(torch.from_numpy(x.astype(np.float32)).to(dtype))
    return xs


FP4QUANT = fp4_kernels.FP4Quant(64)


def _qdq(x2d, codec_name, rounding, seed, step):
    """The reference round trip of one encode call: fp4_kernels itself, or the plain cast."""
    if isinstance(codec_name, str) and codec_name.startswith("none"):
        wire = get_codec(codec_name).dtype
        return x2d.to(wire).float()
    return fp4_kernels.quantize_dequantize(
        x2d.float().contiguous(), fmt=codec_name, rounding=rounding, seed=seed, step=step
    )


def reference_all_reduce(xs, codec_name, rounding, seed, step):
    world = len(xs)
    n = xs[0].numel()
    c = padded_chunk(n, world, get_codec(codec_name).granularity)
    decoded = [
        _qdq(
            F.pad(x.reshape(-1).float(), (0, world * c - n)).view(world, c),
            codec_name,
            rounding,
            rank_seed(seed, r, "reduce_scatter"),
            step,
        )  # fmt: skip
        for r, x in enumerate(xs)
    ]
    chunks = []
    for j in range(world):
        acc = decoded[0][j].clone()
        for r in range(1, world):
            acc += decoded[r][j]
        chunks.append(_qdq(acc.view(1, c), codec_name, rounding, rank_seed(seed, j, "all_gather"),
                           step))  # fmt: skip
    y = torch.cat(chunks, dim=0).reshape(-1)[:n].to(xs[0].dtype)
    return y.view(xs[0].shape), decoded


def _run_all_reduce(comms, world, xs, codec_name, rounding, seed, step):
    comm = comms[world]
    if comm is None:
        return None
    y = comm.all_reduce(xs[comm.rank], codec=codec_name, rounding=rounding, seed=seed, step=step)
    assert y.shape == xs[comm.rank].shape and y.dtype == xs[comm.rank].dtype
    return y.float().numpy()


def _same_on_every_rank(results):
    first = results[0]
    for r, y in enumerate(results[1:], 1):
        assert np.array_equal(y.view(np.uint32), first.view(np.uint32)), f"rank {r} differs"


def all_reduce_bound(xs, codec_name, rounding, dtype):
    """|all_reduce - exact sum| bound: each rank's encode error (hop 1), the float32 sum's
    roundings, and the requantization of the reduced chunk (hop 2), evaluated on an upper
    envelope of the reduced values (the bound grows with |x|, block amax and tensor amax)."""
    codec = get_codec(codec_name)
    world, n = len(xs), xs[0].numel()
    c = padded_chunk(n, world, codec.granularity)
    padded = [F.pad(x.reshape(-1).double(), (0, world * c - n)).view(world, c).numpy() for x in xs]
    hop1 = sum(codec.error_bound(p.astype(np.float32), rounding) for p in padded)
    magnitude = sum(np.abs(p) for p in padded) + hop1
    summing = (world - 1) * FLOAT32_REL_HALF_ULP * magnitude
    exact = sum(padded)
    envelope = np.abs(exact) + hop1 + summing
    hop2 = np.concatenate(
        [
            codec.error_bound(envelope[j : j + 1].astype(np.float32), rounding, dtype)
            for j in range(world)
        ]  # fmt: skip
    )
    total = (hop1 + summing).reshape(-1) + hop2.reshape(-1)
    return exact.reshape(-1)[:n], total[:n]


CASES = [
    # world, shape, codec
    (3, (5, 9), "none-float32"),
    (2, (1,), "nvfp4"),
    (3, (7, 33), "nvfp4"),
    (2, (4, 64), "mxfp4"),
    (3, (1000,), "mxfp4"),
    (2, (3, 50), FP4QUANT),
    (4, (3, 70), "nvfp4"),
]


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize(("world", "shape", "codec_name"), CASES)
def test_all_reduce_matches_reference_and_bound(cluster, world, shape, codec_name, rounding):
    xs = _inputs(world, shape, seed=world * 1000 + shape[0])
    seed, step = 11, 3
    results = cluster.run(_run_all_reduce, world, xs, codec_name, rounding, seed, step)
    results = [r for r in results if r is not None]
    assert len(results) == world
    _same_on_every_rank(results)
    ref, _ = reference_all_reduce(xs, codec_name, rounding, seed, step)
    assert np.array_equal(results[0].view(np.uint32), ref.numpy().view(np.uint32))
    exact, bound = all_reduce_bound(xs, codec_name, rounding, torch.float32)
    err = np.abs(results[0].reshape(-1).astype(np.float64) - exact)
    assert (err <= bound).all(), f"max err/bound {np.max(err / np.maximum(bound, 1e-300))}"


def test_all_reduce_exact_where_the_codec_is_exact(cluster):
    # Small integers are exact in bfloat16 and so are their sums over three ranks: the
    # baseline path ("none", bfloat16 on the wire) must return the exact sum.
    rng = np.random.default_rng(5)
    xs = [torch.from_numpy(rng.integers(-40, 41, size=(3, 37)).astype(np.float32))
          for _ in range(3)]  # fmt: skip
    results = cluster.run(_run_all_reduce, 3, xs, "none", "nearest", 0, 0)[:3]
    exact = sum(x.numpy() for x in xs)
    for y in results:
        assert np.array_equal(y, exact)


def test_all_reduce_bfloat16_in_and_out(cluster):
    xs = _inputs(3, (6, 40), seed=9, dtype=torch.bfloat16)
    results = cluster.run(_run_all_reduce, 3, xs, "nvfp4", "nearest", 0, 0)[:3]
    _same_on_every_rank(results)
    ref, _ = reference_all_reduce(xs, "nvfp4", "nearest", 0, 0)
    assert np.array_equal(results[0], ref.float().numpy())
    exact, bound = all_reduce_bound(xs, "nvfp4", "nearest", torch.bfloat16)
    err = np.abs(results[0].reshape(-1).astype(np.float64) - exact)
    assert (err <= bound).all()


def _run_reduce_scatter(comms, world, xs, codec_name, rounding):
    comm = comms[world]
    if comm is None:
        return None
    return comm.reduce_scatter(xs[comm.rank], codec=codec_name, rounding=rounding,
                               seed=2, step=7).float().numpy()  # fmt: skip


@pytest.mark.parametrize(
    ("world", "shape", "codec_name"),
    [(3, (6, 10), "nvfp4"), (2, (4, 64), "mxfp4"), (3, (3, 5), "none-float32")],
)
def test_reduce_scatter_matches_reference_and_bound(cluster, world, shape, codec_name):
    xs = _inputs(world, shape, seed=17)
    results = cluster.run(_run_reduce_scatter, world, xs, codec_name, "stochastic")
    codec = get_codec(codec_name)
    m = shape[0] // world
    per_rank = xs[0].numel() // world
    c = padded_chunk(per_rank, 1, codec.granularity)
    decoded = [
        _qdq(
            F.pad(x.reshape(world, per_rank), (0, c - per_rank)),
            codec_name,
            "stochastic",
            rank_seed(2, r, "reduce_scatter"),
            7,
        )  # fmt: skip
        for r, x in enumerate(xs)
    ]
    for j in range(world):
        y = results[j]
        assert y.shape == (m,) + shape[1:]
        acc = decoded[0][j].clone()
        for r in range(1, world):
            acc += decoded[r][j]
        assert np.array_equal(y.reshape(-1), acc[:per_rank].numpy())
        rows = [x.reshape(world, per_rank)[j].double().numpy() for x in xs]
        bound = (
            sum(
                codec.error_bound(
                    F.pad(x.reshape(world, per_rank), (0, c - per_rank)).numpy(), "stochastic"
                )[j, :per_rank]
                for x in xs
            )
            + (world - 1) * FLOAT32_REL_HALF_ULP * sum(np.abs(r) for r in rows) * 2
        )
        assert (np.abs(y.reshape(-1) - sum(rows)) <= bound).all()


def _run_all_gather(comms, world, xs, codec_name):
    comm = comms[world]
    if comm is None:
        return None
    return comm.all_gather(xs[comm.rank], codec=codec_name).float().numpy()


@pytest.mark.parametrize(
    ("world", "shape", "codec_name"),
    [(3, (2, 7), "nvfp4"), (2, (3, 32), "mxfp4"), (3, (4,), "none")],
)
def test_all_gather_decodes_every_ranks_tensor(cluster, world, shape, codec_name):
    xs = _inputs(world, shape, seed=23)
    results = cluster.run(_run_all_gather, world, xs, codec_name)
    results = [r for r in results if r is not None]
    _same_on_every_rank(results)
    n = xs[0].numel()
    c = padded_chunk(n, 1, get_codec(codec_name).granularity)
    expected = np.concatenate([
        _qdq(F.pad(x.reshape(1, n), (0, c - n)), codec_name, "nearest",
             rank_seed(0, r, "all_gather"), 0)[0, :n].numpy().reshape(shape)
        for r, x in enumerate(xs)
    ])  # fmt: skip
    assert results[0].shape == (world * shape[0],) + shape[1:]
    assert np.array_equal(results[0], expected)


def _run_send_recv(comms, x, codec_name):
    comm = comms[3]
    if comm is None:
        return None
    if comm.rank == 0:
        comm.send(x, dst=2, codec=codec_name, rounding="stochastic", seed=4, step=5)
        return None
    if comm.rank == 2:
        return comm.recv(x.shape, x.dtype, src=0, codec=codec_name).float().numpy()
    return None


@pytest.mark.parametrize("codec_name", ["nvfp4", "mxfp4", "none"])
def test_send_recv(cluster, codec_name):
    x = _inputs(1, (3, 11), seed=31)[0]
    got = cluster.run(_run_send_recv, x, codec_name)[2]
    n = x.numel()
    c = padded_chunk(n, 1, get_codec(codec_name).granularity)
    expected = _qdq(F.pad(x.reshape(1, n), (0, c - n)), codec_name, "stochastic",
                    rank_seed(4, 0, "send"), 5)[0, :n].reshape(x.shape)  # fmt: skip
    assert np.array_equal(got, expected.numpy())


def _run_stats(comms, xs, codec_name):
    comm = comms[2]
    if comm is None:
        return None
    y, stats = comm.all_reduce(xs[comm.rank], codec=codec_name, step=0, stats=True)
    return {hop: s.as_floats() for hop, s in stats.items()}


@pytest.mark.parametrize("codec_name", ["nvfp4", "none-float32"])
def test_stats_per_hop(cluster, codec_name):
    xs = _inputs(2, (8, 48), seed=41)
    stats = cluster.run(_run_stats, xs, codec_name)
    _, decoded = reference_all_reduce(xs, codec_name, "nearest", 0, 0)
    for r in range(2):
        hop = stats[r]["reduce_scatter"]
        assert set(stats[r]) == {"reduce_scatter", "all_gather"}
        x = xs[r].reshape(-1).double()
        d = decoded[r].reshape(-1)[: x.numel()].double()
        if codec_name == "none-float32":
            assert hop["sqnr_db"] == float("inf") and hop["clipped"] == 0 and hop["zeroed"] == 0
            continue
        expected = 10 * np.log10(float((x**2).sum()) / float(((x - d) ** 2).sum()))
        # float64 sums of the same float32 values in another order: relative 2^-40 suffices
        assert hop["sqnr_db"] == pytest.approx(expected, rel=2.0**-40)
        zeroed = float(((x != 0) & (d == 0)).double().mean())
        assert hop["zeroed"] == zeroed
        assert hop["elements"] == x.numel()
        # clipped: encoded at +-6 units of its block and decoded smaller than it was
        q = fp4_kernels.quantize(F.pad(xs[r].reshape(-1), (0, 2 * 192 - x.numel())).view(2, 192))
        sat = codecs.NVFP4Codec().saturated([q.data, q.scales], 192).reshape(-1)[: x.numel()]
        clipped = float((sat & (d.abs() < x.abs())).double().mean())
        assert hop["clipped"] == clipped


def _run_error_feedback(comms, xs, codec_name, steps, name):
    comm = comms[2]
    if comm is None:
        return None
    total = np.zeros(xs[0].shape)
    for _ in range(steps):
        y = comm.all_reduce(xs[comm.rank], codec=codec_name, error_feedback=name)
        total += y.double().numpy()
    residuals = [comm.error_feedback.residual(name, hop) for hop in ("worker", "server")]
    residuals = [None if r is None else r.double().numpy() for r in residuals]
    comm.error_feedback.reset(name)  # (in place: the tensors read above now hold -0.0)
    return total / steps, residuals


@pytest.mark.parametrize("codec_name", ["nvfp4", "mxfp4"])
def test_error_feedback_converges(cluster, codec_name):
    # The same input every step: without error feedback (nearest rounding) every step makes
    # the same error; with it, the mean of T outputs differs from the exact sum by the final
    # residuals / T (they telescope), plus the float32 roundings of the corrections.
    xs = _inputs(2, (4, 64), seed=51)
    exact = sum(x.double().numpy() for x in xs)
    steps = 16
    plain = cluster.run(_run_error_feedback, xs, codec_name, 1, None)[0][0]
    runs = cluster.run(_run_error_feedback, xs, codec_name, steps, "grads")
    mean = runs[0][0]
    assert np.array_equal(mean, runs[1][0])
    n = exact.size
    worker = sum(r[1][0].reshape(-1)[:n] for r in runs[:2])
    server = np.concatenate([r[1][1].reshape(-1) for r in runs[:2]])[:n]
    # x + e in float32 and the float32 sum of the decoded chunks each round once per step,
    # relative to magnitudes below |x| + |e|; their errors do not telescope.
    magnitude = sum(np.abs(x.double().numpy()) for x in xs).reshape(-1) + 2 * (
        np.abs(worker) + np.abs(server)
    )
    rounding = 4 * FLOAT32_REL_HALF_ULP * magnitude
    bound = (np.abs(worker + server) / steps + rounding).reshape(exact.shape)
    err = np.abs(mean - exact)
    assert (err <= bound).all()
    assert np.abs(plain - exact).max() > 4 * err.max()  # the feedback is what removed the bias


def _run_mismatch(comms, kind):
    comm = comms[3]
    if comm is None:
        return "not a member"
    r = comm.rank
    shape, dtype, codec = (4, 32), torch.float32, "nvfp4"
    if kind == "shape" and r == 1:
        shape = (4, 48)
    if kind == "dtype" and r == 2:
        dtype = torch.bfloat16
    if kind == "codec" and r == 0:
        codec = "mxfp4"
    if kind == "trailing-dims":  # 10 dims, the same first 8 and element count: only the
        shape = (1,) * 8 + ((16, 2) if r == 1 else (2, 16))  # whole shape tells them apart
    try:
        if kind == "shard":  # 5 rows on 3 ranks are shards of 2, 2, 1; rank 1 passes 1
            rows = 1 if r == 1 else shard_rows(5, 3)[r]
            comm.all_gather(torch.ones(rows, 32), codec=codec, total_dim0=5)
        else:
            comm.all_reduce(torch.ones(shape, dtype=dtype), codec=codec)
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.parametrize("kind", ["shape", "dtype", "codec", "shard", "trailing-dims"])
def test_mismatched_arguments_raise_on_every_rank(cluster, kind):
    messages = cluster.run(_run_mismatch, kind)[:3]
    for m in messages:
        assert m is not None and "ranks disagree" in m
    if kind == "shard":  # the rank at fault says what it should have passed
        assert "should hold 2" in messages[1]
    if kind == "trailing-dims":
        assert "(1, 1, 1, 1, 1, 1, 1, ...) of 10 dims (CRC of the whole shape" in messages[0]
    # and the group is still usable afterwards
    assert all(m is None for m in cluster.run(_run_mismatch, "none")[:3])


def _run_p2p_trailing_dims(comms):
    """Rank 0 sends a (1,)*8 + (2, 16) tensor, rank 1 receives (1,)*8 + (16, 2): the same
    element count and first 8 dims."""
    comm = comms[2]
    if comm is None:
        return None
    try:
        if comm.rank == 0:
            comm.send(torch.ones((1,) * 8 + (2, 16)), dst=1)
        else:
            comm.recv((1,) * 8 + (16, 2), torch.float32, src=0)
    except ValueError as err:
        return str(err)
    return None


def test_send_and_recv_of_shapes_that_differ_after_the_eighth_dim_raise(cluster):
    for m in cluster.run(_run_p2p_trailing_dims)[:2]:
        assert m is not None and "disagree" in m and "of 10 dims" in m, m
    assert all(m is None for m in cluster.run(_run_mismatch, "none")[:3])  # still in step


def _run_bad_inputs(comms):
    comm = comms[2]
    if comm is None:
        return None
    errors = []
    for bad in (
        lambda: comm.all_reduce(torch.ones(4, 32, device="meta")),
        lambda: comm.all_reduce(torch.ones(4, 32, dtype=torch.float64)),
        lambda: comm.all_gather(torch.ones(3, 32), total_dim0=-1),
        lambda: comm.send(torch.ones(4), dst=comm.rank),
        lambda: comm.all_reduce(torch.ones(())),
    ):
        try:
            bad()
            errors.append(None)
        except (ValueError, TypeError) as err:
            errors.append(type(err).__name__)
    return errors


def test_bad_inputs_raise_before_any_exchange(cluster):
    for errors in cluster.run(_run_bad_inputs)[:2]:
        assert errors == ["ValueError", "TypeError", "ValueError", "ValueError", "ValueError"]


def test_shard_rows():
    # ceil(d0 / W) rows per rank, the last ranks fewer or none: torch.chunk's pieces, then
    # empty ones (torch.chunk of 6 rows into 4 gives three pieces of 2)
    assert shard_rows(5, 4) == [2, 2, 1, 0]
    assert shard_rows(6, 4) == [2, 2, 2, 0]
    assert shard_rows(8, 4) == [2, 2, 2, 2]
    assert shard_rows(1, 3) == [1, 0, 0]
    assert shard_rows(0, 2) == [0, 0]
    for d0 in range(12):
        for world in (1, 2, 3, 4):
            pieces = [len(p) for p in torch.chunk(torch.arange(d0), world)] if d0 else []
            assert shard_rows(d0, world) == pieces + [0] * (world - len(pieces))


def reference_reduce_scatter(xs, codec_name, rounding, seed, step):
    """One process: rank j's reduce_scatter result, its bound against the exact sum, and that
    exact sum (float64), for every j.  dim 0 padded with zero rows to W ceil(d0 / W)."""
    codec = get_codec(codec_name)
    world, d0, rest = len(xs), xs[0].shape[0], tuple(xs[0].shape[1:])
    m = -(-d0 // world)
    padded = [torch.cat([x.float(), torch.zeros((world * m - d0, *rest))]) for x in xs]
    row = padded[0][0].numel() if d0 else 0
    per = m * row
    c = padded_chunk(per, 1, codec.granularity)
    payloads = [F.pad(p.reshape(world, per), (0, c - per)) for p in padded]
    decoded = [
        _qdq(p, codec_name, rounding, rank_seed(seed, r, "reduce_scatter"), step)
        for r, p in enumerate(payloads)
    ]
    hop1 = sum(codec.error_bound(p.numpy(), rounding) for p in payloads)
    magnitude = sum(np.abs(p.double().numpy()) for p in payloads) + hop1
    bound = hop1 + (world - 1) * FLOAT32_REL_HALF_ULP * magnitude
    exact = sum(p.double().numpy() for p in payloads)
    out = []
    for j, rows in enumerate(shard_rows(d0, world)):
        acc = decoded[0][j].clone()
        for r in range(1, world):
            acc += decoded[r][j]
        k = slice(0, rows * row)
        b, e = bound[j, k], exact[j, k]
        y = acc[k].to(xs[0].dtype)
        if xs[0].dtype != torch.float32:  # the cast of the float32 sum
            b = b + (np.abs(e) + b) * codecs.REL_HALF_ULP[xs[0].dtype]
        out.append((y.view((rows, *rest)), b.reshape((rows, *rest)), e.reshape((rows, *rest))))
    return out


def _run_reduce_scatter_and_gather(comms, world, xs, codec_name, rounding):
    comm = comms[world]
    if comm is None:
        return None
    x = xs[comm.rank]
    kw = {"codec": codec_name, "rounding": rounding, "seed": 2}
    shard = comm.reduce_scatter(x, step=7, **kw)
    whole = comm.all_gather(shard, step=8, total_dim0=x.shape[0], **kw)
    assert shard.dtype == x.dtype and whole.dtype == x.dtype
    return shard, whole


UNEVEN = [
    # world, shape, codec, rounding: dim 0 no multiple of the world size (and, for 3, 4 and
    # 1000, elements per shard no multiple of the block size); (2, 40) on 3 ranks leaves
    # rank 2 without rows
    (3, (5, 9), "nvfp4", "nearest"),
    (4, (7, 33), "nvfp4", "stochastic"),
    (3, (2, 40), "mxfp4", "stochastic"),
    (3, (1000,), "mxfp4", "nearest"),
    (2, (3, 50), FP4QUANT, "stochastic"),
    (4, (9, 16), FP4QUANT, "nearest"),
    (3, (4, 7), "none", "nearest"),
    (4, (5, 3), "none-float32", "nearest"),
    (3, (6, 10), "nvfp4", "stochastic"),  # even, for comparison
]


@pytest.mark.parametrize(("world", "shape", "codec_name", "rounding"), UNEVEN)
def test_reduce_scatter_uneven_and_all_gather_inverse(cluster, world, shape, codec_name,
                                                      rounding):  # fmt: skip
    xs = _inputs(world, shape, seed=100 + world * 10 + shape[0])
    results = cluster.run(_run_reduce_scatter_and_gather, world, xs, codec_name, rounding)
    codec = get_codec(codec_name)
    ref = reference_reduce_scatter(xs, codec_name, rounding, 2, 7)
    for j in range(world):
        shard, _ = results[j]
        y, bound, exact = ref[j]
        assert shard.shape == (shard_rows(shape[0], world)[j], *shape[1:])
        assert torch.equal(shard.view(torch.int32), y.view(torch.int32))
        err = np.abs(shard.double().numpy() - exact)
        assert (err <= bound).all(), f"rank {j}: max err/bound {np.max(err / bound)}"
    # all_gather(total_dim0) is the inverse: the whole (d0, ...) tensor, the same bits on every
    # rank, each shard through one more encode (hop all_gather) of the rank that holds it
    wholes = [results[j][1] for j in range(world)]
    _same_on_every_rank([w.numpy() for w in wholes])
    assert wholes[0].shape == shape
    m = -(-shape[0] // world)
    row = xs[0][0].numel() if len(shape) > 1 else 1
    c = padded_chunk(m * row, 1, codec.granularity)
    expected, bound2 = [], []
    for j in range(world):
        shard = results[j][0].reshape(1, -1)
        n = shard.numel()
        payload = F.pad(shard, (0, c - n))
        expected.append(_qdq(payload, codec_name, rounding, rank_seed(2, j, "all_gather"),
                             8)[0, :n])  # fmt: skip
        bound2.append(codec.error_bound(payload.numpy(), rounding)[0, :n])
    got = wholes[0].reshape(-1).view(torch.int32)
    assert torch.equal(got, torch.cat(expected).view(torch.int32))
    exact = np.concatenate([ref[j][2].reshape(-1) for j in range(world)])
    bound = np.concatenate([ref[j][1].reshape(-1) for j in range(world)]) + np.concatenate(bound2)
    err = np.abs(wholes[0].double().numpy().reshape(-1) - exact)
    assert (err <= bound).all(), f"max err/bound {np.max(err / bound)}"
    if codec_name == "none-float32":  # float32 on the wire: the rank-order float32 sum itself
        acc = xs[0].clone()
        for x in xs[1:]:
            acc += x
        assert torch.equal(wholes[0], acc)


def test_reduce_scatter_uneven_bfloat16(cluster):
    xs = _inputs(3, (7, 24), seed=61, dtype=torch.bfloat16)
    results = cluster.run(_run_reduce_scatter_and_gather, 3, xs, "nvfp4", "nearest")
    ref = reference_reduce_scatter(xs, "nvfp4", "nearest", 2, 7)
    for j in range(3):
        shard = results[j][0]
        y, bound, exact = ref[j]
        assert shard.dtype == torch.bfloat16 and shard.shape == y.shape
        assert torch.equal(shard.view(torch.int16), y.view(torch.int16))
        assert (np.abs(shard.double().numpy() - exact) <= bound).all()
    _same_on_every_rank([r[1].float().numpy() for r in results[:3]])
