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

That is the two-shot all-reduce (``all_reduce_algorithm="two_shot"``).  The one-shot one
(``"one_shot"``): each rank encodes its whole payload once, an all-gather gives every rank
every rank's payload, and every rank decodes the W payloads and adds them in rank order in
float32, rounding once to the input's dtype.  One quantization instead of two (no encode of
the sum), so its bits differ from the two-shot's; W times the bytes a rank receives, one
exchange instead of two: the faster one for small messages on few ranks.  Both give identical
bits on every rank.  ``"auto"`` (``resolve_all_reduce_algorithm``): one-shot where the
transport says so (the peer-to-peer one) for at most ONE_SHOT_MAX_RANKS ranks and
ONE_SHOT_MAX_BYTES of input, two-shot otherwise.

reduce_scatter is steps 1-3; all_gather is steps 4-6 on each rank's own tensor.  Both split
dim 0 as ``shard_rows`` says: ceil(d0 / W) rows per rank, the last ranks fewer or none (dim 0
padded with zero rows to a multiple of W, as a ``reduce_scatter_tensor`` of the padded tensor,
the padding dropped); ``all_gather`` with ``total_dim0`` is the inverse.

Every call runs a *plan* of its kind (``_Plan``): sizes, padding, the layout of its buffers,
the Philox key offsets and the decoders' views worked out once.  A ``Communicator`` keeps the
plans of the kinds of call it has made (``communicator.PLAN_CACHE_SIZE``), so that a repeated
call does no check and no layout again, and each plan keeps its receive buffers per stream for
its next calls (the rule that makes this safe, and where it does not apply: ``_Plan``).  Other
buffers come from torch's caching allocator (on a GPU: stream-ordered reuse, no cudaMalloc per
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
ALL_REDUCE_ALGORITHMS = ("auto", "one_shot", "two_shot")
#: "auto" takes the one-shot all-reduce on transports that ask for it (``Transport.
#: one_shot_auto``: the peer-to-peer one) up to this many ranks and bytes of input (as vLLM's
#: custom all-reduce, whose one-shot kernel serves messages below 512 KB on up to 4 GPUs).
ONE_SHOT_MAX_RANKS = 4
ONE_SHOT_MAX_BYTES = 512 << 10


def check_all_reduce_algorithm(algorithm) -> str:
    """``algorithm`` if it is one of ALL_REDUCE_ALGORITHMS, else ValueError naming it."""
    if not isinstance(algorithm, str) or algorithm not in ALL_REDUCE_ALGORITHMS:
        raise ValueError(
            f"all_reduce_algorithm: {algorithm!r} is not one of 'auto', 'one_shot', 'two_shot'"
        )
    return algorithm


def resolve_all_reduce_algorithm(algorithm: str, one_shot_auto: bool, world: int, nbytes: int):
    """The algorithm ("one_shot" or "two_shot") that ``algorithm`` means for an all-reduce of
    ``nbytes`` bytes of input over ``world`` ranks of a transport whose ``one_shot_auto`` is
    given."""
    if algorithm != "auto":
        return algorithm
    small = world <= ONE_SHOT_MAX_RANKS and nbytes <= ONE_SHOT_MAX_BYTES
    return "one_shot" if one_shot_auto and small else "two_shot"


@dataclass
class Options:
    codec: Codec
    rounding: str = "nearest"
    seed: int = 0
    step: int | torch.Tensor = 0  # or a one-element int64 tensor holding it (CUDA graphs)
    error_feedback: object = None  # ErrorFeedback
    error_feedback_name: str | None = None
    stats: bool = False
    collected: dict = field(default_factory=dict)  # hop -> HopStats


def rank_seed(seed: int, rank: int, hop: str) -> int:
    """The stochastic-rounding key of one rank and hop: ranks must not draw the same random
    words, or their rounding errors would be correlated instead of averaging out."""
    return (seed + (1 + rank + (HOPS.index(hop) << 20)) * _KEY_STRIDE) % 2**64


def wire_step(step):
    """The step the encode kernels take: an int modulo 2^32, or the one-element int64 tensor
    holding it (``graphs.device_step``), which they read as it is."""
    return step % 2**32 if type(step) is int else step


def _section_spans(codec: Codec, chunks: int, n: int, start: int = 0):
    """(offset, bytes per chunk) of each section of ``chunks`` chunks of ``n`` elements laid out
    in one flat buffer from byte ``start`` (rounded up to SECTION_ALIGN_BYTES), and the byte
    after the last one."""
    spans, end = [], -(-start // SECTION_ALIGN_BYTES) * SECTION_ALIGN_BYTES
    for b in codec.section_nbytes(n):
        spans.append((end, b))
        end += -(-(chunks * b) // SECTION_ALIGN_BYTES) * SECTION_ALIGN_BYTES
    return spans, end


def _section_views(flat, spans, chunks):
    return [flat[o : o + chunks * b].view(chunks, b) for o, b in spans]


def receive_sections(codec: Codec, chunks: int, n: int, device):
    """(chunks, nbytes_i) uint8 views into one new flat buffer, one per section."""
    spans, total = _section_spans(codec, chunks, n)
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    return _section_views(flat, spans, chunks)


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
        payload, opts.rounding, rank_seed(opts.seed, rank, hop), wire_step(opts.step)
    )
    if opts.stats or ef_name is not None:
        local = codec.decode(sections, payload.shape[1])
        if opts.stats:
            sat = codec.saturated(sections, payload.shape[1])
            opts.collected[hop] = hop_stats(payload, local, sat, valid)
        if ef_name is not None:
            # store() consumes the corrected payload (the residual is computed in its memory);
            # a codec whose sections are that memory (a float32 wire of the float32 payload)
            # must send a copy, or the wire would carry the residual instead of the values
            if _shares_memory(sections, payload):
                sections = [s.clone() for s in sections]
            opts.error_feedback.store(ef_name, ef_hop, payload, local, codec.granularity)
    return sections


def _shares_memory(sections, t):
    base = t.untyped_storage().data_ptr()
    return any(s.untyped_storage().data_ptr() == base for s in sections)


def _sum_rows(d):
    """Rows of (W, c) float32 added in rank order, one IEEE add at a time (deterministic and
    reproducible by any float32 implementation, unlike a library reduction)."""
    acc = d[0] if d.shape[0] == 1 else d[0] + d[1]
    for i in range(2, d.shape[0]):
        acc += d[i]
    return acc


def _sum_to(d, dtype):
    """The rows of the float32 (W, k) ``d`` added in rank order, in ``dtype``: float32 adds,
    then one rounding to the dtype (the last add writes it straight into the result, as
    ``(... + d[W-1]).to(dtype)``)."""
    W = d.shape[0]
    if W == 1 or dtype == torch.float32:
        return _sum_rows(d).to(dtype)
    acc = d[0]
    for i in range(1, W - 1):
        acc = acc + d[i] if i == 1 else acc.add_(d[i])
    out = torch.empty(d.shape[1], dtype=dtype, device=d.device)
    return torch.add(acc, d[W - 1], out=out)


def _fused_reduction(opts: Options):
    """Whether the all-reduce's middle step (decode the received chunks, add, encode again)
    can be the codec's fused ``requantized_sum`` (NVFP4 and MXFP4: the same bits from the
    encoded chunks, each NVFP4 chunk under its own tensor scale): nearest rounding (its encode
    draws no random words), no error feedback and no statistics (both need the float32 sum)."""
    return (
        hasattr(opts.codec, "requantized_sum")
        and opts.rounding == "nearest"
        and opts.error_feedback_name is None
        and not opts.stats
    )


# ---------------------------------------------------------------------- plans

# A plan keeps its buffers (receive sections, and the zero-padded copy of an input that is no
# whole number of chunks) for its next calls where they take at most this many bytes: an FP4
# all-reduce of up to about 28 MB of bfloat16.  Larger ones come from torch's caching
# allocator on every call: a few microseconds beside transfers of that size, and no memory
# held between calls.  With the communicator's PLAN_CACHE_SIZE plans (more where its graph
# cache keeps more graphs), at most PLAN_CACHE_SIZE * REUSE_STREAMS * REUSE_MAX_BYTES are
# held, typically far less.
REUSE_MAX_BYTES = 16 << 20
# Streams one plan keeps buffers for (a call on another stream drops the oldest set).
REUSE_STREAMS = 2


class _Plan:
    """One kind of call, worked out once: (op, shape, dtype, codec, rounding, world size, rank,
    error feedback and statistics on or off).  The chunk size, the padding, the layout of the
    call's buffers in one allocation and the stochastic-rounding key offsets are computed when
    the plan is made; a call then encodes, moves and decodes, with no check repeated.

    Buffer reuse, and why it is safe: a call's buffers are written and read only by work it
    queues on the current stream (the copy of a padded input, the transfers into the receive
    sections, the decodes out of them).  The next call on the same stream queues its own
    writes after all of that, so it may reuse them: stream order separates the two calls, on
    the GPU as on the host.  Hence buffers are kept per stream (a call on another stream gets
    its own set: work on two streams is not ordered), never under CUDA-graph capture (a
    captured call allocates inside the capture, from the graph's private pool, as before: the
    graph owns its buffers and a replay, on whatever stream, never shares them with an eager
    call or another graph), and only where no result can be a view of them: codecs whose
    decode makes new memory (``Codec.decode_copies``), or a send, which returns nothing.
    Over gloo every call is synchronous, so the same holds trivially.

    Layout: the receive sections whose decode a call returns come first in the allocation, so
    that a result that is a view of them starts where its storage starts, as other torch ops'
    results do (DDP's reducer, for one, views a comm hook's result by absolute storage offset).
    """

    #: buffers that this kind of call returns views of: never kept (see above)
    returns_views_of_buffers = True
    #: the operation the ranks compare before a call (``Communicator``), where it is not the
    #: call's own: the one-shot all-reduce moves other bytes than the two-shot one
    check_op: str | None = None

    def __init__(self, transport, opts: Options, dtype):
        self.codec, self.rounding, self.dtype = opts.codec, opts.rounding, dtype
        self.world, self.rank, self.device = transport.world_size, transport.rank, transport.device
        self.plain = opts.error_feedback_name is None and not opts.stats
        # A section of one row is sent to every peer by transports that say they can; the
        # others get it repeated (NVFP4's tensor scale, shared by the chunks of one encode).
        self.broadcast_rows = getattr(transport, "broadcast_rows", False)
        self._parts = []
        self._nbytes = 0
        self._kept = {}  # stream -> this call kind's buffers on it

    # -- layout, while the plan is made

    def _receive(self, chunks, c, dtype=None, requantize=False):
        """Receive sections of ``chunks`` chunks of ``c`` elements, decoded to ``dtype`` (or
        summed and encoded again: ``requantize``); returns their index in ``buffers()``."""
        spans, self._nbytes = _section_spans(self.codec, chunks, c, self._nbytes)
        self._parts.append(("receive", spans, chunks, c, dtype, requantize))
        return len(self._parts) - 1

    def _stage(self, shape, dtype):
        """A zero-padded (rows, c) copy of the input; its index in ``buffers()``."""
        offset = -(-self._nbytes // SECTION_ALIGN_BYTES) * SECTION_ALIGN_BYTES
        nbytes = shape[0] * shape[1] * dtype.itemsize
        self._nbytes = offset + nbytes
        self._parts.append(("stage", offset, nbytes, shape, dtype))
        return len(self._parts) - 1

    def _done(self):
        reusable = self.codec.decode_copies or not self.returns_views_of_buffers
        self.reuse = reusable and 0 < self._nbytes <= REUSE_MAX_BYTES

    # -- per call

    def buffers(self):
        """The call's buffers: this stream's kept set, or a new one."""
        if not self.reuse:
            return self._allocate()
        stream = None
        if self.device.type == "cuda":
            if torch.cuda.is_current_stream_capturing():
                return self._allocate()
            stream = torch._C._cuda_getCurrentRawStream(self.device.index)
        b = self._kept.get(stream)
        if b is None:
            if len(self._kept) >= REUSE_STREAMS:
                del self._kept[next(iter(self._kept))]
            b = self._kept[stream] = self._allocate()
        return b

    def _allocate(self):
        if not self._nbytes:
            return ()
        flat = torch.empty(self._nbytes, dtype=torch.uint8, device=self.device)
        out = []
        for part in self._parts:
            if part[0] == "stage":
                _, offset, nbytes, shape, dtype = part
                stage = flat[offset : offset + nbytes].view(dtype).view(shape)
                out.append(stage.zero_())  # the padding; calls overwrite the rest only
                continue
            _, spans, chunks, c, dtype, requantize = part
            sections = _section_views(flat, spans, chunks)
            if requantize:
                out.append((sections, self.codec.requantizer(sections, c)))
            else:
                out.append((sections, self.codec.decoder(sections, c, dtype)))
        return out

    def _row(self, x, bufs):
        """The input as one (1, c) row: a view of it where it needs no padding, else its
        zero-padded copy in the plan's stage buffer (``self.stage``, ``self.n``)."""
        if self.stage is None:
            return x.contiguous().view(1, self.n)
        payload = bufs[self.stage]
        payload[0, : self.n].view(self.shape).copy_(x)
        return payload

    def _key_offset(self, hop):
        """rank_seed(seed, rank, hop) == (seed + this) % 2**64."""
        return rank_seed(0, self.rank, hop)

    def _encode(self, payload, hop, key_offset, opts, valid):
        if self.plain:
            seed = (opts.seed + key_offset) % 2**64
            return self.codec.encode_unchecked(payload, self.rounding, seed, wire_step(opts.step))
        return _encode(payload, self.rank, hop, opts, valid)

    def _all_to_all(self, transport, sections, recv):
        if not self.broadcast_rows and self.world > 1:
            sections = [s if s.shape[0] > 1 else s.expand(self.world, -1).contiguous()
                        for s in sections]  # fmt: skip
        transport.all_to_all(list(zip(sections, recv, strict=True)))


class AllReducePlan(_Plan):
    """``all_reduce`` of (shape, dtype): see the module's docstring for the algorithm."""

    def __init__(self, transport, opts: Options, shape, dtype):
        super().__init__(transport, opts, dtype)
        W = self.world
        self.shape, self.n = tuple(shape), _numel(shape)
        self.c = c = padded_chunk(self.n, W, self.codec.granularity)
        self.fused = _fused_reduction(opts)
        self.gather = self._receive(W, c, dtype)  # first: see _Plan
        self.spread = self._receive(W, c, None if self.fused else torch.float32, self.fused)
        self.stage = self._stage((W, c), dtype) if self.n != W * c else None
        self.keys = self._key_offset("reduce_scatter"), self._key_offset("all_gather")
        # The valid elements of this rank's chunk (the last chunks hold padding, or nothing).
        own_valid = max(0, min(c, self.n - self.rank * c))
        self.valid = _prefix(self.n), _prefix(own_valid)
        self._done()

    def run(self, transport, x, opts: Options):
        bufs, W, c = self.buffers(), self.world, self.c
        if self.stage is None:
            payload = x.contiguous().view(W, c)  # view(-1) of a strided view can stay strided
        else:
            payload = bufs[self.stage]
            payload.view(-1)[: self.n].view(self.shape).copy_(x)
        sections = self._encode(payload, "reduce_scatter", self.keys[0], opts, self.valid[0])
        recv, reduce = bufs[self.spread]
        self._all_to_all(transport, sections, recv)
        if self.fused:
            sections = reduce()  # decode + float32 sum + encode in one pass, the same bits
        else:
            reduced = _sum_rows(reduce()).view(1, c)
            sections = self._encode(reduced, "all_gather", self.keys[1], opts, self.valid[1])
        recv, decode = bufs[self.gather]
        transport.all_gather(list(zip(sections, recv, strict=True)))
        y = decode()
        return y.view(self.shape) if self.stage is None else y.view(-1)[: self.n].view(self.shape)


class OneShotAllReducePlan(_Plan):
    """``all_reduce`` of (shape, dtype), one-shot (the module's docstring): the whole payload
    encoded once (the "reduce_scatter" hop: its stochastic-rounding key, its statistics, the
    worker residual of error feedback), gathered by every rank, decoded and added in rank
    order in float32, rounded once to the dtype."""

    check_op = "all_reduce_one_shot"

    def __init__(self, transport, opts: Options, shape, dtype):
        super().__init__(transport, opts, dtype)
        self.shape, self.n = tuple(shape), _numel(shape)
        self.c = c = padded_chunk(self.n, 1, self.codec.granularity)
        self.gather = self._receive(self.world, c, torch.float32)
        self.stage = self._stage((1, c), dtype) if self.n != c else None
        self.key = self._key_offset("reduce_scatter")
        self.valid = _prefix(self.n)
        # the sum of two or more ranks is new memory (_sum_to), whatever the decode returns:
        # the buffers may be kept then, for the "none" codecs too
        self.returns_views_of_buffers = self.world == 1
        self._done()

    def run(self, transport, x, opts: Options):
        bufs = self.buffers()
        payload = self._row(x, bufs)
        sections = self._encode(payload, "reduce_scatter", self.key, opts, self.valid)
        recv, decode = bufs[self.gather]
        transport.all_gather(list(zip(sections, recv, strict=True)))
        return _sum_to(decode()[:, : self.n], self.dtype).view(self.shape)


class ReduceScatterPlan(_Plan):
    """``reduce_scatter`` of (shape, dtype)."""

    def __init__(self, transport, opts: Options, shape, dtype):
        super().__init__(transport, opts, dtype)
        W = self.world
        self.shape = shape = tuple(shape)
        d0 = shape[0]
        row = _numel(shape) // d0 if d0 else 0
        m = -(-d0 // W)
        self.per_rank = per_rank = m * row  # elements of one shard, padding rows included
        self.c = c = padded_chunk(per_rank, 1, self.codec.granularity)
        # Zero rows pad dim 0 to W m rows (zeros encode exactly and change no amax): chunk j is
        # shard j, whole rows, so no rank's shard straddles two chunks.  The first `full`
        # shards are whole, shard `full` holds the `rest` rows left.
        self.full = d0 // m if m else 0
        self.rest = (d0 - self.full * m) * row
        self.spread = self._receive(W, c, torch.float32)  # first: see _Plan
        self.stage = None if W * m == d0 and per_rank == c else self._stage((W, c), dtype)
        self.key = self._key_offset("reduce_scatter")
        rows = shard_rows(d0, W)[self.rank]
        self.keep, self.out_shape = rows * row, (rows, *shape[1:])
        n = d0 * row

        def valid(t):  # the elements of x in a (W, c) payload: neither padding rows nor columns
            return t[:, :per_rank].reshape(-1)[:n]

        self.valid = valid
        self._done()

    def run(self, transport, x, opts: Options):
        bufs = self.buffers()
        if self.stage is None:
            payload = x.contiguous().view(self.world, self.c)
        else:
            payload = bufs[self.stage]
            flat, full, per_rank = x.reshape(-1), self.full, self.per_rank
            payload[:full, :per_rank].copy_(flat[: full * per_rank].view(full, per_rank))
            if self.rest:
                payload[full, : self.rest].copy_(flat[full * per_rank :])
        sections = self._encode(payload, "reduce_scatter", self.key, opts, self.valid)
        recv, decode = bufs[self.spread]
        self._all_to_all(transport, sections, recv)
        return _sum_to(decode()[:, : self.keep], self.dtype).view(self.out_shape)


class AllGatherPlan(_Plan):
    """``all_gather`` of (shape, dtype), rank r holding shard_rows(total_dim0, W)[r] rows."""

    def __init__(self, transport, opts: Options, shape, dtype, total_dim0=None):
        super().__init__(transport, opts, dtype)
        W = self.world
        self.shape = shape = tuple(shape)
        d0 = shape[0]
        self.total = W * d0 if total_dim0 is None else total_dim0
        self.m = m = -(-self.total // W)  # rows of the largest shard (rank 0's)
        self.row = row = _numel(shape) // d0 if d0 else _numel(shape[1:])
        self.n = n = _numel(shape)
        # Every rank sends a chunk of the same length (NCCL's allGather needs equal counts):
        # the largest shard, padded to whole blocks; the shorter shards are zero-padded.
        self.c = c = padded_chunk(m * row, 1, self.codec.granularity)
        self.gather = self._receive(W, c, dtype)  # first: see _Plan
        self.stage = self._stage((1, c), dtype) if n != c else None
        self.key = self._key_offset("all_gather")
        self.valid = _prefix(n)
        self._done()

    def run(self, transport, x, opts: Options):
        bufs, W, m = self.buffers(), self.world, self.m
        payload = self._row(x, bufs)
        sections = self._encode(payload, "all_gather", self.key, opts, self.valid)
        recv, decode = bufs[self.gather]
        transport.all_gather(list(zip(sections, recv, strict=True)))
        y = decode()
        if self.c != m * self.row:
            y = y[:, : m * self.row]
        # Shards before the last non-empty one are full (m rows), so the valid rows are the
        # first total_dim0 of the W m rows.
        y = y.reshape((W * m, *self.shape[1:]))
        return y if W * m == self.total else y[: self.total].contiguous()


class SendPlan(_Plan):
    """``send`` of (shape, dtype)."""

    returns_views_of_buffers = False

    def __init__(self, transport, opts: Options, shape, dtype):
        super().__init__(transport, opts, dtype)
        self.shape, self.n = tuple(shape), _numel(shape)
        self.c = padded_chunk(self.n, 1, self.codec.granularity)
        self.stage = self._stage((1, self.c), dtype) if self.n != self.c else None
        self.key = self._key_offset("send")
        self.valid = _prefix(self.n)
        self._done()

    def run(self, transport, x, opts: Options, peer):
        if self.stage is None:
            payload = x.contiguous().view(1, self.n)
        else:
            payload = self.buffers()[self.stage]
            payload[0, : self.n].view(self.shape).copy_(x)
        transport.send(self._encode(payload, "send", self.key, opts, self.valid), peer)


class RecvPlan(_Plan):
    """``recv`` of (shape, dtype)."""

    def __init__(self, transport, opts: Options, shape, dtype):
        super().__init__(transport, opts, dtype)
        self.shape, self.n = tuple(shape), _numel(shape)
        self.c = padded_chunk(self.n, 1, self.codec.granularity)
        self.receive = self._receive(1, self.c, dtype)
        self._done()

    def run(self, transport, opts: Options, peer):
        sections, decode = self.buffers()[self.receive]
        transport.recv(sections, peer)
        y = decode()
        return y.view(self.shape) if self.n == self.c else y.view(-1)[: self.n].view(self.shape)


#: The plan class of each operation (all_reduce: the two-shot one; ``all_reduce_plan``).
PLANS = {
    "all_reduce": AllReducePlan,
    "reduce_scatter": ReduceScatterPlan,
    "all_gather": AllGatherPlan,
    "send": SendPlan,
    "recv": RecvPlan,
}


# ---------------------------------------------------------------------- one call, no plan kept


ALL_REDUCE_PLANS = {"one_shot": OneShotAllReducePlan, "two_shot": AllReducePlan}


def all_reduce_plan(algorithm: str, transport, nbytes: int):
    """The plan class of an all-reduce of ``nbytes`` bytes of input over ``transport`` for
    ``algorithm`` ("auto", "one_shot", "two_shot"; checked by the caller)."""
    one_shot_auto = getattr(transport, "one_shot_auto", False)
    resolved = resolve_all_reduce_algorithm(algorithm, one_shot_auto, transport.world_size, nbytes)
    return ALL_REDUCE_PLANS[resolved]


def all_reduce(transport, x, opts: Options, algorithm: str = "two_shot"):
    """Sum of ``x`` over the ranks, same shape and dtype, identical bits on every rank."""
    cls = all_reduce_plan(algorithm, transport, x.numel() * x.element_size())
    return cls(transport, opts, x.shape, x.dtype).run(transport, x, opts)


def shard_rows(dim0: int, world_size: int) -> list[int]:
    """Rows of dim 0 that each rank holds when ``dim0`` rows are split over ``world_size`` ranks:
    ``m = ceil(dim0 / W)`` rows each, rank r rows [r m, min((r + 1) m, dim0)), the last ranks
    fewer or none.  The pieces of ``torch.chunk(x, W)``, with empty ones for the ranks past its
    last chunk; equivalently, dim 0 zero-padded to W m rows, split evenly as
    ``torch.distributed.reduce_scatter_tensor`` does, and the padding rows dropped."""
    dim0 = _count(dim0, "shard_rows: dim0", 0)
    world_size = _count(world_size, "shard_rows: world_size", 1)
    if world_size > MAX_WORLD_SIZE:
        raise ValueError(f"shard_rows: world_size is {world_size}; at most 2**24 ranks (the "
                         "list it returns holds one count a rank)")  # fmt: skip
    m = -(-dim0 // world_size)
    return [max(0, min(m, dim0 - r * m)) for r in range(world_size)]


MAX_WORLD_SIZE = 2**24  # ranks shard_rows splits over: more than any machine has


def _count(value, what, low):
    try:
        if isinstance(value, bool):  # an int to operator.index, never meant as a count
            raise TypeError
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
    return ReduceScatterPlan(transport, opts, x.shape, x.dtype).run(transport, x, opts)


def all_gather(transport, x, opts: Options, total_dim0=None):
    """The inverse of ``reduce_scatter``'s split: rank r holds rows [r m, r m + d_r) of a
    (total_dim0, ...) tensor, d_r = shard_rows(total_dim0, W)[r]; every rank gets the whole
    tensor, decoded.  ``total_dim0`` None: every rank holds d0 rows, the result has W d0."""
    plan = AllGatherPlan(transport, opts, x.shape, x.dtype, total_dim0)
    return plan.run(transport, x, opts)


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def send(transport, x, peer, opts: Options):
    SendPlan(transport, opts, x.shape, x.dtype).run(transport, x, opts, peer)


def recv(transport, shape, dtype, peer, opts: Options):
    return RecvPlan(transport, opts, shape, dtype).run(transport, opts, peer)


def collected_stats(opts: Options) -> dict[str, HopStats]:
    return dict(opts.collected)
