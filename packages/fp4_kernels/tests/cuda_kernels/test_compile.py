"""Compile-check tier: every kernel configuration compiled by the real NVVM to sm_90 PTX, no
GPU needed.  Catches typing errors the simulator never sees, and checks the generated code for
what would make the kernels slow or inexact: local memory (spills, register arrays indexed at
run time), float64 arithmetic (a float literal leaking into float32 math), approximate division,
and loads narrower than the 8-byte words the kernels are written for."""

import itertools
import re

import pytest
from numba import config, types

if config.ENABLE_CUDASIM:
    pytest.skip("compile check needs the real NVVM, not the simulator", allow_module_level=True)

from fp4_kernels._scalar import KIND_F32
from fp4_kernels.cuda.amax import amax_kernel
from fp4_kernels.cuda.butterflies import EXCHANGED_DIRECT, WARP_TILE, layouts
from fp4_kernels.cuda.dequantize import dequantize_kernel
from fp4_kernels.cuda.fp4quant import fp4quant_decode_kernel, fp4quant_encode_kernel
from fp4_kernels.cuda.hadamard import hadamard_kernel, smem_hadamard_kernel
from fp4_kernels.cuda.quantize import quantize_kernel
from fp4_kernels.cuda.quantize_dequantize import fake_quantize_kernel
from fp4_kernels.formats.mxfp4 import SPEC as FMT_MXFP4
from fp4_kernels.formats.nvfp4 import SPEC as FMT_NVFP4
from fp4_kernels.testing import compile_ptx

pytestmark = pytest.mark.compile_check

U64 = types.Array(types.uint64, 1, "C")
U16 = types.Array(types.uint16, 1, "C")
U8 = types.Array(types.uint8, 1, "C")
F32 = types.Array(types.float32, 1, "C")
I64 = types.int64
U32 = types.uint32

W32 = types.Array(types.uint32, 1, "C")
QUANTIZE_SIG = (W32, W32, U8, W32, I64, I64, I64, F32, I64, types.float32, F32, U32, U32, U32)
DEQUANTIZE_SIG = (W32, U8, F32, W32, I64, I64, I64)
FAKE_QUANTIZE_SIG = (W32, W32, I64, F32, I64, types.float32, F32, U32, U32, U32)
AMAX_SIG = (W32, I64, F32)
ELEMENTS = {0: types.Array(types.uint32, 1, "C"), 1: U16, 2: U16}  # unaligned inputs
HADAMARD_SIG = (W32, W32, I64, types.Array(types.uint32, 1, "C"))
ENCODE_SIG = (W32, W32, U16, I64, U32, U32, U32)
DECODE_SIG = (W32, U16, W32, I64)
GROUP_SIZES = [16 << i for i in range(10)]  # 16 ... 8192
# every group size in bfloat16, and the other element kinds at a shuffle-only and a
# shared-memory group size
GROUP_CASES = [(1, g) for g in GROUP_SIZES] + [(k, g) for k in (0, 2) for g in (64, 2048)]
# the group sizes whose transform of 16-bit data takes the two-transpose chain: 2048...8192
EXCHANGED_DIRECT_GROUPS = {WARP_TILE << k for k in EXCHANGED_DIRECT}
# the "smem" kernels that load elements prefetch only 16-bit kinds (network_choice)
SMEM_CASES = [(k, g, pf) for k, g in GROUP_CASES for pf in (False, True) if k or not pf]
ENCODE_CASES = [(k, g, False, False) for k, g in GROUP_CASES] + [
    (k, g, True, pf) for k, g, pf in SMEM_CASES
]


def _stage_instructions(ptx, g):
    """The three stage kinds appear exactly where the group size needs them."""
    assert "shfl.sync.bfly" in ptx  # every group spans lanes (g = 16: 2 lanes, 1 stage)
    assert ("bar.sync" in ptx) == (g > 1024)  # shared memory only above a warp's 1024


def _check_ptx(ptx):
    assert ".local" not in ptx, "local memory in the kernel (spill or run-time-indexed array)"
    f64 = re.findall(r"^\s*\S*\.f64\b.*$", ptx, re.M)
    assert not f64, f"float64 arithmetic in the kernel: {f64[:3]}"
    assert "div.approx" not in ptx and "div.full" not in ptx, "non-IEEE float division"
    assert "ld.global.u64" in ptx or "ld.global.nc.u64" in ptx, "no 8-byte loads"


def _check_block_kernel_body(ptx):
    """Registers only (no spills, no run-time-indexed arrays), float32 only, IEEE division."""
    assert ".local" not in ptx, "local memory in the kernel (spill or run-time-indexed array)"
    f64 = re.findall(r"^\s*\S*\.f64\b.*$", ptx, re.M)
    assert not f64, f"float64 arithmetic in the kernel: {f64[:3]}"
    assert "div.approx" not in ptx and "div.full" not in ptx, "non-IEEE float division"


def _check_block_kernel(ptx):
    """The one-thread-per-block kernels: registers only, float32 only, IEEE division."""
    assert ".local" not in ptx, "local memory in the kernel (spill or run-time-indexed array)"
    f64 = re.findall(r"^\s*\S*\.f64\b.*$", ptx, re.M)
    assert not f64, f"float64 arithmetic in the kernel: {f64[:3]}"
    assert "div.approx" not in ptx and "div.full" not in ptx, "non-IEEE float division"
    # a block is one thread's: no shuffles, except the NVFP4 quantizer's one reduction of the
    # tensor amax partials at the start
    assert ptx.count("shfl.sync") <= 5


@pytest.mark.parametrize(
    "kind,fmt,stochastic,swizzled,fused",
    list(
        itertools.product(
            (0, 1, 2), (FMT_NVFP4, FMT_MXFP4), (False, True), (False, True), (False, True)
        )
    ),
)
def test_quantize_kernel_compiles_clean(kind, fmt, stochastic, swizzled, fused):
    ptx = compile_ptx(quantize_kernel(kind, fmt, stochastic, swizzled, fused), QUANTIZE_SIG)
    _check_block_kernel(ptx)
    assert "ld.global.nc.v4.u32" in ptx  # 16-byte loads of the block
    # a block's codes in one 8-byte (NVFP4) or 16-byte (MXFP4) store
    assert ("st.global.v2.u32" if fmt == FMT_NVFP4 else "st.global.v4.u32") in ptx
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx or fmt == FMT_MXFP4  # hardware scale cast
    # the float-pipe e2m1 encoders: saturating multiply-adds (and for stochastic rounding the
    # random bits placed and the codes gathered by byte permute, one Philox call (10 rounds of
    # 2 wide multiplies) per 8 elements)
    assert "fma.rn.sat.f32" in ptx and "mul.rn.sat.f32" in ptx
    if stochastic:
        assert "prmt.b32" in ptx
        assert ptx.count("mul.wide.u32") == 20 * fmt.block_size // 8  # a thread a block
    if kind != 0:
        assert "prmt.b32" in ptx  # sign bits by byte permute
        assert "max.u16x2" in ptx  # block amax on packed 16-bit halves
    if fused:
        assert "st.global.v4.u32" in ptx


@pytest.mark.parametrize(
    "kind,fmt,stochastic",
    list(itertools.product((0, 1, 2), (FMT_NVFP4, FMT_MXFP4), (False, True))),
)
def test_fake_quantize_kernel_compiles_clean(kind, fmt, stochastic):
    ptx = compile_ptx(fake_quantize_kernel(kind, fmt, stochastic), FAKE_QUANTIZE_SIG)
    _check_block_kernel_body(ptx)
    # 16-byte loads of the input and 16-byte stores of the result, nothing else to global
    # memory but the tensor scale (one float32, by thread 0): no codes, no scale bytes
    assert "ld.global.nc.v4.u32" in ptx and "st.global.v4.u32" in ptx
    stores = re.findall(r"^\s*st\.global\.(\S+)", ptx, re.M)
    scalar = [s for s in stores if s != "v4.u32"]
    assert len(scalar) == 1 and scalar[0] in ("f32", "u32"), stores
    assert stores.count("v4.u32") == 2 * (2 if kind == 0 else 1)  # 2 items of 16 / 32 bytes
    # two items' block amaxes: log2(block / 8) butterfly shuffles each (plus the NVFP4 tensor
    # amax partials' warp reduction: 5)
    shuffles = 2 * (fmt.block_size // 8).bit_length() - 2 + (5 if fmt == FMT_NVFP4 else 0)
    assert ptx.count("shfl.sync.bfly") == shuffles
    assert "fma.rn.sat.f32" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx or fmt == FMT_MXFP4
    if stochastic:  # one Philox call (10 rounds of 2 wide multiplies) an item
        assert ptx.count("mul.wide.u32") == 2 * 20 and "add.rm.f32" in ptx
    if kind != 0:
        assert "max.u16x2" in ptx  # block amax on packed 16-bit halves


@pytest.mark.parametrize("kind,fmt", list(itertools.product((0, 1, 2), (FMT_NVFP4, FMT_MXFP4))))
def test_fake_quantize_kernel_unaligned_input_compiles_clean(kind, fmt):
    sig = (ELEMENTS[kind],) + FAKE_QUANTIZE_SIG[1:]
    ptx = compile_ptx(fake_quantize_kernel(kind, fmt, False, False), sig)
    _check_block_kernel_body(ptx)
    assert "ld.global.nc.v4" not in ptx and "st.global.v4.u32" in ptx


@pytest.mark.parametrize("kind,fmt", list(itertools.product((0, 1, 2), (FMT_NVFP4, FMT_MXFP4))))
def test_quantize_kernel_unaligned_input_compiles_clean(kind, fmt):
    sig = (ELEMENTS[kind],) + QUANTIZE_SIG[1:]
    ptx = compile_ptx(quantize_kernel(kind, fmt, False, False, False, False), sig)
    _check_block_kernel(ptx)
    assert "ld.global.nc.v4" not in ptx  # element loads only: the input is not 16-byte aligned


@pytest.mark.parametrize(
    "kind,fmt,swizzled", list(itertools.product((0, 1, 2), (FMT_NVFP4, FMT_MXFP4), (False, True)))
)
def test_dequantize_kernel_compiles_clean(kind, fmt, swizzled):
    # 16 bytes of output an item: 8 codes (a uint32) for 16-bit outputs, 4 (a uint16) for float32
    codes = U16 if kind == 0 else W32
    ptx = compile_ptx(dequantize_kernel(kind, fmt, swizzled), (codes,) + DEQUANTIZE_SIG[1:])
    _check_block_kernel(ptx)
    assert ("ld.global.u16" if kind == 0 else "ld.global.u32") in ptx  # one load of codes
    assert "prmt.b32" in ptx and "st.global.v4.u32" in ptx
    ptx = compile_ptx(dequantize_kernel(kind, fmt, swizzled, False), (U8,) + DEQUANTIZE_SIG[1:])
    _check_block_kernel(ptx)
    assert "ld.global.u8" in ptx  # unaligned codes: byte loads


@pytest.mark.parametrize("kind", (0, 1, 2))
def test_amax_kernel_compiles_clean(kind):
    ptx = compile_ptx(amax_kernel(kind), AMAX_SIG)
    assert ".local" not in ptx and "ld.global.nc.v4.u32" in ptx
    ptx = compile_ptx(amax_kernel(kind, False), (ELEMENTS[kind], I64, F32))
    assert ".local" not in ptx and "ld.global.nc.v4" not in ptx


def test_a_float64_leak_is_a_compile_error():
    """The bit-cast intrinsics refuse float64, so a Python float literal that widened the
    arithmetic cannot go unnoticed."""
    from numba import cuda

    from fp4_kernels.cuda._primitives import f32_as_u32

    @cuda.jit
    def leaky(out):
        out[0] = f32_as_u32(out[0] * 0.5)  # 0.5 is float64: the product is float64

    with pytest.raises(Exception, match="float32 argument"):
        compile_ptx(leaky, (types.Array(types.uint32, 1, "C"),))


@pytest.mark.parametrize("kind,g", GROUP_CASES)
def test_hadamard_kernel_compiles_clean(kind, g):
    ptx = compile_ptx(hadamard_kernel(kind, g, False, True), HADAMARD_SIG)
    _check_block_kernel_body(ptx)
    _stage_instructions(ptx, g)
    assert "ld.global.nc.v4.u32" in ptx  # 16-byte loads and stores
    assert "st.global.v4.u32" in ptx or (g == 8192 and "st.global.v2.u32" in ptx)


@pytest.mark.parametrize("kind,g,prefetch", SMEM_CASES)
def test_smem_hadamard_kernel_compiles_clean(kind, g, prefetch):
    """The shared-memory network: no shuffles, 16-byte shared accesses (8-byte ones in the
    two-transpose exchange of 16-bit data at g = 2048, 4096 and 8192, ``EXCHANGED_DIRECT``),
    CTA barriers only across warps, 16-byte loads and 16-byte stores (8-byte where the final
    layout's runs are 4 elements: float32 at 8192, and 4096 with the direct exchange; 4-byte
    runs of 2 at 8192 with the direct exchange)."""
    ptx = compile_ptx(smem_hadamard_kernel(kind, g, False, True, True, prefetch), HADAMARD_SIG)
    _check_block_kernel_body(ptx)
    assert "shfl.sync" not in ptx
    direct = kind != KIND_F32 and g in EXCHANGED_DIRECT_GROUPS
    shared = "v2" if direct else "v4"
    assert f"ld.shared.{shared}.f32" in ptx and f"st.shared.{shared}.f32" in ptx
    # each transpose of the chain writes and reads a thread's 32 float32 once: the shared-memory
    # traffic a tile is what the layouts say (two transposes, not three, where direct)
    transposes = len(layouts(g, kind == KIND_F32, direct_exchange=True)) - 1
    assert transposes == (2 if direct or g <= WARP_TILE else 3)
    for op in ("ld", "st"):
        moved = 16 * ptx.count(f"{op}.shared.v4.f32") + 8 * ptx.count(f"{op}.shared.v2.f32")
        assert moved == 128 * transposes, (op, moved)
    assert ("bar.sync" in ptx) == (g > 1024)
    assert "ld.global.nc.v4.u32" in ptx
    if direct and g == 8192:
        assert "st.global.u32" in ptx and "st.global.v" not in ptx
    elif g == 8192 or (direct and g == 4096):
        assert "st.global.v2.u32" in ptx
    else:
        assert "st.global.v4.u32" in ptx
    ptx = compile_ptx(smem_hadamard_kernel(kind, g, True, True, False, prefetch),
                      (ELEMENTS[kind],) + HADAMARD_SIG[1:])  # fmt: skip
    _check_block_kernel_body(ptx)  # unaligned input: element loads


@pytest.mark.parametrize("kind,g,smem,prefetch", ENCODE_CASES)
@pytest.mark.parametrize("stochastic", [False, True])
def test_fp4quant_encode_kernel_compiles_clean(kind, g, stochastic, smem, prefetch):
    sig = ENCODE_SIG if g < 8192 else (W32, U16) + ENCODE_SIG[2:]
    kernel = fp4quant_encode_kernel(kind, g, True, stochastic, True, smem, prefetch)
    ptx = compile_ptx(kernel, sig)
    _check_block_kernel_body(ptx)
    _stage_instructions(ptx, g)  # smem: the group amax's shuffles and CTA barriers
    assert ("ld.shared.v4.f32" in ptx) == (smem or g > 1024)
    assert "ld.global.nc.v4.u32" in ptx
    # eight codes per 4-byte store (four per 2-byte store at g = 8192), a bf16 scale per group
    assert ("st.global.u32" if g < 8192 else "st.global.u16") in ptx
    assert "max.NaN.f32" in ptx  # the group amax: one FMNMX.NAN an element
    if stochastic:  # a thread's 32 elements: 4 Philox calls (10 rounds, 2 wide multiplies)
        assert ptx.count("mul.wide.u32") == (80 if g < 8192 else 160)
        assert "add.rm.f32" not in ptx  # the codes gathered from byte 2 of the sums


@pytest.mark.parametrize("g", [16, 256, 2048])
def test_fp4quant_encode_without_transform_compiles_clean(g):
    ptx = compile_ptx(fp4quant_encode_kernel(1, g, False, False), ENCODE_SIG)
    _check_block_kernel_body(ptx)
    assert ("bar.sync" in ptx) == (g > 1024)  # only the cross-warp amax


@pytest.mark.parametrize("kind,g", GROUP_CASES)
@pytest.mark.parametrize("smem,prefetch", [(False, False), (True, False), (True, True)])
def test_fp4quant_decode_kernel_compiles_clean(kind, g, smem, prefetch):
    ptx = compile_ptx(fp4quant_decode_kernel(kind, g, True, smem, prefetch), DECODE_SIG)
    _check_block_kernel_body(ptx)
    if smem:
        assert "shfl.sync" not in ptx and "ld.shared.v4.f32" in ptx
        assert ("bar.sync" in ptx) == (g > 1024)
    else:
        _stage_instructions(ptx, g)
    assert "prmt.b32" in ptx  # e2m1 values by byte-permute lookups
    assert "st.global.v4.u32" in ptx or (g == 8192 and "st.global.v2.u32" in ptx)


def test_blocking_kernel_compiles_to_a_sleep_loop():
    """fp4 report's timing queues each call behind this kernel (fp4_kernels._throughput)."""
    from fp4_kernels._throughput import blocking_kernel

    ptx = compile_ptx(blocking_kernel(), (I64,))
    assert "nanosleep.u32" in ptx and ".local" not in ptx


REDUCE_HEAD = (W32, U8, F32, I64, I64, I64)  # codes, scales, gs, gs_step, rows, n_blocks
REDUCE_SIG = REDUCE_HEAD + (W32, U8, F32, F32, I64)
REDUCE_AMAX_SIG = REDUCE_HEAD + (F32,)


def _decode_products(ptx, products):
    """The decode's last products are mul.rn (never contracted into an FMA with the adds:
    see cuda/reduce.py), one a decoded element, and the sums plain IEEE adds."""
    assert ptx.count("mul.rn.f32") >= products
    assert "add.f32" in ptx or "add.rn.f32" in ptx


@pytest.mark.parametrize("fmt", [FMT_NVFP4, FMT_MXFP4])
def test_requantized_sum_kernel_compiles_clean(fmt):
    from fp4_kernels.cuda.reduce import requantized_sum_kernel

    ptx = compile_ptx(requantized_sum_kernel(fmt), REDUCE_SIG)
    _check_block_kernel(ptx)
    # a row's block of codes in one 16-byte (MXFP4) / 8-byte (NVFP4) load, and so its store
    v = "v4" if fmt == FMT_MXFP4 else "v2"
    assert f"ld.global.nc.{v}.u32" in ptx and f"st.global.{v}.u32" in ptx
    _decode_products(ptx, fmt.block_size)
    ptx = compile_ptx(requantized_sum_kernel(fmt, False), (U8,) + REDUCE_SIG[1:])
    _check_block_kernel(ptx)


def test_requantized_sum_amax_kernel_compiles_clean():
    """The NVFP4 sum's amax pass: decode and add only, so no FMA at all in it."""
    from fp4_kernels.cuda.reduce import requantized_sum_amax_kernel

    for aligned, codes in ((True, W32), (False, U8)):
        ptx = compile_ptx(requantized_sum_amax_kernel(aligned), (codes,) + REDUCE_AMAX_SIG[1:])
        _check_block_kernel(ptx)
        assert "fma" not in ptx, "a decode product contracted with an add"
        _decode_products(ptx, FMT_NVFP4.block_size)
        assert ("ld.global.nc.v2.u32" in ptx) == aligned


STEP_REF = types.Array(types.int64, 1, "C")  # a device step: one int64 element


@pytest.mark.parametrize("fmt", [FMT_NVFP4, FMT_MXFP4])
def test_device_step_variants_compile_clean(fmt):
    """The step read from a one-element int64 array: the same kernel (Philox, registers only,
    float32 only)."""
    for kernel, sig, body in (
        (quantize_kernel(1, fmt, True, False, False, device_step=True), QUANTIZE_SIG, False),
        (fake_quantize_kernel(1, fmt, True, device_step=True), FAKE_QUANTIZE_SIG, True),
        (fp4quant_encode_kernel(1, 64, True, True, device_step=True), ENCODE_SIG, True),
        (fp4quant_encode_kernel(1, 2048, True, True, True, True, False, True), ENCODE_SIG, True),
    ):
        ptx = compile_ptx(kernel, sig[:-1] + (STEP_REF,))
        (_check_block_kernel_body if body else _check_block_kernel)(ptx)
        assert "mul.wide.u32" in ptx  # Philox
