"""fp4_kernels.report: the numbers of `fp4 report` against direct computations, its outputs,
and its errors for paths that are not models."""

import json
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import REAL_GPU

import fp4_kernels as fk
from fp4_kernels import _throughput, report
from fp4_kernels.formats import e2m1

safetensors_numpy = pytest.importorskip("safetensors.numpy")


def _model(path, rng, k=64, extra=None):
    tensors = {
        "layer.0.dense.weight": (rng.standard_normal((8, k)) * 0.05).astype(np.float32),
        "layer.0.dense.bias": np.zeros(8, np.float32),
        "layer.0.LayerNorm.weight": np.ones(k, np.float32),
        "embeddings.word_embeddings.weight": rng.standard_normal((10, k)).astype(np.float32),
    }
    tensors.update(extra or {})
    safetensors_numpy.save_file(tensors, str(path))
    return tensors


def test_numbers_match_direct_computation(tmp_path, rng):
    t = _model(tmp_path / "m.safetensors", rng)
    w = t["layer.0.dense.weight"]
    r = report.run_report(tmp_path / "m.safetensors", progress=False)
    assert r["matrices_count"] == 1 and r["linear_elements"] == w.size
    q = fk.quantize_dequantize(w, fmt="nvfp4")
    nv = r["summary"]["nvfp4"]
    rel = np.abs(w.astype(np.float64) - q).mean() / np.abs(w.astype(np.float64)).mean()
    assert nv["rel_error"] == pytest.approx(rel, rel=1e-12)
    assert nv["zero_fraction"] == np.mean(q == 0)
    assert nv["bits_per_weight"] == 4.5 + 32 / w.size
    assert r["summary"]["mxfp4"]["bits_per_weight"] == 4.25
    raw = e2m1.decode_e2m1(e2m1.encode_e2m1(w))
    assert r["summary"]["e2m1"]["zero_fraction"] == np.mean(raw == 0)
    amax = np.abs(w).max()
    per_tensor = e2m1.decode_e2m1(e2m1.encode_e2m1(w / (amax / np.float32(6)))) * (amax / 6)
    rel_t = np.abs(w - per_tensor).mean() / np.abs(w).mean()
    assert r["summary"]["e2m1/tensor"]["rel_error"] == pytest.approx(rel_t, rel=1e-5)
    # the embedding table and the other tensors stay as stored
    assert r["other_bytes"] == sum(v.nbytes for k, v in t.items() if k != "layer.0.dense.weight")
    assert nv["model_bytes"] == nv["linear_bytes"] + r["other_bytes"]


def test_embeddings_on_request_and_directories(tmp_path, rng):
    _model(tmp_path / "a.safetensors", rng)
    _model(
        tmp_path / "b.safetensors",
        rng,
        extra={"layer.1.out.weight": rng.standard_normal((4, 32)).astype(np.float32)},
    )
    r = report.run_report(tmp_path, progress=False, include_embeddings=True)
    names = {m["name"] for m in r["matrices"]}
    assert names == {
        "layer.0.dense.weight",
        "layer.1.out.weight",
        "embeddings.word_embeddings.weight",
    }


def test_block_formats_pad_a_ragged_last_dimension(tmp_path, rng):
    _model(tmp_path / "m.safetensors", rng, k=48)  # 48: three NVFP4 blocks, 1.5 MXFP4 blocks
    r = report.run_report(tmp_path / "m.safetensors", progress=False)
    mx = r["matrices"][0]["formats"]["mxfp4"]
    assert mx["bytes"] == 8 * 64 / 2 + 8 * 2  # padded to 64 columns: codes + 2 scales a row
    assert 0 < mx["rel_error"] < 0.3


def test_cli_writes_json_csv_png(tmp_path, rng, capsys):
    _model(tmp_path / "m.safetensors", rng)
    out = tmp_path / "out"
    assert (
        report.main(["report", str(tmp_path / "m.safetensors"), "--out", str(out), "--no-progress"])
        == 0
    )
    printed = capsys.readouterr().out
    assert "nvfp4" in printed and "rel. error" in printed
    data = json.loads((out / "report.json").read_text())
    assert set(data["summary"]) == set(report.REPORT_FORMATS)
    assert len((out / "report.csv").read_text().splitlines()) == 1 + len(report.REPORT_FORMATS)
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_help_and_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        report.main(["report", "--help"])
    assert e.value.code == 0 and "safetensors" in capsys.readouterr().out
    assert report.main(["report", str(tmp_path / "missing")]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    (tmp_path / "notes.txt").write_text("not a model")
    assert report.main(["report", str(tmp_path / "notes.txt")]) == 2
    assert "not a readable safetensors model" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert report.main(["report", str(tmp_path / "empty")]) == 2
    assert "no .safetensors file" in capsys.readouterr().err
    safetensors_numpy.save_file(
        {"norm.weight": np.ones(4, np.float32)}, str(tmp_path / "nolinear.safetensors")
    )
    assert report.main(["report", str(tmp_path / "nolinear.safetensors")]) == 2
    assert "no linear weight matrix" in capsys.readouterr().err
    assert report.main(["report", "--formats", "fp8", str(tmp_path)]) == 2


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
    from fp4_kernels.cuda import launch
    launch.launch_override = (64, 2)  # as the tests' `kernels` fixture: small simulated grids
    from fp4_kernels import _throughput as t
    refused = t.unavailable_reason()
    try:
        t.measure_throughput(256)
        raised = False
    except t.ThroughputUnavailable:
        raised = True
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
