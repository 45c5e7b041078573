"""fp4_kernels.experiments.error_study: the properties its numbers must have, on its --quick
data, and its outputs (the JSON schema, the CSV, the table the docs include, the plot); the
example script is its command line."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fp4_kernels.formats import fp4quant

pytest.importorskip("matplotlib")

from fp4_kernels.experiments import error_study as es  # noqa: E402 - after the skip

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "error_study.py"
SYNTHETIC = ("gaussian", "heavy_tailed", "activations")


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """The --quick study on the synthetic datasets (the model wheel is not a test dependency)."""
    out = tmp_path_factory.mktemp("error_study")
    result = es.run_study(quick=True, datasets=SYNTHETIC, commit="0000000")
    es.write_outputs(result, out)
    return result, out


def _row(result, dataset, fmt, transform, g):
    hits = [
        r
        for r in result["rows"]
        if (r["dataset"], r["format"], r["transform"], r["group_size"])
        == (dataset, fmt, transform, g)
    ]
    assert len(hits) == 1, (dataset, fmt, transform, g)
    return hits[0]


def _rel_mse(x, q):
    x = x.astype(np.float64)
    return float(((x - q.astype(np.float64)) ** 2).sum() / (x**2).sum())


# ---------------------------------------------------------------------- the numbers


def test_gaussian_fp4quant_g16_within_e2m1_spacing(quick):
    """Without the transform, element i of a group is y_i = x_i / s on the e2m1 grid, s the bf16
    scale amax/6 rounded up (|y_i| <= 6, nothing clips).  Its error is at most half the grid
    spacing around it times s (spacing 0.5 below 2, 1 up to 4, 2 up to 6): a hard bound.  For
    Gaussian data the error of the other elements is close to uniform over the spacing
    (spacing^2 / 12 on average), while the group's absmax sits at 6 / (1 + a bf16 rounding) and
    its error is (6 - y) s; stochastic rounding's is twice the uniform figure (its variance
    (a - lo)(hi - a) averages spacing^2 / 6)."""
    result, _ = quick
    x = es.gaussian(es.QUICK_SHAPE).reshape(-1, 16)
    s = fp4quant.bf16_bits_to_f32(fp4quant.bf16_round_up(np.abs(x).max(axis=1) / 6))[:, None]
    y = np.abs(x / s).astype(np.float64)
    spacing = np.where(y <= 2, 0.5, np.where(y <= 4, 1.0, 2.0)) * s
    top = y == y.max(axis=1, keepdims=True)
    energy = (x.astype(np.float64) ** 2).sum()
    hard_bound = ((spacing / 2) ** 2).sum() / energy
    model = (np.where(top, ((6 - y) * s) ** 2, spacing**2 / 12)).sum() / energy

    row = _row(result, "gaussian", "fp4quant", False, 16)
    q = es.fp4quant_codec(x.reshape(es.QUICK_SHAPE), 16, False, "nearest", 1)
    assert row["rel_mse"] == pytest.approx(_rel_mse(x, q.reshape(x.shape)), rel=1e-12)
    assert row["rel_mse"] <= hard_bound
    assert row["rel_mse"] == pytest.approx(model, rel=0.05)
    assert row["rel_mse_stochastic"] == pytest.approx(2 * model, rel=0.1)


def test_transform_on_gaussian_changes_nothing(quick):
    """H of i.i.d. Gaussian groups is i.i.d. Gaussian: the error must not move."""
    result, _ = quick
    for g in es.GROUP_SIZES:
        with_h = _row(result, "gaussian", "fp4quant", True, g)["sqnr_db"]
        without = _row(result, "gaussian", "fp4quant", False, g)["sqnr_db"]
        assert abs(with_h - without) < 0.25, g


def test_transform_lowers_error_on_heavy_tails_and_outlier_channels(quick):
    """The seeded heavy-tailed data, with and without outlier channels: with large groups the
    transform gains several dB, and with it FP4Quant's error hardly depends on g."""
    result, _ = quick
    gain = {
        (d, g): _row(result, d, "fp4quant", True, g)["sqnr_db"]
        - _row(result, d, "fp4quant", False, g)["sqnr_db"]
        for d in ("heavy_tailed", "activations")
        for g in es.GROUP_SIZES
    }
    assert gain[("heavy_tailed", 256)] > 1.5
    assert gain[("heavy_tailed", 1024)] > 3.0
    assert gain[("activations", 256)] > 1.0
    assert gain[("activations", 1024)] > 3.0
    # over the channels that are not outliers too, where absmax groups lose most
    reg = {
        h: _row(result, "activations", "fp4quant", h, 1024)["sqnr_db_regular_channels"]
        for h in (False, True)
    }
    assert reg[True] > reg[False] + 3.0
    for d in SYNTHETIC:
        with_h = [_row(result, d, "fp4quant", True, g)["sqnr_db"] for g in es.GROUP_SIZES[2:]]
        assert max(with_h) - min(with_h) < 1.5, d
    # What the page reports: with an outlier channel in a small group, plain absmax scaling
    # keeps the outlier (the group's max) nearly exact and the transform spreads its error.
    assert gain[("activations", 16)] < -1.0


def test_scale_variants(quick):
    """The `bf16_up` variant is the codec itself, bit for bit; it never clips; the others cost
    clipping or bits for a change below 0.2 dB."""
    result, _ = quick
    x, _, _ = es.activations(es.QUICK_SHAPE)
    x = x.reshape(-1, es.ROW_ELEMENTS)
    for g in (64, 256):
        q, clipped = es.scale_variant(x, g, "bf16_up")
        np.testing.assert_array_equal(q, es.fp4quant_codec(x, g, True, "nearest", 1))
        assert clipped == 0.0
    for r in result["scale_rows"]:
        ref = next(
            s
            for s in result["scale_rows"]
            if (s["dataset"], s["group_size"], s["variant"])
            == (r["dataset"], r["group_size"], "bf16_up")
        )
        assert abs(r["sqnr_db"] - ref["sqnr_db"]) < 0.2, r
        bits = 4 + es.SCALE_VARIANTS[r["variant"]][1] / r["group_size"]
        assert r["bits_per_element"] == bits
        if r["variant"] == "bf16_up":
            assert r["clipped_fraction"] == 0.0
            matching = _row(result, r["dataset"], "fp4quant", True, r["group_size"])
            assert r["rel_mse"] == matching["rel_mse"]
        elif r["variant"] == "bf16_nearest":
            assert r["clipped_fraction"] > 0.0  # half the scales round down


def test_two_scales_decode_the_paper_way():
    """The paper's variant on a group with a known answer: a constant group has RMS c and a
    transform with one non-zero coefficient sqrt(g) (absmax sqrt(g)), which e2m1 holds exactly."""
    g = 64
    x = np.full((2, g), 0.375, np.float32)
    x[1] *= -3
    q, clipped = es.scale_variant(x.reshape(-1, g), g, "two_bf16")
    np.testing.assert_allclose(q, x, rtol=2 * np.finfo(np.float32).eps)
    assert clipped == 0.0
    z, _ = es.scale_variant(np.zeros((1, g), np.float32), g, "two_bf16")
    assert not np.any(z)


def test_bf16_round_nearest_ties_to_even():
    one = np.float32(1.0).view(np.uint32)
    u = np.array([one, one + 0x8000, one + 0x18000, one + 0x8001, one + 0x7FFF], np.uint32)
    bits = es.bf16_round_nearest(u.view(np.float32))
    np.testing.assert_array_equal(bits, [0x3F80, 0x3F80, 0x3F82, 0x3F81, 0x3F80])


def test_datasets_are_seeded_and_as_documented():
    shape = (8, 2048)
    x, idx, factors = es.activations(shape)
    x2, idx2, _ = es.activations(shape)
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(idx, idx2)
    base = es.heavy_tailed(shape)
    regular = np.setdiff1d(np.arange(shape[1]), idx)
    np.testing.assert_array_equal(x[:, regular], base[:, regular])
    assert idx.size == round(es.ACT_OUTLIER_FRACTION * shape[1]) == 10
    assert np.all((factors >= es.ACT_OUTLIER_SCALE_MIN) & (factors <= es.ACT_OUTLIER_SCALE_MAX))
    np.testing.assert_allclose(x[:, idx], (base[:, idx] * factors).astype(np.float32), rtol=1e-6)
    assert es.gaussian(shape).dtype == np.float32


def test_model_kinds():
    kinds = {
        "encoder.layer.3.attention.self.query.weight": "query",
        "encoder.layer.3.attention.self.key.weight": "key",
        "encoder.layer.3.attention.self.value.weight": "value",
        "encoder.layer.3.attention.output.dense.weight": "attn_out",
        "encoder.layer.3.intermediate.dense.weight": "ffn_up",
        "encoder.layer.3.output.dense.weight": "ffn_down",
        "pooler.dense.weight": "pooler",
    }
    for name, kind in kinds.items():
        assert es.model_kind(name) == kind


# ---------------------------------------------------------------------- the outputs


def test_json_schema_and_bits(quick):
    result, out = quick
    loaded = json.loads((out / "error_study.json").read_text())
    assert loaded == json.loads(json.dumps(result))
    assert set(loaded["datasets"]) == set(SYNTHETIC)
    assert loaded["provenance"]["commit"] == "0000000"
    assert set(loaded["provenance"]["source_sha256"]) == {
        "experiments/error_study.py",
        "formats/fp4quant.py",
        "formats/hadamard.py",
    }
    per_dataset = 2 * (1 + len(es.GROUP_SIZES)) + 2 * len(es.GROUP_SIZES)
    assert len(loaded["rows"]) == len(SYNTHETIC) * per_dataset
    assert len(loaded["scale_rows"]) == len(SYNTHETIC) * 3 * len(es.SCALE_VARIANTS)
    n = es.QUICK_SHAPE[0] * es.QUICK_SHAPE[1]
    for r in loaded["rows"] + loaded["scale_rows"]:
        assert set(es.CSV_COLUMNS) <= set(r)
        for key in ("rel_mse", "sqnr_db"):
            assert isinstance(r[key], float) and np.isfinite(r[key])
        assert r["sqnr_db"] == pytest.approx(-10 * np.log10(r["rel_mse"]))
        assert 0 < r["rel_mse"] < 0.1
    for r in loaded["rows"]:
        assert r["rel_mse_stochastic"] > r["rel_mse"]  # one rounding of both kinds per element
        expected_bits = {"nvfp4": 4.5 + 32 / n, "mxfp4": 4.25}.get(r["format"])
        if r["format"] == "fp4quant":
            expected_bits = 4 + 16 / r["group_size"]
            assert r["block_size"] == r["group_size"]
            assert r["bits_per_element"] == fp4quant.bits_per_element(r["group_size"])
        else:
            assert r["block_size"] == es.BLOCK_FORMATS[r["format"]]
            assert r["transform"] == (r["group_size"] is not None)
        assert r["bits_per_element"] == expected_bits
        assert ("sqnr_db_regular_channels" in r) == (r["dataset"] == "activations")


def test_csv_table_and_plot(quick):
    result, out = quick
    with open(out / "error_study.csv", newline="") as f:
        lines = list(csv.DictReader(f))
    assert len(lines) == len(result["rows"]) + len(result["scale_rows"])
    assert tuple(lines[0]) == es.CSV_COLUMNS
    first = result["rows"][0]
    assert float(lines[0]["sqnr_db"]) == pytest.approx(first["sqnr_db"], rel=1e-5)
    table = (out / "error_study_table.md").read_text()
    assert "at commit `0000000`" in table
    for line in es.findings(result):
        assert line in table
    g64 = _row(result, "activations", "fp4quant", True, 64)
    assert f"| FP4Quant g=64 + H | 4.25 | {g64['sqnr_db']:.2f}" in table
    assert (out / "error_study.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        es.main(["--help"])
    assert e.value.code == 0
    assert "--quick" in capsys.readouterr().out
    assert es.main(["--datasets", "gaussian,nope", "--out", str(tmp_path)]) == 2
    assert not any(tmp_path.iterdir())


def test_example_script_is_the_command_line():
    out = subprocess.run([sys.executable, str(EXAMPLE), "--help"], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0 and "--quick" in out.stdout, out.stderr
    assert len(EXAMPLE.read_text().splitlines()) < 20


def test_arguments_are_checked(tmp_path, monkeypatch, capsys):
    """Unknown or string dataset lists, an empty one, invalid SQNR / bits inputs and empty
    tensors: named, where before they gave plausible numbers (sqnr_db(nan) inf, 'NVFP4'
    counted as FP4Quant, a substring match loading two datasets for one name) or raw errors."""
    with pytest.raises(TypeError, match="datasets: a sequence of names"):
        es.load_datasets(True, "gaussian_activations")
    with pytest.raises(ValueError, match=r"datasets: \['gausian'\] not among"):
        es.run_study(True, ("gausian",))
    for bad in (float("nan"), -0.5):
        with pytest.raises(ValueError, match="rel_mse: a relative MSE >= 0"):
            es.sqnr_db(bad)
    assert es.sqnr_db(0.0) == float("inf")
    with pytest.raises(ValueError, match="fmt: 'NVFP4' is not"):
        es.bits_per_element("NVFP4", g=16)
    with pytest.raises(ValueError, match="g: FP4Quant's bits need its group size"):
        es.bits_per_element("fp4quant")
    with pytest.raises(ValueError, match="elements: NVFP4's bits need"):
        es.bits_per_element("nvfp4", elements=0)
    for shape in ((4, 0), (1024,)):
        with pytest.raises(ValueError, match="shape: .tokens, channels."):
            es.activations(shape)
    with pytest.raises(ValueError, match="has none to measure"):
        es.measure_dataset("d", [], group_sizes=(16,))
    with pytest.raises(TypeError, match="must be a non-empty numpy array"):
        es.measure_dataset("d", [("t", "all", [[1.0] * 16])], group_sizes=(16,))
    ones = np.ones((1, 1024), np.float32)
    with pytest.raises(ValueError, match="regular: a channel mask with at least one"):
        es.measure_dataset("d", [("t", "all", ones)], regular=np.zeros(1024, bool),
                           group_sizes=(16,))  # fmt: skip
    monkeypatch.setattr(es, "load_datasets", lambda quick, names: {})  # minilm not installed
    assert es.main(["--quick", "--datasets", "minilm", "--out", str(tmp_path / "o")]) == 2
    assert "none could be measured" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    assert es.main(["--quick", "--datasets", ",", "--out", str(tmp_path / "o")]) == 2


def test_an_out_that_is_not_a_folder_is_named_before_the_study(tmp_path, monkeypatch, capsys):
    def study(*args, **kwargs):
        raise AssertionError("the study ran")

    monkeypatch.setattr(es, "run_study", study)
    afile = tmp_path / "afile"
    afile.write_text("x")
    for out, why in ((afile, "exists and is not a folder"), (afile / "sub", "is not a folder")):
        assert es.main(["--quick", "--datasets", "gaussian", "--out", str(out)]) == 2
        assert f"--out {str(out)!r}: " in (err := capsys.readouterr().err) and why in err
    assert afile.read_text() == "x"
