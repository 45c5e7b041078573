"""A CPU model of the peer-to-peer transport, for tests without a GPU.

``ModelWorld(W)`` holds W ranks in one process: each rank's buffer and host page are numpy
arrays, each rank a real ``P2PTransport`` (its host code: planning, packing, failure reports),
and each launch runs the exchange kernel's own code (``_p2p_kernels.build_exchange`` with the
Python primitives) as one Python thread per block, one thread a block.  Call each rank from a
thread of its own: a launch returns when its blocks are done, and they wait for the peers'.

The model checks the protocol's logic (counters, flags, acknowledgements, pieces, lanes,
deadlines, reports), with every interleaving the threads happen to take; it does not check the
GPU's weak memory ordering (the GIL makes every access sequentially consistent), which
``p2p.py`` argues and the GPU tests exercise.  With ``check=True`` every store into a receive
slot is checked against the slot's state: a store into a slot whose message the receiver has
not consumed yet is recorded in ``violations``.
"""

from __future__ import annotations

import ctypes
import threading
import time
from types import SimpleNamespace

import numpy as np
import torch

from . import _p2p_kernels as K
from .p2p import BufferLayout, P2PTransport

_ALIGN = 256


class _HostMemory:
    def __init__(self, nbytes):
        self._raw = np.zeros(nbytes + _ALIGN, np.uint8)
        start = -self._raw.ctypes.data % _ALIGN
        self.array = self._raw[start : start + nbytes]
        self.base = self.array.ctypes.data
        self._host = np.zeros(K.HOST_CTL_BYTES // 8, np.int64)
        self.host_ctl = self.host_ctl_device = self._host.ctypes.data

    def write(self, offset, data):
        self.array[offset : offset + len(data)] = np.frombuffer(data, np.uint8)

    def free(self):
        pass


class _ModelStream:
    """Launches are synchronous in the model: nothing is ever queued."""

    def current(self):
        return 0

    def wait(self, timeout_s, check):
        return True

    def drain(self):
        pass


class ModelWorld:
    """W ranks of the transport in this process, on the CPU (see the module docstring).

    ``dead``: ranks whose launches never run (a killed peer)."""

    def __init__(self, world, timeout_s=5.0, buffer_bytes=None, lanes=2, check=True):
        if buffer_bytes is None:
            buffer_bytes = max(1, world - 1) * lanes * 2 * 256  # 256-byte slots: many pieces
        self.layout = BufferLayout.for_buffer(world, lanes, buffer_bytes)
        self.memories = [_HostMemory(self.layout.total_bytes) for _ in range(world)]
        self.bases = [m.base for m in self.memories]
        self.violations: list[str] = []
        self.dead: set[int] = set()
        self.launches = 0
        ops = K.python_ops(on_store=self._on_store if check else None, poll=_yield)
        self.kernel = K.build_exchange(ops, lambda f: f)
        self.transports = []
        for r in range(world):
            t = P2PTransport.__new__(P2PTransport)
            t._assemble(r, world, torch.device("cpu"), self.layout, self.memories[r], self.bases,
                        timeout_s, self._launcher(r), _ModelStream(), watchdog=False)  # fmt: skip
            t._control = None
            self.transports.append(t)

    def _launcher(self, rank):
        """What ``P2PTransport`` launches with: ``launch`` takes ``cuLaunchKernel``'s
        arguments and runs the grid's blocks on the parameters the pointers point at."""

        def launch(handle, grid, gy, gz, threads, by, bz, shared_bytes, stream, pointers, extra):
            self.launches += 1
            if rank in self.dead:
                return 0
            values = [ctypes.c_int64.from_address(p).value for p in pointers]
            errors = []

            def block(b):
                try:
                    self.kernel.run_block(0, 1, np.zeros(1, np.int64), b, *values)
                except BaseException as err:  # noqa: BLE001 - handed to the caller below
                    errors.append(err)

            threads = [threading.Thread(target=block, args=(b,), daemon=True) for b in range(grid)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if errors:
                raise errors[0]
            return 0

        return SimpleNamespace(handle=0, launch=launch)

    def _on_store(self, addr, n):
        """A store of ``n`` bytes at ``addr``: where it falls into a receive slot, the slot's
        last published message must have been consumed already."""
        layout = self.layout
        for owner, base in enumerate(self.bases):
            off = addr - base
            if not layout.data_off <= off < layout.total_bytes:
                continue
            slot, within = divmod(off - layout.data_off, layout.piece_bytes)
            index, rest = divmod(slot, layout.lanes * 2)
            lane, parity = divmod(rest, 2)
            src = index + 1 if index >= owner else index
            if within + n > layout.piece_bytes:
                self.violations.append(f"a store of {n} bytes crosses slot {slot}'s end")
            published = self._word(owner, layout.ready_at(src, lane, parity))
            consumed = self._word(src, layout.ack_at(owner, lane))
            if published > consumed:
                self.violations.append(
                    f"rank {src} wrote into slot (lane {lane}, parity {parity}) of rank {owner} "
                    f"holding message {published - 1}, which rank {owner} has not consumed "
                    f"({consumed} consumed)"
                )
            return

    def _word(self, rank, offset):
        return int(self.memories[rank].array[offset : offset + 8].view(np.int64)[0])

    def run(self, fn, *args, timeout_s=60.0):
        """``fn(transport, *args)`` for every live rank, each in a thread of its own; the list
        of results (an exception raised by a rank is re-raised here)."""
        results = [None] * len(self.transports)
        errors = {}

        def call(r):
            try:
                results[r] = fn(self.transports[r], *args)
            except BaseException as err:  # noqa: BLE001 - re-raised below
                errors[r] = err

        threads = [threading.Thread(target=call, args=(r,), daemon=True)
                   for r in range(len(self.transports)) if r not in self.dead]  # fmt: skip
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout_s
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise TimeoutError(f"a rank of the model did not return within {timeout_s} s")
        if errors:
            r = min(errors)
            raise errors[r]
        return results


def _yield():
    # a poll of a flag gives the other threads a turn (they hold the message it waits for)
    time.sleep(0)
