"""_notices.py: each notice is logged every time and warned once per process, in a category of
its own, pointing at the code that called fp4_kernels; the CPU and CUDA compile paths give it
(the CPU cache's part and a corrupted cache: test_numba_abi.py)."""

import logging
import types
import warnings

import pytest

import fp4_kernels as fk
from fp4_kernels import _notices, _numba_abi as abi


@pytest.fixture(autouse=True)
def anew(monkeypatch):
    monkeypatch.setattr(_notices, "_GIVEN", set())


def _recording(call):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return caught


def test_warned_once_per_key_and_logged_every_time(caplog):
    caplog.set_level(logging.INFO, logger="fp4_kernels")
    first = _recording(lambda: _notices.notify("a", "message a", fk.KernelCompileWarning))
    again = _recording(lambda: _notices.notify("a", "message a", fk.KernelCompileWarning))
    other = _recording(lambda: _notices.notify("b", "message b", fk.KernelCacheWarning))
    assert [(w.category, str(w.message)) for w in first] == [(fk.KernelCompileWarning, "message a")]
    assert again == []
    assert [w.category for w in other] == [fk.KernelCacheWarning]
    assert [r.getMessage() for r in caplog.records] == ["message a", "message a", "message b"]
    # it points at this file, the caller of fp4_kernels, not into the package
    assert first[0].filename == __file__


def test_the_documented_filter_silences_it():
    def call():
        warnings.filterwarnings("ignore", category=fk.KernelCompileWarning)
        _notices.notify("a", "fp4_kernels is compiling", fk.KernelCompileWarning)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    assert caught == []


class _StubKernel:
    """What compile_kernel needs of a ``@cuda.jit`` dispatcher (nothing is compiled)."""

    def compile(self, argtypes):
        library = types.SimpleNamespace(get_cufunc=lambda: types.SimpleNamespace(kernel="handle"))
        return types.SimpleNamespace(bind=lambda: None, _codelibrary=library)


def test_compiling_a_cuda_kernel_gives_the_notice_once():
    caught = _recording(lambda: abi.compile_kernel(_StubKernel(), []))
    assert [w.category for w in caught] == [fk.KernelCompileWarning]
    assert "fp4_kernels is compiling CUDA kernels" in str(caught[0].message)
    assert _recording(lambda: abi.compile_kernel(_StubKernel(), [])) == []


def _cube(x):
    return x * x * x


def test_compiling_a_cpu_kernel_not_in_the_cache_gives_the_notice_once(tmp_path, monkeypatch):
    import numba
    from numba import config

    monkeypatch.setattr(config, "CACHE_DIR", str(tmp_path))

    def fresh():
        return abi.enable_checked_cache(numba.njit(_cube))

    caught = _recording(lambda: fresh()(2.0))
    assert [w.category for w in caught] == [fk.KernelCompileWarning]
    assert "fp4_kernels is compiling CPU kernels" in str(caught[0].message)
    assert str(tmp_path) in str(caught[0].message)  # it names the cache
    d = fresh()
    assert _recording(lambda: d(2)) == []  # another signature compiles: once per process
    assert sum(d.stats.cache_misses.values()) == 1
    _notices._GIVEN.clear()
    d = fresh()
    assert _recording(lambda: d(2.0)) == []  # loaded from the cache: nothing to say
    assert sum(d.stats.cache_hits.values()) == 1


_CUDA_PROBE = """
import torch
import fp4_kernels as fk
x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
fk.quantize(x)
fk.quantize(x, fmt="mxfp4")
fk.hadamard(x, group_size=64)
torch.cuda.synchronize()
"""


@pytest.mark.gpu
def test_a_process_that_compiles_cuda_kernels_says_so_once(gpu):
    import os
    import subprocess
    import sys

    env = dict(os.environ)
    env.pop("PYTHONWARNINGS", None)
    r = subprocess.run(
        [sys.executable, "-c", _CUDA_PROBE], env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stderr.count(": KernelCompileWarning: fp4_kernels is compiling CUDA kernels") == 1
    quiet = subprocess.run(
        [sys.executable, "-W", "ignore:fp4_kernels is compiling", "-c", _CUDA_PROBE],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert quiet.returncode == 0 and "KernelCompileWarning" not in quiet.stderr
