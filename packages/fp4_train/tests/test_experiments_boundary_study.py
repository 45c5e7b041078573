"""fp4_train.experiments.boundary_study on records made up here: the pairing by layout and seed,
the interval (Student's t), the exact-boundary column, the payload means, the files."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("scipy")
pytest.importorskip("matplotlib")
pytest.importorskip("fp4_comm")

from fp4_train.experiments import boundary_study as bs  # noqa: E402 - after the skips

STEPS = 100


def _record(name, seed, offset, parallel="pp", sp=False, codec="none", grad_codec=None,
            rounding="nearest", grad_rounding="stochastic"):  # fmt: skip
    """A tp_train record whose validation loss is 3 - step / 100 + offset."""
    evals = [{"step": s, "val_loss": 3 - s / 100 + offset} for s in (25, 50, 75, 100)]
    sites = (
        {"forward": "enter", "backward": "exit"}
        if sp
        else {"forward": "boundary", "backward": "boundary"}
    )
    wire = [
        {
            "step": s,
            "site": sites[d],
            "direction": d,
            "op": "send",
            "rms": rms,
            "sqnr_db": sq,
            "payloads": 2,
        }
        for s in range(0, STEPS, 10)
        for d, rms, sq in (("forward", 2.0, 18.0), ("backward", 1e-4, None))
    ]
    if sp:  # the other SP sites, which the table does not show
        wire += [{**w, "site": "exit" if w["site"] == "enter" else "enter", "rms": 7.0}
                 for w in wire]  # fmt: skip
    final = evals[-1]["val_loss"]
    return {
        "name": f"{name}_s{seed}",
        "config": {"seed": seed, "parallel": parallel, "sequence_parallel": sp, "codec": codec,
                   "grad_codec": grad_codec, "rounding": rounding, "steps": STEPS, "layers": 4,
                   "d_model": 128, "heads": 4, "seq_len": 64, "batch": 16, "lr": 3e-3},
        "grad_rounding": grad_rounding,
        "world_size": 2,
        "summary": {"final_val_loss": final,
                    "final_evals": {"as_trained": final, "none-float32": final - offset / 2}},
        "evals": evals,
        "steps": [{"step": s, "loss": 3.0 + offset} for s in range(STEPS)],
        "wire": wire,
        "meta": {"device": "cpu: x86_64", "torch": "2.13", "commit": "abc1234"},
    }  # fmt: skip


def test_mean_ci_is_students_t():
    mean, half, n = bs.mean_ci([1.0, 2.0, 3.0])
    # sd 1, t(0.975, 2) = 4.302653
    assert (mean, n) == (2.0, 3)
    assert half == pytest.approx(4.302653 / math.sqrt(3), rel=1e-6)
    assert bs.mean_ci([0.5]) == (0.5, None, 1)


@pytest.fixture
def folder(tmp_path):
    offsets = {0: 0.010, 1: 0.020, 2: 0.030}  # the configuration's cost per seed
    records = []
    for seed, off in offsets.items():
        records.append(_record("pp_bf16", seed, 0.001 * seed))
        records.append(_record("pp_fwd-rn_bwd-rn", seed, 0.001 * seed + off, codec="fp4quant-g64",
                               grad_rounding="nearest"))  # fmt: skip
        records.append(_record("sp_bf16", seed, 0.0, parallel="tp", sp=True))
        records.append(_record("sp_bwd-sr", seed, 0.005, parallel="tp", sp=True,
                               grad_codec="fp4quant-g64"))  # fmt: skip
    for r in records:
        (tmp_path / f"{r['name']}.json").write_text(json.dumps(r))
    return tmp_path


def test_pairs_by_layout_and_seed(folder):
    rows = {r["config"]: r for r in bs.analyse(bs.load(folder))}
    pp = rows["pp_fwd-rn_bwd-rn"]
    assert pp["what"] == "both nearest" and pp["layout"] == "pp" and pp["seeds"] == [0, 1, 2]
    # the seed's own baseline is subtracted: 0.01, 0.02, 0.03 at every point of training
    for key in ("delta_25", "delta_50", "delta_100"):
        assert pp[key] == pytest.approx(0.02)
        assert pp[key + "_ci"] == pytest.approx(4.302653 * 0.01 / math.sqrt(3), rel=1e-6)
    assert pp["delta_train_last_fifth"] == pytest.approx(0.02)
    # evaluated with an exact boundary, each record loses half its offset (0.001 seed + cost):
    # the mean over seeds of cost / 2 - 0.0005 seed
    assert pp["delta_exact_eval"] == pytest.approx(0.02 / 2 - 0.0005)
    assert pp["forward_rms"] == 2.0 and pp["forward_sqnr_db"] == 18.0
    assert pp["backward_rms"] == 1e-4 and pp["backward_sqnr_db"] is None
    sp = rows["sp_bwd-sr"]
    assert sp["layout"] == "sp" and sp["what"] == "backward stochastic only"
    assert (sp["forward_rms"], sp["backward_rms"]) == (2.0, 1e-4)  # the all-gathers
    assert sp["wire"]["exit.forward"]["rms"] == 7.0
    assert sp["delta_100"] == pytest.approx(0.005) and sp["delta_100_ci"] == pytest.approx(0)
    assert rows["pp_bf16"]["what"] == "bf16 (baseline)"


def test_writes_table_numbers_and_plot(folder):
    table = bs.write(folder)
    assert "| `pp_fwd-rn_bwd-rn` | both nearest | 3 | +0.0200 ± 0.0248 |" in table
    assert "| +0.0200 ± 0.0248 | +0.0095 ± " in table  # training loss; exact boundary
    assert (folder / "boundary.md").read_text() == table
    rows = json.loads((folder / "boundary.json").read_text())["rows"]
    assert {r["config"] for r in rows} == {"pp_bf16", "pp_fwd-rn_bwd-rn", "sp_bf16", "sp_bwd-sr"}
    assert (folder / "boundary.csv").read_text().startswith("config,")
    assert (folder / "boundary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_describe_names_codecs_other_than_the_tables():
    lever = _record("pp_fwd-nvfp4_bwd-sr", 0, 0.0, codec="nvfp4", grad_codec="fp4quant-g64")
    assert bs.describe(lever) == "nvfp4: forward nearest + backward stochastic"
    native = _record("tp_native", 0, 0.0, parallel="tp", codec="native")
    assert bs.describe(native) == "torch.distributed's all-reduce (NCCL's on GPUs)"


def test_a_record_without_what_the_tables_read_is_named(tmp_path):
    """A tp_train record lacking a field the study reads is named with the field, not a
    KeyError; JSON that is no tp_train record (a list, a number) is left out."""
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "number.json").write_text("5")
    for i, drop in enumerate(("name", "evals")):
        record = _record("pp_bf16", i, 0.0)
        del record[drop]
        (tmp_path / "broken.json").write_text(json.dumps(record))
        with pytest.raises(SystemExit, match=f"broken.json: a tp_train record without {drop}"):
            bs.load(tmp_path)
    record = _record("pp_bf16", 0, 0.0)
    del record["config"]["seed"]
    (tmp_path / "broken.json").write_text(json.dumps(record))
    with pytest.raises(SystemExit, match="without config.seed"):
        bs.main(["--out", str(tmp_path)])
    (tmp_path / "broken.json").write_text(json.dumps(_record("pp_bf16", 0, 0.0)))
    assert list(bs.load(tmp_path)) == ["pp_bf16"]


def test_run_options_without_run_are_refused_and_the_preset_checked(tmp_path, capsys, monkeypatch):
    out = ["--out", str(tmp_path)]
    for extra, message in (
        (["--preset", "h200"], "--preset: for the runs of --run, which this call does not"),
        (["--budget-s", "60"], "--budget-s: for the runs of --run"),
        (["--", "--data", "c.txt"], "arguments after --: for the runs of --run"),
        (["--run", "--preset", "bogus"], "--preset: invalid choice: 'bogus'"),
    ):
        with pytest.raises(SystemExit) as stop:
            bs.main([*out, *extra])
        assert stop.value.code == 2 and message in capsys.readouterr().err, extra
    sweeps = []
    monkeypatch.setattr(bs.tp_sweep, "main", sweeps.append)
    monkeypatch.setattr(bs, "write", lambda folder: "written")
    assert bs.main([*out, "--run"]) == 0 and bs.main([*out, "--run", "--preset", "h200"]) == 0
    assert [s[:2] for s in sweeps] == [["--preset", "cpu-boundary"], ["--preset", "h200"]]
