"""Make ``_oracle`` (the shared test oracles beside this file) importable from every test folder;
load the test profile (hypothesis derandomized and without a database unless
FP4_TEST_PROFILE=explore, as ``nox -s tests_explore`` sets it)."""

import sys
from pathlib import Path

import pytest

from fp4_kernels.testing import load_test_profile, seed_torch_generators

sys.path.insert(0, str(Path(__file__).resolve().parent))
load_test_profile()


@pytest.fixture(autouse=True)
def _torch_generators(request):
    """torch's global generators seeded by the test's id (``seed_torch_generators``)."""
    seed_torch_generators(request.node.nodeid)
