"""fp4_kernels.testing: the simulator's warp shuffles behave as the hardware's; the test
profile and seeds."""

import zlib
from pathlib import Path

import numpy as np
import pytest
from numba import cuda

from fp4_kernels.testing import adversarial_blocks, same_bits


def test_warp_shuffles(kernels):
    @cuda.jit
    def shuffles(out):
        t = cuda.threadIdx.x
        out[0, t] = cuda.shfl_xor_sync(0xFFFFFFFF, t, 5)
        out[1, t] = cuda.shfl_down_sync(0xFFFFFFFF, t, 3)
        out[2, t] = cuda.shfl_up_sync(0xFFFFFFFF, t, 2)
        out[3, t] = cuda.shfl_sync(0xFFFFFFFF, t, 7)

    out = cuda.to_device(np.zeros((4, 64), np.int64))
    shuffles[1, 64](out)
    got = out.copy_to_host()
    t = np.arange(64)
    lane = t % 32
    base = t - lane
    np.testing.assert_array_equal(got[0], base + (lane ^ 5))
    np.testing.assert_array_equal(got[1], np.where(lane + 3 < 32, t + 3, t))
    np.testing.assert_array_equal(got[2], np.where(lane >= 2, t - 2, t))
    np.testing.assert_array_equal(got[3], base + 7)


def test_adversarial_blocks_cover_the_cases(rng):
    x = adversarial_blocks(rng, 64, 64)
    assert np.isnan(x).any() and np.isinf(x).any() and (x == 0).any()
    assert (np.signbit(x) & (x == 0)).any()
    tiny = np.abs(x[np.isfinite(x) & (x != 0)]).min()
    assert tiny < np.finfo(np.float32).tiny  # float32 subnormals present


def test_same_bits():
    a = np.array([1.0, np.nan, -0.0], np.float32)
    assert same_bits(a, a.copy())
    assert not same_bits(a, np.array([1.0, np.nan, 0.0], np.float32))
    with pytest.raises(AssertionError):
        assert same_bits(a, a.astype(np.float16))


def test_the_suite_runs_under_the_test_profile():
    # conftest.py loads it: "ci" (derandomized, no example database: no run replays another's
    # failures) unless FP4_TEST_PROFILE=explore; and no test draws randomness it does not control
    from fp4_kernels.testing import suite_profile_problems

    assert suite_profile_problems(Path(__file__).parent) == []


def test_random_seed_is_fixed_by_the_name_under_ci_and_fresh_under_explore(monkeypatch):
    from fp4_kernels import testing

    monkeypatch.delenv(testing.TEST_PROFILE_ENV, raising=False)
    assert testing.random_seed("a::b") == testing.random_seed("a::b") == zlib.crc32(b"a::b")
    assert testing.random_seed("a::b") != testing.random_seed("a::c")
    monkeypatch.setenv(testing.TEST_PROFILE_ENV, "explore")
    monkeypatch.setattr(testing.os, "urandom", lambda n: bytes(range(1, n + 1)))
    assert testing.random_seed("a::b") == 0x04030201
    monkeypatch.setenv(testing.TEST_PROFILE_ENV, "random")
    with pytest.raises(ValueError, match="FP4_TEST_PROFILE='random' is not one of"):
        testing.random_seed("a::b")


def test_torch_generators_are_seeded_by_the_test_alone(request, monkeypatch):
    """Draws from torch's global generator depended on the tests run before in the process
    (xdist's distribution among them): the conftest seeds it by the test's id."""
    torch = pytest.importorskip("torch")
    from fp4_kernels import testing

    monkeypatch.delenv(testing.TEST_PROFILE_ENV, raising=False)
    assert torch.initial_seed() == testing.random_seed(request.node.nodeid)  # the fixture's
    first = torch.randn(4)
    torch.randn(100)  # what another test would have drawn before
    assert testing.seed_torch_generators(request.node.nodeid) == torch.initial_seed()
    assert torch.equal(torch.randn(4), first)
    testing.seed_torch_generators("another::test")
    assert not torch.equal(torch.randn(4), first)


def test_unprofiled_randomness_finds_each_kind(tmp_path):
    from fp4_kernels.testing import unprofiled_randomness

    # written with a "|" that is taken out below, so that this file itself holds none of them
    lines = [
        line.replace("|", "")
        for line in [
            'seed = int.from_bytes(os.ura|ndom(4), "little")',
            "rng = np.random.default_rng(|)",
            "x = np.random.ra|nd(3)",
            "random.se|ed(1)",
            "@settings(derandom|ize=False)",
            "@settings(datab|ase=ExampleDatabase())",
            "@se|ed(123)",
        ]
    ]
    fine = ["rng = np.random.default_rng(5)", "g = np.random.Generator(np.random.PCG64(1))"]
    (tmp_path / "test_x.py").write_text("\n".join(fine + lines) + "\n")
    found = unprofiled_randomness(tmp_path)
    assert [f.split(":", 2)[1] for f in found] == [str(i) for i in range(3, 3 + len(lines))]


def test_packaging_problems_names_each_disagreement(tmp_path):
    import importlib.metadata
    import sys

    import fp4_kernels
    from fp4_kernels.testing import packaging_problems

    if sys.version_info < (3, 11):
        pytest.importorskip("tomli")
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "fp4-none"\nversion = "0.0.0"\n')
    (missing,) = packaging_problems(fp4_kernels, pyproject, "fp4-none")
    assert missing.startswith("fp4-none is not installed (no distribution metadata)"), missing
    try:
        version = importlib.metadata.version("fp4-kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(
            "fp4_kernels is imported from a source tree without installed metadata: "
            "no installed version to compare the disagreements against"
        )
    pyproject.write_text(f'[project]\nname = "fp4-kernels"\nversion = "{version}"\n')
    assert packaging_problems(fp4_kernels, pyproject, "fp4-kernels") == []
    pyproject.write_text('[project]\nname = "fp4-other"\nversion = "0.0.0"\n')
    problems = packaging_problems(fp4_kernels, pyproject, "fp4-kernels", requires=["fp4-none"])
    assert len(problems) == 3, problems
    assert "names 'fp4-other'" in problems[0] and "versions disagree" in problems[1]
    assert problems[2] == "fp4-kernels does not require fp4-none"


def test_annotation_gaps_names_each_function_and_a_hint_that_does_not_resolve():
    from fp4_kernels.testing import annotation_gaps

    def typed(x: int) -> int:
        return x

    def untyped(x, y: int):
        return x

    def unresolved(x: "NoSuchType") -> None:  # noqa: F821
        pass

    assert annotation_gaps({"typed": typed, "untyped": untyped}) == {"untyped": ["x", "return"]}
    with pytest.raises(TypeError, match="unresolved: its annotations do not resolve"):
        annotation_gaps({"unresolved": unresolved})


def test_helpers_name_bad_arguments(tmp_path):
    """A folder that is not there made the randomness check pass (it found no file);
    bfloat16 torch tensors, bools and non-strings gave raw numpy / attribute errors."""
    import fp4_kernels.testing as T

    torch = pytest.importorskip("torch")
    with pytest.raises(NotADirectoryError, match="does not exist"):
        T.unprofiled_randomness(tmp_path / "missing")
    drawn = (
        "np.random." + "rand(3)"
    )  # (not written out here: the suite's own check reads this file)
    (tmp_path / "test_x.py").write_text(f"import numpy as np\nx = {drawn}\n")
    with pytest.raises(NotADirectoryError, match="is a file, not a folder"):
        T.unprofiled_randomness(tmp_path / "test_x.py")
    assert len(T.unprofiled_randomness(tmp_path)) == 1
    t = torch.ones(2, dtype=torch.bfloat16)
    assert T.same_bits(t, t.clone()) and not T.same_bits(t, -t)
    assert T.reference_quantization(torch.ones(2, 16, dtype=torch.bfloat16), "nvfp4")[0].shape == (
        2, 8,
    )  # fmt: skip
    with pytest.raises(TypeError, match="rows must be an int"):
        adversarial_blocks(np.random.default_rng(0), True, 32)
    with pytest.raises(TypeError, match="rng: a numpy Generator"):
        adversarial_blocks(object(), 2, 32)
    with pytest.raises(TypeError, match="name: the test's node id"):
        T.random_seed(5)
