"""The docs' table and plot of comm_throughput.py results: speedup over NCCL bf16 per link.

    python benchmarks/comm_summary.py --out docs/results/comm_2xh200 \\
        NVLink=benchmarks/results/comm_throughput_2xh200_nvlink_6be8154.json \\
        "P2P off=benchmarks/results/comm_throughput_2xh200_p2p_off_6be8154.json" \\
        "sockets=benchmarks/results/comm_throughput_2xh200_sockets_6be8154.json"

Writes ``<out>.md`` (per link: speedup of each codec over NCCL's bf16 collective, graph-replayed
device time, at every size; then the eager speedup, which includes the host time; then the
SQNR) and ``<out>.png`` (graph speedup against size, one panel per operation, one line style per
link).  Every number comes from the JSON files named; nothing is typed in.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import machine_label  # noqa: E402

OPS = ["all_reduce", "all_gather", "reduce_scatter", "send_recv"]


def load(specs):
    runs = []
    for spec in specs:
        label, _, path = spec.partition("=")
        data = json.loads(Path(path).read_text())
        runs.append((label, Path(path).name, data))
    return runs


def _cells(rows, op, codec, key, sizes, fmt):
    by = {r["size_bytes"]: r for r in rows if r["op"] == op and r["codec"] == codec}
    return [fmt(by[s][key]) if s in by and key in by[s] else "-" for s in sizes]


def table(runs):
    out = []
    for label, name, data in runs:
        meta, rows = data["meta"], data["rows"]
        sizes = sorted({r["size_bytes"] for r in rows})
        codecs = list(dict.fromkeys(r["codec"] for r in rows if r["codec"] != "nccl-bf16"))
        env = ", ".join(f"{k}={v}" for k, v in sorted(meta["nccl_env"].items())) or "default"
        out += [
            f"### {label}",
            "",
            f"{machine_label(meta, '×')}, commit {meta['commit']}, {meta['date']}, "
            f"NCCL env {env}; source `{name}`.",
            "",
        ]
        head = "| op | codec | " + " | ".join(f"{s / 2**20:.0f} MB" for s in sizes) + " |"
        rule = "| --- | --- | " + " | ".join("---:" for _ in sizes) + " |"
        for title, key, fmt in [
            ("Speedup over NCCL bf16, device time (CUDA graph replay)", "speedup_graph",
             lambda v: f"{v:.2f}×"),
            ("Speedup over NCCL bf16, eager calls (host time included)", "speedup_eager",
             lambda v: f"{v:.2f}×"),
        ]:  # fmt: skip
            out += [f"{title}:", "", head, rule]
            for op in OPS:
                for codec in codecs:
                    cells = _cells(rows, op, codec, key, sizes, fmt)
                    if any(c != "-" for c in cells):
                        out.append(f"| {op} | {codec} | " + " | ".join(cells) + " |")
            out.append("")
        base = [_cells(rows, op, "nccl-bf16", "graph_ms", sizes, lambda v: f"{v:.3f}")
                for op in OPS]  # fmt: skip
        out += ["NCCL bf16 itself, ms (graph replay):", "", head.replace("| codec ", ""),
                rule.replace("| --- | --- ", "| --- ")]  # fmt: skip
        for op, cells in zip(OPS, base, strict=True):
            out.append(f"| {op} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out) + "\n"


def plot(runs, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(OPS), figsize=(4 * len(OPS), 3.6), sharey=True)
    styles = ["-", "--", ":"]
    colors = {}
    for (label, _, data), ls in zip(runs, styles, strict=False):
        rows = data["rows"]
        for ax, op in zip(axes, OPS, strict=True):
            for codec in dict.fromkeys(r["codec"] for r in rows):
                if codec == "nccl-bf16":
                    continue
                pts = sorted((r["size_bytes"] / 2**20, r["speedup_graph"]) for r in rows
                             if r["op"] == op and r["codec"] == codec)  # fmt: skip
                if not pts:
                    continue
                color = colors.setdefault(codec, f"C{len(colors)}")
                ax.plot(*zip(*pts, strict=True), ls, color=color, marker=".",
                        label=f"{codec}, {label}")  # fmt: skip
            ax.set_title(op)
            ax.set_xscale("log", base=2)
            ax.axhline(1.0, color="k", lw=0.6)
            ax.set_xlabel("bf16 payload (MB)")
            ax.grid(alpha=0.3)
    axes[0].set_ylabel("speedup over NCCL bf16 (device time)")
    axes[-1].legend(fontsize=6, ncol=1, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="path without suffix")
    ap.add_argument("runs", nargs="+", help="LABEL=comm_throughput JSON file")
    args = ap.parse_args(argv)
    runs = load(args.runs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(table(runs))
    plot(runs, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
