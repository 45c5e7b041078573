"""TAH-Quant codecs (fp4_comm.tahquant) against the plain-numpy oracle written from the same
text (_tahquant_oracle.py): every byte on the wire (codes, zeros, scales, token and transform
maps, pivots) and every decoded bit, on ragged, tied, zero, constant, non-finite and
out-of-range inputs; literal cases for the ranking, the transform rule and the packing; error
bounds; the collectives over gloo against a one-process reference built on the oracle."""

import _tahquant_oracle as oracle
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from fp4_comm import tahquant
from fp4_comm.codecs import get_codec, padded_chunk
from fp4_comm.tahquant import TAHQuantCodec, TAHQuantGradCodec

NAN, INF = float("nan"), float("inf")


def _bits(t):
    return t.contiguous().view(torch.int32).numpy()


def _same_floats(a, b):
    """Equal bit for bit, NaN anywhere matching NaN (its payload aside)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    nan = np.isnan(a)
    assert np.array_equal(nan, np.isnan(b))
    assert np.array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32))


def _activations(rng, chunks, tokens, C):
    """Gaussian tokens at scales 2^-6..2^6 with the features the codec treats apart."""
    x = rng.standard_normal((chunks, tokens, C)) * np.exp2(rng.integers(-6, 7, (chunks, tokens, 1)))
    if tokens >= 4:
        x[:, 1] = 0.0  # a zero token
        x[:, 2] = x[:, 3]  # a tie: the same token twice
        x[:, 0, :TILE] = 0.0
        x[:, 0, 5] = 3.0  # a tile with one element: transformed, entropy low
    if tokens >= 6:
        x[:, 4] = rng.permutation(x[0, 5])  # a permutation of another token
        x[:, 5, TILE : 2 * TILE] = 0.25  # a constant tile
    x[:, -1, 7] *= 100.0  # an outlier: transformed tile
    return x.reshape(chunks, tokens * C).astype(np.float32)


TILE = tahquant.TILE_SIZE


def _check_against_oracle(x, C):
    codec = TAHQuantCodec(C)
    xt = torch.from_numpy(x)
    (raw,) = codec.encode(xt)
    fields = oracle.encode_fields(x, C)
    ref = oracle.pack(fields)
    assert raw.shape == (x.shape[0], codec.section_nbytes(x.shape[1])[0])
    assert np.array_equal(raw.numpy(), ref)
    y = codec.decode([raw], x.shape[1])
    _same_floats(y.numpy(), oracle.decode_fields(fields, C))
    return fields, y


SHAPES = [(1, 1, 64), (2, 5, 64), (3, 7, 128), (1, 11, 192), (2, 6, 64), (1, 16, 64)]


@pytest.mark.parametrize(("chunks", "tokens", "C"), SHAPES)
def test_bytes_and_decode_equal_the_oracle(chunks, tokens, C):
    x = _activations(np.random.default_rng(tokens * C + chunks), chunks, tokens, C)
    fields, _ = _check_against_oracle(x, C)
    assert sum(fields[0]["low"]) == tokens * 20 // 100


def test_non_finite_and_out_of_range_tiles_decode_to_nan():
    x = _activations(np.random.default_rng(7), 2, 5, 128)
    t = x.reshape(2, 5, 2, TILE)
    t[0, 0, 0, 3] = NAN
    t[0, 1, 1, 0] = INF
    t[1, 2, 0, 9] = -INF
    t[1, 3, 1, :] = 70000.0  # constant beyond fp16: the zero overflows
    t[1, 4, 0, :] = np.linspace(-60000, 60000, TILE)  # spread / 15 fits, the values too
    t[1, 0, 1, 5] = 3e38  # an outlier tile: transformed, and beyond fp16 all the same
    fields, y = _check_against_oracle(x, 128)
    y = y.numpy().reshape(2, 5, 2, TILE)
    for r, k, j in [(0, 0, 0), (0, 1, 1), (1, 2, 0), (1, 3, 1), (1, 0, 1)]:
        assert np.isnan(y[r, k, j]).all()
    assert np.isfinite(y[1, 4, 0]).all()
    nan_tiles = np.isnan(y).any(-1).sum()
    assert nan_tiles == 5  # nothing else is touched


def test_ranking_literal():
    # five tokens of 64: the one whose mass sits on one channel has the lowest entropy and is
    # the one token (5 * 20 // 100 = 1) sent with 3 bits; a zero token ranks lower still.
    rng = np.random.default_rng(0)
    x = rng.uniform(1, 2, (5, 64)).astype(np.float32)
    x[3, :] = 0.001
    x[3, 10] = 50.0
    codec = TAHQuantCodec(64)
    (raw,) = codec.encode(torch.from_numpy(x.reshape(1, -1)))
    a, b = codec.layout(320)["token_map"]
    assert raw[0, a:b].tolist() == [0b01000]
    x[1] = 0.0
    (raw,) = codec.encode(torch.from_numpy(x.reshape(1, -1)))
    assert raw[0, a:b].tolist() == [0b00010]
    # ties go to the lower index: ten equal tokens, two 3-bit ones
    x = np.ones((1, 640), np.float32)
    (raw,) = codec.encode(torch.from_numpy(x))
    a, b = codec.layout(640)["token_map"]
    assert raw[0, a:b].tolist() == [0b11, 0]


def test_entropy_log_is_accurate():
    p = torch.from_numpy(np.geomspace(1e-40, 1.0, 2001).astype(np.float32))
    got = tahquant._ln(p).double()
    exact = torch.log(p.double())
    # about one float32 ulp of the result, plus the rounding of e * ln 2
    assert ((got - exact).abs() <= 4 * 2.0**-24 * (exact.abs() + 1)).all()


def test_hadamard_rule_at_ratio_two_and_pivot_swap():
    tile = np.full(64, 0.5, np.float32)
    tile[17] = -1.0  # exactly twice the second: transformed, pivot 17
    under = tile.copy()
    under[17] = np.nextafter(np.float32(-1.0), np.float32(0))  # just under twice: not
    x = np.concatenate([tile, under, tile, under]).reshape(1, 256)
    fields, _ = _check_against_oracle(x, 64)
    assert fields[0]["transform"] == [True, False, True, False]
    assert fields[0]["pivots"] == [17, 0, 17, 0]
    # two equal maxima: the second equals the first, no transform
    x = np.zeros((1, 64), np.float32)
    x[0, 3] = x[0, 40] = 2.0
    fields, _ = _check_against_oracle(x, 64)
    assert fields[0]["transform"] == [False]


def test_packing_literal():
    # one token of 64 channels, codes 0..15 ramp: a 4-bit token, element 2i in the low nibble
    x = np.tile(np.arange(16, dtype=np.float32), 4).reshape(1, 64)
    x[0, 16:] = np.arange(48, dtype=np.float32) % 16  # no outlier: max 15, second 15
    codec = TAHQuantCodec(64)
    (raw,) = codec.encode(torch.from_numpy(x))
    lay = codec.layout(64)
    assert lay["low_codes"] == (0, 0)  # 1 * 20 // 100 = 0 tokens of 3 bits
    a, b = lay["high_codes"]
    assert raw[0, a : a + 2].tolist() == [0x10, 0x32]
    z, s = lay["zeros"], lay["scales"]
    assert raw[0, z[0] : z[1]].view(torch.float16).item() == 0.0
    assert raw[0, s[0] : s[1]].view(torch.float16).item() == 1.0
    # 3-bit packing: eight codes per 3 bytes, little-endian
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0]])
    word = sum(c << (3 * k) for k, c in enumerate([1, 2, 3, 4, 5, 6, 7, 0]))
    assert tahquant._pack24(codes, 3)[0].tolist() == [word & 255, word >> 8 & 255, word >> 16]


def test_layout_is_built_once_for_each_n_and_checked_before():
    codec = TAHQuantCodec(64)
    lay = codec.layout(640)
    assert codec.layout(640) is lay and codec.layout(np.int64(640)) == lay
    assert lay["low_codes"] == (0, tahquant.low_token_count(10) * 64 * 3 // 8)
    with pytest.raises(TypeError):
        lay["zeros"] = (0, 0)  # read-only: every call shares it
    for bad in (640.0, 100, True):  # checked as before, cached or not
        with pytest.raises((TypeError, ValueError), match="n"):
            codec.layout(bad)


@pytest.mark.parametrize("C", [64, 768])
def test_section_size_and_bits_per_element(C):
    codec = TAHQuantCodec(C)
    T = 100
    n = T * C
    low = T * 20 // 100
    expected = (low * 3 * C + (T - low) * 4 * C) // 8 + 4 * n // 64
    expected += -(-T // 8) + -(-n // 64 // 8) + -(-n // 64 * 6 // 8)
    assert codec.section_nbytes(n) == (expected,)
    x = torch.randn(2, n)
    assert codec.encode(x)[0].shape == (2, expected)
    if C == 768:
        assert abs(8 * expected / n - 4.41) < 0.01


def test_bfloat16_input_and_output_dtypes():
    x = torch.from_numpy(_activations(np.random.default_rng(3), 2, 5, 64))
    codec = TAHQuantCodec(64)
    (a,) = codec.encode(x.bfloat16())
    (b,) = codec.encode(x.bfloat16().float())
    assert torch.equal(a, b)
    y32 = codec.decode([a], 320)
    assert torch.equal(codec.decode([a], 320, torch.bfloat16), y32.bfloat16())


def test_error_bound_holds_and_is_tight():
    x = _activations(np.random.default_rng(4), 4, 10, 128)
    codec = TAHQuantCodec(128)
    for dtype in (torch.float32, torch.bfloat16):
        y = codec.decode(codec.encode(torch.from_numpy(x)), x.shape[1], dtype)
        err = np.abs(y.double().numpy() - x)
        bound = codec.error_bound(x, "nearest", dtype)
        assert (err <= bound).all()
        assert (err / bound).max() > 0.5


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(-6e4, 6e4, allow_nan=False, width=32), min_size=128, max_size=128))
def test_error_bound_on_arbitrary_values(values):
    x = np.array(values, np.float32).reshape(1, 128)
    codec = TAHQuantCodec(64)
    y = codec.decode(codec.encode(torch.from_numpy(x)), 128)
    assert (np.abs(y.double().numpy() - x) <= codec.error_bound(x)).all()
    _check_against_oracle(x, 64)


# ---------------------------------------------------------------------- the gradient codec


@pytest.mark.parametrize(("chunks", "n"), [(1, 32), (3, 96), (2, 320)])
def test_grad_bytes_and_decode_equal_the_oracle(chunks, n):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal((chunks, n)) * np.exp2(rng.integers(-30, 10, (chunks, n)))).astype(
        np.float32
    )
    x[0, :32] = 0.0  # a zero tile
    if n >= 96:
        x[-1, 32:64] = 1e-9  # below fp16's smallest scale: flushed to zero
        x[0, 64] = NAN
        x[-1, 70] = 7e4  # beyond fp16: NaN
    codec = TAHQuantGradCodec()
    (raw,) = codec.encode(torch.from_numpy(x))
    assert raw.shape == (chunks, codec.section_nbytes(n)[0]) == (chunks, n * 6 // 8 + n // 16)
    assert np.array_equal(raw.numpy(), oracle.grad_encode(x))
    _same_floats(codec.decode([raw], n).numpy(), oracle.grad_decode(raw.numpy(), n))


def test_grad_literal():
    # max 1: codes of 1 and -1 are 31 and -32 (the fixed point's range), 0.5 is 16
    x = torch.zeros(1, 32)
    x[0, :4] = torch.tensor([1.0, -1.0, 0.5, 1 / 64])  # 1/64 * 32 = 0.5: ties to even, 0
    codec = TAHQuantGradCodec()
    y = codec.decode(codec.encode(x), 32)
    assert y[0, :4].tolist() == [31 / 32, -1.0, 0.5, 0.0]


def test_grad_error_bound():
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((4, 256)) * np.exp2(rng.integers(-20, 10, (4, 256)))).astype(
        np.float32
    )
    codec = TAHQuantGradCodec()
    y = codec.decode(codec.encode(torch.from_numpy(x)), 256)
    err = np.abs(y.double().numpy() - x)
    bound = codec.error_bound(x)
    assert (err <= bound).all() and (err / bound).max() > 0.5


def _grad_sqnr_db(rms):
    """The gradient codec's SQNR (dB) on Gaussian tiles of RMS ``rms`` (one fixed draw)."""
    x = torch.randn(64, 32 * 96, generator=torch.Generator().manual_seed(0)) * rms
    codec = TAHQuantGradCodec()
    y = codec.decode(codec.encode(x), x.shape[1]).double()
    return 10 * np.log10(float((x.double() ** 2).sum() / ((x - y) ** 2).sum()))


def test_grad_sqnr_falls_where_its_fp16_scales_are_subnormal():
    """Where a tile's largest magnitude is an fp16 normal number the 6-bit fixed point gives
    the same SQNR at any scale (32.7 dB on Gaussian tiles); below 2**-14 the fp16 scale keeps
    fewer significant bits, and the SQNR falls: 31.1 dB at an RMS of 1.7e-7 and 29.0 at 1e-7
    (the gradients of a 125 M model at a TP = 4 and a TP = 8 all-reduce without a loss
    scale); a power-of-two loss scale of 2**16 restores 32.7."""
    normal = [_grad_sqnr_db(rms) for rms in (1e-2, 1e-4, 1.7e-7 * 2**16, 1e-7 * 2**16)]
    assert max(normal) - min(normal) < 0.05 and abs(normal[0] - 32.7) < 0.1, normal
    assert abs(_grad_sqnr_db(1.7e-7) - 31.1) < 0.1
    assert abs(_grad_sqnr_db(1e-7) - 29.0) < 0.1


# ---------------------------------------------------------------------- names and bad input


def test_get_codec_names():
    c = get_codec("tahquant-h768")
    assert isinstance(c, TAHQuantCodec) and c.granularity == 768 and c.key == "tahquant-h768"
    assert isinstance(get_codec("tahquant-grad"), TAHQuantGradCodec)
    assert get_codec("tahquant-grad").granularity == 32


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (lambda: get_codec("tahquant"), ValueError, ["tahquant-h<C>", "hidden size"]),
        (lambda: get_codec("tahquant-h100"), ValueError, ["multiple", "64"]),
        (lambda: get_codec("tahquant-hx"), ValueError, ["tahquant-hx"]),
        (lambda: TAHQuantCodec(96), ValueError, ["96", "64"]),
        (lambda: TAHQuantCodec(64.0), TypeError, ["token_size"]),
        (
            lambda: TAHQuantCodec(64).encode(torch.zeros(1, 64), "stochastic"),
            ValueError,
            ["nearest"],
        ),
        (
            lambda: TAHQuantGradCodec().encode(torch.zeros(1, 32), "stochastic"),
            ValueError,
            ["nearest"],
        ),
        (lambda: TAHQuantCodec(128).encode(torch.zeros(1, 64)), ValueError, ["128"]),
        (
            lambda: TAHQuantGradCodec().decode([torch.zeros(1, 3, dtype=torch.uint8)], 32),
            ValueError,
            ["section 0"],
        ),
    ],  # fmt: skip
)
def test_rejected(call, error, words):
    with pytest.raises(error) as info:
        call()
    for w in words:
        assert w in str(info.value)


_H = torch.arange(20, dtype=torch.float32).reshape(2, 10)  # (R, T) entropies


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        # n_low -1 ranked all tokens but the last as low (a slice [:-1]); 11 of 10 all of them
        (lambda: tahquant.low_precision_tokens(_H, -1), ValueError, ["n_low", "-1", "[0, 11)"]),
        (lambda: tahquant.low_precision_tokens(_H, 11), ValueError, ["n_low", "11", "[0, 11)"]),
        (lambda: tahquant.low_precision_tokens(_H, 2.0), TypeError, ["n_low", "float"]),
        (lambda: tahquant.low_precision_tokens(_H.numpy(), 2), TypeError, ["h", "ndarray"]),
        (lambda: tahquant.low_precision_tokens(_H[0], 2), ValueError, ["h", "(R, T)", "(10,)"]),
        (lambda: tahquant.low_precision_tokens(_H.double(), 2), TypeError, ["h", "float64"]),
        # a 0-d tensor: IndexError; a numpy array: AttributeError ('abs')
        (lambda: tahquant.token_entropy(torch.tensor(1.0)), ValueError, ["x", "(..., T, C)"]),
        (lambda: tahquant.token_entropy(torch.ones(64)), ValueError, ["x", "(64,)"]),
        (lambda: tahquant.token_entropy(np.ones((2, 64), np.float32)), TypeError, ["x", "ndarray"]),
        (
            lambda: tahquant.token_entropy(torch.ones(2, 64, dtype=torch.int32)),
            TypeError,
            ["x", "int32", "float32"],
        ),
        # -5 tokens gave -1 low tokens; 2.5 gave 0.0
        (lambda: tahquant.low_token_count(-5), ValueError, ["tokens", "-5"]),
        (lambda: tahquant.low_token_count(2.5), TypeError, ["tokens", "float"]),
    ],  # fmt: skip
)
def test_ranking_helpers_reject_bad_arguments(call, error, words):
    with pytest.raises(error) as info:
        call()
    for w in words:
        assert w in str(info.value), str(info.value)


def test_ranking_helpers_take_the_edge_values():
    assert tahquant.low_token_count(0) == 0 and tahquant.low_token_count(np.int64(10)) == 2
    assert not tahquant.low_precision_tokens(_H, 0).any()
    assert tahquant.low_precision_tokens(_H, torch.tensor(10)).all()
    assert tahquant.token_entropy(torch.ones(3, 0)).shape == (3,)


def test_empty_payloads():
    for codec, n in ((TAHQuantCodec(64), 128), (TAHQuantGradCodec(), 64)):
        s = codec.encode(torch.zeros(0, n))
        assert s[0].shape == (0, codec.section_nbytes(n)[0])
        assert codec.decode(s, n).shape == (0, n)


# ---------------------------------------------------------------------- through the collectives


def _oracle_qdq(payload, name):
    """decode(encode(payload)) of the oracle, (chunks, c) float32 numpy."""
    if name == "tahquant-grad":
        return oracle.grad_decode(oracle.grad_encode(payload), payload.shape[1])
    C = get_codec(name).token_size
    return oracle.decode_fields(oracle.encode_fields(payload, C), C)


def _reference_all_reduce(xs, name):
    world, n = len(xs), xs[0].size
    c = padded_chunk(n, world, get_codec(name).granularity)
    decoded = [_oracle_qdq(np.pad(x.reshape(-1), (0, world * c - n)).reshape(world, c), name)
               for x in xs]  # fmt: skip
    out = []
    for j in range(world):
        acc = decoded[0][j].copy()
        for r in range(1, world):
            acc += decoded[r][j]
        out.append(_oracle_qdq(acc.reshape(1, c), name)[0])
    return np.concatenate(out)[:n].reshape(xs[0].shape)


def _all_reduce(comms, world, xs, name):
    comm = comms[world]
    if comm is None:
        return None
    return comm.all_reduce(torch.from_numpy(xs[comm.rank]), codec=name).numpy()


def _send_recv(comms, x, name):
    comm = comms[2]
    if comm is None:
        return None
    if comm.rank == 0:
        comm.send(torch.from_numpy(x), dst=1, codec=name)
        return None
    return comm.recv(x.shape, torch.float32, src=0, codec=name).numpy()


@pytest.mark.parametrize(("world", "shape", "name"), [(3, (5, 128), "tahquant-h128"),
                                                      (2, (6, 64), "tahquant-h64"),
                                                      (3, (7, 40), "tahquant-grad")])  # fmt: skip
def test_all_reduce_over_gloo_equals_the_oracle_reference(cluster, world, shape, name):
    # (5, 128) over 3 ranks: chunks of 2 tokens, the last one a zero token of padding.
    rng = np.random.default_rng(world)
    xs = [_activations(rng, 1, shape[0], shape[1]).reshape(shape) if name != "tahquant-grad"
          else rng.standard_normal(shape).astype(np.float32) for _ in range(world)]  # fmt: skip
    expected = _reference_all_reduce(xs, name)
    results = [y for y in cluster.run(_all_reduce, world, xs, name) if y is not None]
    assert len(results) == world
    for y in results:
        _same_floats(y, expected)


def test_send_recv_over_gloo_is_one_chunk_of_all_tokens(cluster):
    x = _activations(np.random.default_rng(9), 1, 10, 64).reshape(10, 64)
    results = [y for y in cluster.run(_send_recv, x, "tahquant-h64") if y is not None]
    expected = _oracle_qdq(x.reshape(1, -1), "tahquant-h64").reshape(10, 64)
    assert len(results) == 1
    _same_floats(results[0], expected)


# ---------------------------------------------------------------------- CPU and GPU


@pytest.mark.gpu
def test_cuda_equals_cpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    x = torch.from_numpy(_activations(np.random.default_rng(11), 8, 40, 256))
    x.view(8, 40, 4, 64)[0, 0, 0, 0] = NAN
    for codec, n in ((TAHQuantCodec(256), 40 * 256), (TAHQuantGradCodec(), 40 * 256)):
        (cpu,) = codec.encode(x)
        (gpu,) = codec.encode(x.cuda())
        assert torch.equal(gpu.cpu(), cpu)
        _same_floats(codec.decode([gpu], n).cpu().numpy(), codec.decode([cpu], n).numpy())
    # a large payload, as in training: (16384 tokens, 768) through the GPU only, against CPU
    big = torch.randn(4, 4096 * 768) * 3
    codec = TAHQuantCodec(768)
    assert torch.equal(codec.encode(big.cuda())[0].cpu(), codec.encode(big)[0])


def test_padding_with_f_pad_is_what_collectives_do():
    # a payload padded with zero tokens: the padding decodes to exact zeros
    x = torch.from_numpy(_activations(np.random.default_rng(12), 1, 3, 64))
    padded = F.pad(x, (0, 128))
    codec = TAHQuantCodec(64)
    y = codec.decode(codec.encode(padded), 320)
    assert (y[0, 192:] == 0).all()
