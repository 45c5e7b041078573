"""What every experiment script shares: arguments, metadata, writing JSON / CSV / PNG."""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import tempfile
from pathlib import Path

import torch

from fp4_train.experiments import records

REPO = Path(__file__).resolve().parents[3]
# Outside the repository: a rerun does not rewrite the committed results unless asked to
# (`--out docs/results`).
DEFAULT_OUT = Path(tempfile.gettempdir()) / "fp4_train_results"
COMMITTED_OUT = "docs/results"


def parse_args(doc, **extra):
    # One torch thread: the FP4 codec's numba CPU path has threads of its own, and on a small
    # machine torch's OpenMP pool competing with them made these runs 3x slower.
    torch.set_num_threads(1)
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help=f"output folder (default: %(default)s; --out {COMMITTED_OUT} from the repository "
        "root rewrites the committed results)",
    )
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cpu or cuda")
    for name, (kind, default, help_text) in extra.items():
        ap.add_argument(f"--{name}", type=kind, default=default, help=help_text)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    where = records.unusable_path(args.out)
    if where:
        ap.error(f"--out {args.out}: {where}")
    return args


def metadata(device):
    return records.metadata(device, cwd=REPO)


def write_json(path, obj):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2) + "\n")


def write_csv(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


pyplot = records.pyplot


@contextlib.contextmanager
def figure(path, *args, **kw):
    """``pyplot.subplots(*args, **kw)``'s (fig, axes), written to ``path`` when the block ends:
    every script's figures alike (laid out, 120 dpi, closed)."""
    plt = pyplot()
    fig, axes = plt.subplots(*args, **kw)
    try:
        yield fig, axes
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)


def progress(iterable, **kw):
    """A progress bar where tqdm is installed (the [examples] extra), the bare iterable else."""
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, mininterval=1.0, **kw)


def markdown_table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
