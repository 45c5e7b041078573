"""What every experiment writes: metadata (device, torch, commit, date), JSON, CSV, plots."""

from __future__ import annotations

import csv
import datetime
import json
import math
import os
import platform
import subprocess
from pathlib import Path

import torch


def commit(cwd=None):
    """The commit measured: $FP4_COMMIT first (set by whoever copied the tree to a machine
    where a stale .git can say another commit), else git's HEAD where the command runs."""
    if os.environ.get("FP4_COMMIT"):
        return os.environ["FP4_COMMIT"]
    try:
        return subprocess.check_output(
            ["git", "rev-parse", "--short", "HEAD"], cwd=cwd, text=True, stderr=subprocess.DEVNULL
        ).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def metadata(device, cwd=None):
    """device, torch version, commit (of the checkout at ``cwd``) and UTC date of a run."""
    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu"
    return {
        "device": f"{dev.type}: {name}",
        "torch": torch.__version__,
        "commit": commit(cwd),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def finite_or_none(value):
    """JSON has no inf or NaN: such a value (an exact codec's SQNR) is written as null."""
    return value if value is None or math.isfinite(value) else None


def plain(value):
    """``value`` with paths as strings and tuples as lists (argparse's values, for JSON)."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [plain(x) for x in value]
    return value


def write_json(path, obj):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, allow_nan=False) + "\n")


def write_csv(path, rows):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = list(dict.fromkeys(k for row in rows for k in row))  # every row's keys, in order
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
