"""Tensor- or pipeline-parallel training of a small decoder-only transformer whose activations
and activation gradients cross ranks through fp4_comm (FP4 or bf16 on the wire).

    torchrun --standalone --nproc-per-node 2 -m fp4_train.experiments.tp_train \\
        --codec fp4quant --group-size 64 --steps 2000 --out docs/results/tp_runs

Model (``--model``): ``transformer.Transformer`` (byte-level, ``--layers`` blocks of width
``--d-model``), or ``qwen.Qwen``, a Qwen2-style decoder (``qwen`` of those dimensions and
``--kv-heads``, ``--ffn``; ``qwen-125m``, ``qwen-600m``: presets).  Parallelism
(one process per rank, ``--parallel``):

- ``tp`` (default): Megatron tensor parallelism over all ranks through a
  ``fp4_comm.TensorParallelGroup`` (four all-reduces per layer and step: the gradient of each
  block input, the sum of each block output).  ``--sequence-parallel`` splits the residual
  stream along the sequence instead (all-gather / reduce-scatter pairs; the replicated
  LayerNorm, embedding and head gradients are then summed over the ranks in float32).
- ``pp``: two pipeline stages (the first half of the layers with the embedding, the second
  with the head), GPipe order over ``--microbatches``; the residual stream crosses forward and
  its gradient backward through ``fp4_comm.pipeline``.

Communication.  The forward values: ``--codec`` (``none``: bfloat16 values, the baseline;
``none-float32``; ``nvfp4``; ``mxfp4``; ``fp4quant`` with ``--group-size`` and
``--no-hadamard``, or spelled ``fp4quant-g16``, ``fp4quant-g64-nohad``; ``native``:
torch.distributed's own all-reduce, TP only; any other name ``fp4_comm.get_codec`` knows),
``--rounding``, ``--error-feedback``.  The
gradients: ``--grad-codec`` (default: ``--codec``), ``--grad-rounding`` (default: ``--rounding``
for the summed gradients of TP; stochastic for the residual stream's gradient, which the
pipeline boundary and SP's all-gather carry), ``--grad-error-feedback`` (default:
``--error-feedback``).  Error feedback applies where the collective is a sum.
``--graph-cache-gb``: the GiB of inputs that the CUDA graphs replaying fp4_comm's collectives
may stand for (``graph_cache_bounds``; each error-feedback site needs a graph of its own, so
with error feedback the default is ``EF_GRAPH_CACHE_GB``; their pools take 4 to 6 times it).

Data: ``--data`` (one or more files; default the Jargon File) read as ``--data-format``
(``DATA_FORMATS``; ``bytes``: ``corpus.load_corpus``, vocabulary 256; ``tokens``: the BPE
corpus folder that ``build_corpus`` writes, ``corpus.load_tokens``); the seed fixes
initialization, batch order and the rounding words, whatever the codec.

Per step it records loss, step time, time inside fp4_comm calls (``TimedCommunicator``), tokens/s
per rank and model TFLOP/s per rank; every ``--stats-every`` steps the RMS and SQNR of every
compressed payload (``WireStats``), averaged per site and direction.  The final checkpoint is
evaluated as trained and with the codecs of ``--eval-codecs`` in place of the forward codec
(default ``none-float32``: an exact boundary in float32; the pipeline's activation crosses
in float32 then, under bf16 autocast too, where the other codecs take it in bf16).  Rank 0
writes ``<out>/<name>.json`` and ``.csv``; ``tp_summary`` and ``boundary_study`` read the JSON
(or its gzip copy, ``<name>.json.gz``: ``records.RECORD_SUFFIXES``).

Long runs in pieces: ``--checkpoint PATH`` is resumed from where it exists and written at a
stop, every ``--checkpoint-every-s`` and at the end; ``--stop-at-s`` (``--stop-at-step``)
stops with it written and exit status 75; the resumed run gives the bits of one that was not
stopped (on a GPU with ``--deterministic``).  ``checkpoint`` says what it holds.
"""

from __future__ import annotations

import argparse
import contextlib
import lzma
import math
import os
import re
import time
from pathlib import Path

import torch
import torch.distributed as dist

import fp4_comm
import fp4_kernels
from fp4_comm import TensorParallelGroup, TimedCommunicator, WirePolicy, pipeline
from fp4_comm.codecs import ROUNDINGS
from fp4_comm.tensor_parallel import RESIDUAL_GRAD_ROUNDING

from . import checkpoint, qwen
from .corpus import (
    DEFAULT_CORPUS,
    DEFAULT_TOKENS,
    VOCAB,
    load_corpus,
    load_tokens,
    split,
    train_batch,
    val_batches,
)
from .nonfinite import check_finite
from .records import finite_or_none, metadata, plain, unusable_path, write_csv, write_json
from .transformer import Transformer, lm_loss, training_flops

CODECS = ("none", "none-float32", "nvfp4", "mxfp4", "fp4quant", "native")
MODELS = ("byte", "qwen", *(f"qwen-{size}" for size in qwen.SIZES))
# dense bf16 peak of the GPUs the studies ran on, TFLOP/s (NVIDIA's data sheets), for MFU
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4}
GRAPH_WARMUP = 3  # eager steps before the capture (fewer than --timing-warmup's default 5)
#: --graph-cache-gb's default with error feedback: the GiB of inputs that fp4_comm's CUDA graphs
#: of the collectives may stand for (their pools take about 4 to 6 times that where filled).
#: Every error-feedback name is a kind of call of its own, so each call site needs a graph:
#: the 12-layer 125 M model has 48 (1.2 GB of inputs a rank at 16 384 tokens; emulated ranks'
#: graphs count one rank's input, and their pools hold every rank's buffers).
EF_GRAPH_CACHE_GB = 16.0
#: The graphs the cache keeps under --graph-cache-gb: not the bound (the bytes are).
GRAPH_CACHE_GRAPHS = 4096


# ------------------------------------------------------------------------------------ args


def parse_args(argv=None, world_size=None):
    """The run's arguments, checked (``ap.error`` naming the option); ``world_size``: the
    processes of the run where known (``main``: torchrun's ``WORLD_SIZE``), whose ranks the
    model's heads and widths must split over."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a = ap.add_argument
    # fmt: off
    a("--parallel", choices=("tp", "pp"), default="tp")
    a("--sequence-parallel", action="store_true", help="TP with the sequence split (Megatron SP)")
    _wire_arguments(a)
    _model_arguments(a)
    a("--seq-len", type=int, default=256)
    a("--batch", type=int, default=16, help="sequences per step (the whole model replica)")
    a("--microbatches", type=int, default=2, help="pipeline micro-batches per step")
    a("--steps", type=int, default=200)
    a("--lr", type=float, default=1e-3)
    a("--optimizer", choices=("adamw", "sgd"), default="adamw")
    a("--warmup", type=int, default=None, help="linear warm-up steps (default: steps // 10)")
    a("--seed", type=int, default=0, help="initialization, batch order and rounding words")
    a("--data", type=Path, nargs="+", default=[DEFAULT_CORPUS],
      help="text files (.gz read as gzip), concatenated")
    a("--data-format", choices=sorted(DATA_FORMATS), default="bytes",
      help="how --data becomes tokens (DATA_FORMATS): bytes = byte-level, vocabulary 256; "
           "tokens = a build_corpus folder (BPE; default .data/corpus), split by document; "
           "random = uniform ids of --vocab, for timing (nothing to learn)")
    a("--vocab", type=int, default=16384, help="--data-format random: the vocabulary")
    a("--max-bytes", type=int, default=None, help="use only the first N bytes of the corpus")
    a("--val-fraction", type=float, default=0.1)
    a("--eval-every", type=int, default=50)
    a("--eval-batches", type=int, default=8)
    a("--eval-codecs", type=_codec_spec, nargs="*", default=["none-float32"],
      help="also evaluate the final checkpoint with these forward codecs")
    a("--stats-every", type=int, default=10, help="RMS/SQNR of every payload every N steps")
    a("--dtype", choices=("float32", "bfloat16"), default=None,
      help="compute dtype (autocast); default bfloat16 on CUDA, float32 on the CPU")
    a("--device", choices=("auto", "cpu", "cuda"), default="auto")
    a("--threads", type=int, default=1, help="torch CPU threads per process")
    a("--timing-warmup", type=int, default=5, help="steps left out of the throughput means")
    a("--name", default=None, help="run name (default: from the configuration)")
    a("--out", type=Path, default=None, help="folder for <name>.json/.csv (rank 0)")
    a("--cuda-graph", action=argparse.BooleanOptionalAction, default=False,
      help="TP, GPU: capture the whole training step (forward, backward with its collectives, "
           "AdamW) in one CUDA graph after a few eager steps, and replay it; hides the host "
           "time of the collectives' launches (nearest rounding only)")
    a("--graph-cache-gb", type=float, default=None,
      help="GPU collectives: the GiB of inputs that fp4_comm's CUDA graphs may stand for (a "
           "graph per kind of call, error-feedback site included; pools about 4-6x that); "
           f"default: {EF_GRAPH_CACHE_GB:g} with error feedback, fp4_comm's default (8 graphs, "
           "0.5) without")
    a("--check-finite", action="store_true",
      help="debugging: stop at the first torch operation that makes a NaN or an infinity from "
           "finite values, naming it and where it was called (slow: every op synchronizes)")
    a("--quiet", action="store_true")
    # fmt: on
    _checkpoint_arguments(a)
    args = ap.parse_args(argv)
    _model_shape(ap, args)
    _check_checkpoint_arguments(ap, args)
    gb = args.graph_cache_gb
    if gb is not None and not (math.isfinite(gb) and gb * 2**30 >= 1):
        ap.error(f"--graph-cache-gb {gb}: a finite number of GiB, more than 0")
    check_run_arguments(ap, args)
    if world_size is not None:
        check_ranks(ap, args, world_size, f"the {world_size} processes (torchrun's WORLD_SIZE)")
    return args


#: --layers, --d-model, --heads where not given (--model byte and qwen; a qwen-<size> preset
#: fixes its own, but the run's arguments record these)
MODEL_SHAPE = {"layers": 4, "d_model": 256, "heads": 4}


def _wire_arguments(a):
    """The codecs, roundings, error feedback and loss scale of the two directions."""
    # fmt: off
    a("--codec", default="none", type=_codec_spec,
      help=f"forward values: one of {', '.join(CODECS)}, fp4quant-g<G>[-nohad], or a name "
           "fp4_comm.get_codec knows")
    a("--group-size", type=int, default=64, help="FP4Quant group size g (--codec fp4quant)")
    a("--no-hadamard", action="store_true", help="FP4Quant without the Walsh-Hadamard transform")
    a("--rounding", choices=ROUNDINGS, default="nearest", help="forward values")
    a("--error-feedback", action="store_true", help="residual per forward sum (TP)")
    a("--grad-codec", default=None, type=_codec_spec, help="gradients (default: --codec)")
    a("--grad-rounding", choices=ROUNDINGS, default=None,
      help="gradients (default: --rounding for sums, stochastic for the residual stream's)")
    a("--grad-error-feedback", action=argparse.BooleanOptionalAction, default=None,
      help="residual per gradient sum (TP; default: --error-feedback)")
    a("--loss-scale", type=_loss_scale, default=1.0,
      help="a static loss scale, a power of two: the loss times S is backpropagated and the "
           "gradients times 1/S reach the optimizer, so the gradients on the wire are S times "
           "larger (for a gradient codec whose scale format is narrow: TAH-Quant's fp16 "
           "scales; below 1, smaller); every other wire, and bf16, gives the same bits as "
           "without it")
    # fmt: on


def _model_arguments(a):
    # fmt: off
    a("--model", choices=MODELS, default="byte",
      help="byte: transformer.Transformer (LayerNorm, GELU, no positions); qwen: qwen.Qwen of "
           "--layers/--d-model/--heads/--kv-heads/--ffn; qwen-<size>: a qwen.SIZES preset")
    a("--layers", type=int, default=None, help=f"default {MODEL_SHAPE['layers']}")
    a("--d-model", type=int, default=None, help=f"default {MODEL_SHAPE['d_model']}")
    a("--heads", type=int, default=None, help=f"default {MODEL_SHAPE['heads']}")
    a("--kv-heads", type=int, default=None, help="qwen: key/value heads (default: --heads)")
    a("--ffn", type=int, default=None, help="qwen: SwiGLU width (default: 8/3 d, to 64)")
    # fmt: on


def _model_shape(ap, args):
    """``ap.error`` where a ``--model qwen-<size>`` preset or ``--model byte`` is given sizes
    it would ignore; then ``MODEL_SHAPE``'s defaults of the sizes not given."""
    if args.model.startswith("qwen-"):
        given = [f"--{name.replace('_', '-')}" for name in (*MODEL_SHAPE, "kv_heads", "ffn")
                 if getattr(args, name) is not None]  # fmt: skip
        if given:
            ap.error(
                f"{' / '.join(given)}: --model {args.model} is a preset of fixed sizes "
                "(qwen.SIZES); leave them out, or give --model qwen and the sizes"
            )
    if args.model == "byte":
        given = [f"--{n.replace('_', '-')}" for n in ("kv_heads", "ffn") if getattr(args, n)]
        if given:
            ap.error(f"{' / '.join(given)}: qwen sizes; --model byte has as many key/value "
                     "heads as heads and an MLP of 4 x --d-model")  # fmt: skip
    for name, value in MODEL_SHAPE.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


#: --seed's range: the batch order draws from seed * 1_000_003 + step as a 64-bit seed
SEED_LIMIT = 2**32


def check_seeds(ap, seeds):
    """``ap.error`` unless ``seeds`` (a --seeds list of the sweeps, or None) holds each seed
    once, each in [0, SEED_LIMIT) (tp_train's --seed)."""
    for seed in seeds or ():
        if not 0 <= seed < SEED_LIMIT:
            ap.error(f"--seeds: {seed} is not in [0, 2**32) (tp_train's --seed)")
    if seeds is not None and len(set(seeds)) != len(seeds):
        ap.error(f"--seeds {' '.join(map(str, seeds))}: a seed given twice")


_AT_LEAST_1 = ("layers", "d_model", "heads", "seq_len", "batch", "microbatches", "steps",
               "eval_batches", "threads", "group_size")  # fmt: skip
_AT_LEAST_1_IF_GIVEN = ("kv_heads", "ffn", "max_bytes")
_AT_LEAST_0 = ("warmup", "eval_every", "stats_every", "timing_warmup")


def check_run_arguments(ap, args):
    """The sizes, counts and rates of a run in their ranges, and the combinations that mean
    something (``ap.error`` naming the option): a zero batch trained to NaN, a negative
    --eval-every evaluated every step, micro-batches that do not divide the batch scaled the
    gradient.  Called again by a caller that changes ``args`` (``emulated_tp``)."""
    for names, least in ((_AT_LEAST_1, 1), (_AT_LEAST_1_IF_GIVEN, 1), (_AT_LEAST_0, 0)):
        for name in names:
            value = getattr(args, name)
            if value is not None and value < least:
                ap.error(f"--{name.replace('_', '-')} {value}: at least {least}")
    if not (math.isfinite(args.lr) and args.lr >= 0):
        ap.error(f"--lr {args.lr}: a finite number >= 0")
    if not 0 < args.val_fraction < 1:
        ap.error(f"--val-fraction {args.val_fraction}: between 0 and 1 (both excluded)")
    if not 0 <= args.seed < SEED_LIMIT:
        ap.error(f"--seed {args.seed}: in [0, 2**32)")
    if args.parallel == "pp":
        if args.sequence_parallel:
            ap.error("--sequence-parallel: tensor parallelism's; not with --parallel pp")
        if args.batch % args.microbatches:
            ap.error(f"--microbatches {args.microbatches}: must divide --batch {args.batch} "
                     "(each micro-batch's loss is the batch's mean over equal parts)")  # fmt: skip
        if "native" in (args.codec, args.grad_codec):
            ap.error("--codec native / --grad-codec native: torch.distributed's all-reduce, "
                     "tensor parallelism's (--parallel tp); the pipeline sends")  # fmt: skip
        if args.error_feedback or args.grad_error_feedback:
            ap.error("--error-feedback / --grad-error-feedback correct sums (--parallel tp); "
                     "the pipeline's sends have none")  # fmt: skip
    if args.data_format == "tokens" and (len(args.data) > 1 or args.max_bytes is not None):
        ap.error("--data-format tokens: one --data folder (a build_corpus corpus), no "
                 "--max-bytes")  # fmt: skip
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (--device cpu, or auto)")
    for option, path, folder in (("--out", args.out, True),
                                 ("--checkpoint", args.checkpoint, False)):  # fmt: skip
        where = unusable_path(path, folder)
        if where:
            ap.error(f"{option} {path}: {where}")
    if args.model == "byte" and args.d_model % args.heads:
        ap.error(f"--d-model {args.d_model}: a multiple of --heads {args.heads}")
    if args.model == "byte" and args.data_format == "random" and args.vocab != VOCAB:
        ap.error(f"--vocab {args.vocab}: --model byte has a byte vocabulary ({VOCAB}); give "
                 f"--vocab {VOCAB}, or a --model qwen")  # fmt: skip
    if args.model == "qwen":
        heads, kv_heads = args.heads, args.kv_heads or args.heads
        if args.d_model % (2 * heads):
            ap.error(f"--d-model {args.d_model}: a multiple of 2 x --heads {heads} (--model "
                     "qwen: heads of an even width, RoPE rotates pairs)")  # fmt: skip
        if heads % kv_heads:
            ap.error(f"--kv-heads {kv_heads}: must divide --heads {heads} (grouped-query "
                     "attention)")  # fmt: skip
    if "fp4quant" in (args.codec, args.grad_codec, *args.eval_codecs):
        try:
            fp4_kernels.FP4Quant(args.group_size, hadamard=not args.no_hadamard)
        except ValueError as err:
            ap.error(f"--group-size {args.group_size}: {err}")
    _check_roundings(ap, args)


def _check_roundings(ap, args):
    """A codec that rounds to nearest only (TAH-Quant's) with stochastic rounding asked for,
    or given by default (the residual stream's gradient, ``grad_rounding``), or evaluated
    with it (``--eval-codecs``): refused here, naming the option, rather than by the first
    collective of the run or its last evaluation."""
    grad_codec, residual = grad_codec_spec(args), residual_gradient(args)
    for option, spec, rounding, given in (
        ("--rounding", args.codec, args.rounding, True),
        ("--grad-rounding", grad_codec, grad_rounding(args, residual),
         args.grad_rounding is not None),
    ):  # fmt: skip
        if rounding != "nearest" and _nearest_only(spec, args):
            why = "" if given else (" (the default for the residual stream's gradient)"
                                    if residual else " (--rounding's, the default)")  # fmt: skip
            ap.error(f"{option} {rounding}{why}: {spec} rounds to nearest only; pass "
                     f"{option} nearest")  # fmt: skip
    for spec in args.eval_codecs:  # evaluated with the run's forward rounding
        if args.rounding != "nearest" and _nearest_only(spec, args):
            ap.error(f"--eval-codecs {spec}: rounds to nearest only, and an evaluation keeps "
                     f"the run's --rounding {args.rounding}; leave {spec} out")  # fmt: skip


def _nearest_only(spec, args):
    """Whether the codec of ``spec`` rounds to nearest only (``Codec.nearest_only``)."""
    return not _exact(spec) and getattr(fp4_comm.get_codec(codec_of(spec, args)),
                                        "nearest_only", False)  # fmt: skip


def check_ranks(ap, args, ranks, what):
    """``ap.error`` where the run cannot be split over ``ranks`` ranks (``what``: the option
    that sets them, for the message): the pipeline has two stages; tensor parallelism splits
    the heads and the MLP's width, and with --sequence-parallel the sequence, into equal parts
    per rank.  Called before anything is loaded or built."""
    if args.parallel == "pp":
        if ranks != 2:
            ap.error(f"--parallel pp: two pipeline stages, one a rank; not {what}")
        return
    if ranks == 1:
        return
    if args.model == "byte":
        sizes = (("--heads", args.heads), ("the MLP width 4 x --d-model", 4 * args.d_model))
    else:
        cfg = qwen_config(args, VOCAB)
        given = args.model == "qwen"
        sizes = [(f"--{name}" if given else f"{name} of --model {args.model}", n)
                 for name, n in (("heads", cfg.heads), ("kv-heads", cfg.kv_heads),
                                 ("ffn", cfg.ffn))]  # fmt: skip
    for name, n in sizes:
        if n % ranks:
            ap.error(f"{name} ({n}): must divide by {what}, each rank holding an equal part")
    if args.sequence_parallel and args.seq_len % ranks:
        ap.error(f"--seq-len {args.seq_len}: a multiple of {what} with --sequence-parallel "
                 "(each rank holds an equal part of the sequence)")  # fmt: skip


def graph_cache_bounds(args):
    """The ``graph_cache`` bounds of this run's fp4_comm communicators (``--graph-cache-gb``):
    None (fp4_comm's default) where neither the option nor error feedback is given."""
    gb = args.graph_cache_gb
    if gb is None:
        if not (args.error_feedback or args.grad_error_feedback):
            return None
        gb = EF_GRAPH_CACHE_GB
    return (GRAPH_CACHE_GRAPHS, int(gb * 2**30))


def _checkpoint_arguments(a):
    # fmt: off
    a("--checkpoint", type=Path, default=None,
      help="resume from this checkpoint where it exists, and write it (a folder of one file "
           "per process, or with one process a file ending in .pt): at --checkpoint-every-s, "
           "at a stop and at the end")
    a("--checkpoint-every-s", type=float, default=0.0,
      help="write the checkpoint every S seconds (0: only at a stop and at the end)")
    a("--stop-at-step", type=int, default=None,
      help="stop after N steps (the record's steps 0 .. N-1) with the checkpoint written")
    a("--stop-at-s", type=float, default=None,
      help="stop after the first step that ends S seconds or more after the start, with the "
           "checkpoint written; the entry point then exits with status 75 (resumable)")
    a("--deterministic", action="store_true",
      help="deterministic GPU kernels (torch.use_deterministic_algorithms, a fixed cuBLAS "
           "workspace, the math attention): slower, but a run and its resumed pieces give "
           "the same bits (the CPU is deterministic without it)")
    # fmt: on


def _check_checkpoint_arguments(ap, args):
    # (written so that NaN fails: every comparison with it is false)
    if not (math.isfinite(args.checkpoint_every_s) and args.checkpoint_every_s >= 0):
        ap.error(f"--checkpoint-every-s {args.checkpoint_every_s}: a finite number >= 0")
    if args.stop_at_step is not None and args.stop_at_step < 1:
        ap.error(f"--stop-at-step {args.stop_at_step}: at least 1")
    if args.stop_at_s is not None and not (math.isfinite(args.stop_at_s) and args.stop_at_s > 0):
        ap.error(f"--stop-at-s {args.stop_at_s}: a finite number > 0")
    stops = args.stop_at_step is not None or args.stop_at_s is not None
    if args.checkpoint is None and (stops or args.checkpoint_every_s):
        ap.error("--stop-at-step / --stop-at-s / --checkpoint-every-s write a checkpoint: "
                 "give it a place with --checkpoint PATH")  # fmt: skip
    ckpt = args.checkpoint
    if ckpt is not None and ckpt.suffix != ".pt" and ckpt.exists() and not ckpt.is_dir():
        ap.error(f"--checkpoint {ckpt}: a file that does not end in .pt; the checkpoint "
                 "is a folder (a file per process) or a file ending in .pt: give another "
                 "path")  # fmt: skip
    if ckpt is not None and ckpt.suffix == ".pt" and ckpt.is_dir():
        ap.error(f"--checkpoint {ckpt}: a folder ending in .pt; a path ending in .pt is the "
                 "checkpoint file itself: give another path")  # fmt: skip
    if args.checkpoint is not None and args.cuda_graph:
        ap.error("--checkpoint: not with --cuda-graph (a resumed run would capture its graph "
                 "without the eager warm-up steps); run eagerly to checkpoint")  # fmt: skip


def _codec_spec(spec):
    if spec in CODECS:
        return spec
    try:
        if spec.startswith("fp4quant-"):
            g, hadamard = parse_fp4quant(spec)
            fp4_kernels.FP4Quant(g, hadamard=hadamard)  # the group size FP4Quant takes
        elif spec.startswith("fp4quant"):
            parse_fp4quant(spec)
        else:
            fp4_comm.get_codec(spec)  # any codec fp4_comm knows by name
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return spec


def _loss_scale(text):
    """``--loss-scale``: a power of two from 2**-64 to 2**64 (the scaling is then exact: every
    product and quotient of the scaled gradients rounds as the unscaled one, barring over- or
    underflow).  Below 1 it makes the gradients smaller: an experiment's way to put a small
    model's gradients where a larger one's are."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (2.0**-64 <= value <= 2.0**64 and math.frexp(value)[0] == 0.5):
        raise argparse.ArgumentTypeError(
            f"{text!r}: a power of two from 2**-64 to 2**64 (e.g. 65536, torch GradScaler's "
            "first scale), which scales the gradients exactly"
        )
    return value


def loss_scale_label(scale):
    """A loss scale as run names spell it: "65536", or "1by64" for 1/64."""
    return f"{scale:.0f}" if scale >= 1 else f"1by{1 / scale:.0f}"


# The loss scale's part of a run's name (``run_name``), last before the seed: "_ls" and
# ``loss_scale_label``'s spelling.
LOSS_SCALE_SUFFIX = re.compile(r"_ls(\d+|1by\d+)$")


def parse_fp4quant(spec):
    """``fp4quant-g<G>[-nohad]`` -> (G, hadamard)."""
    parts = spec.split("-")
    if parts[0] != "fp4quant" or len(parts) not in (2, 3) or not parts[1][1:].isdigit() \
            or parts[1][0] != "g" or parts[2:] not in ([], ["nohad"]):  # fmt: skip
        raise ValueError(f"codec {spec!r}: use one of {', '.join(CODECS)} or fp4quant-g<G>[-nohad]")
    return int(parts[1][1:]), len(parts) == 2


def codec_label(spec, args):
    """The name a codec goes by in run names and tables."""
    if spec == "fp4quant":
        return f"fp4quant-g{args.group_size}" + ("-nohad" if args.no_hadamard else "")
    return {"none": "bf16", "none-float32": "fp32"}.get(spec, spec)


def codec_of(spec, args):
    """What fp4_comm takes for a codec spec."""
    label = codec_label(spec, args)
    if label.startswith("fp4quant"):
        g, hadamard = parse_fp4quant(label)
        return fp4_kernels.FP4Quant(g, hadamard=hadamard)
    return spec


def _exact(spec):
    return spec in ("none", "none-float32", "native")


def policies(args):
    """The forward and backward ``WirePolicy`` of the run (rounding None: the default)."""
    grad_codec = grad_codec_spec(args)
    grad_ef = args.error_feedback if args.grad_error_feedback is None else args.grad_error_feedback
    forward = WirePolicy(codec_of(args.codec, args), args.rounding, args.error_feedback)
    backward = WirePolicy(codec_of(grad_codec, args), args.grad_rounding, grad_ef)
    return forward, backward


def grad_codec_spec(args):
    """The gradients' codec spec: ``--grad-codec``, else ``--codec``."""
    return args.codec if args.grad_codec is None else args.grad_codec


def residual_gradient(args):
    """Whether a direction carries the residual stream's gradient (the pipeline boundary,
    sequence parallelism), whose rounding defaults to ``RESIDUAL_GRAD_ROUNDING``."""
    return args.parallel == "pp" or args.sequence_parallel


def grad_rounding(args, residual):
    """The rounding the gradients get: ``residual``, the residual stream's gradient."""
    if args.grad_rounding is not None:
        return args.grad_rounding
    return RESIDUAL_GRAD_ROUNDING if residual else args.rounding


def run_name(args):
    if args.name:
        return args.name
    layout = args.parallel + ("-sp" if args.sequence_parallel else "")
    parts = [layout, codec_label(args.codec, args)]
    if args.rounding == "stochastic" and not _exact(args.codec):
        parts.append("sr")
    if args.error_feedback:
        parts.append("ef")
    grad_codec, residual = grad_codec_spec(args), residual_gradient(args)
    rounding = grad_rounding(args, residual)
    if grad_codec != args.codec or (rounding != args.rounding and not _exact(grad_codec)):
        grad = [codec_label(grad_codec, args)]
        if not _exact(grad_codec):
            grad.append("sr" if rounding == "stochastic" else "rn")
        parts.append("grad-" + "-".join(grad))
    if args.loss_scale != 1:
        parts.append("ls" + loss_scale_label(args.loss_scale))
    return "_".join(parts + [f"s{args.seed}"])


# --------------------------------------------------------------------------- data and model


def _byte_splits(args):
    tokens = load_corpus(args.data, args.max_bytes)
    train_tokens, val_tokens = split(tokens, args.val_fraction)
    return train_tokens, val_tokens, VOCAB


RANDOM_TOKENS = 2**20


def _random_splits(args):
    # Uniform token ids of --vocab: nothing to learn, for timing a model of that vocabulary.
    g = torch.Generator().manual_seed(12345)
    tokens = torch.randint(0, args.vocab, (RANDOM_TOKENS,), generator=g)
    train_tokens, val_tokens = split(tokens, args.val_fraction)
    return train_tokens, val_tokens, args.vocab


def _token_splits(args):
    # build_corpus's folder (--data; by default corpus.DEFAULT_TOKENS): split by document
    folder = DEFAULT_TOKENS if list(args.data) == [DEFAULT_CORPUS] else args.data[0]
    tokens = load_tokens(folder)
    return tokens.train, tokens.val, tokens.vocab_size


#: ``--data-format`` -> loader(args) -> (train token ids, validation token ids, vocabulary
#: size): 1-d int64 tensors (ids < vocabulary size) from ``args.data`` (and ``max_bytes``,
#: ``val_fraction``).  A tokenized corpus plugs in as one more entry.
DATA_FORMATS = {"bytes": _byte_splits, "random": _random_splits, "tokens": _token_splits}


def load_data(args):
    """(train tokens, validation tokens, vocabulary size) of ``--data`` in ``--data-format``;
    SystemExit naming --data where it cannot be read, where its vocabulary is not the bytes of
    --model byte, or where a split is shorter than one sequence or holds ids beyond the
    vocabulary."""
    data = " ".join(map(str, args.data))
    try:
        train, val, vocab = DATA_FORMATS[args.data_format](args)
    except (OSError, EOFError, ValueError, KeyError, TypeError, lzma.LZMAError) as err:
        # (gzip.BadGzipFile is an OSError; a manifest without a field, a KeyError)
        raise SystemExit(f"--data {data}: cannot be read as --data-format {args.data_format} "
                         f"({type(err).__name__}: {err})") from None  # fmt: skip
    if args.model == "byte" and vocab != VOCAB:
        raise SystemExit(f"--data {data}: --data-format {args.data_format} gives a vocabulary "
                         f"of {vocab}; --model byte has a byte vocabulary ({VOCAB}): give a "
                         "--model qwen")  # fmt: skip
    need = args.seq_len + 2  # a window and its shifted targets, inside the split
    for name, t in (("training", train), ("validation", val)):
        if len(t) < need:
            raise SystemExit(f"--data {data}: its {name} split holds {len(t)} tokens, fewer "
                             f"than --seq-len + 2 = {need} (more data, a shorter --seq-len, or "
                             "another --val-fraction)")  # fmt: skip
        if int(t.max()) >= vocab or int(t.min()) < 0:
            raise SystemExit(f"--data {data}: its {name} split holds token ids outside the "
                             f"vocabulary of {vocab}")  # fmt: skip
    return train, val, vocab


def qwen_config(args, vocab):
    """The ``qwen.QwenConfig`` of ``--model qwen[-size]`` and a vocabulary of ``vocab``."""
    if args.model.startswith("qwen-"):
        return qwen.config(args.model[len("qwen-") :], vocab)
    ffn = args.ffn or -(-8 * args.d_model // 3 // 64) * 64
    return qwen.QwenConfig(args.layers, args.d_model, args.heads, args.kv_heads or args.heads,
                           ffn, vocab)  # fmt: skip


def model_layers(args, vocab=VOCAB):
    return qwen_config(args, vocab).layers if args.model != "byte" else args.layers


def model_width(args, vocab=VOCAB):
    return qwen_config(args, vocab).d_model if args.model != "byte" else args.d_model


def build_model(args, par, vocab, layers=None, first=True, last=True):
    """``--model`` over the parallel group ``par`` (``layers``, ``first``, ``last``: a
    pipeline stage's part)."""
    if args.model == "byte":
        if vocab != VOCAB:
            raise ValueError(f"--model byte has a byte vocabulary ({VOCAB}); the data has {vocab}")
        return Transformer(args.layers, args.d_model, args.heads, args.seed, par, layers,
                           first=first, last=last)  # fmt: skip
    return qwen.Qwen(qwen_config(args, vocab), args.seed, par, layers, first=first, last=last)


def flops_per_token(args, vocab):
    """Model FLOPs of one training step per token (``training_flops``' convention)."""
    if args.model == "byte":
        return training_flops(args.layers, args.d_model, args.seq_len, 1)
    return qwen_config(args, vocab).flops_per_token(args.seq_len)


# ----------------------------------------------------------------------------------- training


def _lr_factor(step, warmup, steps):
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def check_graph_args(args, device):
    """What --cuda-graph does not do, named before anything runs."""
    why = []
    if device.type != "cuda":
        why.append("it needs a GPU (--device cuda)")
    if args.parallel != "tp":
        why.append("it captures the tensor-parallel step only (--parallel tp)")
    residual = args.sequence_parallel
    if args.rounding != "nearest" or grad_rounding(args, residual) != "nearest":
        # the step number that seeds the random rounding would be frozen into the graph: every
        # replay would draw the same rounding words
        why.append("stochastic rounding would replay the same random words every step "
                   "(with --sequence-parallel the gradients' default is stochastic: pass "
                   "--grad-rounding nearest, or run eagerly)")  # fmt: skip
    if args.optimizer != "adamw":
        why.append("it needs --optimizer adamw (capturable)")
    if args.check_finite:
        why.append("--check-finite synchronizes on every op, which a capture cannot")
    if why:
        raise SystemExit("--cuda-graph: " + "; ".join(why))


class Runner:
    """One training run on this rank: model, optimizer, one step, one evaluation."""

    def __init__(self, args, comm, device, vocab=VOCAB):
        self.args, self.device, self.vocab = args, device, vocab
        self.timed = TimedCommunicator(comm) if comm is not None else None
        self.world_size = 1 if comm is None else comm.world_size
        self.forward, self.backward = policies(args)
        self.pp = args.parallel == "pp"
        self.stats = None  # per-step WireStats, on the steps that log them
        if self.pp:
            self._check_pipeline()
        self.build(comm)
        self.model.to(device)
        params = list(self.model.parameters())
        self.graphed = args.cuda_graph
        if self.graphed:
            check_graph_args(args, device)
        self.warmup = args.steps // 10 if args.warmup is None else args.warmup
        if args.optimizer == "adamw":
            # capturable: Adam's step count and bias corrections live on the device, and the
            # learning rate is a device tensor the schedule fills between replays
            lr = torch.tensor(args.lr, device=device) if self.graphed else args.lr
            self.opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0,
                                         capturable=self.graphed)  # fmt: skip
        else:
            self.opt = torch.optim.SGD(params, lr=args.lr)
        self.sched = None
        if not self.graphed:
            self.sched = torch.optim.lr_scheduler.LambdaLR(
                self.opt, lambda s: _lr_factor(s, self.warmup, args.steps)
            )
        dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
        self.autocast = dtype == "bfloat16"
        self.graph, self.steps_done = None, 0

    # --- checkpoints
    def communicators(self):
        """The communicators whose call counters and residuals are part of the run's state."""
        return [] if self.timed is None else [self.timed.comm]

    def state_dict(self):
        """What the later steps depend on, of this rank: weights, optimizer, schedule, and
        each communicator's counters and error-feedback residuals."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "scheduler": None if self.sched is None else self.sched.state_dict(),
            "steps_done": self.steps_done,
            "communicators": [c.state_dict() for c in self.communicators()],
        }

    def load_state_dict(self, state):
        """Continue from ``state_dict()`` (its tensors anywhere: they are copied here)."""
        comms = self.communicators()
        if len(state["communicators"]) != len(comms):
            raise ValueError(f"the checkpoint holds {len(state['communicators'])} "
                             f"communicators' state, this run has {len(comms)}")  # fmt: skip
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        if self.sched is not None:
            self.sched.load_state_dict(state["scheduler"])
        self.steps_done = state["steps_done"]
        for comm, saved in zip(comms, state["communicators"], strict=True):
            comm.load_state_dict(checkpoint.to_device(saved, self.device))

    def _check_pipeline(self):
        if "native" in (self.forward.codec, self.backward.codec):
            raise ValueError("--codec native is implemented for --parallel tp only")
        if self.forward.error_feedback or self.backward.error_feedback:
            raise ValueError("--error-feedback / --grad-error-feedback correct sums (TP); "
                             "the pipeline's sends have none")  # fmt: skip

    def stage_layers(self, stage):
        """The blocks of pipeline stage 0 or 1: the first and the second half."""
        n = model_layers(self.args, self.vocab)
        return range(n // 2) if stage == 0 else range(n // 2, n)

    def build(self, comm):
        """This rank's parallel group (``self.par``) and model."""
        args = self.args
        if self.pp:
            if comm is None or comm.world_size != 2:
                raise ValueError("--parallel pp runs on exactly 2 ranks")
            self.stage = comm.rank
            self.par = TensorParallelGroup(None)
            self.model = build_model(args, self.par, self.vocab, self.stage_layers(self.stage),
                                     first=self.stage == 0, last=self.stage == 1)  # fmt: skip
        else:
            self.par = TensorParallelGroup(self.timed, self.forward, self.backward,
                                           seed=args.seed,
                                           sequence_parallel=args.sequence_parallel)  # fmt: skip
            self.model = build_model(args, self.par, self.vocab)

    def _ctx(self):
        # autocast's cast cache must be off in a graph capture (its casts are captured too)
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast,
                              cache_enabled=not self.graphed)  # fmt: skip

    def lr(self):
        """The learning rate of the next step."""
        if self.sched is not None:
            return self.sched.get_last_lr()[0]
        return self.args.lr * _lr_factor(self.steps_done, self.warmup, self.args.steps)

    # --- tensor parallel (and the single-rank reference)
    def _tp_step(self, inputs, targets):
        with self._ctx():
            loss = lm_loss(self.model(inputs), targets, self.par)
        # Under SP each rank's loss is the mean over its shard of the sequence and the model's
        # loss their mean; the backward collectives already sum over the ranks, so each rank
        # backpropagates its loss / W.
        scale = 1.0 / self.par.size if self.par.sequence_parallel else 1.0
        self.par.backpropagate(loss, scale * self.args.loss_scale)  # exact: S a power of two
        self.par.sum_partial_grads(self.model.replicated_parameters())
        self.unscale_grads()
        return self.par.each(torch.Tensor.detach, loss)

    def scaled(self, loss):
        """``loss`` times ``--loss-scale`` (itself where that is 1: no operation)."""
        return loss if self.args.loss_scale == 1 else loss * self.args.loss_scale

    def unscale_grads(self):
        """The gradients the optimizer steps with, times 1 / ``--loss-scale`` (exact for a
        power of two); nothing where the scale is 1."""
        if self.args.loss_scale == 1:
            return
        grads = [p.grad for g in self.opt.param_groups for p in g["params"] if p.grad is not None]
        torch._foreach_mul_(grads, 1.0 / self.args.loss_scale)

    # --- two pipeline stages, GPipe order: all forwards, then all backwards
    def boundary_dtype(self, codec):
        """The dtype in which stage 0's output crosses the boundary with forward codec
        ``codec``: the compute dtype (bf16 under autocast), but float32 for ``none-float32``,
        the exact boundary: the residual stream is float32 inside either stage (the block
        outputs are added to float32 activations), so with it the split model computes what
        the whole one does."""
        exact = isinstance(codec, str) and codec == "none-float32"
        return torch.bfloat16 if self.autocast and not exact else torch.float32

    def _pp_step(self, inputs, targets, train=True, codec=None):
        """``codec``: the forward codec in place of the run's (an evaluation)."""
        m = self.args.microbatches if train else 1
        ins, tgts = inputs.chunk(m, dim=1), targets.chunk(m, dim=1)
        fwd, bwd = self.forward, self.backward
        codec = fwd.codec if codec is None else codec
        wire_dtype = self.boundary_dtype(codec)
        kw = {"seed": self.args.seed, "grad_codec": bwd.codec, "stats": self.stats}
        losses, handles = [], []
        for x, y in zip(ins, tgts, strict=True):
            if self.stage == 0:
                with self._ctx():
                    h = self.model(x).to(wire_dtype)
                handles.append(pipeline.send_forward(h, self.timed, 1, codec, fwd.rounding or
                                                     "nearest", **kw))  # fmt: skip
            else:
                shape = (x.shape[0], x.shape[1], model_width(self.args, self.vocab))
                if bwd.rounding is not None:
                    kw["grad_rounding"] = bwd.rounding
                h = pipeline.recv_forward(shape, wire_dtype, self.timed, 0, codec, **kw)
                with self._ctx():
                    losses.append(lm_loss(self.model(h), y, self.par))
        if train:
            for i in range(m):
                if self.stage == 1:
                    # sends the boundary's gradient to stage 0
                    self.scaled(losses[i] / m).backward()
                else:
                    pipeline.backward(handles[i])
            self.unscale_grads()
        if self.stage == 1:
            return torch.stack([v.detach() for v in losses]).mean()
        return torch.zeros((), device=self.device)

    def _checks(self):
        """``--check-finite``'s checks (``nonfinite.check_finite``), or nothing."""
        return check_finite() if self.args.check_finite else contextlib.nullcontext()

    def step(self, inputs, targets, log_stats=False):
        with self._checks():
            return self._step(inputs, targets, log_stats)

    def _step(self, inputs, targets, log_stats):
        self.stats = [] if log_stats else None
        self.par.stats = {} if log_stats else None
        if self.graphed:
            return self._graphed_step(inputs, targets)
        self.opt.zero_grad(set_to_none=True)
        if self.pp:
            loss = self._pp_step(inputs, targets)
        else:
            loss = self._tp_step(inputs, targets)
        self.opt.step()
        self.sched.step()
        self.steps_done += 1
        return loss

    def _graphed_step(self, inputs, targets):
        """GRAPH_WARMUP eager steps on a side stream (kernels compiled and loaded, Adam's state
        and the error-feedback residuals allocated), then the next step captured once, as in
        PyTorch's whole-network capture, and every step from there a replay.  The same
        arithmetic as the eager step: grads are set to None before the capture, so the captured
        backward writes them rather than adding to them."""
        self.par.stats = None  # statistics are host work; a replay does none
        for group in self.opt.param_groups:
            group["lr"].fill_(self.lr())
        if self.steps_done < GRAPH_WARMUP:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.opt.zero_grad(set_to_none=True)
                loss = self._tp_step(inputs, targets)
                self.opt.step()
            torch.cuda.current_stream().wait_stream(side)
        else:
            if self.graph is None:
                self.static = (inputs.clone(), targets.clone())
                self.opt.zero_grad(set_to_none=True)
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph):
                    self.static_loss = self._tp_step(*self.static)
                    self.opt.step()
            self.static[0].copy_(inputs)
            self.static[1].copy_(targets)
            self.graph.replay()
            loss = self.static_loss
        self.steps_done += 1
        return loss

    def wire_stats(self):
        """The logged step's payload statistics, per (site, direction, op), averaged over the
        step's payloads and the ranks: RMS, SQNR (mean of the hops' dB), payloads."""
        records = []
        if self.stats:
            records += [("boundary", s) for s in self.stats]
        for site, stats in (self.par.stats or {}).items():
            records += [(site, s) for s in stats]
        mine = {}
        for site, s in records:
            sqnr = [float(h.sqnr_db) for h in s.hops.values()]
            entry = mine.setdefault((site, s.direction, s.op), [0.0, 0.0, 0])
            entry[0] += float(s.rms)
            entry[1] += sum(sqnr) / len(sqnr) if sqnr else math.nan
            entry[2] += 1
        every = [mine]
        if self.timed is not None and self.timed.world_size > 1:
            every = [None] * self.timed.world_size
            dist.all_gather_object(every, mine, group=self.timed.comm.control_group)
        merged = {}
        for part in every:
            for key, (rms, sqnr, n) in part.items():
                m = merged.setdefault(key, [0.0, 0.0, 0])
                m[0], m[1], m[2] = m[0] + rms, m[1] + sqnr, m[2] + n
        return [
            {"site": site, "direction": d, "op": op, "rms": rms / n,
             "sqnr_db": finite_or_none(sqnr / n), "payloads": n}
            for (site, d, op), (rms, sqnr, n) in sorted(merged.items())
        ]  # fmt: skip

    @torch.no_grad()
    def evaluate(self, batches, codec=None):
        """Mean validation loss; ``codec``: the forward codec in place of the run's."""
        self.model.eval()
        self.stats = self.par.stats = None
        saved = self.par.forward
        if codec is not None and not self.pp:
            self.par.forward = WirePolicy(codec, saved.rounding, saved.error_feedback)
        try:
            with self._checks():
                totals = self._eval_totals(batches, codec)
        finally:
            self.par.forward = saved
            self.model.train()
        return self.mean_over_ranks([t / len(batches) for t in totals])

    def _eval_totals(self, batches, codec):
        totals = None
        for x, y in batches:
            x, y = x.to(self.device), y.to(self.device)
            if self.pp:
                loss = self._pp_step(x, y, train=False, codec=codec)
            else:
                with self._ctx():
                    loss = lm_loss(self.model(x), y, self.par)
            values = self.rank_values(loss)
            if totals is None:
                totals = values
            else:
                totals = [a + b for a, b in zip(totals, values, strict=True)]
        return totals

    def rank_values(self, loss):
        """The loss of each rank this process runs, as floats (here: this rank's)."""
        return [float(loss)]

    def mean_over_ranks(self, values):
        """The loss every rank reports (``values``: ``rank_values``' list): under SP each rank
        has its shard's mean; in the pipeline only the last stage has one."""
        (value,) = values
        if self.timed is None or not (self.par.sequence_parallel or self.pp):
            return value
        t = torch.tensor([value], dtype=torch.float64)
        group = self.timed.comm.control_group
        if self.pp:
            dist.broadcast(t, group_src=1, group=group)
        else:
            dist.all_reduce(t, group=group)
            t /= self.timed.world_size
        return float(t)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_tflops(device):
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def set_deterministic():
    """``--deterministic``: deterministic kernels (an op that has none raises), cuBLAS with
    a fixed workspace (its reductions then do not depend on the stream's history), and the
    math attention (the fused attentions' backward adds with atomics).  Costs time: the math
    attention materializes the score matrix, some deterministic kernels are slower, and torch
    fills the memory it allocates uninitialized (``torch.empty``) in this mode."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)


def train(args, comm, device=None, make_runner=None, options=None):
    """Run one configuration on this rank (every rank of ``comm`` calls it); the record, or
    None where it stopped (``--stop-at-step``, ``--stop-at-s``) with its checkpoint written:
    a call with the same arguments resumes it from ``--checkpoint``.
    ``make_runner(args, device, vocab)``: the runner (default: ``Runner`` over ``comm``);
    ``options``: the caller's own arguments that fix the run's bits, beside ``args``
    (``emulated_tp``'s ``{"tp": k}``), kept in the checkpoint and compared at a resume."""
    device = device or (comm.device if comm is not None else torch.device("cpu"))
    if comm is not None:
        comm.error_feedback.reset()  # a run starts without residuals left by an earlier one
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    if args.deterministic:
        set_deterministic()
    schedule = checkpoint.Schedule(args)  # the clock of --stop-at-s starts here
    run = Training(args, comm, device, make_runner, options)
    schedule.group = run.group
    for step in range(len(run.steps), args.steps):
        run.step(step)
        save, stop = schedule.after(step + 1)
        if stop and step + 1 < args.steps:
            run.save()
            if run.rank == 0 and not args.quiet:
                print(f"stopped after step {step + 1} of {args.steps}: resume from "
                      f"{args.checkpoint} with the same arguments", flush=True)  # fmt: skip
            return None
        if save:
            run.save()
    if args.checkpoint is not None:
        run.save()
    return run.record()


class Training:
    """One run's training loop on this rank: its runner and data, what it has recorded, its
    checkpoint (``--checkpoint``: read back here where it exists)."""

    def __init__(self, args, comm, device, make_runner=None, options=None):
        self.args, self.device, self.start = args, device, time.monotonic()
        self.options = dict(options or {})
        self.train_tokens, val_tokens, self.vocab = load_data(args)
        self.corpus_tokens = len(self.train_tokens) + len(val_tokens)
        self.val = val_batches(val_tokens, args.eval_batches, args.batch, args.seq_len)
        self.runner = (Runner(args, comm, device, self.vocab) if make_runner is None
                       else make_runner(args, device, self.vocab))  # fmt: skip
        self.rank = 0 if comm is None else comm.rank
        self.processes = processes = 1 if comm is None else comm.world_size
        self.group = comm.control_group if processes > 1 else None
        self.steps, self.evals, self.wire = [], [], []
        self.wall_s, self.pieces = 0.0, 1
        self.memory_gb = None  # the earlier pieces' peak of GPU memory
        self.path = None
        if args.checkpoint is not None:
            self.path = checkpoint.shard_path(args.checkpoint, self.rank, processes)
            self.resume()

    def resume(self):
        """Continue from this rank's checkpoint where it exists (every rank, or none)."""
        processes = self.processes
        state, why = checkpoint.read(self.path) if self.path.exists() else (None, None)
        # -2: unreadable, -1: none, else the steps done (every rank raises alike)
        done = -2 if why else -1 if state is None else len(state["records"]["steps"])
        every = [done]
        if self.group is not None:
            every = [None] * processes
            dist.all_gather_object(every, done, group=self.group)
        if -2 in every:
            where = f"{self.path} ({why})" if why else f"rank {every.index(-2)}'s shard"
            raise SystemExit(f"--checkpoint {self.args.checkpoint}: {where} is not a readable "
                             "checkpoint; delete it to start over, or give another "
                             "--checkpoint")  # fmt: skip
        if len(set(every)) > 1:
            raise ValueError(
                f"checkpoint {self.args.checkpoint}: the ranks' shards are at steps "
                f"{every} (-1: none); resuming needs them at one step"
            )
        if state is None:
            return
        if state["format"] != checkpoint.FORMAT or state["world_size"] != processes:
            raise ValueError(f"checkpoint {self.path}: format {state['format']} of "
                             f"{state['world_size']} processes; this run reads format "
                             f"{checkpoint.FORMAT} of {processes}")  # fmt: skip
        checkpoint.check_config(state["config"], self.args, self.path, self.options)
        self.runner.load_state_dict(state["runner"])
        checkpoint.set_rng_state(state["rng"], self.device)
        records = state["records"]
        self.steps, self.evals, self.wire = records["steps"], records["evals"], records["wire"]
        self.wall_s, self.pieces = state["wall_s"], state["pieces"] + 1
        self.memory_gb = state.get("max_memory_gb")

    def elapsed_s(self):
        """Wall seconds of the run so far, over all its pieces."""
        return self.wall_s + time.monotonic() - self.start

    def peak_memory_gb(self):
        """The most GPU memory torch allocated in any piece of the run so far, GiB (this
        process's peak since its start or the caller's last reset); None on the CPU."""
        if self.device.type != "cuda":
            return None
        now = torch.cuda.max_memory_allocated(self.device) / 2**30
        return max(now, self.memory_gb or 0.0)

    def save(self):
        """Write this rank's checkpoint."""
        checkpoint.save(self.path, {
            "format": checkpoint.FORMAT,
            "config": {**checkpoint.config_of(self.args), **self.options},
            "world_size": self.processes,
            "runner": self.runner.state_dict(), "rng": checkpoint.rng_state(self.device),
            "records": {"steps": self.steps, "evals": self.evals, "wire": self.wire},
            "wall_s": self.elapsed_s(), "pieces": self.pieces,
            "max_memory_gb": self.peak_memory_gb(),
        })  # fmt: skip

    def step(self, step):
        """Training step ``step``: its record, and the evaluation that follows it if due."""
        args, runner, device = self.args, self.runner, self.device
        x, y = train_batch(self.train_tokens, step, args.batch, args.seq_len, args.seed)
        x, y = x.to(device), y.to(device)
        log_stats = bool(args.stats_every) and step % args.stats_every == 0 and not (
            runner.graphed)  # fmt: skip
        _sync(device)
        t0 = time.perf_counter()
        lr = runner.lr()
        loss = runner.step(x, y, log_stats)
        _sync(device)
        step_ms = 1e3 * (time.perf_counter() - t0)
        replayed = runner.graph is not None
        comm_ms = runner.timed.take_ms(replayed) if runner.timed is not None else 0.0
        loss = runner.mean_over_ranks(runner.rank_values(loss))
        tokens_per_step = args.batch * args.seq_len  # the model replica's, over all its ranks
        self.steps.append({
            "step": step, "loss": loss, "lr": lr,
            "step_ms": step_ms, "comm_ms": comm_ms,
            "tokens_per_s_per_rank": tokens_per_step / runner.world_size / (step_ms / 1e3),
            "piece": self.pieces,
        })  # fmt: skip
        if log_stats:
            self.wire += [{"step": step, **w} for w in runner.wire_stats()]
        last = step == args.steps - 1
        if last or (args.eval_every and (step + 1) % args.eval_every == 0):
            self.evals.append({"step": step + 1, "val_loss": runner.evaluate(self.val)})
            if runner.timed is not None:
                runner.timed.take_ms()  # evaluation is not training communication
        if self.rank == 0 and not args.quiet and (step % 10 == 0 or last):
            print(f"step {step:5d} loss {loss:.4f} {step_ms:7.1f} ms/step, comm {comm_ms:6.1f} ms"
                  + (f"  val {self.evals[-1]['val_loss']:.4f}" if self.evals
                     and self.evals[-1]["step"] == step + 1 else ""), flush=True)  # fmt: skip

    def record(self):
        """The finished run's record (the final weights evaluated with ``--eval-codecs`` too)."""
        args, runner, steps = self.args, self.runner, self.steps
        final_evals = {"as_trained": self.evals[-1]["val_loss"]}
        for spec in args.eval_codecs:
            if spec != args.codec and spec != "native":
                final_evals[spec] = runner.evaluate(self.val, codec_of(spec, args))
        if runner.timed is not None:
            runner.timed.take_ms()
        world = runner.world_size
        return {
            "name": run_name(args),
            "config": {k: plain(v) for k, v in vars(args).items()},
            "codec": codec_label(args.codec, args),
            "grad_codec": codec_label(grad_codec_spec(args), args),
            "grad_rounding": grad_rounding(args, residual_gradient(args)),
            "world_size": world,
            "corpus_tokens": self.corpus_tokens,
            "vocab": self.vocab,
            "wall_s": self.elapsed_s(),
            "pieces": self.pieces,
            "max_memory_gb": self.peak_memory_gb(),
            "summary": _summary(
                args, self.vocab, world, self.device, steps, self.evals, final_evals
            ),
            "evals": self.evals,
            "steps": steps,
            "wire": self.wire,
        }


def timed_steps(steps: list[dict], warmup: int) -> list[dict]:
    """The step records that time a run: each piece's steps after its first ``warmup`` (a
    resumed piece starts cold, as the first did: kernels compiled, buffers allocated, graphs
    captured again); all of them where that leaves none.  A step without a ``piece`` (a
    record of a run not resumed) belongs to the first."""
    seen: dict[int, int] = {}
    timed = []
    for s in steps:
        piece = s.get("piece", 1)
        if seen.get(piece, 0) >= warmup:
            timed.append(s)
        seen[piece] = seen.get(piece, 0) + 1
    return timed or steps


def _summary(args, vocab, world, device, steps, evals, final_evals):
    """The run's figures: step and communication times averaged over each piece's steps after
    its first ``args.timing_warmup``, throughput, model FLOP/s (and MFU where the GPU's peak is
    known), the final losses."""
    tokens_per_step = args.batch * args.seq_len
    flops = flops_per_token(args, vocab) * tokens_per_step
    timed = timed_steps(steps, args.timing_warmup)
    step_ms = sum(s["step_ms"] for s in timed) / len(timed)
    comm_ms = sum(s["comm_ms"] for s in timed) / len(timed)
    final = evals[-1]["val_loss"]
    tflops = flops / world / (step_ms / 1e3) / 1e12
    peak = _peak_tflops(device)
    return {
        "tokens_per_s_per_rank": tokens_per_step / world / (step_ms / 1e3),
        "step_ms": step_ms,
        "comm_ms": comm_ms,
        "comm_share": comm_ms / step_ms,
        "model_tflop_per_step": flops / 1e12,
        "tflops_per_rank": tflops,
        "mfu": None if peak is None else tflops / peak,
        "final_val_loss": final,
        "final_val_ppl": math.exp(final),
        "final_train_loss": sum(s["loss"] for s in steps[-10:]) / len(steps[-10:]),
        "final_evals": final_evals,
    }


def main(argv=None):
    world = os.environ.get("WORLD_SIZE", "")
    args = parse_args(argv, int(world) if world.isdigit() else None)
    if "RANK" not in os.environ and not dist.is_initialized():
        raise SystemExit(
            "tp_train runs one rank a process, under torchrun: `torchrun --standalone "
            "--nproc-per-node N -m fp4_train.experiments.tp_train ...` (with one process "
            "too); fp4_train.experiments.emulated_tp runs every rank in this one"
        )
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    device = None
    if args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available()):
        device = "cpu"
    comm = fp4_comm.Communicator.from_env(
        device=device, validate="first", graph_cache=graph_cache_bounds(args)
    )
    record = train(args, comm)
    if record is None:  # stopped at its limit, the checkpoint written
        raise SystemExit(checkpoint.EX_TEMPFAIL)
    record["meta"] = metadata(str(comm.device))
    if comm.rank == 0 and args.out is not None:
        write_json(args.out / f"{record['name']}.json", record)
        write_csv(args.out / f"{record['name']}.csv", record["steps"])
    s = record["summary"]
    if comm.rank == 0 and not args.quiet:
        print(f"{record['name']}: {s['tokens_per_s_per_rank']:.0f} tokens/s per rank, "
              f"comm {100 * s['comm_share']:.1f}% of the step, val loss {s['final_val_loss']:.4f} "
              f"(ppl {s['final_val_ppl']:.2f})")  # fmt: skip
    return record


if __name__ == "__main__":
    main()
