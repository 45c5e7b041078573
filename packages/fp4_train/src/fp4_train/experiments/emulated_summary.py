"""The table of the emulated study: every configuration paired with bf16 of the same model,
layout and seed, with the preprint's figures beside it.

    python -m fp4_train.experiments.emulated_summary docs/results/emulated_runs \\
        --reruns docs/results/emulated_reruns --out docs/results/emulated_study

Reads the ``emulated_tp`` summaries in the folders given and writes ``<out>/table.md`` (the
table), ``table.json`` (the same rows, each seed's numbers too), ``gaps.md`` (each run's paired
gap at every evaluation, and late in training), ``pairs.md`` (every two wires of one model and
layout compared on their common seeds), ``baselines.md`` (the bf16 runs of every layout side
by side, against the plain model's where it ran), ``ranks.md`` (a wire's gap to bf16 at two
numbers of tensor-parallel ranks, paired by seed: whether the wire costs more as k grows),
``seeds.md`` (what more seeds would resolve:
for each wire the seeds an interval of +-1 % of bf16's loss takes, and those that would put the
interval's upper end below 1 %, at the gap and spread measured so far), ``timing.md`` (step
time, tokens/s and wall minutes of every run) and ``curves.png`` (the final-loss gaps with
their intervals, and the paired training-loss gap over training, one panel per layout).
``--reruns DIR...``: summaries of runs made again (the same name: configuration and seed),
written beside the first run of each in ``reruns.md``.

Pairing.  Δ = a run's final validation loss minus that of the bf16 run of its model, layout
and seed (the same initialization, batches and rounding keys); the table gives the mean over
seeds and its 95 % interval (Student's t, n - 1 degrees of freedom: the seeds are the only
replication), and the mean Δ as a percentage of the bf16 loss; beside it the same for the
training loss late in training (the paired difference on the same batches, averaged over the
last fifth of the steps: many steps where the final validation loss is one number).  The
bf16 row gives the spread of the seeds themselves (their standard deviation): a gap inside it
is no gap these runs can resolve.

The preprint's figures (FP4Quant, 4-way TP of a 7B Qwen model, its data and schedule) are
quoted beside the rows they correspond to, marked as quoted: bf16 2.1505, FP4Quant g = 64
2.2306, g = 256 3.0616, TAH-Quant 3.48 (4-way TP), the pipeline boundary with g = 64 2.1525.
Its model and data differ from these runs: compare the gaps (quoted as a percentage of its
bf16 loss), not the losses.
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

from .boundary_study import mean_ci, t_half_width
from .emulated_tp import SUMMARY_KIND
from .records import (
    markdown_head,
    markdown_row,
    pyplot,
    read_record,
    record_paths,
    run_stem,
    write_json,
)
from .tp_summary import tail_gap

BASELINE = "bf16"
# The preprint's final losses (quoted): 4-way TP of Qwen 7B, and a PP boundary.
PREPRINT_BF16 = 2.1505
PREPRINT = {
    ("tp4", "bf16"): PREPRINT_BF16,
    ("tp4", "fp4quant-g64"): 2.2306,
    ("tp4", "fp4quant-g256"): 3.0616,
    ("tp4", "tahquant"): 3.48,
    ("pp2", "bf16"): PREPRINT_BF16,
    ("pp2", "fp4quant-g64"): 2.1525,
}


# what the tables read of a summary
_FIELDS = ("name", "model", "layout", "seed", "codec", "grad_codec", "grad_rounding", "config",
           "final_val_loss", "wall_s", "tokens_per_s", "tokens_per_step")  # fmt: skip


def load(folders):
    """The ``emulated_tp`` summaries in ``folders`` (a file given twice, through a folder named
    twice, read once); SystemExit naming the file for a record that cannot be read, one
    without a field the tables read or without a finite final loss (a diverged run), and two
    records of one run (model, layout, policy, seed), which would leave one of them out."""
    out, seen, where = [], set(), {}
    for folder in folders:
        for path in record_paths(folder):
            if path.resolve() in seen:
                continue
            seen.add(path.resolve())
            record = read_record(path)
            if not (isinstance(record, dict) and record.get("kind") == SUMMARY_KIND):
                continue
            missing = [k for k in _FIELDS if k not in record]
            if missing:
                raise SystemExit(f"{path}: an emulated_tp summary without {', '.join(missing)}")
            loss = record["final_val_loss"]
            if isinstance(loss, bool) or not isinstance(loss, (int, float)) \
                    or not math.isfinite(loss):  # fmt: skip
                raise SystemExit(f"{path}: final_val_loss {loss!r}, not a finite loss (a "
                                 "diverged run?); move it out to summarize the others")  # fmt: skip
            key = (record["model"], record["layout"], policy(record), record["seed"])
            if key in where:
                raise SystemExit(f"{path} and {where[key]}: two records of one run "
                                 f"({', '.join(map(str, key))}); keep one")  # fmt: skip
            where[key] = path
            out.append(record)
    return out


def policy(summary):
    """The wire policy part of the run name: 'bf16', 'fp4quant-g64_sr', ..."""
    stem = run_stem(summary["name"])
    return stem[len(f"{summary['model']}_{summary['layout']}_") :]


def quoted(summary):
    """The preprint's loss for this row, or None: its model is a Qwen one (the byte-level CPU
    model's rows quote nothing), its TP rows are 4-way, nearest rounding and no error feedback,
    the same codec forward and backward (TAH-Quant: its activation codec forward and its
    gradient codec backward); its PP row FP4Quant g = 64."""
    c = summary["config"]
    if not summary["model"].startswith("qwen"):
        return None
    if c.get("error_feedback") or c.get("rounding") != "nearest":
        return None
    codec = summary["codec"]
    if codec.startswith("tahquant"):  # its own gradient codec backward
        if not summary["grad_codec"].startswith("tahquant"):
            return None
        codec = "tahquant"
    elif summary["grad_codec"] != codec:
        return None
    if summary["layout"] == "tp4" and summary["grad_rounding"] != "nearest":
        return None
    return PREPRINT.get((summary["layout"], codec))


def _groups(summaries):
    """{(model, layout, policy): {seed: summary}}."""
    out = {}
    for s in summaries:
        out.setdefault((s["model"], s["layout"], policy(s)), {})[s["seed"]] = s
    return out


def _paired(a, b):
    """The seeds both {seed: summary} have, and a's final validation loss minus b's on each."""
    seeds = sorted(set(a) & set(b))
    return seeds, [a[k]["final_val_loss"] - b[k]["final_val_loss"] for k in seeds]


def late_gap(run, base):
    """The paired training-loss gap late in training: the mean, over the last fifth of
    ``train_loss_curve``'s points (window means of the loss on the same batches), of run's
    minus base's; None where either has no curve."""
    return tail_gap([p[1] for p in run.get("train_loss_curve") or []],
                    [p[1] for p in base.get("train_loss_curve") or []])  # fmt: skip


def rows(summaries):
    """One row per (model, layout, policy), paired with bf16 of the same seeds."""
    groups = _groups(summaries)
    out = []
    for (model, lay, pol), by_seed in sorted(groups.items(), key=_order):
        base = groups.get((model, lay, BASELINE), {})
        seeds = sorted(by_seed)
        losses = [by_seed[k]["final_val_loss"] for k in seeds]
        paired, deltas = _paired(by_seed, base)
        base_losses = [base[k]["final_val_loss"] for k in paired]
        late = [late_gap(by_seed[k], base[k]) for k in paired]  # (None: a run without a curve)
        known = [g for g in late if g is not None]
        first = by_seed[seeds[0]]
        row = {
            "model": model, "layout": lay, "policy": pol, "codec": first["codec"],
            "grad_codec": first["grad_codec"], "grad_rounding": first["grad_rounding"],
            "seeds": seeds, "val_loss": losses,
            "val_loss_mean": sum(losses) / len(losses),
            "val_loss_sd": _sd(losses),
            "paired_seeds": paired, "delta": deltas, "train_delta_last_fifth": late,
            "wall_min": sum(by_seed[k]["wall_s"] for k in seeds) / len(seeds) / 60,
            "concurrent_runs": max(by_seed[k].get("concurrent_runs", 1) for k in seeds),
            "tokens_per_s": sum(by_seed[k]["tokens_per_s"] for k in seeds) / len(seeds),
            "steps": first["config"]["steps"], "tokens_per_step": first["tokens_per_step"],
        }  # fmt: skip
        if deltas and pol != BASELINE:
            mean, half, n = mean_ci(deltas)
            base_mean = sum(base_losses) / len(base_losses)
            row.update(delta_mean=mean, delta_ci=half, base_loss=base_mean,
                       gap_pct=100 * mean / base_mean,
                       gap_ci_pct=None if half is None else 100 * half / base_mean)  # fmt: skip
        if known and pol != BASELINE:
            row["train_delta_mean"], row["train_delta_ci"], _ = mean_ci(known)
        q = quoted(first)
        if q is not None:
            row.update(preprint_loss=q, preprint_gap_pct=100 * (q - PREPRINT_BF16) / PREPRINT_BF16)
        out.append(row)
    return out


# The layouts in the order of the table, with the title of each one's curve panel.
LAYOUTS = {"tp2": "TP = 2", "tp4": "TP = 4", "tp8": "TP = 8", "pp2": "PP = 2",
           "tp4-sp": "TP = 4 with SP", "tp1": "one rank"}  # fmt: skip


def _layout_rank(lay):
    return list(LAYOUTS).index(lay) if lay in LAYOUTS else len(LAYOUTS)


def _order(item):
    (model, lay, pol), _ = item
    return (model, _layout_rank(lay), lay, pol != BASELINE, pol)


def _sd(values):
    if len(values) < 2:
        return None
    m = sum(values) / len(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def _fmt(v, digits=4, sign=False):
    if v is None:
        return "–"
    return f"{v:+.{digits}f}" if sign else f"{v:.{digits}f}"


def _mean_ci_cell(values):
    """The mean of ``values`` and the half-width of its 95 % t interval, three decimals
    ('+0.012 ± 0.034'); the mean alone for one value."""
    mean, half, _ = mean_ci(values)
    return _fmt(mean, 3, sign=True) + ("" if half is None else f" ± {half:.3f}")


def markdown(table):
    head = ["model", "layout", "wire (forward; gradient)", "seeds", "val loss",
            "Δ vs bf16 (95 % CI)", "gap % of bf16 (95 % CI)", "Δ train loss, last fifth",
            "preprint, quoted: loss (gap %)", "min / run"]  # fmt: skip
    lines = markdown_head(head)
    for r in table:
        if r["policy"] == BASELINE:
            sd = r["val_loss_sd"]
            delta = "seeds' sd " + _fmt(sd) if sd is not None else "–"
            gap = train = "–"
        else:
            ci = r.get("delta_ci")
            delta = _fmt(r.get("delta_mean"), sign=True) + (f" ± {ci:.4f}" if ci else "")
            gci = r.get("gap_ci_pct")
            gap = _fmt(r.get("gap_pct"), 2, sign=True) + (f" ± {gci:.2f}" if gci else "")
            tci = r.get("train_delta_ci")
            train = _fmt(r.get("train_delta_mean"), sign=True) + (f" ± {tci:.4f}" if tci else "")
        q = r.get("preprint_loss")
        quote = "–" if q is None else f"{q:.4f} ({r['preprint_gap_pct']:+.1f} %)"
        wire = f"{r['codec']}; {r['grad_codec']}"
        if r["grad_codec"] != BASELINE:  # (bf16 rounds by casting: no rounding mode to name)
            wire += f" ({r['grad_rounding']})"
        lines.append(markdown_row([
            r["model"], r["layout"], f"{r['policy']}: {wire}", str(len(r["seeds"])),
            _fmt(r["val_loss_mean"]), delta, gap, train, quote, f"{r['wall_min']:.1f}",
        ]))  # fmt: skip
    lines += [
        "",
        "Δ: final validation loss minus bf16's of the same model, layout and seed, mean over "
        "the paired seeds ± the half-width of its 95 % t interval.  Δ train loss, last fifth: "
        "the training loss minus bf16's on the same batches, averaged over the last fifth of "
        "the steps, then over the seeds (± the same interval).  Preprint figures are "
        "quoted from the FP4Quant preprint (Qwen 7B, its data and schedule): compare its gaps "
        "with ours, not its losses.  min / run: wall minutes of one run, with the number of "
        "runs that shared the GPU in table.json.",
    ]
    return "\n".join(lines) + "\n"


def _evals(summary):
    """{step: validation loss} of a run's evaluations."""
    return {int(k): v for k, v in summary.get("evals", [])}


def gaps_markdown(summaries):
    """Each run's validation loss minus bf16's of its model, layout and seed at every
    evaluation both runs made (their ``evals``): where a gap opens, and whether it closes; and
    the training-loss gap over the last fifth of the steps (``late_gap``)."""
    groups = _groups(summaries)
    lines = []
    for model, lay in sorted({(m, lay) for m, lay, _ in groups}):
        base = groups.get((model, lay, BASELINE), {})
        runs = [(pol, seed, _evals(s), _evals(base[seed]), late_gap(s, base[seed]))
                for (m, la, pol), by_seed in sorted(groups.items())
                if (m, la) == (model, lay) and pol != BASELINE
                for seed, s in sorted(by_seed.items()) if seed in base]  # fmt: skip
        if not runs:
            continue
        steps = sorted(set().union(*(mine.keys() & ref.keys() for _, _, mine, ref, _ in runs)))
        lines += [f"**{model}, {lay}**", "",
                  *markdown_head(["run", *map(str, steps), "train, last fifth"],
                                 right=range(1, len(steps) + 2))]  # fmt: skip
        for pol, seed, mine, ref, late in runs:
            cells = [_fmt(mine[k] - ref[k], 3, sign=True) if k in mine else "–" for k in steps]
            cells.append(_fmt(late, 3, sign=True))
            lines.append(markdown_row([f"{pol}, seed {seed}", *cells]))
        lines.append("")
    lines.append(
        "Validation loss minus bf16's of the same model, layout and seed at each "
        "evaluation step (columns); last column: the training loss minus bf16's on the same "
        "batches, averaged over the last fifth of the steps."
    )
    return "\n".join(lines) + "\n"


def pairs_markdown(summaries):
    """Every two wires of one model and layout, compared on the seeds both ran: the per-seed
    differences of their final validation losses, the mean and its 95 % t interval.  The pairing
    removes what a seed does to both (its initialization and batches)."""
    head = ["model", "layout", "wire a", "wire b", "seeds", "a − b per seed",
            "mean (95 % CI)"]  # fmt: skip
    lines = markdown_head(head)
    groups = _groups(summaries)
    wires = sorted(key for key in groups if key[2] != BASELINE)
    for i, (model, lay, a) in enumerate(wires):
        for b in [w for m, la, w in wires[i + 1 :] if (m, la) == (model, lay)]:
            seeds, d = _paired(groups[(model, lay, a)], groups[(model, lay, b)])
            if len(seeds) >= 2:
                lines.append(markdown_row([
                    model, lay, a, b, " ".join(map(str, seeds)),
                    " / ".join(_fmt(v, 3, sign=True) for v in d), _mean_ci_cell(d),
                ]))  # fmt: skip
    lines += ["", "a − b: final validation loss of wire a minus wire b's on the same seed; "
              "pairs with at least two common seeds."]  # fmt: skip
    return "\n".join(lines) + "\n"


#: The layout other layouts' bf16 runs are compared with where a model has runs of it: the
#: plain model on one rank (no wire).
PLAIN = "tp1"


def baselines_markdown(summaries):
    """bf16 across layouts: each layout's bf16 final validation loss per seed, and its
    difference to the plain model's (``PLAIN``; else to the model's layout with the most bf16
    seeds) on the seeds both ran, mean and 95 % t interval.  Every wire is paired with bf16 of
    its own layout; this says how far the layouts' baselines are from one another."""
    groups = _groups(summaries)
    head = ["model", "layout", "bf16 val loss per seed", "reference", "− reference per seed",
            "mean (95 % CI)"]  # fmt: skip
    lines = markdown_head(head)
    models = sorted({m for m, _, pol in groups if pol == BASELINE})
    for model in models:
        base = {lay: by for (m, lay, pol), by in groups.items() if m == model and pol == BASELINE}
        layouts = sorted(base, key=lambda lay: (_layout_rank(lay), lay))
        ref = PLAIN if PLAIN in base else max(layouts, key=lambda lay: len(base[lay]))
        for lay in layouts:
            losses = " / ".join(f"{k}: {base[lay][k]['final_val_loss']:.4f}"
                                for k in sorted(base[lay]))  # fmt: skip
            per_seed = mean = "–"
            if lay != ref:
                seeds, d = _paired(base[lay], base[ref])
                if seeds:
                    per_seed = " / ".join(f"{k}: {_fmt(v, 3, sign=True)}"
                                          for k, v in zip(seeds, d, strict=True))  # fmt: skip
                    mean = _mean_ci_cell(d)
            lines.append(markdown_row([model, lay, losses, ref, per_seed, mean]))
    lines += ["", "The bf16 runs of each layout (seed: final validation loss), and each "
              "layout's minus the reference layout's on the seeds both ran: the plain model "
              f"({PLAIN}) where it ran, else the layout with the most seeds."]  # fmt: skip
    return "\n".join(lines) + "\n"


#: Plain tensor parallelism over k ranks (not SP, not the pipeline, not the plain model).
_TP_LAYOUT = re.compile(r"tp([2-9]|[1-9][0-9]+)")


def _gaps(groups, model, lay, wire):
    """{seed: wire's final validation loss minus bf16's} at one model and layout."""
    seeds, d = _paired(groups.get((model, lay, wire), {}), groups.get((model, lay, BASELINE), {}))
    return dict(zip(seeds, d, strict=True))


def ranks_markdown(summaries):
    """How a wire's gap changes with the ranks: for every wire run at two layouts of plain
    tensor parallelism (``tp<k>``, k >= 2) of one model, its gap to bf16 of its own layout at
    each, and the larger k's gap minus the smaller's on the seeds both have, mean and 95 % t
    interval.  Pairing the gaps by seed takes out what a seed does to a layout's bf16 and wire
    alike; what is left is the change in the wire's cost (and the trajectories' spread)."""
    groups = _groups(summaries)
    head = ["model", "wire", "ranks a → b", "seeds", "gap at a per seed", "gap at b per seed",
            "b − a per seed", "mean (95 % CI)"]  # fmt: skip
    lines = markdown_head(head)
    ranks = {}  # (model, wire) -> the k of every tp<k> layout it ran at
    for model, lay, wire in groups:
        tp = _TP_LAYOUT.fullmatch(lay)
        if tp and wire != BASELINE:
            ranks.setdefault((model, wire), []).append(int(tp[1]))
    for (model, wire), ks in sorted(ranks.items()):
        ks.sort()
        for i, ka in enumerate(ks):
            for kb in ks[i + 1 :]:
                a, b = (_gaps(groups, model, f"tp{k}", wire) for k in (ka, kb))
                seeds = sorted(set(a) & set(b))
                if not seeds:
                    continue
                d = [b[k] - a[k] for k in seeds]
                lines.append(markdown_row([
                    model, wire, f"{ka} → {kb}", " ".join(map(str, seeds)),
                    " / ".join(_fmt(a[k], 3, sign=True) for k in seeds),
                    " / ".join(_fmt(b[k], 3, sign=True) for k in seeds),
                    " / ".join(_fmt(v, 3, sign=True) for v in d), _mean_ci_cell(d),
                ]))  # fmt: skip
    lines += ["", "gap: a run's final validation loss minus bf16's of its layout and seed; "
              "b − a: the gap with b tensor-parallel ranks minus the gap with a, on the seeds "
              "both have (the interval from two seeds on)."]  # fmt: skip
    return "\n".join(lines) + "\n"


#: The gap the study aims below, as a fraction of bf16's loss.
AIM = 0.01
#: The most seeds ``seeds_needed`` looks at ("more" beyond).
MAX_SEEDS = 200


def seeds_needed(mean, sd, limit, level=0.95):
    """The fewest seeds n (>= 2) whose two-sided ``level`` t interval around ``mean``, with the
    seeds' standard deviation ``sd``, lies below ``limit``: t(n - 1) sd / sqrt(n) <
    ``limit - mean``.  None where it cannot (``mean >= limit``) or takes more than
    ``MAX_SEEDS``."""
    margin = limit - mean
    if margin <= 0:
        return None
    if sd == 0:
        return 2
    for n in range(2, MAX_SEEDS + 1):
        if t_half_width(sd, n, level) < margin:
            return n
    return None


def seeds_markdown(table):
    """For every wire with at least two seeds paired with bf16: its gap and spread so far, and
    how many seeds (at that gap and spread) an interval of +-1 % of bf16's loss takes, and how
    many would put the interval's upper end below 1 % (the study's aim)."""
    head = ["model", "layout", "wire", "seeds", "gap % (95 % CI)", "upper end %",
            "sd of Δ", "seeds for ± 1 %", "seeds for the upper end < 1 %"]  # fmt: skip
    lines = markdown_head(head)
    for r in table:
        if r["policy"] == BASELINE or len(r["delta"]) < 2:
            continue
        base, sd = r["base_loss"], _sd(r["delta"])
        width = seeds_needed(0.0, sd, AIM * base)
        below = seeds_needed(r["delta_mean"], sd, AIM * base)
        lines.append(markdown_row([
            r["model"], r["layout"], r["policy"], str(len(r["delta"])),
            f"{r['gap_pct']:+.2f} ± {r['gap_ci_pct']:.2f}",
            f"{r['gap_pct'] + r['gap_ci_pct']:+.2f}", f"{sd:.4f}",
            str(width) if width else f"> {MAX_SEEDS}",
            str(below) if below else ("never (gap ≥ 1 %)" if r["gap_pct"] >= 100 * AIM
                                      else f"> {MAX_SEEDS}"),
        ]))  # fmt: skip
    lines += ["", "At the gap and the seeds' spread (sd of the paired Δ) measured so far, "
              "Student's t: the seeds a 95 % interval of ± 1 % of bf16's loss takes, and the "
              "seeds that would put its upper end below 1 % (a mean gap at or above 1 % never "
              "does). "
              "Estimates: more seeds also move the gap and the spread."]  # fmt: skip
    return "\n".join(lines) + "\n"


def reruns_markdown(summaries, reruns):
    """Each run made again beside the run of its name: both final validation losses, the
    rerun's minus the run's at every evaluation, the first logged training loss of both and the
    source digests.  Where the GPU kernels are not deterministic, one seed does not fix a run:
    this is how far two of them end apart."""
    by_name = {s["name"]: s for s in summaries}
    missing = sorted({r["name"] for r in reruns} - by_name.keys())
    if missing:
        raise SystemExit(f"reruns whose run is not in the folders: {', '.join(missing)}")
    pairs = [(by_name[r["name"]], r) for r in sorted(reruns, key=lambda r: r["name"])]
    steps = sorted(set().union(*(_evals(a).keys() & _evals(b).keys() for a, b in pairs)))
    head = ["run", "final val loss: run / rerun", *map(str, steps),
            "first training loss: run / rerun", "source: run / rerun"]  # fmt: skip
    lines = markdown_head(head, right=range(2, 2 + len(steps)))
    for run, again in pairs:
        mine, ref = _evals(again), _evals(run)
        cells = [_fmt(mine[k] - ref[k], 3, sign=True) if k in mine and k in ref else "–"
                 for k in steps]  # fmt: skip
        first = " / ".join(f"{s['train_loss_curve'][0][1]:.5f}" for s in (run, again))
        source = " / ".join(s.get("meta", {}).get("source", "?") for s in (run, again))
        losses = f"{_fmt(run['final_val_loss'])} / {_fmt(again['final_val_loss'])}"
        lines.append(markdown_row([run["name"], losses, *cells, first, source]))
    lines += ["", "Columns by step: the rerun's validation loss minus the run's.  First training "
              "loss: the mean over the first logged steps."]  # fmt: skip
    return "\n".join(lines) + "\n"


def timing_markdown(summaries):
    """Every run's speed and provenance: step time, throughput, wall seconds, peak memory, how
    many runs shared the GPU and which GPU, the tree it ran (commit, abbreviated; and the digest
    of the source files a run executes, where recorded: runs of one digest computed with the
    same code) and its date."""
    head = ["run", "step ms", "tokens/s", "model TFLOP/s", "wall s", "GPU memory GB",
            "runs sharing the GPU", "device", "tree", "source digest", "date"]  # fmt: skip
    lines = markdown_head(head)
    for s in sorted(summaries, key=lambda s: s["name"]):
        tflops = "–" if s.get("tflops") is None else f"{s['tflops']:.1f}"
        memory = "–" if s.get("max_memory_gb") is None else f"{s['max_memory_gb']:.1f}"
        meta = s.get("meta", {})
        cells = [s["name"], f"{s['step_ms']:.1f}", f"{s['tokens_per_s']:.0f}", tflops,
                 f"{s['wall_s']:.0f}", memory, str(s.get("concurrent_runs", 1)),
                 meta.get("device", "?").removeprefix("cuda: "),
                 str(meta.get("commit", "?"))[:7], meta.get("source", "–"),
                 str(meta.get("date", "?"))[:10]]  # fmt: skip
        lines.append(markdown_row(cells))
    return "\n".join(lines) + "\n"


def _paired_curves(by):
    """{layout: [(label, steps, mean training-loss gap to bf16 over the paired seeds)]}."""
    out = {}
    for (model, lay, pol), seeds in sorted(by.items()):
        base = by.get((model, lay, BASELINE), {})
        if pol == BASELINE:
            continue
        curves = []
        for k, s in seeds.items():
            if k in base:
                b = base[k]["train_loss_curve"]
                curves.append([(p[0], p[1] - q[1]) for p, q in zip(s["train_loss_curve"], b,
                                                                     strict=False)])  # fmt: skip
        if curves:
            n = min(len(c) for c in curves)
            xs = [curves[0][i][0] for i in range(n)]
            ys = [sum(c[i][1] for c in curves) / len(curves) for i in range(n)]
            seeds_note = f", {len(curves)} seed" + ("s" if len(curves) > 1 else "")
            out.setdefault(lay, []).append((f"{model} {pol}{seeds_note}", xs, ys))
    return out


#: The widest gap (%, its interval included) the gap panel draws on a linear axis.
SYMLOG_FROM_PCT = 10.0


def plot(table, summaries, path):
    """The final-loss gaps with their intervals (left), then one panel per layout: the paired
    training-loss gap over training, mean over the seeds each wire shares with bf16."""
    plt = pyplot()
    curves = _paired_curves(_groups(summaries))
    layouts = sorted(curves, key=_layout_rank) or ["tp4"]
    fig, axes = plt.subplots(1, 1 + len(layouts), figsize=(6.5 * (1 + len(layouts)), 5))
    ax_gap = axes[0]
    shown = [r for r in table if r["policy"] != BASELINE and r.get("delta_mean") is not None]
    labels = [f"{r['model']} {r['layout']} {r['policy']}" for r in shown]
    y = range(len(shown))
    ax_gap.errorbar([r["gap_pct"] for r in shown], list(y),
                    xerr=[r.get("gap_ci_pct") or 0 for r in shown], fmt="o", capsize=3)  # fmt: skip
    quotes = [(i, r["preprint_gap_pct"]) for i, r in enumerate(shown) if "preprint_gap_pct" in r]
    if quotes:
        ax_gap.plot([q for _, q in quotes], [i for i, _ in quotes], "x", color="gray",
                    label="preprint (quoted)")  # fmt: skip
        ax_gap.legend(fontsize=8)
    ax_gap.axvline(0, color="black", lw=0.8)
    ax_gap.set_yticks(list(y), labels, fontsize=7)
    extent = max([abs(r["gap_pct"]) + (r.get("gap_ci_pct") or 0) for r in shown]
                 + [abs(q) for _, q in quotes], default=0.0)  # fmt: skip
    # symlog where the gaps span decades (the preprint's +62 % beside tenths of a percent);
    # linear where they do not (symlog's ticks over a narrow range are unreadable)
    ax_gap.set(xlabel="final validation loss gap to bf16, % (95 % CI)",
               xscale="symlog" if extent > SYMLOG_FROM_PCT else "linear")  # fmt: skip
    ax_gap.margins(x=0.08)  # room for the outermost markers (the quoted gaps)
    ax_gap.grid(alpha=0.3)
    colors = plt.get_cmap("tab20").colors  # more wires than the default cycle's ten colours
    for ax, lay in zip(axes[1:], layouts, strict=True):
        for i, (label, xs, ys) in enumerate(curves.get(lay, [])):
            ax.plot(xs, ys, lw=1.2, label=label, color=colors[i % len(colors)])
        ax.axhline(0, color="black", lw=0.8)
        ax.set(xlabel="step", ylabel="training loss minus bf16's (paired, mean over seeds)",
               title=LAYOUTS.get(lay, lay))  # fmt: skip
        ax.grid(alpha=0.3)
        if len(ax.lines) > 1:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", type=Path, nargs="+", help="folders of emulated_tp summaries")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument(
        "--reruns",
        type=Path,
        nargs="+",
        default=[],
        help="folders of runs made again (each named as a run in the folders)",
    )
    args = ap.parse_args(argv)
    if args.out.exists() and not args.out.is_dir():
        ap.error(f"--out {args.out}: exists and is not a folder")
    summaries = load(args.folders)
    if not summaries:
        raise SystemExit(f"no emulated_tp summaries in {', '.join(map(str, args.folders))}")
    table = rows(summaries)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(markdown(table))
    (args.out / "timing.md").write_text(timing_markdown(summaries))
    (args.out / "gaps.md").write_text(gaps_markdown(summaries))
    (args.out / "pairs.md").write_text(pairs_markdown(summaries))
    (args.out / "baselines.md").write_text(baselines_markdown(summaries))
    (args.out / "ranks.md").write_text(ranks_markdown(summaries))
    (args.out / "seeds.md").write_text(seeds_markdown(table))
    if args.reruns:
        reruns = load(args.reruns)
        if not reruns:
            raise SystemExit(f"no emulated_tp summaries in {', '.join(map(str, args.reruns))}")
        (args.out / "reruns.md").write_text(reruns_markdown(summaries, reruns))
    preprint = {
        "source": "FP4Quant preprint (quoted; Qwen 7B, 4-way TP, its data)",
        "bf16": PREPRINT_BF16,
        "rows": {f"{k[0]} {k[1]}": v for k, v in PREPRINT.items()},
    }
    write_json(args.out / "table.json", {"rows": table, "preprint": preprint})
    if not args.no_plot:
        plot(table, summaries, args.out / "curves.png")
    print((args.out / "table.md").read_text())
    return table


if __name__ == "__main__":
    main()
