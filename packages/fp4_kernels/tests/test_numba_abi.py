"""fp4_kernels._numba_abi: what the direct launch assumes of numba's kernel ABI, checked without
a GPU.  A numba-cuda release that changes how it passes arrays or scalars to a kernel fails
here (CI) instead of launching kernels with shifted arguments on a user's GPU.  And the on-disk
cache of the CPU kernels: keyed to the whole package, its files checked before they are read."""

import re

import numpy as np
import pytest
from numba import config, types

from fp4_kernels import _numba_abi as abi
from fp4_kernels.cuda import launch

compile_check = pytest.mark.compile_check
needs_nvvm = pytest.mark.skipif(
    bool(config.ENABLE_CUDASIM), reason="the ABI of compiled kernels: needs the real NVVM"
)

_PTX_SIZES = {"u64": 8, "b64": 8, "s64": 8, "u32": 4, "b32": 4, "s32": 4, "f32": 4}


def _entry_params(ptx):
    entry = re.search(r"\.entry\s+\S+\((.*?)\)", ptx, re.S).group(1)
    return re.findall(r"\.param\s+\.(\w+)", entry)


@compile_check
@needs_nvvm
def test_array_data_model_fields():
    from numba.cuda.datamodel import default_manager

    model = default_manager.lookup(types.Array(types.uint32, 1, "C"))
    assert tuple(model._fields) == abi.ARRAY_FIELDS


@compile_check
@needs_nvvm
def test_packed_layout_matches_the_compiled_kernel_parameters():
    """The PTX entry of a kernel taking (uint32[::1], int64, uint32, float32, uint8[::1]) has
    exactly the parameters, sizes and order that ``parameter_layout`` packs."""
    from numba import cuda

    from fp4_kernels.testing import compile_ptx

    @cuda.jit
    def k(a, n, u, f, b):
        if cuda.grid(1) < n:
            a[0] = u
            b[0] = np.uint8(f)

    sig = (
        types.Array(types.uint32, 1, "C"),
        types.int64,
        types.uint32,
        types.float32,
        types.Array(types.uint8, 1, "C"),
    )
    params = _entry_params(compile_ptx(k, sig))
    args = (
        launch.DeviceBuffer(0x1000, 4, np.dtype(np.uint32)),
        np.int64(3),
        np.uint32(5),
        np.float32(1.5),
        launch.DeviceBuffer(0x2000, 8, np.dtype(np.uint8)),
    )
    fmt, layout = launch.parameter_layout(args)
    assert [_PTX_SIZES[p] for p in params] == [size for _, size in layout]
    assert len(params) == 2 * len(abi.ARRAY_FIELDS) + 3
    # the values in ABI order: meminfo, parent, nitems, itemsize, data, shape, strides
    values, positions = launch.launch_values(args)
    assert values[:7] == [0, 0, 4, 4, 0x1000, 4, 4]
    assert values[-7:] == [0, 0, 8, 1, 0x2000, 8, 1]
    # each argument's own value: the data pointer of a buffer, a scalar itself
    assert [values[p] for p in positions] == [0x1000, 3, 5, 1.5, 0x2000]
    import struct

    assert struct.calcsize(fmt) == layout[-1][0] + layout[-1][1]


_CACHE_PROBE = """
import numpy as np
import fp4_kernels as fk
from fp4_kernels.cpu import codec
fk.quantize(np.ones((2, 32), np.float32), fmt="mxfp4")
stats = codec.quantize_blocks.stats
print(sum(stats.cache_hits.values()), sum(stats.cache_misses.values()))
"""


def test_cpu_kernels_are_cached_on_disk_between_processes(tmp_path):
    import os
    import subprocess
    import sys

    env = dict(os.environ, FP4_KERNELS_CACHE_DIR=str(tmp_path), NUMBA_ENABLE_CUDASIM="0")
    runs = [
        subprocess.run(
            [sys.executable, "-c", _CACHE_PROBE],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )  # fmt: skip
        for _ in range(2)
    ]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    hits = [tuple(map(int, r.stdout.split())) for r in runs]
    assert hits[0] == (0, 1)  # the first process compiles (and saves)
    assert hits[1] == (1, 0)  # the second loads it
    assert any(tmp_path.rglob("*.nbi"))


def test_the_cache_key_covers_every_source_file(tmp_path):
    """An edit in any module of the package (here _scalar/e2m1.py, whose functions others inline)
    changes the key of every cached function."""
    import shutil
    from pathlib import Path

    package = Path(abi.__file__).resolve().parent
    copy = tmp_path / "fp4_kernels"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    before = abi.package_source_stamp(copy)
    assert abi.package_source_stamp(copy) == before
    scalar = copy / "_scalar" / "e2m1.py"
    scalar.write_text(scalar.read_text() + "\n# an edit\n")
    assert abi.package_source_stamp(copy) != before


# ------------------------------------------------------------------ a corrupted cache


def _square_plus_one(x):
    return x * x + 1.0


def _fresh_dispatcher():
    """A new dispatcher of one small function, cached through ``CheckedFunctionCache`` (a new
    one has nothing in memory: it loads from the cache or compiles)."""
    import numba

    return abi.enable_checked_cache(numba.njit(_square_plus_one))


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _garble(path):
    """One byte in the middle flipped: what a pickle may still load (garbled machine code)."""
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x55
    path.write_bytes(bytes(raw))


def _empty(path):
    path.write_bytes(b"")


def _numba_format(path):
    """numba's own format (no digest): what a cache written by numba's FunctionCache holds."""
    import pickle

    path.write_bytes(pickle.dumps("0.0") + pickle.dumps(("stamp", {})))


CORRUPTIONS = {"truncate": _truncate, "garble": _garble, "empty": _empty, "numba": _numba_format}


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """numba's user-provided cache directory (functions outside fp4_kernels' source, as this
    test's, are cached there) and warnings given anew."""
    from numba import config as numba_config

    from fp4_kernels import _notices

    monkeypatch.setattr(numba_config, "CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_notices, "_GIVEN", set())
    return tmp_path


@pytest.mark.parametrize("which", ["index", "data"])
@pytest.mark.parametrize("how", list(CORRUPTIONS))
def test_a_corrupted_cache_entry_is_discarded_recompiled_and_named_once(cache_dir, how, which):
    import fp4_kernels as fk
    from fp4_kernels import _notices

    caught, value = _call_recording(_fresh_dispatcher())  # compiled and saved
    assert value == 10.0 and [w.category for w in caught] == [fk.KernelCompileWarning]
    (index,) = cache_dir.rglob("*_square_plus_one*.nbi")
    (data,) = cache_dir.rglob("*_square_plus_one*.nbc")
    path = index if which == "index" else data
    CORRUPTIONS[how](path)
    _notices._GIVEN.clear()
    d = _fresh_dispatcher()
    caught, value = _call_recording(d)
    assert value == 10.0
    cache_warnings = [w for w in caught if w.category is fk.KernelCacheWarning]
    assert len(cache_warnings) == 1 and str(path) in str(cache_warnings[0].message)
    assert sum(d.stats.cache_misses.values()) == 1  # compiled again
    # saved again, readable: the next dispatcher loads it without a word
    d = _fresh_dispatcher()
    assert _call_recording(d) == ([], 10.0)
    assert sum(d.stats.cache_hits.values()) == 1
    # once per process: another unreadable entry is discarded and compiled without a word
    CORRUPTIONS[how](path)
    d = _fresh_dispatcher()
    assert _call_recording(d) == ([], 10.0)
    assert sum(d.stats.cache_misses.values()) == 1


def _call_recording(d):
    """(the warnings given, d(3.0))."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = d(3.0)
    return caught, value


def test_every_cpu_kernel_uses_the_checked_cache():
    from numba.core.dispatcher import Dispatcher

    from fp4_kernels.cpu import _primitives, codec, fp4quant

    found = [
        obj
        for module in (codec, fp4quant, _primitives.OPS)
        for obj in vars(module).values()
        if isinstance(obj, Dispatcher)
    ]
    assert len(found) > 20
    assert all(type(d._cache) is abi.CheckedFunctionCache for d in found)


_CORRUPTION_PROBE = """
import numpy as np
from fp4_kernels.cpu import codec
print(codec.load(np.array([0x3FC00000], np.uint32), 0, 0))  # float32 bits of 1.5
stats = codec.load.stats
print(sum(stats.cache_hits.values()), sum(stats.cache_misses.values()))
"""


def test_a_corrupted_kernel_cache_between_processes(tmp_path):
    """The package's own cache (FP4_KERNELS_CACHE_DIR): a truncated index is discarded with one
    warning naming the file, compiled again and saved again (numba's own cache files raise
    UnpicklingError or EOFError from every call, in every process).  Every kind of damage to
    either file: the in-process test above."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, FP4_KERNELS_CACHE_DIR=str(tmp_path), NUMBA_ENABLE_CUDASIM="0")
    env.pop("PYTHONWARNINGS", None)

    def run(*options):
        r = subprocess.run(
            [sys.executable, *options, "-c", _CORRUPTION_PROBE],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-2000:]
        value, counts = r.stdout.split("\n")[:2]
        assert value == "1.5"
        return tuple(map(int, counts.split())), r.stderr

    counts, err = run()
    assert counts == (0, 1) and err.count(": KernelCompileWarning: ") == 1
    (index,) = tmp_path.rglob("codec.load-*.nbi")
    _truncate(index)
    # the compile notice silenced from the command line as documented; the cache warning
    # names the file
    counts, err = run("-W", "ignore:fp4_kernels is compiling")
    assert counts == (0, 1)
    assert err.count(": KernelCacheWarning: ") == 1 and str(index) in err
    assert "KernelCompileWarning" not in err
    counts, err = run()
    assert counts == (1, 0) and "Warning" not in err
