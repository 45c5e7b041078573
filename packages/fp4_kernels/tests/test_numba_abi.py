"""fp4_kernels._numba_abi: what the direct launch assumes of numba's kernel ABI, checked without
a GPU.  A numba-cuda release that changes how it passes arrays or scalars to a kernel fails
here (CI) instead of launching kernels with shifted arguments on a user's GPU."""

import re

import numpy as np
import pytest
from numba import config, types

from fp4_kernels import _numba_abi as abi

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
        abi.DeviceBuffer(0x1000, 4, np.dtype(np.uint32)),
        np.int64(3),
        np.uint32(5),
        np.float32(1.5),
        abi.DeviceBuffer(0x2000, 8, np.dtype(np.uint8)),
    )
    fmt, layout = abi.parameter_layout(args)
    assert [_PTX_SIZES[p] for p in params] == [size for _, size in layout]
    assert len(params) == 2 * len(abi.ARRAY_FIELDS) + 3
    # the values in ABI order: meminfo, parent, nitems, itemsize, data, shape, strides
    values = abi._values(args)
    assert values[:7] == [0, 0, 4, 4, 0x1000, 4, 4]
    assert values[-7:] == [0, 0, 8, 1, 0x2000, 8, 1]
    import struct

    assert struct.calcsize(fmt) == layout[-1][0] + layout[-1][1]


_CACHE_PROBE = """
import numpy as np
import fp4_kernels as fk
from fp4_kernels.cpu import codec
fk.quantize(np.ones((2, 32), np.float32), fmt="mxfp4")
stats = codec.quantize.stats
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
    """An edit in any module of the package (here _scalar.py, whose functions others inline)
    changes the key of every cached function."""
    import shutil
    from pathlib import Path

    package = Path(abi.__file__).resolve().parent
    copy = tmp_path / "fp4_kernels"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    before = abi.package_source_stamp(copy)
    assert abi.package_source_stamp(copy) == before
    scalar = copy / "_scalar.py"
    scalar.write_text(scalar.read_text() + "\n# an edit\n")
    assert abi.package_source_stamp(copy) != before
