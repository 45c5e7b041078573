"""The decomposition of the pipeline boundary and of sequence parallelism: which direction
(the residual stream forward, its gradient backward) and which rounding costs the loss.

    python -m fp4_train.experiments.boundary_study --run --preset cpu-boundary \\
        --out docs/results/tp_boundary_cpu

``--run`` first runs the preset's missing runs (``tp_sweep``: under torchrun, 2 processes; the
arguments after ``--`` are added to every run, e.g. ``-- --data corpus.txt``); then,
from the records in ``--out``, it writes ``boundary.md`` (the table), ``boundary.csv`` /
``boundary.json`` (the same numbers, with every seed's) and ``boundary.png``.

Every configuration is paired with the bf16 run of its layout and seed (the same
initialization, batches and stochastic-rounding keys): Δ = its final validation loss minus
the bf16 one, per seed; the table gives the mean over seeds and its 95 % confidence interval
(Student's t with n - 1 degrees of freedom: the seeds are the only replication), at 25, 50
and 100 % of training, and the same for the paired training-loss difference averaged over the
last fifth of the steps (many paired batches where the final validation loss is one number).
Beside it: the final checkpoint evaluated with an exact (float32)
boundary in place of the trained-with codec, and the payloads' RMS and SQNR per direction
(means over the logged steps of the last half of training, the seeds and, under SP, the
layers): the pipeline's boundary; under SP the all-gathers of the block input (forward) and of
the residual stream's gradient (backward); ``boundary.json`` has every site.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from . import tp_sweep
from .records import (
    finite_or_none,
    markdown_head,
    markdown_row,
    meta_values,
    pyplot,
    read_record,
    record_paths,
    run_stem,
    write_csv,
    write_json,
)
from .tp_summary import late_gap

PRESET = "cpu-boundary"  # --run's default tp_sweep preset
FRACTIONS = (0.25, 0.5, 1.0)  # points of training where Δ is reported
EXACT = "none-float32"
DEFAULT_CODEC = "fp4quant-g64"  # the codec the table's header names


def t_quantile(p, df):
    """Student's t quantile (scipy)."""
    from scipy import stats

    return float(stats.t.ppf(p, df))


def t_half_width(sd, n, level=0.95):
    """Half-width of the two-sided ``level`` Student's t interval of a mean of ``n`` values
    with standard deviation ``sd``."""
    return t_quantile(0.5 + level / 2, n - 1) * sd / math.sqrt(n)


def mean_ci(values, level=0.95):
    """(mean, half-width of the two-sided ``level`` interval, n); half-width None for n < 2."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, None, n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, t_half_width(sd, n, level), n


def load(folder):
    """{config stem: {seed: record}} of the tp_train records in ``folder``."""
    runs = {}
    for path in record_paths(folder):
        record = read_record(path)
        if not (isinstance(record, dict) and "summary" in record and "steps" in record):
            continue  # other JSON: not a tp_train record
        config = record.get("config")
        missing = [k for k in ("name", "evals") if k not in record] + [
            f"config.{k}" for k in ("seed", "parallel", "codec", "rounding")
            if not isinstance(config, dict) or k not in config]  # fmt: skip
        if missing:
            raise SystemExit(f"{path}: a tp_train record without {', '.join(missing)}; move "
                             "it out to summarize the others")  # fmt: skip
        stem = run_stem(record["name"])
        runs.setdefault(stem, {})[record["config"]["seed"]] = record
    return runs


def layout(record):
    c = record["config"]
    return "sp" if c.get("sequence_parallel") else c["parallel"]


def describe(record):
    """What crosses quantized: 'forward nearest + backward stochastic', 'bf16', ..."""
    c = record["config"]
    fwd = None if c["codec"] in ("none", "none-float32") else c["rounding"]
    grad_codec = c.get("grad_codec") or c["codec"]
    bwd = None if grad_codec in ("none", "none-float32") else record.get("grad_rounding")
    if c["codec"] == "native":
        return "torch.distributed's all-reduce (NCCL's on GPUs)"
    parts = [f"{name} {rounding}" for name, rounding in (("forward", fwd), ("backward", bwd))
             if rounding is not None]  # fmt: skip
    if not parts:
        return "bf16 (baseline)" if c["codec"] == "none" else c["codec"]
    if fwd is not None and bwd is not None and fwd == bwd:
        what = f"both {fwd}"
    else:
        what = " + ".join(parts) + (" only" if len(parts) == 1 else "")
    codecs = {c["codec"], grad_codec} - {"none", "none-float32", DEFAULT_CODEC}
    return what if not codecs else f"{'/'.join(sorted(codecs))}: {what}"


def val_at(record, fraction):
    """Validation loss at the evaluation nearest ``fraction`` of training."""
    target = fraction * record["config"]["steps"]
    return min(record["evals"], key=lambda e: abs(e["step"] - target))["val_loss"]


# The payloads the table shows, per layout: the pipeline's boundary; under SP the two
# all-gathers, of the block input forward (what the column-parallel linears read) and of the
# residual stream's gradient backward; in plain TP the two all-reduces, of the block outputs
# forward and of the block inputs' gradients backward.
SHOWN = {"pp": {"forward": ("boundary", "forward"), "backward": ("boundary", "backward")},
         "sp": {"forward": ("enter", "forward"), "backward": ("exit", "backward")},
         "tp": {"forward": ("exit", "forward"), "backward": ("enter", "backward")}}  # fmt: skip


def wire_means(record):
    """{(site, direction): (rms, sqnr_db)} over the logged steps of the last half of training
    (sqnr_db None for an exact codec)."""
    half = record["config"]["steps"] / 2
    acc = {}
    for w in record.get("wire", []):
        if w["step"] < half:
            continue
        a = acc.setdefault((w["site"], w["direction"]), [0.0, 0.0, 0, 0])
        a[0] += w["rms"]
        a[2] += 1
        if w["sqnr_db"] is not None:
            a[1] += w["sqnr_db"]
            a[3] += 1
    return {k: (a[0] / a[2], a[1] / a[3] if a[3] else None) for k, a in acc.items()}


def analyse(runs):
    """The rows of the table: one per configuration, paired against its layout's bf16."""
    rows = []
    for stem, by_seed in sorted(runs.items(), key=lambda kv: _order(kv[0])):
        first = next(iter(by_seed.values()))
        lay = layout(first)
        base = runs.get(f"{lay}_bf16", {})
        seeds = sorted(s for s in by_seed if s in base)
        row = {"config": stem, "layout": lay, "what": describe(first), "seeds": seeds}
        for f in FRACTIONS:
            deltas = [val_at(by_seed[s], f) - val_at(base[s], f) for s in seeds]
            key = f"delta_{round(100 * f)}"
            row[key], row[key + "_ci"], _ = mean_ci(deltas) if deltas else (None, None, 0)
            row[key + "_per_seed"] = deltas
        late = [g for g in (late_gap(by_seed[s], base[s]) for s in seeds) if g is not None]
        row["delta_train_last_fifth"], row["delta_train_last_fifth_ci"], _ = (
            mean_ci(late) if late else (None, None, 0))  # fmt: skip
        row["delta_train_last_fifth_per_seed"] = late
        exact = [by_seed[s]["summary"]["final_evals"].get(EXACT) for s in seeds]
        if seeds and all(v is not None for v in exact):
            trained = [base[s]["summary"]["final_val_loss"] for s in seeds]
            d = [v - b for v, b in zip(exact, trained, strict=True)]
            row["delta_exact_eval"], row["delta_exact_eval_ci"], _ = mean_ci(d)
        loss = [by_seed[s]["summary"]["final_val_loss"] for s in sorted(by_seed)]
        row["val_loss"], row["val_loss_ci"], _ = mean_ci(loss)
        other = {k for s in by_seed.values() for k in s["summary"]["final_evals"]} - {
            "as_trained", EXACT}  # fmt: skip
        for spec in sorted(other):  # e.g. the bf16 run evaluated with an FP4 boundary
            d = [r["summary"]["final_evals"][spec] - r["summary"]["final_val_loss"]
                 for r in by_seed.values()]  # fmt: skip
            row[f"eval_{spec}_minus_trained"], row[f"eval_{spec}_minus_trained_ci"], _ = mean_ci(d)
        per_seed = [wire_means(r) for r in by_seed.values()]
        for site, direction in sorted({k for m in per_seed for k in m}):
            means = [m[(site, direction)] for m in per_seed if (site, direction) in m]
            sq = [m[1] for m in means if m[1] is not None]
            row.setdefault("wire", {})[f"{site}.{direction}"] = {
                "rms": sum(m[0] for m in means) / len(means),
                "sqnr_db": sum(sq) / len(sq) if sq else None,
            }
        for direction, key in SHOWN.get(lay, {}).items():
            shown = row.get("wire", {}).get(".".join(key))
            if shown is not None:
                row[f"{direction}_rms"] = shown["rms"]
                row[f"{direction}_sqnr_db"] = shown["sqnr_db"]
        rows.append(row)
    return rows


def _order(stem):
    lay, _, rest = stem.partition("_")
    return (lay, rest != "bf16", rest)


def _fmt(mean, ci, digits=4):
    if mean is None:
        return "-"
    return f"{mean:+.{digits}f}" + ("" if ci is None else f" ± {ci:.{digits}f}")


def markdown(rows, runs):
    head = ["configuration", "what is quantized (FP4Quant g = 64 unless named)", "seeds",
            "Δ val loss at 25 %", "at 50 %", "at 100 %", "Δ train loss, last fifth",
            "Δ, exact boundary at eval", "fwd RMS", "fwd SQNR dB", "bwd RMS",
            "bwd SQNR dB"]  # fmt: skip
    lines = markdown_head(head)
    for r in rows:
        if r["config"].endswith("_bf16"):
            continue
        cells = [f"`{r['config']}`", r["what"], str(len(r["seeds"])),
                 _fmt(r["delta_25"], r["delta_25_ci"]), _fmt(r["delta_50"], r["delta_50_ci"]),
                 _fmt(r["delta_100"], r["delta_100_ci"]),
                 _fmt(r["delta_train_last_fifth"], r["delta_train_last_fifth_ci"]),
                 _fmt(r.get("delta_exact_eval"), r.get("delta_exact_eval_ci"))]  # fmt: skip
        for direction in ("forward", "backward"):
            rms, sq = r.get(f"{direction}_rms"), r.get(f"{direction}_sqnr_db")
            cells += ["-" if rms is None else f"{rms:.3g}", "-" if sq is None else f"{sq:.1f}"]
        lines.append(markdown_row(cells))
    lines.append("")
    for r in rows:
        if not r["config"].endswith("_bf16"):
            continue
        lines.append(f"- `{r['config']}` (the baseline): val loss {r['val_loss']:.4f}"
                     + ("" if r["val_loss_ci"] is None else f" ± {r['val_loss_ci']:.4f}")
                     + f" over {len(r['seeds'])} seeds; its boundary RMS forward "
                     f"{r.get('forward_rms', float('nan')):.3g}, backward "
                     f"{r.get('backward_rms', float('nan')):.3g}")  # fmt: skip
        for key in r:
            if key.startswith("eval_") and key.endswith("_minus_trained"):
                spec = key[len("eval_") : -len("_minus_trained")]
                lines.append(f"  - evaluated with a {spec} boundary instead (inference only): "
                             f"{_fmt(r[key], r[key + '_ci'])}")  # fmt: skip
    records = [r for s in runs.values() for r in s.values()]
    any_run = records[0]
    cfg = any_run["config"]
    lines += [
        "",
        f"Δ: the configuration's validation loss minus that of the bf16 run of the same layout "
        f"and seed, mean over the seeds ± the half-width of its 95 % confidence interval "
        f"(Student's t); the training-loss column averages the paired difference over the "
        f"last fifth of the steps (the same batches) before the seeds. RMS and SQNR: of the "
        f"pipeline's boundary; under SP of the all-gathered block input (fwd) and residual "
        f"stream's gradient (bwd); in TP of the all-reduced block output (fwd) and block input "
        f"gradient (bwd); means over the "
        f"last half of training. Model: {cfg['layers']} layers, d {cfg['d_model']}, {cfg['heads']} "
        f"heads, sequence {cfg['seq_len']}, batch {cfg['batch']}, {cfg['steps']} steps, "
        f"lr {cfg['lr']}; {any_run['world_size']} ranks. Device: {meta_values(records, 'device')}; "
        f"torch {meta_values(records, 'torch')}; commits {meta_values(records, 'commit')}.",
    ]
    return "\n".join(lines) + "\n"


def plot(rows, runs, path):
    plt = pyplot()
    fig, (ax_d, ax_rms) = plt.subplots(1, 2, figsize=(13, 5))
    shown = [r for r in rows if not r["config"].endswith("_bf16") and r["delta_100"] is not None]
    ys = range(len(shown))
    for y, r in zip(ys, shown, strict=True):
        color = {"pp": "C0", "sp": "C1"}.get(r["layout"], "C2")
        ax_d.errorbar(r["delta_100"], y, xerr=r["delta_100_ci"] or 0, fmt="o", color=color,
                      capsize=3)  # fmt: skip
        ax_d.plot(r["delta_100_per_seed"], [y] * len(r["delta_100_per_seed"]), "x", color="0.5",
                  ms=4)  # fmt: skip
    ax_d.axvline(0, color="k", lw=0.8)
    ax_d.set_yticks(list(ys), [f"{r['config']}\n{r['what']}" for r in shown], fontsize=7)
    ax_d.invert_yaxis()
    ax_d.set(xlabel="Δ final validation loss vs bf16, same seed (mean, 95 % CI; x: seeds)",
             title="cost of the quantized direction(s)")  # fmt: skip
    ax_d.grid(alpha=0.3)
    # the residual stream's RMS at the pipeline boundary over training, mean over the seeds:
    # where nearest-rounded gradients bias the training, it grows
    for stem, by_seed in sorted(runs.items()):
        if layout(next(iter(by_seed.values()))) != "pp":
            continue
        per_step = {}
        for r in by_seed.values():
            for w in r.get("wire", []):
                if w["direction"] == "forward":
                    per_step.setdefault(w["step"], []).append(w["rms"])
        if per_step:
            steps = sorted(per_step)
            style = "--" if stem.endswith("_bf16") else "-"
            ax_rms.plot(steps, [sum(per_step[t]) / len(per_step[t]) for t in steps], style,
                        lw=1.2, label=stem)  # fmt: skip
    ax_rms.set(xlabel="step", ylabel="RMS of the activation sent (stage 0 -> 1)",
               title="pipeline boundary: residual stream (mean over seeds)")  # fmt: skip
    ax_rms.grid(alpha=0.3)
    ax_rms.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(folder):
    runs = load(folder)
    if not runs:
        raise SystemExit(f"{folder}: no tp_train records")
    rows = analyse(runs)
    flat = [{k: (json.dumps(v) if isinstance(v, list) else v) for k, v in r.items()} for r in rows]
    write_csv(Path(folder) / "boundary.csv", flat)
    write_json(Path(folder) / "boundary.json", {"rows": _finite(rows)})
    table = markdown(rows, runs)
    (Path(folder) / "boundary.md").write_text(table)
    plot(rows, runs, Path(folder) / "boundary.png")
    return table


def _finite(obj):
    if isinstance(obj, float):
        return finite_or_none(obj)
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    return obj


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="the folder of the runs")
    ap.add_argument("--run", action="store_true", help="first run the preset's missing runs")
    ap.add_argument("--preset", choices=sorted(tp_sweep.PRESETS), default=None,
                    help=f"tp_sweep preset (with --run; default {PRESET})")  # fmt: skip
    ap.add_argument("--budget-s", type=float, default=None, help="tp_sweep's, with --run")
    args = ap.parse_args(argv)
    if not args.run:
        options = (("--preset", args.preset), ("--budget-s", args.budget_s),
                   ("arguments after --", extra or None))  # fmt: skip
        given = [option for option, value in options if value is not None]
        if given:
            ap.error(f"{' / '.join(given)}: for the runs of --run, which this call does not "
                     "make; add --run, or leave them out to tabulate --out")  # fmt: skip
    if args.run:
        sweep = ["--preset", args.preset or PRESET, "--out", str(args.out), "--no-summary"]
        if args.budget_s is not None:
            sweep += ["--budget-s", str(args.budget_s)]
        tp_sweep.main([*sweep, "--", "--quiet", *extra])
    print(write(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
