"""Walsh–Hadamard transform and FP4Quant codec on the GPU, as multiples of a D2D copy of the same
tensor timed in the same run, beside the peers.

    python benchmarks/hadamard_throughput.py [--log2n 28] [--out DIR] [--fht-loader FILE]
        [--groups 16,32,...] [--variants smem,smem-pf,shfl] [--no-fp4quant]

Every op is timed on a bf16 tensor of 2^log2n elements (rows of 8192): CUDA-graph replays,
``CHAIN`` of them back to back between two CUDA events, median of 15 such samples
(``_timing.graph_time_ms``), inputs rotating among buffers larger than the L2.
``ratio_to_copy`` = op time / time of ``dst.copy_(x)`` for the same tensor, timed the same way
(the faster of eager and graph-replayed calls: a graph may run the memcpy on a copy engine,
slower).

Peers: a torch bf16 matmul by the (normalized) Hadamard matrix (tensor cores), and Dao-AILab's
fast-hadamard-transform when ``--fht-loader`` names a Python file whose ``load()`` returns its
``hadamard_transform(x, scale)`` (built on the machine for sm_90; its code is not part of this
repository).  Host time per call is measured on a 64 x 1024 tensor.  Writes
``hadamard_throughput.json`` / ``.md`` (device, commit, date) to ``--out``.

The transform kernel has variants (``fp4_kernels.cuda.launch_table.NETWORK_VARIANTS``; all give
the same bits): ``smem-pf`` (the default: lane stages through shared-memory transposes, the next
tile's loads issued before this tile's butterflies), ``smem`` (the same without the early
loads), ``smem16`` (``smem`` at g = 16 too; the others keep the shuffle kernel there) and
``shfl`` (lane stages by warp shuffles).  FP4Quant follows the variant (``shfl`` or the
shared-memory network, with the early loads under ``smem-pf``).  The environment variable
``FP4_HADAMARD_VARIANT`` picks the one every call uses; ``--variants`` times the transform rows
once per listed variant in the same run (op names get ``[variant]``).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys

import fp4_kernels as fk

try:  # imported by asv as part of the benchmarks package
    from . import _timing
except ImportError:  # run as a script
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _timing

GROUP_SIZES = [16 << i for i in range(10)]  # 16 ... 8192
K = 8192


def _load_fht(path):
    if not path:
        return None
    spec = importlib.util.spec_from_file_location("fht_loader", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.load()


def main():
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=__doc__.split("\n\n")[-1],  # the kernel variants
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--log2n", type=int, default=28)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--fht-loader", default=None, help="file with load() -> hadamard_transform")
    ap.add_argument("--groups", default=",".join(map(str, GROUP_SIZES)))
    ap.add_argument(
        "--variants",
        default="",
        help="comma-separated transform kernel variants to time each (default: only the one "
        "FP4_HADAMARD_VARIANT names, or the default; see "
        "fp4_kernels.cuda.launch_table.NETWORK_VARIANTS)",
    )
    ap.add_argument("--no-fp4quant", action="store_true", help="time the transform rows only")
    args = ap.parse_args()
    import scipy.linalg
    import torch

    groups = [int(g) for g in args.groups.split(",")]
    n = 1 << args.log2n
    dev = torch.device("cuda")
    torch.manual_seed(0)
    xs = [torch.randn(n // K, K, device=dev, dtype=torch.bfloat16) for _ in range(_timing.ROTATE)]
    dst = torch.empty_like(xs[0])
    # The baseline is the faster of the copy launched eagerly and replayed from a CUDA graph:
    # in a graph a D2D memcpy may run on a copy engine at ~2.7 TB/s instead of ~4.2 with SMs.
    copy_args = [(x,) for x in xs]
    copy_graph_ms, _, _ = _timing.graph_time_ms(lambda x: dst.copy_(x), copy_args)
    copy_eager_ms, _, _ = _timing.cuda_time_ms(
        lambda x: dst.copy_(x), copy_args, chain=_timing.CHAIN
    )
    copy_ms = min(copy_graph_ms, copy_eager_ms)
    print(
        f"copy bf16 {n} elements: {copy_ms:.3f} ms ({4 * n / copy_ms / 1e6:.0f} GB/s; "
        f"graph {copy_graph_ms:.3f} ms, eager {copy_eager_ms:.3f} ms)"
    )
    small = torch.randn(64, 1024, device=dev, dtype=torch.bfloat16)
    fht = _load_fht(args.fht_loader)
    results = []

    def record(op, g, fn, small_fn=None, inputs=None, small_input=None):
        """Time ``fn`` on each of ``inputs`` (default: the bf16 tensors) in rotation; host time
        of ``small_fn`` on ``small_input`` (default: the 64 x 1024 tensor) where g divides it."""
        inputs = xs if inputs is None else inputs
        small_input = small if small_input is None else small_input
        try:
            med, lo, hi = _timing.graph_time_ms(fn, [(x,) for x in inputs])
            one, _, _ = _timing.graph_time_ms(fn, [(x,) for x in inputs], chain=1)
            eager, _, _ = _timing.cuda_time_ms(fn, [(x,) for x in inputs])
        except Exception as e:  # a peer that cannot run this size: say so, keep going
            print(f"{op:40s} g={g:5d}  failed: {type(e).__name__}: {e}", flush=True)
            results.append({"op": op, "group_size": g, "error": f"{type(e).__name__}: {e}"})
            return
        row = {
            "op": op,
            "group_size": g,
            "elements": n,
            "median_ms": med,
            "min_ms": lo,
            "max_ms": hi,
            "eager_ms": eager,
            "one_replay_ms": one,
            "ratio_to_copy": med / copy_ms,
        }
        if small_fn is not None and small.shape[-1] % g == 0:
            row["host_us_per_call"] = _timing.host_time_us(small_fn, (small_input,))
        results.append(row)
        print(
            f"{op:40s} g={g:5d} {med:8.3f} ms  {med / copy_ms:6.2f} x copy  (one replay a "
            f"sample: {one / copy_ms:.2f})"
            + (f"  host {row['host_us_per_call']:.0f} us" if "host_us_per_call" in row else ""),
            flush=True,
        )

    from fp4_kernels.cuda import launch

    chosen = os.environ.get("FP4_HADAMARD_VARIANT")
    variants = [v for v in args.variants.split(",") if v] or [launch.network_variant()]
    for g in groups:
        for v in variants:
            os.environ["FP4_HADAMARD_VARIANT"] = v  # read at every call (and graph capture)
            tag = f" [{v}]" if args.variants else ""
            f = lambda x, g=g: fk.hadamard(x, group_size=g)  # noqa: E731
            record(f"fp4_kernels.hadamard{tag}", g, f, small_fn=f)
            f = lambda x, g=g: fk.hadamard(x, group_size=g, signs=1234)  # noqa: E731
            record(f"fp4_kernels.hadamard signs{tag}", g, f)
        if chosen is None:
            os.environ.pop("FP4_HADAMARD_VARIANT")
        else:
            os.environ["FP4_HADAMARD_VARIANT"] = chosen
        hm = torch.tensor(scipy.linalg.hadamard(g) / math.sqrt(g), dtype=torch.bfloat16, device=dev)
        f = lambda x, g=g, hm=hm: x.view(-1, g) @ hm  # noqa: E731
        record("torch bf16 matmul by H", g, f, small_fn=f)
        if fht is not None:
            f = lambda x, g=g: fht(x.view(-1, g), 1 / math.sqrt(g))  # noqa: E731
            record("fast-hadamard-transform", g, f, small_fn=f)
    for g in [] if args.no_fp4quant else groups:
        for had in (True, False):
            if not had and g not in (16, 64, 256, 1024):
                continue
            fmt = fk.FP4Quant(g, had)
            enc = lambda x, fmt=fmt: fk.quantize(x, fmt=fmt)  # noqa: E731
            record(f"FP4Quant encode{'' if had else ' no-hadamard'}", g, enc, small_fn=enc)
            qs = [fk.quantize(x, fmt=fmt) for x in xs]
            qsmall = fk.quantize(small, fmt=fmt) if small.shape[-1] % g == 0 else None
            dec = lambda q: fk.dequantize(q)  # noqa: E731
            op = f"FP4Quant decode{'' if had else ' no-hadamard'}"
            record(op, g, dec, small_fn=dec, inputs=qs, small_input=qsmall)
            del qs
        if g == 64:
            fmt = fk.FP4Quant(64)
            f = lambda x, fmt=fmt: fk.quantize(x, fmt=fmt, rounding="stochastic")  # noqa: E731
            record("FP4Quant encode stochastic", g, f)
    f = lambda x: fk.quantize(x, fmt="nvfp4", global_amax=4.5)  # noqa: E731
    record("NVFP4 quantize (context)", 16, f)

    meta = _timing.run_meta(
        elements=n,
        dtype="bfloat16",
        row_length=K,
        copy_ms=copy_ms,
        copy_graph_ms=copy_graph_ms,
        copy_eager_ms=copy_eager_ms,
        copy_gbps=4 * n / copy_ms / 1e6,
        fast_hadamard_transform=fht is not None,
        hadamard_variants=variants,
    )
    _timing.write_json(args.out, "hadamard_throughput", {"meta": meta, "results": results})
    lines = [
        f"# Hadamard / FP4Quant throughput: {meta['device']}, commit {meta['commit']}, "
        f"{meta['date']}",
        "",
        f"2^{args.log2n} bf16 elements; copy of the same tensor {copy_ms:.3f} ms "
        f"({meta['copy_gbps']:.0f} GB/s).",
        "",
        "| op | g | ms | x copy | x copy, one replay a sample | host us/call |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['op']} | {r['group_size']} | failed | | | |")
            continue
        host = f"{r['host_us_per_call']:.0f}" if "host_us_per_call" in r else ""
        lines.append(
            f"| {r['op']} | {r['group_size']} | {r['median_ms']:.3f} | "
            f"{r['ratio_to_copy']:.2f} | {r['one_replay_ms'] / copy_ms:.2f} | {host} |"
        )
    _timing.write_markdown(args.out, "hadamard_throughput", lines)


if __name__ == "__main__":
    main()
