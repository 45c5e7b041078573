"""fp4_train.fp4_gemm on the GPU against torch's bf16 GEMM measured in the same run.

    python benchmarks/gemm_throughput.py [--sizes 4096 8192 16384] [--out DIR] [--device-alpha]

For each size n (M = N = K = n): the bf16 GEMM ``torch.mm(a, b.T)`` (bf16 out, the baseline),
the same GEMM with a float32 result (``out_dtype=torch.float32``, what the exact path runs),
and ``fp4_gemm`` on NVFP4 operands by the exact path (decode both operands to bf16 without
their tensor scales, the bf16 GEMM with float32 output, alpha applied once) with a float32 and
a bf16 result, plus the two decodes alone; with ``--device-alpha`` also the exact path with
alpha applied inside one cuBLASLt bf16 GEMM (``bf16_gemm_device_alpha``, no separate pass over
the result; experimental, so best run as a process of its own).  Device time: each call
captured in a CUDA graph, 10 replays back to back between two CUDA events a sample
(``_timing.graph_time_ms``), median of 15 samples after warm-up, inputs rotated among 3 buffer
sets; eager CUDA-event medians
beside them.  The native cuBLASLt FP4 path runs where the device has FP4 tensor cores (compute
capability >= 10.0) and is recorded as unavailable elsewhere.  Writes ``gemm_throughput.json``
and ``gemm_throughput.md`` (device, commit, date) to ``--out`` (default $OUT or .).  The commit
is ``git rev-parse`` or, where there is no .git, the ``FP4_COMMIT`` environment variable.
"""

from __future__ import annotations

import argparse
import os
import sys

try:  # imported as part of the benchmarks package
    from . import _timing
except ImportError:  # run as a script
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _timing

TARGET_RATIO = 1.15  # the aim: the exact path within 1.15x the bf16 GEMM at 8192^3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument(
        "--device-alpha",
        action="store_true",
        help="also time the experimental exact path with alpha inside one cuBLASLt bf16 GEMM "
        "(nvmath-python); run it as a process of its own, after the main run",
    )
    args = ap.parse_args()
    import torch

    import fp4_kernels
    from fp4_train.gemm import NativeGemmUnavailable, fp4_gemm, native_supported
    from fp4_train.gemm._exact import _without_tensor_scale

    dev = torch.device("cuda")
    cc = torch.cuda.get_device_capability(dev)
    torch.manual_seed(0)
    rows = []
    for n in args.sizes:
        a = [torch.randn(n, n, device=dev, dtype=torch.bfloat16) for _ in range(_timing.ROTATE)]
        b = [torch.randn(n, n, device=dev, dtype=torch.bfloat16) for _ in range(_timing.ROTATE)]
        qa = [fp4_kernels.quantize(x, fmt="nvfp4") for x in a]
        qb = [fp4_kernels.quantize(x, fmt="nvfp4") for x in b]
        pairs = list(zip(a, b, strict=True))
        qpairs = list(zip(qa, qb, strict=True))
        flop = 2.0 * n**3

        def decode_both(x, y):
            fp4_kernels.dequantize(_without_tensor_scale(x, "torch"), dtype=torch.bfloat16)
            fp4_kernels.dequantize(_without_tensor_scale(y, "torch"), dtype=torch.bfloat16)

        ops = {
            "bf16_gemm": (lambda x, y: torch.mm(x, y.t()), pairs),
            "bf16_gemm_fp32_out": (
                lambda x, y: torch.mm(x, y.t(), out_dtype=torch.float32),
                pairs,
            ),
            "fp4_exact_fp32_out": (lambda x, y: fp4_gemm(x, y, backend="exact"), qpairs),
            "fp4_exact_bf16_out": (
                lambda x, y: fp4_gemm(x, y, backend="exact", out_dtype="bfloat16"),
                qpairs,
            ),
            "decode_both_operands": (decode_both, qpairs),
        }
        if args.device_alpha:  # experimental: alpha inside one cuBLASLt bf16 GEMM (nvmath)
            from fp4_train.gemm._cublaslt import bf16_gemm_device_alpha

            def exact_lt(x, y, out_dtype):
                x1 = fp4_kernels.dequantize(_without_tensor_scale(x, "torch"), dtype=torch.bfloat16)
                y1 = fp4_kernels.dequantize(_without_tensor_scale(y, "torch"), dtype=torch.bfloat16)
                return bf16_gemm_device_alpha(x1, y1, x.global_scale * y.global_scale, out_dtype)

            ops["fp4_exact_cublaslt_alpha_fp32_out"] = (
                lambda x, y: exact_lt(x, y, "float32"),
                qpairs,
            )
            ops["fp4_exact_cublaslt_alpha_bf16_out"] = (
                lambda x, y: exact_lt(x, y, "bfloat16"),
                qpairs,
            )
        try:
            torch.mm(a[0][:16, :16], b[0][:16, :16].t(), out_dtype=torch.float32)
        except TypeError:  # torch before 2.8: fp4_gemm falls back to a float32 GEMM
            print(f"torch {torch.__version__}: mm has no out_dtype", flush=True)
            del ops["bf16_gemm_fp32_out"]
        row = {"n": n, "ms": {}, "eager_ms": {}, "tflops": {}}
        for name, (fn, arg_list) in ops.items():
            med, lo, hi = _timing.graph_time_ms(fn, arg_list)
            eager, _, _ = _timing.cuda_time_ms(fn, arg_list)
            row["ms"][name] = {"median": med, "min": lo, "max": hi}
            row["eager_ms"][name] = eager
            row["tflops"][name] = flop / med / 1e9
        if native_supported(dev):
            sq = [
                (
                    fp4_kernels.quantize(x, scale_layout="swizzled"),
                    fp4_kernels.quantize(y, scale_layout="swizzled"),
                )
                for x, y in pairs
            ]
            try:
                med, lo, hi = _timing.graph_time_ms(
                    lambda x, y: fp4_gemm(x, y, backend="native"), sq
                )
                row["ms"]["fp4_native_fp32_out"] = {"median": med, "min": lo, "max": hi}
                row["tflops"]["fp4_native_fp32_out"] = flop / med / 1e9
            except NativeGemmUnavailable as e:
                row["native"] = f"unavailable: {e}"
        else:
            row["native"] = f"unavailable: compute capability {cc[0]}.{cc[1]} < 10.0"
        base = row["ms"]["bf16_gemm"]["median"]
        row["ratio_to_bf16_gemm"] = {k: v["median"] / base for k, v in row["ms"].items()}
        rows.append(row)
        print(
            f"n={n}: bf16 {base:.3f} ms; exact fp32-out "
            f"{row['ratio_to_bf16_gemm']['fp4_exact_fp32_out']:.3f}x, bf16-out "
            f"{row['ratio_to_bf16_gemm']['fp4_exact_bf16_out']:.3f}x",
            flush=True,
        )
        del a, b, qa, qb, pairs, qpairs
        torch.cuda.empty_cache()

    meta = _timing.run_meta(
        compute_capability=f"{cc[0]}.{cc[1]}",
        method=f"CUDA-graph replays, {_timing.CHAIN} back to back between CUDA events a sample, "
        "median of 15, 3 rotating input sets",
        target=f"fp4_exact <= {TARGET_RATIO}x bf16_gemm at 8192^3",
    )
    _timing.write_json(args.out, "gemm_throughput", {"meta": meta, "results": rows}, indent=2)
    lines = [
        f"# fp4_gemm vs bf16 GEMM: {meta['device']} (cc {meta['compute_capability']}), "
        f"commit {meta['commit']}, {meta['date']}",
        "",
        "| n = M = N = K | bf16 GEMM ms | bf16 GEMM, fp32 out | exact, fp32 out | "
        "exact, bf16 out | cuBLASLt alpha, fp32 out | cuBLASLt alpha, bf16 out | decode both "
        "| native |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        ratio = r["ratio_to_bf16_gemm"]
        native = (
            f"{ratio['fp4_native_fp32_out']:.3f}x"
            if "fp4_native_fp32_out" in ratio
            else r.get("native", "")
        )
        lines.append(
            f"| {r['n']} | {r['ms']['bf16_gemm']['median']:.3f} "
            f"| {ratio.get('bf16_gemm_fp32_out', float('nan')):.3f}x "
            f"| {ratio['fp4_exact_fp32_out']:.3f}x "
            f"| {ratio['fp4_exact_bf16_out']:.3f}x "
            f"| {ratio.get('fp4_exact_cublaslt_alpha_fp32_out', float('nan')):.3f}x "
            f"| {ratio.get('fp4_exact_cublaslt_alpha_bf16_out', float('nan')):.3f}x "
            f"| {ratio['decode_both_operands']:.3f}x "
            f"| {native} |"
        )
    _timing.write_markdown(args.out, "gemm_throughput", lines, echo=True)


if __name__ == "__main__":
    main()
