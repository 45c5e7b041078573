"""Run ``tp_train`` under torchrun once per configuration of a preset, then ``tp_summary``.

    python -m fp4_train.experiments.tp_sweep --preset cpu-smoke --out docs/results/tp_cpu_smoke
    python -m fp4_train.experiments.tp_sweep --preset h200 --out docs/results/tp_h200

A preset is a model / schedule (the arguments every run shares) and a list of configurations,
each run once per seed of the preset; arguments after ``--`` are added to every run (they
override the preset's).  Runs whose JSON already exists in ``--out`` are skipped (``--force``
reruns them), so an interrupted sweep resumes.  ``--budget-s`` stops starting runs once the
next one (estimated from the longest run so far) would end past the budget; the runs left
out are printed, so a sweep split over several jobs says what it did not run.
``--order`` runs the named runs first; ``--seeds`` replaces the preset's seeds.  ``--list``
prints the runs and their command lines without running anything.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from .records import find_record, unusable_path

# (name, extra arguments).  "native": torch.distributed's own all-reduce (NCCL on GPUs) in the
# compute dtype; "bf16": bfloat16 values through fp4_comm's path.
CODECS = [
    ("tp_native", ["--codec", "native"]),
    ("tp_bf16", ["--codec", "none"]),
    ("tp_nvfp4", ["--codec", "nvfp4"]),
    ("tp_mxfp4", ["--codec", "mxfp4"]),
    ("tp_fp4quant-g64", ["--codec", "fp4quant-g64"]),
    ("tp_fp4quant-g64-nohad", ["--codec", "fp4quant-g64-nohad"]),
    ("tp_fp4quant-g256", ["--codec", "fp4quant-g256"]),
    ("tp_fp4quant-g256-nohad", ["--codec", "fp4quant-g256-nohad"]),
]
# Stochastic rounding draws new words every step and the pipeline is not captured: these run
# eagerly (their step time then includes the collectives' host time).
EAGER = ["--no-cuda-graph"]
# As measured in the first H200 study: every gradient nearest (the default before the
# residual stream's gradient became stochastic).
NEAREST = ["--grad-rounding", "nearest"]
PUSHES = [
    ("tp_fp4quant-g256_sr",
     ["--codec", "fp4quant-g256", "--rounding", "stochastic", *EAGER]),
    ("tp_fp4quant-g256_ef", ["--codec", "fp4quant-g256", "--error-feedback"]),
    ("tp_fp4quant-g512", ["--codec", "fp4quant-g512"]),
    ("tp_nvfp4_sr", ["--codec", "nvfp4", "--rounding", "stochastic", *EAGER]),
    ("tp-sp_fp4quant-g64", ["--codec", "fp4quant-g64", "--sequence-parallel", *NEAREST]),
    ("pp_bf16", ["--codec", "none", "--parallel", "pp", *EAGER]),
    ("pp_fp4quant-g64", ["--codec", "fp4quant-g64", "--parallel", "pp", *NEAREST, *EAGER]),
]  # fmt: skip

# The decomposition of the pipeline boundary and of sequence parallelism: which direction
# (the residual stream forward, its gradient backward) and which rounding costs the loss.
# FP4Quant g = 64 wherever a direction is quantized; "bf16": that direction in bfloat16.
G64 = "fp4quant-g64"
PP = ["--parallel", "pp"]
SP = ["--sequence-parallel"]
BOUNDARY = [
    ("pp_bf16", [*PP, "--codec", "none", "--eval-codecs", "none-float32", G64]),
    ("pp_fwd-rn", [*PP, "--codec", G64, "--grad-codec", "none"]),
    ("pp_bwd-rn", [*PP, "--codec", "none", "--grad-codec", G64, "--grad-rounding", "nearest"]),
    ("pp_bwd-sr", [*PP, "--codec", "none", "--grad-codec", G64, "--grad-rounding", "stochastic"]),
    ("pp_fwd-rn_bwd-rn", [*PP, "--codec", G64, "--grad-rounding", "nearest"]),
    ("pp_fwd-rn_bwd-sr", [*PP, "--codec", G64, "--grad-rounding", "stochastic"]),
    ("pp_fwd-sr_bwd-sr", [*PP, "--codec", G64, "--rounding", "stochastic",
                          "--grad-rounding", "stochastic"]),
    ("sp_bf16", [*SP, "--codec", "none", "--eval-codecs", "none-float32", G64]),
    ("sp_fwd-rn", [*SP, "--codec", G64, "--grad-codec", "none"]),
    ("sp_bwd-rn", [*SP, "--codec", "none", "--grad-codec", G64, "--grad-rounding", "nearest"]),
    ("sp_fwd-rn_bwd-rn", [*SP, "--codec", G64, "--grad-rounding", "nearest"]),
    # the default: the residual stream's gradient (all-gather) stochastic, the summed
    # gradients (reduce-scatter) nearest
    ("sp_fwd-rn_bwd-sr", [*SP, "--codec", G64]),
]  # fmt: skip
BOUNDARY_TP = [
    # plain TP: the block outputs' all-reduce forward, the block inputs' gradient all-reduce
    # backward (nearest by default)
    ("tp_bf16", ["--codec", "none", "--eval-codecs", "none-float32", G64]),
    ("tp_fwd-rn", ["--codec", G64, "--grad-codec", "none"]),
    ("tp_bwd-rn", ["--codec", "none", "--grad-codec", G64, "--grad-rounding", "nearest"]),
    ("tp_bwd-sr", ["--codec", "none", "--grad-codec", G64, "--grad-rounding", "stochastic"]),
    ("tp_fwd-rn_bwd-rn", ["--codec", G64]),
    ("tp_fwd-rn_bwd-sr", ["--codec", G64, "--grad-rounding", "stochastic"]),
]  # fmt: skip


def forward_lever(label, codec):
    """The pipeline run whose boundary sends ``codec`` forward, the backward fixed (FP4Quant
    g = 64, stochastic)."""
    argv = [*PP, "--codec", codec, "--grad-codec", G64, "--grad-rounding", "stochastic"]
    return (f"pp_fwd-{label}_bwd-sr", argv)


# The forward levers once the backward is fixed.
FORWARD_LEVERS = [
    forward_lever(label, codec)
    for label, codec in (("g16", "fp4quant-g16"), ("nvfp4", "nvfp4"), ("g64-nohad",
                                                                       "fp4quant-g64-nohad"))
]  # fmt: skip
# The pipeline boundary's forward codec at the CPU size, the gradient at the default
# (FP4Quant g = 64, stochastic): the levers above, MXFP4, and TAH-Quant both ways (its
# activation codec on tokens of d = 128 forward, its 6-bit gradient codec backward, both
# nearest: its only rounding) and forward only (which of its two directions grows the
# residual stream); with the bf16 baseline and the default to pair with.
CPU_LEVERS = [
    BOUNDARY[0],
    ("pp_fwd-g64_bwd-sr", [*PP, "--codec", G64, "--grad-rounding", "stochastic"]),
    *FORWARD_LEVERS,
    forward_lever("mxfp4", "mxfp4"),
    ("pp_fwd-tahquant_bwd-tahquant", [*PP, "--codec", "tahquant-h128",
                                      "--grad-codec", "tahquant-grad", "--grad-rounding",
                                      "nearest"]),
    forward_lever("tahquant", "tahquant-h128"),
]  # fmt: skip

# fmt: off
# The H200 model: 8 layers of d 1024 (~100M parameters), 16k tokens a step (each TP
# all-reduce: 16M bf16 values, 32 MB).
H200 = ["--device", "cuda", "--layers", "8", "--d-model", "1024", "--heads", "16",
        "--seq-len", "1024", "--batch", "16", "--lr", "6e-4", "--eval-batches", "16"]
# ~1.2B parameters (24 layers of d 2048) on 2 GPUs, 8k tokens a step
H200_1B = ["--device", "cuda", "--layers", "24", "--d-model", "2048", "--heads", "16",
           "--seq-len", "1024", "--batch", "8", "--lr", "3e-4", "--eval-batches", "16"]
# The CPU configuration of the decomposition: 4 layers of d 128, 1k tokens a step.
CPU_BOUNDARY = ["--device", "cpu", "--layers", "4", "--d-model", "128", "--heads", "4",
                "--seq-len", "64", "--batch", "16", "--steps", "600", "--lr", "3e-3",
                "--eval-every", "100", "--eval-batches", "8", "--stats-every", "10"]
# fmt: on

PRESETS = {
    # 2 CPU cores, gloo: a smoke study (tokens/s mean nothing for GPUs; losses show the codec)
    "cpu-smoke": {
        "common": ["--device", "cpu", "--layers", "2", "--d-model", "64", "--heads", "2",
                   "--seq-len", "64", "--batch", "8", "--steps", "300", "--lr", "3e-3",
                   "--eval-every", "50", "--eval-batches", "8"],
        "runs": [*CODECS[:2], ("tp_bf16", ["--codec", "none"], [1]), *CODECS[2:], *PUSHES[:1]],
        "seeds": [0],
    },
    # the first H200 study (one seed; 1000 steps here, 500 were run): the Jargon File repeats
    "h200": {
        "common": [*H200, "--steps", "1000", "--eval-every", "100", "--cuda-graph"],
        "runs": [*CODECS[:2], ("tp_bf16", ["--codec", "none"], [1]), *CODECS[2:], *PUSHES],
        "seeds": [0],
    },
    "cpu-boundary": {"common": CPU_BOUNDARY, "runs": BOUNDARY + BOUNDARY_TP, "seeds": [0, 1, 2]},
    # eight seeds: the codecs' differences are a few thousandths here
    "cpu-levers": {"common": CPU_BOUNDARY, "runs": CPU_LEVERS, "seeds": list(range(8))},
    "h200-boundary": {
        "common": [*H200, "--steps", "2000", "--eval-every", "250", *EAGER],
        "runs": BOUNDARY + FORWARD_LEVERS,
        "seeds": [0, 1, 2],
    },
    # tensor-parallel robustness: 3 seeds, 2000 steps (33M tokens: pass a corpus of more
    # than 33 MB with --data, or it repeats)
    "h200-tp": {
        "common": [*H200, "--steps", "2000", "--eval-every", "250", "--cuda-graph"],
        "runs": [CODECS[0], CODECS[1], CODECS[2], CODECS[3], CODECS[4], CODECS[6]],
        "seeds": [0, 1, 2],
    },
    "h200-1b": {
        "common": [*H200_1B, "--steps", "2000", "--eval-every", "250", "--cuda-graph"],
        "runs": [CODECS[0], CODECS[1], CODECS[3], CODECS[4], CODECS[6]],
        "seeds": [0],
    },
}  # fmt: skip


def expand(preset, seeds=None):
    """[(name, args)] of a preset: each configuration once per seed (its own seeds first)."""
    runs = []
    for entry in preset["runs"]:
        stem, run_args = entry[0], entry[1]
        for seed in entry[2] if len(entry) > 2 else (seeds or preset["seeds"]):
            runs.append((f"{stem}_s{seed}", [*run_args, "--seed", str(seed)]))
    return runs


def command(preset, name, run_args, extra, out, nproc):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "-m", "fp4_train.experiments.tp_train",
            *preset["common"], *run_args, *extra, "--name", name, "--out", str(out)]  # fmt: skip


def check_args(ap, args, names):
    """``ap.error`` naming the option where the arguments cannot mean what they say;
    ``names``: the runs of the preset with its seeds."""
    from .tp_train import check_seeds

    if args.nproc < 1:
        ap.error(f"--nproc {args.nproc}: at least 1")
    if args.budget_s is not None and not (math.isfinite(args.budget_s) and args.budget_s > 0):
        ap.error(f"--budget-s {args.budget_s}: a finite number of seconds > 0")
    check_seeds(ap, args.seeds)
    if args.only == []:  # (a bare --only: no run named, not every run)
        ap.error("--only: name at least one run (--list names them), or leave it out to run "
                 "the preset's all")  # fmt: skip
    for option, given in (("--only", args.only), ("--order", args.order)):
        unknown = sorted(set(given or ()) - names)
        if unknown:
            ap.error(f"{option} {' '.join(unknown)}: not a run of --preset {args.preset} "
                     "(--list names them)")  # fmt: skip
    why = unusable_path(args.out)
    if why:
        ap.error(f"--out {args.out}: {why}; name a folder (every run writes its record there)")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu-smoke")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--only", nargs="*", help="run names to run (default: the preset's all)")
    ap.add_argument("--seeds", type=int, nargs="+", help="the seeds (default: the preset's)")
    ap.add_argument("--force", action="store_true", help="rerun runs whose JSON exists")
    ap.add_argument("--list", action="store_true", help="print the runs, run nothing")
    ap.add_argument("--no-summary", action="store_true", help="skip tp_summary (matplotlib)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no run that would end past this many seconds (estimate: the "
                         "longest run so far)")  # fmt: skip
    ap.add_argument("--order", nargs="*", default=[], help="run these names first, in this order")
    args = ap.parse_args(argv)
    preset = PRESETS[args.preset]
    everything = expand(preset, args.seeds)
    check_args(ap, args, {r[0] for r in everything})
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    runs = [r for r in everything if not args.only or r[0] in args.only]
    rank = {name: i for i, name in enumerate(args.order)}
    runs.sort(key=lambda r: rank.get(r[0], len(rank)))  # stable: the preset's order otherwise
    if args.list:
        for name, run_args in runs:
            print(name, " ".join(command(preset, name, run_args, extra, args.out, args.nproc)[1:]))
        return 0
    t_start, longest, left_out, failed = time.monotonic(), 0.0, [], []
    for name, run_args in runs:
        if find_record(args.out, name) is not None and not args.force:
            print(f"{name}: done already", flush=True)
            continue
        elapsed = time.monotonic() - t_start
        if args.budget_s is not None and elapsed + longest > args.budget_s:
            left_out.append(name)
            continue
        cmd = command(preset, name, run_args, extra, args.out, args.nproc)
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
        from . import tp_summary

        tp_summary.main([str(args.out)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
