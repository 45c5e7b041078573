"""NCCL transport through ``cupy.cuda.nccl``, rendezvous through torch.distributed.

The NCCL unique id is made on group rank 0 and broadcast over a gloo group of torch.distributed
(whose TCPStore rendezvous torchrun already did), not with ``cupyx.distributed``, whose own
rendezvous fails on the GPU machines.  Every NCCL call is queued on the caller's current torch
stream (a CuPy caller's stream is made torch's current one in ``communicator.py``); nothing here
waits for the GPU, except ``synchronize``.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ._transport import CommTimeoutError, Transport, reraise_timeout

# How often synchronize() polls the stream's event and NCCL's async error state.
_POLL_INTERVAL_S = 1e-4


def _nccl():
    try:
        from cupy.cuda import nccl
    except ImportError as err:  # pragma: no cover - depends on the install
        raise ImportError(
            "the NCCL transport needs CuPy with NCCL: pip install 'fp4-comm[nccl]'"
        ) from err
    if not getattr(nccl, "available", False) or not hasattr(nccl, "NcclCommunicator"):
        raise ImportError(
            "cupy.cuda.nccl is not usable (libnccl.so.2 not found): pip install "
            "'nvidia-nccl-cu13>=2.27.7,<3' or 'fp4-comm[nccl]'"
        )
    return nccl


class NcclTransport(Transport):
    """One NCCL communicator over the ranks of ``control_group``, on ``device``.

    Collective: every rank of the group must construct it, each with its own device.
    """

    def __init__(self, control_group, device, timeout_s=300.0):
        nccl = _nccl()
        self._nccl = nccl
        self.device = torch.device(device)
        if self.device.type != "cuda" or self.device.index is None:
            raise ValueError(f"device: expected a CUDA device with an index, got {device!r}")
        self.rank = dist.get_rank(control_group)
        self.world_size = dist.get_world_size(control_group)
        self.timeout_s = timeout_s
        root = 0 if control_group is None else dist.get_global_rank(control_group, 0)
        box = [nccl.get_unique_id() if self.rank == 0 else None]
        try:
            # The broadcast doubles as a barrier with the gloo timeout: NCCL's init below waits
            # for every rank forever, so a rank that never comes is caught here instead.
            dist.broadcast_object_list(box, src=root, group=control_group)
        except RuntimeError as err:
            reraise_timeout(err, "NCCL unique id broadcast")
        import cupy

        with torch.cuda.device(self.device), cupy.cuda.Device(self.device.index):
            # ncclCommInitRank binds the communicator to the current CUDA device (made current
            # through both libraries, which may load CUDA runtimes of their own).
            self.comm = nccl.NcclCommunicator(self.world_size, tuple(box[0]), self.rank)
        self._uint8 = nccl.NCCL_UINT8

    def _stream(self):
        return torch.cuda.current_stream(self.device).cuda_stream

    def all_to_all(self, pairs):
        stream, comm, u8 = self._stream(), self.comm, self._uint8
        for send, recv in pairs:
            # A rank's own row is a device copy on the same stream, not an NCCL self-send.
            recv[self.rank].copy_(send[self.rank])
        self._nccl.groupStart()
        try:
            for send, recv in pairs:
                b = send.shape[1]
                if b == 0:
                    continue
                for p in range(self.world_size):
                    if p == self.rank:
                        continue
                    comm.send(send[p].data_ptr(), b, u8, p, stream)
                    comm.recv(recv[p].data_ptr(), b, u8, p, stream)
        finally:
            self._nccl.groupEnd()

    def all_gather(self, pairs):
        stream, comm, u8 = self._stream(), self.comm, self._uint8
        self._nccl.groupStart()
        try:
            for send, recv in pairs:
                b = send.numel()
                if b:
                    comm.allGather(send.data_ptr(), recv.data_ptr(), b, u8, stream)
        finally:
            self._nccl.groupEnd()

    def send(self, tensors, peer):
        stream, comm, u8 = self._stream(), self.comm, self._uint8
        self._nccl.groupStart()
        try:
            for t in tensors:
                if t.numel():
                    comm.send(t.data_ptr(), t.numel(), u8, peer, stream)
        finally:
            self._nccl.groupEnd()

    def recv(self, tensors, peer):
        stream, comm, u8 = self._stream(), self.comm, self._uint8
        self._nccl.groupStart()
        try:
            for t in tensors:
                if t.numel():
                    comm.recv(t.data_ptr(), t.numel(), u8, peer, stream)
        finally:
            self._nccl.groupEnd()

    def synchronize(self, timeout_s=None):
        """Wait for the current stream; on timeout abort the communicator (so no later call can
        hang on it either) and raise CommTimeoutError."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        deadline = time.monotonic() + timeout_s
        while not event.query():
            self.comm.check_async_error()
            if time.monotonic() > deadline:
                self.comm.abort()
                raise CommTimeoutError(
                    f"NCCL: the stream did not finish within {timeout_s} s (a peer missing from "
                    "a collective, or called with other sizes); the communicator is aborted"
                )
            time.sleep(_POLL_INTERVAL_S)

    def close(self):
        if getattr(self, "comm", None) is not None:
            self.comm.destroy()
            self.comm = None
