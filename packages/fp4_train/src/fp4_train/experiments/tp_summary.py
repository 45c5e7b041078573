"""The table and loss curves of a folder of tp_train runs.

    python -m fp4_train.experiments.tp_summary docs/results/tp_cpu_smoke

Reads every ``<name>.json`` (or ``<name>.json.gz``) there and writes ``summary.md`` (a Markdown
table), ``summary.csv`` and ``loss.png`` (validation loss against step; training loss,
smoothed, beside it).  Speedup is relative to the mean of the bf16 runs (codec "none") of the
same parallel layout, the loss gap to the bf16 run of the same seed (same initialization and
batches); the spread of the bf16 runs over seeds is the seed noise.

Where the folder has GPU runs and one of torch.distributed's own all-reduce (codec "native":
NCCL's bf16), also ``speed.md`` / ``speed.csv``, the speed the way the FP4Quant preprint reports
it: model TFLOP/s per GPU and MFU (``transformer.training_flops``, the GPU's dense bf16 peak),
step and communication ms, speedup against NCCL bf16, the Amdahl bound (the speedup if
communication were free: native step / (native step - native communication)) and the
fraction of it reached ((speedup - 1) / (bound - 1)); eager and CUDA-graph runs are compared
with the native run of the same execution, and the preprint's figures close the table.
Communication ms are CUDA events around each call on the compute stream: for tensor
parallelism all of it is exposed (nothing overlaps it); in the pipeline a receive's time
includes waiting for the other stage (the bubble).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .records import (
    markdown_head,
    markdown_row,
    meta_values,
    pyplot,
    read_record,
    record_paths,
    write_csv,
)
from .transformer import training_flops

SMOOTH = 20  # training-loss moving average, steps
# table order: references first, then by format and group size
CODEC_ORDER = ["native", "bf16", "fp32", "nvfp4", "mxfp4"] + [
    f"fp4quant-g{g}{had}" for g in (64, 256, 512) for had in ("", "-nohad")
]


#: what the tables read of a tp_train record (besides its summary and steps)
_FIELDS = ("name", "codec", "config", "evals", "world_size")


def load(folder):
    """The tp_train records in ``folder`` (JSON with a summary and steps; other JSON is not
    one); SystemExit naming the file for one without a field the tables read."""
    runs = []
    for path in record_paths(folder):
        record = read_record(path)
        if isinstance(record, dict) and "summary" in record and "steps" in record:
            missing = [k for k in _FIELDS if k not in record]
            config = record.get("config", {})
            if not (isinstance(config, dict) and "parallel" in config):
                missing.append("config.parallel")
            if missing:
                raise SystemExit(f"{path}: a tp_train record without {', '.join(missing)}; "
                                 "move it out to summarize the others")  # fmt: skip
            runs.append(record)

    def order(r):
        codec = r["codec"]
        return (layout(r), CODEC_ORDER.index(codec) if codec in CODEC_ORDER else 99, r["name"])

    return sorted(runs, key=order)


def layout(record):
    c = record["config"]
    return c["parallel"] + ("-sp" if c.get("sequence_parallel") else "")


def rows_of(runs):
    rows = []
    for r in runs:
        base = [b for b in runs if b["codec"] == "bf16" and layout(b) == layout(r)]
        s = r["summary"]
        c = r["config"]
        row = {
            "run": r["name"],
            "layout": layout(r),
            "codec": r["codec"],
            "rounding": c["rounding"] if not c["codec"].startswith("none") else "-",
            "error_feedback": "yes" if c.get("error_feedback") else "no",
            "seed": c["seed"],
            "tokens_per_s_per_rank": round(s["tokens_per_s_per_rank"]),
            "speedup_vs_bf16": None,
            "comm_share": round(s["comm_share"], 3),
            "final_val_loss": round(s["final_val_loss"], 4),
            "val_loss_minus_bf16": None,
            "train_loss_minus_bf16_last_fifth": None,
            "final_val_ppl": round(s["final_val_ppl"], 2),
        }
        if base:
            tps = sum(b["summary"]["tokens_per_s_per_rank"] for b in base) / len(base)
            row["speedup_vs_bf16"] = round(s["tokens_per_s_per_rank"] / tps, 3)
            # paired: the bf16 run with the same seed (same initialization and batches)
            paired = [b for b in base if b["config"]["seed"] == c["seed"]] or base
            loss = sum(b["summary"]["final_val_loss"] for b in paired) / len(paired)
            row["val_loss_minus_bf16"] = round(s["final_val_loss"] - loss, 4)
            if len(paired) == 1 and paired[0] is not r:
                gap = late_gap(r, paired[0])
                row["train_loss_minus_bf16_last_fifth"] = None if gap is None else round(gap, 4)
        rows.append(row)
    return rows


def _signed(v):
    return "-" if v is None else f"{v:+.4f}"


def late_gap(run, base):
    """Mean over the last fifth of the steps of the paired training-loss difference (the same
    batches at every step): where one validation loss is noisy, many steps are not."""
    return tail_gap([s["loss"] for s in run["steps"]], [s["loss"] for s in base["steps"]])


def tail_gap(a, b):
    """Mean of ``a[i] - b[i]`` over the last fifth of the points both lists have (at least
    the last one), or None where either is empty: two runs' training losses, paired point by
    point."""
    n = min(len(a), len(b))
    if n == 0:
        return None
    tail = range(n - max(1, n // 5), n)  # (at least the last step of a short run)
    return sum(a[i] - b[i] for i in tail) / len(tail)


def markdown(rows, runs):
    head = ["run", "tokens/s per rank", "speedup vs bf16", "comm share", "val loss",
            "Δ vs bf16 same seed", "Δ train loss, last fifth", "val ppl"]  # fmt: skip
    lines = markdown_head(head)
    for r in rows:
        cells = [f"`{r['run']}`", str(r["tokens_per_s_per_rank"]),
                 f"{r['speedup_vs_bf16']:.2f}×" if r["speedup_vs_bf16"] is not None else "-",
                 f"{100 * r['comm_share']:.0f} %", f"{r['final_val_loss']:.4f}",
                 f"{r['val_loss_minus_bf16']:+.4f}" if r["val_loss_minus_bf16"] is not None
                 else "-", _signed(r["train_loss_minus_bf16_last_fifth"]),
                 f"{r['final_val_ppl']:.2f}"]  # fmt: skip
        lines.append(markdown_row(cells))
    cfg = runs[0]["config"]
    dates = sorted(r.get("meta", {}).get("date", "?") for r in runs)
    lines += [
        "",
        f"Model: {cfg['layers']} layers, d_model {cfg['d_model']}, {cfg['heads']} heads, "
        f"sequence {cfg['seq_len']}, batch {cfg['batch']}, {cfg['steps']} steps, "
        f"{runs[0]['world_size']} ranks. Device: {meta_values(runs, 'device')}; torch "
        f"{meta_values(runs, 'torch')}; commits {meta_values(runs, 'commit')}; "
        f"{dates[0]} to {dates[-1]}.",
    ]
    return "\n".join(lines) + "\n"


def plot(runs, path):
    plt = pyplot()
    fig, (ax_val, ax_train) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in runs:
        style = "-" if r["codec"] != "bf16" else "--"
        lw = 2.2 if r["codec"] == "bf16" else 1.3
        ev = r["evals"]
        ax_val.plot([e["step"] for e in ev], [e["val_loss"] for e in ev], style, lw=lw,
                    marker="o", ms=3, label=r["name"])  # fmt: skip
        loss = [s["loss"] for s in r["steps"]]
        k = min(SMOOTH, len(loss))
        smooth = [sum(loss[i : i + k]) / k for i in range(len(loss) - k + 1)]
        ax_train.plot(range(k, len(loss) + 1), smooth, style, lw=lw, label=r["name"])
    ax_val.set(xlabel="step", ylabel="validation loss (nats/byte)", title="validation")
    ax_train.set(xlabel="step", ylabel=f"training loss, {SMOOTH}-step mean", title="training")
    for ax in (ax_val, ax_train):
        ax.grid(alpha=0.3)
    last = min(e["val_loss"] for r in runs for e in r["evals"])
    ax_val.set_ylim(last - 0.1, last + 1.0)
    ax_val.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# The FP4Quant preprint's tensor-parallel figures (7B model, 4-way TP on H100s): speedup
# against the bf16 baseline and its bf16 throughput.
PAPER = [("FP4Quant preprint, g = 64 (7B, TP 4, H100)", 64, 1.40),
         ("FP4Quant preprint, g = 256 (7B, TP 4, H100)", 256, 1.56)]  # fmt: skip
PAPER_BF16_TFLOPS = 111  # per GPU, about 11 % of the H100's dense bf16 peak
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4}  # dense, NVIDIA's data sheets


def speed_rows(runs):
    """The speed table's rows, or [] without a native run (GPU runs only: on the CPU the
    codec's CPU path and gloo's latency say nothing about the GPUs)."""
    rows = []
    for r in runs:
        if not r.get("meta", {}).get("device", "").startswith("cuda"):
            continue
        c, s = r["config"], r["summary"]
        graph = bool(c.get("cuda_graph"))
        native = [n for n in runs if n["codec"] == "native" and layout(n) == layout(r)
                  and bool(n["config"].get("cuda_graph")) == graph]  # fmt: skip
        if not native:
            continue
        n = native[0]["summary"]
        tokens = c["batch"] * c["seq_len"]
        tflops = training_flops(c["layers"], c["d_model"], c["seq_len"], tokens) / 1e12
        per_gpu = tflops / r["world_size"] / (s["step_ms"] / 1e3)
        device = r.get("meta", {}).get("device", "")
        peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in device), None)
        speedup = n["step_ms"] / s["step_ms"]
        bound = n["step_ms"] / (n["step_ms"] - n["comm_ms"])
        rows.append({
            "run": r["name"], "execution": "graph" if graph else "eager",
            "step_ms": round(s["step_ms"], 2), "comm_ms": round(s["comm_ms"], 2),
            "tflops_per_gpu": round(per_gpu, 1),
            "mfu": None if peak is None else round(per_gpu / peak, 3),
            "speedup_vs_nccl_bf16": round(speedup, 3), "amdahl_bound": round(bound, 3),
            "fraction_of_bound": round((speedup - 1) / (bound - 1), 3) if bound > 1 else None,
        })  # fmt: skip
    return rows


def speed_markdown(rows):
    head = ["run", "execution", "step ms", "comm ms", "TFLOP/s per GPU", "MFU",
            "speedup vs NCCL bf16", "Amdahl bound", "fraction of bound"]  # fmt: skip
    lines = markdown_head(head)
    for r in rows:
        mfu, frac = r["mfu"], r["fraction_of_bound"]
        cells = [f"`{r['run']}`", r["execution"], f"{r['step_ms']:.1f}", f"{r['comm_ms']:.1f}",
                 f"{r['tflops_per_gpu']:.0f}", "-" if mfu is None else f"{100 * mfu:.0f} %",
                 f"{r['speedup_vs_nccl_bf16']:.3f}×", f"{r['amdahl_bound']:.2f}×",
                 "-" if frac is None else f"{100 * frac:.0f} %"]  # fmt: skip
        lines.append(markdown_row(cells))
    for name, g, speedup in PAPER:
        # FP4Quant moves (4 + 16/g) / 16 of bf16's bytes: a speedup s needs a share c of the
        # bf16 step in exposed communication with 1 / (1 - c (1 - bytes ratio)) >= s
        need = (1 - 1 / speedup) / (1 - (4 + 16 / g) / 16)
        lines.append(f"| {name} | - | - | - | {PAPER_BF16_TFLOPS} (bf16) | ~11 % | "
                     f"{speedup:.2f}× | - | needs ≥ {100 * need:.0f} % of the bf16 step in "
                     "exposed communication |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    folder = ap.parse_args(argv).folder
    runs = load(folder)
    if not runs:
        raise SystemExit(f"{folder}: no tp_train records")
    rows = rows_of(runs)
    write_csv(folder / "summary.csv", rows)
    table = markdown(rows, runs)
    (folder / "summary.md").write_text(table)
    plot(runs, folder / "loss.png")
    print(table)
    speed = speed_rows(runs)
    if speed:
        write_csv(folder / "speed.csv", speed)
        (folder / "speed.md").write_text(speed_markdown(speed))
        print(speed_markdown(speed))


if __name__ == "__main__":
    main()
