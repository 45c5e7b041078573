"""Run a grid of ``emulated_tp`` runs on one GPU, several processes at a time.

    python -m fp4_train.experiments.emulated_sweep --preset tp4 --jobs 4 --budget-s 540 \\
        --out docs/results/emulated_runs -- --data-format bytes --data corpus.txt

A preset is the arguments every run shares (model, tokens per step, steps, learning rate) and
a list of configurations, each run once per seed (``--seeds`` replaces the preset's); the
arguments after ``--`` are added to every run and override the preset's.  Runs whose summary
is already in ``--out`` are skipped, so a grid is run over several sittings: ``--budget-s``
starts no run that would end past the budget (its length estimated by the longest run this
sitting, or ``--estimate-s`` before one has ended) and lists those left out.  ``--jobs``
processes share the GPU (a 125 M model with 4 emulated ranks takes a few GB of its memory);
each writes its log to ``<out>/logs``.  ``--list`` prints the runs and their commands only.
``--only`` runs the configurations named (preset names, e.g. ``fp4quant-g64``).

Presets, in the order the study takes them: ``tp4`` (TP = 4, every codec and policy),
``tp8`` (TP = 8: bf16, FP4Quant g = 64 and 256, TAH-Quant), ``pp2`` and ``sp4`` (the pipeline
boundary and SP with TP = 4, the policies of the CPU study), ``600m`` (the 0.6 B model, one
seed), ``timing`` (50 steps of the 125 M model: TP = 4 bf16 and FP4Quant g = 64 emulated, and
the plain model; synthetic tokens of a 16 k vocabulary, the corpus's).  TAH-Quant runs its
activation codec on tokens of the model's width (``tahquant-h<d>``) and its gradient codec
(``tahquant-grad``); a configuration whose codec fp4_comm does not know is listed as
unavailable and left out.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import fp4_comm

from . import emulated_tp

MODULE = "fp4_train.experiments.emulated_tp"
# What every run of the study shares: the 125 M model, 16 k tokens a step (16 sequences of
# 1024), 2000 steps (33 M tokens), AdamW at GPT-3 small's learning rate, the BPE corpus
# (build_corpus's folder: --data, by default .data/corpus).
STUDY = ["--model", "qwen-125m", "--tokens-per-step", "16384", "--steps", "2000", "--lr", "6e-4",
         "--data-format", "tokens"]  # fmt: skip
G64, G256 = "fp4quant-g64", "fp4quant-g256"
SR = ["--rounding", "stochastic"]
EF = ["--error-feedback"]
TAH = "tahquant"


def tah(width):
    """TAH-Quant: its activation codec on tokens of the model's width forward, its 6-bit
    gradient codec backward (both round to nearest: its only rounding)."""
    return (TAH, ["--codec", f"tahquant-h{width}", "--grad-codec", "tahquant-grad"])


TP4 = [
    ("bf16", ["--codec", "none"]),
    (G64, ["--codec", G64]),
    (G256, ["--codec", G256]),
    (f"{G64}-sr", ["--codec", G64, *SR]),
    (f"{G64}-ef", ["--codec", G64, *EF]),
    ("nvfp4", ["--codec", "nvfp4"]),
    ("nvfp4-sr", ["--codec", "nvfp4", *SR]),
    ("nvfp4-ef", ["--codec", "nvfp4", *EF]),
    ("nvfp4-sr-ef", ["--codec", "nvfp4", *SR, *EF]),
    ("mxfp4", ["--codec", "mxfp4"]),
    ("mxfp4-sr", ["--codec", "mxfp4", *SR]),
    ("mxfp4-ef", ["--codec", "mxfp4", *EF]),
    ("mxfp4-sr-ef", ["--codec", "mxfp4", *SR, *EF]),
    tah(768),  # qwen-125m's width
]
TP8 = [c for c in TP4 if c[0] in ("bf16", G64, G256, TAH)]
# The pipeline boundary: the residual stream forward (nearest) and its gradient backward
# (stochastic: tp_train's default; nearest for comparison).  SP: the same two directions.
PP2 = [
    ("bf16", ["--codec", "none"]),
    (G64, ["--codec", G64]),
    (f"{G64}-grad-rn", ["--codec", G64, "--grad-rounding", "nearest"]),
    (f"{G64}-fwd-only", ["--codec", G64, "--grad-codec", "none"]),
]
SP4 = PP2

PRESETS = {
    "tp4": {"args": [*STUDY, "--tp", "4"], "configs": TP4, "seeds": [0, 1, 2]},
    "tp8": {"args": [*STUDY, "--tp", "8"], "configs": TP8, "seeds": [0, 1, 2]},
    "pp2": {"args": [*STUDY, "--parallel", "pp"], "configs": PP2, "seeds": [0, 1, 2]},
    "sp4": {"args": [*STUDY, "--tp", "4", "--sequence-parallel"], "configs": SP4,
            "seeds": [0, 1, 2]},
    "600m": {"args": [*STUDY, "--model", "qwen-600m", "--tokens-per-step", "8192", "--tp", "4"],
             "configs": [c for c in TP4 if c[0] in ("bf16", G64)] + [tah(1536)], "seeds": [0]},
    "timing": {"args": ["--model", "qwen-125m", "--tokens-per-step", "16384", "--steps", "50",
                        "--data-format", "random", "--vocab", "16384", "--eval-every", "0",
                        "--eval-batches", "1", "--stats-every", "0", "--timing-warmup", "10"],
               "configs": [("tp4-bf16", ["--tp", "4", "--codec", "none"]),
                           ("tp4-g64", ["--tp", "4", "--codec", G64]),
                           ("plain", ["--tp", "1"])],
               "seeds": [0]},
}  # fmt: skip


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), required=True)
    ap.add_argument("--out", type=Path, required=True, help="folder of the run summaries")
    ap.add_argument("--seeds", type=int, nargs="+", default=None)
    ap.add_argument("--only", nargs="+", default=None, help="configuration names to run")
    ap.add_argument("--jobs", type=int, default=1, help="processes at a time on the GPU")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no run that would end later than this after the start")  # fmt: skip
    ap.add_argument("--estimate-s", type=float, default=None,
                    help="a run's length before one has ended (default: no estimate)")  # fmt: skip
    ap.add_argument("--force", action="store_true", help="rerun runs whose summary exists")
    ap.add_argument("--list", action="store_true", help="print the runs; run nothing")
    ap.add_argument("extra", nargs="*", help="after --: added to every run")
    args = ap.parse_args(argv)
    if args.jobs < 1:
        ap.error("--jobs: at least 1")
    return args


def available(argv):
    """Whether every codec the arguments name is one fp4_comm (or tp_train) knows."""
    specs = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--codec", "--grad-codec")]
    for spec in specs:
        if spec.startswith(TAH):
            try:
                fp4_comm.get_codec(spec)
            except ValueError:
                return False
    return True


def runs(args):
    """[(run name, argv)] of the preset, seed by seed, and the names "<config> s<seed>" of the
    runs whose codec is not available."""
    preset = PRESETS[args.preset]
    out, unavailable = [], []
    for seed in args.seeds or preset["seeds"]:
        for name, config in preset["configs"]:
            if args.only and name not in args.only:
                continue
            argv = [*preset["args"], *config, *args.extra, "--seed", str(seed), "--quiet",
                    "--out", str(args.out)]  # fmt: skip
            if not available(argv):
                unavailable.append(f"{name} s{seed}")
                continue
            own, run_args = emulated_tp.parse_args(argv)
            out.append((emulated_tp.run_name(run_args, own.tp), argv))
    return out, unavailable


def main(argv=None):
    args = parse_args(argv)
    every, unavailable = runs(args)
    todo = [(n, a) for n, a in every if args.force or not (args.out / f"{n}.json").exists()]
    for name in unavailable:
        print(f"{name}: unavailable (fp4_comm.get_codec does not know its codec)")
    if args.list:
        for run_name, run_argv in todo:
            print(run_name, shlex.join([sys.executable, "-m", MODULE, *run_argv]))
        return 0
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "FP4_CONCURRENT_RUNS": str(args.jobs)}
    start = time.monotonic()
    longest = args.estimate_s
    running, left_out, failed = {}, [], []
    pending = list(todo)
    while pending or running:
        while pending and len(running) < args.jobs:
            elapsed = time.monotonic() - start
            if args.budget_s is not None and longest is not None and (
                    elapsed + longest > args.budget_s):  # fmt: skip
                left_out += [n for n, _ in pending]
                pending = []
                break
            run_name, run_argv = pending.pop(0)
            log = (logs / f"{run_name}.log").open("w")
            cmd = [sys.executable, "-m", MODULE, *run_argv]
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            running[proc] = (run_name, time.monotonic(), log)
            print(f"started {run_name}", flush=True)
        for proc in list(running):
            code = proc.poll()
            if code is None:
                continue
            run_name, t0, log = running.pop(proc)
            log.close()
            took = time.monotonic() - t0
            longest = took if longest is None else max(longest, took)
            if code:
                failed.append(run_name)
            print(f"{'failed' if code else 'done'} {run_name} in {took:.0f} s", flush=True)
        time.sleep(0.5)
    for run_name in left_out:
        print(f"left out (budget): {run_name}")
    for run_name in failed:
        print(f"failed: {run_name} (log: {logs / (run_name + '.log')})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
