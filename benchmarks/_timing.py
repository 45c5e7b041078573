"""GPU timing shared by the asv suite and ``gpu_throughput.py`` (torch imported lazily, so
that asv can import the suite on a machine without torch or a GPU).

Method: warm up, time with CUDA events around ``CHAIN`` calls back to back (so the GPU never
waits for the host inside a timed interval), medians of repeats, inputs rotated among buffers
larger than the L2, a device-to-device copy as the same-run baseline.
"""

from __future__ import annotations

import abc
import itertools
import json
import os
import statistics
import sys
import time

ROTATE = 3  # distinct input buffers, each far larger than the 60 MB L2
GPU_ELEMENTS = 1 << 26  # asv's GPU inputs: 128 MiB of bf16, twice the L2 at least
CPU_ELEMENTS = 1 << 18  # asv's CPU-path inputs
K = 4096  # row length of the benchmark tensors
CHAIN = 10  # calls between two events in one timing sample (``graph_time_ms``)
#: The run records' module, below the repository's root: its ``commit`` names a result's commit.
RECORDS_FILE = ("packages", "fp4_train", "src", "fp4_train", "experiments", "records.py")


def require_gpu():
    """torch with a CUDA device, or NotImplementedError (asv reports the benchmark skipped)."""
    try:
        import torch
    except ImportError:
        raise NotImplementedError("needs torch with CUDA") from None
    if not torch.cuda.is_available():
        raise NotImplementedError("needs a CUDA GPU")
    return torch


def copy_gbps(nbytes=1 << 30):
    """Device-to-device copy bandwidth, bytes read + written, in GB/s."""
    import torch

    srcs = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    ms, _, _ = cuda_time_ms(lambda s: dst.copy_(s), [(s,) for s in srcs], chain=CHAIN)
    return 2 * nbytes / ms / 1e6


def cuda_time_ms(fn, args_list, warmup=3, reps=15, chain=1):
    """Median device time of ``fn(args)`` in ms, cycling through ``args_list``: ``reps``
    samples, each the time between two events around ``chain`` calls divided by ``chain``.
    With ``chain`` > 1 the host queues the calls faster than the GPU runs them (for kernels of
    ~0.1 ms and up), so the launch latency that a single call's interval holds is spread over
    ``chain`` calls."""
    import torch

    for i in range(warmup):
        fn(*args_list[i % len(args_list)])
    torch.cuda.synchronize()
    times = []
    k = 0
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(chain):
            fn(*args_list[k % len(args_list)])
            k += 1
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / chain)
    return statistics.median(times), min(times), max(times)


def graph_time_ms(fn, args_list, reps=15, chain=CHAIN):
    """Median *device* time of ``fn(args)`` in ms: each call captured once in a CUDA graph;
    ``reps`` samples, each ``chain`` replays back to back between two events, divided by
    ``chain``, so neither host overhead nor the graph launch's latency leaves the GPU idle
    inside the interval (``chain=1``: one replay a sample, which counts that latency once
    per call)."""
    import torch

    graphs = []
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for a in args_list:  # warm-up on the side stream: compiles, fills the allocator's pool
            fn(*a)  # and makes fp4_kernels' launch plans (at the second call of a kind)
            fn(*a)
    torch.cuda.current_stream().wait_stream(s)
    for a in args_list:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn(*a)
        graphs.append(g)
    # each graph replayed once to warm up, then the same samples as an eager call's
    return cuda_time_ms(
        lambda g: g.replay(), [(g,) for g in graphs], len(graphs), reps=reps, chain=chain
    )


def host_time_us(fn, args, reps=200):
    """Median host wall time of one call (queued, not waited for), in microseconds."""
    import torch

    for _ in range(10):
        fn(*args)
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(*args)
        ts.append((time.perf_counter() - t0) * 1e6)
        if len(ts) % 50 == 0:
            torch.cuda.synchronize()  # keep the queue short so launches are not throttled
    torch.cuda.synchronize()
    return statistics.median(ts)


def in_nvtx_ranges(ops):
    """For Nsight Compute (``ncu --nvtx --nvtx-include NAME/``): each of ``ops`` (name ->
    callable) run once, then again inside an NVTX range of its name, so that ncu profiles the
    second, warm call only."""
    import torch

    for name, f in ops.items():
        f()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(name)
        f()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        print("ran", name, flush=True, file=sys.stderr)


def commit_id():
    """The commit a result belongs to, by the rule of the study's run records
    (``fp4_train.experiments.records.commit``): ``FP4_COMMIT`` when set (a copy of the tree
    measured on another machine may carry a stale .git, or none), else this checkout's HEAD,
    with ``-dirty`` where its ``packages/`` differ from it.  Where fp4_train is not installed
    (an asv environment), the same function is loaded from this tree's file."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        from fp4_train.experiments.records import commit
    except ImportError:
        import importlib.util

        path = os.path.join(here, os.pardir, *RECORDS_FILE)
        spec = importlib.util.spec_from_file_location("_fp4_records", path)
        records = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(records)
        commit = records.commit
    return commit(cwd=here)


def run_meta(**fields):
    """The header every result file starts with: GPU name, commit, UTC date and torch version,
    then ``fields``."""
    import datetime

    import torch

    return {
        "device": torch.cuda.get_device_name(),
        "commit": commit_id(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        **fields,
    }


def machine_label(meta, times="x"):
    """ "2 x NVIDIA H200", or "4 ranks sharing 1 x NVIDIA H200" where the ranks of a run shared
    GPUs (a record without "ranks", from before it was written, counts ranks as GPUs)."""
    gpus, ranks = meta["gpus"], meta.get("ranks", meta["gpus"])
    if ranks == gpus:
        return f"{gpus} {times} {meta['device']}"
    return f"{ranks} ranks sharing {gpus} {times} {meta['device']}"


def write_json(out_dir, stem, record, indent=1):
    """``<out_dir>/<stem>.json``, the folder made if missing.  Scripts write it before their
    Markdown table, so the raw figures survive a failure in formatting them."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump(record, f, indent=indent)


def write_markdown(out_dir, stem, lines, echo=False):
    """``<out_dir>/<stem>.md`` from table lines (and the same text on stdout with ``echo``)."""
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write(text)
    if echo:
        print(text, end="")


def measure_params(params, measure):
    """The body of a GPU class's ``setup_cache``: ``measure(*p)`` (a dict of figures) for every
    parameter combination, in one process, with the D2D copy bandwidth measured once beside
    them.  asv runs each ``track_*`` method in a process of its own; measuring in
    ``setup_cache`` compiles each kernel configuration once per class instead of once per
    method (numba compiles in every process), and all of a class's figures come from the
    same measurement.  Without a GPU: ``{"skip": reason}``, which ``cached_row`` turns into
    NotImplementedError in ``setup`` (asv reports the benchmarks skipped; an exception in
    ``setup_cache`` itself would count as a failure)."""
    try:
        require_gpu()
    except NotImplementedError as e:
        return {"skip": str(e)}
    rows = {tuple(p): measure(*p) for p in itertools.product(*params)}
    return {"copy_gbps": copy_gbps(), "rows": rows}


def cached_row(cache, params):
    """A ``setup``'s view of ``measure_params``' result: the figures of one combination
    (NotImplementedError, asv's "skipped", where there is no GPU or ``measure`` returned
    ``{"skip": reason}`` for that combination)."""
    if "skip" in cache:
        raise NotImplementedError(cache["skip"])
    row = cache["rows"][tuple(params)]
    if "skip" in row:
        raise NotImplementedError(row["skip"])
    return dict(row, copy_gbps=cache["copy_gbps"])


# asv's version of the GPU classes' figures.  asv publishes a benchmark's results only where
# their version is the suite's; by default it hashes the benchmark's code (its track_ method,
# setup and setup_cache), so any edit of a class, or of these bases, would start its history
# over.  The version is the measurement method's instead: change it when what a figure measures
# changes, not when the code that measures it is reorganized.
GPU_METHOD_VERSION = "graph-replays-1"


class GPUBenchmark(abc.ABC):
    """A GPU class's figures as asv ``track_*`` values: ``setup`` takes the class's measured
    row (``cached_row``), ``track_device_ms`` its device time.  A subclass defines ``params``,
    ``param_names`` and its own ``setup_cache`` (asv keys that cache by the class defining it:
    an inherited one would be shared by every subclass).  The bases are abstract until then:
    asv's discovery imports this module too and skips abstract classes (a concrete base would
    be a benchmark of its own).  The benchmark modules reach them as ``_timing.<name>``: a
    public name in their namespace would be a benchmark to asv."""

    timeout = 900
    version = GPU_METHOD_VERSION

    @abc.abstractmethod
    def setup_cache(self):
        """The class's rows, measured once (``measure_params``)."""

    def setup(self, cache, *params):
        self.m = cached_row(cache, params)

    def track_device_ms(self, cache, *params):
        return self.m["ms"]

    track_device_ms.unit = "ms"


class BandwidthGPU(GPUBenchmark):
    """``track_ratio_to_copy``: the GB/s of the minimum bytes an op moves (``bytes``) over the
    D2D copy's GB/s measured in the same process (higher is better)."""

    def track_ratio_to_copy(self, cache, *params):
        return self.m["bytes"] / self.m["ms"] / 1e6 / self.m["copy_gbps"]

    track_ratio_to_copy.unit = "x D2D copy"
