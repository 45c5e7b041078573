"""cuda/hadamard.py: the transform kernel against the numpy reference, bit for bit (same
butterfly order), in the simulator (small: one or two CTAs) and on a real GPU (full sizes)."""

import numpy as np
import pytest
from _devices import NP_DTYPES, available_kinds, to_gpu, to_host, use_network_variant
from conftest import REAL_GPU, SIMULATOR

import fp4_kernels as fk
from fp4_kernels._scalar import KIND_BF16, KIND_F16, KIND_F32
from fp4_kernels.cuda import hadamard as H, launch
from fp4_kernels.cuda.butterflies import WARP_TILE
from fp4_kernels.cuda.launch_table import NETWORK_VARIANTS
from fp4_kernels.formats import hadamard as h
from fp4_kernels.testing import same_bits

KINDS = available_kinds(REAL_GPU)
# every group size in bfloat16; float32 and float16 at register/shuffle and shared-memory sizes
FULL_CASES = [("bfloat16", 16 << i) for i in range(10)] + [
    (dt, g) for dt in ("float32", "float16") for g in (64, 512, 2048)
]


def _reference(x, g, inverse, seed):
    signs = None if seed is None else h.hadamard_signs(g, seed)
    y = h.hadamard_reference(np.asarray(x, np.float32), g, inverse=inverse, signs=signs)
    return y.astype(x.dtype)


# the simulator runs a CTA of 32 * g / 512 Python threads above g = 512: keep those few
SIM_CASES = [
    (16, "float32", False, None, 3),
    (32, "bfloat16", True, 5, 5),
    (128, "float16", False, 5, 1),
    (256, "bfloat16", False, None, 3),
    (512, "float32", True, 2**63 + 1, 2),
    (1024, "bfloat16", False, 7, 2),
    (2048, "float32", True, None, 1),
]


@pytest.mark.parametrize("variant", list(NETWORK_VARIANTS))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("g,dtype,inverse,seed,rows", SIM_CASES)
def test_kernel_matches_reference(
    kernels, rng, monkeypatch, variant, kind, g, dtype, inverse, seed, rows
):
    use_network_variant(monkeypatch, variant)
    x = (rng.standard_normal((rows, g)) * 2).astype(NP_DTYPES[dtype])
    x.reshape(-1)[:3] = [0.0, -0.0, 1e4]  # signed zeros and a value that dominates a group
    y = fk.hadamard(to_gpu(x, kind), group_size=g, inverse=inverse, signs=seed)
    assert same_bits(to_host(y), _reference(x, g, inverse, seed))


@pytest.mark.parametrize("variant", ["smem-pf", "smem16"])
@pytest.mark.parametrize("g", [64, 8192])
def test_smem_network_every_stage_and_sign(kernels, rng, monkeypatch, variant, g):
    """bf16 (the prefetching kind) at a group size whose transposes move 8 and 16 bytes an
    access, and at the largest (a CTA of 8 warps, three barriers a tile, 8-byte stores);
    several tiles per CTA so that the prefetch and the buffers' reuse are exercised."""
    use_network_variant(monkeypatch, variant)
    rows = 3 if g == 8192 else 200
    x = (rng.standard_normal((rows, g)) * 2).astype(NP_DTYPES["bfloat16"])
    for inverse, seed in ((False, 11), (True, 12)):
        y = fk.hadamard(to_gpu(x, "numba"), group_size=g, inverse=inverse, signs=seed)
        assert same_bits(to_host(y), _reference(x, g, inverse, seed)), (g, inverse)


@pytest.mark.parametrize(
    "variant,kind,choice",
    [("smem-pf", KIND_BF16, (True, True)), ("smem-pf", KIND_F16, (True, True)),
     ("smem-pf", None, (True, True)), ("smem-pf", KIND_F32, (True, False)),
     ("smem", KIND_BF16, (True, False)), ("shfl", KIND_BF16, (False, False))],
)  # fmt: skip
def test_network_choice_prefetches_no_float32_input(kernels, monkeypatch, variant, kind, choice):
    """One rule for the transform and FP4Quant's kernels: float32 input (32 more registers)
    does not prefetch; 16-bit elements and packed codes (None) do under ``smem-pf``.  The
    host sizes the CTA by the resolved choice: 128 threads with the prefetch, 256 without."""
    use_network_variant(monkeypatch, variant)
    assert launch.network_choice(64, kind) == choice
    assert launch.network_choice(16, kind) == (False, False)  # below "smem"'s smallest g
    if kind is not None:
        most = H.transform_kernel(kind, 64, False, True)[1]
        assert most == (launch.network_max_threads(choice[1]) if choice[0] else None)
    if kind == KIND_F32:
        assert H.transform_kernel(kind, 64, False, True)[1] == H.LAUNCH.threads


@pytest.mark.parametrize(
    "variant,dtype,g,grid",
    [("smem-pf", "bfloat16", 64, (4, 128, None)), ("smem-pf", "bfloat16", 1024, (4, 128, None)),
     ("smem-pf", "float32", 64, (8, 256, None)), ("smem", "bfloat16", 64, (8, 256, None)),
     ("smem-pf", "bfloat16", 2048, (8, 64, 384)), ("smem", "bfloat16", 2048, (32, 64, None)),
     ("smem-pf", "bfloat16", 4096, (4, 128, 512)), ("smem", "bfloat16", 4096, (16, 128, None)),
     ("smem-pf", "bfloat16", 8192, (2, 256, 512)), ("smem", "bfloat16", 8192, (8, 256, None)),
     ("shfl", "bfloat16", 64, (8, 256, None))],
)  # fmt: skip
def test_launch_grid(kernels, monkeypatch, variant, dtype, g, grid):
    """(CTAs, threads, resident threads an SM for the carveout) the transform asks for under
    the launch table's policy on a GPU of one SM, for 20 tiles of work: the prefetching kernels
    ``hadamard_prefetch`` row's threads an SM by the grid (4 CTAs of 128; 8 of 64 at g = 2048,
    4 of 128 at 4096, 2 of 256 at 8192), from g = 2048 by the shared-memory carveout too
    (``prefetch_threads_per_sm``: 384 at 2048; the launcher's occupancy cap then follows the
    carveout); the others up to 2048 threads (8 CTAs of 256, 32 of 64)."""
    use_network_variant(monkeypatch, variant)
    monkeypatch.setattr(launch, "sm_count", lambda device_id: 1)
    asked = []
    monkeypatch.setattr(launch, "launch", lambda k, blocks, threads, ctx, a, threads_per_sm=None:
                        asked.append((blocks, threads, threads_per_sm)))  # fmt: skip
    x = np.zeros((10, 8192), NP_DTYPES[dtype])  # 81920 elements
    with launch.launch_policy():  # the table's choice, not the simulator tests' small grids
        fk.hadamard(to_gpu(x, "numba"), group_size=g)
    assert asked == [grid]


@pytest.mark.skipif(SIMULATOR, reason="the carveout is a driver attribute of a real kernel")
@pytest.mark.parametrize("g", [2048, 4096])
def test_prefetching_transform_carveout(gpu, monkeypatch, g):
    """From g = 2048 the prefetching transform's shared-memory carveout is sized for
    ``prefetch_threads_per_sm(g)`` threads' CTAs: the kernel's attribute holds that percentage,
    the occupancy (the launcher's grid cap) has at least that many CTAs and fewer than the
    driver's own choice, which fills the SM with CTAs."""
    from cuda.bindings import driver

    from fp4_kernels import _numba_abi as abi

    use_network_variant(monkeypatch, "smem-pf")
    x = np.ones((64, g), NP_DTYPES["bfloat16"])
    kernel = H.transform_kernel(KIND_BF16, g, False, False)[0]
    fk.hadamard(to_gpu(x, "numba"), group_size=g)
    (key,) = [k for k in launch._compiled if k[0] is kernel]
    threads = 32 * g // WARP_TILE
    ctas = H.prefetch_threads_per_sm(g) // threads
    assert launch._carveout[key] == ctas
    cu_kernel = launch._compiled[key].cu_kernel
    err, percent = driver.cuKernelGetAttribute(
        driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
        cu_kernel.handle,
        key[1],
    )
    assert err == driver.CUresult.CUDA_SUCCESS and 0 < percent < 100
    sized = cu_kernel.occupancy.max_active_blocks_per_multiprocessor(threads, 0)
    try:
        abi.set_carveout(cu_kernel, key[1], None)
        full = cu_kernel.occupancy.max_active_blocks_per_multiprocessor(threads, 0)
    finally:
        assert abi.set_carveout(cu_kernel, key[1], ctas) == percent
    assert ctas <= sized <= full, (ctas, sized, full)


def test_unknown_variant_is_an_error(kernels, monkeypatch):
    monkeypatch.setenv("FP4_HADAMARD_VARIANT", "fast")
    with pytest.raises(ValueError, match="FP4_HADAMARD_VARIANT: 'fast' is not one of"):
        fk.hadamard(to_gpu(np.ones((1, 64), np.float32), "numba"), group_size=64)


def test_kernel_nan_stays_in_its_group(kernels):
    x = np.ones((2, 64), np.float32)
    x[0, 3] = np.nan
    y = to_host(fk.hadamard(to_gpu(x, "numba"), group_size=32))
    assert np.all(np.isnan(y[0, :32])) and np.all(np.isfinite(y[0, 32:]))
    assert np.all(np.isfinite(y[1]))


@pytest.mark.skipif(SIMULATOR, reason="full sizes run on a real GPU only")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype,g", FULL_CASES)
@pytest.mark.parametrize("variant", list(NETWORK_VARIANTS))
def test_full_size_matches_reference(gpu, rng, monkeypatch, variant, kind, dtype, g):
    use_network_variant(monkeypatch, variant)
    n = (1 << 22) + 3 * 8192  # not a multiple of the CTA tile: a partial last tile
    x = (rng.standard_normal(n) * 4).astype(NP_DTYPES[dtype]).reshape(-1, g)
    for inverse, seed in ((False, 1234), (True, None)):
        y = to_host(fk.hadamard(to_gpu(x, kind), group_size=g, inverse=inverse, signs=seed))
        assert same_bits(y, _reference(x, g, inverse, seed)), (g, dtype, inverse)


@pytest.mark.skipif(SIMULATOR, reason="torch streams: real GPU only")
def test_runs_on_the_callers_stream(gpu):
    torch = pytest.importorskip("torch")
    x = torch.randn(64, 4096, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        y = fk.hadamard(x, group_size=1024, signs=3)
        z = fk.hadamard(y, group_size=1024, signs=3, inverse=True)
    s.synchronize()
    torch.testing.assert_close(z, x, rtol=0, atol=1e-5)


@pytest.mark.skipif(SIMULATOR, reason="CUDA contexts: real GPU only")
def test_a_thread_without_a_current_context(gpu):
    """torch's autograd runs backward on a thread of its own, which may have no current CUDA
    context; the kernels launch through the driver API, so the first call binds one."""
    import threading

    torch = pytest.importorskip("torch")
    x = torch.randn(64, 1024, device="cuda")
    expected = fk.hadamard(x, group_size=256)
    q_expected = fk.quantize_dequantize(x, fmt="nvfp4")
    out = {}

    def work():
        try:
            out["h"] = fk.hadamard(x, group_size=256)
            out["q"] = fk.quantize_dequantize(x, fmt="nvfp4")
            torch.cuda.current_stream().synchronize()
        except Exception as e:  # surfaced in the main thread below
            out["error"] = e

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert "error" not in out, out.get("error")
    assert torch.equal(out["h"], expected) and torch.equal(out["q"], q_expected)
