"""What every experiment writes: metadata (device, torch, commit, source digest, date), JSON,
CSV, plots.

    python -m fp4_train.experiments.records

prints the source digest of the installed packages (``source_digest``): at a commit, the value
a run of that commit's code records, whatever git said on the machine that ran it."""

from __future__ import annotations

import csv
import datetime
import gzip
import hashlib
import importlib
import json
import math
import os
import re
import subprocess
import zlib
from pathlib import Path

import torch

from fp4_kernels.experiments import cpu_model


def commit(cwd=None):
    """The commit measured: $FP4_COMMIT first (set by whoever copied the tree to a machine
    where a stale .git can say another commit), else git's HEAD where the command runs, with
    ``-dirty`` after it where the checkout's ``packages/`` differ from it (uncommitted
    changes, or a tree copied over an older .git): then the source digest says which code
    ran."""
    if os.environ.get("FP4_COMMIT"):
        return os.environ["FP4_COMMIT"]

    def git(*args):
        return subprocess.check_output(
            ["git", *args], cwd=cwd, text=True, stderr=subprocess.DEVNULL
        ).strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    try:  # (":/": from the top of the work tree, wherever cwd is in it)
        dirty = bool(git("status", "--porcelain", "--", ":/packages"))
    except (OSError, subprocess.CalledProcessError):
        dirty = False
    return f"{head}-dirty" if dirty else head


#: A run name's seed suffix ("..._s3"), after its configuration's name.
SEED_SUFFIX = re.compile(r"_s(\d+)$")


def run_stem(name):
    """``name`` without its seed suffix: the name its configuration's runs of every seed
    share."""
    return SEED_SUFFIX.sub("", name)


#: The packages whose code a run executes, hashed by ``source_digest``.
PACKAGES = ("fp4_kernels", "fp4_comm", "fp4_train")


def digest_of(roots):
    """The first 12 hex digits of the sha256 of every file below each ``(name, folder)`` of
    ``roots`` (compiled caches left out), in a fixed order, each with its path."""
    h = hashlib.sha256()
    for name, root in roots:
        root = Path(root)
        files = (f for f in root.rglob("*") if f.is_file() and "__pycache__" not in f.parts)
        for f in sorted(files, key=lambda f: f.relative_to(root).as_posix()):
            h.update(f"{name}/{f.relative_to(root).as_posix()}\0".encode())
            h.update(f.read_bytes())
            h.update(b"\0")
    return h.hexdigest()[:12]


def source_digest():
    """``digest_of`` the imported packages of ``PACKAGES`` (their source folders as Python
    finds them): which code ran, independent of git. Two runs with the same digest ran the same
    package code; ``python -m fp4_train.experiments.records`` at a commit gives that commit's."""
    roots = [(n, Path(importlib.import_module(n).__file__).parent) for n in PACKAGES]
    return digest_of(roots)


def cpu_name():
    """The CPU's model name (``fp4_kernels.experiments.cpu_model``) and the instruction set
    torch's CPU kernels dispatch to (``torch.backends.cpu.get_cpu_capability``), e.g.
    "AMD EPYC (AVX512)": CPU runs of the same code and seed give the same bits on the same kind
    of CPU, and other bits (another run) where either differs."""
    return f"{cpu_model() or 'cpu'} ({torch.backends.cpu.get_cpu_capability()})"


def metadata(device, cwd=None):
    """device (a GPU's name; for the CPU, ``cpu_name``), torch version, commit (of the
    checkout at ``cwd``), source digest of the packages (``source_digest``) and UTC date of a
    run."""
    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_name()
    return {
        "device": f"{dev.type}: {name}",
        "torch": torch.__version__,
        "commit": commit(cwd),
        "source": source_digest(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def meta_values(records, key):
    """The distinct values of ``meta[key]`` over ``records`` (``"?"`` where a record lacks it),
    sorted and joined by ", ": a results table's footnote names every device, torch version
    and commit its runs had, not the first run's."""
    return ", ".join(sorted({str(r.get("meta", {}).get(key, "?")) for r in records}))


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
    """``obj`` as strict JSON at ``path``: a float that is not finite (a diverged run's loss)
    is written as null, so that the record of such a run is kept, not lost in a ValueError."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite_or_null(obj), indent=1, allow_nan=False) + "\n")


def unusable_path(path, folder=True):
    """Why ``path`` (a folder to write into, or a file when not ``folder``; None: not given)
    cannot be made, or None: checked before a run rather than at its end."""
    if path is None:
        return None
    path = Path(path)
    if path.exists() and folder and not path.is_dir():
        return "exists and is not a folder"
    parent = path.absolute().parent
    while not parent.exists():
        if parent.is_symlink():
            return f"{parent} is a broken link"
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is not a folder"
    return None


#: A record's file: JSON, or JSON compressed with gzip, which is how a results folder keeps
#: its runs' per-step records small (``gzip -9n <name>.json``; ``gunzip -k`` gives it back).
RECORD_SUFFIXES = (".json", ".json.gz")


def record_name(path):
    """``<name>`` of a record file ``<name>.json`` or ``<name>.json.gz``; None for another."""
    file = Path(path).name
    suffix = next((s for s in RECORD_SUFFIXES if file.endswith(s)), None)
    return None if suffix is None else file[: -len(suffix)]


def record_paths(folder):
    """The record files in ``folder`` (``<name>.json`` and ``<name>.json.gz``), by name;
    SystemExit where one name has both (which of the two is the record is not for a reader to
    guess)."""
    paths = {}
    for suffix in RECORD_SUFFIXES:
        for path in Path(folder).glob(f"*{suffix}"):
            name = record_name(path)
            if name in paths:
                raise SystemExit(f"{paths[name]} and {path}: one record twice; remove one")
            paths[name] = path
    return [paths[name] for name in sorted(paths)]


def find_record(folder, name):
    """``folder``'s record of the run ``name`` (either suffix), or None."""
    found = [p for p in (Path(folder) / f"{name}{s}" for s in RECORD_SUFFIXES) if p.exists()]
    return found[0] if found else None


#: What ``load_record`` raises for a file it cannot read (a truncated or binary file, a
#: folder named *.json, a gzip copy cut short).
UNREADABLE = (OSError, EOFError, zlib.error, UnicodeDecodeError, json.JSONDecodeError)


def load_record(path):
    """The JSON value in ``path`` (gzip-compressed where it ends in ``.gz``); one of
    ``UNREADABLE`` where it cannot be read."""
    path = Path(path)
    data = path.read_bytes()
    if path.name.endswith(".gz"):
        data = gzip.decompress(data)
    return json.loads(data.decode())


def read_record(path):
    """``load_record(path)``; SystemExit naming the file where it cannot be read."""
    try:
        return load_record(path)
    except UNREADABLE as err:
        raise SystemExit(f"{path}: not a readable JSON record ({err})") from None


def _finite_or_null(obj):
    if isinstance(obj, float):
        return finite_or_none(obj)
    if isinstance(obj, dict):
        return {k: _finite_or_null(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_or_null(v) for v in obj]
    return obj


def write_csv(path, rows):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = list(dict.fromkeys(k for row in rows for k in row))  # every row's keys, in order
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)


def markdown_head(head, right=()):
    """The first two lines of a markdown table: the column names ``head`` and the rule under
    them (``---:``, right-aligned, for the column indices in ``right``)."""
    rule = "|" + "".join("---:|" if i in right else "---|" for i in range(len(head)))
    return [markdown_row(head), rule]


def markdown_row(cells):
    """One line of a markdown table: ``cells``, strings."""
    return "| " + " | ".join(cells) + " |"


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


if __name__ == "__main__":
    print(source_digest())
