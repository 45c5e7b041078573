"""Codecs in one process: sections of the advertised sizes, decode equal bit for bit to
fp4_kernels' own round trip (also across chunks whose NVFP4 tensor scales differ), and the
per-element error bound that the collectives' tests rely on holds for adversarial inputs."""

import numpy as np
import pytest
import torch
from hypothesis import assume, example, given, settings, strategies as st

import fp4_kernels
from fp4_comm import codecs
from fp4_comm.codecs import get_codec

CODECS = ["nvfp4", "mxfp4", "none", "none-float32", "fp4quant64", "fp4quant16-plain"]


def _codec(name):
    if name == "fp4quant64":
        return get_codec(fp4_kernels.FP4Quant(64))
    if name == "fp4quant16-plain":
        return codecs.FP4QuantCodec(16, hadamard=False)
    return get_codec(name)


def _fmt(codec):
    return getattr(codec, "fmt", None)


def _data(rng, chunks, n):
    # Per-block magnitudes from 2^-20 to 2^20, so blocks of one tensor differ a lot.
    scale = np.exp2(rng.integers(-20, 21, size=(chunks, n // 16, 1)))
    x = rng.standard_normal((chunks, n // 16, 16)) * scale
    return torch.from_numpy(x.reshape(chunks, n).astype(np.float32))


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("name", CODECS)
def test_sections_and_round_trip(name, rounding):
    codec = _codec(name)
    x = _data(np.random.default_rng(1), 3, 128)
    sections = codec.encode(x, rounding, seed=5, step=2)
    assert [tuple(s.shape) for s in sections] == [(3, b) for b in codec.section_nbytes(128)]
    assert all(s.dtype == torch.uint8 and s.is_contiguous() for s in sections)
    assert codec.encoded_nbytes(128) == sum(codec.section_nbytes(128))
    y = codec.decode(sections, 128)
    if name.startswith("none"):
        expected = x.to(codec.dtype).float()
    else:
        expected = fp4_kernels.quantize_dequantize(x, fmt=_fmt(codec), rounding=rounding,
                                                   seed=5, step=2)  # fmt: skip
    assert torch.equal(y.view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4", "fp4quant64"])
def test_decode_of_chunks_from_separate_encodes(name):
    # A receiver decodes chunks that different ranks encoded (NVFP4: different tensor scales)
    # in one call; each must equal its own encoder's round trip.
    codec = _codec(name)
    rng = np.random.default_rng(2)
    parts = [_data(rng, 1, 64) * 1000.0**i for i in range(3)]
    encoded = [codec.encode(p) for p in parts]
    joined = [torch.cat([e[i] for e in encoded]) for i in range(len(encoded[0]))]
    y = codec.decode(joined, 64, torch.bfloat16)
    for i, p in enumerate(parts):
        ref = fp4_kernels.quantize_dequantize(p, fmt=_fmt(codec)).to(torch.bfloat16)
        assert torch.equal(y[i : i + 1].view(torch.int16), ref.view(torch.int16))


@pytest.mark.parametrize("offset", [1, 2, 3])
@pytest.mark.parametrize("name", [*CODECS, "tahquant-h64", "tahquant-grad"])
def test_decode_of_sections_cut_from_a_byte_buffer_at_any_offset(name, offset):
    # A receiver may hand decode sections that are slices of one flat uint8 buffer, each at
    # whatever offset it lies: torch cannot view bytes at an offset that is no multiple of 2
    # or 4 as bfloat16 / float32, which raised its storage_offset error from inside decode.
    codec = _codec(name)
    x = _data(np.random.default_rng(4), 3, 128)
    sections = codec.encode(x)
    flat = torch.cat([torch.zeros(offset, dtype=torch.uint8)] + [s.reshape(-1) for s in sections])
    cut, at = [], offset
    for s in sections:
        cut.append(flat[at : at + s.numel()].view(s.shape))
        at += s.numel()
    for dtype in (torch.float32, torch.bfloat16):
        got, want = codec.decode(cut, 128, dtype), codec.decode(sections, 128, dtype)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    if hasattr(codec, "requantized_sum"):
        got, want = codec.requantized_sum(cut, 128), codec.requantized_sum(sections, 128)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("name", [*CODECS, "tahquant-h64", "tahquant-grad"])
def test_decode_takes_n_as_any_integer(name):
    # n is checked as an integer (operator.index: a 0-d integer tensor, a numpy integer), but
    # the value passed on to fp4_kernels was the caller's object: a TypeError from inside it.
    codec = _codec(name)
    sections = codec.encode(_data(np.random.default_rng(5), 2, 128))
    want = codec.decode(sections, 128)
    for n in (torch.tensor(128), np.int64(128)):
        assert torch.equal(codec.decode(sections, n).view(torch.int32), want.view(torch.int32))
        if hasattr(codec, "requantized_sum"):
            got, ref = codec.requantized_sum(sections, n), codec.requantized_sum(sections, 128)
            assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    with pytest.raises(TypeError, match="n: expected an integer, got float"):
        codec.decode(sections, 128.0)


@pytest.mark.parametrize("codec", ["none", "none-float32"])
def test_none_codec_round_trip_shares_memory_as_documented(codec):
    # NoneCodec's policy (its docstring): no copy where none is needed, so a local round trip
    # to the wire dtype is a view of the input; a collective's result is not.
    from fp4_comm import reference

    c = get_codec(codec)
    x = torch.randn(2, 32).to(c.dtype)
    y = c.decode(c.encode(x), 32, c.dtype)
    assert y.data_ptr() == x.data_ptr()
    assert c.decode(c.encode(x), 32, torch.float16).data_ptr() != x.data_ptr()
    xs = [x, x.clone()]
    for ys in (reference.all_reduce(xs, codec=codec), reference.all_gather(xs, codec=codec)):
        before = [y.clone() for y in ys]
        x.add_(1)
        assert all(torch.equal(a, b) for a, b in zip(ys, before, strict=True))


def test_nvfp4_sections_carry_the_tensor_scale():
    x = _data(np.random.default_rng(3), 2, 32)
    q = fp4_kernels.quantize(x, fmt="nvfp4")
    codes, scales, inv_s = codecs.NVFP4Codec().encode(x)
    assert torch.equal(codes, q.data) and torch.equal(scales, q.scales)
    assert torch.equal(inv_s.view(torch.float32).reshape(-1), q.global_scale.expand(2))


def test_saturated_marks_the_largest_code():
    # Block amax 6: the element 6 gets code 7 (+6), -6 gets 0xF; nothing else does.
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 3], x[0, 5] = 6.0, -6.0, 5.0
    codec = codecs.MXFP4Codec()
    sat = codec.saturated(codec.encode(x), 32)[0]
    # 5.0 is a tie between 4 and 6, which rounds to even (4): not saturated
    assert sat.nonzero().reshape(-1).tolist() == [0, 3]


def _bound_check(codec, x, rounding, dtype):
    y = codec.decode(codec.encode(x, rounding, seed=9, step=1), x.shape[1], dtype)
    err = (y.double() - x.double()).abs().numpy()
    bound = codec.error_bound(x.numpy(), rounding, dtype)
    assert (err <= bound).all(), float(np.max(err / np.maximum(bound, 1e-300)))
    return float(np.max(err / np.maximum(bound, np.finfo(np.float64).tiny)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("name", CODECS)
def test_error_bound_holds_and_is_tight(name, rounding, dtype):
    codec = _codec(name)
    x = _data(np.random.default_rng(4), 16, 256)
    worst = _bound_check(codec, x, rounding, dtype)
    if name == "none-float32" and dtype == torch.float32:
        assert worst == 0  # float32 through float32: nothing is lost
        return
    # A bound far above the errors would let broken collectives pass their tests: without a
    # Hadamard transform the worst element reaches half of it (the transform's bound is an
    # elementwise worst case that averaging over a group never reaches).
    hadamard = getattr(getattr(codec, "fmt", None), "hadamard", False)
    assert worst > (0.03 if hadamard else 0.5)


def _alone(value):
    """63 zeros and ``value``: a tensor whose amax, and block amax, is that one value."""
    return [0.0] * 63 + [value]


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(["nvfp4", "mxfp4", "fp4quant64", "fp4quant16-plain", "none"]),
    st.sampled_from(["nearest", "stochastic"]),
    st.sampled_from([torch.float32, torch.bfloat16]),
    st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32), min_size=64, max_size=64),
)
# Blocks whose scale falls below 1 / FLT_MAX: the encoders clamp the reciprocal scale to
# FLT_MAX (Transformer Engine's NVFP4 cast does), so the block decodes to less than its value,
# down to 0.  A subnormal alone in its tensor: NVFP4's S clamps to FLT_MAX and the E4M3 block
# scale rounds to 0, so it decodes to 0 (5.6x over the bound that ignored this).
@example("nvfp4", "nearest", torch.float32, _alone(2.34e-43))
@example("nvfp4", "nearest", torch.float32, _alone(1e-38))  # 1/sigma clamped: 2.8x over
@example("fp4quant64", "nearest", torch.float32, _alone(3e-39))  # FP4Quant's clamp: 4.9x
# bfloat16's subnormal scales: the round up adds up to 2^-133, not 2^-7 relative
@example("fp4quant16-plain", "stochastic", torch.float32, _alone(7.609e-42))
@example("none", "nearest", torch.float32, _alone(1e-40))  # bfloat16 subnormals on the wire
def test_error_bound_on_arbitrary_finite_values(name, rounding, dtype, values):
    x = torch.tensor(values, dtype=torch.float32).view(1, 64)
    if name.startswith("fp4quant"):
        # fp4_kernels' inverse transform sums g decoded values of up to amax(H x) <= sum |x|
        # before it divides by g: float32 overflows unless g * sum |x| < FLT_MAX.
        assume(64 * float(x.abs().double().sum()) < float(np.finfo(np.float32).max))
    if name == "none" or dtype == torch.bfloat16:
        # bfloat16 on the wire or out: values it holds (a decoded value may lie a bfloat16
        # ulp above the input: FP4Quant's scale is rounded up)
        assume(float(x.abs().max()) <= float(torch.finfo(torch.bfloat16).max) * (1 - 2**-6))
    _bound_check(_codec(name), x, rounding, dtype)


def test_get_codec():
    assert isinstance(get_codec("nvfp4"), codecs.NVFP4Codec)
    assert get_codec("none").dtype == torch.bfloat16
    assert get_codec("none-float16").dtype == torch.float16
    c = codecs.MXFP4Codec()
    assert get_codec(c) is c
    fq = get_codec(fp4_kernels.FP4Quant(256, hadamard=False))
    assert fq.granularity == 256 and fq.key != get_codec(fp4_kernels.FP4Quant(256)).key
    with pytest.raises(ValueError, match="codec"):
        get_codec("fp8")
    with pytest.raises(ValueError, match="rounding"):
        c.encode(torch.zeros(1, 32), rounding="up")


def test_padded_chunk():
    assert codecs.padded_chunk(1000, 3, 16) == 336  # ceil(1000/3) = 334 -> 336
    assert codecs.padded_chunk(1, 4, 32) == 32
    assert codecs.padded_chunk(96, 3, 32) == 32  # divides evenly: no padding
    assert codecs.padded_chunk(0, 2, 16) == 16  # at least one element a chunk
    assert codecs.padded_chunk(2**60 + 1, 1, 1) == 2**60 + 1  # (a float quotient rounds)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((64, 0, 16), ValueError, r"padded_chunk: chunks: 0; expected an int >= 1"),
        ((64, 2, 0), ValueError, r"padded_chunk: granularity: 0; expected an int >= 1"),
        ((64, -2, 16), ValueError, r"chunks: -2"),
        ((-1, 2, 16), ValueError, r"padded_chunk: n: -1 is outside"),
        ((64, 2.0, 16), TypeError, r"padded_chunk: chunks: expected an integer, got float"),
    ],
)
def test_padded_chunk_names_a_bad_argument(args, error, match):
    # chunks = 0 raised ZeroDivisionError, granularity = 0 too; -2 chunks gave a negative width
    with pytest.raises(error, match=match):
        codecs.padded_chunk(*args)


def _chunks_encoded_apart(codec, x):
    """Each row of ``x`` encoded by a call of its own (NVFP4: under its own tensor scale, as
    the chunks an all-reduce receives from different ranks), the sections stacked."""
    parts = [codec.encode(x[i : i + 1]) for i in range(x.shape[0])]
    return [torch.cat([p[k] for p in parts]) for k in range(len(parts[0]))]


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("chunks", [1, 2, 3, 4])
def test_requantized_sum_is_encode_of_the_decoded_sum(fmt, chunks):
    """The all-reduce's fused middle step against its three steps: decode the chunks (each
    encoded apart, NVFP4 each under its own tensor scale), add them in rank order in float32,
    encode the sum (nearest).  For NVFP4 the chunks' scales differ (amaxes 10^-3 ... 10^6):
    taking one of them for every chunk gives other bits."""
    codec = get_codec(fmt)
    g = torch.Generator().manual_seed(chunks)
    x = torch.randn(chunks, 256, generator=g) * torch.logspace(-3, 3, 256)
    x = x * torch.logspace(0, 3, chunks)[:, None]  # every chunk's amax its own
    x[:, :32] = -0.0  # a block of -0 in every chunk: -0 + -0 stays -0
    sections = _chunks_encoded_apart(codec, x)
    d = codec.decode(sections, 256)
    acc = d[0] if chunks == 1 else d[0] + d[1]
    for i in range(2, chunks):
        acc = acc + d[i]
    expect = codec.encode(acc.view(1, 256))
    got = codec.requantized_sum(sections, 256)
    assert [tuple(t.shape) for t in got] == [(1, n) for n in codec.section_nbytes(256)]
    for a, b in zip(got, expect, strict=True):
        assert torch.equal(a, b)
    assert torch.all(got[0][0, :16] == 0x88)
    again = codec.requantizer(sections, 256)()
    for a, b in zip(again, expect, strict=True):
        assert torch.equal(a, b)
    if fmt == "nvfp4":
        shared = [s.clone() for s in sections]
        shared[2][:] = sections[2][0]  # chunk 0's 1/S for every chunk
        one_scale = codec.requantized_sum(shared, 256)
        same = all(torch.equal(a, b) for a, b in zip(one_scale, expect, strict=True))
        assert same == (chunks == 1)


def test_requantized_sum_needs_a_chunk():
    codec = get_codec("nvfp4")
    with pytest.raises(ValueError, match=r"NVFP4Codec.requantized_sum: needs at least one"):
        codec.requantized_sum([torch.zeros(0, b, dtype=torch.uint8) for b in (8, 1, 4)], 16)


def test_a_tahquant_name_with_a_non_ascii_digit_is_named():
    import pytest

    from fp4_comm.codecs import get_codec

    with pytest.raises(ValueError, match="codec: 'tahquant-h²': TAH-Quant's activation codec"):
        get_codec("tahquant-h²")


@pytest.mark.parametrize(
    ("codec", "kwargs", "error", "match"),
    [
        # a rounding that is no rounding was taken as stochastic (twice the bound)
        ("nvfp4", {"rounding": "up"}, ValueError, "rounding: 'up' is not one of"),
        ("tahquant-h64", {"rounding": "stochastic"}, ValueError, "rounds to nearest only"),
        ("mxfp4", {"dtype": torch.float64}, TypeError, "dtype torch.float64"),
        ("mxfp4", {"x": np.ones((2, 48), np.float32)}, ValueError, "48"),
        ("nvfp4", {"x": torch.ones(2, 64)}, TypeError, "expected a \\(chunks, n\\) float32 numpy"),
        ("none", {"x": np.ones(64, np.float32)}, TypeError, "float32 array of shape \\(64,\\)"),
    ],
)  # fmt: skip
def test_error_bound_names_its_bad_arguments(codec, kwargs, error, match):
    """error_bound checked none of its arguments: numpy broadcast and reshape errors, a
    KeyError for float64, AttributeError for a torch tensor."""
    kwargs = {"x": np.ones((2, 64), np.float32), **kwargs}
    with pytest.raises(error, match=match):
        get_codec(codec).error_bound(**kwargs)
