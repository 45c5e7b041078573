"""Test tiers (see the root README): the same kernel tests run in numba's CUDA simulator
(NUMBA_ENABLE_CUDASIM=1, CI) and on a real GPU; ``compile_check`` tests compile to sm_90 PTX
without a GPU; ``gpu`` tests need a real GPU and skip, with the reason, where there is none.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import config, cuda

from fp4_kernels.testing import (
    install_simulator_warp_intrinsics,
    load_test_profile,
    random_seed,
    seed_torch_generators,
)

SIMULATOR = bool(config.ENABLE_CUDASIM)
install_simulator_warp_intrinsics()
# hypothesis derandomized and without a database, and the rng fixture's seeds fixed, unless
# FP4_TEST_PROFILE=explore (nox -s tests_explore)
TEST_PROFILE = load_test_profile()


def _real_gpu():
    if SIMULATOR:
        return False
    try:
        return cuda.is_available()
    except Exception:  # no driver at all
        return False


REAL_GPU = _real_gpu()


def pytest_report_header(config):
    tier = "simulator" if SIMULATOR else ("real GPU" if REAL_GPU else "no GPU (compile check)")
    return f"fp4_kernels test tier: {tier}; test profile: {TEST_PROFILE}"


@pytest.fixture
def kernels():
    """Kernel tests run on the simulator or a real GPU; skipped (with the reason) otherwise."""
    if not (SIMULATOR or REAL_GPU):
        pytest.skip("no CUDA GPU and not in the simulator (set NUMBA_ENABLE_CUDASIM=1)")
    if SIMULATOR:
        # one Python thread per CUDA thread: keep blocks at 2 warps and the grid at 2 CTAs so
        # grid-stride loops still iterate and shuffles still cross warps.
        from fp4_kernels.cuda.launch import launch_policy

        with launch_policy(threads=64, max_blocks=2):
            yield "simulator"
    else:
        yield "gpu"


@pytest.fixture
def gpu():
    """Real-GPU-only tests (full sizes): skipped with a reason elsewhere."""
    if not REAL_GPU:
        pytest.skip("needs a real CUDA GPU (`nox -s gpu` on a machine with one)")
    return True


@pytest.fixture(autouse=True)
def _torch_generators(request):
    """torch's global generators seeded by the test's id (``seed_torch_generators``)."""
    seed_torch_generators(request.node.nodeid)


@pytest.fixture
def rng(request):
    """A numpy Generator: seeded by the test's id under the "ci" profile (every run draws the
    same inputs), afresh under "explore"."""
    seed = random_seed(request.node.nodeid)
    print(f"rng seed {seed}")  # shown on failure: rerun with this seed to reproduce
    return np.random.default_rng(seed)
