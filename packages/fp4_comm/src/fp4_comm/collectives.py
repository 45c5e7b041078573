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

reduce_scatter is steps 1-3; all_gather is steps 4-6 on each rank's own tensor.  Both split
dim 0 as ``shard_rows`` says: ceil(d0 / W) rows per rank, the last ranks fewer or none (dim 0
padded with zero rows to a multiple of W, as a ``reduce_scatter_tensor`` of the padded tensor,
the padding dropped); ``all_gather`` with ``total_dim0`` is the inverse.

Buffers come from torch's caching allocator (on a GPU: stream-ordered reuse, no cudaMalloc per
call, and a CUDA graph's private pool under capture).
"""

from __future__ import annotations

import operator
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
            opts.error_feedback.store(ef_name, ef_hop, payload, local, codec.granularity)
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


def _fused_reduction(opts: Options):
    """Whether the all-reduce's middle step (decode the received chunks, add, encode again)
    can be the codec's one-pass ``requantized_sum``: nearest rounding (its encode draws no
    random words), no error feedback and no statistics (both need the float32 sum)."""
    return (
        hasattr(opts.codec, "requantized_sum")
        and opts.rounding == "nearest"
        and opts.error_feedback_name is None
        and not opts.stats
    )


def all_reduce(transport, x, opts: Options):
    """Sum of ``x`` over the ranks, same shape and dtype, identical bits on every rank."""
    W, rank = transport.world_size, transport.rank
    n = x.numel()
    c = padded_chunk(n, W, opts.codec.granularity)
    flat = x.contiguous().view(-1)  # reshape(-1) of a strided view can stay strided
    payload = flat.view(W, c) if n == W * c else F.pad(flat, (0, W * c - n)).view(W, c)
    sections = _encode(payload, rank, "reduce_scatter", opts, _prefix(n))
    if _fused_reduction(opts):
        # decode + float32 sum + encode in one pass (same bits as the three steps below)
        recv = receive_sections(opts.codec, W, c, sections[0].device)
        transport.all_to_all(list(zip(sections, recv, strict=True)))
        sections = opts.codec.requantized_sum(recv, c)
    else:
        reduced = _exchange_and_reduce(transport, sections, c, opts.codec)
        # The valid elements of this rank's chunk (the last chunks hold padding, or nothing).
        own_valid = max(0, min(c, n - rank * c))
        sections = _encode(reduced.view(1, c), rank, "all_gather", opts, _prefix(own_valid))
    y = _gather_and_decode(transport, sections, c, opts.codec, x.dtype)
    return y.reshape(-1)[:n].view(x.shape)


def shard_rows(dim0: int, world_size: int) -> list[int]:
    """Rows of dim 0 that each rank holds when ``dim0`` rows are split over ``world_size`` ranks:
    ``m = ceil(dim0 / W)`` rows each, rank r rows [r m, min((r + 1) m, dim0)), the last ranks
    fewer or none.  The pieces of ``torch.chunk(x, W)``, with empty ones for the ranks past its
    last chunk; equivalently, dim 0 zero-padded to W m rows, split evenly as
    ``torch.distributed.reduce_scatter_tensor`` does, and the padding rows dropped."""
    dim0 = _count(dim0, "shard_rows: dim0", 0)
    world_size = _count(world_size, "shard_rows: world_size", 1)
    m = -(-dim0 // world_size)
    return [max(0, min(m, dim0 - r * m)) for r in range(world_size)]


def _count(value, what, low):
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{what}: expected an int, got {type(value).__name__}") from None
    if v < low:
        raise ValueError(f"{what} is {v}; it must be >= {low}")
    return v


def reduce_scatter(transport, x, opts: Options):
    """x (d0, ...) on every rank -> (shard_rows(d0, W)[r], ...) on rank r: the sum over the
    ranks of rows [r m, r m + that), m = ceil(d0 / W).  With d0 a multiple of W, every rank gets
    d0 / W rows, as ``torch.distributed.reduce_scatter_tensor``."""
    W, rank = transport.world_size, transport.rank
    d0 = x.shape[0]
    row = x.numel() // d0 if d0 else 0
    m = -(-d0 // W)
    per_rank = m * row  # elements of one shard, padding rows included
    c = padded_chunk(per_rank, 1, opts.codec.granularity)
    flat = x.contiguous().view(-1)  # reshape(-1) of a strided view can stay strided
    if W * m != d0:
        # Zero rows pad dim 0 to W m rows (zeros encode exactly and change no amax): chunk j
        # is shard j, whole rows, so no rank's shard straddles two chunks.
        flat = F.pad(flat, (0, W * per_rank - d0 * row))
    payload = _padded(flat.view(W, per_rank), c)

    def valid(t):  # the elements of x in a (W, c) payload: neither padding rows nor columns
        return t[:, :per_rank].reshape(-1)[: d0 * row]

    sections = _encode(payload, rank, "reduce_scatter", opts, valid)
    reduced = _exchange_and_reduce(transport, sections, c, opts.codec)
    rows = shard_rows(d0, W)[rank]
    return reduced[: rows * row].to(x.dtype).view((rows,) + tuple(x.shape[1:]))


def all_gather(transport, x, opts: Options, total_dim0=None):
    """The inverse of ``reduce_scatter``'s split: rank r holds rows [r m, r m + d_r) of a
    (total_dim0, ...) tensor, d_r = shard_rows(total_dim0, W)[r]; every rank gets the whole
    tensor, decoded.  ``total_dim0`` None: every rank holds d0 rows, the result has W d0."""
    W, rank = transport.world_size, transport.rank
    d0 = x.shape[0]
    if total_dim0 is None:
        total_dim0 = W * d0
    m = -(-total_dim0 // W)  # rows of the largest shard (rank 0's)
    row = x.numel() // d0 if d0 else _numel(x.shape[1:])
    n = x.numel()
    # Every rank sends a chunk of the same length (NCCL's allGather needs equal counts): the
    # largest shard, padded to whole blocks; the shorter shards are zero-padded.
    c = padded_chunk(m * row, 1, opts.codec.granularity)
    payload = _padded(x.contiguous().view(1, n), c)
    sections = _encode(payload, rank, "all_gather", opts, _prefix(n))
    y = _gather_and_decode(transport, sections, c, opts.codec, x.dtype)
    if c != m * row:
        y = y[:, : m * row]
    # Shards before the last non-empty one are full (m rows), so the valid rows are the first
    # total_dim0 of the W m rows.
    y = y.reshape((W * m,) + tuple(x.shape[1:]))
    return y if W * m == total_dim0 else y[:total_dim0].contiguous()


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def send(transport, x, peer, opts: Options):
    n = x.numel()
    c = padded_chunk(n, 1, opts.codec.granularity)
    payload = _padded(x.contiguous().view(1, n), c)
    sections = _encode(payload, transport.rank, "send", opts, _prefix(n))
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
