"""A decoder-only byte-level transformer whose linears are split Megatron-style over a
``fp4_comm.TensorParallelGroup``, in Megatron's [sequence, batch, hidden] layout.

Byte embedding (vocabulary 256), pre-LayerNorm blocks of causal self-attention and a GELU MLP
of width 4d, a final LayerNorm and an LM head.  QKV and MLP-up are column-parallel (heads and
hidden units split), attention-out and MLP-down row-parallel; embedding, LayerNorms and head
are replicated (a 256-token vocabulary needs no vocabulary-parallel embedding).  The full
weights are drawn from the seed first and then sliced, so one process, any number of tensor-
parallel ranks and the pipeline stages all start from the same model.

The model is written against the parallel-group interface (``par.each``, ``shard``,
``sharded_parameter``, ``replicated_parameter``, ``enter``, ``exit``): with a
``fp4_comm.TensorParallelGroup`` it is one rank's share, with an
``fp4_comm.emulated.EmulatedTensorParallelGroup`` all k ranks' in one process.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .corpus import VOCAB

INIT_STD = 0.02  # GPT-2's; the residual projections get INIT_STD / sqrt(2 * layers)


def _normal(g, *shape, std=INIT_STD):
    return torch.randn(*shape, generator=g) * std


def _cat(*ws):
    return torch.cat(ws)


class Block(nn.Module):
    """Pre-LN attention + MLP; the linears split over ``par`` (a TensorParallelGroup, or an
    emulated one: ``fp4_comm.emulated``)."""

    def __init__(self, i, d, heads, n_layers, par, g):
        super().__init__()
        if heads % par.size or (4 * d) % par.size:
            raise ValueError(f"heads {heads} and MLP width {4 * d} must divide by {par.size}")
        self.i, self.par, self.heads_local, self.d_head = i, par, heads // par.size, d // heads
        out_std = INIT_STD / math.sqrt(2 * n_layers)
        wq, wk, wv = (_normal(g, d, d) for _ in range(3))
        wo = _normal(g, d, d, std=out_std)
        w_up = _normal(g, 4 * d, d)
        w_down = _normal(g, d, 4 * d, std=out_std)
        self.ln1_w, self.ln1_b = _layer_norm_parameters(par, d)
        self.ln2_w, self.ln2_b = _layer_norm_parameters(par, d)
        # column-parallel: this rank's heads' rows of Q, K and V; row-parallel: their columns
        self.w_qkv = par.sharded_parameter(par.each(_cat, *(par.shard(w) for w in (wq, wk, wv))))
        self.w_o = par.sharded_parameter(par.shard(wo, dim=1))
        self.w_up = par.sharded_parameter(par.shard(w_up))
        self.w_down = par.sharded_parameter(par.shard(w_down, dim=1))

    def forward(self, x):  # x: [s, b, d] (with SP: this rank's part of s)
        p, site = self.par, f"L{self.i}"
        h = p.enter(p.each(_layer_norm, x, self.ln1_w, self.ln1_b), f"{site}.attn")
        a = p.each(self._attention, h, self.w_qkv, self.w_o)
        x = p.each(torch.add, x, p.exit(a, f"{site}.attn"))
        h = p.enter(p.each(_layer_norm, x, self.ln2_w, self.ln2_b), f"{site}.mlp")
        m = p.each(_mlp, h, self.w_up, self.w_down)
        return p.each(torch.add, x, p.exit(m, f"{site}.mlp"))

    def _attention(self, h, w_qkv, w_o):
        """This rank's heads: their Q, K, V, attention, and the partial output projection."""
        s, b, _ = h.shape
        q, k, v = F.linear(h, w_qkv).chunk(3, dim=-1)
        q, k, v = (t.reshape(s, b, self.heads_local, self.d_head).permute(1, 2, 0, 3)
                   for t in (q, k, v))  # fmt: skip
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        a = a.permute(2, 0, 1, 3).reshape(s, b, self.heads_local * self.d_head)
        return F.linear(a, w_o)

    def replicated_parameters(self):
        return [self.ln1_w, self.ln1_b, self.ln2_w, self.ln2_b]


def _layer_norm_parameters(par, d):
    # nn.LayerNorm(d)'s weight and bias
    return par.replicated_parameter(torch.ones(d)), par.replicated_parameter(torch.zeros(d))


def _layer_norm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b)


def _mlp(h, w_up, w_down):
    return F.linear(F.gelu(F.linear(h, w_up)), w_down)


class DecoderStack(nn.Module):
    """What a decoder-only model of these experiments does with its parts (``Transformer``,
    ``qwen.Qwen``): the embedding on the first stage (under SP, then this rank's part of the
    sequence), the blocks, the final norm and LM head on the last.  A subclass sets ``par``,
    ``first``, ``last``, ``embedding`` and ``blocks`` and says what its final norm's
    parameters and logits are (``_final_parameters``, ``_logits``)."""

    def forward(self, x):
        """Token ids [s, b] (first stage) or hidden states -> hidden states or logits."""
        p = self.par
        if self.first:
            x = p.each(F.embedding, x, self.embedding)
            if p.sequence_parallel:
                x = p.shard(x)  # this rank's part of the sequence
        for block in self.blocks:
            x = block(x)
        if self.last:
            x = p.each(self._logits, x, *self._final_parameters())
        return x

    def replicated_parameters(self):
        """Parameters every TP rank holds whole (their gradients are partial under SP)."""
        params = [self.embedding] + [p for b in self.blocks for p in b.replicated_parameters()]
        return [p for p in [*params, *self._final_parameters()] if p is not None]

    def _final_parameters(self):
        """The final norm's parameters, then the head (None off the last stage)."""
        raise NotImplementedError

    def _logits(self, x, *final_parameters):
        raise NotImplementedError


class Transformer(DecoderStack):
    """Embedding, blocks, final LayerNorm, LM head.  ``layers`` picks the blocks this rank
    holds (pipeline stages); embedding / head are kept only where ``first`` / ``last``."""

    def __init__(self, n_layers, d, heads, seed, par, layers=None, first=True, last=True):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        embedding = _normal(g, VOCAB, d)
        blocks = [Block(i, d, heads, n_layers, par, g) for i in range(n_layers)]
        head = _normal(g, VOCAB, d)
        keep = range(n_layers) if layers is None else layers
        self.first, self.last = first, last
        self.embedding = par.replicated_parameter(embedding) if first else None
        self.blocks = nn.ModuleList(blocks[i] for i in keep)
        self.ln_f_w, self.ln_f_b = _layer_norm_parameters(par, d) if last else (None, None)
        self.head = par.replicated_parameter(head) if last else None
        self.par = par

    def _final_parameters(self):
        return [self.ln_f_w, self.ln_f_b, self.head]

    @staticmethod
    def _logits(x, w, b, head):
        return F.linear(_layer_norm(x, w, b), head)


def lm_loss(logits, targets, par):
    """Mean cross-entropy of next-token ``logits`` [s, b, vocab] (float32) against
    ``targets`` [s, b]; under SP each rank's over its part of the sequence (per rank, in an
    emulated group)."""
    if par.sequence_parallel:
        targets = par.shard(targets)
    return par.each(_cross_entropy, logits, targets)


def _cross_entropy(logits, targets):
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def training_flops(n_layers, d, seq_len, tokens):
    """Model FLOPs of one training step (forward + backward, 3x the forward's matrix
    products) over ``tokens`` tokens: 2 FLOPs per multiply-add of the linears (12 d^2 per
    layer and token, the head 256 d) and of attention's two products (2 s d per layer and
    token, the causal mask not subtracted, as Megatron and PaLM count them)."""
    per_token = n_layers * (12 * d * d + 2 * seq_len * d) + VOCAB * d
    return 3 * 2 * per_token * tokens
