"""The launch table: how every kernel is launched, as data (``LAUNCHES``), read by each op's
host function (``cuda/<op>.py``) and by the tests; and the launch policy that overrides it for
the calls inside a ``launch_policy`` block.  No numba import here: the plan cache keys every
call by the policy in force.

The grid is ``ceil(work items / (threads * items per thread))`` CTAs, capped at one resident
wave (the kernels are grid-stride loops, so a persistent grid does the same work without a
partly filled last wave) and at ``threads_per_sm`` resident threads an SM where a row sets it.
The transform's kernels and FP4Quant's (32 elements a thread in registers) take a CTA of
``threads`` below g = 2048 and one group a CTA from g = 2048 (32 * g / 1024 threads: its warps
exchange through shared memory; ``launch.group_grid``), on the butterfly network that
``NETWORK_VARIANTS`` names for the group size.

The transform's prefetching kernels ("hadamard_prefetch") run 512 threads an SM: below
g = 2048 4 CTAs of 128 instead of the 7 that fit.  On the H200 (2^28 bf16,
``benchmarks/launch_sweep.py``) 4 ran at 1.04x the copy's time at g = 64 and 1024, 3 at
1.07-1.09x, 5-7 at 1.13-1.14x: each warp keeps a tile's loads in flight, and past 16 warps an
SM the extra requests slow DRAM down more than they hide.  From g = 2048 a CTA is one group and
holds 2g words of shared memory (g at 8192): there the kernel's shared-memory carveout is also
sized for 512 threads' CTAs (``launch.launch``'s ``threads_per_sm``; the driver rounds it up to
a size the SM supports: 9 CTAs of 64 threads at g = 2048, 4 of 128 at 4096, 3 of 256 at 8192
on the H200, where the grid's cap keeps 2: 1.09-1.11x the copy's time against 1.12-1.14x with
3) and the rest of the SM's 256 KB stays L1.  Left to the driver, which maximizes resident
CTAs, the carveout took 228 KB at g = 2048 and 4096 (L1: 28 KB) and the transform ran at
1.17-1.21x the copy's time; with 164 KB (L1: 92 KB) 1.10-1.13x.  At g = 2048 a carveout sized
for 384 threads (6 CTAs of 64; the driver's 132 KB hold 7, L1: 124 KB) ran 0.01-0.02x of the
copy's time faster again, in four same-run comparisons (with and without signs); at 4096 and
8192 384 was no faster (8192: 1 CTA of 256, 1.45x).  The FP4Quant kernels, with more work a
tile, run fastest with all that fit and the driver's carveout.

``launch_policy(threads=..., max_blocks=..., threads_per_sm=...)`` overrides the table for the
calls inside it (the simulator tests use small CTAs and grids so that grid-stride loops iterate
and warps cross; ``benchmarks/launch_sweep.py`` sweeps the grid and the carveout).
"""

from __future__ import annotations

import contextlib
import contextvars
import operator
from dataclasses import dataclass


@dataclass(frozen=True)
class Launch:
    """One row of the launch table."""

    op: str  # the kernel (its host function: cuda/<module>.py)
    module: str
    threads: int  # threads a CTA (below g = 2048 for the group kernels)
    work_item: str  # what a thread takes a pass
    items_per_thread: int = 1  # work items a thread takes a pass (their loads in flight at once)
    threads_per_sm: int | None = None  # resident threads an SM the grid is capped at
    partials_per_sm: int | None = None  # CTAs an SM the partials buffer has room for
    carveout_threads_per_sm: tuple = ()  # (g, threads an SM its carveout is sized for)


LAUNCH_TABLE = (
    Launch("quantize", "quantize", 256, "one scale block (16 / 32 elements; 8 when fused)"),
    Launch(
        "quantize_dequantize",
        "quantize_dequantize",
        256,
        "8 elements (16 bytes of bf16 / fp16 in and out)",
        items_per_thread=2,
    ),
    Launch("amax", "amax", 256, "a 16-byte load", items_per_thread=4, partials_per_sm=8),
    Launch("requantized_sum", "reduce", 256, "one scale block of every row (16 / 32 elements)"),
    Launch(
        "requantized_sum_amax",
        "reduce",
        256,
        "one NVFP4 block of every row",
        partials_per_sm=8,
    ),  # fmt: skip
    Launch("dequantize", "dequantize", 256, "16 bytes of output", items_per_thread=4),
    Launch("hadamard", "hadamard", 256, "an element", items_per_thread=32, threads_per_sm=2048),
    Launch(
        "hadamard_prefetch",
        "hadamard",
        128,
        "an element",
        items_per_thread=32,
        threads_per_sm=512,
        carveout_threads_per_sm=((2048, 384),),
    ),  # fmt: skip
    Launch("fp4quant", "fp4quant", 256, "an element", items_per_thread=32, threads_per_sm=2048),
)
LAUNCHES = {row.op: row for row in LAUNCH_TABLE}

WARP_SIZE = 32

# The butterfly network the transform's and FP4Quant's kernels run (``cuda.butterflies``), by
# variant: name -> None (lane stages by warp shuffles) or (smallest g that takes the "smem"
# network, prefetch).  At g = 16 (one lane stage) a shuffle stage costs no more than the two
# transposes.  ``FP4_HADAMARD_VARIANT`` picks one (for benchmarks; ``launch.network_choice``);
# every variant gives the same bits.
NETWORK_VARIANTS = {
    "smem-pf": (32, True),
    "smem": (32, False),
    "smem16": (16, False),
    "shfl": None,
}
DEFAULT_NETWORK_VARIANT = "smem-pf"


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


def _policy_int(value, name):
    """A policy field as an int (None stays None); TypeError for anything else: a float or a
    bool equal to an int would share that int's plans (``LaunchPolicy`` compares equal) and
    fail in an unplanned launch."""
    if value is None:
        return None
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an int or None, got {type(value).__name__}") from None


@contextlib.contextmanager
def launch_policy(threads=None, max_blocks=None, lanes_per_block=None, threads_per_sm=None):
    """Launch every kernel queued inside the block with ``threads`` per CTA (a multiple of 32),
    at most ``max_blocks`` CTAs, ``lanes_per_block`` threads sharing a quantizer block (1
    or 2 for NVFP4; 1, 2 or 4 for MXFP4) and a shared-memory carveout sized for
    ``threads_per_sm`` resident threads an SM (0: the driver's choice, which fits the most
    CTAs).  Results do not depend on it; speed does."""
    threads, max_blocks, lanes_per_block, threads_per_sm = (
        _policy_int(v, name)
        for v, name in (
            (threads, "threads"),
            (max_blocks, "max_blocks"),
            (lanes_per_block, "lanes_per_block"),
            (threads_per_sm, "threads_per_sm"),
        )
    )
    if threads is not None and (threads <= 0 or threads % 32):
        raise ValueError(f"threads: {threads} is not a positive multiple of 32")
    if max_blocks is not None and max_blocks <= 0:
        raise ValueError(f"max_blocks: {max_blocks} is not positive (None: the table's grid)")
    if lanes_per_block not in (None, 1, 2, 4):
        raise ValueError(f"lanes_per_block: {lanes_per_block} is not 1, 2 or 4")
    if threads_per_sm is not None and threads_per_sm < 0:
        raise ValueError(f"threads_per_sm: {threads_per_sm} is negative (0: the driver's choice)")
    token = POLICY.set(LaunchPolicy(threads, max_blocks, lanes_per_block, threads_per_sm))
    try:
        yield
    finally:
        POLICY.reset(token)
