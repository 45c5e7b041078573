"""Byte movers under the collectives: gloo through torch.distributed (CPU tensors) here, NCCL
through CuPy in ``nccl.py``.

A transport moves uint8 tensors and nothing else; the codec, padding, reduction and validation
live above it (``collectives.py``), so the CPU tests over gloo run the very algorithms that run
over NCCL.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class CommTimeoutError(TimeoutError):
    """A peer did not take part in a collective within the communicator's timeout."""


def _all_gather_into(out, inp, group):
    # torch >= 2.10 names it all_gather_single and deprecates all_gather_into_tensor.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, inp, group=group)


def reraise_timeout(err: RuntimeError, what: str):
    """gloo reports a peer that never came as a RuntimeError saying 'Timed out'."""
    if "timed out" in str(err).lower() or "timeout" in str(err).lower():
        raise CommTimeoutError(f"{what}: a peer did not take part in time ({err})") from err
    raise err


class Transport:
    """Moves uint8 tensors between the ranks of a group.

    ``pairs`` are (send, recv) tensors, one pair per codec section, moved in one go.
    all_to_all: send and recv (world, b): row p of send goes to rank p, row p of recv comes
    from rank p.  all_gather: send (1, b) or (b,), recv (world, b).
    """

    rank: int
    world_size: int
    device: torch.device

    def all_to_all(self, pairs):
        raise NotImplementedError

    def all_gather(self, pairs):
        raise NotImplementedError

    def send(self, tensors, peer):
        raise NotImplementedError

    def recv(self, tensors, peer):
        raise NotImplementedError

    def synchronize(self, timeout_s=None):
        """Wait for the queued transfers (no-op where every call is already synchronous)."""


class GlooTransport(Transport):
    """torch.distributed over a gloo group: CPU tensors, every call synchronous."""

    def __init__(self, group=None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = torch.device("cpu")

    def _peer(self, group_rank):
        # torch.distributed's send/recv take global ranks even with a group.
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def all_to_all(self, pairs):
        try:
            for send, recv in pairs:
                dist.all_to_all_single(recv.reshape(-1), send.reshape(-1), group=self.group)
        except RuntimeError as err:
            reraise_timeout(err, "all_to_all")

    def all_gather(self, pairs):
        try:
            for send, recv in pairs:
                _all_gather_into(recv.reshape(-1), send.reshape(-1), self.group)
        except RuntimeError as err:
            reraise_timeout(err, "all_gather")

    def send(self, tensors, peer):
        try:
            for t in tensors:
                dist.send(t.reshape(-1), self._peer(peer), group=self.group)
        except RuntimeError as err:
            reraise_timeout(err, "send")

    def recv(self, tensors, peer):
        try:
            for t in tensors:
                dist.recv(t.reshape(-1), self._peer(peer), group=self.group)
        except RuntimeError as err:
            reraise_timeout(err, "recv")
