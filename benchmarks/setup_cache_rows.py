"""Print the figures of asv GPU classes without asv: each class's ``setup_cache`` (every
parameter combination, measured in this one process), one line a combination.

    python -m benchmarks.setup_cache_rows bench_reduce:RequantizedSumGPU \
        bench_quantize:QuantizeDequantizeGPU bench_hadamard:FP4QuantEncodeGPU

From the repository root, with the packages importable.  ``ratio_to_copy`` is the row's
``bytes`` over its time, over the D2D copy's GB/s of the same class: the ``track_ratio_to_copy``
of the bandwidth classes (quantize, dequantize, requantized_sum); the Hadamard and FP4Quant
classes report time over the time of copying their input instead, which is
``1 / (2 ratio_to_copy)`` (their ``bytes`` are the input's).
"""

from __future__ import annotations

import argparse
import importlib
import time


def rows(spec: str) -> list[str]:
    """The lines of one ``module:Class`` (``module`` in this folder)."""
    module, name = spec.split(":")
    start = time.time()
    cache = getattr(importlib.import_module(f"benchmarks.{module}"), name)().setup_cache()
    if "skip" in cache:
        return [f"== {spec}: skipped: {cache['skip']}"]
    copy = cache["copy_gbps"]
    out = [f"== {spec} copy {copy:.0f} GB/s ({time.time() - start:.0f} s)"]
    for params, row in cache["rows"].items():
        figures = {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}
        ratio = ""
        if "bytes" in row and "ms" in row:
            ratio = f"  ratio_to_copy={row['bytes'] / row['ms'] / 1e6 / copy:.3f}"
        out.append(f"  {params} {figures}{ratio}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("classes", nargs="+", help="module:Class, e.g. bench_reduce:RequantizedSumGPU")
    for spec in ap.parse_args().classes:
        print("\n".join(rows(spec)), flush=True)


if __name__ == "__main__":
    main()
