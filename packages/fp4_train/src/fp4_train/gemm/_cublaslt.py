"""The native FP4 GEMM: cuBLASLt's block-scaled matmul through nvmath-python's bindings.

Needs compute capability >= 10.0 (FP4 tensor cores: Blackwell).  cuBLAS is column-major, and
``a`` (M, K) and ``b`` (N, K) are row-major with K contiguous, so cuBLAS computes the
column-major N x M matrix D = op(A) op(B) with A = b (stored K x N, transposed: "T"),
B = a (stored K x M, not transposed: "N"); column-major N x M is the row-major (M, N) result
``a @ b^T``.  This "TN" form is the one cuBLASLt requires for FP8 and FP4 operands.  Each
operand's scales go with it: cuBLAS's A scales are ``b.scales`` (N rows of K/16 blocks), its B
scales ``a.scales``, both in the 128 x 4-tile swizzled layout ``fp4_kernels.quantize(...,
scale_layout="swizzled")`` writes.  The two NVFP4 tensor scales are folded into alpha, read
from device memory (pointer mode DEVICE) so that nothing waits for the host.

``plan_native`` describes all of this as plain data (no GPU, no cuBLAS), which the CPU tests
check; ``native_gemm`` applies a plan with cuBLASLt.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

import fp4_kernels

MIN_CAPABILITY = (10, 0)  # FP4 (e2m1) tensor cores: sm_100 and later
WORKSPACE_BYTES = 32 << 20  # cuBLASLt's recommended workspace for Hopper/Blackwell kernels
# cudaDataType values (library_types.h); nvmath.CudaDataType names the same numbers.
CUDA_R_32F = 0
CUDA_R_16BF = 14
CUDA_R_4F_E2M1 = 33
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_COMPUTE_32F = 68
# cuBLASLt wants 16-byte aligned leading dimensions: 32 e2m1 elements.
K_ALIGNMENT = 32
# cublasLtReductionScheme_t: how a split-K kernel combines its partial sums.  INPLACE (1) adds
# them up in the output buffer in the output type and OUTPUT_TYPE (4) stages them in the output
# type: with a bfloat16 result every partial sum is rounded to bfloat16, so the result is no
# longer the float32 product rounded once (and INPLACE's order changes from run to run).
# COMPUTE_TYPE (2) keeps float32 partials in the workspace and reduces them in a separate step.
CUBLASLT_REDUCTION_SCHEME_INPLACE = 1
CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE = 2
CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE = 4
# cublasLtMatmulPreferenceAttributes_t, by member name: the heuristic may pick kernels without
# split-K (always allowed) or with float32 partials; a 32 MiB workspace.
PREFERENCES = {
    "MAX_WORKSPACE_BYTES": WORKSPACE_BYTES,
    "REDUCTION_SCHEME_MASK": CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE,
}


class NativeGemmUnavailable(RuntimeError):
    """The native FP4 GEMM cannot run here (device, operands or nvmath-python)."""


@dataclass(frozen=True)
class MatrixLayout:
    """Arguments of ``cublasLtMatrixLayoutCreate``: column-major rows x cols, leading dim."""

    data_type: int
    rows: int
    cols: int
    ld: int


@dataclass(frozen=True)
class NativePlan:
    """Everything the native GEMM tells cuBLASLt, derived from the operands' metadata."""

    m: int  # cuBLAS m = N (rows of the column-major result)
    n: int  # cuBLAS n = M
    k: int
    trans_a: int
    trans_b: int
    layout_a: MatrixLayout  # of b's codes
    layout_b: MatrixLayout  # of a's codes
    layout_d: MatrixLayout
    scale_mode: str  # MatmulMatrixScale member name, the same for A and B
    scale_bytes_a: int  # bytes of b.scales cuBLASLt reads
    scale_bytes_b: int  # bytes of a.scales
    compute_type: int
    scale_type: int  # the type of alpha and beta
    alpha_from_tensor_scales: bool  # alpha = gs_a * gs_b (NVFP4); MXFP4 has none


_SCALE_MODES = {"nvfp4": "VEC16_UE4M3", "mxfp4": "VEC32_UE8M0"}
_OUT_TYPES = {"float32": CUDA_R_32F, "bfloat16": CUDA_R_16BF}


def plan_native(a, b, out_dtype):
    """The cuBLASLt description of ``a @ b^T``; ValueError for operands it cannot take."""
    if a.scale_layout != "swizzled" or b.scale_layout != "swizzled":
        raise NativeGemmUnavailable(
            "the native FP4 GEMM reads block scales in the swizzled 128x4-tile layout; quantize "
            "both operands with scale_layout='swizzled' "
            f"(a: {a.scale_layout!r}, b: {b.scale_layout!r})"
        )
    (m_rows, k), (n_rows, _) = a.shape, b.shape
    if k % K_ALIGNMENT:
        raise NativeGemmUnavailable(
            f"the native FP4 GEMM needs K a multiple of {K_ALIGNMENT} (16-byte rows of codes), "
            f"got K={k}; use backend='exact'"
        )
    block = a.block_size
    expected = [
        math.prod(fp4_kernels.swizzled_scale_shape(rows, k // block)) for rows in (n_rows, m_rows)
    ]
    got = [math.prod(tuple(q.scales.shape)) for q in (b, a)]
    if got != expected:
        raise ValueError(
            f"swizzled scales of b and a hold {got} bytes, expected {expected} for "
            f"N={n_rows}, M={m_rows}, K={k}"
        )
    return _abt_plan(
        m_rows,
        n_rows,
        k,
        CUDA_R_4F_E2M1,
        out_dtype,
        scale_mode=_SCALE_MODES[a.fmt],
        scale_bytes=expected,
        alpha_from_tensor_scales=a.fmt == "nvfp4",
    )


def _abt_plan(m_rows, n_rows, k, in_type, out_dtype, *, scale_mode, scale_bytes,
              alpha_from_tensor_scales):  # fmt: skip
    """``a (M, K) @ b (N, K)^T`` in cuBLASLt's column-major terms: the row-major (M, N) result
    is the column-major N x M matrix ``op_T(b) @ op_N(a)``, so cuBLAS's A is b and its B is a,
    both K x rows column-major (leading dim K); float32 accumulation and alpha.
    ``scale_bytes``: the block-scale bytes of (b, a)."""
    return NativePlan(
        m=n_rows,
        n=m_rows,
        k=k,
        trans_a=CUBLAS_OP_T,
        trans_b=CUBLAS_OP_N,
        layout_a=MatrixLayout(in_type, k, n_rows, k),
        layout_b=MatrixLayout(in_type, k, m_rows, k),
        layout_d=MatrixLayout(_OUT_TYPES[out_dtype], n_rows, m_rows, n_rows),
        scale_mode=scale_mode,
        scale_bytes_a=scale_bytes[0],
        scale_bytes_b=scale_bytes[1],
        compute_type=CUBLAS_COMPUTE_32F,
        scale_type=CUDA_R_32F,
        alpha_from_tensor_scales=alpha_from_tensor_scales,
    )


def device_capability(device: torch.device | str | int) -> tuple[int, int]:
    """The compute capability (major, minor) of a torch CUDA device."""
    return tuple(torch.cuda.get_device_capability(device))


def native_supported(device: torch.device | str | int) -> bool:
    """Whether ``device`` (a torch device, its name or a CUDA index) is a CUDA device with FP4
    tensor cores: False for a CPU device or where torch has no CUDA device."""
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        raise TypeError(
            f"device: a torch.device, a device name or a CUDA index, got {type(device).__name__}"
        )
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return False
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        return False
    return has_fp4_tensor_cores(dev)


def has_fp4_tensor_cores(device: torch.device) -> bool:
    """Whether the CUDA device ``device`` (of an operand fp4_gemm checked) has FP4 tensor
    cores."""
    return device_capability(device) >= MIN_CAPABILITY


@functools.cache
def _bindings():
    """(nvmath's cuBLASLt bindings, None), or (None, why they cannot be used here)."""
    try:
        from nvmath.bindings import cublasLt
    except ImportError as e:
        return None, (
            f"nvmath-python's cuBLASLt bindings do not import ({e}); they come with the "
            "[native] extra: pip install 'fp4-train[native]'"
        )
    try:
        cublasLt.get_version()
    except Exception as e:  # the bindings import, but libcublasLt does not load
        return None, f"nvmath-python cannot load cuBLASLt ({type(e).__name__}: {e})"
    return cublasLt, None


def bindings_unavailable() -> str | None:
    """None where nvmath-python's cuBLASLt bindings work, else the reason they do not."""
    return _bindings()[1]


def _cublaslt():
    cublasLt, reason = _bindings()
    if cublasLt is None:
        raise NativeGemmUnavailable(f"the native FP4 GEMM needs cuBLASLt: {reason}")
    return cublasLt


def _require_native(a):
    if not (isinstance(a.data, torch.Tensor) and a.data.is_cuda):
        raise NativeGemmUnavailable(
            "the native FP4 GEMM runs on CUDA tensors only; these operands are on the CPU "
            "(use backend='exact')"
        )
    device = a.data.device
    cc = device_capability(device)
    if cc < MIN_CAPABILITY:
        raise NativeGemmUnavailable(
            f"the native FP4 GEMM needs FP4 tensor cores (compute capability >= "
            f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}); {torch.cuda.get_device_name(device)} "
            f"has compute capability {cc[0]}.{cc[1]}; use backend='exact'"
        )
    return _cublaslt(), device


_HANDLES = {}  # device index -> cublasLtHandle_t


def _handle(cublasLt, device):
    if device.index not in _HANDLES:
        _HANDLES[device.index] = cublasLt.create()
    return _HANDLES[device.index]


def _set(setter, dtype_of, obj, attr, value):
    """Set one cuBLASLt attribute from a host buffer of the type the bindings name for it."""
    buf = np.array([value], dtype=dtype_of(attr))
    setter(obj, attr, buf.ctypes.data, buf.nbytes)


def native_gemm(a, b, out_dtype):
    """Run ``plan_native(a, b, out_dtype)`` with cuBLASLt on torch's current stream."""
    cublasLt, device = _require_native(a)
    plan = plan_native(a, b, out_dtype)
    if plan.alpha_from_tensor_scales:
        alpha = a.global_scale * b.global_scale
    else:
        alpha = torch.ones(1, dtype=torch.float32, device=device)
    scale_mode = int(getattr(cublasLt.MatmulMatrixScale, plan.scale_mode))
    attr = cublasLt.MatmulDescAttribute
    return _lt_matmul(
        cublasLt,
        device,
        plan,
        a_ptr=b.data.data_ptr(),
        b_ptr=a.data.data_ptr(),
        alpha=alpha,
        out_dtype=out_dtype,
        extra_desc={
            attr.A_SCALE_MODE: scale_mode,
            attr.B_SCALE_MODE: scale_mode,
            attr.A_SCALE_POINTER: b.scales.data_ptr(),
            attr.B_SCALE_POINTER: a.scales.data_ptr(),
        },
    )


def bf16_gemm_device_alpha(a1, b1, alpha, out_dtype="float32"):
    """``alpha * (a1 @ b1^T)`` for bfloat16 CUDA tensors a1 (M, K), b1 (N, K), with ``alpha`` a
    one-element float32 tensor on the device: one cuBLASLt call (bf16 operands, float32
    accumulation, alpha read from device memory, the result rounded once to ``out_dtype``,
    "float32" or "bfloat16"), so the exact path needs no separate pass over the result to apply
    the tensor scales, and a bfloat16 result comes from the same kind of kernel as a plain bf16
    GEMM.  Any compute capability.

    Experimental: measured by ``benchmarks/gemm_throughput.py`` and tested on a GPU; not yet
    what ``fp4_gemm`` calls.
    """
    check_device_alpha_operands(a1, b1, alpha, out_dtype)
    cublasLt = _cublaslt()
    (m_rows, k), (n_rows, _) = a1.shape, b1.shape
    plan = _abt_plan(m_rows, n_rows, k, CUDA_R_16BF, out_dtype, scale_mode="", scale_bytes=(0, 0),
                     alpha_from_tensor_scales=True)  # fmt: skip
    a1, b1 = a1.contiguous(), b1.contiguous()
    return _lt_matmul(
        cublasLt,
        a1.device,
        plan,
        a_ptr=b1.data_ptr(),
        b_ptr=a1.data_ptr(),
        alpha=alpha,
        out_dtype=out_dtype,
        extra_desc={},
    )


def check_device_alpha_operands(a1, b1, alpha, out_dtype):
    """What ``bf16_gemm_device_alpha`` hands cuBLASLt as raw pointers: bfloat16 (M, K) and
    (N, K) tensors and a one-element float32 alpha, all on one CUDA device."""
    for name, t in (("a1", a1), ("b1", b1), ("alpha", alpha)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch tensor, got {type(t).__name__}")
    if a1.dtype != torch.bfloat16 or b1.dtype != torch.bfloat16:
        raise TypeError(f"a1, b1: expected bfloat16, got {a1.dtype}, {b1.dtype}")
    if a1.dim() != 2 or b1.dim() != 2 or a1.shape[1] != b1.shape[1]:
        raise ValueError(
            f"a1, b1: expected (M, K) and (N, K), got {tuple(a1.shape)} and {tuple(b1.shape)}"
        )
    if alpha.dtype != torch.float32 or alpha.numel() != 1:
        raise ValueError(
            f"alpha: expected one float32 element, got {alpha.numel()} of {alpha.dtype}"
        )
    if out_dtype not in _OUT_TYPES:
        raise ValueError(f"out_dtype: {out_dtype!r} is not one of {tuple(_OUT_TYPES)}")
    devices = {t.device for t in (a1, b1, alpha)}
    if len(devices) != 1 or not a1.is_cuda:
        raise ValueError(
            f"a1, b1, alpha: expected one CUDA device, got {sorted(map(str, devices))}"
        )


def _lt_matmul(cublasLt, device, plan, *, a_ptr, b_ptr, alpha, out_dtype, extra_desc):
    """D = alpha op(A) op(B) (beta = 0) as ``plan`` describes it, on torch's current stream;
    returns D as the row-major (plan.n, plan.m) torch tensor."""
    attr = cublasLt.MatmulDescAttribute
    out = torch.empty((plan.n, plan.m), dtype=getattr(torch, out_dtype), device=device)
    beta = torch.zeros(1, dtype=torch.float32, device=device)
    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    stream = torch.cuda.current_stream(device).cuda_stream
    with torch.cuda.device(device):
        handle = _handle(cublasLt, device)
        desc = cublasLt.matmul_desc_create(plan.compute_type, plan.scale_type)
        layouts = [
            cublasLt.matrix_layout_create(x.data_type, x.rows, x.cols, x.ld)
            for x in (plan.layout_a, plan.layout_b, plan.layout_d)
        ]
        pref = cublasLt.matmul_preference_create()
        try:
            settings = {
                attr.TRANSA: plan.trans_a,
                attr.TRANSB: plan.trans_b,
                # alpha and beta in device memory: nothing waits for the host
                attr.POINTER_MODE: int(cublasLt.PointerMode.DEVICE),
                **extra_desc,
            }
            for key, value in settings.items():
                _set(
                    cublasLt.matmul_desc_set_attribute,
                    cublasLt.get_matmul_desc_attribute_dtype,
                    desc,
                    key,
                    value,
                )
            for name, value in PREFERENCES.items():
                _set(
                    cublasLt.matmul_preference_set_attribute,
                    cublasLt.get_matmul_preference_attribute_dtype,
                    pref,
                    getattr(cublasLt.MatmulPreferenceAttribute, name),
                    value,
                )
            result = cublasLt.MatmulHeuristicResult(1)
            count = np.zeros(1, np.int32)
            la, lb, ld = layouts
            cublasLt.matmul_algo_get_heuristic(
                handle, desc, la, lb, ld, ld, pref, 1, result.ptr, count.ctypes.data
            )
            if count[0] == 0:
                raise NativeGemmUnavailable(
                    f"cuBLASLt has no kernel for M={plan.n}, N={plan.m}, K={plan.k}, "
                    f"A type {plan.layout_a.data_type}, scales {plan.scale_mode or 'none'}, "
                    f"output {out_dtype}"
                )
            # the heuristic result struct starts with its cublasLtMatmulAlgo_t
            cublasLt.matmul(
                handle,
                desc,
                alpha.data_ptr(),
                a_ptr,
                la,
                b_ptr,
                lb,
                beta.data_ptr(),
                out.data_ptr(),
                ld,
                out.data_ptr(),
                ld,
                result.ptr,
                workspace.data_ptr(),
                WORKSPACE_BYTES,
                stream,
            )
        finally:
            cublasLt.matmul_preference_destroy(pref)
            for layout in layouts:
                cublasLt.matrix_layout_destroy(layout)
            cublasLt.matmul_desc_destroy(desc)
    # alpha, beta and the workspace came from torch's allocator on this stream: memory freed
    # here is reused only by work queued after the GEMM, so no record_stream is needed.
    return out
