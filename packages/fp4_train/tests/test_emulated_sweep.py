"""fp4_train.experiments.emulated_sweep: the presets' runs and names, runs started as several
processes at a time, skipped once their summary exists, and left out past the budget; and
emulated_summary's table from run summaries: the pairing with bf16 by seed, the intervals, the
preprint's figures beside the rows they belong to."""

from __future__ import annotations

import argparse
import gzip
import json
import math

import pytest

pytest.importorskip("fp4_comm")

from fp4_train.experiments import emulated_summary, emulated_sweep, emulated_tp  # noqa: E402
from fp4_train.experiments.boundary_study import t_quantile  # noqa: E402


@pytest.mark.parametrize("preset", sorted(emulated_sweep.PRESETS))
def test_presets_list_their_runs(preset, tmp_path, capsys):
    assert emulated_sweep.main(["--preset", preset, "--out", str(tmp_path), "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    listed = [line.split()[0] for line in lines if "-m fp4_train.experiments.emulated_tp" in line]
    p = emulated_sweep.PRESETS[preset]
    assert len(set(listed)) == len(listed) == len(p["configs"]) * len(p["seeds"])
    # every run's arguments pass emulated_tp's checks (a run refused at its start wastes a
    # sweep's slot on the GPU)
    for _, argv in p["configs"]:
        emulated_tp.parse_args([*p["args"], *argv, "--device", "cpu"])
    if any(name == emulated_sweep.TAH for name, _ in p["configs"]):
        # TAH-Quant's activation codec on tokens of the model's width, its gradient codec back
        tah = [line for line in lines if "tahquant" in line]
        assert tah and all("--grad-codec tahquant-grad" in line for line in tah)
    names = {name for name, _ in p["configs"]}
    if emulated_sweep.TAH_LS in names:
        # with the loss scale: its runs (and only those) say so, in their names too
        scaled = [line for line in lines if "--loss-scale" in line]
        assert len(scaled) == len(p["seeds"])
        ls = emulated_sweep.TAH_LOSS_SCALE
        assert all(f"--loss-scale {ls} " in line and f"_ls{ls}_s" in line.split()[0]
                   for line in scaled)  # fmt: skip


def test_a_codec_fp4_comm_does_not_know_is_listed_as_unavailable(tmp_path, monkeypatch, capsys):
    preset = {"args": ["--model", "qwen-tiny", "--tp", "2"], "seeds": [0, 1],
              "configs": [("bf16", ["--codec", "none"]),
                          ("tahquant", ["--codec", "tahquant-hx"])]}  # fmt: skip
    monkeypatch.setitem(emulated_sweep.PRESETS, "odd", preset)
    assert emulated_sweep.main(["--preset", "odd", "--out", str(tmp_path), "--list"]) == 0
    out = capsys.readouterr().out
    assert "tahquant s0: unavailable" in out and "tahquant s1: unavailable" in out
    assert out.count("-m fp4_train.experiments.emulated_tp") == 2


TINY = ["--model", "byte", "--layers", "1", "--d-model", "16", "--heads", "2", "--seq-len",
        "16", "--batch", "2", "--steps", "2", "--eval-every", "0", "--eval-batches", "1",
        "--stats-every", "0", "--timing-warmup", "0", "--device", "cpu", "--tp", "2"]  # fmt: skip


def test_runs_start_as_processes_and_are_skipped_once_done(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 50)
    configs = [("bf16", ["--codec", "none"]), ("nvfp4", ["--codec", "nvfp4"])]
    preset = {"args": [*TINY, "--data", str(corpus)], "seeds": [0], "configs": configs}
    monkeypatch.setitem(emulated_sweep.PRESETS, "cpu-tiny", preset)
    out = tmp_path / "runs"
    base = ["--preset", "cpu-tiny", "--out", str(out)]
    # nothing fits a budget of 0 s once a run is estimated at 1 s
    # (status 75: runs are left for a later invocation)
    assert emulated_sweep.main([*base, "--budget-s", "0", "--estimate-s", "1"]) == 75
    assert not list(out.glob("*.json"))
    assert emulated_sweep.main([*base, "--jobs", "2"]) == 0
    names = sorted(p.stem for p in out.glob("*.json"))
    assert names == ["byte_tp2_bf16_s0", "byte_tp2_nvfp4_s0"]
    for name in names:
        summary = json.loads((out / f"{name}.json").read_text())
        assert summary["concurrent_runs"] == 2 and math.isfinite(summary["final_val_loss"])
        assert (out / "logs" / f"{name}.log").exists()
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("*.json")}
    assert emulated_sweep.main([*base, "--jobs", "2"]) == 0  # both exist: nothing runs
    assert {p: p.stat().st_mtime_ns for p in out.glob("*.json")} == stamps
    # a run finished elsewhere (its summary in a --done folder) is skipped too
    other = tmp_path / "elsewhere"
    other.mkdir()
    (out / "byte_tp2_nvfp4_s0.json").rename(other / "byte_tp2_nvfp4_s0.json")
    assert emulated_sweep.main([*base, "--done", str(other)]) == 0
    assert sorted(p.stem for p in out.glob("*.json")) == ["byte_tp2_bf16_s0"]
    # ... and so is one kept as a gzip copy, whose record gives its configuration's length
    data = (other / "byte_tp2_nvfp4_s0.json").read_bytes()
    (other / "byte_tp2_nvfp4_s0.json").unlink()
    (other / "byte_tp2_nvfp4_s0.json.gz").write_bytes(gzip.compress(data))
    (other / "byte_tp2_mxfp4_s0.json.gz").write_bytes(gzip.compress(data)[:-9])  # cut short
    assert emulated_sweep.main([*base, "--done", str(other)]) == 0
    assert sorted(p.stem for p in out.glob("*.json")) == ["byte_tp2_bf16_s0"]
    recorded = emulated_sweep.recorded_summaries([other])
    assert [config for config, _ in recorded] == ["byte_tp2_nvfp4"]


def test_a_finished_run_is_reported_with_its_loss_or_without_a_summary(tmp_path):
    args = argparse.Namespace(out=tmp_path, jobs=1, estimate_s=None)
    sweep = emulated_sweep.Sweep(args, [])
    (tmp_path / "a.json").write_text(json.dumps({"final_val_loss": 3.31877}))
    (tmp_path / "c.json").write_text("{")  # cut short
    assert sweep.outcome("a") == " (final val loss 3.3188)"
    assert sweep.outcome("b") == sweep.outcome("c") == " (no summary)"


class _Run:
    """A run process that goes on until its ``code`` is set (``Popen`` replaced)."""

    def __init__(self):
        self.code = None

    def poll(self):
        return self.code


def test_a_run_is_estimated_by_its_configurations_records_at_the_same_concurrency(
    tmp_path, monkeypatch
):
    """Two error-feedback runs were started two at a time with an estimate of the grid's other
    runs (470 s) and cut off unfinished at a 584 s limit: a configuration's own records set its
    estimate, and a run that does not fit is left out while a shorter one starts."""
    done = tmp_path / "done"
    done.mkdir()
    records = {"m_tp4_nvfp4_ef_s0": (600.0, 2), "m_tp4_nvfp4_ef_s1": (650.0, 2),
               "m_tp4_bf16_s0": (300.0, 1), "m_tp4_bf16_s1": (460.0, 2),
               "m_tp4_mxfp4_s0": (float("nan"), 2)}  # fmt: skip
    for name, (wall, jobs) in records.items():
        (done / f"{name}.json").write_text(json.dumps({"wall_s": wall, "concurrent_runs": jobs}))
    (done / "m_tp4_g64_s0.json").write_text("{")  # unreadable: passed over
    summaries = emulated_sweep.recorded_summaries([done])
    assert emulated_sweep.recorded_lengths(summaries, 2) == {"m_tp4_nvfp4_ef": 650.0,
                                                          "m_tp4_bf16": 460.0}  # fmt: skip
    assert emulated_sweep.recorded_lengths(summaries, 1) == {"m_tp4_bf16": 300.0}
    args = emulated_sweep.parse_args(["--preset", "tp4", "--out", str(tmp_path / "out"),
                                      "--done", str(done), "--jobs", "2", "--estimate-s", "470",
                                      "--budget-s", "584"])  # fmt: skip
    todo = [("m_tp4_nvfp4_ef_s2", []), ("m_tp4_bf16_s2", []), ("m_tp4_mxfp4_s2", [])]
    sweep = emulated_sweep.Sweep(args, todo)
    assert [sweep.estimate(n) for n, _ in todo] == [650.0, 460.0, 470.0]

    monkeypatch.setattr(emulated_sweep.subprocess, "Popen", lambda cmd, **kw: _Run())
    sweep.start_runs()
    assert sweep.left_out == ["m_tp4_nvfp4_ef_s2"]
    assert [v[0] for v in sweep.running.values()] == ["m_tp4_bf16_s2", "m_tp4_mxfp4_s2"]
    for _, _, log in sweep.running.values():
        log.close()


def test_a_resumed_run_is_expected_to_take_what_is_left_of_it(tmp_path, monkeypatch):
    """On a machine's last job: ``--budget-s`` with ``--stop-at-s`` starts the run whose
    checkpoint has three quarters of its steps done (250 of 1000 s left) and no new run, and a
    run expected to end in the time left starts with less than ``--min-piece-s`` left."""
    done = {"m_tp8_bf16_s1": (1500, 2000)}
    monkeypatch.setattr(emulated_sweep, "progress", lambda path: done.get(path.name))
    base = ["--preset", "tp8", "--out", str(tmp_path / "out"), "--checkpoint-dir",
            str(tmp_path / "c"), "--estimate-s", "1000", "--stop-at-s", "540",
            "--min-piece-s", "300"]  # fmt: skip
    last = emulated_sweep.Sweep(emulated_sweep.parse_args([*base, "--budget-s", "540"]), [])
    assert last.estimate("m_tp8_bf16_s1") == 250.0 and last.estimate("m_tp8_g64_s1") == 1000.0
    assert last.fits(280.0, "m_tp8_bf16_s1") and not last.fits(280.0, "m_tp8_g64_s1")
    assert not last.fits(300.0, "m_tp8_bf16_s1")  # 550 s > the budget
    sweep = emulated_sweep.Sweep(emulated_sweep.parse_args(base), [])
    assert sweep.fits(280.0, "m_tp8_bf16_s1")  # 260 s left, less than --min-piece-s
    assert not sweep.fits(280.0, "m_tp8_g64_s1") and sweep.fits(240.0, "m_tp8_g64_s1")


def test_a_finished_runs_length_is_its_summarys_not_its_last_pieces(tmp_path):
    """A run resumed for its last 250 s that took 1284 s over its pieces: the runs without a
    record of their own are expected to take 1284 s, not 250."""
    args = emulated_sweep.parse_args(["--preset", "tp8", "--out", str(tmp_path)])
    sweep = emulated_sweep.Sweep(args, [])
    (tmp_path / "m_tp8_bf16_s0.json").write_text(json.dumps({"wall_s": 1284.0}))
    sweep.learn("m_tp8_bf16_s0", 250.0)
    assert sweep.estimate("m_tp8_g64_s0") == 1284.0
    sweep.learn("m_tp8_g256_s0", 90.0)  # no summary: the time it took
    assert sweep.longest == 1284.0


def test_runs_start_where_they_fit_the_gpu_memory_beside_the_runs_going_on(
    tmp_path, monkeypatch, capsys
):
    """With 78 GiB: an error-feedback run (43 GB recorded) beside another waits, a bf16 run
    (13 GB) starts beside it; a configuration without a record counts as the largest recorded;
    the waiting run starts once the first ends; unknown memory gates nothing."""
    done = tmp_path / "done"
    done.mkdir()
    for name, peak in {"m_tp4_nvfp4_ef_s0": 41.0, "m_tp4_nvfp4_ef_s1": 43.0,
                       "m_tp4_bf16_s0": 13.0, "m_tp4_g64_s0": float("nan")}.items():  # fmt: skip
        (done / f"{name}.json").write_text(json.dumps({"max_memory_gb": peak}))
    assert emulated_sweep.recorded_memory(emulated_sweep.recorded_summaries([done])) == {
        "m_tp4_nvfp4_ef": 43.0,
        "m_tp4_bf16": 13.0,
    }
    todo = [("m_tp4_nvfp4_ef_s2", []), ("m_tp4_nvfp4_ef_s3", []), ("m_tp4_bf16_s2", []),
            ("m_tp4_mxfp4_s2", [])]  # fmt: skip
    args = emulated_sweep.parse_args(["--preset", "tp4", "--out", str(tmp_path / "out"),
                                      "--done", str(done), "--jobs", "3",
                                      "--gpu-memory-gb", "78"])  # fmt: skip

    monkeypatch.setattr(emulated_sweep, "gpu_name", lambda: None)  # (Popen is a stand-in)
    monkeypatch.setattr(emulated_sweep.subprocess, "Popen", lambda cmd, **kw: _Run())
    sweep = emulated_sweep.Sweep(args, todo)
    ef = 43.0 * (1 + emulated_sweep.MEMORY_SLACK) + emulated_sweep.CONTEXT_GB
    assert sweep.need_gb("m_tp4_nvfp4_ef_s2") == sweep.need_gb("m_tp4_mxfp4_s2") == ef
    sweep.start_runs()
    running = {v[0]: proc for proc, v in sweep.running.items()}
    assert list(running) == ["m_tp4_nvfp4_ef_s2", "m_tp4_bf16_s2"]
    assert [n for n, _ in sweep.pending] == ["m_tp4_nvfp4_ef_s3", "m_tp4_mxfp4_s2"]
    out = capsys.readouterr().out
    assert "waiting: m_tp4_nvfp4_ef_s3 needs ~49 GiB, 49 of 78 held" in out
    assert "waiting: m_tp4_mxfp4_s2" in out
    running["m_tp4_nvfp4_ef_s2"].code = 0
    sweep.poll()
    sweep.start_runs()
    assert [v[0] for v in sweep.running.values()] == ["m_tp4_bf16_s2", "m_tp4_nvfp4_ef_s3"]
    assert "waiting" not in capsys.readouterr().out  # said once a run
    for _, _, log in sweep.running.values():
        log.close()
    # the GPU's memory unknown (no nvidia-smi): every run starts, --jobs at a time
    monkeypatch.setattr(emulated_sweep, "free_gpu_memory_gb", lambda: None)
    args.gpu_memory_gb = None
    sweep = emulated_sweep.Sweep(args, todo)
    sweep.start_runs()
    assert [v[0] for v in sweep.running.values()] == [n for n, _ in todo[:3]]
    for _, _, log in sweep.running.values():
        log.close()


def test_memory_gb_estimate_stands_for_unrecorded_configurations_until_one_finishes(
    tmp_path, monkeypatch
):
    """--memory-gb-estimate is the peak of a configuration without a record (not the largest
    recorded of another); a run that finishes records its own peak for the runs of its
    configuration that start later."""
    done = tmp_path / "done"
    done.mkdir()
    (done / "m_tp4_nvfp4_ef_s0.json").write_text(json.dumps({"max_memory_gb": 43.0}))
    out = tmp_path / "out"
    args = emulated_sweep.parse_args(["--preset", "tp8", "--out", str(out), "--done", str(done),
                                      "--jobs", "4", "--gpu-memory-gb", "78",
                                      "--memory-gb-estimate", "16"])  # fmt: skip

    monkeypatch.setattr(emulated_sweep, "gpu_name", lambda: None)  # (Popen is a stand-in)
    monkeypatch.setattr(emulated_sweep.subprocess, "Popen", lambda cmd, **kw: _Run())
    todo = [(f"m_tp8_bf16_s{s}", []) for s in range(6)]
    sweep = emulated_sweep.Sweep(args, todo)
    need = lambda peak: peak * (1 + emulated_sweep.MEMORY_SLACK) + emulated_sweep.CONTEXT_GB  # noqa: E731
    assert sweep.need_gb("m_tp8_bf16_s0") == need(16.0)
    assert sweep.need_gb("m_tp4_nvfp4_ef_s1") == need(43.0)
    sweep.start_runs()
    assert len(sweep.running) == 4  # 4 x 19.1 of 78 GiB (the largest recorded: 1 of 49.8)
    # the first finishes: its summary says 30 GB, so the next of its configuration needs more
    first = next(p for p, v in sweep.running.items() if v[0] == "m_tp8_bf16_s0")
    (out / "m_tp8_bf16_s0.json").write_text(json.dumps({"max_memory_gb": 30.0}))
    first.code = 0
    sweep.poll()
    assert sweep.need_gb("m_tp8_bf16_s4") == need(30.0)
    sweep.start_runs()
    assert len(sweep.running) == 3  # the three going on now count 34.5 GiB each: it waits
    for _, _, log in sweep.running.values():
        log.close()
    bad = ["--preset", "tp8", "--out", str(out), "--memory-gb-estimate", "nan"]
    with pytest.raises(SystemExit):
        emulated_sweep.parse_args(bad)


def test_a_loss_scaled_configuration_without_records_is_estimated_by_its_unscaled_one(tmp_path):
    """TAH-Quant with a loss scale of 2**16 (or 1/64) and no record of its own takes the time
    and memory of TAH-Quant's records (PP = 2: 160 s, 10.3 GB), not --estimate-s and
    --memory-gb-estimate nor the largest peak recorded (43 GB); its own records come first
    once there are any, and the suffix is looked past only at the end of the name."""
    done = tmp_path / "done"
    done.mkdir()
    tah = "m_pp2_tahquant-h768_grad-tahquant-grad-rn"
    records = {f"{tah}_s0": (160.0, 10.3), "m_tp4_nvfp4_ef_s0": (500.0, 43.0),
               f"{tah}_ls1by64_s0": (170.0, 10.4)}  # fmt: skip
    for name, (wall, peak) in records.items():
        summary = {"wall_s": wall, "concurrent_runs": 1, "max_memory_gb": peak}
        (done / f"{name}.json").write_text(json.dumps(summary))
    args = emulated_sweep.parse_args(["--preset", "pp2-levers", "--out", str(tmp_path / "o"),
                                      "--done", str(done), "--estimate-s", "400",
                                      "--memory-gb-estimate", "30"])  # fmt: skip
    sweep = emulated_sweep.Sweep(args, [])
    need = lambda peak: peak * (1 + emulated_sweep.MEMORY_SLACK) + emulated_sweep.CONTEXT_GB  # noqa: E731
    for name in (f"{tah}_ls65536_s1", f"{tah}_s1"):
        assert sweep.estimate(name) == 160.0 and sweep.need_gb(name) == need(10.3)
    # its own record first
    assert sweep.estimate(f"{tah}_ls1by64_s1") == 170.0
    assert sweep.need_gb(f"{tah}_ls1by64_s1") == need(10.4)
    # no configuration of that name without the scale either: the estimates
    assert sweep.estimate("m_pp2_nvfp4_ls65536_s0") == 400.0
    assert sweep.need_gb("m_pp2_nvfp4_ls65536_s0") == need(30.0)
    assert emulated_sweep.config_record({"m_x": 1.0}, "m_x_ls65536_y_s0") is None
    assert emulated_sweep.config_record({"m_x": 1.0}, "m_x_ls65536_s0") == 1.0


def test_free_memory_and_model_are_read_from_nvidia_smi_for_the_first_visible_gpu(monkeypatch):
    calls, answers = [], {"memory.free": "79872\n", "name": "NVIDIA H100 80GB HBM3\n"}

    def run(cmd, **kw):
        calls.append(cmd)
        return argparse.Namespace(stdout=answers[cmd[3].split("=")[1]])

    monkeypatch.setattr(emulated_sweep.subprocess, "run", run)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert emulated_sweep.free_gpu_memory_gb() == 78.0
    assert emulated_sweep.gpu_name() == "NVIDIA H100 80GB HBM3"
    assert [c[:4] for c in calls] == [["nvidia-smi", "-i", "2", "--query-gpu=memory.free"],
                                      ["nvidia-smi", "-i", "2", "--query-gpu=name"]]  # fmt: skip

    def missing(cmd, **kw):
        raise FileNotFoundError(cmd[0])

    monkeypatch.setattr(emulated_sweep.subprocess, "run", missing)
    assert emulated_sweep.free_gpu_memory_gb() is None
    assert emulated_sweep.gpu_name() is None


def test_the_processes_on_the_gpu_are_counted_from_nvidia_smi(monkeypatch):
    calls, answer = [], {"stdout": "4021\n4177\n\n"}

    def run(cmd, **kw):
        calls.append(cmd)
        return argparse.Namespace(**answer)

    monkeypatch.setattr(emulated_sweep.subprocess, "run", run)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert emulated_sweep.gpu_processes() == 2
    assert calls[0][:4] == ["nvidia-smi", "-i", "1", "--query-compute-apps=pid"]
    answer["stdout"] = ""  # none listed: a container whose processes it does not show
    assert emulated_sweep.gpu_processes() is None

    def missing(cmd, **kw):
        raise FileNotFoundError(cmd[0])

    monkeypatch.setattr(emulated_sweep.subprocess, "run", missing)
    assert emulated_sweep.gpu_processes() is None


def test_the_emulated_runs_on_the_machine_are_counted_from_proc(tmp_path):
    module = emulated_sweep.MODULE.encode()
    for pid, argv in (("12", [b"python3", b"-m", module, b"--tp", b"8"]),
                      ("13", [b"python3", b"-m", b"fp4_train.experiments.emulated_sweep"]),
                      ("14", [b"/usr/bin/python3", b"-m", module]),
                      ("self", [b"python3", b"-m", module])):  # fmt: skip
        (tmp_path / pid).mkdir()
        (tmp_path / pid / "cmdline").write_bytes(b"\0".join(argv) + b"\0")
    (tmp_path / "15").mkdir()  # a process that ended while the folder was read: no cmdline
    assert emulated_sweep.machine_runs(tmp_path) == 2
    assert emulated_sweep.machine_runs(tmp_path / "absent") is None


def test_runs_on_the_cpu_count_the_machines_runs_not_the_gpus(tmp_path, monkeypatch):
    """Two sweeps' CPU runs at once: a run records the machine's emulated_tp processes (4),
    not this sweep's two, and nvidia-smi is not asked."""
    monkeypatch.setattr(emulated_sweep, "machine_runs", lambda: 4)
    monkeypatch.setattr(emulated_sweep, "gpu_processes", lambda: pytest.fail("nvidia-smi"))
    monkeypatch.setattr(emulated_sweep, "gpu_name", lambda: None)
    monkeypatch.setattr(emulated_sweep, "free_gpu_memory_gb", lambda: None)
    monkeypatch.setattr(emulated_sweep.subprocess, "Popen", lambda cmd, **kw: _Run())
    args = emulated_sweep.parse_args(["--preset", "cpu-ranks", "--out", str(tmp_path),
                                      "--jobs", "2"])  # fmt: skip
    runs = [("byte_tp2_bf16_s0", ["--device", "cpu", "--tp", "2"]),
            ("byte_tp8_bf16_s0", ["--device", "cpu", "--tp", "8"])]  # fmt: skip
    sweep = emulated_sweep.Sweep(args, runs)
    sweep.start_runs()
    sweep.note_sharing()
    assert sweep.sharing == {"byte_tp2_bf16_s0": 4, "byte_tp8_bf16_s0": 4}


def test_a_finished_runs_summary_says_how_many_processes_shared_the_gpu_over_its_pieces(
    tmp_path, monkeypatch
):
    """Two runs started two at a time beside another sweep's run (nvidia-smi lists three
    processes): the one that finishes records 3, not the 2 of ``--jobs`` its process wrote;
    the one stopped at the time limit keeps 3 beside its checkpoint, and records it when a
    later invocation finishes it alone, where nvidia-smi lists nothing.  A run alone then
    records 1, and nvidia-smi is asked at most every ``SHARING_POLL_S`` while no run starts or
    ends."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    listed, asked = [3], []

    def processes():
        asked.append(listed[0])
        return listed[0]

    monkeypatch.setattr(emulated_sweep, "gpu_processes", processes)
    monkeypatch.setattr(emulated_sweep, "gpu_name", lambda: None)
    monkeypatch.setattr(emulated_sweep, "free_gpu_memory_gb", lambda: None)
    monkeypatch.setattr(emulated_sweep.subprocess, "Popen", lambda cmd, **kw: _Run())
    base = ["--preset", "tp8", "--out", str(out), "--checkpoint-dir", str(ckpt)]
    sweep = emulated_sweep.Sweep(emulated_sweep.parse_args([*base, "--jobs", "2"]),
                                 [("m_tp8_bf16_s0", []), ("m_tp8_g64_s0", [])])  # fmt: skip
    sweep.start_runs()
    sweep.note_sharing()
    sweep.note_sharing()  # within SHARING_POLL_S, nothing started or ended: not asked again
    assert asked == [3] and sweep.sharing == {"m_tp8_bf16_s0": 3, "m_tp8_g64_s0": 3}
    summary = {"final_val_loss": 3.4, "wall_s": 600.0, "step_ms": None, "concurrent_runs": 2}
    (out / "m_tp8_bf16_s0.json").write_text(json.dumps(summary))
    finished, stopped = list(sweep.running)
    finished.code, stopped.code = 0, emulated_sweep.EX_TEMPFAIL
    sweep.poll()
    recorded = json.loads((out / "m_tp8_bf16_s0.json").read_text())
    assert recorded == {**summary, "concurrent_runs": 3}
    assert (ckpt / "m_tp8_g64_s0" / emulated_sweep.SHARING_FILE).read_text() == "3\n"

    listed[0] = None
    later = emulated_sweep.Sweep(emulated_sweep.parse_args([*base, "--jobs", "1"]),
                                 [("m_tp8_g64_s0", [])])  # fmt: skip
    later.start_runs()
    later.note_sharing()
    (out / "m_tp8_g64_s0.json").write_text(json.dumps({**summary, "concurrent_runs": 1}))
    next(iter(later.running)).code = 0
    later.poll()
    assert json.loads((out / "m_tp8_g64_s0.json").read_text())["concurrent_runs"] == 3
    assert not (ckpt / "m_tp8_g64_s0").exists()  # the finished run's checkpoint, removed

    alone = emulated_sweep.Sweep(emulated_sweep.parse_args([*base, "--jobs", "2"]),
                                 [("m_tp8_g256_s0", [])])  # fmt: skip
    alone.start_runs()
    alone.note_sharing()
    (out / "m_tp8_g256_s0.json").write_text(json.dumps(summary))
    next(iter(alone.running)).code = 0
    alone.poll()
    assert json.loads((out / "m_tp8_g256_s0.json").read_text())["concurrent_runs"] == 1


def test_a_run_is_estimated_by_its_records_on_this_gpu_model_where_there_are_any(
    tmp_path, monkeypatch
):
    """Error-feedback runs took 396 s alone on an H200 and 477 s on an H100: on either GPU
    the estimate is that model's record, on another (or where nvidia-smi names none) the
    longest of all; a configuration with no record on this model takes the longest of all."""
    done = tmp_path / "done"
    done.mkdir()
    # (a record whose meta is not a mapping: passed over for the model's estimates)
    records = {"m_tp4_mxfp4_ef_s0": (396.0, "cuda: NVIDIA H200"),
               "m_tp4_mxfp4_ef_s1": (477.0, "cuda: NVIDIA H100 80GB HBM3"),
               "m_tp4_bf16_s0": (300.0, "cuda: NVIDIA H200"),
               "m_tp4_bf16_s1": (250.0, None)}  # fmt: skip
    for name, (wall, device) in records.items():
        (done / f"{name}.json").write_text(json.dumps(
            {"wall_s": wall, "concurrent_runs": 1,
             "meta": device and {"device": device}}))  # fmt: skip
    summaries = emulated_sweep.recorded_summaries([done])
    lengths = emulated_sweep.recorded_lengths
    assert lengths(summaries, 1, "NVIDIA H200") == {"m_tp4_mxfp4_ef": 396.0, "m_tp4_bf16": 300.0}
    assert lengths(summaries, 1, "NVIDIA H100 80GB HBM3") == {"m_tp4_mxfp4_ef": 477.0,
                                                               "m_tp4_bf16": 300.0}  # fmt: skip
    assert lengths(summaries, 1, None) == lengths(summaries, 1, "NVIDIA B200") == {
        "m_tp4_mxfp4_ef": 477.0, "m_tp4_bf16": 300.0}  # fmt: skip
    monkeypatch.setattr(emulated_sweep, "gpu_name", lambda: "NVIDIA H200")
    args = emulated_sweep.parse_args(["--preset", "tp4", "--out", str(tmp_path / "out"),
                                      "--done", str(done), "--budget-s", "420"])  # fmt: skip
    sweep = emulated_sweep.Sweep(args, [("m_tp4_mxfp4_ef_s2", [])])
    assert sweep.estimate("m_tp4_mxfp4_ef_s2") == 396.0  # fits 420 s on the H200


# ------------------------------------------------------------------ the table


def _summary(layout, policy, codec, seed, loss, grad_codec=None, grad_rounding="nearest"):
    """A run summary with what the table reads (the inputs of the table's arithmetic)."""
    return {
        "kind": "emulated_tp_summary", "name": f"qwen-125m_{layout}_{policy}_s{seed}",
        "model": "qwen-125m", "layout": layout, "codec": codec,
        "grad_codec": grad_codec or codec, "grad_rounding": grad_rounding, "seed": seed,
        "config": {"rounding": "nearest", "error_feedback": False, "steps": 100},
        "tokens_per_step": 16384, "final_val_loss": loss, "wall_s": 120.0,
        "tokens_per_s": 1e5, "step_ms": 160.0, "tflops": None, "concurrent_runs": 4,
        "train_loss_curve": [[0, 10.0 + loss], [50, 5.0 + loss], [99, loss]],
        "evals": [[50, 2 * loss], [100, loss]],
    }  # fmt: skip


def test_the_table_pairs_by_seed_and_quotes_the_preprint(tmp_path):
    bf16 = [3.0, 3.1, 2.95]
    g64 = [3.05, 3.12, 3.01]
    runs = [_summary("tp4", "bf16", "bf16", s, v) for s, v in enumerate(bf16)]
    runs += [_summary("tp4", "fp4quant-g64", "fp4quant-g64", s, v) for s, v in enumerate(g64)]
    runs += [_summary("tp4", "nvfp4", "nvfp4", s, v) for s, v in enumerate([3.02, 3.14])]
    runs += [_summary("tp4", "tahquant-h768_grad-tahquant-grad-rn", "tahquant-h768", 0, 3.2,
                      grad_codec="tahquant-grad")]  # fmt: skip
    runs += [_summary("pp2", "bf16", "bf16", 0, 3.0),
             _summary("pp2", "fp4quant-g64_grad-fp4quant-g64-sr", "fp4quant-g64", 0, 3.01,
                      grad_rounding="stochastic")]  # fmt: skip
    folder = tmp_path / "runs"
    folder.mkdir()
    for r in runs:
        (folder / f"{r['name']}.json").write_text(json.dumps(r))
    (folder / "other.json").write_text(json.dumps({"name": "a tp_train record"}))
    table = emulated_summary.main([str(folder), "--out", str(tmp_path / "table")])
    by = {(r["layout"], r["policy"]): r for r in table}
    assert list(by)[:2] == [("tp4", "bf16"), ("tp4", "fp4quant-g64")]
    row = by[("tp4", "fp4quant-g64")]
    deltas = [a - b for a, b in zip(g64, bf16, strict=True)]
    mean = sum(deltas) / 3
    sd = math.sqrt(sum((d - mean) ** 2 for d in deltas) / 2)
    assert row["delta_mean"] == pytest.approx(mean, rel=1e-12)
    assert row["delta_ci"] == pytest.approx(t_quantile(0.975, 2) * sd / math.sqrt(3), rel=1e-12)
    assert row["gap_pct"] == pytest.approx(100 * mean / (sum(bf16) / 3), rel=1e-12)
    assert row["preprint_loss"] == 2.2306
    assert row["preprint_gap_pct"] == pytest.approx(100 * (2.2306 - 2.1505) / 2.1505)
    assert by[("pp2", "fp4quant-g64_grad-fp4quant-g64-sr")]["preprint_loss"] == 2.1525
    assert by[("tp4", "tahquant-h768_grad-tahquant-grad-rn")]["preprint_loss"] == 3.48
    byte = {**_summary("tp4", "fp4quant-g64", "fp4quant-g64", 0, 2.4), "model": "byte"}
    assert emulated_summary.quoted(byte) is None  # the CPU model is not the preprint's Qwen
    pp = by[("pp2", "fp4quant-g64_grad-fp4quant-g64-sr")]
    assert pp["delta_mean"] == pytest.approx(0.01) and pp["delta_ci"] is None  # one seed
    text = (tmp_path / "table" / "table.md").read_text()
    assert "preprint, quoted" in text and "2.2306 (+3.7 %)" in text
    # a bf16 gradient has no rounding to name (it is cast); an FP4 gradient's is named
    assert "| bf16: bf16; bf16 |" in text and "bf16; bf16 (" not in text
    assert "fp4quant-g64_grad-fp4quant-g64-sr: fp4quant-g64; fp4quant-g64 (stochastic) |" in text
    assert (tmp_path / "table" / "curves.png").stat().st_size > 10_000
    assert "qwen-125m_tp4_bf16_s0 | 160.0" in (tmp_path / "table" / "timing.md").read_text()
    # the gap at every evaluation (here 2 x loss at step 50), runs without a bf16 seed left out
    gaps = (tmp_path / "table" / "gaps.md").read_text()
    assert "| fp4quant-g64, seed 2 | +0.120 | +0.060 | +0.060 |" in gaps  # last: train, late
    assert row["train_delta_last_fifth"] == pytest.approx(deltas)
    assert row["train_delta_mean"] == pytest.approx(mean)
    (line,) = [t for t in text.splitlines() if "| fp4quant-g64: " in t]
    assert line.count(f"| {mean:+.4f} ± {row['delta_ci']:.4f} |") == 2  # Δ val, Δ train late
    assert "| nvfp4, seed 1 | +0.080 | +0.040 |" in gaps and "**qwen-125m, pp2**" in gaps
    # every two wires on their common seeds (g = 64 and NVFP4 share seeds 0 and 1); TAH-Quant
    # has one seed: no row
    pairs = (tmp_path / "table" / "pairs.md").read_text()
    d = [g64[0] - 3.02, g64[1] - 3.14]
    half = t_quantile(0.975, 1) * abs(d[0] - d[1]) / math.sqrt(2) / math.sqrt(2)
    per_seed = f"{d[0]:+.3f} / {d[1]:+.3f}"
    row = f"| fp4quant-g64 | nvfp4 | 0 1 | {per_seed} | {sum(d) / 2:+.3f} ± {half:.3f} |"
    assert row in pairs and "tahquant" not in pairs


def test_the_late_training_gap_pairs_the_last_fifth_of_the_curves_points():
    """Ten window means: the last two of run's minus base's (the same batches), averaged; a
    run without a curve has no late gap."""
    base = {"train_loss_curve": [[10 * i + 4.5, 5.0 - 0.1 * i] for i in range(10)]}
    run = {"train_loss_curve": [[x, y + (0.5 if i < 8 else 0.1 * i)]
                                for i, (x, y) in enumerate(base["train_loss_curve"])]}  # fmt: skip
    assert emulated_summary.late_gap(run, base) == pytest.approx((0.8 + 0.9) / 2)
    assert emulated_summary.late_gap({"train_loss_curve": []}, base) is None
    assert emulated_summary.late_gap({}, base) is None


def test_curves_are_drawn_per_layout_paired_by_seed():
    """``curves.png``'s panels: one per layout with a wire paired to bf16, each curve the mean
    over the seeds the wire shares with bf16 of its layout; a seed without bf16 is left out."""
    runs = [_summary("tp4", "bf16", "bf16", s, 3.0 + s) for s in (0, 1)]
    runs += [_summary("tp4", "nvfp4", "nvfp4", s, 3.1 + s) for s in (0, 1, 2)]
    runs += [_summary("tp8", "bf16", "bf16", 0, 3.0), _summary("tp8", "nvfp4", "nvfp4", 0, 3.3)]
    runs += [_summary("pp2", "nvfp4", "nvfp4", 0, 3.2)]  # no bf16 at pp2: no panel
    curves = emulated_summary._paired_curves(emulated_summary._groups(runs))
    assert sorted(curves, key=emulated_summary._layout_rank) == ["tp4", "tp8"]
    ((label, xs, ys),) = curves["tp4"]
    assert label == "qwen-125m nvfp4, 2 seeds" and xs == [0, 50, 99]
    assert ys == pytest.approx([0.1, 0.1, 0.1])  # seed 2 has no bf16 run: not in the mean
    ((label, xs, ys),) = curves["tp8"]
    assert label == "qwen-125m nvfp4, 1 seed" and ys == pytest.approx([0.3, 0.3, 0.3])


def test_baselines_compare_every_layouts_bf16_with_the_plain_models():
    """``baselines.md``: each layout's bf16 runs, minus the plain model's (tp1) on the seeds
    both ran, with a t interval from two seeds on; without tp1 runs the reference is the
    layout with the most bf16 seeds.  Other wires are not in it."""
    runs = [_summary("tp4", "bf16", "bf16", s, v) for s, v in enumerate([3.4, 3.36, 3.33])]
    runs += [_summary("pp2", "bf16", "bf16", s, v) for s, v in enumerate([3.28, 3.32])]
    runs += [_summary("tp8", "bf16", "bf16", 0, 3.41), _summary("tp4", "nvfp4", "nvfp4", 0, 3.5)]
    text = emulated_summary.baselines_markdown(runs)
    assert "| qwen-125m | tp4 | 0: 3.4000 / 1: 3.3600 / 2: 3.3300 | tp4 | – | – |" in text
    d = [3.28 - 3.4, 3.32 - 3.36]
    half = t_quantile(0.975, 1) * abs(d[0] - d[1]) / math.sqrt(2) / math.sqrt(2)
    assert (f"| pp2 | 0: 3.2800 / 1: 3.3200 | tp4 | 0: {d[0]:+.3f} / 1: {d[1]:+.3f} | "
            f"{sum(d) / 2:+.3f} ± {half:.3f} |") in text  # fmt: skip
    assert "| tp8 | 0: 3.4100 | tp4 | 0: +0.010 | +0.010 |" in text and "3.5000" not in text
    plain = runs + [_summary("tp1", "bf16", "bf16", s, v) for s, v in enumerate([3.3, 3.31])]
    text = emulated_summary.baselines_markdown(plain)
    assert "| tp4 | 0: 3.4000 / 1: 3.3600 / 2: 3.3300 | tp1 | 0: +0.100 / 1: +0.050 |" in text
    assert "| tp1 | 0: 3.3000 / 1: 3.3100 | tp1 | – | – |" in text


def test_ranks_pair_a_wires_gap_at_two_numbers_of_ranks_by_seed():
    """``ranks.md``: a wire's gap to bf16 of its own layout at two TP layouts, and the larger
    k's minus the smaller's on the seeds both have (a seed without bf16 at one layout is left
    out); SP, the pipeline and the plain model are not tensor-parallel layouts here."""
    runs = [
        _summary(lay, "bf16", "bf16", s, v)
        for lay, losses in (("tp4", [3.0, 3.1, 3.2]), ("tp8", [3.05, 3.0]))
        for s, v in enumerate(losses)
    ]
    runs += [_summary("tp4", "nvfp4", "nvfp4", s, v) for s, v in enumerate([3.02, 3.11, 3.3])]
    runs += [_summary("tp8", "nvfp4", "nvfp4", s, v) for s, v in enumerate([3.1, 3.04, 3.5])]
    runs += [
        _summary("tp4-sp", "nvfp4", "nvfp4", 0, 3.9),
        _summary("tp4-sp", "bf16", "bf16", 0, 3.0),
    ]
    runs += [_summary("tp8", "mxfp4", "mxfp4", 0, 3.2)]  # one layout only: no row
    text = emulated_summary.ranks_markdown(runs)
    d = [(3.1 - 3.05) - (3.02 - 3.0), (3.04 - 3.0) - (3.11 - 3.1)]
    half = t_quantile(0.975, 1) * abs(d[0] - d[1]) / math.sqrt(2) / math.sqrt(2)
    row = (f"| qwen-125m | nvfp4 | 4 → 8 | 0 1 | +0.020 / +0.010 | +0.050 / +0.040 | "
           f"{d[0]:+.3f} / {d[1]:+.3f} | {sum(d) / 2:+.3f} ± {half:.3f} |")  # fmt: skip
    assert row in text
    assert "mxfp4" not in text and "tp4-sp" not in text and text.count("| qwen-125m |") == 1
    one = [r for r in runs if not (r["layout"] == "tp8" and r["seed"] == 1)]
    assert "| 4 → 8 | 0 | +0.020 | +0.050 | +0.030 | +0.030 |" in (
        emulated_summary.ranks_markdown(one)
    )


def test_seeds_needed_is_the_first_t_interval_below_the_limit():
    """``seeds_needed``: the fewest n whose t interval around the gap lies below the limit,
    checked against the interval at n and n - 1; None where the gap is at the limit or above."""
    need = emulated_summary.seeds_needed
    for mean, sd, limit in [(0.0, 0.03, 0.034), (0.016, 0.023, 0.034), (0.023, 0.0235, 0.034)]:
        n = need(mean, sd, limit)
        assert mean + t_quantile(0.975, n - 1) * sd / math.sqrt(n) < limit
        if n > 2:
            assert mean + t_quantile(0.975, n - 2) * sd / math.sqrt(n - 1) >= limit
    assert need(0.034, 0.01, 0.034) is None and need(0.05, 0.01, 0.034) is None
    assert need(0.0, 0.0, 0.034) == 2
    assert need(0.0339, 0.03, 0.034) is None  # beyond MAX_SEEDS


def test_seeds_table_says_what_more_seeds_resolve(tmp_path):
    """``seeds.md``: a wire's paired gap and spread, and the seeds for +-1 % and for an upper
    end below 1 % at those; a gap of 1 % or more never gets there; one seed: no row."""
    bf16 = [3.0, 3.1, 2.95, 3.05]
    wires = {"nvfp4": [3.01, 3.12, 2.97, 3.06], "mxfp4_sr": [3.06, 3.15, 3.01, 3.1]}
    runs = [_summary("tp4", "bf16", "bf16", s, v) for s, v in enumerate(bf16)]
    for name, losses in wires.items():
        runs += [_summary("tp4", name, name.split("_")[0], s, v) for s, v in enumerate(losses)]
    runs += [_summary("tp4", "fp4quant-g64", "fp4quant-g64", 0, 3.2)]
    folder = tmp_path / "runs"
    folder.mkdir()
    for r in runs:
        (folder / f"{r['name']}.json").write_text(json.dumps(r))
    emulated_summary.main([str(folder), "--out", str(tmp_path / "t"), "--no-plot"])
    text = (tmp_path / "t" / "seeds.md").read_text()
    base = sum(bf16) / 4
    d = [a - b for a, b in zip(wires["nvfp4"], bf16, strict=True)]
    mean = sum(d) / 4
    sd = math.sqrt(sum((v - mean) ** 2 for v in d) / 3)
    width = emulated_summary.seeds_needed(0.0, sd, 0.01 * base)
    below = emulated_summary.seeds_needed(mean, sd, 0.01 * base)
    assert f"| nvfp4 | 4 | {100 * mean / base:+.2f} ± " in text
    assert text.count(f"| {sd:.4f} | {width} | {below} |") == 1
    assert "| mxfp4_sr | 4 |" in text and "never (gap ≥ 1 %)" in text  # +1.7 % of bf16's loss
    assert "fp4quant-g64" not in text


def test_reruns_are_set_beside_their_run(tmp_path):
    """``--reruns``: each rerun beside the run of its name (final losses, the difference at
    every evaluation, the first training loss); a rerun without its run is an error naming it."""
    folder, again = tmp_path / "runs", tmp_path / "reruns"
    folder.mkdir()
    again.mkdir()
    for r in (_summary("tp4", "bf16", "bf16", 0, 3.0), _summary("tp4", "mxfp4", "mxfp4", 0, 3.1)):
        (folder / f"{r['name']}.json").write_text(json.dumps(r))
    rerun = _summary("tp4", "mxfp4", "mxfp4", 0, 3.05)
    (again / f"{rerun['name']}.json").write_text(json.dumps(rerun))
    out = tmp_path / "table"
    emulated_summary.main([str(folder), "--reruns", str(again), "--out", str(out), "--no-plot"])
    text = (out / "reruns.md").read_text()
    # evals at 50 (2 x loss) and 100 (loss): -0.100 and -0.050; first training-loss points
    row = "| qwen-125m_tp4_mxfp4_s0 | 3.1000 / 3.0500 | -0.100 | -0.050 | 13.10000 / 13.05000 |"
    assert row in text
    orphan = _summary("tp4", "nvfp4", "nvfp4", 1, 3.2)
    (again / f"{orphan['name']}.json").write_text(json.dumps(orphan))
    with pytest.raises(SystemExit, match="qwen-125m_tp4_nvfp4_s1"):
        emulated_summary.main([str(folder), "--reruns", str(again), "--out", str(out)])


# ------------------------------------------------------------------ bad input


def _write(folder, name, record):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(record if isinstance(record, str) else json.dumps(record))


def test_summary_names_a_record_it_cannot_use(tmp_path, capsys):
    """A file that is not JSON, a summary without a field the tables read, one whose final
    loss is null (a diverged run, written as null), and two records of one run: each named,
    where before they gave raw tracebacks or (two records of one run) one silently left out."""
    good = _summary("tp4", "bf16", "bf16", 0, 3.0)
    cases = {
        "truncated": ('{"kind": "emulated_tp_', "not a readable JSON record"),
        "binary": (b"\xff\xfe\x00".decode("latin-1"), "not a readable JSON record"),
        "no loss": ({k: v for k, v in good.items() if k != "final_val_loss"},
                    "without final_val_loss"),
        "diverged": ({**good, "final_val_loss": None}, "final_val_loss None, not a finite loss"),
    }  # fmt: skip
    for i, (what, (record, message)) in enumerate(cases.items()):
        folder = tmp_path / f"c{i}"
        _write(folder, "a.json", good if what != "no loss" and what != "diverged" else record)
        if what in ("truncated", "binary"):
            _write(folder, "b.json", record)
        with pytest.raises(SystemExit, match=message):
            emulated_summary.load([folder])
    twice = tmp_path / "twice"
    _write(twice, "a.json", good)
    _write(twice, "b.json", {**good, "final_val_loss": 9.0})
    with pytest.raises(SystemExit, match="a.json: two records of one run|b.json and .*a.json"):
        emulated_summary.load([twice])
    one = tmp_path / "one"
    _write(one, "a.json", good)
    assert len(emulated_summary.load([one, one])) == 1  # a folder named twice: read once
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SystemExit):
        emulated_summary.main([str(one), "--out", str(tmp_path / "afile"), "--no-plot"])
    assert "exists and is not a folder" in capsys.readouterr().err


def test_sweep_names_unknown_configurations_bad_seeds_and_nan_budgets(tmp_path, capsys):
    base = ["--preset", "pp2", "--out", str(tmp_path)]
    for extra, message in (
        (["--only", "bogus", "bf16"], "--only bogus: not a configuration of --preset pp2"),
        (["--seeds", "0", "0"], "--seeds 0 0: a seed given twice"),
        (["--seeds", "-1"], "--seeds: -1 is not in [0, 2**32)"),
        (["--seeds", str(2**32)], f"--seeds: {2**32} is not in [0, 2**32)"),
        (["--budget-s", "nan"], "--budget-s nan: a finite number of seconds >= 0"),
        (["--estimate-s", "0"], "--estimate-s 0.0: a finite number of seconds > 0"),
        (["--checkpoint-dir", "c", "--stop-at-s", "-1"], "--stop-at-s -1.0: a finite number"),
    ):
        with pytest.raises(SystemExit):
            emulated_sweep.parse_args([*base, *extra])
        assert message in capsys.readouterr().err, extra


def test_sweep_names_a_done_folder_that_is_not_there(tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    for done, message in (("missing", "no such folder"), ("afile", "not a folder")):
        with pytest.raises(SystemExit):
            emulated_sweep.parse_args(["--preset", "pp2", "--out", str(tmp_path / "out"),
                                       "--done", str(tmp_path), str(tmp_path / done)])  # fmt: skip
        assert f"--done {tmp_path / done}: {message}" in capsys.readouterr().err
