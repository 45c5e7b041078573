"""Call descriptors and the argument checks that build them: one frozen object a call, built
once by the public API from checked arguments and handed down unchanged to the CPU path
(``cpu.<op>``), the CUDA host function (``cuda.<op>.run(ctx, call)``) and the plan cache
(``_plans``).

A descriptor holds everything a kernel's launch depends on: the format (a ``FormatSpec`` from
``formats``, or an ``FP4Quant``), the geometry, the rounding, the per-call scalars, the source of
the tensor amax, the scale layout and the dtype; and ``out``, caller-given output buffers (the
public API does not take them yet: None, the host function allocates).  Its ``key`` is its static
part as the caller gave it, a named tuple (``QuantizeKey``, ...): the plan cache's key, None for
a call that is not planned (``_plans``).  ``traced(tracer)`` is the descriptor with the tracer's
placeholders for its arrays and probe values for its per-call scalars, which a plan is recorded
from.

The checks of an array argument (``backend_of``: its library and device; ``dtype_name``,
``is_c_contiguous``, ``same_place``, ...) are every public function's, and ``payload_views``
gives the fields of an FP4Quant tensor from its wire buffer, for the CPU and GPU encoders and
``QuantizedTensor`` alike.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import sys
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ._arrays import DTYPES, KIND_OF_DTYPE, Backend
from .formats import mxfp4, nvfp4
from .formats.fp4quant import FP4Quant

SPECS = {spec.name: spec for spec in (nvfp4.SPEC, mxfp4.SPEC)}  # fmt= string -> FormatSpec

AMAX_NUMBER = "number"  # QuantizeKey.amax of a global_amax given as a number

# The ``fmt`` of a plan key for an ``FP4Quant``: (FP4QUANT_KEY, group_size, hadamard), a tuple
# that hashes and compares in C.  The dataclass itself would run its Python ``__hash__`` at each
# of a planned call's two dict lookups (the plan and its LRU update).  The private marker keeps
# any tuple a caller passes as ``fmt`` from equalling it.
FP4QUANT_KEY = object()

# Probe scalars: distinctive values a traced descriptor (``traced``) passes for its per-call
# scalars while a plan is recorded; the plan finds them again in the packed arguments.  The
# probe indices: seed low and high words, step, amax, in the order a planned call passes them.
PROBE_SEED = (0x5EED_0001 << 32) | 0x5EED_0002
PROBE_STEP = 0x57E9_0003
PROBE_AMAX = 1234.567
SEED_STEP_PROBES = (0, 1, 2)
SEED_PROBES = (0, 1)
AMAX_PROBE = 3


class Geometry(NamedTuple):
    """Sizes every path derives from (shape, block size, scale layout)."""

    shape: tuple
    n: int  # elements
    kb: int  # blocks per row
    padded_kb: int  # blocks per row including the swizzled layout's column padding
    scale_shape: tuple
    pad: bool  # the swizzled layout has padding bytes (which must be zero)
    swizzled: bool

    @classmethod
    def of(cls, shape, block_size, layout="linear"):
        rows = math.prod(shape[:-1])
        kb = shape[-1] // block_size
        n = rows * shape[-1]
        if layout == "swizzled":
            pr, pk = -(-rows // 128) * 128, -(-kb // 4) * 4  # whole 128 x 4 tiles
            return cls(shape, n, kb, pk, (pr * pk,), pr * pk != rows * kb, True)
        return cls(shape, n, kb, kb, shape[:-1] + (kb,), False, False)

    def resized(self, shape):
        """The geometry of ``shape`` (its last dimension this one's) in this block size and
        scale layout: what a plan of every shape recomputes from symbolic leading dimensions."""
        block = self.shape[-1] // self.kb
        return Geometry.of(shape, block, "swizzled" if self.swizzled else "linear")


def payload_views(payload, shape, n, g, lib):
    """(codes (..., K/2) uint8, scales (..., K/g) uint16) views of the FP4Quant wire buffer of
    the ``n`` elements of ``shape`` (group size ``g``): the fields of its QuantizedTensor, which
    the CPU and GPU encoders write."""
    codes = payload[: n // 2].reshape(shape[:-1] + (shape[-1] // 2,))
    tail = payload[n // 2 :]
    if lib == "torch":
        import torch

        # an empty tail has stride 0, which torch refuses to reinterpret
        scales = tail.view(torch.uint16) if tail.numel() else tail.new_empty(0, dtype=torch.uint16)
    else:
        scales = tail.view(np.uint16)
    return codes, scales.reshape(shape[:-1] + (shape[-1] // g,))


# ---------------------------------------------------------------------- checks


def backend_of(x, name="x"):
    """Classify ``x``; raise TypeError naming ``name`` for anything unsupported."""
    torch = sys.modules.get("torch")
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
    torch = sys.modules.get("torch")
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
    if is_transformed_tensor(torch, x):
        raise TypeError(
            f"{name}: a tensor of a torch transform (torch.func.functionalize, vmap or grad, or "
            "a FakeTensor of torch.compile's tracing) has no memory of its values that the "
            "kernels could read; call fp4_kernels outside the transform, on plain tensors"
        )


def is_transformed_tensor(torch, x):
    """Whether the torch tensor ``x`` is a functorch wrapper (functionalize, vmap, grad: its
    memory, if any, is not its values') or a FakeTensor (no values at all)."""
    if torch._C._functorch.is_functorch_wrapped_tensor(x):
        return True
    fake = sys.modules.get("torch._subclasses.fake_tensor")
    return fake is not None and isinstance(x, fake.FakeTensor)


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
        torch = sys.modules.get("torch")
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


def format_spec(fmt, name="fmt"):
    """The ``FormatSpec`` of "nvfp4" / "mxfp4", or the ``FP4Quant`` itself; TypeError /
    ValueError naming ``name`` for anything else."""
    if isinstance(fmt, FP4Quant):
        return fmt
    if not isinstance(fmt, str):
        raise TypeError(
            f"{name}: expected 'nvfp4', 'mxfp4' or an FP4Quant(...), got {type(fmt).__name__}"
        )
    check_choice(fmt, name, tuple(SPECS))
    return SPECS[fmt]


def check_choice(value, name, choices):
    """ValueError unless ``value`` is one of ``choices`` (strings: an array's ``in`` would
    compare element-wise)."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name}: {value!r} is not one of {', '.join(map(repr, choices))}")


def check_int(value, name, lo, hi):
    """``value`` as an int, or TypeError / ValueError unless it is an integer in [lo, hi)."""
    try:
        if isinstance(value, bool):  # an int to operator.index; True for 1 is a slip
            raise TypeError
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an integer, got {type(value).__name__}") from None
    if not lo <= v < hi:
        raise ValueError(f"{name}: {v} is outside [{lo}, {hi})")
    return v


def check_field(a, backend, name, dtype, shape, size=None):
    """TypeError / ValueError unless the array ``a`` has ``dtype``, ``shape`` (or ``size``
    elements) and is C-contiguous."""
    dt = element_dtype(a, backend)
    if dt != dtype:
        raise TypeError(f"{name}: dtype {dt}, expected {dtype}")
    got = tuple(int(d) for d in a.shape)
    if shape is not None and got != shape:
        raise ValueError(f"{name}: shape {got} != expected {shape}")
    if size is not None and math.prod(got) != size:
        raise ValueError(f"{name}: {math.prod(got)} elements, expected {size}")
    if not is_c_contiguous(a, backend):
        raise ValueError(f"{name}: must be C-contiguous (the kernels read it as a flat buffer)")


def check_input(x, block, what):
    """(backend, dtype name, shape) of an input to quantize: a supported array, >= 1-d, its
    last dimension a multiple of ``block`` (``what`` names that size), C-contiguous."""
    backend = backend_of(x, "x")
    check_has_values(x, backend, "x")
    dt = dtype_name(x, backend, "x")
    shape = tuple(int(s) for s in x.shape)
    if len(shape) == 0:
        raise ValueError("x: a 0-d array has no last dimension to quantize; reshape to (1, K)")
    k = shape[-1]
    if k % block != 0:
        raise ValueError(
            f"x: last dimension K={k} is not a multiple of the {what} {block}; "
            f"pad K to a multiple of {block}"
        )
    if not is_c_contiguous(x, backend):
        raise ValueError(
            "x: must be contiguous (the last dimension and the rows in row-major order); "
            "call .contiguous() (torch) or np.ascontiguousarray / cupy.ascontiguousarray first"
        )
    return backend, dt, shape


def is_number(value):
    """Whether ``global_amax`` was given as a number (not an array)."""
    return isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool)


# The tensor scale is computed from float32(global_amax): a float from 2^128 - 2^103 up (half
# an ulp above FLT_MAX = 2^128 - 2^104) rounds to inf there, and S would silently become 1.
AMAX_F32_OVERFLOW = 2.0**128 - 2.0**103


def checked_amax(value):
    """``global_amax`` as a float (-0.0 as 0.0: one launch value for one amax, as a planned
    call passes it), or ValueError unless it is finite, >= 0 and within float32's range."""
    try:
        v, shown = float(value), repr(value)
    except OverflowError:  # an int beyond float64's range (its repr may be too long to print)
        v = AMAX_F32_OVERFLOW if value > 0 else -math.inf
        shown = f"an integer of {value.bit_length()} bits"
    if not (math.isfinite(v) and v >= 0):
        raise ValueError(f"global_amax: must be finite and >= 0, got {shown}")
    if v >= AMAX_F32_OVERFLOW:
        raise ValueError(
            f"global_amax: {shown} is beyond float32's range (largest finite value "
            f"{float(np.finfo(np.float32).max)!r}), in which the tensor scale is computed; "
            "pass at most that (the amax of a float32, bfloat16 or float16 tensor always is)"
        )
    return v + 0.0  # (-0.0 + 0.0 is +0.0)


def checked_amax_array(a, backend):
    """``global_amax`` given as an array: one float32 element where ``x`` lives."""
    try:
        b = backend_of(a, "global_amax")
    except TypeError:
        if is_torch_tensor(a):
            raise  # a torch tensor of a kind the kernels cannot read: the message says which
        raise TypeError(
            "global_amax: expected a non-negative finite float or a one-element float32 array "
            f"where x lives, got {type(a).__name__}"
        ) from None
    same_place(a, backend, "global_amax", "x")
    check_field(a, b, "global_amax", "float32", None, size=1)
    return a


STEP_LIMIT = 2**32  # the Philox counter's step is a uint32


def checked_step_array(a, backend):
    """``step`` given as an array: one int64 element, C-contiguous, where ``x`` lives;
    ValueError naming ``step`` otherwise."""
    try:
        b = backend_of(a, "step")
    except TypeError as err:  # (its words say what kind of array it is and the fix)
        raise ValueError(
            "step: expected an int in [0, 2**32) or a one-element int64 array where x lives, "
            f"got {type(a).__name__} ({err})"
        ) from None
    same_place(a, backend, "step", "x")
    dt = element_dtype(a, b)
    if dt != "int64":
        raise ValueError(f"step: an array of dtype {dt}; pass a one-element int64 array")
    shape = tuple(int(d) for d in a.shape)
    if math.prod(shape) != 1:
        raise ValueError(f"step: an array of shape {shape}; pass a one-element int64 array")
    if not is_c_contiguous(a, b):
        raise ValueError("step: the array must be C-contiguous")
    return a


# ---------------------------------------------------------------------- plan keys


class QuantizeKey(NamedTuple):
    """What a planned quantize / quantize_dequantize depends on: the input (``_plans.tensor_key``),
    the arguments as given, the source of the amax (None: computed, ``AMAX_NUMBER``, or the
    tensor key of a ``global_amax`` array) and the launch policy."""

    x: tuple
    fmt: Any  # as given; an FP4Quant as its fields (FP4QUANT_KEY)
    rounding: str
    scale_layout: str
    amax: Any
    fused: bool
    policy: Any
    step: Any = None  # the tensor key of a ``step`` array; None: an int step


class DequantizeKey(NamedTuple):
    """What a planned ``dequantize`` (or ``requantized_sum``: ``op``) of a QuantizedTensor
    depends on.  ``shape`` is the repr of ``q.shape``: a shape of bools or floats equals one of
    ints, and only the check refuses it.  ``row_scales``: the tensor key of the tensor scales a
    row that ``requantized_sum`` was given (op "requantized_sum_rows"), else None."""

    op: str
    fmt: Any  # as given; an FP4Quant as its fields (FP4QUANT_KEY)
    shape: str
    dtype: Any
    scale_layout: str
    data: tuple
    scales: tuple
    global_scale: tuple | None
    out_dtype: Any
    policy: Any
    row_scales: tuple | None = None


class HadamardKey(NamedTuple):
    """What a planned ``hadamard`` depends on (signs: None or a seed)."""

    x: tuple
    group_size: int
    inverse: bool
    signs: int | None
    policy: Any


# ---------------------------------------------------------------------- descriptors


class CallDescriptor:
    """What every descriptor has: ``ARRAYS``, its array fields (the first, ``anchor``, is the
    array whose device and stream the call runs on), ``kind`` (the element kind of its
    ``dtype`` the kernels are specialized on, ``_scalar.KIND_*``) and ``traced``."""

    ARRAYS: tuple = ()
    dtype: str

    @property
    def kind(self):
        return KIND_OF_DTYPE[self.dtype]

    @property
    def anchor(self):
        return getattr(self, self.ARRAYS[0])

    def traced(self, tracer):
        """(the call as a plan records it: its arrays the tracer's placeholders, and the probe
        scalars its launches must take).  A symbolic tracer's placeholders have symbolic
        leading dimensions (``_sizes``), and so has every size derived from them."""
        placeholders = {name: tracer.input(getattr(self, name)) for name in self.ARRAYS}
        return dataclasses.replace(self, **placeholders), ()

    def kind_key(self):
        """The key of this call's kind: its plan key without its arrays' leading dimensions and
        strides (a checked call's arrays are C-contiguous), or None where this kind of call is
        planned per shape only.  Calls of one kind share a plan of every shape
        (``_plans.KindPlan``)."""
        return None

    def plan_dims(self):
        """The leading dimensions of the call's arrays, in the order ``traced`` records them:
        the values a plan of every shape is evaluated at."""
        dims = []
        for name in self.ARRAYS:
            a = getattr(self, name)
            if a is not None:
                dims += a.shape[:-1]
        return dims


def kind_of(tensor_key):
    """A ``_plans.tensor_key`` without its shape and strides: (type, dtype, number of
    dimensions, last dimension, device, misalignment)."""
    kind, dtype, shape, _, device, misalign = tensor_key
    return kind, dtype, len(shape), shape[-1] if shape else None, device, misalign


def quantize_kind(key):
    """The kind key of a ``QuantizeKey`` (``CallDescriptor.kind_key``): a plain tuple."""
    return ("quantize", kind_of(key.x), *key[1:])


def dequantize_kind(key, shape):
    """The kind key of a ``DequantizeKey`` of a tensor of ``shape``."""
    op, fmt, _, dtype, layout, data, scales, *rest = key
    return (op, fmt, len(shape), shape[-1], dtype, layout, kind_of(data), kind_of(scales), *rest)


def hadamard_kind(key):
    """The kind key of a ``HadamardKey``."""
    return ("hadamard", kind_of(key.x), *key[1:])


@dataclass(frozen=True)
class QuantizeCall(CallDescriptor):
    """A checked quantize (``fused``: quantize_dequantize) of ``x``.

    ``amax_value`` is ``global_amax`` given as a number (< 0: not given), ``amax_array`` given as
    a one-element array where x lives; neither: the amax of x (NVFP4).  ``step_array``: the
    step given as a one-element int64 array on the GPU (read by the kernels; ``step`` is then
    0), None: ``step`` is the step."""

    ARRAYS = ("x", "amax_array", "step_array")

    x: Any
    backend: Backend
    dtype: str  # "float32" | "bfloat16" | "float16"
    fmt: Any  # FormatSpec | FP4Quant
    geometry: Geometry
    stochastic: bool
    seed: int
    step: int
    amax_value: float = -1.0
    amax_array: Any = None
    fused: bool = False
    key: QuantizeKey | None = None
    out: Any = None
    step_array: Any = None

    def traced(self, tracer):
        traced, _ = super().traced(tracer)
        number = self.amax_value >= 0
        traced = dataclasses.replace(
            traced,
            seed=PROBE_SEED,
            step=PROBE_STEP,
            amax_value=PROBE_AMAX if number else -1.0,
        )
        if tracer.symbolic:
            traced = dataclasses.replace(traced, geometry=self.geometry.resized(traced.x.shape))
        # a step array is an input of the plan: its probe is not in the launches
        probes = SEED_STEP_PROBES if self.step_array is None else SEED_PROBES
        return traced, probes + ((AMAX_PROBE,) if number else ())

    def kind_key(self):
        return None if self.key is None else quantize_kind(self.key)


@dataclass(frozen=True)
class DequantizeCall(CallDescriptor):
    """A checked ``dequantize`` of the QuantizedTensor fields ``data``, ``scales`` and
    ``global_scale`` (None: MXFP4 without one, or FP4Quant) to ``dtype``."""

    ARRAYS = ("data", "scales", "global_scale")

    data: Any
    scales: Any
    global_scale: Any
    backend: Backend
    dtype: str
    fmt: Any  # FormatSpec | FP4Quant
    geometry: Geometry
    key: DequantizeKey | None = None
    out: Any = None

    def traced(self, tracer):
        traced, probes = super().traced(tracer)
        if tracer.symbolic:  # (the check made data's leading dimensions the shape's)
            shape = traced.data.shape[:-1] + self.geometry.shape[-1:]
            traced = dataclasses.replace(traced, geometry=self.geometry.resized(shape))
        return traced, probes

    def kind_key(self):
        key = self.key
        if key is None:
            return None
        return dequantize_kind(key, self.geometry.shape)


@dataclass(frozen=True)
class HadamardCall(CallDescriptor):
    """A checked ``hadamard`` of ``x``; ``sign_words``: the uint32 sign words (None: none)."""

    ARRAYS = ("x",)

    x: Any
    backend: Backend
    dtype: str
    group_size: int
    inverse: bool
    sign_words: Any
    key: HadamardKey | None = None
    out: Any = None

    @property
    def n(self):
        return math.prod(self.x.shape)

    def kind_key(self):
        return None if self.key is None else hadamard_kind(self.key)


@dataclass(frozen=True)
class SumCall(CallDescriptor):
    """A checked ``requantized_sum`` of ``rows`` rows of ``n`` elements of the format ``fmt`` (a
    ``FormatSpec``; ``data``, ``scales``: the QuantizedTensor's fields) to a float32 (1, n)
    tensor of that format.  ``global_scale``: NVFP4's tensor decode scales 1/S, one for every
    row (the tensor's own) or, ``per_row``, one a row (``row_scales``); None for MXFP4."""

    ARRAYS = ("data", "scales", "global_scale")

    data: Any
    scales: Any
    global_scale: Any
    backend: Backend
    fmt: Any  # FormatSpec
    rows: int
    n: int
    per_row: bool = False
    dtype: str = "float32"
    key: DequantizeKey | None = None
    out: Any = None
