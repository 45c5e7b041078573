"""fp4_comm's packaging (the version pyproject.toml sets, installed and imported; the
fp4-kernels requirement; the py.typed marker), the type annotations of its public API, its
modules (ddp, tensor_parallel) and the classes its methods return, and its test profile."""

from pathlib import Path

from fp4_kernels import testing

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_metadata_version_and_marker_match_pyproject():
    import fp4_comm

    assert (
        testing.packaging_problems(fp4_comm, PYPROJECT, "fp4-comm", requires=["fp4-kernels"]) == []
    )


def _public_callables():
    """(qualified name, function) of every public function and class member that fp4_comm
    exports, the modules it exports (ddp, tensor_parallel) included, and of the classes its
    public methods return (CapturedCollective)."""
    import fp4_comm
    from fp4_comm.communicator import CapturedCollective

    exports = {name: getattr(fp4_comm, name) for name in fp4_comm.__all__}
    return testing.public_callables(fp4_comm, {**exports, "CapturedCollective": CapturedCollective})


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
        "NVFP4Codec.requantized_sum",  # both from the FP4 codecs' private base
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


def test_public_functions_carry_type_annotations():
    assert testing.annotation_gaps(_public_callables()) == {}  # and the hints resolve


def test_the_suite_runs_under_the_test_profile():
    assert testing.suite_profile_problems(Path(__file__).parent) == []
