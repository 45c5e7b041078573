"""Every fp4_kernels GPU kernel once, on small inputs, for compute-sanitizer.

    compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \\
        python benchmarks/sanitize_workload.py [codec|transform|all] [VARIANT ...] [--groups G,G]
    compute-sanitizer --tool racecheck --error-exitcode 9 python benchmarks/sanitize_workload.py

``codec``: NVFP4 and MXFP4 quantize (nearest and stochastic, with and without ``global_amax``,
linear and swizzled scales), dequantize to bf16 and float32, fake quantization and the MXFP4
requantized sum, for bf16, float32 and float16 inputs, 16-byte aligned and not (a view one
element in).  ``transform``: the Walsh–Hadamard transform (with signs, and inverse) and the
FP4Quant encode / decode (with and without the transform, nearest and stochastic) at g = 16 …
8192 in bf16 and float32 (or the group sizes ``--groups`` lists), for each kernel variant
(``FP4_HADAMARD_VARIANT``), or the ones named after it.  Under the sanitizer numba's
compilations and the instrumented launches take minutes: on an H200 the codec part finishes in
under 4, one variant of the transform part in more (run variants and group sizes as separate
processes, side by side).  Inputs hold a NaN, an Inf and a -0, and (below g = 2048) end in a
partial tile; grids are capped at 3 CTAs so that every
grid-stride loop (and every prefetch past the end) runs several times.  ``--report-api-errors
no``: the launcher's one parameter-table query per kernel ends on the driver's end-of-list
answer, which memcheck would report as an API error.  Needs a CUDA build of torch.
"""

from __future__ import annotations

import os
import sys


def _tensor(torch, rows, k, dtype, offset=0):
    x = torch.randn(rows * k + offset, device="cuda", dtype=dtype) * 3
    x[5], x[40], x[77] = float("nan"), float("inf"), -0.0
    return x[offset:].view(rows, k)


def codec(torch, fk):
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        for offset in (0, 1):
            x = _tensor(torch, 7, 1024 + 32, dtype, offset)
            for fmt in ("nvfp4", "mxfp4"):
                for rounding in ("nearest", "stochastic"):
                    q = fk.quantize(x, fmt=fmt, rounding=rounding, seed=5)
                    fk.dequantize(q)
                    fk.dequantize(q, "float32")
                    fk.quantize_dequantize(x, fmt=fmt, rounding=rounding)
                fk.quantize(x, fmt=fmt, scale_layout="swizzled")
            fk.quantize(x, fmt="nvfp4", global_amax=3.0)
            fk.quantize(x, fmt="nvfp4", global_amax=torch.tensor([3.0], device="cuda"))
    fk.requantized_sum(fk.quantize(_tensor(torch, 5, 4096, torch.float32), fmt="mxfp4"))


GROUPS = (16, 32, 256, 1024, 2048, 4096, 8192)


def transform(torch, fk, variants, groups=GROUPS):
    for variant in variants:
        os.environ["FP4_HADAMARD_VARIANT"] = variant  # read at every call
        for g in groups:
            for dtype in (torch.bfloat16, torch.float32):
                # 3 * 8192 elements and one group more: below g = 2048 (where a tile is one
                # group) the last tile is partial, so both the checked and the unchecked
                # (whole-tile) loads and stores run
                x = _tensor(torch, max(3, 3 * 8192 // g) + 1, g, dtype)
                fk.hadamard(x, group_size=g, signs=7)
                fk.hadamard(x, group_size=g, inverse=True)
                for had in (True, False):
                    for rounding in ("nearest", "stochastic"):
                        q = fk.quantize(x, fmt=fk.FP4Quant(g, had), rounding=rounding, seed=3)
                        fk.dequantize(q)
                        fk.dequantize(q, "float32")
        print(variant, "done", flush=True)
    os.environ.pop("FP4_HADAMARD_VARIANT")


def main():
    args = sys.argv[1:]
    groups = GROUPS
    if "--groups" in args:
        at = args.index("--groups")
        groups = tuple(int(g) for g in args[at + 1].split(","))
        del args[at : at + 2]
    which = args[0] if args else "all"
    if which not in ("codec", "transform", "all"):
        sys.exit(f"usage: {sys.argv[0]} [codec|transform|all] [VARIANT ...] [--groups G,G]")
    import torch

    import fp4_kernels as fk
    from fp4_kernels.cuda.launch import launch_policy
    from fp4_kernels.cuda.launch_table import NETWORK_VARIANTS as VARIANTS

    variants = args[1:] or list(VARIANTS)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        sys.exit(f"VARIANT: {', '.join(unknown)} not among {', '.join(VARIANTS)}")

    torch.manual_seed(0)
    with launch_policy(max_blocks=3):
        if which in ("codec", "all"):
            codec(torch, fk)
        if which in ("transform", "all"):
            transform(torch, fk, variants, groups)
    torch.cuda.synchronize()
    print("done", flush=True)


if __name__ == "__main__":
    main()
