"""QuantizedTensor (in _quantized.py) as a torch user expects it: keyword construction, the array
library's dtype, numel / nbytes, the scales as float8 (bfloat16) views, and .to / .cpu / .cuda
(CPU here; the CUDA moves in the gpu-marked tests)."""

import dataclasses

import ml_dtypes
import numpy as np
import pytest
from numba import cuda

import fp4_kernels as fk
from fp4_kernels._calls import payload_views
from fp4_kernels.formats.e4m3 import decode_e4m3
from fp4_kernels.formats.e8m0 import decode_e8m0
from fp4_kernels.testing import adversarial_blocks, same_bits

torch = pytest.importorskip("torch")

FORMATS = ["nvfp4", "mxfp4", fk.FP4Quant(32)]
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def _x(rng, rows=3, k=128):
    # NaN, Inf, zeros, ties: NaN scale codes too; finite values within float16's range
    return np.clip(adversarial_blocks(rng, rows, k, 32), -6e4, 6e4)


def _tensor(rng, dtype="float32", rows=3, k=128):
    return torch.from_numpy(_x(rng, rows, k)).to(TORCH_DTYPES[dtype])


def _same_q(a, b):
    assert a.fmt == b.fmt and a.shape == b.shape and a.dtype == b.dtype
    for name in ("data", "scales", "global_scale", "payload"):
        u, v = getattr(a, name), getattr(b, name)
        assert (u is None) == (v is None), name
        if u is not None:
            np.testing.assert_array_equal(np.asarray(_host(u)), np.asarray(_host(v)), name)


def _host(a):
    if isinstance(a, torch.Tensor):
        return a.cpu().numpy()
    return a.copy_to_host() if hasattr(a, "copy_to_host") else a


def test_construction_is_by_keyword_only(rng):
    q = fk.quantize(_x(rng))
    fields = [q.data, q.scales, q.global_scale, q.fmt, q.shape, q.dtype, q.scale_layout]
    with pytest.raises(TypeError, match="positional"):
        fk.QuantizedTensor(*fields)
    names = ["data", "scales", "global_scale", "fmt", "shape", "dtype", "scale_layout"]
    same = fk.QuantizedTensor(**dict(zip(names, fields, strict=True)))
    assert same_bits(fk.dequantize(same), fk.dequantize(q))


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_dtype_is_the_array_librarys(rng, fmt, dtype):
    t = _tensor(rng, dtype)
    q = fk.quantize(t, fmt=fmt)
    assert q.dtype == t.dtype and isinstance(q.dtype, torch.dtype) and q.dtype_name == dtype
    assert fk.dequantize(q).dtype == t.dtype
    x = _x(rng).astype(NP_DTYPES[dtype])
    qn = fk.quantize(x, fmt=fmt)
    assert qn.dtype == x.dtype and isinstance(qn.dtype, np.dtype) and qn.dtype_name == dtype


@pytest.mark.parametrize("given", ["bfloat16", ml_dtypes.bfloat16, torch.bfloat16])
def test_dtype_given_any_way_becomes_that_of_data(rng, given):
    q = fk.quantize(_tensor(rng, "bfloat16"))
    assert dataclasses.replace(q, dtype=given).dtype is torch.bfloat16
    qn = dataclasses.replace(
        q, data=q.data.numpy(), scales=q.scales.numpy(), global_scale=q.global_scale.numpy()
    )
    assert qn.dtype == np.dtype(ml_dtypes.bfloat16)
    assert same_bits(fk.dequantize(qn), fk.dequantize(q).view(torch.int16).numpy().view(qn.dtype))


def test_an_unsupported_dtype_is_named_when_used(rng):
    q = dataclasses.replace(fk.quantize(_tensor(rng)), dtype=torch.float64)
    assert q.dtype is torch.float64  # kept as given: nothing to convert it to
    with pytest.raises(TypeError, match=r"q.dtype: torch.float64 is not supported"):
        fk.dequantize(q)


@pytest.mark.parametrize(
    "fmt,layout",
    [("nvfp4", "linear"), ("nvfp4", "swizzled"), ("mxfp4", "linear"), ("mxfp4", "swizzled"),
     (fk.FP4Quant(32), "linear")],
    ids=str,
)  # fmt: skip
def test_numel_and_nbytes(rng, fmt, layout):
    t = _tensor(rng, "bfloat16", rows=5, k=64)
    q = fk.quantize(t, fmt=fmt, scale_layout=layout)
    assert q.numel() == t.numel() == 320
    scale_bytes = q.scales.numel() * q.scales.element_size()
    assert q.nbytes == 160 + scale_bytes + (4 if fmt == "nvfp4" else 0)


@pytest.mark.parametrize("layout", ["linear", "swizzled"])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_typed_scales_torch(rng, fmt, layout):
    q = fk.quantize(_tensor(rng, rows=130), fmt=fmt, scale_layout=layout)
    s = q.typed_scales()
    expect = {"nvfp4": torch.float8_e4m3fn, "mxfp4": torch.float8_e8m0fnu}[fmt]
    assert s.dtype == expect and s.shape == q.scales.shape
    assert s.data_ptr() == q.scales.data_ptr()  # a view, no copy
    codes = q.scales.numpy()
    want = decode_e4m3(codes) if fmt == "nvfp4" else decode_e8m0(codes)
    got = s.float().numpy()
    assert np.isnan(got).any()  # the NaN scale code reads as NaN
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_typed_scales_numpy(rng, fmt):
    q = fk.quantize(_x(rng), fmt=fmt)
    s = q.typed_scales()
    name = {"nvfp4": "float8_e4m3fn", "mxfp4": "float8_e8m0fnu"}.get(fmt, "bfloat16")
    assert s.dtype == np.dtype(getattr(ml_dtypes, name)) and np.shares_memory(s, q.scales)
    if fmt == "nvfp4":
        np.testing.assert_array_equal(s.astype(np.float32), decode_e4m3(q.scales))
    elif fmt == "mxfp4":
        np.testing.assert_array_equal(s.astype(np.float32), decode_e8m0(q.scales))
    else:
        assert np.array_equal(s.view(np.uint16), q.scales)


def test_typed_scales_fp4quant_torch(rng):
    q = fk.quantize(_tensor(rng), fmt=fk.FP4Quant(64))
    s = q.typed_scales()
    assert s.dtype == torch.bfloat16 and torch.equal(s.view(torch.uint16), q.scales)


def test_typed_scales_numba_arrays_are_refused(kernels, rng):
    q = fk.quantize(_x(rng))
    qd = dataclasses.replace(q, **{k: cuda.to_device(getattr(q, k)) for k in _ARRAYS})
    with pytest.raises(TypeError, match="scales: numba arrays have no float8_e4m3fn dtype"):
        qd.typed_scales()


_ARRAYS = ("data", "scales", "global_scale")


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_to_the_device_it_is_on_returns_it(rng, fmt):
    q = fk.quantize(_tensor(rng), fmt=fmt)
    assert q.to("cpu") is q and q.to(torch.device("cpu")) is q and q.cpu() is q
    qn = fk.quantize(_x(rng), fmt=fmt)
    assert qn.to("cpu") is qn and qn.cpu() is qn


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_to_moves_every_field(rng, fmt):
    # the meta device: a real move of every field that needs no GPU
    q = fk.quantize(_tensor(rng, "bfloat16"), fmt=fmt)
    m = q.to("meta")
    assert m is not q and m.dtype is torch.bfloat16 and m.shape == q.shape and m.fmt == q.fmt
    for name in ("data", "scales", "global_scale", "payload"):
        a, b = getattr(q, name), getattr(m, name)
        if a is None:
            assert b is None
        else:
            assert b.device.type == "meta" and b.dtype == a.dtype and b.shape == a.shape
    if m.payload is not None:  # FP4Quant: data and scales stay views of the one payload
        assert _root(m.data) is m.payload
        # a uint16 view of the payload's tail (a dtype view ends the _base chain)
        assert m.scales.untyped_storage().nbytes() == m.payload.nbytes
        assert m.scales.storage_offset() * 2 == m.numel() // 2


def _root(t):
    """The tensor whose memory the view ``t`` shows."""
    while t._base is not None:
        t = t._base
    return t


def test_cpu_of_device_arrays_gives_numpy(kernels, rng):
    for fmt in FORMATS:
        q = fk.quantize(_x(rng), fmt=fmt)
        if q.payload is None:
            qd = dataclasses.replace(q, **{k: cuda.to_device(getattr(q, k)) for k in _ARRAYS})
        else:  # FP4Quant: data and scales are views of the payload, as quantize() makes them
            p = cuda.to_device(q.payload)
            data, scales = payload_views(p, q.shape, q.numel(), q.block_size, "numba")
            qd = dataclasses.replace(q, payload=p, data=data, scales=scales)
            # scales that are no view of the payload: a move would give the payload's
            with pytest.raises(ValueError, match="payload: data and scales are not the views"):
                dataclasses.replace(qd, scales=cuda.to_device(q.scales)).cpu()
        h = qd.cpu()
        assert isinstance(h.data, np.ndarray) and isinstance(h.scales, np.ndarray)
        _same_q(h, q)
        assert same_bits(fk.dequantize(h), fk.dequantize(q))
        assert qd.to("cpu").shape == q.shape


def test_moves_that_cannot_be_made_are_refused(rng):
    q = fk.quantize(_tensor(rng))
    for bad in (torch.float16, torch.zeros(1), None, True, 1.5):
        with pytest.raises(TypeError, match="device: expected a torch.device"):
            q.to(bad)
    with pytest.raises(TypeError, match="device: expected a torch.device"):
        q.cuda(torch.float32)
    qn = fk.quantize(_x(rng))
    with pytest.raises(TypeError, match=r"self: .cuda\(\) moves torch tensors; these fields"):
        qn.cuda()
    with pytest.raises(TypeError, match="device: moving numpy arrays to 'cuda' is not supported"):
        qn.to("cuda")
    broken = dataclasses.replace(q, scales=q.scales.numpy())
    with pytest.raises(ValueError, match="self.scales: must live where self.data lives"):
        broken.to("cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_cuda_and_back(gpu, rng, fmt):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA build of torch")
    q = fk.quantize(_tensor(rng, "bfloat16"), fmt=fmt)
    g = q.cuda()
    assert g.data.is_cuda and g.scales.is_cuda and g.cuda() is g and g.to("cuda:0") is g
    if g.payload is not None:
        assert g.payload.is_cuda and g.data.data_ptr() == g.payload.data_ptr()
    a, b = fk.dequantize(g).cpu(), fk.dequantize(q)
    nan = torch.isnan(a)  # the input has NaN blocks: bits equal elsewhere, NaN in both places
    assert torch.equal(nan, torch.isnan(b))
    assert torch.equal(a.view(torch.int16)[~nan], b.view(torch.int16)[~nan])
    _same_q(g.cpu(), q)
    _same_q(q.to("cuda", non_blocking=True).cpu(), q)
    assert g.typed_scales().is_cuda


def test_pickle_round_trip_and_the_old_module_path(rng):
    import pickle

    from fp4_kernels import _api as old_home

    q = fk.quantize(rng.standard_normal((4, 64)).astype(np.float32))
    back = pickle.loads(pickle.dumps(q))
    assert repr(back) == repr(q)
    # pickles made when the class lived in fp4_kernels._api still load
    assert old_home.QuantizedTensor is fk.QuantizedTensor
    assert old_home.FP4Quant is fk.FP4Quant


# ------------------------------------------------------------------ pickle, copy, equality

COPY_FORMATS = [
    ("nvfp4", "linear"),
    ("nvfp4", "swizzled"),
    ("mxfp4", "linear"),
    (fk.FP4Quant(32), "linear"),
    (fk.FP4Quant(64, hadamard=False), "linear"),
]
COPY_IDS = ["nvfp4", "nvfp4-swizzled", "mxfp4", "fp4quant32", "fp4quant64-nohad"]


def _pickled(q):
    import pickle

    return pickle.loads(pickle.dumps(q))


COPIES = {
    "pickle": _pickled,
    "deepcopy": lambda q: __import__("copy").deepcopy(q),
    "copy": lambda q: __import__("copy").copy(q),
}


def _made(rng, lib, fmt, layout, dtype="bfloat16"):
    x = _tensor(rng, dtype) if lib == "torch" else _x(rng).astype(NP_DTYPES[dtype])
    return fk.quantize(x, fmt=fmt, scale_layout=layout)


def _bits16(y):
    """The raw bits of a 16-bit float result, as a numpy uint16 array."""
    if isinstance(y, torch.Tensor):
        return y.view(torch.int16).cpu().numpy().view(np.uint16)
    return y.view(np.uint16)


def _address(a):
    return a.data_ptr() if isinstance(a, torch.Tensor) else a.__array_interface__["data"][0]


@pytest.mark.parametrize("how", list(COPIES))
@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("fmt, layout", COPY_FORMATS, ids=COPY_IDS)
def test_pickle_and_copies_round_trip_every_kind(rng, fmt, layout, lib, how):
    """torch does not unpickle uint16 tensors (FP4Quant's scales); FP4Quant's data and scales
    stay views of the restored payload; a deep copy owns its memory, a shallow one shares."""
    q = _made(rng, lib, fmt, layout)
    r = COPIES[how](q)
    assert type(r) is fk.QuantizedTensor and r == q
    assert r.fmt == q.fmt and r.shape == q.shape and r.dtype == q.dtype
    assert r.scale_layout == q.scale_layout
    _same_q(r, q)
    assert np.array_equal(_bits16(fk.dequantize(r)), _bits16(fk.dequantize(q)))
    deep = how != "copy"
    if r.payload is not None:
        assert _address(r.data) == _address(r.payload)
        assert _address(r.scales) == _address(r.payload) + q.numel() // 2
        assert (_address(r.payload) != _address(q.payload)) == deep
    else:
        assert (_address(r.data) != _address(q.data)) == deep


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_pickle_keeps_fields_that_are_not_views_of_the_payload(rng, lib):
    """A hand-built FP4Quant tensor without a payload, and one whose data was replaced (not
    a view of its payload any more): each field round-trips as it is."""
    q = _made(rng, lib, fk.FP4Quant(32), "linear")
    no_payload = dataclasses.replace(q, payload=None)
    other = q.data.clone() if lib == "torch" else q.data.copy()
    other[0, 0] ^= 0xFF
    replaced = dataclasses.replace(q, data=other)
    for made in (no_payload, replaced):
        for how in COPIES.values():
            r = how(made)
            assert r == made
            _same_q(r, made)


def test_equality_is_field_wise_and_exact(rng):
    q = _made(rng, "torch", "nvfp4", "linear")
    same = dataclasses.replace(
        q, data=q.data.clone(), scales=q.scales.clone(), global_scale=q.global_scale.clone()
    )
    assert (q == same) is True and (q != same) is False and q in [None, 1, same]
    assert q == q and (q == q.data) is False and q != "nvfp4"
    changed = {
        "data": lambda: dataclasses.replace(q, data=q.data ^ 1),
        "scales": lambda: dataclasses.replace(q, scales=q.scales ^ 1),
        "global_scale": lambda: dataclasses.replace(q, global_scale=q.global_scale * 2),
        "-0": lambda: dataclasses.replace(q, global_scale=torch.tensor([0.0])),
        "fmt": lambda: dataclasses.replace(q, fmt="mxfp4"),
        "shape": lambda: dataclasses.replace(q, shape=(1, *q.shape)),
        "dtype": lambda: dataclasses.replace(q, dtype=torch.float32),
        "scale_layout": lambda: dataclasses.replace(q, scale_layout="swizzled"),
        "numpy": lambda: dataclasses.replace(
            q, data=q.data.numpy(), scales=q.scales.numpy(), global_scale=q.global_scale.numpy()
        ),
        "int8-data": lambda: dataclasses.replace(q, data=q.data.view(torch.int8)),
    }
    zero = dataclasses.replace(q, global_scale=torch.tensor([-0.0]))
    for name, make in changed.items():
        other = zero if name == "-0" else q
        assert (other == make()) is False, name
        assert other not in [make()], name
    half = dataclasses.replace(q, global_scale=torch.tensor([0.5]))
    assert half != dataclasses.replace(q, global_scale=0.5)  # an array is not a float
    nan = dataclasses.replace(q, global_scale=torch.tensor([float("nan")]))
    assert nan == dataclasses.replace(nan, global_scale=nan.global_scale.clone())  # same bits


def test_equality_of_fp4quant_and_mxfp4_without_global_scale(rng):
    q = _made(rng, "numpy", fk.FP4Quant(32), "linear")
    assert q == dataclasses.replace(q, payload=None)  # the payload holds data and scales
    m = _made(rng, "numpy", "mxfp4", "linear")
    assert m != dataclasses.replace(m, global_scale=None)
    none = dataclasses.replace(m, global_scale=None)
    assert none == dataclasses.replace(none)


def test_quantized_tensors_are_not_hashable(rng):
    """Mutable and compared by value, as a numpy array: no hash (key a dict by id(q))."""
    q = _made(rng, "numpy", "nvfp4", "linear")
    with pytest.raises(TypeError, match="unhashable"):
        hash(q)
    assert {id(q): q}[id(q)] is q


def test_equality_of_device_arrays(kernels, rng):
    q = _made(rng, "numpy", "nvfp4", "linear", "float32")
    qd = dataclasses.replace(q, **{k: cuda.to_device(getattr(q, k)) for k in _ARRAYS})
    assert qd == dataclasses.replace(q, **{k: cuda.to_device(getattr(q, k)) for k in _ARRAYS})
    assert qd != q  # numba device arrays are not numpy arrays
    flipped = q.data.copy()
    flipped[0, 0] ^= 1
    assert qd != dataclasses.replace(qd, data=cuda.to_device(flipped))


@pytest.mark.gpu
@pytest.mark.parametrize("how", list(COPIES))
@pytest.mark.parametrize("fmt, layout", COPY_FORMATS, ids=COPY_IDS)
def test_pickle_and_copies_on_cuda(gpu, rng, fmt, layout, how):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA build of torch")
    q = _made(rng, "torch", fmt, layout).cuda()
    r = COPIES[how](q)
    assert r == q and r.data.is_cuda and r.data.device == q.data.device
    _same_q(r, q)
    assert r == q.cpu().cuda() and r != q.cpu()
    if r.payload is not None:
        assert r.data.data_ptr() == r.payload.data_ptr()
        assert r.scales.data_ptr() == r.payload.data_ptr() + q.numel() // 2


def test_a_move_refuses_a_payload_whose_views_were_replaced(rng):
    """A move re-derives FP4Quant's data and scales from the moved payload: with data or
    scales replaced since quantize(), that would silently give the payload's codes back, so it
    is refused, naming the fix; without the payload the fields move as they are.  A tensor
    that stays where it is is returned as it is."""
    q = _made(rng, "torch", fk.FP4Quant(32), "linear")
    for field in ("data", "scales"):
        other = getattr(q, field).clone()
        other.view(torch.uint8)[0, 0] ^= 0xFF
        replaced = dataclasses.replace(q, **{field: other})
        with pytest.raises(ValueError, match=r"payload: .*payload=None"):
            replaced.to("meta")
        assert replaced.cpu() is replaced and replaced.to("cpu") is replaced
        moved = dataclasses.replace(replaced, payload=None).to("meta")
        assert moved.payload is None and getattr(moved, field).device.type == "meta"
    assert q.to("meta").payload is not None  # the untouched tensor still moves


def test_properties_name_a_format_set_after_construction(rng):
    """``fmt`` set to something else after quantize(): the properties that read the format
    name the field, not a KeyError."""
    q = _made(rng, "torch", "nvfp4", "linear")
    q.fmt = "nvfp5"
    for read in (lambda: q.block_size, lambda: q.nbytes, q.typed_scales):
        with pytest.raises(ValueError, match="fmt: 'nvfp5' is not one of"):
            read()
    q.fmt = 4
    with pytest.raises(TypeError, match="fmt: expected"):
        q.block_size  # noqa: B018


def test_nbytes_of_fp4quant_with_and_without_its_payload(rng):
    """FP4Quant's bytes are its codes and scales (no tensor scale), with or without the
    payload that holds them."""
    q = _made(rng, "torch", fk.FP4Quant(32), "linear")
    bare = dataclasses.replace(q, payload=None)
    assert q.nbytes == bare.nbytes == q.payload.numel() == q.numel() // 2 + q.numel() // 32 * 2
