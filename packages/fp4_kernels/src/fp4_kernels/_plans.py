"""Launch plans: the host work of a torch CUDA call done once per kind of call.

Every GPU call arrives here as a call descriptor (``_calls``) with the host function of its op
(``cuda.<op>.run(ctx, call)``, which chooses kernels and grids).  A call whose ``key`` is set
(a torch CUDA tensor, plans enabled: the static part of the call, its input's type, dtype,
shape, strides, device and 16-byte alignment and the launch policy) is planned.  The first
call of a kind of call runs unplanned (below); the second (``RECORD_AT``), checked in full by
the API, runs its host function once against a ``Tracer``:
placeholder arrays whose addresses are tagged symbols, and a context that records each launch
instead of queuing it.  The recording is the plan: the launchers, grids, the packed argument
values (``_numba_launch.launch_values``) with the places where a call's pointers (inputs, outputs)
and scalars (seed, step, a float ``global_amax``) go, and the output layout.  Every later call of
the same key allocates its outputs (one ``torch.empty`` for all byte outputs: codes, scales,
tensor scale and scratch, each 256-byte aligned in it; a float result is a tensor of its own),
writes its pointers and scalars into the recorded arguments and launches on torch's current
stream; no check is repeated, because everything a check reads is in the key.

Plans of every shape: when a plan is recorded, the host function also runs against a symbolic
tracer, whose placeholders' leading dimensions are ``_sizes.Size`` expressions, so that every
size it derives (element counts, grids, the outputs' byte offsets and shapes) is an expression
of the call's dimensions and every comparison of one (a branch, a grid's cap) a guard.  The
result, a ``KindPlan`` of the call's kind (its key without the arrays' leading dimensions and
strides: ``kind_key``), makes the plan of any shape its guards admit by evaluating one generated
function, with no trace: the first call of a new shape of a kind planned before costs a plan's
run and that evaluation (the API's ``shape_plan``, before any check: what the checks read of a
new shape, contiguity and emptiness, is read there; everything else is in the kind).  It must
give the concrete recording's plan at the shape it was recorded at, or it is not kept; a host
function that needs a concrete size (``_sizes.Unplannable``) leaves its kind planned per shape.
Host functions derive every size from the descriptor's geometry and arrays (never from its key
or another concrete source), which is what makes this sound.  A kind keeps up to
``KIND_PLANS_PER_KIND`` of them (ranges of shapes: a grid under its cap, a grid at it).

Calls without a key (numpy, CuPy, numba arrays, the simulator, signs given as a vector),
empty tensors and the first call of a kind (of a key, where the kind has no plan of every
shape) run their host function against the caller's context (``run_unplanned``).  The cache is
bounded: ``PLAN_CACHE_SIZE`` plans (and as many keys called once, and kinds), least recently
used evicted first; ``clear()`` empties it and ``disabled()`` turns it off for the calls inside
it (the unplanned path then runs for torch tensors too).

``on_device`` makes the input's GPU numba's current device for the duration of a call.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import sys
import threading
from collections import OrderedDict

import numpy as np

from . import _arrays as arrays, _sizes
from ._calls import FP4QUANT_KEY, PROBE_AMAX, PROBE_SEED, PROBE_STEP, DequantizeKey
from ._quantized import FP4Quant, QuantizedTensor
from .cuda import launch
from .cuda.launch_table import POLICY

PLAN_CACHE_SIZE = 256
#: The call of a key that records its plan: the first runs unplanned, so that a shape called
#: once (inference over many sequence lengths) costs the checked path alone, about half of a
#: recording and its run; the second records; the later ones run the plan.
RECORD_AT = 2

_PLANS: OrderedDict = OrderedDict()
_SEEN: OrderedDict = OrderedDict()  # key (or kind) -> its calls so far, while fewer than RECORD_AT
#: Plans of every shape a kind of call holds (``KindPlan``, one a range of shapes its guards
#: admit), most recently used first.
KIND_PLANS_PER_KIND = 4
_KINDS: OrderedDict = OrderedDict()  # kind key -> [KindPlan, ...], or FAILED
FAILED = ()  # a kind whose host function needs concrete sizes: planned per shape
#: Why recent recordings of a plan of every shape failed (kind key, reason): for diagnosis.
KIND_FAILURES: list = []
_LOCK = threading.Lock()  # held while a plan is added or evicted
_DISABLED = contextvars.ContextVar("fp4_kernels_plans_disabled", default=False)

# A placeholder address: bit 62 set (no real host or device address has it), the source (an
# input or an allocation of the call) in bits 40..55, the byte offset below.
_TAG = 0x5A << 56
_SOURCE_SHIFT = 40
_ALIGN = 16  # the largest alignment a host function tests (16-byte vector loads)
SECTION_ALIGN = 256  # each byte output's offset in the shared allocation

# The probe scalars (``_calls``: the values a traced descriptor passes) as the recording finds
# them in the packed arguments, in the order a planned call passes its scalars (seed low and
# high words, step, amax).
_PROBES = (
    (np.dtype(np.uint32), PROBE_SEED & 0xFFFFFFFF),
    (np.dtype(np.uint32), PROBE_SEED >> 32),
    (np.dtype(np.uint32), PROBE_STEP),
    (np.dtype(np.float32), float(np.float32(PROBE_AMAX))),
)


def clear() -> None:
    """Forget every plan."""
    with _LOCK:
        _PLANS.clear()
        _SEEN.clear()
        _KINDS.clear()


@contextlib.contextmanager
def disabled():
    """Run the calls inside without plans (neither used nor made)."""
    token = _DISABLED.set(True)
    try:
        yield
    finally:
        _DISABLED.reset(token)


def tensor_key(t):
    """What a plan depends on of a torch CUDA tensor, or None for anything else."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(t, torch.Tensor) or not t.is_cuda:
        return None
    # not in the key, and a sparse tensor has no data pointer: the checked path refuses them
    # (and a functorch wrapper, whose type is torch.Tensor's: its memory is not its values')
    if (
        t.is_nested
        or t.is_neg()
        or t.layout != torch.strided
        or torch._C._functorch.is_functorch_wrapped_tensor(t)
    ):
        return None
    return (type(t), t.dtype, t.shape, t.stride(), t.device, t.data_ptr() % _ALIGN)


NO_PLAN = object()  # ``plan_policy()`` inside ``disabled()``


def plan_policy():
    """What every plan key ends with: the launch policy in force (a plan depends on it), or
    ``NO_PLAN`` inside ``disabled()``, where no plan is used or made."""
    return NO_PLAN if _DISABLED.get() else POLICY.get()


def quantized_key(q, out_dtype, op, row_scales=None):
    """The plan key of a torch CUDA ``op`` (dequantize, requantized_sum) reading the
    QuantizedTensor ``q`` (and ``row_scales``, a tensor requantized_sum was given), or None."""
    if type(q) is not QuantizedTensor or _DISABLED.get():
        return None
    policy = POLICY.get()  # (``plan_policy()`` written out: one Python call fewer a warm call)
    dk, sk = tensor_key(q.data), tensor_key(q.scales)
    if dk is None or sk is None:
        return None
    gk = None
    if q.global_scale is not None:
        gk = tensor_key(q.global_scale)
        if gk is None:
            return None
    rk = None
    if row_scales is not None:
        rk = tensor_key(row_scales)
        if rk is None:
            return None
    fmt = q.fmt
    if type(fmt) is FP4Quant:
        fmt = (FP4QUANT_KEY, fmt.group_size, fmt.hadamard)
    return DequantizeKey(
        op, fmt, repr(q.shape), q.dtype, q.scale_layout, dk, sk, gk, out_dtype, policy, rk
    )


def planned_tensor(data, scales, global_scale, fmt, shape, dtype, scale_layout, payload=None):
    """A QuantizedTensor of fields a plan guarantees: the dtype already that of data's library,
    nothing to convert or check (the constructor's work skipped)."""
    q = QuantizedTensor.__new__(QuantizedTensor)
    q.__dict__.update(
        data=data, scales=scales, global_scale=global_scale, fmt=fmt, shape=shape, dtype=dtype,
        scale_layout=scale_layout, payload=payload,
    )  # fmt: skip
    return q


def get(key):
    """The plan of ``key``, or None (also for None and for a key that cannot be hashed)."""
    try:
        plan = _PLANS.get(key)
    except TypeError:  # an unhashable argument: the unplanned path checks it
        return None
    if plan is not None:
        try:
            _PLANS.move_to_end(key)
        except KeyError:  # evicted by another thread meanwhile
            pass
    return plan


def put(key, plan):
    """Keep ``plan`` under ``key`` (not kept if the key cannot be hashed); returns it."""
    with _LOCK:
        try:
            _PLANS[key] = plan
        except TypeError:
            return plan
        while len(_PLANS) > PLAN_CACHE_SIZE:
            _PLANS.popitem(last=False)
    return plan


def plan_for(call, host):
    """The plan of the checked GPU ``call`` (its tensors not empty): its key's, else one made
    for its shape from a plan of its kind's every shape, else recorded from
    ``host(tracer, call)`` at the ``RECORD_AT``-th call of its kind (of its key where the kind
    has no plan of every shape); None before that and for a call without a key: the caller
    runs it unplanned (``run_unplanned``)."""
    key = call.key
    if key is None:
        return None
    plan = get(key)
    if plan is not None:
        return plan
    kind = call.kind_key()
    kind_plans = _kind_plans(kind)
    if kind_plans:
        plan = _from_kind(key, kind, kind_plans, call.plan_dims())
        if plan is not None:
            return plan
    # counted by kind (a kind of call whose shapes keep changing gets its plan at its second
    # call), by key where the kind's sizes cannot be symbolic; a kind with plans of every
    # shape, none of which admits this one, records at once
    counted = key if kind is None or kind_plans is FAILED else kind
    with _LOCK:
        try:
            seen = _SEEN.pop(counted, 0) + 1
        except TypeError:  # an unhashable argument: never planned
            return None
        if seen < RECORD_AT and not kind_plans:
            _SEEN[counted] = seen
            while len(_SEEN) > PLAN_CACHE_SIZE:
                _SEEN.popitem(last=False)
            return None
    plan = record(call, host)
    if kind is not None and kind_plans is not FAILED:
        _add_kind_plan(kind, record_kind(call, host, plan, kind))
    return put(key, plan)


def shape_plan(key, kind, arrays):
    """The plan of ``key``, a key not seen before, made from a plan of every shape of
    ``kind`` (the API's own route to a new shape's plan, before any check: a plan of the kind
    exists only once a call of it passed them, and what they read of a new shape is read
    here: the arrays, ``arrays`` in the order the call's descriptor records them, C-contiguous
    and the first not empty); None otherwise."""
    plans = _kind_plans(kind)
    if not plans:
        return None
    dims = []
    for a in arrays:
        if not a.is_contiguous():
            return None
        dims += a.shape[:-1]
    if not arrays[0].numel():
        return None
    return _from_kind(key, kind, plans, dims)


def _from_kind(key, kind, plans, dims):
    """The plan of ``key`` from the first of ``kind``'s ``plans`` that admits ``dims``, kept."""
    for kind_plan in plans:
        plan = kind_plan.instantiate(dims)
        if plan is not None:
            try:
                _KINDS.move_to_end(kind)
            except KeyError:  # evicted by another thread meanwhile
                pass
            return put(key, plan)
    return None


def _kind_plans(kind):
    """The plans of every shape of ``kind`` (a list, most recently used first; FAILED; or None:
    none yet)."""
    if kind is None:
        return None
    try:
        return _KINDS.get(kind)
    except TypeError:  # an unhashable argument
        return FAILED


def _add_kind_plan(kind, kind_plan):
    with _LOCK:
        plans = _KINDS.pop(kind, None) or []
        if kind_plan is None:
            _KINDS[kind] = plans or FAILED
        else:
            _KINDS[kind] = [kind_plan, *plans][:KIND_PLANS_PER_KIND]
        while len(_KINDS) > PLAN_CACHE_SIZE:
            _KINDS.popitem(last=False)


def record(call, host):
    """The plan of ``call``: ``host`` run once against a ``Tracer`` (see the module doc)."""
    tracer = Tracer(call.anchor.device.index)
    traced, probes = call.traced(tracer)
    with on_device(tracer):  # the kernels compile for the input's device
        outputs = host(tracer, traced)
    return tracer.plan(outputs, probes)


def record_kind(call, host, plan, kind):
    """The plan of every shape of ``call``'s kind that admits ``call``: ``host`` run against a
    symbolic ``Tracer``; it must give ``plan`` (``call``'s, recorded concretely) at ``call``'s
    shape.  None where the host function needed a concrete size (``_sizes.Unplannable``) or
    anything else failed: the kind is then planned per shape, and ``KIND_FAILURES`` says why."""
    try:
        tracer = Tracer(call.anchor.device.index, symbolic=True)
        with _sizes.recording() as guards:
            traced, probes = call.traced(tracer)
            with on_device(tracer):
                outputs = host(tracer, traced)
            symbolic = tracer.plan(outputs, probes)
    except Exception as err:  # a plan of every shape is an optimization: never the call's error
        _failed(kind, err)
        return None
    return KindPlan(symbolic, guards, tracer.n_dims, kind, (call.plan_dims(), plan))


def _failed(kind, err):
    with _LOCK:  # (threads recording or compiling plans of other kinds at once)
        KIND_FAILURES.append((kind, f"{type(err).__name__}: {err}"))
        del KIND_FAILURES[:-16]


def run_unplanned(call, host):
    """``host(ctx, call)`` against the caller's context: its device, stream and allocator."""
    ctx = launch.GpuContext(call.anchor, call.backend)
    with on_device(ctx):
        return host(ctx, call)


# ---------------------------------------------------------------------- the device of a call

_GPU_COUNT = []
_GPU_COUNT_LOCK = threading.Lock()
_THREAD = threading.local()  # .bound: the devices whose context this thread has made current


def needs_scope(device_id):
    """Whether a call on ``device_id`` must enter ``on_device`` (the first call on a thread, or
    a process with several GPUs)."""
    return not _GPU_COUNT or _GPU_COUNT[0] > 1 or device_id not in getattr(_THREAD, "bound", ())


class on_device:
    """Make the input's GPU numba's current device for the duration of the call (a no-op on a
    one-GPU process, which skips the context query on the hot path).

    The first call on a thread binds the device's primary context (the one torch, CuPy and
    numba share) to that thread: a thread that only ever used the runtime API through torch,
    such as the autograd engine's backward thread, may have none, and the kernels launch
    through the driver API."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.cm = None

    def __enter__(self):
        if self.ctx.device_id is None or self.ctx.simulator:
            return
        from numba import cuda

        bound = getattr(_THREAD, "bound", None)
        if bound is None:
            bound = _THREAD.bound = set()
        if self.ctx.device_id not in bound:
            from cuda.core import Device

            Device(self.ctx.device_id).set_current()
            bound.add(self.ctx.device_id)
        if not _GPU_COUNT:
            # numba fills its device list on first use, and two threads doing that at once
            # fail ("key already in dictionary"): the first call of several threads (ranks
            # emulated one thread each) takes it in turn
            with _GPU_COUNT_LOCK:
                if not _GPU_COUNT:
                    _GPU_COUNT.append(len(cuda.gpus))
        if _GPU_COUNT[0] > 1 and cuda.get_current_device().id != self.ctx.device_id:
            self.cm = cuda.gpus[self.ctx.device_id]
            self.cm.__enter__()

    def __exit__(self, *exc):
        if self.cm is not None:
            self.cm.__exit__(*exc)


# ---------------------------------------------------------------------- recording


class VirtualArray:
    """A placeholder for a torch tensor while a plan is recorded: 1-D views and reshapes of
    a source (an input or an allocation), addressed by a tagged symbol."""

    def __init__(self, source, offset, shape, dtype, itemsize, misalign):
        self.source = source
        self.offset = offset  # bytes from the start of the source
        self.shape = tuple(shape)
        self.dtype = dtype  # a torch dtype
        self.itemsize = itemsize
        self.misalign = misalign

    def data_ptr(self):
        # (the low bits added, not or-ed: a symbolic offset is a ``_sizes.Size``)
        return (_TAG | (self.source << _SOURCE_SHIFT)) + (self.misalign + self.offset)

    def numel(self):
        return math.prod(self.shape)

    def element_size(self):
        return self.itemsize

    def _like(self, offset, shape, dtype=None, itemsize=None):
        return VirtualArray(
            self.source, offset, shape, dtype or self.dtype, itemsize or self.itemsize,
            self.misalign,
        )  # fmt: skip

    def __getitem__(self, index):
        if len(self.shape) != 1 or not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("a plan records 1-D slices only")
        length, start, stop = self.shape[0], index.start, index.stop
        if any(isinstance(v, _sizes.Size) for v in (length, start, stop)):
            # a symbolic size: the slices host functions take, of non-negative bounds
            start = 0 if start is None else start
            stop = length if stop is None else stop
            if start < 0 or stop < 0:
                raise _sizes.Unplannable("a negative bound of a symbolic slice")
            stop = min(stop, length)
            start = min(start, stop)
        else:
            start, stop, _ = index.indices(length)
            stop = max(start, stop)
        return self._like(self.offset + start * self.itemsize, (stop - start,))

    def reshape(self, *shape):
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        if math.prod(shape) != self.numel():
            raise ValueError("reshape changes the number of elements")
        return self._like(self.offset, shape)

    def view(self, dtype):
        size = _torch_itemsize(dtype)
        if len(self.shape) != 1 or (self.numel() * self.itemsize) % size:
            raise TypeError("a plan records 1-D dtype views of whole elements only")
        return self._like(self.offset, (self.numel() * self.itemsize // size,), dtype, size)


def _torch_itemsize(dtype):
    return dtype.itemsize


class Tracer(launch.GpuContext):
    """The ``GpuContext`` a host function runs against while its plan is recorded: it hands out
    placeholders for the call's arrays and records each launch instead of queuing it."""

    def __init__(self, device_id, symbolic=False):
        launch.init_torch_tables()
        self.backend = arrays.Backend("torch", True, None)
        self.simulator = False
        self.device_id = device_id
        self.stream = None  # nothing is queued while recording
        self.sources = []  # ("input",) | ("alloc", shape, torch dtype, packed, zero)
        self.launches = []
        self.keep = []  # constant device arrays the recorded arguments point into
        self._misaligns = {}
        # symbolic: the inputs' leading dimensions are ``_sizes.Size`` d0, d1, ... (in the
        # order of the inputs): a plan of every shape of the call's kind is recorded
        self.symbolic = symbolic
        self.n_dims = 0

    def input(self, t):
        """A placeholder for the input tensor ``t`` (its misalignment kept); None for None."""
        if t is None:
            return None
        self.sources.append(("input",))
        source = len(self.sources) - 1
        self._misaligns[source] = t.data_ptr() % _ALIGN
        shape = tuple(t.shape)
        if self.symbolic:
            k = self.n_dims
            lead = tuple(_sizes.Size.dimension(k + i, d) for i, d in enumerate(shape[:-1]))
            self.n_dims += len(lead)
            shape = lead + shape[-1:]
        return VirtualArray(source, 0, shape, t.dtype, t.element_size(), self._misaligns[source])

    def empty(self, shape, np_dtype, like_dtype=None, zero=False):
        # a float result (like_dtype) is a tensor of its own; byte outputs share one buffer
        packed = like_dtype is None
        dtype = launch.TORCH_OF_NP[np_dtype] if packed else like_dtype
        shape = tuple(shape)
        self.sources.append(("alloc", shape, dtype, packed, zero))
        return VirtualArray(len(self.sources) - 1, 0, shape, dtype, _torch_itemsize(dtype), 0)

    def fill(self, arr, value):
        raise NotImplementedError("plans are made for non-empty tensors only")

    def view(self, arr, np_dtype=None):
        if not isinstance(arr, VirtualArray):
            self.keep.append(arr)  # a cached constant (sign words, the MXFP4 scale 1.0)
        return super().view(arr, np_dtype)

    def submit(self, launcher, blocks, threads, args, ctas_per_sm=None):
        """Record the launch: its values, with the positions a call patches (the pointers into
        its inputs and outputs, the probe scalars), and the carveout it was sized for."""
        values, positions = launch.launch_values(args)
        pointers, scalars = [], []
        for a, pos in zip(args, positions, strict=True):
            if isinstance(a, launch.DeviceBuffer):
                ptr = a.ptr  # (a symbolic offset makes it a Size: its value says the source)
                tagged = ptr.value if isinstance(ptr, _sizes.Size) else ptr
                if tagged & _TAG == _TAG:
                    source = (tagged >> _SOURCE_SHIFT) & 0xFFFF
                    base = _TAG | (source << _SOURCE_SHIFT)
                    pointers.append((pos, source, ptr - base - self._misaligns.get(source, 0)))
                continue
            if isinstance(a, _sizes.Size):
                continue  # a symbolic size stays in the template (``KindPlan``)
            for i, (dt, probe) in enumerate(_PROBES):
                if a.dtype == dt and a == probe:
                    scalars.append((pos, i))
                    break
        self.launches.append((launcher, blocks, threads, values, pointers, scalars, ctas_per_sm))

    def plan(self, result, scalars=()):
        """The plan of what was recorded; ``result``: the placeholders (or None) the call
        returns, in the order the plan returns them; ``scalars``: the probes (indices into
        seed low, seed high, step, amax) the call must find in the arguments, or a per-call
        value would silently be the probe's."""
        found = {k for *_, probes, _ in self.launches for _, k in probes}
        missing = set(scalars) - found
        if missing:
            raise RuntimeError(f"probe scalars {sorted(missing)} not found in the launches")
        return Plan(self, result)


class Plan:
    """One kind of call: allocations, launches with their argument templates, the result.

    A call fills ``slots``: the inputs' addresses (in the order they were recorded), the
    shared buffer's sections, the own tensors, then the scalars; each launch's template gets
    ``slots[slot] + rel`` at the positions recorded for it."""

    simulator = False  # (read by ``on_device``)

    def __init__(self, tracer, result):
        torch = sys.modules["torch"]
        self.device_id = tracer.device_id
        self.device = torch.device("cuda", tracer.device_id)
        # torch's current stream of a device, without building a Stream object
        self.current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
            lambda device: torch.cuda.current_stream(device).cuda_stream
        )
        self.keep = tracer.keep
        inputs, sections, own = self._allocations(tracer.sources)
        order = inputs + sections + own
        slot = {source: k for k, source in enumerate(order)}
        self.launches = [
            (
                launcher, blocks, threads, values,
                tuple((pos, slot[source], rel) for pos, source, rel in pointers)
                + tuple((pos, len(order) + k, 0) for pos, k in scalars),
                ctas,
            )
            for launcher, blocks, threads, values, pointers, scalars, ctas in tracer.launches
        ]  # fmt: skip
        self.result = self._result_views(result, sections, own, torch.uint8)

    def _allocations(self, sources):
        """Lay the byte outputs out in one buffer; (input, section, own tensor) source indices."""
        inputs, sections, own = [], [], []
        self.zero = []  # (byte offset, bytes) of the shared buffer to clear
        self.section_offsets = []
        packed = 0
        for i, source in enumerate(sources):
            if source[0] == "input":
                inputs.append(i)
                continue
            _, shape, dtype, is_packed, is_zero = source
            if not is_packed:
                own.append(i)
                continue
            nbytes = math.prod(shape) * _torch_itemsize(dtype)
            sections.append(i)
            self.section_offsets.append(packed)
            if is_zero:
                self.zero.append((packed, nbytes))
            packed += -(-nbytes // SECTION_ALIGN) * SECTION_ALIGN
        self.packed_bytes = packed
        self.own = [sources[i][1:3] for i in own]  # (shape, dtype)
        return inputs, sections, own

    def _result_views(self, result, sections, own, uint8):
        """(base, shape, stride, offset, whole) of each result: a view of the shared buffer (as
        uint8 or another dtype) or an own tensor; bases of a call are [buffer, the buffer viewed
        as each of view_dtypes..., own tensors...]."""
        self.view_dtypes = [
            v.dtype for v in result if v is not None and v.source in sections and v.dtype != uint8
        ]
        self.view_dtypes = list(dict.fromkeys(self.view_dtypes))
        n_views = 1 + len(self.view_dtypes)
        views = []
        for v in result:
            if v is None:
                views.append(None)
                continue
            if v.offset % v.itemsize:
                raise ValueError("a result view must start on a whole element")
            dims = [max(d, 1) for d in v.shape]
            stride = tuple(math.prod(dims[i + 1 :]) for i in range(len(dims)))
            if v.source in own:
                k = own.index(v.source)
                offset = v.offset // v.itemsize
                whole = offset == 0 and tuple(self.own[k][0]) == v.shape
                views.append((n_views + k, v.shape, stride, offset, whole))
                continue
            offset = (self.section_offsets[sections.index(v.source)] + v.offset) // v.itemsize
            base = 0 if v.dtype == uint8 else 1 + self.view_dtypes.index(v.dtype)
            views.append((base, v.shape, stride, offset, False))
        return views

    def __call__(self, inputs, scalars=()):
        """Queue the plan's launches for ``inputs`` (the tensors, in the recorded order) and
        ``scalars`` (seed low and high words, step, amax as float32); returns the result.

        Every planned call's hot path: it calls no function of this package but the
        launcher's (``needs_scope`` written out, no comprehensions)."""
        scope = None
        if (
            not _GPU_COUNT
            or _GPU_COUNT[0] > 1
            or self.device_id not in getattr(_THREAD, "bound", ())
        ):
            scope = on_device(self)
            scope.__enter__()
        try:
            torch = sys.modules["torch"]
            slots = []
            for t in inputs:
                slots.append(t.data_ptr())
            bases = [None]
            if self.packed_bytes:
                buf = torch.empty(self.packed_bytes, dtype=torch.uint8, device=self.device)
                p = buf.data_ptr()
                if p % _ALIGN:
                    raise RuntimeError(f"the allocator returned {p:#x}, not 16-byte aligned")
                for off, nbytes in self.zero:
                    buf[off : off + nbytes].zero_()
                for off in self.section_offsets:
                    slots.append(p + off)
                bases[0] = buf
                for dt in self.view_dtypes:
                    bases.append(buf.view(dt))
            for shape, dtype in self.own:
                t = torch.empty(shape, dtype=dtype, device=self.device)
                slots.append(t.data_ptr())
                bases.append(t)
            slots += scalars
            stream = self.current_stream(self.device_id)
            for launcher, blocks, threads, template, patches, ctas in self.launches:
                if launcher.ctas_per_sm != ctas:  # another kind of launch resized it since
                    launch.set_carveout(launcher, ctas)
                values = template.copy()
                for pos, slot, rel in patches:
                    values[pos] = slots[slot] + rel
                launcher.launch_values(stream, blocks, threads, values)
            out = []
            for view in self.result:
                if view is None:
                    out.append(None)
                    continue
                base, shape, stride, offset, whole = view
                out.append(bases[base] if whole else bases[base].as_strided(shape, stride, offset))
            return out
        finally:
            if scope is not None:
                scope.__exit__(None, None, None)


# ---------------------------------------------------------------------- plans of every shape


class KindPlan:
    """A plan recorded with symbolic leading dimensions (``Tracer(symbolic=True)``): the
    ``Plan`` of any shape of its kind that satisfies the recording's guards.

    The symbolic plan's fields (templates, grids, section sizes, result views) are written out
    as the source of one Python function of the dimensions, which checks the guards and
    returns the fields of the concrete plan: making a new shape's plan costs one call of it.
    The function is compiled when a new shape first asks for it (a kind called at one shape
    never does), and checked then against ``check``: (dimensions, the plan recorded
    concretely at them), which it must give; if not, it is never used."""

    def __init__(self, plan, guards, n_dims, kind, check):
        self.n_dims = n_dims
        self.kind = kind
        self.symbolic = (plan, guards)
        self.check = check
        self.fields = None  # the compiled function (None: not yet, or its check failed)
        self.source = None
        self._lock = threading.Lock()  # one thread compiles it

    def _compile(self):
        plan, guards = self.symbolic
        constants = []
        fields = _source(dict(vars(plan)), constants)
        names = ", ".join(f"d{i}" for i in range(self.n_dims))
        checks = " and ".join(src if want else f"not {src}" for src, want in guards.items())
        body = f"    if not ({checks}):\n        return None\n" if checks else ""
        source = f"def fields({names}):\n{body}    return {fields}\n"
        scope = {f"c{i}": c for i, c in enumerate(constants)}
        exec(compile(source, "<fp4_kernels plan of every shape>", "exec"), scope)
        self.source = source
        dims, concrete = self.check
        if not same_plan(self._make(scope["fields"], dims), concrete):
            raise RuntimeError("the plan of every shape differs from the plan of its own shape")
        return scope["fields"]

    def instantiate(self, dims):
        """The ``Plan`` at the leading dimensions ``dims`` (``call.plan_dims()``), or None where
        they fall outside the recording's guards."""
        fields = self.fields or self._compiled()
        if fields is None or len(dims) != self.n_dims:
            return None
        return self._make(fields, dims)

    def _compiled(self):
        with self._lock:
            if self.symbolic is not None:  # (compiled by another thread meanwhile: None)
                try:
                    self.fields = self._compile()
                except Exception as err:
                    _failed(self.kind, err)
                    with _LOCK:  # the kind is planned per shape from now on
                        _KINDS[self.kind] = FAILED
                self.symbolic = self.check = None  # (the function holds what it needs)
            return self.fields

    @staticmethod
    def _make(fields, dims):
        try:
            values = fields(*dims)
        except ZeroDivisionError:
            return None
        if values is None:
            return None
        plan = Plan.__new__(Plan)
        plan.__dict__.update(values)
        return plan


def _source(obj, constants):
    """Python source that builds ``obj`` with its symbolic sizes evaluated: literals for plain
    values and containers, names ``c<i>`` for the other objects (appended to ``constants``)."""
    t = type(obj)
    if t is _sizes.Size:
        return obj.src
    if obj is None or t is bool or t is int or t is str:
        return repr(obj)
    if t is tuple:
        items = [_source(v, constants) for v in obj]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if t is list:
        return "[" + ", ".join(_source(v, constants) for v in obj) + "]"
    if t is dict:
        return "{" + ", ".join(f"{k!r}: {_source(v, constants)}" for k, v in obj.items()) + "}"
    constants.append(obj)  # (floats and numpy scalars too: their exact type and bits)
    return f"c{len(constants) - 1}"


def same_plan(a, b):
    """Whether two plans queue the same launches, allocate the same way and return the same
    views (the kept constants compared by identity)."""
    if a is None or b is None:
        return False
    da, db = vars(a), vars(b)
    if da.keys() != db.keys():
        return False
    for name, va in da.items():
        vb = db[name]
        if name == "keep":
            if len(va) != len(vb) or any(x is not y for x, y in zip(va, vb, strict=True)):
                return False
        elif name == "launches":
            if len(va) != len(vb):
                return False
            for la, lb in zip(va, vb, strict=True):
                if la[0] is not lb[0] or la[1:] != lb[1:]:
                    return False
        elif va != vb:
            return False
    return True
