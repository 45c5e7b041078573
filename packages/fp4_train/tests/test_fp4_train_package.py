"""fp4_train installs, imports, and reports the version its pyproject.toml sets."""

import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:
    tomllib = pytest.importorskip("tomli")

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
DIST_NAME = "fp4-train"


@pytest.fixture(scope="module")
def project():
    with PYPROJECT.open("rb") as f:
        return tomllib.load(f)["project"]


def test_version_matches_pyproject(project):
    import fp4_train

    assert project["name"] == DIST_NAME
    assert fp4_train.__version__ == project["version"]
    assert importlib.metadata.version(DIST_NAME) == project["version"]


def test_installed_metadata_requires_fp4_kernels():
    requires = importlib.metadata.requires(DIST_NAME) or []
    # A requirement string starts with its project name: "fp4-kernels>=0.1.0".
    names = {re.match(r"[A-Za-z0-9._-]+", r).group().lower() for r in requires}
    assert "fp4-kernels" in names
