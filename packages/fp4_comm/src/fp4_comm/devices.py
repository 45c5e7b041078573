"""Which GPU a rank uses: ``LOCAL_RANK % torch.cuda.device_count()``.

Under a launcher (torchrun, or any that sets ``LOCAL_RANK``) rank ``r`` of a node uses GPU
``r % n`` of its ``n`` visible GPUs.  With as many ranks as GPUs that is the usual one GPU per
rank; with more ranks than GPUs several ranks share a GPU, which NCCL allows from version 2.30
when ``NCCL_MULTI_RANK_GPU_ENABLE=1`` is set (older NCCL refuses the communicator: 2.28.9
says "invalid usage"; ``sharing_problem`` names what is missing, and the NCCL transport's
error says it).  Ranks that share a GPU time-slice its SMs: such a run shows correctness,
hangs and host cost of multi-rank code, not link speed.  A one-line notice (logger
``fp4_comm``, level WARNING) says so once per node, from local rank 0.
"""

from __future__ import annotations

import logging
import os

import torch

_LOG = logging.getLogger("fp4_comm")
_NOTIFIED = []

#: The environment variable of NCCL (>= 2.30) that lets several ranks share one GPU.
MULTI_RANK_ENV = "NCCL_MULTI_RANK_GPU_ENABLE"
#: The first NCCL version, as ``ncclGetVersion`` numbers it (22809 for 2.28.9), whose ranks
#: may share a GPU.
MULTI_RANK_NCCL_VERSION = 23000


def local_rank(default: int = 0) -> int:
    """``LOCAL_RANK`` as an int (``default`` where it is unset); ValueError naming it if it is
    not a non-negative integer."""
    raw = os.environ.get("LOCAL_RANK")
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"LOCAL_RANK: {raw!r} is not an integer") from None
    if value < 0:
        raise ValueError(f"LOCAL_RANK: {value} is negative")
    return value


def local_world_size() -> int | None:
    """The ranks of this node, ``LOCAL_WORLD_SIZE`` (set by torchrun) as an int; None where it
    is unset or not a number."""
    raw = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(raw) if raw.isdigit() else None


def local_device(rank: int | None = None) -> torch.device:
    """This rank's CUDA device: ``cuda:(rank % torch.cuda.device_count())``, ``rank`` defaulting
    to ``LOCAL_RANK`` (0 where unset).  RuntimeError where there is no CUDA GPU.

    Where the node runs more ranks (``LOCAL_WORLD_SIZE``, set by torchrun) than it has GPUs,
    local rank 0 logs a one-line notice that ranks share GPUs (and whether NCCL's
    multi-rank mode is switched on)."""
    if not torch.cuda.is_available():
        raise RuntimeError("local_device: no CUDA GPU is visible to this process")
    count = torch.cuda.device_count()
    r = local_rank() if rank is None else rank
    if isinstance(r, bool) or not isinstance(r, int) or r < 0:
        raise ValueError(f"rank: expected a non-negative int, got {r!r}")
    ranks = local_world_size()
    if ranks is not None and ranks > count and r == 0 and not _NOTIFIED:
        _NOTIFIED.append(True)
        _LOG.warning(sharing_notice(ranks, count))
    return torch.device("cuda", r % count)


def sharing_notice(ranks: int, gpus: int) -> str:
    """The notice for ``ranks`` local ranks on ``gpus`` GPUs (one line)."""
    mode = (
        "NCCL's multi-rank mode is on"
        if os.environ.get(MULTI_RANK_ENV) == "1"
        else f"NCCL needs {MULTI_RANK_ENV}=1 (NCCL >= 2.30) for that"
    )
    return (
        f"fp4_comm: {ranks} ranks share {gpus} GPU{'s' if gpus != 1 else ''} (local rank r "
        f"uses cuda:(r % {gpus})); {mode}; times then show host cost, not link speed"
    )


def sharing_problem(
    ranks: int, gpus: int | None = None, nccl_version: int | None = None
) -> str | None:
    """Why ``ranks`` NCCL ranks of one node cannot run on its ``gpus`` GPUs (default: the
    visible ones) with the NCCL of ``nccl_version`` (``ncclGetVersion``'s number; default: the
    one CuPy loads, ImportError where there is none), naming what is missing; None where they
    can: no more ranks than GPUs, or NCCL >= 2.30 with ``NCCL_MULTI_RANK_GPU_ENABLE=1``."""
    if gpus is None:
        gpus = torch.cuda.device_count()
    if ranks <= gpus:
        return None
    if nccl_version is None:
        from .nccl import nccl_version as loaded

        nccl_version = loaded()
    missing = []
    if nccl_version < MULTI_RANK_NCCL_VERSION:
        missing.append(f"NCCL >= 2.30 (this is {nccl_version})")
    if os.environ.get(MULTI_RANK_ENV) != "1":
        missing.append(f"{MULTI_RANK_ENV}=1")
    if not missing:
        return None
    return (
        f"{ranks} ranks on {gpus} GPU{'s' if gpus != 1 else ''} share a GPU: that needs "
        + " with ".join(missing)
    )


__all__ = [
    "MULTI_RANK_ENV",
    "MULTI_RANK_NCCL_VERSION",
    "local_device",
    "local_rank",
    "local_world_size",
    "sharing_notice",
    "sharing_problem",
]
