"""Tensor- or pipeline-parallel training of a small decoder-only transformer whose activations
and activation gradients cross ranks through fp4_comm (FP4 or bf16 on the wire).

    torchrun --standalone --nproc-per-node 2 packages/fp4_train/examples/tp_train.py \\
        --codec fp4quant --group-size 64 --steps 2000 --out docs/results/tp_h200

Model: byte embedding (vocab 256), ``--layers`` pre-LayerNorm blocks of causal self-attention
and a GELU MLP, a final LayerNorm and an LM head, in Megatron's [sequence, batch, hidden]
layout.  Parallelism (one process per rank, ``--parallel``):

- ``tp`` (default): Megatron tensor parallelism over all ranks.  The QKV and MLP-up linears are
  column-parallel (heads and hidden units split), the attention-output and MLP-down linears
  row-parallel; ``fp4_comm.tensor_parallel.copy_to_tensor_parallel`` feeds each block (identity
  forward, all-reduce of the gradient backward) and ``reduce_from_tensor_parallel`` sums its
  output (all-reduce forward): four all-reduces per layer and step.  ``--sequence-parallel``
  splits the residual stream along the sequence instead (all-gather / reduce-scatter pairs;
  the replicated LayerNorm, embedding and head gradients are then summed over the ranks in
  float32).  Embedding, LayerNorms and head are replicated (a 256-token vocabulary needs no
  vocabulary-parallel embedding).
- ``pp``: two pipeline stages (the first half of the layers with the embedding, the second with
  the head), GPipe order over ``--microbatches``: activations forward and their gradients
  backward cross with ``comm.send`` / ``comm.recv``.

Communication (``--codec``): ``none`` (bfloat16 values, the baseline), ``none-float32`` (exact
up to the float32 sums), ``nvfp4``, ``mxfp4``, ``fp4quant`` (``--group-size`` 64/256/512,
``--no-hadamard``), ``native`` (torch.distributed's own all-reduce: NCCL's on GPUs; TP
only); ``--rounding nearest|stochastic``; ``--error-feedback`` (tensor parallelism, with or
without ``--sequence-parallel``: each all-reduce / reduce-scatter site keeps the residual of
its quantization and adds it to the next one; the all-gathers and the pipeline's send/recv
carry none).

Data: the bytes of a text file (``--data``; default the Jargon File that Debian's
``jargon-text`` package installs, gzip read transparently); the last ``--val-fraction`` is the
validation split.  The seed fixes the initialization (full weights first, then each rank's
shard, so every parallel layout starts from the same model) and the batch order, whatever the
codec.

Per step it records loss, step time, time inside fp4_comm calls (CUDA events on a GPU,
perf_counter on the CPU) and tokens/s per rank; writes ``<out>/<name>.json`` and ``.csv`` on
rank 0.  ``tp_summary.py`` builds the table and the loss plot from a folder of runs.
"""

from __future__ import annotations

import argparse
import gzip
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import metadata, write_csv, write_json  # noqa: E402

import fp4_comm  # noqa: E402
import fp4_comm.tensor_parallel as tp  # noqa: E402
import fp4_kernels  # noqa: E402

VOCAB = 256  # byte-level tokens
# Debian package jargon-text (apt-get install jargon-text): the Jargon File 4.4.7, 1.7 MB text.
DEFAULT_CORPUS = Path("/usr/share/doc/jargon-text/jargon.txt.gz")
INIT_STD = 0.02  # GPT-2's; the residual projections get INIT_STD / sqrt(2 * layers)


# ------------------------------------------------------------------------------------ args


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a = ap.add_argument
    a("--parallel", choices=("tp", "pp"), default="tp")
    a("--sequence-parallel", action="store_true", help="TP with the sequence split (Megatron SP)")
    a("--codec", default="none",
      choices=("none", "none-float32", "nvfp4", "mxfp4", "fp4quant", "native"))  # fmt: skip
    a("--group-size", type=int, default=64, help="FP4Quant group size g")
    a("--no-hadamard", action="store_true", help="FP4Quant without the Walsh-Hadamard transform")
    a("--rounding", choices=("nearest", "stochastic"), default="nearest")
    a("--error-feedback", action="store_true", help="residual per all-reduce/reduce-scatter site")
    a("--layers", type=int, default=4)
    a("--d-model", type=int, default=256)
    a("--heads", type=int, default=4)
    a("--seq-len", type=int, default=256)
    a("--batch", type=int, default=16, help="sequences per step (the whole model replica)")
    a("--microbatches", type=int, default=2, help="pipeline micro-batches per step")
    a("--steps", type=int, default=200)
    a("--lr", type=float, default=1e-3)
    a("--optimizer", choices=("adamw", "sgd"), default="adamw")
    a("--warmup", type=int, default=None, help="linear warm-up steps (default: steps // 10)")
    a("--seed", type=int, default=0, help="initialization, batch order and rounding words")
    a("--data", type=Path, default=DEFAULT_CORPUS, help="text file (.gz read as gzip)")
    a("--max-bytes", type=int, default=None, help="use only the first N bytes of the corpus")
    a("--val-fraction", type=float, default=0.1)
    a("--eval-every", type=int, default=50)
    a("--eval-batches", type=int, default=8)
    a("--dtype", choices=("float32", "bfloat16"), default=None,
      help="compute dtype (autocast); default bfloat16 on CUDA, float32 on the CPU")  # fmt: skip
    a("--device", choices=("auto", "cpu", "cuda"), default="auto")
    a("--threads", type=int, default=1, help="torch CPU threads per process")
    a("--timing-warmup", type=int, default=5, help="steps left out of the throughput means")
    a("--name", default=None, help="run name (default: from the configuration)")
    a("--out", type=Path, default=None, help="folder for <name>.json/.csv (rank 0)")
    a("--cuda-graph", action=argparse.BooleanOptionalAction, default=False,
      help="TP, GPU: capture the whole training step (forward, backward with its collectives, "
           "AdamW) in one CUDA graph after a few eager steps, and replay it; hides the host "
           "time of the collectives' launches (nearest rounding only)")  # fmt: skip
    a("--quiet", action="store_true")
    return ap.parse_args(argv)


def codec_of(args):
    if args.codec == "fp4quant":
        return fp4_kernels.FP4Quant(args.group_size, hadamard=not args.no_hadamard)
    return args.codec


def codec_label(args):
    if args.codec == "fp4quant":
        return f"fp4quant-g{args.group_size}" + ("-nohad" if args.no_hadamard else "")
    return {"none": "bf16", "none-float32": "fp32", "native": "native"}.get(args.codec, args.codec)


def run_name(args):
    if args.name:
        return args.name
    parts = [args.parallel + ("-sp" if args.sequence_parallel else ""), codec_label(args)]
    if args.rounding == "stochastic" and args.codec not in ("none", "none-float32", "native"):
        parts.append("sr")
    if args.error_feedback:
        parts.append("ef")
    return "_".join(parts + [f"s{args.seed}"])


# ------------------------------------------------------------------------------------ data


def load_corpus(path, max_bytes=None):
    """The bytes of a text file as int64 token ids (0..255)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"{path}: no corpus; `apt-get install jargon-text` installs the default one, or "
            "pass --data PATH (any text file; .gz is read as gzip)"
        )
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    if max_bytes:
        raw = raw[:max_bytes]
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()


def split(tokens, val_fraction):
    n_val = int(len(tokens) * val_fraction)
    return tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]


def train_batch(tokens, step, batch, seq_len, seed):
    """Sequences at random offsets, drawn from (seed, step) alone: the same batches for every
    codec and layout.  Returns inputs and targets, [seq_len, batch] each."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(tokens) - seq_len - 1, (batch,), generator=g)
    idx = starts[None, :] + torch.arange(seq_len + 1)[:, None]
    window = tokens[idx]
    return window[:-1], window[1:]


def val_batches(tokens, n_batches, batch, seq_len):
    """Evenly spaced windows of the validation split (the same ones at every evaluation)."""
    n = n_batches * batch
    starts = torch.linspace(0, len(tokens) - seq_len - 2, n).long()
    idx = starts[None, :] + torch.arange(seq_len + 1)[:, None]
    window = tokens[idx]
    return [
        (window[:-1, i * batch : (i + 1) * batch], window[1:, i * batch : (i + 1) * batch])
        for i in range(n_batches)
    ]


# ------------------------------------------------------------------------------ communication


class TimedComm:
    """The communicator, with the time spent in its calls added up: CUDA events on the current
    stream for a GPU communicator (read after the step's synchronize), perf_counter on the CPU.
    The tensor_parallel functions call it like a Communicator."""

    def __init__(self, comm):
        self.comm = comm
        self.cuda = comm.device.type == "cuda"
        self.events, self.cpu_s = [], 0.0
        # events recorded inside a CUDA-graph capture ("external": the replay records them
        # again, so their elapsed times are those of the latest replay)
        self.graph_events = []

    def __getattr__(self, name):
        return getattr(self.comm, name)

    def _timed(self, fn, *args, **kwargs):
        if self.cuda:
            capturing = torch.cuda.is_current_stream_capturing()
            start, end = (torch.cuda.Event(enable_timing=True, external=capturing)
                          for _ in range(2))  # fmt: skip
            start.record()
            out = fn(*args, **kwargs)
            end.record()
            (self.graph_events if capturing else self.events).append((start, end))
            return out
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        self.cpu_s += time.perf_counter() - t0
        return out

    def all_reduce(self, *a, **k):
        return self._timed(self.comm.all_reduce, *a, **k)

    def reduce_scatter(self, *a, **k):
        return self._timed(self.comm.reduce_scatter, *a, **k)

    def all_gather(self, *a, **k):
        return self._timed(self.comm.all_gather, *a, **k)

    def send(self, *a, **k):
        return self._timed(self.comm.send, *a, **k)

    def recv(self, *a, **k):
        return self._timed(self.comm.recv, *a, **k)

    def native_all_reduce(self, x, group):
        """torch.distributed's own all-reduce (NCCL's ring on GPUs, gloo on the CPU), in x's
        dtype: the reference the compressed collectives have to beat."""

        def run(x):
            y = x.contiguous().clone()
            dist.all_reduce(y, group=group)
            return y

        return self._timed(run, x)

    def take_ms(self, replayed=False):
        """Milliseconds in calls since the last take (call after the device synchronized);
        ``replayed``: a captured step was replayed since, add its calls."""
        ms = 1e3 * self.cpu_s + sum(s.elapsed_time(e) for s, e in self.events)
        if replayed:
            ms += sum(s.elapsed_time(e) for s, e in self.graph_events)
        self.events, self.cpu_s = [], 0.0
        return ms


class _NativeAllReduce(torch.autograd.Function):
    """Megatron's copy_to (``forward=False``) / reduce_from (``forward=True``) pair through
    torch.distributed's own all-reduce, for ``--codec native``."""

    @staticmethod
    def forward(ctx, x, comm, group, forward):
        ctx.comm, ctx.group, ctx.forward = comm, group, forward
        return comm.native_all_reduce(x, group) if forward else x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        g = grad if ctx.forward else ctx.comm.native_all_reduce(grad, ctx.group)
        return g, None, None, None


class TensorParallel:
    """This rank's place in the tensor-parallel group and the collectives a block needs."""

    def __init__(self, comm, codec, rounding, seed, sequence_parallel=False, error_feedback=False):
        self.comm = comm
        self.size = 1 if comm is None else comm.world_size
        self.rank = 0 if comm is None else comm.rank
        self.opts = {"codec": codec, "rounding": rounding, "seed": seed}
        self.sp = sequence_parallel and self.size > 1
        self.ef = error_feedback
        self.native_group = None
        if codec == "native" and self.size > 1:
            if self.sp or self.ef:
                raise ValueError("--codec native is implemented for TP without SP or EF")
            # every rank of the default group takes part; NCCL for CUDA tensors
            backend = "nccl" if comm.device.type == "cuda" else "gloo"
            self.native_group = dist.new_group(backend=backend)

    def enter(self, x, site):
        """A block's input, replicated before its column-parallel linear."""
        if self.size == 1:
            return x
        if self.native_group is not None:
            return _NativeAllReduce.apply(x, self.comm, self.native_group, False)
        # error feedback on the gradient's sum (backward): one residual buffer per site
        ef = f"{site}.in.grad" if self.ef else None
        if self.sp:
            return tp.gather_from_sequence_parallel(x, self.comm, **self.opts, error_feedback=ef)
        return tp.copy_to_tensor_parallel(x, self.comm, **self.opts, error_feedback=ef)

    def exit(self, x, site):
        """A row-parallel linear's partial output, summed over the ranks."""
        if self.size == 1:
            return x
        if self.native_group is not None:
            return _NativeAllReduce.apply(x, self.comm, self.native_group, True)
        # error feedback on the forward sum, in training only: a validation pass must not
        # move the residuals
        ef = f"{site}.out" if self.ef and torch.is_grad_enabled() else None
        if self.sp:
            return tp.reduce_scatter_to_sequence_parallel(
                x, self.comm, **self.opts, error_feedback=ef
            )
        return tp.reduce_from_tensor_parallel(x, self.comm, **self.opts, error_feedback=ef)

    def shard(self, w, dim=0):
        """This rank's slice of a full weight along ``dim``."""
        return w.chunk(self.size, dim)[self.rank].clone()


# -------------------------------------------------------------------------------------- model


def _normal(g, *shape, std=INIT_STD):
    return torch.randn(*shape, generator=g) * std


class Block(nn.Module):
    """Pre-LN attention + MLP; the linears split Megatron-style over ``par``.  The full weights
    are drawn first (the same numbers for any number of ranks), then sliced."""

    def __init__(self, i, d, heads, n_layers, par: TensorParallel, g):
        super().__init__()
        if heads % par.size or (4 * d) % par.size:
            raise ValueError(f"heads {heads} and MLP width {4 * d} must divide by {par.size}")
        self.i, self.par, self.heads_local, self.d_head = i, par, heads // par.size, d // heads
        out_std = INIT_STD / math.sqrt(2 * n_layers)
        wq, wk, wv = (_normal(g, d, d) for _ in range(3))
        wo = _normal(g, d, d, std=out_std)
        w_up = _normal(g, 4 * d, d)
        w_down = _normal(g, d, 4 * d, std=out_std)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        # column-parallel: this rank's heads' rows of Q, K and V; row-parallel: their columns
        self.w_qkv = nn.Parameter(torch.cat([par.shard(w) for w in (wq, wk, wv)]))
        self.w_o = nn.Parameter(par.shard(wo, dim=1))
        self.w_up = nn.Parameter(par.shard(w_up))
        self.w_down = nn.Parameter(par.shard(w_down, dim=1))

    def forward(self, x):  # x: [s, b, d] (with SP: this rank's part of s)
        site = f"L{self.i}"
        h = self.par.enter(self.ln1(x), f"{site}.attn")
        s, b, _ = h.shape
        q, k, v = F.linear(h, self.w_qkv).chunk(3, dim=-1)
        q, k, v = (t.reshape(s, b, self.heads_local, self.d_head).permute(1, 2, 0, 3)
                   for t in (q, k, v))  # fmt: skip
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        a = a.permute(2, 0, 1, 3).reshape(s, b, self.heads_local * self.d_head)
        x = x + self.par.exit(F.linear(a, self.w_o), f"{site}.attn")
        h = self.par.enter(self.ln2(x), f"{site}.mlp")
        h = F.gelu(F.linear(h, self.w_up))
        return x + self.par.exit(F.linear(h, self.w_down), f"{site}.mlp")


class Transformer(nn.Module):
    """Embedding, blocks, final LayerNorm, LM head.  ``layers`` picks the blocks this rank
    holds (pipeline stages); embedding / head are kept only where ``first`` / ``last``."""

    def __init__(self, args, par, layers=None, first=True, last=True):
        super().__init__()
        d, n = args.d_model, args.layers
        g = torch.Generator().manual_seed(args.seed)
        embedding = _normal(g, VOCAB, d)
        blocks = [Block(i, d, args.heads, n, par, g) for i in range(n)]
        head = _normal(g, VOCAB, d)
        keep = range(n) if layers is None else layers
        self.first, self.last = first, last
        self.embedding = nn.Parameter(embedding) if first else None
        self.blocks = nn.ModuleList(blocks[i] for i in keep)
        self.ln_f = nn.LayerNorm(d) if last else None
        self.head = nn.Parameter(head) if last else None
        self.par = par

    def forward(self, x):
        """Token ids [s, b] (first stage) or hidden states → hidden states or logits."""
        if self.first:
            x = F.embedding(x, self.embedding)
            if self.par.sp:
                x = self.par.shard(x)  # this rank's part of the sequence
        for block in self.blocks:
            x = block(x)
        if self.last:
            x = F.linear(self.ln_f(x), self.head)
        return x

    def replicated_parameters(self):
        """Parameters every TP rank holds whole (their gradients are partial under SP)."""
        sharded = {id(p) for b in self.blocks for p in (b.w_qkv, b.w_o, b.w_up, b.w_down)}
        return [p for p in self.parameters() if id(p) not in sharded]


def lm_loss(logits, targets, par):
    if par.sp:
        targets = par.shard(targets)
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


# ----------------------------------------------------------------------------------- training


class Runner:
    """One training run on this rank: model, optimizer, one step, one evaluation."""

    def __init__(self, args, comm, device):
        self.args, self.device = args, device
        self.timed = TimedComm(comm) if comm is not None else None
        codec = codec_of(args)
        self.opts = {"codec": codec, "rounding": args.rounding, "seed": args.seed}
        self.pp = args.parallel == "pp"
        if self.pp:
            if comm.world_size != 2:
                raise ValueError("--parallel pp runs on exactly 2 ranks")
            if args.codec == "native":
                raise ValueError("--codec native is implemented for --parallel tp only")
            self.stage = comm.rank
            half = args.layers // 2
            layers = range(half) if self.stage == 0 else range(half, args.layers)
            par = TensorParallel(None, codec, args.rounding, args.seed)
            self.model = Transformer(args, par, layers, first=self.stage == 0,
                                     last=self.stage == 1)  # fmt: skip
        else:
            par = TensorParallel(self.timed, codec, args.rounding, args.seed,
                                 args.sequence_parallel, args.error_feedback)  # fmt: skip
            self.model = Transformer(args, par)
        self.par = par
        self.model.to(device)
        params = list(self.model.parameters())
        self.graphed = args.cuda_graph
        if self.graphed:
            _check_graph_args(args, device)
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
        scale = 1.0 / self.par.size if self.par.sp else 1.0
        (loss * scale).backward()
        if self.par.sp:  # partial over the sequence shards: sum (float32, exact up to the adds)
            grads = [p.grad for p in self.model.replicated_parameters()]
            flat = torch.cat([g.reshape(-1) for g in grads]).float()
            flat = self.timed.all_reduce(flat, codec="none-float32")
            off = 0
            for g in grads:
                g.copy_(flat[off : off + g.numel()].view_as(g))
                off += g.numel()
        return loss.detach()

    # --- two pipeline stages, GPipe order: all forwards, then all backwards
    def _pp_step(self, inputs, targets, train=True):
        m = self.args.microbatches if train else 1
        ins, tgts = inputs.chunk(m, dim=1), targets.chunk(m, dim=1)
        d = self.args.d_model
        wire_dtype = torch.bfloat16 if self.autocast else torch.float32
        losses, kept = [], []
        for x, y in zip(ins, tgts, strict=True):
            shape = (x.shape[0], x.shape[1], d)
            if self.stage == 0:
                with self._ctx():
                    h = self.model(x)
                h = h.to(wire_dtype)
                self.timed.send(h.detach().contiguous(), 1, **self.opts)
                kept.append(h)
            else:
                h = self.timed.recv(shape, wire_dtype, 0, codec=self.opts["codec"])
                h.requires_grad_(train)
                with self._ctx():
                    loss = lm_loss(self.model(h), y, self.par)
                losses.append(loss)
                kept.append(h)
        if train:
            for i in range(m):
                if self.stage == 1:
                    (losses[i] / m).backward()
                    self.timed.send(kept[i].grad.contiguous(), 0, **self.opts)
                else:
                    shape, dtype = kept[i].shape, kept[i].dtype
                    grad = self.timed.recv(shape, dtype, 1, codec=self.opts["codec"])
                    kept[i].backward(grad)
        if self.stage == 1:
            return torch.stack([v.detach() for v in losses]).mean()
        return torch.zeros((), device=self.device)

    def step(self, inputs, targets):
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

    @torch.no_grad()
    def evaluate(self, batches):
        self.model.eval()
        total = 0.0
        for x, y in batches:
            x, y = x.to(self.device), y.to(self.device)
            if self.pp:
                total += float(self._pp_step(x, y, train=False))
            else:
                with self._ctx():
                    total += float(lm_loss(self.model(x), y, self.par))
        self.model.train()
        return self._mean_over_ranks(total / len(batches))

    def _mean_over_ranks(self, value):
        """The loss every rank reports: under SP each rank has its shard's mean; in the
        pipeline only the last stage has one."""
        if self.timed is None or not (self.par.sp or self.pp):
            return value
        t = torch.tensor([value], dtype=torch.float64)
        group = self.timed.comm.control_group
        if self.pp:
            dist.broadcast(t, group_src=1, group=group)
        else:
            dist.all_reduce(t, group=group)
            t /= self.timed.world_size
        return float(t)


GRAPH_WARMUP = 3  # eager steps before the capture (fewer than --timing-warmup's default 5)


def _check_graph_args(args, device):
    """What --cuda-graph does not do, named before anything runs."""
    why = []
    if device.type != "cuda":
        why.append("it needs a GPU (--device cuda)")
    if args.parallel != "tp":
        why.append("it captures the tensor-parallel step only (--parallel tp)")
    if args.rounding != "nearest":
        # the step number that seeds the random rounding would be frozen into the graph: every
        # replay would draw the same rounding words
        why.append("stochastic rounding would replay the same random words every step")
    if args.optimizer != "adamw":
        why.append("it needs --optimizer adamw (capturable)")
    if why:
        raise SystemExit("--cuda-graph: " + "; ".join(why))


def _lr_factor(step, warmup, steps):
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(args, comm, device=None):
    """Run one configuration on this rank (every rank of ``comm`` calls it); the record."""
    device = device or (comm.device if comm is not None else torch.device("cpu"))
    if comm is not None:
        comm.error_feedback.reset()  # a run starts without residuals left by an earlier one
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    tokens = load_corpus(args.data, args.max_bytes)
    train_tokens, val_tokens = split(tokens, args.val_fraction)
    val = val_batches(val_tokens, args.eval_batches, args.batch, args.seq_len)
    runner = Runner(args, comm, device)
    rank = 0 if comm is None else comm.rank
    world = 1 if comm is None else comm.world_size
    steps, evals = [], []
    tokens_per_step = args.batch * args.seq_len  # the model replica's, over all its ranks
    for step in range(args.steps):
        x, y = train_batch(train_tokens, step, args.batch, args.seq_len, args.seed)
        x, y = x.to(device), y.to(device)
        _sync(device)
        t0 = time.perf_counter()
        lr = runner.lr()
        loss = runner.step(x, y)
        _sync(device)
        step_ms = 1e3 * (time.perf_counter() - t0)
        replayed = runner.graph is not None
        comm_ms = runner.timed.take_ms(replayed) if runner.timed is not None else 0.0
        loss = runner._mean_over_ranks(float(loss))
        steps.append({
            "step": step, "loss": loss, "lr": lr,
            "step_ms": step_ms, "comm_ms": comm_ms,
            "tokens_per_s_per_rank": tokens_per_step / world / (step_ms / 1e3),
        })  # fmt: skip
        last = step == args.steps - 1
        if last or (args.eval_every and (step + 1) % args.eval_every == 0):
            evals.append({"step": step + 1, "val_loss": runner.evaluate(val)})
            if runner.timed is not None:
                runner.timed.take_ms()  # evaluation is not training communication
        if rank == 0 and not args.quiet and (step % 10 == 0 or last):
            print(f"step {step:5d} loss {loss:.4f} {step_ms:7.1f} ms/step, comm {comm_ms:6.1f} ms"
                  + (f"  val {evals[-1]['val_loss']:.4f}" if evals and evals[-1]["step"] == step + 1
                     else ""), flush=True)  # fmt: skip
    timed = steps[args.timing_warmup :] or steps
    step_ms = sum(s["step_ms"] for s in timed) / len(timed)
    comm_ms = sum(s["comm_ms"] for s in timed) / len(timed)
    final = evals[-1]["val_loss"]
    return {
        "name": run_name(args),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "codec": codec_label(args),
        "world_size": world,
        "corpus_bytes": len(tokens),
        "summary": {
            "tokens_per_s_per_rank": tokens_per_step / world / (step_ms / 1e3),
            "step_ms": step_ms,
            "comm_ms": comm_ms,
            "comm_share": comm_ms / step_ms,
            "final_val_loss": final,
            "final_val_ppl": math.exp(final),
            "final_train_loss": sum(s["loss"] for s in steps[-10:]) / len(steps[-10:]),
        },
        "evals": evals,
        "steps": steps,
    }


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    device = None
    if args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available()):
        device = "cpu"
    comm = fp4_comm.Communicator.from_env(device=device, validate="first")
    record = train(args, comm)
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
