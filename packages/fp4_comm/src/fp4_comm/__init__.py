"""fp4_comm: FP4-compressed collectives for torch tensors and CuPy arrays.

    comm = fp4_comm.Communicator.from_env()          # under torchrun: NCCL on GPU LOCAL_RANK % n
    y = comm.all_reduce(x, codec="nvfp4")            # every rank gets the same bits
    y = comm.reduce_scatter(x, codec="mxfp4", error_feedback="grads")
    y = comm.all_gather(x, codec="none")             # bfloat16 baseline through the same path
    y = comm.all_gather(shard, total_dim0=d0)        # the inverse of a reduce_scatter of d0 rows

The same algorithms run over NCCL (through ``cupy.cuda.nccl``) for CUDA tensors and over a gloo
group for CPU tensors.  Codecs: ``fp4_comm.codecs``; torch integration: ``fp4_comm.ddp`` (a DDP
communication hook) and ``fp4_comm.tensor_parallel`` (autograd functions), both imported with
the package; ``TensorParallelGroup`` (a block's tensor-parallel collectives, with forward and
gradient policies), ``fp4_comm.pipeline`` (stage boundaries) and ``TimedCommunicator`` (time
spent communicating).  ``fp4_comm.reference`` runs the k ranks of a collective in one process
(the same algorithms, bit for bit), and ``fp4_comm.emulated`` a tensor-, sequence- or
pipeline-parallel model of k ranks on one device.  A peer that is gone raises
``CommPeerError`` (``CommTimeoutError``: it did not come in time; ``CommConnectionError``: its
connection closed).
"""

from importlib.metadata import PackageNotFoundError, version as _version

from . import ddp, emulated, reference, tensor_parallel
from ._transport import CommConnectionError, CommPeerError, CommTimeoutError
from .codecs import Codec, FP4QuantCodec, MXFP4Codec, NoneCodec, NVFP4Codec, get_codec
from .collectives import shard_rows
from .communicator import Communicator
from .devices import local_device
from .error_feedback import ErrorFeedback
from .parallel_group import TensorParallelGroup, WirePolicy
from .stats import HopStats
from .timing import TimedCommunicator

try:
    __version__ = _version("fp4-comm")
except PackageNotFoundError:  # running from a source tree (PYTHONPATH=packages/fp4_comm/src)
    __version__ = "0+unknown"

__all__ = [
    "Codec",
    "CommConnectionError",
    "CommPeerError",
    "CommTimeoutError",
    "FP4QuantCodec",
    "Communicator",
    "ErrorFeedback",
    "HopStats",
    "MXFP4Codec",
    "NVFP4Codec",
    "NoneCodec",
    "get_codec",
    "local_device",
    "TensorParallelGroup",
    "TimedCommunicator",
    "WirePolicy",
    "shard_rows",
    "ddp",
    "emulated",
    "reference",
    "tensor_parallel",
    "__version__",
]
