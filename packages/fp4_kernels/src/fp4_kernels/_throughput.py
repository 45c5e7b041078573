"""GPU throughput of ``quantize`` and ``dequantize`` for ``fp4 report``, against a
device-to-device copy of the same input timed in the same run.

Method (that of ``benchmarks/_timing.py``, which is not part of the package, with numba's
events and device arrays instead of torch's, so that torch stays optional): one synthetic
tensor (standard normal values, rows of 4096 elements, or of 256 when the element count is
not a multiple of 4096) copied to ``ROTATE`` device buffers that the calls cycle through (at
the default size each is larger than an H100 / H200 L2; one buffer in the simulator), warm-up
calls, then the median of CUDA-event timings of one call each.  What ``quantize`` /
``dequantize`` do on the host (checks, numba's launch, the allocation of the output) takes
longer than their kernels at these sizes, so events around an eager call would time an idle
GPU.  Each timed call is therefore queued behind a blocking kernel (nvbench's method): a
one-thread kernel that sleeps ``BLOCK_MS`` on the GPU, launched before the start event, so the
host has queued the whole call before the GPU reaches the start event and the interval holds
device time only.  Each repeat also times the host's part; a repeat whose host part outlasted
its blocking kernel is counted in ``host_bound_repeats`` (its time may include idle GPU).
The copy is ``cuMemcpyDtoDAsync`` on the same stream.  Output buffers are freed outside the
timed intervals (numba's deferred deallocation would otherwise run ``cuMemFree``, which
synchronizes, inside one).

GB/s counts the bytes a call must read and write at least: the input and the quantized tensor
(codes, scales and, for NVFP4, the tensor scale) for ``quantize``, the other way round for
``dequantize``; the copy counts its input twice (read + written).  NVFP4's ``quantize`` reads
its input twice (the tensor amax, then the blocks), which its GB/s does not count.

In numba's CUDA simulator (only when asked for: ``allow_simulator=True``) the same code runs
with the host clock instead of events (the simulator's events record nothing); its times say
nothing about a GPU.
"""

from __future__ import annotations

import functools
import statistics
import time

import numpy as np

DEFAULT_ELEMENTS = 1 << 26
ROTATE = 3  # distinct input buffers the calls cycle through
ROW = 4096  # row length of the synthetic tensor (256 when the element count needs it)
GRANULE = 256  # the element count must be a multiple of the largest block (FP4Quant g=256)
# report format -> what ``quantize`` takes as ``fmt``: the formats with a GPU path
THROUGHPUT_FORMATS = ("mxfp4", "nvfp4", "fp4quant-g64", "fp4quant-g256")
DIRECTIONS = ("quantize", "dequantize")
BLOCK_MS = 5.0  # the blocking kernel's sleep: several times the ~1 ms host part of a call


class ThroughputUnavailable(Exception):
    """No CUDA GPU to time on; the message says why."""


def _fmt(name):
    if name.startswith("fp4quant-g"):
        from ._quantized import FP4Quant

        return FP4Quant(int(name[len("fp4quant-g") :]))
    return name


def check_elements(elements):
    """``elements`` as an int: 0 (no measurement) or a positive multiple of 256; else
    ValueError."""
    if isinstance(elements, bool) or not isinstance(elements, (int, np.integer)):
        raise TypeError(f"an integer expected, got {elements!r}")
    n = int(elements)
    if n < 0 or n % GRANULE:
        raise ValueError(f"must be 0 or a positive multiple of {GRANULE}, got {elements}")
    return n


def unavailable_reason(allow_simulator=False):
    """None where the kernels can be timed on a CUDA GPU, else why not (one line)."""
    from numba import config

    if config.ENABLE_CUDASIM:
        if allow_simulator:
            return None
        return "numba's CUDA simulator is on (NUMBA_ENABLE_CUDASIM=1): no GPU to time"
    try:
        from numba import cuda

        if cuda.is_available():
            return None
        err = cuda.cuda_error()
    except Exception as e:  # a broken driver install
        err = e
    detail = " ".join(str(err).split()) if err else "numba.cuda.is_available() is false"
    return f"no CUDA GPU ({detail})"  # one line: the driver's message spans several


def _device_name(cuda):
    name = getattr(cuda.get_current_device(), "name", "unknown")
    if isinstance(name, bytes):
        name = name.decode(errors="replace")
    return str(name)


@functools.cache
def blocking_kernel():
    """A one-thread kernel that sleeps ``n`` microseconds (``nanosleep`` of 1 us, n times: the
    hardware may sleep up to twice as long, which only lengthens the head start)."""
    from numba import cuda, uint32

    @cuda.jit
    def block(n):
        for _ in range(n):
            cuda.nanosleep(uint32(1000))

    return block


def cuda_time_ms(fn, args_list, warmup=3, reps=15, simulator=False, stats=None):
    """(median, min, max) device time of ``fn(*args)`` in ms, cycling through ``args_list``:
    ``warmup`` untimed calls, then ``reps`` calls each between two CUDA events on the legacy
    default stream (where the kernels run for numba device arrays), queued behind the blocking
    kernel.  What ``fn`` returns is kept until its end event has completed, so freeing it never
    falls inside an interval.  ``stats`` (a dict), if given, receives the host part's median
    (``host_ms``) and ``host_bound_repeats``."""
    from numba import cuda

    for i in range(warmup):
        fn(*args_list[i % len(args_list)])
    cuda.synchronize()
    block = None if simulator else blocking_kernel()
    block_us = int(BLOCK_MS * 1000)
    times, host, host_bound = [], [], 0
    for i in range(reps):
        a = args_list[i % len(args_list)]
        if simulator:  # synchronous, and its events record nothing: the host clock
            t0 = time.perf_counter()
            out = fn(*a)
            cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        else:
            start, end = cuda.event(), cuda.event()
            with cuda.defer_cleanup():  # no cuMemFree (which synchronizes) in the interval
                block[1, 1](block_us)
                t0 = time.perf_counter()
                start.record()
                out = fn(*a)
                end.record()
                host_ms = (time.perf_counter() - t0) * 1e3
            end.synchronize()
            times.append(cuda.event_elapsed_time(start, end))
            host.append(host_ms)
            host_bound += host_ms >= BLOCK_MS
        del out  # freed (or queued for freeing) outside the interval
    if stats is not None:
        stats.update(host_ms=statistics.median(host) if host else None,
                     host_bound_repeats=host_bound)  # fmt: skip
    return statistics.median(times), min(times), max(times)


def _synthetic(elements, dtype, seed):
    """The synthetic tensor on the host: (raw bits as uint16 / uint32, shape)."""
    from ._arrays import BITS_DTYPE, numpy_dtype

    k = ROW if elements % ROW == 0 else GRANULE
    shape = (elements // k, k)
    x = np.random.default_rng(seed).standard_normal(elements, dtype=np.float32)
    return x.astype(numpy_dtype(dtype)).view(BITS_DTYPE[dtype]).reshape(shape), shape


def _format_rows(name, inputs, in_bytes, copy_ms, warmup, reps, simulator):
    """``measure_throughput``'s rows of one format: quantize, then dequantize."""
    from ._api import dequantize, quantize

    fmt = _fmt(name)
    quantized = [quantize(x, fmt=fmt) for x in inputs]  # also compiles the kernels
    nbytes = in_bytes + int(quantized[0].nbytes)
    timed = (
        ("quantize", lambda x: quantize(x, fmt=fmt), [(x,) for x in inputs]),
        ("dequantize", dequantize, [(q,) for q in quantized]),
    )
    rows = []
    for direction, fn, args_list in timed:
        stats = {}
        ms, lo, hi = cuda_time_ms(fn, args_list, warmup, reps, simulator, stats)
        rows.append(
            {
                "format": name,
                "direction": direction,
                "ms": ms,
                "min_ms": lo,
                "max_ms": hi,
                "bytes": nbytes,
                "gbps": nbytes / ms / 1e6,
                "x_copy": ms / copy_ms,
                **stats,
            }
        )
    return rows


def measure_throughput(
    elements=DEFAULT_ELEMENTS,
    formats=THROUGHPUT_FORMATS,
    dtype="float32",
    warmup=3,
    reps=15,
    seed=0,
    allow_simulator=False,
):
    """Time ``quantize`` and ``dequantize`` (nearest rounding, linear scales) of each of
    ``formats`` on a synthetic ``dtype`` tensor of ``elements`` elements, and a D2D copy of it.
    float32 by default: numba device arrays have no bfloat16 on a real GPU (the kernel tests
    skip that combination; torch tensors carry bfloat16, but torch is optional here).

    Returns the dict ``fp4 report`` stores under ``"throughput"``: the device, the sizes, the
    method, ``"copy"`` (ms, GB/s) and ``"rows"``: one per format and direction with ms (median,
    min, max), bytes, GB/s and ``x_copy`` (its median time / the copy's).  Raises
    ThroughputUnavailable where there is no GPU (or only the simulator, unless
    ``allow_simulator``), ValueError for a bad element count, format or dtype.
    """
    from ._arrays import DTYPES, numpy_dtype

    n = check_elements(elements)
    if n == 0:
        raise ValueError("elements: 0 elements, nothing to time")
    formats = tuple(formats)
    bad = [f for f in formats if f not in THROUGHPUT_FORMATS]
    if bad:
        raise ValueError(f"formats: {bad} have no GPU path; choose from {THROUGHPUT_FORMATS}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {DTYPES}")
    reason = unavailable_reason(allow_simulator)
    if reason is not None:
        raise ThroughputUnavailable(reason)
    from numba import config, cuda

    simulator = bool(config.ENABLE_CUDASIM)
    bits, shape = _synthetic(n, dtype, seed)
    # numba cannot copy ml_dtypes' bfloat16 to the GPU (no buffer export): copy the raw bits,
    # then view them as the element dtype on the device (the API reads the dtype from the view)
    raw = [cuda.to_device(bits) for _ in range(1 if simulator else ROTATE)]
    inputs = [r.view(numpy_dtype(dtype)) for r in raw]
    in_bytes = int(bits.nbytes)

    copy_dst = cuda.device_array_like(raw[0])
    stream = cuda.default_stream()  # a stream object: cuMemcpyDtoDAsync, not the blocking copy
    copy_stats = {}
    copy_ms, copy_min, copy_max = cuda_time_ms(
        lambda src: copy_dst.copy_to_device(src, stream=stream),
        [(r,) for r in raw], warmup, reps, simulator, copy_stats,
    )  # fmt: skip
    copy_bytes = 2 * in_bytes
    rows = [
        row
        for name in formats
        for row in _format_rows(name, inputs, in_bytes, copy_ms, warmup, reps, simulator)
    ]
    return {
        "device": "CUDA simulator" if simulator else _device_name(cuda),
        "elements": n,
        "shape": list(shape),
        "dtype": dtype,
        "input_bytes": in_bytes,
        "timer": "host clock (CUDA simulator)"
        if simulator
        else f"CUDA events, each call queued behind a {BLOCK_MS:g} ms blocking kernel",
        "warmup": warmup,
        "repeats": reps,
        "statistic": "median",
        "rounding": "nearest",
        "copy": {
            "ms": copy_ms,
            "min_ms": copy_min,
            "max_ms": copy_max,
            "bytes": copy_bytes,
            "gbps": copy_bytes / copy_ms / 1e6,
            **copy_stats,
        },
        "rows": rows,
    }
