"""Everything fp4_kernels relies on below numba's public API, in one place.

* float32 <-> uint32 bit casts as ``@intrinsic``s (an LLVM ``bitcast``: a register move) for the
  CPU and CUDA targets, with plain-Python twins for numba's CUDA simulator;
* the address of an array element, for inline-PTX loads and stores;
* what the direct launch (``cuda.launch``) needs of numba: a ``@cuda.jit`` kernel compiled
  once per signature to a driver function handle (``compile_kernel``), its shared-memory
  carveout (``set_carveout``), and numba's kernel ABI of an array, ``ARRAY_FIELDS``, in which
  ``cuda.launch`` packs the arguments;
* the on-disk cache of the CPU functions: keyed to the whole package's source
  (``install_cache_locator``), each file checked against a digest before it is read
  (``CheckedFunctionCache``, which replaces a dispatcher's numba ``FunctionCache``).

numba's kernel ABI passes a 1-D C-contiguous array as the seven fields of its data model,
``ARRAY_FIELDS``; scalars as themselves (``cuda.launch.parameter_layout`` lays them out).
``tests/test_numba_abi.py`` compiles a kernel to PTX and checks this layout without a GPU, so
a numba release that changes it fails CI instead of launching kernels with shifted arguments.
"""

from __future__ import annotations

import hashlib
import os
import pickle

import numpy as np
from numba.core import caching, types
from numba.core.errors import TypingError

from ._notices import KernelCacheWarning, KernelCompileWarning, notify

# numba's data model of an array, in ABI order (meminfo and parent are host-side, passed as 0)
ARRAY_FIELDS = ("meminfo", "parent", "nitems", "itemsize", "data", "shape", "strides")


# ---------------------------------------------------------------------- bit casts


def make_bitcast_intrinsics(intrinsic):
    """Return ``(f32_as_u32, u32_as_f32)`` built with the target's ``intrinsic`` decorator.

    The typing accepts *only* float32 / uint32: a float64 that leaks into codec arithmetic
    (numba types Python float literals as float64) is then a compile-time error instead of a
    silent change of rounding."""
    f32_as_u32 = _bitcast(intrinsic, types.float32, types.uint32, "f32_as_u32", "float32",
                          " (float64 leak?)")  # fmt: skip
    u32_as_f32 = _bitcast(intrinsic, types.uint32, types.float32, "u32_as_f32", "uint32", "")
    return f32_as_u32, u32_as_f32


def _bitcast(intrinsic, source, target, name, what, hint):
    """An intrinsic reinterpreting a ``source`` value's bits as ``target`` (an LLVM bitcast)."""

    def typer(typingctx, x):
        if x != source:
            raise TypingError(f"{name} needs a {what} argument, got {x}{hint}")

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], context.get_value_type(target))

        return target(source), codegen

    typer.__name__ = name
    return intrinsic(typer)


def py_f32_as_u32(x):
    """Python version for numba's CUDA simulator."""
    return np.float32(x).view(np.uint32)


def py_u32_as_f32(x):
    """Python version for numba's CUDA simulator."""
    return np.uint32(x).view(np.float32)


# ---------------------------------------------------------------------- element addresses


def element_address(context, builder, array_type, array, index):
    """The 64-bit address of ``array[index]`` (1-D, no wraparound, no bounds check), as an
    LLVM i64 for an inline-PTX ``l`` operand.  Global memory's generic addresses are its
    global addresses, so ``ld.global`` / ``st.global`` take it as is."""
    from llvmlite import ir
    from numba.cuda import cgutils

    ary = context.make_array(array_type)(context, builder, value=array)
    ptr = cgutils.get_item_pointer(
        context, builder, array_type, ary, [index], wraparound=False, boundscheck=False
    )
    return builder.ptrtoint(ptr, ir.IntType(64))


# ---------------------------------------------------------------------- direct launch


def compile_kernel(kernel, argtypes):
    """Compile ``kernel`` (a ``@cuda.jit`` dispatcher) for ``argtypes`` on the current device
    and return its ``cuda.core`` kernel handle."""
    argtypes = tuple(argtypes)
    notify(
        "compile-cuda",
        "fp4_kernels is compiling CUDA kernels (seconds for each new kind of call: op, "
        "format, dtype, options; once per process, they are not cached on disk). Silence with "
        "warnings.filterwarnings('ignore', category=fp4_kernels.KernelCompileWarning)",
        KernelCompileWarning,
    )
    compiled = kernel.compile(argtypes)
    compiled.bind()
    return compiled._codelibrary.get_cufunc().kernel


def _driver_value(result, what):
    """The value of a ``cuda.bindings`` driver call's ``(CUresult, value...)`` result."""
    from cuda.bindings import driver

    err, *value = result
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed with {err!r}")
    return value[0] if value else None


def set_carveout(cu_kernel, device_id, ctas_per_sm):
    """Size ``cu_kernel``'s preferred shared-memory carveout (the part of an SM's unified L1 /
    shared memory kept as shared memory) for ``ctas_per_sm`` resident CTAs: their static shared
    memory and the driver's reservation a CTA, as a percentage of the SM's most, rounded up
    (the driver rounds up again, to a size the SM supports); the rest stays L1.  None restores
    the driver's choice (-1).  The occupancy API counts the preference.  Returns the
    percentage set."""
    from cuda.bindings import driver

    func = driver.CUfunction_attribute
    percent = -1
    if ctas_per_sm is not None:
        dev = driver.CUdevice_attribute
        static = _driver_value(
            driver.cuKernelGetAttribute(
                func.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, cu_kernel.handle, device_id
            ),
            "cuKernelGetAttribute(SHARED_SIZE_BYTES)",
        )
        most, reserved = (
            _driver_value(
                driver.cuDeviceGetAttribute(attr, device_id), f"cuDeviceGetAttribute({attr.name})"
            )
            for attr in (
                dev.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
                dev.CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK,
            )
        )
        percent = min(100, -(-100 * ctas_per_sm * (static + reserved) // most))
    _driver_value(
        driver.cuKernelSetAttribute(
            func.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
            percent,
            cu_kernel.handle,
            device_id,
        ),
        "cuKernelSetAttribute(PREFERRED_SHARED_MEMORY_CARVEOUT)",
    )
    return percent


# ---------------------------------------------------------------------- on-disk cache


def _user_cache_dir():
    """Where compiled CPU kernels are kept: ``FP4_KERNELS_CACHE_DIR``, else the user's cache
    directory (``$XDG_CACHE_HOME`` or ``~/.cache``) / fp4_kernels / numba."""
    import os
    from pathlib import Path

    explicit = os.environ.get("FP4_KERNELS_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fp4_kernels" / "numba"


_LOCATOR = []


def package_source_stamp(package):
    """A hash of every ``.py`` file under ``package`` (names and contents) and the numba version:
    the key of every cached CPU function, so that an edit anywhere in the package invalidates
    them all."""
    import hashlib

    import numba

    digest = hashlib.sha256(numba.__version__.encode())
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def install_cache_locator():
    """Let numba cache fp4_kernels' CPU functions on disk, keyed to the whole package's source.

    numba keys a cached function to its own source file only; here one function inlines the
    scalar codec of other modules, so an edited ``_scalar/e2m1.py`` could leave a stale kernel in
    the cache.  The locator registered here (first in numba's list, for files of this package
    only) stamps every entry with a hash of all the package's ``.py`` files and the numba
    version, and keeps the entries in the user's cache directory; a directory it cannot write
    makes numba fall back to its other locators, or compile without a cache."""
    if _LOCATOR:
        return
    from pathlib import Path

    from numba.core import caching

    package = Path(__file__).resolve().parent
    stamp = package_source_stamp(package)
    root = _user_cache_dir() / stamp[:16]

    class PackageCacheLocator(caching._CacheLocator):
        def __init__(self, py_func, py_file):
            self._lineno = py_func.__code__.co_firstlineno
            rel = Path(py_file).resolve().relative_to(package)
            self._path = str(root / rel.parent)

        def get_cache_path(self):
            return self._path

        def get_source_stamp(self):
            return stamp

        def get_disambiguator(self):
            return str(self._lineno)

        @classmethod
        def from_function(cls, py_func, py_file):
            try:
                Path(py_file).resolve().relative_to(package)
            except (ValueError, OSError):
                return None
            locator = cls(py_func, py_file)
            try:
                locator.ensure_cache_path()
            except OSError:
                return None
            return locator

    caching.CacheImpl._locator_classes.insert(0, PackageCacheLocator)
    _LOCATOR.append(PackageCacheLocator)


_MAGIC = b"fp4_kernels numba cache, sha256\n"
_DIGEST_BYTES = 32


class CorruptCacheFile(Exception):
    """A cache file that does not hold what was written to it."""

    def __init__(self, path, reason):
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class CheckedCacheFile(caching.IndexDataCacheFile):
    """numba's index and data files of one function, each written with a SHA-256 digest of its
    contents in front and checked against it before anything in it is unpickled or loaded as
    machine code.  A truncated, garbled or emptied file raises ``CorruptCacheFile``, where
    numba's own files would raise EOFError or UnpicklingError on every call, or load garbled
    code that still unpickles."""

    def _save_index(self, overloads):
        self._write(self._index_path, self._dump((self._version, self._source_stamp, overloads)))

    def _load_index(self):
        try:
            body = self._read(self._index_path)
        except FileNotFoundError:
            return {}
        version, stamp, overloads = _unpickle(body, self._index_path)
        if version != self._version or stamp != self._source_stamp:
            return {}  # stale: its entries are overwritten as new ones are saved (as numba)
        return overloads

    def _save_data(self, name, data):
        self._write(self._data_path(name), self._dump(data))

    def _load_data(self, name):
        path = self._data_path(name)
        return _unpickle(self._read(path), path)

    def _write(self, path, body):
        with self._open_for_write(path) as f:  # numba's: a temporary file, then os.replace
            f.write(_MAGIC + hashlib.sha256(body).digest() + body)

    @staticmethod
    def _read(path):
        with open(path, "rb") as f:
            raw = f.read()
        head = len(_MAGIC) + _DIGEST_BYTES
        if len(raw) < head or not raw.startswith(_MAGIC):
            raise CorruptCacheFile(path, f"{len(raw)} bytes, not a complete cache file")
        if hashlib.sha256(raw[head:]).digest() != raw[len(_MAGIC) : head]:
            raise CorruptCacheFile(path, "its contents do not match their SHA-256 digest")
        return raw[head:]


def _unpickle(body, path):
    try:
        return pickle.loads(body)
    except Exception as exc:  # a digest that matches but a body that does not load
        raise CorruptCacheFile(path, f"unpickling failed ({exc!r})") from exc


class CheckedFunctionCache(caching.FunctionCache):
    """numba's per-function cache with ``CheckedCacheFile``s: an entry that cannot be read is
    deleted (with a warning naming it, once per process) and the function compiled and saved
    again; a function compiled because it was not in the cache gives a notice (once per
    process)."""

    def __init__(self, py_func):
        super().__init__(py_func)
        self._cache_file = CheckedCacheFile(
            cache_path=self._cache_path,
            filename_base=self._impl.filename_base,
            source_stamp=self._impl.locator.get_source_stamp(),
        )

    def _load_overload(self, sig, target_context):
        try:
            cres = super()._load_overload(sig, target_context)
        except Exception as exc:  # CorruptCacheFile, or numba failing to rebuild what it read
            path = getattr(exc, "path", self._cache_file._index_path)
            self._discard()
            notify(
                "cache-corrupt",
                f"fp4_kernels: discarded an unreadable entry of the kernel cache, {path} "
                f"({getattr(exc, 'reason', repr(exc))}); compiling it again. The cache is "
                f"{self._cache_path} (FP4_KERNELS_CACHE_DIR sets where; deleting it is safe)",
                KernelCacheWarning,
            )
            cres = None
        if cres is None and self._enabled:
            notify(
                "compile-cpu",
                "fp4_kernels is compiling CPU kernels not in its on-disk cache yet (seconds to "
                f"a minute, once: they are then cached in {self._cache_path}). Silence with "
                "warnings.filterwarnings('ignore', category=fp4_kernels.KernelCompileWarning)",
                KernelCompileWarning,
            )
        return cres

    def _save_overload(self, sig, data):
        try:
            super()._save_overload(sig, data)
        except CorruptCacheFile:  # an index spoiled since it was read: start it again
            self._discard()
            super()._save_overload(sig, data)

    def _discard(self):
        """Delete this function's index and data files (whatever can be deleted)."""
        index = os.path.basename(self._cache_file._index_path)
        base = index.removesuffix(".nbi")
        try:
            names = os.listdir(self._cache_path)
        except OSError:
            return
        for name in names:
            if name == index or (name.startswith(base + ".") and name.endswith(".nbc")):
                try:
                    os.unlink(os.path.join(self._cache_path, name))
                except OSError:
                    pass


def enable_checked_cache(dispatcher):
    """Cache ``dispatcher`` (a ``numba.njit`` function) on disk through
    ``CheckedFunctionCache``: what ``cache=True`` does, with numba's own ``FunctionCache``."""
    from numba.core.dispatcher import Dispatcher

    if isinstance(dispatcher, Dispatcher):  # (not under NUMBA_DISABLE_JIT)
        dispatcher._cache = CheckedFunctionCache(dispatcher.py_func)
    return dispatcher
