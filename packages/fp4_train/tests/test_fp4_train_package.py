"""fp4_train installs, imports, reports the version its pyproject.toml sets, and its public API
carries type annotations (with a py.typed marker)."""

from pathlib import Path

from fp4_kernels import testing

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_metadata_version_and_marker_match_pyproject():
    import fp4_train

    assert (
        testing.packaging_problems(fp4_train, PYPROJECT, "fp4-train", requires=["fp4-kernels"])
        == []
    )


def _public_callables():
    """(qualified name, function) of every public function and method that fp4_train and
    fp4_train.gemm export: functions, and the methods, properties and dunders their classes
    (and their bases in fp4_train) define themselves (not what they inherit, e.g. from
    torch.nn.Module)."""
    import fp4_train
    import fp4_train.gemm

    exports = {n: getattr(m, n) for m in (fp4_train, fp4_train.gemm) for n in m.__all__}
    return testing.public_callables(fp4_train, exports)


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


def test_public_functions_carry_type_annotations():
    assert testing.annotation_gaps(_public_callables()) == {}  # and the hints resolve


def test_the_suite_runs_under_the_test_profile():
    assert testing.suite_profile_problems(Path(__file__).parent) == []
