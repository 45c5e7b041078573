"""Test support other packages' tests may reuse.

``install_simulator_warp_intrinsics()`` gives numba's CUDA simulator the warp shuffles it lacks
(``shfl_sync``, ``shfl_xor_sync``, ``shfl_up_sync``, ``shfl_down_sync``).  The simulator runs a
CUDA block as Python threads with a block-wide barrier; a shuffle here is: publish the value,
barrier, read the source lane's value, barrier.  That matches hardware semantics under the
contract our kernels keep anyway: every thread of the block executes the same sequence of
shuffles (loops are block-uniform; out-of-range lanes run on dummy data).  A kernel that breaks
that contract deadlocks or errors in the simulator instead of silently passing.

``load_test_profile()`` and ``random_seed(name)`` make the three packages' test suites draw
the same inputs on every run (the "ci" profile, the default) or fresh ones ("explore",
``FP4_TEST_PROFILE=explore``, as ``nox -s tests_explore`` sets it).
"""

from __future__ import annotations

import os
import re
import threading
import types
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, SupportsFloat

import numpy as np
import numpy.typing as npt

from . import _arrays as arrays

WARP_SIZE = 32


def _exchange(value, src_lane_of):
    t = threading.current_thread()
    mgr = t._manager
    slots = mgr.__dict__.setdefault("_fp4_shfl_slots", {})
    tid = t.thread_id
    slots[tid] = value
    t.syncthreads()  # every thread has published before anyone reads
    lane = tid % WARP_SIZE
    src = src_lane_of(lane)
    if 0 <= src < WARP_SIZE and (tid - lane + src) in slots:
        out = slots[tid - lane + src]
    else:
        out = value  # hardware returns the caller's own value for an out-of-range source
    t.syncthreads()  # everyone has read before the slots are reused
    return out


def _shfl_sync(self, mask, value, src_lane):
    return _exchange(value, lambda lane: src_lane % WARP_SIZE)


def _shfl_xor_sync(self, mask, value, lane_mask):
    return _exchange(value, lambda lane: lane ^ lane_mask)


def _shfl_up_sync(self, mask, value, delta):
    return _exchange(value, lambda lane: lane - delta)


def _shfl_down_sync(self, mask, value, delta):
    return _exchange(value, lambda lane: lane + delta)


def install_simulator_warp_intrinsics() -> None:
    """Patch the simulator's fake ``cuda`` module; a no-op unless NUMBA_ENABLE_CUDASIM=1."""
    from numba import config

    if not config.ENABLE_CUDASIM:
        return False
    from numba.cuda.simulator import kernelapi

    cls = kernelapi.FakeCUDAModule
    cls.shfl_sync = _shfl_sync
    cls.shfl_xor_sync = _shfl_xor_sync
    cls.shfl_up_sync = _shfl_up_sync
    cls.shfl_down_sync = _shfl_down_sync
    return True


# ---------------------------------------------------------------------- test data


def adversarial_blocks(rng: np.random.Generator, rows: int, k: int, block: int = 16) -> np.ndarray:
    """float32 (rows, k) mixing what breaks codecs, block by block (k % block == 0):

    Gaussian blocks at scales from 2^-140 (float32 subnormals) to 2^120; exact e2m1 ties
    (grid midpoints times a power of two); all-zero and signed-zero blocks; blocks with NaN,
    +Inf or -Inf; a saturating outlier among small values; values just below and above the e4m3
    scale rounding boundaries.  Non-finite values are a small fraction so the tensor amax
    stays finite.
    """
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng: a numpy Generator (np.random.default_rng(seed)), got "
                        f"{type(rng).__name__}")  # fmt: skip
    for name, value in (("rows", rows), ("k", k), ("block", block)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"adversarial_blocks: {name} must be an int, got {value!r}")
    if block <= 0 or rows < 0 or k < 0 or k % block:
        raise ValueError(f"adversarial_blocks: rows {rows} and k {k} >= 0, block {block} > 0 "
                         "dividing k")  # fmt: skip
    n_blocks = rows * k // block
    x = rng.standard_normal((n_blocks, block)).astype(np.float32)
    kind = rng.integers(0, 10, n_blocks)
    exps = rng.integers(-140, 121, n_blocks).astype(np.float32)
    x *= np.exp2(exps)[:, None]
    mid = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], np.float32)
    ties = rng.choice(mid, (n_blocks, block)) * rng.choice([-1.0, 1.0], (n_blocks, block))
    ties = (ties * np.exp2(rng.integers(-8, 8, n_blocks))[:, None]).astype(np.float32)
    x[kind == 1] = ties[kind == 1]
    x[kind == 2] = 0.0
    sz = kind == 3
    x[sz] = np.where(rng.random((sz.sum(), block)) < 0.5, -0.0, 0.0).astype(np.float32)
    bad = np.flatnonzero(kind == 4)
    if bad.size:
        x[bad, rng.integers(0, block, bad.size)] = rng.choice(
            np.array([np.nan, np.inf, -np.inf], np.float32), bad.size
        )
    out = np.flatnonzero(kind == 5)
    if out.size:
        x[out] *= np.float32(1e-3)
        x[out, rng.integers(0, block, out.size)] = np.float32(1e3)
    return x.reshape(rows, k)


def reference_quantization(
    x: npt.ArrayLike,
    fmt: str,
    rounding: str = "nearest",
    seed: int = 0,
    step: int = 0,
    global_amax: SupportsFloat | None = None,
    scale_layout: str = "linear",
) -> tuple[np.ndarray, np.ndarray, np.float32, np.ndarray]:
    """What ``quantize`` must return for float32 ``x``, from the numpy oracle in ``formats``.

    Returns numpy ``(data, scales, global_scale, dequantized_float32)`` in the public layouts:
    packed codes (..., K/2), scales linear (..., K/block) or swizzled (flat, padded).
    """
    from .formats import e2m1, mxfp4, nvfp4, scale_layout as layout

    if not isinstance(fmt, str) or fmt not in ("nvfp4", "mxfp4"):
        raise ValueError(f"fmt: {fmt!r} is not 'nvfp4' or 'mxfp4' (FP4Quant's oracle: "
                         "formats.fp4quant.quantize_reference)")  # fmt: skip
    if scale_layout not in ("linear", "swizzled"):
        raise ValueError(f"scale_layout: {scale_layout!r} is not 'linear' or 'swizzled'")
    x = np.ascontiguousarray(arrays.to_numpy(x), np.float32)
    with np.errstate(all="ignore"):
        if fmt == "nvfp4":
            codes, scales, gs = nvfp4.quantize_reference(
                x, rounding=rounding, seed=seed, step=step, global_amax=global_amax
            )
            deq = nvfp4.dequantize_reference(codes, scales, gs)
        else:
            codes, scales = mxfp4.quantize_reference(x, rounding=rounding, seed=seed, step=step)
            gs = np.float32(1.0)
            deq = mxfp4.dequantize_reference(codes, scales)
    if scale_layout == "swizzled":
        scales = layout.to_swizzled(scales.reshape(-1, scales.shape[-1]))
    return e2m1.pack_e2m1(codes), scales, np.float32(gs), deq


def same_bits(a: npt.ArrayLike, b: npt.ArrayLike) -> bool:
    """Bitwise equality of two float arrays of one dtype, NaN payloads aside (any NaN == NaN);
    torch tensors are compared as numpy arrays (bfloat16 as ml_dtypes' bfloat16)."""
    a = np.asarray(arrays.to_numpy(a))
    b = np.asarray(arrays.to_numpy(b))
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    w = {2: np.uint16, 4: np.uint32, 8: np.uint64}.get(a.dtype.itemsize)
    if a.dtype.kind != "f" and a.dtype.name != "bfloat16" or w is None:
        raise TypeError(f"same_bits: compares float arrays (16, 32 or 64 bits), got {a.dtype}")
    nan = np.isnan(a.astype(np.float64))
    if not np.array_equal(nan, np.isnan(b.astype(np.float64))):
        return False
    return np.array_equal(a[~nan].view(w), b[~nan].view(w))


# ---------------------------------------------------------------------- compile check


def compile_ptx(kernel: Any, signature: str | Sequence[Any], cc: tuple[int, int] = (9, 0)) -> str:
    """PTX of a ``@cuda.jit`` kernel for compute capability ``cc``, with or without a GPU.

    numba-cuda compiles the device functions a kernel calls for the *current device's* compute
    capability, which fails when there is no driver; here they are compiled for ``cc`` instead.
    """
    import types as pytypes

    from numba import cuda
    from numba.cuda import dispatcher

    saved = dispatcher.get_current_device
    dispatcher.get_current_device = lambda: pytypes.SimpleNamespace(compute_capability=cc)
    try:
        ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=cc)
    finally:
        dispatcher.get_current_device = saved
    return ptx


# ---------------------------------------------------------------------- public API checks


def missing_annotations(fn: Callable[..., Any]) -> list[str]:
    """What a public function's signature leaves unannotated: the names of its parameters
    without an annotation (``self`` / ``cls`` aside) and ``"return"`` when the return is not
    annotated.  Raises if the annotations do not resolve (a typo, a missing import).  The
    three packages' tests check every public callable with it."""
    import inspect
    import typing

    signature = inspect.signature(fn)
    missing = [
        p.name
        for i, p in enumerate(signature.parameters.values())
        if p.annotation is inspect.Parameter.empty and not (i == 0 and p.name in ("self", "cls"))
    ]
    if signature.return_annotation is inspect.Signature.empty:
        missing.append("return")
    typing.get_type_hints(fn)
    return missing


def annotation_gaps(callables: Mapping[str, Callable[..., Any]]) -> dict[str, list[str]]:
    """``missing_annotations`` of each of ``callables`` (qualified name -> function, as
    ``public_callables`` gives) where it is not empty; TypeError naming a function whose
    annotations do not resolve."""
    gaps = {}
    for name, fn in callables.items():
        try:
            missing = missing_annotations(fn)
        except Exception as e:
            raise TypeError(f"{name}: its annotations do not resolve ({e!r})") from e
        if missing:
            gaps[name] = missing
    return gaps


def public_callables(
    package: types.ModuleType, exports: Mapping[str, object]
) -> dict[str, Callable[..., Any]]:
    """(qualified name, function) of what ``exports`` names (name -> object) of ``package``'s
    public API, for ``missing_annotations``: a function as itself; a class, the public methods,
    properties and dunders that it and its bases in ``package`` define in ``package``'s source
    (not generated ones, as dataclasses' ``__eq__`` is; a decorated one by what it wraps), as
    "Class.attr"; a module, its public functions and classes defined in it, as "module.name"
    (its classes' members as "module.Class.attr")."""
    import inspect
    from pathlib import Path

    source = Path(package.__file__).resolve().parent

    def written_here(fn: object) -> bool:  # a decorated one by what it wraps
        code = getattr(inspect.unwrap(fn), "__code__", None)
        return code is not None and Path(code.co_filename).resolve().is_relative_to(source)

    found: dict[str, Callable[..., Any]] = {}

    def add(name: str, obj: object) -> None:
        if inspect.isfunction(obj):
            found[name] = obj
        elif inspect.isclass(obj):
            for base in obj.__mro__:
                if not base.__module__.startswith(package.__name__):
                    continue
                for attr, value in vars(base).items():
                    if attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__")):
                        continue
                    if isinstance(value, (staticmethod, classmethod)):
                        value = value.__func__
                    if isinstance(value, property):
                        value = value.fget
                    if inspect.isfunction(value) and written_here(value):
                        found.setdefault(f"{name}.{attr}", value)
        elif isinstance(obj, types.ModuleType):
            for attr, value in vars(obj).items():
                if not attr.startswith("_") and getattr(value, "__module__", "") == obj.__name__:
                    add(f"{name}.{attr}", value)

    for name, obj in exports.items():
        add(name, obj)
    return found


def packaging_problems(
    package: types.ModuleType,
    pyproject: str | os.PathLike[str],
    dist_name: str,
    requires: Sequence[str] = (),
) -> list[str]:
    """What disagrees between a package's ``pyproject.toml``, its installed metadata and the
    module: the project's name against ``dist_name``, the version (``pyproject.toml``,
    ``package.__version__``, ``importlib.metadata``), each project in ``requires`` that the
    installed distribution does not require, and a missing ``py.typed`` marker; empty where
    all agree.  Where ``dist_name`` has no installed metadata (the package imported from a
    source tree on ``PYTHONPATH``) that is the one problem named: there is nothing installed
    to compare."""
    import importlib.metadata
    import importlib.resources
    import sys

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # the packages' test extras bring tomli there
        import tomli as tomllib

    try:
        installed = importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return [
            f"{dist_name} is not installed (no distribution metadata): install it, e.g. "
            f"`pip install -e` its folder, rather than putting its source on PYTHONPATH"
        ]
    with open(pyproject, "rb") as f:
        project = tomllib.load(f)["project"]
    problems = []
    if project["name"] != dist_name:
        problems.append(f"pyproject.toml names {project['name']!r}, not {dist_name!r}")
    versions = {
        "pyproject.toml": project["version"],
        f"{package.__name__}.__version__": package.__version__,
        "installed metadata": installed,
    }
    if len(set(versions.values())) != 1:
        problems.append(f"versions disagree: {versions}")
    # A requirement string starts with its project name: "fp4-kernels>=0.1.0".
    required = importlib.metadata.requires(dist_name) or []
    names = {re.match(r"[A-Za-z0-9._-]+", r).group().lower() for r in required}
    problems += [f"{dist_name} does not require {r}" for r in requires if r.lower() not in names]
    # hatchling ships every file of the package's source in the wheel, this marker included
    if not importlib.resources.files(package.__name__).joinpath("py.typed").is_file():
        problems.append(f"{package.__name__} has no py.typed marker")
    return problems


# ---------------------------------------------------------------------- test randomness

#: The environment variable that picks the test profile: "ci" (unset) or "explore".
TEST_PROFILE_ENV = "FP4_TEST_PROFILE"
TEST_PROFILES = ("ci", "explore")


def current_test_profile() -> str:
    """The test profile that ``FP4_TEST_PROFILE`` names ("ci" where it is unset); ValueError
    for another value."""
    name = os.environ.get(TEST_PROFILE_ENV, "ci")
    if name not in TEST_PROFILES:
        raise ValueError(f"{TEST_PROFILE_ENV}={name!r} is not one of {TEST_PROFILES}")
    return name


def load_test_profile() -> str:
    """Register the hypothesis profiles of the test suites and load the current one; returns
    its name.  Every package's ``tests/conftest.py`` calls it.

    - "ci" (the default): derandomized (each test draws the examples its own code fixes) and
      no example database, so a run never depends on an earlier one: a failure found once
      does not replay in every later run, and a green run stays green.
    - "explore": random seeds and the example database in ``.hypothesis/``, which replays the
      failures it found until they pass (``nox -s tests_explore``).

    A failure worth keeping goes into its test as an ``@example``.  pytest's
    ``--hypothesis-profile`` still overrides the profile for hypothesis alone.  Without
    hypothesis installed there is nothing to register.
    """
    name = current_test_profile()
    try:
        from hypothesis import settings
    except ImportError:
        return name
    settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
    settings.register_profile("explore", derandomize=False, print_blob=True)
    settings.load_profile(name)
    return name


def random_seed(name: str) -> int:
    """The seed of a test's random inputs: under the "ci" profile fixed by ``name`` (a test's
    node id: CRC-32), under "explore" fresh from the OS.  Print it, so that a failure can be
    rerun with the same inputs."""
    if not isinstance(name, str):
        raise TypeError(f"name: the test's node id, a str; got {type(name).__name__}")
    if current_test_profile() == "explore":
        return int.from_bytes(os.urandom(4), "little")
    return zlib.crc32(name.encode())


def seed_torch_generators(name: str) -> int | None:
    """Seed torch's global generators (the CPU one, and CUDA's, lazily) with
    ``random_seed(name)``, so that a test's draws from them (``torch.randn`` without a
    ``generator``) depend on the test alone, not on what ran before it in the process: every
    conftest calls it before each test.  Returns the seed; None where torch is not installed
    (nothing to seed)."""
    try:
        import torch
    except ImportError:
        return None
    seed = random_seed(name)
    torch.manual_seed(seed)
    return seed


# Randomness that would escape the test profile: the OS's, an unseeded generator (numpy's
# global one is seeded from the OS), hypothesis settings of a test's own.
_UNPROFILED = re.compile(
    r"urandom\(|default_rng\(\)|np\.random\.(?!default_rng|Generator|SeedSequence|PCG64|Philox)\w+\(|"
    r"\brandom\.(seed|random|randint|choice|shuffle)\(|torch\.seed\(\)|@seed\(|"
    r"derandomize\s*=|database\s*="
)


def unprofiled_randomness(folder: str | os.PathLike[str]) -> list[str]:
    """The lines of the Python files under ``folder`` (a package's tests) that draw randomness
    the test profile does not control, as "path:line: text"; empty where there is none."""
    from pathlib import Path

    root = Path(folder)
    if not root.is_dir():  # (rglob of a missing folder or a file finds nothing: a check
        # that could never fail)
        what = "is a file, not a folder" if root.exists() else "does not exist"
        raise NotADirectoryError(f"folder: {str(root)!r} {what}; name the tests' folder")
    found = []
    for path in sorted(root.rglob("*.py")):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if _UNPROFILED.search(line):
                found.append(f"{path}:{n}: {line.strip()}")
    return found


def suite_profile_problems(folder: str | os.PathLike[str]) -> list[str]:
    """What keeps the test suite under ``folder`` from running under the test profile that
    its ``conftest.py`` loads (``load_test_profile``): hypothesis's default settings other
    than the profile's ("ci": derandomized, no example database; where hypothesis is
    installed), and the lines that draw randomness the profile does not control
    (``unprofiled_randomness``); empty where there is none."""
    problems = []
    try:
        from hypothesis import settings
    except ImportError:
        settings = None
    if settings is not None:
        ci = current_test_profile() == "ci"
        if settings.default.derandomize is not ci or (settings.default.database is None) is not ci:
            problems.append(f"hypothesis settings are not the {current_test_profile()!r} profile's")
    return problems + unprofiled_randomness(folder)
