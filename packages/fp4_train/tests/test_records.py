"""fp4_train.experiments.records: the source digest a run records says which package code ran;
a record reads the same from its gzip copy, and the committed tables come back from those."""

from __future__ import annotations

import gzip
import importlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp4_train.experiments import records


def _tree(root, files):
    for rel, data in files.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(data)
    return root


def test_digest_follows_every_byte_and_path_but_not_compiled_caches(tmp_path):
    files = {"a.py": b"x = 1\n", "sub/b.py": b"y = 2\n", "data/t.json": b"{}"}
    one = _tree(tmp_path / "one", files)
    two = _tree(tmp_path / "two", files)
    d = records.digest_of([("pkg", one)])
    assert re.fullmatch(r"[0-9a-f]{12}", d)
    assert records.digest_of([("pkg", two)]) == d  # where the tree lies does not count
    _tree(two, {"__pycache__/a.cpython-311.pyc": b"\0\1", "sub/__pycache__/b.nbi": b"\2"})
    assert records.digest_of([("pkg", two)]) == d
    assert records.digest_of([("other", two)]) != d  # the package's name counts
    _tree(two, {"sub/b.py": b"y = 3\n"})
    assert records.digest_of([("pkg", two)]) != d  # one byte
    three = _tree(tmp_path / "three", {"a.py": b"x = 1\n", "sub/c.py": b"y = 2\n",
                                       "data/t.json": b"{}"})  # fmt: skip
    assert records.digest_of([("pkg", three)]) != d  # a renamed file
    four = _tree(tmp_path / "four", {**files, "new.py": b""})
    assert records.digest_of([("pkg", four)]) != d  # an added (even empty) file


def test_metadata_records_the_digest_that_the_command_prints():
    meta = records.metadata("cpu")
    assert meta["source"] == records.source_digest()
    assert set(meta) == {"device", "torch", "commit", "source", "date"}
    # a CPU run names the CPU and the instruction set torch's kernels use (they decide its bits)
    capability = torch.backends.cpu.get_cpu_capability()
    assert meta["device"].startswith("cpu: ") and meta["device"].endswith(f" ({capability})")
    out = subprocess.run([sys.executable, "-m", "fp4_train.experiments.records"],
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert out.stdout.strip() == meta["source"]


def test_commit_is_marked_dirty_where_the_packages_differ_from_head(tmp_path, monkeypatch):
    """A tree copied over an older .git (or edited) records ``<HEAD>-dirty``, not a clean
    commit whose code did not run; other files do not count; FP4_COMMIT overrides."""
    monkeypatch.delenv("FP4_COMMIT", raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # no checkout above counts
    repo = _tree(tmp_path / "repo", {"packages/p/a.py": b"x = 1\n", "docs/d.md": b"d\n"})

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                       check=True, capture_output=True)  # fmt: skip

    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "one")
    head = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=repo, text=True)
    assert records.commit(repo) == head.strip()
    _tree(repo, {"docs/d.md": b"changed\n"})
    assert records.commit(repo / "docs") == head.strip()  # outside packages/: clean
    _tree(repo, {"packages/p/a.py": b"x = 2\n"})
    assert records.commit(repo / "docs") == f"{head.strip()}-dirty"
    git("checkout", "-q", "--", "packages")
    _tree(repo, {"packages/p/new.py": b""})  # an untracked module counts too
    assert records.commit(repo) == f"{head.strip()}-dirty"
    monkeypatch.setenv("FP4_COMMIT", "abc1234")
    assert records.commit(repo) == "abc1234"
    assert records.commit(tmp_path) == "abc1234"
    monkeypatch.delenv("FP4_COMMIT")
    assert records.commit(tmp_path) == "unknown"  # no git checkout there


def test_benchmarks_name_the_commit_by_the_same_rule_without_fp4_train(monkeypatch):
    """The benchmarks' ``commit_id`` (benchmarks/_timing.py) where fp4_train cannot be imported
    (an asv environment) loads ``records.commit`` from the tree's file: the same answer."""
    bench = Path(__file__).resolve().parents[3] / "benchmarks"
    code = ("import sys; sys.modules['fp4_train'] = None; sys.path.insert(0, sys.argv[1]); "
            "import _timing; print(_timing.commit_id())")  # fmt: skip
    for marker in (None, "abc1234"):
        if marker is None:
            monkeypatch.delenv("FP4_COMMIT", raising=False)
        else:
            monkeypatch.setenv("FP4_COMMIT", marker)
        out = subprocess.run([sys.executable, "-c", code, str(bench)], capture_output=True,
                             text=True, check=True)  # fmt: skip
        assert out.stdout.strip() == records.commit(bench) == (marker or records.commit(bench))


# ------------------------------------------------------------------ record files


def test_a_record_reads_the_same_from_its_gzip_copy(tmp_path):
    """``<name>.json.gz`` (``gzip -9n``) reads as ``<name>.json``; a truncated one is named, not
    an EOFError."""
    record = {"name": "a", "steps": [{"loss": 2.5}], "loss": float("nan")}
    records.write_json(tmp_path / "a.json", record)
    data = (tmp_path / "a.json").read_bytes()
    (tmp_path / "b.json.gz").write_bytes(gzip.compress(data, mtime=0))
    assert records.read_record(tmp_path / "b.json.gz") == records.read_record(tmp_path / "a.json")
    (tmp_path / "c.json.gz").write_bytes(gzip.compress(data, mtime=0)[:-12])
    with pytest.raises(SystemExit, match=r"c.json.gz: not a readable JSON record"):
        records.read_record(tmp_path / "c.json.gz")
    (tmp_path / "d.json.gz").write_bytes(data)  # not gzip
    with pytest.raises(SystemExit, match=r"d.json.gz: not a readable JSON record"):
        records.read_record(tmp_path / "d.json.gz")


def test_record_paths_take_both_forms_and_refuse_one_run_twice(tmp_path):
    for name in ("b.json", "a.json.gz", "c.json", "c.csv", "d.json.xz"):
        (tmp_path / name).write_text("{}")
    assert [p.name for p in records.record_paths(tmp_path)] == ["a.json.gz", "b.json", "c.json"]
    assert [records.record_name(tmp_path / n) for n in ("a.json.gz", "c.json", "c.csv")] == [
        "a", "c", None]  # fmt: skip
    assert records.find_record(tmp_path, "a").name == "a.json.gz"
    assert records.find_record(tmp_path, "d") is None
    (tmp_path / "b.json.gz").write_text("{}")
    with pytest.raises(SystemExit, match=r"b.json and .*b.json.gz: one record twice"):
        records.record_paths(tmp_path)


REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    ("folder", "tool", "tables"),
    [
        ("tp_boundary_cpu", "boundary_study", ("boundary.md", "boundary.csv", "boundary.json")),
        ("tp_h200", "tp_summary", ("summary.md", "summary.csv", "speed.md", "speed.csv")),
        ("tp_cpu_smoke", "tp_summary", ("summary.md", "summary.csv")),
    ],
)
def test_committed_tables_regenerate_from_their_compressed_records(tmp_path, folder, tool, tables):
    """The committed folders keep their runs as ``<name>.json.gz``: the tables built from those
    are the committed tables, byte for byte."""
    source = REPO / "docs" / "results" / folder
    assert list(source.glob("*.json.gz")) and not list(source.glob("*_s[0-9].json"))
    copy = shutil.copytree(source, tmp_path / folder)
    for name in tables:
        (copy / name).unlink()
    module = importlib.import_module(f"fp4_train.experiments.{tool}")
    module.main(["--out", str(copy)] if tool == "boundary_study" else [str(copy)])
    for name in tables:
        assert (copy / name).read_bytes() == (source / name).read_bytes(), name


def test_a_table_footnote_names_every_device_torch_and_commit_of_its_runs():
    """A folder whose runs came from two machines says both, where the first run's alone was
    said before (section 1's rerun records: 'cpu: AMD EPYC (AVX512)' beside 'cpu: cpu')."""
    runs = [{"meta": {"device": "cpu: b", "commit": "2"}}, {"meta": {"device": "cpu: a"}},
            {"meta": {"device": "cpu: b", "commit": "1"}}, {}]  # fmt: skip
    assert records.meta_values(runs, "device") == "?, cpu: a, cpu: b"
    assert records.meta_values(runs, "commit") == "1, 2, ?"
    folder = REPO / "docs" / "results" / "tp_boundary_cpu"
    table = (folder / "boundary.md").read_text()
    devices = {records.read_record(p)["meta"]["device"] for p in folder.glob("*.json.gz")}
    assert len(devices) > 1 and f"Device: {', '.join(sorted(devices))};" in table
