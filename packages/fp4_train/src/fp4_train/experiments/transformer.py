"""A decoder-only byte-level transformer whose linears are split Megatron-style over a
``fp4_comm.TensorParallelGroup``, in Megatron's [sequence, batch, hidden] layout.

Byte embedding (vocabulary 256), pre-LayerNorm blocks of causal self-attention and a GELU MLP
of width 4d, a final LayerNorm and an LM head.  QKV and MLP-up are column-parallel (heads and
hidden units split), attention-out and MLP-down row-parallel; embedding, LayerNorms and head
are replicated (a 256-token vocabulary needs no vocabulary-parallel embedding).  The full
weights are drawn from the seed first and then sliced, so one process, any number of tensor-
parallel ranks and the pipeline stages all start from the same model.
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


class Block(nn.Module):
    """Pre-LN attention + MLP; the linears split over ``par`` (a TensorParallelGroup)."""

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

    def __init__(self, n_layers, d, heads, seed, par, layers=None, first=True, last=True):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        embedding = _normal(g, VOCAB, d)
        blocks = [Block(i, d, heads, n_layers, par, g) for i in range(n_layers)]
        head = _normal(g, VOCAB, d)
        keep = range(n_layers) if layers is None else layers
        self.first, self.last = first, last
        self.embedding = nn.Parameter(embedding) if first else None
        self.blocks = nn.ModuleList(blocks[i] for i in keep)
        self.ln_f = nn.LayerNorm(d) if last else None
        self.head = nn.Parameter(head) if last else None
        self.par = par

    def forward(self, x):
        """Token ids [s, b] (first stage) or hidden states -> hidden states or logits."""
        if self.first:
            x = F.embedding(x, self.embedding)
            if self.par.sequence_parallel:
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
    if par.sequence_parallel:
        targets = par.shard(targets)
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def training_flops(n_layers, d, seq_len, tokens):
    """Model FLOPs of one training step (forward + backward, 3x the forward's matrix
    products) over ``tokens`` tokens: 2 FLOPs per multiply-add of the linears (12 d^2 per
    layer and token, the head 256 d) and of attention's two products (2 s d per layer and
    token, the causal mask not subtracted, as Megatron and PaLM count them)."""
    per_token = n_layers * (12 * d * d + 2 * seq_len * d) + VOCAB * d
    return 3 * 2 * per_token * tokens
