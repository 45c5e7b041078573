"""Make ``_oracle`` (the shared test oracles beside this file) importable from every test folder;
load the test profile (hypothesis derandomized and without a database unless
FP4_TEST_PROFILE=explore, as ``nox -s tests_explore`` sets it)."""

import sys
from pathlib import Path

from fp4_kernels.testing import load_test_profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
load_test_profile()
