"""Tensor-, sequence- or pipeline-parallel training of k ranks emulated in one process on one
device: the runs of ``tp_train`` bit for bit, without k devices.

    python -m fp4_train.experiments.emulated_tp --tp 4 --codec fp4quant-g64 --seed 0 \\
        --steps 2000 --tokens-per-step 16384 --model qwen-125m --out DIR

Every ``tp_train`` argument applies (codecs and policies, ``--sequence-parallel``,
``--parallel pp``, model, data, schedule), with these defaults instead of its own: sequence
length 1024, validation every 200 steps on 8 batches, payload statistics every 100 steps,
throughput averaged after 10 steps.  Added: ``--tp K`` (the emulated tensor-parallel ranks;
``--tp 1`` is the plain model on one device, no emulation; ``--parallel pp`` emulates its two
stages whatever ``--tp`` says), ``--tokens-per-step`` (sets ``--batch`` to it over the sequence
length), ``--seeds`` (several runs, one after another, in this process; runs whose summary is
in ``--out`` are skipped unless ``--force``).  ``tp_train``'s ``--checkpoint`` and
``--stop-at-s`` run it in pieces (exit status 75: stopped, resumable; with several seeds each
run keeps its checkpoint in ``<checkpoint>/<run name>``); the summary of a resumed run is the
whole run's, ``wall_s`` summed over its ``pieces``.

How.  ``tp_train.Runner`` with its parallel group replaced: an
``fp4_comm.emulated.EmulatedTensorParallelGroup`` over ``fp4_comm.reference.EmulatedRanks``
(tensor and sequence parallelism: one model holding every rank's shards, each shard's partial
product computed as its rank computes it, the collectives run by the ranks' own code on
threads), or for the pipeline both stages' models joined by ``emulated.pipeline_boundary``.
The same model code, data, initialization, schedule and optimizer as the k-process run, the
same call counts (stochastic-rounding steps) and error-feedback residuals per rank: the tests
check the losses and weights against gloo processes, bit for bit.

Output: ``<out>/<name>.json``, a compact summary (a few kB): final validation loss, the
evaluations, the training-loss curve as at most ``--curve-points`` window means, tokens/s,
wall seconds of the run, the GPU memory it took at most, the payloads' RMS and SQNR per site
over the last half of training, device, commit and date.  ``emulated_summary`` builds the
table from a folder of them.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

from fp4_comm import TensorParallelGroup
from fp4_comm.emulated import EmulatedTensorParallelGroup, is_per_rank, pipeline_boundary
from fp4_comm.reference import EmulatedRanks

from . import tp_train
from .checkpoint import EX_TEMPFAIL
from .records import finite_or_none, metadata, write_json
from .transformer import lm_loss

# tp_train arguments whose defaults the study changes (given ones come after and win)
DEFAULTS = ["--seq-len", "1024", "--eval-every", "200", "--eval-batches", "8",
            "--stats-every", "100", "--timing-warmup", "10"]  # fmt: skip
CURVE_POINTS = 200
SUMMARY_KIND = "emulated_tp_summary"


class EmulatedRunner(tp_train.Runner):
    """``tp_train.Runner`` of all ranks in this process (``tp`` tensor-parallel ranks, or the
    two pipeline stages)."""

    def __init__(self, args, device, vocab, tp):
        self.tp = tp
        super().__init__(args, None, device, vocab)
        self.world_size = 1  # one process, one device: throughput is per device

    def build(self, comm):
        args, k = self.args, 2 if self.pp else self.tp
        self.ranks = EmulatedRanks(k, self.device, graph_cache=tp_train.graph_cache_bounds(args))
        if args.cuda_graph:
            raise SystemExit("--cuda-graph: not with emulated ranks (their collectives run on "
                             "threads)")  # fmt: skip
        if self.pp:
            self.par = TensorParallelGroup(None)
            self.stages = [tp_train.build_model(args, self.par, self.vocab, self.stage_layers(s),
                                                first=s == 0, last=s == 1)
                           for s in (0, 1)]  # fmt: skip
            self.model = nn.ModuleList(self.stages)
        else:
            self.par = EmulatedTensorParallelGroup(
                self.ranks, self.forward, self.backward, seed=args.seed,
                sequence_parallel=args.sequence_parallel,
            )  # fmt: skip
            self.model = tp_train.build_model(args, self.par, self.vocab)

    def _pp_step(self, inputs, targets, train=True, codec=None):
        """``tp_train.Runner._pp_step`` of both stages: GPipe order, the boundary emulated."""
        m = self.args.microbatches if train else 1
        fwd, bwd = self.forward, self.backward
        codec = fwd.codec if codec is None else codec
        wire_dtype = self.boundary_dtype(codec)
        kw = {"grad_codec": bwd.codec, "stats": self.stats}
        if bwd.rounding is not None:
            kw["grad_rounding"] = bwd.rounding
        losses = []
        for x, y in zip(inputs.chunk(m, dim=1), targets.chunk(m, dim=1), strict=True):
            with self._ctx():
                h = self.stages[0](x).to(wire_dtype)
            h = pipeline_boundary(h, self.ranks, 0, 1, codec, fwd.rounding or "nearest",
                                  self.args.seed, **kw)  # fmt: skip
            with self._ctx():
                losses.append(lm_loss(self.stages[1](h), y, self.par))
        if train:
            for loss in losses:
                # the last stage's backward of micro-batch i, its gradient across the
                # boundary, then the first stage's backward of micro-batch i
                self.scaled(loss / m).backward()
            self.unscale_grads()
        return torch.stack([v.detach() for v in losses]).mean()

    def communicators(self):
        return self.ranks.comms

    def rank_values(self, loss):
        if is_per_rank(loss):
            return [float(v) for v in loss]
        return [float(loss)]

    def mean_over_ranks(self, values):
        return sum(values) / len(values)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], add_help=False, allow_abbrev=False
    )  # --seed is tp_train's, not --seeds
    ap.add_argument("--tp", type=int, default=4, help="emulated tensor-parallel ranks")
    ap.add_argument("--tokens-per-step", type=int, default=None)
    ap.add_argument("--seeds", type=int, nargs="+", default=None,
                    help="several runs in this process (default: --seed)")  # fmt: skip
    ap.add_argument("--curve-points", type=int, default=CURVE_POINTS)
    ap.add_argument("--force", action="store_true", help="rerun runs whose summary exists")
    ap.add_argument("-h", "--help", action="store_true")
    own, rest = ap.parse_known_args(argv)
    if own.help:
        ap.print_help()
        print("\nand every argument of fp4_train.experiments.tp_train:\n")
        tp_train.parse_args(["--help"])
    args = tp_train.parse_args(DEFAULTS + rest)
    if own.tp < 1:
        ap.error(f"--tp {own.tp}: at least 1")
    if own.tokens_per_step is not None:
        if own.tokens_per_step < 1 or own.tokens_per_step % args.seq_len:
            ap.error(f"--tokens-per-step {own.tokens_per_step}: a positive multiple of "
                     f"--seq-len {args.seq_len}")  # fmt: skip
        args.batch = own.tokens_per_step // args.seq_len
        tp_train.check_run_arguments(ap, args)  # the batch again (--microbatches divides it)
    if not 1 <= own.curve_points:
        ap.error("--curve-points: at least 1")
    if args.name is not None:
        ap.error("--name: emulated runs are named from their configuration (model, layout, "
                 "policy, seed), which emulated_summary reads back; leave it out")  # fmt: skip
    tp_train.check_seeds(ap, own.seeds)
    if args.parallel == "tp":  # (--parallel pp emulates its two stages whatever --tp says)
        tp_train.check_ranks(ap, args, own.tp, f"--tp {own.tp}")
    return own, args


def layout(args, tp):
    """ "tp4", "tp4-sp", "pp2" or "tp1" (the plain model)."""
    if args.parallel == "pp":
        return "pp2"
    return f"tp{tp}" + ("-sp" if args.sequence_parallel and tp > 1 else "")


def run_name(args, tp):
    """``<model>_<layout>_<codec and policy>_s<seed>``, e.g. qwen-125m_tp4_fp4quant-g64_s0."""
    name = tp_train.run_name(args)  # "<tp_train layout>_<policy>_s<seed>"
    policy = name.split("_", 1)[1]
    return f"{args.model}_{layout(args, tp)}_{policy}"


def _window_means(steps, points):
    """The training loss as at most ``points`` means over consecutive windows of steps:
    [[mean step, mean loss], ...]."""
    n = len(steps)
    size = max(1, -(-n // points))
    out = []
    for i in range(0, n, size):
        window = steps[i : i + size]
        out.append([sum(s["step"] for s in window) / len(window),
                    sum(s["loss"] for s in window) / len(window)])  # fmt: skip
    return out


def _wire_means(wire, steps):
    """Per (site, direction, op): RMS and SQNR (dB) averaged over the logged steps of the
    last half of training."""
    acc = {}
    for w in wire:
        if w["step"] < steps / 2:
            continue
        key = (w["site"], w["direction"], w["op"])
        a = acc.setdefault(key, [0.0, 0.0, 0, 0])
        a[0] += w["rms"]
        a[2] += 1
        if w["sqnr_db"] is not None:
            a[1] += w["sqnr_db"]
            a[3] += 1
    return [{"site": s, "direction": d, "op": op, "rms": a[0] / a[2],
             "sqnr_db": finite_or_none(a[1] / a[3]) if a[3] else None}
            for (s, d, op), a in sorted(acc.items())]  # fmt: skip


def summarize(record, args, tp, wall_s, curve_points=CURVE_POINTS):
    """The compact summary of one run's ``tp_train`` record."""
    s = record["summary"]
    tokens_per_step = args.batch * args.seq_len
    return {
        "kind": SUMMARY_KIND,
        "name": run_name(args, tp),
        "model": args.model,
        "layout": layout(args, tp),
        "emulated_ranks": 2 if args.parallel == "pp" else tp,
        "codec": record["codec"],
        "grad_codec": record["grad_codec"],
        "grad_rounding": record["grad_rounding"],
        "seed": args.seed,
        "config": record["config"],
        "vocab": record["vocab"],
        "tokens_per_step": tokens_per_step,
        "final_val_loss": s["final_val_loss"],
        "final_train_loss": s["final_train_loss"],
        "final_evals": s["final_evals"],
        "evals": [[e["step"], e["val_loss"]] for e in record["evals"]],
        "train_loss_curve": _window_means(record["steps"], curve_points),
        "step_ms": s["step_ms"],
        "tokens_per_s": tokens_per_step / (s["step_ms"] / 1e3),
        "tflops": s["tflops_per_rank"],
        "wall_s": wall_s,
        # the sweep's --jobs; emulated_sweep replaces it with the processes it saw on the GPU
        "concurrent_runs": int(os.environ.get("FP4_CONCURRENT_RUNS", "1")),
        "wire": _wire_means(record["wire"], args.steps),
    }


def make_runner(tp):
    """``tp_train.train``'s runner: the emulated one, or for ``tp`` 1 the plain model."""

    def make(args, device, vocab):
        if tp == 1 and args.parallel != "pp":
            return tp_train.Runner(args, None, device, vocab)
        return EmulatedRunner(args, device, vocab, tp)

    return make


def _device(args):
    if args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def run(args, tp, curve_points=CURVE_POINTS):
    """One run: its compact summary, or None where it stopped at ``--stop-at-step`` /
    ``--stop-at-s`` with its checkpoint written (``tp_train.train``)."""
    device = _device(args)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    # --tp fixes the run's bits (not --parallel pp's, which emulates its two stages)
    options = {} if args.parallel == "pp" else {"tp": tp}
    record = tp_train.train(args, None, device, make_runner(tp), options)
    if record is None:
        return None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    # wall seconds over every piece of a resumed run (each piece's start-up included)
    summary = summarize(record, args, tp, record["wall_s"], curve_points)
    summary["pieces"] = record["pieces"]
    # what a run holds of the GPU at most, over all its pieces: how many fit on it at once
    summary["max_memory_gb"] = record["max_memory_gb"]
    summary["meta"] = metadata(str(device))
    return summary


def checkpoint_path(path, name, several):
    """Where run ``name`` keeps its checkpoint: ``--checkpoint`` (``path``) itself, or with
    several seeds a folder of that name inside it."""
    if path is None or not several:
        return path
    if path.suffix == ".pt":
        raise SystemExit(f"--checkpoint {path}: with several --seeds give a folder (each run "
                         "keeps its checkpoint in <folder>/<run name>)")  # fmt: skip
    return path / name


def main(argv=None):
    own, args = parse_args(argv)
    summaries, seeds, base = [], own.seeds or [args.seed], args.checkpoint
    for seed in seeds:
        args.seed = seed
        name = run_name(args, own.tp)
        path = None if args.out is None else args.out / f"{name}.json"
        if path is not None and path.exists() and not own.force:
            print(f"{name}: {path} exists, skipped (--force reruns it)", flush=True)
            continue
        args.checkpoint = checkpoint_path(base, name, len(seeds) > 1)
        summary = run(args, own.tp, own.curve_points)
        if summary is None:  # stopped at its limit, the checkpoint written: resumable
            raise SystemExit(EX_TEMPFAIL)
        if path is not None:
            write_json(path, summary)
        if not args.quiet:
            print(f"{name}: val loss {summary['final_val_loss']:.4f}, {summary['step_ms']:.1f} "
                  f"ms/step, {summary['tokens_per_s']:.0f} tokens/s, {summary['wall_s']:.0f} s",
                  flush=True)  # fmt: skip
        summaries.append(summary)
    return summaries


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
