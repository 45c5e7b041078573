"""Run tp_train.py under torchrun once per communication configuration, then tp_summary.py.

    cd packages/fp4_train/examples
    python tp_sweep.py --preset cpu-smoke --out ../../../docs/results/tp_cpu_smoke
    python tp_sweep.py --preset h200 --out ../../../docs/results/tp_h200

A preset is a model / schedule (the arguments every run shares) and a list of configurations;
arguments after ``--`` are added to every run (they override the preset's).  Runs whose JSON
already exists in ``--out`` are skipped (``--force`` reruns them), so an interrupted sweep
resumes.  ``--budget-s`` stops starting runs once the next one (estimated from the longest
run so far) would end past the budget; the runs left out are printed, so a sweep split over
several sessions says what it did not run.  ``--order`` runs the named runs first.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# (name, extra arguments).  "native": torch.distributed's own all-reduce (NCCL on GPUs) in the
# compute dtype; "bf16": bfloat16 values through fp4_comm's path, the baseline of the table,
# twice, with two seeds, for the seed noise.
CODECS = [
    ("tp_native_s0", ["--codec", "native"]),
    ("tp_bf16_s0", ["--codec", "none"]),
    ("tp_bf16_s1", ["--codec", "none", "--seed", "1"]),
    ("tp_nvfp4_s0", ["--codec", "nvfp4"]),
    ("tp_mxfp4_s0", ["--codec", "mxfp4"]),
    ("tp_fp4quant-g64_s0", ["--codec", "fp4quant", "--group-size", "64"]),
    ("tp_fp4quant-g64-nohad_s0", ["--codec", "fp4quant", "--group-size", "64", "--no-hadamard"]),
    ("tp_fp4quant-g256_s0", ["--codec", "fp4quant", "--group-size", "256"]),
    ("tp_fp4quant-g256-nohad_s0", ["--codec", "fp4quant", "--group-size", "256", "--no-hadamard"]),
]
# Stochastic rounding draws new words every step and the pipeline is not captured: these run
# eagerly (their step time then includes the collectives' host time; see the table's notes).
EAGER = ["--no-cuda-graph"]
# the pushes of the issue: can stochastic rounding or error feedback close the gap?
PUSHES = [
    ("tp_fp4quant-g256_sr_s0",
     ["--codec", "fp4quant", "--group-size", "256", "--rounding", "stochastic", *EAGER]),
    ("tp_fp4quant-g256_ef_s0", ["--codec", "fp4quant", "--group-size", "256", "--error-feedback"]),
    ("tp_fp4quant-g512_s0", ["--codec", "fp4quant", "--group-size", "512"]),
    ("tp_nvfp4_sr_s0", ["--codec", "nvfp4", "--rounding", "stochastic", *EAGER]),
    ("tp-sp_fp4quant-g64_s0",
     ["--codec", "fp4quant", "--group-size", "64", "--sequence-parallel"]),
    ("pp_bf16_s0", ["--codec", "none", "--parallel", "pp", *EAGER]),
    ("pp_fp4quant-g64_s0",
     ["--codec", "fp4quant", "--group-size", "64", "--parallel", "pp", *EAGER]),
]  # fmt: skip

PRESETS = {
    # 2 CPU cores, gloo: a smoke study (tokens/s mean nothing for GPUs; losses show the codec)
    "cpu-smoke": {
        "common": ["--device", "cpu", "--layers", "2", "--d-model", "64", "--heads", "2",
                   "--seq-len", "64", "--batch", "8", "--steps", "300", "--lr", "3e-3",
                   "--eval-every", "50", "--eval-batches", "8"],
        "runs": CODECS + PUSHES[:1],
    },
    # 2 x H200, NCCL through fp4_comm: 8 layers of d 1024 (~100M parameters), 16k tokens a
    # step (each all-reduce: 16M bf16 values, 32 MB); 1000 steps are ~11 passes over the
    # Jargon File's 1.5 MB training split
    "h200": {
        "common": ["--device", "cuda", "--layers", "8", "--d-model", "1024", "--heads", "16",
                   "--seq-len", "1024", "--batch", "16", "--steps", "1000", "--lr", "6e-4",
                   "--eval-every", "100", "--eval-batches", "16", "--cuda-graph"],
        "runs": CODECS + PUSHES,
    },
}  # fmt: skip


def main():
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu-smoke")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--only", nargs="*", help="run names to run (default: the preset's all)")
    ap.add_argument("--force", action="store_true", help="rerun runs whose JSON exists")
    ap.add_argument("--no-summary", action="store_true", help="skip tp_summary.py (matplotlib)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no run that would end past this many seconds (estimate: the "
                         "longest run so far)")  # fmt: skip
    ap.add_argument("--order", nargs="*", default=[], help="run these names first, in this order")
    args = ap.parse_args(argv)
    preset = PRESETS[args.preset]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    runs = [r for r in preset["runs"] if not args.only or r[0] in args.only]
    rank = {name: i for i, name in enumerate(args.order)}
    runs.sort(key=lambda r: rank.get(r[0], len(rank)))  # stable: the preset's order otherwise
    t_start, longest, left_out, failed = time.monotonic(), 0.0, [], []
    for name, run_args in runs:
        if (args.out / f"{name}.json").exists() and not args.force:
            print(f"{name}: done already", flush=True)
            continue
        elapsed = time.monotonic() - t_start
        if args.budget_s is not None and elapsed + longest > args.budget_s:
            left_out.append(name)
            continue
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={args.nproc}", str(HERE / "tp_train.py"), *preset["common"],
               *run_args, *extra, "--name", name, "--out", str(args.out)]  # fmt: skip
        print(" ".join(cmd[1:]), flush=True)
        t0 = time.monotonic()
        rc = subprocess.run(cmd, env=env).returncode
        longest = max(longest, time.monotonic() - t0)
        print(f"{name}: {time.monotonic() - t0:.0f} s, exit status {rc}", flush=True)
        if rc:
            failed.append(name)  # the other runs still go: one bad configuration costs one run
    if left_out:
        print(f"not run (budget {args.budget_s:.0f} s): {' '.join(left_out)}", flush=True)
    if failed:
        sys.exit(f"failed: {' '.join(failed)}")
    if not args.no_summary:
        subprocess.run([sys.executable, str(HERE / "tp_summary.py"), str(args.out)], check=True)


if __name__ == "__main__":
    main()
