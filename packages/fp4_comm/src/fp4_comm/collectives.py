"""The compressed collective algorithms, over any ``Transport``.

Every algorithm works on flat payloads split into equal chunks whose length is a multiple of
the codec's block size; zeros pad the end (zeros encode and decode exactly, and do not change a
block's or a tensor's amax).  Reductions decode to float32 and add the ranks' chunks in rank
order, one float32 add at a time, so the sum does not depend on the library's reduction order.

all_reduce (W ranks, payload of W chunks):
    1. each rank encodes its W chunks (one encode call)                    [hop "reduce_scatter"]
    2. all-to-all: chunk j of every rank goes to rank j
    3. rank j decodes the W chunks it received and adds them in float32
    4. rank j encodes its reduced chunk                                    [hop "all_gather"]
    5. all-gather of the encoded reduced chunks
    6. every rank decodes the same W encoded chunks: bit-identical results on all ranks.

reduce_scatter is steps 1-3; all_gather is steps 4-6 on each rank's own tensor.

Buffers come from torch's caching allocator (on a GPU: stream-ordered reuse, no cudaMalloc per
call, and a CUDA graph's private pool under capture).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .codecs import Codec, padded_chunk
from .stats import HopStats, hop_stats

# Offsets of the sections in one receive buffer are rounded up to this many bytes, so that each
# section can be viewed as float32 (NVFP4's tensor scales) and starts on an aligned address.
SECTION_ALIGN_BYTES = 16
# The golden-ratio increment (2^64 / phi): rank and hop give distinct, well-spread Philox keys.
_KEY_STRIDE = 0x9E3779B97F4A7C15
HOPS = ("reduce_scatter", "all_gather", "send")


@dataclass
class Options:
    codec: Codec
    rounding: str = "nearest"
    seed: int = 0
    step: int = 0
    error_feedback: object = None  # ErrorFeedback
    error_feedback_name: str | None = None
    stats: bool = False
    collected: dict = field(default_factory=dict)  # hop -> HopStats


def rank_seed(seed: int, rank: int, hop: str) -> int:
    """The stochastic-rounding key of one rank and hop: ranks must not draw the same random
    words, or their rounding errors would be correlated instead of averaging out."""
    return (seed + (1 + rank + (HOPS.index(hop) << 20)) * _KEY_STRIDE) % 2**64


def receive_sections(codec: Codec, chunks: int, n: int, device):
    """(chunks, nbytes_i) uint8 views into one new flat buffer, one per section."""
    sizes = codec.section_nbytes(n)
    offsets, total = [], 0
    for s in sizes:
        offsets.append(total)
        total += -(-(chunks * s) // SECTION_ALIGN_BYTES) * SECTION_ALIGN_BYTES
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    return [flat[o : o + chunks * s].view(chunks, s) for o, s in zip(offsets, sizes, strict=True)]


def _padded(x2d, c):
    """(rows, m) -> (rows, c) with zeros after column m; a view when m == c."""
    m = x2d.shape[1]
    return x2d if m == c else F.pad(x2d, (0, c - m))


def _prefix(n):
    return lambda t: t.reshape(-1)[:n]


def _encode(payload, rank, hop, opts: Options, valid):
    """Encode (chunks, c) ``payload``; keep its error-feedback residual and statistics.
    ``valid`` maps a (chunks, c) tensor to its elements that are not padding."""
    codec = opts.codec
    ef_name = opts.error_feedback_name
    ef_hop = "worker" if hop != "all_gather" else "server"
    if ef_name is not None:
        payload = opts.error_feedback.corrected(ef_name, ef_hop, payload)
    sections = codec.encode(
        payload, opts.rounding, rank_seed(opts.seed, rank, hop), opts.step % 2**32
    )
    if opts.stats or ef_name is not None:
        local = codec.decode(sections, payload.shape[1])
        if opts.stats:
            sat = codec.saturated(sections, payload.shape[1])
            opts.collected[hop] = hop_stats(payload, local, sat, valid)
        if ef_name is not None:
            opts.error_feedback.store(ef_name, ef_hop, payload, local)
    return sections


def _sum_rows(d):
    """Rows of (W, c) float32 added in rank order, one IEEE add at a time (deterministic and
    reproducible by any float32 implementation, unlike a library reduction)."""
    acc = d[0] if d.shape[0] == 1 else d[0] + d[1]
    for i in range(2, d.shape[0]):
        acc += d[i]
    return acc


def _exchange_and_reduce(transport, sections, c, codec):
    recv = receive_sections(codec, transport.world_size, c, sections[0].device)
    transport.all_to_all(list(zip(sections, recv, strict=True)))
    return _sum_rows(codec.decode(recv, c))


def _gather_and_decode(transport, sections, c, codec, dtype):
    recv = receive_sections(codec, transport.world_size, c, sections[0].device)
    transport.all_gather(list(zip(sections, recv, strict=True)))
    return codec.decode(recv, c, dtype)


def all_reduce(transport, x, opts: Options):
    """Sum of ``x`` over the ranks, same shape and dtype, identical bits on every rank."""
    W, rank = transport.world_size, transport.rank
    n = x.numel()
    c = padded_chunk(n, W, opts.codec.granularity)
    flat = x.reshape(-1)
    payload = flat.view(W, c) if n == W * c else F.pad(flat, (0, W * c - n)).view(W, c)
    sections = _encode(payload, rank, "reduce_scatter", opts, _prefix(n))
    reduced = _exchange_and_reduce(transport, sections, c, opts.codec)
    # The valid elements of this rank's chunk (the last chunks hold padding, or nothing).
    own_valid = max(0, min(c, n - rank * c))
    sections = _encode(reduced.view(1, c), rank, "all_gather", opts, _prefix(own_valid))
    y = _gather_and_decode(transport, sections, c, opts.codec, x.dtype)
    return y.reshape(-1)[:n].view(x.shape)


def reduce_scatter(transport, x, opts: Options):
    """x (W * m, ...) on every rank -> (m, ...): rank r gets the sum of the ranks' r-th slices."""
    W, rank = transport.world_size, transport.rank
    m_rows = x.shape[0] // W
    per_rank = x.numel() // W
    c = padded_chunk(per_rank, 1, opts.codec.granularity)
    payload = _padded(x.reshape(W, per_rank), c)
    sections = _encode(payload, rank, "reduce_scatter", opts, lambda t: t[:, :per_rank])
    reduced = _exchange_and_reduce(transport, sections, c, opts.codec)
    return reduced[:per_rank].to(x.dtype).view((m_rows,) + tuple(x.shape[1:]))


def all_gather(transport, x, opts: Options):
    """x (d0, ...) on every rank -> (W * d0, ...), rank r's tensor at rows [r d0, (r+1) d0)."""
    W, rank = transport.world_size, transport.rank
    n = x.numel()
    c = padded_chunk(n, 1, opts.codec.granularity)
    payload = _padded(x.reshape(1, n), c)
    sections = _encode(payload, rank, "all_gather", opts, _prefix(n))
    y = _gather_and_decode(transport, sections, c, opts.codec, x.dtype)
    if c != n:
        y = y[:, :n].contiguous()
    return y.view((W * x.shape[0],) + tuple(x.shape[1:]))


def send(transport, x, peer, opts: Options):
    n = x.numel()
    c = padded_chunk(n, 1, opts.codec.granularity)
    sections = _encode(_padded(x.reshape(1, n), c), transport.rank, "send", opts, _prefix(n))
    transport.send(sections, peer)


def recv(transport, shape, dtype, peer, opts: Options):
    n = 1
    for s in shape:
        n *= s
    c = padded_chunk(n, 1, opts.codec.granularity)
    sections = receive_sections(opts.codec, 1, c, transport.device)
    transport.recv(sections, peer)
    y = opts.codec.decode(sections, c, dtype)
    return y.reshape(-1)[:n].view(shape)


def collected_stats(opts: Options) -> dict[str, HopStats]:
    return dict(opts.collected)
