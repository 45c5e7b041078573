"""The launch policy: overrides of the launch table for the calls inside a ``launch_policy``
block.  No numba import here: the plan cache keys every call by the policy in force.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchPolicy:
    """Threads per CTA, a cap on the number of CTAs, the threads that share an NVFP4 / MXFP4
    block in the quantizer and the resident threads an SM every kernel's shared-memory
    carveout is sized for (0: the driver's choice); ``None`` keeps the table's choice."""

    threads: int | None = None
    max_blocks: int | None = None
    lanes_per_block: int | None = None
    threads_per_sm: int | None = None


DEFAULT_POLICY = LaunchPolicy()
POLICY = contextvars.ContextVar("fp4_kernels_launch_policy", default=None)


@contextlib.contextmanager
def launch_policy(threads=None, max_blocks=None, lanes_per_block=None, threads_per_sm=None):
    """Launch every kernel queued inside the block with ``threads`` per CTA (a multiple of 32),
    at most ``max_blocks`` CTAs, ``lanes_per_block`` threads sharing a quantizer block (1
    or 2 for NVFP4; 1, 2 or 4 for MXFP4) and a shared-memory carveout sized for
    ``threads_per_sm`` resident threads an SM (0: the driver's choice, which fits the most
    CTAs).  Results do not depend on it; speed does."""
    if threads is not None and (threads <= 0 or threads % 32):
        raise ValueError(f"threads: {threads} is not a positive multiple of 32")
    if lanes_per_block not in (None, 1, 2, 4):
        raise ValueError(f"lanes_per_block: {lanes_per_block} is not 1, 2 or 4")
    if threads_per_sm is not None and threads_per_sm < 0:
        raise ValueError(f"threads_per_sm: {threads_per_sm} is negative (0: the driver's choice)")
    token = POLICY.set(LaunchPolicy(threads, max_blocks, lanes_per_block, threads_per_sm))
    try:
        yield
    finally:
        POLICY.reset(token)


def current_policy() -> LaunchPolicy:
    return POLICY.get() or DEFAULT_POLICY
