"""Launch plans (``fp4_kernels._plans``): a planned torch CUDA call queues exactly the launches
of the unplanned path, and a plan is never reused for a call it does not fit.

Without a GPU: torch tensors pretend to live on cuda:0 (``_fake_cuda``), launches are recorded
with their packed parameters, and the pointers in them are read back as (output field, offset)
so that the two paths' launches compare although their allocations differ.  On a GPU,
``test_planned_results_equal_unplanned_on_the_gpu`` compares the bits of every op.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from _fake_cuda import Pointer, fake_cuda  # noqa: E402

import fp4_kernels as fk  # noqa: E402
from fp4_kernels import _plans  # noqa: E402
from fp4_kernels.cuda.launch import launch_policy  # noqa: E402

G64 = fk.FP4Quant(group_size=64)


@pytest.fixture
def fake():
    _plans.clear()
    with fake_cuda() as recorder:
        yield recorder
    _plans.clear()


def _tensors(result):
    """(name, tensor) of what a call returned (a tensor or a QuantizedTensor's fields)."""
    if isinstance(result, fk.QuantizedTensor):
        fields = ("data", "scales", "global_scale", "payload")
        return [(f, getattr(result, f)) for f in fields if getattr(result, f) is not None]
    return [("out", result)]


def _roles(launches, named, unnamed=None):
    """The launches' values with each pointer (an array's data field) read as (name, byte offset)
    inside a named tensor, or else as ``unnamed(pointer)`` (default: ("scratch", the order of
    its first appearance): buffers that the call does not return)."""
    ranges = [(t.data_ptr(), t.numel() * t.element_size(), name) for name, t in named]
    if unnamed is None:
        anonymous = {}

        def unnamed(v):
            return ("scratch", anonymous.setdefault(v, len(anonymous)))

    def role(v):
        if not isinstance(v, Pointer):
            return v
        for start, nbytes, name in ranges:
            if start <= v < start + max(nbytes, 1):
                return (name, v - start)
        return unnamed(v)

    return [
        (kernel, blocks, threads, stream, tuple(role(v) for v in values))
        for kernel, blocks, threads, stream, values in launches
    ]


def _launches(recorder, call, inputs):
    """Run ``call``; its result and its launches with pointers read as roles."""
    recorder.launches.clear()
    result = call()
    return result, _roles(recorder.launches, list(inputs.items()) + _tensors(result))


def _compare(recorder, call, inputs, new_plan=True):
    with _plans.disabled():
        ref_result, ref = _launches(recorder, call, inputs)
    assert ref, "the unplanned path launched nothing"
    n_plans = len(_plans._PLANS)
    first_result, first = _launches(recorder, call, inputs)  # unplanned: a first call
    if new_plan:
        assert len(_plans._PLANS) == n_plans
    cold_result, cold = _launches(recorder, call, inputs)  # records the plan, then runs it
    n_cold = len(_plans._PLANS)
    if new_plan:
        assert n_cold == n_plans + 1
    warm_result, warm = _launches(recorder, call, inputs)  # the plan alone
    assert len(_plans._PLANS) == n_cold
    assert first == ref
    assert cold == ref
    assert warm == ref
    for r in (first_result, cold_result, warm_result):
        _same_structure(r, ref_result)
    return warm_result


def _planned(call):
    """``call()`` run until its plan is made (``_plans.RECORD_AT`` calls); the last result."""
    for _ in range(_plans.RECORD_AT):
        result = call()
    return result


def _same_structure(a, b):
    if isinstance(b, fk.QuantizedTensor):
        assert isinstance(a, fk.QuantizedTensor)
        assert repr(a.fmt) == repr(b.fmt) and a.shape == b.shape and a.dtype == b.dtype
        assert a.scale_layout == b.scale_layout
        for (na, ta), (nb, tb) in zip(_tensors(a), _tensors(b), strict=True):
            assert na == nb and ta.dtype == tb.dtype and ta.shape == tb.shape
            assert ta.is_contiguous() and ta.data_ptr() % 16 == 0
        assert fk.dequantize is not None
    else:
        assert a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous()


def _x(shape=(64, 256), dtype=torch.bfloat16, offset=0):
    flat = torch.randn(offset + math.prod(shape)).to(dtype)
    return flat[offset:].reshape(shape)


QUANTIZE_CASES = {
    "nvfp4": {},
    "nvfp4_stochastic": {"rounding": "stochastic", "seed": 2**40 + 12345, "step": 777},
    "nvfp4_swizzled": {"scale_layout": "swizzled"},
    "nvfp4_amax_float": {"global_amax": 3.5},
    "mxfp4": {"fmt": "mxfp4"},
    "mxfp4_stochastic": {"fmt": "mxfp4", "rounding": "stochastic", "seed": 5, "step": 9},
    "fp4quant": {"fmt": G64},
    "fp4quant_no_hadamard_sr": {"fmt": fk.FP4Quant(128, hadamard=False), "rounding": "stochastic"},
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("case", sorted(QUANTIZE_CASES))
@pytest.mark.parametrize("fused", [False, True])
def test_planned_quantize_launches_what_the_unplanned_path_launches(fake, case, dtype, fused):
    x = _x(dtype=dtype)
    kw = QUANTIZE_CASES[case]
    f = fk.quantize_dequantize if fused else fk.quantize
    if fused and "scale_layout" in kw:
        pytest.skip("quantize_dequantize has no scale layout")
    _compare(fake, lambda: f(x, **kw), {"x": x})


def test_planned_quantize_with_an_amax_tensor(fake):
    x = _x()
    amax = x.float().abs().amax().reshape(1)
    _compare(fake, lambda: fk.quantize(x, global_amax=amax), {"x": x, "amax": amax})


def test_unaligned_input_gets_the_unaligned_plan(fake):
    aligned, unaligned = _x(), _x(offset=1)  # 2 bytes off a 16-byte boundary
    assert unaligned.data_ptr() % 16
    for x in (aligned, unaligned):
        _compare(fake, lambda: fk.quantize(x), {"x": x})  # noqa: B023
        _compare(fake, lambda: fk.hadamard(x, group_size=64), {"x": x})  # noqa: B023
    kernels = {launch[0] for launch in fake.launches}
    assert kernels  # the two alignments do not share a plan: the comparisons above hold


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", G64])
@pytest.mark.parametrize("out", [None, torch.float32, "float16"])
def test_planned_dequantize_launches_what_the_unplanned_path_launches(fake, fmt, out):
    x = _x()
    with _plans.disabled():
        q = fk.quantize(x, fmt=fmt)
    named = {
        f: getattr(q, f) for f in ("data", "scales", "global_scale") if getattr(q, f) is not None
    }
    _compare(fake, lambda: fk.dequantize(q, out), named)


def test_planned_dequantize_of_swizzled_scales(fake):
    with _plans.disabled():
        q = fk.quantize(_x(), scale_layout="swizzled")
    _compare(fake, lambda: fk.dequantize(q), {"data": q.data, "scales": q.scales})


@pytest.mark.parametrize("signs", [None, 7])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("g", [16, 256, 2048])
def test_planned_hadamard_launches_what_the_unplanned_path_launches(fake, g, inverse, signs):
    x = _x((8, 4096))
    _compare(fake, lambda: fk.hadamard(x, group_size=g, inverse=inverse, signs=signs), {"x": x})


@pytest.mark.parametrize("g,ctas", [(1024, None), (2048, 6), (4096, 4)])
def test_transform_carveout_is_set_once(fake, monkeypatch, g, ctas):
    """The prefetching transform asks for a carveout of 384 threads' CTAs at g = 2048 and 512
    from 4096 (a CTA of g / 32 threads is one group), none below; planned calls keep the
    kernel's attribute."""
    monkeypatch.setenv("FP4_HADAMARD_VARIANT", "smem-pf")
    x = _x((8, 4096))
    for _ in range(3):
        fk.hadamard(x, group_size=g)
    if ctas is None:
        assert fake.carveouts == {}
    else:
        assert list(fake.carveouts.values()) == [ctas]


def test_a_launch_policy_sizes_every_kernels_carveout(fake, monkeypatch):
    """``launch_policy(threads_per_sm=N)`` sizes the carveout of any kernel for N threads an SM,
    0 gives it back to the driver, and outside the policy each op's own choice returns: the
    kernel's attribute follows the latest launch."""
    monkeypatch.setenv("FP4_HADAMARD_VARIANT", "smem-pf")
    x = _x((8, 4096))

    def transform_carveout(**policy):
        with launch_policy(**policy):
            fk.hadamard(x, group_size=4096)
        (value,) = fake.carveouts.values()
        return value

    assert transform_carveout(threads_per_sm=640) == 5  # CTAs of 128
    assert transform_carveout() == 4  # the transform's 512 threads an SM
    assert transform_carveout(threads_per_sm=0) is None  # the driver's
    with launch_policy(threads_per_sm=512):
        fk.quantize(x, fmt=G64)  # the FP4Quant encoder: the driver's unless a policy says
    assert sorted(v for v in fake.carveouts.values() if v is not None) == [4]  # CTAs of 128
    with pytest.raises(ValueError, match="threads_per_sm: -1 is negative"):
        with launch_policy(threads_per_sm=-1):
            pass


def test_a_planned_call_sets_the_carveout_it_was_recorded_with(fake, monkeypatch):
    """The carveout is an attribute of the kernel that follows its latest launch: a planned
    call after a launch of another policy sizes it again as its plan was recorded (the
    transform's 4 CTAs an SM at g = 4096 after the driver's choice; the FP4Quant encoder's
    driver choice after 4)."""
    monkeypatch.setenv("FP4_HADAMARD_VARIANT", "smem-pf")
    x = _x((8, 4096))

    def carveouts(op, **policy):
        """The carveouts of the kernels ``op`` launched, as they are after it."""
        fake.launches.clear()
        with launch_policy(**policy):
            op()
        return [fake.carveouts.get(launched[0], "unset") for launched in fake.launches]

    def transform():
        fk.hadamard(x, group_size=4096)

    def encode():
        fk.quantize(x, fmt=G64)

    for _ in range(3):  # unplanned, recorded, planned
        assert carveouts(transform) == [4]
        assert carveouts(encode) == ["unset"]  # the driver's, never set
    assert carveouts(transform, threads_per_sm=0) == [None]
    assert carveouts(encode, threads_per_sm=512) == [4]  # CTAs of 128
    assert carveouts(transform) == [4]  # the plans' launches size them again
    assert carveouts(encode) == [None]


@pytest.mark.parametrize(
    "policy, error, message",
    [
        ({"max_blocks": 2.0}, TypeError, "max_blocks: expected an int or None, got float"),
        ({"threads": 64.0}, TypeError, "threads: expected an int or None, got float"),
        ({"lanes_per_block": True}, TypeError, "lanes_per_block: expected an int or None"),
        ({"threads_per_sm": 512.0}, TypeError, "threads_per_sm: expected an int or None"),
        ({"max_blocks": 0}, ValueError, "max_blocks: 0 is not positive"),
        ({"max_blocks": -3}, ValueError, "max_blocks: -3 is not positive"),
    ],
)
def test_a_launch_policy_takes_ints(fake, policy, error, message):
    """A float or bool field equal to an int compared equal to it, so a call under it reused
    the int policy's plan (or failed in its unplanned launch); max_blocks = 0 gave empty
    grids.  Refused when the block is entered; a numpy integer is an int."""
    with pytest.raises(error, match=message):
        with launch_policy(**policy):
            pass
    with launch_policy(max_blocks=np.int64(2), threads=np.int32(64)):
        fk.quantize(_x((8, 64)))
    assert {launched[1:3] for launched in fake.launches} <= {(1, 64), (2, 64)}


def _wire_roles(launches, named):
    """``_roles`` with a pointer outside the named tensors read as ("wire", offset from the
    first such pointer): the one buffer a call does not return, FP4Quant's wire buffer between
    its encoding and its decoding."""
    wire = []

    def unnamed(v):
        wire[:] = wire or [v]
        return ("wire", v - wire[0])

    return _roles(launches, list(named.items()), unnamed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", [G64, fk.FP4Quant(128, hadamard=False)])
def test_fp4quant_quantize_dequantize_launches_quantize_then_dequantize(fake, fmt, dtype):
    """FP4Quant's quantize_dequantize is one host function and one plan: unplanned, at the
    first planned call and warm, the launches of ``dequantize(quantize(x))``, the same kernels
    with the same arguments, the payload a buffer of the call's own."""
    x = _x(dtype=dtype)
    with _plans.disabled():
        fake.launches.clear()
        q = fk.quantize(x, fmt=fmt, rounding="stochastic", seed=9, step=4)
        out = fk.dequantize(q)
        ref = _wire_roles(fake.launches, {"x": x, "wire": q.payload, "out": out})
    assert len(ref) == 2
    for planned in (False, True, True):
        fake.launches.clear()
        with contextlib.ExitStack() as stack:
            if not planned:
                stack.enter_context(_plans.disabled())
            y = fk.quantize_dequantize(x, fmt=fmt, rounding="stochastic", seed=9, step=4)
        assert _wire_roles(fake.launches, {"x": x, "out": y}) == ref
        assert y.dtype == out.dtype and y.shape == out.shape
    assert len(_plans._PLANS) == 1


def test_fp4quant_plans_follow_the_format_fields(fake):
    """A plan key holds an FP4Quant as its fields: equal formats share a plan, other group
    sizes or transforms get their own, a tuple of the same fields is still refused, and the
    result carries the caller's format object (a subclass's too)."""

    class Named(fk.FP4Quant):
        pass

    x = _x()
    q = _planned(lambda: fk.quantize(x, fmt=fk.FP4Quant(64)))
    assert len(_plans._PLANS) == 1
    again = fk.FP4Quant(64)
    assert fk.quantize(x, fmt=again).fmt is again and len(_plans._PLANS) == 1
    _planned(lambda: fk.quantize(x, fmt=fk.FP4Quant(128)))
    _planned(lambda: fk.quantize(x, fmt=fk.FP4Quant(64, hadamard=False)))
    assert len(_plans._PLANS) == 3
    with pytest.raises(TypeError, match="fmt"):
        fk.quantize(x, fmt=(64, True))
    sub = Named(64)
    named = _compare(fake, lambda: fk.quantize(x, fmt=sub), {"x": x})
    assert named.fmt is sub and named.shape == q.shape
    fk.dequantize(named)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_planned_requantized_sum_launches_what_the_unplanned_path_launches(fake, fmt):
    with _plans.disabled():
        q = fk.quantize(_x((4, 1024), torch.float32), fmt=fmt)
    inputs = {"data": q.data, "scales": q.scales}
    if fmt == "nvfp4":
        inputs["global_scale"] = q.global_scale
    _compare(fake, lambda: fk.requantized_sum(q), inputs)


def test_planned_requantized_sum_with_row_scales_is_a_plan_of_its_own(fake):
    """row_scales (op "requantized_sum_rows") is in the key, by its tensor key: another
    tensor of the same kind reuses the plan with its own pointer; one scale for every row,
    or row scales of another kind, are other plans."""
    with _plans.disabled():
        q = fk.quantize(_x((4, 1024), torch.float32))
    rs = torch.rand(4) + 0.5
    inputs = {"data": q.data, "scales": q.scales, "row_scales": rs}
    _compare(fake, lambda: fk.requantized_sum(q, rs), inputs)
    (key,) = _plans._PLANS
    assert key.op == "requantized_sum_rows" and key.row_scales == _plans.tensor_key(rs)
    other = torch.rand(4) + 0.5
    inputs["row_scales"] = other
    _compare(fake, lambda: fk.requantized_sum(q, other), inputs, new_plan=False)
    _planned(lambda: fk.requantized_sum(q))
    with pytest.raises(ValueError, match="row_scales: must be C-contiguous"):
        fk.requantized_sum(q, torch.rand(8)[::2])  # a key of its own: checked, no plan
    assert len(_plans._PLANS) == 2


def test_each_call_gets_its_own_seed_and_step(fake):
    x = _x()
    for seed, step in [(1, 2), (2**64 - 1, 2**32 - 1), (0, 0)]:
        kw = {"rounding": "stochastic", "seed": seed, "step": step}
        _compare(fake, lambda: fk.quantize(x, **kw), {"x": x})  # noqa: B023
        _plans.clear()
        _compare(fake, lambda: fk.quantize(x, fmt=G64, **kw), {"x": x})  # noqa: B023
        _plans.clear()


def test_each_call_gets_its_own_float_amax(fake):
    """... launched as the unplanned path launches it (-0.0 as 0.0: a plan's patch adds)."""
    x = _x()
    _planned(lambda: fk.quantize(x, global_amax=1.0))
    _planned(lambda: fk.quantize_dequantize(x, global_amax=1.0))
    for amax in (2.5, 0.0, -0.0, 1e30, 7, np.float32(0.25), np.int64(3), np.float32(-0.0)):
        _compare(fake, lambda: fk.quantize(x, global_amax=amax), {"x": x}, new_plan=False)  # noqa: B023
        _compare(fake, lambda: fk.quantize_dequantize(x, global_amax=amax), {"x": x}, False)  # noqa: B023
    assert len(_plans._PLANS) == 2


def test_a_launch_policy_is_part_of_the_plan(fake):
    x = _x()
    _compare(fake, lambda: fk.quantize(x), {"x": x})
    with launch_policy(threads=64, max_blocks=3, lanes_per_block=1):
        _compare(fake, lambda: fk.quantize(x), {"x": x})
        assert {launch[2] for launch in fake.launches} == {64}


def test_same_shape_other_dtype_gets_its_own_plan(fake):
    x16 = _x(dtype=torch.bfloat16)
    _planned(lambda: fk.quantize(x16))
    x = _x(dtype=torch.float32)
    _compare(fake, lambda: fk.quantize(x), {"x": x})
    q = fk.quantize(x)
    assert q.dtype == torch.float32
    assert len(_plans._PLANS) == 2


def test_non_contiguous_input_after_a_contiguous_one_is_refused(fake):
    x = _x((256, 256))
    fk.quantize(x)
    fk.hadamard(x, group_size=256)
    for bad in (x.t(), x[:, ::2].repeat_interleave(2, dim=1).t()):
        assert bad.shape == x.shape and not bad.is_contiguous()
        with pytest.raises(ValueError, match="contiguous"):
            fk.quantize(bad)
        with pytest.raises(ValueError, match="contiguous"):
            fk.hadamard(bad, group_size=256)


@pytest.mark.parametrize("new_shape", [False, True])
def test_bad_arguments_after_a_planned_call_are_refused(fake, new_shape):
    x = _x()
    n_plans = len(_plans._PLANS)
    _planned(lambda: fk.quantize(x, rounding="stochastic"))
    _planned(lambda: fk.quantize(x, global_amax=1.0))
    _planned(lambda: fk.quantize(x, fmt=G64))
    assert len(_plans._PLANS) == n_plans + 3 and len(_plans._KINDS) == 3
    if new_shape:  # of the planned kinds: their plans made from the kinds' before any check
        x = _x((3, 256))
    with pytest.raises(ValueError, match="seed"):
        fk.quantize(x, rounding="stochastic", seed=-1)
    with pytest.raises(ValueError, match="seed"):
        fk.quantize(x, rounding="stochastic", seed=2**64)
    with pytest.raises(ValueError, match="step"):
        fk.quantize(x, rounding="stochastic", step=2**32)
    with pytest.raises(TypeError, match="seed"):
        fk.quantize(x, rounding="stochastic", seed=1.0)
    with pytest.raises(ValueError, match="step"):
        fk.quantize(x, fmt=G64, step=-1)
    for amax in (float("nan"), float("inf"), -1.0, -1, np.float32("nan"), np.float64(-2)):
        with pytest.raises(ValueError, match="global_amax"):
            fk.quantize(x, global_amax=amax)
    with pytest.raises(ValueError, match="rounding"):
        fk.quantize(x, rounding="up")
    with pytest.raises(TypeError, match="fmt"):
        fk.quantize(x, fmt=["nvfp4"])  # unhashable: no plan lookup can fail on it


@pytest.mark.parametrize("new_shape", [False, True])
def test_a_tampered_quantized_tensor_after_a_planned_dequantize_is_refused(fake, new_shape):
    import dataclasses

    q = fk.quantize(_x())
    _planned(lambda: fk.dequantize(q))
    assert len(_plans._KINDS) == 1
    if new_shape:  # of the planned kind: its plan made from the kind's once the fields agree
        q = fk.quantize(_x((48, 256)))
        n_plans = len(_plans._PLANS)
        with pytest.raises(ValueError, match="shape"):  # rows of data, shape of another
            fk.dequantize(dataclasses.replace(q, shape=(32, 256)))
        with pytest.raises(ValueError, match="scales"):
            fk.dequantize(dataclasses.replace(q, scales=q.scales[:-1]))
        assert len(_plans._PLANS) == n_plans
    bad_shapes = [(64.0, 256), (64, 256.0)]
    for shape in bad_shapes:
        with pytest.raises(TypeError, match="shape"):
            fk.dequantize(dataclasses.replace(q, shape=shape))
    with pytest.raises(ValueError, match="global_scale"):
        fk.dequantize(dataclasses.replace(q, global_scale=None))
    with pytest.raises(TypeError, match="data"):
        fk.dequantize(dataclasses.replace(q, data=q.data.view(torch.int8)))
    with pytest.raises(ValueError, match="scales"):
        fk.dequantize(dataclasses.replace(q, scales=q.scales[:-1]))
    with pytest.raises(ValueError, match="shape"):
        fk.dequantize(dataclasses.replace(q, shape=(32, 512)))  # data's shape no longer fits


def test_another_device_gets_its_own_plan(fake):
    x0 = _x()
    x1 = _x()
    x1.fake_device = torch.device("cuda", 1)
    _planned(lambda: fk.quantize(x0))
    fake.launches.clear()
    _planned(lambda: fk.quantize(x1))
    plans = list(_plans._PLANS.values())
    assert [p.device_id for p in plans] == [0, 1]
    assert {launch[3] for launch in fake.launches} == {fake.stream(1)}  # device 1's stream


def test_each_device_gets_its_own_compiled_launcher(fake):
    """A CUfunction belongs to one context: the launcher compiled for a tensor on device 0
    must not be used to launch on device 1.  The device is the tensor's, never a driver query
    for the current context (which the fake leaves at device 0 throughout)."""
    from fp4_kernels.cuda import launch

    x1 = _x()
    x1.fake_device = torch.device("cuda", 1)
    with _plans.disabled():
        fk.quantize(_x())
        on_device0 = dict(launch._compiled)
        fk.quantize(x1)
    assert on_device0 and {k[1] for k in on_device0} == {0}
    added = {k: v for k, v in launch._compiled.items() if k not in on_device0}
    assert {k[0] for k in added} == {k[0] for k in on_device0}  # the same kernels, again
    assert {k[1] for k in added} == {1}
    assert {id(v) for v in added.values()}.isdisjoint(id(v) for v in on_device0.values())


def test_requires_grad_inputs(fake):
    x = _x().requires_grad_()
    q = fk.quantize(x)
    assert not q.data.requires_grad
    y = fk.quantize_dequantize(x)
    assert y.requires_grad
    y.float().sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    x2 = _x()
    _compare(fake, lambda: fk.quantize_dequantize(x2), {"x": x2}, new_plan=False)


def test_the_cache_is_bounded_and_keeps_the_recent_plans(fake, monkeypatch):
    monkeypatch.setattr(_plans, "PLAN_CACHE_SIZE", 3)
    xs = [_x((16, 64 * (i + 1))) for i in range(5)]
    for x in xs:
        _planned(lambda: fk.quantize(x))  # noqa: B023
    fk.quantize(xs[2])  # used again: the most recent
    x9 = _x((16, 64 * 9))
    _planned(lambda: fk.quantize(x9))
    assert len(_plans._PLANS) == 3
    shapes = [key.x[2][1] for key in _plans._PLANS]
    assert shapes == [64 * 5, 64 * 3, 64 * 9]


def test_a_key_called_once_runs_unplanned_and_the_second_call_records(fake, monkeypatch):
    """A first call of a key runs the checked path and makes no plan (a shape called once costs
    no recording); the second records.  The keys called once are bounded as the plans are."""
    monkeypatch.setattr(_plans, "PLAN_CACHE_SIZE", 3)
    recordings = []
    real = _plans.record
    monkeypatch.setattr(_plans, "record", lambda *a: recordings.append(1) or real(*a))
    xs = [_x((16, 64 * (i + 1))) for i in range(5)]
    for x in xs:
        fk.quantize(x)
    assert not _plans._PLANS and not recordings and len(_plans._SEEN) == 3
    fk.quantize(xs[0])  # forgotten (the oldest of five): a first call again
    assert not _plans._PLANS and not recordings
    fk.quantize(xs[4])
    assert (
        len(_plans._PLANS) == 1
        and recordings == [1]
        and not any(kind[1][3] == xs[4].shape[-1] for kind in _plans._SEEN)  # (counted by kind)
    )
    fk.quantize(xs[4])
    assert recordings == [1]
    monkeypatch.setattr(_plans, "RECORD_AT", 1)  # at the first call
    x = _x((16, 64 * 7))
    fk.quantize(x)
    assert len(_plans._PLANS) == 2 and recordings == [1, 1]


def test_disabled_makes_no_plan(fake):
    x = _x()
    with _plans.disabled():
        for _ in range(_plans.RECORD_AT):  # as many calls as make a plan outside disabled()
            fk.quantize(x)
            fk.hadamard(x, group_size=64)
    assert not _plans._PLANS and not _plans._SEEN
    for _ in range(_plans.RECORD_AT):
        fk.quantize(x)
    assert len(_plans._PLANS) == 1  # (the same calls outside it do make one)


def test_a_plan_is_not_made_for_empty_tensors(fake):
    x = torch.empty((0, 64), dtype=torch.bfloat16)
    for _ in range(_plans.RECORD_AT):
        fk.quantize(x)
    assert not _plans._PLANS and not _plans._SEEN


# ---------------------------------------------------------------------- plans of every shape

# leading dimensions of one kind of call (its last dimension 256): small and large grids (the
# amax pass and the encoder capped at the CTAs resident at once from ~17K rows on the pretend
# GPU's 132 SMs), one row
NEW_ROWS = (3, 1, 640, 5000, 100_000, 17)


def _fields(q):
    names = ("data", "scales", "global_scale")
    return {f: getattr(q, f) for f in names if getattr(q, f) is not None}


def _new_shapes(fake, monkeypatch, make_call, shapes):
    """``make_call(shape)`` (a call and its named inputs, made once a shape) planned at
    ``shapes[0]``, then called once at each other shape: each first call launches exactly what
    the unplanned path launches at that shape, its plan made without a recording while the
    shape is one its kind's plans admit.  Returns the number of recordings after the first
    shape's."""
    recordings = []
    real = _plans.record
    monkeypatch.setattr(_plans, "record", lambda *a: recordings.append(1) or real(*a))
    call, _ = make_call(shapes[0])
    _planned(call)
    assert len(recordings) == 1 and not _plans.KIND_FAILURES
    recordings.clear()
    for shape in shapes[1:]:
        call, inputs = make_call(shape)
        with _plans.disabled():
            ref_result, ref = _launches(fake, call, inputs)
        n_plans = len(_plans._PLANS)
        result, got = _launches(fake, call, inputs)  # the first call of its key
        assert got == ref, shape
        _same_structure(result, ref_result)
        assert len(_plans._PLANS) == n_plans + 1  # its plan kept: the next call runs it
        _, warm = _launches(fake, call, inputs)
        assert warm == ref
    assert not _plans.KIND_FAILURES
    return len(recordings)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", sorted(QUANTIZE_CASES))
@pytest.mark.parametrize("fused", [False, True])
def test_a_new_shape_of_a_planned_kind_launches_what_the_unplanned_path_launches(
    fake, monkeypatch, case, dtype, fused
):
    kw = QUANTIZE_CASES[case]
    f = fk.quantize_dequantize if fused else fk.quantize
    if fused and "scale_layout" in kw:
        pytest.skip("quantize_dequantize has no scale layout")

    def make_call(shape):
        x = _x(shape, dtype)
        return lambda: f(x, **kw), {"x": x}

    shapes = [(64, 256)] + [(r, 256) for r in NEW_ROWS]
    recorded = _new_shapes(fake, monkeypatch, make_call, shapes)
    # a new range of grids (the capped ones) records once; the rest are made from the plans
    assert recorded <= 2


def test_new_shapes_of_several_leading_dimensions(fake, monkeypatch):
    amax = torch.tensor([3.0])

    def make_call(shape):
        x = _x(shape)
        call = lambda: fk.quantize(x, global_amax=amax, rounding="stochastic", seed=9, step=2)  # noqa: E731
        return call, {"x": x, "amax": amax}

    shapes = [(2, 7, 128), (5, 3, 128), (1, 1, 128), (40, 900, 128), (3, 2, 128)]
    _new_shapes(fake, monkeypatch, make_call, shapes)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", G64, fk.FP4Quant(256, hadamard=False)])
@pytest.mark.parametrize("out", [None, torch.float32])
def test_a_new_shape_of_a_planned_dequantize(fake, monkeypatch, fmt, out):
    def make_call(shape):
        with _plans.disabled():
            q = fk.quantize(_x(shape), fmt=fmt)
        return lambda: fk.dequantize(q, out), _fields(q)

    shapes = [(64, 512)] + [(r, 512) for r in NEW_ROWS]
    _new_shapes(fake, monkeypatch, make_call, shapes)


def test_a_new_shape_of_a_planned_dequantize_of_swizzled_scales(fake, monkeypatch):
    def make_call(shape):
        with _plans.disabled():
            q = fk.quantize(_x(shape), scale_layout="swizzled")
        return lambda: fk.dequantize(q), _fields(q)

    # the scales' padded length is in the kind (rows padded to 128): 1-128 rows share it
    shapes = [(100, 256), (3, 256), (128, 256), (1, 256)]
    _new_shapes(fake, monkeypatch, make_call, shapes)


@pytest.mark.parametrize("g", [16, 256, 2048, 8192])
@pytest.mark.parametrize("signs", [None, 5])
def test_a_new_shape_of_a_planned_transform(fake, monkeypatch, g, signs):
    def make_call(shape):
        x = _x(shape)
        return lambda: fk.hadamard(x, group_size=g, signs=signs, inverse=signs is None), {"x": x}

    shapes = [(8, 8192), (1, 8192), (3, 8192), (700, 8192), (2, 8192)]
    _new_shapes(fake, monkeypatch, make_call, shapes)


def test_a_kind_keeps_a_few_plans_of_every_shape(fake, monkeypatch):
    monkeypatch.setattr(_plans, "KIND_PLANS_PER_KIND", 2)
    x = _x((64, 256))
    _planned(lambda: fk.quantize(x))
    kinds = list(_plans._KINDS.values())
    assert len(kinds) == 1 and len(kinds[0]) == 1
    for rows in (100_000, 3, 200_000, 5):  # capped grids, then small ones again: no new one
        fk.quantize(_x((rows, 256)))
    assert len(kinds[0]) == 1 and len(_plans._KINDS[next(iter(_plans._KINDS))]) == 2
    with launch_policy(max_blocks=1):  # another policy: another kind
        _planned(lambda: fk.quantize(x))
    assert len(_plans._KINDS) == 2


def test_a_new_shape_that_is_not_contiguous_or_empty_takes_the_checked_path(fake):
    x = _x((64, 256))
    _planned(lambda: fk.quantize(x))
    n_plans = len(_plans._PLANS)
    with pytest.raises(ValueError, match="contiguous"):
        fk.quantize(_x((256, 512))[:, :256])
    empty = fk.quantize(_x((0, 256)))
    assert empty.data.shape == (0, 128) and len(_plans._PLANS) == n_plans


def test_a_host_function_that_needs_a_concrete_size_is_planned_per_shape(fake, monkeypatch):
    from fp4_kernels.cuda import quantize as op

    real = op.run

    def concrete(ctx, call):
        range(call.geometry.n)  # a concrete size: no plan of every shape
        return real(ctx, call)

    monkeypatch.setattr(op, "run", concrete)
    monkeypatch.setattr(_plans, "KIND_FAILURES", [])
    recordings = []
    real_record = _plans.record
    monkeypatch.setattr(_plans, "record", lambda *a: recordings.append(1) or real_record(*a))
    x = _x((64, 256))
    _compare(fake, lambda: fk.quantize(x), {"x": x})
    assert len(_plans.KIND_FAILURES) == 1 and "Unplannable" in _plans.KIND_FAILURES[0][1]
    assert list(_plans._KINDS.values()) == [_plans.FAILED]
    x2 = _x((3, 256))
    _compare(fake, lambda: fk.quantize(x2), {"x": x2})  # its first call unplanned, as before
    assert len(recordings) == 2 and len(_plans.KIND_FAILURES) == 1


# ---------------------------------------------------------------------- on a GPU


def _bits(result):
    return [t.contiguous().view(torch.uint8) for _, t in _tensors(result)]


@pytest.mark.gpu
def test_planned_results_equal_unplanned_on_the_gpu(gpu):
    _plans.clear()
    dev = torch.device("cuda")
    x = torch.randn(64, 4096, device=dev).to(torch.bfloat16)
    x[3, 17] = float("nan")
    amax = x.float().nan_to_num(0).abs().amax().reshape(1)
    xu = torch.randn(64 * 4096 + 1, device=dev)[1:].reshape(64, 4096)  # 4 bytes off
    calls = {}
    for name, kw in QUANTIZE_CASES.items():
        for xi, tag in ((x, ""), (x.float(), "_f32"), (xu, "_unaligned")):
            calls[f"quantize_{name}{tag}"] = lambda xi=xi, kw=kw: fk.quantize(xi, **kw)
            if "scale_layout" not in kw:
                calls[f"qdq_{name}{tag}"] = lambda xi=xi, kw=kw: fk.quantize_dequantize(xi, **kw)
    calls["quantize_amax_tensor"] = lambda: fk.quantize(x, global_amax=amax)
    for g in (16, 256, 4096):
        for signs in (None, 3):
            calls[f"hadamard_{g}_{signs}"] = lambda g=g, s=signs: fk.hadamard(
                x, group_size=g, signs=s
            )
            calls[f"hadamard_inv_{g}_{signs}"] = lambda g=g, s=signs: fk.hadamard(
                x, group_size=g, signs=s, inverse=True
            )
    with _plans.disabled():
        qs = {
            "nvfp4": fk.quantize(x),
            "mxfp4": fk.quantize(x, fmt="mxfp4"),
            "swizzled": fk.quantize(x, scale_layout="swizzled"),
            "fp4quant": fk.quantize(x, fmt=G64),
            "sum": fk.quantize(x[:4].float(), fmt="mxfp4"),
            "sum_nvfp4": fk.quantize(x[:4].float()),
        }
    for name, q in qs.items():
        for dt in (None, torch.float32, torch.float16):
            calls[f"dequantize_{name}_{dt}"] = lambda q=q, dt=dt: fk.dequantize(q, dt)
    calls["requantized_sum"] = lambda: fk.requantized_sum(qs["sum"])
    calls["requantized_sum_nvfp4"] = lambda: fk.requantized_sum(qs["sum_nvfp4"])
    row_scales = torch.rand(4, device=dev) + 0.5
    calls["requantized_sum_rows"] = lambda: fk.requantized_sum(qs["sum_nvfp4"], row_scales)
    for name, call in calls.items():
        with _plans.disabled():
            ref = _bits(call())
        first = _bits(call())  # unplanned: the first call of its key
        cold = _bits(call())  # records the plan, then runs it
        torch.cuda.set_sync_debug_mode("error")  # a planned call never synchronizes
        try:
            warm = _bits(call())
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for a, f, b, c in zip(ref, first, cold, warm, strict=True):
            assert torch.equal(a, f) and torch.equal(a, b) and torch.equal(a, c), name
    assert len(_plans._PLANS) == len(calls)  # each call's plan made and run
    _plans.clear()


def test_a_plan_of_every_shape_that_misses_its_own_shape_is_not_used(fake, monkeypatch):
    monkeypatch.setattr(_plans, "KIND_FAILURES", [])
    monkeypatch.setattr(_plans, "same_plan", lambda a, b: False)  # as a wrong expression would
    x = _x((64, 256))
    _planned(lambda: fk.quantize(x))
    assert not _plans.KIND_FAILURES  # (checked when a new shape first needs it)
    x2 = _x((3, 256))
    _compare(fake, lambda: fk.quantize(x2), {"x": x2})  # unplanned first, as per shape
    assert len(_plans.KIND_FAILURES) == 1 and "differs" in _plans.KIND_FAILURES[0][1]
    assert list(_plans._KINDS.values()) == [_plans.FAILED]


def test_new_shapes_from_several_threads(fake, monkeypatch):
    """Threads calling new shapes of one kind at once (emulated ranks do): each compile of a
    plan of every shape is one thread's, none fails, every result has its shape."""
    import threading

    monkeypatch.setattr(_plans, "KIND_FAILURES", [])
    x = _x((64, 256))
    _planned(lambda: fk.quantize(x))
    errors = []

    def rank(r):
        _plans._THREAD.bound = {0, 1}  # (the pretend GPU's device, bound in this thread too)
        try:
            for rows in range(1 + r, 400, 4):
                q = fk.quantize(_x((rows, 256)))
                assert q.data.shape == (rows, 128) and q.scales.shape == (rows, 16)
        except Exception as err:  # noqa: BLE001 (reported below)
            errors.append(err)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not _plans.KIND_FAILURES
    kinds = list(_plans._KINDS.values())
    assert len(kinds) == 1 and kinds[0] and all(k.fields for k in kinds[0])


@pytest.mark.gpu
def test_new_shapes_of_planned_kinds_equal_unplanned_on_the_gpu(gpu):
    """Every op's first call of a new shape, its plan made from its kind's plan of every shape
    (small grids and grids at their cap), gives the unplanned path's bits."""
    _plans.clear()
    dev = torch.device("cuda")
    calls = {}
    for name, kw in QUANTIZE_CASES.items():
        calls[f"quantize_{name}"] = lambda x, kw=kw: fk.quantize(x, **kw)
        if "scale_layout" not in kw:
            calls[f"qdq_{name}"] = lambda x, kw=kw: fk.quantize_dequantize(x, **kw)
    for g in (256, 4096):
        calls[f"hadamard_{g}"] = lambda x, g=g: fk.hadamard(x, group_size=g, signs=3)
    for fmt in ("nvfp4", "mxfp4", G64):
        calls[f"dequantize_{fmt}"] = lambda x, fmt=fmt: fk.dequantize(
            _unplanned(lambda: fk.quantize(x, fmt=fmt)), torch.float32
        )
    for name, call in calls.items():
        for i, rows in enumerate((64, 64, 3, 1, 2000, 20_000, 17)):
            x = torch.randn(rows, 4096, device=dev).to(torch.bfloat16)
            x[0, 5] = float("nan")
            ref = _bits(_unplanned(lambda: call(x)))  # noqa: B023
            n_plans = len(_plans._PLANS)
            got = _bits(call(x))  # the kind's first call unplanned, then a plan each shape
            assert len(_plans._PLANS) == n_plans + (i > 0), (name, rows)
            for a, b in zip(ref, got, strict=True):
                assert torch.equal(a, b), (name, rows)
    assert not _plans.KIND_FAILURES
    _plans.clear()


def _unplanned(call):
    with _plans.disabled():
        return call()


def test_a_host_function_that_transforms_a_scalar_gets_no_plan(fake, monkeypatch):
    # the per-call scalars are found in the recorded arguments by their probe values; a host
    # function passing a function of the seed would leave the probe in every later call
    import dataclasses

    from fp4_kernels.cuda import quantize as op

    real = op.run

    def seed_plus_one(ctx, call):
        return real(ctx, dataclasses.replace(call, seed=call.seed + 1))

    monkeypatch.setattr(op, "run", seed_plus_one)
    x = _x()
    fk.quantize(x, rounding="stochastic", seed=3)  # a first call: unplanned
    with pytest.raises(RuntimeError, match="probe scalars"):
        fk.quantize(x, rounding="stochastic", seed=3)  # the recording
    assert not _plans._PLANS


def test_first_calls_of_several_threads_count_the_gpus_once(monkeypatch):
    """numba fills its device list on first use and fails when two threads do it at once
    (AssertionError "key already in dictionary"): ranks emulated one thread each met it on their
    first calls.  ``on_device`` counts the GPUs under a lock: one thread asks, once."""
    import sys
    import threading
    import time
    import types

    from fp4_kernels import _plans

    inside, entered = [0], []

    class Gpus:
        def __len__(self):
            inside[0] += 1
            entered.append(inside[0])
            time.sleep(0.05)  # long enough for the other threads to arrive
            inside[0] -= 1
            return 1

    fake_cuda = types.SimpleNamespace(gpus=Gpus(), get_current_device=lambda: None)
    fake_core = types.ModuleType("cuda.core")
    fake_core.Device = lambda i: types.SimpleNamespace(set_current=lambda: None)
    monkeypatch.setattr("numba.cuda", fake_cuda, raising=False)
    monkeypatch.setitem(sys.modules, "numba.cuda", fake_cuda)
    monkeypatch.setitem(sys.modules, "cuda.core", fake_core)
    monkeypatch.setattr(_plans, "_GPU_COUNT", [])
    ctx = types.SimpleNamespace(device_id=0, simulator=False)
    barrier = threading.Barrier(4)

    def first_call():
        barrier.wait()
        with _plans.on_device(ctx):
            pass

    threads = [threading.Thread(target=first_call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert entered == [1] and _plans._GPU_COUNT == [1]
