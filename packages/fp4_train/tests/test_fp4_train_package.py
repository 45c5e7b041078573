"""fp4_train installs, imports, reports the version its pyproject.toml sets, and its public API
carries type annotations (with a py.typed marker)."""

import importlib.metadata
import importlib.resources
import inspect
import re
import sys
from pathlib import Path

import pytest

from fp4_kernels.testing import missing_annotations

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


def _public_callables():
    """(qualified name, function) of every public function and method that fp4_train and
    fp4_train.gemm export: functions, and the methods, properties and dunders their classes
    define themselves (not what they inherit, e.g. from torch.nn.Module)."""
    import fp4_train
    import fp4_train.gemm

    found = {}
    for module in (fp4_train, fp4_train.gemm):
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isfunction(obj):
                found[name] = obj
            elif inspect.isclass(obj):
                for attr, value in vars(obj).items():
                    if attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__")):
                        continue
                    if isinstance(value, (staticmethod, classmethod)):
                        value = value.__func__
                    if isinstance(value, property):
                        value = value.fget
                    if inspect.isfunction(value):
                        found[f"{name}.{attr}"] = value
    return found


def test_the_public_api_lists_what_it_should():
    names = set(_public_callables())
    expected = {
        "fp4_gemm",
        "fp4_linear",
        "native_supported",
        "ErrorFeedback.qdq",
        "FP4Linear.__init__",
        "FP4Linear.forward",
        "FP4StoredWeights.step",
        "FP4StoredWeights.param_groups",
    }
    assert expected <= names


@pytest.mark.parametrize("qualname", sorted(_public_callables()))
def test_public_functions_carry_type_annotations(qualname):
    missing = missing_annotations(_public_callables()[qualname])  # and the hints resolve
    assert not missing, f"{qualname}: without annotation: {missing}"


def test_py_typed_marker_is_in_the_package():
    # hatchling ships every file of src/fp4_train in the wheel, this marker included
    assert importlib.resources.files("fp4_train").joinpath("py.typed").is_file()


def test_the_suite_runs_under_the_test_profile():
    # conftest.py loads it (fp4_kernels.testing.load_test_profile), for tests that use
    # hypothesis where it is installed
    hypothesis = pytest.importorskip("hypothesis")

    from fp4_kernels.testing import current_test_profile

    ci = current_test_profile() == "ci"
    assert hypothesis.settings.default.derandomize is ci
    assert (hypothesis.settings.default.database is None) is ci


def test_no_test_draws_randomness_the_profile_does_not_control():
    from pathlib import Path

    from fp4_kernels.testing import unprofiled_randomness

    assert unprofiled_randomness(Path(__file__).parent) == []
