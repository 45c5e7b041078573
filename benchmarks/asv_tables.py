"""Markdown tables of committed asv results, one column per commit (oldest first), for the docs.

    python benchmarks/asv_tables.py [--machine h200] [--out docs/results/asv_h200.md]
    python benchmarks/asv_tables.py --check docs/results/asv_h200.md   # nox -s bench_site

Reads `.asv/results/<machine>/` and `.asv/results/benchmarks.json` (what `asv publish` reads),
orders the commits by `git log` (the oldest first; commits git does not know go last), and
writes one table per benchmark named in TABLES: a row per parameter combination, n/a where a
commit has no figure (skipped, failed or not run).
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# benchmark -> number format: the ratios to the same-run baselines, which the docs discuss
TABLES = {
    "bench_quantize.QuantizeGPU.track_ratio_to_copy": "{:.2f}",
    "bench_quantize.QuantizeDequantizeGPU.track_ratio_to_copy": "{:.2f}",
    "bench_dequantize.DequantizeGPU.track_ratio_to_copy": "{:.2f}",
    "bench_hadamard.HadamardGPU.track_ratio_to_copy": "{:.2f}",
    "bench_hadamard.FP4QuantEncodeGPU.track_ratio_to_copy": "{:.2f}",
    "bench_hadamard.FP4QuantDecodeGPU.track_ratio_to_copy": "{:.2f}",
    "bench_hadamard.FP4QuantStochasticEncodeGPU.track_ratio_to_copy": "{:.2f}",
    "bench_quantize.QuantizeAmaxGivenGPU.track_ratio_to_copy": "{:.2f}",
    "bench_gemm.FP4GemmGPU.track_ratio_to_bf16_gemm": "{:.2f}",
    "bench_comm.Collectives.track_speedup_over_nccl_bf16": "{:.2f}",
}


def _order(hashes):
    log = subprocess.run(["git", "log", "--format=%H", "--all"], cwd=ROOT, capture_output=True,
                         text=True).stdout.split()  # fmt: skip
    rank = {h: i for i, h in enumerate(reversed(log))}
    return sorted(hashes, key=lambda h: rank.get(h, len(rank)))


def tables(machine):
    results = {}
    for f in sorted((ROOT / ".asv" / "results" / machine).glob("*.json")):
        if f.name == "machine.json":
            continue
        d = json.loads(f.read_text())
        results[d["commit_hash"]] = d["results"]
    meta = json.loads((ROOT / ".asv" / "results" / "benchmarks.json").read_text())
    commits = _order(results)
    lines = []
    for name, fmt in TABLES.items():
        stored = [results[c].get(name) for c in commits]
        # a commit's values keyed by parameter combination: a benchmark whose parameter lists
        # grew (a group size appended) keeps the older commits' figures in their rows
        by_combo = [
            dict(zip(itertools.product(*s[1]), s[0] or [], strict=False)) if s else {}
            for s in stored
        ]
        params = next((s[1] for s in reversed(stored) if s), None)  # the newest commit's rows
        if params is None:
            continue
        b = meta[name]
        lines += [f"**{name}** ({b.get('unit')}; {', '.join(b['param_names'])})", ""]
        lines.append("| " + " | ".join(["parameters", *(c[:7] for c in commits)]) + " |")
        lines.append("|---|" + "---:|" * len(commits))
        for combo in itertools.product(*params):
            cells = []
            for values in by_combo:
                v = values.get(combo)
                cells.append("n/a" if v is None or v != v else fmt.format(v))
            label = ", ".join(str(p).strip("'") for p in combo)
            lines.append("| " + " | ".join([label, *cells]) + " |")
        lines.append("")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--machine", default="h200")
    ap.add_argument("--out", default=None, help="Markdown file (default: stdout)")
    ap.add_argument("--check", default=None, metavar="FILE",
                    help="fail unless FILE holds exactly these tables")  # fmt: skip
    args = ap.parse_args(argv)
    text = "\n".join(tables(args.machine))
    if args.check:
        if Path(args.check).read_text() != text:
            raise SystemExit(f"{args.check} is not the tables of .asv/results/{args.machine}: "
                             f"python benchmarks/asv_tables.py --out {args.check}")  # fmt: skip
        print(f"{args.check}: matches .asv/results/{args.machine}")
    elif args.out:
        Path(args.out).write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
