"""The bad-input corpus: every public function of fp4_kernels with inputs a careless or hostile
caller might pass.  Each case must raise a clear exception (type and message naming the argument)
or follow the documented policy; none may crash, hang or silently differ from the reference.

The corpus runs on the CPU path (numpy and torch CPU) here and, with a real GPU, on torch CUDA
tensors (``gpu`` marker); ``compute-sanitizer --tool memcheck python -m pytest -m gpu
tests/test_bad_input.py`` checks that no kernel touches memory it was not given.
"""

from __future__ import annotations

import dataclasses
import warnings

import ml_dtypes
import numpy as np
import pytest

import fp4_kernels as fk
from fp4_kernels.testing import same_bits

torch = pytest.importorskip("torch")

FMTS = ["nvfp4", "mxfp4", fk.FP4Quant(64), fk.FP4Quant(32, hadamard=False)]
FMT_IDS = ["nvfp4", "mxfp4", "fp4quant64", "fp4quant32-nohad"]


def _places():
    places = ["numpy", "torch-cpu"]
    if torch.cuda.is_available():
        places.append(pytest.param("torch-cuda", marks=pytest.mark.gpu))
    return places


@pytest.fixture(params=_places())
def place(request):
    return request.param


def _to(place, a):
    """A numpy array as the array kind of ``place`` (same dtype, bfloat16 included)."""
    if place == "numpy":
        return a
    if a.dtype == ml_dtypes.bfloat16:
        t = torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    else:
        t = torch.from_numpy(a.copy())
    return t.cuda() if place == "torch-cuda" else t


def _x(rows=2, k=64, dtype=np.float32, seed=0):
    return np.random.default_rng(seed).standard_normal((rows, k)).astype(dtype)


# ------------------------------------------------------------------ the input array


@pytest.mark.parametrize("order", [">f4", ">f2"])
@pytest.mark.parametrize(
    "call",
    [
        lambda x: fk.quantize(x),
        lambda x: fk.quantize_dequantize(x, fmt="mxfp4"),
        lambda x: fk.quantize(x, fmt=fk.FP4Quant(64)),
        lambda x: fk.hadamard(x, group_size=16),
    ],
    ids=["quantize", "quantize_dequantize", "fp4quant", "hadamard"],
)
def test_non_native_byte_order_is_refused(call, order):
    # '>f4'.name is 'float32': read as little-endian the bytes of N(0, 1) become ~1e38
    x = _x().astype(order)
    with pytest.raises(TypeError, match=r"x: byte order '>f[24]' is not the machine's"):
        call(x)
    # the fix the message names gives the reference result
    y = fk.quantize_dequantize(x.astype(x.dtype.newbyteorder("=")))
    assert np.all(np.isfinite(y)) and np.abs(y).max() < 10


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # np.matrix itself warns
@pytest.mark.parametrize(
    "make",
    [lambda a: np.asmatrix(a), lambda a: np.ma.masked_array(a, mask=a > 1)],
    ids=["matrix", "masked"],
)
def test_ndarray_subclasses_with_non_plain_elements_are_refused(make):
    with pytest.raises(TypeError, match=r"pass np.asarray\(x\)"):
        fk.quantize(make(_x()))
    with pytest.raises(TypeError, match=r"pass np.asarray\(x\)"):
        fk.hadamard(make(_x()), group_size=16)


def test_memmap_is_an_ordinary_input(tmp_path):
    a = _x()
    m = np.memmap(tmp_path / "x.bin", np.float32, "w+", shape=a.shape)
    m[:] = a
    assert same_bits(fk.quantize_dequantize(m), fk.quantize_dequantize(a))


@pytest.mark.parametrize(
    "x, exc, match",
    [
        (np.zeros((2, 64), np.float64), TypeError, "x: dtype float64 is not supported"),
        (np.zeros((2, 64), np.int32), TypeError, "x: dtype int32"),
        (np.zeros((2, 64), np.complex64), TypeError, "x: dtype complex64"),
        (np.zeros((2, 64), bool), TypeError, "x: dtype bool"),
        (np.zeros((2, 40), np.float32), ValueError, "K=40 is not a multiple"),
        (np.zeros((64, 4), np.float32).T, ValueError, "x: must be contiguous"),
        (np.zeros((), np.float32), ValueError, "x: a 0-d array"),
        ([1.0] * 64, TypeError, "x: expected a numpy array"),
        ("x", TypeError, "x: expected a numpy array"),
        (None, TypeError, "x: expected a numpy array"),
    ],
    ids=[
        "float64",
        "int32",
        "complex",
        "bool",
        "ragged-k",
        "transposed",
        "0-d",
        "list",
        "str",
        "none",
    ],
)
@pytest.mark.parametrize("fmt", FMTS, ids=FMT_IDS)
def test_bad_x(x, exc, match, fmt):
    with pytest.raises(exc, match=match):
        fk.quantize(x, fmt=fmt)
    with pytest.raises(exc, match=match):
        fk.quantize_dequantize(x, fmt=fmt)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"seed": -1}, ValueError, r"seed: -1 is outside \[0, 18446744073709551616\)"),
        ({"seed": 2**64}, ValueError, "seed"),
        ({"seed": 1.5}, TypeError, "seed: expected an integer"),
        ({"seed": "1"}, TypeError, "seed: expected an integer"),
        ({"step": -5}, ValueError, "step: -5 is outside"),
        ({"step": 2**40}, ValueError, "step"),
        ({"step": np.float32(3)}, TypeError, "step: expected an integer"),
        ({"rounding": "up"}, ValueError, "rounding: 'up' is not one of"),
        ({"rounding": None}, ValueError, "rounding"),
        ({"fmt": "fp4"}, ValueError, "fmt: 'fp4' is not one of"),
        ({"fmt": 16}, TypeError, "fmt: expected 'nvfp4', 'mxfp4' or an FP4Quant"),
        ({"scale_layout": "tiled"}, ValueError, "scale_layout"),
    ],
)
def test_bad_options(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        fk.quantize(_x(), **kwargs)


# ------------------------------------------------------------------ tensors without plain memory


def _nested(t, layout):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: nested tensors are a prototype
        return torch.nested.nested_tensor([t, t.clone()], layout=layout)


# (id, the odd kind of a dense torch tensor t, message with {name} for the argument)
ODD_TENSORS = [
    ("meta", lambda t: t.to("meta"), r"{name}: .*meta"),
    ("nested", lambda t: _nested(t, torch.strided), r"{name}: nested tensors are not supported"),
    ("jagged", lambda t: _nested(t, torch.jagged), r"{name}: nested tensors are not supported"),
    # its memory holds t while it shows -t: a raw read would flip every sign (silently on a GPU)
    ("neg-view", torch._neg_view, r"{name}: a lazily negated .* pass {name}.resolve_neg\(\)"),
    ("sparse", lambda t: t.to_sparse(), r"{name}: layout torch.sparse_coo is not supported"),
]
ODD_IDS = [case[0] for case in ODD_TENSORS]

X_CALLS = {
    "quantize": lambda x: fk.quantize(x),
    "quantize_dequantize": lambda x: fk.quantize_dequantize(x, fmt="mxfp4"),
    "fp4quant": lambda x: fk.quantize(x, fmt=fk.FP4Quant(64)),
    "hadamard": lambda x: fk.hadamard(x, group_size=64),
}


@pytest.mark.parametrize("call", list(X_CALLS))
@pytest.mark.parametrize("case", range(len(ODD_TENSORS)), ids=ODD_IDS)
def test_torch_tensors_without_plain_memory_are_refused_as_x(case, call):
    _, odd, match = ODD_TENSORS[case]
    with pytest.raises(TypeError, match=match.format(name="x")):
        X_CALLS[call](odd(torch.from_numpy(_x())))


def test_the_fix_named_for_a_negated_view_gives_the_values_it_shows():
    t = torch.from_numpy(_x())
    for call in X_CALLS.values():
        got, want = call(torch._neg_view(t).resolve_neg()), call(-t)
        if isinstance(want, fk.QuantizedTensor):
            got, want = fk.dequantize(got), fk.dequantize(want)
        assert torch.equal(got, want)


@pytest.mark.parametrize("case", range(len(ODD_TENSORS)), ids=ODD_IDS)
def test_torch_tensors_without_plain_memory_are_refused_as_other_arguments(case):
    _, odd, _ = ODD_TENSORS[case]
    x = torch.from_numpy(_x())
    with pytest.raises((TypeError, ValueError), match="global_amax: "):
        fk.quantize(x, global_amax=odd(torch.tensor([3.0])))
    with pytest.raises((TypeError, ValueError), match="signs: "):
        fk.hadamard(x, group_size=64, signs=odd(torch.ones(64)))
    q = fk.quantize(x)
    for field in ("data", "scales", "global_scale"):
        bad = dataclasses.replace(q, **{field: odd(getattr(q, field))})
        with pytest.raises((TypeError, ValueError), match=f"q.{field}: "):
            fk.dequantize(bad)
        with pytest.raises((TypeError, ValueError), match=f"q.{field}: "):
            fk.requantized_sum(bad)
    with pytest.raises((TypeError, ValueError), match="row_scales: "):
        fk.requantized_sum(q, odd(torch.ones(q.shape[0])))


# (id, the call of a plain tensor's plan made odd, its error): what looks like that tensor to a
# plan key (a lazily negated view; a functionalized tensor, whose type is torch.Tensor's)
_PLANNED_LOOKALIKES = [
    ("neg-view", lambda call, x: call(torch._neg_view(x)), r"x: a lazily negated"),
    ("functionalized", lambda call, x: torch.func.functionalize(call)(x),
     r"x: a tensor of a torch transform"),
]  # fmt: skip


@pytest.mark.parametrize("call", list(X_CALLS))
@pytest.mark.parametrize(
    "lookalike", [c[1:] for c in _PLANNED_LOOKALIKES], ids=[c[0] for c in _PLANNED_LOOKALIKES]
)
def test_a_lookalike_on_the_planned_path_is_refused(call, lookalike):
    """On a GPU a planned call reads raw memory without a check: a tensor whose memory is not
    its values must not match the plan of its plain tensor (here torch tensors pretend to live
    on a GPU: ``_fake_cuda``, no kernel runs), and is refused, with no launch."""
    from _fake_cuda import fake_cuda

    from fp4_kernels import _plans

    odd_call, match = lookalike
    _plans.clear()
    try:
        with fake_cuda() as recorder:
            x = torch.randn(4, 64)
            for _ in range(_plans.RECORD_AT):  # the plan of this kind of call
                X_CALLS[call](x)
            assert _plans._PLANS
            recorder.launches.clear()
            with pytest.raises(TypeError, match=match):
                odd_call(X_CALLS[call], x)
            assert not recorder.launches
    finally:
        _plans.clear()


@pytest.mark.parametrize("call", list(X_CALLS))
@pytest.mark.parametrize("case", range(len(ODD_TENSORS)), ids=ODD_IDS)
def test_odd_tensors_on_the_planned_path_are_refused(case, call):
    """Every odd kind of the tensor a plan was made for (meta, nested, sparse, a negated view)
    finds no plan and is refused as on the checked path, with no launch (torch tensors pretend
    to live on a GPU: ``_fake_cuda``, where a meta tensor stays on the meta device)."""
    from _fake_cuda import fake_cuda

    from fp4_kernels import _plans

    _, odd, match = ODD_TENSORS[case]
    x = torch.randn(4, 64)
    bad = odd(x)  # (made outside the fake: torch builds a nested tensor for its device)
    _plans.clear()
    try:
        with fake_cuda() as recorder:
            for _ in range(_plans.RECORD_AT):  # the plan of this kind of call
                X_CALLS[call](x)
            assert _plans._PLANS
            recorder.launches.clear()
            with pytest.raises(TypeError, match=match.format(name="x")):
                X_CALLS[call](bad)
            assert not recorder.launches
    finally:
        _plans.clear()


@pytest.mark.gpu
def test_planned_torch_cuda_calls_refuse_what_the_unplanned_path_refuses(gpu):
    """On a real GPU: a negated view, a nested, a sparse and a meta tensor, and a float amax
    beyond float32's range, each after the plan of the same kind of call was made (planned
    calls skip the checks)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA build of torch")
    x = torch.randn(128, 256, device="cuda")
    for call in X_CALLS.values():
        call(x)
        call(x)  # planned
        for _, odd, match in ODD_TENSORS:
            with pytest.raises(TypeError, match=match.format(name="x")):
                call(odd(x))
    fk.quantize(x, global_amax=2.0)
    good = fk.quantize(x, global_amax=3.0)  # planned
    for amax in (3.5e38, np.float64(1e39), 1e300, 10**400):
        with pytest.raises(ValueError, match="global_amax: .* beyond float32's range"):
            fk.quantize(x, global_amax=amax)
    again = fk.quantize(x, global_amax=3.0)  # the plan still serves good calls
    assert torch.equal(again.data, good.data) and torch.equal(again.scales, good.scales)
    assert torch.equal(again.global_scale, good.global_scale)
    torch.cuda.synchronize()


@pytest.mark.parametrize("call", list(X_CALLS))
@pytest.mark.parametrize("flip", [(slice(None, None, -1),), (slice(None), slice(None, None, -1))])
def test_negative_strided_numpy_views_are_refused_and_the_fix_works(call, flip):
    x = _x(4, 64)
    with pytest.raises(ValueError, match=r"x: must be (C-)?contiguous.*ascontiguousarray"):
        X_CALLS[call](x[flip])
    got, want = X_CALLS[call](np.ascontiguousarray(x[flip])), X_CALLS[call](x[flip].copy())
    if isinstance(want, fk.QuantizedTensor):
        got, want = fk.dequantize(got), fk.dequantize(want)
    assert same_bits(got, want)
    # torch has no negative strides: torch.flip copies (an ordinary input)
    flipped = X_CALLS[call](torch.from_numpy(x).flip(0))
    assert torch.equal(
        _torch_result(flipped), _torch_result(X_CALLS[call](torch.from_numpy(x[::-1].copy())))
    )


def _torch_result(r):
    return fk.dequantize(r) if isinstance(r, fk.QuantizedTensor) else r


# ------------------------------------------------------------------ global_amax


@pytest.mark.parametrize(
    "amax, exc, match",
    [
        ("2.0", TypeError, "global_amax: expected a non-negative finite float or a one-element"),
        (float("nan"), ValueError, "global_amax: must be finite and >= 0"),
        (float("inf"), ValueError, "global_amax: must be finite and >= 0"),
        (-1.0, ValueError, "global_amax: must be finite and >= 0"),
        (True, TypeError, "global_amax: expected a non-negative finite float"),
        (np.zeros(0, np.float32), ValueError, "global_amax: 0 elements, expected 1"),
        (np.array([2.0, 3.0], np.float32), ValueError, "global_amax: 2 elements, expected 1"),
        (np.array([2.0]), TypeError, "global_amax: dtype float64, expected float32"),
        (np.array([2.0], ">f4"), TypeError, "global_amax: dtype >f4, expected float32"),
        (np.array([np.nan], np.float32), ValueError, "global_amax: must be finite and >= 0"),
        # beyond float32's range: float32(amax) would be inf, S silently 1 (1e38 -> 2688)
        (3.5e38, ValueError, r"global_amax: 3.5e\+38 is beyond float32's range"),
        (np.float64(1e39), ValueError, r"global_amax: np.float64\(1e\+39\) is beyond float32's"),
        (1e300, ValueError, r"global_amax: 1e\+300 is beyond float32's range"),
        (2.0**128 - 2.0**103, ValueError, "beyond float32's range"),  # rounds to inf
        (10**400, ValueError, "global_amax: an integer of 1329 bits is beyond float32's range"),
        (-(10**400), ValueError, "global_amax: must be finite and >= 0, got an integer of"),
    ],
    ids=[
        "str",
        "nan",
        "inf",
        "negative",
        "bool",
        "empty",
        "two",
        "float64",
        "big-endian",
        "nan-arr",
        "3.5e38",
        "np-1e39",
        "1e300",
        "f32-overflow",
        "int-beyond-float64",
        "negative-int-beyond-float64",
    ],
)
def test_bad_global_amax(amax, exc, match):
    with pytest.raises(exc, match=match):
        fk.quantize(_x(), fmt="nvfp4", global_amax=amax)
    with pytest.raises(exc, match=match):
        fk.quantize_dequantize(_x(), fmt="nvfp4", global_amax=amax)


def test_global_amax_up_to_float32s_range_is_that_float32():
    """The largest accepted amax is the largest float that rounds to a finite float32 (just
    below FLT_MAX + half an ulp): it quantizes as FLT_MAX itself."""
    x = np.zeros((1, 16), np.float32)
    x[0, 0] = 1e38
    flt_max = float(np.finfo(np.float32).max)
    below = np.nextafter(2.0**128 - 2.0**103, 0.0)
    ref = fk.quantize(x, global_amax=flt_max)
    for amax in (below, np.float32(flt_max), np.float64(below)):
        q = fk.quantize(x, global_amax=amax)
        assert same_bits(q.global_scale, ref.global_scale)
        assert np.array_equal(q.data, ref.data) and np.array_equal(q.scales, ref.scales)
    assert np.isfinite(ref.global_scale[0]) and ref.global_scale[0] != 1.0


def test_global_amax_beyond_float32_is_refused_on_the_planned_path():
    """A torch CUDA call whose kind of call has a plan skips the checks; a float amax goes into
    the plan's float32 argument there, so it is checked on that path too (here torch tensors
    pretend to live on a GPU: ``_fake_cuda``, no kernel runs)."""
    from _fake_cuda import fake_cuda

    from fp4_kernels import _plans

    _plans.clear()
    try:
        with fake_cuda() as recorder:
            x = torch.randn(4, 64)
            for _ in range(_plans.RECORD_AT):  # the plan of this kind of call
                fk.quantize(x, global_amax=2.0)
            n_plans = len(_plans._PLANS)
            assert n_plans == 1
            recorder.launches.clear()
            fk.quantize(x, global_amax=3.0)  # planned: launches with amax 3.0
            assert recorder.launches and len(_plans._PLANS) == n_plans
            for amax in (3.5e38, np.float64(1e39), 10**400, 2.0**128 - 2.0**103):
                recorder.launches.clear()
                with pytest.raises(ValueError, match="global_amax: .* beyond float32's range"):
                    fk.quantize(x, global_amax=amax)
                with pytest.raises(ValueError, match="global_amax: .* beyond float32's range"):
                    fk.quantize_dequantize(x, global_amax=amax)
                assert not recorder.launches
    finally:
        _plans.clear()


def test_global_amax_must_live_where_x_lives():
    with pytest.raises(ValueError, match="global_amax: must live where x lives"):
        fk.quantize(torch.zeros(2, 64), global_amax=np.ones(1, np.float32))


def test_global_amax_one_element_array_is_the_float(place):
    x = _to(place, _x())
    a = fk.quantize(x, global_amax=_to(place, np.array([3.0], np.float32)))
    b = fk.quantize(x, global_amax=3.0)
    assert np.array_equal(_np(a.data), _np(b.data))
    assert np.array_equal(_np(a.scales), _np(b.scales))


def _np(a):
    return a.detach().cpu().numpy() if hasattr(a, "detach") else np.asarray(a)


# ------------------------------------------------------------------ tampered QuantizedTensors


# (fmt id, field, dtype it is given, dtype the message expects)
_WRONG_FIELD_DTYPES = [
    ("fp4quant", "data", np.uint16, "uint8"),
    ("fp4quant", "data", np.float32, "uint8"),
    # the SIGSEGV case: uint8 scales of the right shape would be read as twice as many bytes
    ("fp4quant", "scales", np.uint8, "uint16"),
    ("mxfp4", "scales", np.int64, "uint8"),
]


def _tampered(place):
    """(fmt id, field replacement, expected exception, message) for hand-built tensors."""
    return [
        *(
            (
                fmt_id,
                lambda q, field=field, dtype=dtype: {field: _as(getattr(q, field), dtype, place)},
                TypeError,
                rf"q.{field}: dtype {np.dtype(dtype).name}, expected {expected}",
            )
            for fmt_id, field, dtype, expected in _WRONG_FIELD_DTYPES
        ),
        (
            "nvfp4",
            lambda q: {"global_scale": None},
            ValueError,
            r"q.global_scale: NVFP4 needs its tensor decode scale",
        ),
        (
            "nvfp4",
            lambda q: {"global_scale": 0.5},
            TypeError,
            r"q.global_scale: expected a one-element float32 array",
        ),
        (
            "nvfp4",
            lambda q: {"global_scale": _cat(q.global_scale, place)},
            ValueError,
            r"q.global_scale: 2 elements, expected 1",
        ),
        ("nvfp4", lambda q: {"dtype": "float64"}, TypeError, r"q.dtype: 'float64' is not"),
        ("nvfp4", lambda q: {"shape": (2, 32)}, ValueError, r"q.data: shape \(2, 32\) != expected"),
        ("nvfp4", lambda q: {"shape": (2, 60)}, ValueError, r"q.shape: last dimension 60"),
        ("nvfp4", lambda q: {"shape": [2, 64]}, TypeError, r"q.shape: expected a tuple"),
        ("nvfp4", lambda q: {"scale_layout": "tiled"}, ValueError, r"q.scale_layout"),
        ("nvfp4", lambda q: {"scales": q.scales[:, :2]}, ValueError, r"q.scales: shape \(2, 2\)"),
        ("nvfp4", lambda q: {"fmt": "nvfp8"}, ValueError, r"q.fmt: 'nvfp8' is not one of"),
        ("fp4quant", lambda q: {"scale_layout": "swizzled"}, ValueError, r"q.scale_layout"),
    ]


def _as(a, dtype, place):
    """Same shape, another element dtype (what a careless .astype / hand-built tensor gives)."""
    n = _np(a).astype(dtype)
    return _to(place, n)


def _cat(gs, place):
    return _to(place, np.concatenate([_np(gs), _np(gs)]))


_FMT_BY_ID = {"nvfp4": "nvfp4", "mxfp4": "mxfp4", "fp4quant": fk.FP4Quant(64)}


@pytest.mark.parametrize("case", range(len(_tampered("numpy"))))
def test_tampered_quantized_tensor_is_refused(place, case):
    fmt_id, change, exc, match = _tampered(place)[case]
    q = fk.quantize(_to(place, _x()), fmt=_FMT_BY_ID[fmt_id])
    bad = dataclasses.replace(q, **change(q))
    with pytest.raises(exc, match=match):
        fk.dequantize(bad)
    if len(q.shape) == 2 and fmt_id != "fp4quant":
        with pytest.raises(exc, match=match):
            fk.requantized_sum(bad)


def test_sigsegv_case_at_full_size_is_an_error():
    """200000 x 64 FP4Quant with uint8 scales used to read past the scale buffer (SIGSEGV)."""
    q = fk.quantize(np.ones((200000, 64), np.float32), fmt=fk.FP4Quant(64))
    bad = dataclasses.replace(q, scales=q.scales.astype(np.uint8))
    with pytest.raises(TypeError, match="q.scales: dtype uint8, expected uint16"):
        fk.dequantize(bad)


def test_non_contiguous_fields_are_refused():
    q = fk.quantize(_x(4, 64), fmt="mxfp4")
    with pytest.raises(ValueError, match="q.data: shape"):
        fk.dequantize(dataclasses.replace(q, data=q.data[::2]))
    data = np.zeros((2, 64), np.uint8)[:, ::2]  # right shape and dtype, strided
    with pytest.raises(ValueError, match="q.data: must be C-contiguous"):
        fk.dequantize(dataclasses.replace(fk.quantize(_x(), fmt="mxfp4"), data=data))


def test_fields_must_live_together():
    q = fk.quantize(torch.zeros(2, 64))
    with pytest.raises(ValueError, match="q.scales: must live where q.data lives"):
        fk.dequantize(dataclasses.replace(q, scales=q.scales.numpy()))
    with pytest.raises(ValueError, match="q.global_scale: must live where q.data lives"):
        fk.dequantize(dataclasses.replace(q, global_scale=q.global_scale.numpy()))


def test_mxfp4_without_global_scale_decodes():
    """MXFP4 has no tensor scale: a hand-built tensor may leave global_scale None."""
    q = fk.quantize(_x(), fmt="mxfp4")
    assert same_bits(fk.dequantize(dataclasses.replace(q, global_scale=None)), fk.dequantize(q))


@pytest.mark.parametrize("value", [2.0, 0.5, 0.0, -1.0, np.nan, np.inf])
def test_mxfp4_with_a_tensor_scale_is_refused_where_it_can_be_read(place, value):
    """MXFP4 has no tensor scale: quantize() stores [1.0] and the decode reads only the block
    scales, so another value would be silently ignored.  On the host it is refused; a GPU
    array is not read (no host synchronization), as documented: it decodes as [1.0]."""
    q = fk.quantize(_to(place, _x()), fmt="mxfp4")
    assert float(_np(q.global_scale)[0]) == 1.0
    bad = dataclasses.replace(q, global_scale=_to(place, np.array([value], np.float32)))
    if place == "torch-cuda":
        assert same_bits(_np(fk.dequantize(bad)), _np(fk.dequantize(q)))
        return
    with pytest.raises(ValueError, match=r"q.global_scale: MXFP4 has no tensor scale .* got \["):
        fk.dequantize(bad)
    with pytest.raises(ValueError, match=r"q.global_scale: MXFP4 has no tensor scale"):
        fk.requantized_sum(bad)


@pytest.mark.parametrize("dtype", ["float64", np.int8, "bf16", None.__class__])
def test_bad_dequantize_dtype(dtype):
    q = fk.quantize(_x())
    with pytest.raises(TypeError, match="dtype"):
        fk.dequantize(q, dtype=dtype)


# ------------------------------------------------------------------ hadamard


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"group_size": 24}, ValueError, "group_size: 24 is not a power of two"),
        ({"group_size": 8}, ValueError, r"group_size: 8 is not a power of two in \[16, 8192\]"),
        (
            {"group_size": 16384},
            ValueError,
            r"group_size: 16384 is not a power of two in \[16, 8192\]",
        ),
        ({"group_size": 16.0}, TypeError, "group_size"),
        ({"group_size": 16, "inverse": 1}, TypeError, "inverse: expected True or False"),
        ({"group_size": 16, "signs": -3}, ValueError, r"signs: a seed must be in \[0, 2\*\*64\)"),
        ({"group_size": 16, "signs": [1] * 15}, ValueError, "signs: expected 16 values"),
        ({"group_size": 16, "signs": [2] * 16}, ValueError, "signs: every entry must be"),
        ({"group_size": 128}, ValueError, "not a multiple of group_size=128"),
    ],
)
def test_bad_hadamard_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        fk.hadamard(_x(), **kwargs)


def test_signs_that_require_grad_are_refused():
    """The transform's gradient is taken with respect to x only; signs that require grad
    would silently get none."""
    signs = torch.ones(16).requires_grad_()
    for x in (torch.from_numpy(_x()), torch.from_numpy(_x()).requires_grad_()):
        with pytest.raises(ValueError, match=r"signs: .* requires grad.*signs.detach\(\)"):
            fk.hadamard(x, group_size=16, signs=signs)
        y = fk.hadamard(x, group_size=16, signs=signs.detach())  # the fix named
        assert torch.equal(y.detach(), fk.hadamard(x.detach(), group_size=16, signs=[1] * 16))
    with torch.no_grad():  # no graph is recorded: nothing to drop
        fk.hadamard(torch.from_numpy(_x()), group_size=16, signs=signs)


# ------------------------------------------------------------------ documented policies


@pytest.mark.parametrize("fmt", FMTS, ids=FMT_IDS)
def test_non_finite_inputs_follow_the_policy(place, fmt):
    """A block (group) holding NaN or +-Inf decodes to NaN; every other block is unaffected."""
    x = _x(4, 64)
    x[1, 3] = np.nan
    x[2, 40] = -np.inf
    y = _np(fk.quantize_dequantize(_to(place, x), fmt=fmt))
    clean = _np(fk.quantize_dequantize(_to(place, np.where(np.isfinite(x), x, 0)), fmt=fmt))
    block = fmt.group_size if isinstance(fmt, fk.FP4Quant) else fk.FORMATS[fmt]
    bad = np.zeros_like(x, bool)
    bad[1, :block] = True
    bad[2, 40 // block * block : 40 // block * block + block] = True
    assert np.all(np.isnan(y[bad]))
    assert same_bits(y[~bad], clean[~bad])  # (NVFP4 too: its tensor amax ignores non-finite)
    assert np.all(np.isfinite(y[~bad]))


def test_fp4quant_range_near_float32_max_is_documented():
    """docs/fp4quant.md: with the transform, a group whose transform overflows float32 decodes
    to NaN; without it, the group scale is amax / 6 rounded up, so an amax within 2^-8 of
    FLT_MAX decodes its largest elements to +-inf."""
    x = np.zeros((1, 64), np.float32)
    x[0, 0], x[0, 1] = 3.4e38, -3.0e38
    assert np.all(np.isnan(fk.quantize_dequantize(x, fmt=fk.FP4Quant(64))))
    y = fk.quantize_dequantize(x, fmt=fk.FP4Quant(64, hadamard=False))
    assert y[0, 0] == np.inf and y[0, 1] == -np.inf and np.all(y[0, 2:] == 0)
    x[0, 0], x[0, 1] = 3.3e38, -3.0e38  # below the threshold: finite
    assert np.all(np.isfinite(fk.quantize_dequantize(x, fmt=fk.FP4Quant(64, hadamard=False))))


def test_hadamard_overflow_is_float32_arithmetic():
    """The transform adds in float32 before scaling: partial sums above FLT_MAX are +-inf (and
    inf - inf is NaN), as the docstring states; below FLT_MAX / g nothing overflows."""
    big = np.finfo(np.float32).max
    h = np.zeros((1, 16), np.float32)
    h[0, :2] = big
    y = fk.hadamard(h, group_size=16)
    assert np.all(np.isinf(y[0, 0::2])) and np.all(y[0, 1::2] == 0)
    h[0, :2] = big / 16
    assert np.all(np.isfinite(fk.hadamard(h, group_size=16)))


def test_empty_tensors_round_trip(place):
    for fmt in FMTS:
        x = _to(place, np.zeros((0, 64), np.float32))
        q = fk.quantize(x, fmt=fmt)
        assert tuple(fk.dequantize(q).shape) == (0, 64)
    assert tuple(fk.hadamard(_to(place, np.zeros((0, 64), np.float32)), group_size=64).shape) == (
        0,
        64,
    )


@pytest.mark.parametrize("args", [(-1, 4), (128, -4), (1.5, 4), ("a", 4)])
def test_bad_swizzled_scale_shape(args):
    with pytest.raises((TypeError, ValueError), match="rows|blocks_per_row"):
        fk.swizzled_scale_shape(*args)


# ---------------------------------------------------------------------- torch transforms

# (id, a function of a call and a tensor: the call's result on the tensor inside the transform)
TRANSFORMS = [
    ("functionalize", lambda call, t: torch.func.functionalize(call)(t)),
    ("vmap", lambda call, t: torch.func.vmap(call)(t.unsqueeze(0))),
    # (the differentiable ops are autograd Functions without setup_context: under grad torch
    # itself refuses them, naming the functorch transforms)
    ("grad", lambda call, t: torch.func.grad(lambda u: _summed(call(u)))(t)),
]
_DIFFERENTIABLE = ("quantize_dequantize", "hadamard")
_TRANSFORMED = r"x: a tensor of a torch transform .* call fp4_kernels outside the transform"


def _summed(y):
    return (fk.dequantize(y) if isinstance(y, fk.QuantizedTensor) else y).sum()


@pytest.mark.parametrize("call", list(X_CALLS))
@pytest.mark.parametrize("transform", [t[1] for t in TRANSFORMS], ids=[t[0] for t in TRANSFORMS])
def test_tensors_of_torch_transforms_are_refused(call, transform):
    """A functionalized tensor's memory is not its values (read raw, it gave NaN or garbage; a
    row_scales one crashed the process); vmap's and grad's wrappers have none: refused."""
    grad = transform is TRANSFORMS[2][1]
    kind, match = (RuntimeError, "functorch transforms") if grad else (TypeError, _TRANSFORMED)
    if call not in _DIFFERENTIABLE:
        kind, match = TypeError, _TRANSFORMED
    with pytest.raises(kind, match=match):
        transform(X_CALLS[call], torch.from_numpy(_x()))


def test_fake_tensors_and_transformed_arguments_are_refused():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.from_numpy(_x()))
    with pytest.raises(TypeError, match=_TRANSFORMED):
        fk.quantize(fake)
    q = fk.quantize(torch.from_numpy(_x()))
    with pytest.raises(TypeError, match=r"row_scales: a tensor of a torch transform"):
        torch.func.functionalize(lambda r: fk.requantized_sum(q, r).data)(torch.ones(2))


# ---------------------------------------------------------------------- values a host reads


@pytest.mark.parametrize("kw", [{"seed": True}, {"step": True}], ids=["seed", "step"])
def test_bools_are_not_counters(kw):
    """``True`` for 1 is a slip (np.bool_ was refused already): refused as the other bools."""
    with pytest.raises(TypeError, match=f"{next(iter(kw))}: expected an integer, got bool"):
        fk.quantize(_x(), rounding="stochastic", **kw)


def test_fp4quant_takes_numpy_integers_as_ints():
    g = fk.FP4Quant(np.int64(64))
    assert type(g.group_size) is int and g == fk.FP4Quant(64)
    x = _x()
    assert same_bits(
        fk.quantize_dequantize(x, fmt=g), fk.quantize_dequantize(x, fmt=fk.FP4Quant(64))
    )


@pytest.mark.parametrize("value", [-1.0, 0.0, float("nan"), float("inf")])
def test_host_tensor_decode_scales_are_positive_and_finite(value):
    """On the CPU, where they are read anyway: a negative row scale subtracted its row, a zero
    one dropped it, a NaN or infinite one made the whole sum NaN, a negative global_scale
    flipped every sign; all silently."""
    for lib in ("numpy", "torch"):
        q = fk.quantize(_x() if lib == "numpy" else torch.from_numpy(_x()))
        rows = np.ones(q.shape[0], np.float32)
        rows[1] = value
        with pytest.raises(ValueError, match=r"row_scales: row 1's decode scale .* positive"):
            fk.requantized_sum(q, rows if lib == "numpy" else torch.from_numpy(rows))
        gs = np.array([value], np.float32)
        bad = dataclasses.replace(q, global_scale=gs if lib == "numpy" else torch.from_numpy(gs))
        with pytest.raises(ValueError, match=r"q.global_scale: .*positive and finite"):
            fk.dequantize(bad)


# ---------------------------------------------------------------------- the oracles


def test_hadamard_reference_takes_a_seed_as_the_transform_does():
    """``signs=1234`` is seed 1234's +-1 vector (it multiplied by 1234); the groups must
    tile the last dimension (they ran across rows); signs are g values of +-1."""
    from fp4_kernels.formats import hadamard as h

    x = _x(2, 128)
    want = h.hadamard_reference(x, 64, signs=h.hadamard_signs(64, 1234))
    assert same_bits(h.hadamard_reference(x, 64, signs=1234), want)
    assert same_bits(h.hadamard_reference(x, 64, signs=np.int64(1234)), want)
    assert same_bits(fk.hadamard(x, group_size=64, signs=1234), want)
    with pytest.raises(ValueError, match="not a multiple of 64"):
        h.hadamard_reference(np.zeros((4, 32), np.float32), 64)
    for bad in (np.full(64, 2.0), np.full(64, np.nan), np.ones(63)):
        with pytest.raises(ValueError, match=r"signs: expected 64 values of \+1 / -1"):
            h.hadamard_reference(x, 64, signs=bad)
    with pytest.raises(TypeError, match="signs: expected a seed"):
        h.hadamard_reference(x, 64, signs="abc")


def test_fp4quant_dequantize_reference_checks_the_scales_shape():
    from fp4_kernels.formats import fp4quant

    codes, scales = fp4quant.quantize_reference(_x(2, 128), 64)
    with pytest.raises(ValueError, match=r"scales: expected uint16 bf16 bits of shape \(2, 2\)"):
        fp4quant.dequantize_reference(codes, scales[:1, :1], 64)
    with pytest.raises(ValueError, match="scales: expected uint16"):
        fp4quant.dequantize_reference(codes, scales.astype(np.float32), 64)


def test_testing_helpers_refuse_what_they_do_not_cover():
    from fp4_kernels import testing

    for fmt in ("fp4quant", fk.FP4Quant(64), "NVFP4"):
        with pytest.raises(ValueError, match="fmt: .* is not 'nvfp4' or 'mxfp4'"):
            testing.reference_quantization(_x(), fmt)
    with pytest.raises(ValueError, match="scale_layout: 'tiled'"):
        testing.reference_quantization(_x(), "nvfp4", scale_layout="tiled")
    assert same_bits(np.ones(3), np.ones(3)) and not same_bits(np.ones(3), -np.ones(3))
    assert same_bits(np.array([np.nan, 1.0]), np.array([np.nan, 1.0]))
    with pytest.raises(TypeError, match="same_bits: compares float arrays"):
        same_bits(np.ones(3, bool), np.ones(3, bool))


def test_e8m0_exponents_clip_in_their_own_dtype():
    """A uint64 exponent above 2**63 wrapped negative through int64 (2**64 - 1 -> 126)."""
    from fp4_kernels.formats.e8m0 import encode_e8m0_exponent

    assert encode_e8m0_exponent(np.array([2**64 - 1, 5], np.uint64)).tolist() == [254, 132]
    assert encode_e8m0_exponent(np.array([-128, 127], np.int8)).tolist() == [0, 254]


def test_odd_step_and_signs_arguments_are_named_with_the_reason():
    """A nested step raised torch's internal error; a sparse or negated one, and signs torch or
    numpy cannot read as numbers, gave messages without the reason or without the argument."""
    x = torch.from_numpy(_x())
    for odd, why in (
        (_nested(torch.tensor([3]), torch.strided), "nested tensors are not supported"),
        (torch.tensor([3]).to_sparse(), "layout torch.sparse_coo"),
        (torch._neg_view(torch.tensor([3])), "lazily negated"),
    ):
        with pytest.raises(ValueError, match=f"^step: expected an int .*{why}"):
            fk.quantize(x, rounding="stochastic", step=odd)
    for bad in (torch.ones(64).to(torch.float8_e4m3fn), {1: 2}, "abc"):
        with pytest.raises(TypeError, match=r"^signs: expected a seed \(int\) or 64 values"):
            fk.hadamard(x, group_size=64, signs=bad)


def test_helpers_name_their_bad_arguments():
    from fp4_kernels import report, testing
    from fp4_kernels.formats import hadamard as h, scale_layout

    w = _x(2, 64)
    for fmt, match in (("fp8", "fmt: 'fp8' is not one of"), ("fp4quant-gx", "fp4quant-g<G>")):
        with pytest.raises(ValueError, match=match):
            report.evaluate(w, fmt)
    with pytest.raises(ValueError, match="a seed must be in"):
        h.sign_words(64, -1)
    with pytest.raises(TypeError, match="a seed is an int, got bool"):
        h.sign_words(64, True)
    with pytest.raises(TypeError):
        scale_layout.swizzled_shape(1.5, 4)
    assert scale_layout.swizzled_shape(np.int64(130), 5) == (256, 8)
    with pytest.raises(ValueError, match="adversarial_blocks: .* block 0 > 0"):
        testing.adversarial_blocks(np.random.default_rng(0), 2, 64, 0)


@pytest.mark.parametrize(
    "kw",
    [{"scale_layout": np.array(["linear", "x"])}, {"rounding": np.array(["nearest"])}],
    ids=["layout", "rounding"],
)
def test_array_valued_choices_are_named(kw):
    """An array for a string choice raised numpy's "truth value is ambiguous"."""
    with pytest.raises(ValueError, match=f"{next(iter(kw))}: .* is not one of"):
        fk.quantize(_x(), **kw)
