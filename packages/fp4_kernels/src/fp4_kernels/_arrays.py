"""Array kinds in and out: numpy / torch CPU run on the CPU; torch CUDA, CuPy and numba device
arrays run on the GPU, zero-copy, on the caller's current stream, with no host synchronization.

Everything the kernels see is a flat view of raw bits (uint64 words on the GPU, uint16/uint32
elements on the CPU), so bfloat16 needs no support from the array library beyond a bit view.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from . import _numba_abi as abi
from ._scalar import KIND_BF16, KIND_F16, KIND_F32

DTYPES = ("float32", "bfloat16", "float16")
KIND_OF_DTYPE = {"float32": KIND_F32, "bfloat16": KIND_BF16, "float16": KIND_F16}
BITS_DTYPE = {"float32": np.uint32, "bfloat16": np.uint16, "float16": np.uint16}


@dataclass(frozen=True)
class Backend:
    """Where an array lives and how to make more like it."""

    lib: str  # "numpy" | "torch" | "cupy" | "numba"
    gpu: bool
    device: object = None  # torch.device, cupy device id or numba device id


def _torch():
    return sys.modules.get("torch")


def backend_of(x, name="x"):
    """Classify ``x``; raise TypeError naming ``name`` for anything unsupported."""
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        _check_torch_tensor(torch, x, name)
        return Backend("torch", x.is_cuda, x.device)
    if isinstance(x, np.ndarray):
        if type(x) is not np.ndarray and not isinstance(x, np.memmap):
            # np.matrix keeps two dimensions through reshape, a masked array carries a mask
            # the kernels would ignore: neither is a plain buffer of elements
            raise TypeError(
                f"{name}: {type(x).__name__} is not supported (an ndarray subclass whose "
                f"elements are not plain data); pass np.asarray({name}) to quantize its data"
            )
        return Backend("numpy", False)
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(x, cupy.ndarray):
        return Backend("cupy", True, x.device.id)
    # numba DeviceNDArray (and the simulator's FakeCUDAArray): duck-typed, both have these
    if hasattr(x, "copy_to_host") and hasattr(x, "is_c_contiguous") and hasattr(x, "dtype"):
        return Backend("numba", True)
    raise TypeError(
        f"{name}: expected a numpy array, a torch tensor, a CuPy array or a numba device array, "
        f"got {type(x).__name__}"
    )


def is_torch_tensor(x):
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def _check_torch_tensor(torch, x, name):
    """TypeError naming ``name`` for torch tensors whose memory is not plain strided elements
    on the CPU or a CUDA device: the kernels read raw memory, so a lazily negated view
    (``torch._neg_view``, whose memory holds the values un-negated) would be read with the wrong
    sign, and nested, sparse and meta tensors have no such memory."""
    if x.is_nested:
        raise TypeError(
            f"{name}: nested tensors are not supported; pass their components one by one "
            f"({name}.unbind()) or a padded dense tensor ({name}.to_padded_tensor(0.0))"
        )
    if x.layout != torch.strided:
        raise TypeError(
            f"{name}: layout {x.layout} is not supported; pass a dense tensor ({name}.to_dense())"
        )
    kind = x.device.type
    if kind not in ("cpu", "cuda", "meta"):  # (meta: a QuantizedTensor may be moved there)
        raise TypeError(
            f"{name}: a tensor on device '{kind}' is not supported (the kernels need its data "
            f"on the CPU or a CUDA GPU); move it with {name}.cpu() or {name}.cuda()"
        )
    if x.is_neg() or x.is_conj():
        raise TypeError(
            f"{name}: a lazily negated or conjugated view (its memory does not hold the values "
            f"it shows) is not supported; pass {name}.resolve_neg().resolve_conj()"
        )


def check_has_values(x, backend, name="x"):
    """TypeError naming ``name`` for a torch tensor on the meta device (shape and dtype only)."""
    if backend.lib == "torch" and backend.device.type == "meta":
        raise TypeError(
            f"{name}: a tensor on the meta device has no values to read; materialize it first "
            "(e.g. module.to_empty(device=...), then load its weights)"
        )


def dtype_name(x, backend, name="x"):
    """Canonical dtype name of ``x`` ('float32' | 'bfloat16' | 'float16'), else TypeError."""
    if backend.lib == "torch":
        dt = str(x.dtype).replace("torch.", "")
    else:
        npdt = np.dtype(x.dtype)
        dt = npdt.name
        if not npdt.isnative:
            # '>f4'.name is 'float32': without this check the kernels would read big-endian
            # bytes as little-endian values
            raise TypeError(
                f"{name}: byte order {npdt.str!r} is not the machine's; convert first with "
                f"{name}.astype({name}.dtype.newbyteorder('='))"
            )
    if dt not in DTYPES:
        raise TypeError(
            f"{name}: dtype {dt} is not supported; expected float32, bfloat16 or float16 "
            f"(cast first, e.g. x.float() or x.astype(np.float32))"
        )
    return dt


def element_dtype(a, backend):
    """The element type name of any array of ``backend``'s kind ('uint8', 'float32', ...),
    byte order included for numpy-like arrays ('>f4' is not 'float32')."""
    if backend.lib == "torch":
        return str(a.dtype).replace("torch.", "")
    dt = np.dtype(a.dtype)
    return dt.name if dt.isnative else dt.str


def same_place(a, backend, name, where):
    """TypeError / ValueError unless ``a`` is an array of ``backend``'s kind on its device."""
    b = backend_of(a, name)
    if (
        b.lib != backend.lib
        or b.gpu != backend.gpu
        or (b.device is not None and backend.device is not None and b.device != backend.device)
    ):
        raise ValueError(
            f"{name}: must live where {where} lives ({backend.lib}, {_place(backend)}), got "
            f"{b.lib}, {_place(b)}"
        )
    return b


def _place(b):
    if b.gpu:
        return f"GPU {b.device}"
    return "CPU" if b.device is None or str(b.device) == "cpu" else f"device {b.device}"


def normalize_dtype(dtype, name="dtype"):
    """Accept 'bfloat16', np.float32, torch.bfloat16, ml_dtypes.bfloat16 ... -> canonical name."""
    if isinstance(dtype, str):
        dt = dtype
    else:
        torch = _torch()
        if torch is not None and isinstance(dtype, torch.dtype):
            dt = str(dtype).replace("torch.", "")
        else:
            try:
                dt = np.dtype(dtype).name
            except TypeError:
                dt = str(dtype)
    if dt not in DTYPES:
        raise TypeError(f"{name}: {dtype!r} is not supported; use float32, bfloat16 or float16")
    return dt


def is_c_contiguous(x, backend):
    if backend.lib == "torch":
        return x.is_contiguous()
    if backend.lib in ("numpy", "cupy"):
        return x.flags.c_contiguous
    return x.is_c_contiguous()


# ---------------------------------------------------------------------- CPU side


def to_numpy(a):
    """A numpy array of a torch tensor (copied to the host if it is on a GPU) or ``a`` itself."""
    if hasattr(a, "detach"):
        return a.detach().cpu().numpy()
    return a


def cpu_bits(x, dt):
    """Flat numpy view of the raw bits of a numpy array or torch CPU tensor (no copy)."""
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        x = x.detach().reshape(-1).view(torch.int32 if dt == "float32" else torch.int16).numpy()
    return x.reshape(-1).view(BITS_DTYPE[dt])


def numpy_dtype(dt):
    if dt == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dt)


def cpu_from_bits(bits, dt, shape, backend):
    """Wrap raw bits as an array of dtype ``dt`` and ``shape`` of the given backend (no copy)."""
    if backend.lib == "torch":
        torch = _torch()
        t = torch.from_numpy(bits.view(np.int32 if dt == "float32" else np.int16))
        return t.view(getattr(torch, dt)).reshape(shape)
    if dt == "bfloat16":
        return bits.view(numpy_dtype(dt)).reshape(shape)
    return bits.view(dt).reshape(shape)


def wrap_cpu(arr, backend):
    """Hand a numpy buffer back as the caller's kind (torch CPU -> torch tensor, no copy)."""
    if backend.lib == "torch":
        return _torch().from_numpy(arr)
    return arr


# ---------------------------------------------------------------------- GPU side


class GpuContext:
    """The caller's device and current stream, flat views of its arrays and an allocator of
    its kind.  On a real GPU a view is a ``DeviceBuffer`` (pointer, length, dtype: all the
    direct launcher needs); in the simulator it is a numba array."""

    def __init__(self, x, backend):
        from numba import config

        init_torch_tables()
        self.backend = backend
        self.simulator = bool(config.ENABLE_CUDASIM)
        if backend.lib == "torch":
            torch = _torch()
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
            self.stream = abi.StreamRef(stream_ptr)

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
        return abi.DeviceBuffer(ptr, nbytes // dt.itemsize, dt)

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
            torch = _torch()
            tdt = like_dtype if like_dtype is not None else TORCH_OF_NP[np.dtype(np_dtype).name]
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
        torch = _torch()
        device = _torch_device(torch, self.device_id)
        dtype = TORCH_OF_NP[values.dtype.name]
        bits = values.view(TORCH_NP[dtype])  # the same bits as torch's dtype holds them
        if one:
            return torch.full(values.shape, bits[0].item(), dtype=dtype, device=device)
        return torch.from_numpy(bits.copy()).to(device)

    def submit(self, launcher, blocks, threads, args):
        """Queue a compiled launch (``launch.launch``) on the caller's stream."""
        launcher(self.stream.ptr, blocks, threads, args)

    def float_dtype_of_kind(self, kind):
        return self.float_dtype(DTYPES[kind])

    def float_dtype(self, dt):
        """The array library's dtype object for an element dtype name."""
        lib = self.backend.lib
        if lib == "torch":
            return getattr(_torch(), dt)
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
TORCH_OF_NP = {}  # numpy dtype name -> the torch dtype of a GPU buffer of those bits
TORCH_NP = {}  # torch dtype -> the numpy dtype a view of it has


def init_torch_tables():
    """dtype maps between torch and numpy, filled once torch has been imported by the caller."""
    torch = _torch()
    if torch is None or TORCH_OF_NP:
        return
    TORCH_OF_NP.update(
        {
            "uint8": torch.uint8,
            "float32": torch.float32,
            "uint16": torch.int16,
            "uint32": torch.int32,
            "uint64": torch.int64,
        }
    )
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
    from numba import config

    if config.ENABLE_CUDASIM:
        d[...] = 0
        return
    from numba.cuda.cudadrv.driver import device_memset

    device_memset(d, 0, d.nbytes)
