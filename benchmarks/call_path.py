"""The host path of a torch CUDA call: the package's source files and the Python function calls
from the public function to ``cuLaunchKernel``, for each op, warm (its plan made), at the first
call of its kind (checks, descriptor, the host function against the caller's context; kernels
compiled), at the second (the same checks, the plans recorded and run) and at the first call
of a new shape of the kind (its plan made from the kind's plan of every shape, compiled at the
kind's first new shape before).

    python benchmarks/call_path.py

Runs anywhere: torch tensors pretend to live on ``cuda:0`` (``tests/_fake_cuda.py``), nothing is
compiled or launched; the counts are cProfile's (builtins and C methods left out).
"""

from __future__ import annotations

import functools
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "packages", "fp4_kernels", "tests"))

import torch  # noqa: E402
from _fake_cuda import Recorder, call_path, fake_cuda  # noqa: E402

import fp4_kernels as fk  # noqa: E402
from fp4_kernels import _plans  # noqa: E402


def _quantized_rows(fmt):
    """A function of a tensor making the arguments of a ``requantized_sum`` of ``fmt`` (with
    ``row_scales`` for "nvfp4-rows"): its first sixteenth of rows (8 of 128), quantized."""

    def prepare(x):
        rows = x.shape[0] // 16
        x = x[:rows].float().contiguous()
        q = fk.quantize(x, fmt="mxfp4" if fmt == "mxfp4" else "nvfp4")
        return (q, torch.rand(rows) + 0.5) if fmt == "nvfp4-rows" else (q,)

    return prepare


def ops():
    """name -> a function of a tensor making the call, or (a function of a tensor making the
    call's arguments, the call): what is counted is the call alone.  Each call is a function of
    our own, since ``call_path`` counts the function it is given aside (the public function,
    given directly, would be left out of its own count)."""
    g64 = fk.FP4Quant(group_size=64)

    def summed(*args):
        return fk.requantized_sum(*args)

    return {
        "quantize nvfp4": lambda x: fk.quantize(x),
        "quantize mxfp4": lambda x: fk.quantize(x, fmt="mxfp4"),
        "quantize_dequantize nvfp4": lambda x: fk.quantize_dequantize(x),
        "quantize fp4quant g64": lambda x: fk.quantize(x, fmt=g64),
        "hadamard g256": lambda x: fk.hadamard(x, group_size=256),
        "requantized_sum mxfp4 8 rows": (_quantized_rows("mxfp4"), summed),
        "requantized_sum nvfp4 8 rows": (_quantized_rows("nvfp4"), summed),
        "requantized_sum nvfp4 row_scales": (_quantized_rows("nvfp4-rows"), summed),
    }


def main():
    torch.set_num_threads(1)
    print(
        f"{'op':34s} {'warm files':>10s} {'calls':>6s} {'first files':>12s} {'calls':>6s} "
        f"{'recording calls':>15s} {'new shape files':>15s} {'calls':>6s}"
    )
    with fake_cuda(Recorder(keep=False)):
        for name, op in ops().items():
            prepare, f = op if isinstance(op, tuple) else ((lambda x: (x,)), op)
            with _plans.disabled():  # the kernels: built, "compiled"
                f(*prepare(torch.randn(64, 256).to(torch.bfloat16)))
            args = prepare(torch.randn(128, 256).to(torch.bfloat16))
            first_calls, first_files = call_path(functools.partial(f, *args))
            recording_calls, _ = call_path(functools.partial(f, *args))
            warm_calls, warm_files = call_path(functools.partial(f, *args))
            # another shape of the kind (its first compiles the kind's plan of every shape)
            f(*prepare(torch.randn(96, 256).to(torch.bfloat16)))
            new = prepare(torch.randn(80, 256).to(torch.bfloat16))
            new_calls, new_files = call_path(functools.partial(f, *new))
            print(
                f"{name:34s} {len(warm_files):10d} {warm_calls:6d} {len(first_files):12d} "
                f"{first_calls:6d} {recording_calls:15d} {len(new_files):15d} {new_calls:6d}"
                f"   warm: {', '.join(warm_files)}"
            )


if __name__ == "__main__":
    main()
