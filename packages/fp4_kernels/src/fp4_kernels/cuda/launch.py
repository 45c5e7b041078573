"""The launch layer: the caller's context, a kernel, its grid and its arguments, queued on the
caller's stream.

No host synchronization anywhere on this path.  ``GpuContext`` is the caller's device and
current stream, its allocator and flat views of its arrays (``DeviceBuffer``: pointer, length,
dtype, all the direct launcher needs; numba arrays in the simulator).  On a real GPU a kernel
is compiled once per signature (``_numba_abi.compile_kernel``) and launched straight through
``cuLaunchKernel`` by a ``PackedLauncher``, its arguments packed as numba's kernel ABI lays
them out (``_numba_abi.ARRAY_FIELDS``, ``parameter_layout``, ``launch_values``): a few
microseconds a launch instead of the dispatcher's 25-55 (which types every argument and builds
a device-array object for each); in the simulator numba's own dispatcher runs it.

Each op's host function reads its launch from the launch table (``launch_table.LAUNCHES``: the
threads a CTA, what a thread takes a pass, the caps) and the launch policy in force
(``launch_policy``), which overrides the table for the calls inside it.

Importing this module imports no numba CUDA module (the plan cache, imported with the package,
subclasses ``GpuContext``); they are imported where a launch or an allocation needs them.
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys
import threading
from typing import NamedTuple

import numpy as np
from numba import config

from .. import _numba_abi as abi
from .._arrays import DTYPES, numpy_dtype
from .._scalar import KIND_F32
from .._sizes import Size
from .launch_table import (
    DEFAULT_NETWORK_VARIANT,
    DEFAULT_POLICY,
    LAUNCHES,
    NETWORK_VARIANTS,
    POLICY,
    WARP_SIZE,
    LaunchPolicy,
    launch_policy,
)

__all__ = ["GpuContext", "LaunchPolicy", "current_policy", "int64", "launch", "launch_policy"]

SIMULATOR = bool(config.ENABLE_CUDASIM)  # numba's CUDA simulator runs the kernels


def current_policy() -> LaunchPolicy:
    """The launch policy in force (``launch_policy``), or the table's choice."""
    return POLICY.get() or DEFAULT_POLICY


_sm_count = {}


def sm_count(device_id):
    n = _sm_count.get(device_id)
    if n is None:
        from numba import cuda

        n = 1 if SIMULATOR else cuda.get_current_device().MULTIPROCESSOR_COUNT
        _sm_count[device_id] = n
    return n


def int64(value):
    """A kernel's int64 scalar argument: ``np.int64(value)``, or a symbolic size (``_sizes``:
    a plan of every shape being recorded) kept symbolic."""
    if type(value) is Size:
        return value.as_int64()
    return np.int64(value)


def threads_for(default):
    """The CTA size: the policy's if it sets one, else the op's ``default``."""
    threads = current_policy().threads
    return default if threads is None else threads


def grid_for(work_items, per_cta):
    """CTAs for ``work_items`` when one CTA takes ``per_cta`` of them per pass (>= 1)."""
    blocks = -(-work_items // per_cta)
    if blocks < 1:  # (not ``max(1, ...)``: a symbolic size's guard is then the rare case)
        blocks = 1
    cap = current_policy().max_blocks
    return blocks if cap is None else min(blocks, cap)


_compiled = {}  # (kernel, device, argument dtypes) -> PackedLauncher
_resident = {}  # (that key, threads, resident threads an SM) -> CTAs resident at once
_carveout = {}  # that key -> its launcher's ctas_per_sm: the carveout's CTAs an SM (None: driver)


def current_device_id():
    """The device of numba's current CUDA context: a kernel handle (``CUfunction``) belongs to
    one context, so compiled launchers and occupancy are kept per device."""
    from numba import cuda

    return cuda.current_context().device.id


def launch(kernel, blocks, threads, ctx, args, threads_per_sm=None):
    """Queue ``kernel`` on the caller's stream (``ctx.submit``, on ``ctx.device_id``, the
    device the host wrapper made current); ``args`` are DeviceBuffers (GPU) or numba arrays
    (simulator) and numpy scalars.  Returns the number of CTAs launched: on a GPU the grid is
    capped at the CTAs that can be resident at once (occupancy API).

    ``threads_per_sm``: the resident threads an SM the kernel is meant to run with; its
    shared-memory carveout is then sized for that many threads' CTAs and the rest of the SM's
    unified L1 / shared memory stays L1 (the occupancy, and so the grid, follow).  None: the
    driver's choice, which maximizes resident CTAs.  A launch policy's ``threads_per_sm``
    overrides it."""
    if SIMULATOR:
        kernel[blocks, threads, ctx.stream](*args)
        return blocks
    device = ctx.device_id
    if device is None:  # numba device arrays: the current context's device
        device = current_device_id()
    key = (kernel, device, tuple(a.dtype for a in args))
    launcher = _compiled.get(key)
    if launcher is None:
        cu_kernel = abi.compile_kernel(kernel, map(numba_type, args))
        launcher = _compiled[key] = PackedLauncher(cu_kernel, args)
        launcher.cu_kernel = cu_kernel
        launcher.key = key
    forced = current_policy().threads_per_sm
    if forced is not None:
        threads_per_sm = forced or None
    ctas_per_sm = None if threads_per_sm is None else max(1, threads_per_sm // threads)
    if launcher.ctas_per_sm != ctas_per_sm:
        set_carveout(launcher, ctas_per_sm)
    resident = _resident.get((key, threads, ctas_per_sm))
    if resident is None:
        per_sm = launcher.cu_kernel.occupancy.max_active_blocks_per_multiprocessor(threads, 0)
        resident = _resident[(key, threads, ctas_per_sm)] = max(1, per_sm) * sm_count(device)
    blocks = min(blocks, resident)
    # queued, or recorded into a plan (``_plans``) with the carveout it was launched under
    ctx.submit(launcher, blocks, threads, args, ctas_per_sm)
    return blocks


def set_carveout(launcher, ctas_per_sm):
    """Size the shared-memory carveout of ``launcher``'s kernel for ``ctas_per_sm`` CTAs an SM
    (None: the driver's choice).  It is an attribute of the kernel, which follows the latest
    launch of any kind: ``launch`` and a plan's launches set it again where it differs from
    what they were sized for (``launcher.ctas_per_sm``)."""
    abi.set_carveout(launcher.cu_kernel, launcher.key[1], ctas_per_sm)
    launcher.ctas_per_sm = _carveout[launcher.key] = ctas_per_sm


def seed_step_args(ctx, seed, step, step_array=None):
    """The Philox key and counter arguments of an encoding kernel: ``seed``'s low and high
    words (uint32), then ``step`` (uint32) or, where the call gave its step as a one-element
    int64 array (``step_array``), a view of that array: the argument of the kernel variant
    compiled with ``device_step``, which reads the step at launch."""
    last = np.uint32(step) if step_array is None else ctx.view(step_array)
    return np.uint32(seed & 0xFFFFFFFF), np.uint32(seed >> 32), last


def max_blocks(default_per_sm, device_id):
    """The largest grid an op with a partials buffer may launch (its size)."""
    cap = current_policy().max_blocks
    return cap if cap is not None else sm_count(device_id) * default_per_sm


# ------------------------------------------------- the group kernels (transform, FP4Quant)


def network_variant():
    """The butterfly network variant ``FP4_HADAMARD_VARIANT`` names (default
    ``launch_table.DEFAULT_NETWORK_VARIANT``).  Read when a call's kernels are chosen: a
    torch call whose kind has a plan keeps the variant of its plan (a change in a running
    process takes effect for them after ``fp4_kernels._plans.clear()``)."""
    name = os.environ.get("FP4_HADAMARD_VARIANT") or DEFAULT_NETWORK_VARIANT
    if name not in NETWORK_VARIANTS:
        raise ValueError(
            f"FP4_HADAMARD_VARIANT: {name!r} is not one of {', '.join(NETWORK_VARIANTS)} (unset "
            f"it for the default, {DEFAULT_NETWORK_VARIANT})"
        )
    return name


def network_choice(group_size, kind):
    """(smem, prefetch): whether the current variant runs the "smem" network at
    ``group_size``, and with the prefetch, for a kernel that loads elements of ``kind`` (None:
    packed FP4 codes).  The one rule for the transform and FP4Quant's kernels: float32 input
    does not prefetch (32 more registers, not worth it)."""
    choice = NETWORK_VARIANTS[network_variant()]
    if choice is None or group_size < choice[0]:
        return False, False
    return True, choice[1] and kind != KIND_F32


def network_max_threads(prefetch):
    """Most threads a CTA of the "smem" network's kernels below g = 2048 (the transform's rows:
    "hadamard_prefetch" with the prefetch, "hadamard" without)."""
    return LAUNCHES["hadamard_prefetch" if prefetch else "hadamard"].threads


def group_grid(row, group_size, n, device_id, max_threads=None):
    """(CTAs, threads) of a kernel on the butterfly networks over ``n`` elements, on the launch
    table's ``row`` (``items_per_thread`` elements a thread; a warp's tile 32 times that): a
    CTA is one group where a group spans several warps' tiles (g >= 2048: its warps exchange
    through shared memory), the row's threads otherwise (at most ``max_threads``); a
    persistent grid of up to the row's resident threads an SM (``launch`` caps it again at
    what fits)."""
    per_thread = row.items_per_thread
    if group_size > WARP_SIZE * per_thread:
        threads = group_size // per_thread
    else:
        threads = threads_for(row.threads)
        if max_threads is not None:
            threads = min(threads, max_threads)
    blocks = grid_for(n, threads * per_thread)
    return min(blocks, max_blocks(max(1, row.threads_per_sm // threads), device_id)), threads


# ---------------------------------------------------------------------- the caller's context


class GpuContext:
    """The caller's device and current stream, flat views of its arrays and an allocator of
    its kind.  On a real GPU a view is a ``DeviceBuffer`` (pointer, length, dtype: all the
    direct launcher needs); in the simulator it is a numba array."""

    def __init__(self, x, backend):
        init_torch_tables()
        self.backend = backend
        self.simulator = bool(config.ENABLE_CUDASIM)
        if backend.lib == "torch":
            torch = sys.modules.get("torch")
            dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
            self.device_id = dev
            stream_ptr = _torch_stream(torch, dev)
        elif backend.lib == "cupy":
            import cupy

            self.device_id = backend.device
            stream_ptr = cupy.cuda.get_current_stream().ptr
        else:
            self.device_id = None
            stream_ptr = 0  # numba device arrays: the legacy default stream
        if self.simulator:
            from numba import cuda

            self.stream = cuda.default_stream()
        else:
            self.stream = StreamRef(stream_ptr)

    def view(self, arr, np_dtype=None):
        """Zero-copy flat view of a C-contiguous GPU array of the caller's kind as ``np_dtype``
        (default: its own dtype; raw bits for bfloat16)."""
        lib = self.backend.lib
        if self.simulator:  # only numba (fake) device arrays exist there
            d = arr.reshape(arr.size) if arr.ndim != 1 else arr
            return d.view(np_dtype) if np_dtype is not None else d
        if lib == "torch":
            ptr = arr.data_ptr()
            nbytes = arr.numel() * arr.element_size()
            own = TORCH_NP.get(arr.dtype)
        elif lib == "cupy":
            ptr = arr.data.ptr
            nbytes = arr.nbytes
            own = arr.dtype
        else:
            ptr = arr.device_ctypes_pointer.value or 0
            nbytes = arr.nbytes
            own = arr.dtype
        dt = np.dtype(np_dtype if np_dtype is not None else own)
        return DeviceBuffer(ptr, nbytes // dt.itemsize, dt)

    def words_view(self, x, kind):
        """(view, aligned): ``x`` as uint32 words when its address is 16-byte aligned (the
        block kernels' vector loads), else as its own elements (uint16 / uint32)."""
        if _address(x, self.simulator) % 16 == 0:
            return self.view(x, np.uint32), True
        return self.view(x, np.uint32 if kind == KIND_F32 else np.uint16), False

    def codes_view(self, data, align):
        """(view, aligned): packed codes as uint32 words when their address is a multiple of
        ``align`` bytes (one vector load per block), else as bytes."""
        if _address(data, self.simulator) % align == 0:
            return self.view(data, np.uint32), True
        return self.view(data, np.uint8), False

    def fill(self, arr, value):
        """Fill a float32 array of the caller's kind with ``value`` on the caller's stream."""
        lib = self.backend.lib
        if lib == "torch":
            arr.fill_(value)
        elif lib == "cupy":
            arr.fill(value)
        else:
            arr.copy_to_device(np.full(arr.shape, value, np.float32))

    def empty(self, shape, np_dtype, like_dtype=None, zero=False):
        """Allocate on the caller's device through the caller's allocator (torch caching
        allocator / CuPy memory pool / numba), ordered on the caller's stream."""
        lib = self.backend.lib
        if lib == "torch":
            torch = sys.modules.get("torch")
            tdt = like_dtype if like_dtype is not None else TORCH_OF_NP[np_dtype]
            f = torch.zeros if zero else torch.empty
            return f(shape, dtype=tdt, device=_torch_device(torch, self.device_id))
        if lib == "cupy":
            import cupy

            f = cupy.zeros if zero else cupy.empty
            return f(shape, dtype=like_dtype if like_dtype is not None else np_dtype)
        from numba import cuda

        d = cuda.device_array(shape, dtype=like_dtype if like_dtype is not None else np_dtype)
        if zero:
            _numba_zero(d)
        return d

    def constant(self, values):
        """A device array of the caller's kind on its device holding ``values`` (a 1-D numpy
        array of 4-byte elements), made once and kept: what a kernel reads as a constant
        argument (the transform's sign words, MXFP4's tensor scale 1.0).  One value repeated
        is filled where it lives (on the caller's stream, no copy from the host)."""
        key = (self.backend.lib, self.device_id, values.dtype.str, values.tobytes())
        arr = CONSTANTS.get(key)
        if arr is None:
            arr = CONSTANTS[key] = self._to_device(values)
        return arr

    def _to_device(self, values):
        lib = self.backend.lib
        if self.simulator or lib == "numba":
            from numba import cuda

            return cuda.to_device(values)
        one = bool(np.all(values == values[0]))
        if lib == "cupy":
            import cupy

            return cupy.full(values.shape, values[0], values.dtype) if one else cupy.asarray(values)
        torch = sys.modules.get("torch")
        device = _torch_device(torch, self.device_id)
        dtype = TORCH_OF_NP[values.dtype]
        bits = values.view(TORCH_NP[dtype])  # the same bits as torch's dtype holds them
        if one:
            return torch.full(values.shape, bits[0].item(), dtype=dtype, device=device)
        return torch.from_numpy(bits.copy()).to(device)

    def submit(self, launcher, blocks, threads, args, ctas_per_sm=None):
        """Queue a compiled launch (``launch.launch``, which has sized the kernel's carveout
        for ``ctas_per_sm``) on the caller's stream."""
        launcher(self.stream.ptr, blocks, threads, args)

    def float_dtype_of_kind(self, kind):
        return self.float_dtype(DTYPES[kind])

    def float_dtype(self, dt):
        """The array library's dtype object for an element dtype name."""
        lib = self.backend.lib
        if lib == "torch":
            return getattr(sys.modules.get("torch"), dt)
        if lib == "cupy" and dt == "bfloat16":
            raise TypeError(
                "dtype: CuPy has no bfloat16; dequantize to float32 or float16, or use torch"
            )
        return numpy_dtype(dt)  # numba device arrays take ml_dtypes' bfloat16


def _torch_stream(torch, dev):
    """The raw handle of torch's current stream on ``dev``: torch's own C accessor (what
    torch.cuda.current_stream(dev).cuda_stream returns, without building a Stream object)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(dev)
    return torch.cuda.current_stream(dev).cuda_stream


_TORCH_DEVICES = {}


def _torch_device(torch, index):
    d = _TORCH_DEVICES.get(index)
    if d is None:
        d = _TORCH_DEVICES[index] = torch.device("cuda", index)
    return d


def _address(arr, simulator):
    """The address of a GPU array's first element (in the simulator: of the host array that
    stands for it, so the unaligned code paths run there too)."""
    if simulator:
        return arr._ary.__array_interface__["data"][0]
    if hasattr(arr, "data_ptr"):
        return arr.data_ptr()
    if hasattr(arr, "data") and hasattr(arr.data, "ptr"):
        return arr.data.ptr
    return arr.device_ctypes_pointer.value or 0


CONSTANTS = {}  # (array kind, device, dtype, bytes) -> ``GpuContext.constant``'s arrays
# numpy dtype, as its scalar type or dtype object -> the torch dtype of a GPU buffer of those
# bits (keyed both ways: np.dtype(x).name cost more than an allocation's own Python)
TORCH_OF_NP = {}
TORCH_NP = {}  # torch dtype -> the numpy dtype a view of it has


def init_torch_tables():
    """dtype maps between torch and numpy, filled once torch has been imported by the caller."""
    torch = sys.modules.get("torch")
    if torch is None or TORCH_OF_NP:
        return
    by_name = {
        "uint8": torch.uint8,
        "float32": torch.float32,
        "uint16": torch.int16,
        "uint32": torch.int32,
        "uint64": torch.int64,
    }
    for name, tdt in by_name.items():
        TORCH_OF_NP.update({np.dtype(name): tdt, np.dtype(name).type: tdt})
    TORCH_NP.update(
        {
            torch.uint8: np.dtype(np.uint8),
            torch.float32: np.dtype(np.float32),
            torch.float16: np.dtype(np.float16),
            torch.bfloat16: np.dtype(np.uint16),
            torch.int16: np.dtype(np.int16),
            torch.int32: np.dtype(np.int32),
            torch.int64: np.dtype(np.int64),
        }
    )


def _numba_zero(d):
    if config.ENABLE_CUDASIM:
        d[...] = 0
        return
    from numba.cuda.cudadrv.driver import device_memset

    device_memset(d, 0, d.nbytes)


# ---------------------------------------------------------------------- direct launch


class DeviceBuffer(NamedTuple):
    """A flat, C-contiguous device buffer seen as ``n`` elements of ``dtype``."""

    ptr: int
    n: int
    dtype: np.dtype


class StreamRef:
    """A raw CUstream handle in the ``__cuda_stream__`` protocol cuda.core accepts."""

    __slots__ = ("ptr",)

    def __init__(self, ptr):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


# struct codes of the scalar kernel parameters (native size and alignment)
_SCALAR_CODES = {np.dtype(np.int64): "q", np.dtype(np.uint32): "I", np.dtype(np.float32): "f"}


def numba_type(arg):
    """The numba type a launch argument compiles as: a DeviceBuffer is a 1-D C array of its
    dtype, a numpy scalar (or a symbolic ``int64`` size) its own type."""
    from numba.core import types
    from numba.np import numpy_support

    if isinstance(arg, DeviceBuffer):
        return types.Array(numpy_support.from_dtype(arg.dtype), 1, "C")
    return numpy_support.from_dtype(arg.dtype)


def parameter_layout(args):
    """(struct format, [(offset, size)] of each kernel parameter) for ``args`` in numba's ABI:
    a DeviceBuffer is its abi.ARRAY_FIELDS, seven 8-byte words; a scalar its own size; each
    parameter aligned to its size, as the CUDA ABI lays out a kernel's parameter buffer."""
    codes = []
    for a in args:
        array = isinstance(a, DeviceBuffer)
        codes += ["Q"] * len(abi.ARRAY_FIELDS) if array else [_SCALAR_CODES[a.dtype]]
    fmt, params, offset = "=", [], 0
    for c in codes:
        size = struct.calcsize("=" + c)
        pad = -offset % size
        fmt += "x" * pad + c
        offset += pad
        params.append((offset, size))
        offset += size
    return fmt, params


_DATA_FIELD = abi.ARRAY_FIELDS.index("data")


def launch_values(args):
    """(values, positions): the kernel parameters of ``args`` in numba's ABI, one value per
    field (a DeviceBuffer is its abi.ARRAY_FIELDS: meminfo and parent 0, its length as nitems and
    shape, its itemsize as itemsize and stride), and where each argument's own value is in them
    (a DeviceBuffer's data pointer, a scalar itself): what a launch plan patches per call."""
    values, positions = [], []
    for a in args:
        if isinstance(a, DeviceBuffer):
            size = a.dtype.itemsize
            positions.append(len(values) + _DATA_FIELD)
            values += (0, 0, a.n, size, a.ptr, a.n, size)
        else:
            positions.append(len(values))
            values.append(a)
    return values, positions


_libcuda = None


def _cu_launch_kernel():
    global _libcuda
    if _libcuda is None:
        lib = ctypes.CDLL("libcuda.so.1")
        f = lib.cuLaunchKernel
        f.restype = ctypes.c_int
        f.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        _libcuda = f
    return _libcuda


class PackedLauncher:
    """One kernel, one argument signature: the parameter buffer laid out once, each launch a
    ``struct.pack_into`` of the values and one ``cuLaunchKernel`` (a few microseconds).

    The layout is checked against the compiled kernel's own parameter table
    (``cuda.core``'s ``Kernel.arguments_info``) when the launcher is made, so a numba release
    that changes its ABI raises here instead of launching with shifted arguments."""

    def __init__(self, cu_kernel, args):
        fmt, params = parameter_layout(args)
        info = [(int(o), int(z)) for o, z in cu_kernel.arguments_info]
        if info != params:
            raise RuntimeError(
                "numba's kernel ABI differs from the layout fp4_kernels packs "
                f"({len(info)} parameters {info[:8]}... vs {len(params)} {params[:8]}...); "
                "this numba-cuda release is not supported"
            )
        self.struct = struct.Struct(fmt)
        self.buffer = ctypes.create_string_buffer(max(1, self.struct.size))
        base = ctypes.addressof(self.buffer)
        self.pointers = (ctypes.c_void_p * len(params))(*[base + o for o, _ in params])
        self.function = int(cu_kernel.handle)
        self.ctas_per_sm = None  # the carveout last set (``set_carveout``; None: the driver's)
        self.cu_launch_kernel = _cu_launch_kernel()
        self.lock = threading.Lock()  # the buffer is shared: pack and launch as one step

    def __call__(self, stream_ptr, blocks, threads, args):
        self.launch_values(stream_ptr, blocks, threads, launch_values(args)[0])

    def launch_values(self, stream_ptr, blocks, threads, values):
        """Launch with the parameter values already laid out (``launch_values(args)[0]``)."""
        with self.lock:
            self.struct.pack_into(self.buffer, 0, *values)
            rc = self.cu_launch_kernel(
                self.function, blocks, 1, 1, threads, 1, 1, 0, stream_ptr, self.pointers, None
            )
        if rc:
            raise RuntimeError(f"cuLaunchKernel failed with CUresult {rc}")
