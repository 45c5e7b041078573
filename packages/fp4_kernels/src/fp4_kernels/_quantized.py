"""``QuantizedTensor`` and ``FP4Quant``, the checks of every field a kernel reads
(``check_quantized``) and the sizes derived from a shape and a format."""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import numpy as np

from . import _arrays as arrays
from ._calls import (
    SPECS,
    Geometry,
    backend_of,
    check_choice,
    check_field,
    check_has_values,
    check_int,
    element_dtype,
    format_spec,
    is_torch_tensor,
    normalize_dtype,
    payload_views,
    same_place,
)
from .formats.fp4quant import FP4Quant

FORMATS = {name: spec.block_size for name, spec in SPECS.items()}  # format -> block size
SCALE_LAYOUTS = ("linear", "swizzled")

#: A numpy array, a torch tensor (CPU or CUDA), a CuPy array or a numba device array; results
#: are arrays of the input's kind, on its device.
Array = Any
#: A dtype: a name ("float32", "bfloat16", "float16"), a numpy / ml_dtypes or a torch dtype.
DType = Any
Rounding = Literal["nearest", "stochastic"]
ScaleLayout = Literal["linear", "swizzled"]
#: A torch.device, a device string ("cuda:1", "cpu") or a CUDA device index.
Device = Any


#: ``fmt=`` of quantize / dequantize: "nvfp4", "mxfp4" or an ``FP4Quant``.
Format = Literal["nvfp4", "mxfp4"] | FP4Quant


@dataclass(kw_only=True)
class QuantizedTensor:
    """A tensor in NVFP4, MXFP4 or FP4Quant, as ``quantize`` returns it.

    Construction is by keyword only.  The arrays are of one kind (numpy, torch, CuPy or numba
    device arrays) and live on one device; ``dequantize`` checks every field it reads.  From a
    torch CUDA ``quantize``, ``data``, ``scales`` and ``global_scale`` are views of one
    allocation (each 256-byte aligned in it).

    Attributes:
        data: uint8 (..., K/2): element 2i in the low nibble, 2i+1 in the high nibble.
        scales: uint8 raw e4m3 bits (NVFP4) or e8m0 bits (MXFP4); linear: (..., K/block);
            swizzled: 1-D, the padded 128x4-tile layout cuBLASLt and torch._scaled_mm read.
            FP4Quant: uint16 raw bfloat16 bits (..., K/g).  ``typed_scales()`` views them as
            float8 (bfloat16) values.
        global_scale: float32, shape (1,): the NVFP4 tensor *decode* scale, fp32(1) / S with
            S = 2688 / amax (1.0 for MXFP4), an array of the input's kind so that it can stay
            on the GPU; a decoded element is e2m1 * block scale * global_scale: positive and
            finite (a host array is checked, a GPU array is not read).  None for FP4Quant.
            MXFP4 has no tensor scale: None or [1.0]; another value is refused
            where it can be read without a device synchronization (host arrays; a GPU array is
            not read).  Not FlashInfer's ``global_scale``: the one its ``fp4_quantize`` /
            ``nvfp4_quantize`` take is the *encode* scale S itself (its decode takes 1 / S,
            which is this one).
        fmt: "nvfp4", "mxfp4" or an ``FP4Quant``.
        shape: the shape of the tensor that was quantized.
        dtype: its dtype, as the array library spells it (``torch.bfloat16`` for torch tensors,
            ``numpy.float32`` or ``ml_dtypes.bfloat16`` for numpy, CuPy and numba arrays).  The
            constructor accepts a name ("float32", "bfloat16", "float16") or any library's
            dtype and converts it to that of ``data``; ``dtype_name`` is the name.
        scale_layout: "linear" or "swizzled".
        payload: FP4Quant only: the wire buffer, uint8 (n/2 + 2n/g,), codes then scales;
            ``data`` and ``scales`` are views of it, so it can be sent as one message.
    """

    data: Array
    scales: Array
    global_scale: Array | None
    fmt: Format
    shape: tuple[int, ...]
    dtype: DType
    scale_layout: ScaleLayout
    payload: Array | None = None

    # Mutable and compared by value (as a numpy array is): not hashable; key a dict by id(q).
    __hash__ = None  # type: ignore[assignment]

    def __eq__(self, other: object) -> bool:
        """Field-wise exact equality, a plain bool: the same ``fmt``, ``shape``, ``dtype`` and
        ``scale_layout``, and ``data``, ``scales`` and ``global_scale`` arrays of the same kind
        on the same device with the same dtype, shape and bits (a NaN scale equals itself, -0
        does not equal 0).  ``payload`` holds the bytes of ``data`` and ``scales`` and is not
        compared again.  GPU arrays are compared on their device, which waits for them."""
        if not isinstance(other, QuantizedTensor):
            return NotImplemented
        if self is other:
            return True
        return all(
            _same(getattr(self, f), getattr(other, f))
            for f in ("fmt", "shape", "dtype", "scale_layout")
        ) and all(
            _same_bits(getattr(self, f), getattr(other, f))
            for f in ("data", "scales", "global_scale")
        )

    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any]]]:
        """Pickling and ``copy.deepcopy``: every field, as it is.  FP4Quant's ``data`` and
        ``scales`` are made again as views of the restored ``payload`` (pickling them would
        give three unrelated buffers), and torch uint16 scales travel as int16 (torch does not
        unpickle uint16 tensors)."""
        fields = dict(self.__dict__)
        if self.payload is not None and _are_payload_views(self):
            fields["data"] = fields["scales"] = None
        for name in _ARRAY_FIELDS:
            a = fields[name]
            if is_torch_tensor(a) and a.dtype == sys.modules["torch"].uint16:
                fields[name] = _TorchUint16(a.view(sys.modules["torch"].int16))
        return (_unpickle, (fields,))

    def __post_init__(self) -> None:
        # The dtype of data's library, so that q.dtype compares equal to x.dtype.  A dtype or
        # data that is not supported stays as given: check_quantized (dequantize) names it.
        try:
            name = normalize_dtype(self.dtype)
            lib = backend_of(self.data).lib
        except TypeError:
            return
        if lib == "torch":
            self.dtype = getattr(sys.modules["torch"], name)
        else:
            self.dtype = arrays.numpy_dtype(name)

    @property
    def dtype_name(self) -> str:
        """The name of ``dtype``: "float32", "bfloat16" or "float16"."""
        return normalize_dtype(self.dtype, "dtype")

    @property
    def block_size(self) -> int:
        """Elements per scale: 16 (NVFP4), 32 (MXFP4) or the FP4Quant group size."""
        spec = self._spec()
        return spec.group_size if isinstance(spec, FP4Quant) else spec.block_size

    def _spec(self):
        """The ``FormatSpec`` of ``fmt`` ("nvfp4" / "mxfp4") or the ``FP4Quant``; a ``fmt`` set to
        anything else after construction is named (TypeError / ValueError)."""
        spec = SPECS.get(self.fmt) if type(self.fmt) is str else None
        return format_spec(self.fmt, "fmt") if spec is None else spec

    @property
    def rows(self) -> int:
        """The number of rows: the product of ``shape`` without its last dimension."""
        return math.prod(self.shape[:-1])

    def numel(self) -> int:
        """Elements of the tensor that was quantized (the product of ``shape``)."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of codes + scales (+ the float32 tensor scale for NVFP4; MXFP4 and FP4Quant have
        none): FP4Quant's ``payload`` holds exactly its codes and scales."""
        spec = self._spec()
        tensor_scale = not isinstance(spec, FP4Quant) and spec.tensor_scale
        return int(_nbytes(self.data) + _nbytes(self.scales) + (4 if tensor_scale else 0))

    def typed_scales(self) -> Array:
        """The scales viewed as what they are, without a copy: ``float8_e4m3fn`` (NVFP4),
        ``float8_e8m0fnu`` (MXFP4) or ``bfloat16`` (FP4Quant), as torch dtypes for torch
        tensors (what ``torch._scaled_mm`` takes for block-scaled FP4 operands) and ml_dtypes
        dtypes for numpy arrays.  Same shape and layout as ``scales``; the NaN scale code
        (e4m3 0x7F, e8m0 0xFF) reads as NaN.  CuPy and numba arrays have no such dtypes:
        TypeError.
        """
        backend = backend_of(self.scales, "scales")
        spec = self._spec()
        name = "bfloat16" if isinstance(spec, FP4Quant) else spec.scale_dtype
        if backend.lib == "torch":
            return self.scales.view(getattr(sys.modules["torch"], name))
        if backend.lib == "numpy":
            import ml_dtypes

            return self.scales.view(getattr(ml_dtypes, name))
        raise TypeError(
            f"scales: {backend.lib} arrays have no {name} dtype; typed_scales() views torch "
            "tensors and numpy arrays (move the tensor with .cpu() first, or use torch)"
        )

    def to(self, device: Device, *, non_blocking: bool = False) -> QuantizedTensor:
        """The tensor on ``device`` (a ``torch.device``, "cuda:1", "cpu", a GPU index): each
        field moved with ``torch.Tensor.to``; ``self`` when every field is already there (as
        torch does).  FP4Quant's ``data`` and ``scales`` stay views of the moved ``payload``.

        Fields that are not torch tensors: ``to("cpu")`` is ``cpu()``; moving numpy, CuPy or
        numba arrays to a GPU is not supported (TypeError): convert them to torch tensors.
        The dtype cannot change (``dequantize(q, dtype)`` decodes to another one).
        """
        _check_device(device)
        backend = check_quantized(self, "self")
        if backend.lib != "torch":
            if _is_cpu_device(device):
                return self.cpu()
            raise TypeError(
                f"device: moving {backend.lib} arrays to {device!r} is not supported; .to() "
                "moves torch tensors (wrap the fields with torch.from_numpy / torch.as_tensor)"
            )
        return self._map_torch(lambda t: t.to(device, non_blocking=non_blocking))

    def cpu(self) -> QuantizedTensor:
        """The tensor in host memory: torch CPU tensors for torch fields, numpy arrays for CuPy
        and numba device arrays; ``self`` when it is there already."""
        backend = check_quantized(self, "self")
        if backend.lib == "torch":
            return self._map_torch(lambda t: t.cpu())
        if not backend.gpu:
            return self
        return self._map(_to_host)

    def cuda(self, device: Device | None = None, *, non_blocking: bool = False) -> QuantizedTensor:
        """The tensor on a CUDA device (default: torch's current one), as ``torch.Tensor.cuda``;
        ``self`` when it is there already.  Torch tensors only (TypeError otherwise)."""
        if device is not None:
            _check_device(device)
        backend = check_quantized(self, "self")
        if backend.lib != "torch":
            raise TypeError(
                f"self: .cuda() moves torch tensors; these fields are {backend.lib} arrays "
                "(wrap them with torch.from_numpy / torch.as_tensor first)"
            )
        return self._map_torch(lambda t: t.cuda(device, non_blocking=non_blocking))

    def _map_torch(self, move):
        fields = (self.data, self.scales) if self.payload is None else (self.payload,)
        moved = [move(a) for a in fields]
        gs = None if self.global_scale is None else move(self.global_scale)
        if all(m is a for m, a in zip(moved, fields, strict=True)) and gs is self.global_scale:
            return self  # already there, as torch.Tensor.to returns the tensor itself
        return self._replace_arrays(moved, gs)

    def _map(self, move):
        fields = (self.data, self.scales) if self.payload is None else (self.payload,)
        gs = None if self.global_scale is None else move(self.global_scale)
        return self._replace_arrays([move(a) for a in fields], gs)

    def _replace_arrays(self, moved, global_scale):
        """A copy with (data, scales) or, for FP4Quant, the payload replaced by ``moved``;
        FP4Quant's views are re-derived from the moved payload (moving them one by one would
        give three unrelated buffers)."""
        if self.payload is None:
            data, scales = moved
            return dataclasses.replace(self, data=data, scales=scales, global_scale=global_scale)
        if not _are_payload_views(self):  # (a tensor that stays where it is is returned as is)
            raise ValueError(_PAYLOAD_MISMATCH)
        (payload,) = moved
        lib = backend_of(payload, "payload").lib
        data, scales = payload_views(payload, self.shape, self.numel(), self.block_size, lib)
        return dataclasses.replace(
            self, data=data, scales=scales, global_scale=global_scale, payload=payload
        )


_ARRAY_FIELDS = ("data", "scales", "global_scale", "payload")
# a move re-derives FP4Quant's data and scales from the moved payload: other fields would be lost
_PAYLOAD_MISMATCH = (
    "payload: data and scales are not the views of payload that quantize() made (a field was "
    "replaced since); moving the tensor would give payload's codes and scales, not these. Set "
    "payload=None (dataclasses.replace(q, payload=None)) to move data and scales as they are"
)


class _TorchUint16(NamedTuple):
    """A torch uint16 tensor in a pickle: its bits as int16."""

    bits: Any


def _unpickle(fields):
    """The ``QuantizedTensor`` of ``__reduce__``'s fields."""
    for name in _ARRAY_FIELDS:
        if isinstance(fields[name], _TorchUint16):
            fields[name] = fields[name].bits.view(sys.modules["torch"].uint16)
    if fields["data"] is None:  # FP4Quant: views of the payload
        payload, shape, fmt = fields["payload"], fields["shape"], fields["fmt"]
        lib = backend_of(payload, "payload").lib
        fields["data"], fields["scales"] = payload_views(
            payload, shape, math.prod(shape), fmt.group_size, lib
        )
    q = QuantizedTensor.__new__(QuantizedTensor)  # the fields as they were: nothing converted
    q.__dict__.update(fields)
    return q


def _are_payload_views(q):
    """Whether ``q.data`` and ``q.scales`` are the views ``payload_views`` makes of
    ``q.payload`` (a hand-built or modified tensor may hold others)."""
    try:
        lib = backend_of(q.payload, "payload").lib
        views = payload_views(q.payload, q.shape, q.numel(), q.block_size, lib)
        return all(_layout(v) == _layout(a) for v, a in zip(views, (q.data, q.scales), strict=True))
    except Exception:  # fields a view cannot be made of: pickled one by one
        return False


def _layout(a):
    """(type, address, shape, dtype, strides) of an array of any supported kind."""
    if hasattr(a, "data_ptr"):  # torch
        return (type(a), a.data_ptr(), tuple(a.shape), a.dtype, a.stride())
    if isinstance(a, np.ndarray):
        address = a.__array_interface__["data"][0]
    elif hasattr(a, "_ary"):  # numba's simulator: a host array stands for the device one
        address = a._ary.__array_interface__["data"][0]
    elif hasattr(a, "device_ctypes_pointer"):  # numba
        address = a.device_ctypes_pointer.value
    else:  # CuPy
        address = a.data.ptr
    return (type(a), address, tuple(a.shape), a.dtype, tuple(a.strides))


def _same(a, b):
    """``a == b`` as a bool (False where the comparison itself fails)."""
    try:
        return bool(a == b)
    except Exception:
        return a is b


def _same_bits(a, b):
    """Arrays of the same kind, device, dtype and shape holding the same bytes (or both None;
    objects that are not arrays: ``_same``)."""
    if a is None or b is None:
        return a is b
    ka, kb = _kind_or_none(a), _kind_or_none(b)
    if ka is None or kb is None:  # (an array never equals what is not one)
        return ka is kb and _same(a, b)
    if ka != kb or element_dtype(a, ka) != element_dtype(b, kb):
        return False
    if tuple(a.shape) != tuple(b.shape):
        return False
    if math.prod(a.shape) == 0:
        return True
    if ka.lib == "torch":
        torch = sys.modules["torch"]
        a, b = (t.detach().contiguous().reshape(-1).view(torch.uint8) for t in (a, b))
        return bool(torch.equal(a, b))
    if ka.lib == "numba":
        a, b = a.copy_to_host(), b.copy_to_host()
    xp = sys.modules["cupy"] if ka.lib == "cupy" else np
    a, b = (xp.ascontiguousarray(t).reshape(-1).view(np.uint8) for t in (a, b))
    return bool(xp.array_equal(a, b))


def _kind_or_none(a):
    try:
        return backend_of(a)
    except TypeError:
        return None


def _check_device(device):
    torch = sys.modules.get("torch")
    ok = isinstance(device, (str, int)) and not isinstance(device, bool)
    if not (ok or (torch is not None and isinstance(device, torch.device))):
        raise TypeError(
            f"device: expected a torch.device, a device string ('cuda:0', 'cpu') or a GPU "
            f"index, got {device!r}; a QuantizedTensor keeps its dtype (dequantize(q, dtype) "
            "decodes to another one)"
        )


def _is_cpu_device(device):
    return str(device) == "cpu"


def _to_host(a):
    """A numpy copy of a CuPy or numba device array."""
    return a.get() if backend_of(a).lib == "cupy" else a.copy_to_host()


def _nbytes(a):
    n = getattr(a, "nbytes", None)
    if n is None:  # torch
        n = a.numel() * a.element_size()
    return n


def swizzled_scale_shape(rows: int, blocks_per_row: int) -> tuple[int, int]:
    """(padded_rows, padded_cols) of the 128x4-tile scale layout."""
    rows = check_int(rows, "rows", 0, 2**63)
    blocks_per_row = check_int(blocks_per_row, "blocks_per_row", 0, 2**63)
    return (-(-rows // 128) * 128, -(-blocks_per_row // 4) * 4)


def leading_dims_agree(q):
    """Whether ``q.shape`` is a tuple of ints whose leading dimensions are those of ``q.data``
    and ``q.scales`` (linear scale layout): what ``check_quantized`` reads of a new shape of a
    QuantizedTensor whose kind (everything else: types, dtypes, last dimensions, devices) a
    checked call had (``_plans.shape_plan``)."""
    shape = q.shape
    if type(shape) is not tuple or not shape:
        return False
    for d in shape:
        if type(d) is not int or d < 0:
            return False
    lead = shape[:-1]
    return q.data.shape[:-1] == lead and q.scales.shape[:-1] == lead


def check_quantized(q, name="q"):
    """Validate every field of a ``QuantizedTensor`` that a kernel indexes; returns its backend.

    A hand-built or modified ``QuantizedTensor`` is checked as thoroughly as a bad argument:
    the kernels read ``data`` and ``scales`` as flat buffers of the sizes ``shape`` implies, so
    a wrong dtype, size, layout or device would read memory the tensor does not own.
    """
    if not isinstance(q, QuantizedTensor):
        raise TypeError(
            f"{name}: expected a QuantizedTensor from quantize(), got {type(q).__name__}"
        )
    fmt = format_spec(q.fmt, f"{name}.fmt")
    shape = q.shape
    if not isinstance(shape, tuple) or not all(
        isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise TypeError(f"{name}.shape: expected a tuple of non-negative ints, got {shape!r}")
    if len(shape) == 0:
        raise ValueError(f"{name}.shape: () has no last dimension; a QuantizedTensor is >= 1-d")
    block = q.block_size
    if shape[-1] % block:
        raise ValueError(
            f"{name}.shape: last dimension {shape[-1]} is not a multiple of the block size {block}"
        )
    normalize_dtype(q.dtype, f"{name}.dtype")
    fp4quant = isinstance(fmt, FP4Quant)
    check_choice(q.scale_layout, f"{name}.scale_layout", ("linear",) if fp4quant else SCALE_LAYOUTS)
    backend = backend_of(q.data, f"{name}.data")
    check_has_values(q.data, backend, f"{name}.data")
    check_field(q.data, backend, f"{name}.data", "uint8", shape[:-1] + (shape[-1] // 2,))
    same_place(q.scales, backend, f"{name}.scales", f"{name}.data")
    if fp4quant:
        scale_shape, scale_dtype = shape[:-1] + (shape[-1] // block,), "uint16"
    else:
        geo = Geometry.of(shape, block, q.scale_layout)
        scale_shape, scale_dtype = geo.scale_shape, "uint8"
    check_field(q.scales, backend, f"{name}.scales", scale_dtype, scale_shape)
    if not fp4quant and (fmt.tensor_scale or q.global_scale is not None):
        gs = q.global_scale
        if gs is None:
            raise ValueError(
                f"{name}.global_scale: NVFP4 needs its tensor decode scale 1/S (a one-element "
                "float32 array, as quantize() returns it); got None"
            )
        # (a nested torch tensor raises on .shape: same_place names what it is)
        if isinstance(gs, (int, float, np.floating)) or not (
            is_torch_tensor(gs) or hasattr(gs, "shape")
        ):
            raise TypeError(
                f"{name}.global_scale: expected a one-element float32 array where "
                f"{name}.data lives, got {type(gs).__name__}"
            )
        same_place(gs, backend, f"{name}.global_scale", f"{name}.data")
        check_field(gs, backend, f"{name}.global_scale", "float32", None, size=1)
        if not backend.gpu:  # (a GPU value is not read: no sync)
            value = float(np.asarray(arrays.to_numpy(gs)).reshape(-1)[0])
            if fmt.tensor_scale and not (math.isfinite(value) and value > 0):
                raise ValueError(
                    f"{name}.global_scale: [{value!r}]; NVFP4's tensor decode scale 1/S is "
                    "positive and finite, as quantize() returns it"
                )
            if not fmt.tensor_scale and value != 1.0:
                raise ValueError(
                    f"{name}.global_scale: {fmt.name.upper()} has no tensor scale (its decode "
                    "reads only the "
                    f"power-of-two block scales), so it must be None or [1.0] as quantize() "
                    f"returns it; got [{value!r}] (scale the decoded values instead, or use "
                    "NVFP4)"
                )
    return backend
