"""The peer-to-peer transport: ranks whose GPUs can map each other's memory move the collectives'
bytes with one kernel of their own, through buffers shared by CUDA IPC, instead of NCCL.

``Communicator.from_process_group(group, device, transport="p2p")`` (or ``from_env(...,
transport="p2p")``) makes one.  It applies when every rank of the group is on one node and each
pair of ranks is on one GPU or on two GPUs with peer access (``cudaDeviceCanAccessPeer``);
otherwise construction raises ValueError on every rank, saying which pair cannot reach the
other, and ``transport="nccl"`` is the one to use.

Design
------
``P2PTransport`` implements the ``Transport`` interface (``all_to_all``, ``all_gather``,
``send``, ``recv``), so ``collectives.py`` runs its algorithms unchanged over it: the codecs,
padding, rank-order float32 sums and the bits of every result are those of the NCCL and gloo
paths for the same all-reduce algorithm, because a transport only moves bytes and this one
moves them exactly.  ``one_shot_auto``: ``all_reduce_algorithm="auto"`` takes the one-shot
all-reduce (an all-gather of each rank's encoded input, ``collectives.py``) over this
transport for small inputs on few ranks.  (A one-shot kernel that encodes straight into the
peers' buffers is not built.)

Each rank allocates one device buffer (``BufferLayout``) when the communicator is made: flags,
acknowledgements, its own message counters and the table of the peers' buffer addresses, then
the receive slots.  Its CUDA IPC handle goes to the other ranks over the communicator's gloo
control group; each opens the others' buffers once.  A call launches one kernel,
``_p2p_kernels.exchange``, on the caller's current stream: no host synchronization, nothing
allocated; its parameters are packed once per kind of launch (``_Exchange``), a call writes
its sections' addresses into them.  Its blocks are (peer, lane) pairs.  A message (the row
of each codec section meant for one peer, the sections packed at 16-byte offsets) is cut into
pieces of one slot; piece q travels on lane q % lanes, so every lane is a first-in first-out
channel of its own between two ranks, with its own counters, flags and two slots in the
receiver's buffer.  A block pushes its pieces into the peer's slots (stores over NVLink, or
within the GPU when both ranks share one) and takes the peer's pieces out of its own slots.
Messages larger than the buffer go through in as many pieces as they need.  ``send`` /
``recv`` use the same channels in one direction.

Protocol (message k of one lane from rank s to rank r; k counts every message of that lane
over the communicator's life, in device memory):

1. s waits until ``ack[r][lane] >= k - 1`` in its own buffer (r has consumed message k - 2, the
   previous tenant of slot k % 2), writes the piece into r's slot k % 2, barrier, and thread 0
   stores ``ready[s][lane][k % 2] = k + 1`` in r's buffer with ``st.release.sys``;
2. r's thread 0 spins on ``ready[s][lane][k % 2]`` with ``ld.acquire.sys`` until it is k + 1,
   barrier, the block copies the piece out, barrier, and thread 0 stores ``ack[r][lane] = k + 1``
   in s's buffer with ``st.release.sys``.

Why no slot is overwritten before it is consumed: s writes slot k % 2 only after acquiring an
ack that r released after its block's loads of message k - 2 (barrier, then release: the
release orders them).  Why r never reads a stale piece: the flag holds k + 1 only after s's
release, which follows every thread's stores of the piece (barrier, then release: cumulative);
r's other threads read after the barrier that follows thread 0's acquire.  A flag value k + 1
cannot be mistaken for another message's: slot k % 2 holds the even or the odd messages only,
and its flag moves to k + 3 only after r acknowledged k + 1.  Two slots per lane let s write
message k + 1 while r still reads k.  Why no deadlock: a block depends only on its counterpart
(the peer's block of the same lane), and within a lane the two ranks alternate send and receive
in the same order; the waits a block makes are for messages the counterpart has already sent
or is about to, never for a later block.  Counters live in device memory and the kernels
advance them, so a CUDA graph that captured calls replays them with fresh epochs, and eager calls
and replays may be mixed in the same order on every rank.

Faults: every wait has a deadline (``timeout_s`` of the communicator, read from
``%globaltimer``).  A missed deadline writes a report to a page of host memory mapped into the
device (which peer, which lane, what was awaited) and marks this rank's failure word; every
block and every launch queued after it then returns at once.  The host raises
``CommTimeoutError`` naming the peer: from ``synchronize()``, from the next call, and a watchdog
thread warns as soon as the report appears.  The communicator is unusable afterwards and says so
at every call.  A peer that is killed, or never calls, or calls something else, ends in that
error on every rank that waits for it, within ``timeout_s`` of the wait's start, never a hang.

Rules the caller keeps (as with NCCL): every rank makes the same calls with the same sizes in
the same order (``validate`` checks it); calls of one communicator are ordered (one stream, or
streams ordered by events); ``close()`` is collective.  Messages of two communicators are
independent.

Measured and not: on one GPU shared by several processes, the transport is checked for
correctness, hang-freedom and host cost; its speed over NVLink waits for a machine with two
GPUs.  ``P2PTransport.loopback`` runs several ranks in one process on one GPU, each on its own
stream (the benchmark's floor for the kernel's cost: no link crossed).
"""

from __future__ import annotations

import ctypes
import functools
import socket
import struct
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from . import _p2p_kernels as K
from ._transport import CommTimeoutError, Transport, reraise_peer_error

#: Default bytes of receive slots a rank allocates (the message counters and flags come on top).
DEFAULT_BUFFER_BYTES = 64 << 20
#: Default lanes (blocks a peer): the most pieces of one message in flight at once.
DEFAULT_LANES = 8
MAX_LANES = 32
#: A message gets one lane per this many bytes (at most ``lanes``): small messages take one.
LANE_MIN_BYTES = 64 << 10
#: Slots are a multiple of this many bytes (keeps every piece boundary 16-byte aligned).
PIECE_ALIGN = 256
#: Kinds of launch (operation, peer, the sections' shapes and dtypes) a transport keeps packed;
#: past it the oldest is dropped (a launch's parameters are copied when it is made, also into a
#: captured graph) and packed again should it come back.
MAX_PLANS = 256
# Where the slots start in a buffer (after the flags and counters).
_DATA_ALIGN = 4096
# How often synchronize() polls its event and the report, and the watchdog the report.
_POLL_INTERVAL_S = 1e-4
_WATCHDOG_INTERVAL_S = 5e-3
# cuLaunchKernel results that mean "not this thread's current context": retried on the device.
_CONTEXT_ERRORS = (201, 400)  # CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_HANDLE

TRANSPORTS = ("nccl", "p2p", "gloo")


# ---------------------------------------------------------------------- layout and planning


@dataclass(frozen=True)
class BufferLayout:
    """Byte offsets in each rank's buffer (the same on every rank).

    ``ready[src][lane][parity]``: the epoch (message index + 1) of the piece in that slot,
    written by rank src.  ``ack[dst][lane]``: messages of this rank that rank dst has consumed,
    written by dst.  ``counters``: this rank's sent[peer][lane] then received[peer][lane].
    ``failed``: this rank's failure word.  ``table``: the peers' buffer addresses in this
    process.  ``data``: ``(world - 1) x lanes x 2`` slots of ``piece_bytes``, for the other
    ranks in rank order."""

    world: int
    lanes: int
    piece_bytes: int

    @classmethod
    def for_buffer(cls, world: int, lanes: int, buffer_bytes: int) -> BufferLayout:
        """The layout whose slots take at most ``buffer_bytes``: the largest multiple of
        PIECE_ALIGN a slot; ValueError naming ``buffer_bytes`` when a slot would be smaller."""
        slots = max(1, world - 1) * lanes * 2
        piece = buffer_bytes // slots // PIECE_ALIGN * PIECE_ALIGN
        if piece < PIECE_ALIGN:
            raise ValueError(
                f"buffer_bytes: {buffer_bytes} bytes hold no slot of {PIECE_ALIGN} bytes for "
                f"{max(1, world - 1)} peers x {lanes} lanes x 2; give at least "
                f"{slots * PIECE_ALIGN} (or fewer lanes)"
            )
        return cls(world, lanes, piece)

    @property
    def ready_off(self) -> int:
        return 0

    @property
    def ack_off(self) -> int:
        return self.ready_off + 8 * self.world * self.lanes * 2

    @property
    def counters_off(self) -> int:
        return self.ack_off + 8 * self.world * self.lanes

    @property
    def failed_off(self) -> int:
        return self.counters_off + 8 * 2 * self.world * self.lanes

    @property
    def table_off(self) -> int:
        return self.failed_off + 16

    @property
    def data_off(self) -> int:
        return K.align_up(self.table_off + 8 * self.world, _DATA_ALIGN)

    @property
    def total_bytes(self) -> int:
        return self.data_off + (self.world - 1) * self.lanes * 2 * self.piece_bytes

    def slot_off(self, owner: int, src: int, lane: int, parity: int) -> int:
        """Offset of the slot in ``owner``'s buffer that receives ``src``'s pieces."""
        index = src - 1 if src > owner else src
        return K.slot_at(self.data_off, index, self.lanes, lane, parity, self.piece_bytes)

    def ready_at(self, src: int, lane: int, parity: int) -> int:
        return K.ready_at(self.ready_off, src, self.lanes, lane, parity)

    def ack_at(self, dst: int, lane: int) -> int:
        return K.ack_at(self.ack_off, dst, self.lanes, lane)


def packed_bytes(nbytes) -> int:
    """Bytes of one packed message: each section's row padded to 16 bytes, in order (the
    kernel computes the same from its four sizes)."""
    return sum(K.align_up(n, K.SECTION_ALIGN) for n in nbytes)


class Launch(NamedTuple):
    """One launch of the exchange kernel: lanes in use, blocks, bytes of each message."""

    lanes: int
    grid: int
    message_bytes: int


def plan_launch(layout: BufferLayout, nbytes, only_peer: int = -1) -> Launch | None:
    """The launch moving sections of ``nbytes`` bytes a row, or None where there is nothing to
    move.  Every rank computes the same plan from the same sizes (the lanes must match)."""
    if len(nbytes) > K.MAX_SECTIONS:
        raise ValueError(f"at most {K.MAX_SECTIONS} sections a launch, got {len(nbytes)}")
    total = packed_bytes(nbytes)
    if total == 0:
        return None
    pieces = -(-total // layout.piece_bytes)
    lanes = max(1, min(layout.lanes, -(-total // LANE_MIN_BYTES), pieces))
    grid = lanes if only_peer >= 0 else layout.world * lanes
    return Launch(lanes, grid, total)


def shared_gpu_lanes(lanes: int, world: int, sms: int) -> int:
    """Lanes for ``world`` ranks that share one GPU of ``sms`` SMs: few enough that every
    rank's blocks (world x lanes each) fit on the GPU at once, one block an SM, since each
    kernel waits for the others' (where the processes' kernels run at the same time, as under
    MPS; time-sliced processes need no cap, and it costs them nothing measurable)."""
    return max(1, min(lanes, sms // (world * world)))


def describe_failure(words, rank: int, world: int, timeout_s: float) -> tuple[str, list[int]]:
    """The message and the peers of a failure report (the words of the host page)."""
    status, peer, wait, lane = words[K.REPORT_STATUS : K.REPORT_LANE + 1]
    op, expected, seen, waited_ns = words[K.REPORT_OP : K.REPORT_WAITED_NS + 1]
    name = K.OP_NAMES.get(op, f"operation {op}")
    where = f"p2p {name} on rank {rank} of {world}"
    if wait == K.WAIT_DATA:
        awaited = f"message {expected - 1} of lane {lane} from rank {peer} (its flag holds {seen})"
    else:
        awaited = (
            f"rank {peer} to take message {expected - 1} of lane {lane} out of its receive "
            f"slot (its acknowledgement holds {seen})"
        )
    if status == K.STATUS_ABORTED:
        text = (
            f"{where}: stopped by this rank's host while waiting for {awaited}: the "
            "communicator was aborted (a synchronize() timed out, or close())"
        )
    else:
        text = (
            f"{where}: rank {peer} did not take part in time: waited {waited_ns / 1e9:.2f} s "
            f"(timeout_s = {timeout_s}) for {awaited}; it is gone, or called another "
            "collective or other sizes"
        )
        if op == K.OP_SEND:
            text += (
                ", or is itself in a send to this rank (a send waits for its receiver once "
                "its pieces fill the receiver's slots: of two ranks that exchange, one must "
                "receive first)"
            )
    return text + "; the communicator is unusable: make a new one", [peer]


# ---------------------------------------------------------------------- CUDA driver calls


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError:  # cuda-python < 12.6 names the module cuda.cuda
        from cuda import cuda as driver
    return driver


def _call(fn, *args):
    """A ``cuda.bindings`` driver call's value; RuntimeError naming the call on failure."""
    driver = _driver()
    err, *out = fn(*args)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"p2p transport: {fn.__name__} failed with {err!r}")
    if not out:
        return None
    return out[0] if len(out) == 1 else tuple(out)


IPC_HANDLE_BYTES = 64


def ipc_handle_bytes(handle) -> bytes:
    """A ``CUipcMemHandle`` as the 64 bytes that travel to the other ranks."""
    return ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES)


def ipc_handle_from_bytes(data: bytes):
    """The ``CUipcMemHandle`` of ``ipc_handle_bytes``."""
    if len(data) != IPC_HANDLE_BYTES:
        raise ValueError(f"a CUDA IPC handle has {IPC_HANDLE_BYTES} bytes, got {len(data)}")
    handle = _driver().CUipcMemHandle()
    ctypes.memmove(handle.getPtr(), data, IPC_HANDLE_BYTES)
    return handle


class _DeviceMemory:
    """This rank's buffer (one ``cuMemAlloc``, zeroed) and its page of mapped host memory
    (pinned, mapped into the device: the failure report and the abort word), on ``device``."""

    def __init__(self, device: torch.device, nbytes: int):
        driver = _driver()
        self.device = device
        self.opened: list[int] = []
        self.base = self.host_ctl = self.host_ctl_device = 0
        with torch.cuda.device(device):
            torch.cuda.synchronize(device)  # the primary context exists and is current
            self.base = int(_call(driver.cuMemAlloc, nbytes))
            try:
                _call(driver.cuMemsetD8, self.base, 0, nbytes)
                flags = int(driver.CU_MEMHOSTALLOC_DEVICEMAP) | int(driver.CU_MEMHOSTALLOC_PORTABLE)
                self.host_ctl = int(_call(driver.cuMemHostAlloc, K.HOST_CTL_BYTES, flags))
                ctypes.memset(self.host_ctl, 0, K.HOST_CTL_BYTES)
                self.host_ctl_device = int(_call(driver.cuMemHostGetDevicePointer,
                                                 self.host_ctl, 0))  # fmt: skip
                _call(driver.cuCtxSynchronize)  # the memset is done before a peer writes
            except BaseException:
                self.free()
                raise

    def ipc_handle(self) -> bytes:
        with torch.cuda.device(self.device):
            return ipc_handle_bytes(_call(_driver().cuIpcGetMemHandle, self.base))

    def open_peer(self, data: bytes) -> int:
        driver = _driver()
        flags = int(driver.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        with torch.cuda.device(self.device):
            ptr = int(_call(driver.cuIpcOpenMemHandle, ipc_handle_from_bytes(data), flags))
        self.opened.append(ptr)
        return ptr

    def write(self, offset: int, data: bytes) -> None:
        with torch.cuda.device(self.device):
            buf = ctypes.create_string_buffer(data, len(data))
            _call(_driver().cuMemcpyHtoD, self.base + offset, ctypes.addressof(buf), len(data))

    def free(self) -> None:
        driver = _driver()
        with torch.cuda.device(self.device):
            for ptr in self.opened:
                _call(driver.cuIpcCloseMemHandle, ptr)
            self.opened = []
            if self.host_ctl:
                _call(driver.cuMemFreeHost, self.host_ctl)
                self.host_ctl = self.host_ctl_device = 0
            if self.base:
                _call(driver.cuMemFree, self.base)
                self.base = 0


_libcuda = None


def _cu_launch_kernel():
    global _libcuda
    if _libcuda is None:
        f = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
        f.restype = ctypes.c_int
        f.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        _libcuda = f
    return _libcuda


@functools.cache
def _exchange_kernel(cc: tuple[int, int]):
    """The exchange kernel compiled (numba-cuda's NVVM) and linked (cuda.core's linker, as
    numba-cuda links its own kernels) for compute capability ``cc``; a ``cuda.core`` Kernel."""
    try:
        from cuda.core import Linker, LinkerOptions, ObjectCode
    except ImportError:  # cuda.core < 0.4
        from cuda.core.experimental import Linker, LinkerOptions, ObjectCode
    ptx = K.compile_ptx(cc)
    K.check_ptx_params(ptx)
    linker = Linker(
        ObjectCode.from_ptx(ptx.encode()), options=LinkerOptions(arch=f"sm_{cc[0]}{cc[1]}")
    )
    try:
        cubin = linker.link("cubin")
    finally:
        linker.close()
    return cubin.get_kernel(K.entry_name(ptx))


class _KernelLauncher:
    """The exchange kernel on one device: its handle and ``cuLaunchKernel`` (ctypes), which a
    call invokes itself with the parameters its plan packed (``_Exchange``)."""

    def __init__(self, device: torch.device):
        self.device = device
        cc = torch.cuda.get_device_capability(device)
        self.kernel = _exchange_kernel(tuple(cc))  # keeps the library loaded
        self.handle = int(self.kernel.handle)
        self.launch = _cu_launch_kernel()


class _Exchange:
    """One kind of launch (operation, peer, section shapes), packed once: the kernel's
    parameters as int64 words with everything that does not change between calls in place,
    and the array of their addresses that ``cuLaunchKernel`` takes.  A call writes its
    tensors' addresses into ``params`` and launches (the driver copies the parameters at the
    launch, so the next call may overwrite them).  ``grid`` 0: nothing to move."""

    __slots__ = ("grid", "params", "pointers", "nbytes")

    def __init__(self, launch: Launch | None, values, nbytes):
        self.grid = 0 if launch is None else launch.grid
        self.nbytes = tuple(nbytes)
        self.params = (ctypes.c_int64 * len(K.PARAMS))(*values)
        base = ctypes.addressof(self.params)
        self.pointers = (ctypes.c_void_p * len(K.PARAMS))(
            *[base + 8 * i for i in range(len(K.PARAMS))]
        )


# Where the first section's parameters (send0, recv0, nbytes0) start among PARAMS.
_SECTION_PARAMS = K.PARAMS.index("send0")


@functools.cache
def _launcher(device: torch.device) -> _KernelLauncher:
    return _KernelLauncher(device)


# ---------------------------------------------------------------------- reachability


def _node_id() -> str:
    """This machine: its host name and boot id (containers may share a host name)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _gpu_id(index: int) -> str:
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        return str(uuid)
    return f"pci {props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}"


def reach_row(mine: dict, others: list[dict]) -> list[str | None]:
    """For each rank's ``info``: None where this rank can map its buffer (same GPU, or peer
    access), else why not.  ``info``: node, gpu (an id), local (the GPU ids this process sees,
    by device index) and index (this rank's device index)."""
    row = []
    for other in others:
        if other["node"] != mine["node"]:
            row.append(f"on another node ({other['node'].split('/')[0]})")
        elif other["gpu"] == mine["gpu"]:
            row.append(None)
        elif other["gpu"] not in mine["local"]:
            row.append(f"its GPU {other['gpu']} is not visible here (CUDA_VISIBLE_DEVICES)")
        elif not mine["peer_access"].get(other["gpu"], False):
            row.append(f"no peer access from GPU {mine['gpu']} to GPU {other['gpu']}")
        else:
            row.append(None)
    return row


def _local_info(device: torch.device) -> dict:
    count = torch.cuda.device_count()
    local = [_gpu_id(i) for i in range(count)]
    peer_access = {
        local[j]: (j == device.index or torch.cuda.can_device_access_peer(device.index, j))
        for j in range(count)
    }
    return {
        "node": _node_id(),
        "sms": torch.cuda.get_device_properties(device.index).multi_processor_count,
        "gpu": local[device.index],
        "local": local,
        "index": device.index,
        "peer_access": peer_access,
    }


def unreachable_pairs(rows: list[list[str | None]]) -> list[str]:
    """Lines naming every pair (rank a, rank b) where a cannot map b's buffer."""
    return [
        f"rank {a} cannot reach rank {b}: {why}"
        for a, row in enumerate(rows)
        for b, why in enumerate(row)
        if why is not None and a != b
    ]


# ---------------------------------------------------------------------- the transport


class P2PTransport(Transport):
    """Collectives' bytes moved by the exchange kernel through CUDA IPC buffers.

    Collective: every rank of ``control_group`` (a gloo group) constructs it, each on its own
    ``device``.  ``timeout_s`` bounds every wait of the kernel (and ``synchronize``);
    ``buffer_bytes`` is the size of this rank's receive slots (messages larger than it go in
    pieces); ``lanes`` the most blocks a peer.  ValueError on every rank where the ranks cannot
    all map each other's memory (another node, no peer access): use NCCL there."""

    one_shot_auto = True

    def __init__(
        self,
        control_group: dist.ProcessGroup | None,
        device: torch.device | str | int,
        timeout_s: float = 60.0,
        *,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        lanes: int = DEFAULT_LANES,
        watchdog: bool = True,
    ) -> None:
        device = _check_device(device)
        rank = dist.get_rank(control_group)
        world = dist.get_world_size(control_group)
        args = (_check_lanes(lanes), _check_bytes(buffer_bytes))
        info = {**_local_info(device), "args": args}
        infos = _gather(info, control_group, rank, world, "p2p setup (GPU check)")
        if len({i["args"] for i in infos}) > 1:
            given = ", ".join(f"rank {r}: {i['args']}" for r, i in enumerate(infos))
            raise ValueError(f"p2p transport: the ranks disagree on (lanes, buffer_bytes): {given}")
        if len({i["gpu"] for i in infos}) == 1:
            lanes = shared_gpu_lanes(lanes, world, infos[0]["sms"])
        layout = BufferLayout.for_buffer(world, lanes, buffer_bytes)
        rows = _gather(reach_row(info, infos), control_group, rank, world, "p2p setup")
        problems = unreachable_pairs(rows)
        if problems:
            raise ValueError(
                "transport='p2p' needs every rank to map every other rank's GPU memory (one "
                "node; the same GPU, or GPUs with peer access); use transport='nccl' here:\n  "
                + "\n  ".join(problems[:8])
            )
        memory = _DeviceMemory(device, layout.total_bytes)
        try:
            handle = memory.ipc_handle() if world > 1 else b""
            handles = _gather(handle, control_group, rank, world, "p2p setup (IPC handles)")
            bases, opened = [], None
            try:
                for r, h in enumerate(handles):
                    bases.append(memory.base if r == rank else memory.open_peer(h))
            except RuntimeError as err:
                opened = str(err)
            failures = _gather(opened, control_group, rank, world, "p2p setup (IPC open)")
            if any(failures):
                raise RuntimeError(
                    "p2p transport: opening the peers' CUDA IPC buffers failed: "
                    + "; ".join(f"rank {r}: {f}" for r, f in enumerate(failures) if f)
                )
            self._assemble(rank, world, device, layout, memory, bases, timeout_s,
                           _launcher(device), _CudaStream(device), watchdog)  # fmt: skip
        except BaseException:
            memory.free()
            raise
        self._control = control_group
        try:
            # no rank's kernel writes into a buffer before its owner has it zeroed and mapped
            dist.barrier(group=control_group)
        except RuntimeError as err:
            reraise_peer_error(err, "p2p setup (barrier)", rank, world)

    @classmethod
    def loopback(
        cls,
        world_size: int,
        device: torch.device | str | int,
        timeout_s: float = 60.0,
        *,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        lanes: int = DEFAULT_LANES,
    ) -> list[P2PTransport]:
        """``world_size`` ranks in this process on one GPU (no IPC: the buffers are this
        process's): rank r's calls must be queued on a stream of their own, since each kernel
        waits for the others' (``lanes`` is capped so that all of them fit on the GPU at once:
        ``shared_gpu_lanes``).  For tests and the kernel benchmark."""
        device = _check_device(device)
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size: {world_size!r} is not a positive int")
        sms = torch.cuda.get_device_properties(device.index).multi_processor_count
        # the ranks' kernels run at once here, and each waits for the others'
        lanes = shared_gpu_lanes(_check_lanes(lanes), world_size, sms)
        layout = BufferLayout.for_buffer(world_size, lanes, _check_bytes(buffer_bytes))
        memories = [_DeviceMemory(device, layout.total_bytes) for _ in range(world_size)]
        bases = [m.base for m in memories]
        launcher, stream = _launcher(device), _CudaStream(device)
        out = []
        for r, memory in enumerate(memories):
            t = cls.__new__(cls)
            t._assemble(r, world_size, device, layout, memory, bases, timeout_s, launcher,
                        stream, watchdog=False)  # fmt: skip
            t._control = None
            out.append(t)
        return out

    def _assemble(self, rank, world, device, layout, memory, bases, timeout_s, launcher,
                  stream, watchdog):  # fmt: skip
        """Set up from the parts (the constructor, ``loopback``, the CPU model).  ``launcher``:
        ``handle`` and ``launch`` (``cuLaunchKernel``'s signature); ``stream``: ``current()``
        (the raw handle of the caller's current stream), ``wait`` and ``drain``."""
        self.rank, self.world_size, self.device = rank, world, device
        self.timeout_s = _check_timeout(timeout_s)
        self.layout = layout
        self._memory = memory
        self._closed = False
        memory.write(layout.table_off, struct.pack(f"={world}q", *bases))
        self._launcher = launcher
        self._kernel, self._cu_launch = launcher.handle, launcher.launch
        self._stream = stream
        self._current_stream = stream.current
        self._fixed = (
            memory.base, memory.host_ctl_device, rank, world, layout.lanes, layout.piece_bytes,
            layout.ready_off, layout.ack_off, layout.counters_off, layout.failed_off,
            layout.table_off, layout.data_off,
        )  # fmt: skip
        self._timeout_ns = int(self.timeout_s * 1e9)
        self._plans: dict[tuple, _Exchange] = {}
        self._status = ctypes.c_int64.from_address(memory.host_ctl + 8 * K.REPORT_STATUS)
        self._abort_word = ctypes.c_int64.from_address(memory.host_ctl + 8 * K.HOST_ABORT)
        self._failed: str | None = None
        self._failed_peers: list[int] | None = None
        self._watchdog = watchdog
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # ------------------------------------------------------------------ the data path

    def all_to_all(self, pairs) -> None:
        self._move(pairs, K.MODE_ALL_TO_ALL, -1, K.OP_ALL_TO_ALL)

    def all_gather(self, pairs) -> None:
        self._move(pairs, K.MODE_ALL_GATHER, -1, K.OP_ALL_GATHER)

    def send(self, tensors, peer) -> None:
        self._move([(t, None) for t in tensors], K.MODE_SEND, peer, K.OP_SEND)

    def recv(self, tensors, peer) -> None:
        self._move([(None, t) for t in tensors], K.MODE_RECV, peer, K.OP_RECV)

    def _move(self, pairs, mode, peer, op):
        if self._failed is not None or self._status.value != 0 or self._closed:
            self._raise_if_failed()
        if len(pairs) > K.MAX_SECTIONS:
            for start in range(0, len(pairs), K.MAX_SECTIONS):
                self._move(pairs[start : start + K.MAX_SECTIONS], mode, peer, op)
            return
        # the plan of these section shapes and dtypes (the mode fixes the operation): checked
        # and packed once (every parameter but the addresses), then a lookup
        key = (mode, peer, *[(s is not None and (s.shape, s.dtype),
                              r is not None and (r.shape, r.dtype)) for s, r in pairs])  # fmt: skip
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= MAX_PLANS:  # the oldest kind (insertion order)
                del self._plans[next(iter(self._plans))]
            plan = self._plans[key] = self._plan(pairs, mode, peer, op)
        if plan.grid:
            params, i = plan.params, _SECTION_PARAMS
            for send, recv in pairs:
                # the plan holds for tensors of these shapes laid out contiguously; where the
                # mode moves no send (recv) side, its address stays the plan's 0
                if send is not None:
                    if not send.is_contiguous():
                        raise ValueError("p2p transport: sections must be contiguous tensors")
                    params[i] = send.data_ptr()
                if recv is not None:
                    if not recv.is_contiguous():
                        raise ValueError("p2p transport: sections must be contiguous tensors")
                    params[i + 1] = recv.data_ptr()
                i += 3
            stream = self._current_stream()
            rc = self._cu_launch(self._kernel, plan.grid, 1, 1, K.THREADS, 1, 1, 0, stream,
                                 plan.pointers, None)  # fmt: skip
            if rc:
                self._launch_again(rc, plan, stream)
        if self._watchdog and self._thread is None:
            name = f"fp4_comm p2p watchdog rank {self.rank}"
            self._thread = threading.Thread(target=self._watch_loop, daemon=True, name=name)
            self._thread.start()

    def _launch_again(self, rc, plan, stream):
        """A launch that failed with ``rc``: where this thread's current context is another
        device's, launch again on ours; RuntimeError if that fails too, or for any other
        error."""
        if rc in _CONTEXT_ERRORS:
            with torch.cuda.device(self.device):
                rc = self._cu_launch(self._kernel, plan.grid, 1, 1, K.THREADS, 1, 1, 0, stream,
                                     plan.pointers, None)  # fmt: skip
        if rc:
            raise RuntimeError(f"p2p transport: cuLaunchKernel failed with CUresult {rc}")

    def before_replay(self) -> None:
        # A replay runs the captured kernels, whose waits have their deadlines on the device
        # (fresh epochs from the counters in device memory); the host check of a call is here.
        if self._failed is not None or self._status.value != 0 or self._closed:
            self._raise_if_failed()

    def _plan(self, group, mode, peer, op):
        """The launch of one group of sections, packed (``_Exchange``), their tensors checked:
        one-byte elements (uint8, int8: bytes, as the other transports move them) and the
        shapes the operation moves (other shapes would move other bytes than asked)."""
        nbytes = []
        for send, recv in group:
            for t in (send, recv):
                if t is not None and t.element_size() != 1:
                    raise ValueError(f"p2p transport: sections must be tensors of one-byte "
                                     f"elements (uint8), got {t.dtype}")  # fmt: skip
            if mode == K.MODE_ALL_TO_ALL:
                n = send.shape[1] if send.dim() == 2 else -1
                ok = send.shape[0] == self.world_size and recv.shape == send.shape
            elif mode == K.MODE_ALL_GATHER:
                n = send.numel()
                ok = recv.dim() == 2 and recv.shape[0] == self.world_size and recv.shape[1] == n
            else:
                n = (send if send is not None else recv).numel()
                ok = True
            if not ok or n < 0:
                shapes = [None if t is None else tuple(t.shape) for t in (send, recv)]
                raise ValueError(f"p2p transport: section shapes {shapes} do not fit operation "
                                 f"mode {mode} on {self.world_size} ranks")  # fmt: skip
            nbytes.append(n)
        launch = plan_launch(self.layout, nbytes, peer)
        lanes = 0 if launch is None else launch.lanes
        values = [*self._fixed, lanes, mode, peer, self._timeout_ns, op]
        for n in nbytes:
            values += (0, 0, n)  # the addresses: written by each call
        values += (0, 0, 0) * (K.MAX_SECTIONS - len(nbytes))
        return _Exchange(launch, values, nbytes)

    # ------------------------------------------------------------------ faults

    def _report_words(self):
        base = self._memory.host_ctl
        return [ctypes.c_int64.from_address(base + 8 * i).value for i in range(8)]

    def _raise_if_failed(self):
        if self._failed is None and self._status.value == 0:
            if self._closed:
                raise RuntimeError("p2p transport: the communicator was closed")
            return
        message = self.failed()
        raise CommTimeoutError(message, op=None, rank=self.rank, peers=self._failed_peers)

    def failed(self) -> str | None:
        """Why the transport is unusable (a peer missed its deadline, or an abort), or None."""
        if self._failed is None and self._status.value != 0:
            self._failed, self._failed_peers = describe_failure(
                self._report_words(), self.rank, self.world_size, self.timeout_s
            )
        return self._failed

    def abort(self, reason: str) -> None:
        """Make this rank's waiting kernels stop within microseconds and every later call
        raise CommTimeoutError with ``reason``."""
        if self._failed is None:
            self._failed = reason
            self._failed_peers = [r for r in range(self.world_size) if r != self.rank]
        self._abort_word.value = 1

    def _watch_loop(self):
        while not self._stop.wait(_WATCHDOG_INTERVAL_S):
            if self._status.value != 0:
                message = self.failed()
                warnings.warn(f"fp4_comm p2p watchdog: {message}", RuntimeWarning, stacklevel=1)
                return

    def synchronize(self, timeout_s: float | None = None) -> None:
        """Wait for this rank's queued calls; CommTimeoutError naming the peer if a kernel
        missed a deadline, or if the stream is not done within ``timeout_s`` (the kernels are
        then aborted and the error names no peer).

        By default ``timeout_s`` is twice the communicator's timeout: each kernel's own
        deadline runs ``timeout`` from the moment it starts waiting, which can be later than
        this call (work queued before it, ranks time-sliced on one GPU), and its report names
        the peer that is missing; the host's deadline is the backstop behind it."""
        timeout_s = 2 * self.timeout_s if timeout_s is None else timeout_s
        self._raise_if_failed()
        if not self._stream.wait(timeout_s, self._raise_if_failed):
            self.abort(
                f"p2p on rank {self.rank} of {self.world_size}: the stream did not finish "
                f"within {timeout_s} s; the communicator was aborted and is unusable"
            )
            self._raise_if_failed()
        self._raise_if_failed()

    def close(self) -> None:
        """Collective: wait for this rank's kernels, meet the other ranks (so that none still
        writes into this rank's buffer), free the buffers.  No call may follow."""
        if self._closed:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._failed is not None or self._status.value != 0:
            self._abort_word.value = 1  # waiting kernels end now rather than at their deadline
        self._stream.drain()
        if self._control is not None:
            try:
                dist.barrier(group=self._control)
            except RuntimeError:
                pass  # a peer is gone: nothing of it can still write here
        self._closed = True
        self._memory.free()


class _CudaStream:
    """The caller's current stream on ``device``, and waits on it."""

    def __init__(self, device):
        self.device = device
        # current(): the raw handle of the current stream on the device, one C call
        self.current = functools.partial(torch._C._cuda_getCurrentRawStream, device.index)

    def wait(self, timeout_s, check) -> bool:
        """Poll an event on the current stream until done (True) or ``timeout_s`` (False);
        ``check()`` on every poll raises where a kernel reported a failure meanwhile."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        deadline = time.monotonic() + timeout_s
        while not event.query():
            check()
            if time.monotonic() > deadline:
                return False
            time.sleep(_POLL_INTERVAL_S)
        return True

    def drain(self):
        torch.cuda.synchronize(self.device)


def _gather(obj: Any, group, rank, world, what) -> list[Any]:
    out = [None] * world
    try:
        dist.all_gather_object(out, obj, group=group)
    except RuntimeError as err:
        reraise_peer_error(err, what, rank, world)
    return out


def _check_device(device):
    try:
        device = torch.device(device)
    except (TypeError, RuntimeError) as err:
        raise ValueError(f"device: {device!r} is not a device ({err})") from None
    if device.type != "cuda":
        raise ValueError(
            f"device: the p2p transport moves CUDA memory; {device} is not a CUDA device (CPU "
            "tensors go over gloo: transport='gloo')"
        )
    if not torch.cuda.is_available():
        raise ValueError("device: the p2p transport needs CUDA, and torch sees no CUDA device")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _check_lanes(lanes):
    if isinstance(lanes, bool) or not isinstance(lanes, int) or not 1 <= lanes <= MAX_LANES:
        raise ValueError(f"lanes: {lanes!r} is not an int in 1..{MAX_LANES}")
    return lanes


def _check_bytes(nbytes):
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"buffer_bytes: {nbytes!r} is not a positive int")
    return nbytes


def _check_timeout(timeout_s):
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise TypeError(f"timeout_s: expected seconds as a number, got {type(timeout_s).__name__}")
    if not (timeout_s > 0 and timeout_s < 1e9):
        raise ValueError(f"timeout_s: {timeout_s} is not a positive finite number of seconds")
    return float(timeout_s)


__all__ = ["BufferLayout", "P2PTransport", "describe_failure", "plan_launch"]
