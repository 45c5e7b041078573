"""fp4_comm installs, imports, reports the version its pyproject.toml sets, and its public API
carries type annotations (with a py.typed marker)."""

import importlib.metadata
import importlib.resources
import inspect
import re
import sys
import types
from pathlib import Path

import pytest

from fp4_kernels.testing import missing_annotations

if sys.version_info >= (3, 11):
    import tomllib
else:
    tomllib = pytest.importorskip("tomli")

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
DIST_NAME = "fp4-comm"


@pytest.fixture(scope="module")
def project():
    with PYPROJECT.open("rb") as f:
        return tomllib.load(f)["project"]


def test_version_matches_pyproject(project):
    import fp4_comm

    assert project["name"] == DIST_NAME
    assert fp4_comm.__version__ == project["version"]
    assert importlib.metadata.version(DIST_NAME) == project["version"]


def test_installed_metadata_requires_fp4_kernels():
    requires = importlib.metadata.requires(DIST_NAME) or []
    # A requirement string starts with its project name: "fp4-kernels>=0.1.0".
    names = {re.match(r"[A-Za-z0-9._-]+", r).group().lower() for r in requires}
    assert "fp4-kernels" in names


def _written_here(fn):
    """Defined in fp4_comm's own source (not generated, as dataclasses' __eq__ is)."""
    import fp4_comm

    source = Path(fp4_comm.__file__).resolve().parent
    code = getattr(fn, "__code__", None)
    return code is not None and Path(code.co_filename).resolve().is_relative_to(source)


def _members(prefix, cls, found):
    """The public methods, properties and dunders of ``cls`` and its bases in fp4_comm."""
    for base in cls.__mro__:
        if not base.__module__.startswith("fp4_comm"):
            continue
        for attr, value in vars(base).items():
            if attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__")):
                continue
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if isinstance(value, property):
                value = value.fget
            if inspect.isfunction(value) and _written_here(value):
                found.setdefault(f"{prefix}.{attr}", value)


def _public_callables():
    """(qualified name, function) of every public function and class member that fp4_comm
    exports, the modules it exports (ddp, tensor_parallel) included, and of the classes its
    public methods return (CapturedCollective)."""
    import fp4_comm
    from fp4_comm.communicator import CapturedCollective

    found = {}

    def add(prefix, obj):
        if inspect.isfunction(obj):
            found[prefix] = obj
        elif inspect.isclass(obj):
            _members(prefix, obj, found)

    for name in fp4_comm.__all__:
        obj = getattr(fp4_comm, name)
        if isinstance(obj, types.ModuleType):
            for attr, value in vars(obj).items():
                if not attr.startswith("_") and getattr(value, "__module__", "") == obj.__name__:
                    add(f"{name}.{attr}", value)
        else:
            add(name, obj)
    add("CapturedCollective", CapturedCollective)
    return found


def test_the_public_api_lists_what_it_should():
    expected = {
        "get_codec",
        "shard_rows",
        "Communicator.from_process_group",
        "Communicator.all_reduce",
        "Communicator.recv",
        "Codec.encode",
        "NVFP4Codec.encode",  # inherited from the FP4 codecs' private base
        "NVFP4Codec.decode",
        "MXFP4Codec.requantized_sum",
        "ErrorFeedback.state_dict",
        "HopStats.as_floats",
        "CommPeerError.__init__",
        "CapturedCollective.replay",
        "ddp.register",
        "ddp.fp4_allreduce_hook",
        "tensor_parallel.copy_to_tensor_parallel",
        "tensor_parallel.reduce_scatter_to_sequence_parallel",
    }
    assert expected <= set(_public_callables())


@pytest.mark.parametrize("qualname", sorted(_public_callables()))
def test_public_functions_carry_type_annotations(qualname):
    missing = missing_annotations(_public_callables()[qualname])  # and the hints resolve
    assert not missing, f"{qualname}: without annotation: {missing}"


def test_py_typed_marker_is_in_the_package():
    # hatchling ships every file of src/fp4_comm in the wheel, this marker included
    assert importlib.resources.files("fp4_comm").joinpath("py.typed").is_file()


def test_the_suite_runs_under_the_test_profile():
    # conftest.py loads it (fp4_kernels.testing.load_test_profile): derandomized and without
    # an example database unless FP4_TEST_PROFILE=explore
    from hypothesis import settings

    from fp4_kernels.testing import current_test_profile

    ci = current_test_profile() == "ci"
    assert settings.default.derandomize is ci
    assert (settings.default.database is None) is ci


def test_no_test_draws_randomness_the_profile_does_not_control():
    from pathlib import Path

    from fp4_kernels.testing import unprofiled_randomness

    assert unprofiled_randomness(Path(__file__).parent) == []
