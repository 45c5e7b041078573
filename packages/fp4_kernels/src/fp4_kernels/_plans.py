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
    return (type(t), t.dtype, t.shape, t.stride(), t.device, t.data_ptr() % _ALIGN)


def policy():
    from .cuda import launch

    return launch._POLICY.get()


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
    with _LOCK:
        _PLANS[key] = plan
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

    def plan(self, result):
        """The plan of what was recorded; ``result``: the placeholders (or None) the call
        returns, in the order the plan returns them."""
        return Plan(self, result)


class Plan:
    """One kind of call: allocations, launches with their argument templates, the result."""

    def __init__(self, tracer, result):
        torch = sys.modules["torch"]
        self.device_id = tracer.device_id
        self.device = torch.device("cuda", tracer.device_id)
        self.n_inputs = sum(1 for s in tracer.sources if s[0] == "input")
        self.keep = tracer.keep
        self.launches = [
            (launcher, blocks, threads, values, tuple(ptrs), tuple(scalars))
            for launcher, blocks, threads, values, ptrs, scalars in tracer.launches
        ]
        # sources -> where they live in a call: the shared byte buffer or their own tensor
        offsets = {}
        own = []  # (source, shape, dtype)
        zero = []  # (byte offset, bytes) of the shared buffer to clear
        packed = 0
        for i, s in enumerate(tracer.sources):
            if s[0] != "alloc":
                continue
            _, shape, dtype, is_packed, is_zero = s
            if is_packed:
                nbytes = math.prod(shape) * _torch_itemsize(dtype)
                offsets[i] = packed
                if is_zero:
                    zero.append((packed, nbytes))
                packed += -(-nbytes // SECTION_ALIGN) * SECTION_ALIGN
            else:
                own.append((i, shape, dtype))
        self.packed_bytes = packed
        self.offsets = offsets
        self.own = own
        self.zero = zero
        self.result = tuple(None if r is None else self._result_spec(r) for r in result)

    def _result_spec(self, v):
        if v.offset % v.itemsize:
            raise ValueError("a result view must start on a whole element")
        strides = []
        step = 1
        for d in reversed(v.shape):
            strides.append(step)
            step *= max(d, 1)
        stride = tuple(reversed(strides))
        if v.source in self.offsets:
            offset = (self.offsets[v.source] + v.offset) // v.itemsize
            return ("packed", v.dtype, v.shape, stride, offset)
        return ("own", v.source, v.shape, stride, v.offset // v.itemsize)

    def __call__(self, inputs, scalars=()):
        """Queue the plan's launches for ``inputs`` (the tensors, in the recorded order) and
        ``scalars`` (seed low and high words, step, amax as float32); returns the result."""
        dev = self.device_id
        if _devices.needs_scope(dev):
            with _devices.on_device(self):
                return self._run(inputs, scalars)
        return self._run(inputs, scalars)

    simulator = False  # for on_device

    def _run(self, inputs, scalars):
        torch = sys.modules["torch"]
        stream = arrays._torch_stream(torch, self.device_id)
        base = [t.data_ptr() for t in inputs]
        tensors = {}
        buf = None
        if self.packed_bytes:
            buf = torch.empty(self.packed_bytes, dtype=torch.uint8, device=self.device)
            p = buf.data_ptr()
            if p % _ALIGN:
                raise RuntimeError(f"the allocator returned an address {p:#x} not 16-byte aligned")
            for off, nbytes in self.zero:
                buf[off : off + nbytes].zero_()
        ptrs = {}
        for i, off in self.offsets.items():
            ptrs[i] = p + off
        for i, shape, dtype in self.own:
            t = tensors[i] = torch.empty(shape, dtype=dtype, device=self.device)
            ptrs[i] = t.data_ptr()
        for i in range(self.n_inputs):
            ptrs[i] = base[i]
        for launcher, blocks, threads, template, pointers, scalar_slots in self.launches:
            values = list(template)
            for pos, source, rel in pointers:
                values[pos] = ptrs[source] + rel
            for pos, k in scalar_slots:
                values[pos] = scalars[k]
            launcher.launch_values(stream, blocks, threads, values)
        out = []
        views = {}
        for spec in self.result:
            if spec is None:
                out.append(None)
            elif spec[0] == "packed":
                _, dtype, shape, stride, offset = spec
                b = views.get(dtype)
                if b is None:
                    b = views[dtype] = buf if dtype == torch.uint8 else buf.view(dtype)
                out.append(b.as_strided(shape, stride, offset))
            else:
                _, source, shape, stride, offset = spec
                t = tensors[source]
                if offset == 0 and tuple(t.shape) == shape:
                    out.append(t)
                else:
                    out.append(t.as_strided(shape, stride, offset))
        return out
