"""A Qwen2-style decoder whose linears are split Megatron-style over a parallel group, in
Megatron's [sequence, batch, hidden] layout.

The architecture of Qwen2 (Yang et al. 2024, arXiv 2407.10671; its ``modeling_qwen2``):
pre-norm blocks with RMSNorm (eps 1e-6, float32 statistics), grouped-query attention with
rotary position embeddings (RoPE, base 10^6, the rotate-half pairing) and biases on the Q, K
and V projections only, a SwiGLU MLP (``down(silu(gate(x)) * up(x))``), a final RMSNorm and an
LM head that is *not* tied to the embedding (as Qwen2-7B, the model of the TP study this
reproduces; Qwen2-0.5B ties them).  Untied, the pipeline's two stages each hold one of the two
matrices and need no exchange of the embedding's gradient.

Tensor parallelism as Megatron-LM splits it: Q, K, V (with their biases) and the MLP's gate and
up projections column-parallel (each rank holds ``heads / k`` query heads, ``kv_heads / k`` key
and value heads, ``ffn / k`` hidden units), the attention output and MLP down projections
row-parallel; norms, embedding and head replicated.  The full weights are drawn from the seed
first (normal, std 0.02; the two residual projections 0.02 / sqrt(2 * layers) as GPT-2 and
Megatron scale them; biases 0, norms 1) and then sliced, so one process, any number of
tensor-parallel ranks, the emulated ranks and the pipeline stages all start from the same
model.  Written against the parallel-group interface, as ``transformer.Transformer``.

Sizes (``SIZES``; parameters with the BPE corpus's vocabulary of 16 384): ``125m`` (12 layers,
d = 768, 16 heads of 48, 8 key/value heads, SwiGLU width 2048: 78 M in the blocks, 103 M in
all), ``600m`` (22 layers, d = 1536, 24 heads of 64, 8 key/value heads, width 4096: 555 M + 50 M
= 605 M), and ``tiny`` for tests.  Head counts divide by 8, so TP = 2, 4 and 8 all split them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .transformer import DecoderStack

INIT_STD = 0.02  # Qwen2's initializer_range


@dataclass(frozen=True)
class QwenConfig:
    layers: int
    d_model: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    rope_theta: float = 1e6
    norm_eps: float = 1e-6

    def __post_init__(self):
        for name in ("layers", "d_model", "heads", "kv_heads", "ffn", "vocab"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"QwenConfig: {name} = {v!r}; it must be a positive int")
        if self.d_model % self.heads or (self.d_model // self.heads) % 2:
            raise ValueError(f"QwenConfig: d_model {self.d_model} must split into {self.heads} "
                             "heads of an even width (RoPE rotates pairs)")  # fmt: skip
        if self.heads % self.kv_heads:
            raise ValueError(f"QwenConfig: heads {self.heads} must be a multiple of kv_heads "
                             f"{self.kv_heads}")  # fmt: skip

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    def parameter_count(self) -> int:
        d, dh = self.d_model, self.head_dim
        qkv = (self.heads + 2 * self.kv_heads) * dh
        block = d * qkv + qkv + self.heads * dh * d + 3 * d * self.ffn + 2 * d
        return self.layers * block + 2 * self.vocab * d + d

    def flops_per_token(self, seq_len: int) -> int:
        """Model FLOPs of one training step per token (forward + backward, 3x the forward's
        matrix products; 2 FLOPs a multiply-add): the linears and the LM head, and attention's
        two products (2 s (heads * head_dim) multiply-adds per layer and token, the causal mask
        not subtracted, as Megatron and PaLM count them)."""
        d, dh = self.d_model, self.head_dim
        linears = d * (self.heads + 2 * self.kv_heads) * dh + self.heads * dh * d
        linears += 3 * d * self.ffn
        attention = 2 * seq_len * self.heads * dh
        return 3 * 2 * (self.layers * (linears + attention) + self.vocab * d)


#: name -> (layers, d_model, heads, kv_heads, ffn)
SIZES = {
    "tiny": (2, 64, 4, 2, 128),
    "125m": (12, 768, 16, 8, 2048),
    "600m": (22, 1536, 24, 8, 4096),
}


def config(size: str, vocab: int) -> QwenConfig:
    """The preset ``size`` with a vocabulary of ``vocab`` tokens."""
    if size not in SIZES:
        raise ValueError(f"size {size!r}: one of {', '.join(SIZES)}")
    layers, d, heads, kv, ffn = SIZES[size]
    return QwenConfig(layers, d, heads, kv, ffn, vocab)


def _normal(g, *shape, std=INIT_STD):
    return torch.randn(*shape, generator=g) * std


def _cat(*ws):
    return torch.cat(ws)


class Rope:
    """cos and sin of the rotary embedding, float32 [s, head_dim], per length and device."""

    def __init__(self, head_dim: int, theta: float) -> None:
        self.inv_freq = 1.0 / theta ** (
            torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
        )
        self._cache: dict = {}

    def __call__(self, s: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (s, str(device))
        if key not in self._cache:
            angles = torch.arange(s, dtype=torch.float64)[:, None] * self.inv_freq[None, :]
            angles = torch.cat([angles, angles], dim=-1)  # rotate-half: pairs (i, i + dh / 2)
            self._cache[key] = tuple(t.float().to(device) for t in (angles.cos(), angles.sin()))
        return self._cache[key]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of x [..., s, head_dim], in float32, back to x's dtype."""
    x32 = x.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


class QwenBlock(nn.Module):
    """RMSNorm, grouped-query attention, RMSNorm, SwiGLU MLP, each around a residual add; the
    linears split over ``par``."""

    def __init__(self, i: int, cfg: QwenConfig, par, g: torch.Generator, rope: Rope) -> None:
        super().__init__()
        k = par.size
        for what, n in (("heads", cfg.heads), ("kv_heads", cfg.kv_heads), ("ffn", cfg.ffn)):
            if n % k:
                raise ValueError(f"{what} = {n} does not divide by the tensor-parallel size {k}")
        self.i, self.par, self.cfg, self.rope = i, par, cfg, rope
        self.heads_local, self.kv_local = cfg.heads // k, cfg.kv_heads // k
        d, dh = cfg.d_model, cfg.head_dim
        out_std = INIT_STD / math.sqrt(2 * cfg.layers)
        wq, wk, wv = (_normal(g, n * dh, d) for n in (cfg.heads, cfg.kv_heads, cfg.kv_heads))
        bq, bk, bv = (torch.zeros(n * dh) for n in (cfg.heads, cfg.kv_heads, cfg.kv_heads))
        wo = _normal(g, d, cfg.heads * dh, std=out_std)
        w_gate, w_up = _normal(g, cfg.ffn, d), _normal(g, cfg.ffn, d)
        w_down = _normal(g, d, cfg.ffn, std=out_std)
        self.norm1 = par.replicated_parameter(torch.ones(d))
        self.norm2 = par.replicated_parameter(torch.ones(d))
        # column-parallel: this rank's query heads, and the key/value heads they share
        self.w_qkv = par.sharded_parameter(par.each(_cat, *(par.shard(w) for w in (wq, wk, wv))))
        self.b_qkv = par.sharded_parameter(par.each(_cat, *(par.shard(b) for b in (bq, bk, bv))))
        self.w_o = par.sharded_parameter(par.shard(wo, dim=1))  # row-parallel
        self.w_gate_up = par.sharded_parameter(par.each(_cat, par.shard(w_gate), par.shard(w_up)))
        self.w_down = par.sharded_parameter(par.shard(w_down, dim=1))

    def forward(self, x):  # x: [s, b, d] (with SP: this rank's part of s)
        p, site = self.par, f"L{self.i}"
        h = p.enter(p.each(self._norm, x, self.norm1), f"{site}.attn")
        a = p.each(self._attention, h, self.w_qkv, self.b_qkv, self.w_o)
        x = p.each(torch.add, x, p.exit(a, f"{site}.attn"))
        h = p.enter(p.each(self._norm, x, self.norm2), f"{site}.mlp")
        m = p.each(_swiglu, h, self.w_gate_up, self.w_down)
        return p.each(torch.add, x, p.exit(m, f"{site}.mlp"))

    def _norm(self, x, w):
        return F.rms_norm(x, (x.shape[-1],), w, self.cfg.norm_eps)

    def _attention(self, h, w_qkv, b_qkv, w_o):
        """This rank's heads: Q, K, V, RoPE, causal attention (grouped), and the partial
        output projection."""
        s, b, _ = h.shape
        dh, hl, kvl = self.cfg.head_dim, self.heads_local, self.kv_local
        q, k, v = F.linear(h, w_qkv, b_qkv).split([hl * dh, kvl * dh, kvl * dh], dim=-1)
        q, k, v = (t.reshape(s, b, n, dh).permute(1, 2, 0, 3)
                   for t, n in ((q, hl), (k, kvl), (v, kvl)))  # fmt: skip
        cos, sin = self.rope(s, h.device)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hl != kvl)
        a = a.permute(2, 0, 1, 3).reshape(s, b, hl * dh)
        return F.linear(a, w_o)

    def replicated_parameters(self):
        return [self.norm1, self.norm2]


def _swiglu(h, w_gate_up, w_down):
    gate, up = F.linear(h, w_gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w_down)


class Qwen(DecoderStack):
    """Embedding, blocks, final RMSNorm, LM head.  ``layers`` picks the blocks this rank holds
    (pipeline stages); the embedding / norm and head are kept only where ``first`` / ``last``."""

    def __init__(self, cfg: QwenConfig, seed: int, par, layers=None, first=True, last=True):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        rope = Rope(cfg.head_dim, cfg.rope_theta)
        embedding = _normal(g, cfg.vocab, cfg.d_model)
        blocks = [QwenBlock(i, cfg, par, g, rope) for i in range(cfg.layers)]
        head = _normal(g, cfg.vocab, cfg.d_model)
        keep = range(cfg.layers) if layers is None else layers
        self.cfg, self.par, self.first, self.last = cfg, par, first, last
        self.embedding = par.replicated_parameter(embedding) if first else None
        self.blocks = nn.ModuleList(blocks[i] for i in keep)
        self.norm_f = par.replicated_parameter(torch.ones(cfg.d_model)) if last else None
        self.head = par.replicated_parameter(head) if last else None

    def _final_parameters(self):
        return [self.norm_f, self.head]

    def _logits(self, x, norm, head):
        return F.linear(F.rms_norm(x, (x.shape[-1],), norm, self.cfg.norm_eps), head)
