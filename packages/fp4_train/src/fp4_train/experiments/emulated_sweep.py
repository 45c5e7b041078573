"""Run a grid of ``emulated_tp`` runs on one GPU, several processes at a time.

    python -m fp4_train.experiments.emulated_sweep --preset tp4 --jobs 4 --budget-s 540 \\
        --out docs/results/emulated_runs -- --data-format bytes --data corpus.txt

A preset is the arguments every run shares (model, tokens per step, steps, learning rate) and a
list of configurations, each run once per seed (``--seeds`` replaces the preset's); the
arguments after ``--`` are added to every run and override the preset's.  Runs whose summary is
already in ``--out`` (or in a ``--done`` folder: a grid's finished runs gathered from other
machines) are skipped, so a grid is run over several jobs: ``--budget-s`` starts no run that
would end past the budget and lists those left out.  A run's length is estimated by the longest
recorded ``wall_s`` of its configuration (any seed) made with ``--jobs`` processes on the GPU
(its ``concurrent_runs``, below), from the summaries in those folders, on this GPU's model
where the configuration has such a record (``nvidia-smi``'s name against the summary's device;
a model's runs can take 1.2 times another's), else on any; a configuration with a loss scale and
no record of its own, by the same configuration's without it (``config_record``); for a
configuration without such a record, by the longest run of this invocation (its summary's
``wall_s``, every piece's), or ``--estimate-s`` before one has ended; a run resumed from its
checkpoint, by that less the share of its steps the checkpoint has done.  ``--jobs`` processes
share the GPU (a 125 M model with 4 emulated ranks takes 13 GB of its memory, 43 GB with error
feedback: its graphs); each writes its log to ``<out>/logs``.  A run starts only where it fits
the GPU's memory beside the runs going on (``--gpu-memory-gb``, by default the free memory
``nvidia-smi`` reports at the start): its need is the largest ``max_memory_gb`` its
configuration's summaries record (any seed, this invocation's finished runs included; where its
own has none, the same configuration's without its loss scale, else ``--memory-gb-estimate``,
else the largest of any configuration), plus ``MEMORY_SLACK`` of it and ``CONTEXT_GB`` for the
process's CUDA context; the first pending run that fits starts, and one that fits only alone
waits for the GPU to empty.  A finished run's summary says in ``concurrent_runs`` the most
processes that shared the GPU while it ran, itself included, over all its pieces: this
sweep's runs going on at once, or the compute processes ``nvidia-smi`` lists where it lists
more (another sweep's runs beside this one; asked every ``SHARING_POLL_S`` at most, and
whenever a run starts or ends).  Runs on the CPU (``--device cpu``) count the processes that
share its cores instead: the machine's ``emulated_tp`` processes, from ``/proc``.
``--list`` prints the runs and their commands only.
``--only`` runs the configurations named (preset names, e.g. ``fp4quant-g64``).

Runs longer than one job: with ``--checkpoint-dir DIR`` every run resumes from and writes
its checkpoint ``DIR/<run name>`` (``emulated_tp --checkpoint``), and ``--stop-at-s S`` stops
each run after its first step that ends S seconds or more after the sweep started (the run
writes its checkpoint and exits with status 75, ``checkpoint.EX_TEMPFAIL``); no run starts
with less than ``--min-piece-s`` left, unless it is expected to end in the time left.  The
sweep then lists the runs finished, resumable and not started, and exits with status 75 while
any is left; the same command again resumes the unfinished runs and skips the finished ones
(their summaries are in ``--out``; their checkpoints are removed unless
``--keep-checkpoints``).  A run's clock starts after its imports, and it stops only at a
step's end, then writes its checkpoint: leave S that much short of a hard limit.  Where the
checkpoints will not outlive this job (a machine given back after it), ``--budget-s``
besides ``--stop-at-s`` finishes the runs begun and starts none that cannot end: a resumed
run is expected to take only what is left of it.

Presets, in the order the study takes them: ``tp4`` (TP = 4, every codec and policy),
``tp8`` (TP = 8: bf16, FP4Quant g = 64 and 256, the best FP4 policy of ``tp4`` (``BEST``),
TAH-Quant), ``pp2`` and ``sp4`` (the pipeline boundary and SP with TP = 4, the policies of the
CPU study), ``pp2-levers`` (the pipeline boundary's forward codecs: NVFP4, MXFP4, FP4Quant
g = 16, g = 64 without the transform, with the gradient at FP4Quant g = 64 stochastic; and
TAH-Quant), ``plain`` (the model on one rank, bf16: the control of every layout's bf16),
``600m`` (the 0.6 B model, one seed: bf16, g = 64, ``BEST``, TAH-Quant with the loss scale),
``cpu-ranks`` (on the CPU: the byte-level model of ``tp_sweep``'s CPU study with 8 heads, bf16,
FP4Quant g = 64 and NVFP4 at TP = 2, 4 and 8: whether a wire costs more with more ranks),
``cpu-tah-scale`` (on the CPU: TAH-Quant on that model at TP = 4 with loss scales 1, 2**-6 and
2**10: what its gradient codec's subnormal fp16 scales cost; and with 2**10 at TP = 2 and 8:
whether its gap grows with the ranks),
``timing`` (50 steps of the 125 M model: TP = 4 bf16 and FP4Quant g = 64 emulated, and the
plain model; synthetic tokens of a 16 k vocabulary, the corpus's).  TAH-Quant runs its
activation codec on tokens of the model's width (``tahquant-h<d>``) and its gradient codec
(``tahquant-grad``), without a loss scale (``tahquant``) and with one of 2**16
(``tahquant-ls``, ``TAH_LOSS_SCALE``: its gradient codec's fp16 scales out of the subnormal
range; the 0.6 B model runs this one only); a configuration whose codec fp4_comm does not know
is listed as unavailable and left out.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import fp4_comm

from . import emulated_tp, tp_train
from .checkpoint import EX_TEMPFAIL, progress
from .records import (
    UNREADABLE,
    find_record,
    load_record,
    record_name,
    record_paths,
    run_stem,
    write_json,
)

MODULE = "fp4_train.experiments.emulated_tp"
SHARING_POLL_S = 5.0  # how often, at most, the sweep asks nvidia-smi which processes the GPU runs
# In a stopped run's checkpoint folder: the most processes seen on the GPU in its pieces so far.
SHARING_FILE = "gpu_sharing"
# What every run of the study shares: the 125 M model, 16 k tokens a step (16 sequences of
# 1024), 2000 steps (33 M tokens), AdamW at GPT-3 small's learning rate, the BPE corpus
# (build_corpus's folder: --data, by default .data/corpus).
STUDY = ["--model", "qwen-125m", "--tokens-per-step", "16384", "--steps", "2000", "--lr", "6e-4",
         "--data-format", "tokens"]  # fmt: skip
G64, G256 = "fp4quant-g64", "fp4quant-g256"
SR = ["--rounding", "stochastic"]
EF = ["--error-feedback"]
TAH = "tahquant"
# TAH-Quant's gradient codec scales each tile by its largest magnitude in fp16; without a loss
# scale the 125 M model's gradients at the all-reduce (RMS 1e-7 to 2e-7) make those scales fp16
# subnormals of two or three significant bits.  2**16 (torch GradScaler's first scale) puts
# them at about 0.01-0.1, in fp16's normal range and far below its largest value; on every
# other wire a power-of-two loss scale changes no bit.
TAH_LS, TAH_LOSS_SCALE = "tahquant-ls", 2**16
BF16 = ("bf16", ["--codec", "none"])  # the baseline: bf16 on the wire
# What a run holds beyond its recorded peak (torch's allocations, ``max_memory_gb``): a share
# of it (the caching allocator's rounding and fragmentation) and its CUDA context, GiB.
MEMORY_SLACK, CONTEXT_GB = 0.10, 1.5
# --stop-at-s: the least time worth starting a run for (start-up, loading or building the
# model, a few steps, writing the checkpoint)
MIN_PIECE_S = 60.0


def tah(width):
    """TAH-Quant: its activation codec on tokens of the model's width forward, its 6-bit
    gradient codec backward (both round to nearest: its only rounding, named for the
    pipeline, whose gradient rounds stochastically by default)."""
    return (TAH, ["--codec", f"tahquant-h{width}", "--grad-codec", "tahquant-grad",
                  "--grad-rounding", "nearest"])  # fmt: skip


def tah_ls(width):
    """``tah(width)`` with the loss scale ``TAH_LOSS_SCALE``: its gradient codec's scales in
    fp16's normal range."""
    return (TAH_LS, [*tah(width)[1], "--loss-scale", str(TAH_LOSS_SCALE)])


TP4 = [
    BF16,
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
    tah_ls(768),
]
# The best FP4 policy of the TP = 4 table, taken to TP = 8 and the 0.6 B model: NVFP4 with
# nearest rounding both ways, no error feedback.  Its mean gap ties MXFP4's (+0.021 and +0.018
# over 3 seeds, paired difference -0.003 +- 0.121); stochastic rounding and error feedback
# both cost loss there; NVFP4's payloads have the higher SQNR (20.4 dB against 18.7).
BEST = "nvfp4"
TP8 = [c for c in TP4 if c[0] in (BF16[0], G64, G256, BEST, TAH, TAH_LS)]
# The pipeline boundary: the residual stream forward (nearest) and its gradient backward
# (stochastic: tp_train's default; nearest for comparison).  SP: the same two directions.
PP2 = [
    BF16,
    (G64, ["--codec", G64]),
    (f"{G64}-grad-rn", ["--codec", G64, "--grad-rounding", "nearest"]),
    (f"{G64}-fwd-only", ["--codec", G64, "--grad-codec", "none"]),
]
SP4 = PP2
# The pipeline boundary's forward levers (its forward crossing is what costs there), the
# gradient at the pipeline's default (FP4Quant g = 64, stochastic): NVFP4 and MXFP4 (the block
# formats of the TP table), FP4Quant g = 16 (4x the scales of g = 64) and g = 64 without the
# transform; and TAH-Quant, a codec written for pipeline activations, both ways.  bf16 is
# pp2's (the same runs).
PP2_LEVERS = [
    BF16,
    ("nvfp4-fwd", ["--codec", "nvfp4", "--grad-codec", G64]),
    ("mxfp4-fwd", ["--codec", "mxfp4", "--grad-codec", G64]),
    ("fp4quant-g16-fwd", ["--codec", "fp4quant-g16", "--grad-codec", G64]),
    ("fp4quant-g64-nohad-fwd", ["--codec", "fp4quant-g64-nohad", "--grad-codec", G64]),
    tah(768),
    tah_ls(768),
]

# How the wire's cost changes with the ranks, on the CPU: the configuration of tp_sweep's CPU
# study (the byte-level transformer, 4 layers, d = 128, 600 steps of 1k tokens) with 8 heads,
# so that 2, 4 and 8 ranks all split them; bf16, FP4Quant g = 64 and NVFP4 (the TP = 8 wires
# of the GPU study) at TP = 2, 4 and 8.  Emulated ranks make TP = 8 one process of one thread.
CPU_RANKS = ["--device", "cpu", "--model", "byte", "--layers", "4", "--d-model", "128",
             "--heads", "8", "--seq-len", "64", "--batch", "16", "--steps", "600", "--lr", "3e-3",
             "--eval-every", "100", "--eval-batches", "8", "--stats-every", "10",
             "--data-format", "bytes"]  # fmt: skip
CPU_RANKS_CONFIGS = [(f"tp{k}-{name}", ["--tp", str(k), *args]) for k in (2, 4, 8)
                     for name, args in (BF16, (G64, ["--codec", G64]),
                                        (BEST, ["--codec", BEST]))]  # fmt: skip
# TAH-Quant's gradient codec against the magnitude of the gradients, on the CPU: the CPU
# ranks model at TP = 4 (its gradients at the all-reduce have an RMS of about 6e-6), TAH-Quant
# both ways as it comes (loss scale 1), with its gradients 64 times smaller (2**-6: an RMS of
# about 1e-7, the 125 M model's at TP = 8 without a loss scale, where the fp16 tile scales keep
# two or three significant bits) and 1024 times larger (every scale a normal fp16 number); and
# with every scale normal at TP = 2 and 8 as well, whether its gap grows with the ranks as the
# cpu-ranks preset asks of the FP4 wires.  bf16 is the cpu-ranks preset's run of the layout (the
# same run names: ``--done`` takes them).
CPU_TAH_NORMAL_SCALE = 2.0**10
CPU_TAH_SCALES = [1.0, 2.0**-6, CPU_TAH_NORMAL_SCALE]


def _cpu_tah(k, scale):
    """TAH-Quant both ways on the CPU ranks model at TP = ``k`` with loss scale ``scale``."""
    return (f"tp{k}-{TAH}-ls{tp_train.loss_scale_label(scale)}",
            ["--tp", str(k), *tah(128)[1], "--loss-scale", repr(scale)])  # fmt: skip


CPU_RANKS_BF16 = {k: next(c for c in CPU_RANKS_CONFIGS if c[0] == f"tp{k}-{BF16[0]}")
                  for k in (2, 4, 8)}  # fmt: skip
CPU_TAH_SCALE_CONFIGS = (
    [CPU_RANKS_BF16[4]]
    + [_cpu_tah(4, scale) for scale in CPU_TAH_SCALES]
    + [c for k in (2, 8) for c in (CPU_RANKS_BF16[k], _cpu_tah(k, CPU_TAH_NORMAL_SCALE))]
)  # fmt: skip

PRESETS = {
    "tp4": {"args": [*STUDY, "--tp", "4"], "configs": TP4, "seeds": [0, 1, 2]},
    "tp8": {"args": [*STUDY, "--tp", "8"], "configs": TP8, "seeds": [0, 1, 2]},
    "pp2": {"args": [*STUDY, "--parallel", "pp"], "configs": PP2, "seeds": [0, 1, 2]},
    "pp2-levers": {"args": [*STUDY, "--parallel", "pp"], "configs": PP2_LEVERS,
                   "seeds": [0, 1, 2]},
    "sp4": {"args": [*STUDY, "--tp", "4", "--sequence-parallel"], "configs": SP4,
            "seeds": [0, 1, 2]},
    "600m": {"args": [*STUDY, "--model", "qwen-600m", "--tokens-per-step", "8192", "--tp", "4"],
             "configs": [c for c in TP4 if c[0] in (BF16[0], G64, BEST)] + [tah_ls(1536)],
             "seeds": [0]},
    # the plain model (no ranks, no wire): the control of every layout's bf16
    "plain": {"args": [*STUDY, "--tp", "1"], "configs": [BF16],
              "seeds": [0, 1, 2]},
    "cpu-ranks": {"args": CPU_RANKS, "configs": CPU_RANKS_CONFIGS, "seeds": [0, 1, 2, 3, 4]},
    "cpu-tah-scale": {"args": CPU_RANKS, "configs": CPU_TAH_SCALE_CONFIGS,
                      "seeds": [0, 1, 2, 3]},
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
                    help="a run's length where its configuration has no record at --jobs "
                         "and no run has ended yet (default: no estimate)")  # fmt: skip
    ap.add_argument("--checkpoint-dir", type=Path, default=None,
                    help="each run resumes from and writes <dir>/<run name> (emulated_tp "
                         "--checkpoint); a finished run's is removed")  # fmt: skip
    ap.add_argument("--stop-at-s", type=float, default=None,
                    help="stop every run after its first step that ends S seconds or more "
                         "after the sweep's start, with its checkpoint written (resumable: "
                         "the next invocation continues it); needs --checkpoint-dir")  # fmt: skip
    ap.add_argument("--min-piece-s", type=float, default=MIN_PIECE_S,
                    help="with --stop-at-s: start no run with less time left")  # fmt: skip
    ap.add_argument("--keep-checkpoints", action="store_true",
                    help="keep a finished run's checkpoint (its final state)")  # fmt: skip
    ap.add_argument("--gpu-memory-gb", type=float, default=None,
                    help="GiB the runs may hold at once (default: free GPU memory)")  # fmt: skip
    ap.add_argument("--memory-gb-estimate", type=float, default=None,
                    help="the peak GiB of a run whose configuration has no recorded "
                         "max_memory_gb, nor has it without its loss scale (default: the "
                         "largest recorded of any)")  # fmt: skip
    ap.add_argument("--done", type=Path, nargs="+", default=[],
                    help="folders of finished runs' summaries (besides --out): those runs "
                         "are skipped")  # fmt: skip
    ap.add_argument("--force", action="store_true", help="rerun runs whose summary exists")
    ap.add_argument("--list", action="store_true", help="print the runs; run nothing")
    ap.add_argument("extra", nargs="*", help="after --: added to every run")
    args = ap.parse_args(argv)
    if args.jobs < 1:
        ap.error("--jobs: at least 1")
    if args.stop_at_s is not None and args.checkpoint_dir is None:
        ap.error("--stop-at-s stops runs with their checkpoint written: give --checkpoint-dir")
    # (written so that NaN fails: every comparison with it is false)
    numbers = ("budget_s", "estimate_s", "stop_at_s", "min_piece_s", "gpu_memory_gb",
               "memory_gb_estimate")  # fmt: skip
    for option in numbers:
        value, zero = getattr(args, option), option in ("budget_s", "min_piece_s")
        if value is not None and not (math.isfinite(value) and (value >= 0 if zero else value > 0)):
            bound, unit = ">= 0" if zero else "> 0", "GiB" if option.endswith("gb") else "seconds"
            ap.error(f"--{option.replace('_', '-')} {value}: a finite number of {unit} {bound}")
    from .tp_train import check_seeds

    check_seeds(ap, args.seeds)
    for folder in args.done:
        if not folder.is_dir():
            what = "not a folder" if folder.exists() else "no such folder"
            ap.error(f"--done {folder}: {what}; name the folders that hold finished runs' "
                     "summaries")  # fmt: skip
    names = [name for name, _ in PRESETS[args.preset]["configs"]]
    unknown = [n for n in args.only or () if n not in names]
    if unknown:
        ap.error(f"--only {' '.join(unknown)}: not a configuration of --preset {args.preset} "
                 f"({', '.join(names)})")  # fmt: skip
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
            # (each piece gets its own --checkpoint, which stop arguments after -- need)
            ckpt = [] if args.checkpoint_dir is None else ["--checkpoint", str(args.checkpoint_dir)]
            own, run_args = emulated_tp.parse_args([*argv, *ckpt])
            out.append((emulated_tp.run_name(run_args, own.tp), argv))
    return out, unavailable


def piece_args(args, run_name, elapsed_s):
    """The arguments of one piece of run ``run_name`` started ``elapsed_s`` into the sweep:
    its checkpoint in ``--checkpoint-dir``, and the time left before ``--stop-at-s``."""
    if args.checkpoint_dir is None:
        return []
    extra = ["--checkpoint", str(args.checkpoint_dir / run_name)]
    if args.stop_at_s is not None:
        extra += ["--stop-at-s", f"{args.stop_at_s - elapsed_s:.1f}"]
    return extra


def recorded_summaries(folders):
    """[(run name without its ``_s<seed>``, summary)] of the readable run summaries in
    ``folders`` (``<name>.json`` or its gzip copy) whose names end in a seed (the others
    passed over)."""
    out = []
    for folder in folders:
        for path in record_paths(folder):
            try:
                summary = load_record(path)
            except UNREADABLE:
                continue
            name = record_name(path)
            config = run_stem(name)
            if config != name and isinstance(summary, dict):
                out.append((config, summary))
    return out


def _largest(summaries, field, admits=lambda summary: True):
    """{configuration: the largest finite ``field`` (at least 0) of its summaries that
    ``admits``}; a summary whose field is missing or no number is passed over."""
    largest = {}
    for config, summary in summaries:
        try:
            value = float(summary[field])
            if not admits(summary):
                continue
        except (KeyError, TypeError, ValueError):
            continue
        if math.isfinite(value):
            largest[config] = max(largest.get(config, 0.0), value)
    return largest


def recorded_lengths(summaries, jobs, gpu=None):
    """{run name without its ``_s<seed>``: the longest ``wall_s`` of its finished runs made
    with ``jobs`` processes on the GPU (``concurrent_runs``)}, of its runs on the GPU model
    named ``gpu`` where it has any, else of all (``summaries``: ``recorded_summaries``)."""

    def at_jobs(s):
        return int(s["concurrent_runs"]) == jobs

    lengths = _largest(summaries, "wall_s", at_jobs)
    if gpu:
        ran_here = _largest(summaries, "wall_s", lambda s: at_jobs(s) and _ran_on(s, gpu))
        lengths.update(ran_here)
    return lengths


def config_record(table, run_name):
    """``table``'s entry (``recorded_lengths``, ``recorded_memory``) for run ``run_name``'s
    configuration, else for the same configuration without its loss scale
    (``tp_train.LOSS_SCALE_SUFFIX``): a static loss scale costs a run no measurable time and
    no memory (the loss times S and the gradients times 1/S, once a step); None where neither
    has one."""
    stem = run_stem(run_name)
    for config in (stem, tp_train.LOSS_SCALE_SUFFIX.sub("", stem)):
        if config in table:
            return table[config]
    return None


def _ran_on(summary, gpu):
    """Whether ``summary``'s run ran on the GPU model ``gpu`` (its device, e.g. "cuda: NVIDIA
    H200", ends with the name); a summary without a readable device did not."""
    meta = summary.get("meta")
    return isinstance(meta, dict) and str(meta.get("device", "")).endswith(gpu)


def recorded_memory(summaries):
    """{run name without its ``_s<seed>``: the largest ``max_memory_gb`` of its finished runs}
    (``summaries``: ``recorded_summaries``)."""
    return _largest(summaries, "max_memory_gb", lambda s: float(s["max_memory_gb"]) > 0)


def free_gpu_memory_gb():
    """The free memory of the GPU the runs take in GiB, as ``nvidia-smi`` reports it; None
    where it reports none."""
    free = _nvidia_smi("memory.free")
    try:
        return float(free) / 1024  # MiB
    except (TypeError, ValueError):
        return None


def gpu_name():
    """The model of the GPU the runs take, as ``nvidia-smi`` names it (e.g. "NVIDIA H200");
    None where it names none."""
    return _nvidia_smi("name") or None


def gpu_processes():
    """The number of compute processes on the GPU the runs take, as ``nvidia-smi`` lists them
    (this sweep's runs and any other's); None where it lists none (no GPU, or a container
    whose processes it does not show)."""
    return len(_nvidia_smi_lines("--query-compute-apps=pid")) or None


def machine_runs(proc=Path("/proc")):
    """The number of ``emulated_tp`` processes this machine runs (any sweep's, or none's), from
    the command lines under ``proc``; None where it cannot be read (no ``/proc``).  On the CPU
    they share the cores as GPU runs share the GPU."""
    try:
        pids = [p for p in proc.iterdir() if p.name.isdigit()]
    except OSError:
        return None
    count = 0
    for pid in pids:
        try:
            argv = (pid / "cmdline").read_bytes().split(b"\0")
        except OSError:  # (a process that has ended, or one not ours to read)
            continue
        count += MODULE.encode() in argv
    return count


def _nvidia_smi(field):
    """``nvidia-smi``'s ``field`` of the GPU the runs take, a string; None where it gives
    none."""
    lines = _nvidia_smi_lines(f"--query-gpu={field}")
    return lines[0] if lines else None


def _nvidia_smi_lines(query):
    """The lines ``nvidia-smi`` answers to ``query`` (``--query-gpu=...``,
    ``--query-compute-apps=...``) for the GPU the runs take (the first of
    ``CUDA_VISIBLE_DEVICES``), stripped, the empty ones left out; none where it does not
    answer.  (Not through torch: a CUDA context in the sweep's own process would hold memory
    for the whole sweep.)"""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip() or "0"
    command = ["nvidia-smi", "-i", first, query, "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


class Sweep:
    """The runs of one invocation: started ``--jobs`` at a time, each polled until it exits
    (0: finished; ``EX_TEMPFAIL``: stopped at ``--stop-at-s``, resumable; else failed)."""

    def __init__(self, args, todo):
        self.args, self.pending = args, list(todo)
        self.logs = args.out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "FP4_CONCURRENT_RUNS": str(args.jobs)}
        # runs on the CPU share its cores: count the machine's emulated_tp processes
        self.on_cpu = any(a == "--device" and b == "cpu" for _, argv in self.pending
                          for a, b in zip(argv, argv[1:], strict=False))  # fmt: skip
        self.start, self.longest = time.monotonic(), args.estimate_s
        summaries = recorded_summaries([args.out, *getattr(args, "done", [])])
        self.recorded = recorded_lengths(summaries, args.jobs, gpu_name())
        self.peaks = recorded_memory(summaries)
        memory = getattr(args, "gpu_memory_gb", None)
        self.memory = memory if memory is not None else free_gpu_memory_gb()
        self.waiting = set()  # runs said to wait for memory
        self.done_share = {}  # run name -> the share of its steps its checkpoint had done
        self.running, self.left_out = {}, []
        self.finished, self.resumable, self.failed = [], [], []
        self.summaries = {}  # finished run name -> its summary (None: unreadable)
        self.sharing = {}  # run name -> the most processes seen on the GPU in its pieces
        self.listed, self.listed_at = None, None  # processes listed (nvidia-smi; CPU: /proc), when

    def estimate(self, run_name):
        """The time expected of what is left of run ``run_name``: its configuration's record
        (``config_record``; else the longest run of this invocation, or ``--estimate-s``) less
        the share of its steps that its checkpoint in ``--checkpoint-dir`` has done; None:
        unknown."""
        length = config_record(self.recorded, run_name)
        length = self.longest if length is None else length
        return None if length is None else length * (1.0 - self.done(run_name))

    def done(self, run_name):
        """The share of run ``run_name``'s steps done by its checkpoint (0 without one), read
        once: the checkpoint changes only while the run goes on."""
        if run_name not in self.done_share:
            ckpt = self.args.checkpoint_dir
            steps = None if ckpt is None else progress(ckpt / run_name)
            self.done_share[run_name] = 0.0 if not steps else min(1.0, steps[0] / steps[1])
        return self.done_share[run_name]

    def fits(self, elapsed, run_name):
        """Whether run ``run_name`` started now fits ``--budget-s`` and ``--stop-at-s`` (a run
        expected to end before ``--stop-at-s`` starts with less than ``--min-piece-s`` left)."""
        args, length = self.args, self.estimate(run_name)
        if args.budget_s is not None and length is not None and elapsed + length > args.budget_s:
            return False
        piece = args.min_piece_s if length is None else min(args.min_piece_s, length)
        return args.stop_at_s is None or elapsed + piece <= args.stop_at_s

    def need_gb(self, run_name):
        """The GPU memory run ``run_name`` is expected to hold, GiB (see the module doc);
        None: no record says."""
        peak = config_record(self.peaks, run_name)
        if peak is None:
            peak = getattr(self.args, "memory_gb_estimate", None)
        if peak is None:
            peak = max(self.peaks.values(), default=None)
        return None if peak is None else peak * (1 + MEMORY_SLACK) + CONTEXT_GB

    def fits_memory(self, run_name):
        """Whether run ``run_name`` fits the GPU's memory beside the runs going on (always
        where nothing runs, or where the memory or the run's need is unknown)."""
        need = self.need_gb(run_name)
        if not self.running or self.memory is None or need is None:
            return True
        held = sum(self.need_gb(n) or 0.0 for n, _, _ in self.running.values())
        if held + need <= self.memory:
            return True
        if run_name not in self.waiting:
            self.waiting.add(run_name)
            print(f"waiting: {run_name} needs ~{need:.0f} GiB, {held:.0f} of "
                  f"{self.memory:.0f} held by the runs going on", flush=True)  # fmt: skip
        return False

    def start_runs(self):
        while self.pending and len(self.running) < self.args.jobs:
            elapsed = time.monotonic() - self.start
            # (a run that does not fit now never will: the time left only shrinks)
            fitting = [i for i, (n, _) in enumerate(self.pending) if self.fits(elapsed, n)]
            self.left_out += [n for i, (n, _) in enumerate(self.pending) if i not in fitting]
            self.pending = [self.pending[i] for i in fitting]
            first = next((i for i, (n, _) in enumerate(self.pending) if self.fits_memory(n)), None)
            if first is None:  # (none fits beside the runs going on: wait for one to end)
                return
            run_name, run_argv = self.pending.pop(first)
            log = (self.logs / f"{run_name}.log").open("a")
            cmd = [sys.executable, "-m", MODULE, *run_argv,
                   *piece_args(self.args, run_name, elapsed)]  # fmt: skip
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
            self.running[proc] = (run_name, time.monotonic(), log)
            self.sharing.setdefault(run_name, self.earlier_sharing(run_name))
            self.listed_at = None  # (the processes on the GPU changed: ask again)
            length = self.estimate(run_name)
            expected = "" if length is None else f" (expected {length:.0f} s)"
            print(f"started {run_name}{expected}", flush=True)

    def poll(self):
        for proc in list(self.running):
            code = proc.poll()
            if code is None:
                continue
            run_name, t0, log = self.running.pop(proc)
            log.close()
            self.listed_at = None
            took = time.monotonic() - t0
            if code == EX_TEMPFAIL:
                self.resumable.append(run_name)
                self.keep_sharing(run_name)
                print(f"stopped {run_name} after {took:.0f} s (resumable)", flush=True)
                continue
            (self.failed if code else self.finished).append(run_name)
            print(f"{'failed' if code else 'done'} {run_name} in {took:.0f} s", flush=True)
            if code:
                continue
            self.record_sharing(run_name)
            self.learn(run_name, took)
            if self.args.checkpoint_dir is not None and not self.args.keep_checkpoints:
                shutil.rmtree(self.args.checkpoint_dir / run_name, ignore_errors=True)

    def learn(self, run_name, took):
        """Take a finished run's length as the estimate of runs without a record (the longest
        so far: its summary's ``wall_s``, every piece's, where readable, not this last piece's
        ``took`` seconds alone) and its recorded peak as its configuration's (the largest so
        far), for the runs that start later."""
        record = self.summary(run_name)
        summary = [] if record is None else [(run_stem(run_name), record)]
        length = _largest(summary, "wall_s").get(run_stem(run_name), took)
        self.longest = length if self.longest is None else max(self.longest, length)
        for config, peak in recorded_memory(summary).items():
            self.peaks[config] = max(self.peaks.get(config, 0.0), peak)

    def note_sharing(self):
        """Count for every run going on the processes that share the GPU now: this sweep's
        runs, or the compute processes ``nvidia-smi`` lists where it lists more; runs on the
        CPU (``--device cpu``): this sweep's, or the machine's ``emulated_tp`` processes
        (``machine_runs``) where there are more."""
        if not self.running:
            return
        now = time.monotonic()
        if self.listed_at is None or now - self.listed_at >= SHARING_POLL_S:
            self.listed = machine_runs() if self.on_cpu else gpu_processes()
            self.listed_at = now
        count = max(len(self.running), self.listed or 0)
        for run_name, _, _ in self.running.values():
            self.sharing[run_name] = max(self.sharing.get(run_name, 1), count)

    def _sharing_path(self, run_name):
        ckpt = self.args.checkpoint_dir
        return None if ckpt is None else ckpt / run_name / SHARING_FILE

    def earlier_sharing(self, run_name):
        """The most processes seen on the GPU in run ``run_name``'s earlier pieces (1 where
        it has none, or nothing says)."""
        path = self._sharing_path(run_name)
        if path is None:
            return 1
        try:
            return max(1, int(path.read_text()))
        except (OSError, ValueError):
            return 1

    def keep_sharing(self, run_name):
        """Write beside a stopped run's checkpoint the most processes seen on the GPU in its
        pieces so far, for the invocation that resumes it."""
        path = self._sharing_path(run_name)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"{self.sharing.get(run_name, 1)}\n")

    def record_sharing(self, run_name):
        """Set a finished run's ``concurrent_runs`` to the most processes seen on the GPU in
        its pieces (the run writes ``--jobs``, what this sweep allowed, not what ran)."""
        summary = self.summary(run_name)
        if isinstance(summary, dict):
            summary["concurrent_runs"] = self.sharing.get(run_name, 1)
            write_json(self.args.out / f"{run_name}.json", summary)

    def run(self):
        while self.pending or self.running:
            self.start_runs()
            self.note_sharing()
            self.poll()
            time.sleep(0.5)

    def outcome(self, run_name):
        """The final validation loss of a finished run as its summary gives it (printed, so that
        the sweep's own output keeps it where the summary file is not brought back)."""
        try:
            return f" (final val loss {self.summary(run_name)['final_val_loss']:.4f})"
        except (KeyError, TypeError, ValueError):
            return " (no summary)"

    def summary(self, run_name):
        """The summary a finished run wrote (None where unreadable), read once."""
        if run_name not in self.summaries:
            try:
                self.summaries[run_name] = load_record(self.args.out / f"{run_name}.json")
            except UNREADABLE:
                self.summaries[run_name] = None
        return self.summaries[run_name]

    def report(self):
        """Print what became of each run; the exit status: 1 if one failed, ``EX_TEMPFAIL``
        if one is left to a later invocation, else 0."""
        for run_name in self.finished:
            print(f"finished: {run_name}{self.outcome(run_name)}")
        ckpt = self.args.checkpoint_dir
        for run_name in self.resumable:
            print(f"resumable: {run_name} (checkpoint {ckpt / run_name}; run the sweep again)")
        why = "time limit" if self.args.stop_at_s is not None else "budget"
        for run_name in self.left_out:
            print(f"left out ({why}): {run_name}")
        for run_name in self.failed:
            print(f"failed: {run_name} (log: {self.logs / (run_name + '.log')})")
        if self.failed:
            return 1
        return EX_TEMPFAIL if self.resumable or self.left_out else 0


def main(argv=None):
    args = parse_args(argv)
    every, unavailable = runs(args)
    folders = [args.out, *args.done]
    todo = [(n, a) for n, a in every
            if args.force or not any(find_record(f, n) for f in folders)]  # fmt: skip
    for name in unavailable:
        print(f"{name}: unavailable (fp4_comm.get_codec does not know its codec)")
    if args.list:
        for run_name, run_argv in todo:
            print(run_name, shlex.join([sys.executable, "-m", MODULE, *run_argv]))
        return 0
    sweep = Sweep(args, todo)
    sweep.run()
    return sweep.report()


if __name__ == "__main__":
    sys.exit(main())
