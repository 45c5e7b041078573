"""fp4_kernels.report: the numbers of `fp4 report` against direct computations, its outputs,
and its errors for paths that are not models."""

import json

import numpy as np
import pytest

import fp4_kernels as fk
from fp4_kernels import report
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
