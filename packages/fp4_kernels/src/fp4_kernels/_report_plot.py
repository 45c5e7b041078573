"""The figure of ``fp4 report``: per-matrix relative errors by format, and error against bits
per weight with every label readable."""

from __future__ import annotations

import math

import numpy as np


def figure(result):
    """The report's figure: per-matrix relative errors by format (left); error against bits
    per weight, labelled with zeros and the decode model's ms per token (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fmts = list(result["summary"])
    colors = {f: plt.get_cmap("tab10")(i % 10) for i, f in enumerate(fmts)}
    # a shape per format too: two formats can sit on one point (same bits, same error)
    markers = {f: "osD^vPX*"[i % 8] for i, f in enumerate(fmts)}
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(13, 5.2), gridspec_kw={"width_ratios": [1, 1.15]})

    _errors_by_matrix(ax0, result, fmts, colors)
    _cost_against_error(ax1, result, fmts, colors, markers)
    name = result["model"]
    fig.suptitle(  # (parse_math off: a "$" in the model's path is not TeX)
        f"FP4 formats on {name}: {result['linear_elements']:,} linear weights",
        fontsize=11,
        parse_math=False,
    )
    fig.tight_layout()
    return fig


LABEL_POINTS = 9


def _matrices(n):
    return "1 matrix" if n == 1 else f"{n} matrices"


def _say_nothing_to_draw(ax):
    ax.text(
        0.5,
        0.5,
        "no error above 0 and finite to draw\n(see the table)",
        transform=ax.transAxes,
        ha="center",
        va="center",
        color="0.35",
    )


def _plottable(v):
    return math.nan if v is None else float(v)


def _label_column(ax, pts, colors, x_text, decode):
    """Labels at x_text, in the order of their points' errors, at least a label's height
    apart (measured on the rendered text), each joined to its point by a line."""
    texts = {
        fmt: f"{fmt}: {s['zero_fraction']:.1%} zeros\n{s['decode_ms_per_token']:.3f} ms/token"
        for fmt, _, _, s in pts
    }
    fig = ax.figure
    probe = ax.text(0, 0, max(texts.values(), key=len), fontsize=LABEL_POINTS)
    fig.canvas.draw()
    label_px = probe.get_window_extent().height
    probe.remove()
    lo, hi = (math.log10(v) for v in ax.get_ylim())
    gap = 1.3 * label_px / ax.get_window_extent().height * (hi - lo)  # in log10 units
    order = sorted(pts, key=lambda p: p[2])
    placed = []
    for _, _, err, _ in order:  # push up whatever would overlap the label below
        y = math.log10(err)
        placed.append(max(y, placed[-1] + gap) if placed else y)
    overflow = placed[-1] - (hi - gap / 2)
    if overflow > 0:  # then shift the column down, keeping the gaps, within the axes
        placed = [max(p - overflow, lo + gap / 2 + i * gap) for i, p in enumerate(placed)]
    for (fmt, bits, err, _), y in zip(order, placed, strict=True):
        ax.annotate(
            texts[fmt],
            xy=(bits, err),
            xytext=(x_text, 10**y),
            textcoords="data",
            va="center",
            fontsize=LABEL_POINTS,
            color=colors[fmt],
            # from the label's left middle: left of the column, so no line crosses a label
            arrowprops={
                "arrowstyle": "-",
                "color": colors[fmt],
                "lw": 0.8,
                "shrinkB": 4,
                "relpos": (0.0, 0.5),
            },
        )
    ax.text(
        0.99,
        0.01,
        f"ms/token: decode-speed model (not measured), {decode['bandwidth_gbs']:g} GB/s "
        f"+ {decode['fixed_ms']:g} ms",
        transform=ax.transAxes,
        ha="right",
        va="bottom",
        fontsize=7,
        color="0.35",
    )


def _plain_log_ticks(axis):
    """Log-scale ticks at 1, 2, 5 x 10^k, written as plain numbers (0.05, 0.1, 0.2)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def plot(result, png_path):
    """``figure(result)`` saved as a PNG."""
    import matplotlib.pyplot as plt

    fig = figure(result)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


def _errors_by_matrix(ax0, result, fmts, colors):
    # left: one dot per matrix, formats as rows; x is the error itself
    # (a log scale: an error that is 0 or not finite is not drawn; an axis with none says so)
    rng = np.random.default_rng(0)  # vertical jitter only, so dots of equal error stay apart
    drawn = 0
    for i, fmt in enumerate(fmts):
        errs = np.array(
            [_plottable(m["formats"][fmt]["rel_error"]) for m in result["matrices"]], float
        )
        errs = errs[np.isfinite(errs) & (errs > 0)]
        y = len(fmts) - 1 - i
        if errs.size:
            drawn += errs.size
            ax0.scatter(
                errs, y + rng.uniform(-0.18, 0.18, errs.size), s=10, color=colors[fmt], alpha=0.6
            )
            s = _plottable(result["summary"][fmt]["rel_error"])
            if math.isfinite(s) and s > 0:
                ax0.plot([s, s], [y - 0.32, y + 0.32], color="black", lw=1.5)
    ax0.set_yticks(range(len(fmts)), list(reversed(fmts)))
    ax0.set_ylim(-0.6, len(fmts) - 0.4)
    _log_scale(ax0, "x", drawn)
    ax0.set_xlabel("mean|w - q(w)| / mean|w| of a matrix (log scale)")
    ax0.set_title(
        f"relative error of each of the {_matrices(result['matrices_count'])}\n"
        "(dots; bar: all matrices together)",
        fontsize=10,
    )
    ax0.grid(axis="x", which="both", alpha=0.3)


def _cost_against_error(ax1, result, fmts, colors, markers):
    # right: one point per format; labels in a column beside the points, joined by a line,
    # so that formats with the same bits per weight (mxfp4, fp4quant-g64) stay readable
    pts = []
    for fmt in fmts:
        s = result["summary"][fmt]
        err = _plottable(s["rel_error"])
        if math.isfinite(err) and err > 0:
            pts.append((fmt, s["bits_per_weight"], err, s))
            ax1.scatter(
                s["bits_per_weight"],
                err,
                s=70,
                marker=markers[fmt],
                facecolors="none",
                edgecolors=colors[fmt],
                linewidths=1.6,
                zorder=3,
            )
    _log_scale(ax1, "y", bool(pts))
    ax1.set_xlabel("bits per weight, scales included")
    ax1.set_ylabel("relative error, all matrices (log scale)")
    ax1.set_title("cost against error", fontsize=10)
    ax1.grid(which="both", alpha=0.3)
    if pts:
        xs = [p[1] for p in pts]
        lo, hi = min(xs), max(xs)
        span = max(hi - lo, 0.25)
        ax1.set_xlim(lo - 0.15 * span, hi + 1.6 * span)  # room on the right for the labels
        errs = [p[2] for p in pts]
        ax1.set_ylim(min(errs) / 1.6, max(errs) * 1.6)
        _label_column(ax1, pts, colors, hi + 0.35 * span, result["decode_model"])


def _log_scale(ax, axis, drawn):
    """A log scale with plain tick labels on ``ax``'s ``axis`` ("x" or "y") where anything
    was drawn; else a note that there is nothing to draw."""
    if drawn:
        getattr(ax, f"set_{axis}scale")("log")
        _plain_log_ticks(getattr(ax, f"{axis}axis"))
    else:
        _say_nothing_to_draw(ax)
