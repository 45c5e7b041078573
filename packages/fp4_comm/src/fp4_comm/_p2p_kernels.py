"""The peer-to-peer transport's kernel, ``exchange``: the protocol, its layout constants, and
its primitives for two targets (CUDA through inline PTX, and plain Python for the CPU model of
``_p2p_model.py``).

The kernel is written once, in ``build_exchange(ops, jit)``: ``ops`` supplies the memory
operations (a load with acquire and a store with release at system scope, relaxed and plain
loads and stores, a compare-and-swap, a system fence, the global timer, copies of 16, 8, 4 and
1 bytes, the block barrier) and ``jit`` compiles each function for the target (numba's
``cuda.jit(device=True)``, or nothing: the same Python runs in threads on the CPU).  Every
address is an int64 (a device address, an address of host memory the device can see, or, in
the CPU model, an address of host memory).

The launch contract (``P2PTransport`` keeps it): one block of ``THREADS`` threads per (peer,
lane); the parameters are ``PARAMS``, every one an int64; ``lanes`` of this launch, at most
``lanes_max``, and no more than the message has pieces.  ``p2p.py``'s module docstring states
the protocol and argues why it is free of races and hangs.
"""

from __future__ import annotations

import functools
import re
from types import SimpleNamespace

# Threads of one block.  The copy loops stride by it; nothing else depends on the number.  256:
# the kernel takes about 128 registers a thread, and 256 threads launch whatever register count
# a compiler gives (at most 255 a thread, 65536 a block).
THREADS = 256
# Sections (codec payload parts) moved by one launch; more are moved by several launches.
MAX_SECTIONS = 4
# Every section starts on a 16-byte boundary of the packed message (the slots' layout).
SECTION_ALIGN = 16

# mode bits
MODE_SEND = 1  # push this rank's bytes into the peer's slots
MODE_RECV = 2  # take the peer's bytes out of this rank's slots
MODE_SEND_ROW_IS_PEER = 4  # the peer's row of each send section (all_to_all), else row 0
MODE_RECV_ROW_IS_PEER = 8  # the peer's row of each receive section (collectives), else row 0
MODE_ALL_TO_ALL = MODE_SEND | MODE_RECV | MODE_SEND_ROW_IS_PEER | MODE_RECV_ROW_IS_PEER
MODE_ALL_GATHER = MODE_SEND | MODE_RECV | MODE_RECV_ROW_IS_PEER

# operations, named in failure reports
OP_ALL_TO_ALL, OP_ALL_GATHER, OP_SEND, OP_RECV = 1, 2, 3, 4
OP_NAMES = {OP_ALL_TO_ALL: "all_to_all", OP_ALL_GATHER: "all_gather", OP_SEND: "send",
            OP_RECV: "recv"}  # fmt: skip

# The failure report: int64 words at the start of a page of host memory mapped into the device
# (the host reads it without a synchronization), and the host's abort word in the same page.
REPORT_STATUS, REPORT_PEER, REPORT_WAIT, REPORT_LANE = 0, 1, 2, 3
REPORT_OP, REPORT_EXPECTED, REPORT_SEEN, REPORT_WAITED_NS = 4, 5, 6, 7
HOST_ABORT = 16  # word index: 128 bytes in, on a line of its own
HOST_CTL_BYTES = 4096
STATUS_TIMEOUT = 1  # a wait passed its deadline
STATUS_ABORTED = 2  # the host asked the kernels to stop (HOST_ABORT)
WAIT_DATA = 1  # waiting for a peer's message
WAIT_SLOT = 2  # waiting for a peer to free the slot of an earlier message

# A spinning thread looks at the clock, the failure word and the host's abort word once every
# this many polls of its flag (each poll is an acquire load at system scope).
CHECK_EVERY = 64

#: The kernel's parameters, in order; every one an int64.
PARAMS = (
    "own_base",  # this rank's buffer (flags, counters, peer table, slots)
    "host_ctl",  # device address of the mapped host page (report, abort word)
    "rank",
    "world",
    "lanes_max",  # lanes of the layout
    "piece_bytes",  # bytes of one slot: a piece of a message
    "ready_off",
    "ack_off",
    "counters_off",
    "failed_off",
    "table_off",
    "data_off",
    "lanes",  # lanes of this launch
    "mode",
    "only_peer",  # -1: every rank (one block row per peer), else that peer only
    "timeout_ns",
    "op",
) + tuple(f"{k}{i}" for i in range(MAX_SECTIONS) for k in ("send", "recv", "nbytes"))

KIND_SELF, KIND_SEND, KIND_RECV = 0, 1, 2


def align_up(n: int, a: int) -> int:
    return -(-n // a) * a


def slot_free(ack: int, k: int) -> bool:
    """Whether message ``k`` of a lane may be written into its slot (slot ``k % 2``): the
    receiver has consumed message k - 2, the slot's previous tenant (``ack`` counts the
    messages it has consumed)."""
    return ack >= k - 1


def data_ready(flag: int, k: int) -> bool:
    """Whether message ``k`` of a lane is in its slot: the sender stores k + 1 in the slot's
    flag after the bytes (a flag only grows: k + 2 comes after the receiver freed slot k)."""
    return flag >= k + 1


# Where a lane's slots, flags and acknowledgements lie within their regions of a buffer
# (``p2p.Layout`` places the regions): the host, the CPU model and the kernel use these.
# ``lanes``: the layout's lanes (the kernel's ``lanes_max``).


def slot_at(data_off: int, index: int, lanes: int, lane: int, parity: int, piece_bytes: int) -> int:
    """Offset of slot ``parity`` of lane ``lane`` for the sender at ``index`` among the buffer
    owner's peers (slots are kept for the other ranks only)."""
    return data_off + ((index * lanes + lane) * 2 + parity) * piece_bytes


def ready_at(ready_off: int, src: int, lanes: int, lane: int, parity: int) -> int:
    """Offset of the flag that ``src`` releases when slot ``parity`` of lane ``lane`` is full."""
    return ready_off + 8 * ((src * lanes + lane) * 2 + parity)


def ack_at(ack_off: int, dst: int, lanes: int, lane: int) -> int:
    """Offset of the count of lane ``lane``'s messages that ``dst`` has consumed."""
    return ack_off + 8 * (dst * lanes + lane)


def block_target(block: int, lanes: int, only_peer: int) -> tuple[int, int]:
    """(peer, lane) of block ``block`` of a launch: one block per (peer, lane), peer-major, or
    with ``only_peer`` >= 0 one block per lane of that peer."""
    if only_peer < 0:
        peer = block // lanes
        lane = block - peer * lanes
    else:
        peer = only_peer
        lane = block
    return peer, lane


def packed_pieces(piece_bytes: int, n0: int, n1: int, n2: int, n3: int) -> int:
    """Pieces of ``piece_bytes`` in the packed message of sections of n0 .. n3 bytes a row, each
    starting on a 16-byte boundary (SECTION_ALIGN)."""
    total = (
        (n0 + 15) // 16 * 16 + (n1 + 15) // 16 * 16 + (n2 + 15) // 16 * 16 + (n3 + 15) // 16 * 16
    )
    return (total + piece_bytes - 1) // piece_bytes


def build_exchange(ops, jit):
    """The kernel's functions for one target; ``run_block`` is one block's whole work."""
    moves = _build_moves(ops, jit)
    waits = _build_waits(ops, jit)
    pass_piece = _build_pass(ops, jit, moves.move_piece, waits.wait_for)
    run_block = _build_block(ops, jit, moves.move_piece, pass_piece)
    return SimpleNamespace(**vars(moves), **vars(waits), run_block=run_block)


def _build_moves(ops, jit):
    """``copy_span``, and ``move_section`` / ``move_piece``: a piece's part of each section."""
    copy_v4x4, copy_v4, copy_v2 = ops.copy_v4x4, ops.copy_v4, ops.copy_v2
    copy_u32, copy_u8 = ops.copy_u32, ops.copy_u8

    @jit
    def copy_span(dst, src, n, tid, nthreads):
        """n bytes src -> dst by the block's threads: the widest access both addresses allow
        (16, 8, 4 bytes), the tail byte by byte."""
        both = dst | src
        if both & 15 == 0:
            w = 16
        elif both & 7 == 0:
            w = 8
        elif both & 3 == 0:
            w = 4
        else:
            w = 1
        # bytes moved by the wide loops; the byte loop below takes the rest (all of it at w 1)
        bulk = n - n % w if w > 1 else 0
        step = nthreads * w
        i = tid * w
        if w == 16:
            # four 16-byte loads in flight before their stores
            while i + 3 * step < bulk:
                copy_v4x4(dst + i, src + i, step)
                i += 4 * step
            while i < bulk:
                copy_v4(dst + i, src + i)
                i += step
        elif w == 8:
            while i < bulk:
                copy_v2(dst + i, src + i)
                i += step
        elif w == 4:
            while i < bulk:
                copy_u32(dst + i, src + i)
                i += step
        i = bulk + tid
        while i < n:
            copy_u8(dst + i, src + i)
            i += nthreads

    @jit
    def move_section(kind, qlo, qhi, o, n, send_row, recv_row, slot, tid, nthreads):
        """The part of one section that falls in the piece [qlo, qhi) of the packed message
        (the section at packed offset ``o``, ``n`` bytes a row)."""
        lo = max(qlo, o)
        hi = min(qhi, o + n)
        if lo >= hi:
            return
        if kind == KIND_SEND:
            copy_span(slot + (lo - qlo), send_row + (lo - o), hi - lo, tid, nthreads)
        elif kind == KIND_RECV:
            copy_span(recv_row + (lo - o), slot + (lo - qlo), hi - lo, tid, nthreads)
        else:
            copy_span(recv_row + (lo - o), send_row + (lo - o), hi - lo, tid, nthreads)

    @jit
    def move_piece(kind, qlo, piece_bytes, slot, srow, rrow, s0, r0, n0, s1, r1, n1, s2, r2,
                   n2, s3, r3, n3, tid, nthreads):  # fmt: skip
        qhi = qlo + piece_bytes
        o = 0
        move_section(kind, qlo, qhi, o, n0, s0 + srow * n0, r0 + rrow * n0, slot, tid, nthreads)
        o += (n0 + 15) // 16 * 16
        move_section(kind, qlo, qhi, o, n1, s1 + srow * n1, r1 + rrow * n1, slot, tid, nthreads)
        o += (n1 + 15) // 16 * 16
        move_section(kind, qlo, qhi, o, n2, s2 + srow * n2, r2 + rrow * n2, slot, tid, nthreads)
        o += (n2 + 15) // 16 * 16
        move_section(kind, qlo, qhi, o, n3, s3 + srow * n3, r3 + rrow * n3, slot, tid, nthreads)

    return SimpleNamespace(copy_span=copy_span, move_section=move_section, move_piece=move_piece)


def _build_waits(ops, jit):
    """``wait_for`` a peer's flag, with a deadline, and the failure ``report``."""
    ld_acquire, ld_relaxed, st_relaxed = ops.ld_acquire, ops.ld_relaxed, ops.st_relaxed
    cas, fence_sys, globaltimer = ops.cas, ops.fence_sys, ops.globaltimer
    slot_free_ = jit(slot_free)
    data_ready_ = jit(data_ready)

    @jit
    def report(failed, host_ctl, status, peer, wait, lane, op, expected, seen, waited):
        """The first failure of this rank (one compare-and-swap on the failure word decides
        which) is written to the host page, its status word last."""
        if cas(failed, 0, status) == 0:
            st_relaxed(host_ctl + 8 * REPORT_PEER, peer)
            st_relaxed(host_ctl + 8 * REPORT_WAIT, wait)
            st_relaxed(host_ctl + 8 * REPORT_LANE, lane)
            st_relaxed(host_ctl + 8 * REPORT_OP, op)
            st_relaxed(host_ctl + 8 * REPORT_EXPECTED, expected)
            st_relaxed(host_ctl + 8 * REPORT_SEEN, seen)
            st_relaxed(host_ctl + 8 * REPORT_WAITED_NS, waited)
            fence_sys()
            st_relaxed(host_ctl + 8 * REPORT_STATUS, status)

    @jit
    def wait_for(addr, k, wait, timeout_ns, failed, host_ctl, peer, lane, op):
        """Spin until the flag at ``addr`` says message ``k`` may go (WAIT_SLOT) or has come
        (WAIT_DATA), with a deadline: False when it passed (reported), when the host asked to
        stop (reported) or when another block of this rank failed (already reported)."""
        start = globaltimer()
        spins = 0
        while True:
            seen = ld_acquire(addr)
            if wait == WAIT_SLOT:
                if slot_free_(seen, k):
                    return True
            elif data_ready_(seen, k):
                return True
            spins += 1
            if spins % CHECK_EVERY == 0:
                if ld_relaxed(failed) != 0:
                    return False
                waited = globaltimer() - start
                expected = k - 1 if wait == WAIT_SLOT else k + 1
                if ld_relaxed(host_ctl + 8 * HOST_ABORT) != 0:
                    report(failed, host_ctl, STATUS_ABORTED, peer, wait, lane, op, expected,
                           seen, waited)  # fmt: skip
                    return False
                if waited > timeout_ns:
                    report(failed, host_ctl, STATUS_TIMEOUT, peer, wait, lane, op, expected,
                           seen, waited)  # fmt: skip
                    return False

    return SimpleNamespace(report=report, wait_for=wait_for)


def _build_pass(ops, jit, move_piece, wait_for):
    """``pass_piece``: one side of a message's handshake for one piece."""
    st_release, barrier = ops.st_release, ops.barrier

    @jit
    def pass_piece(kind, k, wait, wait_at, release_at, slot, qlo, piece_bytes, srow, rrow, s0, r0,
                   n0, s1, r1, n1, s2, r2, n2, s3, r3, n3, tid, nthreads, shared, timeout_ns,
                   failed, host_ctl, peer, lane, op):  # fmt: skip
        """One side of message ``k``'s handshake for the piece at ``qlo``: thread 0 waits for
        the word at ``wait_at`` (``wait_for``; ``shared[0]`` carries its verdict to the block),
        the block copies the piece into ``slot`` (KIND_SEND) or out of it (KIND_RECV), and
        thread 0 releases k + 1 at ``release_at``.  The barrier before the release orders every
        thread's copy before it (cumulative): the receiver that acquires the flag sees the
        whole piece, the sender that acquires the ack overwrites a slot no thread still reads.
        False when the wait failed: the block stops."""
        if tid == 0:
            if not wait_for(wait_at, k, wait, timeout_ns, failed, host_ctl, peer, lane, op):
                shared[0] = 1
        barrier()
        if shared[0] != 0:
            return False
        move_piece(kind, qlo, piece_bytes, slot, srow, rrow, s0, r0, n0, s1, r1, n1, s2, r2, n2,
                   s3, r3, n3, tid, nthreads)  # fmt: skip
        barrier()
        if tid == 0:
            st_release(release_at, k + 1)
        return True

    return pass_piece


def _build_block(ops, jit, move_piece, pass_piece):
    """``run_block``: one block's pieces to and from its peer."""
    ld_relaxed, barrier = ops.ld_relaxed, ops.barrier
    ld_plain, st_plain = ops.ld_plain, ops.st_plain
    slot_at_, ready_at_, ack_at_ = jit(slot_at), jit(ready_at), jit(ack_at)
    block_target_, packed_pieces_ = jit(block_target), jit(packed_pieces)

    @jit
    def run_block(tid, nthreads, shared, block, own_base, host_ctl, rank, world, lanes_max,
                  piece_bytes, ready_off, ack_off, counters_off, failed_off, table_off,
                  data_off, lanes, mode, only_peer, timeout_ns, op, s0, r0, n0, s1, r1, n1,
                  s2, r2, n2, s3, r3, n3):  # fmt: skip
        """One block: the pieces of lane ``lane`` of the message to and from one peer.

        Message k of a lane (counted per peer and lane, in device memory, over every launch)
        goes in slot k % 2 of that lane.  Sending it: wait until the peer consumed message
        k - 2, copy, barrier, release the slot's flag = k + 1.  Receiving it: acquire the flag
        = k + 1, copy out, barrier, release the ack = k + 1 in the sender's buffer.
        ``shared[0]`` carries thread 0's verdict on a wait to the block (1: stop)."""
        peer, lane = block_target_(block, lanes, only_peer)
        failed = own_base + failed_off
        if tid == 0:
            # an earlier failure of this rank: the launches queued after it end at once
            shared[0] = 1 if ld_relaxed(failed) != 0 else 0
        barrier()
        if shared[0] != 0:
            return
        pieces = packed_pieces_(piece_bytes, n0, n1, n2, n3)
        srow = peer if mode & MODE_SEND_ROW_IS_PEER else 0
        rrow = peer if mode & MODE_RECV_ROW_IS_PEER else 0
        if peer == rank:
            q = lane
            while q < pieces:
                move_piece(KIND_SELF, q * piece_bytes, piece_bytes, 0, srow, rrow, s0, r0, n0,
                           s1, r1, n1, s2, r2, n2, s3, r3, n3, tid, nthreads)  # fmt: skip
                q += lanes
            return
        peer_base = ld_plain(own_base + table_off + 8 * peer)
        sent_at = own_base + counters_off + 8 * (peer * lanes_max + lane)
        recvd_at = sent_at + 8 * world * lanes_max
        sent = ld_plain(sent_at)
        recvd = ld_plain(recvd_at)
        # slots are kept for the other ranks only: index of the sender among them
        out_index = rank - 1 if rank > peer else rank
        in_index = peer - 1 if peer > rank else peer
        q = lane
        while q < pieces:
            qlo = q * piece_bytes
            if mode & MODE_SEND:
                # wait until the peer consumed message sent - 2, fill the slot, raise its flag
                parity = sent & 1
                consumed = own_base + ack_at_(ack_off, peer, lanes_max, lane)
                flag = peer_base + ready_at_(ready_off, rank, lanes_max, lane, parity)
                slot = peer_base + slot_at_(data_off, out_index, lanes_max, lane, parity,
                                            piece_bytes)  # fmt: skip
                if not pass_piece(KIND_SEND, sent, WAIT_SLOT, consumed, flag, slot, qlo,
                                  piece_bytes, srow, rrow, s0, r0, n0, s1, r1, n1, s2, r2, n2, s3,
                                  r3, n3, tid, nthreads, shared, timeout_ns, failed, host_ctl,
                                  peer, lane, op):  # fmt: skip
                    return
                sent += 1
            if mode & MODE_RECV:
                # wait for the flag of message recvd, empty the slot, acknowledge it
                parity = recvd & 1
                flag = own_base + ready_at_(ready_off, peer, lanes_max, lane, parity)
                consumed = peer_base + ack_at_(ack_off, rank, lanes_max, lane)
                slot = own_base + slot_at_(data_off, in_index, lanes_max, lane, parity,
                                           piece_bytes)  # fmt: skip
                if not pass_piece(KIND_RECV, recvd, WAIT_DATA, flag, consumed, slot, qlo,
                                  piece_bytes, srow, rrow, s0, r0, n0, s1, r1, n1, s2, r2, n2, s3,
                                  r3, n3, tid, nthreads, shared, timeout_ns, failed, host_ctl,
                                  peer, lane, op):  # fmt: skip
                    return
                recvd += 1
            q += lanes
        if tid == 0:
            st_plain(sent_at, sent)
            st_plain(recvd_at, recvd)

    return run_block


# ---------------------------------------------------------------------- the CUDA target


def _asm_intrinsic(ptx, constraint, n_in, returns):
    """A numba intrinsic of ``n_in`` int64 operands (and an int64 result where ``returns``):
    one inline-PTX block, never reordered or removed (side effects, memory clobber where the
    constraint says so)."""
    from llvmlite import ir
    from numba.core import types
    from numba.cuda.extending import intrinsic

    i64 = ir.IntType(64)
    out = types.int64 if returns else types.void

    def codegen(context, builder, signature, args):
        ret = i64 if returns else ir.VoidType()
        asm = ir.InlineAsm(ir.FunctionType(ret, [i64] * n_in), ptx, constraint, side_effect=True)
        value = builder.call(asm, list(args))
        return value if returns else context.get_dummy_value()

    def typer(*args):
        if len(args) != n_in or any(a != types.int64 for a in args):
            return None
        return out(*args), codegen

    # @intrinsic reads the typer's parameters: one fixed signature per arity
    if n_in == 0:
        return intrinsic(lambda typingctx: typer())
    if n_in == 1:
        return intrinsic(lambda typingctx, a: typer(a))
    if n_in == 2:
        return intrinsic(lambda typingctx, a, b: typer(a, b))
    if n_in == 3:
        return intrinsic(lambda typingctx, a, b, c: typer(a, b, c))
    raise ValueError(n_in)


_V4X4 = (
    "{ .reg .b32 w<16>; .reg .b64 s<3>, d<3>; "
    "add.s64 s0, $1, $2; add.s64 s1, s0, $2; add.s64 s2, s1, $2; "
    "add.s64 d0, $0, $2; add.s64 d1, d0, $2; add.s64 d2, d1, $2; "
    "ld.global.v4.u32 {w0, w1, w2, w3}, [$1]; ld.global.v4.u32 {w4, w5, w6, w7}, [s0]; "
    "ld.global.v4.u32 {w8, w9, w10, w11}, [s1]; ld.global.v4.u32 {w12, w13, w14, w15}, [s2]; "
    "st.global.v4.u32 [$0], {w0, w1, w2, w3}; st.global.v4.u32 [d0], {w4, w5, w6, w7}; "
    "st.global.v4.u32 [d1], {w8, w9, w10, w11}; st.global.v4.u32 [d2], {w12, w13, w14, w15}; }"
)

#: The PTX of every CUDA primitive: (instruction block, constraints, int64 operands, result).
CUDA_PTX = {
    # flags: acquire / release at system scope (the peer is another process, maybe another GPU)
    "ld_acquire": ("ld.acquire.sys.global.u64 $0, [$1];", "=l,l,~{memory}", 1, True),
    "st_release": ("st.release.sys.global.u64 [$0], $1;", "l,l,~{memory}", 2, False),
    # the failure word (device) and the host page (mapped host memory): read fresh each time
    "ld_relaxed": ("ld.relaxed.sys.global.u64 $0, [$1];", "=l,l,~{memory}", 1, True),
    "st_relaxed": ("st.relaxed.sys.global.u64 [$0], $1;", "l,l,~{memory}", 2, False),
    # counters and the peer table: written by earlier launches of this rank only
    "ld_plain": ("ld.global.u64 $0, [$1];", "=l,l,~{memory}", 1, True),
    "st_plain": ("st.global.u64 [$0], $1;", "l,l,~{memory}", 2, False),
    "cas": ("atom.global.cas.b64 $0, [$1], $2, $3;", "=l,l,l,l,~{memory}", 3, True),
    "fence_sys": ("fence.sc.sys;", "~{memory}", 0, False),
    "globaltimer": ("mov.u64 $0, %globaltimer;", "=l", 0, True),
    # data: weak loads and stores, ordered by the barriers and the flags around them (the
    # memory clobber keeps the compiler from moving them across either)
    "copy_v4x4": (_V4X4, "l,l,l,~{memory}", 3, False),
    "copy_v4": (
        "{ .reg .b32 w<4>; ld.global.v4.u32 {w0, w1, w2, w3}, [$1]; "
        "st.global.v4.u32 [$0], {w0, w1, w2, w3}; }",
        "l,l,~{memory}",
        2,
        False,
    ),
    "copy_v2": (
        "{ .reg .b32 w<2>; ld.global.v2.u32 {w0, w1}, [$1]; st.global.v2.u32 [$0], {w0, w1}; }",
        "l,l,~{memory}",
        2,
        False,
    ),
    "copy_u32": (
        "{ .reg .b32 w; ld.global.u32 w, [$1]; st.global.u32 [$0], w; }",
        "l,l,~{memory}",
        2,
        False,
    ),
    "copy_u8": (
        "{ .reg .b16 h; ld.global.u8 h, [$1]; st.global.u8 [$0], h; }",
        "l,l,~{memory}",
        2,
        False,
    ),
}


@functools.cache
def cuda_ops():
    """The primitives as numba-cuda intrinsics (inline PTX), and the block barrier."""
    from numba import cuda

    ops = {name: _asm_intrinsic(*spec) for name, spec in CUDA_PTX.items()}

    def _barrier():
        cuda.syncthreads()

    ops["barrier"] = cuda.jit(device=True)(_barrier)
    return SimpleNamespace(**ops)


@functools.cache
def exchange_kernel():
    """The ``@cuda.jit`` kernel: one block per (peer, lane) of ``run_block``."""
    from numba import cuda, int64

    run_block = build_exchange(cuda_ops(), cuda.jit(device=True, forceinline=True)).run_block

    @cuda.jit
    def exchange(own_base, host_ctl, rank, world, lanes_max, piece_bytes, ready_off, ack_off,
                 counters_off, failed_off, table_off, data_off, lanes, mode, only_peer,
                 timeout_ns, op, s0, r0, n0, s1, r1, n1, s2, r2, n2, s3, r3, n3):  # fmt: skip
        shared = cuda.shared.array(1, int64)
        run_block(cuda.threadIdx.x, cuda.blockDim.x, shared, cuda.blockIdx.x, own_base,
                  host_ctl, rank, world, lanes_max, piece_bytes, ready_off, ack_off,
                  counters_off, failed_off, table_off, data_off, lanes, mode, only_peer,
                  timeout_ns, op, s0, r0, n0, s1, r1, n1, s2, r2, n2, s3, r3, n3)  # fmt: skip

    return exchange


def signature():
    """The kernel's numba signature: every parameter an int64."""
    from numba.core import types

    return (types.int64,) * len(PARAMS)


def entry_name(ptx: str) -> str:
    """The name of the PTX's kernel entry."""
    found = re.findall(r"\.entry\s+(\S+?)\s*\(", ptx)
    if len(found) != 1:
        raise RuntimeError(f"expected one kernel entry in the PTX, found {len(found)}")
    return found[0]


def entry_params(ptx: str) -> list[str]:
    """The PTX types of the kernel entry's parameters, in order."""
    entry = re.search(r"\.entry\s+\S+?\s*\((.*?)\)", ptx, re.S).group(1)
    return re.findall(r"\.param\s+\.(\w+)", entry)


def compile_ptx(cc: tuple[int, int]) -> str:
    """The kernel's PTX for compute capability ``cc`` (numba-cuda's NVVM; the device functions
    too are compiled for ``cc``, not for whatever device numba would find current)."""
    from fp4_kernels.testing import compile_ptx as compile_for

    return compile_for(exchange_kernel(), signature(), cc=tuple(cc))


def check_ptx_params(ptx: str) -> None:
    """The launch packs ``PARAMS`` as consecutive 8-byte words: the PTX entry must take
    exactly that (a numba release that added a parameter would shift every argument)."""
    params = entry_params(ptx)
    if len(params) != len(PARAMS) or any(p not in ("u64", "s64", "b64") for p in params):
        raise RuntimeError(
            f"the p2p exchange kernel's PTX entry takes {params}, not {len(PARAMS)} 8-byte "
            "integers: this numba-cuda release is not supported"
        )


# ---------------------------------------------------------------------- the Python target


def python_ops(on_store=None, on_release=None, poll=None):
    """The primitives on host memory, for the CPU model (``_p2p_model.py``): each block runs
    with one thread, in a Python thread of its own; the GIL makes every access atomic and
    sequentially consistent (the model checks the protocol's logic, not the GPU's weak
    ordering, which the module docstring of ``p2p.py`` argues).  ``on_store(addr, n)`` is
    called before every data store, ``on_release(addr, value)`` before every flag release
    (the model's hazard checks), ``poll()`` on every flag poll (a chance to switch threads)."""
    import ctypes
    import threading
    import time

    lock = threading.Lock()

    def word(addr):
        return ctypes.c_int64.from_address(addr)

    def ld(addr):
        return word(addr).value

    def ld_acquire(addr):
        if poll is not None:
            poll()
        return word(addr).value

    def st(addr, value):
        word(addr).value = value

    def st_release(addr, value):
        if on_release is not None:
            on_release(addr, value)
        word(addr).value = value

    def cas(addr, compare, value):
        with lock:
            old = word(addr).value
            if old == compare:
                word(addr).value = value
            return old

    def copy(n):
        def move(dst, src):
            if on_store is not None:
                on_store(dst, n)
            ctypes.memmove(dst, src, n)

        return move

    copy_v4 = copy(16)

    def copy_v4x4(dst, src, stride):
        for j in range(4):
            copy_v4(dst + j * stride, src + j * stride)

    return SimpleNamespace(
        ld_acquire=ld_acquire,
        st_release=st_release,
        ld_relaxed=ld,
        st_relaxed=st,
        ld_plain=ld,
        st_plain=st,
        cas=cas,
        fence_sys=lambda: None,
        globaltimer=time.monotonic_ns,
        barrier=lambda: None,
        copy_v4x4=copy_v4x4,
        copy_v4=copy_v4,
        copy_v2=copy(8),
        copy_u32=copy(4),
        copy_u8=copy(1),
    )
