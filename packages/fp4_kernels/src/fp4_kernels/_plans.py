"""Launch plans: the host work of a torch CUDA call done once per kind of call.

The first call of a kind (op, options, the input's type, dtype, shape, strides, device and
16-byte alignment, the launch policy) is checked in full, then its op's host function (the one
in ``cuda/<op>.py`` that chooses kernels and grids) runs once against a ``Tracer``: placeholder
arrays whose addresses are tagged symbols, and a stream that records each launch instead of
queuing it.  The recording is the plan: the compiled kernels, grids, the packed argument values
with the places where a call's pointers (inputs, outputs) and scalars (seed, step, a float
``global_amax``) go, and the output layout.  Every later call of the same kind allocates its
outputs (one ``torch.empty`` for all byte outputs: codes, scales, tensor scale and scratch,
each 256-byte aligned in it; a float result is a tensor of its own), writes its pointers and
scalars into the recorded arguments and launches on torch's current stream; no check is
repeated, because everything a check reads is in the key.

Calls that are not of that form (numpy, CuPy, numba arrays, the simulator, empty tensors,
signs given as a vector) take the unplanned path.  The cache is bounded: ``PLAN_CACHE_SIZE``
plans, least recently used evicted first; ``clear()`` empties it and ``disabled()`` turns it
off for the calls inside it (the unplanned path then runs for torch tensors too).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import sys
import threading
from collections import OrderedDict

import numpy as np

from . import _arrays as arrays, _devices
from ._numba_abi import DeviceBuffer

PLAN_CACHE_SIZE = 256

_PLANS: OrderedDict = OrderedDict()
_LOCK = threading.Lock()  # held while a plan is added or evicted
_DISABLED = contextvars.ContextVar("fp4_kernels_plans_disabled", default=False)

# A placeholder address: bit 62 set (no real host or device address has it), the source (an
# input or an allocation of the call) in bits 40..55, the byte offset below.
_TAG = 0x5A << 56
_SOURCE_SHIFT = 40
_ALIGN = 16  # the largest alignment a host function tests (16-byte vector loads)
SECTION_ALIGN = 256  # each byte output's offset in the shared allocation

# Probe scalars: distinctive values passed while recording, found again in the arguments.
PROBE_SEED = (0x5EED_0001 << 32) | 0x5EED_0002
PROBE_STEP = 0x57E9_0003
PROBE_AMAX = 1234.567
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
    if t.is_nested or t.is_neg():  # not in the key: the unplanned path refuses them
        return None
    return (type(t), t.dtype, t.shape, t.stride(), t.device, t.data_ptr() % _ALIGN)


_POLICY = []  # launch's ContextVar of the launch policy, once cuda.launch is imported


def policy():
    """The launch policy in force (a plan depends on it)."""
    if not _POLICY:
        from .cuda import launch

        _POLICY.append(launch._POLICY)
    return _POLICY[0].get()


def enabled() -> bool:
    return not _DISABLED.get()


def get(key):
    """The plan of ``key``, or None (also for a key that cannot be hashed)."""
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
        return _TAG | (self.source << _SOURCE_SHIFT) | (self.misalign + self.offset)

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
        start, stop, _ = index.indices(self.shape[0])
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


class Tracer(arrays.GpuContext):
    """The ``GpuContext`` a host function runs against while its plan is recorded."""

    def __init__(self, device_id):
        from . import _numba_abi as abi

        arrays.init_torch_tables()
        self._abi = abi
        self.backend = arrays.Backend("torch", True, None)
        self.simulator = False
        self.device_id = device_id
        self.stream = self
        self.sources = []  # ("input", tensor) | ("alloc", shape, torch dtype, packed, zero)
        self.launches = []
        self.keep = []  # constant device arrays the recorded arguments point into
        self._misaligns = {}

    def input(self, t):
        """A placeholder for the input tensor ``t`` (its misalignment kept)."""
        if t is None:
            return None
        self.sources.append(("input",))
        source = len(self.sources) - 1
        self._misaligns[source] = t.data_ptr() % _ALIGN
        return VirtualArray(
            source, 0, tuple(t.shape), t.dtype, t.element_size(), self._misaligns[source]
        )

    def empty(self, shape, np_dtype, like_dtype=None, zero=False):
        # a float result (like_dtype) is a tensor of its own; byte outputs share one buffer
        packed = like_dtype is None
        dtype = arrays._TORCH_OF_NP[np.dtype(np_dtype).name] if packed else like_dtype
        shape = tuple(shape)
        self.sources.append(("alloc", shape, dtype, packed, zero))
        return VirtualArray(len(self.sources) - 1, 0, shape, dtype, _torch_itemsize(dtype), 0)

    def fill(self, arr, value):
        raise NotImplementedError("plans are made for non-empty tensors only")

    def view(self, arr, np_dtype=None):
        if not isinstance(arr, VirtualArray):
            self.keep.append(arr)  # a cached constant (sign words, the MXFP4 scale 1.0)
        return super().view(arr, np_dtype)

    # the recording stream (``launch.launch`` calls it instead of queuing)
    def record(self, launcher, blocks, threads, args):
        from ._numba_abi import _values

        values = _values(args)
        pointers, scalars = [], []
        pos = 0
        for a in args:
            if isinstance(a, DeviceBuffer):
                ptr_pos = pos + 4  # ARRAY_FIELDS: meminfo, parent, nitems, itemsize, data, ...
                if a.ptr & _TAG == _TAG:
                    source = (a.ptr >> _SOURCE_SHIFT) & 0xFFFF
                    rel = (a.ptr & ((1 << _SOURCE_SHIFT) - 1)) - self._misalign(source)
                    pointers.append((ptr_pos, source, rel))
                pos += 7
            else:
                for i, (dt, probe) in enumerate(_PROBES):
                    if a.dtype == dt and a == probe:
                        scalars.append((pos, i))
                        break
                pos += 1
        self.launches.append((launcher, blocks, threads, values, pointers, scalars))

    def _misalign(self, source):
        return self._misaligns.get(source, 0)

    def plan(self, result, scalars=()):
        """The plan of what was recorded; ``result``: the placeholders (or None) the call
        returns, in the order the plan returns them; ``scalars``: the probes (indices into
        seed low, seed high, step, amax) the call must find in the arguments, or a per-call
        value would silently be the probe's."""
        found = {k for launch in self.launches for _, k in launch[5]}
        missing = set(scalars) - found
        if missing:
            raise RuntimeError(f"probe scalars {sorted(missing)} not found in the launches")
        return Plan(self, result)


class Plan:
    """One kind of call: allocations, launches with their argument templates, the result.

    A call fills ``slots``: the inputs' addresses (in the order they were recorded), the
    shared buffer's sections, the own tensors, then the scalars; each launch's template gets
    ``slots[slot] + rel`` at the positions recorded for it."""

    simulator = False  # (read by ``_devices.on_device``)

    def __init__(self, tracer, result):
        torch = sys.modules["torch"]
        self.device_id = tracer.device_id
        self.device = torch.device("cuda", tracer.device_id)
        # torch's current stream of a device, without building a Stream object
        self.current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
            lambda device: torch.cuda.current_stream(device).cuda_stream
        )
        self.keep = tracer.keep
        inputs, sections, own = [], [], []  # source indices of each kind
        self.zero = []  # (byte offset, bytes) of the shared buffer to clear
        self.section_offsets = []
        packed = 0
        for i, s in enumerate(tracer.sources):
            if s[0] == "input":
                inputs.append(i)
                continue
            _, shape, dtype, is_packed, is_zero = s
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
        self.n_inputs = len(inputs)
        self.own = [tracer.sources[i][1:3] for i in own]  # (shape, dtype)
        order = inputs + sections + own
        slot = {source: k for k, source in enumerate(order)}
        n_slots = len(order)
        self.launches = [
            (
                launcher, blocks, threads, values,
                tuple((pos, slot[source], rel) for pos, source, rel in pointers)
                + tuple((pos, n_slots + k, 0) for pos, k in scalars),
            )
            for launcher, blocks, threads, values, pointers, scalars in tracer.launches
        ]  # fmt: skip
        # results: views of the shared buffer (as uint8 or another dtype) or own tensors
        self.view_dtypes = []
        specs = []
        for v in result:
            if v is None:
                specs.append(None)
                continue
            if v.offset % v.itemsize:
                raise ValueError("a result view must start on a whole element")
            stride, step = [], 1
            for d in reversed(v.shape):
                stride.insert(0, step)
                step *= max(d, 1)
            if v.source in own:
                k = own.index(v.source)
                specs.append(["own", k, v.shape, tuple(stride), v.offset // v.itemsize])
                continue
            offset = self.section_offsets[sections.index(v.source)] + v.offset
            if v.dtype != torch.uint8 and v.dtype not in self.view_dtypes:
                self.view_dtypes.append(v.dtype)
            specs.append(["packed", v.dtype, v.shape, tuple(stride), offset // v.itemsize])
        # bases of a call: [buffer, buffer viewed as each of view_dtypes..., own tensors...]
        n_views = 1 + len(self.view_dtypes)
        self.result = []
        for spec in specs:
            if spec is None:
                self.result.append(None)
            elif spec[0] == "own":
                _, k, shape, stride, offset = spec
                whole = offset == 0 and tuple(self.own[k][0]) == shape
                self.result.append((n_views + k, shape, stride, offset, whole))
            else:
                _, dtype, shape, stride, offset = spec
                base = 0 if dtype == torch.uint8 else 1 + self.view_dtypes.index(dtype)
                self.result.append((base, shape, stride, offset, False))

    def __call__(self, inputs, scalars=()):
        """Queue the plan's launches for ``inputs`` (the tensors, in the recorded order) and
        ``scalars`` (seed low and high words, step, amax as float32); returns the result."""
        if _devices.needs_scope(self.device_id):
            with _devices.on_device(self):
                return self._run(inputs, scalars)
        return self._run(inputs, scalars)

    def _run(self, inputs, scalars):
        torch = sys.modules["torch"]
        slots = [t.data_ptr() for t in inputs]
        bases = []
        if self.packed_bytes:
            buf = torch.empty(self.packed_bytes, dtype=torch.uint8, device=self.device)
            p = buf.data_ptr()
            if p % _ALIGN:
                raise RuntimeError(f"the allocator returned an address {p:#x} not 16-byte aligned")
            for off, nbytes in self.zero:
                buf[off : off + nbytes].zero_()
            slots += [p + off for off in self.section_offsets]
            bases.append(buf)
            bases += [buf.view(dt) for dt in self.view_dtypes]
        else:
            bases.append(None)
        for shape, dtype in self.own:
            t = torch.empty(shape, dtype=dtype, device=self.device)
            slots.append(t.data_ptr())
            bases.append(t)
        slots += scalars
        stream = self.current_stream(self.device_id)
        for launcher, blocks, threads, template, patches in self.launches:
            values = template.copy()
            for pos, slot, rel in patches:
                values[pos] = slots[slot] + rel
            launcher.launch_values(stream, blocks, threads, values)
        return [
            None
            if spec is None
            else bases[spec[0]]
            if spec[4]
            else bases[spec[0]].as_strided(spec[1], spec[2], spec[3])
            for spec in self.result
        ]
